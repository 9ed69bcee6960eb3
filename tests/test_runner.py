"""Model-runner paths that production uses on CUDA, exercised on CPU."""
from __future__ import annotations

import pytest

from nanovllm import LLM


def test_warmup_forward_runs_on_cpu(tiny_ckpt):
    """The profiling pass used to size the KV cache on CUDA (throwaway cache, logits and sampling)."""
    llm = LLM(tiny_ckpt("qwen3"), device="cpu", kvcache_block_size=16, max_num_batched_tokens=100)
    runner = llm.engine.runner
    runner._warmup_forward([60, 30, 10])
    # the real cache is untouched and generation still works
    out = llm.generate([[1, 2, 3]], use_tqdm=False)
    assert len(out[0]["token_ids"]) == 16


def test_shutdown_releases_the_model_and_refuses_new_steps(tiny_ckpt):
    llm = LLM(tiny_ckpt("qwen3"), device="cpu", kvcache_block_size=16, max_num_batched_tokens=100)
    runner = llm.engine.runner
    assert runner.kv_cache is not None and runner.model is not None
    llm.shutdown()
    assert runner.kv_cache is None and runner.model is None and runner.attn_layers == []
    llm.shutdown()  # idempotent
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate([[1, 2, 3]], use_tqdm=False)
