"""What the GPU engine tests share: their workloads, running an engine to completion, and teacher-forced agreement."""
from __future__ import annotations

import gc
import random

import torch

from nanovllm import LLM, SamplingParams

# Tiny Qwen3 with the attention shapes that matter on the GPU (head_dim 128, GQA 4:1); train_tiny.ARCH's too.
ARCH = dict(hidden_size=512, intermediate_size=1024, num_layers=4, num_heads=8, num_kv_heads=2, head_dim=128,
            vocab_size=512)
# Engines of these tests share the GPU with the test process: a KV cache of at most 30% of it.
COMMON = dict(gpu_memory_utilization=0.3)


def random_prompts(n: int, max_len: int = 600, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(480) for _ in range(rng.randint(1, max_len))] for _ in range(n)]


def mixed_workload(n: int = 96, seed: int = 0) -> tuple[list[list[int]], list[SamplingParams]]:
    """Prompts of 1-700 tokens and 1-120 greedy output tokens: with a 2,048-token step budget the run has pure
    prefill steps, mixed steps (prefill chunks + decode rows) and decode steps of every batch size."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(480) for _ in range(rng.randint(1, 700))] for _ in range(n)]
    params = [SamplingParams(temperature=0.0, max_tokens=rng.randint(1, 120), ignore_eos=True) for _ in prompts]
    return prompts, params


MIXED_ENGINE = dict(max_model_len=1024, max_num_batched_tokens=2048, **COMMON)


def free_gpu() -> None:
    """Return cached blocks to the device, so that the next engine sizes its KV cache from a clean GPU."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def generate(path: str, prompts, params, **engine_kw) -> list[list[int]]:
    """The output token ids of one engine, started for this call and shut down after it."""
    with LLM(path, **engine_kw) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
    free_gpu()
    return [o["token_ids"] for o in outs]


def teacher_forced_agreement(path: str, prompts, engines: list[dict], new_tokens: int = 32, **common) -> float:
    """Fraction of positions at which engines[1] picks the greedy next token engines[0] picks, both given the same
    context: each prompt followed by engines[0]'s greedy continuation up to that position. (Free-running
    agreement understates it: in bf16 one near-tie flips everything after it.)"""
    greedy = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    continuations, forced = None, []
    for kw in engines:
        with LLM(path, kvcache_block_size=16, max_num_seqs=128, **COMMON, **common, **kw) as llm:
            if continuations is None:
                continuations = [o["token_ids"] for o in llm.generate(prompts, greedy, use_tqdm=False)]
            contexts = [p + c[:k] for p, c in zip(prompts, continuations) for k in range(len(c))]
            forced.append([o["token_ids"][0] for o in llm.generate(contexts, one, use_tqdm=False)])
        free_gpu()
    a, b = forced
    return sum(x == y for x, y in zip(a, b)) / len(a)


def same_sequences(a: list[list[int]], b: list[list[int]]) -> str:
    """'k/n sequences identical, first difference at sequence i' for an assertion message."""
    diff = [i for i, (x, y) in enumerate(zip(a, b)) if x != y]
    return f"{len(a) - len(diff)}/{len(a)} sequences identical" + (f", first difference at {diff[0]}" if diff else "")
