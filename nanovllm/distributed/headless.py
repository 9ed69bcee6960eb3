"""A node that runs only tensor-parallel workers (`nanovllm serve --headless`): no API server, no scheduler.

    connect to the leader's store (master_addr:master_port), beat
    resolve the engine configuration; it must match the leader's (remote.config_summary), else failed/k
    set joined/k; spawn ranks k * per_node .. (k + 1) * per_node - 1 (local ranks 0 .., one GPU each)
    loop, every HEARTBEAT_S: read the ranks' pipes and sentinels; beat; read abort
        all ranks exited 0 (the leader's ShutdownMsg reached them through rank 0): exit 0
        a rank raised or died: failed/k = its report, kill the others, exit 1
        the leader aborted, or its store stopped answering: kill the ranks, exit 1 (0 after a clean shutdown)

The ranks join the leader's process group and serve the steps rank 0 broadcasts (distributed/remote.py). Exit
status: 0 after the leader's shutdown or a SIGTERM/SIGINT, 1 after a failure, 2 for a bad configuration.
"""
from __future__ import annotations

import json
import logging
import multiprocessing as mp
import os
import signal
import socket
import sys
import time
import traceback
from datetime import timedelta
from multiprocessing.connection import wait as mp_wait

from nanovllm.distributed.executor import SHUTDOWN_JOIN_S, _env_timeout
from nanovllm.distributed.protocol import Failed, Ready, blames_a_peer
from nanovllm.distributed.remote import (
    HEARTBEAT_S,
    NodeReport,
    config_mismatch,
    config_summary,
    heartbeat_timeout,
    key,
    open_store,
)
from nanovllm.distributed.worker import _PG_TIMEOUT, WorkerSpec, worker_main
from nanovllm.utils.processes import describe_exit

logger = logging.getLogger(__name__)


class NodeFailed(RuntimeError):
    """This node stopped because of a failure (already reported to the leader where it could be)."""


def run_headless(args, *, init_timeout: float | None = None) -> int:
    """Run this node's ranks until the leader shuts them down. Raises ValueError for a bad configuration (also
    reported to the leader), NodeFailed / RuntimeError for a failure."""
    from nanovllm.config import EngineConfig
    from nanovllm.distributed.nodes import NodeConfig

    nodes = NodeConfig.from_args(args, os.environ)
    k = nodes.node_rank
    if not nodes.multinode or k == 0:
        raise ValueError(f"--headless runs the workers of a node other than the leader, node_rank 1..nnodes-1; got "
                         f"nnodes={nodes.nnodes}, node_rank={k} (node 0 runs nanovllm serve without --headless)")
    if init_timeout is None:
        init_timeout = _env_timeout("NANOVLLM_TP_INIT_TIMEOUT") or _PG_TIMEOUT.total_seconds()
    _, store = open_store(nodes, leader=False, timeout=init_timeout)
    store.add(key("hb", k), 1)
    try:
        config = EngineConfig.resolve(args)
        leaders = json.loads(store.get(key("config")))
        diff = config_mismatch(config_summary(config), leaders)
        if diff:
            raise ValueError(f"{nodes.describe(k)}'s engine arguments differ from the leader's: " + "; ".join(diff))
    except (ValueError, TypeError) as e:
        store.set(key("failed", k), NodeReport(k, f"{nodes.describe(k)} could not start: {type(e).__name__}: {e}",
                                               type(e).__name__, traceback.format_exc(), config_error=True).encode())
        raise
    store.set(key("joined", k), f"{socket.gethostname()} pid {os.getpid()}")
    # from now on a store call that takes longer than this means the leader's host is gone
    store.set_timeout(timedelta(seconds=heartbeat_timeout()))
    return _Node(config, nodes, store).run()


