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
    group: int | None = None   # (made only by this package's kernels, which size q and scale so: no checks per step)

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    def dim(self) -> int:
        return 2
