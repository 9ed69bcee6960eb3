"""Sweep the decode-attention kernel's launch config at the workload's shapes (needs CUDA).

    python benchmarks/decode_sweep.py [--out best.txt] [--configs 128,4,3 64,4,2 ...]

Times (BLOCK_N, num_warps, num_stages) variants on bf16 paged decode at 256 x ctx 100-2048 and 64 x ctx
500-1500 (Qwen3: 16 or 32 query heads, 8 KV heads, head_dim 128, 256-token blocks), checks each against
the torch reference, prints GB/s and writes the best config as "BLOCK_N,WARPS,STAGES". --configs times only
the listed ones.
"""
from __future__ import annotations

import argparse
import itertools
import os
import sys
from functools import partial

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import triton  # noqa: E402
from decode_layout import decode_case  # noqa: E402

from nanovllm.kernels.attention import paged_decode_attention  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--configs", nargs="*", default=None, help="BLOCK_N,WARPS,STAGES triples (default: all)")
    ns = ap.parse_args()
    cases = [decode_case(256, 100, 2048, 16), decode_case(256, 100, 2048, 32), decode_case(64, 500, 1500, 16)]
    results = []
    configs = [tuple(int(x) for x in c.split(",")) for c in ns.configs] if ns.configs else \
        itertools.product((32, 64, 128), (2, 4, 8), (2, 3, 4))
    for bn, w, st in configs:
        os.environ["NANOVLLM_DECODE_ATTN"] = f"{bn},{w},{st}"
        try:
            tot_ms, ok = 0.0, True
            gbs = []
            for q, k, v, sl, bt, ref, nbytes in cases:
                fn = partial(paged_decode_attention, q, k, v, sl, bt, q.shape[-1] ** -0.5)
                out = fn()
                err = ((out.float() - ref).norm() / ref.norm()).item()
                ok &= err < 1e-2
                ms = triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")
                tot_ms += ms
                gbs.append(nbytes / ms / 1e6)
        except Exception as e:  # noqa: BLE001 - a config that does not compile or run
            print(f"BLOCK_N={bn:3d} warps={w} stages={st}: failed ({type(e).__name__})", flush=True)
            continue
        results.append((tot_ms, bn, w, st, ok, gbs))
        print(f"BLOCK_N={bn:3d} warps={w} stages={st}: {' '.join(f'{g:7.0f}' for g in gbs)} GB/s "
              f"total {tot_ms * 1e3:7.1f} us {'ok' if ok else 'WRONG'}", flush=True)
    os.environ.pop("NANOVLLM_DECODE_ATTN", None)
    best = min((r for r in results if r[4]), key=lambda r: r[0])
    print(f"best: BLOCK_N={best[1]} warps={best[2]} stages={best[3]} ({best[0] * 1e3:.1f} us total)")
    if ns.out:
        with open(ns.out, "w") as f:
            f.write(f"{best[1]},{best[2]},{best[3]}")


if __name__ == "__main__":
    main()
