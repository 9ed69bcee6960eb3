"""Structured outputs with xgrammar: grammars compiled once per spec (a cache keyed by the spec's text), one matcher
per sequence, and the token bitmask of a step's constrained rows.

When the masks are filled (engine/llm_engine.py): a step with a constrained row is *deferred* — the runner runs its
forward pass up to the logits and stops before sampling (`PendingStep.sample`). With async scheduling that step
(N + 1) is launched before step N's tokens are read; the engine then reads them, advances each matcher with its
sequence's token, fills step N + 1's bitmask on the host while the GPU runs N + 1's forward, and hands it over: the
sampler applies it on the device (layers/logits_processing.py). So grammar matching overlaps the forward pass and
a constrained sequence still decodes every step. Without async scheduling the same code runs in order.

JSON is compiled compact (no free whitespace between tokens): a model, or noise, cannot stall in whitespace.

Host cost per step (256 rows, see `bench_sampling_features.py --host-only`): one `batch_accept_token` (serial in
xgrammar) and one `batch_fill_next_token_bitmask` over the constrained rows, on one thread or xgrammar's threads,
whichever is faster for the grammars at hand (`FillChooser`: starting the threads costs more than a cheap fill).
Two more choices keep it small:
- The grammar's vocabulary is the tokenizer's ids, not the model's padded vocabulary (`num_tokens`): xgrammar
  treats every id without text as a special token, and its accept_token costs time linear in their number (the
  built-in tiny tokenizer has 483 ids; padded to Qwen's 151,936 that is 151,453 special ids and ~25 us per token
  instead of ~2 us). Ids past the mask are never allowed in a constrained row (apply_token_bitmask).
- The bitmask is one buffer reused every step (pinned on CUDA, so the runner's copy to the device is
  asynchronous and never waits for the forward pass; a fresh 4.9 MB tensor a step cost 3-11 ms of page faults
  on a 2-core machine). The next fill rewrites it: safe because the engine reads each step's result, which waits
  for that step's sampling and so for the copy before it, before it fills the next step's masks
  (llm_engine.step_tokens).
"""
from __future__ import annotations

import json
import os
import time
from collections import OrderedDict

import torch

from nanovllm.sampling_params import StructuredOutputsParams

INSTALL_HINT = "structured outputs need xgrammar: pip install 'nanovllm[structured]' (or pip install xgrammar)"
CACHE_SIZE = 256  # compiled grammars kept (least recently used dropped first)


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


def _ebnf_literal(s: str) -> str:
    return json.dumps(s)  # a JSON string literal is a valid GBNF string literal (same escapes)


def _choice_ebnf(choice: list[str]) -> str:
    return "root ::= " + " | ".join(map(_ebnf_literal, choice))


def _spec_error(kind: str, e: Exception) -> ValueError:
    msg = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
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
            xgr.Grammar.from_ebnf(_choice_ebnf(spec.choice) if kind == "choice" else text)
    except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError / its own types for bad specs
        raise _spec_error(kind, e) from None


class FillChooser:
    """Which of xgrammar's batch matchers fills a step's masks: one thread, or `threads` of them.

    xgrammar starts its threads at every fill, which costs more than a cheap fill: 256 rows of a JSON array schema
    took 0.13 ms on one thread and 0.25 ms on two with the built-in tokenizer, 0.52 vs 0.67 ms with Qwen3's
    151k-token vocabulary (2-core CPU, 2026-12-01), while a JSON object schema costs ~14 us a row on one core with
    Qwen's tokenizer, where 8 threads win. So one thread fills while its fills would take under `threads_from`
    seconds (exponential average of the seconds per row, times the rows); above that both are timed and the one
    with the lower average fills, the other timed again every `probe_every` fills. `clock` is injectable for tests.
    """

    def __init__(self, xgr, threads: int, threads_from: float = 1e-3, probe_every: int = 64,
                 clock=time.perf_counter):
        self.serial = xgr.BatchGrammarMatcher(1)
        self._modes = [self.serial] + ([xgr.BatchGrammarMatcher(threads)] if threads > 1 else [])
        self._cost: list[float | None] = [None] * len(self._modes)  # seconds per row, averaged
        self.threads_from, self.probe_every, self._clock, self._fills = threads_from, probe_every, clock, 0

    def choice(self, rows: int) -> int:
        """The mode a fill of `rows` matchers uses: 0 = one thread, 1 = several."""
        serial, threaded = self._cost[0], self._cost[-1]
        if len(self._modes) == 1 or serial is None or serial * rows < self.threads_from:
            return 0
        if threaded is None:
            return 1
        best = 0 if serial <= threaded else 1
        return 1 - best if self._fills % self.probe_every == 0 else best

    def fill(self, matchers: list, mask: torch.Tensor) -> None:
        i = self.choice(len(matchers))
        t0 = self._clock()
        self._modes[i].batch_fill_next_token_bitmask(matchers, mask)
        per_row = (self._clock() - t0) / max(len(matchers), 1)
        c = self._cost[i]
        self._cost[i] = per_row if c is None else 0.75 * c + 0.25 * per_row
        self._fills += 1


