"""Rotary position embedding (NeoX "rotate half" layout) applied to q and k in one launch.

Rounding follows ``apply_rotary_ref``: cos/sin are rounded to q's dtype and every product / sum is rounded to
that dtype, as HF computes it in the model dtype (exact match for float32 and near bit-exact for half types).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanovllm.kernels._common import check_float, check_int, check_same_device, next_pow2


@triton.jit
def _rotate_heads(X, XO, n_heads, stride_h, stride_oh, cos, sin, offs_d, d_ok,
                  HALF: tl.constexpr, BLOCK_H: tl.constexpr):
    dt = XO.dtype.element_ty
    for h0 in range(0, n_heads, BLOCK_H):
        offs_h = h0 + tl.arange(0, BLOCK_H)
        mask = (offs_h < n_heads)[:, None] & d_ok[None, :]
        src = X + offs_h[:, None] * stride_h + offs_d[None, :]
        x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
        a = (x1 * cos).to(dt).to(tl.float32)
        b = (x2 * sin).to(dt).to(tl.float32)
        c = (x2 * cos).to(dt).to(tl.float32)
        e = (x1 * sin).to(dt).to(tl.float32)
        dst = XO + offs_h[:, None] * stride_oh + offs_d[None, :]
        tl.store(dst, (a - b).to(dt), mask=mask)
        tl.store(dst + HALF, (c + e).to(dt), mask=mask)


@triton.jit
def _rotary_kernel(
    Q, K, QO, KO, POS, CS, num_q_heads, num_k_heads,
    stride_qt, stride_qh, stride_kt, stride_kh,
    stride_qot, stride_qoh, stride_kot, stride_koh, stride_cs,
    HALF: tl.constexpr, HALF_PAD: tl.constexpr, BLOCK_H: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(POS + t).to(tl.int64)
    offs_d = tl.arange(0, HALF_PAD)
    d_ok = offs_d < HALF
    dt = QO.dtype.element_ty
    cos = tl.load(CS + pos * stride_cs + offs_d, mask=d_ok, other=0.0).to(dt).to(tl.float32)
    sin = tl.load(CS + pos * stride_cs + HALF + offs_d, mask=d_ok, other=0.0).to(dt).to(tl.float32)
    _rotate_heads(Q + t * stride_qt, QO + t * stride_qot, num_q_heads, stride_qh, stride_qoh,
                  cos, sin, offs_d, d_ok, HALF, BLOCK_H)
    _rotate_heads(K + t * stride_kt, KO + t * stride_kot, num_k_heads, stride_kh, stride_koh,
                  cos, sin, offs_d, d_ok, HALF, BLOCK_H)


def _as_heads(name: str, x: torch.Tensor, T: int, D: int) -> torch.Tensor:
    if x.dim() == 2:
        if x.shape[1] % D:
            raise ValueError(f"apply_rotary: {name} last dim {x.shape[1]} is not a multiple of head_dim {D}")
        x = x.unflatten(1, (x.shape[1] // D, D))  # a view (last dim contiguous is checked below)
    if x.dim() != 3 or x.shape[0] != T or x.shape[2] != D:
        raise ValueError(f"apply_rotary: {name} must be (T={T}, heads, head_dim={D}) or (T, heads * head_dim), "
                         f"got {tuple(x.shape)}")
    if x.stride(2) != 1:
        raise ValueError(f"apply_rotary: {name} must have a contiguous head_dim, got strides {tuple(x.stride())}")
    return x


def apply_rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                 inplace: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q (T, H, D) and k (T, Hkv, D) (or their (T, heads * D) flattenings) at ``positions`` (T,).

    ``cos_sin_cache`` is (max_pos, D) float32 = [cos | sin] of the D/2 frequencies. q and k may be strided
    views (e.g. slices of a fused qkv output) with a contiguous head_dim. With ``inplace=True`` (default) the
    rotation is written back into q and k, which are returned; otherwise new contiguous tensors are returned.
    Positions are not bounds-checked (that would need a device sync).
    """
    check_float("apply_rotary: q", q)
    check_float("apply_rotary: k", k)
    check_int("apply_rotary: positions", positions)
    if cos_sin_cache.dim() != 2 or cos_sin_cache.shape[1] % 2:
        raise ValueError(f"apply_rotary: cos_sin_cache must be (max_pos, head_dim), got {tuple(cos_sin_cache.shape)}")
    if q.dtype != k.dtype:
        raise ValueError(f"apply_rotary: q and k dtypes differ ({q.dtype} vs {k.dtype})")
    D = cos_sin_cache.shape[1]
    T = q.shape[0]
    qv, kv = _as_heads("q", q, T, D), _as_heads("k", k, T, D)
    if positions.numel() != T:
        raise ValueError(f"apply_rotary: positions must have T={T} elements, got {tuple(positions.shape)}")
    positions = positions.reshape(-1)
    if positions.stride(0) != 1:
        positions = positions.contiguous()
    if cos_sin_cache.stride(1) != 1:
        cos_sin_cache = cos_sin_cache.contiguous()
    check_same_device(q=q, k=k, positions=positions, cos_sin_cache=cos_sin_cache)
    if inplace:
        q_out, k_out, qo, ko = q, k, qv, kv
    else:
        q_out, k_out = torch.empty(q.shape, dtype=q.dtype, device=q.device), torch.empty(k.shape, dtype=k.dtype,
                                                                                           device=k.device)
        qo, ko = _as_heads("q", q_out, T, D), _as_heads("k", k_out, T, D)
    if T == 0:
        return q_out, k_out
    H, Hkv = qv.shape[1], kv.shape[1]
    HALF = D // 2
    HALF_PAD = next_pow2(HALF)
    BLOCK_H = max(1, min(next_pow2(max(H, Hkv)), 2048 // HALF_PAD))
    _rotary_kernel[(T,)](
        qv, kv, qo, ko, positions, cos_sin_cache, H, Hkv,
        qv.stride(0), qv.stride(1), kv.stride(0), kv.stride(1),
        qo.stride(0), qo.stride(1), ko.stride(0), ko.stride(1), cos_sin_cache.stride(0),
        HALF=HALF, HALF_PAD=HALF_PAD, BLOCK_H=BLOCK_H, num_warps=4,
    )
    return q_out, k_out
