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
    launch(batch) -> TPStep N:
        pickle StepMsg(N) once, send -----> runner.launch(N)   (queued on the device behind N-1)
                                            wait for N-1, send Done(N-1)  (StepResult on rank 0, else None)
    handle N-1 .result():
        read Done(N-1)             <------
    handle N .result() with no step N+1 sent:
        send FlushMsg(N)           ------>  wait for N, send Done(N)
    execute(batch) = launch with StepMsg.report (the ranks report at once) + result()

The driver never has more than one report per rank outstanding before it sends a step: it reads every
report that is due first (see `TPExecutor`), so neither side can block writing to the other for good,
and results come back in step order. Rank 0's reports fill the handles; the others' are acknowledgements
read along the way (they prove the rank is alive and in step).

Failures: the driver waits on the pipes *and* the workers' process sentinels, so a worker that raises
(its traceback comes back in a `Failed` message) or dies (killed, OOM) is seen at once; the driver then
gathers what the other ranks report for a moment, kills every worker and raises RuntimeError (ValueError
for a configuration error raised while the workers start). Its headline names the rank at fault: one that died,
else one that raised an error of its own, never a survivor whose collective merely lost that rank (`_fail`).
After that the executor is shut down.

Several nodes (`EngineConfig.nodes`, docs/scale-out.md): the driver spawns only node 0's ranks (pipes as above)
and hosts the rendezvous at master_addr:master_port; rank 0 forwards every driver message to the other nodes'
ranks over torch.distributed, and `NodeWatch` (distributed/remote.py) folds the other nodes' reports and
heartbeats into the same failure path.
"""
from __future__ import annotations

import logging
import multiprocessing as mp
import os
import time
import weakref
from dataclasses import dataclass, field
from multiprocessing.connection import wait as mp_wait

from nanovllm.config import EngineConfig
from nanovllm.distributed.protocol import (
    Done,
    Failed,
    FlushMsg,
    Ready,
    ShutdownMsg,
    StepMsg,
    blames_a_peer,
    encode,
)
from nanovllm.distributed.worker import WorkerSpec, worker_main
from nanovllm.utils.processes import describe_exit

logger = logging.getLogger(__name__)

FAILURE_GRACE_S = 1.0     # after a failure, how long to listen for the other ranks' reports
SHUTDOWN_JOIN_S = 5.0     # a clean shutdown waits this long before terminating workers


def _env_timeout(name: str) -> float | None:
    """A timeout in seconds from the environment variable `name` (unset, "", "0" or "none": no timeout)."""
    v = os.environ.get(name)
    if v is None or v.strip() in ("", "0", "none"):
        return None
    try:
        t = float(v)
    except ValueError:
        t = float("nan")
    if not 0 < t < float("inf"):
        raise ValueError(f"{name} must be a number of seconds > 0 (or 0 / none: no timeout), got {v!r}")
    return t


@dataclass
class _Resources:
    """What the finalizer must release; holds no reference to the executor itself."""
    procs: list = field(default_factory=list)
    conns: list = field(default_factory=list)
    store: object = None
    watch: object = None   # NodeWatch with several nodes (distributed/remote.py)
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
    if res.watch is not None:  # the other nodes' ranks got the ShutdownMsg through rank 0, else this stops them
        if res.graceful:
            res.watch.wait_done(SHUTDOWN_JOIN_S)
        res.watch.abort("" if res.graceful else "the leader failed")
        res.watch = None
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


_NO_RESULT = object()


class TPStep:
    """A step launched on every rank (what `TPExecutor.launch` returns). `result()` waits for rank 0's
    StepResult of this step; results are read in step order, so waiting for step N also reads the reports
    of the steps before it (each kept by its own handle)."""

    __slots__ = ("_executor", "step", "_result", "__weakref__")

    def __init__(self, executor: TPExecutor, step: int):
        self._executor = executor
        self.step = step
        self._result = _NO_RESULT

    def sample(self, late) -> None:
        raise RuntimeError("deferred sampling (structured outputs, multi-token bad words) is not supported with "
                           "tensor parallelism; such requests are rejected at validation")

    def result(self):
        if self._result is _NO_RESULT:
            self._executor._wait_result(self)
        return self._result

    def __repr__(self) -> str:
        state = "pending" if self._result is _NO_RESULT else "done"
        return f"TPStep({self.step}, {state})"


class TPExecutor:
    """Runs a ModelRunner per rank in worker processes; the engine's `Executor` (nanovllm.engine.executor):
    `num_kvcache_blocks`, `launch(batch) -> handle` (handle.result() -> StepResult),
    `execute(batch) -> StepResult`, `shutdown()`.

    Step bookkeeping (driver side): steps are numbered; `_sent` is the latest step sent to every rank,
    `_acked[r]` the latest step whose Done rank r has sent (Dones come in step order), `_flushed[r]` the
    latest step rank r was asked to report at once (StepMsg.report or FlushMsg). Rank r's Done for step k
    is *due* (certain to come without another message) iff k < _sent or k <= _flushed[r]."""

    def __init__(self, config: EngineConfig, *, init_timeout: float | None = None,
                 step_timeout: float | None = None, worker_fn=None):
        """`worker_fn(spec, conn)`: what each worker process runs (default `worker_main`; the protocol
        tests and benchmarks pass a stand-in that serves steps without a model)."""
        import torch.distributed as dist

        self.config = config
        nodes = config.nodes
        self.tp_size = config.args.tensor_parallel_size
        if self.tp_size < 2:
            raise ValueError(f"TPExecutor needs tensor_parallel_size >= 2, got {self.tp_size}")
        if nodes.node_rank != 0:
            raise ValueError(f"node_rank={nodes.node_rank}: the engine runs on node 0; the other nodes run only "
                             f"workers (`nanovllm serve MODEL --headless --node-rank {nodes.node_rank} ...`)")
        self.size = self.tp_size // nodes.nnodes  # the ranks on this node, each with a pipe: 0 .. size - 1
        self.init_timeout = init_timeout if init_timeout is not None else _env_timeout("NANOVLLM_TP_INIT_TIMEOUT")
        self.step_timeout = step_timeout if step_timeout is not None else _env_timeout("NANOVLLM_TP_STEP_TIMEOUT")
        self._failure: str | None = None
        self.load_seconds = self.kv_seconds = self.gemm_plan_seconds = self.capture_seconds = 0.0
        self._sent = -1
        self._acked = [-1] * self.size
        self._flushed = [-1] * self.size
        self._handles: weakref.WeakValueDictionary[int, TPStep] = weakref.WeakValueDictionary()
        self._ready: dict[int, Ready] | None = {}   # filled while the workers start
        self._pids: list[int] = []
        self._res = _Resources()
        self._finalizer = weakref.finalize(self, _release, self._res)
        try:
            host = "127.0.0.1"
            if nodes.multinode:
                from nanovllm.distributed.remote import NodeWatch
                self._res.watch = NodeWatch.start(config, self.init_timeout)
                self._res.store = self._res.watch.tcp_store
                host = nodes.master_addr if nodes.use_agent_store else host
            else:
                self._res.store = dist.TCPStore(host, 0, None, True, wait_for_workers=False)
            port = self._res.store.port
            ctx = mp.get_context("spawn")
            for rank in range(self.size):
                spec = WorkerSpec(config=config, rank=rank, size=self.tp_size, store_host=host,
                                  store_port=port, parent_pid=os.getpid())
                parent_end, child_end = ctx.Pipe(duplex=True)
                proc = ctx.Process(target=worker_fn or worker_main, args=(spec, child_end),
                                   name=f"nanovllm-tp-rank{rank}", daemon=True)
                self._res.procs.append(proc)
                self._res.conns.append(parent_end)
                proc.start()
                child_end.close()  # the worker holds the only copy: its death closes the pipe
                self._pids.append(proc.pid)
            self._pump(lambda: [r for r in range(self.size) if r not in self._ready], self.init_timeout,
                       "start-up")
            ready, self._ready = self._ready, None
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
        logger.info("tensor parallel: %d ranks (here: pids %s), %d node(s), %d KV blocks", self.tp_size, self._pids,
                    nodes.nnodes, self.num_kvcache_blocks)

    # --- public ------------------------------------------------------------------------------------
    @property
    def worker_pids(self) -> list[int]:
        return list(self._pids)

    @property
    def is_alive(self) -> bool:
        return self._failure is None and self._finalizer.alive

    def launch(self, batch) -> TPStep:
        """Send one step to every rank and return at once (the ranks launch it on their devices as soon as
        it arrives, queued behind the step before it). Placeholder inputs are filled by each rank from the
        ids it sampled in the latest step."""
        return self._launch(batch, report=False)

    def execute(self, batch):
        """Run one step on every rank; returns rank 0's StepResult."""
        return self._launch(batch, report=True).result()

    def shutdown(self) -> None:
        """Stop the workers and release everything; idempotent (also runs at exit / garbage collection)."""
        self._finalizer()

    # --- internals ---------------------------------------------------------------------------------
    @property
    def _pending(self) -> set[int]:
        """Ranks that owe a Done for a step sent."""
        return {r for r in range(self.size) if self._acked[r] < self._sent}

    def _check_usable(self) -> None:
        if self._failure is not None:
            raise RuntimeError(f"the tensor-parallel executor has failed and was shut down: {self._failure}")
        if not self._finalizer.alive:
            raise RuntimeError("the tensor-parallel executor has been shut down")

    def _launch(self, batch, report: bool) -> TPStep:
        self._check_usable()
        # every report due before this step goes out: then no rank can be blocked writing to the driver
        # while the driver writes this step to it, and each pipe holds at most a step's worth of messages
        self._pump(self._due_late, self.step_timeout, "the previous step")
        step = self._sent + 1
        self._send_all(encode(StepMsg(batch, step, report)), range(self.size), "a step")
        self._sent = step
        if report:
            self._flushed = [step] * self.size
        handle = TPStep(self, step)
        self._handles[step] = handle
        return handle

    def _due_late(self) -> list[int]:
        """Ranks whose due reports have not all been read yet."""
        before = self._sent - 1
        return [r for r in range(self.size) if self._acked[r] < max(before, self._flushed[r])]

    def _wait_result(self, handle: TPStep) -> None:
        self._check_usable()
        k = handle.step
        if self._acked[0] < k:
            if k == self._sent:  # no later step was sent: ask for this one (every rank, so all stay alike)
                late = [r for r in range(self.size) if self._flushed[r] < k]
                if late:
                    self._send_all(encode(FlushMsg(k)), late, "a flush request")
                    for r in late:
                        self._flushed[r] = k
            self._pump(lambda: [0] if self._acked[0] < k else [], self.step_timeout, "a step")
        if handle._result is _NO_RESULT:
            raise RuntimeError(f"tensor-parallel step {k}'s result was lost (handle of another executor?)")

    def _send_all(self, data: bytes, ranks, what: str) -> None:
        rank = -1
        try:
            for rank in ranks:
                self._res.conns[rank].send_bytes(data)
        except OSError as e:
            proc = self._res.procs[rank]
            proc.join(0.5)
            if not proc.is_alive():
                self._fail(dead=rank)
            self._fail(f"could not send {what} to rank {rank} (pid {self._pids[rank]}): {e}")
        except BaseException:  # interrupted half-way: the ranks are out of step for good
            self._failure = f"interrupted while sending {what} to the workers"
            self._res.graceful = False
            self.shutdown()
            raise

    def _pump(self, late, timeout: float | None, what: str) -> None:
        """Read the workers' messages until `late()` (the ranks still awaited) is empty, watching every
        worker's pipe and process sentinel: a report is filed (`_on_message`), a failure or death raises."""
        waiting = late()
        if not waiting:
            return
        res = self._res
        deadline = None if timeout is None else time.monotonic() + timeout
        conns = {c: r for r, c in enumerate(res.conns)}
        sentinels = {p.sentinel: r for r, p in enumerate(res.procs)}
        objs = list(conns) + list(sentinels)
        watch = res.watch
        while waiting:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if watch is not None:  # the other nodes: failure reports, heartbeats
                report = watch.poll()
                if report is not None:
                    self._fail(node=report)
                left = watch.due() if left is None else min(left, watch.due())
            ready = mp_wait(objs, timeout=left)
            if not ready and (deadline is None or time.monotonic() < deadline):
                continue
            if not ready:
                if watch is not None and watch.missing_report() is not None:
                    self._fail(node=watch.missing_report())
                self._fail(f"timed out after {timeout:g}s waiting for rank(s) {waiting} to finish {what} "
                           f"(set NANOVLLM_TP_STEP_TIMEOUT / NANOVLLM_TP_INIT_TIMEOUT to wait longer)")
            for obj in ready:  # the pipes first: a worker's last words come before its death
                if obj in conns:
                    r = conns[obj]
                    self._on_message(r, self._recv(r))
            for obj in ready:
                if obj in sentinels:
                    r = sentinels[obj]
                    conn = res.conns[r]
                    while conn.poll(0):
                        try:
                            msg = conn.recv()
                        except (EOFError, OSError):
                            break
                        self._on_message(r, msg)
                    self._fail(dead=r)
            waiting = late()

    def _on_message(self, r: int, msg) -> None:
        if isinstance(msg, Failed):
            self._fail(failed=msg)
        if isinstance(msg, Done) and msg.rank == r and msg.step == self._acked[r] + 1 and msg.step <= self._sent:
            self._acked[r] = msg.step
            if r == 0:
                handle = self._handles.pop(msg.step, None)
                if handle is not None:  # else: nobody holds the step any more (e.g. after Ctrl-C)
                    handle._result = msg.result
            return
        if isinstance(msg, Ready) and self._ready is not None and msg.rank == r and r not in self._ready:
            self._ready[r] = msg
            return
        if isinstance(msg, Done):
            what = f"Done for step {msg.step} (rank {msg.rank}) while it owed step {self._acked[r] + 1}"
        else:
            what = type(msg).__name__
        self._fail(f"rank {r} sent an unexpected {what} (protocol error)")

    def _recv(self, r: int):
        try:
            return self._res.conns[r].recv()
        except (EOFError, OSError):
            self._fail(dead=r)

    def _exit_of(self, r: int) -> str:
        self._res.procs[r].join(1.0)  # its pipe closed or its sentinel fired: reap it to learn the exit status
        return describe_exit(self._res.procs[r].exitcode)

    def _fail(self, reason: str | None = None, *, failed: Failed | None = None, dead: int | None = None,
              node=None):
        """Listen briefly for the other ranks' reports, kill every worker, raise.

        What the driver saw first (a rank's `failed` message, a `dead` rank, or a `reason` of its own) need not
        be the cause: when a rank dies, the others' collectives fail too, and their Failed ("connection reset
        by peer") can reach the driver before the dead rank's sentinel. So the headline is chosen once every
        rank has had its say (or FAILURE_GRACE_S is up): a rank that died without a word (killed, OOM, a
        crash), else the first rank that raised an error of its own, else the first report. A reason of the
        driver's own (a timeout, a protocol error) stays the headline.

        With several nodes the other nodes are heard too (`NodeWatch.blame`: their reports, or a node whose
        heartbeat stopped): `node`, a NodeReport the watch raised, or a node that died or failed of its own is
        the headline after a local rank that died, before a local rank's error."""
        res = self._res
        res.graceful = False
        reports: dict[int, Failed] = {failed.rank: failed} if failed else {}  # in the order they came
        silent: list[int] = [] if dead is None else [dead]                   # died without a Failed
        deadline = time.monotonic() + FAILURE_GRACE_S
        while time.monotonic() < deadline:
            live = {res.conns[r]: r for r in range(self.size) if r not in reports and r not in silent}
            if not live:
                break
            for obj in mp_wait(list(live), timeout=max(0.0, deadline - time.monotonic())):
                r = live[obj]
                try:
                    msg = obj.recv()
                except (EOFError, OSError):
                    silent.append(r)
                    continue
                if isinstance(msg, Failed):
                    reports[r] = msg
        deaths = {r: self._exit_of(r) for r in silent}
        remote = res.watch.blame(node) if res.watch is not None else {}  # the other nodes' say
        own = [m for m in remote.values() if not m.peer_error]  # a node that died or failed of its own
        cause = remote_cause = None  # the Failed / NodeReport the headline reports
        if reason is not None:
            headline = reason
        elif node is not None or (not deaths and (own or not reports)):
            remote_cause = node or (own or list(remote.values()))[0]
            headline = remote_cause.headline
        elif deaths:
            r = silent[0]
            headline = f"tensor-parallel worker rank {r} (pid {self._pids[r]}) died unexpectedly ({deaths.pop(r)})"
        else:
            cause = next((m for m in reports.values() if not blames_a_peer(m)), next(iter(reports.values())))
            headline = (f"tensor-parallel worker rank {cause.rank} (pid {self._pids[cause.rank]}) raised "
                        f"{cause.exc_type}: {cause.message}")
        lines = [headline]
        lines += [f"  rank {r} also died ({how})" for r, how in deaths.items()]
        lines += [f"  rank {r} also raised {m.exc_type}: {m.message}"
                  for r, m in sorted(reports.items()) if m is not cause]
        lines += [f"  node {k}: {m.headline}" for k, m in sorted(remote.items()) if m.headline != headline]
        if cause is not None:
            lines.append(f"--- traceback of rank {cause.rank} ---\n{cause.traceback.rstrip()}")
        elif remote_cause is not None and remote_cause.traceback:
            lines.append(f"--- traceback on node {remote_cause.node} ---\n{remote_cause.traceback.rstrip()}")
        message = "\n".join(lines)
        self._failure = headline
        if res.watch is not None:
            res.watch.abort(headline)
        self.shutdown()
        if remote_cause is not None and remote_cause.config_error:
            raise ValueError(message)
        if cause is not None and cause.during_init and cause.exc_type in ("ValueError", "TypeError"):
            # a configuration problem found while the ranks start (e.g. the KV cache is too small)
            raise (ValueError if cause.exc_type == "ValueError" else TypeError)(message)
        raise RuntimeError(message)
