"""The FP8 GEMM of online quantization (row-wise scales) on one CUDA GPU: torch._scaled_mm (with fast accumulation,
as the engine calls it) against every candidate tiling of our Triton kernel (``nanovllm.kernels.fp8_gemm``), at a
model's projection shapes and decode row counts.

    python3 benchmarks/fp8_gemm_bench.py [--model benchmarks/models/qwen3-8b] [--rows 16 64 128 256] [--json f]

Each product runs in a CUDA graph that cycles over --copies copies of the weight (so the weights stream from HBM
as in a decode step, not from L2). Prints per (shape, rows): _scaled_mm's microseconds and TB/s, the best Triton
tiling and its, and per row count the whole layer (every projection once) by _scaled_mm, by the best tiling of
each shape, and by "plan": the faster of the two per shape, what a startup plan could pick (the engine has none
for FP8: it uses _scaled_mm, see RESULTS.md). The best tiling is checked against the float32 reference
(relative error < 1e-2).
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from nanovllm.engine.gemm_plan import graph_seconds  # noqa: E402
from nanovllm.kernels.fp8_gemm import Fp8GemmConfig, w8a8_gemm  # noqa: E402
from nanovllm.layers.quantization import fp8_ref  # noqa: E402


def projections(config_path: str) -> dict[str, tuple[int, int]]:
    """(N, K) of a dense Qwen3 / Llama-style decoder layer's four projections, from its config.json."""
    with open(config_path) as f:
        c = json.load(f)
    h, d = c["hidden_size"], c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    q, kv, inter = c["num_attention_heads"] * d, c["num_key_value_heads"] * d, c["intermediate_size"]
    return {"qkv": (q + 2 * kv, h), "o": (h, q), "gate_up": (2 * inter, h), "down": (h, inter)}


def candidates(rows: int) -> list[Fp8GemmConfig]:
    """Tilings whose pipeline fits in ~200 KB of shared memory (one byte per operand)."""
    if rows <= 64:
        grid = itertools.product((16, 32, 64), (32, 64, 128), (128, 256), (4,), (4, 5))
    else:
        grid = itertools.product((64, 128), (32, 64, 128), (128, 256), (4, 8), (3, 4, 5))
    return [Fp8GemmConfig(bm, bn, bk, w, s) for bm, bn, bk, w, s in grid
            if bm <= max(16, rows) and (bm * bk + bn * bk) * s <= 200 * 1024]


def _try(fn):
    try:
        return fn()
    except Exception as e:  # out of resources on this GPU: timed as inf below
        return e


def _seconds(fn, copies: int) -> float:
    try:
        return graph_seconds(fn) / copies
    except Exception:  # out of resources on this GPU: not a candidate
        return float("inf")


def bench_shape(M: int, name: str, N: int, K: int, ws: list, cands: list[Fp8GemmConfig], dev):
    """One (shape, rows): _scaled_mm and every candidate, printed; returns (row, _scaled_mm s, best s)."""
    xq, xs = fp8_ref.quantize_rows(torch.randn(M, K, device=dev).bfloat16())
    out = torch.empty(M, N, device=dev, dtype=torch.bfloat16)
    with ThreadPoolExecutor(16) as pool:  # compile side by side (the compiler runs in subprocesses)
        list(pool.map(lambda c: _try(lambda: w8a8_gemm(xq, xs, *ws[0], torch.bfloat16, out=out, config=c)), cands))
    torch.cuda.synchronize()
    t_mm = _seconds(lambda: [torch._scaled_mm(xq, w.t(), scale_a=xs, scale_b=s.view(1, -1), out_dtype=torch.bfloat16,
                                              out=out, use_fast_accum=True) for w, s in ws], len(ws))
    times = {c: _seconds(lambda c=c: [w8a8_gemm(xq, xs, w, s, torch.bfloat16, out=out, config=c) for w, s in ws],
                         len(ws)) for c in cands}
    best = min(times, key=times.get)
    y = w8a8_gemm(xq, xs, *ws[0], torch.bfloat16, config=best).float()
    ref = fp8_ref.fp8_linear_rowwise_ref(xq, xs, *ws[0], torch.float32)
    err = ((y - ref).norm() / ref.norm()).item()
    moved = N * K + M * K + 2 * M * N
    row = {"rows": M, "proj": name, "N": N, "K": K, "scaled_mm_us": t_mm * 1e6,
           "scaled_mm_TB_s": moved / t_mm / 1e12, "best": str(best), "best_us": times[best] * 1e6,
           "best_TB_s": moved / times[best] / 1e12, "rel_err": err}
    print(f"M={M:4d} {name:8s} ({N:5d}, {K:5d}) | _scaled_mm {t_mm * 1e6:7.1f} us {row['scaled_mm_TB_s']:4.2f} "
          f"TB/s | best triton {best} {times[best] * 1e6:7.1f} us {row['best_TB_s']:4.2f} TB/s "
          f"({t_mm / times[best]:.2f}x) | rel err {err:.1e}" + ("  WRONG" if err > 1e-2 else ""), flush=True)
    return row, t_mm, times[best]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="benchmarks/models/qwen3-8b", help="a directory with config.json")
    ap.add_argument("--rows", type=int, nargs="+", default=[16, 64, 128, 256])
    ap.add_argument("--copies", type=int, default=4, help="weight copies cycled through (to miss L2)")
    ap.add_argument("--json", default=None, help="write the rows here")
    ns = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("fp8_gemm_bench.py needs a CUDA GPU")
    dev = torch.device("cuda")
    shapes = projections(os.path.join(ns.model, "config.json"))
    print(f"FP8 GEMM (row-wise scales), {ns.model}: {shapes}; {torch.cuda.get_device_name()}")
    weights = {}
    for name, (N, K) in shapes.items():
        ws = [fp8_ref.quantize_rows(0.02 * torch.randn(N, K, device=dev)) for _ in range(ns.copies)]
        weights[name] = [(q, s.view(-1)) for q, s in ws]
    rows_out, totals = [], []
    for M in ns.rows:
        cands = candidates(M)
        layer = {"scaled_mm": 0.0, "best triton": 0.0, "plan": 0.0}
        for name, (N, K) in shapes.items():
            row, t_mm, t_best = bench_shape(M, name, N, K, weights[name], cands, dev)
            rows_out.append(row)
            layer["scaled_mm"] += t_mm
            layer["best triton"] += t_best
            layer["plan"] += min(t_mm, t_best)
        totals.append({"rows": M, **{k: v * 1e6 for k, v in layer.items()}})
        print(f"M={M:4d} layer: _scaled_mm {layer['scaled_mm'] * 1e6:.1f} us, best triton "
              f"{layer['best triton'] * 1e6:.1f} us, plan {layer['plan'] * 1e6:.1f} us "
              f"({layer['scaled_mm'] / layer['plan']:.2f}x)", flush=True)
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump({"shapes": shapes, "rows": rows_out, "layers": totals}, f, indent=1)


if __name__ == "__main__":
    main()
