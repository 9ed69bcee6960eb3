"""Sampling: seeds, top-k/top-p/min-p, temperature, stop strings, stop tokens and min_tokens."""
from __future__ import annotations

import pytest
import torch

from nanovllm import LLM, SamplingParams
from nanovllm.layers.sampler import Sampler, SamplingTensors, hash_uniform
from tests.conftest import make_prompts


@pytest.fixture(scope="module")
def llm(tiny_ckpt):
    return LLM(tiny_ckpt("qwen3"), device="cpu", kvcache_block_size=16)


def _tensors(B, temps, top_k=0, top_p=1.0, min_p=0.0, seeds=None, steps=None):
    t = torch.tensor(temps, dtype=torch.float32).expand(B).clone()
    seeds = torch.tensor(seeds if seeds is not None else range(B), dtype=torch.int64)
    return SamplingTensors(
        temperatures=t, top_ks=torch.full((B,), top_k), top_ps=torch.full((B,), top_p),
        min_ps=torch.full((B,), min_p), seeds=seeds,
        steps=torch.tensor(steps if steps is not None else [0] * B, dtype=torch.int64),
        banned_rows=None, banned_tokens=None,
        all_greedy=bool((t == 0).all()), need_top_k=top_k > 0,
        need_top_p=top_p < 1.0, need_min_p=min_p > 0.0, max_logprobs=None)


def _freqs(ids, V):
    return torch.bincount(ids, minlength=V).float() / ids.numel()


def test_sampler_matches_distribution():
    """Across seeds (rows) and across output positions (steps), tokens follow softmax(logits / T)."""
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    B, V = 40000, 5
    for temp in (1.0, 0.5):
        want = torch.softmax(logits / temp, -1)
        ids = Sampler()(logits.expand(B, V).clone(), _tensors(B, [temp])).token_ids
        assert torch.allclose(_freqs(ids, V), want, atol=0.01), (temp, _freqs(ids, V), want)
        one_seed = _tensors(B, [temp], seeds=[7] * B, steps=list(range(B)))
        ids = Sampler()(logits.expand(B, V).clone(), one_seed).token_ids
        assert torch.allclose(_freqs(ids, V), want, atol=0.01), (temp, _freqs(ids, V), want)


def test_top_k_top_p_min_p_masks():
    logits = torch.tensor([3.0, 2.0, 1.0, 0.0, -1.0])
    probs = torch.softmax(logits, -1)  # ~ [.64, .23, .09, .03, .01]
    B, V = 20000, 5
    s = Sampler()
    ids = s(logits.expand(B, V).clone(), _tensors(B, [1.0], top_k=2)).token_ids
    f = _freqs(ids, V)
    assert f[2:].sum() == 0 and torch.allclose(f[:2], probs[:2] / probs[:2].sum(), atol=0.015)
    ids = s(logits.expand(B, V).clone(), _tensors(B, [1.0], top_p=0.8)).token_ids  # keeps {0, 1}: .64 < .8
    f = _freqs(ids, V)
    assert f[2:].sum() == 0 and f[1] > 0.2
    ids = s(logits.expand(B, V).clone(), _tensors(B, [1.0], min_p=0.1)).token_ids  # keeps p >= .064
    f = _freqs(ids, V)
    assert f[3:].sum() == 0 and f[2] > 0.05


def test_hash_uniform_is_a_pure_function():
    a = hash_uniform(torch.tensor([1, 2, 1]), torch.tensor([0, 0, 5]), 1000)
    b = hash_uniform(torch.tensor([1]), torch.tensor([0]), 1000)
    assert torch.equal(a[0], b[0]) and not torch.equal(a[0], a[1]) and not torch.equal(a[0], a[2])
    assert 0 < a.min() and a.max() < 1 and abs(a.mean().item() - 0.5) < 0.02


