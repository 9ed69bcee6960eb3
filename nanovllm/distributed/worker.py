"""One tensor-parallel rank: a process that joins the group, builds its shard of the model and runs steps.

    worker_main(spec, conn):
        join the process group (rendezvous on the driver's TCPStore, or env:// when launched by torchrun)
        runner = ModelRunner(config, TPGroup(rank, size, group))     # agrees the KV block count (MIN)
        send Ready(num_kvcache_blocks)
        loop: StepMsg -> runner.execute -> send Done(result)   |   ShutdownMsg / driver gone -> exit

Anything raised is sent back as `Failed` (with the traceback text) before the process exits with code 1.
"""
from __future__ import annotations

import dataclasses
import os
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta

from nanovllm.distributed.protocol import Done, Failed, Ready, ShutdownMsg, StepMsg, decode_driver_message

# how long a rank waits for the others to join the group / for one collective (NCCL/gloo timeout)
_PG_TIMEOUT = timedelta(seconds=float(os.environ.get("NANOVLLM_TP_PG_TIMEOUT", "600")))


# ModelRunner start-up timings passed back to the driver (max over ranks becomes TPExecutor.<name>)
_TIMINGS = ("load_seconds", "capture_seconds")


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a rank needs to start (pickled to the spawned process)."""
    config: object            # EngineConfig
    rank: int
    size: int
    store_host: str | None    # None: env:// rendezvous (MASTER_ADDR / MASTER_PORT)
    store_port: int
    parent_pid: int
    local_rank: int | None = None  # GPU index on this host; None: rank


def _watch_parent(parent_pid: int) -> None:
    """Exit if the driver process goes away (even while blocked inside a collective)."""
    def loop():
        while True:
            if os.getppid() != parent_pid:
                os._exit(3)
            time.sleep(0.5)
    threading.Thread(target=loop, name="nanovllm-tp-parent-watch", daemon=True).start()


def init_process_group(spec: WorkerSpec):
    """Join this engine's process group (the default group of this worker process) and return it."""
    import torch
    import torch.distributed as dist

    device = spec.config.device
    kwargs = {}
    if device.type == "cuda":
        backend = "nccl"
        local = spec.rank if spec.local_rank is None else spec.local_rank
        torch.cuda.set_device(local)
        kwargs["device_id"] = torch.device("cuda", local)  # eager NCCL communicator init, bound to this GPU
    else:
        backend = "gloo"
    if spec.store_host is None:
        dist.init_process_group(backend, init_method="env://", rank=spec.rank, world_size=spec.size,
                                timeout=_PG_TIMEOUT, **kwargs)
    else:
        store = dist.TCPStore(spec.store_host, spec.store_port, is_master=False, timeout=_PG_TIMEOUT)
        dist.init_process_group(backend, store=store, rank=spec.rank, world_size=spec.size,
                                timeout=_PG_TIMEOUT, **kwargs)
    return dist.group.WORLD


def build_runner(spec: WorkerSpec):
    import torch

    from nanovllm.distributed.group import TPGroup
    from nanovllm.engine.model_runner import ModelRunner

    if spec.config.device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        # the ranks share the host's cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // spec.size))
    config = spec.config
    if config.device.type == "cuda":
        # name the GPU explicitly, so the runner uses this host's GPU `local_rank` even when the global
        # rank is larger than the number of GPUs on this host (multi-node)
        local = spec.rank if spec.local_rank is None else spec.local_rank
        config = dataclasses.replace(config, device=torch.device("cuda", local))
    group = init_process_group(spec)
    return ModelRunner(config, TPGroup(spec.rank, spec.size, group))


def _destroy_process_group() -> None:
    try:
        import torch.distributed as dist
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - best effort on the way out
        pass


def worker_main(spec: WorkerSpec, conn) -> None:
    """Entry point of a spawned worker process."""
    # Ctrl-C reaches the whole foreground process group; the driver handles it and shuts us down.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _watch_parent(spec.parent_pid)
    rank = spec.rank
    in_init = True
    code = 0
    try:
        runner = build_runner(spec)
        timings = {k: float(getattr(runner, k)) for k in _TIMINGS if isinstance(getattr(runner, k, None), (int, float))}
        conn.send(Ready(rank, os.getpid(), runner.num_kvcache_blocks, timings))
        in_init = False
        while True:
            try:
                data = conn.recv_bytes()
            except (EOFError, OSError):
                break  # the driver is gone
            msg = decode_driver_message(data)
            if isinstance(msg, ShutdownMsg):
                break
            assert isinstance(msg, StepMsg)
            conn.send(Done(rank, runner.execute(msg.batch)))
    except BaseException as e:  # noqa: BLE001 - reported to the driver, then exit non-zero
        code = 1
        try:
            conn.send(Failed(rank, type(e).__name__, str(e), traceback.format_exc(), in_init))
        except Exception:  # noqa: BLE001 - the driver may be gone already
            pass
    if code == 0:
        _destroy_process_group()  # after a failure the group may be wedged: just leave
    try:
        conn.close()
    except Exception:  # noqa: BLE001
        pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001
            pass
    # skip interpreter teardown (CUDA/NCCL atexit hooks can stall after a peer failed)
    os._exit(code)
