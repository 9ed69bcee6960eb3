"""SiLU-and-mul (SwiGLU gate) on the fused [gate | up] projection."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanovllm.kernels._common import check_float, check_last_contiguous, next_pow2


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


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., 2 * I) laid out [gate | up] -> (..., I) = silu(gate) * up; same result as ``silu_and_mul_ref``."""
    check_float("silu_and_mul: x", x)
    check_last_contiguous("silu_and_mul: x", x)
    if x.dim() == 0 or x.shape[-1] % 2:
        raise ValueError(f"silu_and_mul: last dim must be even ([gate | up]), got shape {tuple(x.shape)}")
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
