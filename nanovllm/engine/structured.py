"""Structured outputs with xgrammar: specs checked when a request arrives, one matcher per sequence in the grammar
process (engine/grammar_worker.py), and the token bitmasks of a step's constrained rows.

When the masks are filled (engine/llm_engine.py): a step with a constrained row is *deferred* — the runner runs its
forward pass up to the logits and stops before sampling (`PendingStep.sample`). With async scheduling that step
(N + 1) is launched before step N's tokens are read; as soon as they are, the engine sends the grammar process one
job (each matcher accepts its sequence's token, then the rows of N + 1 are filled), goes on with N's stop checks
and outputs while the child works and the GPU runs N + 1's forward, and collects the masks for N + 1's sampler,
which applies them on the device (the fused sampling kernel, or layers/logits_processing.py). So grammar matching
overlaps both the forward pass and the engine's own host work, and a constrained sequence still decodes every
step. Without async scheduling the same jobs run in order.

JSON is compiled compact (no free whitespace between tokens): a model, or noise, cannot stall in whitespace.

Host cost per step (256 rows, see `bench_sampling_features.py --host-only`): one `batch_accept_token` (serial in
xgrammar) and one `batch_fill_next_token_bitmask` over the constrained rows, in the child, on one thread or
xgrammar's threads, whichever is faster for the grammars at hand (`FillChooser`). The grammar's vocabulary is the
tokenizer's ids, not the model's padded vocabulary (`num_tokens`): xgrammar treats every id without text as a
special token, and its accept_token costs time linear in their number (the built-in tiny tokenizer has 483 ids;
padded to Qwen's 151,936 that is 151,453 special ids and ~25 us per token instead of ~2 us). Ids past the mask
are never allowed in a constrained row (apply_token_bitmask).
"""
from __future__ import annotations

import json
import logging
import os
import re
from collections import OrderedDict

import torch

from nanovllm.engine.grammar_worker import GrammarProcess, GrammarProcessExited, choice_ebnf
from nanovllm.sampling_params import StructuredOutputsParams

logger = logging.getLogger(__name__)

INSTALL_HINT = "structured outputs need xgrammar: pip install 'nanovllm[structured]' (or pip install xgrammar)"
CACHE_SIZE = 256  # checked specs remembered (least recently used dropped first)


def _import_xgrammar():
    try:
        import xgrammar
    except ImportError as e:
        raise ValueError(INSTALL_HINT) from e
    return xgrammar


def spec_key(spec: StructuredOutputsParams) -> tuple[str, str]:
    """(kind, text): the cache key of a spec (a JSON schema dict as its JSON text, properties in order)."""
    kind = spec.kind
    if kind == "json":
        text = spec.json if isinstance(spec.json, str) else json.dumps(spec.json)
    elif kind == "choice":
        text = json.dumps(spec.choice)
    elif kind == "json_object":
        text = ""
    else:
        text = getattr(spec, kind)
    return kind, text


def _spec_error(kind: str, e: Exception) -> ValueError:
    msg = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
    msg = re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", msg)  # xgrammar's "[time] file.cc:line: " prefix
    return ValueError(f"structured_outputs.{kind} is not valid: {msg}")


def check_spec(spec: StructuredOutputsParams) -> None:
    """Parse a spec without a vocabulary (no token masks: cheap), ValueError naming it if malformed: the API server
    answers a malformed spec with a 400 this way before the engine core compiles it."""
    xgr = _import_xgrammar()
    kind, text = spec_key(spec)
    try:
        if kind == "json":
            xgr.Grammar.from_json_schema(text, any_whitespace=False)
        elif kind == "regex":
            xgr.Grammar.from_regex(text)
        elif kind in ("choice", "grammar"):
            xgr.Grammar.from_ebnf(choice_ebnf(spec.choice) if kind == "choice" else text)
    except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError / its own types for bad specs
        raise _spec_error(kind, e) from None


