"""Engine arguments (what the user asks for) and the resolved configuration (what the engine runs with).

`EngineArgs` holds exactly what the user passed, validated. `ModelConfig` (nanovllm/model_config.py) is parsed
from the checkpoint's config.json. `EngineConfig` joins the two with everything resolved ("auto" device and
dtype, defaults that depend on the model); runtime facts learned later (the number of KV blocks) live in the
runner.
"""
from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass

import torch

from nanovllm.distributed.nodes import NodeConfig, validate_node_args
from nanovllm.layers.quantization import SUPPORTED as QUANTIZATION_METHODS
from nanovllm.layers.quantization import QuantizationConfig, resolve_quantization
from nanovllm.model_config import ModelConfig

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
           "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "half": torch.float16,
           "float": torch.float32}
# kv_cache_dtype values (vLLM's names) other than "auto" (the model dtype)
KV_CACHE_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn}


@dataclass(frozen=True)
class EngineArgs:
    model: str
    tokenizer: str | None = None
    device: str = "auto"
    dtype: str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    kvcache_block_size: int = 256
    num_kvcache_blocks: int | None = None
    gpu_memory_utilization: float = 0.9
    enforce_eager: bool = False
    enable_prefix_caching: bool = True
    load_format: str = "auto"
    tensor_parallel_size: int = 1
    seed: int = 0
    attention_backend: str = "auto"
    async_scheduling: bool | None = None
    scheduling_policy: str = "auto"
    revision: str | None = None            # of a Hugging Face model id (a branch, tag or commit)
    tokenizer_revision: str | None = None
    download_dir: str | None = None        # Hugging Face cache directory (default: huggingface_hub's)
    trust_remote_code: bool = False        # accepted for vLLM scripts; no remote code ever runs
    quantization: str | None = None
    kv_cache_dtype: str = "auto"
    speculative_config: dict | None = None  # speculative decoding (vLLM's dict; see SpeculativeConfig)
    kv_events_config: dict | KVEventsConfig | None = None  # KV-cache events (vLLM's dict; see KVEventsConfig)
    # multi-node tensor parallelism (distributed/nodes.py); None: one node
    nnodes: int | None = None
    node_rank: int | None = None
    master_addr: str | None = None         # the leader's (node 0's) address
    master_port: int | None = None         # its rendezvous port (default 29501)

    @classmethod
    def from_kwargs(cls, model: str, **kwargs) -> EngineArgs:
        """Build from keyword arguments; an unknown name is a TypeError that names it."""
        names = {f.name for f in dataclasses.fields(cls)} - {"model"}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise TypeError(f"unknown engine argument(s) {', '.join(map(repr, unknown))}; "
                            f"valid: {', '.join(sorted(names))}")
        return cls(model=model, **kwargs)

    def __post_init__(self):
        def need(name, ok, what):
            if not ok:
                raise ValueError(f"{name} must be {what}, got {getattr(self, name)!r}")

        def int_arg(name, lo, allow_none=False):
            v = getattr(self, name)
            if v is None and allow_none:
                return
            if not isinstance(v, int) or isinstance(v, bool):
                raise TypeError(f"{name} must be an int, got {type(v).__name__} {v!r}")
            need(name, v >= lo, f">= {lo}")

        if not isinstance(self.model, (str, os.PathLike)):
            raise TypeError(f"model must be a path string, got {type(self.model).__name__} {self.model!r}")
        for name in ("revision", "tokenizer_revision", "download_dir", "tokenizer"):
            v = getattr(self, name)
            if v is not None and not isinstance(v, (str, os.PathLike)):
                raise TypeError(f"{name} must be a string, got {type(v).__name__} {v!r}")
        if not isinstance(self.trust_remote_code, bool):
            raise TypeError(f"trust_remote_code must be a bool, got {self.trust_remote_code!r}")
        for name in ("device", "dtype", "kv_cache_dtype"):
            if not isinstance(getattr(self, name), str):
                raise TypeError(f"{name} must be a string, got {type(getattr(self, name)).__name__} "
                                f"{getattr(self, name)!r}")
        need("device", self.device in ("auto", "cpu", "cuda") or re.fullmatch(r"cuda:\d+", self.device) is not None,
             "'auto', 'cpu', 'cuda' or 'cuda:N'")
        need("dtype", self.dtype == "auto" or self.dtype in _DTYPES,
             "'auto', 'float32', 'bfloat16' or 'float16'")
        int_arg("max_model_len", 1, allow_none=True)
        int_arg("max_num_seqs", 1)
        int_arg("max_num_batched_tokens", 1, allow_none=True)
        int_arg("kvcache_block_size", 16)
        need("kvcache_block_size", self.kvcache_block_size % 16 == 0, "a multiple of 16")
        int_arg("num_kvcache_blocks", 1, allow_none=True)
        if not isinstance(self.gpu_memory_utilization, (int, float)) or isinstance(self.gpu_memory_utilization, bool):
            raise TypeError(f"gpu_memory_utilization must be a float, got {self.gpu_memory_utilization!r}")
        need("gpu_memory_utilization", 0.0 < self.gpu_memory_utilization <= 1.0, "in (0, 1]")
        for flag in ("enforce_eager", "enable_prefix_caching"):
            if not isinstance(getattr(self, flag), bool):
                raise TypeError(f"{flag} must be a bool, got {getattr(self, flag)!r}")
        need("load_format", self.load_format in ("auto", "dummy", "safetensors"), "'auto', 'safetensors' or 'dummy'")
        int_arg("tensor_parallel_size", 1)
        int_arg("seed", 0)
        need("attention_backend", self.attention_backend in ("auto", "torch", "triton"),
             "'auto', 'torch' or 'triton'")
        if self.async_scheduling is not None and not isinstance(self.async_scheduling, bool):
            raise TypeError(f"async_scheduling must be a bool or None, got {self.async_scheduling!r}")
        need("scheduling_policy", self.scheduling_policy in ("auto", *SCHEDULING_POLICIES),
             "'auto', " + " or ".join(map(repr, SCHEDULING_POLICIES)))
        need("quantization", self.quantization is None or self.quantization in QUANTIZATION_METHODS,
             "None or " + " or ".join(map(repr, QUANTIZATION_METHODS)))
        need("kv_cache_dtype", self.kv_cache_dtype == "auto" or self.kv_cache_dtype in KV_CACHE_DTYPES,
             "'auto', " + " or ".join(map(repr, KV_CACHE_DTYPES)))
        SpeculativeConfig.from_dict(self.speculative_config)  # raises on a bad key or value
        KVEventsConfig.from_dict(self.kv_events_config)
        validate_node_args(self.tensor_parallel_size, self.nnodes, self.node_rank, self.master_addr,
                           self.master_port)


