"""The model runner owns the model, its KV cache and the sampler, and turns a StepBatch into tokens."""
from __future__ import annotations

import bisect
import logging
import os
import time
from dataclasses import dataclass, replace

import torch

from nanovllm.attention.backend import AttentionMetadata, OutputRows, get_attention_backend
from nanovllm.config import EngineConfig, weight_bytes_per_gpu
from nanovllm.distributed.group import TPGroup
from nanovllm.engine.batch import SamplingBatch, StepBatch
from nanovllm.engine.step_inputs import Layout, Staging
from nanovllm.engine.step_timer import StepProfiler, StepTimer
from nanovllm.layers.attention import Attention
from nanovllm.layers.sampler import Sampler, SamplerOutput, SamplingTensors
from nanovllm.models.loader import init_dummy, load_safetensors
from nanovllm.models.registry import build_model
from nanovllm.utils.env import env_switch

logger = logging.getLogger(__name__)

CPU_KV_CACHE_BYTES = 2 << 30  # default KV budget on CPU when num_kvcache_blocks is not given
MIXED_MAX_TOKENS = 512  # the largest mixed-step graph (the balanced scheduler's step sizes)
PREFILL_GRAPH_MAX_WEIGHT_BYTES = 4 << 30  # below this per GPU, large prefill steps may replay graphs too


@dataclass
class StepResult:
    """What one step produced, on the host, row by row over the batch's sample_rows."""
    token_ids: list[int]
    logprobs: list[float] | None = None
    top_ids: list[list[int]] | None = None
    top_logprobs: list[list[float]] | None = None


