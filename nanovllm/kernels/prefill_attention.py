"""Varlen paged attention: causal attention of a flat batch of query chunks (whole prompts, chunks of them, single
decode rows) over each sequence's paged KV cache, flash-attention style (``nanovllm.kernels.paged_common`` for
the design points; reference ``nanovllm.attention.torch_ref.paged_attention_ref``)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanovllm.kernels._common import check_int, check_same_device, dot_precision, next_pow2, sm_count, upcast_dots
from nanovllm.kernels.paged_common import LOG2E, check_paged_args, kv_tile, online_softmax_step


@triton.jit
def _prefill_tile(
    Q, K, V, KS, VS, Out, SEQ_LENS, BT, qk_scale, b, q_start, q_len, qb, kvh,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_kb, stride_ks, stride_kh, stride_bt, stride_sb, stride_ss,
    G: tl.constexpr, G_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr, FP8: tl.constexpr,
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
        k, v, ks = kv_tile(K, V, KS, VS, Q, bt_row, n0, offs_n, offs_d, kv_end, None, head_off, kvh, stride_kb,
                           stride_ks, stride_sb, stride_ss, BLOCK_SIZE, BLOCK_N, False, UPCAST, FP8)
        qk = tl.dot(q, tl.trans(k), input_precision=PREC)
        if FP8:
            qk = qk * (ks * qk_scale)[None, :]
        else:
            qk = qk * qk_scale
        m_i, l_i, acc = online_softmax_step(qk, v, m_i, l_i, acc, PREC, False)

    # tiles crossing the diagonal: causal + length masks
    for n0 in range(full_end, kv_end, BLOCK_N):
        n = n0 + offs_n
        n_ok = n < kv_end
        k, v, ks = kv_tile(K, V, KS, VS, Q, bt_row, n0, offs_n, offs_d, kv_end, n_ok, head_off, kvh, stride_kb,
                           stride_ks, stride_sb, stride_ss, BLOCK_SIZE, BLOCK_N, True, UPCAST, FP8)
        qk = tl.dot(q, tl.trans(k), input_precision=PREC)
        if FP8:
            qk = qk * (ks * qk_scale)[None, :]
        else:
            qk = qk * qk_scale
        visible = (n[None, :] <= q_abs[:, None]) & n_ok[None, :]
        qk = tl.where(visible, qk, float("-inf"))
        m_i, l_i, acc = online_softmax_step(qk, v, m_i, l_i, acc, PREC, True)  # rows may see nothing yet

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
    Q, K, V, KS, VS, Out, CU, SEQ_LENS, BT, qk_scale, num_seqs,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_bt, stride_sb, stride_ss,
    G: tl.constexpr, G_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_B: tl.constexpr,
    PERSISTENT: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr, FP8: tl.constexpr,
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
            _prefill_tile(Q, K, V, KS, VS, Out, SEQ_LENS, BT, qk_scale, b, q_start, q_len, t - first, kvh,
                          stride_qt, stride_qh, stride_ot, stride_oh, stride_kb, stride_ks, stride_kh, stride_bt,
                          stride_sb, stride_ss, G, G_PAD, BLOCK_Q, BLOCK_M, BLOCK_N, HEAD_DIM, BLOCK_SIZE, PREC,
                          UPCAST, FP8)
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
            _prefill_tile(Q, K, V, KS, VS, Out, SEQ_LENS, BT, qk_scale, b, q_start, q_len, qb, kvh,
                          stride_qt, stride_qh, stride_ot, stride_oh, stride_kb, stride_ks, stride_kh, stride_bt,
                          stride_sb, stride_ss, G, G_PAD, BLOCK_Q, BLOCK_M, BLOCK_N, HEAD_DIM, BLOCK_SIZE, PREC,
                          UPCAST, FP8)


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
                            persistent: bool = False, k_scales: torch.Tensor | None = None,
                            v_scales: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of a flat batch of queries over the paged cache (same semantics as ``paged_attention_ref``).

    Args:
        q: (T, H, D); may be a strided view (contiguous head_dim).
        k_cache, v_cache: (num_blocks, block_size, Hkv, D), same dtype as q, or e4m3 with k_scales / v_scales
            (num_blocks, block_size, Hkv) float32; this step's K/V already stored.
        cu_seqlens_q: (B + 1,) int query offsets; seq_lens: (B,) int; block_tables: (B, max_blocks) int, -1 pad.
        scale: softmax scale. max_seqlen_q: host int >= every q_len (only sizes the tiles; not read on device).
        out: optional (T, H, D) output buffer.
        persistent: launch a fixed grid of about two programs per SM that loop over the query tiles, numbered
            exactly on the device, instead of one program per possible tile (``T // BLOCK_Q + B``, most of which
            exit at once when few of the B sequences have queries: a mixed step's chunks in a padded graph).
    Rows of ``out`` outside ``cu_seqlens_q[0] .. cu_seqlens_q[-1]`` are left untouched.
    """
    T = q.shape[0] if q.dim() == 3 else -1
    out, seq_lens, H, Hkv, D, block_size, B, (fp8, stride_sb, stride_ss) = check_paged_args(
        "paged_prefill_attention", q, k_cache, v_cache, seq_lens, block_tables, out, q.shape, k_scales, v_scales)
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
        q, k_cache, v_cache, k_scales if fp8 else k_cache, v_scales if fp8 else v_cache, out, cu_seqlens_q, seq_lens,
        block_tables, float(scale) * LOG2E, B,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0), stride_sb, stride_ss,
        G=G, G_PAD=G_PAD, BLOCK_Q=BLOCK_Q, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, HEAD_DIM=D,
        BLOCK_SIZE=block_size, BLOCK_B=_PREFILL_BLOCK_B, PERSISTENT=bool(persistent), PREC=dot_precision(q.dtype),
        UPCAST=upcast_dots(q.dtype), FP8=fp8, num_warps=warps, num_stages=stages,
    )
    return out
