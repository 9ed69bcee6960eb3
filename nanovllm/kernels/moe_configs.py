"""Tile configs of the fused-MoE kernels (`nanovllm.kernels.moe`), by weight shape and number of tokens.

A step of T tokens routes T * top_k (token, expert) pairs; the expert-sorted layout pads each expert's pairs to
blocks of ``block_m`` rows, and the two grouped GEMMs (gate/up with SiLU-and-mul, down) tile those blocks by
``block_n`` outputs and ``block_k`` of the reduction. At decode sizes an expert gets a few rows and the layer is
bound by streaming the expert weights (Qwen3-30B-A3B: ~58 GB of experts per step once most are touched, at 256
sequences): small blocks of rows, wide tiles and deep pipelines to keep loads in flight. For large steps it is
compute-bound: 64-row (or larger) blocks, which Hopper's wgmma needs.

``MOE_CONFIGS`` holds the measured table, keyed by (experts, hidden size, intermediate size per rank): buckets
of (largest token count, config), ascending; a step takes the first bucket that holds its token count, the last
one beyond. Shapes not in it use ``DEFAULT_BUCKETS``. ``benchmarks/kernel_bench.py moe`` measures the table on
a GPU and prints it in this form.
"""
from __future__ import annotations

from dataclasses import dataclass

from nanovllm.kernels._common import check_tiling, next_pow2


@dataclass(frozen=True)
class GemmTile:
    """One grouped GEMM's tiling: outputs and reduction per step (powers of two >= 16), warps, pipeline stages."""
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self):
        check_tiling(self, ("block_n", "block_k"))

    def fit(self, n: int, k: int, itemsize: int = 2) -> GemmTile:
        """This tile shrunk to an (n outputs, k reduction) problem smaller than it (tiny test models), with the
        k-tile scaled to the bytes of the 2-byte (bf16) tiles the table holds: half for 4-byte operands (float32),
        twice for 1-byte ones (e4m3 on both sides; at least 32 wide, what FP8 tensor-core dots take)."""
        bk = self.block_k * 2 // itemsize
        least = 32 if itemsize == 1 else 16
        return GemmTile(min(self.block_n, max(16, next_pow2(n))), max(least, min(bk, next_pow2(k))),
                        self.num_warps, self.num_stages)

    def __str__(self) -> str:
        return f"{self.block_n}x{self.block_k}w{self.num_warps}s{self.num_stages}"


@dataclass(frozen=True)
class MoEConfig:
    """Rows per expert block (the layout both GEMMs share) and each GEMM's tile."""
    block_m: int
    gate_up: GemmTile
    down: GemmTile

    def __post_init__(self):
        check_tiling(self, ("block_m",), ())

    def __str__(self) -> str:
        return f"m{self.block_m} gate_up {self.gate_up} down {self.down}"


def _c(block_m, up, down) -> MoEConfig:
    return MoEConfig(block_m, GemmTile(*up), GemmTile(*down))


# Untuned Hopper starting points (to be replaced by `kernel_bench.py moe` on an H200): up to ~16 rows per expert
# (128 tokens at E=128, k=8), 16-row blocks stream the weights with 4-5 stages; up to ~32 rows per expert
# (512 tokens: the decode and mixed-step graphs), 32-row blocks, so that an expert's tile is read once; from
# there 64-row blocks for wgmma. The down projection's reduction is short (I = 768): wide tiles give each
# program more of the weight to stream per pipeline fill.
DEFAULT_BUCKETS: tuple[tuple[int, MoEConfig], ...] = (
    (16, _c(16, (32, 128, 4, 5), (64, 128, 4, 5))),
    (128, _c(16, (64, 128, 4, 4), (128, 128, 4, 4))),
    (512, _c(32, (64, 128, 4, 4), (128, 128, 4, 4))),
    (1 << 30, _c(64, (128, 64, 8, 3), (128, 64, 8, 3))),
)

# (num_experts, hidden_size, intermediate_size per rank) -> buckets; measured on an H200 by
# `python benchmarks/kernel_bench.py moe --tokens 256 1024 4096 8192` (2026-12-01; up to 128 tokens DEFAULT_BUCKETS'
# entries, which the 16-128-token sweep measured within 1% of its best). Against DEFAULT_BUCKETS the layer took 410
# vs 448 us at 1,024 tokens, 876 vs 1,108 at 4,096 and 1,604 vs 2,058 at 8,192. At 256 tokens (the reference
# workload's decode and mixed steps) gate/up with 2 stages: the sweep's pick in two later calls (with 8-warp and
# 2-5 stage candidates), the layer 313.9 vs 316.8 us.
MOE_CONFIGS: dict[tuple[int, int, int], tuple[tuple[int, MoEConfig], ...]] = {
    (128, 2048, 768): (  # Qwen3-30B-A3B, one GPU
        DEFAULT_BUCKETS[0],
        DEFAULT_BUCKETS[1],
        (256, _c(32, (64, 128, 4, 2), (64, 128, 4, 3))),
        (1024, _c(64, (64, 64, 4, 3), (128, 64, 8, 3))),
        (4096, _c(128, (128, 64, 8, 4), (256, 64, 8, 4))),
        (1 << 30, _c(128, (128, 64, 8, 3), (256, 64, 8, 4))),
    ),
}


def config_buckets(num_experts: int, hidden_size: int, intermediate_size: int) -> tuple[tuple[int, MoEConfig], ...]:
    """The (largest token count, config) buckets of experts of this shape (intermediate_size: this rank's)."""
    return MOE_CONFIGS.get((num_experts, hidden_size, intermediate_size), DEFAULT_BUCKETS)


def moe_config(tokens: int, num_experts: int, hidden_size: int, intermediate_size: int) -> MoEConfig:
    """The config for a step of `tokens` tokens over experts of this shape (intermediate_size: this rank's)."""
    buckets = config_buckets(num_experts, hidden_size, intermediate_size)
    for max_tokens, cfg in buckets:
        if tokens <= max_tokens:
            return cfg
    return buckets[-1][1]
