"""Token-budget scheduler.

There is no prefill phase and no decode phase. Each sequence has `num_computed_tokens` (K/V in the cache)
and `num_tokens` (known tokens); each step hands out up to `max_num_batched_tokens` tokens of work:

1. Running sequences first, in admission order: each gets min(tokens left, budget left) — one token for
   a sequence in decode, a chunk for one still in prefill. If its blocks can't be extended, the most
   recently admitted running sequence is preempted (its blocks released, its progress reset; it is
   recomputed later, prefix cache permitting), repeatedly, until the blocks fit or it preempted itself.
2. Then waiting sequences, oldest first, while the budget, `max_num_seqs` and free blocks allow: each
   reuses whatever prefix the cache holds and is admitted with a chunk of its remaining tokens. Samples 1..n-1
   of a request wait (right behind sample 0) until sample 0 has computed its prompt's full blocks, which they
   then take from the prefix cache instead of computing them again.

Chunked prefill, prefix-cache hits, decode and mixed prefill+decode batches all come out of these two
loops. A sequence whose chunk reaches its last known token gets a new token sampled this step. Decode rows
(sequences that compute one token, their last) come first in the step (so a backend can send them to its decode
kernel).

Policies (what decides how much prefill joins a step):
* ``fcfs``: waiting requests in arrival order, as much prefill as the token budget allows. Lowest time to first
  token; what a server wants.
* ``balanced``: for a batch known up front (offline ``generate``), spread the prefill over the run instead of
  front-loading it. A decode step of a large model is bound by reading the weights: every step reads them once,
  whether it computes 50 rows or 250, so prefill rows that ride along in a decode step cost little, while a
  decode step at the run's thin tail pays the full weight read for a few rows. Each step therefore computes
  about ``work left / steps left`` tokens: work left counts every unfinished request's prompt and
  ``max_tokens`` still to compute, steps left is the longest ``max_tokens`` still to generate (no schedule can
  finish sooner). Waiting requests are admitted longest ``max_tokens`` first, and one whose ``max_tokens`` is
  not shorter than what the run still needs is admitted at once with a full chunk (waiting would lengthen the
  run). While every request fits in ``max_num_seqs`` and the KV cache at its full length, a request's prompt is
  computed ahead but its last prompt token (which samples its first token) waits until then, so requests finish
  together at the end and the last steps are as full as the others. Only requests whose length is known are
  held back: one that can stop early (EOS, stop ids or strings), for which ``max_tokens`` is only a bound, is
  admitted as under fcfs.

With async scheduling the step after this one is scheduled before this one's tokens are read back: each
sampling sequence gets a PLACEHOLDER token (its value stays on the device and feeds the next step's input
directly); a sequence whose placeholder is its last allowed token is not scheduled again.

Speculative decoding (engine/spec/): a decoding sequence with k draft tokens (`Sequence.draft_ids`) wants 1 + k
tokens: its last token and the drafts after it, as far as the budget allows (`SchedulerOutput.num_drafts`), with
KV slots for all of them (if the free blocks don't cover the drafts, it verifies none: drafts never preempt).
Only the last real token counts as computed when the step is launched (`on_step_done`); the engine adds the
accepted drafts once they are verified, and the rejected ones' slots are overwritten later. So a block is
registered in the prefix cache only once every token in it is real.
"""
from __future__ import annotations

import bisect
import math
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from nanovllm.config import SCHEDULING_POLICIES
from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.sequence import PLACEHOLDER, Sequence, SequenceStatus


def is_decode_row(seq: Sequence, n: int) -> bool:
    """A decode row: the sequence computes one token, its last known one, so the step samples its next token
    from that row (a decode step proper, or a prompt's last token)."""
    return n == 1 and seq.num_computed_tokens == seq.num_tokens - 1


