"""`Fp8Rows`: activations quantized by the kernel that produced them (an RMSNorm, SiLU-and-mul), handed to the FP8
linear layer that consumes them in place of a model-dtype tensor, so that layer skips its own quantization launch;
`Fp8RowsSpec`: the quantization a layer's method takes that way."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Fp8RowsSpec:
    group: int | None = None   # None: one scale per token (online FP8); else per token and `group` columns (block)


@dataclass(frozen=True)
class Fp8Rows:
    q: torch.Tensor        # (M, K) e4m3
    scale: torch.Tensor    # (M, 1) float32, or (M, K // group): q * scale (broadcast per group) is the row
    dtype: torch.dtype     # the model dtype the rows stand for (the product's output dtype)
    group: int | None = None

    def __post_init__(self):
        if self.q.dim() != 2 or self.q.dtype != torch.float8_e4m3fn:
            raise ValueError(f"Fp8Rows: q must be 2-D e4m3, got {tuple(self.q.shape)} {self.q.dtype}")
        M, K = self.q.shape
        cols = 1 if self.group is None else K // self.group
        if self.scale.shape != (M, cols) or self.scale.dtype != torch.float32:
            raise ValueError(f"Fp8Rows: scale must be ({M}, {cols}) float32, got "
                             f"{tuple(self.scale.shape)} {self.scale.dtype}")

    @property
    def spec(self) -> Fp8RowsSpec:
        return Fp8RowsSpec(self.group)

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    def dim(self) -> int:
        return 2
