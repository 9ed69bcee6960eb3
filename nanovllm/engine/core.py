"""The engine core: an LLMEngine as the server drives it, with no I/O of its own.

Requests come in as `AddRequest` / `Abort` messages (engine/core_protocol.py) and every step goes out as one
`StepOutputs`: for each token the step emitted, its request id, sample index and token id, plus finish reasons and
logprobs.
Token ids only: the text is the API process's job (the core detokenizes only to find stop strings, as offline).

`engine/core_process.py` runs one in a process of its own behind a pipe; tests drive it directly. The offline `LLM`
does not use it: it calls LLMEngine in-process.
"""
from __future__ import annotations

import logging

from nanovllm.config import EngineArgs
from nanovllm.engine.core_protocol import (
    AddRequest,
    EngineStats,
    Finished,
    Ready,
    RequestsFailed,
    StepOutputs,
    TokenLogprobs,
    chunks,
    params_from_wire,
)
from nanovllm.engine.llm_engine import LLMEngine

logger = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, engine: LLMEngine):
        self.engine = engine

    @classmethod
    def from_args(cls, args: EngineArgs) -> EngineCore:
        return cls(LLMEngine(args))

    def ready(self, pid: int) -> Ready:
        e = self.engine
        cfg = e.config
        return Ready(pid=pid, model_dir=cfg.model_dir, max_model_len=cfg.max_model_len, vocab_size=e.vocab_size,
                     num_kvcache_blocks=e.block_manager.num_blocks, block_size=cfg.block_size,
                     device=str(cfg.device), dtype=str(cfg.dtype).removeprefix("torch."),
                     tensor_parallel_size=cfg.args.tensor_parallel_size,
                     worker_pids=list(getattr(e.runner, "worker_pids", [])), startup_seconds=e.startup_seconds)

    # --- requests ----------------------------------------------------------------------------------
    def add(self, msg: AddRequest) -> RequestsFailed | None:
        """Queue the message's requests, all or none: a RequestsFailed (status 400) naming them if the engine
        rejects one (the API process validated them already; this is the engine's own check)."""
        try:
            if len(msg.request_ids) != len(msg.params):
                raise ValueError(f"{len(msg.request_ids)} request ids but {len(msg.params)} parameter sets")
            valid = [self.engine.validate_request(msg.prompt_token_ids, params_from_wire(p)) for p in msg.params]
            taken = [rid for rid in msg.request_ids if rid in self.engine.requests]
            if taken or len(set(msg.request_ids)) != len(msg.request_ids):
                raise ValueError(f"request id {(taken or msg.request_ids)[0]!r} is already in use")
        except (ValueError, TypeError) as e:
            return RequestsFailed(list(msg.request_ids), str(e), 400)
        for rid, req in zip(msg.request_ids, valid):
            self.engine.add_request(rid, req)   # not streamed: no text is made here (stop strings aside)
        return None

    def abort(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.engine.abort_request(rid)

    def has_work(self) -> bool:
        return self.engine.has_unfinished_requests()

    def fail_all(self, message: str) -> list[RequestsFailed]:
        """Drop every request (after a step raised); the messages that tell the API process."""
        ids = self.engine.abort_all()
        return [RequestsFailed(part, message, 500) for part in chunks(ids)]

    # --- steps -------------------------------------------------------------------------------------
    def step(self) -> StepOutputs:
        advanced, _, _ = self.engine.step_tokens()
        ids, toks, samples, finished, logprobs = [], [], [], [], []
        for seq, start, count in advanced:
            rid, sample, lps, all_toks = seq.request_id, seq.index, seq.logprobs, seq.token_ids
            for pos in range(start, start + count):   # one row per token (several: accepted drafts)
                if lps is not None:
                    e = lps[pos - seq.num_prompt_tokens]
                    logprobs.append(TokenLogprobs(len(ids), e["logprob"], [t for t, _ in e["top"]],
                                                  [lp for _, lp in e["top"]]))
                ids.append(rid)
                toks.append(all_toks[pos])
                samples.append(sample)
            if seq.is_finished:
                stop = seq.stop_reason
                text_len = len(seq.detok.text) if isinstance(stop, str) else None
                finished.append(Finished(len(ids) - 1, seq.finish_reason, stop, text_len))
        return StepOutputs(ids, toks, finished, logprobs, self.stats(), samples if any(samples) else [])

    def idle_outputs(self) -> StepOutputs:
        """An empty StepOutputs: the current stats, sent when the core goes idle."""
        return StepOutputs([], [], stats=self.stats())

    def stats(self) -> EngineStats:
        e = self.engine
        bm = e.block_manager
        return EngineStats(num_running=e.num_running, num_waiting=e.num_waiting, num_free_blocks=bm.num_free_blocks,
                           num_blocks=bm.num_blocks, prompt_tokens=e.num_prompt_tokens,
                           generation_tokens=e.num_generation_tokens, num_preemptions=e.scheduler.num_preemptions,
                           prefix_queries=bm.prefix_queries, prefix_hits=bm.prefix_hits, **_spec_stats(e))

    @property
    def executor_alive(self) -> bool:
        return self.engine.runner.is_alive

    def shutdown(self) -> None:
        self.engine.shutdown()


def _spec_stats(engine: LLMEngine) -> dict:
    spec = engine.spec_metrics
    if spec is None:
        return {}
    return {"spec_decode": True, "spec_num_drafts": spec["num_drafts"],
            "spec_num_draft_tokens": spec["num_draft_tokens"], "spec_num_accepted_tokens": spec["num_accepted_tokens"]}
