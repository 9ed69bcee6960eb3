"""One request's state as it moves waiting -> running -> finished (possibly back to waiting if preempted)."""
from __future__ import annotations

import enum

from nanovllm.sampling_params import SamplingParams

PLACEHOLDER = -1  # an output token sampled on the device but not yet read back (async scheduling)


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """Token ids (prompt then output), how many of them have K/V in the cache, and the blocks holding them.

    The scheduler's whole view of a request is `num_computed_tokens` against `num_tokens`: the difference
    is the work left before the next token can be sampled (a whole prompt, a chunk of one, or the single
    last token in decode).
    """

    def __init__(self, seq_id: int, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 max_tokens: int, stop_ids: frozenset[int], noise_seed: int, index: int = 0,
                 leader: Sequence | None = None):
        self.seq_id = seq_id
        self.request_id = request_id
        self.index = index                    # which of the request's n samples
        self.leader = leader                  # sample 0 of the request (None for sample 0 itself)
        self.token_ids: list[int] = list(prompt_token_ids)
        self._prompt: list[int] = list(prompt_token_ids)  # read-only copy, handed out without copying
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.max_tokens = max_tokens          # resolved: never past max_model_len
        self.stop_ids = stop_ids              # EOS (unless ignore_eos) and stop_token_ids
        self.noise_seed = noise_seed          # seed of this request's sampling noise (its own or drawn)
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        self.block_table: list[int] = []
        self.num_hashed_blocks = 0            # leading blocks registered in the prefix cache
        self.block_hashes: list[int] = []     # chain hash of each hashed block
        self.num_cached_tokens = 0            # prompt tokens served by the prefix cache (last admission)
        self.num_preemptions = 0
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.logprobs: list[dict] | None = [] if params.logprobs is not None else None
        # prompt log-probabilities (sample 0 only): entry p is position p's, None for position 0
        self.prompt_logprobs: list[dict | None] | None = \
            [None] if params.prompt_logprobs is not None and index == 0 else None
        # sampler state (engine/sampling_features.py): the runner's slot of this sequence's penalty counts and
        # biases (None: it uses none, or has not sampled yet), the bad words' token ids, its grammar's spec
        self.sampler_slot: int | None = None
        self.slot_fresh = False               # the slot is new: the next step initialises it on the device
        self.static_bias: tuple[list[int], list[tuple[int, float]]] | None = None  # (allowed ids, (id, bias))
        self.bad_word_ids: list[tuple[int, ...]] = []  # multi-token bad words (one-token ones are in static_bias)
        self.grammar: tuple[str, str] | None = None  # structured outputs' spec key; the matcher is in the grammar
                                                      # process (engine/grammar_worker.py)
        # speculative decoding (engine/spec/): the draft tokens proposed for this step, which the scheduler lets it
        # verify after its last token (never part of token_ids), and the speculator's per-sequence state
        self.draft_ids: list[int] = []
        self.spec = None
        # output side, owned by the engine
        self.stream = False                   # report progress every step
        self.detok = None                     # IncrementalDetokenizer when text is needed as it grows
        self.text = ""                        # text reported so far
        self.num_emitted = 0                  # output tokens reported so far
        self.arrival_time = 0.0
        self.first_token_time: float | None = None
        self.pending_row: int | None = None   # row of the in-flight step's sampled ids holding PLACEHOLDER's value

    # --- token bookkeeping -------------------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self._prompt

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    @property
    def fixed_length(self) -> bool:
        """It generates exactly max_tokens: nothing can stop it sooner (no EOS or stop ids, no stop strings)."""
        return not self.stop_ids and not self.params.stop_strings

    @property
    def awaiting_last_token(self) -> bool:
        """Its final token is in flight: nothing more to compute, it only waits to be finished."""
        return self.num_output_tokens >= self.max_tokens

    @property
    def uses_slot(self) -> bool:
        """It keeps sampler state on the device (penalty counts, a bias row): engine/sampling_features.py."""
        return self.params.uses_penalties or self.static_bias is not None

    @property
    def can_speculate(self) -> bool:
        """Its rows can be verified several at a time: each row's logits processing depends on nothing sampled in
        the same step (no penalties, whose counts would have to include the drafts; no grammar or multi-token bad
        words, whose masks follow the previous token)."""
        return not self.params.uses_penalties and not self.deferred_sampling

    @property
    def deferred_sampling(self) -> bool:
        """Its next token's mask or bans depend on its last token (structured outputs, multi-token bad words)."""
        return self.grammar is not None or bool(self.bad_word_ids)

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, status={self.status.value}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, blocks={len(self.block_table)})")
