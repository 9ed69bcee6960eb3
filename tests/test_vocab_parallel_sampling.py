"""Vocabulary-parallel sampling: each rank's exact (best score, global id) partial over its vocabulary shard,
reduced across ranks, gives the ids of the full-logits sampler; filters and logprobs fall back to gathering.

The ranks run as threads of this process over a group whose collectives meet at a barrier, so the Sampler's
real code path (partials, one all-gather, reduction) runs for tp = 2, 3, 4 without process groups.
"""
from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from nanovllm.distributed.group import TPGroup
from nanovllm.layers.embed_head import ParallelLMHead
from nanovllm.layers.ops import TORCH_OPS
from nanovllm.layers.sampler import (
    Sampler,
    SamplingTensors,
    VocabShard,
    hash_uniform,
    reduce_partials,
    sample_partial_ref,
    sample_ref,
)


def _shards(vocab: int, tp: int) -> list[tuple[int, int]]:
    """(start, valid columns) per rank, as ParallelLMHead splits the vocabulary."""
    size = -(-vocab // tp)
    return [(r * size, max(0, min(size, vocab - r * size))) for r in range(tp)]


def _rows(B, V, seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, V, generator=g) * 3
    temps = torch.tensor([0.0, 0.7, 1.0, 1.3, -1.0, 0.05, 2.0, 0.9])[torch.arange(B) % 8]
    seeds = torch.randint(-2**63, 2**63 - 1, (B,), generator=g, dtype=torch.int64)
    steps = torch.randint(0, 2**40, (B,), generator=g, dtype=torch.int64)
    return logits, temps, seeds, steps


def _reduce_by_hand(logits, temps, seeds, steps, tp):
    parts = [sample_partial_ref(logits[:, s:s + n], temps, seeds, steps, s) for s, n in _shards(logits.shape[1], tp)]
    return reduce_partials(torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts]))


@pytest.mark.parametrize("vocab, tp", [(64, 2), (61, 2), (61, 4), (485, 3), (5, 4), (7, 8), (1, 2)])
def test_partials_reduce_to_the_full_row(vocab, tp):
    logits, temps, seeds, steps = _rows(16, vocab, seed=vocab * 10 + tp)
    assert _reduce_by_hand(logits, temps, seeds, steps, tp).tolist() == sample_ref(logits, temps, seeds, steps).tolist()


def test_partial_is_the_exact_best_score_with_a_global_id():
    logits, temps, seeds, steps = _rows(8, 300, seed=1)
    full_x = torch.where((temps <= 0)[:, None], logits, logits / temps[:, None]
                         - torch.log(-torch.log(hash_uniform(seeds, steps, 300))))
    scores, ids = sample_partial_ref(logits[:, 120:250], temps, seeds, steps, 120)
    assert ((ids >= 120) & (ids < 250)).all()
    want = full_x[:, 120:250].max(dim=-1).values
    assert torch.equal(scores, want) and torch.equal(full_x.gather(1, ids[:, None]).squeeze(1), want)
    empty_scores, empty_ids = sample_partial_ref(logits[:, :0], temps, seeds, steps, 300)
    assert (empty_scores == float("-inf")).all() and (empty_ids == 300).all()


