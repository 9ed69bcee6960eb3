"""Rotary position embedding (NeoX / HF "rotate_half" layout), with Llama 3 and linear scaling."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from nanovllm.layers.ops import Ops


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """Inverse frequencies (head_dim // 2,), float32, computed the way transformers does."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"unsupported rope scaling type {rope_type!r}; supported: default, linear, llama3")


def apply_rotary_ref(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                     cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q: (T, H, D), k: (T, Hkv, D), positions: (T,), cos_sin_cache: (max_pos, D) float32 = [cos | sin]
    of the D/2 frequencies. Returns rotated (q, k) in their dtype; arithmetic in that dtype, as HF does."""
    half = cos_sin_cache.shape[-1] // 2
    cs = cos_sin_cache[positions]                                   # (T, D)
    cos, sin = cs[:, None, :half].to(q.dtype), cs[:, None, half:].to(q.dtype)  # (T, 1, D/2)

    def rot(x):
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    return rot(q), rot(k)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, theta: float, scaling: dict | None = None,
                 ops: Ops | None = None):
        """ops: the kernels to run (None: the torch references)."""
        super().__init__()
        from nanovllm.layers.ops import TORCH_OPS
        self.ops = ops or TORCH_OPS
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        freqs = torch.arange(max_position, dtype=torch.float32)[:, None] * inv_freq[None, :]  # (P, D/2)
        self.register_buffer("cos_sin_cache", torch.cat((freqs.cos(), freqs.sin()), dim=-1), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        return self.ops.apply_rotary(q, k, positions, self.cos_sin_cache)