def test_seed_reproducible_across_batch_compositions(llm, tiny_ckpt):
    prompts = make_prompts([7, 40, 130, 3, 90], seed=3)
    target = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=20)
    alone = llm.generate([prompts[0]], target, use_tqdm=False)[0]["token_ids"]
    mixed = llm.generate(prompts, [target, SamplingParams(temperature=1.0, max_tokens=30),
                                   SamplingParams(temperature=0.0, max_tokens=5), target,
                                   SamplingParams(temperature=0.7, seed=1, max_tokens=25)], use_tqdm=False)
    assert mixed[0]["token_ids"] == alone
    # a different engine configuration (chunked prefill, another batch) still gives the same tokens
    other = LLM(tiny_ckpt("qwen3"), device="cpu", max_num_batched_tokens=32, kvcache_block_size=32, seed=99)
    again = other.generate([prompts[2], prompts[0]], [SamplingParams(temperature=1.0, max_tokens=8), target],
                           use_tqdm=False)
    assert again[1]["token_ids"] == alone
    different = llm.generate([prompts[0]], SamplingParams(temperature=0.9, top_p=0.95, seed=4321, max_tokens=20),
                             use_tqdm=False)[0]["token_ids"]
    assert different != alone


def test_top_k_1_equals_greedy(llm):
    prompts = make_prompts([5, 60, 200], seed=11)
    greedy = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False)
    topk1 = llm.generate(prompts, SamplingParams(temperature=1.5, top_k=1, max_tokens=16), use_tqdm=False)
    assert [o["token_ids"] for o in topk1] == [o["token_ids"] for o in greedy]


def test_stop_string_cuts_text(llm):
    prompt = "Once upon a time"
    full = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=30), use_tqdm=False)[0]
    text = full["text"]
    stop = text[8:11]
    assert len(stop) == 3 and stop.strip()
    cut = text.find(stop)
    out = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=30, stop=[stop, "\x00never"]),
                       use_tqdm=False)[0]
    assert out["finish_reason"] == "stop"
    assert out["text"] == text[:cut]
    assert stop not in out["text"]
    assert full["token_ids"][:len(out["token_ids"])] == out["token_ids"]
    assert len(out["token_ids"]) < len(full["token_ids"])


def test_stop_token_ids_and_min_tokens(llm):
    prompt = make_prompts([20], seed=21)[0]
    full = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=30), use_tqdm=False)[0]["token_ids"]
    stop_tok = full[2]
    first = full.index(stop_tok)
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=[stop_tok]),
                       use_tqdm=False)[0]
    assert out["finish_reason"] == "stop" and out["token_ids"] == full[:first + 1]
    # min_tokens holds the stop token back: it cannot appear in the first 10 tokens
    held = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=[stop_tok],
                                                 min_tokens=10), use_tqdm=False)[0]
    assert stop_tok not in held["token_ids"][:10]
    assert len(held["token_ids"]) > 10
    assert held["finish_reason"] == "length" or held["token_ids"][-1] == stop_tok


def test_ignore_eos_and_max_tokens(llm):
    outs = llm.generate(make_prompts([4, 9]), SamplingParams(temperature=0.8, max_tokens=7, ignore_eos=True),
                        use_tqdm=False)
    assert all(len(o["token_ids"]) == 7 and o["finish_reason"] == "length" for o in outs)


def test_logprobs(llm):
    out = llm.generate(make_prompts([10]), SamplingParams(temperature=0.0, max_tokens=5, logprobs=3),
                       use_tqdm=False)[0]
    lps = out["logprobs"]                       # vLLM's format: {token id: Logprob} per output token
    assert lps is out.outputs[0].logprobs and len(lps) == 5
    for tok, pos in zip(out["token_ids"], lps):
        assert len(pos) == 3 and pos[tok].rank == 1 and pos[tok].logprob <= 0  # greedy picks the most likely
        ranked = sorted(pos.values(), key=lambda lp: lp.rank)
        assert [lp.rank for lp in ranked] == [1, 2, 3]
        assert ranked[0].logprob >= ranked[1].logprob >= ranked[2].logprob


def test_max_tokens_capped_by_context(tiny_ckpt):
    llm = LLM(tiny_ckpt("qwen3"), device="cpu", max_model_len=40, kvcache_block_size=16)
    out = llm.generate([list(range(30))], SamplingParams(temperature=0.0, max_tokens=100), use_tqdm=False)[0]
    assert out["finish_reason"] == "length" and len(out["token_ids"]) == 10
    out = llm.generate([list(range(40))], SamplingParams(temperature=0.0, max_tokens=100), use_tqdm=False)[0]
    assert len(out["token_ids"]) == 1  # a prompt filling the context still yields one token