def test_ties_nan_and_padding_across_shard_boundaries():
    """vocab 61 over tp 2: shards [0, 31) and [31, 61); tp 4: [0, 16), [16, 32), [32, 48), [48, 61)."""
    V = 61
    logits, _, seeds, steps = _rows(9, V, seed=7)
    temps = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.8, 0.8, 0.8, 0.0, 0.8])
    logits[0, [30, 31, 47]] = 9.0                      # greedy tie straddling both boundaries -> 30
    logits[1, [48, 33]] = float("nan")                 # NaN is the max (above +inf in an earlier shard), the first
    logits[1, 5] = float("inf")
    logits[2] = float("-inf")                          # everything -inf -> 0
    logits[3, [60, 15, 16]] = 4e4                      # ties at the last real token and a tp-4 boundary -> 15
    logits[4, [31, 32]] = float("inf")                 # sampled: +inf ties (inf + noise) -> 31
    logits[4, 30] = float("inf")                       # ... now straddling the tp-2 boundary -> 30
    logits[5] = float("-inf")                          # sampled, all banned -> 0
    logits[6, [47, 50]] = float("nan")                 # sampled NaN -> 47
    logits[7] = 0.0                                    # greedy flat: 0
    logits[8, 60] = float("inf")                       # sampled, last token
    ref = sample_ref(logits, temps, seeds, steps).tolist()
    assert ref == [30, 33, 0, 15, 30, 0, 47, 0, 60]
    # the last shard's padded tail (zeros from the LM head's zero rows, or anything) never wins
    for tp in (2, 3, 4):
        size = -(-V // tp)
        padded = torch.full((9, size * tp), float("nan"))
        padded[:, :V] = logits
        parts = [sample_partial_ref(padded[:, s:s + n], temps, seeds, steps, s) for s, n in _shards(V, tp)]
        got = reduce_partials(torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts]))
        assert got.tolist() == ref, tp


# --- the Sampler on every rank, ranks as threads ---------------------------------------------------------------

@dataclass
class _Hub:
    size: int
    barrier: threading.Barrier = None
    slots: list = None
    calls: dict = field(default_factory=lambda: {"all_gather": 0, "all_gather_last_dim": 0})
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self):
        self.barrier = threading.Barrier(self.size)
        self.slots = [None] * self.size


@dataclass(frozen=True)
class ThreadGroup(TPGroup):
    """Collectives between threads of one process (each thread one rank)."""
    hub: Any = None

    def all_gather(self, x):
        hub = self.hub
        if self.rank == 0:
            with hub.lock:
                hub.calls["all_gather"] += 1
        hub.slots[self.rank] = x.clone()
        hub.barrier.wait()
        out = torch.stack(hub.slots)
        hub.barrier.wait()  # everyone has read the slots before they are reused
        return out

    def all_gather_last_dim(self, x):
        if self.rank == 0:
            with self.hub.lock:
                self.hub.calls["all_gather_last_dim"] += 1
        return super().all_gather_last_dim(x)


def _tensors(temps, top_k=None, top_p=None, logprobs=None, banned=None, seed=0):
    B = len(temps)
    g = torch.Generator().manual_seed(seed)
    t = torch.tensor(temps, dtype=torch.float32)
    top_ks = torch.tensor(top_k if top_k is not None else [0] * B)
    top_ps = torch.tensor(top_p if top_p is not None else [1.0] * B, dtype=torch.float32)
    rows = torch.tensor([r for r, _ in banned], dtype=torch.int32) if banned else None
    toks = torch.tensor([v for _, v in banned], dtype=torch.int32) if banned else None
    return SamplingTensors(
        temperatures=t, top_ks=top_ks, top_ps=top_ps, min_ps=torch.zeros(B),
        seeds=torch.randint(0, 2**62, (B,), generator=g), steps=torch.randint(0, 1000, (B,), generator=g),
        banned_rows=rows, banned_tokens=toks, all_greedy=bool((t <= 0).all()),
        need_top_k=bool((top_ks > 0).any()), need_top_p=bool((top_ps < 1).any()), need_min_p=False,
        max_logprobs=logprobs)


def run_ranks(logits, t, tp, dtype=torch.float32, fused_partial=None):
    """Every rank's Sampler on its (padded) shard of `logits`, concurrently. Returns (outputs per rank, calls)."""
    B, V = logits.shape
    hub = _Hub(tp)
    results, errors = [None] * tp, []

    def rank(r):
        try:
            head = ParallelLMHead(V, 4, ThreadGroup(r, tp, hub=hub))
            shard = head.vocab_shard()
            # padding: what the zero rows of the LM head give (it would win rows of negative logits)
            local = torch.zeros(B, shard.size, dtype=dtype, device=logits.device)
            local[:, :shard.valid] = logits[:, shard.start:shard.start + shard.valid]
            ops = dataclasses.replace(TORCH_OPS, sample_partial=fused_partial)
            results[r] = Sampler(ops, vocab_shard=shard)(local, t)
        except BaseException as e:  # surface in the main thread
            errors.append(e)
            hub.barrier.abort()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(tp)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=60)
    if errors:
        raise errors[0]
    return results, hub.calls


