"""Batched sampling on the device with per-request parameters.

Sampling is the Gumbel-max trick: token = argmax(logit_i / T + G_i) with G_i = -log(-log(U_i)) Gumbel noise,
which draws exactly from softmax(logits / T) and needs no softmax, cumulative sum or host round trip.

U_i comes from a counter-based hash of (request seed, output position, token id): a request's tokens are a
pure function of its seed and its logits, whatever else is in the batch. Requests without a seed get one
from the engine's RNG. `sample_ref` is the reference; on CUDA a fused Triton kernel computes the same
thing in one pass over the logits when no top-k / top-p / min-p filter is asked for.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


def _i64(x: int) -> int:
    return x - (1 << 64) if x >= (1 << 63) else x


_GOLDEN = _i64(0x9E3779B97F4A7C15)
_MIX1 = _i64(0xBF58476D1CE4E5B9)
_MIX2 = _i64(0x94D049BB133111EB)
_STEP = _i64(0xD1B54A32D192ED03)


def hash_uniform(seeds: torch.Tensor, steps: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(B,) int64 seeds and output positions -> (B, vocab_size) float32 uniforms in (0, 1).

    splitmix64 of seed * golden + step * c + token, top 23 bits: a pure function of its three inputs.
    Shifts are arithmetic on int64, so each is masked to act as a logical shift.
    """
    tok = torch.arange(vocab_size, device=seeds.device, dtype=torch.int64)
    x = (seeds.long() * _GOLDEN + steps.long() * _STEP)[:, None] + tok[None, :]  # (B, V), wraps mod 2^64
    x = x ^ ((x >> 30) & ((1 << 34) - 1))
    x = x * _MIX1
    x = x ^ ((x >> 27) & ((1 << 37) - 1))
    x = x * _MIX2
    x = x ^ ((x >> 31) & ((1 << 33) - 1))
    top23 = (x >> 41) & 0x7FFFFF  # 23 bits: (top23 + 0.5) / 2^23 is exact in float32 and always < 1
    return (top23.float() + 0.5) * (1.0 / 8388608.0)


@dataclass
class SamplingTensors:
    """One step's per-row sampling parameters on the device, plus host flags to skip unused work."""
    temperatures: torch.Tensor   # (B,) float32, 0 = greedy
    top_ks: torch.Tensor         # (B,) int64, 0 = off
    top_ps: torch.Tensor         # (B,) float32
    min_ps: torch.Tensor         # (B,) float32
    seeds: torch.Tensor          # (B,) int64 noise seeds
    steps: torch.Tensor          # (B,) int64 output position being sampled
    banned_rows: torch.Tensor | None   # (n,) with banned_tokens: logits forced to -inf (min_tokens)
    banned_tokens: torch.Tensor | None
    all_greedy: bool
    any_greedy: bool
    need_top_k: bool
    need_top_p: bool
    need_min_p: bool
    max_logprobs: int | None      # largest `logprobs` requested in the batch (None: nobody asked)


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor                      # (B,) int64
    logprobs: torch.Tensor | None = None         # (B,) log-prob of the sampled token
    top_ids: torch.Tensor | None = None          # (B, k)
    top_logprobs: torch.Tensor | None = None     # (B, k)


def sample_ref(logits: torch.Tensor, temperatures: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor,
               top_ks: torch.Tensor | None = None, top_ps: torch.Tensor | None = None,
               min_ps: torch.Tensor | None = None) -> torch.Tensor:
    """(B, V) float32 logits -> (B,) sampled ids. Rows with temperature 0 take the argmax."""
    B, V = logits.shape
    greedy = temperatures <= 0
    x = logits / torch.where(greedy, torch.ones_like(temperatures), temperatures)[:, None]
    if top_ks is not None or top_ps is not None:
        x = _apply_top_k_top_p(x, top_ks, top_ps)
    if min_ps is not None:  # p_i < min_p * p_max  <=>  x_i < x_max + log(min_p)
        floor = x.amax(dim=-1, keepdim=True) + torch.log(min_ps.clamp_min(1e-30))[:, None]
        x = x.masked_fill((x < floor) & (min_ps[:, None] > 0), float("-inf"))
    gumbel = -torch.log(-torch.log(hash_uniform(seeds, steps, V)))
    ids = (x + gumbel).argmax(dim=-1)
    return torch.where(greedy, logits.argmax(dim=-1), ids)


class Sampler(nn.Module):
    def __init__(self, fused_sample=None):
        super().__init__()
        self.fused_sample = fused_sample  # Triton kernel (CUDA): same as sample_ref without filters

    @torch.no_grad()
    def forward(self, logits: torch.Tensor, t: SamplingTensors) -> SamplerOutput:
        """logits: (B, V), any float dtype (modified in place); sampling works on their float32 values (an exact
        conversion), so the tokens don't depend on it. Returns the sampled ids and requested logprobs."""
        if t.banned_rows is not None:
            logits[t.banned_rows, t.banned_tokens] = float("-inf")
        out = SamplerOutput(token_ids=torch.empty(0))
        if t.max_logprobs is not None:
            logp = torch.log_softmax(logits.float(), dim=-1)
        filters = t.need_top_k or t.need_top_p or t.need_min_p
        if t.all_greedy:
            out.token_ids = logits.argmax(dim=-1)
        elif self.fused_sample is not None and not filters:
            out.token_ids = self.fused_sample(logits, t.temperatures, t.seeds, t.steps)  # reads any float dtype
        else:
            out.token_ids = sample_ref(logits.float(), t.temperatures, t.seeds, t.steps,
                                       t.top_ks if t.need_top_k else None, t.top_ps if t.need_top_p else None,
                                       t.min_ps if t.need_min_p else None)
        if t.max_logprobs is not None:
            out.logprobs = logp.gather(1, out.token_ids[:, None]).squeeze(1)
            if t.max_logprobs > 0:
                out.top_logprobs, out.top_ids = logp.topk(t.max_logprobs, dim=-1)
        return out


def _apply_top_k_top_p(x: torch.Tensor, top_ks: torch.Tensor | None, top_ps: torch.Tensor | None) -> torch.Tensor:
    """Mask logits outside each row's top-k and top-p nucleus with -inf (rows with k=0 / p=1 untouched)."""
    B, V = x.shape
    sorted_x, order = x.sort(dim=-1, descending=True)                           # (B, V)
    drop = torch.zeros_like(sorted_x, dtype=torch.bool)
    if top_ks is not None:
        k = torch.where(top_ks > 0, top_ks, torch.full_like(top_ks, V)).clamp(max=V)
        drop |= torch.arange(V, device=x.device)[None, :] >= k[:, None]
    if top_ps is not None:
        probs = torch.softmax(sorted_x.masked_fill(drop, float("-inf")), dim=-1)
        before = probs.cumsum(dim=-1) - probs      # mass strictly above each token
        drop |= (before > top_ps[:, None]) & (top_ps[:, None] < 1.0)  # the top token always stays (before = 0)
    mask = torch.empty_like(drop).scatter_(1, order, drop)
    return x.masked_fill(mask, float("-inf"))
