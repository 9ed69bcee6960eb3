"""QK-norm + RoPE + KV-cache store, fused into one launch on the output of the QKV projection.

Per layer, between the QKV GEMM and attention, the unfused path runs (Qwen3) a copy of the strided q view, the
q RMSNorm, the same two for k, the RoPE kernel and the KV-store kernel; this kernel does all of it in one pass:

* q heads: [RMSNorm] -> RoPE -> ``q_out`` (T, H, D);
* k heads: [RMSNorm] -> RoPE -> ``k_cache`` at the token's slot; v heads: copied to ``v_cache`` (slot -1: skip).

Rounding follows the torch references op for op (``rms_norm_ref`` then ``apply_rotary_ref`` then
``store_kvcache_ref``, composed in ``nanovllm.layers.fused_qkv_ref``): the norm runs in float32, is rounded to
the input dtype, scaled by the weight and rounded to ``promote_types(weight, input)``; RoPE rounds cos/sin and
every product / sum to that dtype; the cache store casts to the cache dtype, or quantizes each k / v head to
e4m3 with its own scale (as ``kernels.kvcache`` does).

Grid: (T, q head-blocks + kv head-blocks). A program either rotates one block of q heads, or handles one
block of kv heads (k and v) of one token; every block is a (BLOCK_H, D/2) tile per rotate-half, so all heads
of a block are read and written with vectorized loads. The launch config depends on shapes only and nothing
is read back to the host, so the op can be captured in a CUDA graph.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanovllm.kernels._common import check_cache, check_float, check_int, check_kv_scales, check_same_device, next_pow2
from nanovllm.kernels.fp8_quant import fp8_inverse, fp8_quantize, fp8_scale


@triton.jit
def _norm_rope_tile(X, W, QO, eps, cos, sin, offs_h, offs_d, mask,
                    HAS_NORM: tl.constexpr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr):
    """Load heads ``offs_h`` (rows of HEAD_DIM elements at X), [RMSNorm with W], rotate; returns both halves
    in QO's dtype (the dtype of the normed values, in which RoPE is computed)."""
    dt = QO.dtype.element_ty
    src = X + offs_h[:, None] * HEAD_DIM + offs_d[None, :]
    x1 = tl.load(src, mask=mask, other=0.0)
    x2 = tl.load(src + HALF, mask=mask, other=0.0)
    x1f = x1.to(tl.float32)
    x2f = x2.to(tl.float32)
    if HAS_NORM:
        ss = tl.sum(x1f * x1f, axis=1) + tl.sum(x2f * x2f, axis=1)
        rstd = tl.rsqrt(ss / HEAD_DIM + eps)[:, None]
        xdt = X.dtype.element_ty
        h1 = (x1f * rstd).to(xdt).to(tl.float32)
        h2 = (x2f * rstd).to(xdt).to(tl.float32)
        d_ok = offs_d < HALF
        w1 = tl.load(W + offs_d, mask=d_ok, other=0.0).to(tl.float32)
        w2 = tl.load(W + HALF + offs_d, mask=d_ok, other=0.0).to(tl.float32)
        x1f = (w1[None, :] * h1).to(dt).to(tl.float32)
        x2f = (w2[None, :] * h2).to(dt).to(tl.float32)
    a = (x1f * cos).to(dt).to(tl.float32)
    b = (x2f * sin).to(dt).to(tl.float32)
    c = (x2f * cos).to(dt).to(tl.float32)
    e = (x1f * sin).to(dt).to(tl.float32)
    return (a - b).to(dt), (c + e).to(dt)


