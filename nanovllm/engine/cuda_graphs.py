"""CUDA graphs of the forward pass: captured once at startup for fixed step shapes, replayed for the steps
that fit, so a step costs one launch instead of hundreds.

Two kinds behind one class (`CUDAGraphs`):
* decode graphs, one per batch size B (1, 2, 4, 8, 16, 32, ... max_num_seqs): B one-token sequences, forward and
  logits of every row; for the sizes whose decode attention splits long contexts differently
  (``kernels.decode_attention.decode_long_splits``), a second graph with those splits, which a step whose mean
  context is at least ``LONG_CONTEXT_TOKENS`` replays;
* step graphs for mixed steps (prefill chunks riding with decode rows) of up to R tokens, R a multiple of 128 up
  to 512, and for a small model's large prefill steps (1,024, 2,048, ... up to the token budget): forward to the
  hidden states of the step's logits rows; the LM head runs after the replay on those rows only.

A step graph has a logits row for each of its sequences and, with speculative decoding, for each draft token a
verification step can hold (engine/spec/). A step replays the smallest graph of its kind that fits. Its inputs are
packed into the graph's own fixed `Layout` of one shared staging buffer (the graph reads them in place); rows past
the step's are padding (slot -1, sequence length 0) that every kernel skips. All graphs share one memory pool,
captured largest first.
"""
from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass

import torch

from nanovllm.config import EngineConfig, weight_bytes_per_gpu
from nanovllm.engine.batch import StepBatch
from nanovllm.engine.step_inputs import Layout, StepInputs

MIXED_GRAPH_STEP = 128  # mixed-step graphs every 128 rows: faster than 64 and 32 (benchmarks/RESULTS.md)
MIXED_MAX_TOKENS = 512  # the largest mixed-step graph (the balanced scheduler's step sizes)
PREFILL_GRAPH_MAX_WEIGHT_BYTES = 4 << 30  # below this per GPU, large prefill steps replay graphs too


def decode_graph_sizes(config: EngineConfig) -> list[int]:
    """Batch sizes of the decode graphs: 1, 2, 4, 8, then every 16 up to max_num_seqs (at most 512)."""
    max_bs = min(config.max_num_seqs, 512)
    return sorted({b for b in (1, 2, 4, 8, *range(16, max_bs + 1, 16)) if b <= max_bs} | {max_bs})


def mixed_graph_sizes(config: EngineConfig) -> list[int]:
    """Token counts of the graphs for mixed steps: multiples of 128 up to 512 (and the token budget). Empty when
    CUDA graphs are off, or with the torch attention backend (its reference attention is not graph-safe for
    mixed steps). The balanced scheduler fills its steps to these sizes."""
    if config.device.type != "cuda" or config.args.enforce_eager or config.attention_backend != "triton":
        return []
    return list(range(MIXED_GRAPH_STEP, min(MIXED_MAX_TOKENS, config.max_num_batched_tokens) + 1,
                      MIXED_GRAPH_STEP))


def prefill_graph_sizes(config: EngineConfig) -> list[int]:
    """Token counts of the graphs for large (prefill) steps, above the mixed sizes: 1024, 2048, 4096, ... up to the
    token budget, and the budget itself. Only for a model with less than PREFILL_GRAPH_MAX_WEIGHT_BYTES of weights
    per GPU: its eager prefill step is bound by the host launching it (Qwen3-0.6B on an H200: an 8,192-token step
    is ~12.5 ms of kernels, but its eager launch takes 27-45 ms), while a larger model's step is bound by the
    device and would only pay for the padding to a graph's size. Measured: 20.4 against 23.9 ms per 8,192-token
    step, +1.7% for the whole run, identical tokens (benchmarks/RESULTS.md). Empty where mixed steps have no
    graphs."""
    budget = config.max_num_batched_tokens
    if not mixed_graph_sizes(config) or budget <= MIXED_MAX_TOKENS:
        return []
    if weight_bytes_per_gpu(config.model, config.dtype, config.args.tensor_parallel_size, config.quantization) \
            >= PREFILL_GRAPH_MAX_WEIGHT_BYTES:
        return []
    sizes, s = [], 2 * MIXED_MAX_TOKENS
    while s < budget:
        sizes.append(s)
        s *= 2
    return sizes + [budget]


def long_context(batch: StepBatch, long_context_tokens: int | None) -> bool:
    """Whether a decode step takes the decode kernel's long-context KV splits: its mean context is at least
    `long_context_tokens` (None: never, no such splits)."""
    return long_context_tokens is not None and sum(batch.seq_lens) >= long_context_tokens * batch.num_seqs


# (inputs, batch size, the decode kernel's KV splits or None for its default) -> logits of every row /
# (inputs, rows, sequences) -> hidden states of the logits rows
DecodeForward = Callable[[StepInputs, int, int | None], torch.Tensor]
StepForward = Callable[[StepInputs, int, int], torch.Tensor]


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    layout: Layout
    out: torch.Tensor        # the captured output: (B, vocab | shard) logits, or (S, hidden) hidden states


