"""The fused mixture-of-experts layer in Triton: routing, the expert-sorted layout (``nanovllm.kernels.
moe_routing``), two grouped GEMMs and the combine. Reference: ``nanovllm.layers.moe_ref`` (``fused_moe_ref`` and
one function per step below).

    moe_route_align  (T, E) logits -> top-k weights (T, k) float32, expert ids (T, k), and the pairs sorted by
                     expert in blocks of BLOCK_M rows (MoELayout)
    moe_gate_up      per block: x rows of its pairs @ w13[e].T -> silu(gate) * up, (rows, I) in x's dtype (e4m3
                     experts: x quantized per token first, FP8 tensor-core products)
    moe_down         per block: those rows @ w2[e].T * the pair's routing weight -> row t * k + j of (T * k, H)
    moe_combine      out[t] = sum over j in order 0 .. k-1 of row t * k + j, in float32 (deterministic: no
                     atomics); skipped with combine=False, when the add + RMSNorm that follows sums the rows

A GEMM program takes one block of rows (one expert) and BLOCK_N outputs; programs are ordered blocks first, so
the blocks of one expert that share a weight tile run side by side. The grids are sized for the worst case
(`max_blocks`) and a program past the last real block exits at once (its block's expert is -1): every shape
depends on the token count only, so decode and mixed steps replay in CUDA graphs. Products accumulate in
float32; the SiLU-and-mul result, each weighted pair row and the sum are rounded to x's dtype, as in the
reference. Tile sizes come from ``nanovllm.kernels.moe_configs`` (by token count and weight shape).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanovllm.kernels._common import (
    check_float,
    check_same_device,
    check_scale_block,
    dot_precision,
    next_pow2,
    upcast_dots,
)
from nanovllm.kernels.moe_configs import GemmTile, MoEConfig, config_buckets, moe_config
from nanovllm.kernels.moe_routing import moe_route_align
from nanovllm.layers.moe_ref import MoELayout

FP8 = torch.float8_e4m3fn


@triton.jit(do_not_specialize=["n_blocks"])
def _gate_up_kernel(X, XS, W, WS, SORTED, BLOCK_EXPERT, BLOCK_ROWS, OUT, n_blocks, N, K,
                    stride_x, stride_xsm, stride_xsg, stride_we, stride_wn, stride_o,
                    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    EVEN_K: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr, FP8: tl.constexpr,
                    SCALE_BN: tl.constexpr, SCALE_BK: tl.constexpr):
    pid = tl.program_id(0)
    blk = pid % n_blocks
    e = tl.load(BLOCK_EXPERT + blk)
    if e < 0:  # past the last real block
        return
    offs_m = tl.arange(0, BLOCK_M)
    row_ok = offs_m < tl.load(BLOCK_ROWS + blk)
    rows = blk.to(tl.int64) * BLOCK_M + offs_m
    tok = (tl.load(SORTED + rows, mask=row_ok, other=0) // TOP_K).to(tl.int64)
    offs_n = (pid // n_blocks) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = X + tok[:, None] * stride_x + offs_k[None, :]
    # (BLOCK_K, BLOCK_N) tiles of the gate rows [0, N) and the up rows [N, 2N) of w13[e]
    g_ptrs = W + e.to(tl.int64) * stride_we + offs_n.to(tl.int64)[None, :] * stride_wn + offs_k[:, None]
    u_ptrs = g_ptrs + N * stride_wn
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if SCALE_BK > 0:  # WS (E, 2N / SCALE_BN, K / SCALE_BK): each tile's scale; the gate's rows, then the up's
        kb = tl.cdiv(K, SCALE_BK)
        sg_ptrs = WS + e.to(tl.int64) * (2 * N // SCALE_BN) * kb + (offs_n // SCALE_BN) * kb
        su_ptrs = sg_ptrs + (N // SCALE_BN) * kb
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
            g = tl.load(g_ptrs, mask=n_ok[None, :], other=0.0)
            u = tl.load(u_ptrs, mask=n_ok[None, :], other=0.0)
        else:
            k_ok = offs_k < K - k0
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            g = tl.load(g_ptrs, mask=n_ok[None, :] & k_ok[:, None], other=0.0)
            u = tl.load(u_ptrs, mask=n_ok[None, :] & k_ok[:, None], other=0.0)
        if UPCAST and not FP8:
            a, g, u = a.to(tl.float32), g.to(tl.float32), u.to(tl.float32)
        if SCALE_BK > 0:  # (BLOCK_K divides SCALE_BK: one weight scale per output and one activation scale per
            #              row in this k-tile)
            xs = tl.load(XS + tok * stride_xsm + (k0 // SCALE_BK) * stride_xsg, mask=row_ok, other=0.0)[:, None]
            acc_g += tl.dot(a, g) * (tl.load(sg_ptrs + k0 // SCALE_BK, mask=n_ok)[None, :] * xs)
            acc_u += tl.dot(a, u) * (tl.load(su_ptrs + k0 // SCALE_BK, mask=n_ok)[None, :] * xs)
        else:
            acc_g = tl.dot(a, g, acc_g, input_precision=PRECISION)
            acc_u = tl.dot(a, u, acc_u, input_precision=PRECISION)
        a_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    if FP8 and SCALE_BK == 0:  # WS (E, 2N) float32: each expert's per-row scales, [gate | up]; XS (T, 1)
        ws = WS + e.to(tl.int64) * 2 * N + offs_n
        xs = tl.load(XS + tok * stride_xsm, mask=row_ok, other=0.0)[:, None]
        acc_g = acc_g * tl.load(ws, mask=n_ok, other=0.0)[None, :] * xs
        acc_u = acc_u * tl.load(ws + N, mask=n_ok, other=0.0)[None, :] * xs
    h = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
    tl.store(OUT + rows[:, None] * stride_o + offs_n[None, :], h.to(OUT.dtype.element_ty),
             mask=row_ok[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["n_blocks"])
def _down_kernel(A, W, WS, SORTED, BLOCK_EXPERT, BLOCK_ROWS, TOPW, OUT, n_blocks, N, K,
                 stride_a, stride_we, stride_wn, stride_o,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                 UPCAST: tl.constexpr, PRECISION: tl.constexpr, FP8: tl.constexpr, SCALE_BN: tl.constexpr,
                 SCALE_BK: tl.constexpr):
    pid = tl.program_id(0)
    blk = pid % n_blocks
    e = tl.load(BLOCK_EXPERT + blk)
    if e < 0:
        return
    offs_m = tl.arange(0, BLOCK_M)
    row_ok = offs_m < tl.load(BLOCK_ROWS + blk)
    rows = blk.to(tl.int64) * BLOCK_M + offs_m
    pair = tl.load(SORTED + rows, mask=row_ok, other=0).to(tl.int64)
    offs_n = (pid // n_blocks) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = A + rows[:, None] * stride_a + offs_k[None, :]
    w_ptrs = W + e.to(tl.int64) * stride_we + offs_n.to(tl.int64)[None, :] * stride_wn + offs_k[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if SCALE_BK > 0:  # WS (E, N / SCALE_BN, K / SCALE_BK)
        kb = tl.cdiv(K, SCALE_BK)
        s_ptrs = WS + e.to(tl.int64) * tl.cdiv(N, SCALE_BN) * kb + (offs_n // SCALE_BN) * kb
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
            w = tl.load(w_ptrs, mask=n_ok[None, :], other=0.0)
        else:
            k_ok = offs_k < K - k0
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=n_ok[None, :] & k_ok[:, None], other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
        if UPCAST or FP8:
            w = w.to(a.dtype)
        if SCALE_BK > 0:
            acc += tl.dot(a, w, input_precision=PRECISION) * tl.load(s_ptrs + k0 // SCALE_BK, mask=n_ok)[None, :]
        else:
            acc = tl.dot(a, w, acc, input_precision=PRECISION)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if FP8 and SCALE_BK == 0:  # WS (E, N) float32
        acc = acc * tl.load(WS + e.to(tl.int64) * N + offs_n, mask=n_ok, other=0.0)[None, :]
    acc = acc * tl.load(TOPW + pair, mask=row_ok, other=0.0)[:, None]
    tl.store(OUT + pair[:, None] * stride_o + offs_n[None, :], acc.to(OUT.dtype.element_ty),
             mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def _combine_kernel(P, OUT, H, stride_p, stride_o, TOP_K: tl.constexpr, BLOCK_H: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    m = offs < H
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        acc += tl.load(P + (t * TOP_K + j) * stride_p + offs, mask=m, other=0.0).to(tl.float32)
    tl.store(OUT + t * stride_o + offs, acc.to(OUT.dtype.element_ty), mask=m)


def _rows_contiguous(name: str, t: torch.Tensor) -> None:
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got shape {tuple(t.shape)} strides {tuple(t.stride())}")


def _scale_shape(w: torch.Tensor, block: tuple[int, int] | None) -> tuple[int, ...]:
    """The scales of e4m3 experts w (E, N, K): per row (E, N), or per (bn x bk) tile (E, N / bn, K / bk)."""
    E, N, K = w.shape
    return (E, N) if block is None else (E, -(-N // block[0]), -(-K // block[1]))


def _check_operands(fn: str, a: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor | None = None,
                    block: tuple[int, int] | None = None) -> None:
    """a (rows, K) with contiguous rows and w (E, N, K) contiguous, one dtype; or w e4m3 with its float32 scales
    w_scale, contiguous: per row (E, N), or per `block` (bn, bk) tile (E, N / bn, K / bk)."""
    if a.dim() != 2 or w.dim() != 3 or a.shape[1] != w.shape[2] or (a.shape[1] > 1 and a.stride(1) != 1):
        raise ValueError(f"{fn}: want rows (n, K) with contiguous rows and weights (E, N, K), got {tuple(a.shape)} "
                         f"strides {tuple(a.stride())} and {tuple(w.shape)}")
    if (w.dtype == FP8) != (w_scale is not None):
        raise ValueError(f"{fn}: float8_e4m3fn weights come with their scales (and only they), got {w.dtype} "
                         f"weights and {'no' if w_scale is None else 'some'} scales")
    if w_scale is not None:
        want = _scale_shape(w, block)
        if w_scale.dtype != torch.float32 or tuple(w_scale.shape) != want or not w_scale.is_contiguous():
            raise ValueError(f"{fn}: weight scales must be contiguous float32 {want}, got "
                             f"{w_scale.dtype} {tuple(w_scale.shape)}")
        if block is not None:
            check_scale_block(fn, block)
        check_same_device(weights=w, weight_scales=w_scale)
    elif a.dtype != w.dtype:
        raise ValueError(f"{fn}: operands must share a dtype, got {a.dtype} and {w.dtype}")
    _rows_contiguous(f"{fn}: weights", w)


def _tile_args(tile: GemmTile, n: int, K: int, dtype: torch.dtype, w_scale, block, itemsize: int | None = None
               ) -> dict:
    """The launch arguments of a grouped GEMM: the tile fitted to (n, K) and to operands of `itemsize` bytes
    (default dtype's; block-scaled: k-tiles within a weight tile), the dtype flags and the weights' scaling (FP8:
    e4m3; SCALE_BN / SCALE_BK: the tile, 0 per row)."""
    tile = tile.fit(n, K, itemsize or torch.empty(0, dtype=dtype).element_size())
    if block is not None:
        tile = GemmTile(tile.block_n, min(tile.block_k, block[1]), tile.num_warps, tile.num_stages)
    bn, bk = block if block is not None else (0, 0)
    return dict(BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, EVEN_K=K % tile.block_k == 0, UPCAST=upcast_dots(dtype),
                PRECISION=None if itemsize == 1 else dot_precision(dtype), FP8=w_scale is not None, SCALE_BN=bn,
                SCALE_BK=bk, num_warps=tile.num_warps, num_stages=tile.num_stages)


def moe_gate_up(x: torch.Tensor, w13: torch.Tensor, layout: MoELayout, top_k: int, tile: GemmTile,
                w13_scale: torch.Tensor | None = None, block: tuple[int, int] | None = None) -> torch.Tensor:
    """(rows, I) silu(gate) * up of each layout row's token and expert (``gate_up_ref``; padding rows unwritten).
    x (T, H) with contiguous rows; w13 (E, 2I, H) contiguous, [gate | up] per expert, in x's dtype or e4m3 with
    w13_scale float32: (E, 2I), one scale per expert and row, or with `block` (bn, bk) (E, 2I / bn, H / bk), one
    per tile (a block-FP8 checkpoint's; I a multiple of bn). With e4m3 experts x is quantized first, per token
    (per row scales) or per token and bk columns (`block`), and the products run on FP8 tensor cores (W8A8: the
    weights' bytes stream at bf16's rate, where converting e4m3 tiles to bf16 in the loop did not: RESULTS.md);
    the tiles then take twice the k-width of the table's bf16 tile (the same bytes)."""
    _check_operands("moe_gate_up", x, w13, w13_scale, block)
    E, two_i, H = w13.shape
    inter = two_i // 2
    if block is not None and inter % block[0]:
        raise ValueError(f"moe_gate_up: the gate and up projections ({inter} rows each) must be whole "
                         f"{block[0]}-row tiles")
    if block is not None and H % block[1]:
        raise ValueError(f"moe_gate_up: the hidden size {H} must be whole {block[1]}-column tiles (x is quantized "
                         f"per token and {block[1]} columns)")
    nb = layout.block_expert.numel()
    out = torch.empty(nb * layout.block_m, inter, dtype=x.dtype, device=x.device)
    if w13_scale is None:
        xq, xs, args = x, x, _tile_args(tile, inter, H, x.dtype, None, block)
    else:
        from nanovllm.kernels.fp8_quant import per_token_group_quant_fp8, per_token_quant_fp8
        xq, xs = per_token_quant_fp8(x) if block is None else per_token_group_quant_fp8(x, block[1])
        args = _tile_args(tile, inter, H, x.dtype, w13_scale, block, itemsize=1)
    if nb:
        grid = (nb * triton.cdiv(inter, args["BLOCK_N"]),)
        _gate_up_kernel[grid](xq, xs, w13, w13 if w13_scale is None else w13_scale, layout.sorted_ids,
                              layout.block_expert, layout.block_rows, out, nb, inter, H,
                              xq.stride(0), xs.stride(0), xs.stride(-1), w13.stride(0), w13.stride(1), out.stride(0),
                              TOP_K=top_k, BLOCK_M=layout.block_m, **args)
    return out


def moe_down(inter: torch.Tensor, w2: torch.Tensor, layout: MoELayout, weights: torch.Tensor,
             tile: GemmTile, w2_scale: torch.Tensor | None = None, block: tuple[int, int] | None = None
             ) -> torch.Tensor:
    """(T * top_k, H) weighted down projections, row t * top_k + j (``down_ref``). inter (rows, I) from
    moe_gate_up; w2 (E, H, I) contiguous, in inter's dtype or e4m3 with w2_scale float32 (E, H), or with `block`
    (E, H / bn, I / bk); weights (T, top_k) float32 contiguous."""
    _check_operands("moe_down", inter, w2, w2_scale, block)
    if weights.dtype != torch.float32 or not weights.is_contiguous():
        raise ValueError(f"moe_down: weights must be contiguous float32, got {weights.dtype} {tuple(weights.stride())}")
    E, H, K = w2.shape
    args = _tile_args(tile, H, K, inter.dtype, w2_scale, block)
    nb = layout.block_expert.numel()
    out = torch.empty(weights.numel(), H, dtype=inter.dtype, device=inter.device)
    if nb:
        grid = (nb * triton.cdiv(H, args["BLOCK_N"]),)
        _down_kernel[grid](inter, w2, w2 if w2_scale is None else w2_scale, layout.sorted_ids, layout.block_expert,
                           layout.block_rows, weights, out, nb, H, K, inter.stride(0), w2.stride(0), w2.stride(1),
                           out.stride(0), BLOCK_M=layout.block_m, **args)
    return out


def moe_combine(pairs: torch.Tensor, top_k: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """(T * top_k, H) rows -> (T, H): each token's rows summed in order (``combine_ref``), into `out` (contiguous
    rows) when given."""
    n, H = pairs.shape
    T = n // top_k
    if n % top_k or (H > 1 and pairs.stride(1) != 1):
        raise ValueError(f"moe_combine: pairs must be (T * {top_k}, H) with contiguous rows, got {tuple(pairs.shape)}")
    if out is None:
        out = torch.empty(T, H, dtype=pairs.dtype, device=pairs.device)
    elif tuple(out.shape) != (T, H) or out.dtype != pairs.dtype or (H > 1 and out.stride(1) != 1):
        raise ValueError(f"moe_combine: out must be ({T}, {H}) {pairs.dtype} with contiguous rows, got "
                         f"{tuple(out.shape)} {out.dtype}")
    if T:
        block = min(1024, next_pow2(H))
        _combine_kernel[(T, triton.cdiv(H, block))](pairs, out, H, pairs.stride(0), out.stride(0), TOP_K=top_k,
                                                   BLOCK_H=block, num_warps=4)
    return out


def fused_moe(x: torch.Tensor, router_logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, top_k: int,
              renormalize: bool, out: torch.Tensor | None = None, *, config: MoEConfig | None = None,
              w13_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None,
              block: tuple[int, int] | None = None, combine: bool = True) -> torch.Tensor:
    """The mixture-of-experts feed-forward (T, H), as ``fused_moe_ref``: x (T, H); router_logits (T, E);
    w13 (E, 2I, H) and w2 (E, H, I) contiguous in x's dtype (I: this rank's slice: the result is then its partial
    sum), or e4m3 with their float32 per-row scales w13_scale (E, 2I) and w2_scale (E, H) (FP8: gate/up on x
    quantized per token, down on the SiLU-and-mul rows in x's dtype), or with `block` (bn, bk) per-tile scales
    (E, 2I / bn, H / bk) and (E, H / bn, I / bk) (a block-FP8 checkpoint's; x quantized per token and bk
    columns); into `out` ((T, H) contiguous, x's dtype) when given. config None: from
    the table (moe_config). combine=False: the (T * top_k, H) weighted expert rows, for the add + RMSNorm that
    follows to sum (``add_rms_norm(..., rows_per_token=top_k)``); no `out` then."""
    fn = "fused_moe"
    if not combine and out is not None:
        raise ValueError(f"{fn}: combine=False returns the expert rows; it takes no out")
    check_float(f"{fn}: x", x)
    if (w13_scale is None) != (w2_scale is None):
        raise ValueError(f"{fn}: w13_scale and w2_scale come together (FP8 experts) or not at all")
    if block is not None and w13_scale is None:
        raise ValueError(f"{fn}: block={block} describes FP8 experts' scales, and none were given")
    for name, t, sc in (("w13", w13, w13_scale), ("w2", w2, w2_scale)):
        if sc is None:
            check_float(f"{fn}: {name}", t)
        elif t.dtype != FP8:
            raise ValueError(f"{fn}: {name} with scales must be float8_e4m3fn, got {t.dtype}")
    if x.dim() != 2 or w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(f"{fn}: want x (T, H), w13 (E, 2I, H), w2 (E, H, I); got {tuple(x.shape)}, "
                         f"{tuple(w13.shape)}, {tuple(w2.shape)}")
    T, H = x.shape
    E, two_i, _ = w13.shape
    if two_i % 2 or tuple(w13.shape) != (E, two_i, H) or tuple(w2.shape) != (E, H, two_i // 2):
        raise ValueError(f"{fn}: shapes disagree: x {tuple(x.shape)}, w13 {tuple(w13.shape)} (want (E, 2I, {H})), "
                         f"w2 {tuple(w2.shape)} (want ({E}, {H}, I))")
    if tuple(router_logits.shape) != (T, E):
        raise ValueError(f"{fn}: router_logits must be ({T}, {E}), got {tuple(router_logits.shape)}")
    if w13_scale is None and not (x.dtype == w13.dtype == w2.dtype):
        raise ValueError(f"{fn}: x, w13 and w2 must share a dtype, got {x.dtype}, {w13.dtype}, {w2.dtype}")
    if H > 1 and x.stride(1) != 1:
        raise ValueError(f"{fn}: x needs contiguous rows, got strides {tuple(x.stride())}")
    _rows_contiguous(f"{fn}: w13", w13)
    _rows_contiguous(f"{fn}: w2", w2)
    if out is None:
        out = torch.empty(T, H, dtype=x.dtype, device=x.device) if combine else None
    elif tuple(out.shape) != (T, H) or out.dtype != x.dtype or not out.is_contiguous():
        raise ValueError(f"{fn}: out must be ({T}, {H}) {x.dtype} contiguous, got {tuple(out.shape)} {out.dtype}")
    check_same_device(x=x, router_logits=router_logits, w13=w13, w2=w2)
    if out is not None:
        check_same_device(x=x, out=out)
    if config is None:
        config = moe_config(T, E, H, two_i // 2)
    weights, _, layout = moe_route_align(router_logits, top_k, renormalize, config.block_m)
    inter = moe_gate_up(x, w13, layout, top_k, config.gate_up, w13_scale, block)
    rows = moe_down(inter, w2, layout, weights, config.down, w2_scale, block)
    return moe_combine(rows, top_k, out) if combine else rows


def fused_moe_compile(w13: torch.Tensor, w2: torch.Tensor, top_k: int, renormalize: bool,
                      w13_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None,
                      dtype: torch.dtype | None = None, block: tuple[int, int] | None = None) -> int:
    """Run the layer on one token with every config of its weight shape's table, so that each kernel variant a step
    can pick is compiled now (at start-up), not by the first step of its size mid-run; the first config alone
    (it compiles the kernels all share), the others side by side on CUDA (the compiler runs in subprocesses; the
    CPU interpreter runs one launch at a time). FP8 experts: with their scales (and `block`), for activations of
    `dtype`.
    Returns how many configs."""
    from concurrent.futures import ThreadPoolExecutor
    E, two_i, H = w13.shape
    configs = list(dict.fromkeys(cfg for _, cfg in config_buckets(E, H, two_i // 2)))
    dtype = dtype or w13.dtype
    x = torch.zeros(1, H, dtype=dtype, device=w13.device)
    logits = torch.zeros(1, E, dtype=dtype, device=w13.device)

    def run(cfg):
        fused_moe(x, logits, w13, w2, top_k, renormalize, config=cfg, w13_scale=w13_scale, w2_scale=w2_scale,
                  block=block)

    run(configs[0])
    with ThreadPoolExecutor(max(1, len(configs) - 1) if w13.is_cuda else 1) as pool:
        list(pool.map(run, configs[1:]))
    return len(configs)
