"""Data parallelism behind one API server: `DataParallelClient` owns D EngineCoreClients (one engine-core process
each, each with its own tensor-parallel workers) and sends every HTTP request to one of them.

    HTTP handlers -> DataParallelClient.submit -> route -> EngineCoreClient i -> pipe -> engine-core process i

Routing (per HTTP request: its prompts and samples stay on one core, as one RequestGroup):
- load of a core = the samples (sequences) this API process sent it that have not finished;
- affinity: the core that was last sent a prompt with the same first KV block (the first `block_size` tokens of
  the request's first prompt) gets it again, unless its load exceeds the least load by more than
  `affinity_slack` (`load[c] > min(load) + affinity_slack`): its prefix cache probably holds that block;
- otherwise the least-loaded core, ties broken round robin (an idle server alternates its cores).
The affinity table remembers the AFFINITY_ENTRIES most recent first blocks (by hash: a collision only routes a
request somewhere else).

Everything else goes to the core that holds the request: a handler's RequestGroup belongs to the core's client,
so its close() (a finished request, a client that went away) aborts there. /metrics sums the cores' counters and
gauges, plus a series per core labelled `engine` (metrics.py). Failure: a core that dies, stalls or exits fails
its own requests at once (EngineDeadError naming the core); the server is then unhealthy as with one core (new
requests 503, /health 503, exit status 1 once the requests in flight are answered: those on the other cores
finish). D = 1 does not use this class (`nanovllm serve` runs one EngineCoreClient, as before).

GPUs: core i runs on the devices [i*tp, (i+1)*tp) of those visible to the API process (`core_cuda_devices`), set
as its CUDA_VISIBLE_DEVICES before it initializes CUDA. On CPU every core runs on the CPU, with its share of the
threads (`core_envs`).
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import threading
import time
from collections import OrderedDict

from nanovllm.engine.core_process import make_engine_core
from nanovllm.engine.core_protocol import EngineStats, Ready
from nanovllm.server.config import check_data_parallel_size
from nanovllm.server.core_client import EngineCoreClient
from nanovllm.server.metrics import EngineShare, ServerMetrics
from nanovllm.server.request_group import EngineDeadError, RequestGroup

logger = logging.getLogger(__name__)

AFFINITY_SLACK = 16        # sequences a core may carry above the least-loaded one and still keep its prefixes
AFFINITY_ENTRIES = 1 << 16


def visible_cuda_devices() -> list[str]:
    """The CUDA devices this process may use, as CUDA_VISIBLE_DEVICES entries (indices or UUIDs)."""
    import torch
    n = torch.cuda.device_count()
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is None:
        return [str(i) for i in range(n)]
    return [d.strip() for d in env.split(",") if d.strip()][:n]


def core_cuda_devices(data_parallel_size: int, tensor_parallel_size: int, visible: list[str]) -> list[list[str]]:
    """Core i's devices: visible[i*tp:(i+1)*tp]. ValueError if D x tp exceeds the devices visible."""
    need = data_parallel_size * tensor_parallel_size
    if need > len(visible):
        raise ValueError(f"--data-parallel-size {data_parallel_size} x --tensor-parallel-size {tensor_parallel_size} "
                         f"needs {need} CUDA devices, but {len(visible)} are visible"
                         + (f" (CUDA_VISIBLE_DEVICES={','.join(visible)})" if visible else ""))
    tp = tensor_parallel_size
    return [visible[i * tp:(i + 1) * tp] for i in range(data_parallel_size)]


