"""`Fp8Rows`: activations quantized per token by the kernel that produced them (an RMSNorm, SiLU-and-mul), handed
to the online FP8 linear layer that consumes them in place of a model-dtype tensor, so that layer skips its own
quantization launch."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Fp8Rows:
    q: torch.Tensor       # (M, K) e4m3
    scale: torch.Tensor   # (M, 1) float32: row i is q[i] * scale[i]
    dtype: torch.dtype    # the model dtype the rows stand for (the product's output dtype)

    def __post_init__(self):
        if self.q.dim() != 2 or self.q.dtype != torch.float8_e4m3fn:
            raise ValueError(f"Fp8Rows: q must be 2-D e4m3, got {tuple(self.q.shape)} {self.q.dtype}")
        if self.scale.shape != (self.q.shape[0], 1) or self.scale.dtype != torch.float32:
            raise ValueError(f"Fp8Rows: scale must be ({self.q.shape[0]}, 1) float32, got "
                             f"{tuple(self.scale.shape)} {self.scale.dtype}")

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    def dim(self) -> int:
        return 2
