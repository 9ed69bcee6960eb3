"""Paged attention over the block-table KV cache: a varlen (mixed prefill/decode) flash-attention kernel and a
split-KV (flash-decoding) decode kernel. Semantics are those of ``nanovllm.attention.torch_ref``.

Common design points
--------------------
* K/V live in ``(num_blocks, block_size, num_kv_heads, head_dim)`` caches; a tile of ``BLOCK_N`` keys is
  addressed through the sequence's block-table row. When ``block_size % BLOCK_N == 0`` a tile lies inside one
  physical block (one scalar block-table load per tile); otherwise every key looks up its own block.
* GQA packing: a program owns one KV head and processes all ``G = H // Hkv`` query heads that share it, stacked
  along the M dimension of the ``tl.dot`` (row ``r`` = query ``r // G_PAD``, head ``r % G_PAD``), so each K/V tile
  is loaded once per KV head. ``G`` is padded to a power of two; padded rows are masked out.
* Online softmax in float32 in the log2 domain (``exp2``); the scale is folded into one multiply.
* Keys past a sequence's length are never used: their loads are masked (stale or uninitialised cache memory,
  even NaN, cannot leak into the output). Sequences with ``seq_len == 0`` produce zeros.
* No host syncs: every launch size comes from tensor shapes (and the host int ``max_seqlen_q``).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanovllm.kernels._common import (
    check_float,
    check_int,
    check_same_device,
    dot_precision,
    is_pow2,
    next_pow2,
    sm_count,
    upcast_dots,
)

_LOG2E = 1.4426950408889634


# ----------------------------------------------------------------------------------------------------------------
# shared device helpers
# ----------------------------------------------------------------------------------------------------------------

@triton.jit
def _kv_rows(bt_row, n0, offs_n, n_limit, stride_kb, stride_ks,
             BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr):
    """Element offsets (int64, without head/dim terms) of the cache rows holding keys n0 + offs_n."""
    if BLOCK_SIZE % BLOCK_N == 0:
        # the whole tile sits in one physical block (tiles start at multiples of BLOCK_N)
        blk = tl.load(bt_row + n0 // BLOCK_SIZE).to(tl.int64)
        rows = blk * stride_kb + ((n0 % BLOCK_SIZE) + offs_n).to(tl.int64) * stride_ks
    else:
        n = n0 + offs_n
        if MASKED:
            blk = tl.load(bt_row + n // BLOCK_SIZE, mask=n < n_limit, other=0).to(tl.int64)
        else:
            blk = tl.load(bt_row + n // BLOCK_SIZE).to(tl.int64)
        rows = blk * stride_kb + (n % BLOCK_SIZE).to(tl.int64) * stride_ks
    return rows


@triton.jit
def _kv_tile(K, V, bt_row, n0, offs_n, offs_d, n_limit, n_ok, head_off, stride_kb, stride_ks,
             BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, UPCAST: tl.constexpr):
    """The (BLOCK_N, HEAD_DIM) key and value tiles of keys n0 + offs_n of one KV head, upcast to float32 when
    UPCAST. MASKED: keys at or past n_limit (n_ok = n0 + offs_n < n_limit, False) read as zeros."""
    rows = _kv_rows(bt_row, n0, offs_n, n_limit, stride_kb, stride_ks, BLOCK_SIZE, BLOCK_N, MASKED) + head_off
    if MASKED:
        k = tl.load(K + rows[:, None] + offs_d[None, :], mask=n_ok[:, None], other=0.0)
        v = tl.load(V + rows[:, None] + offs_d[None, :], mask=n_ok[:, None], other=0.0)
    else:
        k = tl.load(K + rows[:, None] + offs_d[None, :])
        v = tl.load(V + rows[:, None] + offs_d[None, :])
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    return k, v


# ----------------------------------------------------------------------------------------------------------------
# prefill / mixed batch
# ----------------------------------------------------------------------------------------------------------------

@triton.jit
def _online_softmax_step(qk, v, m_i, l_i, acc, PREC: tl.constexpr, SOME_ROWS_EMPTY: tl.constexpr):
    """Fold one tile of scores qk (base-2 logits, masked keys at -inf) and its values into the running
    max m_i, denominator l_i and output acc. SOME_ROWS_EMPTY: a row may have no visible key yet."""
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new) if SOME_ROWS_EMPTY else m_new
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(qk - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
    return m_new, l_i, acc


@triton.jit
def _prefill_tile(
    Q, K, V, Out, SEQ_LENS, BT, qk_scale, b, q_start, q_len, qb, kvh,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_kb, stride_ks, stride_kh, stride_bt,
    G: tl.constexpr, G_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr,
):
    """Query tile qb (BLOCK_Q queries x the G heads of KV head kvh) of sequence b."""
    seq_len = tl.load(SEQ_LENS + b).to(tl.int32)
    ctx = seq_len - q_len                      # cached tokens before this step's queries
    offs_m = tl.arange(0, BLOCK_M)
    qi = qb * BLOCK_Q + offs_m // G_PAD        # query index within the sequence
    g = offs_m % G_PAD
    row_ok = (qi < q_len) & (g < G)
    q_abs = ctx + qi                           # absolute position of each row's query
    head = kvh * G + g
    tok = (q_start + qi).to(tl.int64)
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + tok[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=row_ok[:, None], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    first = ctx + qb * BLOCK_Q                 # smallest query position of the tile
    kv_end = tl.maximum(tl.minimum(first + BLOCK_Q, seq_len), 0)   # no key at/after this is visible
    full_end = tl.maximum(tl.minimum(first + 1, kv_end), 0) // BLOCK_N * BLOCK_N  # visible to every row

    bt_row = BT + b.to(tl.int64) * stride_bt
    head_off = kvh.to(tl.int64) * stride_kh
    offs_n = tl.arange(0, BLOCK_N)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)

    # tiles strictly below the causal diagonal of every row: no masks at all
    for n0 in range(0, full_end, BLOCK_N):
        k, v = _kv_tile(K, V, bt_row, n0, offs_n, offs_d, kv_end, None, head_off, stride_kb, stride_ks,
                        BLOCK_SIZE, BLOCK_N, False, UPCAST)
        qk = tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale
        m_i, l_i, acc = _online_softmax_step(qk, v, m_i, l_i, acc, PREC, False)

    # tiles crossing the diagonal: causal + length masks
    for n0 in range(full_end, kv_end, BLOCK_N):
        n = n0 + offs_n
        n_ok = n < kv_end
        k, v = _kv_tile(K, V, bt_row, n0, offs_n, offs_d, kv_end, n_ok, head_off, stride_kb, stride_ks,
                        BLOCK_SIZE, BLOCK_N, True, UPCAST)
        qk = tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale
        visible = (n[None, :] <= q_abs[:, None]) & n_ok[None, :]
        qk = tl.where(visible, qk, float("-inf"))
        m_i, l_i, acc = _online_softmax_step(qk, v, m_i, l_i, acc, PREC, True)  # rows may see nothing yet

    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]            # seq_len 0 -> zeros
    tl.store(Out + tok[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
             out.to(Out.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def _seq_tiles(CU, offs_b, num_seqs, BLOCK_Q: tl.constexpr):
    """Query tiles of sequences offs_b (0 past num_seqs)."""
    ok = offs_b < num_seqs
    lo = tl.load(CU + offs_b, mask=ok, other=0).to(tl.int32)
    hi = tl.load(CU + offs_b + 1, mask=ok, other=0).to(tl.int32)
    return tl.where(ok, tl.cdiv(hi - lo, BLOCK_Q), 0)


# num_seqs and the block-table row stride change from step to step: specializing on them (divisible by 16, or
# 1) would compile new variants mid-run (seen on an H200: ~1 s stalls in the first steps of a benchmark)
@triton.jit(do_not_specialize=["num_seqs", "stride_bt"])
def _prefill_kernel(
    Q, K, V, Out, CU, SEQ_LENS, BT, qk_scale, num_seqs,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_bt,
    G: tl.constexpr, G_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_B: tl.constexpr,
    PERSISTENT: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr,
):
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    if PERSISTENT:
        # A fixed grid whose programs loop over the query tiles of all sequences, numbered exactly: sequence b
        # owns tiles [S(b), S(b) + cdiv(q_len(b), BLOCK_Q)), S the exclusive prefix sum. For short chunks in a
        # large padded batch (a mixed CUDA graph: hundreds of sequences, most without queries here), where one
        # program per possible tile would launch thousands of programs that do nothing.
        total = 0
        for b0 in range(0, num_seqs, BLOCK_B):
            total += tl.sum(_seq_tiles(CU, b0 + tl.arange(0, BLOCK_B), num_seqs, BLOCK_Q), axis=0)
        for t in range(pid, total, tl.num_programs(0)):
            b = 0
            first = 0
            carry = 0
            for b0 in range(0, num_seqs, BLOCK_B):
                offs_b = b0 + tl.arange(0, BLOCK_B)
                n = _seq_tiles(CU, offs_b, num_seqs, BLOCK_Q)
                start = tl.cumsum(n, axis=0) - n + carry
                # the last hit is this tile's sequence (one without tiles shares the next one's start)
                hit = start <= t
                b = tl.maximum(b, tl.max(tl.where(hit, offs_b, 0), axis=0))
                first = tl.maximum(first, tl.max(tl.where(hit, start, 0), axis=0))
                carry += tl.sum(n, axis=0)
            q_start = tl.load(CU + b).to(tl.int32)
            q_len = tl.load(CU + b + 1).to(tl.int32) - q_start
            _prefill_tile(Q, K, V, Out, SEQ_LENS, BT, qk_scale, b, q_start, q_len, t - first, kvh,
                          stride_qt, stride_qh, stride_ot, stride_oh, stride_kb, stride_ks, stride_kh, stride_bt,
                          G, G_PAD, BLOCK_Q, BLOCK_M, BLOCK_N, HEAD_DIM, BLOCK_SIZE, PREC, UPCAST)
    else:
        # Axis 0 enumerates query tiles of all sequences: sequence b owns tiles [start(b), start(b + 1)) with
        # start(b) = cu[b] // BLOCK_Q + b, which always covers its cdiv(q_len, BLOCK_Q) tiles (surplus tiles
        # exit). The grid is T // BLOCK_Q + B, an upper bound computed on the host without reading device values.
        # start() is strictly increasing, so this tile's sequence is (number of starts <= pid) - 1: one vector
        # load of cu_seqlens and a reduction instead of a chain of dependent loads.
        # BLOCK_B is fixed (not sized to the batch), so one compiled kernel serves every batch size
        b = -1
        for b0 in range(0, num_seqs, BLOCK_B):
            offs_b = b0 + tl.arange(0, BLOCK_B)
            starts = tl.load(CU + offs_b, mask=offs_b < num_seqs, other=1 << 30).to(tl.int32) // BLOCK_Q + offs_b
            b += tl.sum((starts <= pid).to(tl.int32), axis=0)
        # cu[0] may be > 0 (rows before it belong to no sequence): the programs before sequence 0's first tile
        # find no sequence (b = -1) and exit below (qb < 0)
        b = tl.maximum(b, 0)
        q_start = tl.load(CU + b).to(tl.int32)
        q_len = tl.load(CU + b + 1).to(tl.int32) - q_start
        qb = pid - (q_start // BLOCK_Q + b)
        if (qb >= 0) & (qb * BLOCK_Q < q_len):
            _prefill_tile(Q, K, V, Out, SEQ_LENS, BT, qk_scale, b, q_start, q_len, qb, kvh,
                          stride_qt, stride_qh, stride_ot, stride_oh, stride_kb, stride_ks, stride_kh, stride_bt,
                          G, G_PAD, BLOCK_Q, BLOCK_M, BLOCK_N, HEAD_DIM, BLOCK_SIZE, PREC, UPCAST)


# ----------------------------------------------------------------------------------------------------------------
# decode (one query per sequence), optionally split along the KV length
# ----------------------------------------------------------------------------------------------------------------

@triton.jit(do_not_specialize=["stride_bt", "num_splits"])
def _decode_kernel(
    Q, K, V, Out, PART_O, PART_LSE, SEQ_LENS, BT, ORDER, qk_scale, num_splits,
    stride_qb, stride_qh, stride_ob, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_bt,
    G: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, SPLIT: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr,
    USE_ORDER: tl.constexpr, SKIP_EMPTY: tl.constexpr,
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
    for n0 in range(start, end, BLOCK_N):
        n = n0 + offs_n
        n_ok = n < end
        k, v = _kv_tile(K, V, bt_row, n0, offs_n, offs_d, end, n_ok, head_off, stride_kb, stride_ks,
                        BLOCK_SIZE, BLOCK_N, True, UPCAST)
        qk = tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale
        qk = tl.where(n_ok[None, :], qk, float("-inf"))
        m_i, l_i, acc = _online_softmax_step(qk, v, m_i, l_i, acc, PREC, False)  # every tile has a valid key

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


# ----------------------------------------------------------------------------------------------------------------
# host wrappers
# ----------------------------------------------------------------------------------------------------------------

def _check_common(fn: str, q, k_cache, v_cache, seq_lens, block_tables, out, out_shape):
    check_float(f"{fn}: q", q)
    if q.dim() != 3:
        raise ValueError(f"{fn}: q must be 3-D, got {tuple(q.shape)}")
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(f"{fn}: k_cache/v_cache must both be (num_blocks, block_size, num_kv_heads, head_dim), "
                         f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(f"{fn}: cache dtype ({k_cache.dtype}/{v_cache.dtype}) must equal q dtype {q.dtype}")
    if k_cache.stride() != v_cache.stride():
        raise ValueError(f"{fn}: k_cache and v_cache must have the same strides, got {tuple(k_cache.stride())} "
                         f"and {tuple(v_cache.stride())}")
    _, H, D = q.shape
    _, block_size, Hkv, Dk = k_cache.shape
    if Dk != D:
        raise ValueError(f"{fn}: head_dim of q ({D}) and cache ({Dk}) differ")
    if not is_pow2(D) or D < 16:
        raise ValueError(f"{fn}: head_dim must be a power of two >= 16, got {D}")
    if Hkv == 0 or H % Hkv:
        raise ValueError(f"{fn}: num_heads ({H}) must be a multiple of num_kv_heads ({Hkv})")
    if q.stride(2) != 1 or k_cache.stride(3) != 1:
        raise ValueError(f"{fn}: q and the caches need a contiguous head_dim, got strides {tuple(q.stride())} "
                         f"and {tuple(k_cache.stride())}")
    check_int(f"{fn}: seq_lens", seq_lens)
    check_int(f"{fn}: block_tables", block_tables)
    B = seq_lens.shape[0]
    if seq_lens.dim() != 1 or block_tables.dim() != 2 or block_tables.shape[0] != B:
        raise ValueError(f"{fn}: seq_lens must be (B,) and block_tables (B, max_blocks), got "
                         f"{tuple(seq_lens.shape)} and {tuple(block_tables.shape)}")
    if block_tables.shape[1] > 1 and block_tables.stride(1) != 1:
        raise ValueError(f"{fn}: block_tables rows must be contiguous, got strides {tuple(block_tables.stride())}")
    check_same_device(q=q, k_cache=k_cache, v_cache=v_cache, seq_lens=seq_lens, block_tables=block_tables)
    if out is None:
        out = torch.empty(out_shape, dtype=q.dtype, device=q.device)
    else:
        if tuple(out.shape) != tuple(out_shape) or out.dtype != q.dtype or out.device != q.device:
            raise ValueError(f"{fn}: out must be {tuple(out_shape)} {q.dtype} on {q.device}, got "
                             f"{tuple(out.shape)} {out.dtype} on {out.device}")
        if out.stride(2) != 1:
            raise ValueError(f"{fn}: out needs a contiguous head_dim, got strides {tuple(out.stride())}")
    seq_lens = seq_lens if seq_lens.is_contiguous() else seq_lens.contiguous()
    return out, seq_lens, H, Hkv, D, block_size, B


_PREFILL_BLOCK_B = 128  # sequences looked up per step of the tile -> sequence search


def _prefill_config(D: int, G_PAD: int, max_seqlen_q: int, dtype=torch.bfloat16):
    """(BLOCK_M, BLOCK_N, num_warps, num_stages): heuristics for Hopper (wgmma for BLOCK_M >= 64), checked to
    compile for sm_90 without register spills in half precision."""
    if dtype == torch.float32:  # exact fp32 dots (FMA, not tensor cores): keep tiles small; a debug path
        bm_max, block_n = 64, 32
    elif D <= 128:
        bm_max, block_n = 128, 64
    else:
        bm_max, block_n = 64, 32
    # two tile heights only (short chunks / decode rows, and long prefills), so at most two compiled variants
    block_m = min(bm_max, 32 if max_seqlen_q * G_PAD <= 32 else bm_max)
    block_m = max(block_m, G_PAD)
    warps = 8 if (block_m >= 128 or D > 128) and dtype != torch.float32 else 4
    return block_m, block_n, warps, 2


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                            scale: float, max_seqlen_q: int, out: torch.Tensor | None = None, *,
                            persistent: bool = False) -> torch.Tensor:
    """Causal attention of a flat batch of queries over the paged cache (same semantics as ``paged_attention_ref``).

    Args:
        q: (T, H, D); may be a strided view (contiguous head_dim).
        k_cache, v_cache: (num_blocks, block_size, Hkv, D), same dtype as q; this step's K/V already stored.
        cu_seqlens_q: (B + 1,) int query offsets; seq_lens: (B,) int; block_tables: (B, max_blocks) int, -1 pad.
        scale: softmax scale. max_seqlen_q: host int >= every q_len (only sizes the tiles; not read on device).
        out: optional (T, H, D) output buffer.
        persistent: launch a fixed grid of about two programs per SM that loop over the query tiles, numbered
            exactly on the device, instead of one program per possible tile (``T // BLOCK_Q + B``, most of which
            exit at once when few of the B sequences have queries: a mixed step's chunks in a padded graph).
    Rows of ``out`` outside ``cu_seqlens_q[0] .. cu_seqlens_q[-1]`` are left untouched.
    """
    T = q.shape[0] if q.dim() == 3 else -1
    out, seq_lens, H, Hkv, D, block_size, B = _check_common(
        "paged_prefill_attention", q, k_cache, v_cache, seq_lens, block_tables, out, q.shape)
    check_int("paged_prefill_attention: cu_seqlens_q", cu_seqlens_q)
    if cu_seqlens_q.dim() != 1 or cu_seqlens_q.shape[0] != B + 1:
        raise ValueError(f"paged_prefill_attention: cu_seqlens_q must be (B + 1 = {B + 1},), got "
                         f"{tuple(cu_seqlens_q.shape)}")
    check_same_device(q=q, cu_seqlens_q=cu_seqlens_q)
    cu_seqlens_q = cu_seqlens_q if cu_seqlens_q.is_contiguous() else cu_seqlens_q.contiguous()
    if T == 0 or B == 0:
        return out
    G = H // Hkv
    G_PAD = next_pow2(G)
    BLOCK_M, BLOCK_N, warps, stages = _prefill_config(D, G_PAD, max(int(max_seqlen_q), 1), q.dtype)
    BLOCK_Q = BLOCK_M // G_PAD
    if persistent:
        grid = (max(1, min(T // BLOCK_Q + B, triton.cdiv(2 * sm_count(q.device), Hkv))), Hkv)
    else:
        grid = (T // BLOCK_Q + B, Hkv)
    _prefill_kernel[grid](
        q, k_cache, v_cache, out, cu_seqlens_q, seq_lens, block_tables, float(scale) * _LOG2E, B,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        G=G, G_PAD=G_PAD, BLOCK_Q=BLOCK_Q, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, HEAD_DIM=D,
        BLOCK_SIZE=block_size, BLOCK_B=_PREFILL_BLOCK_B, PERSISTENT=bool(persistent), PREC=dot_precision(q.dtype),
        UPCAST=upcast_dots(q.dtype), num_warps=warps, num_stages=stages,
    )
    return out


_MAX_SPLITS = 32
_MIN_TOKENS_PER_SPLIT = 256


def _decode_block_n(D: int, dtype=torch.bfloat16) -> int:
    return 64 if D <= 128 and dtype != torch.float32 else 32


def _decode_launch(D: int, dtype) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages) of the decode kernel: the best of a sweep on an H200 for head_dim <= 128
    in half precision (RESULTS run 7)."""
    if D <= 128 and dtype != torch.float32:
        return 128, 4, 3
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


def decode_workspace_numel(batch: int, num_heads: int, head_dim: int, num_splits: int = _MAX_SPLITS) -> int:
    """float32 elements of the split-KV workspace for up to ``batch`` sequences and ``num_splits`` splits."""
    return batch * num_heads * num_splits * (head_dim + 1)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seq_lens: torch.Tensor,
                           block_tables: torch.Tensor, scale: float, out: torch.Tensor | None = None, *,
                           num_splits: int | None = None, workspace: torch.Tensor | None = None,
                           order: torch.Tensor | None = None, skip_empty: bool = False) -> torch.Tensor:
    """One query per sequence at position seq_len - 1 (``paged_attention_ref`` with cu_seqlens_q = arange(B+1)).

    Args:
        q: (B, H, D); may be a strided view (contiguous head_dim).
        k_cache, v_cache: (num_blocks, block_size, Hkv, D) with q's dtype.
        seq_lens: (B,) int, 0 = padding (outputs zeros); block_tables: (B, max_blocks) int, -1 padded.
        scale: softmax scale. out: optional (B, H, D) output buffer.
        num_splits: KV splits (1 = single pass, no workspace); default: ``decode_num_splits`` of the shapes.
        workspace: optional flat float32 buffer of >= ``decode_workspace_numel(B, H, D, num_splits)`` elements
            (otherwise one is allocated, sized from shapes only).
        order: optional (B,) int permutation of 0..B-1: the order in which sequences are launched (not checked on
            the device: anything else leaves rows unwritten). Longest first balances the GPU's tail: the programs
            of long sequences start early and short ones fill the gaps. Results don't depend on it.
        skip_empty: leave the rows of sequences with seq_len 0 untouched instead of writing zeros (another kernel
            may be writing them at the same time: a mixed step's varlen half).
    CUDA-graph safe: no host sync, launch sizes and allocations depend on shapes only.
    """
    fn = "paged_decode_attention"
    out, seq_lens, H, Hkv, D, block_size, B = _check_common(fn, q, k_cache, v_cache, seq_lens, block_tables, out,
                                                            q.shape)
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
    BLOCK_N, warps, stages = _decode_launch(D, q.dtype)
    prec = dot_precision(q.dtype)
    common = dict(G=G, BLOCK_G=BLOCK_G, BLOCK_N=BLOCK_N, HEAD_DIM=D, BLOCK_SIZE=block_size, SPLIT=num_splits > 1,
                  PREC=prec, UPCAST=upcast_dots(q.dtype), USE_ORDER=order is not None,
                  SKIP_EMPTY=bool(skip_empty), num_warps=warps, num_stages=stages)
    grid = (Hkv, B, num_splits)
    strides = (q.stride(0), q.stride(1), out.stride(0), out.stride(1),
               k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0))
    qk_scale = float(scale) * _LOG2E
    if num_splits == 1:
        _decode_kernel[grid](q, k_cache, v_cache, out, out, out, seq_lens, block_tables,
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
    _decode_kernel[grid](q, k_cache, v_cache, out, part_o, part_lse, seq_lens, block_tables,
                         seq_lens if order is None else order, qk_scale, num_splits, *strides, **common)
    # one padded width for every split count up to _MAX_SPLITS: one compiled variant
    _decode_reduce_kernel[(B, H)](part_o, part_lse, out, out.stride(0), out.stride(1), num_splits,
                                  SPLITS_PAD=next_pow2(max(num_splits, _MAX_SPLITS)), HEAD_DIM=D,
                                  SKIP_EMPTY=bool(skip_empty), num_warps=4)
    return out