class _Node:
    """This node's ranks: spawned, watched (pipes, sentinels, the leader's store), stopped."""

    def __init__(self, config, nodes, store):
        self.config, self.nodes, self.store = config, nodes, store
        self.k = nodes.node_rank
        self.procs, self.conns, self.ranks = [], [], list(nodes.ranks(self.k))

    def run(self) -> int:
        previous = signal.signal(signal.SIGTERM, signal.default_int_handler)
        try:
            self._spawn()
            return self._watch()
        except KeyboardInterrupt:
            self._report(NodeReport(self.k, f"{self.nodes.describe(self.k)} was stopped (SIGTERM/SIGINT)"))
            return 0
        finally:
            self._stop()
            signal.signal(signal.SIGTERM, previous)

    def _spawn(self) -> None:
        ctx = mp.get_context("spawn")
        for local, rank in enumerate(self.ranks):
            spec = WorkerSpec(config=self.config, rank=rank, size=self.nodes.tensor_parallel_size,
                              store_host=self.nodes.master_addr, store_port=self.nodes.master_port,
                              parent_pid=os.getpid(), local_rank=local)
            parent_end, child_end = ctx.Pipe(duplex=True)
            proc = ctx.Process(target=worker_main, args=(spec, child_end), name=f"nanovllm-tp-rank{rank}", daemon=True)
            self.procs.append(proc)
            self.conns.append(parent_end)
            proc.start()
            child_end.close()
        logger.info("%s: ranks %s started (pids %s)", self.nodes.describe(self.k), self.ranks,
                    [p.pid for p in self.procs])

    def _watch(self) -> int:
        conns = {c: i for i, c in enumerate(self.conns)}
        sentinels = {p.sentinel: i for i, p in enumerate(self.procs)}
        done: set[int] = set()
        while True:
            ready = mp_wait([c for c, i in conns.items() if i not in done] +
                            [s for s, i in sentinels.items() if i not in done], timeout=HEARTBEAT_S)
            for obj in ready:
                if obj in conns:
                    try:
                        msg = obj.recv()
                    except (EOFError, OSError):
                        continue  # its sentinel says how it ended
                    self._on_message(conns[obj], msg)
            for obj in ready:
                if obj in sentinels:
                    i = sentinels[obj]
                    proc = self.procs[i]
                    proc.join(1.0)
                    while self.conns[i].poll(0):  # its last words come before its death
                        try:
                            self._on_message(i, self.conns[i].recv())
                        except (EOFError, OSError):
                            break
                    if proc.exitcode != 0:
                        self._fail(NodeReport(self.k, f"tensor-parallel worker rank {self.ranks[i]} (pid {proc.pid}) "
                                                      f"on {self.nodes.describe(self.k)} died unexpectedly "
                                                      f"({describe_exit(proc.exitcode)})"))
                    done.add(i)
            if len(done) == len(self.procs):
                logger.info("%s: every rank finished: exiting", self.nodes.describe(self.k))
                try:
                    self.store.set(key("done", self.k), "")  # the leader keeps its store up until it reads this
                except Exception:  # noqa: BLE001 - the leader is gone already
                    pass
                return 0
            self._beat(done)

    def _on_message(self, i: int, msg) -> None:
        if isinstance(msg, Ready):
            logger.info("rank %d ready (%d KV blocks)", msg.rank, msg.num_kvcache_blocks)
        elif isinstance(msg, Failed):
            what = f"tensor-parallel worker rank {msg.rank} (pid {self.procs[i].pid}) on {self.nodes.describe(self.k)}"
            if blames_a_peer(msg):  # its collective or the step broadcast lost a peer: the fallout, not the cause
                self._fail(NodeReport(self.k, f"{what} lost its connection to the other ranks (the leader or another "
                                              f"node is gone): "
                                              f"{msg.exc_type}: {msg.message}", msg.exc_type, peer_error=True))
            self._fail(NodeReport(self.k, f"{what} raised {msg.exc_type}: {msg.message}", msg.exc_type, msg.traceback,
                                  config_error=msg.during_init and msg.exc_type in ("ValueError", "TypeError")))

    def _beat(self, done: set[int]) -> None:
        """Heartbeat, and read the leader's abort; the leader's store gone means the leader is gone."""
        try:
            self.store.add(key("hb", self.k), 1)
            abort = self.store.get(key("abort")).decode() if self.store.check([key("abort")]) else None
        except Exception as e:  # noqa: BLE001 - the store's server is the leader's process
            if self._finish_alone(done):
                return
            raise NodeFailed(f"{self.nodes.describe(self.k)} lost the leader: its rendezvous at "
                             f"{self.nodes.master_addr}:{self.nodes.master_port} stopped answering ({e})") from e
        if abort is None:
            return
        if abort == "" and self._finish_alone(done):
            return
        raise NodeFailed(f"the leader stopped the engine: {abort or 'shut down'}")

    def _finish_alone(self, done: set[int]) -> bool:
        """After the leader's shutdown: whether every rank exits cleanly by itself (it got the ShutdownMsg)."""
        deadline = time.monotonic() + SHUTDOWN_JOIN_S
        for i, p in enumerate(self.procs):
            if i not in done:
                p.join(max(0.0, deadline - time.monotonic()))
        if all(p.exitcode == 0 for p in self.procs):
            done.update(range(len(self.procs)))
            return True
        return False

    def _report(self, report: NodeReport) -> None:
        try:
            self.store.set(key("failed", self.k), report.encode())
        except Exception:  # noqa: BLE001 - the leader may be gone already
            pass

    def _fail(self, report: NodeReport) -> None:
        self._report(report)
        error = ValueError if report.config_error else NodeFailed
        raise error(report.headline + (f"\n{report.traceback.rstrip()}" if report.traceback else ""))

    def _stop(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.terminate()
        for p in self.procs:
            p.join(2.0)
            if p.is_alive():
                p.kill()
                p.join(2.0)
        for c in self.conns:
            c.close()
        sys.stderr.flush()
