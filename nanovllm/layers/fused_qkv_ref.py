"""Torch reference of the fused QK-norm + RoPE + KV-store op (``nanovllm.kernels.fused_qkv``).

It is the unfused decoder path, composed from the existing references: split the QKV projection output,
``rms_norm_ref`` per head of q and k (Qwen3 only), ``apply_rotary_ref``, then ``store_kvcache_ref``.
Imports no triton.
"""
from __future__ import annotations

import torch

from nanovllm.attention.torch_ref import store_kvcache_ref
from nanovllm.layers.layernorm import rms_norm_ref
from nanovllm.layers.rotary import apply_rotary_ref


def qkv_norm_rope_store_ref(qkv: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                            q_norm_weight: torch.Tensor | None, k_norm_weight: torch.Tensor | None, eps: float,
                            k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                            num_heads: int, num_kv_heads: int, head_dim: int,
                            q_out: torch.Tensor | None = None, k_scales: torch.Tensor | None = None,
                            v_scales: torch.Tensor | None = None) -> torch.Tensor:
    """qkv (T, (H + 2 Hkv) D) -> q (T, H, D) normed + rotated; k (normed + rotated) and v stored in the paged
    cache at ``slot_mapping`` (-1: skipped; an e4m3 cache with its scales). See
    ``nanovllm.kernels.fused_qkv.qkv_norm_rope_store``."""
    if (q_norm_weight is None) != (k_norm_weight is None):
        raise ValueError("qkv_norm_rope_store_ref: give both q_norm_weight and k_norm_weight, or neither")
    T = qkv.shape[0]
    H, Hkv, D = num_heads, num_kv_heads, head_dim
    q, k, v = qkv.split([H * D, Hkv * D, Hkv * D], dim=-1)
    q, k, v = q.reshape(T, H, D), k.reshape(T, Hkv, D), v.reshape(T, Hkv, D)
    if q_norm_weight is not None:
        q, k = rms_norm_ref(q, q_norm_weight, eps), rms_norm_ref(k, k_norm_weight, eps)
    q, k = apply_rotary_ref(q, k, positions, cos_sin_cache)
    store_kvcache_ref(k, v, k_cache, v_cache, slot_mapping, k_scales, v_scales)
    if q_out is None:
        return q.contiguous()
    q_out.copy_(q)
    return q_out