class WaitingQueue:
    """The waiting sequences in scheduling order, with O(1) removal of any one of them (an abort), so that
    aborting a request costs what the request holds, not what the queue holds."""

    def __init__(self):
        self._seqs: OrderedDict[Sequence, None] = OrderedDict()  # a Sequence hashes by identity

    def __len__(self) -> int:
        return len(self._seqs)

    def __bool__(self) -> bool:
        return bool(self._seqs)

    def __iter__(self) -> Iterator[Sequence]:
        return iter(self._seqs)

    def __contains__(self, seq: Sequence) -> bool:
        return seq in self._seqs

    def first(self) -> Sequence:
        return next(iter(self._seqs))

    def append(self, seq: Sequence) -> None:
        self._seqs[seq] = None

    def appendleft(self, seq: Sequence) -> None:
        self._seqs[seq] = None
        self._seqs.move_to_end(seq, last=False)

    def popleft(self) -> Sequence:
        return self._seqs.popitem(last=False)[0]

    def remove(self, seq: Sequence) -> None:
        del self._seqs[seq]

    def sort(self, key: Callable[[Sequence], object]) -> None:
        self._seqs = OrderedDict.fromkeys(sorted(self._seqs, key=key))


@dataclass
class SchedulerOutput:
    """One step's work: sequences and how many new tokens of each to compute. The decode rows
    (`is_decode_row`) come first: `num_decode` of them."""
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)  # draft tokens included
    num_drafts: list[int] = field(default_factory=list)      # of them, draft tokens (seq.draft_ids[:k]) verified
    preempted: list[Sequence] = field(default_factory=list)
    num_decode: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    @property
    def is_decode(self) -> bool:
        """Every sequence is a decode row (pure decode batch)."""
        return self.num_decode == len(self.seqs) > 0

    def __bool__(self) -> bool:
        return bool(self.seqs)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 policy: str = "fcfs", step_sizes: list[int] | tuple[int, ...] = ()):
        """`step_sizes`: token counts the runner runs fastest (its mixed-step CUDA graphs); the balanced policy
        rounds its steps up to one of them, so no graph row is padding."""
        if policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling policy must be one of {SCHEDULING_POLICIES}, got {policy!r}")
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.policy = policy
        self.step_sizes = sorted(step_sizes)
        self.waiting = WaitingQueue()
        self._waiting_work = 0  # balanced policy: tokens the waiting sequences will compute (prompt + max_tokens)
        self._unsorted = False  # requests were added since `waiting` was last put in the policy's order
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    # --- request lifecycle -------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)
        self._waiting_work += self._work(seq)
        self._unsorted = True

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Mark a running or waiting sequence finished and release its blocks. O(1) for a waiting sequence (an
        abort of a queued request), O(max_num_seqs) for a running one."""
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status == SequenceStatus.WAITING:
            self.waiting.remove(seq)
            self._waiting_work -= self._work(seq)
        else:
            return
        self.bm.release(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    # --- one step ----------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        balanced = self.policy == "balanced"
        if balanced and self._unsorted:
            # preempted sequences stay in front (they have waited longest), then those of unknown length (never
            # held back), then longest max_tokens first
            self.waiting.sort(key=lambda s: (s.num_preemptions == 0, s.fixed_length,
                                             -s.max_tokens if s.fixed_length else 0))
        self._unsorted = False
        # tokens of prompt (or recomputation) work this step may take; decode tokens never wait for it
        prefill_budget, horizon, hold = self._prefill_target() if balanced else (budget, 0, False)

        # 1. running sequences (decode, or the next chunk of a prefill)
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if seq.awaiting_last_token:
                i += 1
                continue
            left = seq.num_tokens - seq.num_computed_tokens
            n = min(left, budget)
            starts = not seq.num_output_tokens  # its last prompt token samples its first token
            if n > 1 or (hold and starts):
                if not self._urgent(seq, horizon):
                    # held back: prefill out of the step's prefill budget; under `hold` the last prompt token
                    # waits until the sequence is urgent, so that it starts as late as the run allows
                    n = min(n, prefill_budget, left - 1 if hold and starts else left)
                if n == 0:
                    i += 1
                    continue
                prefill_budget = max(prefill_budget - n, 0)
            drafts = 0
            if left == 1 and seq.draft_ids:  # decode: the drafts are verified after its last token, in this step
                drafts = min(len(seq.draft_ids), budget - 1)
                if not self.bm.can_grow(seq, seq.num_computed_tokens + 1 + drafts):
                    drafts = 0  # drafts never cost a preemption
                n += drafts
            target = seq.num_computed_tokens + n
            while not self.bm.can_grow(seq, target):
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            if seq.status != SequenceStatus.RUNNING:
                break  # preempted itself: nothing after it is left in `running`
            self.bm.grow(seq, target)
            out.seqs.append(seq)
            out.num_new_tokens.append(n)
            out.num_drafts.append(drafts)
            budget -= n
            i += 1

        # 2. waiting sequences (new, or preempted earlier); none while we are short of blocks
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not out.preempted:
            seq = self.waiting.first()
            if not self._prefix_ready(seq):
                break  # a later sample of a request whose first one is still computing the prompt
            urgent = self._urgent(seq, horizon)
            room = budget if urgent else min(budget, prefill_budget)
            if room <= 0:
                break
            hits, hashes = self.bm.find_cached_prefix(seq)
            cached = len(hits) * self.bm.block_size
            n = min(seq.num_tokens - cached, room)
            if hold and not urgent and not seq.num_output_tokens:
                n = min(n, max(seq.num_tokens - cached - 1, 1))  # keep the last prompt token back
            if not self.bm.can_admit(hits, cached + n):
                break
            self.waiting.popleft()
            self._waiting_work -= self._work(seq)
            self.bm.admit(seq, hits, hashes)
            self.bm.grow(seq, cached + n)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.seqs.append(seq)
            out.num_new_tokens.append(n)
            out.num_drafts.append(0)
            budget -= n
            prefill_budget = max(prefill_budget - n, 0)

        # decode rows first (stable): a backend can hand that prefix of the batch to its decode kernel
        decode = [is_decode_row(s, n) for s, n in zip(out.seqs, out.num_new_tokens)]
        out.num_decode = sum(decode)
        if 0 < out.num_decode < len(out.seqs):
            order = sorted(range(len(out.seqs)), key=lambda i: not decode[i])
            out.seqs = [out.seqs[i] for i in order]
            out.num_new_tokens = [out.num_new_tokens[i] for i in order]
            out.num_drafts = [out.num_drafts[i] for i in order]
        return out

    def _prefill_target(self) -> tuple[int, int, bool]:
        """Balanced policy: (prompt tokens this step may compute, steps a request must need to be urgent,
        whether last prompt tokens are held back).

        The step's rows are ``ceil(work / steps)``, rounded up to a step size: work is every unfinished token
        still to compute (prompts and ``max_tokens``), steps the longest ``max_tokens`` still to generate. The
        running sequences' decode rows come out of those rows; the rest may go to prefill, unless that is under half
        the smallest step size. A request's prefill and its start are decoupled: its last prompt token (which
        samples its first token) is held back until it is urgent, so prefill fills the early steps while requests
        start as late as the run allows and finish together, keeping the tail of the run full. (Admitting fast
        enough for every waiting request's latest start, with the start tied to the prefill, front-loads both and
        thins the tail: ~2% slower in a simulation, benchmarks/RESULTS.md run 17.)"""
        work = 0
        decode = 0
        last_prompt_token = 0  # sequences with only their last prompt token left to compute
        horizon = 0  # steps the running sequences still need (their longest remaining max_tokens)
        for s in self.running:
            if s.awaiting_last_token:
                continue
            work += self._work(s)
            if s.num_tokens - s.num_computed_tokens == 1:
                if s.num_output_tokens:
                    decode += 1
                else:
                    last_prompt_token += 1
            horizon = max(horizon, s.max_tokens - s.num_output_tokens)
        # the waiting sequences: their work is kept up to date; the longest of them is the first of known length
        # (sorted by max_tokens), or one of the few in front of it (preempted, or of unknown length)
        work += self._waiting_work
        steps = horizon
        for s in self.waiting:
            steps = max(steps, s.max_tokens - s.num_output_tokens)
            if s.fixed_length and not s.num_preemptions:
                break
        # hold back the last prompt token of a request that need not start yet, so that it starts as late as the
        # run allows: while every unfinished request fits in max_num_seqs and the KV cache can hold all of them at
        # their full length, requests then finish together at the end, and the last steps stay as full as the
        # first. Otherwise its first token is sampled as soon as its prompt is computed.
        hold = (len(self.running) + len(self.waiting) <= self.max_num_seqs
                and work // self.bm.block_size + len(self.running) + len(self.waiting) <= self.bm.num_free_blocks)
        if not hold:
            decode += last_prompt_token
        rows = max(math.ceil(work / max(steps, 1)), decode)
        i = bisect.bisect_left(self.step_sizes, rows)
        if i < len(self.step_sizes):
            rows = self.step_sizes[i]
        if self.step_sizes and rows - decode < self.step_sizes[0] // 2:
            rows = decode  # too little prefill to pay for a mixed step's varlen kernel: it joins a later, fuller step
        # under `hold`, a request is urgent once it needs as many steps as the whole run still does (so only the
        # longest starts at once); otherwise once it needs as many as the running requests still do
        return rows - decode, steps if hold else horizon, hold

    def _prefix_ready(self, seq: Sequence) -> bool:
        """Sample i > 0 of a request may start: its sample 0 is not running (finished, preempted) or has computed
        every full block of the prompt that a hit can reuse."""
        lead = seq.leader
        if lead is None or not self.bm.enable_prefix_caching or lead.status != SequenceStatus.RUNNING:
            return True
        return lead.num_computed_tokens >= (seq.num_tokens - 1) // self.bm.block_size * self.bm.block_size

    @staticmethod
    def _work(seq: Sequence) -> int:
        """Tokens a sequence still computes: its prompt (again, after a preemption) and up to max_tokens."""
        return seq.num_prompt_tokens + seq.max_tokens - seq.num_computed_tokens

    def _urgent(self, seq: Sequence, horizon: int) -> bool:
        """Balanced policy: holding back this sequence's prefill would lengthen the run (it needs at least as
        many steps as the running sequences still do), or its length is not known. Under fcfs nothing is held
        back anyway."""
        return (self.policy != "balanced" or not seq.fixed_length
                or seq.max_tokens - seq.num_output_tokens >= horizon)

    def _preempt(self, seq: Sequence) -> None:
        self.bm.release(seq)
        seq.draft_ids = []
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        self._waiting_work += self._work(seq)

    def on_step_done(self, out: SchedulerOutput) -> list[tuple[Sequence, int]]:
        """Advance computed counts once a step is launched and give every sampling sequence a PLACEHOLDER
        token. Returns (sequence, first row of the step's sampled ids) pairs; sequences finished meanwhile
        (aborted, or stopped by the previous step's tokens) are skipped. A sequence verifying k drafts has 1 + k
        rows and counts only its last real token as computed: the engine adds the accepted drafts."""
        sampled = []
        row = 0
        for seq, n, drafts in zip(out.seqs, out.num_new_tokens, out.num_drafts or [0] * len(out.seqs)):
            n -= drafts
            samples = seq.num_computed_tokens + n == seq.num_tokens
            if seq.status == SequenceStatus.RUNNING:
                seq.num_computed_tokens += n
                self.bm.register_full_blocks(seq)
                if samples:
                    seq.append_token(PLACEHOLDER)
                    seq.pending_row = row
                    sampled.append((seq, row))
            row += (1 + drafts) * samples
        return sampled
