"""Mixture-of-experts routing on the device: top-k of the router's softmax, then the (token, j) pairs sorted by
expert into blocks of BLOCK_M rows (references: ``nanovllm.layers.moe_ref.route_ref`` / ``align_ref``).

Every shape is a function of the token count alone, so the kernels run inside CUDA graphs: buffers are sized for
the worst case (`max_blocks` blocks), grids are fixed, and nothing is read back to the host.

Two launches (``moe_route_align``):

* ``_route_kernel``: the tokens are split into at most MAX_CHUNKS chunks, one program each, BLOCK_T tokens at a
  time (a chunk is one tile up to MAX_CHUNKS * BLOCK_T = 1,024 tokens, eight at 8,192): softmax in float32, top-k
  by repeated argmax (ties to the lower expert index), optional renormalization. With COUNT it also counts the
  chunk's pairs per expert and ranks each pair among the chunk's earlier pairs of its expert: a token's top-k
  experts are distinct, so a pair's rank is the number of earlier tokens of the chunk that picked its expert (a
  cumulative sum over the tile's token x expert picks).
* ``_scatter_kernel``: each chunk's program scans all the chunks' counts (SCAN_C chunks' rows at a time, read by
  every program, so no single-program scan runs between the two launches) into each expert's padded start and
  its own offset within it, writes its pairs' indices to their rows, and labels its share of the blocks with
  their expert and real row count (-1 and 0 past the last). Pairs of one expert keep pair-index order, so the
  layout is deterministic.

``moe_route`` is the first kernel alone (weights and ids, for tests and benchmarks).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanovllm.kernels._common import check_float, next_pow2
from nanovllm.layers.moe_ref import MoELayout, max_blocks

# Tile sizes, fixed (one compile serves every token count) and small enough that a (tile, experts) int32 matrix
# stays in registers at E=128: tokens per routing step (8 tokens, 4 warps: 2.6 us at 256 tokens against 4.2 for
# 16 tokens a program in an H200 probe), pairs per scattering step, the most chunks (each scattering program reads
# every chunk's counts: 64 KB at E=128), the chunks' rows scanned per step, and blocks labelled per step.
BLOCK_T = 8
BLOCK_P = 64
MAX_CHUNKS = 128
SCAN_C = 32
BLOCK_B = 16


@triton.jit(do_not_specialize=["T", "chunk_tokens"])
def _route_kernel(LOGITS, WEIGHTS, IDS, RANKS, COUNTS, T, E, stride_t, chunk_tokens,
                  TOP_K: tl.constexpr, RENORM: tl.constexpr, COUNT: tl.constexpr, BLOCK_T: tl.constexpr,
                  BLOCK_E: tl.constexpr, K_PAD: tl.constexpr):
    chunk = tl.program_id(0)
    offs_e = tl.arange(0, BLOCK_E)
    mask_e = offs_e < E
    offs_k = tl.arange(0, K_PAD)
    running = tl.zeros((BLOCK_E,), dtype=tl.int32)  # this chunk's pairs per expert so far
    for t0 in range(0, chunk_tokens, BLOCK_T):  # (chunk_tokens: a multiple of BLOCK_T)
        offs_t = chunk * chunk_tokens + t0 + tl.arange(0, BLOCK_T)
        mask_t = offs_t < T
        x = tl.load(LOGITS + offs_t.to(tl.int64)[:, None] * stride_t + offs_e[None, :],
                    mask=mask_t[:, None] & mask_e[None, :], other=0.0).to(tl.float32)
        x = tl.where(mask_e[None, :], x, float("-inf"))
        p = tl.exp(x - tl.max(x, axis=1)[:, None])
        p = tl.where(mask_e[None, :], p, 0.0)
        probs = p / tl.sum(p, axis=1)[:, None]
        # a row of NaN / inf logits (a padding row's garbage) still picks top_k distinct real experts
        probs = tl.where(probs == probs, probs, -1.0)
        probs = tl.where(mask_e[None, :], probs, -2.0)
        ids = tl.zeros((BLOCK_T, K_PAD), dtype=tl.int32)
        ws = tl.zeros((BLOCK_T, K_PAD), dtype=tl.float32)
        for j in tl.static_range(TOP_K):
            best = tl.max(probs, axis=1)
            idx = tl.argmax(probs, axis=1, tie_break_left=True)  # the lowest index among equal maxima
            ids = tl.where(offs_k[None, :] == j, idx[:, None], ids)
            ws = tl.where(offs_k[None, :] == j, best[:, None], ws)
            probs = tl.where(offs_e[None, :] == idx[:, None], -3.0, probs)  # picked: below every other value
        if RENORM:
            ws = ws / tl.sum(ws, axis=1)[:, None]
        out = offs_t.to(tl.int64)[:, None] * TOP_K + offs_k[None, :]
        mask = mask_t[:, None] & (offs_k < TOP_K)[None, :]
        tl.store(IDS + out, ids, mask=mask)
        tl.store(WEIGHTS + out, ws, mask=mask)
        if COUNT:
            picked = ((probs == -3.0) & mask_t[:, None]).to(tl.int32)              # (BLOCK_T, BLOCK_E)
            before = tl.cumsum(picked, axis=0) - picked + running[None, :]          # earlier tokens' picks
            ranks = tl.zeros((BLOCK_T, K_PAD), dtype=tl.int32)
            for j in tl.static_range(TOP_K):
                e_j = tl.sum(tl.where(offs_k[None, :] == j, ids, 0), axis=1)
                r = tl.sum(tl.where(offs_e[None, :] == e_j[:, None], before, 0), axis=1)
                ranks = tl.where(offs_k[None, :] == j, r[:, None], ranks)
            tl.store(RANKS + out, ranks, mask=mask)
            running += tl.sum(picked, axis=0)
    if COUNT:
        tl.store(COUNTS + chunk * E + offs_e, running, mask=mask_e)


@triton.jit(do_not_specialize=["N", "chunk_size", "n_chunks", "n_blocks", "blocks_per_chunk"])
def _scatter_kernel(IDS, RANKS, COUNTS, SORTED, BLOCK_EXPERT, BLOCK_ROWS, N, E, chunk_size, n_chunks, n_blocks,
                    blocks_per_chunk, BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_E: tl.constexpr,
                    SCAN_C: tl.constexpr, BLOCK_B: tl.constexpr):
    chunk = tl.program_id(0)
    offs_e = tl.arange(0, BLOCK_E)
    mask_e = offs_e < E
    total = tl.zeros((BLOCK_E,), dtype=tl.int32)    # pairs per expert
    earlier = tl.zeros((BLOCK_E,), dtype=tl.int32)  # ... in the chunks before this one
    for c0 in range(0, n_chunks, SCAN_C):
        c = c0 + tl.arange(0, SCAN_C)
        counts = tl.load(COUNTS + c[:, None] * E + offs_e[None, :], mask=(c < n_chunks)[:, None] & mask_e[None, :],
                         other=0)                                             # (SCAN_C, BLOCK_E)
        total += tl.sum(counts, axis=0)
        earlier += tl.sum(tl.where((c < chunk)[:, None], counts, 0), axis=0)
    padded = (total + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded
    offset = starts + earlier  # this chunk's pairs of expert e go after the earlier chunks' ones
    p_end = tl.minimum((chunk + 1) * chunk_size, N)
    for p0 in range(0, chunk_size, BLOCK_P):
        offs_p = chunk * chunk_size + p0 + tl.arange(0, BLOCK_P)
        ok = offs_p < p_end
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


def chunking(num_tokens: int) -> tuple[int, int]:
    """(tokens per chunk, chunks) of the routing launch: BLOCK_T tokens, or a multiple of it so that there are at
    most MAX_CHUNKS chunks."""
    chunk = max(1, triton.cdiv(triton.cdiv(num_tokens, MAX_CHUNKS), BLOCK_T)) * BLOCK_T
    return chunk, triton.cdiv(num_tokens, chunk)


def _check_logits(fn: str, router_logits: torch.Tensor, top_k: int) -> None:
    check_float(f"{fn}: router_logits", router_logits)
    if router_logits.dim() != 2 or (router_logits.shape[1] > 1 and router_logits.stride(1) != 1):
        raise ValueError(f"{fn}: router_logits must be (T, E) with contiguous rows, got shape "
                         f"{tuple(router_logits.shape)} strides {tuple(router_logits.stride())}")
    E = router_logits.shape[1]
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= E:
        raise ValueError(f"{fn}: top_k must be an int in [1, {E}], got {top_k!r}")


def _route(router_logits: torch.Tensor, top_k: int, renormalize: bool, counts: torch.Tensor | None,
           ranks: torch.Tensor | None, chunk_tokens: int, chunks: int) -> tuple[torch.Tensor, torch.Tensor]:
    T, E = router_logits.shape
    dev = router_logits.device
    weights = torch.empty(T, top_k, dtype=torch.float32, device=dev)
    ids = torch.empty(T, top_k, dtype=torch.int32, device=dev)
    if T:
        count = counts is not None
        _route_kernel[(chunks,)](
            router_logits, weights, ids, ranks if count else ids, counts if count else ids, T, E,
            router_logits.stride(0), chunk_tokens, TOP_K=top_k, RENORM=bool(renormalize), COUNT=count,
            BLOCK_T=BLOCK_T, BLOCK_E=max(16, next_pow2(E)), K_PAD=max(2, next_pow2(top_k)), num_warps=4)
    return weights, ids


def moe_route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(T, E) router logits (any float dtype, contiguous rows) -> (weights (T, top_k) float32, expert ids (T, top_k)
    int32), best first; as ``route_ref``."""
    _check_logits("moe_route", router_logits, top_k)
    return _route(router_logits, top_k, renormalize, None, None, *chunking(router_logits.shape[0]))


