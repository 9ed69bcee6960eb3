"""bf16 on the GPU: do the Triton kernels + CUDA graphs give the same greedy tokens as the torch backend?

    python benchmarks/parity_bf16.py

Builds a small random checkpoint (real-model head_dim 128, GQA), generates greedily with
(a) attention_backend="torch", enforce_eager=True and (b) the default GPU path (Triton kernels, CUDA
graphs), and reports the fraction of output positions that agree before the first divergence.
"""
from __future__ import annotations

import os
import random
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from nanovllm import LLM, SamplingParams  # noqa: E402
from nanovllm.utils.tiny_model import build_tiny_checkpoint  # noqa: E402


def main():
    path = build_tiny_checkpoint(os.path.join(tempfile.mkdtemp(), "m"), "qwen3", hidden_size=512, num_layers=4,
                                 num_heads=8, num_kv_heads=2, head_dim=128, intermediate_size=1024)
    rng = random.Random(0)
    prompts = [[rng.randrange(480) for _ in range(rng.randint(1, 600))] for _ in range(64)]
    params = SamplingParams(temperature=0.0, max_tokens=64)
    runs = {}
    for name, kw in {"torch-eager": dict(attention_backend="torch", enforce_eager=True),
                     "triton-graphs": dict()}.items():
        llm = LLM(path, dtype="bfloat16", kvcache_block_size=16, max_num_seqs=64, **kw)
        runs[name] = [o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)]
        del llm
    a, b = runs["torch-eager"], runs["triton-graphs"]
    total = sum(len(x) for x in a)
    agree = 0
    for x, y in zip(a, b):
        for i, (s, t) in enumerate(zip(x, y)):
            if s != t:
                break
            agree += 1
    same = sum(x == y for x, y in zip(a, b))
    print(f"bf16 greedy parity, triton+graphs vs torch eager: {agree}/{total} positions agree before the first "
          f"divergence ({100 * agree / total:.2f}%), {same}/{len(a)} sequences identical")


if __name__ == "__main__":
    main()
