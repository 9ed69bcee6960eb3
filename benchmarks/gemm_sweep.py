"""Decode-size GEMMs of Qwen3-8B: cuBLAS, cuBLASLt and the best tiling of the Triton skinny GEMM (GPU only).

    python benchmarks/gemm_sweep.py [--tp 1 2] [--rows 16 64 ...] [--budget-s 420] [--json best.json]

For each linear layer (TP=1 and the TP=2 shard) and row count M it times torch.mm under both BLAS libraries
and every candidate ``MatmulConfig`` of ``nanovllm.kernels.matmul`` (each checked against torch first),
inside CUDA graphs of 20 calls that cycle over enough weight copies to miss L2 (as in a real step, where 36
layers' weights stream by). Prints microseconds per call and the best config per (layer, M), and writes them
as JSON. The engine offers only the winners at <= 32 rows (``nanovllm.engine.gemm_plan``).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from functools import partial

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from nanovllm.engine.gemm_plan import graph_seconds
from nanovllm.kernels.matmul import MatmulConfig, linear, workspace_numel

HID, INTER, H, HKV, D, LAYERS = 4096, 12288, 32, 8, 128, 36
SMS = 132
ITERS = 20


def shapes(tp: int) -> dict[str, tuple[int, int]]:
    return {"qkv": ((H + 2 * HKV) * D // tp, HID), "o": (HID, H * D // tp),
            "gate_up": (2 * INTER // tp, HID), "down": (HID, INTER // tp)}


def all_configs() -> list[MatmulConfig]:
    out = []
    for bm in (64, 128):
        for bn in (64, 128, 256):
            for bk in (64, 128):
                for warps in (4, 8):
                    for stages in (3, 4):
                        if (bn == 256 and bk == 128) or (bm + bn) * bk * 2 * stages > 200 * 1024:
                            continue
                        out.append(MatmulConfig(bm, bn, bk, swap=False, num_warps=warps, num_stages=stages))
    for bm in (16, 32, 64, 128):
        for bn in (64, 128):
            for bk in (64, 128, 256):
                for stages in (3, 5):
                    if (bm + bn) * bk * 2 * stages > 200 * 1024:
                        continue
                    out.append(MatmulConfig(bm, bn, bk, swap=True, num_warps=4, num_stages=stages))
    return out


def candidates(base: list[MatmulConfig], M: int, N: int, K: int) -> list[MatmulConfig]:
    p2 = max(16, 1 << (M - 1).bit_length())
    out = []
    for c in base:
        if c.swap and (M > 128 or c.block_m not in (p2, p2 // 2)):
            continue
        if not c.swap and (M < 64 or c.block_m > p2):
            continue
        tiles = c.tiles(M, N)
        for s in (1, 2, 4, 8):
            cfg = MatmulConfig(c.block_m, c.block_n, c.block_k, splits=s, swap=c.swap, num_warps=c.num_warps,
                               num_stages=c.num_stages)
            if cfg.fits(K) and tiles * s <= 8 * SMS and (s == 1 or tiles * s // 2 < 2 * SMS):
                out.append(cfg)
    return out


def _mm(x, weights, out, i):
    torch.mm(x, weights[i].t(), out=out)


def _triton(x, weights, out, cfg, ws, cnt, i):
    linear(x, weights[i], cfg, out, workspace=ws, counters=cnt)


def graph_time(fn, n_copies: int) -> float:
    """Microseconds per call of fn(i) (i cycles over the weight copies), from a CUDA graph of ITERS calls."""
    def body():
        for i in range(ITERS):
            fn(i % n_copies)
    return graph_seconds(body, reps=5) * 1e6 / ITERS


def warm_compile(base: list[MatmulConfig]) -> None:
    """Compile every tiling once, without and with splits (threads overlap the ptxas subprocesses)."""
    x = torch.randn(64, 1024, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(256, 1024, device="cuda", dtype=torch.bfloat16)

    ws = torch.empty(2 * 64 * 256, device="cuda", dtype=torch.float32)
    cnt = torch.zeros(64, device="cuda", dtype=torch.int32)

    def one(c):
        try:
            linear(x, w, c)
            linear(x, w, MatmulConfig(c.block_m, c.block_n, c.block_k, splits=2, swap=c.swap,
                                      num_warps=c.num_warps, num_stages=c.num_stages), workspace=ws, counters=cnt)
            return None
        except Exception as e:  # out of shared memory / registers: dropped from the sweep
            return c, e

    with ThreadPoolExecutor(8) as pool:
        bad = [r for r in pool.map(one, base) if r is not None]
    for c, e in bad:
        print(f"skip {c}: {type(e).__name__}: {str(e)[:100]}")
        base.remove(c)
    torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--rows", type=int, nargs="+", default=[8, 16, 32, 64, 96, 128, 160, 192, 224, 256])
    ap.add_argument("--budget-s", type=float, default=420.0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    t_end = time.time() + args.budget_s
    dev = "cuda"
    base = all_configs()
    t0 = time.time()
    warm_compile(base)
    print(f"{len(base)} tilings compiled in {time.time() - t0:.0f}s", flush=True)
    ws = torch.empty(8 * 256 * 2 * INTER, device=dev, dtype=torch.float32)
    cnt = torch.zeros(65536, device=dev, dtype=torch.int32)
    results = []
    for tp in args.tp:
        print(f"--- TP={tp} (us per call; best Triton tiling)")
        step = {m: {"cublas": 0.0, "cublaslt": 0.0, "best": 0.0} for m in args.rows}
        for name, (N, K) in shapes(tp).items():
            copies = max(1, math.ceil(256e6 / (N * K * 2)))
            ws_ = [torch.randn(N, K, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
            for M in args.rows:
                if time.time() > t_end:
                    print("budget spent; stopping")
                    break
                x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
                out = torch.empty(M, N, device=dev, dtype=torch.bfloat16)
                ref = torch.mm(x, ws_[0].t())
                row = {"tp": tp, "layer": name, "N": N, "K": K, "M": M}
                for lib in ("cublas", "cublaslt"):
                    torch.backends.cuda.preferred_blas_library(lib)
                    row[lib] = graph_time(partial(_mm, x, ws_, out), copies)
                torch.backends.cuda.preferred_blas_library("cublas")
                best = None
                for cfg in candidates(base, M, N, K):
                    assert workspace_numel(M, N, cfg) <= ws.numel()
                    y = linear(x, ws_[0], cfg, workspace=ws, counters=cnt)
                    err = (y.float() - ref.float()).abs().max().item()
                    if not err <= 0.05 * ref.float().abs().max().item() + 1e-2:
                        print(f"WRONG {cfg} M={M} {name}: max err {err}")
                        continue
                    us = graph_time(partial(_triton, x, ws_, out, cfg, ws, cnt), copies)
                    if best is None or us < best[0]:
                        best = (us, cfg)
                if best is None:
                    continue
                row["triton"], row["config"] = best[0], asdict(best[1])
                results.append(row)
                lo = min(row["cublas"], row["cublaslt"])
                st = step[M]
                st["cublas"] += row["cublas"]
                st["cublaslt"] += row["cublaslt"]
                st["best"] += min(lo, best[0])
                c = best[1]
                print(f"{name:7s} M={M:4d} | cublas {row['cublas']:6.1f} lt {row['cublaslt']:6.1f} | triton "
                      f"{best[0]:6.1f} ({lo / best[0]:4.2f}x, {N * K * 2 / best[0] / 1e3:5.0f} GB/s, "
                      f"{2 * M * N * K / best[0] / 1e6:4.0f} TF) "
                      f"{'swap' if c.swap else 'norm'} {c.block_m}x{c.block_n}x{c.block_k} s{c.splits} "
                      f"w{c.num_warps} st{c.num_stages}", flush=True)
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(results, f, indent=1)
        print(f"TP={tp} per decode step (x{LAYERS} layers, ms): M, cuBLAS, cuBLASLt, best of all three")
        for M, st in step.items():
            print(f"  M={M:4d}  {st['cublas'] * LAYERS / 1e3:6.2f}  {st['cublaslt'] * LAYERS / 1e3:6.2f}  "
                  f"{st['best'] * LAYERS / 1e3:6.2f}")


if __name__ == "__main__":
    main()