class StructuredOutputs:
    """The engine's grammars: compile (cached), a matcher per sequence, bitmasks for a step's rows."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids, pin_memory: bool = False):
        xgr = _import_xgrammar()
        self.xgr = xgr
        self.vocab_size = vocab_size
        stops = sorted(stop_token_ids)
        # the ids a mask covers: the tokenizer's (and the stop ids), not the model's padding (module docstring)
        self.num_tokens = min(vocab_size, max([len(tokenizer)] + [t + 1 for t in stops]))
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.num_tokens,
                                                  stop_token_ids=stops or None)
        self.compiler = xgr.GrammarCompiler(info, cache_enabled=False)  # our cache below: one, keyed by the spec
        self._cache: OrderedDict[tuple[str, str], object] = OrderedDict()
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        self._fills = FillChooser(xgr, threads=max(1, min(8, cpus // 2)))
        self._batch = self._fills.serial  # accept: serial in xgrammar whatever its thread count
        self._pin = pin_memory
        self._mask = torch.empty(0, xgr.get_bitmask_shape(1, self.num_tokens)[1], dtype=torch.int32)

    def compile(self, spec: StructuredOutputsParams):
        """The compiled grammar of a spec; ValueError naming the spec if it is malformed."""
        key = spec_key(spec)
        hit = self._cache.get(key)
        if hit is not None:
            self._cache.move_to_end(key)
            return hit
        kind, text = key
        try:
            if kind == "json":
                compiled = self.compiler.compile_json_schema(text, any_whitespace=False)
            elif kind == "json_object":
                compiled = self.compiler.compile_builtin_json_grammar()
            elif kind == "regex":
                compiled = self.compiler.compile_regex(text)
            elif kind == "choice":
                compiled = self.compiler.compile_grammar(_choice_ebnf(spec.choice))
            else:
                compiled = self.compiler.compile_grammar(text)
        except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError / its own types for bad specs
            raise _spec_error(kind, e) from None
        self._cache[key] = compiled
        if len(self._cache) > CACHE_SIZE:
            self._cache.popitem(last=False)
        return compiled

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def accept(self, matchers: list, tokens: list[int]) -> list[bool]:
        """Advance each matcher by its token (threads in xgrammar); False where the token breaks the grammar."""
        return self._batch.batch_accept_token(matchers, tokens)

    def fill(self, matchers: list) -> torch.Tensor:
        """(len(matchers), ceil(num_tokens / 32)) int32 bitmask of the next token of each matcher (threads in
        xgrammar): a view of the reused buffer, valid until the next fill (module docstring)."""
        n = len(matchers)
        if n > self._mask.shape[0]:  # grows to the most rows a step has constrained (xgrammar writes whole rows)
            self._mask = torch.empty(max(n, 2 * self._mask.shape[0]), self._mask.shape[1], dtype=torch.int32,
                                     pin_memory=self._pin)
        mask = self._mask[:n]
        self._fills.fill(matchers, mask)
        if self.num_tokens % 32:  # xgrammar may leave bits past the vocabulary set (a state allowing "anything")
            mask[:, -1] &= (1 << (self.num_tokens % 32)) - 1
        return mask
