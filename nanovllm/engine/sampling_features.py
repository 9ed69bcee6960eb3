"""Host side of the sampler's per-request features: requests checked against the vocabulary, bad words as token
ids, the runner's state slots handed out and taken back, and a deferred step's LateInputs.

    validate_request -> request_features(params)     ids in range, bad words tokenized, grammar compiled
    each step        -> SlotAllocator.assign(seqs)   a slot for each sequence that needs one, at its first sample
                        (build_step_batch sends each row's slot, and a new slot's set-up, in its FeatureBatch)
    deferred step    -> late_inputs(batch, seqs)     bitmasks (structured outputs) and multi-token bad-word bans
    finish           -> SlotAllocator.release(seq)
"""
from __future__ import annotations

import heapq
import logging
from dataclasses import dataclass, field

from nanovllm.engine.batch import LateInputs, StepBatch
from nanovllm.engine.sequence import PLACEHOLDER, Sequence
from nanovllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class RequestFeatures:
    """What validation derived from a request's sampling features (shared by its n samples)."""
    static_bias: tuple[list[int], list[tuple[int, float]]] | None = None  # (allowed ids, (id, bias) entries)
    bad_word_ids: list[tuple[int, ...]] = field(default_factory=list)  # multi-token bad words
    grammar: object = None                                              # xgrammar CompiledGrammar


def _check_ids(name: str, ids, vocab_size: int) -> None:
    bad = [t for t in ids if t >= vocab_size]
    if bad:
        raise ValueError(f"{name} include token id {bad[0]}, outside the vocabulary [0, {vocab_size})")


def bad_words_token_ids(tokenizer, words: list[str]) -> list[tuple[int, ...]]:
    """Each word as the tokens it encodes to, alone and after a space (vLLM's rule), without duplicates (in
    first-seen order)."""
    out: dict[tuple[int, ...], None] = {}
    for w in words:
        for text in (w.lstrip(), " " + w.lstrip()):
            ids = tuple(tokenizer.encode(text, add_special_tokens=False))
            if ids:
                out.setdefault(ids)
    return list(out)


def request_features(params: SamplingParams, vocab_size: int, tokenizer, structured, tp_size: int,
                     held_back: set[int] = frozenset()) -> RequestFeatures:
    """Check a request's features against the model and derive what its sequences carry; ValueError if bad.
    `structured`: the engine's StructuredOutputs (None: built on demand by the caller). `held_back`: the ids
    its first min_tokens tokens may not be (stop ids and EOS), so that an allowed set they empty is an error
    rather than a row with nothing left to sample."""
    f = RequestFeatures()
    if params.allowed_token_ids is not None:
        _check_ids("allowed_token_ids", params.allowed_token_ids, vocab_size)
    if params.logit_bias:
        _check_ids("logit_bias keys", params.logit_bias, vocab_size)
    single: list[int] = []
    if params.bad_words:
        if tokenizer is None:
            raise ValueError("bad_words need a tokenizer, and this engine has none")
        for ids in bad_words_token_ids(tokenizer, params.bad_words):
            if len(ids) == 1:
                single.append(ids[0])
            else:
                f.bad_word_ids.append(ids)
    if params.allowed_token_ids is not None:
        left = set(params.allowed_token_ids) - set(single)
        if not left:
            raise ValueError(f"bad_words ban every token of allowed_token_ids {params.allowed_token_ids}")
        if params.min_tokens > 0 and left <= held_back:
            raise ValueError(f"allowed_token_ids {sorted(left)} are all stop or EOS ids, which the first "
                             f"min_tokens={params.min_tokens} tokens may not be")
    if params.allowed_token_ids is not None or params.logit_bias or single:
        entries = list((params.logit_bias or {}).items()) + [(t, float("-inf")) for t in single]
        f.static_bias = (sorted(set(params.allowed_token_ids or ())), entries)
    if params.structured_outputs is not None:
        f.grammar = structured.compile(params.structured_outputs)
    if (f.grammar is not None or f.bad_word_ids) and tp_size > 1:
        raise ValueError("structured_outputs and multi-token bad_words are not supported with "
                         "tensor_parallel_size > 1 yet")
    return f


class SlotAllocator:
    """Slots of the runner's SlotState: the lowest free one first, so the device tensors stay small."""

    def __init__(self):
        self._free: list[int] = []
        self._next = 0

    def assign(self, seqs: list[Sequence], num_new_tokens: list[int]) -> None:
        """Give a slot to each sequence that samples this step, needs one and has none."""
        for seq, n in zip(seqs, num_new_tokens):
            if seq.sampler_slot is None and seq.uses_slot and seq.num_computed_tokens + n == seq.num_tokens:
                if self._free:
                    seq.sampler_slot = heapq.heappop(self._free)
                else:
                    seq.sampler_slot, self._next = self._next, self._next + 1
                seq.slot_fresh = True

    def release(self, seq: Sequence) -> None:
        if seq.sampler_slot is not None:
            heapq.heappush(self._free, seq.sampler_slot)
            seq.sampler_slot = None


def late_inputs(batch: StepBatch, seqs: list[Sequence], structured) -> LateInputs:
    """A deferred step's masks and bans (`seqs`: the step's sequences, in batch order), from its sequences' now-known
    tokens: each matcher has accepted every token up to the one this step samples (whose place holds PLACEHOLDER).
    Rows of sequences finished meanwhile may get masks too: their tokens are dropped."""
    late = LateInputs()
    sb = batch.sampling
    if sb.grammar_sids:
        late.bitmask, late.mask_index = structured.masks(sb.grammar_sids, sb.grammar_rows, batch.num_logits)
    for row in sb.bad_word_rows:
        seq = seqs[batch.logits_seqs[row]]
        if not seq.is_finished:  # the output's tail (before the placeholder) vs each word's prefix
            toks = seq.token_ids
            end = len(toks) - (toks[-1] == PLACEHOLDER)
            for word in seq.bad_word_ids:
                k = len(word) - 1
                if end - k >= seq.num_prompt_tokens and tuple(toks[end - k:end]) == word[:-1]:
                    late.banned.append((row, word[-1]))
    return late
