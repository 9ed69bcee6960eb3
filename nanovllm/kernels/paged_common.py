"""What the paged-attention kernels share: K/V tile loads through the block table, the online-softmax step and
the host-side argument checks. The kernels: ``prefill_attention`` (varlen, mixed prefill/decode batches) and
``decode_attention`` (split-KV flash-decoding); their semantics are those of ``nanovllm.attention.torch_ref``.

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
* An e4m3 cache (``FP8``) is read with its per-(token, KV head) float32 scales: a key tile is converted
  exactly and its scales multiply the scores after the dot. The prefill kernel dequantizes a value tile in
  registers (value * scale, float32, then the dot dtype), as ``torch_ref`` dequantizes the cache; the decode
  kernel computes in float16 and folds each value's scale into its probability instead (measured 1.11x on
  Qwen3-8B FP8 end to end, 2026-12-01). It reads an e4m3 cache at ~2.9-3.0 TB/s where a bf16 one reaches ~4.2
  (``kernel_bench.py decode``); more tiles in flight (deeper pipelines) and the score product on FP8 wgmma
  were both measured slower (benchmarks/RESULTS.md, the decode-attention row).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanovllm.kernels._common import check_float, check_int, check_kv_scales, check_same_device, is_pow2

LOG2E = 1.4426950408889634


@triton.jit
def kv_slots(bt_row, n0, offs_n, n_limit, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr):
    """(physical block, offset in it), int64, of keys n0 + offs_n."""
    if BLOCK_SIZE % BLOCK_N == 0:
        # the whole tile sits in one physical block (tiles start at multiples of BLOCK_N)
        blk = tl.load(bt_row + n0 // BLOCK_SIZE).to(tl.int64)
        pos = ((n0 % BLOCK_SIZE) + offs_n).to(tl.int64)
    else:
        n = n0 + offs_n
        if MASKED:
            blk = tl.load(bt_row + n // BLOCK_SIZE, mask=n < n_limit, other=0).to(tl.int64)
        else:
            blk = tl.load(bt_row + n // BLOCK_SIZE).to(tl.int64)
        pos = (n % BLOCK_SIZE).to(tl.int64)
    return blk, pos


@triton.jit
def kv_tile(K, V, KS, VS, Q, bt_row, n0, offs_n, offs_d, n_limit, n_ok, head_off, kvh, stride_kb, stride_ks,
            stride_sb, stride_ss, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
            UPCAST: tl.constexpr, FP8: tl.constexpr):
    """The (BLOCK_N, HEAD_DIM) key and value tiles of keys n0 + offs_n of one KV head (head_off = its element
    offset, kvh its index), in the query's (Q's) dtype, or float32 when UPCAST, and the keys' (BLOCK_N,) scales.
    FP8: the keys as stored (scale them by the returned scales: 1.0 otherwise), the values dequantized.
    MASKED: keys at or past n_limit (n_ok = n0 + offs_n < n_limit, False) read as zeros."""
    blk, pos = kv_slots(bt_row, n0, offs_n, n_limit, BLOCK_SIZE, BLOCK_N, MASKED)
    rows = blk * stride_kb + pos * stride_ks + head_off
    if MASKED:
        k = tl.load(K + rows[:, None] + offs_d[None, :], mask=n_ok[:, None], other=0.0)
        v = tl.load(V + rows[:, None] + offs_d[None, :], mask=n_ok[:, None], other=0.0)
    else:
        k = tl.load(K + rows[:, None] + offs_d[None, :])
        v = tl.load(V + rows[:, None] + offs_d[None, :])
    return kv_convert(k, v, KS, VS, Q, blk, pos, n_ok, kvh, stride_sb, stride_ss, BLOCK_N, MASKED, UPCAST, FP8)


@triton.jit
def kv_convert(k, v, KS, VS, Q, blk, pos, n_ok, kvh, stride_sb, stride_ss, BLOCK_N: tl.constexpr,
               MASKED: tl.constexpr, UPCAST: tl.constexpr, FP8: tl.constexpr):
    """K and V tiles as loaded (keys at physical block blk, a scalar or per key, and offsets pos in it) -> the
    tiles in the query's (Q's) dtype, or float32 when UPCAST, and the keys' (BLOCK_N,) scales (1.0 unless FP8).
    FP8: the keys converted as stored (exact; the caller scales the scores by the returned scales), the values
    dequantized (value * scale in float32); MASKED: the scales of keys with n_ok False read as 0."""
    dt = tl.float32 if UPCAST else Q.dtype.element_ty
    if FP8:
        srows = blk * stride_sb + pos * stride_ss + kvh
        if MASKED:
            ks = tl.load(KS + srows, mask=n_ok, other=0.0)
            vs = tl.load(VS + srows, mask=n_ok, other=0.0)
        else:
            ks = tl.load(KS + srows)
            vs = tl.load(VS + srows)
        k = k.to(dt)
        v = (v.to(tl.float32) * vs[:, None]).to(dt)
    else:
        ks = tl.full([BLOCK_N], 1.0, tl.float32)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
    return k, v, ks


@triton.jit
def online_softmax_step(qk, v, m_i, l_i, acc, PREC: tl.constexpr, SOME_ROWS_EMPTY: tl.constexpr):
    """Fold one tile of scores qk (base-2 logits, masked keys at -inf) and its values into the running
    max m_i, denominator l_i and output acc. SOME_ROWS_EMPTY: a row may have no visible key yet."""
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new) if SOME_ROWS_EMPTY else m_new
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(qk - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
    return m_new, l_i, acc


def check_paged_args(fn: str, q, k_cache, v_cache, seq_lens, block_tables, out, out_shape, k_scales=None,
                     v_scales=None):
    """Checks the arguments; returns (out, seq_lens, H, Hkv, D, block_size, B, (FP8, scales' block stride, their
    slot stride))."""
    check_float(f"{fn}: q", q)
    if q.dim() != 3:
        raise ValueError(f"{fn}: q must be 3-D, got {tuple(q.shape)}")
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(f"{fn}: k_cache/v_cache must both be (num_blocks, block_size, num_kv_heads, head_dim), "
                         f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    fp8 = check_kv_scales(fn, k_cache, v_cache, k_scales, v_scales)
    if not fp8[0] and (k_cache.dtype != q.dtype or v_cache.dtype != q.dtype):
        raise ValueError(f"{fn}: cache dtype ({k_cache.dtype}/{v_cache.dtype}) must equal q dtype {q.dtype} "
                         f"(or be float8_e4m3fn, with scales)")
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
    return out, seq_lens, H, Hkv, D, block_size, B, fp8
