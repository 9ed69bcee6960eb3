"""Which node this process is and where its ranks are: multi-node tensor parallelism's layout, resolved.

`tensor_parallel_size` ranks are spread evenly over `nnodes` nodes, node k holding global ranks
``k * per_node .. (k + 1) * per_node - 1`` (its local ranks 0 .. per_node - 1, one GPU each). Node 0 is the
leader: the engine (scheduler, driver), the API server and ranks 0 .. per_node - 1. Every other node runs only
workers (``nanovllm serve --headless``). One nanovllm process per node starts that node's ranks itself.

The values come from EngineArgs (``--nnodes --node-rank --master-addr --master-port``); the command line fills
what was not given from the environment that LeaderWorkerSet and torchrun set (`node_kwargs_from_env`).
"""
from __future__ import annotations

from dataclasses import dataclass

DEFAULT_MASTER_PORT = 29501  # vLLM's

# EngineArgs field -> the environment variables that give it when the flag is not given, first found wins:
# LeaderWorkerSet's (one pod per node), then torchrun's (launched with --nproc-per-node 1: one process per node,
# so WORLD_SIZE counts nodes and RANK is the node's rank)
ENV_SOURCES = {
    "nnodes": ("LWS_GROUP_SIZE", "WORLD_SIZE"),
    "node_rank": ("LWS_WORKER_INDEX", "RANK"),
    "master_addr": ("LWS_LEADER_ADDRESS", "MASTER_ADDR"),
    "master_port": ("MASTER_PORT",),
}


def node_kwargs_from_env(given: dict, env) -> dict:
    """The node arguments (nnodes, node_rank, master_addr, master_port) missing from `given` (the flags), taken
    from `env`. A bad value is a ValueError naming the variable; so is a torchrun launch of several processes per
    node (LOCAL_RANK / LOCAL_WORLD_SIZE other than 0 / 1): nanovllm starts a node's ranks itself."""
    for var, want in (("LOCAL_RANK", "0"), ("LOCAL_WORLD_SIZE", "1")):
        v = env.get(var)
        if v is not None and v.strip() != want:
            raise ValueError(f"${var}={v}: run one nanovllm process per node (torchrun --nproc-per-node 1); it "
                             f"starts the node's tensor_parallel_size / nnodes ranks itself")
    out = {}
    for name, variables in ENV_SOURCES.items():
        if given.get(name) is not None:
            continue
        var = next((v for v in variables if env.get(v, "").strip()), None)
        if var is None:
            continue
        text = env[var].strip()
        if name == "master_addr":
            out[name] = text
            continue
        try:
            out[name] = int(text)
        except ValueError:
            raise ValueError(f"${var}={text!r} (for {name}) is not an integer") from None
    return out


def env_source(name: str, given: dict, env) -> str:
    """Where a node argument came from, for error messages: '--node-rank', or '$LWS_WORKER_INDEX'."""
    if given.get(name) is not None:
        return "--" + name.replace("_", "-")
    var = next((v for v in ENV_SOURCES[name] if env.get(v, "").strip()), None)
    return f"${var}" if var else "--" + name.replace("_", "-")


def validate_node_args(tp: int, nnodes: int | None, node_rank: int | None, master_addr: str | None,
                       master_port: int | None) -> None:
    """Raise ValueError / TypeError naming the bad value (called by EngineArgs)."""
    for name, v in (("nnodes", nnodes), ("node_rank", node_rank), ("master_port", master_port)):
        if v is not None and (not isinstance(v, int) or isinstance(v, bool)):
            raise TypeError(f"{name} must be an int, got {type(v).__name__} {v!r}")
    if master_addr is not None and (not isinstance(master_addr, str) or not master_addr.strip()):
        raise ValueError(f"master_addr must be a host name or address, got {master_addr!r}")
    n = 1 if nnodes is None else nnodes
    rank = 0 if node_rank is None else node_rank
    if n < 1:
        raise ValueError(f"nnodes must be >= 1, got {n}")
    if not 0 <= rank < n:
        raise ValueError(f"node_rank must be in 0..nnodes-1 = 0..{n - 1}, got {rank}")
    if master_port is not None and not 1 <= master_port <= 65535:
        raise ValueError(f"master_port must be in 1..65535, got {master_port}")
    if n > 1:
        if tp % n:
            raise ValueError(f"tensor_parallel_size={tp} is not divisible by nnodes={n}: every node runs "
                             f"tensor_parallel_size / nnodes ranks")
        if rank > 0 and master_addr is None:
            raise ValueError(f"node_rank={rank} needs master_addr, the leader's (node 0's) address "
                             f"(--master-addr, or $LWS_LEADER_ADDRESS / $MASTER_ADDR)")


@dataclass(frozen=True)
class NodeConfig:
    """The resolved layout (part of EngineConfig, so every rank has it)."""
    tensor_parallel_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = DEFAULT_MASTER_PORT
    use_agent_store: bool = False  # under torchrun: its agent hosts the store at master_addr:master_port
    # the namespace of this run's keys in that store: torchrun keeps its store across restarts of the workers
    store_prefix: str = "nanovllm/0"

    @classmethod
    def from_args(cls, args, env=None) -> NodeConfig:
        """From EngineArgs (already validated). `env`: only torchrun's TORCHELASTIC_USE_AGENT_STORE and
        TORCHELASTIC_RESTART_COUNT are read from it."""
        env = env or {}
        return cls(tensor_parallel_size=args.tensor_parallel_size, nnodes=args.nnodes or 1,
                   node_rank=args.node_rank or 0, master_addr=args.master_addr or "127.0.0.1",
                   master_port=args.master_port or DEFAULT_MASTER_PORT,
                   use_agent_store=env.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
                   store_prefix=f"nanovllm/{env.get('TORCHELASTIC_RESTART_COUNT', '0')}")

    @property
    def multinode(self) -> bool:
        return self.nnodes > 1

    @property
    def ranks_per_node(self) -> int:
        return self.tensor_parallel_size // self.nnodes

    def ranks(self, node: int) -> range:
        """The global ranks on `node`."""
        k = self.ranks_per_node
        return range(node * k, (node + 1) * k)

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node

    @property
    def remote_ranks(self) -> tuple[int, ...]:
        """The ranks not on the leader: they get their steps from rank 0 through torch.distributed."""
        return tuple(range(self.ranks_per_node, self.tensor_parallel_size))

    def describe(self, node: int) -> str:
        ranks = self.ranks(node)
        return f"node {node} (rank{'s' if len(ranks) > 1 else ''} {ranks[0]}" + \
            (f"-{ranks[-1]})" if len(ranks) > 1 else ")")

    def headless_command(self, node: int) -> str:
        return (f"nanovllm serve MODEL --headless --tensor-parallel-size {self.tensor_parallel_size} --nnodes "
                f"{self.nnodes} --node-rank {node} --master-addr {self.master_addr} --master-port "
                f"{self.master_port}")
