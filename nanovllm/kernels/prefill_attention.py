"""Varlen paged attention: causal attention of a flat batch of query chunks (whole prompts, chunks of them, single
decode rows) over each sequence's paged KV cache, flash-attention style (``nanovllm.kernels.paged_common`` for
the design points; reference ``nanovllm.attention.torch_ref.paged_attention_ref``; tile configs in
``nanovllm.kernels.prefill_config``).

A program owns one query tile of one sequence and a slot of query heads (all G heads of a KV head stacked along
M, or one head). Its KV loop is split in two: the tiles below the causal diagonal of every row (the cached
prefix of a chunk included) run with no mask at all, pipelined; then the one or two tiles that cross the diagonal
or the sequence's end, masked. K/V tiles come through the block table by pointers, or by TMA (host tensor
descriptors over the flattened cache) where the config asks and the cache allows. The launch order puts the
tiles that read the most keys first, so the last wave holds the short ones.

An e4m3 cache (``FP8``, a compile-time flag: the bf16/fp16 variants hold none of it) is read on either path with
its per-(token, KV head) float32 scales, as ``paged_common.kv_convert`` states: the FP8 tiles come in as stored
(TMA boxes of an fp8 descriptor, or pointer loads), their scales through pointers; keys are converted to the
query's dtype and their scales multiply the scores after the dot, values are dequantized in registers.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanovllm.kernels._common import (
    check_int,
    check_same_device,
    device_capability,
    dot_precision,
    next_pow2,
    sm_count,
    upcast_dots,
)
from nanovllm.kernels.paged_common import LOG2E, check_paged_args, kv_convert, kv_tile
from nanovllm.kernels.prefill_config import ORDERS, TileConfig, tile_config

_PREFILL_BLOCK_B = 128  # sequences looked up per step of the tile -> sequence searches


@triton.jit
def _kv_tiles(K, V, KS, VS, KD, VD, Q, bt_row, n0, offs_n, offs_d, n_limit, n_ok, kvh, head_off, stride_kb,
              stride_ks, stride_sb, stride_ss, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
              HEAD_DIM: tl.constexpr, MASKED: tl.constexpr, UPCAST: tl.constexpr, USE_TMA: tl.constexpr,
              FP8: tl.constexpr):
    """The (BLOCK_N, HEAD_DIM) K and V tiles of keys n0 + offs_n of KV head kvh, in the dot's dtype, and the keys'
    (BLOCK_N,) scales (FP8; 1.0 otherwise): the one place this kernel reads the cache. MASKED: keys at or past
    n_limit (n_ok False) are zero in V (K's are masked out of the scores)."""
    if USE_TMA:
        # the tile lies in one physical block (block_size % BLOCK_N == 0): one box of the (slots, Hkv * D) view
        blk = tl.load(bt_row + n0 // BLOCK_SIZE).to(tl.int32)
        row = blk * BLOCK_SIZE + n0 % BLOCK_SIZE
        k = KD.load([row, kvh * HEAD_DIM])
        v = VD.load([row, kvh * HEAD_DIM])
        pos = ((n0 % BLOCK_SIZE) + offs_n).to(tl.int64)   # the keys' slots, for an e4m3 cache's scales
        k, v, ks = kv_convert(k, v, KS, VS, Q, blk.to(tl.int64), pos, n_ok, kvh, stride_sb, stride_ss, BLOCK_N,
                              MASKED, UPCAST, FP8)
        if MASKED:  # slots past the sequence hold stale (even NaN) values: 0 * NaN would reach the output
            v = tl.where(n_ok[:, None], v, 0.0)
    else:
        k, v, ks = kv_tile(K, V, KS, VS, Q, bt_row, n0, offs_n, offs_d, n_limit, n_ok, head_off, kvh, stride_kb,
                           stride_ks, stride_sb, stride_ss, BLOCK_SIZE, BLOCK_N, MASKED, UPCAST, FP8)
    return k, v, ks


@triton.jit
def _kv_loop(acc, l_i, m_i, q, q_abs, K, V, KS, VS, KD, VD, Q, bt_row, lo, hi, kv_end, kvh, head_off, qk_scale,
             stride_kb, stride_ks, stride_sb, stride_ss, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
             HEAD_DIM: tl.constexpr, MASKED: tl.constexpr, STAGES: tl.constexpr, WS: tl.constexpr,
             PREC: tl.constexpr, UPCAST: tl.constexpr, USE_TMA: tl.constexpr, FP8: tl.constexpr):
    """Fold keys lo..hi (lo a multiple of BLOCK_N) into the online softmax (m_i, l_i: base-2 running max and
    denominator; acc: unnormalised output). Scores stay unscaled until one fused multiply-add in the exponent
    (qk_scale > 0, so the scaled row max is the row max scaled). MASKED: causal and length masks, and a row may
    have seen no key yet; otherwise every key is visible to every row. FP8: the scores of an e4m3 cache's keys
    are scaled by the keys' scales right after the dot (before the max)."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    for n0 in tl.range(lo, hi, BLOCK_N, num_stages=STAGES, warp_specialize=WS):
        n0 = tl.multiple_of(n0, BLOCK_N)
        n = n0 + offs_n
        n_ok = n < kv_end
        k, v, ks = _kv_tiles(K, V, KS, VS, KD, VD, Q, bt_row, n0, offs_n, offs_d, kv_end, n_ok, kvh, head_off,
                             stride_kb, stride_ks, stride_sb, stride_ss, BLOCK_SIZE, BLOCK_N, HEAD_DIM, MASKED,
                             UPCAST, USE_TMA, FP8)
        qk = tl.dot(q, tl.trans(k), input_precision=PREC)
        if FP8:
            qk = qk * ks[None, :]
        if MASKED:
            qk = tl.where((n[None, :] <= q_abs[:, None]) & n_ok[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        if MASKED:
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_use = m_new
        p = tl.exp2(qk * qk_scale - m_use[:, None])
        alpha = tl.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PREC)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _prefill_tile(
    Q, K, V, KS, VS, KD, VD, Out, SEQ_LENS, BT, qk_scale, b, q_start, q_len, qb, kvh, hs,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_kb, stride_ks, stride_kh, stride_bt, stride_sb, stride_ss,
    G: tl.constexpr, HPP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, STAGES: tl.constexpr, WS: tl.constexpr,
    PREC: tl.constexpr, UPCAST: tl.constexpr, USE_TMA: tl.constexpr, FP8: tl.constexpr,
):
    """Query tile qb (BLOCK_Q queries x HPP heads: row r is query r // HPP of head slot hs's head r % HPP) of
    sequence b, for KV head kvh."""
    seq_len = tl.load(SEQ_LENS + b).to(tl.int32)
    ctx = seq_len - q_len                      # cached tokens before this step's queries
    offs_m = tl.arange(0, BLOCK_M)
    qi = qb * BLOCK_Q + offs_m // HPP          # query index within the sequence
    g = hs * HPP + offs_m % HPP                # query head within the KV head's group
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
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    # the cached prefix and the tiles strictly below every row's diagonal: no masks, pipelined
    acc, l_i, m_i = _kv_loop(acc, l_i, m_i, q, q_abs, K, V, KS, VS, KD, VD, Q, bt_row, 0, full_end, kv_end, kvh,
                             head_off, qk_scale, stride_kb, stride_ks, stride_sb, stride_ss, BLOCK_SIZE, BLOCK_N,
                             HEAD_DIM, False, STAGES, WS, PREC, UPCAST, USE_TMA, FP8)
    # the tiles crossing the diagonal or the sequence's end
    acc, l_i, m_i = _kv_loop(acc, l_i, m_i, q, q_abs, K, V, KS, VS, KD, VD, Q, bt_row, full_end, kv_end, kv_end,
                             kvh, head_off, qk_scale, stride_kb, stride_ks, stride_sb, stride_ss, BLOCK_SIZE,
                             BLOCK_N, HEAD_DIM, True, STAGES, False, PREC, UPCAST, USE_TMA, FP8)
    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]            # seq_len 0 -> zeros
    tl.store(Out + tok[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
             out.to(Out.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def _seq_tiles(CU, SEQ_LENS, offs_b, num_seqs, BLOCK_Q: tl.constexpr):
    """Query tiles of sequences offs_b (0 past num_seqs) and the level of each one's last tile: its key count
    in units of BLOCK_Q, cdiv(seq_len, BLOCK_Q); tile j of a sequence with n tiles has level top - (n - 1 - j)."""
    ok = offs_b < num_seqs
    lo = tl.load(CU + offs_b, mask=ok, other=0).to(tl.int32)
    hi = tl.load(CU + offs_b + 1, mask=ok, other=0).to(tl.int32)
    n = tl.where(ok, tl.cdiv(hi - lo, BLOCK_Q), 0)
    top = tl.maximum(tl.cdiv(tl.load(SEQ_LENS + offs_b, mask=ok, other=0).to(tl.int32), BLOCK_Q), n)
    return n, top


@triton.jit
def _tiles_at_or_above(CU, SEQ_LENS, num_seqs, level, BLOCK_Q: tl.constexpr, BLOCK_B: tl.constexpr):
    count = 0
    for b0 in range(0, num_seqs, BLOCK_B):
        n, top = _seq_tiles(CU, SEQ_LENS, b0 + tl.arange(0, BLOCK_B), num_seqs, BLOCK_Q)
        count += tl.sum(tl.minimum(tl.maximum(top - level + 1, 0), n), axis=0)
    return count


@triton.jit
def _sorted_tile(CU, SEQ_LENS, num_seqs, r, BLOCK_Q: tl.constexpr, BLOCK_B: tl.constexpr):
    """The r-th query tile of the batch in decreasing order of level (ties: by sequence) -> (sequence, tile), the
    sequence -1 when r >= the number of tiles. The level is found by bisection on the count of tiles at or above a
    level, which falls as the level rises; the sequence by a running count of those with a tile there."""
    top_max = 0
    total = 0
    for b0 in range(0, num_seqs, BLOCK_B):
        n, top = _seq_tiles(CU, SEQ_LENS, b0 + tl.arange(0, BLOCK_B), num_seqs, BLOCK_Q)
        top_max = tl.maximum(top_max, tl.max(tl.where(n > 0, top, 0), axis=0))
        total += tl.sum(n, axis=0)
    lo = 1                  # count(lo) > r whenever r < total
    hi = top_max + 1        # count(hi) == 0 <= r
    while hi - lo > 1:
        mid = (lo + hi) // 2
        above = _tiles_at_or_above(CU, SEQ_LENS, num_seqs, mid, BLOCK_Q, BLOCK_B) > r
        lo = tl.where(above, mid, lo)
        hi = tl.where(above, hi, mid)
    k = r - _tiles_at_or_above(CU, SEQ_LENS, num_seqs, lo + 1, BLOCK_Q, BLOCK_B)  # index among level lo's tiles
    b = -1
    qb = 0
    seen = 0
    for b0 in range(0, num_seqs, BLOCK_B):
        offs_b = b0 + tl.arange(0, BLOCK_B)
        n, top = _seq_tiles(CU, SEQ_LENS, offs_b, num_seqs, BLOCK_Q)
        has = (n > 0) & (top - n < lo) & (lo <= top)
        hit = has & (tl.cumsum(has.to(tl.int32), axis=0) - 1 + seen == k)
        b = tl.maximum(b, tl.max(tl.where(hit, offs_b, -1), axis=0))
        qb = tl.maximum(qb, tl.max(tl.where(hit, n - 1 - (top - lo), 0), axis=0))
        seen += tl.sum(has.to(tl.int32), axis=0)
    return tl.where(r < total, b, -1), qb


@triton.jit
def _natural_tile(CU, num_seqs, r, BLOCK_Q: tl.constexpr, BLOCK_B: tl.constexpr):
    """Tile r of the one-slot-per-tile numbering: sequence b owns [start(b), start(b + 1)) with start(b) =
    cu[b] // BLOCK_Q + b, which always covers its cdiv(q_len, BLOCK_Q) tiles (surplus tiles exit). start() is
    strictly increasing, so r's sequence is (number of starts <= r) - 1: one vector load of cu_seqlens and a
    reduction instead of a chain of dependent loads. Returns (sequence, its tile index, its tile count)."""
    b = -1
    for b0 in range(0, num_seqs, BLOCK_B):
        offs_b = b0 + tl.arange(0, BLOCK_B)
        starts = tl.load(CU + offs_b, mask=offs_b < num_seqs, other=1 << 30).to(tl.int32) // BLOCK_Q + offs_b
        b += tl.sum((starts <= r).to(tl.int32), axis=0)
    # cu[0] may be > 0 (rows before it belong to no sequence): the slots before sequence 0's first tile find no
    # sequence (b = -1) and get a negative tile index
    b = tl.maximum(b, 0)
    q_start = tl.load(CU + b).to(tl.int32)
    n = tl.cdiv(tl.load(CU + b + 1).to(tl.int32) - q_start, BLOCK_Q)
    return b, r - (q_start // BLOCK_Q + b), n


# num_seqs and the block-table row stride change from step to step: specializing on them (divisible by 16, or
# 1) would compile new variants mid-run (seen on an H200: ~1 s stalls in the first steps of a benchmark)
@triton.jit(do_not_specialize=["num_seqs", "stride_bt"])
def _prefill_kernel(
    Q, K, V, KS, VS, KD, VD, Out, CU, SEQ_LENS, BT, qk_scale, num_seqs, num_slots,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_bt, stride_sb, stride_ss,
    G: tl.constexpr, HPP: tl.constexpr, SLOTS_PER_KV: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_B: tl.constexpr,
    PERSISTENT: tl.constexpr, ORDER: tl.constexpr, STAGES: tl.constexpr, WS: tl.constexpr,
    PREC: tl.constexpr, UPCAST: tl.constexpr, USE_TMA: tl.constexpr, FP8: tl.constexpr,
):
    if PERSISTENT:
        # A fixed grid whose programs loop over the query tiles of all sequences (axis 1: the head slot), numbered
        # exactly: sequence b owns tiles [S(b), S(b) + cdiv(q_len(b), BLOCK_Q)), S the exclusive prefix sum. For
        # short chunks in a large padded batch (a mixed CUDA graph: hundreds of sequences, most without queries
        # here), where one program per possible tile would launch thousands of programs that do nothing.
        slot = tl.program_id(1)
        kvh = slot // SLOTS_PER_KV
        hs = slot % SLOTS_PER_KV
        total = 0
        for b0 in range(0, num_seqs, BLOCK_B):
            n, _ = _seq_tiles(CU, SEQ_LENS, b0 + tl.arange(0, BLOCK_B), num_seqs, BLOCK_Q)
            total += tl.sum(n, axis=0)
        for t in range(tl.program_id(0), total, tl.num_programs(0)):
            b = 0
            first = 0
            carry = 0
            for b0 in range(0, num_seqs, BLOCK_B):
                offs_b = b0 + tl.arange(0, BLOCK_B)
                n, _ = _seq_tiles(CU, SEQ_LENS, offs_b, num_seqs, BLOCK_Q)
                start = tl.cumsum(n, axis=0) - n + carry
                # the last hit is this tile's sequence (one without tiles shares the next one's start)
                hit = start <= t
                b = tl.maximum(b, tl.max(tl.where(hit, offs_b, 0), axis=0))
                first = tl.maximum(first, tl.max(tl.where(hit, start, 0), axis=0))
                carry += tl.sum(n, axis=0)
            q_start = tl.load(CU + b).to(tl.int32)
            q_len = tl.load(CU + b + 1).to(tl.int32) - q_start
            _prefill_tile(Q, K, V, KS, VS, KD, VD, Out, SEQ_LENS, BT, qk_scale, b, q_start, q_len, t - first, kvh,
                          hs, stride_qt, stride_qh, stride_ot, stride_oh, stride_kb, stride_ks, stride_kh, stride_bt,
                          stride_sb, stride_ss, G, HPP, BLOCK_Q, BLOCK_M, BLOCK_N, HEAD_DIM, BLOCK_SIZE, STAGES, WS,
                          PREC, UPCAST, USE_TMA, FP8)
    else:
        # One program per (tile slot, head slot), the head slot fastest: the programs of one query tile launch
        # together, and the order over tiles is ORDER's (0 natural, 1 reverse, 2 sorted; see TileConfig.order).
        # The grid is (T // BLOCK_Q + B) * num_slots, an upper bound computed on the host without reading device
        # values; surplus programs exit.
        pid = tl.program_id(0)
        r = pid // num_slots
        slot = pid % num_slots
        kvh = slot // SLOTS_PER_KV
        hs = slot % SLOTS_PER_KV
        if ORDER == 2:
            b, qb = _sorted_tile(CU, SEQ_LENS, num_seqs, r, BLOCK_Q, BLOCK_B)
            valid = b >= 0
            b = tl.maximum(b, 0)
        else:
            b, qb, n = _natural_tile(CU, num_seqs, r, BLOCK_Q, BLOCK_B)
            valid = (qb >= 0) & (qb < n)
            if ORDER == 1:
                qb = n - 1 - qb
        if valid:
            q_start = tl.load(CU + b).to(tl.int32)
            q_len = tl.load(CU + b + 1).to(tl.int32) - q_start
            _prefill_tile(Q, K, V, KS, VS, KD, VD, Out, SEQ_LENS, BT, qk_scale, b, q_start, q_len, qb, kvh, hs,
                          stride_qt, stride_qh, stride_ot, stride_oh, stride_kb, stride_ks, stride_kh, stride_bt,
                          stride_sb, stride_ss, G, HPP, BLOCK_Q, BLOCK_M, BLOCK_N, HEAD_DIM, BLOCK_SIZE, STAGES, WS,
                          PREC, UPCAST, USE_TMA, FP8)


def _kv_descriptors(k_cache: torch.Tensor, v_cache: torch.Tensor, cfg: TileConfig):
    """Host tensor descriptors of [block_n, head_dim] boxes over the caches viewed as (slots, Hkv * D), in the
    cache's dtype (e4m3 included: its boxes are a head's bytes), or None when TMA is off for this call: the config
    does not ask, a KV tile would span physical blocks, the cache rows are not dense and 16-byte aligned (a box
    row under 16 bytes included), or the GPU predates Hopper. (Built per call: a CUDA graph captures the encoded
    descriptor by value, and the cache tensors never move.)"""
    num_blocks, block_size, Hkv, D = k_cache.shape
    if not cfg.tma or block_size % cfg.block_n or cfg.block_n > 256 or D > 256:
        return None
    if k_cache.device.type == "cuda" and device_capability(k_cache.device) < (9, 0):
        return None
    dense = (D, Hkv * D, block_size * Hkv * D, 1)
    if tuple(k_cache.stride()[i] for i in (2, 1, 0, 3)) != dense or k_cache.stride() != v_cache.stride():
        return None
    if (k_cache.data_ptr() | v_cache.data_ptr()) % 16 or (Hkv * D * k_cache.element_size()) % 16 or \
            D * k_cache.element_size() < 16:
        return None
    from triton.tools.tensor_descriptor import TensorDescriptor
    rows = num_blocks * block_size
    return tuple(TensorDescriptor(c.view(rows, Hkv * D), [rows, Hkv * D], [Hkv * D, 1], [cfg.block_n, D])
                 for c in (k_cache, v_cache))


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                            scale: float, max_seqlen_q: int, out: torch.Tensor | None = None, *,
                            persistent: bool = False, config: TileConfig | None = None,
                            k_scales: torch.Tensor | None = None, v_scales: torch.Tensor | None = None
                            ) -> torch.Tensor:
    """Causal attention of a flat batch of queries over the paged cache (same semantics as ``paged_attention_ref``).

    Args:
        q: (T, H, D); may be a strided view (contiguous head_dim).
        k_cache, v_cache: (num_blocks, block_size, Hkv, D), same dtype as q, or e4m3 with k_scales / v_scales
            (num_blocks, block_size, Hkv) float32; this step's K/V already stored.
        cu_seqlens_q: (B + 1,) int query offsets; seq_lens: (B,) int; block_tables: (B, max_blocks) int, -1 pad.
        scale: softmax scale (> 0). max_seqlen_q: host int >= every q_len (picks the tile config; not read on
            device).
        out: optional (T, H, D) output buffer.
        persistent: launch a fixed grid of about two programs per SM that loop over the query tiles, numbered
            exactly on the device, instead of one program per possible tile (``T // BLOCK_Q + B``, most of which
            exit at once when few of the B sequences have queries: a mixed step's chunks in a padded graph).
        config: the tile config to use instead of ``prefill_config.tile_config``'s choice (benchmarks, tests).
    Rows of ``out`` outside ``cu_seqlens_q[0] .. cu_seqlens_q[-1]`` are left untouched.
    """
    T = q.shape[0] if q.dim() == 3 else -1
    out, seq_lens, H, Hkv, D, block_size, B, (fp8, stride_sb, stride_ss) = check_paged_args(
        "paged_prefill_attention", q, k_cache, v_cache, seq_lens, block_tables, out, q.shape, k_scales, v_scales)
    check_int("paged_prefill_attention: cu_seqlens_q", cu_seqlens_q)
    if cu_seqlens_q.dim() != 1 or cu_seqlens_q.shape[0] != B + 1:
        raise ValueError(f"paged_prefill_attention: cu_seqlens_q must be (B + 1 = {B + 1},), got "
                         f"{tuple(cu_seqlens_q.shape)}")
    if not scale > 0:
        raise ValueError(f"paged_prefill_attention: scale must be > 0, got {scale}")
    if config is not None and not isinstance(config, TileConfig):
        raise TypeError(f"paged_prefill_attention: config must be a TileConfig, got {type(config).__name__}")
    check_same_device(q=q, cu_seqlens_q=cu_seqlens_q)
    cu_seqlens_q = cu_seqlens_q if cu_seqlens_q.is_contiguous() else cu_seqlens_q.contiguous()
    if T == 0 or B == 0:
        return out
    G = H // Hkv
    G_PAD = next_pow2(G)
    cfg = config if config is not None else tile_config(D, G_PAD, max(int(max_seqlen_q), 1), q.dtype, fp8)
    HPP = G_PAD if cfg.pack_gqa else 1
    if cfg.block_m < HPP:
        raise ValueError(f"paged_prefill_attention: config {cfg.name} has block_m {cfg.block_m} < the {HPP} "
                         f"query heads it packs")
    BLOCK_Q = cfg.block_m // HPP
    slots_per_kv = triton.cdiv(G, HPP)
    num_slots = Hkv * slots_per_kv
    descs = _kv_descriptors(k_cache, v_cache, cfg)
    kd, vd = descs if descs is not None else (None, None)
    if persistent:
        grid = (max(1, min(T // BLOCK_Q + B, triton.cdiv(2 * sm_count(q.device), num_slots))), num_slots)
    else:
        grid = ((T // BLOCK_Q + B) * num_slots,)
    _prefill_kernel[grid](
        q, k_cache, v_cache, k_scales if fp8 else k_cache, v_scales if fp8 else v_cache, kd, vd, out, cu_seqlens_q,
        seq_lens, block_tables, float(scale) * LOG2E, B, num_slots,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0), stride_sb, stride_ss,
        G=G, HPP=HPP, SLOTS_PER_KV=slots_per_kv, BLOCK_Q=BLOCK_Q, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        HEAD_DIM=D, BLOCK_SIZE=block_size, BLOCK_B=_PREFILL_BLOCK_B, PERSISTENT=bool(persistent),
        ORDER=ORDERS.index(cfg.order), STAGES=cfg.num_stages, WS=cfg.warp_specialize and descs is not None,
        PREC=dot_precision(q.dtype), UPCAST=upcast_dots(q.dtype), USE_TMA=descs is not None, FP8=fp8,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out
