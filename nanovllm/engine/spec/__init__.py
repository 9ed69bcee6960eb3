"""Speculative decoding: draft tokens proposed on the host, verified by the target model in one step.

    engine step (llm_engine.py)   Speculator.wants_drafts(running)      speculate this step? (batch size, backoff)
                                  resolve the step in flight            the drafts start from its tokens
                                  Speculator.propose(running)           Proposer.propose(histories) -> seq.draft_ids
    scheduler.py                  a decoding sequence with k drafts wants 1 + k tokens (KV slots for all of them)
    batch.py                      1 + k logits rows per verifying sequence (SamplingBatch.drafts)
    layers/sampler.py             sample every row, accepted_drafts: cumprod of (sample == draft)
    llm_engine.py `_resolve`      emit the accepted drafts and one more token (stop checks token by token),
                                  count the accepted drafts as computed; Speculator.record adapts

Proposers share one small interface (`Proposer`): the token histories of some sequences and how many drafts each
may get -> the drafts. `ngram` (prompt lookup, `ngram.py`) is the one method; vLLM's `suffix` method (a suffix
tree over this and earlier requests) is not implemented.
"""
from __future__ import annotations

from typing import Protocol

import numpy as np

from nanovllm.config import SpeculativeConfig


class Proposer(Protocol):
    def propose(self, histories: list[np.ndarray], max_drafts: list[int]) -> list[list[int]]:
        """Draft tokens for each sequence: histories[i] is its prompt and output tokens (int32, the last one
        sampled), max_drafts[i] >= 1 the most drafts it may get; an empty list: no proposal."""


def make_proposer(config: SpeculativeConfig) -> Proposer:
    if config.method == "ngram":
        from nanovllm.engine.spec.ngram import NgramProposer
        return NgramProposer(config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max)
    raise ValueError(f"unknown speculative method {config.method!r}")  # (SpeculativeConfig checked it already)
