"""The plain-torch mixture of experts: the definitions the Triton kernels (`nanovllm.kernels.moe`) answer to.

A token's feed-forward output is a weighted sum over the `top_k` experts its router picks:

    probs = softmax(router_logits) in float32; (w, ids) = its top_k, ties to the lower expert index;
    w /= sum(w) when renormalizing (norm_topk_prob)
    out[t] = sum over j = 0 .. top_k-1, in that order, of w[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t)), e = ids[t, j]

with every product accumulated in float32 and rounded to the model's dtype at the same three points as the
kernels: the SiLU-and-mul result (the down projection's input), each weighted (token, j) row, and the sum.
`torch.topk`'s order among equal values is unspecified (on CPU ``topk([1, 1, 1], 2)`` gives indices 2, 1), so
ties are broken by a stable sort instead: the lower expert index wins, as in the kernel.

`fused_moe_ref` is the model's feed-forward on the torch backend: it runs every expert on every token (static
shapes, no host syncs, so it also runs inside CUDA graphs) and keeps each token's routed results; E / top_k
times the work of the kernels, which only the tests and small models see. `align_ref`, `gate_up_ref`,
`down_ref` and `combine_ref` define the kernels' intermediate steps over the expert-sorted layout (`MoELayout`);
they read the layout on the host (tests only).

FP8 experts (``quantization="fp8"``): w13 / w2 in e4m3 with one float32 scale per expert and output row
(``w13_scale`` (E, 2I), ``w2_scale`` (E, H)), or a block-FP8 checkpoint's one per (bn x bk) tile (``block``:
(E, 2I / bn, H / bk) and (E, H / bn, I / bk)); every function here then multiplies by the dequantized weights
(``dequantize_experts``). The gate/up products take x quantized as the kernels quantize it (``expert_input``:
per token, or per token and bk columns); the down products take the SiLU-and-mul rows in the model's dtype.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


def route_ref(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(T, E) router logits -> (weights (T, top_k) float32, expert ids (T, top_k) int32), best first."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    w, ids = torch.sort(probs, dim=-1, descending=True, stable=True)
    w, ids = w[:, :top_k], ids[:, :top_k]
    if renormalize:
        w = w / w.sum(dim=-1, keepdim=True)
    return w, ids.to(torch.int32)


def max_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """How many blocks of block_m rows the expert-sorted layout of num_pairs (token, expert) pairs can need:
    each expert's rows are padded to a multiple of block_m, so sum_e ceil(c_e / block_m) <= (num_pairs +
    E (block_m - 1)) / block_m, and no more blocks than pairs (every block holds one)."""
    return min(num_pairs, (num_pairs + num_experts * (block_m - 1)) // block_m)


@dataclass(frozen=True)
class MoELayout:
    """The (token, j) pairs sorted by expert, each expert's rows padded to whole blocks of block_m rows.

    sorted_ids (max_blocks * block_m,) int32: row r holds the flat pair index t * top_k + j (rows past a
    block's `block_rows` are padding: their entries are never read); block_expert (max_blocks,) int32: the expert
    of each block, -1 past the last; block_rows (max_blocks,) int32: the block's real rows (the first ones)."""
    sorted_ids: torch.Tensor
    block_expert: torch.Tensor
    block_rows: torch.Tensor
    block_m: int

    def row_mask(self) -> torch.Tensor:
        """(rows,) bool: the rows that hold a pair."""
        r = torch.arange(self.sorted_ids.numel(), device=self.sorted_ids.device)
        return (r % self.block_m) < self.block_rows.long().repeat_interleave(self.block_m)


def align_ref(ids: torch.Tensor, num_experts: int, block_m: int) -> MoELayout:
    """The expert-sorted layout of (T, top_k) expert ids: experts in index order, each one's pairs in pair-index
    order (a stable sort), padding rows 0."""
    flat = ids.flatten().long()
    n = flat.numel()
    nb = max_blocks(n, num_experts, block_m)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    sorted_ids = torch.zeros(nb * block_m, dtype=torch.int32)
    block_expert = torch.full((nb,), -1, dtype=torch.int32)
    block_rows = torch.zeros(nb, dtype=torch.int32)
    src = row = 0
    for e, c in enumerate(counts):
        sorted_ids[row:row + c] = order[src:src + c].to(torch.int32)
        for b in range(row // block_m, (row + c + block_m - 1) // block_m):
            block_expert[b] = e
            block_rows[b] = min(block_m, row + c - b * block_m)
        src += c
        row += -(-c // block_m) * block_m
    dev = ids.device
    return MoELayout(sorted_ids.to(dev), block_expert.to(dev), block_rows.to(dev), block_m)


def dequantize_experts(w: torch.Tensor, scale: torch.Tensor | None,
                       block: tuple[int, int] | None = None) -> torch.Tensor:
    """Stacked expert weights (..., N, K) as float32: e4m3 ones times their per-row scales (..., N), or with
    `block` (bn, bk) their per-tile scales (..., N / bn, K / bk)."""
    if scale is None:
        return w.float()
    if block is None:
        return w.float() * scale.float()[..., None]
    N, K = w.shape[-2:]
    s = scale.float().repeat_interleave(block[0], dim=-2)[..., :N, :].repeat_interleave(block[1], dim=-1)
    return w.float() * s[..., :K]


def expert_input(x: torch.Tensor, w13_scale: torch.Tensor | None, block: tuple[int, int] | None) -> torch.Tensor:
    """x (T, H) as the gate/up products read it, float32: as is for experts in the model's dtype; for e4m3
    experts quantized to e4m3 per token (per-row weight scales) or per token and block[1] columns, dequantized."""
    from nanovllm.layers.quantization import fp8_ref
    if w13_scale is None:
        return x.float()
    q, s = fp8_ref.quantize_rows(x) if block is None else fp8_ref.quantize_groups(x, block[1])
    return fp8_ref.dequantize(q, s if block is None else s.repeat_interleave(block[1], 1))


def gate_up_ref(x: torch.Tensor, w13: torch.Tensor, layout: MoELayout, top_k: int,
                w13_scale: torch.Tensor | None = None, block: tuple[int, int] | None = None) -> torch.Tensor:
    """The SiLU-and-mul of each layout row's expert: (rows, I) in x's dtype, padding rows 0.
    x (T, H); w13 (E, 2I, H) laid out [gate | up] per expert (e4m3 with w13_scale, per row or `block`: x then
    quantized, ``expert_input``)."""
    xf = expert_input(x, w13_scale, block)
    w13 = dequantize_experts(w13, w13_scale, block)
    inter = w13.shape[1] // 2
    out = torch.zeros(layout.sorted_ids.numel(), inter, dtype=x.dtype, device=x.device)
    rows = layout.row_mask().nonzero().flatten()
    experts = layout.block_expert.long().repeat_interleave(layout.block_m)[rows]
    xt = xf[(layout.sorted_ids.long()[rows] // top_k)]                              # (n, H)
    gu = torch.einsum("nh,nih->ni", xt, w13[experts])                               # (n, 2I)
    out[rows] = (F.silu(gu[:, :inter]) * gu[:, inter:]).to(x.dtype)
    return out


def down_ref(inter: torch.Tensor, w2: torch.Tensor, layout: MoELayout, weights: torch.Tensor,
             w2_scale: torch.Tensor | None = None, block: tuple[int, int] | None = None) -> torch.Tensor:
    """Each pair's weighted down projection: (T * top_k, H) in inter's dtype, row t * top_k + j.
    inter (rows, I) from gate_up_ref; w2 (E, H, I) (e4m3 with w2_scale, per row or `block`); weights (T, top_k)
    float32."""
    w2 = dequantize_experts(w2, w2_scale, block)
    n_pairs = weights.numel()
    out = torch.zeros(n_pairs, w2.shape[1], dtype=inter.dtype, device=inter.device)
    rows = layout.row_mask().nonzero().flatten()
    experts = layout.block_expert.long().repeat_interleave(layout.block_m)[rows]
    pairs = layout.sorted_ids.long()[rows]
    y = torch.einsum("ni,nhi->nh", inter[rows].float(), w2[experts])                # (n, H)
    out[pairs] = (y * weights.flatten()[pairs, None].float()).to(inter.dtype)
    return out


def combine_ref(pairs: torch.Tensor, top_k: int) -> torch.Tensor:
    """(T * top_k, H) weighted rows -> (T, H): each token's top_k rows summed in float32 in order j = 0, 1, ..."""
    p = pairs.view(-1, top_k, pairs.shape[-1]).float()
    acc = p[:, 0]
    for j in range(1, top_k):
        acc = acc + p[:, j]
    return acc.to(pairs.dtype)


@dataclass(frozen=True)
class ExpertRows:
    """A mixture-of-experts block's output before its combine: ``rows`` (T * top_k, H), row t * top_k + j token
    t's j-th weighted expert output. The residual add + RMSNorm that follows sums them (``add_rms_norm``'s
    ``rows_per_token``), so the block needs no combine launch."""
    rows: torch.Tensor
    top_k: int


def fused_moe_ref(x: torch.Tensor, router_logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, top_k: int,
                  renormalize: bool, out: torch.Tensor | None = None, *, w13_scale: torch.Tensor | None = None,
                  w2_scale: torch.Tensor | None = None, block: tuple[int, int] | None = None,
                  combine: bool = True) -> torch.Tensor:
    """The mixture-of-experts feed-forward (T, H) of x (T, H) with router_logits (T, E), w13 (E, 2I, H) and
    w2 (E, H, I) (this rank's slice of I under tensor parallelism: the result is then this rank's partial sum;
    FP8 experts: e4m3 with w13_scale (E, 2I) and w2_scale (E, H), or per `block` tile); into `out` when given.
    combine=False: the weighted rows (T * top_k, H) in x's dtype, unsummed (``combine_ref`` sums them); no
    `out` then."""
    if not combine and out is not None:
        raise ValueError("fused_moe_ref: combine=False returns the expert rows; it takes no out")
    weights, ids = route_ref(router_logits, top_k, renormalize)
    T, H = x.shape
    inter = w13.shape[1] // 2
    xf = expert_input(x, w13_scale, block)
    rows = torch.zeros(T, top_k, H, dtype=torch.float32, device=x.device)  # (token, j) weighted outputs
    for e in range(w13.shape[0]):
        gu = xf @ dequantize_experts(w13[e], None if w13_scale is None else w13_scale[e], block).t()  # (T, 2I)
        h = (F.silu(gu[:, :inter]) * gu[:, inter:]).to(x.dtype).float()
        y = h @ dequantize_experts(w2[e], None if w2_scale is None else w2_scale[e], block).t()       # (T, H)
        weighted = (y[:, None, :] * weights[:, :, None]).to(x.dtype).float()      # (T, top_k, H)
        rows = torch.where((ids == e)[:, :, None], weighted, rows)
    if not combine:
        return rows.to(x.dtype).view(T * top_k, H)
    acc = rows[:, 0]
    for j in range(1, top_k):
        acc = acc + rows[:, j]
    if out is None:
        return acc.to(x.dtype)
    return out.copy_(acc)
