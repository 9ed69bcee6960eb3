"""SiLU-and-mul (SwiGLU gate) on the fused [gate | up] projection; ``silu_and_mul_fp8`` quantizes its rows per
token, or per token and ``group`` columns, for an FP8 down projection (``nanovllm.kernels.fp8_quant``'s scheme) in
the same launch."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanovllm.kernels._common import check_float, check_last_contiguous, next_pow2
from nanovllm.kernels.fp8_quant import (
    check_group,
    fp8_inverse,
    fp8_quant_empty,
    fp8_quantize,
    fp8_quantize_groups,
    fp8_scale,
)


@triton.jit
def _silu_and_mul_kernel(X, Y, inter, stride_x, stride_y, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter
    g = tl.load(X + row * stride_x + offs, mask=mask, other=0.0)
    u = tl.load(X + row * stride_x + inter + offs, mask=mask, other=0.0)
    gf = g.to(tl.float32)
    # like torch: silu in float32, rounded to the input dtype, then the product rounded again
    s = (gf / (1.0 + tl.exp(-gf))).to(g.dtype).to(tl.float32)
    tl.store(Y + row * stride_y + offs, (s * u.to(tl.float32)).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _silu_mul_tile(X, row, stride_x, inter, offs, mask):
    """silu(gate) * up of one tile of a row, rounded as ``_silu_and_mul_kernel`` rounds it, as float32."""
    g = tl.load(X + row * stride_x + offs, mask=mask, other=0.0)
    u = tl.load(X + row * stride_x + inter + offs, mask=mask, other=0.0)
    gf = g.to(tl.float32)
    s = (gf / (1.0 + tl.exp(-gf))).to(g.dtype).to(tl.float32)
    return (s * u.to(tl.float32)).to(g.dtype).to(tl.float32)


@triton.jit
def _silu_and_mul_fp8_kernel(X, Q, S, inter, stride_x, stride_q, BLOCK: tl.constexpr, ONE_PASS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    if ONE_PASS:  # the whole row in one tile
        mask = offs < inter
        y = _silu_mul_tile(X, row, stride_x, inter, offs, mask)
        s = fp8_scale(tl.max(tl.abs(y), axis=0))
        tl.store(Q + row * stride_q + offs, fp8_quantize(y, fp8_inverse(s)), mask=mask)
    else:  # the row's largest magnitude first, then the row again (recomputed: the same values)
        amax = tl.zeros([BLOCK], tl.float32)
        for i0 in range(0, inter, BLOCK):
            mask = i0 + offs < inter
            amax = tl.maximum(amax, tl.abs(_silu_mul_tile(X, row, stride_x, inter, i0 + offs, mask)))
        s = fp8_scale(tl.max(amax, axis=0))
        inv = fp8_inverse(s)
        for i0 in range(0, inter, BLOCK):
            mask = i0 + offs < inter
            y = _silu_mul_tile(X, row, stride_x, inter, i0 + offs, mask)
            tl.store(Q + row * stride_q + i0 + offs, fp8_quantize(y, inv), mask=mask)
    tl.store(S + row, s)


@triton.jit
def _silu_and_mul_fp8_group_kernel(X, Q, S, inter, stride_x, stride_q, stride_sm, stride_sg,
                                   BLOCK: tl.constexpr, QGROUP: tl.constexpr):
    """One BLOCK-wide tile of a row (whole groups: the scales need nothing outside it)."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter
    q, s = fp8_quantize_groups(_silu_mul_tile(X, row, stride_x, inter, offs, mask), BLOCK, QGROUP)
    tl.store(Q + row * stride_q + offs, q, mask=mask)
    gs = tl.program_id(1) * (BLOCK // QGROUP) + tl.arange(0, BLOCK // QGROUP)
    tl.store(S + row * stride_sm + gs * stride_sg, s, mask=gs < inter // QGROUP)


def _check_gate_up(fn: str, x: torch.Tensor) -> None:
    check_float(f"{fn}: x", x)
    check_last_contiguous(f"{fn}: x", x)
    if x.dim() == 0 or x.shape[-1] % 2:
        raise ValueError(f"{fn}: last dim must be even ([gate | up]), got shape {tuple(x.shape)}")


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., 2 * I) laid out [gate | up] -> (..., I) = silu(gate) * up; same result as ``silu_and_mul_ref``."""
    _check_gate_up("silu_and_mul", x)
    inter = x.shape[-1] // 2
    x2 = x if x.dim() == 2 else x.reshape(-1, 2 * inter)
    out_shape = (*x.shape[:-1], inter)
    if out is None:
        out = torch.empty(out_shape, dtype=x.dtype, device=x.device)
    elif tuple(out.shape) != out_shape or out.dtype != x.dtype:
        raise ValueError(f"silu_and_mul: out must be {out_shape} {x.dtype}, got {tuple(out.shape)} {out.dtype}")
    check_last_contiguous("silu_and_mul: out", out)
    if out.dim() == 2:
        y2 = out
    else:
        try:
            y2 = out.view(-1, inter)
        except RuntimeError:
            raise ValueError("silu_and_mul: out cannot be viewed as (rows, I)") from None
    M = x2.shape[0]
    if M == 0 or inter == 0:
        return out
    BLOCK = min(1024, next_pow2(inter))
    grid = (M, triton.cdiv(inter, BLOCK))
    _silu_and_mul_kernel[grid](x2, y2, inter, x2.stride(0), y2.stride(0), BLOCK=BLOCK, num_warps=4)
    return out


def silu_and_mul_fp8(x: torch.Tensor, group: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, 2 * I) [gate | up] -> (q (M, I) e4m3, s (M, 1) float32): silu(gate) * up quantized per row for an FP8
    GEMM, bit for bit ``per_token_quant_fp8(silu_and_mul(x))``; with a group, s (M, I // group), bit for bit
    ``per_token_group_quant_fp8(silu_and_mul(x), group)`` (laid out as it lays them out). Launch sizes come from
    shapes only."""
    _check_gate_up("silu_and_mul_fp8", x)
    if x.dim() != 2:
        raise ValueError(f"silu_and_mul_fp8: x must be 2-D (tokens, 2 * I), got shape {tuple(x.shape)}")
    M, inter = x.shape[0], x.shape[1] // 2
    if group is not None:
        check_group("silu_and_mul_fp8", group, inter)
    q, s = fp8_quant_empty(M, inter, group, x.device)
    if M == 0 or inter == 0:
        return q, s
    if group is not None:
        block = max(group, min(next_pow2(inter), 2048))
        _silu_and_mul_fp8_group_kernel[(M, triton.cdiv(inter, block))](
            x, q, s, inter, x.stride(0), q.stride(0), s.stride(0), s.stride(1), BLOCK=block, QGROUP=group,
            num_warps=min(16, max(4, block // 256)))
        return q, s
    # rows of up to 4,096 in one tile, longer ones in two passes of 4,096-wide tiles; one warp per 256 columns
    # (at I = 12,288 and 256 rows on an H200: 10.6 us, against 14.5 for one 16,384-wide tile and 12.1 for
    # silu_and_mul + per_token_quant_fp8: RESULTS.md)
    block = min(next_pow2(inter), 4096)
    warps = min(16, max(4, block // 256))
    _silu_and_mul_fp8_kernel[(M,)](x, q, s, inter, x.stride(0), q.stride(0), BLOCK=block, ONE_PASS=block >= inter,
                                   num_warps=warps)
    return q, s
