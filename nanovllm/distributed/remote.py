"""Multi-node tensor parallelism's control plane: the rendezvous store, the step broadcast, node liveness.

    leader (node 0)                                          node k (``nanovllm serve --headless``)
    ---------------                                          --------------------------------------
    driver: TCPStore on master_addr:master_port  <--------   connect; compare config; set joined/k
            config (the engine configuration's summary)      every HEARTBEAT_S: add hb/k, read abort
            watches joined/k, hb/k, failed/k  <------------  a rank raised or died: set failed/k, exit 1
            on failure: set abort (its headline)  ------->   abort: kill its ranks, exit 1
    rank 0: each driver message (pipe) -> broadcast  ---->   ranks k * per_node ..: serve_steps over it
            over a gloo group of rank 0 + remote ranks

Steps reach the ranks on other nodes only through torch.distributed: rank 0 forwards the driver's bytes (the
same encoded `StepMsg` / `FlushMsg` / `ShutdownMsg` its pipe carried) with two broadcasts (length, payload) over
a gloo (CPU) group; the remote ranks run the same `serve_steps` loop over it and report nothing back (their
`Done` would only acknowledge). The ranks of node 0 keep their pipes: one host write per rank, as on one node.

Liveness goes through the store, so a dead or missing node is an error on every node within a bound, whatever the
collectives do: the leader fails a node whose heartbeat stops for `heartbeat_timeout` (default
HEARTBEAT_TIMEOUT_S; NANOVLLM_TP_HEARTBEAT_TIMEOUT), or that has not joined within the start-up timeout, or that
reported a failure; a node exits when the leader aborts, or when the leader's store stops answering (the leader's
process or host is gone). Store values are JSON, never pickles.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from datetime import timedelta

HEARTBEAT_S = 0.5            # how often a node beats
HEARTBEAT_TIMEOUT_S = 10.0   # a node silent this long is dead (normal operation)
BLAME_WINDOW_S = 2.0         # after a failure: a node whose beat does not advance twice in this window is dead
# a control group only carries steps; an idle server sends none for hours, so its waits must not time out (a dead
# leader is seen through the store instead)
CONTROL_GROUP_TIMEOUT = timedelta(days=365)


def heartbeat_timeout() -> float:
    """Seconds without a heartbeat after which a node counts as dead (NANOVLLM_TP_HEARTBEAT_TIMEOUT)."""
    v = os.environ.get("NANOVLLM_TP_HEARTBEAT_TIMEOUT", "").strip()
    if not v:
        return HEARTBEAT_TIMEOUT_S
    try:
        t = float(v)
    except ValueError:
        t = 0.0
    if not t > 2 * HEARTBEAT_S:
        raise ValueError(f"NANOVLLM_TP_HEARTBEAT_TIMEOUT must be a number of seconds > {2 * HEARTBEAT_S:g} (a "
                         f"heartbeat comes every {HEARTBEAT_S:g}s), got {v!r}")
    return t


def key(name: str, node: int | None = None) -> str:
    """A control key (in the store `open_store` returns, under NodeConfig.store_prefix)."""
    return name + ("" if node is None else f"/{node}")


def open_store(nodes, *, leader: bool, timeout: float):
    """The rendezvous TCPStore at master_addr:master_port: hosted by the leader's driver, or (torchrun, or any other
    node) a client of it. A client waits up to `timeout` seconds for it to come up. Returns (the TCPStore, its
    view under this run's prefix: the control keys; the process group's keys are under prefix/pg)."""
    raw = _tcp_store(nodes, leader, timeout)
    import torch.distributed as dist
    return raw, dist.PrefixStore(nodes.store_prefix, raw)


def _tcp_store(nodes, leader: bool, timeout: float):
    import torch.distributed as dist
    td = timedelta(seconds=timeout)
    host, port = nodes.master_addr, nodes.master_port
    if leader and not nodes.use_agent_store:
        try:
            return dist.TCPStore(host, port, None, True, wait_for_workers=False, timeout=td)
        except Exception as e:  # noqa: BLE001 - e.g. the port is taken
            raise ValueError(f"the leader could not listen on master_port={port} for the other nodes ({e}); pick "
                             f"a free port with --master-port") from e
    try:
        return dist.TCPStore(host, port, None, False, timeout=td)
    except Exception as e:  # noqa: BLE001 - timed out connecting
        raise RuntimeError(f"could not reach the leader's rendezvous at {host}:{port} within {timeout:g}s ({e}): "
                           f"is node 0 running nanovllm serve with --nnodes {nodes.nnodes} --master-port {port}?"
                           ) from e


class StepBroadcast:
    """Rank 0 -> the ranks on other nodes: driver messages as bytes, over a gloo group (two broadcasts each)."""

    def __init__(self, group):
        self.group = group

    def send(self, data: bytes) -> None:
        import torch
        import torch.distributed as dist
        dist.broadcast(torch.tensor([len(data)], dtype=torch.int64), src=0, group=self.group)
        dist.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8), src=0, group=self.group)

    def recv_bytes(self) -> bytes:
        import torch
        import torch.distributed as dist
        n = torch.empty(1, dtype=torch.int64)
        dist.broadcast(n, src=0, group=self.group)
        buf = torch.empty(int(n.item()), dtype=torch.uint8)
        dist.broadcast(buf, src=0, group=self.group)
        return buf.numpy().tobytes()


class ForwardingConn:
    """Rank 0's pipe to the driver: every driver message is broadcast to the remote ranks before rank 0 reads it."""

    def __init__(self, conn, steps: StepBroadcast):
        self.conn, self.steps = conn, steps

    def recv_bytes(self) -> bytes:
        data = self.conn.recv_bytes()
        self.steps.send(data)
        return data

    def send(self, msg) -> None:
        self.conn.send(msg)


