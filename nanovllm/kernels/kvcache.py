"""Scatter one step's keys/values into the paged KV cache (an e4m3 cache: quantized per token and KV head, the
scale beside it; reference ``nanovllm.attention.torch_ref.store_kvcache_ref``)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanovllm.kernels._common import check_cache, check_float, check_int, check_kv_scales, check_same_device, next_pow2
from nanovllm.kernels.fp8_quant import fp8_inverse, fp8_quantize, fp8_scale


@triton.jit
def store_fp8_heads(C, CS, dst, sdst, x, mask, h_ok):
    """Quantize a (heads, D) tile x per head (row) and store it at C + dst, its scales at CS + sdst."""
    xf = x.to(tl.float32)
    s = fp8_scale(tl.max(tl.where(mask, tl.abs(xf), 0.0), axis=1))
    tl.store(C + dst, fp8_quantize(xf, fp8_inverse(s)[:, None]), mask=mask)
    tl.store(CS + sdst, s, mask=h_ok)


@triton.jit
def _store_kvcache_kernel(
    K, V, KC, VC, KS, VS, SLOTS, num_kv_heads,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_cs, stride_ch, stride_sb, stride_ss,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_H: tl.constexpr,
    FP8: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    slot = tl.load(SLOTS + t).to(tl.int64)
    if slot >= 0:
        blk = slot // BLOCK_SIZE
        off = slot % BLOCK_SIZE
        offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
        offs_d = tl.arange(0, D_PAD)
        mask = (offs_h < num_kv_heads)[:, None] & (offs_d < HEAD_DIM)[None, :]
        k = tl.load(K + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
        v = tl.load(V + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
        dst = blk * stride_cb + off * stride_cs + offs_h[:, None] * stride_ch + offs_d[None, :]
        if FP8:
            sdst = blk * stride_sb + off * stride_ss + offs_h
            h_ok = offs_h < num_kv_heads
            store_fp8_heads(KC, KS, dst, sdst, k, mask, h_ok)
            store_fp8_heads(VC, VS, dst, sdst, v, mask, h_ok)
        else:
            tl.store(KC + dst, k.to(KC.dtype.element_ty), mask=mask)
            tl.store(VC + dst, v.to(VC.dtype.element_ty), mask=mask)


def store_kvcache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor, k_scales: torch.Tensor | None = None,
                  v_scales: torch.Tensor | None = None) -> None:
    """Write key/value (T, num_kv_heads, head_dim) into k_cache/v_cache (num_blocks, block_size, num_kv_heads,
    head_dim) at the flat slots ``slot_mapping`` (T,) (slot = block * block_size + offset); slot -1 is skipped.

    key/value may be strided views (e.g. slices of a fused qkv projection) as long as their last dimension is
    contiguous; the caches may be any strided 4-D views with a contiguous last dimension, but k_cache and
    v_cache must have the same shape and strides. Values are cast to the cache dtype; an e4m3 cache takes the
    per-(token, head) scales into k_scales / v_scales (num_blocks, block_size, num_kv_heads) float32.
    """
    if key.dim() != 3 or value.shape != key.shape:
        raise ValueError(f"store_kvcache: key/value must both be (T, num_kv_heads, head_dim), got "
                         f"{tuple(key.shape)} and {tuple(value.shape)}")
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(f"store_kvcache: k_cache/v_cache must both be (num_blocks, block_size, num_kv_heads, "
                         f"head_dim), got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    T, Hkv, D = key.shape
    if tuple(k_cache.shape[2:]) != (Hkv, D):
        raise ValueError(f"store_kvcache: cache heads/head_dim {tuple(k_cache.shape[2:])} do not match key "
                         f"{(Hkv, D)}")
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != T:
        raise ValueError(f"store_kvcache: slot_mapping must be (T={T},), got {tuple(slot_mapping.shape)}")
    check_int("store_kvcache: slot_mapping", slot_mapping)
    for name, t in (("key", key), ("value", value), ("k_cache", k_cache), ("v_cache", v_cache)):
        (check_cache if name.endswith("cache") else check_float)(f"store_kvcache: {name}", t)
        if D > 1 and t.stride(-1) != 1:
            raise ValueError(f"store_kvcache: {name} must have a contiguous last (head_dim) dimension, got "
                             f"strides {tuple(t.stride())}")
    if k_cache.stride() != v_cache.stride():
        raise ValueError(f"store_kvcache: k_cache and v_cache must have the same strides, got "
                         f"{tuple(k_cache.stride())} and {tuple(v_cache.stride())}")
    check_same_device(key=key, value=value, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping)
    fp8, stride_sb, stride_ss = check_kv_scales("store_kvcache", k_cache, v_cache, k_scales, v_scales)
    if T == 0:
        return
    if not slot_mapping.is_contiguous():
        slot_mapping = slot_mapping.contiguous()
    block_size = k_cache.shape[1]
    BLOCK_H = min(next_pow2(Hkv), max(1, 2048 // next_pow2(D)))
    grid = (T, triton.cdiv(Hkv, BLOCK_H))
    _store_kvcache_kernel[grid](
        key, value, k_cache, v_cache, k_scales if fp8 else k_cache, v_scales if fp8 else v_cache, slot_mapping, Hkv,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), stride_sb, stride_ss,
        BLOCK_SIZE=block_size, HEAD_DIM=D, D_PAD=next_pow2(D), BLOCK_H=BLOCK_H, FP8=fp8,
        num_warps=4,
    )
