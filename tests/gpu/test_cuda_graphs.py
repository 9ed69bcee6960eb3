"""CUDA-graph replay gives the tokens of eager mode, and the balanced scheduling policy those of fcfs (float32,
greedy, on the GPU).

One workload (tests.gpu.engines.mixed_workload) through fcfs eager, fcfs with graphs (decode graphs, mixed-step
graphs for steps of prefill chunks + decode rows, the large prefill steps' graphs of a small model) and balanced
with graphs (prompt chunks spread over the run's decode steps, last prompt tokens held back): every sequence's
tokens must be identical. Then min_tokens from graph steps: banned stop tokens reach the sampler there too.
"""
import pytest

from nanovllm import LLM, SamplingParams
from tests.gpu.engines import ARCH, MIXED_ENGINE, free_gpu, generate, mixed_workload, same_sequences

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