def grammar_workers(cpus: int) -> tuple[int, int]:
    """(grammar processes, xgrammar fill threads in each) for a machine with `cpus` CPUs: a process per 4 CPUs, at
    most 4 (each then accepts a quarter of a step's tokens: 256 JSON rows took ~1.6 ms in one process on a 2-core
    CPU), and the fill threads of half the CPUs between them, at most 8 each."""
    workers = max(1, min(4, cpus // 4))
    return workers, max(1, min(8, cpus // (2 * workers)))


class StructuredOutputs:
    """The engine's structured outputs: specs checked (cached), matchers in the grammar processes, bitmasks for a
    step's rows. Sequences are named by their seq_id; `rows`: the most rows a step samples (max_num_seqs).

    If a grammar process dies (killed, out of memory), every constrained sequence is reported broken (the engine
    finishes them) and new processes start: the other requests, and the structured requests after it, go on."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids, rows: int, pin_memory: bool = False):
        xgr = _import_xgrammar()
        self.vocab_size = vocab_size
        stops = sorted(stop_token_ids)
        # the ids a mask covers: the tokenizer's (and the stop ids), not the model's padding (module docstring)
        self.num_tokens = min(vocab_size, max([len(tokenizer)] + [t + 1 for t in stops]))
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.num_tokens,
                                                  stop_token_ids=stops or None)
        self._checked: OrderedDict[tuple[str, str], None] = OrderedDict()
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        workers, threads = grammar_workers(cpus)
        self._start = lambda: GrammarProcess(info.serialize_json(), self.num_tokens, rows, threads=threads,
                                             pin_memory=pin_memory, workers=workers)
        self.proc = self._start()
        self._live: set[int] = set()       # seq_ids with a matcher (added, not dropped)
        self.broken: dict[int, str] = {}   # seq_id -> why: its token broke the grammar, or its grammar failed

    def compile(self, spec: StructuredOutputsParams) -> tuple[str, str]:
        """The spec's key (kind, text), once it parses; ValueError naming the spec if it is malformed. The grammar
        process compiles it for the vocabulary when a sequence first uses it."""
        key = spec_key(spec)
        if key in self._checked:
            self._checked.move_to_end(key)
            return key
        check_spec(spec)
        self._checked[key] = None
        if len(self._checked) > CACHE_SIZE:
            self._checked.popitem(last=False)
        return key

    def add(self, seq_id: int, key: tuple[str, str]) -> None:
        self._live.add(seq_id)
        self.proc.add(seq_id, *key)

    def drop(self, seq_id: int) -> None:
        self._live.discard(seq_id)
        self.proc.drop(seq_id)

    def is_live(self, seq_id: int) -> bool:
        """The sequence has a matcher (added, not dropped: it has not finished)."""
        return seq_id in self._live

    def _lost(self, e: GrammarProcessExited) -> None:
        """The grammar process died: its sequences are broken, a new process takes the next ones."""
        logger.error("%s: finishing its %d constrained sequences; starting a new one", e, len(self._live))
        for sid in self._live:  # (still live: each is dropped when the engine finishes it)
            self.broken[sid] = str(e)
        self.proc.close()
        self.proc = self._start()

    def advance(self, sids: list[int], tokens: list[int], fill: tuple[list[int], list[int], int] | None) -> None:
        """Send the job for a step's tokens: matcher sids[i] accepts tokens[i]; then, with `fill` (the next step's
        constrained seq_ids and their logits rows, already launched, and its number of rows), their masks are
        filled. The reply is read when the masks are wanted (`masks`), or before the next job."""
        try:
            self._collect()
            self.proc.submit(sids, tokens, *(fill if fill is not None else ([], [], 0)))
        except GrammarProcessExited as e:  # the tokens went with the matchers: their sequences are broken
            self._lost(e)

    def _collect(self) -> tuple | None:
        """Read the reply of the job in flight, if any (noting the broken sequences); returns its fill (sids, logits
        rows, number of rows)."""
        job = self.proc.in_flight
        if job is None:
            return None
        broke, errors = self.proc.collect()
        for sid in broke:
            self.broken.setdefault(sid, "its token breaks its grammar")
        for sid, why in errors.items():
            self.broken[sid] = f"its grammar failed to compile: {why}"
        return job

    def masks(self, sids: list[int], rows: list[int], num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The masks of a step's constrained rows (seq_ids and their logits rows; the step has `num_rows` rows): the
        job in flight's if it filled these very lists, else a new job's. Returns the (n, W) int32 bitmask and the
        (num_rows,) int32 bitmask row of each logits row (-1: none; also for a sequence whose grammar has ended or
        failed): views of the shared buffer, valid until the next job."""
        try:
            job = self._collect()
            if job is None or job[0] is not sids or job[1] is not rows or job[2] != num_rows:
                self.proc.submit([], [], sids, rows, num_rows)
                self._collect()
        except GrammarProcessExited as e:
            self._lost(e)
            self.proc.submit([], [], sids, rows, num_rows)  # a new process: no matchers, so no masks
            self._collect()
        return self.proc.mask[:len(sids)], self.proc.index[:num_rows]

    def stats(self) -> dict:
        """The grammar process's live matchers and compiled grammars (for tests and debugging)."""
        self._collect()
        return self.proc.stats()

    def take_broken(self) -> dict[int, str]:
        """The sequences to finish (seq_id -> why) found since the last call."""
        out, self.broken = self.broken, {}
        return out

    def close(self) -> None:
        self.proc.close()
