"""The engine: requests in, one scheduled step at a time, outputs back.

    add_request -> Scheduler.schedule -> build_step_batch -> ModelRunner.launch -> _resolve -> outputs

Everything a user can get wrong is checked in `validate_request`, before any state changes.
"""
from __future__ import annotations

import itertools
import json
import logging
import os
import random
import time
from dataclasses import dataclass, field

from nanovllm.config import EngineArgs, EngineConfig
from nanovllm.engine.batch import build_step_batch
from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.cuda_graphs import mixed_graph_sizes
from nanovllm.engine.detokenizer import IncrementalDetokenizer, find_stop
from nanovllm.engine.executor import Executor
from nanovllm.engine.scheduler import Scheduler
from nanovllm.engine.sequence import Sequence
from nanovllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class RequestOutput:
    """A request's progress after a step (emitted every step for streamed requests, else once at the end)."""
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]               # all output tokens (filled once finished; streamed: new_token_ids)
    new_token_ids: list[int]           # produced by this step
    text: str                          # output text so far (final text once finished)
    new_text: str                      # text produced by this step (streamed requests)
    finished: bool
    finish_reason: str | None = None   # "stop" | "length" | "abort"
    stop_reason: str | int | None = None
    logprobs: list[dict] | None = None         # per output token: {"token_id", "logprob", "top": [(id, lp)]}
    new_logprobs: list[dict] | None = None
    num_cached_tokens: int = 0
    metrics: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        d = {"request_id": self.request_id, "text": self.text, "token_ids": self.token_ids,
             "prompt_token_ids": self.prompt_token_ids, "finish_reason": self.finish_reason}
        if self.logprobs is not None:
            d["logprobs"] = self.logprobs
        return d


@dataclass
class ValidRequest:
    """A prompt and params that passed validation; adding it cannot fail."""
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int


def _load_tokenizer(path: str):
    from transformers import AutoTokenizer
    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as e:  # noqa: BLE001 - surfaced as a clear user error
        raise ValueError(f"could not load a tokenizer from {path!r}: {e}") from e


def _eos_ids(model_dir: str, config_eos: tuple[int, ...], tokenizer) -> frozenset[int]:
    """EOS ids as transformers' generate sees them: generation_config.json first, then config.json."""
    path = os.path.join(model_dir, "generation_config.json")
    if os.path.isfile(path):
        with open(path) as f:
            eos = json.load(f).get("eos_token_id")
        if eos is not None:
            return frozenset(eos if isinstance(eos, list) else [eos])
    if config_eos:
        return frozenset(config_eos)
    if tokenizer is not None and getattr(tokenizer, "eos_token_id", None) is not None:
        return frozenset([tokenizer.eos_token_id])
    return frozenset()


