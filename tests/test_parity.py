"""Greedy tokens identical to transformers (float32, CPU) under every scheduling regime, on the dense tiny
checkpoints and (chunked prefill, preemption, text prompts) the mixture-of-experts ones."""
from __future__ import annotations

import json
import os
import shutil
from collections import Counter

import pytest

from nanovllm import LLM, SamplingParams
from tests.conftest import make_prompts

MAX_NEW = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)


def _check(llm: LLM, path, prompts, hf_greedy, params=GREEDY):
    outs = llm.generate(prompts, params, use_tqdm=False)
    ref = hf_greedy(path, prompts, params.max_tokens)
    for i, (o, r) in enumerate(zip(outs, ref)):
        assert o["prompt_token_ids"] == prompts[i]
        assert o["token_ids"] == r, f"prompt {i} (len {len(prompts[i])}) diverged"
    return outs


@pytest.mark.parametrize("arch", ["qwen3", "qwen2", "llama"])
def test_default_settings(arch, tiny_ckpt, hf_greedy):
    path = tiny_ckpt(arch)
    llm = LLM(path, device="cpu", dtype="float32")
    outs = _check(llm, path, make_prompts(), hf_greedy)
    assert all(o["finish_reason"] == "length" for o in outs)
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


@pytest.mark.parametrize("arch", ["qwen3", "llama", "qwen3_moe", "mixtral"])
def test_chunked_prefill(arch, tiny_ckpt, hf_greedy):
    path = tiny_ckpt(arch)
    llm = LLM(path, device="cpu", max_num_batched_tokens=48, kvcache_block_size=32)
    seen = []
    real = llm.engine.scheduler.schedule

    def spy():
        out = real()
        seen.append([(s.num_computed_tokens, n, s.num_tokens) for s, n in zip(out.seqs, out.num_new_tokens)])
        return out

    llm.engine.scheduler.schedule = spy
    _check(llm, path, make_prompts(), hf_greedy)
    assert all(sum(n for _, n, _ in step) <= 48 for step in seen)
    # some prompt was split into several chunks, and some step mixed a chunk with decodes
    assert any(c > 0 and c + n < t for step in seen for c, n, t in step)
    assert any(len({n == 1 for _, n, _ in step}) == 2 for step in seen)


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_preemption(arch, tiny_ckpt, hf_greedy):
    path = tiny_ckpt(arch)
    # 34 blocks of 16 tokens: room for a couple of long sequences at a time
    llm = LLM(path, device="cpu", kvcache_block_size=16, num_kvcache_blocks=34, max_model_len=512)
    _check(llm, path, make_prompts(), hf_greedy)
    assert llm.engine.scheduler.num_preemptions > 0
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_preemption_without_prefix_cache(tiny_ckpt, hf_greedy):
    path = tiny_ckpt("qwen2")
    llm = LLM(path, device="cpu", kvcache_block_size=16, num_kvcache_blocks=34, max_model_len=512,
              enable_prefix_caching=False, max_num_batched_tokens=64)
    _check(llm, path, make_prompts(), hf_greedy)
    assert llm.engine.scheduler.num_preemptions > 0


def test_prefix_cache_same_prompts_twice(tiny_ckpt, hf_greedy):
    path = tiny_ckpt("qwen3")
    llm = LLM(path, device="cpu", kvcache_block_size=16)
    prompts = make_prompts()
    _check(llm, path, prompts, hf_greedy)
    bm = llm.engine.block_manager
    hits_before = bm.prefix_hits
    _check(llm, path, prompts, hf_greedy)
    # every prompt longer than one block is served from the cache the second time
    assert bm.prefix_hits - hits_before == sum(len(p) > 16 for p in prompts)


def test_prefix_cache_full_block_prompt_recomputes_last_token(tiny_ckpt, hf_greedy):
    path = tiny_ckpt("qwen3")
    llm = LLM(path, device="cpu", kvcache_block_size=16)
    prompt = make_prompts([64], seed=5)
    _check(llm, path, prompt, hf_greedy)
    seq_cached = []
    real = llm.engine.scheduler.schedule

    def spy():
        out = real()
        seq_cached.extend((s.num_computed_tokens, n) for s, n in zip(out.seqs, out.num_new_tokens))
        return out

    llm.engine.scheduler.schedule = spy
    _check(llm, path, prompt, hf_greedy)
    assert seq_cached[0] == (48, 16)  # 3 of 4 blocks reused; the last block recomputed for its logits


def test_shared_prefixes(tiny_ckpt, hf_greedy):
    path = tiny_ckpt("llama")
    llm = LLM(path, device="cpu", kvcache_block_size=16)
    base = make_prompts([100], seed=7)[0]
    tails = make_prompts([1, 5, 17, 40, 0 + 3, 60], seed=8)
    prompts = [base + t for t in tails] + [base[:50] + t for t in tails[:3]]
    # first one alone so its blocks are cached, then the rest in one batch
    _check(llm, path, prompts[:1], hf_greedy)
    hits = llm.engine.block_manager.prefix_hits
    _check(llm, path, prompts[1:], hf_greedy)
    assert llm.engine.block_manager.prefix_hits - hits >= len(prompts) - 1


