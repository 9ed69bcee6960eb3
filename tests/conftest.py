"""Shared fixtures: tiny random checkpoints (built once per session), transformers references; gpu tests skipped
without CUDA."""
from __future__ import annotations

import os

import torch

# Triton kernels run on CPU through the interpreter; it must be chosen before triton is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import random  # noqa: E402

import pytest  # noqa: E402

from nanovllm.utils.tiny_model import build_tiny_checkpoint  # noqa: E402

# Tiny models: one thread is faster than two fighting over a small matmul.
torch.set_num_threads(1)

PROMPT_LENS = [1, 2, 3, 5, 8, 15, 16, 17, 31, 33, 64, 100, 150, 200, 255, 257, 300]


def make_prompts(lens=PROMPT_LENS, seed=0, high=450) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(high) for _ in range(n)] for n in lens]


def pytest_collection_modifyitems(config, items):
    """Tests marked gpu (tests/gpu) need CUDA: skipped without it, so plain `pytest` on a CPU reports them."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (run `pytest -m gpu` on a GPU machine)")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory):
    """tiny_ckpt(arch="qwen3", **build_kwargs) -> path of a tiny random checkpoint (cached per session)."""
    cache: dict = {}

    def get(arch: str = "qwen3", **kw) -> str:
        key = (arch, tuple(sorted(kw.items())))
        if key not in cache:
            cache[key] = build_tiny_checkpoint(tmp_path_factory.mktemp(f"tiny-{arch}"), arch, overwrite=True, **kw)
        return cache[key]

    return get


@pytest.fixture(scope="session")
def hf_greedy():
    """hf_greedy(path, prompts, max_new_tokens) -> transformers' greedy output ids per prompt (float32, CPU)."""
    from transformers import AutoModelForCausalLM
    models: dict = {}
    results: dict = {}

    def run(path: str, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        if path not in models:
            models[path] = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        m = models[path]
        outs = []
        for p in prompts:
            key = (path, tuple(p), max_new_tokens)
            if key not in results:
                ids = torch.tensor([p])
                with torch.no_grad():
                    g = m.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                   do_sample=False, pad_token_id=m.generation_config.eos_token_id)
                results[key] = g[0, len(p):].tolist()
            outs.append(results[key])
        return outs

    return run