class ModelRunner:
    def __init__(self, config: EngineConfig, tp: TPGroup | None = None):
        self.config = config
        self.tp = tp or TPGroup()
        self.device = config.device
        self.dtype = config.dtype
        self.block_size = config.block_size
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device if self.device.index is not None else self.tp.rank)
            self.device = torch.device("cuda", torch.cuda.current_device())
            blas = os.environ.get("NANOVLLM_BLAS")  # for A/B runs: cublas | cublaslt (torch's process-wide choice)
            if blas:
                if blas not in ("cublas", "cublaslt"):
                    raise ValueError(f"NANOVLLM_BLAS must be 'cublas' or 'cublaslt', got {blas!r}")
                torch.backends.cuda.preferred_blas_library(blas)
            if self.tp.size > 1:
                self.tp = replace(self.tp, reducer=self._make_reducer())
        t0 = time.perf_counter()
        self.model = self._load_model()
        self.load_seconds = time.perf_counter() - t0
        self.backend = get_attention_backend(config.attention_backend)
        # under TP the sampler gets this rank's logits slice and gathers only what the step needs
        self.sampler = Sampler(vocab_shard=self.model.lm_head.vocab_shard() if self.tp.size > 1 else None)
        self.attn_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        if config.attention_backend == "triton" and self.device.type == "cuda":
            self._install_fused_ops()
        self.staging = Staging(self.device)
        # prefill steps run the last layer for the sampled rows only (NANOVLLM_TRIM_LAST_LAYER=0: every row)
        self.trim_last_layer = env_switch("NANOVLLM_TRIM_LAST_LAYER")
        # decode attention launches the longest sequences first (NANOVLLM_DECODE_ORDER=0: batch order)
        self.decode_order = env_switch("NANOVLLM_DECODE_ORDER")
        # CUDA graphs: per (layer shape, graph batch size) the fastest GEMM (NANOVLLM_GEMM_PLAN=0: torch's default)
        self.use_gemm_plan = env_switch("NANOVLLM_GEMM_PLAN")
        self.timer = StepTimer.from_env(self.device, self.tp.rank)
        self.profilers = StepProfiler.from_env(self.device, self.tp.rank)
        # the latest step's sampled ids, read on the device by the next step's placeholder inputs
        self.sampled_buf = torch.zeros(max(config.max_num_seqs, 1), dtype=torch.int64, device=self.device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.graph_sizes: list[int] = []
        self.mixed_sizes = mixed_graph_sizes(config)
        # every non-decode step size with a graph: the mixed sizes, then the large prefill steps' (small models)
        self.step_graph_sizes = self.mixed_sizes + prefill_graph_sizes(config)
        self.mixed_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        # mixed graphs: the varlen kernel on a fixed grid looping over the chunks' tiles, not one program per
        # possible tile of the graph's hundreds of sequences (NANOVLLM_PREFILL_PERSISTENT=0: the latter)
        self.mixed_prefill_persistent = env_switch("NANOVLLM_PREFILL_PERSISTENT")
        # mixed graphs: the LM head on the step's sampled rows only, after the replay (NANOVLLM_MIXED_LM_TRIM=0:
        # on every row of the graph, as inside it before)
        self.mixed_lm_trim = env_switch("NANOVLLM_MIXED_LM_TRIM")
        t0 = time.perf_counter()
        self.num_kvcache_blocks = self._allocate_kv_cache()  # (its warm-up steps run eagerly: no graphs yet)
        self.kv_seconds = time.perf_counter() - t0  # KV sizing, incl. the warm-up steps' kernel compiles
        self.capture_seconds = self.gemm_plan_seconds = 0.0
        self.gemm_plan: dict = {}
        if self.device.type == "cuda" and not config.args.enforce_eager:
            max_bs = min(config.max_num_seqs, 512)
            self.graph_sizes = sorted({b for b in (1, 2, 4, 8, *range(16, max_bs + 1, 16)) if b <= max_bs} | {max_bs})
            if self.use_gemm_plan:
                from nanovllm.engine.gemm_plan import describe, plan_gemms
                t0 = time.perf_counter()
                self.gemm_plan = plan_gemms(self.model, sorted(set(self.graph_sizes) | set(self.mixed_sizes)),
                                            use_triton=config.attention_backend == "triton")
                self.gemm_plan_seconds = time.perf_counter() - t0
                logger.info("GEMM plan (%.1fs): %s", self.gemm_plan_seconds, describe(self.gemm_plan))
            t0 = time.perf_counter()
            self._capture_cudagraphs()
            self.capture_seconds = time.perf_counter() - t0

    # --- setup -------------------------------------------------------------------------------------
    def _load_model(self):
        cfg = self.config
        prev = torch.get_default_dtype()
        torch.set_default_dtype(cfg.dtype)
        try:
            with torch.device(self.device):
                model = build_model(cfg.model, self.tp)
        finally:
            torch.set_default_dtype(prev)
        # buffers computed in float32 (RoPE tables) stay float32
        if cfg.args.load_format == "dummy":
            init_dummy(model, cfg.args.seed + self.tp.rank)
        else:
            load_safetensors(model, cfg.model_dir)
        return model.eval().requires_grad_(False)

    def _make_reducer(self):
        """The symmetric-memory all-reduce for the row-parallel layers (collective: every rank builds it here),
        sized for the largest forward: a full token budget, or the largest CUDA-graph batch."""
        from nanovllm.distributed.symm_allreduce import SymmMemAllReduce
        cfg = self.config
        rows = max(cfg.max_num_batched_tokens, cfg.max_num_seqs)
        return SymmMemAllReduce.maybe_create(self.tp.group, self.tp.rank, self.tp.size,
                                             rows * cfg.model.hidden_size, self.dtype, self.device)

    def _install_fused_ops(self) -> None:
        """Swap the torch reference ops for their Triton kernels (norms, RoPE, SiLU-and-mul, sampling), and fuse
        each attention layer's QK-norm + RoPE + KV-cache store into one kernel (the layer then only attends)."""
        from nanovllm import kernels
        from nanovllm.layers.layernorm import RMSNorm
        from nanovllm.layers.rotary import RotaryEmbedding
        from nanovllm.models.decoder import DecoderMLP, install_fused_qkv
        ops = kernels.TritonOps()
        for m in self.model.modules():
            if isinstance(m, (RMSNorm, RotaryEmbedding)):
                m.fused = ops
            elif isinstance(m, DecoderMLP):
                m.act = ops.silu_and_mul
        install_fused_qkv(self.model, ops.qkv_norm_rope_store)
        self.sampler.fused_sample = ops.sample
        self.sampler.fused_partial = ops.sample_partial

    def kv_bytes_per_block(self) -> int:
        m = self.config.model
        a = self.attn_layers[0]
        itemsize = torch.empty(0, dtype=self.dtype).element_size()
        return 2 * m.num_layers * self.block_size * a.num_kv_heads * a.head_dim * itemsize

    def _allocate_kv_cache(self) -> int:
        cfg = self.config
        per_block = self.kv_bytes_per_block()
        if cfg.args.num_kvcache_blocks is not None:
            num_blocks = cfg.args.num_kvcache_blocks
        elif self.device.type == "cuda":
            num_blocks = self._profile_num_blocks(per_block)
            self._warmup_forward([1, 2, 3][:cfg.max_num_seqs])  # the short-chunk prefill variant, compiled now
        else:
            want = -(-cfg.max_model_len // self.block_size) * cfg.max_num_seqs
            num_blocks = max(1, min(want, CPU_KV_CACHE_BYTES // per_block))
        num_blocks = self._agree_num_blocks(num_blocks)
        if num_blocks * self.block_size < cfg.max_model_len:
            raise ValueError(
                f"the KV cache holds {num_blocks} blocks x {self.block_size} tokens = {num_blocks * self.block_size} "
                f"tokens, fewer than max_model_len={cfg.max_model_len}: lower max_model_len, or raise "
                f"num_kvcache_blocks / gpu_memory_utilization")
        a = self.attn_layers[0]
        shape = (2, len(self.attn_layers), num_blocks, self.block_size, a.num_kv_heads, a.head_dim)
        self.kv_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        for i, layer in enumerate(self.attn_layers):
            layer.k_cache, layer.v_cache = self.kv_cache[0, i], self.kv_cache[1, i]
            layer.backend = self.backend
        return num_blocks

    def _agree_num_blocks(self, n: int) -> int:
        """All ranks must use the same block count: take the minimum."""
        if self.tp.size == 1:
            return n
        import torch.distributed as dist
        t = torch.tensor([n], device=self.device if self.device.type == "cuda" else "cpu")
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.tp.group)
        return int(t.item())

    @torch.inference_mode()
    def _profile_num_blocks(self, per_block: int) -> int:
        """Run the largest batch once, see its activation peak, give what is left under the budget to KV."""
        cfg = self.config
        n = cfg.max_num_batched_tokens
        n_seqs = max(1, min(cfg.max_num_seqs, -(-n // cfg.max_model_len)))
        lens = [n // n_seqs] * n_seqs
        lens[-1] += n - sum(lens)
        torch.cuda.empty_cache()
        self._warmup_forward(lens)
        # the activation memory of that pass stays reserved by torch's allocator (counted as used below), so
        # real steps reuse it instead of allocating afresh
        free, total = torch.cuda.mem_get_info()
        budget = total * cfg.args.gpu_memory_utilization - (total - free)
        return max(0, int(budget) // per_block)

    @torch.inference_mode()
    def _warmup_forward(self, lens: list[int]) -> None:
        """One step through the real eager path (packed inputs, forward, logits, sampling) for sequences of
        these lengths over a throwaway KV cache: sizes the activation memory and compiles the kernels that
        real steps of those shapes use."""
        bs = self.block_size
        blocks = [-(-n // bs) for n in lens]
        a = self.attn_layers[0]
        cache = torch.zeros(2, sum(blocks), bs, a.num_kv_heads, a.head_dim, dtype=self.dtype, device=self.device)
        saved = [(layer.k_cache, layer.v_cache) for layer in self.attn_layers]
        for layer in self.attn_layers:
            layer.k_cache, layer.v_cache, layer.backend = cache[0], cache[1], self.backend
        tables, slots, positions, cu, first = [], [], [], [0], 0
        for n, nb in zip(lens, blocks):
            tables.append(list(range(first, first + nb)))
            slots.extend(range(first * bs, first * bs + n))
            positions.extend(range(n))
            cu.append(cu[-1] + n)
            first += nb
        S = len(lens)
        batch = StepBatch(
            input_ids=[0] * cu[-1], positions=positions, slot_mapping=slots, cu_seqlens_q=cu, seq_lens=list(lens),
            block_tables=tables, max_seqlen_q=max(lens), is_decode=False, sample_rows=list(range(S)),
            sampling=SamplingBatch(temperatures=[1.0] * S, top_ks=[0] * S, top_ps=[1.0] * S, min_ps=[0.0] * S,
                                   seeds=list(range(S)), steps=[0] * S, logprobs=[None] * S))
        self.launch(batch).result()
        for layer, (k, v) in zip(self.attn_layers, saved):
            layer.k_cache, layer.v_cache = k, v
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    # --- CUDA graphs (decode) -----------------------------------------------------------------------
    @torch.inference_mode()
    def _capture_cudagraphs(self) -> None:
        """One graph per decode batch size: forward and logits, reading the step's packed inputs in place.

        A batch of n sequences replays the smallest graph of size >= n; the padded rows have slot -1 and
        sequence length 0, which every attention backend treats as "skip"."""
        cfg = self.config
        max_bs = self.graph_sizes[-1]
        self.graph_width = -(-cfg.max_model_len // self.block_size)
        self.graph_layouts = {bs: Layout.make(bs, bs, self.graph_width, bs) for bs in self.graph_sizes}
        # mixed graphs: R token rows of up to min(R, max_num_seqs) sequences, all of which may sample
        self.mixed_layouts = {r: Layout.make(r, min(r, cfg.max_num_seqs), self.graph_width, min(r, cfg.max_num_seqs))
                              for r in self.step_graph_sizes}
        nbytes = max(lay.nbytes for lay in [*self.graph_layouts.values(), *self.mixed_layouts.values()])
        self.g_stage = torch.zeros(nbytes, dtype=torch.uint8, device=self.device)
        self.g_cu = torch.arange(max_bs + 1, dtype=torch.int32, device=self.device)
        self.g_logits: dict[int, torch.Tensor] = {}
        self.m_hidden: dict[int, torch.Tensor] = {}
        pool = None
        # largest first, all in one memory pool; the staging bytes are zeros here (every sequence empty)
        kinds = ((self.mixed_graphs, self.m_hidden, self.mixed_layouts, self._mixed_forward, self.step_graph_sizes),
                 (self.graphs, self.g_logits, self.graph_layouts, self._graph_forward, self.graph_sizes))
        for graphs, outputs, layouts, forward, sizes in kinds:
            for size in reversed(sizes):
                v = layouts[size].views(self.g_stage)
                forward(size, v)  # warm up
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool):
                    outputs[size] = forward(size, v)
                pool = graph.pool()
                graphs[size] = graph
                torch.cuda.synchronize()

    def _graph_forward(self, bs: int, v: dict) -> torch.Tensor:
        meta = AttentionMetadata(v["slots"], self.g_cu[:bs + 1], v["seq_lens"], v["tables"].view(bs, self.graph_width),
                                 max_seqlen_q=1, is_decode=True,
                                 decode_order=v["order"] if self.decode_order else None)
        return self.model.compute_logits(self.model(self._input_ids(v), v["pos"], meta),
                                         gather=self.tp.size == 1)                    # (bs, V | shard)

    def _mixed_forward(self, rows: int, v: dict) -> torch.Tensor:
        """A mixed step (prefill chunks and decode rows) of up to `rows` tokens: the one-token sequences attend
        through the decode kernel, the chunks through the varlen kernel (AttentionMetadata); the final hidden
        states of the sampled rows (`last`, padded with row 0). The LM head runs outside the graph, on the step's
        sampled rows only: early in a balanced run a step samples a few dozen of the graph's 256 rows."""
        B = self.mixed_layouts[rows].B
        meta = AttentionMetadata(v["slots"], v["cu"], v["seq_lens"], v["tables"].view(B, self.graph_width),
                                 max_seqlen_q=rows, is_decode=False, decode_lens=v["dec_lens"],
                                 prefill_cu=v["cu_pre"], decode_splits=self._decode_splits(B),
                                 # (a large step's chunks fill the old grid: one program per tile)
                                 prefill_persistent=self.mixed_prefill_persistent and rows <= MIXED_MAX_TOKENS,
                                 decode_order=v["order"] if self.decode_order else None)
        return self.model(self._input_ids(v), v["pos"], meta)[v["last"]]              # (B, hidden)

    def _input_ids(self, v: dict) -> torch.Tensor:
        """The step's token ids, with each placeholder (async scheduling) read from the previous step's sampled
        ids on the device."""
        return torch.where(v["src"] >= 0, self.sampled_buf[v["src"].clamp(min=0)], v["ids"])

    # --- one step ----------------------------------------------------------------------------------
    def _sampling_from(self, v: dict, sb: SamplingBatch) -> SamplingTensors:
        S = len(sb.temperatures)
        greedy = [t == 0.0 for t in sb.temperatures]
        asked = [k for k in sb.logprobs if k is not None]
        banned = None
        if sb.banned:
            if v["banned_rows"].numel() == len(sb.banned):
                banned = v["banned_rows"], v["banned_tokens"]
            else:  # a CUDA graph's staging layout has no room for them: a separate small copy
                pairs = torch.tensor(sb.banned, dtype=torch.int32).T.contiguous().to(self.device, non_blocking=True)
                banned = pairs[0], pairs[1]
        return SamplingTensors(
            temperatures=v["temps"][:S], top_ks=v["top_ks"][:S], top_ps=v["top_ps"][:S], min_ps=v["min_ps"][:S],
            seeds=v["seeds"][:S], steps=v["steps"][:S],
            banned_rows=banned[0] if banned else None, banned_tokens=banned[1] if banned else None,
            all_greedy=all(greedy), any_greedy=any(greedy),
            need_top_k=any(k > 0 for k in sb.top_ks), need_top_p=any(p < 1.0 for p in sb.top_ps),
            need_min_p=any(p > 0.0 for p in sb.min_ps), max_logprobs=max(asked) if asked else None)

    @torch.inference_mode()
    def launch(self, batch: StepBatch, prev: PendingStep | None = None) -> PendingStep:
        """Enqueue one step on the device and return at once; `.result()` waits for the sampled ids.

        Placeholder inputs (async scheduling) read the previous step's sampled ids, which stay on the device
        in `sampled_buf`."""
        if self.model is None:
            raise RuntimeError("the model runner has been shut down")
        n, S = batch.num_seqs, len(batch.sample_rows)
        for p in self.profilers:
            p.before(batch.is_decode)
        started = self.timer.start() if self.timer is not None else None
        pending = self._launch(batch, n, S)
        if started is not None:
            self.timer.end(started, n, batch.num_tokens, batch.is_decode)
        for p in self.profilers:
            p.after(batch.is_decode)
        return pending

    def _launch(self, batch: StepBatch, n: int, S: int) -> PendingStep:
        if batch.is_decode and self.graphs and n <= self.graph_sizes[-1]:
            bs = self.graph_sizes[bisect.bisect_left(self.graph_sizes, n)]
            v = self.staging.upload(batch, self.graph_layouts[bs], self.g_stage)
            self.graphs[bs].replay()
            logits = self.g_logits[bs][:n]                                     # (B, vocab | shard); all sample
        elif S and self.mixed_graphs and batch.num_tokens <= self.step_graph_sizes[-1]:
            rows = self.step_graph_sizes[bisect.bisect_left(self.step_graph_sizes, batch.num_tokens)]
            v = self.staging.upload(batch, self.mixed_layouts[rows], self.g_stage)
            self.mixed_graphs[rows].replay()
            hidden = self.m_hidden[rows][:S] if self.mixed_lm_trim else self.m_hidden[rows]
            logits = self.model.compute_logits(hidden, gather=self.tp.size == 1)[:S]  # (S, vocab | shard)
        else:
            width = max((len(t) for t in batch.block_tables), default=1)
            v = self.staging.upload(batch, Layout.make(batch.num_tokens, n, width, S, len(batch.sampling.banned)))
            # (the launch order is packed for every step; only the decode kernel reads it)
            meta = AttentionMetadata(v["slots"], v["cu"], v["seq_lens"], v["tables"].view(n, width),
                                     max_seqlen_q=batch.max_seqlen_q, is_decode=batch.is_decode,
                                     decode_order=v["order"] if self.decode_order else None)
            if batch.num_decode and not batch.is_decode:
                # the one-token sequences through the decode kernel with the mixed graphs' options (one KV split,
                # the launch order), whose variant is compiled at their capture: another (a split count varying
                # with the step, or no order) would compile mid-run, ~0.6 s (benchmarks/RESULTS.md run 18)
                meta.decode_lens, meta.prefill_cu, meta.decode_splits = v["dec_lens"], v["cu_pre"], 1
            ids = self._input_ids(v) if batch.placeholder_pos else v["ids"]
            if not S:
                self.model(ids, v["pos"], meta)                                # fills the KV cache; nothing samples
                return PendingStep(sampled=None, rank=self.tp.rank)
            if self.trim_last_layer and S < batch.num_tokens:
                # only the sampled rows' hidden states are used: the last layer stores every row's K/V, then
                # attends (one query per sampled row) and runs its MLP for those rows alone
                seqs = v["sample_seqs"]
                # (one-token queries through the varlen kernel: its variant for short queries is compiled at
                # start-up, where the decode kernel's split count would vary with each step's rows)
                rows = OutputRows(v["last"], AttentionMetadata(
                    v["slots"][:0], torch.arange(S + 1, dtype=torch.int32, device=self.device),
                    meta.seq_lens[seqs], meta.block_tables[seqs], max_seqlen_q=1, is_decode=False))
                hidden = self.model(ids, v["pos"], meta, rows)                 # (S, hidden)
            else:
                hidden = self.model(ids, v["pos"], meta)[v["last"]]            # (T, hidden) -> (S, hidden)
            logits = self.model.compute_logits(hidden, gather=self.tp.size == 1)  # (S, vocab | shard)
        # sampling is a pure function of the full logits and the seeds; under TP every rank holds its vocabulary
        # shard and the sampler exchanges per-row partials (or gathers the logits), so every rank samples the same
        # ids: each keeps them on its device for the next step's placeholder inputs
        out = self.sampler(logits, self._sampling_from(v, batch.sampling))
        self.sampled_buf[:S].copy_(out.token_ids)
        if self.tp.rank != 0:
            return PendingStep(sampled=out.token_ids, rank=self.tp.rank)
        return PendingStep.start_copy(out, self.device)

    def _decode_splits(self, batch: int) -> int:
        """The decode kernel's KV splits for `batch` sequences, as a decode graph of that size uses them."""
        if self.config.attention_backend != "triton":
            return 1
        from nanovllm.kernels.attention import decode_num_splits
        return decode_num_splits(batch, self.attn_layers[0].num_kv_heads,
                                 -(-self.config.max_model_len // self.block_size), self.block_size, self.device)

    def execute(self, batch: StepBatch) -> StepResult | None:
        """Run one step and wait for it. Returns the sampled tokens (on the rank that samples), else None."""
        return self.launch(batch).result()

    def shutdown(self) -> None:
        """Release the model, KV cache and CUDA graphs, so the device memory goes back to the GPU (another engine
        in this process or another process can then use it). Idempotent; no step can run afterwards."""
        if self.model is None:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        if self.timer is not None:
            self.timer.write()
        for layer in self.attn_layers:
            layer.k_cache = layer.v_cache = None
        self.graphs, self.mixed_graphs = {}, {}  # (their memory pool goes with the last of them)
        self.g_logits, self.m_hidden = {}, {}
        self.model = self.kv_cache = self.g_stage = self.g_cu = self.staging = self.sampled_buf = None
        self.attn_layers = []
        if self.device.type == "cuda":
            import gc
            gc.collect()
            torch.cuda.empty_cache()


def mixed_graph_sizes(config: EngineConfig) -> list[int]:
    """Token counts of the CUDA graphs for mixed steps (prefill chunks riding with decode rows): multiples of
    128 up to 512 (and the token budget); 128 was faster than 64 and 32 (benchmarks/RESULTS.md run 17). Empty
    when CUDA graphs are off, or with the torch attention backend (its reference attention is not graph-safe for
    mixed steps). The balanced scheduler fills its steps to these sizes."""
    step = os.environ.get("NANOVLLM_MIXED_GRAPH_STEP", "128")  # for A/B runs; checked on every device
    if step not in ("16", "32", "64", "128", "256"):
        raise ValueError(f"NANOVLLM_MIXED_GRAPH_STEP must be 16, 32, 64, 128 or 256, got {step!r}")
    if config.device.type != "cuda" or config.args.enforce_eager or config.attention_backend != "triton":
        return []
    return list(range(int(step), min(MIXED_MAX_TOKENS, config.max_num_batched_tokens) + 1, int(step)))


def prefill_graph_sizes(config: EngineConfig) -> list[int]:
    """Token counts of the CUDA graphs for large (prefill) steps, above the mixed sizes: 1024, 2048, 4096, ... up
    to the token budget, and the budget itself. Only for a model with less than PREFILL_GRAPH_MAX_WEIGHT_BYTES of
    weights per GPU: its eager prefill step is bound by the host launching it (Qwen3-0.6B on an H200: an
    8,192-token step is ~12.5 ms of kernels, but its eager launch takes 27-45 ms, benchmarks/RESULTS.md run 19),
    while a larger model's step is bound by the device and would only pay for the padding to a graph's size.
    Measured in run 20: 20.4 against 23.9 ms per 8,192-token step, +1.7% for the whole run, identical tokens.
    NANOVLLM_PREFILL_GRAPHS=auto (the default) applies the rule, 1 forces the graphs, 0 leaves large steps
    eager. Empty where mixed steps have no graphs."""
    value = os.environ.get("NANOVLLM_PREFILL_GRAPHS", "auto")  # checked on every device
    if value not in ("auto", "0", "1"):
        raise ValueError(f"NANOVLLM_PREFILL_GRAPHS must be auto, 0 or 1, got {value!r}")
    budget = config.max_num_batched_tokens
    if value == "0" or not mixed_graph_sizes(config) or budget <= MIXED_MAX_TOKENS:
        return []
    if value == "auto" and weight_bytes_per_gpu(config.model, config.dtype, config.args.tensor_parallel_size) \
            >= PREFILL_GRAPH_MAX_WEIGHT_BYTES:
        return []
    sizes, s = [], 2 * MIXED_MAX_TOKENS
    while s < budget:
        sizes.append(s)
        s *= 2
    return sizes + [budget]


class PendingStep:
    """A launched step: its sampled ids on the device (for the next step's inputs) and a copy to the host."""

    def __init__(self, sampled: torch.Tensor | None, rank: int = 0, host: dict | None = None, event=None):
        self.sampled = sampled
        self.rank = rank
        self.host = host or {}
        self.event = event

    @classmethod
    def start_copy(cls, out: SamplerOutput, device: torch.device) -> PendingStep:
        cuda = device.type == "cuda"
        host = {}
        for name in ("token_ids", "logprobs", "top_ids", "top_logprobs"):
            t = getattr(out, name)
            if t is not None:
                if cuda:
                    h = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                    h.copy_(t, non_blocking=True)
                    t = h
                host[name] = t
        event = None
        if cuda:
            event = torch.cuda.Event()
            event.record()
        return cls(out.token_ids, 0, host, event)

    def result(self) -> StepResult | None:
        if self.rank != 0:
            return None
        if self.sampled is None:
            return StepResult(token_ids=[])
        if self.event is not None:
            self.event.synchronize()
        h = self.host
        res = StepResult(token_ids=h["token_ids"].tolist())
        if "logprobs" in h:
            res.logprobs = h["logprobs"].tolist()
            if "top_ids" in h:
                res.top_ids, res.top_logprobs = h["top_ids"].tolist(), h["top_logprobs"].tolist()
        return res