def core_envs(data_parallel_size: int, tensor_parallel_size: int, device_type: str) -> list[dict[str, str]]:
    """Each core's environment: on CUDA its CUDA_VISIBLE_DEVICES (`core_cuda_devices`); on CPU, unless
    OMP_NUM_THREADS is set already, its share of the CPU threads (D cores x tp ranks share the machine)."""
    if device_type == "cuda":
        return [{"CUDA_VISIBLE_DEVICES": ",".join(d)}
                for d in core_cuda_devices(data_parallel_size, tensor_parallel_size, visible_cuda_devices())]
    if "OMP_NUM_THREADS" in os.environ:
        return [{} for _ in range(data_parallel_size)]
    threads = max(1, (os.cpu_count() or 1) // (data_parallel_size * tensor_parallel_size))
    return [{"OMP_NUM_THREADS": str(threads)} for _ in range(data_parallel_size)]


def choose_core(loads: list[int], preferred: int | None, slack: int, start: int) -> int:
    """The routing rule (module docstring): `preferred` (the affinity core, or None) unless its load exceeds the
    least by more than `slack`; else the least-loaded core, the first of them from `start` on."""
    least = min(loads)
    if preferred is not None and loads[preferred] <= least + slack:
        return preferred
    n = len(loads)
    return next(i % n for i in range(start, start + n) if loads[i % n] == least)


class DataParallelClient:
    """What the HTTP app needs of an engine-core client (EngineCoreClient's interface), over D cores."""

    def __init__(self, args, data_parallel_size: int, *, step_timeout: float | None = 60.0,
                 make_core=make_engine_core, envs: list[dict[str, str]] | None = None,
                 affinity_slack: int = AFFINITY_SLACK):
        """`args`: every core's engine arguments. `envs`: each core's environment variables (`core_envs`)."""
        size = check_data_parallel_size(data_parallel_size)
        if envs is not None and len(envs) != size:
            raise ValueError(f"envs has {len(envs)} entries for {size} engine cores")
        if not isinstance(affinity_slack, int) or affinity_slack < 0:
            raise ValueError(f"affinity_slack must be an int >= 0, got {affinity_slack!r}")
        self.metrics = ServerMetrics()          # shared: the cores record into one set of request metrics
        self.cores = [
            EngineCoreClient(args, step_timeout=step_timeout, make_core=make_core, metrics=self.metrics,
                             env=None if envs is None else envs[i],
                             label=f"engine core {i} of {size}")
            for i in range(size)]
        self.envs = envs
        self.affinity_slack = affinity_slack
        self.info: Ready | None = None
        self.routed = [0] * size                # engine requests sent to each core
        self._affinity: OrderedDict[int, int] = OrderedDict()   # hash of a first block -> core it last went to
        self._next = 0                          # round-robin start among equally loaded cores
        self._block_size = 0
        self._dead: str | None = None
        self._death_callbacks: list = []

    # --- lifecycle ---------------------------------------------------------------------------------
    def start(self, timeout: float | None = None) -> Ready:
        """Start every core (they load their models at the same time) and wait for all; if one fails, stop the
        others and raise its error. Returns core 0's Ready with the KV blocks of all the cores."""
        try:
            for c in self.cores:
                c.launch()
            deadline = None if timeout is None else time.monotonic() + timeout
            ready = [c.wait_ready(None if deadline is None else max(0.0, deadline - time.monotonic()))
                     for c in self.cores]
        except BaseException:
            for c in self.cores:
                c.close()
            raise
        first = ready[0]
        for i, r in enumerate(ready[1:], 1):
            if (r.max_model_len, r.vocab_size, r.block_size) != (first.max_model_len, first.vocab_size,
                                                                  first.block_size):
                self.close()
                raise RuntimeError(f"engine core {i} runs with max_model_len={r.max_model_len}, vocab_size="
                                   f"{r.vocab_size}, block_size={r.block_size}; core 0 with {first.max_model_len}, "
                                   f"{first.vocab_size}, {first.block_size}")
        self._block_size = first.block_size
        self.info = dataclasses.replace(first, num_kvcache_blocks=sum(r.num_kvcache_blocks for r in ready),
                                        worker_pids=[p for r in ready for p in r.worker_pids])
        return self.info

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        for c in self.cores:
            c.add_death_callback(self._core_died)
            c.attach(loop)

    def add_death_callback(self, fn) -> None:
        """`fn(reason)` runs on the event loop once, when the first core dies (not after a clean close())."""
        self._death_callbacks.append(fn)

    @property
    def is_alive(self) -> bool:
        return self._dead is None and all(c.is_alive for c in self.cores)

    @property
    def dead_reason(self) -> str | None:
        return self._dead or next((c.dead_reason for c in self.cores if c.dead_reason), None)

    @property
    def pids(self) -> list[int | None]:
        return [c.pid for c in self.cores]

    def close(self) -> None:
        """Shut every core down at once (each waits for its own: see EngineCoreClient.close)."""
        threads = [threading.Thread(target=c.close, name=f"nanovllm-close-core-{i}") for i, c in enumerate(self.cores)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    def _core_died(self, reason: str) -> None:
        """A core's death callback (its reason names it): the first one makes the whole client dead."""
        if self._dead is not None:
            return
        self._dead = reason
        alive = sum(c.is_alive for c in self.cores)
        logger.error("%s; the %d other core(s) finish the requests they hold, then the server stops", reason, alive)
        for fn in self._death_callbacks:
            try:
                fn(reason)
            except Exception:  # noqa: BLE001
                logger.exception("engine death callback failed")

    # --- requests (event loop) ---------------------------------------------------------------------
    def submit(self, prompts: list[tuple[list[int], list[tuple[str, object]]]], *, stream: bool) -> RequestGroup:
        """EngineCoreClient.submit on the core the routing rule picks."""
        if not self.is_alive:
            raise EngineDeadError(self.dead_reason or "the engine is not running")
        ids = prompts[0][0] if prompts else []
        bs = self._block_size
        key = hash(tuple(ids[:bs])) if bs and len(ids) >= bs else None
        preferred = None if key is None else self._affinity.get(key)
        i = choose_core([c.load for c in self.cores], preferred, self.affinity_slack, self._next)
        group = self.cores[i].submit(prompts, stream=stream)
        if i != preferred:
            self._next = (i + 1) % len(self.cores)
        self.routed[i] += sum(len(reqs) for _, reqs in prompts)
        if key is not None:
            self._affinity[key] = i
            self._affinity.move_to_end(key)
            if len(self._affinity) > AFFINITY_ENTRIES:
                self._affinity.popitem(last=False)
        return group

    def abort(self, request_ids: list[str]) -> None:
        for c in self.cores:
            mine = [rid for rid in request_ids if c.holds(rid)]
            if mine:
                c.abort(mine)

    def fail_all(self, exc: BaseException) -> int:
        return sum(c.fail_all(exc) for c in self.cores)

    # --- what the app and /metrics read ------------------------------------------------------------
    @property
    def num_live(self) -> int:
        return sum(c.num_live for c in self.cores)

    @property
    def stats(self) -> EngineStats:
        """The cores' latest stats, summed (speculative decoding: on if it is on anywhere)."""
        per = [c.stats for c in self.cores]
        fields = {f.name: sum(getattr(s, f.name) for s in per) for f in dataclasses.fields(EngineStats)
                  if f.name != "spec_decode"}
        return EngineStats(spec_decode=any(s.spec_decode for s in per), **fields)

    def render_metrics(self, model_name: str) -> str:
        shares = tuple(EngineShare(i, self.routed[i], c.load, c.stats.prefix_hits, c.stats.prefix_queries)
                       for i, c in enumerate(self.cores))
        return self.metrics.render(self.stats, model_name, shares)
