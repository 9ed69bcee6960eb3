"""Tensor parallelism on two GPUs gives the tokens of one GPU (skipped with fewer than two CUDA devices).

float32: TP=2 (symmetric-memory all-reduce fused into the norms, per-shard sampling) against TP=1, greedy and
seeded sampling at temperature 0.6: identical (the row-parallel sums round differently, but in float32 not by
enough to flip a token of these runs: measured 16/16 sequences every time). Balanced scheduling and CUDA graphs
under TP=2 against fcfs eager under TP=2: identical. bf16 on the copy-task model, TP=2 against TP=1,
teacher-forced: >= 99% of positions.
"""
import pytest
import torch

from nanovllm import SamplingParams
from tests.gpu.engines import (
    ARCH,
    MIXED_ENGINE,
    generate,
    mixed_workload,
    random_prompts,
    same_sequences,
    teacher_forced_agreement,
)

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")]


def test_tp2_gives_tp1_tokens_float32(tiny_ckpt):
    path = tiny_ckpt("qwen3", **ARCH)
    prompts = random_prompts(16) * 2
    params = [SamplingParams(temperature=0.0, max_tokens=32)] * 16 + \
        [SamplingParams(temperature=0.6, seed=1234 + i, max_tokens=32) for i in range(16)]
    tp1 = generate(path, prompts, params, dtype="float32", kvcache_block_size=16, gpu_memory_utilization=0.3)
    tp2 = generate(path, prompts, params, dtype="float32", kvcache_block_size=16, gpu_memory_utilization=0.3,
                   tensor_parallel_size=2)
    assert tp2[:16] == tp1[:16], "greedy: " + same_sequences(tp2[:16], tp1[:16])
    assert tp2[16:] == tp1[16:], "seeded sampling: " + same_sequences(tp2[16:], tp1[16:])


def test_tp2_graphs_and_balanced_policy_give_eager_tokens(tiny_ckpt):
    path = tiny_ckpt("qwen3", **ARCH)
    prompts, params = mixed_workload()
    kw = dict(dtype="float32", tensor_parallel_size=2, **MIXED_ENGINE)
    eager = generate(path, prompts, params, scheduling_policy="fcfs", enforce_eager=True, **kw)
    graphs = generate(path, prompts, params, scheduling_policy="fcfs", **kw)
    assert graphs == eager, "TP=2 fcfs, CUDA graphs vs eager: " + same_sequences(graphs, eager)
    balanced = generate(path, prompts, params, scheduling_policy="balanced", **kw)
    assert balanced == eager, "TP=2 balanced vs fcfs eager: " + same_sequences(balanced, eager)


def test_tp2_bf16_trained_model(trained_ckpt, capsys):
    import train_tiny  # (benchmarks/, on the path through tests/gpu/conftest.py)

    prompts = train_tiny.copy_prompts(64, seed=0, max_len=600)
    agree = teacher_forced_agreement(trained_ckpt, prompts, [{}, dict(tensor_parallel_size=2)], dtype="bfloat16")
    with capsys.disabled():
        print(f"\nbf16, copy-task model: TP=2 picks TP=1's next token at {agree:.2%} of positions")
    assert agree >= 0.99
