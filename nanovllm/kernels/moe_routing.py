"""Mixture-of-experts routing on the device: top-k of the router's softmax, then the (token, j) pairs sorted by
expert into blocks of BLOCK_M rows (references: ``nanovllm.layers.moe_ref.route_ref`` / ``align_ref``).

Every shape is a function of the token count alone, so the kernels run inside CUDA graphs: buffers are sized for
the worst case (`max_blocks` blocks), grids are fixed, and nothing is read back to the host.

* ``moe_route``: one program per BLOCK_T tokens: softmax in float32, top-k by repeated argmax (ties to the lower
  expert index), optional renormalization.
* ``moe_align`` (two launches): the pairs are split into at most MAX_CHUNKS chunks; each chunk counts its pairs
  per expert and ranks each pair among its chunk's pairs of the same expert (a cumulative sum over a one-hot
  matrix, BLOCK_P pairs at a time). Then each chunk's program scans all the chunks' counts (a small tile, read by
  every program, so no single-program scan runs between the two launches) into each expert's padded start and
  its own offset within it, writes its pairs' indices to their rows, and labels its share of the blocks with
  their expert and real row count (-1 and 0 past the last). Pairs of one expert keep pair-index order, so the
  layout is deterministic.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanovllm.kernels._common import check_float, check_int, next_pow2
from nanovllm.layers.moe_ref import MoELayout, max_blocks

# Tile sizes, fixed (one compile serves every token count) and small enough that a (tile, experts) int32 matrix
# stays in registers at E=128: tokens per routing program, pairs per counting / scattering step, the most chunks
# the pairs are split into (the scan tile every scattering program reads), and blocks labelled per step.
BLOCK_T = 16
BLOCK_P = 64
MAX_CHUNKS = 32
BLOCK_B = 16


@triton.jit(do_not_specialize=["T"])
def _route_kernel(LOGITS, WEIGHTS, IDS, T, E, stride_t,
                  TOP_K: tl.constexpr, RENORM: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
                  K_PAD: tl.constexpr):
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_e = tl.arange(0, BLOCK_E)
    mask_t = offs_t < T
    mask_e = offs_e < E
    x = tl.load(LOGITS + offs_t.to(tl.int64)[:, None] * stride_t + offs_e[None, :],
                mask=mask_t[:, None] & mask_e[None, :], other=0.0).to(tl.float32)
    x = tl.where(mask_e[None, :], x, float("-inf"))
    p = tl.exp(x - tl.max(x, axis=1)[:, None])
    p = tl.where(mask_e[None, :], p, 0.0)
    probs = p / tl.sum(p, axis=1)[:, None]
    # a row of NaN / inf logits (a padding row's garbage) still picks top_k distinct real experts
    probs = tl.where(probs == probs, probs, -1.0)
    probs = tl.where(mask_e[None, :], probs, -2.0)
    offs_k = tl.arange(0, K_PAD)
    ids = tl.zeros((BLOCK_T, K_PAD), dtype=tl.int32)
    ws = tl.zeros((BLOCK_T, K_PAD), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        best = tl.max(probs, axis=1)
        idx = tl.argmax(probs, axis=1, tie_break_left=True)  # the lowest index among equal maxima
        ids = tl.where(offs_k[None, :] == j, idx[:, None], ids)
        ws = tl.where(offs_k[None, :] == j, best[:, None], ws)
        probs = tl.where(offs_e[None, :] == idx[:, None], -3.0, probs)
    if RENORM:
        ws = ws / tl.sum(ws, axis=1)[:, None]
    out = offs_t.to(tl.int64)[:, None] * TOP_K + offs_k[None, :]
    mask = mask_t[:, None] & (offs_k < TOP_K)[None, :]
    tl.store(IDS + out, ids, mask=mask)
    tl.store(WEIGHTS + out, ws, mask=mask)


def moe_route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(T, E) router logits (any float dtype, contiguous rows) -> (weights (T, top_k) float32, expert ids (T, top_k)
    int32), best first; as ``route_ref``."""
    check_float("moe_route: router_logits", router_logits)
    if router_logits.dim() != 2 or (router_logits.shape[1] > 1 and router_logits.stride(1) != 1):
        raise ValueError(f"moe_route: router_logits must be (T, E) with contiguous rows, got shape "
                         f"{tuple(router_logits.shape)} strides {tuple(router_logits.stride())}")
    T, E = router_logits.shape
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= E:
        raise ValueError(f"moe_route: top_k must be an int in [1, {E}], got {top_k!r}")
    dev = router_logits.device
    weights = torch.empty(T, top_k, dtype=torch.float32, device=dev)
    ids = torch.empty(T, top_k, dtype=torch.int32, device=dev)
    if T:
        _route_kernel[(triton.cdiv(T, BLOCK_T),)](
            router_logits, weights, ids, T, E, router_logits.stride(0), TOP_K=top_k, RENORM=bool(renormalize),
            BLOCK_T=BLOCK_T, BLOCK_E=max(16, next_pow2(E)), K_PAD=max(2, next_pow2(top_k)), num_warps=4)
    return weights, ids


@triton.jit(do_not_specialize=["N", "chunk_size"])
def _count_kernel(IDS, COUNTS, RANKS, N, E, chunk_size, BLOCK_P: tl.constexpr, BLOCK_E: tl.constexpr):
    chunk = tl.program_id(0)
    offs_e = tl.arange(0, BLOCK_E)
    running = tl.zeros((BLOCK_E,), dtype=tl.int32)  # this chunk's pairs per expert so far
    for p0 in range(0, chunk_size, BLOCK_P):
        offs_p = chunk * chunk_size + p0 + tl.arange(0, BLOCK_P)
        ok = offs_p < N  # (chunk_size: a multiple of BLOCK_P)
        ids = tl.load(IDS + offs_p, mask=ok, other=-1)
        hot = (ids[:, None] == offs_e[None, :]).to(tl.int32)                 # (BLOCK_P, BLOCK_E)
        before = tl.cumsum(hot, axis=0) - hot + running[None, :]               # earlier pairs of the same expert
        tl.store(RANKS + offs_p, tl.sum(before * hot, axis=1), mask=ok)
        running += tl.sum(hot, axis=0)
    tl.store(COUNTS + chunk * E + offs_e, running, mask=offs_e < E)