@pytest.mark.parametrize("vocab, tp", [(61, 2), (485, 3), (64, 4), (5, 4)])
def test_plain_sampling_takes_the_shard_path(vocab, tp):
    logits = torch.randn(6, vocab, generator=torch.Generator().manual_seed(vocab)) * 2
    logits[0] = -logits[0].abs() - 1                   # greedy, all negative: the zero padding must not win
    t = _tensors([0.0, 0.8, 1.0, 0.0, 1.7, 0.3])
    want = Sampler()(logits.clone(), t).token_ids
    outs, calls = run_ranks(logits, t, tp)
    assert calls == {"all_gather": 1, "all_gather_last_dim": 0}  # only the (B, 2) partials were exchanged
    for o in outs:
        assert o.token_ids.tolist() == want.tolist() and o.logprobs is None


def test_all_greedy_and_half_precision_shards():
    logits = (torch.randn(5, 97, generator=torch.Generator().manual_seed(3)) * 4).to(torch.bfloat16).float()
    logits[0, [48, 49]] = 20.0                         # a tie straddling the tp-2 boundary (shard size 49)
    for temps in ([0.0] * 5, [0.0, 0.9, 0.0, 1.2, 0.6]):
        t = _tensors(temps, seed=4)
        want = Sampler()(logits.clone(), t).token_ids.tolist()
        outs, calls = run_ranks(logits, t, 2, dtype=torch.bfloat16)
        assert calls["all_gather_last_dim"] == 0
        assert all(o.token_ids.tolist() == want for o in outs)
        assert want[0] == 48


def test_banned_tokens_per_shard():
    logits = torch.randn(3, 61, generator=torch.Generator().manual_seed(5))
    logits[:, [10, 40, 60]] = 50.0                    # the banned ones would win
    banned = [(0, 10), (0, 40), (0, 60), (1, 40), (1, 60), (2, 60), (2, 60)]
    t = _tensors([0.0, 0.7, 1.0], banned=banned)
    want = Sampler()(logits.clone(), t).token_ids.tolist()
    assert want[0] not in (10, 40, 60) and want[1] == 10 and want[2] in (10, 40)
    for tp in (2, 4):
        outs, calls = run_ranks(logits, t, tp)
        assert calls["all_gather_last_dim"] == 0
        assert all(o.token_ids.tolist() == want for o in outs)


@pytest.mark.parametrize("kw", [dict(top_k=[0, 5, 0, 0]), dict(top_p=[1.0, 1.0, 0.7, 1.0]), dict(logprobs=2)])
def test_filters_and_logprobs_fall_back_to_gathering(kw):
    logits = torch.randn(4, 61, generator=torch.Generator().manual_seed(6)) * 2
    t = _tensors([0.0, 0.9, 1.1, 0.5], banned=[(1, 3)], **kw)
    want = Sampler()(logits.clone(), t)
    outs, calls = run_ranks(logits, t, 2)
    assert calls["all_gather_last_dim"] == 1
    for o in outs:
        assert o.token_ids.tolist() == want.token_ids.tolist()
        if "logprobs" in kw:
            assert torch.equal(o.logprobs, want.logprobs) and torch.equal(o.top_ids, want.top_ids)


def test_vocab_shard_of_the_lm_head():
    shards = [ParallelLMHead(5, 4, TPGroup(r, 4)).vocab_shard() for r in range(4)]
    assert [(s.start, s.size, s.valid) for s in shards] == [(0, 2, 2), (2, 2, 2), (4, 2, 1), (6, 2, 0)]
    assert VocabShard(TPGroup(), 0, 7, 7).valid == 7
