"""CUDA-graph replay gives the tokens of eager mode, and the balanced scheduling policy those of fcfs (float32,
greedy, on the GPU).

One workload (tests.gpu.engines.mixed_workload) through fcfs eager, fcfs with graphs (decode graphs, mixed-step
graphs for steps of prefill chunks + decode rows, the large prefill steps' graphs of a small model) and balanced
with graphs (prompt chunks spread over the run's decode steps, last prompt tokens held back): every sequence's
tokens must be identical. Then min_tokens from graph steps: banned stop tokens reach the sampler there too. Then
decode steps of long contexts, whose graphs split the KV differently (decode_long_splits), against the torch
backend.
"""
import random

import pytest

from nanovllm import LLM, SamplingParams
from tests.gpu.engines import ARCH, COMMON, MIXED_ENGINE, free_gpu, generate, mixed_workload, same_sequences

pytestmark = pytest.mark.gpu


def test_graphs_and_balanced_policy_give_fcfs_eager_tokens(tiny_ckpt):
    path = tiny_ckpt("qwen3", **ARCH)
    prompts, params = mixed_workload()
    eager = generate(path, prompts, params, dtype="float32", scheduling_policy="fcfs", enforce_eager=True,
                     **MIXED_ENGINE)
    graphs = generate(path, prompts, params, dtype="float32", scheduling_policy="fcfs", **MIXED_ENGINE)
    assert graphs == eager, "fcfs, CUDA graphs vs eager: " + same_sequences(graphs, eager)
    balanced = generate(path, prompts, params, dtype="float32", scheduling_policy="balanced", **MIXED_ENGINE)
    assert balanced == eager, "balanced with CUDA graphs vs fcfs eager: " + same_sequences(balanced, eager)


def test_min_tokens_in_graph_steps(tiny_ckpt):
    path = tiny_ckpt("qwen3", **ARCH)
    prompts, _ = mixed_workload(8)
    stop = [SamplingParams(temperature=0.0, max_tokens=40, min_tokens=30, stop_token_ids=[t]) for t in range(8)]
    with LLM(path, dtype="float32", scheduling_policy="balanced", **MIXED_ENGINE) as llm:
        lens = [len(o["token_ids"]) for o in llm.generate(prompts, stop, use_tqdm=False)]
    free_gpu()
    assert all(n >= 30 for n in lens), lens


def test_long_context_decode_graphs_give_the_torch_backend_tokens(tiny_ckpt):
    """64 prompts of 4,200-4,800 tokens and 60 output tokens each (the first ones decode in the 36 prefill steps,
    so that all 64 are still running after them): every pure decode step's mean context is above
    LONG_CONTEXT_TOKENS, so it replays a decode graph with four KV splits (the default's would be three at 64
    sequences); float32 greedy tokens equal the torch backend's."""
    path = tiny_ckpt("qwen3", max_position_embeddings=8192, **ARCH)
    rng = random.Random(1)
    prompts = [[rng.randrange(480) for _ in range(rng.randint(4200, 4800))] for _ in range(64)]
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    kw = dict(dtype="float32", max_model_len=5120, max_num_batched_tokens=8192, **COMMON)
    with LLM(path, **kw) as llm:
        graphs = llm.engine.runner.graphs
        assert graphs.long_splits.get(64) == 4
        keys, find = [], graphs.find
        graphs.find = lambda batch: keys.append(find(batch)) or keys[-1]
        out = [o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)]
        graphs = find = None  # (they hold the runner, and so its KV cache)
    free_gpu()
    assert keys.count(("decode-long", 64)) >= 10 and ("decode", 64) not in keys
    # (the torch backend's attention holds a step's whole score matrix: smaller steps)
    ref = generate(path, prompts, params, attention_backend="torch", enforce_eager=True,
                   **{**kw, "max_num_batched_tokens": 1024})
    assert out == ref, "long-context decode graphs vs the torch backend: " + same_sequences(out, ref)
