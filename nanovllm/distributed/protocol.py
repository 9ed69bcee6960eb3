"""The typed messages between the TP driver and its worker processes.

Driver -> worker: one pickled `StepMsg` or `ShutdownMsg` per `Connection.send_bytes` (the pipe's own
length-prefixed framing; the driver pickles a step once and sends the same bytes to every rank).
Worker -> driver: `Ready` once after start-up, then one `Done` per step, or a `Failed` (after which the
worker exits). Every message is a small plain dataclass: nothing here holds a tensor or a process group.
"""
from __future__ import annotations

import pickle
from dataclasses import dataclass
from typing import Any

from nanovllm.engine.batch import StepBatch


@dataclass(frozen=True)
class StepMsg:
    batch: StepBatch


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
    result: Any  # StepResult on rank 0, None elsewhere


@dataclass(frozen=True)
class Failed:
    rank: int
    exc_type: str
    message: str
    traceback: str
    during_init: bool


DRIVER_MESSAGES = (StepMsg, ShutdownMsg)
WORKER_MESSAGES = (Ready, Done, Failed)


def encode(msg) -> bytes:
    if not isinstance(msg, DRIVER_MESSAGES):
        raise TypeError(f"not a driver message: {type(msg).__name__}")
    return pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)


def decode_driver_message(data: bytes):
    msg = pickle.loads(data)
    if not isinstance(msg, DRIVER_MESSAGES):
        raise TypeError(f"worker got an unexpected message of type {type(msg).__name__}")
    return msg
