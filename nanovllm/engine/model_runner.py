"""The model runner owns the model, its KV cache, its CUDA graphs and the sampler, and turns a StepBatch into
tokens: one rank's `Executor`.

    launch(batch): pack the inputs into one buffer, one host-to-device copy (engine/step_inputs.py)
                   -> replay a CUDA graph that fits (engine/cuda_graphs.py), or run the step eagerly
                   -> logits of the step's logits rows -> Sampler (and the accepted draft tokens of a
                      verification step) -> sampled ids stay on the device (the next step's placeholder inputs
                      read them) and are copied to pinned host memory
    result():      wait for that copy -> StepResult
"""
from __future__ import annotations

import logging
import time
from dataclasses import replace

import torch

from nanovllm.attention.backend import AttentionMetadata, OutputRows, get_attention_backend
from nanovllm.config import EngineConfig
from nanovllm.distributed.group import TPGroup
from nanovllm.engine import kv_cache
from nanovllm.engine.batch import LateInputs, SamplingBatch, StepBatch
from nanovllm.engine.cuda_graphs import MIXED_MAX_TOKENS, CUDAGraphs, long_context
from nanovllm.engine.executor import StepResult
from nanovllm.engine.step_inputs import Layout, Staging, StepInputs
from nanovllm.engine.step_timer import StepProfiler, StepTimer
from nanovllm.kernels.prefill_config import SHORT_MAX_Q
from nanovllm.layers.attention import Attention
from nanovllm.layers.context import LayerContext
from nanovllm.layers.linear import GemmPlan, UnquantizedLinearMethod
from nanovllm.layers.logits_processing import SlotState, pairs_to_device, to_device
from nanovllm.layers.ops import select_ops
from nanovllm.layers.sampler import Sampler, SamplerOutput, SamplingTensors
from nanovllm.models.loader import init_dummy, load_safetensors, process_weights_after_loading
from nanovllm.models.registry import build_model, packed_modules_mapping

