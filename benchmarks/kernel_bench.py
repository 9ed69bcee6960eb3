"""Kernel micro-benchmarks on a GPU, one subcommand per kernel family.

    python benchmarks/kernel_bench.py moe [--tp 1] [--tokens 1 8 256 ...] [--layers 4] [--json moe.json]

moe: the fused mixture-of-experts layer (``nanovllm.kernels.moe``) at Qwen3-30B-A3B's shapes (hidden 2048, 128
experts, top-8, expert width 768 / tp) in bf16, random weights (N(0, 0.02), the router too). For each token count
M and each block of rows (block_m) it times every candidate tile of the gate/up GEMM and of the down GEMM on
that block's expert-sorted layout, then the whole layer (routing, layout, both GEMMs, combine) with the best
pair; the best block_m wins. Everything runs in CUDA graphs that cycle over --layers copies of the weights (one
layer's 1.2 GB already exceeds L2; the copies keep a replay from finding the last one's tiles there), as the
decode graphs do. The winner is checked against the torch reference (``fused_moe_ref``, M <= 1024) or the
current table's config. Prints per M: microseconds, achieved TB/s (the experts touched + activations) and
TFLOP/s, the current table's time, and at the end the measured table as an entry of ``MOE_CONFIGS`` in
``nanovllm/kernels/moe_configs.py``, to paste there.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from nanovllm.engine.gemm_plan import graph_seconds  # noqa: E402
from nanovllm.kernels.moe import fused_moe, moe_down, moe_gate_up  # noqa: E402
from nanovllm.kernels.moe_configs import GemmTile, MoEConfig, moe_config  # noqa: E402
from nanovllm.kernels.moe_routing import moe_align, moe_route  # noqa: E402
from nanovllm.layers.moe_ref import fused_moe_ref  # noqa: E402

TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 384, 512, 1024, 2048, 4096, 8192)


def block_ms(tokens: int) -> tuple[int, ...]:
    """The rows per expert block worth trying at this many tokens (each expert gets ~tokens * k / E rows)."""
    if tokens <= 64:
        return (16,)
    if tokens <= 512:
        return (16, 32, 64)
    return (32, 64, 128)


def tiles(block_m: int, operands: int) -> list[GemmTile]:
    """Candidate tiles of a GEMM that loads `operands` weight tiles per step (gate/up: 2, down: 1): decode-sized
    blocks stream the weights (wide k-tiles, deep pipelines); large blocks are compute tiles. Those over ~200 KB
    of shared memory are left out (they do not build)."""
    if block_m <= 32:
        grid = itertools.product((32, 64, 128, 256), (64, 128, 256), (4,), (3, 4, 5))
    else:
        grid = itertools.product((64, 128, 256), (32, 64, 128), (4, 8), (3, 4))
    return [GemmTile(bn, bk, warps, stages) for bn, bk, warps, stages in grid
            if (block_m * bk + operands * bk * bn) * 2 * stages <= 200 * 1024]


def _try(fn):
    try:
        return fn()
    except Exception as e:  # out of resources on this GPU: not a candidate
        return e


def _seconds(fn, copies: int) -> float:
    """Seconds per weight copy of fn (a CUDA graph over all copies); inf when the config does not run here."""
    r = _try(lambda: graph_seconds(fn) / copies)
    return r if isinstance(r, float) else float("inf")


def layer_seconds(x, logits, w13, w2, k, cfg: MoEConfig) -> float:
    """The whole fused layer (routing, layout, GEMMs, combine) with cfg, per weight copy."""
    return _seconds(lambda: [fused_moe(x, logits, a, b, k, True, config=cfg) for a, b in zip(w13, w2)], len(w13))


def sweep_block(x, logits, weights, ids, w13, w2, k: int, block_m: int):
    """The best tile of each GEMM on the layout of `block_m`-row blocks, then the whole layer with them:
    (layer seconds, config, gate_up seconds, down seconds, blocks in the layout)."""
    layout = moe_align(ids, w13[0].shape[0], block_m)
    up_tiles, down_tiles = tiles(block_m, 2), tiles(block_m, 1)
    with ThreadPoolExecutor(16) as pool:  # compile side by side (the compiler runs in subprocesses)
        list(pool.map(lambda t: _try(lambda: moe_gate_up(x, w13[0], layout, k, t)), up_tiles))
        h = moe_gate_up(x, w13[0], layout, k, up_tiles[0])
        list(pool.map(lambda t: _try(lambda: moe_down(h, w2[0], layout, weights, t)), down_tiles))
    gu = {t: _seconds(lambda t=t: [moe_gate_up(x, w, layout, k, t) for w in w13], len(w13)) for t in up_tiles}
    dn = {t: _seconds(lambda t=t: [moe_down(h, w, layout, weights, t) for w in w2], len(w2)) for t in down_tiles}
    cfg = MoEConfig(block_m, min(gu, key=gu.get), min(dn, key=dn.get))
    return layer_seconds(x, logits, w13, w2, k, cfg), cfg, gu[cfg.gate_up], dn[cfg.down], layout.block_expert.numel()


def bench_moe(ns) -> dict:
    dev = torch.device("cuda")
    E, H, k = ns.experts, ns.hidden, ns.top_k
    inter = ns.inter // ns.tp
    dt = torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(0)

    def rand(*shape):
        return (0.02 * torch.randn(*shape, generator=gen, device=dev)).to(dt)

    w13 = [rand(E, 2 * inter, H) for _ in range(ns.layers)]
    w2 = [rand(E, H, inter) for _ in range(ns.layers)]
    router = rand(E, H)
    expert_bytes = 3 * H * inter * 2
    print(f"fused MoE: E={E} H={H} I={inter} (tp={ns.tp}) top-{k}, bf16, {ns.layers} weight copies, "
          f"{expert_bytes * E / 1e9:.2f} GB of experts per layer; {torch.cuda.get_device_name()}")
    rows, table = [], []
    for M in ns.tokens:
        x = torch.randn(M, H, generator=gen, device=dev).to(dt)
        logits = F.linear(x, router)
        weights, ids = moe_route(logits, k, True)
        touched = torch.unique(ids).numel()
        t0 = time.perf_counter()
        total, cfg, t_gu, t_dn, nb = min((sweep_block(x, logits, weights, ids, w13, w2, k, bm)
                                          for bm in block_ms(M)), key=lambda r: r[0])
        current = moe_config(M, E, H, inter)
        t_cur = layer_seconds(x, logits, w13, w2, k, current)
        y = fused_moe(x, logits, w13[0], w2[0], k, True, config=cfg)
        ref = fused_moe_ref(x, logits, w13[0], w2[0], k, True) if M <= 1024 else \
            fused_moe(x, logits, w13[0], w2[0], k, True, config=current)
        err = ((y.float() - ref.float()).norm() / ref.float().norm()).item()
        moved = touched * expert_bytes + 2 * M * H * 2 + M * k * (2 * inter + 2 * H) * 2
        row = {"tokens": M, "experts_touched": touched, "max_blocks": nb, "config": str(cfg), "us": total * 1e6,
               "gate_up_us": t_gu * 1e6, "down_us": t_dn * 1e6, "TB_s": moved / total / 1e12,
               "TFLOP_s": 2 * M * k * 3 * H * inter / total / 1e12, "current_us": t_cur * 1e6,
               "current": str(current), "rel_err": err, "sweep_s": time.perf_counter() - t0}
        rows.append(row)
        table.append((M, cfg))
        print(f"M={M:5d} experts {touched:3d} | best {cfg} | {total * 1e6:8.1f} us (gate_up {t_gu * 1e6:7.1f}, "
              f"down {t_dn * 1e6:7.1f}) {row['TB_s']:5.2f} TB/s {row['TFLOP_s']:6.1f} TFLOP/s | table now "
              f"{t_cur * 1e6:8.1f} us | rel err {err:.1e} | {row['sweep_s']:.0f}s", flush=True)
        if err > 1e-2:
            print(f"WARNING: M={M}: the best config's output is off by {err:.1e} (relative)")
    print_table(table, (E, H, inter), ns.tp)
    return {"shape": [E, H, inter, k], "rows": rows}


def print_table(table: list[tuple[int, MoEConfig]], key: tuple[int, int, int], tp: int) -> None:
    """The measured configs as moe_configs.py buckets: consecutive token counts with one config make one bucket
    (up to the last of them; the last bucket covers every larger step)."""
    buckets = []
    for M, cfg in table:
        if buckets and buckets[-1][1] == cfg:
            buckets[-1] = (M, cfg)
        else:
            buckets.append((M, cfg))
    buckets[-1] = (1 << 30, buckets[-1][1])
    print("\n# an entry of MOE_CONFIGS in nanovllm/kernels/moe_configs.py")
    print(f"    # measured on {torch.cuda.get_device_name()} by benchmarks/kernel_bench.py moe --tp {tp}")
    print(f"    {key}: (")
    for M, c in buckets:
        up, dn = c.gate_up, c.down
        print(f"        ({M}, _c({c.block_m}, ({up.block_n}, {up.block_k}, {up.num_warps}, {up.num_stages}), "
              f"({dn.block_n}, {dn.block_k}, {dn.num_warps}, {dn.num_stages}))),")
    print("    ),")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("moe", help="the fused MoE layer over candidate tile configs")
    m.add_argument("--tp", type=int, default=1, help="the expert width per rank is 768 / tp")
    m.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS))
    m.add_argument("--layers", type=int, default=4, help="weight copies cycled through (to miss L2)")
    m.add_argument("--experts", type=int, default=128)
    m.add_argument("--hidden", type=int, default=2048)
    m.add_argument("--inter", type=int, default=768)
    m.add_argument("--top-k", type=int, default=8)
    m.add_argument("--json", default=None, help="write the rows here")
    ns = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("kernel_bench.py needs a CUDA GPU")
    if ns.inter % ns.tp:
        ap.error(f"--inter {ns.inter} is not divisible by --tp {ns.tp}")
    res = bench_moe(ns)
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
