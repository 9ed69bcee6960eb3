"""A stand-in TP worker for protocol tests and benchmarks: the real step loop (`serve_steps`) over a fake
runner that has no model and no process group, but behaves like an asynchronous device.

`FakeRunner.launch` returns at once; the step "runs" for `device_time` seconds after the step before it
(a device queue), and rank 0's `result()` blocks until then. Every rank "samples" with `sample()` below,
where a placeholder input reads the previous step's sampled ids, like ModelRunner's `sampled_buf`.

A step whose first input id is FAIL_TOKEN fails on rank `fail_rank`: it raises a ValueError, or with
`fault="kill"` the rank SIGKILLs itself. With `peer_error`, the other ranks then raise what a real collective
raises when it loses a peer (gloo's "Connection reset by peer") at once, and the failing rank waits PEER_LAG_S
first: so the fallout reaches the driver before the cause, the race a real kill can lose.
"""
from __future__ import annotations

import os
import signal
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


FAIL_TOKEN = -999  # a batch whose first input id is this makes rank `fail_rank` fail in launch()
PEER_LAG_S = 0.3   # with peer_error: how long the failing rank waits after the others raised
PEER_ERROR = "[gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:4242: Connection reset by peer"


class FakeRunner:
    def __init__(self, rank: int, device_time: float, fails: bool, fault: str = "raise", peer_error: bool = False):
        self.rank, self.device_time, self.fails = rank, device_time, fails
        self.fault, self.peer_error = fault, peer_error
        self.sampled: list[int] = []
        self.device_free_at = 0.0
        self.steps = 0

    def launch(self, batch):
        if batch.input_ids[:1] == [FAIL_TOKEN] and (self.fails or self.peer_error):
            if not self.fails:
                raise RuntimeError(PEER_ERROR)
            if self.peer_error:
                time.sleep(PEER_LAG_S)
            if self.fault == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise ValueError(f"fake failure at step {self.steps}")
        self.steps += 1
        tokens = sample(batch, self.sampled)
        if tokens:
            self.sampled = tokens
        self.device_free_at = max(time.perf_counter(), self.device_free_at) + self.device_time
        return FakePending(self.rank, tokens, self.device_free_at)


def fake_worker(spec, conn, device_time: float = 0.0, fail_rank: int = 1, report_first: bool = False,
                fault: str = "raise", peer_error: bool = False) -> None:
    """`TPExecutor(config, worker_fn=functools.partial(fake_worker, ...))`."""
    runner = FakeRunner(spec.rank, device_time, spec.rank == fail_rank, fault, peer_error)
    conn.send(Ready(spec.rank, os.getpid(), spec.config.args.num_kvcache_blocks or 64, {}))
    try:
        serve_steps(conn, spec.rank, runner, report_first=report_first)
    except BaseException as e:  # noqa: BLE001 - as worker_main does
        conn.send(Failed(spec.rank, type(e).__name__, str(e), traceback.format_exc(), False))
        os._exit(1)
    conn.close()
    os._exit(0)
