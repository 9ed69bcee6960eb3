"""Tensor-parallel executor: the engine's model runner when tensor_parallel_size > 1.

Design: every rank, rank 0 included, runs in its own spawned worker process; the caller's process is a
pure driver that never joins the process group. So each engine owns a whole, private process group
(the default group of its workers' processes), and two engines in one process or on one host can't
collide: the rendezvous is a TCPStore the driver hosts on a free port (bound to port 0 by the store
itself, so there is no window in which another process could take it).

    driver (engine process)                 worker rank r (one process each, rank r on cuda:r / CPU)
    -----------------------                 -------------------------------------------------------
    TCPStore(127.0.0.1, port 0)   <-------  join the group (NCCL on CUDA, gloo on CPU)
                                            ModelRunner(config, TPGroup(r, size, WORLD))
    wait for Ready from every rank <------  Ready(num_kvcache_blocks)   (already MIN-agreed)
    execute(batch):
        pickle StepMsg once, send   ------> runner.execute(batch)  (collectives between the ranks)
        wait for rank 0's Done     <------  Done(StepResult) from rank 0, Done(None) from the others
        (the others' Done are collected before the next step is sent)

Failures: the driver waits on the pipes *and* the workers' process sentinels, so a worker that raises
(its traceback comes back in a `Failed` message) or dies (killed, OOM) is seen at once; the driver then
gathers what the other ranks report for a moment, kills every worker and raises RuntimeError (ValueError
for a configuration error raised while the workers start). After that the executor is shut down.
"""
from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
import time
import weakref
from dataclasses import dataclass, field
from multiprocessing.connection import wait as mp_wait

from nanovllm.config import EngineConfig
from nanovllm.distributed.protocol import Done, Failed, Ready, ShutdownMsg, StepMsg, encode
from nanovllm.distributed.worker import WorkerSpec, worker_main

logger = logging.getLogger(__name__)

FAILURE_GRACE_S = 1.0     # after a failure, how long to listen for the other ranks' reports
SHUTDOWN_JOIN_S = 5.0     # a clean shutdown waits this long before terminating workers


def _env_timeout(name: str) -> float | None:
    v = os.environ.get(name)
    if v is None or v.strip() in ("", "0", "none"):
        return None
    return float(v)


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


@dataclass
class _Resources:
    """What the finalizer must release; holds no reference to the executor itself."""
    procs: list = field(default_factory=list)
    conns: list = field(default_factory=list)
    store: object = None
    graceful: bool = True  # False once a worker failed: don't ask politely, kill


def _release(res: _Resources) -> None:
    """Stop every worker and free the pipes and the store. Runs once (weakref.finalize)."""
    procs = [p for p in res.procs if p is not None]
    if res.graceful:
        shutdown = encode(ShutdownMsg())
        for p, conn in zip(res.procs, res.conns):
            if p is not None and p.is_alive():
                try:
                    conn.send_bytes(shutdown)
                except OSError:
                    pass
        deadline = time.monotonic() + SHUTDOWN_JOIN_S
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(2.0)
        if p.is_alive():
            p.kill()
            p.join(2.0)
    for conn in res.conns:
        try:
            conn.close()
        except OSError:
            pass
    for p in procs:
        try:
            p.close()
        except ValueError:  # still running (unkillable): leave it to the OS
            pass
    res.procs.clear()
    res.conns.clear()
    res.store = None  # closes the rendezvous server socket