class CUDAGraphs:
    """Every captured graph, and the one shared buffer their inputs are staged in."""

    def __init__(self, config: EngineConfig, device: torch.device, decode_forward: DecodeForward,
                 step_forward: StepForward, long_splits: Callable[[int], int | None] = lambda b: None,
                 long_context_tokens: int | None = None):
        """`long_splits(B)`: the decode kernel's KV splits for B sequences of long contexts (a mean of at least
        `long_context_tokens`), None where they are its default's (no second graph)."""
        self.decode_sizes = decode_graph_sizes(config)
        self.step_sizes = mixed_graph_sizes(config) + prefill_graph_sizes(config)
        self.width = -(-config.max_model_len // config.block_size)  # block-table columns of every layout
        self.device = device
        self._decode_forward, self._step_forward = decode_forward, step_forward
        seqs = config.max_num_seqs
        # logits rows beyond one per sequence: speculative decoding's draft rows (1 + k per verifying sequence)
        drafts = config.speculative.max_draft_tokens if config.speculative is not None else 0
        self.decode: dict[int, _Graph] = {}
        self.decode_long: dict[int, _Graph] = {}
        self.step: dict[int, _Graph] = {}
        self.long_splits = {b: n for b in self.decode_sizes if (n := long_splits(b)) is not None}
        self.long_context_tokens = long_context_tokens
        # a step graph of R rows: up to min(R, max_num_seqs) sequences, each of which may have a logits row, and the
        # draft rows of a verification step
        self._layouts = {("decode", b): Layout.make(b, b, self.width, b) for b in self.decode_sizes}
        self._layouts.update({("decode-long", b): self._layouts[("decode", b)] for b in self.long_splits})
        self._layouts.update({("step", r): Layout.make(r, min(r, seqs), self.width, min(r, seqs + drafts))
                              for r in self.step_sizes})
        self.buffer: torch.Tensor | None = None
        # decode graphs' query offsets: one query per sequence, padding included (0, 1, ..., B)
        self.decode_cu = torch.arange(max(self.decode_sizes, default=0) + 1, dtype=torch.int32, device=device)

    @property
    def all_sizes(self) -> list[int]:
        """Every row count a graph runs the model at (for the GEMM plan)."""
        return sorted(set(self.decode_sizes) | set(self.step_sizes))

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every graph, largest first, in one memory pool; the staging bytes are zeros here (every
        sequence empty), which every kernel treats as padding."""
        nbytes = max(lay.nbytes for lay in self._layouts.values())
        self.buffer = torch.zeros(nbytes, dtype=torch.uint8, device=self.device)
        pool = None
        kinds = ((self.step, "step", self.step_sizes, lambda v, r, lay: self._step_forward(v, r, lay.B)),
                 (self.decode, "decode", self.decode_sizes, lambda v, b, lay: self._decode_forward(v, b, None)),
                 (self.decode_long, "decode-long", sorted(self.long_splits),
                  lambda v, b, lay: self._decode_forward(v, b, self.long_splits[b])))
        for graphs, kind, sizes, forward in kinds:
            for size in reversed(sizes):
                layout = self._layouts[(kind, size)]
                v = layout.views(self.buffer)
                forward(v, size, layout)  # warm up (compiles the kernels of this shape)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool):
                    out = forward(v, size, layout)
                pool = graph.pool()
                graphs[size] = _Graph(graph, layout, out)
                torch.cuda.synchronize()

    def find(self, batch: StepBatch) -> tuple[str, int] | None:
        """The graph a step replays: ("decode", B), ("decode-long", B) or ("step", R), the smallest that fits;
        None: run eagerly."""
        if batch.is_decode and self.decode and batch.num_seqs <= self.decode_sizes[-1]:
            b = self.decode_sizes[bisect.bisect_left(self.decode_sizes, batch.num_seqs)]
            if b in self.decode_long and long_context(batch, self.long_context_tokens):
                return "decode-long", b
            return "decode", b
        if batch.num_logits and self.step and batch.num_tokens <= self.step_sizes[-1]:
            key = "step", self.step_sizes[bisect.bisect_left(self.step_sizes, batch.num_tokens)]
            if batch.num_logits <= self._layouts[key].S:
                return key
        return None

    def layout(self, key: tuple[str, int]) -> Layout:
        return self._layouts[key]

    def replay(self, key: tuple[str, int], num_logits: int) -> torch.Tensor:
        """Replay a graph whose inputs were staged into `buffer`; its output for the first `num_logits` rows:
        logits (decode graphs) or hidden states (step graphs)."""
        kind, size = key
        g = {"decode": self.decode, "decode-long": self.decode_long, "step": self.step}[kind][size]
        g.graph.replay()
        return g.out[:num_logits]

    def release(self) -> None:
        self.decode, self.decode_long, self.step = {}, {}, {}  # (their memory pool goes with the last of them)
        self.buffer = self.decode_cu = None
