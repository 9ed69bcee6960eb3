"""The engine-core process: a thin loop around an EngineCore, between two pipes to the API server process.

    loop:  take every message waiting (block only while idle) -> one step -> send its StepOutputs

Adds and aborts are applied between steps, so a request joins the running batch at the next step. The loop
never waits for the API process except to hand it a message: the API process reads its pipe in a thread of its
own that does nothing else, so a slow HTTP client (buffered per stream over there) cannot hold up a step.

Failures: a step that raises fails the requests in flight (RequestsFailed, status 500) and the loop carries on;
if the executor is dead (a tensor-parallel worker died), the core sends EngineDead and exits 1. A stalled step
(a worker stopped or hung) is the API process's to see: it watches for step outputs (`server/core_client.py`).

The process puts itself in a process group of its own, which its tensor-parallel workers join when spawned: a
terminal's Ctrl-C reaches only the API process (which drains and then shuts the core down), and the API process
can stop the core and all its workers at once (killpg) when the core stalls.
"""
from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
import traceback

from nanovllm.engine.core_protocol import (
    API_MESSAGES,
    Abort,
    AddRequest,
    EngineDead,
    ProtocolError,
    Shutdown,
    StartupFailed,
    recv,
    send,
)

logger = logging.getLogger(__name__)


def make_engine_core(args):
    """The default `make_core`: an EngineCore over an LLMEngine built from EngineArgs (imported here, in the
    engine-core process, so that the API process never loads the model code)."""
    from nanovllm.engine.core import EngineCore
    return EngineCore.from_args(args)


def _watch_parent(parent_pid: int) -> None:
    """Exit if the API process goes away, even in the middle of a step."""
    def loop():
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os._exit(3)
    threading.Thread(target=loop, name="nanovllm-core-parent-watch", daemon=True).start()


def run_engine_core(args, inbox, outbox, make_core, parent_pid: int, env: dict[str, str] | None = None) -> None:
    """Entry point of the engine-core process (a multiprocessing spawn target).

    `inbox` / `outbox`: the read end of the API process's pipe and the write end of ours; `make_core(args)` builds
    the core (EngineCore.from_args, or a stand-in without a model for benchmarks and tests). `env`: environment
    variables set before anything else runs, so before CUDA is initialized (a data-parallel core's
    CUDA_VISIBLE_DEVICES; its tensor-parallel workers inherit them)."""
    if env:
        os.environ.update(env)
    try:
        os.setpgid(0, 0)
    except OSError:   # already a group leader
        pass
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s [engine core] %(name)s: %(message)s")
    _watch_parent(parent_pid)
    try:
        core = make_core(args)
    except BaseException as e:  # noqa: BLE001 - reported to the API process, which prints it
        send(outbox, StartupFailed(type(e).__name__, str(e), traceback.format_exc()))
        sys.exit(1)
    code = 0
    try:
        send(outbox, core.ready(os.getpid()))
        code = CoreLoop(core, inbox, outbox).run()
    except (EOFError, BrokenPipeError, ConnectionResetError):
        logger.info("the API process went away: shutting down")
    except BaseException:
        logger.exception("the engine core failed")
        code = 1
    finally:
        core.shutdown()
    # the engine is shut down: skip the interpreter's teardown (a second with torch loaded)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class CoreLoop:
    def __init__(self, core, inbox, outbox):
        self.core = core
        self.inbox = inbox
        self.outbox = outbox
        self.stopping = False

    def run(self) -> int:
        """Serve until Shutdown (0) or until the executor dies (1). EOFError: the API process is gone."""
        idle_reported = True
        while True:
            busy = self.core.has_work()
            if not busy and not idle_reported:
                send(self.outbox, self.core.idle_outputs())   # fresh stats: every block free, nothing running
                idle_reported = True
            timeout = 0 if busy else None
            while self.inbox.poll(timeout):
                self._handle(recv(self.inbox, API_MESSAGES))
                if self.stopping:
                    return 0
                idle_reported = False
                timeout = 0
            if not self.core.has_work():
                continue
            idle_reported = False
            try:
                out = self.core.step()
            except Exception as e:  # noqa: BLE001 - fail what is in flight; go on if the executor can
                logger.exception("engine step failed")
                if not self.core.executor_alive:
                    send(self.outbox, EngineDead(f"the engine failed and cannot continue: {e}"))
                    return 1
                for msg in self.core.fail_all(f"the engine failed while running this request: {e}"):
                    send(self.outbox, msg)
                continue
            send(self.outbox, out)

    def _handle(self, msg) -> None:
        if isinstance(msg, AddRequest):
            failed = self.core.add(msg)
            if failed is not None:
                send(self.outbox, failed)
        elif isinstance(msg, Abort):
            self.core.abort(msg.request_ids)
        elif isinstance(msg, Shutdown):
            self.stopping = True
        else:  # pragma: no cover - decode() admits API messages only
            raise ProtocolError(f"unexpected {type(msg).__name__}")
