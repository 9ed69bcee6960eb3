"""An asynchronous front for the single-threaded LLMEngine: online continuous batching.

One background thread owns the engine and is the only thread that calls into it (add, abort, step).
Other threads talk to it through a thread-safe inbox: `submit()` queues requests (they join the running
batch at the next step), `abort()` drops them (their KV blocks are freed at once). Each submitted group of
requests gets an asyncio.Queue on the caller's event loop, fed from the engine thread with
`loop.call_soon_threadsafe`; a `ResultStream` reads it as an async iterator.

When idle the loop blocks on an Event rather than spinning. If a step raises, the requests in flight are
failed with `RequestFailedError` (and aborted, freeing their blocks) and the loop carries on.
"""
from __future__ import annotations

import asyncio
import collections
import copy
import logging
import threading
import time
from dataclasses import dataclass

from nanovllm.server.metrics import ServerMetrics

logger = logging.getLogger(__name__)


class RequestFailedError(RuntimeError):
    """The engine raised while this request was in flight."""


class EngineDeadError(RuntimeError):
    """The engine loop is not running (shut down, or it crashed)."""


class RequestAbortedError(RuntimeError):
    """The stream was closed (client gone) while someone was still reading it."""


_CLOSED = object()   # queued by ResultStream.close() to wake a reader


@dataclass
class _Sink:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    submit_time: float   # time.monotonic() when the HTTP side submitted the request


def _deliver(items: list) -> None:
    """Runs on the caller's event loop: hand each item to its queue."""
    for q, item in items:
        q.put_nowait(item)


class ResultStream:
    """Outputs (RequestOutput) of a group of requests, in the order the engine made them.

    Iteration ends once every request of the group has finished. `close()` aborts whatever is still
    running; use the stream as an `async with` block (or call close in a finally) so that a cancelled or
    disconnected caller frees its KV blocks at once."""

    def __init__(self, engine: AsyncEngine, request_ids: list[str], queue: asyncio.Queue,
                 samples: list[int] | None = None):
        self._engine = engine
        self._queue = queue
        self.request_ids = list(request_ids)
        # request id -> its samples (SamplingParams.n) not finished yet
        self._left = dict(zip(request_ids, samples or [1] * len(request_ids)))
        self.aborted = False

    @property
    def finished(self) -> bool:
        return not self._left

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.aborted:
            raise RequestAbortedError("the request was aborted")
        if not self._left:
            raise StopAsyncIteration
        try:
            item = await self._queue.get()
        except BaseException:
            self.close()
            raise
        if item is _CLOSED:
            raise RequestAbortedError("the request was aborted")
        if isinstance(item, BaseException):
            self._left.clear()   # the engine side already dropped these requests
            raise item
        if item.finished and item.request_id in self._left:
            self._left[item.request_id] -= 1
            if not self._left[item.request_id]:
                del self._left[item.request_id]
        return item

    def close(self) -> None:
        """Abort whatever is still running (call on the event loop that reads the stream)."""
        if self._left:
            self._engine.abort(list(self._left))
            self._left.clear()
            self.aborted = True
            self._queue.put_nowait(_CLOSED)

    def __del__(self):
        # safety net for a stream dropped without close(): abort only (thread-safe), no queue traffic
        left = getattr(self, "_left", None)
        if left:
            self._engine.abort(list(left))

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        self.close()


