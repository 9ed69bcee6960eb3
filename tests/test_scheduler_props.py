"""Property tests: random add/step/finish/abort sequences against the block manager and scheduler.

No model: a step is simulated by advancing computed counts and appending a random token to every
sequence that sampled. Invariants after every operation: each block's ref count equals the number of
live block tables holding it, free blocks are exactly those with ref count 0, the prefix-cache table
points at blocks holding those hashes, the block manager's events (stored / removed / cleared) replayed give its
prefix-cache table; at the end every block is free.
"""
from __future__ import annotations

import random

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from nanovllm.engine.block_manager import BlockManager, hash_block
from nanovllm.engine.scheduler import Scheduler
from nanovllm.engine.sequence import PLACEHOLDER, Sequence, SequenceStatus
from nanovllm.sampling_params import SamplingParams


class CacheMirror:
    """The prefix cache as a router sees it, built from the block manager's events alone."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.hashes: set[int] = set()

    def stored(self, block_hashes, parent_hash, token_ids):
        assert len(block_hashes) == len(token_ids)
        for h, toks in zip(block_hashes, token_ids):
            assert h not in self.hashes and len(toks) == self.block_size and h == hash_block(parent_hash, toks)
            self.hashes.add(h)
            parent_hash = h

    def removed(self, block_hashes):
        assert set(block_hashes) <= self.hashes
        self.hashes -= set(block_hashes)

    def cleared(self):
        self.hashes.clear()


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(block_size=st.sampled_from([16, 32]), num_blocks=st.integers(8, 40),
                budget=st.integers(16, 200), max_seqs=st.integers(1, 8), caching=st.booleans(),
                async_mode=st.booleans(), policy=st.sampled_from(["fcfs", "balanced"]),
                step_sizes=st.sampled_from([(), (16, 32, 48), (64,)]))
    def setup(self, block_size, num_blocks, budget, max_seqs, caching, async_mode, policy, step_sizes):
        self.async_mode = async_mode  # resolve each step's tokens one step late, as async scheduling does
        self.inflight = None
        self.mirror = CacheMirror(block_size)
        self.bm = BlockManager(num_blocks, block_size, caching, events=self.mirror)
        self.sched = Scheduler(self.bm, max_seqs, budget, policy, step_sizes=step_sizes)
        self.max_len = num_blocks * block_size  # one sequence alone always fits
        self.budget, self.max_seqs = budget, max_seqs
        self.seqs: dict[int, Sequence] = {}
        self.next_id = 0
        self.rng = random.Random(0)
        self.prefixes = [[self.rng.randrange(4) for _ in range(200)] for _ in range(3)]

    def live(self):
        return [s for s in self.seqs.values() if not s.is_finished]

    @rule(prefix=st.integers(0, 2), shared=st.integers(0, 120), extra=st.integers(1, 100),
          max_tokens=st.integers(1, 40))
    def add(self, prefix, shared, extra, max_tokens):
        prompt = self.prefixes[prefix][:shared] + [self.rng.randrange(4) for _ in range(extra)]
        prompt = prompt[: self.max_len - 1]
        max_tokens = min(max_tokens, self.max_len - len(prompt))  # the engine caps it the same way
        seq = Sequence(self.next_id, str(self.next_id), prompt, SamplingParams(max_tokens=max_tokens),
                       max_tokens, frozenset(), 0)
        self.seqs[self.next_id] = seq
        self.next_id += 1
        self.sched.add(seq)

    @rule()
    def step(self):
        out = self.sched.schedule()
        assert out.num_tokens <= self.budget
        assert len(self.sched.running) <= self.max_seqs
        assert len({s.seq_id for s in out.seqs}) == len(out.seqs)
        for s, n in zip(out.seqs, out.num_new_tokens):
            assert n >= 1 and s.num_computed_tokens + n <= s.num_tokens
            assert len(s.block_table) * self.bm.block_size >= s.num_computed_tokens + n
        if self.sched.has_unfinished() and not out.preempted and self.inflight is None:
            assert out, "no progress although requests are pending"
        if self.inflight is not None:
            self._resolve(self.inflight)
            self.inflight = None
        if out:
            pending = self.sched.on_step_done(out)
            assert all(s.token_ids[-1] == PLACEHOLDER for s, _ in pending)
            if self.async_mode:
                self.inflight = pending
            else:
                self._resolve(pending)

    def _resolve(self, pending):
        for seq, _ in pending:
            if seq.is_finished:
                continue
            assert seq.token_ids[-1] == PLACEHOLDER
            seq.token_ids[-1] = self.rng.randrange(4)
            if seq.num_output_tokens >= seq.max_tokens or seq.num_tokens >= self.max_len:
                self.sched.finish(seq, "length")

    @precondition(lambda self: any(s.status == SequenceStatus.RUNNING for s in self.seqs.values()))
    @rule(data=st.data())
    def finish_running(self, data):
        running = [s for s in self.seqs.values() if s.status == SequenceStatus.RUNNING]
        self.sched.finish(data.draw(st.sampled_from(running)), "stop")

    @precondition(lambda self: any(not s.is_finished for s in self.seqs.values()))
    @rule(data=st.data())
    def abort(self, data):
        self.sched.finish(data.draw(st.sampled_from(self.live())), "abort")

    @rule(data=st.data())
    def abort_finished_again(self, data):
        done = [s for s in self.seqs.values() if s.is_finished]
        if done:
            before = self.bm.num_free_blocks
            self.sched.finish(data.draw(st.sampled_from(done)), "abort")  # no-op, never a double free
            assert self.bm.num_free_blocks == before

    @rule()
    def reset_prefix_cache(self):
        held = any(s.block_table for s in self.seqs.values())
        assert self.bm.reset_prefix_cache() == (not held)
        if not held:
            assert not self.bm.hash_to_block and all(b.hash is None for b in self.bm.blocks)

    @invariant()
    def blocks_consistent(self):
        if not hasattr(self, "bm"):
            return
        self.bm.check_invariants(self.live())
        assert self.mirror.hashes == set(self.bm.hash_to_block)
        assert all(b.ref_count >= 0 for b in self.bm.blocks)
        for s in self.seqs.values():
            if s.status != SequenceStatus.RUNNING:
                assert s.block_table == []

    @invariant()
    def waiting_work_kept_up_to_date(self):
        if not hasattr(self, "sched"):
            return
        assert self.sched._waiting_work == sum(s.num_prompt_tokens + s.max_tokens - s.num_computed_tokens
                                               for s in self.sched.waiting)

    def teardown(self):
        if not hasattr(self, "bm"):
            return
        # drain: everything left must finish and free every block
        for _ in range(10_000):
            if not self.sched.has_unfinished() and self.inflight is None:
                break
            self.step()
        assert not self.sched.has_unfinished()
        self.bm.check_invariants([])
        assert self.bm.num_free_blocks == self.bm.num_blocks


SchedulerMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
TestSchedulerMachine = SchedulerMachine.TestCase


def test_aborting_a_long_queue_is_linear_and_keeps_order():
    """Finishing waiting sequences removes them from the queue in O(1) each (a list/deque scan per abort made
    aborting 64k queued sequences take 10 s), and the rest keep their order."""
    bm = BlockManager(64, 16)
    sched = Scheduler(bm, 8, 256)
    params = SamplingParams(max_tokens=4)
    seqs = [Sequence(i, str(i), [1, 2, 3], params, 4, frozenset(), 0) for i in range(40_000)]
    for s in seqs:
        sched.add(s)
    for s in reversed(seqs[1::2]):        # the worst order for a scan from the front
        sched.finish(s, "abort")
    assert len(sched.waiting) == 20_000 and sched._waiting_work == 20_000 * 7
    assert all(s.finish_reason == "abort" for s in seqs[1::2])
    assert [s.seq_id for s in sched.waiting][:3] == [0, 2, 4]
    out = sched.schedule()
    assert [s.seq_id for s in out.seqs] == [0, 2, 4, 6, 8, 10, 12, 14]
    for s in seqs[::2]:
        sched.finish(s, "abort")
    assert not sched.has_unfinished() and bm.num_free_blocks == bm.num_blocks