@pytest.mark.parametrize("arch", ["qwen3", "llama", "qwen3_moe", "mixtral"])
def test_string_prompts(arch, tiny_ckpt, hf_greedy):
    path = tiny_ckpt(arch)
    llm = LLM(path, device="cpu")
    texts = ["Hello, Nano-vLLM.", "The quick brown fox jumps over the lazy dog. " * 5, "a", "Once upon a time"]
    outs = llm.generate(texts, GREEDY, use_tqdm=False)
    tok = llm.tokenizer
    prompts = [tok.encode(t) for t in texts]
    ref = hf_greedy(path, prompts, MAX_NEW)
    for o, p, r in zip(outs, prompts, ref):
        assert o["prompt_token_ids"] == p
        assert o["token_ids"] == r
        assert o["text"] == tok.decode(r, skip_special_tokens=True)


def test_sharded_untied_checkpoint(tiny_ckpt, hf_greedy):
    path = tiny_ckpt("qwen3", tie_word_embeddings=False, max_shard_size="40KB")
    assert os.path.exists(os.path.join(path, "model.safetensors.index.json"))
    llm = LLM(path, device="cpu")
    _check(llm, path, make_prompts()[:8], hf_greedy)


def test_stops_on_eos_like_transformers(tiny_ckpt, hf_greedy, tmp_path):
    """Make a frequently generated token the EOS: both engines must stop on it and include it."""
    src = tiny_ckpt("qwen3")
    prompts = make_prompts()
    ref = hf_greedy(src, prompts, MAX_NEW)
    eos = Counter(t for r in ref for t in r[2:]).most_common(1)[0][0]
    path = str(tmp_path / "eos-model")
    shutil.copytree(src, path)
    gc_path = os.path.join(path, "generation_config.json")
    with open(gc_path) as f:
        gc = json.load(f)
    gc["eos_token_id"] = eos
    with open(gc_path, "w") as f:
        json.dump(gc, f)
    llm = LLM(path, device="cpu")
    outs = _check(llm, path, prompts, hf_greedy)
    stopped = [o for o in outs if o["finish_reason"] == "stop"]
    assert stopped, "no prompt hit the EOS token"
    for o in stopped:
        assert o["token_ids"][-1] == eos and eos not in o["token_ids"][:-1]
    for o in outs:
        if o["finish_reason"] == "length":
            assert len(o["token_ids"]) == MAX_NEW


@pytest.mark.parametrize("kwargs", [
    {},
    {"max_num_batched_tokens": 48, "kvcache_block_size": 32},
    {"kvcache_block_size": 16, "num_kvcache_blocks": 34, "max_model_len": 512},
])
def test_async_scheduling(kwargs, tiny_ckpt, hf_greedy):
    """Scheduling step N+1 before step N's tokens are read back changes nothing in the output."""
    path = tiny_ckpt("qwen3")
    llm = LLM(path, device="cpu", async_scheduling=True, **kwargs)
    assert llm.engine.async_scheduling
    prompts = make_prompts()
    _check(llm, path, prompts, hf_greedy)
    _check(llm, path, prompts[::-1], hf_greedy)  # again, with prefix-cache hits
    if "num_kvcache_blocks" in kwargs:
        assert llm.engine.scheduler.num_preemptions > 0
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    # stop strings and seeds come out the same as without async scheduling
    sync = LLM(path, device="cpu", async_scheduling=False, **kwargs)
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=20, stop=["ab", "e "]) for i in range(len(prompts))]
    a = llm.generate(prompts, params, use_tqdm=False)
    b = sync.generate(prompts, params, use_tqdm=False)
    assert [(o["token_ids"], o["text"], o["finish_reason"]) for o in a] == \
        [(o["token_ids"], o["text"], o["finish_reason"]) for o in b]
    assert {o["finish_reason"] for o in a} == {"stop", "length"}


@pytest.mark.parametrize("kwargs", [
    {"max_num_batched_tokens": 48, "kvcache_block_size": 32, "async_scheduling": True},
    {"kvcache_block_size": 16, "num_kvcache_blocks": 9, "max_model_len": 120},
    # prefill spread over the run: most steps mix decode rows (decode kernel) with chunks (varlen kernel)
    {"max_num_batched_tokens": 48, "kvcache_block_size": 32, "scheduling_policy": "balanced"},
])
def test_triton_backend_under_interpreter(kwargs, tiny_ckpt, hf_greedy):
    """The Triton attention kernels (KV store, varlen prefill, decode) in the engine: float32 on the CPU
    interpreter, with chunked prefill, prefix hits and preemption. (The fused norm/RoPE/SiLU kernels,
    which the engine uses on CUDA only, are tested against their references in tests/kernels.)"""
    pytest.importorskip("triton")
    path = tiny_ckpt("qwen3")
    llm = LLM(path, device="cpu", dtype="float32", attention_backend="triton", **kwargs)
    prompts = make_prompts([1, 15, 31, 47, 63, 100], seed=2)  # lengths just short of block boundaries
    params = SamplingParams(temperature=0.0, max_tokens=6)
    _check(llm, path, prompts, hf_greedy, params)
    _check(llm, path, prompts[:3], hf_greedy, params)  # prefix hits
    if "num_kvcache_blocks" in kwargs:
        assert llm.engine.scheduler.num_preemptions > 0