class AsyncEngine:
    def __init__(self, engine, *, start: bool = True):
        self.engine = engine
        # The HTTP side tokenizes with its own copy so that it never shares the tokenizer object with the
        # engine thread (the engine detokenizes while requests are being validated).
        try:
            self.tokenizer = copy.deepcopy(engine.tokenizer)
        except Exception:  # noqa: BLE001 - fall back to sharing (encode/decode only read it)
            self.tokenizer = engine.tokenizer
        self.max_model_len = engine.config.max_model_len
        self.vocab_size = engine.vocab_size
        self.metrics = ServerMetrics()
        self._inbox: collections.deque = collections.deque()
        self._inbox_lock = threading.Lock()     # orders submit() against the loop's final drain
        self._closed = False                    # the loop has exited: no more requests are taken
        self._wake = threading.Event()
        self._sinks: dict[str, _Sink] = {}     # engine thread only: live request id -> its sink
        self._samples_left: dict[str, int] = {}  # engine thread only: live request id -> samples not finished
        self._stop = False
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._busy = False
        self.stats = self._snapshot()
        if start:
            self.start()

    # --- lifecycle ---------------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="nanovllm-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the loop; requests still in flight fail with EngineDeadError. The engine is left open."""
        self._stop = True
        self._wake.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stop

    @property
    def error(self) -> BaseException | None:
        return self._error

    def is_idle(self) -> bool:
        """No request queued, in flight or being processed (a snapshot; for tests and health checks)."""
        return not self._inbox and not self._busy and not self.stats["num_running"] and \
            not self.stats["num_waiting"] and not self.stats["num_live"]

    # --- caller side (any thread with a running event loop) ------------------------------------------
    def submit(self, requests: list[tuple[str, object]], *, stream: bool = True) -> ResultStream:
        """Queue (request_id, ValidRequest) pairs; they join the batch at the next step.

        `stream=True` yields an output every step (text deltas), else one per request when it finishes."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        sink = _Sink(loop, queue, time.monotonic())
        with self._inbox_lock:
            if self._closed or not self.is_running:
                raise EngineDeadError("the engine loop is not running" +
                                      (f" (it failed: {self._error!r})" if self._error else ""))
            self._inbox.append(("add", list(requests), stream, sink))
        self._wake.set()
        return ResultStream(self, [rid for rid, _ in requests], queue,
                            [getattr(getattr(v, "params", None), "n", 1) for _, v in requests])

    def abort(self, request_ids: list[str]) -> None:
        """Drop requests (from any thread); their KV blocks are freed before the next step."""
        if request_ids:
            self._inbox.append(("abort", list(request_ids)))
            self._wake.set()

    # --- engine thread -----------------------------------------------------------------------------
    def _run(self) -> None:
        dev = getattr(self.engine.config, "device", None)
        if dev is not None and getattr(dev, "type", None) == "cuda":
            import torch  # the current CUDA device is per thread
            runner_dev = getattr(self.engine.runner, "device", dev)
            if getattr(runner_dev, "index", None) is not None:
                torch.cuda.set_device(runner_dev)
        try:
            while True:
                self._wake.clear()
                self._busy = True
                self._drain_inbox()
                if self._stop:
                    break
                if not self.engine.has_unfinished_requests():
                    self.stats = self._snapshot()
                    self._busy = False
                    self._wake.wait()
                    continue
                try:
                    outputs, _, _ = self.engine.step()
                except Exception as e:  # noqa: BLE001 - fail the requests in flight, keep serving
                    logger.exception("engine step failed; failing the %d requests in flight", len(self._sinks))
                    self._fail_all(RequestFailedError(f"the engine failed while running this request: {e}"))
                else:
                    self._dispatch(outputs)
                self.stats = self._snapshot()
        except BaseException as e:  # noqa: BLE001 - the loop itself broke: nothing can be served any more
            logger.exception("engine loop crashed")
            self._error = e
        finally:
            self._stop = True
            self._busy = False
            with self._inbox_lock:
                self._closed = True
            self._drain_inbox(reject=True)
            self._fail_all(EngineDeadError("the engine loop stopped"))
            self.stats = self._snapshot()

    def _drain_inbox(self, reject: bool = False) -> None:
        while self._inbox:
            cmd = self._inbox.popleft()
            if cmd[0] == "add":
                _, reqs, stream, sink = cmd
                if reject:
                    self._send({sink.loop: [(sink.queue, EngineDeadError("the engine loop stopped"))]})
                    continue
                self._add(reqs, stream, sink)
            else:
                n = 0
                for rid in cmd[1]:
                    if self._sinks.pop(rid, None) is not None:
                        self._safe_abort(rid)
                        n += self._samples_left.pop(rid, 1)
                if n:
                    self.metrics.record_aborted(n)

    def _add(self, reqs, stream: bool, sink: _Sink) -> None:
        added = []
        for rid, valid in reqs:
            try:
                self.engine.add_request(rid, valid, stream=stream)
            except Exception as e:  # noqa: BLE001 - e.g. a duplicate id: the whole group fails
                for r in added:
                    self._sinks.pop(r, None)
                    self._samples_left.pop(r, None)
                    self._safe_abort(r)
                self._send({sink.loop: [(sink.queue, e)]})
                return
            added.append(rid)
            self._sinks[rid] = sink
            self._samples_left[rid] = getattr(getattr(valid, "params", None), "n", 1)

    def _safe_abort(self, rid: str) -> None:
        try:
            self.engine.abort_request(rid)
        except Exception:  # noqa: BLE001
            logger.exception("aborting request %s failed", rid)

    def _dispatch(self, outputs) -> None:
        by_loop: dict = {}
        for out in outputs:
            sink = self._sinks.get(out.request_id)
            if sink is None:
                continue   # aborted meanwhile
            if out.finished:
                self._samples_left[out.request_id] -= 1
                if not self._samples_left[out.request_id]:
                    del self._sinks[out.request_id], self._samples_left[out.request_id]
                self._record(out, sink)
            by_loop.setdefault(sink.loop, []).append((sink.queue, out))
        self._send(by_loop)

    def _record(self, out, sink: _Sink) -> None:
        m = out.metrics or {}
        first, now = m.get("first_token_time"), m.get("now")
        ttft = first - sink.submit_time if first is not None else None
        n = len(out.token_ids)
        tpot = (now - first) / (n - 1) if first is not None and now is not None and n > 1 else None
        e2e = now - sink.submit_time if now is not None else None
        self.metrics.record_finished(out.finish_reason, ttft, tpot, e2e)

    def _fail_all(self, exc: BaseException) -> None:
        by_loop: dict = {}
        queues = set()
        for rid, sink in list(self._sinks.items()):
            self._safe_abort(rid)
            if id(sink.queue) not in queues:     # one exception per group is enough
                queues.add(id(sink.queue))
                by_loop.setdefault(sink.loop, []).append((sink.queue, exc))
        for rid in self._sinks:
            for _ in range(self._samples_left.get(rid, 1)):
                self.metrics.record_finished("error", None, None, None)
        self._sinks.clear()
        self._samples_left.clear()
        self._send(by_loop)

    def _send(self, by_loop: dict) -> None:
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:   # that event loop is closed: nobody is listening any more
                dead = {id(q) for q, _ in items}
                for rid, sink in list(self._sinks.items()):
                    if id(sink.queue) in dead:
                        del self._sinks[rid]
                        self._samples_left.pop(rid, None)
                        self._safe_abort(rid)

    def _snapshot(self) -> dict:
        e = self.engine
        bm = e.block_manager
        return {
            "num_running": e.num_running,
            "num_waiting": e.num_waiting,
            "num_live": len(self._sinks),
            "kv_usage": bm.usage,
            "num_free_blocks": bm.num_free_blocks,
            "num_blocks": bm.num_blocks,
            "prompt_tokens": e.num_prompt_tokens,
            "generation_tokens": e.num_generation_tokens,
            "num_preemptions": getattr(e.scheduler, "num_preemptions", 0),
            "prefix_queries": getattr(bm, "prefix_queries", 0),
            "prefix_hits": getattr(bm, "prefix_hits", 0),
            "spec": getattr(e, "spec_metrics", None),  # speculative decoding's counters, None without it
        }
