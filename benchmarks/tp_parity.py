"""Greedy tokens of a tensor-parallel engine on the GPU, against TP=1 and between all-reduce paths.

    python benchmarks/tp_parity.py            # needs 2 GPUs

Tiny random Qwen3 checkpoint, 16 prompts x 32 greedy tokens:
* float32: TP=2 (symmetric-memory all-reduce) vs TP=1 — the same tokens are expected (the reduction order of
  the row-parallel layers differs, so a rare near-tie could flip; the count is printed);
* bfloat16: TP=2 with the symmetric-memory all-reduce (fused into the norms) vs TP=2 with NCCL
  (NANOVLLM_ALLREDUCE=nccl) and vs the unfused two-shot kernel (=twoshot): a sum of two partials rounds the
  same either way, so the tokens must be identical;
* the same with seeded sampling at temperature 0.6 (TP=2 samples per vocabulary shard).
"""
from __future__ import annotations

import os
import random
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from nanovllm import LLM, SamplingParams  # noqa: E402
from nanovllm.utils.tiny_model import build_tiny_checkpoint  # noqa: E402


def run(path, dtype, tp, allreduce="auto", temperature=0.0):
    os.environ["NANOVLLM_ALLREDUCE"] = allreduce
    rng = random.Random(0)
    prompts = [[rng.randrange(480) for _ in range(rng.randint(1, 600))] for _ in range(16)]
    llm = LLM(path, dtype=dtype, tensor_parallel_size=tp, kvcache_block_size=16, max_num_seqs=64)
    try:
        sp = SamplingParams(temperature=temperature, seed=1234, max_tokens=32)
        outs = llm.generate(prompts, sp, use_tqdm=False)
    finally:
        llm.shutdown()
    return [o["token_ids"] for o in outs]


def compare(name, a, b):
    same = sum(x == y for x, y in zip(a, b))
    pos = sum(sum(s == t for s, t in zip(x, y)) for x, y in zip(a, b))
    print(f"{name}: {same}/{len(a)} sequences identical, {pos}/{sum(map(len, a))} positions equal")
    return same == len(a)


def main():
    path = build_tiny_checkpoint(os.path.join(tempfile.mkdtemp(), "m"), "qwen3", hidden_size=512, num_layers=4,
                                 num_heads=8, num_kv_heads=2, head_dim=128, intermediate_size=1024)
    ok = compare("float32 TP=2 (symm) vs TP=1", run(path, "float32", 2), run(path, "float32", 1))
    ok &= compare("bfloat16 TP=2 symm vs TP=2 nccl", run(path, "bfloat16", 2), run(path, "bfloat16", 2, "nccl"))
    ok &= compare("bfloat16 TP=2 symm+fused norm vs two-shot", run(path, "bfloat16", 2),
                  run(path, "bfloat16", 2, "twoshot"))
    # seeded sampling at T=0.6: TP=2 samples per vocabulary shard, TP=1 over the whole row
    ok &= compare("float32 T=0.6 TP=2 vs TP=1", run(path, "float32", 2, temperature=0.6),
                  run(path, "float32", 1, temperature=0.6))
    ok &= compare("bfloat16 T=0.6 TP=2 symm vs nccl", run(path, "bfloat16", 2, temperature=0.6),
                  run(path, "bfloat16", 2, "nccl", temperature=0.6))
    print("OK" if ok else "MISMATCH")


if __name__ == "__main__":
    main()