logger = logging.getLogger(__name__)


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
            if self.tp.size > 1 and not config.nodes.multinode:  # symmetric memory: the GPUs of one host
                self.tp = replace(self.tp, reducer=self._make_reducer())
        self.backend = get_attention_backend(config.attention_backend)
        self.ops = select_ops(config.attention_backend)
        self.gemm_plan = GemmPlan()
        t0 = time.perf_counter()
        self.model = self._load_model()
        self.load_seconds = time.perf_counter() - t0
        self.attn_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        # under TP the sampler gets this rank's logits slice and gathers only what the step needs
        self.sampler = Sampler(self.ops, self.model.lm_head.vocab_shard() if self.tp.size > 1 else None)
        self.staging = Staging(self.device)
        self.slot_state = SlotState(config.model.vocab_size, self.device)  # penalties and biases, allocated on use
        self.timer = StepTimer.from_env(self.device, self.tp.rank)
        self.profilers = StepProfiler.from_env(self.device, self.tp.rank)
        # the latest step's sampled ids, read on the device by the next step's placeholder inputs: a row per
        # sequence, and one per draft token a step can verify (speculative decoding)
        rows = config.max_num_seqs + (config.speculative.max_draft_tokens if config.speculative else 0)
        self.sampled_buf = torch.zeros(max(min(rows, config.max_num_batched_tokens), config.max_num_seqs, 1),
                                       dtype=torch.int64, device=self.device)
        # the mean context from which a decode step takes the decode kernel's long-context KV splits (Triton only)
        self.long_context_tokens: int | None = None
        if config.attention_backend == "triton":
            from nanovllm.kernels.decode_attention import LONG_CONTEXT_TOKENS
            self.long_context_tokens = LONG_CONTEXT_TOKENS
        self.graphs: CUDAGraphs | None = None
        if self.device.type == "cuda" and not config.args.enforce_eager:
            self.graphs = CUDAGraphs(config, self.device, self._decode_forward, self._step_forward,
                                     lambda b: self._decode_splits(b, long=True), self.long_context_tokens)
        t0 = time.perf_counter()
        self.num_kvcache_blocks = self._allocate_kv_cache()  # (its warm-up steps run eagerly: no graphs yet)
        self.kv_seconds = time.perf_counter() - t0  # KV sizing, incl. the warm-up steps' kernel compiles
        self.capture_seconds = self.gemm_plan_seconds = 0.0
        if self.graphs is not None:
            from nanovllm.engine.gemm_plan import describe, plan_gemms
            t0 = time.perf_counter()
            plan = plan_gemms(self.model, self.graphs.all_sizes, use_triton=config.attention_backend == "triton")
            self.gemm_plan_seconds = time.perf_counter() - t0
            logger.info("GEMM plan (%.1fs): %s", self.gemm_plan_seconds, describe(plan))
            t0 = time.perf_counter()
            self.graphs.capture()
            self.capture_seconds = time.perf_counter() - t0

    # --- setup -------------------------------------------------------------------------------------
    def _load_model(self):
        cfg = self.config
        quant = None
        if cfg.quantization is not None:
            from nanovllm.layers.quantization import QuantizationMethods
            quant = QuantizationMethods(cfg.quantization, use_kernels=self.ops.fused,
                                        packed_modules=packed_modules_mapping(cfg.model))
        moe = {"moe_method": quant.moe_method()} if quant is not None and cfg.model.num_experts else {}
        ctx = LayerContext(attention=self.backend, tp=self.tp, ops=self.ops,
                           linear_method=UnquantizedLinearMethod(self.gemm_plan), quantization=quant, **moe)
        prev = torch.get_default_dtype()
        torch.set_default_dtype(cfg.dtype)
        try:
            with torch.device(self.device):
                model = build_model(cfg.model, ctx)
        finally:
            torch.set_default_dtype(prev)
        # buffers computed in float32 (RoPE tables) stay float32
        if cfg.args.load_format == "dummy":
            init_dummy(model, cfg.args.seed, self.tp.rank)
        else:
            load_safetensors(model, cfg.model_dir)
        process_weights_after_loading(model)
        return model.eval().requires_grad_(False)

    def _make_reducer(self):
        """The symmetric-memory all-reduce for the row-parallel layers (collective: every rank builds it here),
        sized for the largest forward: a full token budget, or the largest CUDA-graph batch."""
        from nanovllm.distributed.symm_allreduce import SymmMemAllReduce
        cfg = self.config
        rows = max(cfg.max_num_batched_tokens, cfg.max_num_seqs)
        return SymmMemAllReduce.maybe_create(self.tp.group, self.tp.rank, self.tp.size,
                                             rows * cfg.model.hidden_size, self.dtype, self.device)

    def _allocate_kv_cache(self) -> int:
        cfg = self.config
        per_block = kv_cache.bytes_per_block(self.attn_layers, self.block_size, cfg.cache_dtype)
        n = kv_cache.num_blocks(cfg, per_block, lambda: self.warmup(kv_cache.profile_lens(cfg)))
        if self.device.type == "cuda" and cfg.args.num_kvcache_blocks is None:
            # the varlen kernel's variants for a few query rows and for prompts up to SHORT_MAX_Q tokens, compiled
            # now (the largest step above compiled the long one), not in a step of the run
            self.warmup([1, 2, 3][:cfg.max_num_seqs])
            self.warmup([min(SHORT_MAX_Q, cfg.max_num_batched_tokens, cfg.max_model_len)])
        n = kv_cache.agree(self.tp, n, self.device)
        kv_cache.check_fits(n, cfg)
        # the K/V values, and an e4m3 cache's per-(token, head) scales (None otherwise)
        self.kv_cache, self.kv_scales = kv_cache.allocate(self.attn_layers, n, self.block_size, cfg.cache_dtype,
                                                          self.device)
        kv_cache.bind(self.attn_layers, self.kv_cache, self.kv_scales)
        return n

    @torch.inference_mode()
    def warmup(self, lens: list[int]) -> None:
        """One eager step (packed inputs, forward, logits, sampling) of sequences of these lengths over a
        throwaway KV cache: sizes the activation memory and compiles the kernels real steps of those shapes use."""
        with kv_cache.throwaway_cache(self.attn_layers, kv_cache.blocks_needed(lens, self.block_size),
                                      self.block_size, self.config.cache_dtype, self.device):
            self.launch(kv_cache.warmup_batch(lens, self.block_size)).result()
            if self.device.type == "cuda":
                torch.cuda.synchronize()

    # --- the forward pass --------------------------------------------------------------------------
    def _input_ids(self, v: StepInputs) -> torch.Tensor:
        """The step's token ids, with each placeholder (async scheduling) read from the previous step's sampled
        ids on the device."""
        return torch.where(v.src >= 0, self.sampled_buf[v.src.clamp(min=0)], v.ids)

    def _decode_forward(self, v: StepInputs, B: int, splits: int | None) -> torch.Tensor:
        """A decode graph's body: B one-token sequences -> logits of every row, (B, vocab | shard); `splits`: the
        decode kernel's KV splits (None: its default for B)."""
        g = self.graphs
        meta = AttentionMetadata(v.slots, g.decode_cu[:B + 1], v.seq_lens, v.block_tables(B, g.width),
                                 max_seqlen_q=1, is_decode=True, decode_order=v.order, decode_splits=splits)
        return self.model.compute_logits(self.model(self._input_ids(v), v.pos, meta), gather=self.tp.size == 1)

    def _step_forward(self, v: StepInputs, rows: int, B: int) -> torch.Tensor:
        """A step graph's body: up to `rows` tokens of up to B sequences, the decode rows through the decode kernel
        and the chunks through the varlen kernel (AttentionMetadata) -> the final hidden states of the logits rows
        (padded with row 0), (B, hidden). The LM head runs outside the graph, on the step's logits rows only."""
        W = self.graphs.width
        meta = AttentionMetadata(v.slots, v.cu, v.seq_lens, v.block_tables(B, W), max_seqlen_q=rows, is_decode=False,
                                 decode_lens=v.dec_lens, prefill_cu=v.cu_pre, decode_splits=self._decode_splits(B),
                                 # a large step's chunks fill the one-program-per-tile grid
                                 prefill_persistent=rows <= MIXED_MAX_TOKENS, decode_order=v.order)
        return self.model(self._input_ids(v), v.pos, meta)[v.logits_indices]

    def _eager_forward(self, batch: StepBatch, v: StepInputs, keep_all: bool = False) -> torch.Tensor | None:
        """The step without a graph: hidden states of its logits rows (S, hidden), or None when none samples;
        `keep_all`: of every token row (T, hidden)."""
        n, S = batch.num_seqs, batch.num_logits
        W = max((len(t) for t in batch.block_tables), default=1)
        meta = AttentionMetadata(v.slots, v.cu, v.seq_lens, v.block_tables(n, W), max_seqlen_q=batch.max_seqlen_q,
                                 is_decode=batch.is_decode, decode_order=v.order)
        if batch.num_decode and not batch.is_decode:
            # the decode rows through the decode kernel with the step graphs' options (one KV split, the launch
            # order), whose variant is compiled at their capture: another (a split count varying with the step)
            # would compile mid-run, ~0.6 s
            meta.decode_lens, meta.prefill_cu, meta.decode_splits = v.dec_lens, v.cu_pre, 1
        elif batch.is_decode and long_context(batch, self.long_context_tokens):
            meta.decode_splits = self._decode_splits(n, long=True)  # as the decode graphs choose (None: the default)
        ids = self._input_ids(v) if batch.placeholder_pos else v.ids
        if keep_all:
            return self.model(ids, v.pos, meta)                                # (T, hidden)
        if not S:
            self.model(ids, v.pos, meta)                                       # fills the KV cache; nothing samples
            return None
        if S == batch.num_tokens:
            return self.model(ids, v.pos, meta)[v.logits_indices]              # (S, hidden)
        # only the logits rows' hidden states are used: the last layer stores every row's K/V, then attends (one
        # query per logits row, over the keys up to its position) and runs its MLP for those rows alone. (One-token
        # queries through the varlen kernel: its variant for short queries is compiled at start-up, where the
        # decode kernel's split count would vary with each step's rows.)
        seqs = v.logits_seqs
        rows = OutputRows(v.logits_indices, AttentionMetadata(
            v.slots[:0], torch.arange(S + 1, dtype=torch.int32, device=self.device),
            v.pos[v.logits_indices] + 1, meta.block_tables[seqs], max_seqlen_q=1, is_decode=False))
        return self.model(ids, v.pos, meta, rows)                              # (S, hidden)

    def _decode_splits(self, batch: int, long: bool = False) -> int | None:
        """The decode kernel's KV splits for `batch` sequences, as a decode graph of that size uses them; `long`:
        for long contexts (``decode_long_splits``: None where they are the default's)."""
        if self.config.attention_backend != "triton":
            return None if long else 1
        from nanovllm.kernels.decode_attention import decode_long_splits, decode_num_splits
        rule = decode_long_splits if long else decode_num_splits
        return rule(batch, self.attn_layers[0].num_kv_heads, -(-self.config.max_model_len // self.block_size),
                    self.block_size, self.device)

    def _prompt_logprobs(self, batch: StepBatch, hidden: torch.Tensor) -> dict[str, torch.Tensor]:
        """Raw log-probability, 1-based rank and top tokens of each prompt token a row of `hidden` (T, hidden)
        predicts (batch.prompt_lp_rows / _targets), a few hundred rows at a time (their logits are (rows, V))."""
        rows = to_device(batch.prompt_lp_rows, torch.int64, self.device)
        targets = to_device(batch.prompt_lp_targets, torch.int64, self.device)
        k = batch.prompt_lp_k
        parts: dict[str, list[torch.Tensor]] = {"logprobs": [], "ranks": [], "top_logprobs": [], "top_ids": []}
        for i in range(0, rows.numel(), 256):
            logp = torch.log_softmax(self.model.compute_logits(hidden[rows[i:i + 256]]).float(), dim=-1)
            lp = logp.gather(1, targets[i:i + 256, None])                                  # (n, 1)
            parts["logprobs"].append(lp.squeeze(1))
            parts["ranks"].append((logp > lp).sum(dim=-1) + 1)
            if k:
                top_lp, top_ids = logp.topk(k, dim=-1)
                parts["top_logprobs"].append(top_lp)
                parts["top_ids"].append(top_ids)
        return {name: torch.cat(ts) for name, ts in parts.items() if ts}

    # --- one step ----------------------------------------------------------------------------------
    def _sampling_tensors(self, v: StepInputs, sb: SamplingBatch) -> SamplingTensors:
        S = len(sb.temperatures)
        asked = [k for k in sb.logprobs if k is not None]
        banned = None
        if sb.banned:
            if v.banned_rows.numel() == len(sb.banned):
                banned = v.banned_rows, v.banned_tokens
            else:  # a CUDA graph's staging layout has no room for them: a separate small copy
                banned = pairs_to_device(sb.banned, torch.int32, self.device)
        drafts = None
        if sb.drafts is not None:  # speculative decoding: one small copy of the verifying rows and their drafts
            d = sb.drafts
            flat = to_device(d.first_rows + d.tokens, torch.int64, self.device)
            N = len(d.first_rows)
            drafts = flat[:N], flat[N:].view(N, d.width)
        return SamplingTensors(
            temperatures=v.temps[:S], top_ks=v.top_ks[:S], top_ps=v.top_ps[:S], min_ps=v.min_ps[:S],
            seeds=v.seeds[:S], steps=v.steps[:S],
            banned_rows=banned[0] if banned else None, banned_tokens=banned[1] if banned else None,
            # (SamplingParams checks temperature >= 0, top_k >= -1, top_p <= 1 and min_p >= 0)
            all_greedy=max(sb.temperatures, default=0.0) == 0.0, need_top_k=max(sb.top_ks, default=0) > 0,
            need_top_p=min(sb.top_ps, default=1.0) < 1.0, need_min_p=max(sb.min_ps, default=0.0) > 0.0,
            max_logprobs=max(asked) if asked else None,
            features=self.slot_state.prepare(sb.features) if sb.features is not None else None,
            slot_state=self.slot_state, draft_rows=drafts[0] if drafts else None,
            draft_tokens=drafts[1] if drafts else None)

    @torch.inference_mode()
    def launch(self, batch: StepBatch) -> PendingStep:
        """Enqueue one step on the device and return at once; `.result()` waits for the sampled ids.

        Placeholder inputs (async scheduling) read the previous step's sampled ids, which stay on the device
        in `sampled_buf`."""
        if self.model is None:
            raise RuntimeError("the model runner has been shut down")
        for p in self.profilers:
            p.before(batch.is_decode)
        started = self.timer.start() if self.timer is not None else None
        pending = self._launch(batch)
        if started is not None:
            self.timer.end(started, batch.num_seqs, batch.num_tokens, batch.is_decode)
        for p in self.profilers:
            p.after(batch.is_decode)
        return pending

    def _launch(self, batch: StepBatch) -> PendingStep:
        S = batch.num_logits
        prompt_lp = None
        # a step that wants prompt log-probabilities runs eagerly: they need every prompt row's hidden state
        graph = self.graphs.find(batch) if self.graphs is not None and not batch.prompt_lp_rows else None
        if graph is not None:
            v = self.staging.upload(batch, self.graphs.layout(graph), self.graphs.buffer)
            out = self.graphs.replay(graph, S)
            if graph[0] != "step":
                logits = out                                                   # (S, vocab | shard)
            else:
                logits = self.model.compute_logits(out, gather=self.tp.size == 1)
        else:
            width = max((len(t) for t in batch.block_tables), default=1)
            layout = Layout.make(batch.num_tokens, batch.num_seqs, width, S, len(batch.sampling.banned))
            v = self.staging.upload(batch, layout)
            if batch.prompt_lp_rows:
                hidden = self._eager_forward(batch, v, keep_all=True)
                prompt_lp = self._prompt_logprobs(batch, hidden)
                hidden = hidden[v.logits_indices] if S else None
            else:
                hidden = self._eager_forward(batch, v)
            if hidden is None:
                if self.tp.rank != 0 or prompt_lp is None:
                    return PendingStep(sampled=None, rank=self.tp.rank)
                return PendingStep.start_copy(None, self.device, prompt_lp)
            logits = self.model.compute_logits(hidden, gather=self.tp.size == 1)  # (S, vocab | shard)
        t = self._sampling_tensors(v, batch.sampling)
        if batch.sampling.deferred:  # the engine hands over the masks / bans, then PendingStep.sample runs this
            return PendingStep(sampled=None, rank=self.tp.rank, deferred=lambda late: self._sample(
                logits, replace(t, late=late), S, prompt_lp))
        return self._sample(logits, t, S, prompt_lp)

    def _sample(self, logits: torch.Tensor, t: SamplingTensors, S: int, prompt_lp: dict | None) -> PendingStep:
        # sampling is a pure function of the full logits and the seeds; under TP every rank holds its vocabulary
        # shard and the sampler exchanges per-row partials (or gathers the logits), so every rank samples the same
        # ids: each keeps them on its device for the next step's placeholder inputs
        out = self.sampler(logits, t)
        self.sampled_buf[:S].copy_(out.token_ids)
        if self.tp.rank != 0:
            return PendingStep(sampled=out.token_ids, rank=self.tp.rank)
        return PendingStep.start_copy(out, self.device, prompt_lp)

    @property
    def is_alive(self) -> bool:
        return self.model is not None

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
        kv_cache.bind(self.attn_layers, None)
        if self.graphs is not None:
            self.graphs.release()
        self.model = self.kv_cache = self.kv_scales = self.graphs = self.staging = self.sampled_buf = None
        self.attn_layers = []
        if self.device.type == "cuda":
            import gc
            gc.collect()
            torch.cuda.empty_cache()


class PendingStep:
    """A launched step: its sampled ids on the device (for the next step's inputs) and a copy to the host.

    A deferred step (some row's mask or bans wait for the previous step's tokens) has run up to its logits;
    `sample(late)` samples it (before the next step is launched)."""

    def __init__(self, sampled: torch.Tensor | None, rank: int = 0, host: dict | None = None, event=None,
                 deferred=None):
        self.sampled = sampled
        self.rank = rank
        self.host = host or {}
        self.event = event
        self._deferred = deferred

    def sample(self, late: LateInputs) -> None:
        if self._deferred is None:
            raise RuntimeError("this step was not deferred (or has been sampled already)")
        with torch.inference_mode():
            done, self._deferred = self._deferred(late), None
        self.sampled, self.host, self.event = done.sampled, done.host, done.event

    @classmethod
    def start_copy(cls, out: SamplerOutput | None, device: torch.device,
                   prompt_lp: dict[str, torch.Tensor] | None = None) -> PendingStep:
        cuda = device.type == "cuda"
        tensors = {}
        if out is not None:
            for name in ("token_ids", "logprobs", "ranks", "top_ids", "top_logprobs", "num_accepted"):
                if getattr(out, name) is not None:
                    tensors[name] = getattr(out, name)
        for name, t in (prompt_lp or {}).items():
            tensors["prompt_" + name] = t
        host = {}
        for name, t in tensors.items():
            if cuda:
                h = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                h.copy_(t, non_blocking=True)
                t = h
            host[name] = t
        event = None
        if cuda:
            event = torch.cuda.Event()
            event.record()
        return cls(out.token_ids if out is not None else torch.empty(0), 0, host, event)

    def result(self) -> StepResult | None:
        if self._deferred is not None:
            raise RuntimeError("a deferred step must be sampled (PendingStep.sample) before its result is read")
        if self.rank != 0:
            return None
        if self.sampled is None:
            return StepResult(token_ids=[])
        if self.event is not None:
            self.event.synchronize()
        h = {name: t.tolist() for name, t in self.host.items()}
        return StepResult(token_ids=h.get("token_ids", []), logprobs=h.get("logprobs"), ranks=h.get("ranks"),
                          top_ids=h.get("top_ids"), top_logprobs=h.get("top_logprobs"),
                          num_accepted=h.get("num_accepted"), prompt_logprobs=h.get("prompt_logprobs"),
                          prompt_ranks=h.get("prompt_ranks"), prompt_top_ids=h.get("prompt_top_ids"),
                          prompt_top_logprobs=h.get("prompt_top_logprobs"))
