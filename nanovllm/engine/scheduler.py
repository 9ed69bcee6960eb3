"""Token-budget scheduler.

There is no prefill phase and no decode phase. Each sequence has `num_computed_tokens` (K/V in the cache)
and `num_tokens` (known tokens); each step hands out up to `max_num_batched_tokens` tokens of work:

1. Running sequences first, in admission order: each gets min(tokens left, budget left) — one token for
   a sequence in decode, a chunk for one still in prefill. If its blocks can't be extended, the most
   recently admitted running sequence is preempted (its blocks released, its progress reset; it is
   recomputed later, prefix cache permitting), repeatedly, until the blocks fit or it preempted itself.
2. Then waiting sequences, oldest first, while the budget, `max_num_seqs` and free blocks allow: each
   reuses whatever prefix the cache holds and is admitted with a chunk of its remaining tokens.

Chunked prefill, prefix-cache hits, decode and mixed prefill+decode batches all come out of these two
loops. A sequence whose chunk reaches its last known token gets a new token sampled this step.

With async scheduling the step after this one is scheduled before this one's tokens are read back: each
sampling sequence gets a PLACEHOLDER token (its value stays on the device and feeds the next step's input
directly); a sequence whose placeholder is its last allowed token is not scheduled again.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.sequence import PLACEHOLDER, Sequence, SequenceStatus


@dataclass
class SchedulerOutput:
    """One step's work: sequences and how many new tokens of each to compute."""
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    @property
    def is_decode(self) -> bool:
        """Every sequence computes exactly its last token (pure decode batch)."""
        return all(n == 1 and s.num_computed_tokens == s.num_tokens - 1
                   for s, n in zip(self.seqs, self.num_new_tokens))

    def __bool__(self) -> bool:
        return bool(self.seqs)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    # --- request lifecycle -------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Mark a running or waiting sequence finished and release its blocks."""
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status == SequenceStatus.WAITING:
            self.waiting.remove(seq)
        else:
            return
        self.bm.release(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    # --- one step ----------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens

        # 1. running sequences (decode, or the next chunk of a prefill)
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if seq.awaiting_last_token:
                i += 1
                continue
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
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
            budget -= n
            i += 1

        # 2. waiting sequences (new, or preempted earlier); none while we are short of blocks
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not out.preempted:
            seq = self.waiting[0]
            hits, hashes = self.bm.find_cached_prefix(seq)
            cached = len(hits) * self.bm.block_size
            n = min(seq.num_tokens - cached, budget)
            if not self.bm.can_admit(hits, cached + n):
                break
            self.waiting.popleft()
            self.bm.admit(seq, hits, hashes)
            self.bm.grow(seq, cached + n)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.seqs.append(seq)
            out.num_new_tokens.append(n)
            budget -= n
        return out

    def _preempt(self, seq: Sequence) -> None:
        self.bm.release(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def on_step_done(self, out: SchedulerOutput) -> list[tuple[Sequence, int]]:
        """Advance computed counts once a step is launched and give every sampling sequence a PLACEHOLDER
        token. Returns (sequence, row of the step's sampled ids) pairs; sequences finished meanwhile
        (aborted, or stopped by the previous step's tokens) are skipped."""
        sampled = []
        row = 0
        for seq, n in zip(out.seqs, out.num_new_tokens):
            samples = seq.num_computed_tokens + n == seq.num_tokens
            if seq.status == SequenceStatus.RUNNING:
                seq.num_computed_tokens += n
                self.bm.register_full_blocks(seq)
                if samples:
                    seq.append_token(PLACEHOLDER)
                    seq.pending_row = row
                    sampled.append((seq, row))
            row += samples
        return sampled
