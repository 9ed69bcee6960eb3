"""RMSNorm and fused residual-add + RMSNorm; the add can first sum a mixture of experts' uncombined rows (each
token's top-k weighted expert outputs: ``rows_per_token``), so the MoE layer needs no combine launch of its own.

Rounding follows the torch reference (``nanovllm.layers.layernorm``) op for op: the residual sum is rounded to
its dtype, the normalization runs in float32, the normalized value is rounded to the input dtype, then scaled by
the weight and rounded to the output dtype (``promote_types(weight, x)``); a token's expert rows are summed in
float32 in row order and rounded to x's dtype before the add, as ``combine_ref``. So half-precision results match
the reference to the last bit up to the float32 reduction order.

``rms_norm_fp8`` / ``add_rms_norm_fp8`` quantize the normalized rows for an FP8 linear layer (e4m3 and float32
scales per row, or per row and ``group`` columns: ``nanovllm.kernels.fp8_quant``'s scheme) instead of writing them
in the model dtype: bit for bit what ``per_token_quant_fp8`` / ``per_token_group_quant_fp8`` give on the unfused
output, without their launch and their re-read.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanovllm.kernels._common import check_float, check_last_contiguous, check_same_device, next_pow2
from nanovllm.kernels.fp8_quant import (
    check_group,
    fp8_inverse,
    fp8_quant_empty,
    fp8_quantize,
    fp8_quantize_groups,
    fp8_scale,
)

_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


@triton.jit
def _rms_norm_kernel(
    X, R, W, Y, S, YS, N, eps,
    stride_x, stride_r, stride_y, stride_s, stride_ys, stride_ysg,
    HAS_RES: tl.constexpr, GROUP: tl.constexpr, BLOCK: tl.constexpr, Y_DTYPE: tl.constexpr, FP8_OUT: tl.constexpr,
    QGROUP: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    if GROUP == 1:
        x = tl.load(X + row * stride_x + offs, mask=mask, other=0.0)
    else:  # rows row * GROUP ... row * GROUP + GROUP - 1 of X summed in order
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for j in tl.static_range(GROUP):
            acc += tl.load(X + (row * GROUP + j) * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
        x = acc.to(X.dtype.element_ty)
    if HAS_RES:
        r = tl.load(R + row * stride_r + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(S.dtype.element_ty)
        tl.store(S + row * stride_s + offs, x, mask=mask)
    h = _rms_row(x, N, eps)
    w = tl.load(W + offs, mask=mask, other=0.0).to(tl.float32)
    y = (w * h).to(Y_DTYPE)
    if FP8_OUT and QGROUP == 0:  # Y e4m3, YS one scale per row, of the rounded values (masked lanes are 0)
        yf = y.to(tl.float32)
        ys = fp8_scale(tl.max(tl.abs(yf), axis=0))
        tl.store(Y + row * stride_y + offs, fp8_quantize(yf, fp8_inverse(ys)), mask=mask)
        tl.store(YS + row * stride_ys, ys)
    elif FP8_OUT:  # one scale per QGROUP columns (N is a multiple of QGROUP; the groups past N are all masked)
        q, ys = fp8_quantize_groups(y.to(tl.float32), BLOCK, QGROUP)
        tl.store(Y + row * stride_y + offs, q, mask=mask)
        gs = tl.arange(0, BLOCK // QGROUP)
        tl.store(YS + row * stride_ys + gs * stride_ysg, ys, mask=gs < N // QGROUP)
    else:
        tl.store(Y + row * stride_y + offs, y, mask=mask)


@triton.jit
def _rms_row(x, N, eps):
    """One row x (masked lanes zero) normalized in float32 and rounded to x's dtype, as the reference does
    before scaling; returned as float32."""
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / N
    return (xf * tl.rsqrt(var + eps)).to(x.dtype).to(tl.float32)


def _as_rows(name: str, t: torch.Tensor, N: int, output: bool = False) -> torch.Tensor:
    """t (..., N) as (rows, N) with a contiguous last dim. Inputs may be copied when no such view exists;
    outputs must be viewable (the kernel writes through the view)."""
    check_last_contiguous(name, t)
    if t.dim() == 2:
        return t
    if not output:
        return t.reshape(-1, N)
    try:
        return t.view(-1, N)
    except RuntimeError:
        raise ValueError(f"{name}: cannot be viewed as (rows, {N}) (strides {tuple(t.stride())})") from None


def _num_warps(block: int) -> int:
    return 4 if block <= 2048 else (8 if block <= 8192 else 16)


def _fp8_num_warps(block: int) -> int:
    """The quantizing norm's warps: one per 256 columns, 4 to 16 (its e4m3 rounding and IEEE divisions are
    compute; at 4,096 columns 16 warps take 4.0 us for 256 rows on an H200 against 5.2 with 4: RESULTS.md)."""
    return min(16, max(4, block // 256))


def _launch(x, residual, weight, eps, out, residual_out, rows_per_token=1, fp8_out=False, group=None):
    check_float("rms_norm: x", x)
    check_float("rms_norm: weight", weight)
    N = x.shape[-1]
    if isinstance(rows_per_token, bool) or not isinstance(rows_per_token, int) or rows_per_token < 1:
        raise ValueError(f"add_rms_norm: rows_per_token must be an int >= 1, got {rows_per_token!r}")
    if rows_per_token > 1 and (x.dim() != 2 or residual is None or x.shape[0] != rows_per_token * residual.shape[0]):
        raise ValueError(f"add_rms_norm: with rows_per_token={rows_per_token}, x must be (T * {rows_per_token}, "
                         f"{N}) for a residual (T, {N}), got {tuple(x.shape)} and "
                         f"{None if residual is None else tuple(residual.shape)}")
    if weight.dim() != 1 or weight.shape[0] != N:
        raise ValueError(f"rms_norm: weight must be ({N},), got {tuple(weight.shape)}")
    if N > 65536:
        raise ValueError(f"rms_norm: hidden size {N} > 65536 is not supported by the single-pass kernel")
    check_same_device(x=x, weight=weight)
    weight = weight.contiguous()
    x2 = _as_rows("rms_norm: x", x, N)  # what the kernel reads: rows_per_token rows per token
    x = x2[::rows_per_token] if rows_per_token > 1 else x  # one row per token: the outputs' shape
    M = x2.shape[0] // rows_per_token
    if residual is not None:
        if residual.shape != x.shape:
            raise ValueError(f"add_rms_norm: residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}")
        check_float("add_rms_norm: residual", residual)
        check_same_device(x=x, residual=residual)
        r2 = _as_rows("add_rms_norm: residual", residual, N)
        sum_dtype = torch.promote_types(x.dtype, residual.dtype)
        if residual_out is None:
            residual_out = torch.empty(x.shape, dtype=sum_dtype, device=x.device)
        elif residual_out.shape != x.shape or residual_out.dtype != sum_dtype:
            raise ValueError(f"add_rms_norm: residual_out must be {tuple(x.shape)} {sum_dtype}")
        s2 = _as_rows("add_rms_norm: residual_out", residual_out, N, output=True)
    else:
        r2 = s2 = x2
        sum_dtype = x.dtype
    y_dtype = torch.promote_types(weight.dtype, sum_dtype)
    if fp8_out:  # (M, N) e4m3 rows and their (M, 1) or (M, N // group) scales
        if group is not None:
            check_group("rms_norm_fp8", group, N)
        out = y2, ys = fp8_quant_empty(M, N, group, x.device)
    else:
        if out is None:
            out = torch.empty(x.shape, dtype=y_dtype, device=x.device)
        elif out.shape != x.shape or out.dtype != y_dtype:
            raise ValueError(f"rms_norm: out must be {tuple(x.shape)} {y_dtype}, got {tuple(out.shape)} {out.dtype}")
        y2 = ys = _as_rows("rms_norm: out", out, N, output=True)
    if M == 0:
        return out, residual_out
    BLOCK = next_pow2(N)
    _rms_norm_kernel[(M,)](
        x2, r2, weight, y2, s2, ys, N, float(eps),
        x2.stride(0), r2.stride(0), y2.stride(0), s2.stride(0), ys.stride(0), ys.stride(-1),
        HAS_RES=residual is not None, GROUP=rows_per_token, BLOCK=BLOCK, Y_DTYPE=_TL_DTYPES[y_dtype],
        FP8_OUT=fp8_out, QGROUP=group or 0, num_warps=_fp8_num_warps(BLOCK) if fp8_out else _num_warps(BLOCK),
    )
    return out, residual_out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm over the last dim of x (..., N) with weight (N,); same result as ``rms_norm_ref``."""
    return _launch(x, None, weight, eps, out, None)[0]


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                 out: torch.Tensor | None = None, residual_out: torch.Tensor | None = None, *,
                 rows_per_token: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused ``s = x + residual; return rms_norm(s), s`` (one read of x and residual, one write of each output).

    ``out`` / ``residual_out`` may be preallocated (``residual_out`` may alias ``residual`` or ``x`` for an
    in-place update: each element is read before it is written by the same program). ``rows_per_token`` k > 1:
    x is (T * k, N) with contiguous rows, each token's k rows summed first (``add_rms_norm_ref``).
    """
    return _launch(x, residual, weight, eps, out, residual_out, rows_per_token)


def rms_norm_fp8(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 group: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``rms_norm`` quantized per row for an FP8 GEMM: x (M, N) -> (q (M, N) e4m3, s (M, 1) float32), bit for bit
    ``per_token_quant_fp8(rms_norm(x, weight, eps))``; with a group, s (M, N // group), bit for bit
    ``per_token_group_quant_fp8(rms_norm(x, weight, eps), group)``."""
    _check_rows_2d("rms_norm_fp8", x)
    return _launch(x, None, weight, eps, None, None, fp8_out=True, group=group)[0]


def add_rms_norm_fp8(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                     residual_out: torch.Tensor | None = None, *, rows_per_token: int = 1,
                     group: int | None = None) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    """``add_rms_norm`` with its normalized rows quantized for an FP8 GEMM as ``rms_norm_fp8`` quantizes them:
    ((q (T, N) e4m3, s (T, 1) or (T, N // group) float32), x + residual)."""
    _check_rows_2d("add_rms_norm_fp8", x)
    return _launch(x, residual, weight, eps, None, residual_out, rows_per_token, fp8_out=True, group=group)


def _check_rows_2d(fn: str, x: torch.Tensor) -> None:
    if x.dim() != 2:
        raise ValueError(f"{fn}: x must be 2-D (tokens, hidden), got shape {tuple(x.shape)}")
