"""The engine: requests in, one scheduled step at a time, outputs back.

    add_request -> Scheduler.schedule -> build_step_batch -> ModelRunner.launch -> _resolve -> outputs

Everything a user can get wrong is checked in `validate_request`, before any state changes. A request with
`n` samples is n sequences (sample i seeded with seed + i); the scheduler admits samples 1.. once sample 0's
prompt blocks are in the prefix cache, so they share them.
"""
from __future__ import annotations

import itertools
import logging
import random
import time
from dataclasses import dataclass, field

from nanovllm.config import EngineArgs, EngineConfig
from nanovllm.engine.batch import build_step_batch
from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.cuda_graphs import mixed_graph_sizes
from nanovllm.engine.detokenizer import IncrementalDetokenizer, find_stop
from nanovllm.engine.executor import Executor
from nanovllm.engine.kv_events import KVEventPublisher
from nanovllm.engine.output import StepOutput
from nanovllm.engine.sampling_features import RequestFeatures, SlotAllocator, late_inputs, request_features
from nanovllm.engine.scheduler import Scheduler
from nanovllm.engine.sequence import PLACEHOLDER, Sequence
from nanovllm.engine.spec.speculator import Speculator
from nanovllm.engine.tokenizer import eos_ids, load_tokenizer
from nanovllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class ValidRequest:
    """A prompt and params that passed validation; adding it cannot fail."""
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int
    features: RequestFeatures = field(default_factory=RequestFeatures)


def _entry(tok: int, logprob: float, rank: int, top_ids, top_lps) -> dict:
    """A log-probability entry (engine/output.py): the chosen token's, its rank, the top tokens in rank order."""
    return {"token_id": tok, "logprob": logprob, "rank": rank, "top": list(zip(top_ids, top_lps))}


# what a step gave: (sequence, position of its first new token in `token_ids`, number of new tokens)
Advanced = list[tuple[Sequence, int, int]]


def _merge(advanced: Advanced, more: Advanced) -> Advanced:
    """Two resolved steps' lists as one, a sequence in both once (the later step's tokens follow the earlier's)."""
    at = {seq: i for i, (seq, _, _) in enumerate(advanced)}  # a Sequence hashes by identity
    for seq, start, count in more:
        i = at.get(seq)
        if i is None:
            advanced.append((seq, start, count))
        else:
            advanced[i] = (seq, advanced[i][1], advanced[i][2] + count)
    return advanced


