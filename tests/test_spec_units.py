"""Speculative decoding's parts without a model: the config, the n-gram proposer, the scheduler's draft rows, the
accept/reject op, the adaptive policy, the CLI flag and the server's metrics."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from nanovllm.config import SPEC_MAX_STEP_TOKENS, EngineArgs, SpeculativeConfig
from nanovllm.engine.batch import build_step_batch
from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.scheduler import Scheduler
from nanovllm.engine.sequence import PLACEHOLDER, Sequence, SequenceStatus
from nanovllm.engine.spec.ngram import NgramProposer, longest_match
from nanovllm.engine.spec.speculator import MAX_BACKOFF_STEPS, Speculator
from nanovllm.layers.sampler import accepted_drafts
from nanovllm.sampling_params import SamplingParams

NGRAM = {"method": "ngram", "num_speculative_tokens": 3}


# --- config ----------------------------------------------------------------------------------------
def test_config_defaults_follow_vllm():
    c = SpeculativeConfig.from_dict(NGRAM)
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (5, 5)
    assert c.disable_by_batch_size == SPEC_MAX_STEP_TOKENS // 4
    assert c.max_draft_tokens == c.disable_by_batch_size * 3
    assert SpeculativeConfig.from_dict({**NGRAM, "prompt_lookup_max": 4}).prompt_lookup_min == 4
    assert SpeculativeConfig.from_dict({**NGRAM, "prompt_lookup_min": 2}).prompt_lookup_max == 2
    c = SpeculativeConfig.from_dict({**NGRAM, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
                                     "disable_by_batch_size": 7})
    assert (c.prompt_lookup_min, c.prompt_lookup_max, c.disable_by_batch_size) == (1, 3, 7)
    assert SpeculativeConfig.from_dict(None) is None
    assert EngineArgs(model=".", speculative_config=NGRAM).speculative_config == NGRAM
    # a long k: the same batch limit (the step budget is shared, see below); one step verifies at most 127 drafts
    c = SpeculativeConfig.from_dict({**NGRAM, "num_speculative_tokens": 12})
    assert (c.disable_by_batch_size, c.max_step_tokens, c.max_draft_tokens) == (32, SPEC_MAX_STEP_TOKENS, 127)
    # an explicit batch limit: room for k drafts each
    c = SpeculativeConfig.from_dict({**NGRAM, "num_speculative_tokens": 12, "disable_by_batch_size": 64})
    assert (c.max_step_tokens, c.max_draft_tokens) == (64 * 13, 64 * 12)


@pytest.mark.parametrize("bad, match", [
    ({"method": "eagle", "num_speculative_tokens": 3}, r"method.*'ngram'.*'eagle'"),
    ({"num_speculative_tokens": 3}, r"method.*'ngram'.*None"),
    ({"method": "ngram"}, r"needs 'num_speculative_tokens'"),
    ({**NGRAM, "num_speculative_tokens": 0}, r"num_speculative_tokens.*>= 1, got 0"),
    ({**NGRAM, "num_speculative_tokens": True}, r"num_speculative_tokens.*True"),
    ({**NGRAM, "num_speculative_tokens": 2.5}, r"num_speculative_tokens.*2.5"),
    ({**NGRAM, "prompt_lookup_max": 0}, r"prompt_lookup_max.*got 0"),
    ({**NGRAM, "prompt_lookup_min": "2"}, r"prompt_lookup_min.*'2'"),
    ({**NGRAM, "prompt_lookup_min": 4, "prompt_lookup_max": 2}, r"prompt_lookup_min'\] \(4\) must be <= .*\(2\)"),
    ({**NGRAM, "disable_by_batch_size": -1}, r"disable_by_batch_size.*-1"),
    ({**NGRAM, "model": "some/draft"}, r"unknown key.*'model'.*supported: method"),
])
def test_config_rejects_bad_values(bad, match):
    with pytest.raises(ValueError, match=match):
        SpeculativeConfig.from_dict(bad)
    with pytest.raises(ValueError, match=match):  # at EngineArgs, before anything loads
        EngineArgs(model=".", speculative_config=bad)


def test_config_must_be_a_dict():
    with pytest.raises(TypeError, match="speculative_config must be a dict"):
        EngineArgs(model=".", speculative_config='{"method": "ngram"}')


def test_cli_flag_parses_json():
    from nanovllm.cli import build_parser, engine_kwargs
    ns = build_parser().parse_args(["generate", "--speculative-config",
                                    '{"method": "ngram", "num_speculative_tokens": 4}'])
    assert engine_kwargs(ns)["speculative_config"] == {"method": "ngram", "num_speculative_tokens": 4}
    ns = build_parser().parse_args(["serve", "some/model", "--speculative-config",
                                    '{"method": "ngram", "num_speculative_tokens": 2}'])
    from nanovllm.server.cli import server_engine_args
    assert server_engine_args(ns).speculative_config == {"method": "ngram", "num_speculative_tokens": 2}
    for bad in ("{not json", "[1, 2]"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["generate", "--speculative-config", bad])


# --- the n-gram proposer -----------------------------------------------------------------------------
def _h(*toks):
    return np.array(toks, dtype=np.int32)


def test_longest_match_prefers_length_then_the_latest_occurrence():
    #      0  1  2  3  4  5  6  7  8  9
    h = _h(1, 2, 3, 9, 2, 3, 8, 1, 2, 3)
    assert longest_match(h, 1, 3) == 2       # "1 2 3" at 0..2 (longer than the later "2 3" at 4..5)
    assert longest_match(h, 1, 2) == 5       # n <= 2: "2 3" ends latest at 5
    assert longest_match(h, 4, 5) == -1      # no earlier 4-gram "8 1 2 3"
    assert longest_match(_h(5, 6, 7), 1, 3) == -1   # the last token never occurred before
    assert longest_match(_h(7), 1, 1) == -1
    assert longest_match(_h(7, 7), 1, 4) == 0


def test_proposer_takes_what_followed_and_repeats_a_short_pattern():
    p = NgramProposer(k=4, n_min=1, n_max=3)
    h = _h(1, 2, 3, 9, 2, 3, 8, 1, 2, 3)
    assert p.propose([h], [4]) == [[9, 2, 3, 8]]
    assert p.propose([h], [2]) == [[9, 2]]                  # the sequence's own limit
    # a period-2 tail: the match ends one period back; the pattern continues past the history's end
    assert p.propose([_h(4, 5, 6, 5, 6)], [4]) == [[5, 6, 5, 6]]
    assert p.propose([_h(7, 7, 7)], [4]) == [[7, 7, 7, 7]]
    assert p.propose([_h(1, 2, 3)], [4]) == [[]]
    # several sequences at once, each its own match
    assert p.propose([_h(1, 2, 1), _h(3, 4, 5, 3)], [4, 1]) == [[2, 1, 2, 1], [4]]


def test_proposer_on_long_history_is_the_brute_force_answer():
    rng = np.random.default_rng(0)
    for _ in range(200):
        h = rng.integers(0, 4, size=int(rng.integers(2, 60))).astype(np.int32)
        lo, hi = sorted(rng.integers(1, 5, size=2).tolist())
        want = -1
        for n in range(min(hi, len(h) - 1), lo - 1, -1):  # longest n first, then the latest occurrence
            ends = [p for p in range(n - 1, len(h) - 1) if (h[p - n + 1:p + 1] == h[len(h) - n:]).all()]
            if ends:
                want = ends[-1]
                break
        assert longest_match(h, lo, hi) == want, (h.tolist(), lo, hi)


# --- scheduling and verification --------------------------------------------------------------------
def _decoding_seq(seq_id, prompt, outputs, max_tokens=32, params=None):
    seq = Sequence(seq_id, str(seq_id), prompt, params or SamplingParams(temperature=0.0), max_tokens, frozenset(), 0)
    seq.token_ids += outputs
    seq.num_computed_tokens = seq.num_tokens - 1
    seq.status = SequenceStatus.RUNNING
    return seq


def test_scheduler_gives_drafts_their_rows_within_the_budget():
    bm = BlockManager(16, 16, enable_prefix_caching=True)
    sched = Scheduler(bm, 8, max_num_batched_tokens=6)
    a, b = _decoding_seq(0, list(range(14)), [20]), _decoding_seq(1, list(range(30, 40)), [21])
    for s in (a, b):
        bm.grow(s, s.num_computed_tokens)
        sched.running.append(s)
    a.draft_ids, b.draft_ids = [5, 6, 7], [8, 9, 10]
    out = sched.schedule()
    # a: its last token and 3 drafts (blocks for 18 tokens); b: its last token and what is left of the budget
    assert out.num_new_tokens == [4, 2] and out.num_drafts == [3, 1] and out.num_decode == 0
    assert len(a.block_table) == 2
    batch = build_step_batch(out, 16)
    assert batch.input_ids == [20, 5, 6, 7, 21, 8]
    assert batch.positions == [14, 15, 16, 17, 10, 11]
    assert batch.logits_indices == [0, 1, 2, 3, 4, 5] and batch.logits_seqs == [0, 0, 0, 0, 1, 1]
    assert batch.sampling.steps == [1, 2, 3, 4, 1, 2]     # the output position each row samples
    d = batch.sampling.drafts
    assert d.first_rows == [0, 4] and d.num_drafts == [3, 1] and d.tokens == [5, 6, 7, 8, -1, -1]
    pending = sched.on_step_done(out)
    # only the last real token counts as computed: no block with a draft in it is registered
    assert pending == [(a, 0), (b, 4)]
    assert (a.num_computed_tokens, b.num_computed_tokens) == (15, 11)
    assert a.token_ids[-1] == PLACEHOLDER and a.num_hashed_blocks == 0


def test_drafts_never_preempt():
    bm = BlockManager(2, 16, enable_prefix_caching=False)
    sched = Scheduler(bm, 8, max_num_batched_tokens=64)
    a, b = _decoding_seq(0, list(range(15)), [20]), _decoding_seq(1, list(range(10)), [21])
    for s in (a, b):  # a fills its block with its last token; drafts would need a third block
        bm.grow(s, s.num_computed_tokens + 1)
        sched.running.append(s)
    a.draft_ids = [1, 2, 3]
    out = sched.schedule()
    assert out.num_new_tokens == [1, 1] and out.num_drafts == [0, 0] and not out.preempted
    assert build_step_batch(out, 16).sampling.drafts is None


def test_accepted_drafts_is_the_leading_run_of_matches():
    sampled = torch.tensor([5, 6, 0, 9, 8, 3, 4])
    first = torch.tensor([0, 4, 6])
    drafts = torch.tensor([[5, 6, 7], [8, -1, -1], [1, -1, -1]])  # rows 0-2 vs 5 6 7; row 4 vs 8; row 6 vs 1
    assert accepted_drafts(sampled, first, drafts).tolist() == [2, 1, 0]
    assert accepted_drafts(torch.tensor([5, 6, 7, 1]), torch.tensor([0]), torch.tensor([[5, 6, 7]])).tolist() == [3]


def test_speculating_sequences_share_the_step_token_budget():
    """k = 12: one sequence gets 12 drafts; 16 share the 128 - 16 tokens their rows leave (7 each); 32 get 3."""
    spec = Speculator(SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 12,
                                                   "prompt_lookup_min": 1, "prompt_lookup_max": 2}), max_model_len=1000)
    period = list(range(1, 21))

    def batch(n):
        return [_decoding_seq(i, period * 3, [1], max_tokens=64) for i in range(n)]

    for n, each in ((1, 12), (16, 7), (32, 3)):
        seqs = batch(n)
        assert spec.wants_drafts(seqs)
        assert spec.propose(seqs) == seqs
        assert [len(s.draft_ids) for s in seqs] == [each] * n
        assert n + sum(len(s.draft_ids) for s in seqs) <= SPEC_MAX_STEP_TOKENS
    assert not spec.wants_drafts(batch(33))


def test_policy_switches_off_for_large_batches_and_backs_off_on_misses():
    spec = Speculator(SpeculativeConfig.from_dict({**NGRAM, "prompt_lookup_min": 1, "prompt_lookup_max": 2,
                                                   "disable_by_batch_size": 4}), max_model_len=1000)
    rep = _decoding_seq(0, [1, 2, 3, 1, 2, 3, 1, 2], [3])        # repeats: always has a proposal
    odd = _decoding_seq(1, [1, 2, 3, 4, 5, 6], [7])             # never does
    big = [rep, odd] + [_decoding_seq(i, [9], [9]) for i in range(2, 5)]
    assert not spec.wants_drafts(big)                            # 5 running > disable_by_batch_size
    assert spec.wants_drafts([rep, odd])
    assert spec.propose([rep, odd]) == [rep] and rep.draft_ids == [1, 2, 3] and odd.draft_ids == []
    # odd missed: it is due again 2 steps later, then 4, 8, 16 ... MAX_BACKOFF_STEPS steps after each further miss
    due = [True]
    for _ in range(150):
        due.append(spec.wants_drafts([odd]))
        if due[-1]:
            spec.propose([odd])
    gaps = np.diff(np.flatnonzero(due)).tolist()
    assert gaps[:5] == [2, 4, 8, 16, 32] and set(gaps[5:]) == {MAX_BACKOFF_STEPS}
    # rep's drafts: all accepted -> one more next time (up to k); none accepted -> one draft, and a backoff
    spec.record(rep, 3, 3)
    assert rep.spec.max_drafts == 3 and rep.spec.misses == 0
    spec.record(rep, 3, 1)
    assert rep.spec.max_drafts == 2
    spec.record(rep, 2, 0)
    assert rep.spec.max_drafts == 1 and rep.spec.misses == 1 and rep.spec.next_try > spec.clock
    assert (spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens) == (3, 8, 4)
    assert spec.mean_acceptance_length == 1 + 4 / 3


def test_policy_respects_max_tokens_context_and_sampling_features():
    spec = Speculator(SpeculativeConfig.from_dict({**NGRAM, "prompt_lookup_min": 1}), max_model_len=12)
    near_end = _decoding_seq(0, [1, 1, 1], [1], max_tokens=3)    # 1 output, 2 more allowed: 1 draft + 1 token
    assert spec.propose([near_end]) == [near_end] and near_end.draft_ids == [1]
    at_context = _decoding_seq(1, [1] * 10, [1], max_tokens=100)  # 11 of 12 tokens: no room for a draft
    penalized = _decoding_seq(2, [1, 1, 1], [1], params=SamplingParams(temperature=0.0, presence_penalty=0.5))
    prefill = _decoding_seq(3, [1, 1, 1], [])                      # its first token is not sampled yet
    assert not spec.wants_drafts([at_context, penalized, prefill])
    assert spec.propose([at_context, penalized, prefill]) == []


def test_server_metrics_use_vllms_names():
    from nanovllm.engine.core_protocol import EngineStats
    from nanovllm.server.metrics import ServerMetrics
    stats = dict(num_running=1, num_waiting=0, num_free_blocks=3, num_blocks=6, prompt_tokens=10, generation_tokens=20,
                 num_preemptions=0, prefix_queries=1, prefix_hits=0)
    assert "spec_decode" not in ServerMetrics().render(EngineStats(**stats), "m")
    text = ServerMetrics().render(EngineStats(**stats, spec_decode=True, spec_num_drafts=4, spec_num_draft_tokens=12,
                                              spec_num_accepted_tokens=7), "m")
    assert 'nanovllm:spec_decode_num_draft_tokens_total{model_name="m"} 12' in text
    assert 'nanovllm:spec_decode_num_accepted_tokens_total{model_name="m"} 7' in text
    assert 'nanovllm:spec_decode_num_drafts_total{model_name="m"} 4' in text
