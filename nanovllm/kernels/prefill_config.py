"""Tile configurations of the varlen prefill kernel (``prefill_attention``): what one compiled variant is
(`TileConfig`), the table of chosen configs keyed by (head_dim, padded GQA group, query-length bucket, dtype),
and the choice for one call (`tile_config`). No triton import: benchmarks and tests read it on their own.

The table holds the configs measured best on an H200 by ``benchmarks/kernel_bench.py attention --sweep``, which
prints its winners as entries to paste here; a key not in the table falls back to `_heuristic`.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

ORDERS = ("natural", "reverse", "sorted")

# query-length buckets (host max_seqlen_q): one compiled variant each at most. "decode": a few rows per program
# (one-token queries, e.g. the last layer's sampled rows); "short": prompts and chunks up to 1,024 tokens (mixed
# steps, short prompts); "long": everything longer
SHORT_MAX_Q = 1024
DECODE_MAX_ROWS = 32


@dataclass(frozen=True)
class TileConfig:
    """One variant of the varlen kernel.

    block_m: rows of a program's query tile (queries x the query heads it packs); block_n: keys per KV tile.
    num_warps / num_stages: Triton launch options (num_stages pipelines the unmasked KV loop's loads).
    tma: K/V tiles through host-side tensor descriptors (TMA on sm_90+) over the flattened cache; used when the
        cache allows it (``block_size % block_n == 0``, dense 16-byte aligned rows), else plain pointer loads.
    warp_specialize: Triton's automatic warp specialization of the unmasked KV loop (producer/consumer warps);
        with Triton 3.6 on sm_90 it compiles to the same kernel (or trips a compiler assertion): kept for newer
        Tritons, left out of the table and the sweep.
    pack_gqa: a program stacks the query heads that share its KV head along M (each K/V tile loaded once for
        all of them); False: one query head per program (the others read the same tile from L2).
    order: the launch order of the query tiles. "natural": sequence by sequence, first tile first; "reverse":
        sequence by sequence, each sequence's last (most keys) tile first; "sorted": all tiles of the batch by
        the keys they read, most first (a search over the batch's sequences per program). Ignored by the
        persistent grid, which numbers its tiles in natural order.
    """
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    tma: bool = False
    warp_specialize: bool = False
    pack_gqa: bool = True
    order: str = "reverse"

    def __post_init__(self):
        for name in ("block_m", "block_n"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"TileConfig.{name} must be a power of two >= 16, got {v}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"TileConfig.num_warps must be 1, 2, 4, 8 or 16, got {self.num_warps}")
        if self.num_stages < 1:
            raise ValueError(f"TileConfig.num_stages must be >= 1, got {self.num_stages}")
        if self.order not in ORDERS:
            raise ValueError(f"TileConfig.order must be one of {ORDERS}, got {self.order!r}")
        if self.warp_specialize and not self.tma:
            raise ValueError("TileConfig.warp_specialize needs tma=True (its producer warps issue TMA loads)")

    @property
    def name(self) -> str:
        flags = [f for f, on in (("tma", self.tma), ("ws", self.warp_specialize), ("nopack", not self.pack_gqa))
                 if on]
        return "-".join([f"m{self.block_m}n{self.block_n}w{self.num_warps}s{self.num_stages}", *flags, self.order])

    def code(self) -> str:
        """The config as Python source, for a table entry."""
        extra = "".join(f", {k}={getattr(self, k)!r}" for k in ("tma", "warp_specialize", "pack_gqa", "order")
                        if getattr(self, k) != getattr(_DEFAULT, k))
        return f"TileConfig({self.block_m}, {self.block_n}, {self.num_warps}, {self.num_stages}{extra})"


_DEFAULT = TileConfig(16, 16, 4, 1)
_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}

# (head_dim, G_PAD, bucket, dtype) -> config, from `kernel_bench.py attention --sweep` on an H200 (2026-12-01): long
# prompts 128 x 128 tiles, 8 warps (two warpgroups of 64 rows, wgmma), TMA loads (the sweep's best geometric mean,
# nopack and the other orders, is within 0.6% of it: kept); short ones (<= 1,024 tokens) the same tiles with
# pointer loads and 2 stages, 1.8x the 64 x 64 TMA tiles they replace at 1k tokens (208 vs 115 TFLOP/s at 32 / 8
# heads; the reference workload 0.998x on Qwen3-0.6B and -8B, same call each). fp16 runs at bf16's rates and takes
# its tiles. A G_PAD missing here takes the nearest one's.
TABLE: dict[tuple[int, int, str, str], TileConfig] = {
    (128, 2, "long", "bf16"): TileConfig(128, 128, 8, 3, tma=True),
    (128, 2, "short", "bf16"): TileConfig(128, 128, 8, 2),
    (128, 4, "long", "bf16"): TileConfig(128, 128, 8, 3, tma=True),
    (128, 4, "short", "bf16"): TileConfig(128, 128, 8, 2),
    (64, 4, "long", "bf16"): TileConfig(64, 128, 4, 2, tma=True),   # 452 vs 299 TFLOP/s at 8k (head_dim 64)
    (64, 4, "short", "bf16"): TileConfig(128, 128, 8, 2),
}
TABLE.update({(d, g, b, "fp16"): cfg for (d, g, b, dt), cfg in list(TABLE.items()) if dt == "bf16"})

# Over an e4m3 cache (kv_cache_dtype="fp8") the K/V tiles are converted in registers, which the bf16 tiles' deep
# TMA pipelines and 128-row programs leave no room for: pointer loads, one stage for long prompts and 64-row
# programs for short ones. Measured on an H200 (`.dev` probe over kernel_bench's AttentionCase, CUDA graphs,
# 2026-12-03), 32 / 4 and 32 / 8 heads, head_dim 128, against the bf16 entries above over the same e4m3 cache:
# long, 4,096 fresh tokens 520 vs 598 us, a 2,048-token chunk after 6,144 838 vs 963, 2 x 8,192 3,837 vs 4,304
# (1.12-1.15x); short, a mixed step's chunks (373 fresh tokens; 200 after 600 beside 173; 256 after 768; 3 x 64
# after 900) 16.0-31.1 vs 20.5-42.1 us (1.28-1.35x), 1,024 fresh 48.4 vs 53.4. head_dim 64 takes the bf16 table.
E4M3_TABLE: dict[tuple[int, str], TileConfig] = {
    (128, "long"): TileConfig(128, 128, 8, 1),
    (128, "short"): TileConfig(64, 128, 4, 2),
}


# The candidates `kernel_bench.py attention --sweep` times on every shape (each is one compile per head_dim and
# GQA group): the previous kernel's tiles, wider KV tiles, pointer vs TMA loads, pipeline depths, one head per
# program, the three launch orders, and 64-row tiles of one warpgroup whose shared memory (~83 KB) and registers
# let two programs share an SM (independent warpgroups: one's softmax can overlap the other's MMAs, which Triton
# does not schedule inside one program on sm_90). (warp_specialize is left out: with Triton 3.6 on sm_90 it
# compiles to the same kernel, or trips an assertion in the compiler.)
SWEEP: tuple[TileConfig, ...] = (
    TileConfig(128, 64, 8, 2, order="natural"),
    TileConfig(128, 128, 8, 2),
    TileConfig(128, 64, 8, 3, tma=True),
    TileConfig(128, 128, 8, 2, tma=True),
    TileConfig(128, 128, 8, 3, tma=True),
    TileConfig(128, 128, 8, 3, tma=True, order="natural"),
    TileConfig(128, 128, 8, 3, tma=True, order="sorted"),
    TileConfig(128, 128, 8, 3, tma=True, pack_gqa=False),
    TileConfig(64, 64, 4, 2, tma=True),
    TileConfig(64, 64, 4, 3, tma=True),
    TileConfig(64, 128, 4, 1, tma=True),
    TileConfig(64, 128, 4, 2, tma=True),
)


def bucket(max_seqlen_q: int, g_pad: int) -> str:
    """The query-length bucket of a call: "decode", "short" or "long"."""
    if max_seqlen_q * g_pad <= DECODE_MAX_ROWS:
        return "decode"
    return "short" if max_seqlen_q <= SHORT_MAX_Q else "long"


def _heuristic(head_dim: int, g_pad: int, bucket_name: str, dtype: torch.dtype) -> TileConfig:
    """Configs for keys the table leaves out: float32 (exact FMA dots, small tiles: a debug path), other head
    dims, and the decode bucket (a few query rows per program: mma.sync tiles of 32 rows)."""
    if dtype == torch.float32:
        bm, bn = 64, 32
    elif head_dim <= 128:
        bm, bn = 128, 64
    else:
        bm, bn = 64, 32
    if bucket_name == "decode":
        bm = 32
    bm = max(bm, g_pad)
    warps = 8 if (bm >= 128 or head_dim > 128) and dtype != torch.float32 else 4
    return TileConfig(bm, bn, warps, 2)


def tile_config(head_dim: int, g_pad: int, max_seqlen_q: int, dtype: torch.dtype,
                kv_fp8: bool = False) -> TileConfig:
    """The config of a call: over an e4m3 cache (kv_fp8, half-precision queries) E4M3_TABLE's entry for its
    head_dim and bucket, else the table's entry for its key (for a G_PAD it lacks, the nearest G_PAD's entry of
    the same head_dim, bucket and dtype), else the heuristic; block_m is at least g_pad (a program holds at least
    one query of every packed head)."""
    b = bucket(max_seqlen_q, g_pad)
    dt = _DTYPE_NAMES.get(dtype, "")
    near = [g for d, g, bk, t in TABLE if (d, bk, t) == (head_dim, b, dt)]
    cfg = E4M3_TABLE.get((head_dim, b)) if kv_fp8 and dt in ("bf16", "fp16") else None
    if cfg is None and near:
        g = min(near, key=lambda g: (abs(g.bit_length() - g_pad.bit_length()), g))
        cfg = TABLE[(head_dim, g, b, dt)]
    if cfg is None:
        cfg = _heuristic(head_dim, g_pad, b, dtype)
    if cfg.pack_gqa and cfg.block_m < g_pad:
        cfg = replace(cfg, block_m=g_pad)
    return cfg