class LLMEngine:
    def __init__(self, args: EngineArgs):
        t0 = time.perf_counter()
        self.config = EngineConfig.resolve(args)
        try:
            tok_dir = self.config.model_dir
            if args.tokenizer is not None:
                from nanovllm.utils.hub import resolve_model_dir
                tok_dir = resolve_model_dir(args.tokenizer, args.tokenizer_revision, args.download_dir, "tokenizer")
            self.tokenizer = load_tokenizer(tok_dir)
        except ValueError:
            if args.load_format != "dummy":
                raise
            # benchmarks on a bare config.json: token-id prompts only, outputs carry no text
            logger.warning("no tokenizer in %s: only token-id prompts are accepted", self.config.model_dir)
            self.tokenizer = None
        self.eos_token_ids = eos_ids(self.config.model_dir, self.config.model.eos_token_ids, self.tokenizer)
        # KV-cache events, or None: the sockets open before the model loads, so a port in use fails fast
        self.kv_events = KVEventPublisher.create(self.config.kv_events, self.config.block_size)
        try:
            self.runner: Executor = self._make_runner()
        except BaseException:
            self.shutdown()
            raise
        self.block_manager = BlockManager(self.runner.num_kvcache_blocks, self.config.block_size,
                                          args.enable_prefix_caching, events=self.kv_events)
        self.scheduler = Scheduler(self.block_manager, self.config.max_num_seqs,
                                   self.config.max_num_batched_tokens, self.config.scheduling_policy,
                                   step_sizes=mixed_graph_sizes(self.config))
        self.requests: dict[str, list[Sequence]] = {}   # request id -> its samples
        self.slots = SlotAllocator()
        self._structured = None  # StructuredOutputs, built at the first structured request
        self.speculator = Speculator(self.config.speculative, self.config.max_model_len) \
            if self.config.speculative is not None else None
        # async scheduling: the launched step whose tokens are not read yet: (handle, its (seq, row) pairs, (batch,
        # seqs), whether it still has to be sampled: a deferred step is sampled in the next call, `_sample_inflight`)
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
        params.verify()  # again: a field may have changed since construction
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
        structured = self.structured if params.structured_outputs is not None else None
        held = set(params.stop_token_ids or ()) | (set() if params.ignore_eos else set(self.eos_token_ids))
        features = request_features(params, V, self.tokenizer, structured, self.config.args.tensor_parallel_size,
                                    held_back=held)
        return ValidRequest(ids, params, max_tokens, features)

    @property
    def structured(self):
        """The engine's grammars (engine/structured.py), built on first use."""
        if self._structured is None:
            if self.tokenizer is None:
                raise ValueError("structured_outputs need a tokenizer, and this engine has none")
            from nanovllm.engine.structured import StructuredOutputs
            self._structured = StructuredOutputs(self.tokenizer, self.vocab_size, self.eos_token_ids,
                                                 rows=self.config.max_num_seqs,
                                                 pin_memory=self.config.device.type == "cuda")
        return self._structured

    def add_request(self, request_id: str, prompt, params: SamplingParams | None = None, *,
                    stream: bool = False) -> list[Sequence]:
        """Validate and queue a request (its `n` samples). `stream` makes step() report each sample every step,
        with text deltas."""
        req = prompt if isinstance(prompt, ValidRequest) else self.validate_request(prompt, params)
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        p, f = req.params, req.features
        stop_ids = set(p.stop_token_ids or ())
        if not p.ignore_eos:
            stop_ids |= self.eos_token_ids
        seqs: list[Sequence] = []
        now = time.monotonic()
        for i in range(p.n):
            if p.seed is not None:  # sample i: seed + i (vLLM's rule), wrapped to 64 bits
                seed = (p.seed + i + (1 << 63)) % (1 << 64) - (1 << 63)
            else:
                seed = self._noise_rng.getrandbits(63)
            seq = Sequence(next(self._seq_ids), request_id, req.prompt_token_ids, p, req.max_tokens,
                           frozenset(stop_ids), seed, index=i, leader=seqs[0] if seqs else None)
            seq.stream = stream
            seq.static_bias, seq.bad_word_ids = f.static_bias, f.bad_word_ids
            if f.grammar is not None:
                seq.grammar = f.grammar
                self.structured.add(seq.seq_id, f.grammar)
            if (stream or p.stop_strings) and self.tokenizer is not None:
                seq.detok = IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids, p.skip_special_tokens)
            seq.arrival_time = now
            seqs.append(seq)
        self.requests[request_id] = seqs
        for seq in seqs:
            self.scheduler.add(seq)
        return seqs

    def abort_request(self, request_id: str) -> bool:
        """Drop a request (all its samples) and free its blocks at once; False if it is unknown or already done."""
        seqs = self.requests.pop(request_id, None)
        if seqs is None or all(s.is_finished for s in seqs):
            return False
        for seq in seqs:
            self._finish(seq, "abort")
        return True

    def _finish(self, seq: Sequence, reason: str) -> None:
        if not seq.is_finished:
            self.scheduler.finish(seq, reason)
        self.slots.release(seq)
        if seq.grammar is not None:
            self._structured.drop(seq.seq_id)
            seq.grammar = None

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

    @property
    def spec_metrics(self) -> dict | None:
        """Speculative decoding's counters (None without it): sequence-steps with drafts, draft tokens verified,
        drafts accepted, and the mean acceptance length (tokens per sequence per verification step)."""
        s = self.speculator
        if s is None:
            return None
        return {"num_drafts": s.num_drafts, "num_draft_tokens": s.num_draft_tokens,
                "num_accepted_tokens": s.num_accepted_tokens, "mean_acceptance_length": s.mean_acceptance_length}

    # --- one step ----------------------------------------------------------------------------------
    def step(self) -> tuple[list[StepOutput], int, int]:
        """Schedule and launch one step, and process the tokens of the step before it (async scheduling)
        or of this one (otherwise). A step with draft tokens (speculative decoding) is scheduled after the step
        before it is read (its drafts start from that step's tokens) and runs synchronously (engine/spec/).

        Returns (outputs, prompt tokens launched, tokens sampled by the processed steps). Outputs hold every
        request that finished and every streamed request that made progress."""
        advanced, num_prefill, num_sampled = self.step_tokens()
        now = time.monotonic()
        outputs = [self._make_output(seq, now) for seq, _, _ in advanced if seq.is_finished or seq.stream]
        return outputs, num_prefill, num_sampled

    def step_tokens(self) -> tuple[Advanced, int, int]:
        """`step` without building outputs (the engine core's step: it reports token ids, not text). Returns
        (`Advanced`: each sequence the processed steps gave tokens, once; prompt tokens launched; tokens emitted).
        Stop checks are done: a sequence that finished has its finish reason and has released its blocks."""
        advanced, num_sampled = [], 0
        drafted: list[Sequence] = []
        if self.speculator is not None and self.speculator.wants_drafts(self.scheduler.running):
            advanced, num_sampled = self._resolve_inflight()
            drafted = self.speculator.propose(self.scheduler.running)
        sync = not self.async_scheduling or bool(drafted)
        sched = self.scheduler.schedule()
        launched = None
        num_prefill = 0
        if sched:
            self.slots.assign(sched.seqs, sched.num_new_tokens)
            batch = build_step_batch(sched, self.config.block_size)
            # prompt tokens (or tokens recomputed after a preemption) this step computes: all but the decode rows
            # whose token is an output token and the rows verifying drafts
            num_prefill = sum(n for i, (s, n, k) in enumerate(zip(sched.seqs, sched.num_new_tokens, sched.num_drafts))
                              if not k and not (i < sched.num_decode and s.num_output_tokens))
            deferred = batch.sampling.deferred
            # a deferred step stops before sampling: its masks / bans are filled once the tokens before it are known
            # (engine/structured.py): below without async scheduling, in the next call with it
            self._sample_inflight()
            handle = self.runner.execute(batch) if sync and not deferred else self.runner.launch(batch)
            launched = (handle, sched, batch)
        for seq in drafted:  # the batch holds the drafts the scheduler took
            seq.draft_ids = []
        if self._inflight is not None:  # the previous step's tokens (its successor is already queued)
            # a deferred successor's grammar rows: the grammar process fills them while the rest of this runs
            fill = None
            if launched is not None and launched[2].sampling.grammar_sids:
                sb = launched[2].sampling
                fill = (sb.grammar_sids, sb.grammar_rows, launched[2].num_logits)
            more, n = self._resolve_inflight(fill)
            advanced, num_sampled = _merge(advanced, more), num_sampled + n
        if launched is not None:
            handle, sched, batch = launched
            pending = self.scheduler.on_step_done(sched)
            if batch.sampling.deferred and sync:
                handle.sample(late_inputs(batch, sched.seqs, self._structured))
            if not sync:
                self._inflight = (handle, pending, (batch, sched.seqs), batch.sampling.deferred)
            else:
                result = handle.result() if batch.sampling.deferred else handle  # execute() gave the result itself
                more, n = self._resolve(result, pending, (batch, sched.seqs))
                advanced, num_sampled = _merge(advanced, more), num_sampled + n
        elif self.scheduler.has_unfinished() and not advanced and not num_sampled:
            raise RuntimeError("scheduler made no progress with requests pending (KV cache too small?)")
        if self._structured is not None and self._structured.broken:
            self._finish_broken(advanced)
        self.num_prompt_tokens += num_prefill
        self.num_generation_tokens += num_sampled
        if self.kv_events is not None:   # the blocks this step stored and evicted, as one batch
            self.kv_events.end_step()
        return advanced, num_prefill, num_sampled

    def _resolve_inflight(self, fill: tuple[list[int], list[int], int] | None = None) -> tuple[Advanced, int]:
        if self._inflight is None:
            return [], 0
        self._sample_inflight()
        handle, pending, step, _ = self._inflight
        self._inflight = None
        return self._resolve(handle.result(), pending, step, fill)

    def _sample_inflight(self) -> None:
        """Sample the deferred step in flight (async scheduling), if it is not yet. This waits for its masks from the
        grammar process, whose job was sent when the tokens before it were read: the engine puts it off until the
        next step is scheduled and built (or the step's tokens are needed), so the grammar work hides behind all
        that host work, not only the previous step's stop checks."""
        if self._inflight is not None and self._inflight[3]:
            handle, pending, step, _ = self._inflight
            handle.sample(late_inputs(*step, self._structured))
            self._inflight = (handle, pending, step, False)

    def _finish_broken(self, advanced: Advanced) -> None:
        """Finish (abort) the sequences whose token broke their grammar, or whose grammar failed to compile in the
        grammar process, once they are among this step's advanced sequences (so their outputs report it)."""
        here = {seq.seq_id: seq for seq, _, _ in advanced}
        keep = {}
        for sid, why in self._structured.take_broken().items():
            seq = here.get(sid)
            if seq is None:  # no token this step: reported with its next one, unless it has finished
                if self._structured.is_live(sid):
                    keep[sid] = why
                continue
            if seq.is_finished:
                continue
            logger.warning("request %s: %s; finishing it", seq.request_id, why)
            if seq.pending_row is not None:  # the token of the step in flight is not its own any more
                seq.token_ids.pop()
                seq.pending_row = None
            self._end(seq, "abort")
        self._structured.broken.update(keep)

    def _end(self, seq: Sequence, reason: str) -> None:
        """Finish a sequence with `reason`; its request is done once all its samples are."""
        self._finish(seq, reason)
        if all(s.is_finished for s in self.requests.get(seq.request_id, ())):
            self.requests.pop(seq.request_id, None)

    def _resolve(self, result, pending: list[tuple[Sequence, int]], step,
                 fill: tuple[list[int], list[int], int] | None = None) -> tuple[Advanced, int]:
        """Put a step's sampled tokens in place of its placeholders, then check each sequence for a stop. A sequence
        that verified drafts gets the accepted ones and one more token, checked one at a time; the accepted drafts
        count as computed (their K/V is in the cache). `step`: (the StepBatch, its sequences), for the prompt
        log-probabilities it computed. `fill`: the next step's grammar rows (seq_ids, logits rows, its number of
        rows), sent to the grammar process with this step's tokens. Returns the sequences' new tokens (`Advanced`)
        and how many were emitted."""
        now = time.monotonic()
        batch, seqs = step
        if batch.prompt_lp_rows:
            self._record_prompt_logprobs(result, batch, seqs)
        db = batch.sampling.drafts
        verified = {} if db is None else dict(zip(db.first_rows, zip(db.num_drafts, result.num_accepted)))
        advanced = []
        self._advance_matchers(result, batch.sampling, fill)
        emitted = 0
        for seq, row in pending:
            if seq.is_finished:  # aborted while its step was in flight
                continue
            tok = result.token_ids[row]
            start = seq.num_prompt_tokens + seq.num_output_tokens - 1  # its placeholder
            seq.token_ids[start] = tok
            seq.pending_row = None
            if seq.first_token_time is None:
                seq.first_token_time = now
            reason = self._accept_token(seq, tok, result, row)
            count = 1
            if verified and row in verified:  # the accepted drafts, then the token after them
                num_drafts, accepted = verified[row]
                self.speculator.record(seq, num_drafts, accepted)
                while reason is None and count <= accepted:
                    tok = result.token_ids[row + count]
                    seq.append_token(tok)
                    reason = self._accept_token(seq, tok, result, row + count)
                    count += 1
                if reason is None and accepted:  # their K/V stays; blocks holding them can be registered now
                    seq.num_computed_tokens += accepted
                    self.block_manager.register_full_blocks(seq)
            emitted += count
            if reason is not None:
                self._end(seq, reason)
            advanced.append((seq, start, count))
        return advanced, emitted

    def _advance_matchers(self, result, sb, fill: tuple[list[int], list[int], int] | None) -> None:
        """Send a step's constrained tokens (`sb`: its SamplingBatch, whose grammar rows they are) to the grammar
        process in one job, with the next step's rows to fill (`fill`), before anything else is done with them: the
        child works while this process goes on. A token that breaks its grammar is found when the reply is read
        (`_finish_broken`). The rows of sequences finished meanwhile go too: the child has dropped their matchers
        or their grammar has ended, and their sequences ignore what it says of them."""
        if self._structured is None or not (sb.grammar_sids or (fill and fill[0])):
            return
        toks = result.token_ids
        self._structured.advance(sb.grammar_sids, [toks[r] for r in sb.grammar_rows], fill)

    @staticmethod
    def _record_prompt_logprobs(result, batch, seqs: list[Sequence]) -> None:
        k = batch.prompt_lp_k
        for i, (b, target) in enumerate(zip(batch.prompt_lp_seqs, batch.prompt_lp_targets)):
            seq = seqs[b]
            if seq.prompt_logprobs is None or seq.is_finished:
                continue
            want = seq.params.prompt_logprobs
            seq.prompt_logprobs.append(_entry(
                target, result.prompt_logprobs[i], result.prompt_ranks[i],
                result.prompt_top_ids[i][:want] if k and want else (),
                result.prompt_top_logprobs[i][:want] if k and want else ()))

    def _accept_token(self, seq: Sequence, tok: int, result, row: int) -> str | None:
        """A new output token (row `row` of the step's result): record its logprobs and check for a stop (whether it
        kept its grammar is the grammar process's answer: `_finish_broken`). Returns the reason to finish, if any."""
        p = seq.params
        if seq.logprobs is not None:
            k = p.logprobs
            seq.logprobs.append(_entry(tok, result.logprobs[row], result.ranks[row],
                                       result.top_ids[row][:k] if k else (), result.top_logprobs[row][:k] if k
                                       else ()))
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
                    seq.detok.text = text[:i + len(seq.stop_reason)] if p.include_stop_str_in_output else text[:i]
                    return "stop"
        if n_out >= seq.max_tokens or seq.num_tokens >= self.config.max_model_len:
            return "length"
        return None

    def _make_output(self, seq: Sequence, now: float) -> StepOutput:
        toks = seq.token_ids
        end = len(toks) - (toks[-1] == PLACEHOLDER)  # not the token of the step in flight (async scheduling)
        new_ids = toks[seq.num_prompt_tokens + seq.num_emitted:end]
        # the whole output list only at the end: copying it every step of every stream is O(length)
        out_ids = seq.output_token_ids if seq.is_finished else []
        p = seq.params
        if seq.is_finished and isinstance(seq.stop_reason, str):
            text = seq.detok.text                   # cut at its stop string
        elif seq.is_finished and self.tokenizer is not None:
            # the whole output decoded at once, whether or not a detokenizer followed it (the same text either way)
            text = self.tokenizer.decode(out_ids, skip_special_tokens=p.skip_special_tokens)
        elif seq.detok is not None:
            text = seq.detok.text
            if p.stop_strings:  # held back: what could be the start of a stop string that the next tokens complete
                text = text[:max(len(seq.text), len(text) - (max(map(len, p.stop_strings)) - 1))]
        else:
            text = ""
        new_text = text[len(seq.text):] if seq.stream else ""
        new_lp = seq.logprobs[seq.num_emitted:seq.num_emitted + len(new_ids)] if seq.logprobs is not None else None
        seq.num_emitted += len(new_ids)
        seq.text = text
        metrics = {"arrival_time": seq.arrival_time, "first_token_time": seq.first_token_time, "now": now,
                   "num_preemptions": seq.num_preemptions}
        return StepOutput(
            request_id=seq.request_id, index=seq.index, prompt_token_ids=seq.prompt_token_ids, token_ids=out_ids,
            new_token_ids=new_ids, text=text, new_text=new_text, finished=seq.is_finished,
            finish_reason=seq.finish_reason, stop_reason=seq.stop_reason,
            logprobs=seq.logprobs, new_logprobs=new_lp,
            prompt_logprobs=seq.prompt_logprobs if seq.is_finished else None,
            num_cached_tokens=seq.num_cached_tokens, metrics=metrics)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (vLLM's `LLM.reset_prefix_cache`); False, changing nothing, while requests
        hold blocks. Publishes AllBlocksCleared with KV-cache events on."""
        done = self.block_manager.reset_prefix_cache()
        if done and self.kv_events is not None:
            self.kv_events.end_step()
        return done

    def shutdown(self) -> None:
        try:
            if hasattr(self, "runner"):
                self.runner.shutdown()
        finally:
            if self.kv_events is not None:
                self.kv_events.shutdown()
            if getattr(self, "_structured", None) is not None:  # the grammar process
                self._structured.close()