class TPExecutor:
    """Runs a ModelRunner per rank in worker processes; quacks like a ModelRunner for the engine:
    `num_kvcache_blocks`, `execute(batch) -> StepResult`, `shutdown()`."""

    def __init__(self, config: EngineConfig, *, init_timeout: float | None = None,
                 step_timeout: float | None = None):
        import torch.distributed as dist

        self.config = config
        self.size = config.args.tensor_parallel_size
        if self.size < 2:
            raise ValueError(f"TPExecutor needs tensor_parallel_size >= 2, got {self.size}")
        self.init_timeout = init_timeout if init_timeout is not None else _env_timeout("NANOVLLM_TP_INIT_TIMEOUT")
        self.step_timeout = step_timeout if step_timeout is not None else _env_timeout("NANOVLLM_TP_STEP_TIMEOUT")
        self._failure: str | None = None
        self._pending: set[int] = set()   # ranks that owe a Done for the last step sent
        self._pids: list[int] = []
        self._res = _Resources()
        self._finalizer = weakref.finalize(self, _release, self._res)
        try:
            self._res.store = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
            port = self._res.store.port
            ctx = mp.get_context("spawn")
            for rank in range(self.size):
                spec = WorkerSpec(config=config, rank=rank, size=self.size, store_host="127.0.0.1",
                                  store_port=port, parent_pid=os.getpid())
                parent_end, child_end = ctx.Pipe(duplex=True)
                proc = ctx.Process(target=worker_main, args=(spec, child_end), name=f"nanovllm-tp-rank{rank}",
                                   daemon=True)
                self._res.procs.append(proc)
                self._res.conns.append(parent_end)
                proc.start()
                child_end.close()  # the worker holds the only copy: its death closes the pipe
                self._pids.append(proc.pid)
            self._pending = set(range(self.size))
            ready = self._collect(set(range(self.size)), Ready, self.init_timeout, "start-up")
            blocks = {m.num_kvcache_blocks for m in ready.values()}
            if len(blocks) != 1:
                self._fail(f"ranks disagree on the KV cache size: "
                           f"{ {r: m.num_kvcache_blocks for r, m in sorted(ready.items())} }")
            self.num_kvcache_blocks = blocks.pop()
            for name in {k for m in ready.values() for k in m.timings}:  # e.g. load_seconds: the slowest rank
                setattr(self, name, max(m.timings.get(name, 0.0) for m in ready.values()))
        except BaseException:
            self._res.graceful = False
            self.shutdown()
            raise
        logger.info("tensor parallel: %d ranks (pids %s), %d KV blocks", self.size, self._pids,
                    self.num_kvcache_blocks)

    # --- public ------------------------------------------------------------------------------------
    @property
    def worker_pids(self) -> list[int]:
        return list(self._pids)

    @property
    def is_alive(self) -> bool:
        return self._failure is None and self._finalizer.alive

    def execute(self, batch):
        """Run one step on every rank; returns rank 0's StepResult."""
        self._check_usable()
        if self._pending:  # the other ranks' acknowledgements of the previous step
            self._collect(set(self._pending), Done, self.step_timeout, "the previous step")
        data = encode(StepMsg(batch))
        rank = 0
        try:
            for rank, conn in enumerate(self._res.conns):
                conn.send_bytes(data)
                self._pending.add(rank)
        except OSError as e:
            proc = self._res.procs[rank]
            proc.join(0.5)
            if not proc.is_alive():
                self._fail(self._death(rank))
            self._fail(f"could not send the step to rank {rank} (pid {self._pids[rank]}): {e}")
        except BaseException:  # interrupted half-way: the ranks are out of step for good
            self._failure = "interrupted while sending a step to the workers"
            self._res.graceful = False
            self.shutdown()
            raise
        return self._collect({0}, Done, self.step_timeout, "a step")[0].result

    def shutdown(self) -> None:
        """Stop the workers and release everything; idempotent (also runs at exit / garbage collection)."""
        self._finalizer()

    # --- internals ---------------------------------------------------------------------------------
    def _check_usable(self) -> None:
        if self._failure is not None:
            raise RuntimeError(f"the tensor-parallel executor has failed and was shut down: {self._failure}")
        if not self._finalizer.alive:
            raise RuntimeError("the tensor-parallel executor has been shut down")

    def _collect(self, need: set[int], kind: type, timeout: float | None, what: str) -> dict[int, object]:
        """Wait until every rank in `need` has sent its `kind` reply; meanwhile read whatever any rank
        that owes a reply sends, and watch every worker's process sentinel. Returns {rank: message}."""
        res = self._res
        got: dict[int, object] = {}
        deadline = None if timeout is None else time.monotonic() + timeout
        sentinels = {p.sentinel: r for r, p in enumerate(res.procs)}
        while need & self._pending:
            conns = {res.conns[r]: r for r in self._pending}
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready = mp_wait(list(conns) + list(sentinels), timeout=left)
            if not ready:
                late = sorted(need & self._pending)
                self._fail(f"timed out after {timeout:g}s waiting for rank(s) {late} to finish {what} "
                           f"(set NANOVLLM_TP_STEP_TIMEOUT / NANOVLLM_TP_INIT_TIMEOUT to wait longer)")
            for obj in ready:  # the pipes first: a worker's last words come before its death
                if obj in conns:
                    r = conns[obj]
                    msg = self._recv(r)
                    if isinstance(msg, Failed):
                        self._fail_with(msg)
                    if not isinstance(msg, kind) or msg.rank != r:
                        self._fail(f"rank {r} sent an unexpected {type(msg).__name__} while the driver "
                                   f"waited for {kind.__name__}")
                    got[r] = msg
                    self._pending.discard(r)
            for obj in ready:
                if obj in sentinels:
                    r = sentinels[obj]
                    conn = res.conns[r]
                    if r in self._pending and conn.poll(0):
                        msg = self._recv(r)
                        if isinstance(msg, Failed):
                            self._fail_with(msg)
                    self._fail(self._death(r))
        return got

    def _recv(self, r: int):
        try:
            return self._res.conns[r].recv()
        except (EOFError, OSError):
            self._fail(self._death(r))

    def _death(self, r: int) -> str:
        self._res.procs[r].join(1.0)  # its sentinel fired: reap it to learn the exit status
        return (f"tensor-parallel worker rank {r} (pid {self._pids[r]}) died unexpectedly "
                f"({_describe_exit(self._res.procs[r].exitcode)})")

    def _fail_with(self, first: Failed):
        self._fail(None, first)

    def _fail(self, reason: str | None, first: Failed | None = None):
        """Listen briefly for the other ranks' reports, kill every worker, raise."""
        res = self._res
        res.graceful = False
        reports: dict[int, Failed] = {first.rank: first} if first else {}
        dead: set[int] = set()
        deadline = time.monotonic() + FAILURE_GRACE_S
        while time.monotonic() < deadline:
            live = {res.conns[r]: r for r in range(self.size) if r not in reports and r not in dead}
            if not live:
                break
            for obj in mp_wait(list(live), timeout=max(0.0, deadline - time.monotonic())):
                r = live[obj]
                try:
                    msg = obj.recv()
                except (EOFError, OSError):
                    dead.add(r)
                    continue
                if isinstance(msg, Failed):
                    reports[r] = msg
        if first is not None:
            headline = (f"tensor-parallel worker rank {first.rank} (pid {self._pids[first.rank]}) raised "
                        f"{first.exc_type}: {first.message}")
        else:
            headline = reason
        lines = [headline]
        for r, m in sorted(reports.items()):
            if m is not first:
                lines.append(f"  rank {r} also raised {m.exc_type}: {m.message}")
        if first is not None:
            lines.append(f"--- traceback of rank {first.rank} ---\n{first.traceback.rstrip()}")
        message = "\n".join(lines)
        self._failure = headline
        self.shutdown()
        if first is not None and first.during_init and first.exc_type in ("ValueError", "TypeError"):
            # a configuration problem found while the ranks start (e.g. the KV cache is too small)
            raise (ValueError if first.exc_type == "ValueError" else TypeError)(message)
        raise RuntimeError(message)
