"""RMSNorm, optionally fused with the residual add that precedes it (as in every Llama-style block), and
optionally quantizing its output for the FP8 linear layer it feeds (`Fp8Rows`)."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from nanovllm.layers.moe_ref import combine_ref
from nanovllm.layers.quantization.fp8_rows import Fp8Rows, Fp8RowsSpec

if TYPE_CHECKING:
    from nanovllm.layers.ops import Ops


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's RMSNorm, op for op: normalize in float32, cast back, then scale."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, *,
                     rows_per_token: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual); the sum is taken in x's dtype, as HF does.
    rows_per_token k > 1: x (T * k, N) holds each token's k weighted expert rows, combined first (``combine_ref``:
    float32, in row order, rounded to x's dtype)."""
    if rows_per_token > 1:
        x = combine_ref(x, rows_per_token)
    s = x + residual
    return rms_norm_ref(s, weight, eps), s


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6, ops: Ops | None = None,
                 fp8_out: Fp8RowsSpec | None = None):
        """ops: the kernels to run (None: the torch references). fp8_out: the normalized rows come out as
        `Fp8Rows` quantized so (for a linear layer whose method takes them) where ops has the quantizing norms."""
        super().__init__()
        from nanovllm.layers.ops import TORCH_OPS
        self.eps = eps
        self.ops = ops or TORCH_OPS
        self.fp8_out = fp8_out if self.ops.rms_norm_fp8 is not None else None
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, rows_per_token: int = 1):
        """rms_norm(x); with a residual, (rms_norm(x + residual), x + residual); rows_per_token k > 1: x holds k
        rows per token (a mixture of experts' uncombined output), summed before the add. With fp8_out the
        normalized rows are `Fp8Rows`."""
        w, eps = self.weight, self.eps
        if self.fp8_out is not None:  # (rows in the dtype the plain norm would write: the weight's and the sum's)
            g = self.fp8_out.group
            if residual is None:
                return Fp8Rows(*self.ops.rms_norm_fp8(x, w, eps, group=g), torch.promote_types(w.dtype, x.dtype), g)
            (q, s), summed = self.ops.add_rms_norm_fp8(x, residual, w, eps, rows_per_token=rows_per_token, group=g)
            return Fp8Rows(q, s, torch.promote_types(w.dtype, summed.dtype), g), summed
        if residual is None:
            return self.ops.rms_norm(x, w, eps)
        return self.ops.add_rms_norm(x, residual, w, eps, rows_per_token=rows_per_token)
