"""What the API process keeps of the requests it sent to the engine core: a `RequestState` per choice (one sample
of an engine request: its tokens so far, its finish), a `RequestGroup` per HTTP request (its prompts x n choices;
one engine request per prompt, with n samples), which its handler reads and the EngineCoreClient fills on the
event loop, one wake-up per step at most."""
from __future__ import annotations

import asyncio
import time


class EngineDeadError(RuntimeError):
    """The engine core is gone (exited, stalled, or shut down): nothing can be served any more."""


class RequestFailedError(RuntimeError):
    """The engine core rejected a request (status 400) or failed while running it (status 500)."""

    def __init__(self, message: str, status: int = 500):
        super().__init__(message)
        self.status = status


class RequestState:
    """One sample of an engine request (one choice of an HTTP request) as the API process sees it: its tokens so
    far."""

    __slots__ = ("request_id", "sample", "group", "token_ids", "logprobs", "finish_reason", "stop_reason", "text_len",
                 "first_token_time", "dirty")

    def __init__(self, request_id: str, sample: int, group: RequestGroup):
        self.request_id = request_id
        self.sample = sample                 # which of the engine request's n samples
        self.group = group
        self.token_ids: list[int] = []
        self.logprobs: list[tuple] = []      # per token (token id, logprob, top ids, top logprobs), if asked for
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.text_len: int | None = None     # stop string: the output text is cut to this length
        self.first_token_time: float | None = None
        self.dirty = False                   # queued in group._changed

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class RequestGroup:
    """The engine requests of one HTTP request (prompts x n choices). Its handler calls `changed()` until
    `finished`, and `close()` when it is done (a finally: a disconnected client's requests are aborted)."""

    def __init__(self, client, requests: list[tuple[str, int]], stream: bool):
        """`client`: the EngineCoreClient (`_release(group)` aborts what still runs). `requests`: (engine request
        id, its number of samples)."""
        self.client = client
        self.stream = stream
        self.request_ids = [rid for rid, _ in requests]
        self.states = [RequestState(rid, j, self) for rid, n in requests for j in range(n)]
        self.unfinished = len(self.states)
        self.error: BaseException | None = None
        self.closed = False
        self.submit_time = time.monotonic()
        self._changed: list[RequestState] = []
        self._event = asyncio.Event()

    @property
    def finished(self) -> bool:
        return self.unfinished == 0

    async def changed(self) -> list[RequestState]:
        """Wait for news: the states that got tokens or finished since the last call ([] once all finished).
        Raises the group's error (RequestFailedError, EngineDeadError) if it failed."""
        while not self._changed and self.error is None and self.unfinished:
            await self._event.wait()
            self._event.clear()
        if self.error is not None:
            raise self.error
        out, self._changed = self._changed, []
        for st in out:
            st.dirty = False
        return out

    def close(self) -> None:
        """Abort whatever of the group still runs; idempotent."""
        if not self.closed:
            self.closed = True
            self.client._release(self)

    # --- event loop, from the client --------------------------------------------------------------------
    def _touch(self, st: RequestState) -> None:
        if not st.dirty:
            st.dirty = True
            self._changed.append(st)
        if not self._event.is_set():
            self._event.set()

    def fail(self, exc: BaseException) -> None:
        """End the group's reading with `exc` (raised by changed()); close() still aborts its requests."""
        if self.error is None:
            self.error = exc
        self._event.set()
