"""Plain-torch paged attention: the reference every Triton kernel is tested against.

KV cache layout (one tensor each for K and V, per layer):

    k_cache, v_cache: (num_blocks, block_size, num_kv_heads, head_dim)

A *slot* is ``block_id * block_size + offset``. A slot of ``-1`` means "skip this token" (padding in a
CUDA-graph batch). A sequence's blocks are listed, in order, in its row of ``block_tables``
(``-1`` past its last block).

One step's batch is flat: ``T`` query tokens belonging to ``B`` sequences; sequence ``b`` owns query rows
``cu_seqlens_q[b]:cu_seqlens_q[b+1]`` and, after this step's K/V are written, has ``seq_lens[b]`` tokens in
the cache. Its queries are its *last* ``q_len`` tokens, so query ``i`` sits at absolute position
``seq_lens[b] - q_len + i`` and attends causally to cache positions ``0..that position``.
A sequence with ``seq_lens[b] == 0`` is padding: its outputs are zero.

FP8 cache (``kv_cache_dtype="fp8"``): the caches hold e4m3 values and ``k_scales, v_scales`` (num_blocks,
block_size, num_kv_heads) float32 hold one scale per token and KV head, chosen when the token is stored: its
head's largest magnitude maps to e4m3's 448 (``nanovllm.layers.quantization.fp8_ref``), so nothing overflows
whatever the scale of K or V. Attention dequantizes (value * scale, float32) and computes in float32.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from nanovllm.layers.quantization.fp8_ref import FP8_DTYPE, quantize_rows


def quantize_kv_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys or values (T, Hkv, D) -> (e4m3 (T, Hkv, D), float32 scales (T, Hkv)), per (token, head)."""
    T, Hkv, D = x.shape
    q, s = quantize_rows(x.reshape(T * Hkv, D))
    return q.view(T, Hkv, D), s.view(T, Hkv)


def dequantize_kv_ref(cache: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """An e4m3 cache (..., Hkv, D) with its scales (..., Hkv) -> float32 values."""
    return cache.float() * scales[..., None]


def store_kvcache_ref(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      slot_mapping: torch.Tensor, k_scales: torch.Tensor | None = None,
                      v_scales: torch.Tensor | None = None) -> None:
    """Write key/value (T, num_kv_heads, head_dim) into the paged cache at slot_mapping (T,); -1 skips. An e4m3
    cache is written quantized, with the scales into k_scales / v_scales (num_blocks, block_size, num_kv_heads)."""
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].long()
    k_flat = k_cache.view(num_blocks * block_size, num_kv_heads, head_dim)
    v_flat = v_cache.view(num_blocks * block_size, num_kv_heads, head_dim)
    if k_cache.dtype != FP8_DTYPE:
        k_flat[slots] = key[valid].to(k_cache.dtype)
        v_flat[slots] = value[valid].to(v_cache.dtype)
        return
    if k_scales is None or v_scales is None:
        raise ValueError("store_kvcache_ref: a float8_e4m3fn cache needs k_scales and v_scales")
    for src, flat, scales in ((key, k_flat, k_scales), (value, v_flat, v_scales)):
        q, s = quantize_kv_ref(src[valid])
        flat[slots] = q
        scales.view(num_blocks * block_size, num_kv_heads)[slots] = s


def paged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                        scale: float, max_seqlen_q: int, k_scales: torch.Tensor | None = None,
                        v_scales: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of each sequence's new queries over its paged KV cache.

    Args:
        q: (T, num_heads, head_dim) queries of this step, sequences back to back.
        k_cache, v_cache: (num_blocks, block_size, num_kv_heads, head_dim).
        cu_seqlens_q: (B + 1,) int, query offsets per sequence.
        seq_lens: (B,) int, tokens in the cache per sequence (context + this step's).
        block_tables: (B, max_blocks) int, -1 padded.
        scale: softmax scale.
        max_seqlen_q: host int >= every q_len (avoids a device sync).
        k_scales, v_scales: (num_blocks, block_size, num_kv_heads) float32, with an e4m3 cache (else None).
    Returns:
        (T, num_heads, head_dim) in q's dtype; zero for padding sequences.
    """
    T, H, D = q.shape
    _, block_size, Hkv, _ = k_cache.shape
    B = seq_lens.shape[0]
    device = q.device
    cu = cu_seqlens_q.long()
    q_lens = cu[1:] - cu[:-1]                                            # (B,)
    seq_idx = torch.repeat_interleave(torch.arange(B, device=device), q_lens, output_size=T)  # (T,)
    pos_in_q = torch.arange(T, device=device) - cu[seq_idx]              # (T,)

    fp8 = k_cache.dtype == FP8_DTYPE
    out_dtype = q.dtype
    if fp8:  # dequantized: float32 throughout
        if k_scales is None or v_scales is None:
            raise ValueError("paged_attention_ref: a float8_e4m3fn cache needs k_scales and v_scales")
        q = q.float()
    Mq = max(int(max_seqlen_q), 1)
    qp = q.new_zeros(B, Mq, H, D)
    qp[seq_idx, pos_in_q] = q                                            # (B, Mq, H, D)

    bt = block_tables.long().clamp(min=0)
    if fp8:
        k = dequantize_kv_ref(k_cache[bt], k_scales[bt]).reshape(B, -1, Hkv, D)  # (B, S, Hkv, D)
        v = dequantize_kv_ref(v_cache[bt], v_scales[bt]).reshape(B, -1, Hkv, D)
    else:
        k = k_cache[bt].reshape(B, -1, Hkv, D)                           # (B, S, Hkv, D)
        v = v_cache[bt].reshape(B, -1, Hkv, D)
    S = k.shape[1]

    lens = seq_lens.long()
    q_pos = (lens - q_lens)[:, None] + torch.arange(Mq, device=device)[None]      # (B, Mq)
    k_pos = torch.arange(S, device=device)
    mask = (k_pos[None, None, :] <= q_pos[:, :, None]) & (k_pos[None, None, :] < lens[:, None, None])
    mask[:, :, 0] = True  # keep every row finite; padding rows are zeroed below

    out = F.scaled_dot_product_attention(
        qp.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),         # (B, H|Hkv, *, D)
        attn_mask=mask[:, None], scale=scale, enable_gqa=(H != Hkv))       # (B, H, Mq, D)
    out = out.transpose(1, 2)[seq_idx, pos_in_q]                          # (T, H, D)
    return (out * (lens[seq_idx] > 0).to(out.dtype)[:, None, None]).to(out_dtype)
