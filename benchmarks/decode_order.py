"""Decode attention: does launching the longest sequences first (and/or splitting the KV) fill the GPU better?

    python benchmarks/decode_order.py      (needs CUDA)

The decode kernel runs one program per (sequence, KV head[, split]); with contexts of 100-2048 tokens the
programs' lengths vary 20x, and in batch order a long program that starts late keeps its SM busy while the
others have finished. For the workload's shapes at TP=1 (32/8 heads) and TP=2 (16/4 heads per rank), times
the kernel with and without a longest-first launch order, for 1 and 2 KV splits and a few launch configs;
prints achieved GB/s (KV bytes read / time). Every result is checked against the torch reference.
"""
from __future__ import annotations

import os
import sys
from functools import partial

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import triton  # noqa: E402
from decode_layout import decode_case  # noqa: E402

from nanovllm.kernels.attention import decode_num_splits, paged_decode_attention  # noqa: E402


def main():
    configs = [(128, 4, 3), (64, 4, 3), (64, 4, 2)]
    for H, Hkv in ((32, 8), (16, 4)):
        for B, lo, hi in ((256, 100, 2048), (192, 300, 1500), (128, 500, 2048), (64, 600, 2048)):
            q, k, v, sl, bt, ref, nbytes = decode_case(B, lo, hi, H, Hkv=Hkv)
            order = torch.argsort(sl, descending=True, stable=True).to(torch.int32)
            auto = decode_num_splits(B, Hkv, 16, 256, q.device)  # the engine's graphs: 16 blocks of 256
            cells = []
            for cfg in configs:
                os.environ["NANOVLLM_DECODE_ATTN"] = ",".join(map(str, (*cfg, 1)))
                for splits in sorted({auto, 2}):
                    for name, o in (("batch", None), ("long1st", order)):
                        fn = partial(paged_decode_attention, q, k, v, sl, bt, 128 ** -0.5, num_splits=splits, order=o)
                        err = ((fn().float() - ref).norm() / ref.norm()).item()
                        if err > 1e-2:
                            raise SystemExit(f"wrong result: H={H} B={B} cfg={cfg} splits={splits} {name}: {err}")
                        ms = triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median")
                        cells.append(f"{cfg[0]},{cfg[2]}st s{splits} {name}: {nbytes / ms / 1e6:5.0f}")
            os.environ.pop("NANOVLLM_DECODE_ATTN", None)
            print(f"H={H:2d}/{Hkv} B={B:3d} ctx {lo}-{hi} (auto splits {auto}) GB/s | " + " | ".join(cells),
                  flush=True)
            del q, k, v, ref


if __name__ == "__main__":
    main()