class FollowerConn:
    """A remote rank's step source: rank 0's broadcasts. Its reports go nowhere (only rank 0's carry results)."""

    def __init__(self, steps: StepBroadcast):
        self.steps = steps

    def recv_bytes(self) -> bytes:
        return self.steps.recv_bytes()

    def send(self, msg) -> None:
        pass


# EngineArgs fields a node may set differently from the leader (where it finds the model, who it is)
_PER_NODE = ("model", "tokenizer", "revision", "tokenizer_revision", "download_dir", "trust_remote_code",
             "node_rank", "master_addr", "scheduling_policy", "async_scheduling")


def config_summary(config) -> dict[str, str]:
    """What every node's configuration must agree on (the ranks build their model shards and CUDA graphs from it)."""
    out = {name: repr(v) for name, v in sorted(asdict(config.args).items()) if name not in _PER_NODE}
    out.update(device=config.device.type, dtype=str(config.dtype), max_model_len=str(config.max_model_len),
               max_num_batched_tokens=str(config.max_num_batched_tokens), block_size=str(config.block_size),
               attention_backend=config.attention_backend, quantization=repr(config.quantization),
               kv_cache_dtype=str(config.kv_cache_dtype),
               model_config=json.dumps({k: v for k, v in config.model.raw.items() if k != "_name_or_path"},
                                       sort_keys=True, default=str))
    return out


def config_mismatch(mine: dict, leaders: dict) -> list[str]:
    return [f"{k}: {mine.get(k)} here, {leaders.get(k)} on the leader" for k in sorted(set(mine) | set(leaders))
            if mine.get(k) != leaders.get(k)]


