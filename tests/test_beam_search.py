"""`LLM.beam_search` (vLLM's API): the beams against the same search run on transformers' log-probabilities, the
bookkeeping (EOS, length penalty, order) on hand-made log-probabilities, and the errors."""
from __future__ import annotations

import math

import pytest
import torch

from nanovllm import LLM, BeamSearchOutput, BeamSearchParams, Logprob
from nanovllm.beam_search import beam_score, beam_search
from nanovllm.outputs import CompletionOutput, RequestOutput
from tests.conftest import make_prompts


@pytest.fixture(scope="module")
def llm(tiny_ckpt):
    return LLM(tiny_ckpt("qwen3"), device="cpu", dtype="float32", kvcache_block_size=16, max_model_len=128)


def _reference(model, prompt: list[int], width: int, steps: int, eos: frozenset[int], length_penalty: float):
    """The search written out on transformers' float32 logits: every beam's top 2 * width next tokens."""
    def score(tokens, cum):
        n = len(tokens) - (1 if tokens[-1] in eos else 0)
        return cum / n ** length_penalty
    live, done = [(list(prompt), 0.0)], []
    for _ in range(steps):
        grown = []
        for tokens, cum in live:
            with torch.no_grad():
                lp = torch.log_softmax(model(torch.tensor([tokens])).logits[0, -1].float(), -1)
            top = torch.topk(lp, 2 * width)
            for t, v in zip(top.indices.tolist(), top.values.tolist()):
                (done if t in eos else grown).append((tokens + [t], cum + v))
        live = sorted(grown, key=lambda b: score(*b), reverse=True)[:width]
    return sorted(done + live, key=lambda b: score(*b), reverse=True)[:width]


@pytest.mark.parametrize("length_penalty", [1.0, 0.0])
def test_beams_match_the_search_on_transformers_logprobs(llm, tiny_ckpt, length_penalty):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(tiny_ckpt("qwen3"), dtype=torch.float32).eval()
    prompts = make_prompts((5, 9), seed=3)
    params = BeamSearchParams(beam_width=3, max_tokens=4, length_penalty=length_penalty)
    outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)
    assert len(outs) == 2 and all(isinstance(o, BeamSearchOutput) for o in outs)
    for prompt, out in zip(prompts, outs):
        want = _reference(model, prompt, 3, 4, llm.engine.eos_token_ids, length_penalty)
        assert [s.tokens for s in out.sequences] == [t for t, _ in want]
        for seq, (_, cum) in zip(out.sequences, want):
            assert seq.cum_logprob == pytest.approx(cum, abs=1e-4)
            assert seq.tokens[:len(prompt)] == prompt and len(seq.logprobs) == len(seq.tokens) - len(prompt)
            assert seq.text == llm.tokenizer.decode(seq.tokens)
            assert seq.finish_reason in ("stop", "length")


def _stub(table: dict[int, dict[int, float]]):
    """A `generate` whose next-token log-probabilities depend on the beam's last token only; records its calls."""
    calls = []

    def generate(prompts, sp):
        calls.append((len(prompts), sp.logprobs, sp.max_tokens))
        outs = []
        for p in prompts:
            top = {t: Logprob(v, rank=r + 1) for r, (t, v) in enumerate(table[p["prompt_token_ids"][-1]].items())}
            best = next(iter(top))
            outs.append(RequestOutput("r", None, p["prompt_token_ids"], None,
                                      [CompletionOutput(0, "", [best], top[best].logprob, [top])], True))
        return outs
    return generate, calls


EOS = 9
TABLE = {0: {1: math.log(0.5), EOS: math.log(0.3), 2: math.log(0.2)},
         1: {EOS: math.log(0.7), 3: math.log(0.3)},
         2: {3: math.log(0.9), 1: math.log(0.1)},
         EOS: {3: math.log(1.0)}}
