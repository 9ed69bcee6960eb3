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
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def store_kvcache_ref(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      slot_mapping: torch.Tensor) -> None:
    """Write key/value (T, num_kv_heads, head_dim) into the paged cache at slot_mapping (T,); -1 skips."""
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].long()
    k_flat = k_cache.view(num_blocks * block_size, num_kv_heads, head_dim)
    v_flat = v_cache.view(num_blocks * block_size, num_kv_heads, head_dim)
    k_flat[slots] = key[valid].to(k_cache.dtype)
    v_flat[slots] = value[valid].to(v_cache.dtype)


def paged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                        scale: float, max_seqlen_q: int) -> torch.Tensor:
    """Causal attention of each sequence's new queries over its paged KV cache.

    Args:
        q: (T, num_heads, head_dim) queries of this step, sequences back to back.
        k_cache, v_cache: (num_blocks, block_size, num_kv_heads, head_dim).
        cu_seqlens_q: (B + 1,) int, query offsets per sequence.
        seq_lens: (B,) int, tokens in the cache per sequence (context + this step's).
        block_tables: (B, max_blocks) int, -1 padded.
        scale: softmax scale.
        max_seqlen_q: host int >= every q_len (avoids a device sync).
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

    Mq = max(int(max_seqlen_q), 1)
    qp = q.new_zeros(B, Mq, H, D)
    qp[seq_idx, pos_in_q] = q                                            # (B, Mq, H, D)

    bt = block_tables.long().clamp(min=0)
    k = k_cache[bt].reshape(B, -1, Hkv, D)                               # (B, S, Hkv, D)
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
    return out * (lens[seq_idx] > 0).to(out.dtype)[:, None, None]
