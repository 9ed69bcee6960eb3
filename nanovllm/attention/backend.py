"""The attention-backend interface and its registry.

A backend receives one step's flat batch (see `torch_ref` for the layout) and must:
  * write this step's K/V into the paged cache at `slot_mapping` (slot -1: skip): `store`, then
  * return causal attention of the queries over each sequence's cached tokens: `attend`.
Callers that store K/V themselves (the fused QK-norm + RoPE + KV-store kernel) call `attend` alone, and a
model that needs the output of only some rows stores all of them and attends for those.
Everything in `AttentionMetadata` is a device tensor except `max_seqlen_q` and `is_decode`, which are
host values fixed per captured CUDA graph, so a backend can run inside a graph with padded slots.
An e4m3 cache (kv_cache_dtype="fp8") comes with its per-(token, KV head) scales, `k_scales` / `v_scales`
(num_blocks, block_size, Hkv) float32, which both calls take (None with a cache in the model dtype).
"""
from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from nanovllm.attention.torch_ref import paged_attention_ref, store_kvcache_ref


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor   # (T,) cache slot of each new token, -1 = padding
    cu_seqlens_q: torch.Tensor   # (B + 1,) query offsets
    seq_lens: torch.Tensor       # (B,) cached tokens per sequence after this step; 0 = padding
    block_tables: torch.Tensor   # (B, max_blocks) -1 padded
    max_seqlen_q: int            # host: longest query chunk in the batch
    is_decode: bool              # host: every sequence has exactly one query token
    # decode: optional (B,) permutation, the order in which a backend should schedule the sequences (longest
    # first balances the device); results don't depend on it
    decode_order: torch.Tensor | None = None
    # mixed steps (optional): the one-token sequences can go through a decode kernel and the rest through the
    # varlen kernel. `decode_lens` (B,) is each one-token sequence's length and 0 for the others; `prefill_cu`
    # (B + 1,) are query offsets in which the one-token sequences have no queries. Row b of a one-token sequence b
    # is query row b: the scheduler puts them first.
    decode_lens: torch.Tensor | None = None
    prefill_cu: torch.Tensor | None = None
    # host: the decode kernel's KV splits (decode and mixed steps); None: its default for the shapes
    decode_splits: int | None = None
    prefill_persistent: bool = False  # host: the varlen kernel's fixed, looping grid (short chunks, padded batch)


@dataclass
class OutputRows:
    """The rows of a step whose outputs are used (the sampled ones), for a model that computes its last layer
    for those rows only: after the last layer's K/V of every row are stored, each of these rows attends as a
    one-token query over its sequence's cache (``meta``)."""
    rows: torch.Tensor           # (S,) row indices into the step's T rows
    meta: AttentionMetadata      # S one-token queries: cu_seqlens_q = 0..S, each row's seq_len and block table


class AttentionBackend(ABC):
    """Computes attention over the paged KV cache."""
    name: str = ""

    @abstractmethod
    def store(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              slot_mapping: torch.Tensor, k_scales: torch.Tensor | None = None,
              v_scales: torch.Tensor | None = None) -> None:
        """Write k, v (T, Hkv, D) into k_cache, v_cache (num_blocks, block_size, Hkv, D) at slot_mapping (T,);
        slot -1 is skipped."""

    @abstractmethod
    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
               scale: float, k_scales: torch.Tensor | None = None,
               v_scales: torch.Tensor | None = None) -> torch.Tensor:
        """Causal attention of q (T, H, D) over each sequence's cached tokens (this step's K/V already stored),
        with meta describing the queries and scale the softmax scale. Returns (T, H, D)."""


class TorchAttentionBackend(AttentionBackend):
    """Plain torch (runs anywhere); the reference for the Triton kernels."""
    name = "torch"

    def store(self, k, v, k_cache, v_cache, slot_mapping, k_scales=None, v_scales=None):
        store_kvcache_ref(k, v, k_cache, v_cache, slot_mapping, k_scales, v_scales)

    def attend(self, q, k_cache, v_cache, meta, scale, k_scales=None, v_scales=None):
        return paged_attention_ref(q, k_cache, v_cache, meta.cu_seqlens_q, meta.seq_lens, meta.block_tables,
                                   scale, meta.max_seqlen_q, k_scales, v_scales)


class TritonAttentionBackend(AttentionBackend):
    """Triton kernels: a varlen prefill kernel and a split-KV decode kernel over the paged cache."""
    name = "triton"

    def __init__(self):
        from nanovllm import kernels
        if not kernels.triton_available():
            raise ValueError("attention_backend='triton' needs the triton package; use attention_backend='torch'")
        self.k = kernels
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    def store(self, k, v, k_cache, v_cache, slot_mapping, k_scales=None, v_scales=None):
        self.k.store_kvcache(k, v, k_cache, v_cache, slot_mapping, k_scales, v_scales)

    def attend(self, q, k_cache, v_cache, meta, scale, k_scales=None, v_scales=None):
        fp8 = dict(k_scales=k_scales, v_scales=v_scales)
        if meta.is_decode:
            return self.k.paged_decode_attention(q, k_cache, v_cache, meta.seq_lens, meta.block_tables, scale,
                                                 num_splits=meta.decode_splits, order=meta.decode_order, **fp8)
        if meta.decode_lens is None:
            return self.k.paged_prefill_attention(q, k_cache, v_cache, meta.cu_seqlens_q, meta.seq_lens,
                                                  meta.block_tables, scale, meta.max_seqlen_q, **fp8)
        # mixed step: the chunks through the varlen kernel and the one-token rows through the decode kernel (it
        # packs a KV head's query heads without padding them to a prefill tile). The two write disjoint rows, so
        # on a GPU they run side by side: the varlen kernel's few long programs on a second stream, next to the
        # decode kernel's many short ones.
        B = meta.decode_lens.shape[0]
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        side = self._side_stream(q.device)
        if side is not None:
            main = torch.cuda.current_stream(q.device)
            side.wait_stream(main)
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            self.k.paged_prefill_attention(q, k_cache, v_cache, meta.prefill_cu, meta.seq_lens, meta.block_tables,
                                           scale, meta.max_seqlen_q, out=out, persistent=meta.prefill_persistent,
                                           **fp8)
        self.k.paged_decode_attention(q[:B], k_cache, v_cache, meta.decode_lens, meta.block_tables, scale,
                                      out=out[:B], num_splits=meta.decode_splits, skip_empty=True,
                                      order=meta.decode_order, **fp8)
        if side is not None:
            main.wait_stream(side)
        return out

    def _side_stream(self, device: torch.device):
        """The second CUDA stream of `device` for mixed steps (None off CUDA), made on first use."""
        if device.type != "cuda":
            return None
        if self._streams.get(device) is None:
            self._streams[device] = torch.cuda.Stream(device)  # (a high priority measured no different)
        return self._streams[device]


ATTENTION_BACKENDS: dict[str, type[AttentionBackend]] = {
    "torch": TorchAttentionBackend,
    "triton": TritonAttentionBackend,
}


def get_attention_backend(name: str) -> AttentionBackend:
    try:
        cls = ATTENTION_BACKENDS[name]
    except KeyError:
        valid = ", ".join(sorted(ATTENTION_BACKENDS))
        raise ValueError(f"unknown attention backend {name!r}; valid: {valid}") from None
    return cls()