@triton.jit(do_not_specialize=["N", "chunk_size", "n_chunks", "n_blocks", "blocks_per_chunk"])
def _scatter_kernel(IDS, RANKS, COUNTS, SORTED, BLOCK_EXPERT, BLOCK_ROWS, N, E, chunk_size, n_chunks, n_blocks,
                    blocks_per_chunk, BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_E: tl.constexpr,
                    MAX_CHUNKS: tl.constexpr, BLOCK_B: tl.constexpr):
    chunk = tl.program_id(0)
    offs_e = tl.arange(0, BLOCK_E)
    mask_e = offs_e < E
    c = tl.arange(0, MAX_CHUNKS)
    counts = tl.load(COUNTS + c[:, None] * E + offs_e[None, :], mask=(c < n_chunks)[:, None] & mask_e[None, :],
                     other=0)                                                 # (MAX_CHUNKS, BLOCK_E)
    total = tl.sum(counts, axis=0)
    padded = (total + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded
    # this chunk's pairs of expert e go after the earlier chunks' ones
    offset = starts + tl.sum(tl.where((c < chunk)[:, None], counts, 0), axis=0)
    for p0 in range(0, chunk_size, BLOCK_P):
        offs_p = chunk * chunk_size + p0 + tl.arange(0, BLOCK_P)
        ok = offs_p < N  # (chunk_size: a multiple of BLOCK_P)
        ids = tl.load(IDS + offs_p, mask=ok, other=-1)
        base = tl.sum(tl.where(ids[:, None] == offs_e[None, :], offset[None, :], 0), axis=1)
        tl.store(SORTED + base + tl.load(RANKS + offs_p, mask=ok, other=0), offs_p, mask=ok)
    used = tl.sum(padded, axis=0)
    b_end = tl.minimum((chunk + 1) * blocks_per_chunk, n_blocks)
    for b0 in range(chunk * blocks_per_chunk, b_end, BLOCK_B):
        b = b0 + tl.arange(0, BLOCK_B)
        row = b * BLOCK_M
        # the expert whose padded rows hold `row`: the number of experts ending at or before it
        e = tl.sum(((ends[None, :] <= row[:, None]) & mask_e[None, :]).to(tl.int32), axis=1)
        hot = offs_e[None, :] == e[:, None]
        start = tl.sum(tl.where(hot, starts, 0), axis=1)
        count = tl.sum(tl.where(hot, total, 0), axis=1)
        rows = tl.minimum(tl.maximum(count - (row - start), 0), BLOCK_M)
        live = row < used
        tl.store(BLOCK_EXPERT + b, tl.where(live, e, -1), mask=b < b_end)
        tl.store(BLOCK_ROWS + b, tl.where(live, rows, 0), mask=b < b_end)


def chunking(num_pairs: int) -> tuple[int, int]:
    """(pairs per chunk, chunks) of moe_align's launches: chunks of BLOCK_P pairs, or of a multiple of it so that
    there are at most MAX_CHUNKS."""
    chunk = triton.cdiv(triton.cdiv(num_pairs, MAX_CHUNKS), BLOCK_P) * BLOCK_P
    return chunk, triton.cdiv(num_pairs, chunk)


def moe_align(ids: torch.Tensor, num_experts: int, block_m: int) -> MoELayout:
    """(T, top_k) expert ids in [0, num_experts) -> their expert-sorted layout (``align_ref``; padding rows of
    sorted_ids are left unwritten)."""
    check_int("moe_align: ids", ids)
    if ids.dim() != 2:
        raise ValueError(f"moe_align: ids must be (T, top_k), got shape {tuple(ids.shape)}")
    if block_m < 16 or block_m & (block_m - 1):
        raise ValueError(f"moe_align: block_m must be a power of two >= 16, got {block_m}")
    flat = ids.to(torch.int32).contiguous().view(-1)
    n = flat.numel()
    nb = max_blocks(n, num_experts, block_m)
    dev = ids.device
    sorted_ids = torch.empty(nb * block_m, dtype=torch.int32, device=dev)
    block_expert = torch.empty(nb, dtype=torch.int32, device=dev)
    block_rows = torch.empty(nb, dtype=torch.int32, device=dev)
    if n:
        chunk, chunks = chunking(n)
        counts = torch.empty(chunks, num_experts, dtype=torch.int32, device=dev)
        ranks = torch.empty(n, dtype=torch.int32, device=dev)
        be = max(16, next_pow2(num_experts))
        _count_kernel[(chunks,)](flat, counts, ranks, n, num_experts, chunk, BLOCK_P=BLOCK_P, BLOCK_E=be,
                                 num_warps=4)
        _scatter_kernel[(chunks,)](flat, ranks, counts, sorted_ids, block_expert, block_rows, n, num_experts, chunk,
                                   chunks, nb, triton.cdiv(nb, chunks), BLOCK_M=block_m, BLOCK_P=BLOCK_P, BLOCK_E=be,
                                   MAX_CHUNKS=MAX_CHUNKS, BLOCK_B=BLOCK_B, num_warps=4)
    return MoELayout(sorted_ids, block_expert, block_rows, block_m)
