"""A stand-in TP worker for protocol tests and benchmarks: the real step loop (`serve_steps`) over a fake
runner that has no model and no process group, but behaves like an asynchronous device.

`FakeRunner.launch` returns at once; the step "runs" for `device_time` seconds after the step before it
(a device queue), and rank 0's `result()` blocks until then. Every rank "samples" with `sample()` below,
where a placeholder input reads the previous step's sampled ids, like ModelRunner's `sampled_buf`.
"""
from __future__ import annotations

import os
import time
import traceback

from nanovllm.distributed.protocol import Failed, Ready
from nanovllm.distributed.worker import serve_steps


def sample(batch, prev_sampled: list[int]) -> list[int]:
    """The fake model: the next token of a sequence is (its last input token * 7 + position) % 1000, with
    placeholder inputs taken from the previous step's sampled ids."""
    ids = list(batch.input_ids)
    for pos, row in zip(batch.placeholder_pos, batch.placeholder_rows, strict=True):
        ids[pos] = prev_sampled[row]
    return [(ids[r] * 7 + batch.positions[r]) % 1000 for r in batch.logits_indices]


class _FakeEvent:
    def __init__(self, ready_at: float):
        self.ready_at = ready_at

    def query(self) -> bool:
        return time.perf_counter() >= self.ready_at


class FakePending:
    def __init__(self, rank: int, tokens: list[int] | None, ready_at: float):
        self.rank, self.tokens, self.ready_at = rank, tokens, ready_at
        self.event = _FakeEvent(ready_at) if rank == 0 else None  # like ModelRunner's PendingStep on CUDA

    def result(self):
        from nanovllm.engine.model_runner import StepResult
        if self.rank != 0:
            return None  # like ModelRunner: only rank 0 reads its ids back (and waits for them)
        delay = self.ready_at - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        return StepResult(token_ids=list(self.tokens))


FAIL_TOKEN = -999  # a batch whose first input id is this makes rank `fail_rank` raise in launch()


class FakeRunner:
    def __init__(self, rank: int, device_time: float, fails: bool):
        self.rank, self.device_time, self.fails = rank, device_time, fails
        self.sampled: list[int] = []
        self.device_free_at = 0.0
        self.steps = 0

    def launch(self, batch):
        if self.fails and batch.input_ids[:1] == [FAIL_TOKEN]:
            raise ValueError(f"fake failure at step {self.steps}")
        self.steps += 1
        tokens = sample(batch, self.sampled)
        if tokens:
            self.sampled = tokens
        self.device_free_at = max(time.perf_counter(), self.device_free_at) + self.device_time
        return FakePending(self.rank, tokens, self.device_free_at)


def fake_worker(spec, conn, device_time: float = 0.0, fail_rank: int = 1, report_first: bool = False) -> None:
    """`TPExecutor(config, worker_fn=functools.partial(fake_worker, ...))`."""
    runner = FakeRunner(spec.rank, device_time, spec.rank == fail_rank)
    conn.send(Ready(spec.rank, os.getpid(), spec.config.args.num_kvcache_blocks or 64, {}))
    try:
        serve_steps(conn, spec.rank, runner, report_first=report_first)
    except BaseException as e:  # noqa: BLE001 - as worker_main does
        conn.send(Failed(spec.rank, type(e).__name__, str(e), traceback.format_exc(), False))
        os._exit(1)
    conn.close()
    os._exit(0)