# after two steps: 0 1 EOS (0.35), 0 EOS (0.3, ended at step 1), 0 2 3 (0.18), 0 1 3 (0.15), 0 2 1 (0.02)


def _tokens(out):
    return [(s.tokens, s.finish_reason) for s in out.sequences]


def test_eos_beams_finish_and_all_are_ranked_by_length_normalized_score():
    gen, calls = _stub(TABLE)
    out, = beam_search(gen, [[0]], BeamSearchParams(beam_width=4, max_tokens=2), frozenset([EOS]))
    # cum / len, the prompt counted and a last EOS not: -1.050 / 2, -1.715 / 3, -1.897 / 3, -1.204 / 1
    assert _tokens(out) == [([0, 1, EOS], "stop"), ([0, 2, 3], "length"), ([0, 1, 3], "length"),
                            ([0, EOS], "stop")]
    assert out.sequences[0].stop_reason == EOS and out.sequences[1].stop_reason is None
    assert out.sequences[0].cum_logprob == pytest.approx(math.log(0.35))
    assert [len(s.logprobs) for s in out.sequences] == [2, 2, 2, 1]
    # one token a step for every live beam, with 2 * beam_width logprobs; beams that ended are not extended
    assert calls == [(1, 8, 1), (2, 8, 1)]
    assert beam_score([0, 1, EOS], math.log(0.35), frozenset([EOS]), 1.0) == pytest.approx(math.log(0.35) / 2)


def test_without_length_penalty_the_most_likely_beams_win():
    out, = beam_search(_stub(TABLE)[0], [[0]], BeamSearchParams(2, 2, length_penalty=0.0), frozenset([EOS]))
    assert _tokens(out) == [([0, 1, EOS], "stop"), ([0, EOS], "stop")]


def test_ignore_eos_keeps_eos_beams_growing():
    out, = beam_search(_stub(TABLE)[0], [[0]], BeamSearchParams(2, 2, ignore_eos=True, length_penalty=0.0),
                       frozenset([EOS]))
    # live after step 1: 0 1 (0.5) and 0 EOS (0.3); after step 2: 0 1 EOS (0.35), 0 EOS 3 (0.3), 0 1 3 (0.15)
    assert _tokens(out) == [([0, 1, EOS], "length"), ([0, EOS, 3], "length")]


@pytest.mark.parametrize("kw,err,name", [
    (dict(beam_width=0, max_tokens=1), ValueError, "beam_width"), (dict(beam_width=11, max_tokens=1), ValueError,
                                                                    "beam_width"),
    (dict(beam_width=True, max_tokens=1), TypeError, "beam_width"), (dict(beam_width=2, max_tokens=0), ValueError,
                                                                     "max_tokens"),
    (dict(beam_width=2, max_tokens=1.5), TypeError, "max_tokens"),
    (dict(beam_width=2, max_tokens=1, temperature=-1), ValueError, "temperature"),
    (dict(beam_width=2, max_tokens=1, length_penalty=float("nan")), ValueError, "length_penalty"),
    (dict(beam_width=2, max_tokens=1, ignore_eos=1), TypeError, "ignore_eos")])
def test_bad_params_are_errors_naming_them(kw, err, name):
    with pytest.raises(err, match=name):
        BeamSearchParams(**kw)


def test_bad_prompts_and_params_fail_before_any_step(llm):
    with pytest.raises(ValueError, match="prompt 1: .*max_model_len=128"):
        llm.beam_search([[1, 2], list(range(120))], BeamSearchParams(2, 10))
    with pytest.raises(ValueError, match="prompt 0: .*empty"):
        llm.beam_search([""], BeamSearchParams(2, 2))
    with pytest.raises(TypeError, match="BeamSearchParams"):
        llm.beam_search([[1, 2]], {"beam_width": 2})
    out, = llm.beam_search("hello", BeamSearchParams(2, 3))   # the engine is still fine; strings work too
    assert len(out.sequences) == 2 and all(len(s.logprobs) <= 3 for s in out.sequences)
