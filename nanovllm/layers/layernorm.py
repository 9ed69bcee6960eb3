"""RMSNorm, optionally fused with the residual add that precedes it (as in every Llama-style block)."""
from __future__ import annotations

import torch
from torch import nn


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's RMSNorm, op for op: normalize in float32, cast back, then scale."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual); the sum is taken in x's dtype, as HF does."""
    s = x + residual
    return rms_norm_ref(s, weight, eps), s


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.fused = None  # set by the model runner to a Triton kernel on CUDA

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            if self.fused is not None:
                return self.fused.rms_norm(x, self.weight, self.eps)
            return rms_norm_ref(x, self.weight, self.eps)
        if self.fused is not None:
            return self.fused.add_rms_norm(x, residual, self.weight, self.eps)
        return add_rms_norm_ref(x, residual, self.weight, self.eps)