class LLMEngine:
    def __init__(self, args: EngineArgs):
        t0 = time.perf_counter()
        self.config = EngineConfig.resolve(args)
        try:
            self.tokenizer = _load_tokenizer(args.tokenizer or self.config.model_dir)
        except ValueError:
            if args.load_format != "dummy":
                raise
            # benchmarks on a bare config.json: token-id prompts only, outputs carry no text
            logger.warning("no tokenizer in %s: only token-id prompts are accepted", self.config.model_dir)
            self.tokenizer = None
        self.eos_token_ids = _eos_ids(self.config.model_dir, self.config.model.eos_token_ids, self.tokenizer)
        self.runner: Executor = self._make_runner()
        self.block_manager = BlockManager(self.runner.num_kvcache_blocks, self.config.block_size,
                                          args.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, self.config.max_num_seqs,
                                   self.config.max_num_batched_tokens, self.config.scheduling_policy,
                                   step_sizes=mixed_graph_sizes(self.config))
        self.requests: dict[str, Sequence] = {}
        # async scheduling: the launched step whose tokens are not read yet, with its (seq, row) pairs
        self._inflight: tuple | None = None
        self.async_scheduling = self.config.async_scheduling
        self._seq_ids = itertools.count()
        self._noise_rng = random.Random(args.seed)
        # counters (for tqdm and /metrics)
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.startup_seconds = time.perf_counter() - t0

    def _make_runner(self) -> Executor:
        if self.config.args.tensor_parallel_size > 1:
            from nanovllm.distributed.executor import TPExecutor
            return TPExecutor(self.config)
        from nanovllm.engine.model_runner import ModelRunner
        return ModelRunner(self.config)

    # --- requests ----------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.config.model.vocab_size

    def tokenize(self, prompt) -> list[int]:
        """A prompt (str, or a list of token ids) as token ids; raises ValueError/TypeError if malformed."""
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            if self.tokenizer is None:
                raise ValueError("this engine has no tokenizer: pass prompts as token ids")
            return self.tokenizer.encode(prompt)
        if isinstance(prompt, (list, tuple)):
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
                bad = next(t for t in prompt if not isinstance(t, int) or isinstance(t, bool))
                raise TypeError(f"prompt token ids must be ints, got {type(bad).__name__} {bad!r}")
            return list(prompt)
        raise TypeError(f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}")

    def validate_request(self, prompt, params: SamplingParams | None) -> ValidRequest:
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params must be SamplingParams, got {type(params).__name__}")
        ids = self.tokenize(prompt)
        if not ids:
            raise ValueError("prompt is empty (no tokens)")
        V = self.vocab_size
        bad = [t for t in ids if not 0 <= t < V]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {V})")
        L = self.config.max_model_len
        if len(ids) > L:
            raise ValueError(f"prompt has {len(ids)} tokens, more than max_model_len={L}")
        if params.stop_token_ids and any(t >= V for t in params.stop_token_ids):
            raise ValueError(f"stop_token_ids {params.stop_token_ids} include ids outside the vocabulary [0, {V})")
        room = max(1, L - len(ids))
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        return ValidRequest(ids, params, max_tokens)

    def add_request(self, request_id: str, prompt, params: SamplingParams | None = None, *,
                    stream: bool = False) -> Sequence:
        """Validate and queue a request. `stream` makes step() report it every step, with text deltas."""
        req = prompt if isinstance(prompt, ValidRequest) else self.validate_request(prompt, params)
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        p = req.params
        stop_ids = set(p.stop_token_ids or ())
        if not p.ignore_eos:
            stop_ids |= self.eos_token_ids
        seed = p.seed if p.seed is not None else self._noise_rng.getrandbits(63)
        seq = Sequence(next(self._seq_ids), request_id, req.prompt_token_ids, p, req.max_tokens,
                       frozenset(stop_ids), seed)
        seq.stream = stream
        if (stream or p.stop_strings) and self.tokenizer is not None:
            seq.detok = IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids, p.skip_special_tokens)
        seq.arrival_time = time.monotonic()
        self.requests[request_id] = seq
        self.scheduler.add(seq)
        return seq

    def abort_request(self, request_id: str) -> bool:
        """Drop a request and free its blocks at once; False if it is unknown or already done."""
        seq = self.requests.pop(request_id, None)
        if seq is None or seq.is_finished:
            return False
        self.scheduler.finish(seq, "abort")
        return True

    def abort_all(self) -> list[str]:
        """Drop every request, and the tokens of a launched step not read yet (after a step failed). Returns
        the ids dropped."""
        ids = list(self.requests)
        for rid in ids:
            self.abort_request(rid)
        self._inflight = None
        return ids

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or self._inflight is not None

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    # --- one step ----------------------------------------------------------------------------------
    def step(self) -> tuple[list[RequestOutput], int, int]:
        """Schedule and launch one step, and process the tokens of the step before it (async scheduling)
        or of this one (otherwise).

        Returns (outputs, prompt tokens launched, tokens sampled by the processed step). Outputs hold every
        request that finished and every streamed request that made progress."""
        advanced, num_prefill, num_sampled = self.step_tokens()
        now = time.monotonic()
        outputs = [self._make_output(seq, now) for seq, _ in advanced if seq.is_finished or seq.stream]
        return outputs, num_prefill, num_sampled

    def step_tokens(self) -> tuple[list[tuple[Sequence, int]], int, int]:
        """`step` without building outputs (the engine core's step: it reports token ids, not text).

        Returns ((sequence, token) for every sequence the processed step gave a token, prompt tokens launched,
        tokens sampled). Stop checks are done: a sequence that finished has its finish reason and has released
        its blocks."""
        sched = self.scheduler.schedule()
        launched = None
        num_prefill = 0
        if sched:
            batch = build_step_batch(sched, self.config.block_size)
            # prompt tokens (or tokens recomputed after a preemption) this step computes: all but the decode rows
            # whose token is an output token
            num_prefill = sched.num_tokens - sum(1 for s in sched.seqs[:sched.num_decode] if s.num_output_tokens)
            handle = self.runner.launch(batch) if self.async_scheduling else self.runner.execute(batch)
            launched = (handle, sched)
        advanced, num_sampled = [], 0
        if self._inflight is not None:  # the previous step's tokens (its successor is already queued)
            prev_handle, prev_pending = self._inflight
            advanced, num_sampled = self._resolve(prev_handle.result(), prev_pending)
            self._inflight = None
        if launched is not None:
            handle, sched = launched
            pending = self.scheduler.on_step_done(sched)
            if self.async_scheduling:
                self._inflight = (handle, pending)
            else:
                advanced, num_sampled = self._resolve(handle, pending)  # execute() gave the result itself
        elif self.scheduler.has_unfinished() and not advanced and not num_sampled:
            raise RuntimeError("scheduler made no progress with requests pending (KV cache too small?)")
        self.num_prompt_tokens += num_prefill
        self.num_generation_tokens += num_sampled
        return advanced, num_prefill, num_sampled

    def _resolve(self, result, pending: list[tuple[Sequence, int]]) -> tuple[list[tuple[Sequence, int]], int]:
        """Put a step's sampled tokens in place of its placeholders, then check each sequence for a stop.
        Returns the (sequence, token) pairs resolved and the number of tokens the step sampled."""
        now = time.monotonic()
        advanced = []
        for seq, row in pending:
            if seq.is_finished:  # aborted while its step was in flight
                continue
            tok = result.token_ids[row]
            seq.token_ids[seq.num_prompt_tokens + seq.num_output_tokens - 1] = tok
            seq.pending_row = None
            if seq.first_token_time is None:
                seq.first_token_time = now
            if seq.logprobs is not None:
                entry = {"token_id": tok, "logprob": result.logprobs[row]}
                k = seq.params.logprobs
                entry["top"] = list(zip(result.top_ids[row][:k], result.top_logprobs[row][:k])) if k else []
                seq.logprobs.append(entry)
            reason = self._check_stop(seq, tok)
            if reason is not None:
                self.scheduler.finish(seq, reason)
                self.requests.pop(seq.request_id, None)
            advanced.append((seq, tok))
        return advanced, len(pending)

    def _check_stop(self, seq: Sequence, tok: int) -> str | None:
        p = seq.params
        n_out = seq.num_output_tokens
        if tok in seq.stop_ids and n_out >= p.min_tokens:
            # vLLM's convention: stop_reason is the token id for stop_token_ids, None for EOS
            seq.stop_reason = tok if tok in (p.stop_token_ids or ()) else None
            return "stop"
        if seq.detok is not None:
            delta = seq.detok.add(tok)
            if delta and p.stop_strings and n_out >= p.min_tokens:
                i = find_stop(seq.detok.text, len(delta), p.stop_strings)
                if i != -1:
                    text = seq.detok.text
                    seq.stop_reason = next(s for s in p.stop_strings if text.startswith(s, i))
                    seq.detok.text = text[:i]
                    return "stop"
        if n_out >= seq.max_tokens or seq.num_tokens >= self.config.max_model_len:
            return "length"
        return None

    def _make_output(self, seq: Sequence, now: float) -> RequestOutput:
        new_ids = seq.token_ids[seq.num_prompt_tokens + seq.num_emitted:]
        # the whole output list only at the end: copying it every step of every stream is O(length)
        out_ids = seq.output_token_ids if seq.is_finished else []
        if seq.detok is not None:
            text = seq.detok.text
        elif seq.is_finished and self.tokenizer is not None:
            text = self.tokenizer.decode(out_ids, skip_special_tokens=seq.params.skip_special_tokens)
        else:
            text = ""
        new_text = text[len(seq.text):] if seq.stream else ""
        new_lp = seq.logprobs[seq.num_emitted:] if seq.logprobs is not None else None
        seq.num_emitted += len(new_ids)
        seq.text = text
        metrics = {"arrival_time": seq.arrival_time, "first_token_time": seq.first_token_time, "now": now,
                   "num_preemptions": seq.num_preemptions}
        return RequestOutput(
            request_id=seq.request_id, prompt_token_ids=seq.prompt_token_ids, token_ids=out_ids,
            new_token_ids=new_ids, text=text, new_text=new_text, finished=seq.is_finished,
            finish_reason=seq.finish_reason, stop_reason=seq.stop_reason,
            logprobs=seq.logprobs, new_logprobs=new_lp, num_cached_tokens=seq.num_cached_tokens,
            metrics=metrics)

    def shutdown(self) -> None:
        self.runner.shutdown()
