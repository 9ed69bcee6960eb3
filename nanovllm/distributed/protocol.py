"""The typed messages between the TP driver and its worker processes, and how to read a worker's end.

Driver -> worker: one `StepMsg`, `FlushMsg` or `ShutdownMsg` per `Connection.send_bytes` (the pipe's
own length-prefixed framing), as a kind byte and the pickle (`encode`); the driver encodes a step
once and sends the same bytes to every rank. Worker -> driver: `Ready` once after start-up, then one
`Done` per step, in step order, or a `Failed` (after which the worker exits). Every message is a small
plain dataclass: nothing here holds a tensor or a process group.

Steps are numbered 0, 1, 2, ... by the driver. A worker launches each step as it arrives and reports
step N (`Done(step=N)`) only once step N+1 has arrived (before launching it if N is already done, else
right after), or at once if `StepMsg.report` is set, or when a `FlushMsg(N)` asks for it: so the driver
always knows which reports are on their way.
"""
from __future__ import annotations

import pickle
import re
from dataclasses import dataclass
from typing import Any

from nanovllm.engine.batch import StepBatch


@dataclass(frozen=True)
class StepMsg:
    batch: StepBatch
    step: int             # 0, 1, 2, ...: one more than the previous StepMsg
    report: bool = False  # report this step as soon as it is done (synchronous use: execute())


@dataclass(frozen=True)
class FlushMsg:
    step: int  # report this step (the latest one launched, not reported yet) as soon as it is done


@dataclass(frozen=True)
class ShutdownMsg:
    pass


@dataclass(frozen=True)
class Ready:
    rank: int
    pid: int
    num_kvcache_blocks: int
    timings: dict  # name -> seconds (load_seconds, capture_seconds, ... whatever the runner reports)


@dataclass(frozen=True)
class Done:
    rank: int
    step: int
    result: Any  # StepResult on rank 0, None elsewhere


@dataclass(frozen=True)
class Failed:
    rank: int
    exc_type: str
    message: str
    traceback: str
    during_init: bool


DRIVER_MESSAGES = (StepMsg, FlushMsg, ShutdownMsg)
WORKER_MESSAGES = (Ready, Done, Failed)

# a driver message is one kind byte, then the pickle: a worker can see what came before unpickling it
KIND_STEP, KIND_FLUSH, KIND_SHUTDOWN = b"s", b"f", b"x"
_KINDS = {StepMsg: KIND_STEP, FlushMsg: KIND_FLUSH, ShutdownMsg: KIND_SHUTDOWN}


def encode(msg) -> bytes:
    kind = _KINDS.get(type(msg))
    if kind is None:
        raise TypeError(f"not a driver message: {type(msg).__name__}")
    return kind + pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)


def message_kind(data: bytes) -> bytes:
    return data[:1]


def decode_driver_message(data: bytes):
    msg = pickle.loads(memoryview(data)[1:])
    if _KINDS.get(type(msg)) != data[:1]:
        raise TypeError(f"worker got an unexpected message of type {type(msg).__name__}")
    return msg


# a collective that lost a peer: gloo's "Connection reset/closed by peer", "Broken pipe", "Timed out waiting
# ...", NCCL's "remote process exited or there was a network error" / an aborted communicator
_PEER_ERROR = re.compile(r"by peer|connection (reset|closed|refused)|broken pipe|socket closed|timed out|"
                         r"remote process|network error|communicator was aborted", re.IGNORECASE)


def blames_a_peer(m: Failed) -> bool:
    """Whether a rank's error looks like the fallout of another rank's failure, not a failure of its own."""
    return m.exc_type in ("DistError", "DistBackendError", "DistNetworkError") or bool(_PEER_ERROR.search(m.message))