SCHEDULING_POLICIES = ("fcfs", "balanced")  # see nanovllm.engine.scheduler
SPECULATIVE_METHODS = ("ngram",)  # see nanovllm.engine.spec
# A step that verifies drafts holds at most SPEC_MAX_STEP_TOKENS tokens (its sequences' rows plus their drafts), so
# it fits the smallest mixed-step CUDA graph (engine/cuda_graphs.py): up to about this many rows a forward pass of a
# model on an H200 costs what one row does (it is bound by reading the weights), so the drafts ride for free. The
# speculating sequences share the draft tokens that leaves (each at most k), so one sequence verifies k drafts and
# 16 verify 7 each. Speculation runs while at most SPEC_MAX_STEP_TOKENS // (1 + min(k, SPEC_MIN_DRAFTS)) sequences
# are running (vLLM's disable_by_batch_size; 32 for k >= 3): with fewer drafts each, a synchronous verification
# step costs more than it saves.
SPEC_MAX_STEP_TOKENS = 128
SPEC_MIN_DRAFTS = 3


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding, validated from vLLM's `speculative_config` dict (engine/spec/ has the design).

    method: "ngram" (prompt lookup: drafts copied from the sequence's own tokens). num_speculative_tokens: k, the
    most draft tokens a sequence verifies per step. prompt_lookup_max / prompt_lookup_min: the longest / shortest
    n-gram matched (vLLM's defaults: both 5 when neither is given, else the one given for both).
    disable_by_batch_size: no speculation in a step with more than this many running sequences (default
    SPEC_MAX_STEP_TOKENS // (1 + min(k, SPEC_MIN_DRAFTS))): a large batch is bound by compute, where drafts cost
    what they save. max_step_tokens: the most tokens (rows + drafts) a verification step holds; the speculating
    sequences share the drafts that leaves. SPEC_MAX_STEP_TOKENS, or, where disable_by_batch_size is given, enough
    for that many sequences with k drafts each (not a vLLM key: derived)."""
    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int
    prompt_lookup_min: int
    disable_by_batch_size: int
    max_step_tokens: int = SPEC_MAX_STEP_TOKENS

    KEYS = ("method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "disable_by_batch_size")

    @property
    def max_draft_tokens(self) -> int:
        """The most draft tokens one step can verify: k for each of disable_by_batch_size sequences, within the
        step's token budget (at least one row)."""
        return min(self.disable_by_batch_size * self.num_speculative_tokens, self.max_step_tokens - 1)

    @classmethod
    def from_dict(cls, d: dict | None) -> SpeculativeConfig | None:
        """Validate vLLM's dict; None stays None. A bad key or value is a ValueError (TypeError: not a dict)."""
        if d is None:
            return None
        if not isinstance(d, dict):
            raise TypeError(f"speculative_config must be a dict (or None), got {type(d).__name__} {d!r}")
        unknown = sorted(set(map(str, d)) - set(cls.KEYS))
        if unknown:
            raise ValueError(f"speculative_config has unknown key(s) {', '.join(map(repr, unknown))}; supported: "
                             f"{', '.join(cls.KEYS)}")
        method = d.get("method")
        if method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config['method'] must be one of {', '.join(map(repr, SPECULATIVE_METHODS))}"
                             f" (the supported methods), got {method!r}")

        def int_value(key, required=False):
            v = d.get(key)
            if v is None:
                if required:
                    raise ValueError(f"speculative_config needs {key!r} (an int >= 1)")
                return None
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"speculative_config[{key!r}] must be an int >= 1, got {v!r}")
            return v

        k = int_value("num_speculative_tokens", required=True)
        lo, hi = int_value("prompt_lookup_min"), int_value("prompt_lookup_max")
        if lo is None and hi is None:
            lo = hi = 5
        lo, hi = (hi if lo is None else lo), (lo if hi is None else hi)
        if lo > hi:
            raise ValueError(f"speculative_config['prompt_lookup_min'] ({lo}) must be <= prompt_lookup_max ({hi})")
        batch = int_value("disable_by_batch_size")
        if batch is None:
            batch, step_tokens = SPEC_MAX_STEP_TOKENS // (1 + min(k, SPEC_MIN_DRAFTS)), SPEC_MAX_STEP_TOKENS
        else:
            step_tokens = max(SPEC_MAX_STEP_TOKENS, batch * (1 + k))
        return cls(method=method, num_speculative_tokens=k, prompt_lookup_max=hi, prompt_lookup_min=lo,
                   disable_by_batch_size=batch, max_step_tokens=step_tokens)


KV_EVENT_PUBLISHERS = ("null", "zmq")
KV_EVENT_ENCODINGS = ("array", "map")
_ZMQ_SCHEMES = ("tcp://", "ipc://", "inproc://")


@dataclass(frozen=True)
class KVEventsConfig:
    """KV-cache events for prefix-aware routers, vLLM's `kv_events_config` / `--kv-events-config`
    (engine/kv_events.py publishes them; docs/scale-out.md has the wire format).

    enable_kv_cache_events: publish at all (default off: nothing is recorded). publisher: "zmq", or "null" (no
    events); None: "zmq" when enabled (vLLM's default). endpoint: the ZMQ PUB address, bound when it has a wildcard
    ("*", "::") or is ipc:// / inproc://, else connected to. replay_endpoint: a ROUTER address where a subscriber
    asks for the batches it missed from a sequence number (None: no replay). buffer_steps: batches kept for replay.
    hwm: the PUB socket's high-water mark (messages queued per subscriber before ZMQ drops them). max_queue_size:
    batches waiting for the publisher thread before new ones are dropped. topic: the first frame of every message.
    encoding (nanovllm's key, not vLLM's): "array", each event a positional array (vLLM's layout before its map
    encoding; every router decodes it), or "map", each event a map keyed by field name (vLLM's newer layout)."""
    enable_kv_cache_events: bool = False
    publisher: str | None = None
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""
    encoding: str = "array"

    @property
    def publishes(self) -> bool:
        return self.enable_kv_cache_events and self.publisher != "null"

    def __post_init__(self):
        def bad(key, what):
            return ValueError(f"kv_events_config[{key!r}] must be {what}, got {getattr(self, key)!r}")

        if not isinstance(self.enable_kv_cache_events, bool):
            raise bad("enable_kv_cache_events", "a bool")
        if self.publisher is not None and self.publisher not in KV_EVENT_PUBLISHERS:
            raise bad("publisher", " or ".join(map(repr, KV_EVENT_PUBLISHERS)))
        for key in ("endpoint", "replay_endpoint"):
            v = getattr(self, key)
            if v is None and key == "replay_endpoint":
                continue
            if not isinstance(v, str) or not v.startswith(_ZMQ_SCHEMES) or v in _ZMQ_SCHEMES:
                raise bad(key, "a ZMQ address such as 'tcp://*:5557' (tcp://, ipc:// or inproc://)")
        if self.replay_endpoint == self.endpoint:
            raise bad("replay_endpoint", "an address other than endpoint's")
        for key in ("buffer_steps", "hwm", "max_queue_size"):
            v = getattr(self, key)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise bad(key, "an int >= 1")
        if not isinstance(self.topic, str):
            raise bad("topic", "a string")
        if self.encoding not in KV_EVENT_ENCODINGS:
            raise bad("encoding", " or ".join(map(repr, KV_EVENT_ENCODINGS)))

    @classmethod
    def from_dict(cls, d: dict | KVEventsConfig | None) -> KVEventsConfig | None:
        """Validate vLLM's dict (a KVEventsConfig is checked when built); None stays None. A bad key or value is a
        ValueError naming it (TypeError: neither a dict nor a KVEventsConfig)."""
        if d is None or isinstance(d, KVEventsConfig):
            return d
        if not isinstance(d, dict):
            raise TypeError(f"kv_events_config must be a dict (or None), got {type(d).__name__} {d!r}")
        keys = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(map(str, d)) - set(keys))
        if unknown:
            raise ValueError(f"kv_events_config has unknown key(s) {', '.join(map(repr, unknown))}; supported: "
                             f"{', '.join(keys)}")
        return cls(**d)


