"""Batched sampling on the device with per-request parameters.

Sampling is the Gumbel-max trick: token = argmax(logit_i / T + G_i) with G_i = -log(-log(U_i)) Gumbel noise,
which draws exactly from softmax(logits / T) and needs no softmax, cumulative sum or host round trip.

U_i comes from a counter-based hash of (request seed, output position, token id): a request's tokens are a
pure function of its seed and its logits, whatever else is in the batch. Requests without a seed get one
from the engine's RNG. `sample_ref` is the reference; on CUDA a fused Triton kernel computes the same
thing in one pass over the logits when no top-k / top-p / min-p filter is asked for.

Under tensor parallelism each rank holds the logits of its slice of the vocabulary (`VocabShard`). When the step
needs no full-vocabulary view (no filter, no logprobs), each rank computes the exact (best score, global argmax)
of its slice per row (`sample_partial_ref`, or the kernel), the ranks all-gather these (B, 2) partials and every
rank reduces them alike (`reduce_partials`): the ids of the full-logits path, without gathering the logits.
Otherwise the logits are gathered and sampled as with one rank.

Speculative decoding verifies draft tokens with the same draws (`accepted_drafts`). A sequence verifying drafts
d_0..d_{k-1} has k + 1 logits rows; row j holds the target's logits after d_{j-1} and is sampled with the noise of
the output position it samples, so sample_j is exactly the token plain decoding would draw there if d_0..d_{j-1}
are the tokens before it. Draft d_j is accepted iff every draft before it was and sample_j == d_j; the sequence
then gets the accepted drafts and the sample of the first row that did not match (all k + 1 when every draft
matched). The output is therefore token for token what decoding without drafts gives with the same seed (up to
the float rounding of logits computed in a differently shaped batch). For a deterministic draft this is
speculative rejection sampling: P(accept d) = P(Gumbel-max = d) = p(d), and given a rejection the emitted token
is Gumbel-max conditioned on not being d, i.e. drawn from p with d removed and renormalized.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from nanovllm.distributed.group import TPGroup
from nanovllm.engine.batch import LateInputs
from nanovllm.layers.logits_processing import DeviceFeatures, SlotState, apply_late, mask_for_kernel
from nanovllm.layers.ops import TORCH_OPS, Ops


def _i64(x: int) -> int:
    return x - (1 << 64) if x >= (1 << 63) else x


_GOLDEN = _i64(0x9E3779B97F4A7C15)
_MIX1 = _i64(0xBF58476D1CE4E5B9)
_MIX2 = _i64(0x94D049BB133111EB)
_STEP = _i64(0xD1B54A32D192ED03)


def hash_uniform(seeds: torch.Tensor, steps: torch.Tensor, vocab_size: int, start: int = 0) -> torch.Tensor:
    """(B,) int64 seeds and output positions -> (B, vocab_size) float32 uniforms in (0, 1), for the tokens
    start .. start + vocab_size - 1 (a slice of the vocabulary has the same noise as in the full row).

    splitmix64 of seed * golden + step * c + token, top 23 bits: a pure function of its three inputs.
    Shifts are arithmetic on int64, so each is masked to act as a logical shift.
    """
    tok = torch.arange(start, start + vocab_size, device=seeds.device, dtype=torch.int64)
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
    need_top_k: bool
    need_top_p: bool
    need_min_p: bool
    max_logprobs: int | None      # largest `logprobs` requested in the batch (None: nobody asked)
    # penalties / biases of the rows that keep state in `slot_state` (layers/logits_processing.py), and a
    # deferred step's masks and bans; None: no row uses them (nothing extra runs)
    features: DeviceFeatures | None = None
    slot_state: SlotState | None = None
    late: LateInputs | None = None
    # speculative decoding: (N,) first logits row of each verifying sequence and its (N, K) draft tokens, -1 padded
    draft_rows: torch.Tensor | None = None
    draft_tokens: torch.Tensor | None = None


@dataclass(frozen=True)
class VocabShard:
    """This rank's slice of the vocabulary under tensor parallelism: columns [0, size) of its logits are the
    global tokens [start, start + size); those >= vocab_size are padding (the last shard's tail)."""
    tp: TPGroup
    start: int
    size: int
    vocab_size: int

    @property
    def valid(self) -> int:
        """Columns that are real tokens (0 on a tail rank that holds only padding)."""
        return max(0, min(self.size, self.vocab_size - self.start))

    def gather(self, local: torch.Tensor) -> torch.Tensor:
        """(..., size) shard logits -> (..., vocab_size) full logits, on every rank."""
        return self.tp.all_gather_last_dim(local)[..., :self.vocab_size]


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor                      # (B,) int64
    logprobs: torch.Tensor | None = None         # (B,) log-prob of the sampled token
    ranks: torch.Tensor | None = None            # (B,) 1-based rank of the sampled token
    top_ids: torch.Tensor | None = None          # (B, k)
    top_logprobs: torch.Tensor | None = None     # (B, k)
    num_accepted: torch.Tensor | None = None     # (N,) accepted draft tokens of each verifying sequence


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


def accepted_drafts(token_ids: torch.Tensor, first_rows: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
    """(S,) sampled ids, (N,) first logits row of each verifying sequence, (N, K) its drafts (-1 padded) -> (N,)
    accepted drafts: how many leading drafts equal the samples of their rows (cumprod of the matches)."""
    S = token_ids.shape[0]
    K = drafts.shape[1]
    rows = (first_rows[:, None] + torch.arange(K, device=drafts.device)[None, :]).clamp(max=S - 1)  # (N, K)
    match = token_ids[rows] == drafts                          # padding (-1) never matches a token id
    return match.to(torch.int32).cumprod(dim=1).sum(dim=1)


def sample_partial_ref(logits: torch.Tensor, temperatures: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor,
                       vocab_start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """`sample_ref` (no filters) over a slice of the vocabulary, stopped before the choice.

    logits: (B, n) float32, the global tokens vocab_start .. vocab_start + n - 1 (padding sliced off). Returns
    (B,) float32 best scores and (B,) int64 global ids of their first occurrence: the raw logit for greedy rows
    (T <= 0), logit / T + gumbel(seed, step, global id) otherwise, compared like torch.argmax (NaN above all)."""
    B, n = logits.shape
    if n == 0:
        return (torch.full((B,), float("-inf"), device=logits.device),
                torch.full((B,), vocab_start, dtype=torch.int64, device=logits.device))
    greedy = temperatures <= 0
    x = logits / torch.where(greedy, torch.ones_like(temperatures), temperatures)[:, None]
    gumbel = -torch.log(-torch.log(hash_uniform(seeds, steps, n, vocab_start)))
    scores = torch.where(greedy[:, None], logits, x + gumbel)                    # (B, n)
    idx = scores.argmax(dim=-1)
    return scores.gather(1, idx[:, None]).squeeze(1), idx + vocab_start


def reduce_partials(scores: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """(R, B) per-slice best scores and global ids, slices in vocabulary order -> (B,) ids of the full row.

    torch.argmax over the slices gives the first maximum, NaN above all: with each slice's partial being its
    own first maximum (or first NaN), that is the full row's argmax (ties to the lowest global id)."""
    k = scores.argmax(dim=0)                                                      # (B,) winning slice
    return ids.gather(0, k[None]).squeeze(0)


def _ban_in_shard(logits: torch.Tensor, rows: torch.Tensor, tokens: torch.Tensor, start: int) -> None:
    """logits[rows[i], tokens[i] - start] = -inf for the banned (row, global token) pairs inside this shard, in
    place and without a host sync: the pairs of other shards are written to a spare column of the mask."""
    B, n = logits.shape
    local = tokens - start
    mine = (local >= 0) & (local < n)
    hit = torch.zeros(B, n + 1, dtype=torch.bool, device=logits.device)
    hit[rows, torch.where(mine, local, torch.full_like(local, n))] = True
    logits.masked_fill_(hit[:, :n], float("-inf"))


class Sampler(nn.Module):
    def __init__(self, ops: Ops = TORCH_OPS, vocab_shard: VocabShard | None = None):
        super().__init__()
        self.fused_sample = ops.sample             # Triton kernel (CUDA): same as sample_ref without filters
        self.fused_partial = ops.sample_partial    # Triton kernel (CUDA): same as sample_partial_ref
        self.vocab_shard = vocab_shard  # set under tensor parallelism: forward gets this rank's logits slice

    @staticmethod
    def needs_full_vocab(t: SamplingTensors) -> bool:
        """True when the step can't be sampled from vocabulary slices: a filter, logprobs, penalties, biases or
        masks need whole rows."""
        return (t.need_top_k or t.need_top_p or t.need_min_p or t.max_logprobs is not None
                or t.features is not None or t.late is not None)

    @torch.no_grad()
    def forward(self, logits: torch.Tensor, t: SamplingTensors) -> SamplerOutput:
        """logits: (B, V), any float dtype (modified in place); sampling works on their float32 values (an exact
        conversion), so the tokens don't depend on it. Returns the sampled ids and requested logprobs.

        With a `vocab_shard`, logits are this rank's (B, shard size) slice (padding included) and every rank
        must call this with the same batch (collectives): the ids are those of the full logits."""
        shard = self.vocab_shard
        if shard is not None and not self.needs_full_vocab(t):
            out = SamplerOutput(token_ids=self._sample_sharded(logits, t, shard))
        else:
            out = self._sample(shard.gather(logits) if shard is not None else logits, t)
        if t.draft_rows is not None:
            out.num_accepted = accepted_drafts(out.token_ids, t.draft_rows, t.draft_tokens)
        return out

    def _sample(self, logits: torch.Tensor, t: SamplingTensors) -> SamplerOutput:
        """The full-vocabulary path: (B, V) logits (modified in place) -> ids and the logprobs asked for."""
        out = SamplerOutput(token_ids=torch.empty(0))
        if t.max_logprobs is not None:  # of the raw logits (vLLM's default), before anything below changes them
            logp = torch.log_softmax(logits.float(), dim=-1)
        fused = self.fused_sample is not None and not (t.need_top_k or t.need_top_p or t.need_min_p)
        # structured outputs' bitmasks: inside the fused kernel (one pass over the logits) or as -inf before the
        # torch paths. -inf commutes with the bias and penalties below (it stays -inf), so the order is the same
        masks = {}
        if t.late is not None:  # masks and bans are -inf: exact in any dtype, no float32 copy for them
            if fused and t.late.mask_index is not None:
                masks = dict(zip(("bitmask", "mask_index"), mask_for_kernel(t.late, logits.device)))
            apply_late(logits, t.late, logits.device, masks=not masks)
        if t.features is not None:
            logits = logits.float()  # (a copy unless float32 already)
            t.slot_state.apply(logits, t.features)
        if t.banned_rows is not None:
            logits[t.banned_rows, t.banned_tokens] = float("-inf")
        if t.all_greedy and not masks:
            out.token_ids = logits.argmax(dim=-1)
        elif fused:  # reads any float dtype
            out.token_ids = self.fused_sample(logits, t.temperatures, t.seeds, t.steps, **masks)
        else:
            out.token_ids = sample_ref(logits.float(), t.temperatures, t.seeds, t.steps,
                                       t.top_ks if t.need_top_k else None, t.top_ps if t.need_top_p else None,
                                       t.min_ps if t.need_min_p else None)
        if t.features is not None:
            t.slot_state.record(t.features, out.token_ids)
        if t.max_logprobs is not None:
            out.logprobs = logp.gather(1, out.token_ids[:, None]).squeeze(1)
            out.ranks = (logp > out.logprobs[:, None]).sum(dim=-1) + 1
            if t.max_logprobs > 0:
                out.top_logprobs, out.top_ids = logp.topk(t.max_logprobs, dim=-1)
        return out

    def _sample_sharded(self, logits: torch.Tensor, t: SamplingTensors, shard: VocabShard) -> torch.Tensor:
        """Each rank's exact partial (best score, global id) per row, one all-gather of those (B, 2), the same
        reduction on every rank."""
        if t.banned_rows is not None:
            _ban_in_shard(logits, t.banned_rows, t.banned_tokens, shard.start)
        local = logits[:, :shard.valid]                                          # padding never wins
        if local.shape[1] == 0:
            scores, ids = sample_partial_ref(local.float(), t.temperatures, t.seeds, t.steps, shard.start)
        elif t.all_greedy:
            ids = local.argmax(dim=-1)
            scores, ids = local.gather(1, ids[:, None]).squeeze(1).float(), ids + shard.start
        elif self.fused_partial is not None:
            scores, ids = self.fused_partial(local, t.temperatures, t.seeds, t.steps, vocab_start=shard.start)
        else:
            scores, ids = sample_partial_ref(local.float(), t.temperatures, t.seeds, t.steps, shard.start)
        # float64 holds both exactly (float32 scores incl. NaN / inf; ids < 2^31): one collective
        parts = shard.tp.all_gather(torch.stack([scores.double(), ids.double()], dim=1))  # (R, B, 2)
        return reduce_partials(parts[..., 0], parts[..., 1].long())


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
