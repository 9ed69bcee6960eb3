"""Beam search over `LLM.generate`, as vLLM's `LLM.beam_search` does it: every step asks the engine for one token
of every live beam with its top 2 * beam_width log-probabilities, extends each beam by each of those tokens, sets
aside the extensions that end in EOS, and keeps the beam_width best of the rest (with prefix caching, the
default, a step computes each beam's tokens past its last full cached block only). At the end the finished and
the live beams are ranked together and the beam_width best returned.

A beam's score is ``cum_logprob / len ** length_penalty`` with len its token count, the prompt's included and a
final EOS not (vLLM's `get_beam_search_score`). EOS is any of the engine's EOS ids (vLLM: the tokenizer's one).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from nanovllm.outputs import PositionLogprobs, RequestOutput
from nanovllm.sampling_params import BeamSearchParams, SamplingParams


@dataclass
class BeamSearchSequence:
    """One beam: ``tokens`` the prompt's and the generated ones; ``logprobs`` one dict per generated token (the
    step's top tokens, as `CompletionOutput.logprobs`); ``text`` the decoded tokens, prompt included (vLLM's)."""
    tokens: list[int]
    logprobs: list[PositionLogprobs] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None   # "stop": it ended in EOS; "length": max_tokens generated
    stop_reason: int | None = None     # the EOS id that ended it


@dataclass
class BeamSearchOutput:
    """The beam_width best beams of one prompt, best first."""
    sequences: list[BeamSearchSequence]


def beam_score(tokens: list[int], cum_logprob: float, eos_ids: frozenset[int], length_penalty: float) -> float:
    n = len(tokens) - (1 if tokens and tokens[-1] in eos_ids else 0)
    return cum_logprob / (max(n, 1) ** length_penalty)


def beam_search(generate: Callable[[list, SamplingParams], list[RequestOutput]], prompts: list[list[int]],
                params: BeamSearchParams, eos_ids: frozenset[int],
                decode: Callable[[list[int]], str] | None = None, use_tqdm: bool = False) -> list[BeamSearchOutput]:
    """Beam search of each prompt (token ids); `generate(prompts, sampling_params)` runs one engine batch (the
    `LLM`'s, without a progress bar), `decode` turns a beam's tokens into its text (None: no text); use_tqdm: a
    progress bar over the steps."""
    step = SamplingParams(max_tokens=1, logprobs=2 * params.beam_width, temperature=params.temperature)
    ends = frozenset() if params.ignore_eos else eos_ids

    def key(b: BeamSearchSequence) -> float:
        return beam_score(b.tokens, b.cum_logprob, eos_ids, params.length_penalty)

    live = [[BeamSearchSequence(list(p))] for p in prompts]
    done: list[list[BeamSearchSequence]] = [[] for _ in prompts]
    steps = range(params.max_tokens)
    if use_tqdm:
        from tqdm.auto import tqdm
        steps = tqdm(steps, desc="Beam search", dynamic_ncols=True)
    for _ in steps:
        flat = [b for beams in live for b in beams]
        if not flat:
            break
        outs = generate([{"prompt_token_ids": b.tokens} for b in flat], step)
        i = 0
        for p, beams in enumerate(live):
            grown = []
            for b in beams:
                top = outs[i].outputs[0].logprobs[0]
                i += 1
                for tid, lp in top.items():
                    nb = BeamSearchSequence(b.tokens + [tid], b.logprobs + [top], b.cum_logprob + lp.logprob)
                    if tid in ends:
                        nb.finish_reason, nb.stop_reason = "stop", tid
                        done[p].append(nb)
                    else:
                        grown.append(nb)
            live[p] = sorted(grown, key=key, reverse=True)[:params.beam_width]
    results = []
    for p in range(len(prompts)):
        for b in live[p]:
            b.finish_reason = "length"
        best = sorted(done[p] + live[p], key=key, reverse=True)[:params.beam_width]
        if decode is not None:
            for b in best:
                b.text = decode(b.tokens)
        results.append(BeamSearchOutput(best))
    return results