def resolve_device(args: EngineArgs) -> torch.device:
    """The device `args` asks for, checked against this machine (before anything loads): CUDA must be there for
    device='cuda' and for the triton attention backend (unless Triton runs under its CPU interpreter)."""
    if args.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(args.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device={args.device!r} but CUDA is not available; use device='cpu'")
    if args.attention_backend == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("attention_backend='triton' needs a CUDA GPU (none is available here); use 'auto' or "
                         "'torch'")
    return device

# scheduling_policy="auto" picks "balanced" from this many bytes of weights per GPU: on one GPU, and under
# tensor parallelism (where a step's all-reduces grow with its tokens). Measured on an H200, balanced against
# fcfs: Qwen3-8B at TP=1 (16.4 GB) +3-5% (run 17), Qwen3-8B with FP8 weights (8.2 GB) +10% (2026-12-01, one
# call), Qwen3-0.6B (1.2 GB) -16%; Qwen3-8B at TP=2 (8.2 GB per GPU) -2% (run 17, before the last-token hold).
BALANCED_MIN_WEIGHT_BYTES = 6 << 30
BALANCED_MIN_WEIGHT_BYTES_TP = 12 << 30


def weight_bytes_per_gpu(model: ModelConfig, dtype: torch.dtype, tensor_parallel_size: int,
                         quantization: QuantizationConfig | None = None) -> float:
    """Bytes of the weights one GPU multiplies with each step (``ModelConfig.matmul_params``, sharded): with FP8
    quantization one byte per weight of the decoder's projections, the LM head in the model dtype."""
    itemsize = torch.empty(0, dtype=dtype).element_size()
    if quantization is None:
        return model.matmul_params() * itemsize / tensor_parallel_size
    head = model.vocab_size * model.hidden_size
    return ((model.matmul_params() - head) + head * itemsize) / tensor_parallel_size


def auto_scheduling_policy(model: ModelConfig, dtype: torch.dtype, tensor_parallel_size: int,
                           device: torch.device, quantization: QuantizationConfig | None = None) -> str:
    """What scheduling_policy="auto" means for this model and device (see BALANCED_MIN_WEIGHT_BYTES)."""
    per_gpu = weight_bytes_per_gpu(model, dtype, tensor_parallel_size, quantization)
    floor = BALANCED_MIN_WEIGHT_BYTES if tensor_parallel_size == 1 else BALANCED_MIN_WEIGHT_BYTES_TP
    return "balanced" if device.type == "cuda" and per_gpu >= floor else "fcfs"


@dataclass(frozen=True)
class EngineConfig:
    """Everything resolved: what the scheduler, block manager and runner are built from."""
    args: EngineArgs
    model: ModelConfig
    model_dir: str
    device: torch.device
    dtype: torch.dtype
    max_model_len: int
    max_num_batched_tokens: int
    max_num_seqs: int
    block_size: int
    attention_backend: str
    async_scheduling: bool
    scheduling_policy: str
    quantization: QuantizationConfig | None = None   # FP8 weights (online or the checkpoint's), or None
    kv_cache_dtype: torch.dtype | None = None        # the KV cache's element type; None: the model dtype

    @property
    def cache_dtype(self) -> torch.dtype:
        """The KV cache's element type: float8_e4m3fn (with per-(token, head) scales), or the model dtype."""
        return self.dtype if self.kv_cache_dtype is None else self.kv_cache_dtype
    speculative: SpeculativeConfig | None = None
    kv_events: KVEventsConfig | None = None          # None: no KV-cache events (not enabled, or publisher "null")
    nodes: NodeConfig = NodeConfig()                 # where the tensor-parallel ranks run (one node by default)

    @classmethod
    def resolve(cls, args: EngineArgs) -> EngineConfig:
        device = resolve_device(args)
        from nanovllm.utils.hub import resolve_model_dir
        model_dir = resolve_model_dir(args.model, args.revision, args.download_dir)
        mcfg = ModelConfig.from_dir(model_dir)
        from nanovllm.models.registry import check_supported
        check_supported(mcfg)

        if args.dtype != "auto":
            dtype = _DTYPES[args.dtype]
        elif device.type == "cpu":
            dtype = torch.float32
        else:
            dtype = _DTYPES.get(str(mcfg.torch_dtype), torch.bfloat16)
            if dtype == torch.float32:
                dtype = torch.bfloat16
        if device.type == "cpu" and dtype == torch.float16:
            raise ValueError("dtype='float16' is not supported on CPU; use 'float32' or 'bfloat16'")

        if args.max_model_len is None:
            max_model_len = mcfg.max_position_embeddings
        else:
            if args.max_model_len > mcfg.max_position_embeddings:
                raise ValueError(f"max_model_len={args.max_model_len} exceeds the model's "
                                 f"max_position_embeddings={mcfg.max_position_embeddings}")
            max_model_len = args.max_model_len

        max_batched = args.max_num_batched_tokens
        if max_batched is None:
            max_batched = 8192 if device.type == "cuda" else 2048
        # every running sequence needs at least one token of each step's budget
        max_num_seqs = min(args.max_num_seqs, max_batched)

        quant = resolve_quantization(args.quantization, mcfg.raw.get("quantization_config"))
        kv_dtype = KV_CACHE_DTYPES.get(args.kv_cache_dtype)
        if (quant is not None or kv_dtype is not None) and device.type == "cuda":
            major, minor = torch.cuda.get_device_capability(device)
            if (major, minor) < (8, 9):
                what = "FP8 weights" if quant is not None else f"kv_cache_dtype={args.kv_cache_dtype!r}"
                raise ValueError(f"{what} need a GPU with FP8 support (compute capability 8.9+, e.g. L4, H100, "
                                 f"H200); this one is {major}.{minor}")

        backend = args.attention_backend
        if backend == "auto":
            backend = "triton" if device.type == "cuda" else "torch"
        if args.tensor_parallel_size != 1:
            from nanovllm.distributed import check_tp_supported
            check_tp_supported(args.tensor_parallel_size, mcfg, device, nnodes=args.nnodes or 1)
        # schedule step N+1 while step N runs: pays off when the device runs asynchronously to the host
        # (one rank, or tensor parallel: TPExecutor.launch keeps a step queued on every rank)
        async_sched = args.async_scheduling
        if async_sched is None:
            async_sched = device.type == "cuda"
        policy = args.scheduling_policy
        if policy == "auto":
            # balanced pays where a decode step is bound by reading the weights (prefill rows ride along in those
            # steps), i.e. a large model per GPU; with less per GPU the per-step costs it adds win. The server
            # asks for fcfs (time to first token).
            policy = auto_scheduling_policy(mcfg, dtype, args.tensor_parallel_size, device, quant)
        kv_events = KVEventsConfig.from_dict(args.kv_events_config)
        return cls(args=args, model=mcfg, model_dir=model_dir, device=device, dtype=dtype,
                   max_model_len=max_model_len, max_num_batched_tokens=max_batched,
                   max_num_seqs=max_num_seqs, block_size=args.kvcache_block_size, attention_backend=backend,
                   async_scheduling=async_sched, scheduling_policy=policy, quantization=quant,
                   kv_cache_dtype=kv_dtype, speculative=SpeculativeConfig.from_dict(args.speculative_config),
                   kv_events=kv_events if kv_events is not None and kv_events.publishes else None,
                   nodes=NodeConfig.from_args(args, os.environ))
