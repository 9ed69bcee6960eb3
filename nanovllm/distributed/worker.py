"""One tensor-parallel rank: a process that joins the group, builds its shard of the model and runs steps.

    worker_main(spec, conn):
        join the process group (rendezvous on the driver's TCPStore; with several nodes, the leader's)
        runner = ModelRunner(config, TPGroup(rank, size, group))     # agrees the KV block count (MIN)
        send Ready(num_kvcache_blocks)
        serve_steps(conn, rank, runner): the step loop (below)   |   ShutdownMsg / driver gone -> exit
        (several nodes: rank 0 forwards each driver message to the other nodes' ranks, which serve_steps over
        that broadcast instead of a pipe: distributed/remote.py)

The step loop keeps one step "in flight": StepMsg N+1 -> runner.launch(N+1) (queued on the GPU
behind step N), then wait for step N and send Done(N). So the device always has the next step queued
while this rank waits for, and reports, the previous one; the driver reads Done(N) while step N+1 runs.
`StepMsg(report=True)` (synchronous use) and `FlushMsg(N)` (the driver wants step N and has no step N+1
to send) report at once. A step N already done when the next message arrives (always on CPU, where the
launch *is* the computation; on a GPU when the host, not the device, is the bottleneck) is reported
before that message is even unpickled: the driver works on step N's tokens while the ranks launch N+1.

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

from nanovllm.distributed.protocol import (
    KIND_SHUTDOWN,
    Done,
    Failed,
    FlushMsg,
    Ready,
    ShutdownMsg,
    StepMsg,
    decode_driver_message,
    message_kind,
)

# how long a rank waits for the others to join the group / for one collective (NCCL/gloo timeout)
_PG_TIMEOUT = timedelta(seconds=float(os.environ.get("NANOVLLM_TP_PG_TIMEOUT", "600")))


# ModelRunner start-up timings passed back to the driver (max over ranks becomes TPExecutor.<name>)
_TIMINGS = ("load_seconds", "kv_seconds", "capture_seconds", "gemm_plan_seconds")


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a rank needs to start (pickled to the spawned process)."""
    config: object            # EngineConfig
    rank: int
    size: int
    store_host: str           # the rendezvous TCPStore: the driver's, or with several nodes the leader's
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
    """Join this engine's process group (the default group of this worker process); returns it and, with several
    nodes, the step broadcast from rank 0 to the ranks on the other nodes (distributed/remote.py), else None."""
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
    store = dist.TCPStore(spec.store_host, spec.store_port, is_master=False, timeout=_PG_TIMEOUT)
    nodes = spec.config.nodes
    if nodes.multinode:  # the leader's store may be torchrun's, kept across restarts: this run's keys only
        store = dist.PrefixStore(nodes.store_prefix + "/pg", store)
    dist.init_process_group(backend, store=store, rank=spec.rank, world_size=spec.size, timeout=_PG_TIMEOUT,
                            **kwargs)
    if not nodes.multinode:
        return dist.group.WORLD, None
    from nanovllm.distributed.remote import CONTROL_GROUP_TIMEOUT, StepBroadcast
    # every rank creates it (new_group is collective over the default group), only rank 0 and the remote ranks use it
    control = dist.new_group([0, *nodes.remote_ranks], backend="gloo", timeout=CONTROL_GROUP_TIMEOUT)
    return dist.group.WORLD, StepBroadcast(control)


def build_runner(spec: WorkerSpec):
    """The rank's ModelRunner, and its step broadcast (init_process_group)."""
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
    group, steps = init_process_group(spec)
    return ModelRunner(config, TPGroup(spec.rank, spec.size, group)), steps


def _destroy_process_group() -> None:
    try:
        import torch.distributed as dist
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - best effort on the way out
        pass


def _finished(pending) -> bool:
    """Whether a launched step is known to be done on the device (its result can be read at once)."""
    event = getattr(pending, "event", None)
    return event is not None and event.query()


class ProtocolError(RuntimeError):
    """The driver sent something out of order (a bug): reported to the driver as a failure."""


def serve_steps(conn, rank: int, runner, *, report_first: bool = False) -> bool:
    """Run steps from `conn` until ShutdownMsg (returns True) or EOF (the driver is gone: False).

    `runner` needs `launch(batch) -> pending` with `pending.result()` (a ModelRunner, or a stand-in
    in the protocol tests and benchmarks). Raises ProtocolError if the driver's messages are out of order.

    `report_first`: report a finished step as soon as the next message arrives, before unpickling and
    launching it (CPU, where `launch` computes the whole step). Otherwise launch first, then wait for and
    report the previous step, unless (rank 0) the previous step is already done on the device: then the
    host, not the device, is the bottleneck, and the driver gets its tokens an unpickle + launch earlier."""
    unreported = None      # (step id, pending) launched and not reported yet
    reported = -1          # the latest step reported
    expect = 0             # the next step id

    def report() -> None:
        nonlocal unreported, reported
        step, pending = unreported
        conn.send(Done(rank, step, pending.result()))
        unreported, reported = None, step

    while True:
        try:
            data = conn.recv_bytes()
        except (EOFError, OSError):
            return False  # the driver is gone
        kind = message_kind(data)
        if unreported is not None and kind != KIND_SHUTDOWN and (
                report_first or (rank == 0 and _finished(unreported[1]))):
            report()  # already done: the driver goes on with it while this rank unpickles and launches
        msg = decode_driver_message(data)
        if isinstance(msg, StepMsg):
            if msg.step != expect:
                raise ProtocolError(f"got step {msg.step}, expected step {expect}")
            expect += 1
            launched = runner.launch(msg.batch)
            if unreported is not None:
                report()  # waits for the previous step while this one is queued behind it
            unreported = (msg.step, launched)
            if msg.report:
                report()
        elif isinstance(msg, FlushMsg):
            if unreported is not None and unreported[0] == msg.step:
                report()
            elif not (unreported is None and reported == msg.step):
                have = None if unreported is None else unreported[0]
                raise ProtocolError(f"asked to report step {msg.step}, but the unreported step is {have}")
        else:
            assert isinstance(msg, ShutdownMsg)
            if unreported is not None:
                unreported[1].result()  # let it finish before the process group goes away
            return True


def worker_main(spec: WorkerSpec, conn) -> None:
    """Entry point of a spawned worker process."""
    # Ctrl-C reaches the whole foreground process group; the driver handles it and shuts us down.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _watch_parent(spec.parent_pid)
    rank = spec.rank
    in_init = True
    code = 0
    try:
        runner, steps = build_runner(spec)
        timings = {k: float(getattr(runner, k)) for k in _TIMINGS if isinstance(getattr(runner, k, None), (int, float))}
        conn.send(Ready(rank, os.getpid(), runner.num_kvcache_blocks, timings))
        in_init = False
        cuda = spec.config.device.type == "cuda"
        source = conn
        if steps is not None:  # several nodes: rank 0 forwards the driver's messages, the other nodes' ranks follow
            from nanovllm.distributed.remote import FollowerConn, ForwardingConn
            if spec.rank == 0:
                source = ForwardingConn(conn, steps)
            elif spec.config.nodes.node_of(spec.rank) != 0:
                source = FollowerConn(steps)
        if serve_steps(source, rank, runner, report_first=not cuda):
            runner.shutdown()  # waits for the device: nothing of ours still running when the group is destroyed
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
