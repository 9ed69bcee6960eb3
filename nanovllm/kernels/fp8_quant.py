"""FP8 (e4m3) quantization in Triton: the jit helpers every FP8 writer uses (the KV-store kernels, the activation
quantizers) and the dynamic activation quantizers of the FP8 linear layers.

The scheme is ``nanovllm.layers.quantization.fp8_ref``'s (scale = max(amax / 448, 2^-40) per group, value =
e4m3(clamp(x * (1 / scale))), nearest-even), bit for bit: the two divisions per group are IEEE (``div_rn``),
each value is one float32 multiplication by the group's reciprocal (``fp8_inverse``; a division per value made
the e4m3 KV store 2-3x slower than the bf16 one), and the rounding to e4m3 is done in float32 arithmetic
(``e4m3_round``) before the cast, so the cast itself is exact. (The Triton
interpreter's float32 -> e4m3 cast mis-rounds: no carry into the exponent, no ties-to-even, no saturation; the
GPU's is right but then the interpreter would test another path. A few integer operations per element in
memory-bound kernels.)

* ``per_token_quant_fp8(x)``             -> (q (M, K) e4m3, s (M, 1) float32)   (reference ``quantize_rows``)
* ``per_token_group_quant_fp8(x, group)`` -> (q (M, K) e4m3, s (M, K // group))  (reference ``quantize_groups``)

The per-token-and-group quantizers (this one, the quantizing norms and SiLU-and-mul) write into
``fp8_quant_empty``'s buffers: the layout cuBLASLt's block-wise scaled GEMM takes (``padded_group_rows``).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanovllm.kernels._common import check_float, next_pow2

FP8_MAX = 448.0
FP8_MIN_SCALE = 2.0 ** -40


@triton.jit
def e4m3_round(x):
    """float32 x -> the nearest e4m3 value (ties to even), saturated to +-448, still as float32."""
    bits = x.to(tl.int32, bitcast=True)
    sign = bits & -2147483648
    a = tl.minimum(tl.abs(x), 448.0)
    # normal range (>= 2^-6): keep 3 of float32's 23 mantissa bits, rounding half to even (a carry moves into the
    # exponent, as it should)
    ab = a.to(tl.int32, bitcast=True)
    ab = (ab + 0x7FFFF + ((ab >> 20) & 1)) & -0x100000
    normal = ab.to(tl.float32, bitcast=True)
    # subnormal range (< 2^-6): multiples of 2^-9; adding 1.5 * 2^14 (whose ulp is 2^-9) rounds to them
    sub = (a + 24576.0) - 24576.0
    r = tl.where(a < 0.015625, sub, normal)
    return (r.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def fp8_scale(amax):
    """The float32 scale of groups whose largest magnitude is amax."""
    return tl.maximum(tl.math.div_rn(amax, 448.0), 9.094947017729282e-13)  # 2^-40


@triton.jit
def fp8_inverse(scale):
    """1 / scale (IEEE), what ``fp8_quantize`` multiplies by: computed once per group, before broadcasting."""
    return tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale)


@triton.jit
def fp8_quantize(x, inv_scale):
    """e4m3 of x * inv_scale (float32 operands, broadcast; inv_scale from ``fp8_inverse``)."""
    return e4m3_round(x * inv_scale).to(tl.float8e4nv)


@triton.jit
def fp8_quantize_groups(y, BLOCK: tl.constexpr, GROUP: tl.constexpr):
    """A (BLOCK,) float32 tile of a row quantized per GROUP consecutive values (BLOCK a multiple of GROUP):
    (e4m3 (BLOCK,), float32 scales (BLOCK // GROUP,)). Masked lanes should be 0."""
    yg = tl.reshape(y, (BLOCK // GROUP, GROUP))
    s = fp8_scale(tl.max(tl.abs(yg), axis=1))
    return tl.reshape(fp8_quantize(yg, fp8_inverse(s)[:, None]), (BLOCK,)), s


def check_group(fn: str, group, K: int) -> None:
    """A per-token-and-group quantization's group size: a power of two >= 16 dividing K (ValueError naming it)."""
    if isinstance(group, bool) or not isinstance(group, int) or group < 16 or group & (group - 1) or K % group:
        raise ValueError(f"{fn}: the group size must be a power of two >= 16 dividing K={K}, got {group!r}")


@triton.jit
def _per_token_quant_kernel(X, Q, S, K, stride_x, stride_q, BLOCK_K: tl.constexpr, ONE_PASS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_K)
    x_row = X + row * stride_x
    q_row = Q + row * stride_q
    if ONE_PASS:  # the whole row in one tile
        ok = offs < K
        x = tl.load(x_row + offs, mask=ok, other=0.0).to(tl.float32)
        s = fp8_scale(tl.max(tl.abs(x), axis=0))
        tl.store(q_row + offs, fp8_quantize(x, fp8_inverse(s)), mask=ok)
    else:
        amax = tl.zeros([BLOCK_K], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ok = k0 + offs < K
            amax = tl.maximum(amax, tl.abs(tl.load(x_row + k0 + offs, mask=ok, other=0.0).to(tl.float32)))
        s = fp8_scale(tl.max(amax, axis=0))
        inv = fp8_inverse(s)
        for k0 in range(0, K, BLOCK_K):
            ok = k0 + offs < K
            x = tl.load(x_row + k0 + offs, mask=ok, other=0.0).to(tl.float32)
            tl.store(q_row + k0 + offs, fp8_quantize(x, inv), mask=ok)
    tl.store(S + row, s)


def fp8_quant_empty(M: int, K: int, group: int | None, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The outputs of an FP8 quantization of (M, K) rows. Per token (group None): q (M, K) e4m3 and s (M, 1)
    float32. Per token and `group` columns, laid out as ``torch._scaled_mm`` takes 1 x group activation scales
    (cuBLASLt's block-wise scaling on Hopper): q (M, K) e4m3, the first M rows of a buffer of M rounded up to a
    multiple of 4 rows; s (M, K // group) float32 over the same padded rows, column by column (strides (1,
    M_pad)). The rows past M are never written."""
    if group is None:
        return (torch.empty((M, K), dtype=torch.float8_e4m3fn, device=device),
                torch.empty((M, 1), dtype=torch.float32, device=device))
    m_pad = -(-M // 4) * 4
    q = torch.empty((m_pad, K), dtype=torch.float8_e4m3fn, device=device)[:M]
    s = torch.empty((K // group, m_pad), dtype=torch.float32, device=device).t()[:M]
    return q, s


def padded_group_rows(q: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``fp8_quant_empty``'s (q, s) as the whole padded buffers (M_pad, K) and (M_pad, K // group) they are
    views of, or None when they are not laid out so (rows quantized elsewhere)."""
    (M, K), G = q.shape, s.shape[1]
    m_pad = -(-M // 4) * 4
    if (q.dtype != torch.float8_e4m3fn or s.dtype != torch.float32 or s.shape[0] != M or q.stride() != (K, 1)
            or s.stride() != (1, m_pad) or q.storage_offset() or s.storage_offset()
            or q.untyped_storage().nbytes() < m_pad * K or s.untyped_storage().nbytes() < 4 * m_pad * G):
        return None
    return q.as_strided((m_pad, K), (K, 1)), s.as_strided((m_pad, G), (1, m_pad))


@triton.jit
def _group_quant_kernel(X, Q, S, num_groups, stride_x, stride_q, stride_sm, stride_sg,
                        GROUP: tl.constexpr, GROUPS_PER_PROG: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    gs = tl.program_id(1) * GROUPS_PER_PROG + tl.arange(0, GROUPS_PER_PROG)
    g_ok = gs < num_groups
    offs = gs[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    x = tl.load(X + row * stride_x + offs, mask=g_ok[:, None], other=0.0).to(tl.float32)
    s = fp8_scale(tl.max(tl.abs(x), axis=1))                                 # (GROUPS_PER_PROG,)
    tl.store(Q + row * stride_q + offs, fp8_quantize(x, fp8_inverse(s)[:, None]), mask=g_ok[:, None])
    tl.store(S + row * stride_sm + gs * stride_sg, s, mask=g_ok)


def _check_2d(fn: str, x: torch.Tensor) -> None:
    check_float(f"{fn}: x", x)
    if x.dim() != 2 or (x.shape[1] > 1 and x.stride(1) != 1):
        raise ValueError(f"{fn}: x must be 2-D with a contiguous last dim, got shape {tuple(x.shape)} strides "
                         f"{tuple(x.stride())}")


def per_token_quant_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token quantization of activations x (M, K): (q (M, K) e4m3, contiguous; s (M, 1) float32).
    Launch sizes come from shapes only (CUDA-graph safe)."""
    _check_2d("per_token_quant_fp8", x)
    M, K = x.shape
    q, s = fp8_quant_empty(M, K, None, x.device)
    if M == 0 or K == 0:
        return q, s
    block = min(next_pow2(K), 4096)
    _per_token_quant_kernel[(M,)](x, q, s, K, x.stride(0), q.stride(0), BLOCK_K=block, ONE_PASS=block >= K,
                                  num_warps=4 if block <= 2048 else 8)
    return q, s


def per_token_group_quant_fp8(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic quantization per token and per ``group`` consecutive columns (the activations of a block-FP8
    GEMM): x (M, K), K a multiple of group (a power of two >= 16) -> (q (M, K) e4m3, s (M, K // group) float32),
    laid out by ``fp8_quant_empty``."""
    fn = "per_token_group_quant_fp8"
    _check_2d(fn, x)
    M, K = x.shape
    check_group(fn, group, K)
    num_groups = K // group
    q, s = fp8_quant_empty(M, K, group, x.device)
    if M == 0 or K == 0:
        return q, s
    per_prog = max(1, min(next_pow2(num_groups), 4096 // group))
    grid = (M, triton.cdiv(num_groups, per_prog))
    _group_quant_kernel[grid](x, q, s, num_groups, x.stride(0), q.stride(0), s.stride(0), s.stride(1), GROUP=group,
                              GROUPS_PER_PROG=per_prog, num_warps=4)
    return q, s
