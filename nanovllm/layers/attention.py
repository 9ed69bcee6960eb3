"""The attention layer: holds its slice of the paged KV cache and defers the math to a backend."""
from __future__ import annotations

import torch
from torch import nn

from nanovllm.attention.backend import AttentionBackend, AttentionMetadata


class Attention(nn.Module):
    def __init__(self, num_heads: int, head_dim: int, num_kv_heads: int, scale: float, backend: AttentionBackend):
        super().__init__()
        self.num_heads, self.head_dim, self.num_kv_heads, self.scale = num_heads, head_dim, num_kv_heads, scale
        self.backend = backend
        # views of the runner's KV cache, bound once it is allocated (engine/kv_cache.py); an e4m3 cache's
        # per-(token, head) scales beside it (None otherwise)
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)
        self.k_scales: torch.Tensor | None = None
        self.v_scales: torch.Tensor | None = None

    def store(self, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> None:
        """Write this step's keys and values ((T, Hkv, D) or (T, Hkv * D)) into the cache."""
        T = k.shape[0]
        self.backend.store(k.view(T, self.num_kv_heads, self.head_dim), v.view(T, self.num_kv_heads, self.head_dim),
                           self.k_cache, self.v_cache, meta.slot_mapping, self.k_scales, self.v_scales)

    def attend(self, q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Attention of q (T, H, D) over the cache, whose K/V for this step were already stored."""
        T = q.shape[0]
        o = self.backend.attend(q, self.k_cache, self.v_cache, meta, self.scale, self.k_scales,
                                self.v_scales)                                  # (T, H, D)
        return o.reshape(T, self.num_heads * self.head_dim)
