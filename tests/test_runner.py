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


def test_banned_tokens_without_room_in_the_staging_layout(tiny_ckpt):
    """A CUDA graph's fixed staging layout has no banned (row, token) pairs: the sampler gets them from a separate
    small copy instead (min_tokens in a graph step)."""
    import torch

    from nanovllm.engine.batch import SamplingBatch
    from nanovllm.engine.step_inputs import Layout
    llm = LLM(tiny_ckpt("qwen3"), device="cpu", kvcache_block_size=16, max_num_batched_tokens=100)
    runner = llm.engine.runner
    sb = SamplingBatch(temperatures=[0.0, 1.0], top_ks=[0, 0], top_ps=[1.0, 1.0], min_ps=[0.0, 0.0], seeds=[0, 1],
                       steps=[0, 0], logprobs=[None, None], banned=[(0, 5), (1, 9), (1, 11)])
    layout = Layout.make(4, 4, 1, 4)  # no banned pairs (as a graph's)
    v = layout.views(torch.zeros(layout.nbytes, dtype=torch.uint8))
    t = runner._sampling_from(v, sb)
    assert t.banned_rows.tolist() == [0, 1, 1] and t.banned_tokens.tolist() == [5, 9, 11]
    assert t.temperatures.tolist() == [0.0, 0.0]  # (the views themselves, zeros here)
