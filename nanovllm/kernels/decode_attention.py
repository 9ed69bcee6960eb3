"""Decode attention: one query per sequence over its paged KV cache, optionally split along the KV length
(flash-decoding: partial results per split, then a reduce kernel). ``nanovllm.kernels.paged_common`` has the
design points; reference ``nanovllm.attention.torch_ref.paged_attention_ref`` with one query per sequence."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanovllm.kernels._common import (
    check_int,
    check_same_device,
    dot_precision,
    is_pow2,
    next_pow2,
    sm_count,
    upcast_dots,
)
from nanovllm.kernels.paged_common import LOG2E, check_paged_args, kv_slots, kv_tile, online_softmax_step


@triton.jit(do_not_specialize=["stride_bt", "num_splits"])
def _decode_kernel(
    Q, K, V, KS, VS, Out, PART_O, PART_LSE, SEQ_LENS, BT, ORDER, qk_scale, num_splits,
    stride_qb, stride_qh, stride_ob, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_bt, stride_sb, stride_ss,
    G: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, SPLIT: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr,
    USE_ORDER: tl.constexpr, SKIP_EMPTY: tl.constexpr, FP8: tl.constexpr,
):
    # SPLIT: num_splits > 1 programs per sequence write partial results for _decode_reduce_kernel; the count
    # itself is a runtime value, so every split count shares one compiled variant.
    # Grid (Hkv, B, splits): the programs of one sequence's KV heads are launched together (+2-3% bandwidth on an
    # H200 over (B, Hkv, splits), RESULTS run 14)
    kvh = tl.program_id(0)
    b = tl.program_id(1)
    H = tl.num_programs(0) * G
    if USE_ORDER:
        # the b-th program to launch takes sequence ORDER[b] (longest first: the short ones fill the tail)
        b = tl.load(ORDER + b)
    split = tl.program_id(2)
    seq_len = tl.load(SEQ_LENS + b).to(tl.int32)
    # each sequence's own length is split evenly (in whole tiles) over the num_splits programs
    chunk = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * chunk
    end = tl.minimum(start + chunk, seq_len)

    offs_g = tl.arange(0, BLOCK_G)
    g_ok = offs_g < G
    head = kvh * G + offs_g
    offs_d = tl.arange(0, HEAD_DIM)
    b64 = b.to(tl.int64)
    q = tl.load(Q + b64 * stride_qb + head[:, None] * stride_qh + offs_d[None, :], mask=g_ok[:, None], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    bt_row = BT + b64 * stride_bt
    head_off = kvh.to(tl.int64) * stride_kh
    offs_n = tl.arange(0, BLOCK_N)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
    if FP8:
        # e4m3 K/V tiles: converted to float16 (one instruction per pair of values; the cost that bounds this
        # loop) and used as stored, each key's scale applied to its score, each value's folded into its
        # probability before the second dot (a (G, BLOCK_N) product, not a (BLOCK_N, D) dequantization); the
        # query clamped into float16's range. float32 queries (and the CPU interpreter) compute in float32.
        cdt = tl.float32 if UPCAST or Q.dtype.element_ty == tl.float32 else tl.float16
        qc = tl.minimum(tl.maximum(q.to(tl.float32), -65504.0), 65504.0).to(cdt)
        for n0 in range(start, end, BLOCK_N):
            n = n0 + offs_n
            n_ok = n < end
            blk, pos = kv_slots(bt_row, n0, offs_n, end, BLOCK_SIZE, BLOCK_N, True)
            rows = blk * stride_kb + pos * stride_ks + head_off
            k = tl.load(K + rows[:, None] + offs_d[None, :], mask=n_ok[:, None], other=0.0).to(cdt)
            v = tl.load(V + rows[:, None] + offs_d[None, :], mask=n_ok[:, None], other=0.0).to(cdt)
            srows = blk * stride_sb + pos * stride_ss + kvh
            ks = tl.load(KS + srows, mask=n_ok, other=0.0)
            vs = tl.load(VS + srows, mask=n_ok, other=0.0)
            qk = tl.dot(qc, tl.trans(k), input_precision=PREC) * (ks * qk_scale)[None, :]
            qk = tl.where(n_ok[None, :], qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))       # every tile has a valid key
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(qk - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot((p * vs[None, :]).to(cdt), v, input_precision=PREC)
            m_i = m_new
    else:
        for n0 in range(start, end, BLOCK_N):
            n = n0 + offs_n
            n_ok = n < end
            k, v, _ = kv_tile(K, V, KS, VS, Q, bt_row, n0, offs_n, offs_d, end, n_ok, head_off, kvh, stride_kb,
                              stride_ks, stride_sb, stride_ss, BLOCK_SIZE, BLOCK_N, True, UPCAST, False)
            qk = tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale
            qk = tl.where(n_ok[None, :], qk, float("-inf"))
            m_i, l_i, acc = online_softmax_step(qk, v, m_i, l_i, acc, PREC, False)  # every tile has a valid key

    has = l_i > 0.0
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    if not SPLIT:
        keep = g_ok
        if SKIP_EMPTY:
            keep = offs_g < tl.where(seq_len > 0, G, 0)
        tl.store(Out + b64 * stride_ob + head[:, None] * stride_oh + offs_d[None, :],
                 out.to(Out.dtype.element_ty), mask=keep[:, None])
    else:
        # workspace: PART_O (B, H, num_splits, D), PART_LSE (B, H, num_splits), contiguous float32
        idx = (b64 * H + head) * num_splits + split
        tl.store(PART_O + idx[:, None] * HEAD_DIM + offs_d[None, :], out, mask=g_ok[:, None])
        lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
        tl.store(PART_LSE + idx, lse, mask=g_ok)


@triton.jit(do_not_specialize=["num_splits"])
def _decode_reduce_kernel(PART_O, PART_LSE, Out, stride_ob, stride_oh, num_splits,
                          SPLITS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, SKIP_EMPTY: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    H = tl.num_programs(1)
    offs_s = tl.arange(0, SPLITS_PAD)
    s_ok = offs_s < num_splits
    offs_d = tl.arange(0, HEAD_DIM)
    base = (b * H + h) * num_splits
    lse = tl.load(PART_LSE + base + offs_s, mask=s_ok, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)        # seq_len 0: every split empty -> zeros
    w = tl.exp2(lse - m)
    denom = tl.sum(w, 0)
    po = tl.load(PART_O + (base + offs_s)[:, None] * HEAD_DIM + offs_d[None, :], mask=s_ok[:, None], other=0.0)
    out = tl.sum(po * w[:, None], 0) / tl.where(denom > 0.0, denom, 1.0)
    keep = offs_d < HEAD_DIM
    if SKIP_EMPTY:
        keep = offs_d < tl.where(denom > 0.0, HEAD_DIM, 0)
    tl.store(Out + b * stride_ob + h * stride_oh + offs_d, out.to(Out.dtype.element_ty), mask=keep)


_MAX_SPLITS = 32
_MIN_TOKENS_PER_SPLIT = 256


def _decode_block_n(D: int, dtype=torch.bfloat16) -> int:
    return 64 if D <= 128 and dtype != torch.float32 else 32


def _decode_launch(D: int, dtype, fp8: bool = False) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages) of the decode kernel: the best of a sweep on an H200 for head_dim <= 128
    in half precision (RESULTS run 7). Over an e4m3 cache, 128 keys at 2 warps and 2 stages: 1.12x the 4-warp
    launch at 256 sequences (`kernel_bench.py decode --sweep`, 2026-12-01; a program's converted float16 tiles
    take 208 registers a thread at 4 warps, which leaves two programs an SM; at 2 warps the split-KV variant
    spills 8 bytes, sm90_compile_check)."""
    if D <= 128 and dtype != torch.float32:
        return (128, 2, 2) if fp8 else (128, 4, 3)
    return _decode_block_n(D, dtype), 4, 2


