"""An engine core without a model: it speaks the engine-core protocol and makes up tokens.

For measuring the API server process alone (benchmarks/online_bench.py --fake-core: its CPU per token, with the
engine's cost taken out) and for testing the API side of the transport. Every running request gets one token per
step, `step_seconds` apart (the GPU's time, simulated): the token ids cycle through `token_ids` (ids that decode
to text) from a per-sample offset, and a sample ends with "length" after max_tokens tokens.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass

from nanovllm.engine.core_protocol import (
    AddRequest,
    EngineStats,
    Finished,
    Ready,
    RequestsFailed,
    StepOutputs,
    chunks,
    params_from_wire,
)


@dataclass(frozen=True)
class FakeCoreArgs:
    token_ids: tuple[int, ...]     # what the made-up outputs are drawn from
    vocab_size: int
    max_model_len: int = 4096
    max_num_seqs: int = 256
    step_seconds: float = 0.0

    def __post_init__(self):
        if not self.token_ids:
            raise ValueError("FakeCoreArgs.token_ids must not be empty")
        if self.step_seconds < 0:
            raise ValueError(f"step_seconds must be >= 0, got {self.step_seconds}")


class _Req:
    """One sample of a request."""
    __slots__ = ("rid", "sample", "offset", "max_tokens", "n")

    def __init__(self, rid: str, sample: int, offset: int, max_tokens: int):
        self.rid, self.sample, self.offset, self.max_tokens, self.n = rid, sample, offset, max_tokens, 0


class FakeEngineCore:
    def __init__(self, args: FakeCoreArgs):
        self.args = args
        self.reqs: OrderedDict[tuple[str, int], _Req] = OrderedDict()   # (request id, sample) -> its state
        self.num_samples: dict[str, int] = {}                           # live request id -> its n
        self.generated = 0
        self.prompt_tokens = 0

    @classmethod
    def from_args(cls, args: FakeCoreArgs) -> FakeEngineCore:
        return cls(args)

    def ready(self, pid: int) -> Ready:
        a = self.args
        return Ready(pid=pid, model_dir="fake-core", max_model_len=a.max_model_len, vocab_size=a.vocab_size,
                     num_kvcache_blocks=1, block_size=16, device="cpu", dtype="none", tensor_parallel_size=1,
                     worker_pids=[], startup_seconds=0.0)

    def add(self, msg: AddRequest) -> RequestsFailed | None:
        if any(rid in self.num_samples for rid in msg.request_ids):
            return RequestsFailed(list(msg.request_ids), "request id already in use", 400)
        room = self.args.max_model_len - len(msg.prompt_token_ids)
        for rid, p in zip(msg.request_ids, msg.params):
            params = params_from_wire(p)
            mt = room if params.max_tokens is None else min(params.max_tokens, room)
            for j in range(params.n):
                self.reqs[rid, j] = _Req(rid, j, len(msg.prompt_token_ids) + len(self.reqs), mt)
            self.num_samples[rid] = params.n
        self.prompt_tokens += len(msg.prompt_token_ids) * len(msg.request_ids)
        return None

    def abort(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            for j in range(self.num_samples.pop(rid, 0)):
                self.reqs.pop((rid, j), None)

    def has_work(self) -> bool:
        return bool(self.reqs)

    def step(self) -> StepOutputs:
        if self.args.step_seconds:
            time.sleep(self.args.step_seconds)
        toks = self.args.token_ids
        ids, out, samples, finished = [], [], [], []
        for i, r in enumerate(list(self.reqs.values())[:self.args.max_num_seqs]):
            ids.append(r.rid)
            samples.append(r.sample)
            out.append(toks[(r.offset + r.n) % len(toks)])
            r.n += 1
            if r.n >= r.max_tokens:
                finished.append(Finished(i, "length"))
                del self.reqs[r.rid, r.sample]
                if all((r.rid, j) not in self.reqs for j in range(self.num_samples[r.rid])):
                    del self.num_samples[r.rid]
        self.generated += len(ids)
        return StepOutputs(ids, out, finished, [], self.stats(), samples if any(samples) else [])

    def idle_outputs(self) -> StepOutputs:
        return StepOutputs([], [], stats=self.stats())

    def fail_all(self, message: str) -> list[RequestsFailed]:
        ids = list(self.num_samples)
        self.reqs.clear()
        self.num_samples.clear()
        return [RequestsFailed(part, message, 500) for part in chunks(ids)]

    def stats(self) -> EngineStats:
        running = min(len(self.reqs), self.args.max_num_seqs)
        return EngineStats(num_running=running, num_waiting=len(self.reqs) - running, num_free_blocks=1, num_blocks=1,
                           prompt_tokens=self.prompt_tokens, generation_tokens=self.generated)

    executor_alive = True

    def shutdown(self) -> None:
        pass
