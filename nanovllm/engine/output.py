"""What the engine reports after a step (`StepOutput`, one per sample that finished or, when streamed, made
progress) and how `LLM` turns a request's final step outputs into the public vLLM-shaped `RequestOutput`.

`StepOutput` is internal (the server streams from it); users see `nanovllm.outputs`. Both are plain data.
A log-probability entry, per output (or prompt) position, is {"token_id", "logprob", "rank", "top": [(id, lp)]}:
the chosen token's raw log-probability and 1-based rank, and the top tokens in rank order.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from nanovllm.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestOutput


@dataclass
class StepOutput:
    """One sample's progress after a step (every step for streamed requests, else once at the end)."""
    request_id: str
    index: int                         # which of the request's n samples
    prompt_token_ids: list[int]
    token_ids: list[int]               # all output tokens (filled once finished; streamed: see new_token_ids)
    new_token_ids: list[int]           # produced by this step
    text: str                          # output text so far (final text once finished)
    new_text: str                      # text produced by this step (streamed requests)
    finished: bool
    finish_reason: str | None = None   # "stop" | "length" | "abort"
    stop_reason: str | int | None = None
    logprobs: list[dict] | None = None         # per output token (see the module docstring)
    new_logprobs: list[dict] | None = None
    prompt_logprobs: list[dict | None] | None = None  # sample 0 only, once finished: None for position 0
    num_cached_tokens: int = 0
    metrics: dict = field(default_factory=dict)


def position_logprobs(entry: dict, decode: Callable[[int], str | None]) -> PositionLogprobs:
    """An internal entry as vLLM's {token id: Logprob}: the top tokens, and the chosen one (always there)."""
    pos = {t: Logprob(lp, rank, decode(t)) for rank, (t, lp) in enumerate(entry["top"], start=1)}
    tok = entry["token_id"]
    if tok not in pos:
        pos[tok] = Logprob(entry["logprob"], entry["rank"], decode(tok))
    return pos


def request_output(request_id: str, prompt: str | None, samples: list[StepOutput],
                   decode: Callable[[int], str | None]) -> RequestOutput:
    """The finished samples of one request (any order) as the public RequestOutput."""
    samples = sorted(samples, key=lambda s: s.index)
    outputs = []
    for s in samples:
        lps = None if s.logprobs is None else [position_logprobs(e, decode) for e in s.logprobs]
        outputs.append(CompletionOutput(
            index=s.index, text=s.text, token_ids=s.token_ids,
            cumulative_logprob=None if s.logprobs is None else float(sum(e["logprob"] for e in s.logprobs)),
            logprobs=lps, finish_reason=s.finish_reason, stop_reason=s.stop_reason))
    first = samples[0]
    plp = None
    if first.prompt_logprobs is not None:
        plp = [None if e is None else position_logprobs(e, decode) for e in first.prompt_logprobs]
    return RequestOutput(request_id=request_id, prompt=prompt, prompt_token_ids=first.prompt_token_ids,
                         prompt_logprobs=plp, outputs=outputs, finished=all(s.finished for s in samples),
                         num_cached_tokens=first.num_cached_tokens, metrics=first.metrics)
