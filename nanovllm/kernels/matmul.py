"""Skinny GEMM for decode steps: ``y = x @ w.T`` with x (M, K) of few rows and w (N, K) a linear layer's weight.

At decode batch sizes (M <= 256) a linear layer is bound by reading its weight (M below ~200) or sits near the
compute/bandwidth ridge, where a library's tile choice for general shapes can leave SMs idle. This kernel
takes its tiling as an argument (``MatmulConfig``):

* ``swap=False``: tiles of (block_m rows x block_n outputs), ``acc = x_tile @ w_tile.T``;
* ``swap=True``: the weight is the MMA's "M" side, ``acc = w_tile @ x_tile.T`` (block_n outputs x block_m rows),
  so a few rows don't waste a 64-row MMA tile;
* ``splits > 1``: K is cut into ``splits`` slices run by separate programs (more programs to stream the weight
  with). Each writes its float32 partial tile to a workspace and bumps the tile's counter; the program that
  arrives last adds the partials **in slice order** (so the result does not depend on who was last), writes
  the output and resets the counter to 0 for the next launch. No second kernel and no atomics on data.

Measured on an H200 (a sweep in RESULTS run 16): the swapped tiles beat cuBLAS by up to
1.11x at <= 32 rows; the plain tiles reach 400-520 TFLOP/s at 96-256 rows where cuBLAS reaches 670. So the
engine offers only swapped configs, at <= 32 rows (``nanovllm.engine.gemm_plan``).

Accumulation is float32; the output is rounded once to x's dtype. Reference: ``x.float() @ w.float().T``
rounded to x's dtype (``linear_ref``); cuBLAS's bf16 GEMM also accumulates in float32, so the two agree to
rounding of the accumulation order.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from nanovllm.kernels._common import (
    check_float,
    check_int,
    check_same_device,
    check_tiling,
    dot_precision,
    upcast_dots,
)


@dataclass(frozen=True)
class MatmulConfig:
    """One tiling of the skinny GEMM. block_* are powers of two; block_k divides K / splits."""
    block_m: int
    block_n: int
    block_k: int
    splits: int = 1
    swap: bool = False
    num_warps: int = 4
    num_stages: int = 4

    def __post_init__(self):
        check_tiling(self, ("block_m", "block_n", "block_k"), ("splits", "num_warps", "num_stages"))

    def tiles(self, M: int, N: int) -> int:
        return triton.cdiv(M, self.block_m) * triton.cdiv(N, self.block_n)

    def fits(self, K: int) -> bool:
        """Whether this config can run a K of this size (each slice a whole number of k-blocks)."""
        return K % (self.splits * self.block_k) == 0


@triton.jit(do_not_specialize=["M"])  # one compile serves every row count
def _linear_kernel(
    X, W, Y, WS, CNT, M, N, K_SLICE,
    stride_xm, stride_wn, stride_ym,
    SWAP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr, SPLIT: tl.constexpr, PRECISION: tl.constexpr,
):
    tile = tl.program_id(0)
    split = tl.program_id(1)
    splits = tl.num_programs(1)
    grid_m = tl.cdiv(M, BLOCK_M)
    # rows fastest: the programs that share a weight slab run side by side and read it once from HBM
    pid_m = tile % grid_m
    pid_n = tile // grid_m
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    k0 = split.to(tl.int64) * K_SLICE
    x_ptrs = X + offs_m.to(tl.int64)[:, None] * stride_xm + k0 + offs_k[None, :]
    w_ptrs = W + offs_n.to(tl.int64)[:, None] * stride_wn + k0 + offs_k[None, :]
    if SWAP:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for _ in range(0, K_SLICE, BLOCK_K):
        x = tl.load(x_ptrs, mask=mask_m[:, None], other=0.0)
        w = tl.load(w_ptrs, mask=mask_n[:, None], other=0.0)
        if UPCAST:
            x = x.to(tl.float32)
            w = w.to(tl.float32)
        if SWAP:
            acc = tl.dot(w, tl.trans(x), acc, input_precision=PRECISION)
        else:
            acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K

    if SWAP:
        out_offs = offs_m.to(tl.int64)[None, :] * stride_ym + offs_n[:, None]
        out_mask = mask_m[None, :] & mask_n[:, None]
        ws_offs = offs_m.to(tl.int64)[None, :] * N + offs_n[:, None]
    else:
        out_offs = offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
        out_mask = mask_m[:, None] & mask_n[None, :]
        ws_offs = offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]
    if not SPLIT:
        tl.store(Y + out_offs, acc.to(Y.dtype.element_ty), mask=out_mask)
    else:
        slab = (tl.zeros([], dtype=tl.int64) + M) * N  # elements per slice's partial (M may be a constexpr 1)
        tl.store(WS + split * slab + ws_offs, acc, mask=out_mask)
        tl.debug_barrier()  # every thread's partial is written before the counter says so
        arrived = tl.atomic_add(CNT + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == splits - 1:  # the last slice in: sum all of them in slice order
            tl.debug_barrier()
            total = tl.load(WS + ws_offs, mask=out_mask, other=0.0, cache_modifier=".cg")
            for s in range(1, splits):
                total += tl.load(WS + s * slab + ws_offs, mask=out_mask, other=0.0, cache_modifier=".cg")
            tl.store(Y + out_offs, total.to(Y.dtype.element_ty), mask=out_mask)
            tl.atomic_xchg(CNT + tile, 0, sem="relaxed", scope="gpu")


def workspace_numel(M: int, N: int, config: MatmulConfig) -> int:
    """float32 elements of workspace a split-K call needs (0 without splits)."""
    return 0 if config.splits == 1 else config.splits * M * N


def linear(x: torch.Tensor, w: torch.Tensor, config: MatmulConfig, out: torch.Tensor | None = None, *,
           workspace: torch.Tensor | None = None, counters: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ w.T`` -> (M, N) in x's dtype, tiled as ``config`` says.

    x (M, K) and w (N, K) with contiguous rows and one float dtype. A config with ``splits > 1`` needs
    ``workspace`` (float32, >= ``workspace_numel`` elements) and ``counters`` (int32, zero, one per output tile;
    the kernel leaves them zero again), both owned by the caller and not used concurrently by another launch.
    """
    fn = "linear"
    check_float(f"{fn}: x", x)
    check_float(f"{fn}: w", w)
    if not isinstance(config, MatmulConfig):
        raise TypeError(f"{fn}: config must be a MatmulConfig, got {type(config).__name__}")
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"{fn}: want x (M, K) and w (N, K), got {tuple(x.shape)} and {tuple(w.shape)}")
    if x.dtype != w.dtype:
        raise ValueError(f"{fn}: x and w must share a dtype, got {x.dtype} and {w.dtype}")
    for name, t in (("x", x), ("w", w)):
        if t.shape[1] > 1 and t.stride(1) != 1:
            raise ValueError(f"{fn}: {name} needs contiguous rows, got strides {tuple(t.stride())}")
    M, K = x.shape
    N = w.shape[0]
    if not config.fits(K):
        raise ValueError(f"{fn}: K={K} is not a multiple of splits * block_k = {config.splits * config.block_k}")
    if out is None:
        out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    elif tuple(out.shape) != (M, N) or out.dtype != x.dtype or (N > 1 and out.stride(1) != 1):
        raise ValueError(f"{fn}: out must be ({M}, {N}) {x.dtype} with contiguous rows, got "
                         f"{tuple(out.shape)} {out.dtype} strides {tuple(out.stride())}")
    check_same_device(x=x, w=w, out=out)
    if M == 0 or N == 0:
        return out
    if config.splits > 1:
        if workspace is None or counters is None:
            raise ValueError(f"{fn}: splits={config.splits} needs a workspace and counters")
        if workspace.dtype != torch.float32 or workspace.numel() < workspace_numel(M, N, config):
            raise ValueError(f"{fn}: workspace must be float32 with >= {workspace_numel(M, N, config)} elements, "
                             f"got {workspace.dtype} with {workspace.numel()}")
        check_int(f"{fn}: counters", counters)
        if counters.dtype != torch.int32 or counters.numel() < config.tiles(M, N):
            raise ValueError(f"{fn}: counters must be int32 with >= {config.tiles(M, N)} elements, got "
                             f"{counters.dtype} with {counters.numel()}")
        check_same_device(x=x, workspace=workspace, counters=counters)
    else:
        workspace = counters = out  # unused by the kernel
    grid = (config.tiles(M, N), config.splits)
    _linear_kernel[grid](
        x, w, out, workspace, counters, M, N, K // config.splits,
        x.stride(0), w.stride(0), out.stride(0),
        SWAP=config.swap, BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        UPCAST=upcast_dots(x.dtype), SPLIT=config.splits > 1, PRECISION=dot_precision(x.dtype),
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return out


def linear_ref(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Plain-torch reference: float32 product rounded to x's dtype."""
    return (x.float() @ w.float().t()).to(x.dtype)
