"""Down projection at a decode step's row counts: cuBLAS's own choice (for Qwen3-8B at 256 rows a split-K GEMM
plus its separate reduce kernel) against two K-halves as one batched GEMM, whose partial sums a following
add + RMSNorm kernel could read (needs CUDA).

    python benchmarks/splitk_bench.py [--rows 128,256,384,512] [--k 12288] [--n 4096]

Prints microseconds per layer (each case a CUDA graph over 36 layers' own weights, as in a decode step): plain
mm into bf16, bmm of the halves into float32 and into bf16 partials, and the bf16 sum of the two float32 halves
(torch ops, an upper bound on what a fused norm would add).
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from nanovllm.engine.gemm_plan import graph_seconds  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="128,256,384,512")
    ap.add_argument("--k", type=int, default=12288)
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=36)
    ns = ap.parse_args()
    dev = torch.device("cuda")
    K, N, L = ns.k, ns.n, ns.layers
    ws = [torch.randn(N, K, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(L)]
    # each weight's two K-halves as a (2, K/2, N) batch of column-major views (no copy)
    halves = [w.view(N, 2, K // 2).permute(1, 2, 0) for w in ws]
    for M in (int(r) for r in ns.rows.split(",")):
        one(M, ws, halves, L, dev)


def one(M, ws, halves, L, dev):
    N, K = ws[0].shape
    x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
    xh = x.view(M, 2, K // 2).permute(1, 0, 2)                       # (2, M, K/2)
    out = torch.empty(M, N, device=dev, dtype=torch.bfloat16)
    p32 = torch.empty(2, M, N, device=dev, dtype=torch.float32)
    p16 = torch.empty(2, M, N, device=dev, dtype=torch.bfloat16)

    def mm():
        for w in ws:
            torch.mm(x, w.t(), out=out)

    def bmm32():
        for h in halves:
            torch.bmm(xh, h, out_dtype=torch.float32, out=p32)

    def bmm16():
        for h in halves:
            torch.bmm(xh, h, out=p16)

    def add32():
        for _ in ws:
            torch.add(p32[0], p32[1], out=out)
    ref = x.float() @ ws[0].float().t()
    torch.bmm(xh, halves[0], out_dtype=torch.float32, out=p32)
    err = ((p32.sum(0) - ref).norm() / ref.norm()).item()
    t = {name: graph_seconds(fn, reps=5) / L * 1e6 for name, fn in
         (("mm", mm), ("bmm fp32", bmm32), ("bmm bf16", bmm16), ("add fp32 halves", add32))}
    print(f"M={M:4d} K={K} N={N}: " + ", ".join(f"{k} {v:6.1f} us" for k, v in t.items())
          + f" | halves rel err {err:.1e}", flush=True)


if __name__ == "__main__":
    main()
