"""When to speculate, for which sequences and with how many drafts; the per-sequence state; the counters.

The engine asks `wants_drafts(running)` before it schedules a step. Drafts for a step need the token the step
before it sampled, which async scheduling has not read yet when it schedules the next step, so a step with drafts
is scheduled only after the engine has read the step in flight, and runs synchronously; a step without drafts keeps
the async path (and, on the GPU, its decode CUDA graphs). So the answer must be "no" wherever speculation would
not pay:

* large batches: no drafts in a step with more than `disable_by_batch_size` running sequences (default 32 for
  k >= 3, config.py), and a verification step holds at most `max_step_tokens` tokens (SPEC_MAX_STEP_TOKENS, 128):
  the speculating sequences share the draft tokens its rows leave, k at most each. A forward pass over that many
  rows is bound by reading the weights, so the drafts ride almost for free, and the step fits the smallest
  mixed-step graph; above it, drafts cost compute and the lost async overlap, and at full load speculation is off
  altogether.
* sequences whose drafts do not get accepted: after a step in which a sequence got no proposal or none of its
  drafts was accepted, it is not *due* for 2, 4, 8, ... up to MAX_BACKOFF_STEPS steps (reset by an accepted
  draft), and a step speculates only if some sequence is due. Text that does not repeat itself (random weights,
  most chat) thus costs a synchronous step now and then, not every step. Once a step speculates, every sequence
  that can gets a proposal, due or not: the step is synchronous anyway, and its drafts ride along.
* draft length: a sequence gets up to min(k, accepted + 1) drafts after a step in which it had `accepted` of them
  accepted (one more than last time when all were), never more than it can still emit (max_tokens, the context).

Sequences with penalties, structured outputs or multi-token bad words never speculate (`Sequence.can_speculate`).
Counters (vLLM's metrics): `num_drafts` (sequence-steps with drafts), `num_draft_tokens`, `num_accepted_tokens`;
the mean acceptance length is 1 + accepted / drafts (tokens per verification step of a sequence).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from nanovllm.config import SpeculativeConfig
from nanovllm.engine.sequence import PLACEHOLDER, Sequence
from nanovllm.engine.spec import make_proposer

MAX_BACKOFF_STEPS = 32


@dataclass
class SpecState:
    """The speculator's view of one sequence (`Sequence.spec`)."""
    max_drafts: int                    # drafts it gets next time (adaptive, <= k)
    # its tokens as the proposer reads them, copied as they arrive: history[:length] == token_ids[:length]
    history: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int32))
    length: int = 0
    misses: int = 0                    # consecutive attempts without an accepted draft
    next_try: int = 0                  # the step (Speculator.clock) from which it is due again


class Speculator:
    def __init__(self, config: SpeculativeConfig, max_model_len: int):
        self.config = config
        self.k = config.num_speculative_tokens
        self.max_model_len = max_model_len
        self.proposer = make_proposer(config)
        self.clock = 0                 # steps asked about (wants_drafts)
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a sequence gets per verification step: 1 + accepted drafts per step with drafts (1.0: none)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    def _room(self, seq: Sequence) -> int:
        """Drafts it can still use: a step emits up to drafts + 1 tokens, within max_tokens and the context."""
        return min(seq.max_tokens - seq.num_output_tokens, self.max_model_len - seq.num_tokens) - 1

    def _state(self, seq: Sequence) -> SpecState:
        if seq.spec is None:
            seq.spec = SpecState(max_drafts=self.k)
        return seq.spec

    def _can_draft(self, seq: Sequence) -> bool:
        """A decoding sequence that can verify drafts in the next step."""
        return (seq.num_output_tokens > 0 and seq.num_computed_tokens == seq.num_tokens - 1 and seq.can_speculate
                and self._room(seq) > 0)

    def _due(self, seq: Sequence) -> bool:
        """One that can, and whose backoff is over."""
        return self._can_draft(seq) and self._state(seq).next_try <= self.clock

    def wants_drafts(self, running: list[Sequence]) -> bool:
        """Whether the next step speculates: few enough sequences run, and one of them is due. Called once per
        step, before its in-flight predecessor is read (a due sequence's last token may be a placeholder)."""
        self.clock += 1
        return 0 < len(running) <= self.config.disable_by_batch_size and any(self._due(s) for s in running)

    def _history(self, seq: Sequence) -> np.ndarray:
        st = self._state(seq)
        toks = seq.token_ids
        L = len(toks)
        if L > st.history.shape[0]:
            grown = np.empty(max(2 * st.history.shape[0], L, 64), dtype=np.int32)
            grown[:st.length] = st.history[:st.length]
            st.history = grown
        if L > st.length:
            st.history[st.length:L] = toks[st.length:L]
            st.length = L
        return st.history[:L]

    def propose(self, running: list[Sequence]) -> list[Sequence]:
        """Set `draft_ids` of the sequences that can draft and the proposer has drafts for (their last tokens are
        known now); returns them. One without a proposal backs off."""
        seqs = [s for s in running if self._can_draft(s) and s.token_ids[-1] != PLACEHOLDER]
        if not seqs:
            return []
        # the step's token budget: a row per running sequence, the rest shared by the ones that can draft
        share = max(1, (self.config.max_step_tokens - len(running)) // len(seqs))
        limits = [min(self._state(s).max_drafts, self._room(s), share) for s in seqs]
        drafted = []
        for seq, drafts in zip(seqs, self.proposer.propose([self._history(s) for s in seqs], limits)):
            if drafts:
                seq.draft_ids = drafts
                drafted.append(seq)
            else:
                self._miss(seq.spec)
        return drafted

    def record(self, seq: Sequence, num_drafts: int, num_accepted: int) -> None:
        """A verification step's outcome for one sequence: the counters, its next draft length and backoff."""
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        st = self._state(seq)
        st.max_drafts = min(self.k, num_accepted + 1)
        if num_accepted:
            st.misses = 0
        else:
            self._miss(st)

    def _miss(self, st: SpecState) -> None:
        st.misses += 1
        st.next_try = self.clock + min(1 << min(st.misses, 30), MAX_BACKOFF_STEPS)