def moe_route_align(router_logits: torch.Tensor, top_k: int, renormalize: bool, block_m: int
                    ) -> tuple[torch.Tensor, torch.Tensor, MoELayout]:
    """(T, E) router logits -> (weights, ids) as ``moe_route`` and their expert-sorted layout in blocks of
    block_m rows (``align_ref`` of ids; padding rows of sorted_ids are left unwritten)."""
    _check_logits("moe_route_align", router_logits, top_k)
    if isinstance(block_m, bool) or not isinstance(block_m, int) or block_m < 16 or block_m & (block_m - 1):
        raise ValueError(f"moe_route_align: block_m must be a power of two >= 16, got {block_m!r}")
    T, E = router_logits.shape
    n = T * top_k
    nb = max_blocks(n, E, block_m)
    dev = router_logits.device
    sorted_ids = torch.empty(nb * block_m, dtype=torch.int32, device=dev)
    block_expert = torch.empty(nb, dtype=torch.int32, device=dev)
    block_rows = torch.empty(nb, dtype=torch.int32, device=dev)
    chunk_tokens, chunks = chunking(T)
    counts = torch.empty(max(chunks, 1), E, dtype=torch.int32, device=dev)
    ranks = torch.empty(n, dtype=torch.int32, device=dev)
    weights, ids = _route(router_logits, top_k, renormalize, counts, ranks, chunk_tokens, chunks)
    if n:
        _scatter_kernel[(chunks,)](ids, ranks, counts, sorted_ids, block_expert, block_rows, n, E,
                                   chunk_tokens * top_k, chunks, nb, triton.cdiv(nb, chunks), BLOCK_M=block_m,
                                   BLOCK_P=BLOCK_P, BLOCK_E=max(16, next_pow2(E)), SCAN_C=SCAN_C, BLOCK_B=BLOCK_B,
                                   num_warps=4)
    return weights, ids, MoELayout(sorted_ids, block_expert, block_rows, block_m)