@triton.jit
def _store_halves(C, CS, dst, sdst, x1, x2, mask, h_ok, HALF: tl.constexpr, FP8: tl.constexpr):
    """Store both rotate-halves (heads, HALF_PAD) of a k or v tile at C + dst; e4m3: each head quantized over
    both halves, its scale at CS + sdst."""
    if FP8:
        f1 = x1.to(tl.float32)
        f2 = x2.to(tl.float32)
        amax = tl.maximum(tl.max(tl.where(mask, tl.abs(f1), 0.0), axis=1),
                          tl.max(tl.where(mask, tl.abs(f2), 0.0), axis=1))
        s = fp8_scale(amax)
        inv = fp8_inverse(s)[:, None]
        tl.store(C + dst, fp8_quantize(f1, inv), mask=mask)
        tl.store(C + dst + HALF, fp8_quantize(f2, inv), mask=mask)
        tl.store(CS + sdst, s, mask=h_ok)
    else:
        tl.store(C + dst, x1.to(C.dtype.element_ty), mask=mask)
        tl.store(C + dst + HALF, x2.to(C.dtype.element_ty), mask=mask)


@triton.jit
def _qkv_norm_rope_store_kernel(
    QKV, POS, CS, QW, KW, QO, KC, VC, KSC, VSC, SLOTS, eps,
    stride_t, stride_cs, stride_qot, stride_qoh, stride_cb, stride_cslot, stride_ch, stride_sb, stride_ss,
    H: tl.constexpr, HKV: tl.constexpr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr, NUM_QB: tl.constexpr, BLOCK_SIZE: tl.constexpr, HAS_NORM: tl.constexpr,
    FP8: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    dt = QO.dtype.element_ty  # dtype of the normed q / k, in which RoPE is computed
    offs_d = tl.arange(0, HALF_PAD)
    d_ok = offs_d < HALF
    row = QKV + t * stride_t
    if hb < NUM_QB:
        pos = tl.load(POS + t).to(tl.int64)
        cos = tl.load(CS + pos * stride_cs + offs_d, mask=d_ok, other=0.0).to(dt).to(tl.float32)
        sin = tl.load(CS + pos * stride_cs + HALF + offs_d, mask=d_ok, other=0.0).to(dt).to(tl.float32)
        offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
        mask = (offs_h < H)[:, None] & d_ok[None, :]
        q1, q2 = _norm_rope_tile(row, QW, QO, eps, cos, sin, offs_h, offs_d, mask, HAS_NORM, HEAD_DIM, HALF)
        dst = QO + t * stride_qot + offs_h[:, None] * stride_qoh + offs_d[None, :]
        tl.store(dst, q1, mask=mask)
        tl.store(dst + HALF, q2, mask=mask)
    else:
        slot = tl.load(SLOTS + t).to(tl.int64)
        if slot >= 0:
            pos = tl.load(POS + t).to(tl.int64)
            cos = tl.load(CS + pos * stride_cs + offs_d, mask=d_ok, other=0.0).to(dt).to(tl.float32)
            sin = tl.load(CS + pos * stride_cs + HALF + offs_d, mask=d_ok, other=0.0).to(dt).to(tl.float32)
            offs_h = (hb - NUM_QB) * BLOCK_H + tl.arange(0, BLOCK_H)
            mask = (offs_h < HKV)[:, None] & d_ok[None, :]
            k1, k2 = _norm_rope_tile(row + H * HEAD_DIM, KW, QO, eps, cos, sin, offs_h, offs_d, mask,
                                     HAS_NORM, HEAD_DIM, HALF)
            dst = ((slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cslot
                   + offs_h[:, None] * stride_ch + offs_d[None, :])
            sdst = (slot // BLOCK_SIZE) * stride_sb + (slot % BLOCK_SIZE) * stride_ss + offs_h
            h_ok = offs_h < HKV
            _store_halves(KC, KSC, dst, sdst, k1, k2, mask, h_ok, HALF, FP8)
            vsrc = row + (H + HKV) * HEAD_DIM + offs_h[:, None] * HEAD_DIM + offs_d[None, :]
            v1 = tl.load(vsrc, mask=mask, other=0.0)
            v2 = tl.load(vsrc + HALF, mask=mask, other=0.0)
            _store_halves(VC, VSC, dst, sdst, v1, v2, mask, h_ok, HALF, FP8)


def launch_config(num_heads: int, num_kv_heads: int, head_dim: int) -> tuple[int, int, int]:
    """(BLOCK_H, q head-blocks, kv head-blocks): a block is at most 1024 elements per rotate-half."""
    half_pad = next_pow2(head_dim // 2)
    block_h = max(1, min(next_pow2(max(num_heads, num_kv_heads)), 1024 // half_pad))
    return block_h, triton.cdiv(num_heads, block_h), triton.cdiv(num_kv_heads, block_h)


def qkv_norm_rope_store(qkv: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                        q_norm_weight: torch.Tensor | None, k_norm_weight: torch.Tensor | None, eps: float,
                        k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                        num_heads: int, num_kv_heads: int, head_dim: int,
                        q_out: torch.Tensor | None = None, k_scales: torch.Tensor | None = None,
                        v_scales: torch.Tensor | None = None) -> torch.Tensor:
    """Split the fused QKV projection output, [per-head RMSNorm q and k], RoPE q and k, store k and v in the
    paged cache and return q.

    Args:
        qkv: (T, (H + 2 * Hkv) * D), last dim contiguous (the row stride may exceed the width); q, k, v are
            its column ranges [0, H*D), [H*D, (H+Hkv)*D), [(H+Hkv)*D, (H+2*Hkv)*D).
        positions: (T,) int token positions (not bounds-checked: that would need a device sync).
        cos_sin_cache: (max_pos, D) = [cos | sin] of the D/2 frequencies (float32).
        q_norm_weight, k_norm_weight: (D,) per-head RMSNorm weights (Qwen3), or both None (no norm).
        eps: RMSNorm epsilon (unused without norm weights).
        k_cache, v_cache: (num_blocks, block_size, Hkv, D), same shape and strides, last dim contiguous.
        slot_mapping: (T,) int flat cache slot per token; -1 = do not store (q is still written).
        num_heads, num_kv_heads, head_dim: H, Hkv, D (D even).
        q_out: optional (T, H, D) output with a contiguous last dim; its dtype must be the result dtype
            (qkv's dtype, promoted with the norm weights' dtype when they are given).
        k_scales, v_scales: with an e4m3 cache, its (num_blocks, block_size, Hkv) float32 scales (else None).
    Returns:
        q_out (T, H, D), normed and rotated.
    """
    fn = "qkv_norm_rope_store"
    H, Hkv, D = int(num_heads), int(num_kv_heads), int(head_dim)
    if H < 1 or Hkv < 1 or D < 2 or D % 2:
        raise ValueError(f"{fn}: need num_heads >= 1, num_kv_heads >= 1 and an even head_dim >= 2, got "
                         f"{H}, {Hkv}, {D}")
    check_float(f"{fn}: qkv", qkv)
    width = (H + 2 * Hkv) * D
    if qkv.dim() != 2 or qkv.shape[1] != width:
        raise ValueError(f"{fn}: qkv must be (T, (num_heads + 2 * num_kv_heads) * head_dim = {width}), got "
                         f"{tuple(qkv.shape)}")
    if qkv.stride(1) != 1:
        raise ValueError(f"{fn}: qkv must have a contiguous last dim, got strides {tuple(qkv.stride())}")
    T = qkv.shape[0]
    check_int(f"{fn}: positions", positions)
    if positions.numel() != T or positions.dim() > 1:
        raise ValueError(f"{fn}: positions must be (T={T},), got {tuple(positions.shape)}")
    check_float(f"{fn}: cos_sin_cache", cos_sin_cache)
    if cos_sin_cache.dim() != 2 or cos_sin_cache.shape[1] != D:
        raise ValueError(f"{fn}: cos_sin_cache must be (max_pos, head_dim={D}), got {tuple(cos_sin_cache.shape)}")
    if (q_norm_weight is None) != (k_norm_weight is None):
        raise ValueError(f"{fn}: give both q_norm_weight and k_norm_weight, or neither")
    has_norm = q_norm_weight is not None
    out_dtype = qkv.dtype
    if has_norm:
        for name, w in (("q_norm_weight", q_norm_weight), ("k_norm_weight", k_norm_weight)):
            check_float(f"{fn}: {name}", w)
            if w.dim() != 1 or w.shape[0] != D:
                raise ValueError(f"{fn}: {name} must be (head_dim={D},), got {tuple(w.shape)}")
        if q_norm_weight.dtype != k_norm_weight.dtype:
            raise ValueError(f"{fn}: q_norm_weight and k_norm_weight dtypes differ ({q_norm_weight.dtype} vs "
                             f"{k_norm_weight.dtype})")
        out_dtype = torch.promote_types(q_norm_weight.dtype, qkv.dtype)
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(f"{fn}: k_cache/v_cache must both be (num_blocks, block_size, num_kv_heads, head_dim), "
                         f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if tuple(k_cache.shape[2:]) != (Hkv, D):
        raise ValueError(f"{fn}: cache (num_kv_heads, head_dim) {tuple(k_cache.shape[2:])} != {(Hkv, D)}")
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        check_cache(f"{fn}: {name}", c)
        if c.stride(3) != 1:
            raise ValueError(f"{fn}: {name} must have a contiguous last dim, got strides {tuple(c.stride())}")
    if k_cache.stride() != v_cache.stride():
        raise ValueError(f"{fn}: k_cache and v_cache must have the same strides, got {tuple(k_cache.stride())} "
                         f"and {tuple(v_cache.stride())}")
    check_int(f"{fn}: slot_mapping", slot_mapping)
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != T:
        raise ValueError(f"{fn}: slot_mapping must be (T={T},), got {tuple(slot_mapping.shape)}")
    if q_out is None:
        q_out = torch.empty((T, H, D), dtype=out_dtype, device=qkv.device)
    else:
        if tuple(q_out.shape) != (T, H, D) or q_out.dtype != out_dtype:
            raise ValueError(f"{fn}: q_out must be {(T, H, D)} {out_dtype}, got {tuple(q_out.shape)} {q_out.dtype}")
        if q_out.stride(2) != 1:
            raise ValueError(f"{fn}: q_out must have a contiguous last dim, got strides {tuple(q_out.stride())}")
    tensors = dict(qkv=qkv, positions=positions, cos_sin_cache=cos_sin_cache, k_cache=k_cache, v_cache=v_cache,
                   slot_mapping=slot_mapping, q_out=q_out)
    if has_norm:
        tensors.update(q_norm_weight=q_norm_weight, k_norm_weight=k_norm_weight)
    check_same_device(**tensors)
    fp8, stride_sb, stride_ss = check_kv_scales(fn, k_cache, v_cache, k_scales, v_scales)
    if T == 0:
        return q_out
    positions = positions.reshape(-1)
    if positions.stride(0) != 1:
        positions = positions.contiguous()
    if slot_mapping.stride(0) != 1:
        slot_mapping = slot_mapping.contiguous()
    if cos_sin_cache.stride(1) != 1:
        cos_sin_cache = cos_sin_cache.contiguous()
    if has_norm:
        q_norm_weight, k_norm_weight = q_norm_weight.contiguous(), k_norm_weight.contiguous()
    else:
        q_norm_weight = k_norm_weight = qkv  # unused placeholders
    block_h, n_qb, n_kb = launch_config(H, Hkv, D)
    _qkv_norm_rope_store_kernel[(T, n_qb + n_kb)](
        qkv, positions, cos_sin_cache, q_norm_weight, k_norm_weight, q_out, k_cache, v_cache,
        k_scales if fp8 else k_cache, v_scales if fp8 else v_cache, slot_mapping, float(eps),
        qkv.stride(0), cos_sin_cache.stride(0), q_out.stride(0), q_out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), stride_sb, stride_ss,
        H=H, HKV=Hkv, HEAD_DIM=D, HALF=D // 2, HALF_PAD=next_pow2(D // 2), BLOCK_H=block_h, NUM_QB=n_qb,
        BLOCK_SIZE=k_cache.shape[1], HAS_NORM=has_norm, FP8=fp8, num_warps=4,
    )
    return q_out
