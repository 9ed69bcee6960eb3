"""Scaled FP8 GEMM in Triton: ``y = dequant(xq) @ dequant(wq).T (+ bias)`` with e4m3 operands and float32 scales.

Two scalings, one kernel:
* block-wise (the Hub's block-FP8 checkpoints): activation scales per token and per ``bk`` columns (M, K / bk),
  weight scales per ``bn x bk`` tile (N / bn, K / bk); each K tile of ``bk`` (= BLOCK_K) is multiplied in fp8
  with float32 accumulation and added with its two scales;
* row-wise (online FP8 where ``torch._scaled_mm`` can't take the shape): per-token (M, 1) and per-output-channel
  (N,) scales, applied once after the K loop.

References: ``nanovllm.layers.quantization.fp8_ref.fp8_linear_block_ref`` / ``fp8_linear_rowwise_ref``. Tile
sizes depend on shapes only (CUDA-graph safe, one compiled variant per row-count bucket).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from nanovllm.kernels._common import check_same_device, check_scale_block, check_tiling, sm_count


@dataclass(frozen=True)
class Fp8GemmConfig:
    """A tiling of the FP8 GEMM: rows x outputs x reduction per program (powers of two >= 16), warps, stages.
    (Block-wise scaling fixes the reduction tile to the weight's block: ``block_k`` must equal it.)"""
    block_m: int
    block_n: int
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 4

    def __post_init__(self):
        check_tiling(self, ("block_m", "block_n", "block_k"))

    def __str__(self) -> str:
        return f"{self.block_m}x{self.block_n}x{self.block_k}w{self.num_warps}s{self.num_stages}"


# M changes from step to step: specializing on it (1, multiples of 16) would compile variants mid-run
@triton.jit(do_not_specialize=["M"])
def _fp8_gemm_kernel(
    A, B, AS, BS, C, BIAS, M, N, K,
    stride_am, stride_bn, stride_cm, stride_asm, stride_asg, stride_bsn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SCALE_N: tl.constexpr,
    GROUP_M: tl.constexpr, BLOCKWISE: tl.constexpr, HAS_BIAS: tl.constexpr,
):
    # tiles in groups of GROUP_M rows of tiles: consecutive programs share weight tiles in L2
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    group = pid // (GROUP_M * num_n)
    first_m = group * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * num_n)) % size_m
    pid_n = (pid % (GROUP_M * num_n)) // size_m

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    a_ptrs = A + offs_m[:, None].to(tl.int64) * stride_am + offs_k[None, :]
    b_ptrs = B + offs_n[None, :].to(tl.int64) * stride_bn + offs_k[:, None]     # (BLOCK_K, BLOCK_N) of B.T
    as_ptrs = AS + offs_m * stride_asm
    bs_ptrs = BS + (offs_n // SCALE_N) * stride_bsn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        k_ok = offs_k < K - kb * BLOCK_K
        a = tl.load(a_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if BLOCKWISE:
            a_s = tl.load(as_ptrs + kb * stride_asg, mask=m_ok, other=0.0)
            b_s = tl.load(bs_ptrs + kb, mask=n_ok, other=0.0)
            acc += tl.dot(a, b) * a_s[:, None] * b_s[None, :]
        else:
            acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if not BLOCKWISE:
        a_s = tl.load(as_ptrs, mask=m_ok, other=0.0)
        b_s = tl.load(bs_ptrs, mask=n_ok, other=0.0)
        acc = acc * a_s[:, None] * b_s[None, :]
    if HAS_BIAS:
        acc += tl.load(BIAS + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    c = C + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :]
    tl.store(c, acc.to(C.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def default_config(M: int, N: int, block_k: int, device: torch.device) -> Fp8GemmConfig:
    """The tiling by row-count bucket: skinny tiles for decode rows (the weight read is the cost: enough programs
    to cover the SMs), square ones for prefill."""
    if M <= 64:
        block_m = 16 if M <= 16 else (32 if M <= 32 else 64)
        block_n = 64 if triton.cdiv(N, 64) * triton.cdiv(M, block_m) >= sm_count(device) else 32
        return Fp8GemmConfig(block_m, block_n, block_k, 4, 4)
    return Fp8GemmConfig(128, 128, block_k, 8, 3)


def w8a8_gemm(xq: torch.Tensor, xs: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor, out_dtype: torch.dtype, *,
             block: tuple[int, int] | None = None, bias: torch.Tensor | None = None,
             out: torch.Tensor | None = None, config: Fp8GemmConfig | None = None) -> torch.Tensor:
    """``(xq * xs) @ (wq * ws).T (+ bias)`` -> (M, N) in out_dtype (or into ``out``).

    Args:
        xq: (M, K) e4m3 activations, contiguous last dim. wq: (N, K) e4m3 weights, contiguous last dim.
        block: None for row-wise scales: xs (M, 1), ws (N,); or the weight's (bn, bk) tile (powers of two >= 16)
            for block-wise scales: xs (M, ceil(K / bk)), any strides (the group quantizers write them column-major),
            and ws (ceil(N / bn), ceil(K / bk)).
        bias: optional (N,). out: optional (M, N) output, contiguous last dim.
        config: the tiling (default: ``default_config`` of the shape); block-wise, its block_k must be bk.
    """
    fn = "w8a8_gemm"
    for name, t in (("xq", xq), ("wq", wq)):
        if t.dtype != torch.float8_e4m3fn or t.dim() != 2 or (t.shape[1] > 1 and t.stride(1) != 1):
            raise ValueError(f"{fn}: {name} must be a 2-D float8_e4m3fn tensor with a contiguous last dim, got "
                             f"{t.dtype} {tuple(t.shape)} strides {tuple(t.stride())}")
    M, K = xq.shape
    N = wq.shape[0]
    if wq.shape[1] != K:
        raise ValueError(f"{fn}: xq {tuple(xq.shape)} and wq {tuple(wq.shape)} disagree on K")
    if block is None:
        want_xs, want_ws, block_k, scale_n = (M, 1), (N,), 128, 1
    else:
        check_scale_block(fn, block)
        bn, bk = block
        want_xs, want_ws, block_k, scale_n = (M, -(-K // bk)), (-(-N // bn), -(-K // bk)), bk, bn
    for name, t, want in (("xs", xs, want_xs), ("ws", ws, want_ws)):
        if t.dtype != torch.float32 or tuple(t.shape) != want or (name == "ws" and t.stride(-1) != 1):
            raise ValueError(f"{fn}: {name} must be float32 {want}" + (" with a contiguous last dim" if name == "ws"
                             else "") + f", got {t.dtype} {tuple(t.shape)}")
    if bias is not None and (bias.shape != (N,) or not bias.is_contiguous()):
        raise ValueError(f"{fn}: bias must be contiguous ({N},), got {tuple(bias.shape)}")
    if out is None:
        out = torch.empty((M, N), dtype=out_dtype, device=xq.device)
    elif tuple(out.shape) != (M, N) or out.dtype != out_dtype or (N > 1 and out.stride(1) != 1):
        raise ValueError(f"{fn}: out must be ({M}, {N}) {out_dtype} with a contiguous last dim, got "
                         f"{tuple(out.shape)} {out.dtype}")
    check_same_device(xq=xq, xs=xs, wq=wq, ws=ws, out=out)
    if M == 0 or N == 0:
        return out
    if config is None:
        config = default_config(M, N, block_k, xq.device)
    elif block is not None and config.block_k != block_k:
        raise ValueError(f"{fn}: block-wise scaling needs config.block_k == {block_k}, got {config}")
    block_m, block_n, block_k = config.block_m, config.block_n, config.block_k
    grid = (triton.cdiv(M, block_m) * triton.cdiv(N, block_n),)
    _fp8_gemm_kernel[grid](
        xq, wq, xs, ws, out, bias if bias is not None else ws, M, N, K,
        xq.stride(0), wq.stride(0), out.stride(0), xs.stride(0), xs.stride(1), ws.stride(0) if block is not None else 1,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SCALE_N=scale_n, GROUP_M=8,
        BLOCKWISE=block is not None, HAS_BIAS=bias is not None, num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return out