def decode_num_splits(batch: int, num_kv_heads: int, max_blocks: int, block_size: int,
                      device: torch.device | None = None) -> int:
    """KV splits for the decode kernel, from static shapes only (safe for CUDA-graph capture).

    Splits only when (batch * num_kv_heads) programs would leave the GPU under-filled and the longest possible
    context (max_blocks * block_size) gives every split at least ``_MIN_TOKENS_PER_SPLIT`` tokens.
    """
    max_ctx = max_blocks * block_size
    programs = max(batch * num_kv_heads, 1)
    target = 2 * sm_count(device if device is not None else torch.device("cpu"))
    if programs >= target:
        return 1
    splits = min(triton.cdiv(target, programs), max_ctx // _MIN_TOKENS_PER_SPLIT, _MAX_SPLITS)
    return max(splits, 1)


# Long contexts (a prompt of thousands of tokens): a decode step of a few dozen such sequences launches B * Hkv
# programs of ~50 KV tiles each, one per SM at a time, so the last wave idles most SMs for a whole program.
# Four splits (each >= _LONG_SPLIT_TOKENS on average) fill it: 432 vs 466 us at 64 sequences of 6,000-8,200
# tokens, 16 / 8 heads (`kernel_bench.py decode --batch 64 --ctx 6000-8200 --heads 16/8 [--splits 1]`, H200,
# 2026-12-01); 377 vs 430 at 56 in CUDA graphs. Short contexts lose by splitting (the reduce kernel and the
# partial rows: 93 sequences of 300-1,300 tokens, 32 / 4 heads, 54 vs 45 us).
_LONG_SPLITS = 4
_LONG_SPLIT_TOKENS = 1024
LONG_CONTEXT_TOKENS = _LONG_SPLITS * _LONG_SPLIT_TOKENS  # mean context of a step that takes decode_long_splits


def decode_long_splits(batch: int, num_kv_heads: int, max_blocks: int, block_size: int,
                       device: torch.device | None = None) -> int | None:
    """KV splits for a decode step of up to ``batch`` sequences whose mean context is at least
    ``LONG_CONTEXT_TOKENS``, or None where ``decode_num_splits``' own stay: more than four waves of programs without
    splitting (the tail is short), a model length no longer than that mean, or a batch it splits as much already.
    Static shapes only (a CUDA graph per choice)."""
    base = decode_num_splits(batch, num_kv_heads, max_blocks, block_size, device)
    sms = sm_count(device if device is not None else torch.device("cpu"))
    if batch * num_kv_heads > 4 * sms or max_blocks * block_size <= LONG_CONTEXT_TOKENS or base >= _LONG_SPLITS:
        return None
    return _LONG_SPLITS


def decode_workspace_numel(batch: int, num_heads: int, head_dim: int, num_splits: int = _MAX_SPLITS) -> int:
    """float32 elements of the split-KV workspace for up to ``batch`` sequences and ``num_splits`` splits."""
    return batch * num_heads * num_splits * (head_dim + 1)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seq_lens: torch.Tensor,
                           block_tables: torch.Tensor, scale: float, out: torch.Tensor | None = None, *,
                           num_splits: int | None = None, workspace: torch.Tensor | None = None,
                           order: torch.Tensor | None = None, skip_empty: bool = False,
                           k_scales: torch.Tensor | None = None, v_scales: torch.Tensor | None = None,
                           launch: tuple[int, int, int] | None = None) -> torch.Tensor:
    """One query per sequence at position seq_len - 1 (``paged_attention_ref`` with cu_seqlens_q = arange(B+1)).

    Args:
        q: (B, H, D); may be a strided view (contiguous head_dim).
        k_cache, v_cache: (num_blocks, block_size, Hkv, D) with q's dtype, or e4m3 with k_scales / v_scales
            (num_blocks, block_size, Hkv) float32.
        seq_lens: (B,) int, 0 = padding (outputs zeros); block_tables: (B, max_blocks) int, -1 padded.
        scale: softmax scale. out: optional (B, H, D) output buffer.
        num_splits: KV splits (1 = single pass, no workspace); default: ``decode_num_splits`` of the shapes.
        workspace: optional flat float32 buffer of >= ``decode_workspace_numel(B, H, D, num_splits)`` elements
            (otherwise one is allocated, sized from shapes only).
        order: optional (B,) int permutation of 0..B-1: the order in which sequences are launched (not checked on
            the device: anything else leaves rows unwritten). Longest first balances the GPU's tail: the programs
            of long sequences start early and short ones fill the gaps. Results don't depend on it.
        launch: (BLOCK_N, num_warps, num_stages) instead of the measured default (benchmarks' sweeps).
        skip_empty: leave the rows of sequences with seq_len 0 untouched instead of writing zeros (another kernel
            may be writing them at the same time: a mixed step's varlen half).
    CUDA-graph safe: no host sync, launch sizes and allocations depend on shapes only.
    """
    fn = "paged_decode_attention"
    out, seq_lens, H, Hkv, D, block_size, B, (fp8, stride_sb, stride_ss) = check_paged_args(
        fn, q, k_cache, v_cache, seq_lens, block_tables, out, q.shape, k_scales, v_scales)
    if q.shape[0] != B:
        raise ValueError(f"{fn}: q has {q.shape[0]} rows but seq_lens has {B} sequences")
    if order is not None:
        check_int(f"{fn}: order", order)
        if order.shape != (B,) or not order.is_contiguous():
            raise ValueError(f"{fn}: order must be a contiguous ({B},) permutation, got {tuple(order.shape)}")
        check_same_device(q=q, order=order)
    if B == 0:
        return out
    if num_splits is None:
        num_splits = decode_num_splits(B, Hkv, block_tables.shape[1], block_size, q.device)
    num_splits = int(num_splits)
    if num_splits < 1:
        raise ValueError(f"{fn}: num_splits must be >= 1, got {num_splits}")
    G = H // Hkv
    BLOCK_G = max(16, next_pow2(G))  # tl.dot needs M >= 16; padded rows are masked
    if launch is None:
        launch = _decode_launch(D, q.dtype, fp8)
    BLOCK_N, warps, stages = (int(x) for x in launch)
    if BLOCK_N < 16 or not is_pow2(BLOCK_N) or warps not in (1, 2, 4, 8) or stages < 1:
        raise ValueError(f"{fn}: launch must be (BLOCK_N: a power of two >= 16, num_warps: 1, 2, 4 or 8, "
                         f"num_stages >= 1), got {launch}")
    prec = dot_precision(q.dtype)
    common = dict(G=G, BLOCK_G=BLOCK_G, BLOCK_N=BLOCK_N, HEAD_DIM=D, BLOCK_SIZE=block_size, SPLIT=num_splits > 1,
                  PREC=prec, UPCAST=upcast_dots(q.dtype), USE_ORDER=order is not None,
                  SKIP_EMPTY=bool(skip_empty), FP8=fp8, num_warps=warps, num_stages=stages)
    grid = (Hkv, B, num_splits)
    strides = (q.stride(0), q.stride(1), out.stride(0), out.stride(1),
               k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0), stride_sb, stride_ss)
    scales = (k_scales, v_scales) if fp8 else (k_cache, v_cache)
    qk_scale = float(scale) * LOG2E
    if num_splits == 1:
        _decode_kernel[grid](q, k_cache, v_cache, *scales, out, out, out, seq_lens, block_tables,
                             seq_lens if order is None else order, qk_scale, 1, *strides, **common)
        return out
    need = decode_workspace_numel(B, H, D, num_splits)
    if workspace is None:
        workspace = torch.empty(need, dtype=torch.float32, device=q.device)
    elif workspace.dtype != torch.float32 or workspace.numel() < need or not workspace.is_contiguous() \
            or workspace.device != q.device:
        raise ValueError(f"{fn}: workspace must be a contiguous float32 tensor on {q.device} with >= {need} "
                         f"elements, got {workspace.dtype} with {workspace.numel()} on {workspace.device}")
    workspace = workspace.view(-1)
    part_o = workspace[: B * H * num_splits * D]
    part_lse = workspace[B * H * num_splits * D: need]
    _decode_kernel[grid](q, k_cache, v_cache, *scales, out, part_o, part_lse, seq_lens, block_tables,
                         seq_lens if order is None else order, qk_scale, num_splits, *strides, **common)
    # one padded width for every split count up to _MAX_SPLITS: one compiled variant
    _decode_reduce_kernel[(B, H)](part_o, part_lse, out, out.stride(0), out.stride(1), num_splits,
                                  SPLITS_PAD=next_pow2(max(num_splits, _MAX_SPLITS)), HEAD_DIM=D,
                                  SKIP_EMPTY=bool(skip_empty), num_warps=4)
    return out