@dataclass(frozen=True)
class NodeReport:
    """A node's last words, set in the store (failed/k) before it exits."""
    node: int
    headline: str          # e.g. "tensor-parallel worker rank 1 (pid 42) raised ValueError: ..."
    exc_type: str = ""     # the rank's exception type, "" for a death or a node-level problem
    traceback: str = ""
    config_error: bool = False  # a configuration problem (ValueError while starting): the leader raises ValueError
    peer_error: bool = False    # the fallout of another node's failure (a collective lost its peer)

    def encode(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def decode(cls, data: bytes) -> NodeReport:
        return cls(**json.loads(data.decode()))


class NodeWatch:
    """The leader's view of the other nodes, through the store: who joined, heartbeats, failure reports.

    `poll()` (called at most every HEARTBEAT_S while the driver waits) returns the first problem it sees, or None:
    a node's report, a joined node silent for `heartbeat_timeout` seconds, a node not joined `join_timeout`
    seconds after start. A report of a peer error (a rank's collective lost another rank) is the fallout of a
    failure seen elsewhere (a local rank's pipe or sentinel, another node's report or silence), so it is returned
    only if nothing else has failed `heartbeat_timeout` seconds later."""

    def __init__(self, stores, nodes, *, join_timeout: float, heartbeat_timeout: float):
        self.tcp_store, self.store = stores  # the TCPStore (its server, when the leader hosts it), the control keys
        self.nodes = nodes
        self.join_timeout, self.heartbeat_timeout = join_timeout, heartbeat_timeout
        self.started = time.monotonic()
        self.others = list(range(1, nodes.nnodes))
        self._beat: dict[int, tuple[int, float]] = {}   # node -> (counter, when it last changed)
        self._joined: set[int] = set()
        self._next_poll = 0.0
        self._peer_seen: dict[int, float] = {}          # node -> when its peer-error report was first seen

    @classmethod
    def start(cls, config, init_timeout: float | None) -> NodeWatch:
        """The leader's: host the rendezvous, publish the configuration the other nodes must match. The other nodes
        must join within `init_timeout` (None: the process group's timeout)."""
        from nanovllm.distributed.worker import _PG_TIMEOUT
        join = init_timeout if init_timeout is not None else _PG_TIMEOUT.total_seconds()
        watch = cls(open_store(config.nodes, leader=True, timeout=join), config.nodes, join_timeout=join,
                    heartbeat_timeout=heartbeat_timeout())
        watch.store.set(key("config"), json.dumps(config_summary(config)))
        return watch

    def abort(self, reason: str) -> None:
        """Tell the other nodes to stop ("": a clean shutdown, else the reason); the first call wins (best effort:
        the store may be gone)."""
        try:
            if not self.store.check([key("abort")]):
                self.store.set(key("abort"), reason)
        except Exception:  # noqa: BLE001
            pass

    def wait_done(self, timeout: float) -> None:
        """After a clean shutdown: give the other nodes up to `timeout` seconds to say their ranks have exited (so
        they never see the store vanish first)."""
        deadline = time.monotonic() + timeout
        try:
            while not self.store.check([key("done", k) for k in self.others]) and time.monotonic() < deadline:
                time.sleep(0.05)
        except Exception:  # noqa: BLE001 - best effort
            pass

    def missing(self) -> list[int]:
        return [k for k in self.others if k not in self._joined]

    def due(self) -> float:
        """Seconds until the next poll is due."""
        return max(0.0, self._next_poll - time.monotonic())

    def reports(self) -> dict[int, NodeReport]:
        out = {}
        for k in self.others:
            if self.store.check([key("failed", k)]):
                out[k] = NodeReport.decode(self.store.get(key("failed", k)))
        return out

    def _beats(self, now: float) -> None:
        for k in self.others:
            n = self.store.add(key("hb", k), 0)
            if k not in self._joined and self.store.check([key("joined", k)]):
                self._joined.add(k)
                self._beat[k] = (n, now)
            elif k in self._joined and n != self._beat[k][0]:
                self._beat[k] = (n, now)

    def poll(self) -> NodeReport | None:
        now = time.monotonic()
        if now < self._next_poll:
            return None
        self._next_poll = now + HEARTBEAT_S
        reports = self.reports()
        for k, report in reports.items():
            if not report.peer_error or now - self._peer_seen.setdefault(k, now) > self.heartbeat_timeout:
                return report
        self._beats(now)
        for k in self.others:
            if k in self._joined:
                silent = now - self._beat[k][1]
                if silent > self.heartbeat_timeout:
                    return reports.get(k) or NodeReport(
                        k, f"{self.nodes.describe(k)} stopped sending heartbeats {silent:.1f}s ago: its host or its "
                           f"nanovllm process died, or the network to it is down "
                           f"(NANOVLLM_TP_HEARTBEAT_TIMEOUT={self.heartbeat_timeout:g}s)")
        if now - self.started > self.join_timeout:
            return self.missing_report()
        return None

    def missing_report(self) -> NodeReport | None:
        """The error for the nodes that have not joined (None if every node has)."""
        missing = self.missing()
        if not missing:
            return None
        nodes = ", ".join(self.nodes.describe(k) for k in missing)
        return NodeReport(missing[0], f"{nodes} did not join within {time.monotonic() - self.started:.0f}s: start `"
                                      f"{self.nodes.headless_command(missing[0])}` there (same engine arguments "
                                      f"as the leader)", config_error=True)

    def blame(self, first: NodeReport | None = None) -> dict[int, NodeReport]:
        """After a failure: `first` (what poll() found), then each other node's report, or a verdict of death for a
        node whose heartbeat does not advance twice within BLAME_WINDOW_S (returns early once every node reported
        or proved alive). {} if the store itself fails."""
        try:
            found = self._blame([k for k in self.others if first is None or k != first.node])
        except Exception:  # noqa: BLE001 - don't hide the failure being reported
            found = {}
        return found if first is None else {first.node: first, **{k: m for k, m in found.items() if k != first.node}}

    def _blame(self, others: list[int]) -> dict[int, NodeReport]:
        if not others:
            return {}
        start = {k: self.store.add(key("hb", k), 0) for k in others}
        deadline = time.monotonic() + BLAME_WINDOW_S
        out: dict[int, NodeReport] = {}
        alive: set[int] = set()
        while True:
            out.update((k, m) for k, m in self.reports().items() if k in start)
            for k in others:
                if k not in out and self.store.add(key("hb", k), 0) >= start[k] + 2:
                    alive.add(k)
            if set(out) | alive >= set(others) or time.monotonic() >= deadline:
                break
            time.sleep(0.1)
        for k in others:
            if k not in out and k not in alive:
                what = "stopped sending heartbeats" if k in self._joined or self.store.check([key("joined", k)]) \
                    else "never joined"
                out[k] = NodeReport(k, f"{self.nodes.describe(k)} {what}: its host or its nanovllm process died, "
                                       f"or the network to it is down")
        return out
