"""The API process's side of the engine core: it starts the engine-core process, sends it requests and aborts,
and hands each step's outputs to the HTTP handlers waiting for them.

    event loop (HTTP handlers)    submit() / abort() ----> sender thread ----pipe----> engine-core process
                                  _on_step() <- call_soon_threadsafe <- reader thread <----pipe----

Neither pipe can stall the event loop: the sender thread does the writing (and the encoding), the reader thread
the reading; the reader does nothing else, so the engine core is never kept waiting by a busy event loop or a
slow client. Each step arrives as one StepOutputs and costs one hop to the loop; `_on_step` appends each row's
token to its `RequestState` (a sample of an engine request) and wakes the row's `RequestGroup` (the engine
requests of one HTTP request) once per step at most: a handler that falls behind (its client reads slowly) finds
several steps' tokens waiting and sends them as one chunk. A group that is not streamed is woken only when its
requests finish.

The reader thread is also the watchdog. The engine core sends a message every step while it has work, so if
requests are in flight and nothing has come for `step_timeout` seconds, a step has stalled (a tensor-parallel
worker stopped or hung, the device wedged): the engine-core process group is killed, the requests in flight fail
with EngineDeadError and the death callbacks run (the server exits non-zero, for a supervisor to restart it).
The same happens if the core process exits or reports EngineDead.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing as mp
import os
import queue
import signal
import threading
import time
from multiprocessing.connection import wait as mp_wait

from nanovllm.engine.core_process import make_engine_core, run_engine_core
from nanovllm.engine.core_protocol import (
    CORE_MESSAGES,
    Abort,
    AddRequest,
    EngineDead,
    EngineStats,
    ProtocolError,
    Ready,
    RequestsFailed,
    Shutdown,
    StartupFailed,
    StepOutputs,
    chunks,
    params_to_wire,
    recv,
    send,
)
from nanovllm.server.metrics import ServerMetrics
from nanovllm.server.request_group import EngineDeadError, RequestFailedError, RequestGroup, RequestState
from nanovllm.utils.processes import describe_exit

__all__ = ["EngineCoreClient", "EngineDeadError", "RequestFailedError", "RequestGroup", "RequestState"]

logger = logging.getLogger(__name__)

SHUTDOWN_JOIN_S = 15.0    # a clean shutdown waits this long for the engine core (and its workers) to exit


class EngineCoreClient:
    def __init__(self, args, *, step_timeout: float | None = 60.0, make_core=make_engine_core,
                 metrics: ServerMetrics | None = None, env: dict[str, str] | None = None, label: str | None = None):
        """`args`: what `make_core(args)` builds the engine core from in its process (EngineArgs by default).
        `step_timeout`: seconds without a step's outputs, while requests are in flight, that count as a stall
        (None: no watchdog). The rest is for one core of several (server/dp_client.py): `metrics` to record into
        (shared by the cores; default a new one), `env` for the core's process (CUDA_VISIBLE_DEVICES), `label`
        put before the reason of its death ("engine core 1 of 2")."""
        if step_timeout is not None and not step_timeout > 0:
            raise ValueError(f"step_timeout must be > 0 seconds (or None), got {step_timeout!r}")
        self.args = args
        self.step_timeout = step_timeout
        self.make_core = make_core
        self.env = dict(env) if env else None
        self.label = label
        self.info: Ready | None = None
        self.stats = EngineStats()
        self.metrics = metrics if metrics is not None else ServerMetrics()
        self._proc = None
        self._to_core = None          # write end (sender thread)
        self._from_core = None        # read end (reader thread)
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._threads: list[threading.Thread] = []
        # event loop only: engine request id -> the states of its samples, until every one has finished
        self._live: dict[str, list[RequestState]] = {}
        self._groups: set[RequestGroup] = set()      # event loop only: groups with requests in the core
        self.num_live = 0                            # len(_live), read by the watchdog
        self._busy_since = 0.0                       # when num_live last went from 0 to 1
        self._last_heard = 0.0                       # when the core last sent anything
        self._dead: str | None = None
        self._dead_lock = threading.Lock()
        self._death_callbacks: list = []
        self._closing = False

    # --- lifecycle ---------------------------------------------------------------------------------
    def start(self, timeout: float | None = None) -> Ready:
        """Start the engine-core process and wait until it is ready (model loaded, KV cache sized). Raises the
        core's start-up error: ValueError/TypeError for a bad configuration, else RuntimeError."""
        self.launch()
        return self.wait_ready(timeout)

    def launch(self) -> None:
        """Start the engine-core process (`wait_ready` waits for it: several cores load their models at once)."""
        if self._proc is not None:
            raise RuntimeError("the engine core was started already")
        ctx = mp.get_context("spawn")
        core_in, self._to_core = ctx.Pipe(duplex=False)
        self._from_core, core_out = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(target=run_engine_core, name="nanovllm-engine-core",
                                 args=(self.args, core_in, core_out, self.make_core, os.getpid(), self.env))
        self._proc.start()
        core_in.close()
        core_out.close()

    def wait_ready(self, timeout: float | None = None) -> Ready:
        """Wait until the launched core is ready; its start-up error otherwise (see `start`)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready = mp_wait([self._from_core, self._proc.sentinel], timeout=left)
            if not ready:
                self._kill()
                raise RuntimeError(f"the engine core did not start within {timeout:g}s")
            if self._from_core in ready:
                try:
                    msg = recv(self._from_core, CORE_MESSAGES)
                except (EOFError, OSError):
                    msg = None
                if isinstance(msg, Ready):
                    self.info = msg
                    self.stats = EngineStats(num_free_blocks=msg.num_kvcache_blocks, num_blocks=msg.num_kvcache_blocks)
                    return msg
                self._kill()
                if isinstance(msg, StartupFailed):
                    if msg.exc_type in ("ValueError", "TypeError"):
                        raise (ValueError if msg.exc_type == "ValueError" else TypeError)(msg.message)
                    raise RuntimeError(f"the engine core failed to start: {msg.exc_type}: {msg.message}\n"
                                       f"{msg.traceback}")
                raise RuntimeError(f"the engine core exited during start-up ({self._exit_status()})")
            self._proc.join(1.0)
            raise RuntimeError(f"the engine core exited during start-up ({self._exit_status()})")

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start serving on `loop` (the server's event loop): the sender and reader threads."""
        if self._loop is not None:
            raise RuntimeError("the engine-core client is already attached to an event loop")
        if self.info is None:
            raise RuntimeError("start() the engine-core client before attaching it")
        self._loop = loop
        self._last_heard = time.monotonic()
        for target, name in ((self._send_loop, "nanovllm-core-sender"), (self._read_loop, "nanovllm-core-reader")):
            t = threading.Thread(target=target, name=name, daemon=True)
            t.start()
            self._threads.append(t)

    def add_death_callback(self, fn) -> None:
        """`fn(reason)` runs on the event loop once the engine core is dead (not after a clean close())."""
        self._death_callbacks.append(fn)

    @property
    def is_alive(self) -> bool:
        return self._dead is None and self._proc is not None and self._proc.is_alive()

    @property
    def dead_reason(self) -> str | None:
        return self._dead

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    @property
    def load(self) -> int:
        """Samples (sequences) this client sent to the core that have not finished: what the data-parallel
        router balances (event loop)."""
        return sum(g.unfinished for g in self._groups)

    def holds(self, request_id: str) -> bool:
        """Whether the engine request is in flight on this core (event loop)."""
        return request_id in self._live

    def render_metrics(self, model_name: str) -> str:
        """/metrics: this client's request metrics and the core's latest stats."""
        return self.metrics.render(self.stats, model_name)

    def close(self, timeout: float = SHUTDOWN_JOIN_S) -> None:
        """Shut the engine core down (it shuts its executor down) and wait for it; kill it after `timeout`."""
        self._closing = True
        with self._dead_lock:
            if self._dead is None:
                self._dead = "the engine core was shut down"
        if self._proc is None:
            return
        if self.info is None:                # still starting up: nothing to shut down cleanly
            self._kill()
            return
        self._outbox.put(Shutdown())
        self._outbox.put(None)               # the sender thread's end
        if not self._threads:                # never attached: send it here
            try:
                send(self._to_core, Shutdown())
            except OSError:
                pass
        self._proc.join(timeout)
        if self._proc.is_alive():
            self._kill()
        for t in self._threads:
            t.join(2.0)

    # --- requests (event loop) ---------------------------------------------------------------------
    def submit(self, prompts: list[tuple[list[int], list[tuple[str, object]]]], *, stream: bool) -> RequestGroup:
        """Queue engine requests: for each prompt (token ids), its (request id, SamplingParams) requests, each
        with its `n` samples. They join the batch at the engine's next step. `stream`: wake the group every step
        (else once they finish)."""
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        group = RequestGroup(self, [(rid, p.n) for _, reqs in prompts for rid, p in reqs], stream)
        if len(set(group.request_ids)) != len(group.request_ids) or any(r in self._live for r in group.request_ids):
            raise ValueError(f"a request id of {group.request_ids} is already in use")
        if not self._live:
            self._busy_since = time.monotonic()
        for st in group.states:
            self._live.setdefault(st.request_id, []).append(st)
        self.num_live = len(self._live)
        self._groups.add(group)
        for ids, choices in prompts:
            self._outbox.put(AddRequest(ids, [rid for rid, _ in choices], [params_to_wire(p) for _, p in choices]))
        return group

    def abort(self, request_ids: list[str]) -> None:
        for part in chunks(request_ids):
            self._outbox.put(Abort(part))

    def fail_all(self, exc: BaseException) -> int:
        """End every group still running with `exc` (server shutdown), aborting its requests; how many ended."""
        groups = list(self._groups)
        for g in groups:
            self._drop(g)
            g.fail(exc)
        return len(groups)

    def _release(self, group: RequestGroup) -> None:
        """A handler is done with its group: abort what still runs (the client went away)."""
        ids = set(self._drop(group))
        if ids:
            self.metrics.record_aborted(sum(not st.finished and st.request_id in ids for st in group.states))

    def _drop(self, group: RequestGroup) -> list[str]:
        ids = [rid for rid in group.request_ids if self._live.pop(rid, None) is not None]
        self.num_live = len(self._live)
        self._groups.discard(group)
        if ids and self._dead is None:
            self.abort(ids)
        return ids

    # --- engine-core messages (event loop) ---------------------------------------------------------
    def _on_step(self, msg: StepOutputs) -> None:
        now = time.monotonic()
        live = self._live
        ids, samples = msg.request_ids, msg.samples
        for rid, tok, j in zip(ids, msg.token_ids, samples or itertools.repeat(0)):
            sts = live.get(rid)
            if sts is None:
                continue           # aborted meanwhile
            st = sts[j]
            st.token_ids.append(tok)
            if st.first_token_time is None:
                st.first_token_time = now
            if st.group.stream:
                st.group._touch(st)
        for lp in msg.logprobs:
            sts = live.get(ids[lp.index])
            if sts is not None:
                sts[samples[lp.index] if samples else 0].logprobs.append(
                    (msg.token_ids[lp.index], lp.logprob, lp.top_ids, lp.top_logprobs))
        for f in msg.finished:
            rid = ids[f.index]
            sts = live.get(rid)
            if sts is None:
                continue
            st = sts[samples[f.index] if samples else 0]
            if st.finished:
                continue
            st.finish_reason, st.stop_reason, st.text_len = f.finish_reason, f.stop_reason, f.text_len
            if all(s.finished for s in sts):
                del live[rid]
            g = st.group
            g.unfinished -= 1
            g._touch(st)
            if not g.unfinished:
                self._groups.discard(g)
            self._record(st, now)
        self.num_live = len(live)
        self.stats = msg.stats

    def _record(self, st: RequestState, now: float) -> None:
        start = st.group.submit_time
        first = st.first_token_time
        n = len(st.token_ids)
        tpot = (now - first) / (n - 1) if first is not None and n > 1 else None
        self.metrics.record_finished(st.finish_reason, None if first is None else first - start, tpot, now - start)

    def _on_failed(self, msg: RequestsFailed) -> None:
        exc = RequestFailedError(msg.message, msg.status)
        for rid in msg.request_ids:
            sts = self._live.pop(rid, None)
            if sts is None:
                continue
            g = sts[0].group
            for st in sts:
                if not st.finished:
                    g.unfinished -= 1
                    self.metrics.record_finished("error", None, None, None)
            g.fail(exc)
            if not g.unfinished:
                self._groups.discard(g)
        self.num_live = len(self._live)

    def _on_dead(self, reason: str) -> None:
        exc = EngineDeadError(reason)
        for g in list(self._groups):
            g.fail(exc)
        self._groups.clear()
        self._live.clear()
        self.num_live = 0
        for fn in self._death_callbacks:
            try:
                fn(reason)
            except Exception:  # noqa: BLE001
                logger.exception("engine death callback failed")

    # --- threads -----------------------------------------------------------------------------------
    def _send_loop(self) -> None:
        while True:
            msg = self._outbox.get()
            if msg is None:
                return
            try:
                send(self._to_core, msg)
            except (OSError, ValueError) as e:   # the core is gone (the reader reports it), or a message too large
                if isinstance(e, ValueError):
                    logger.error("could not send a %s to the engine core: %s", type(msg).__name__, e)
                    if isinstance(msg, AddRequest):
                        self._post(self._on_failed, RequestsFailed(msg.request_ids, str(e), 400))
                    continue
                return

    def _read_loop(self) -> None:
        conn, sentinel = self._from_core, self._proc.sentinel
        while True:
            ready = mp_wait([conn, sentinel], timeout=0.25)
            if conn in ready:
                try:
                    msg = recv(conn, CORE_MESSAGES)
                except (EOFError, OSError):
                    self._die(f"the engine core process exited ({self._exit_status()})")
                    return
                except ProtocolError as e:
                    self._die(f"the engine core sent a bad message: {e}")
                    return
                self._last_heard = time.monotonic()
                if isinstance(msg, StepOutputs):
                    self._post(self._on_step, msg)
                elif isinstance(msg, RequestsFailed):
                    self._post(self._on_failed, msg)
                elif isinstance(msg, EngineDead):
                    self._die(msg.message)
                    return
                continue
            if sentinel in ready:
                self._die(f"the engine core process exited ({self._exit_status()})")
                return
            timeout = self.step_timeout
            if timeout is not None and self.num_live and self._dead is None:
                quiet = time.monotonic() - max(self._last_heard, self._busy_since)
                if quiet > timeout:
                    self._die(f"the engine made no progress for {quiet:.1f}s with {self.num_live} requests in "
                              f"flight (a step stalled; the watchdog's limit is {timeout:g}s): engine core stopped")
                    return

    def _post(self, fn, arg) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, arg)
        except RuntimeError:   # the event loop is closed: nobody is listening any more
            pass

    def _die(self, reason: str) -> None:
        """The engine core is gone for good (any thread): kill what is left of it, fail everything in flight."""
        with self._dead_lock:
            if self._dead is not None:
                return
            if self.label:
                reason = f"{self.label}: {reason}"
            self._dead = reason
        if not self._closing:
            logger.error("%s", reason)
        self._kill()
        self._outbox.put(None)
        self._post(self._on_dead, reason)

    def _kill(self) -> None:
        """SIGKILL the engine core's process group (the core and its tensor-parallel workers), if still there."""
        proc = self._proc
        if proc is None:
            return
        try:
            os.killpg(proc.pid, signal.SIGKILL)   # its own group (core_process.py): the workers too
        except (ProcessLookupError, PermissionError):
            if proc.is_alive():
                proc.kill()
        proc.join(5.0)

    def _exit_status(self) -> str:
        proc = self._proc
        proc.join(1.0)
        return describe_exit(proc.exitcode)
