"""The paged KV cache: how many blocks fit (a profiling pass on CUDA, a fixed budget on CPU), agreed across
tensor-parallel ranks, allocated as one tensor and bound to every attention layer as views.

Its element type is the cache's own (`EngineConfig.cache_dtype`): the model dtype, or e4m3
(kv_cache_dtype="fp8"), which holds one byte per value plus a float32 scale per (token, KV head) in a second
tensor of the same layout (2, layers, blocks, block_size, Hkv) -- with head_dim 128, 1 + 4/128 bytes per value
instead of 2, so about 1.94x the tokens fit. Per-token scales (not vLLM's default of one static scale per
tensor) because a static 1.0 overflows e4m3's +-448 or loses V in its subnormals whenever a model's keys or
values are not of order one; a token's scale makes its head's largest value 448, whatever the model.

The profiling pass and the warm-up steps run one step of given sequence lengths through the runner's real eager
path over a throwaway cache (`warmup_batch`, `throwaway_cache`): that sizes the activation memory and compiles
the kernels real steps of those shapes use.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

from nanovllm.config import EngineConfig
from nanovllm.distributed.group import TPGroup
from nanovllm.engine.batch import SamplingBatch, StepBatch
from nanovllm.layers.attention import Attention

CPU_KV_CACHE_BYTES = 2 << 30  # default KV budget on CPU when num_kvcache_blocks is not given


def is_scaled(dtype: torch.dtype) -> bool:
    """Whether a cache of this dtype stores scales beside the values (e4m3)."""
    return dtype == torch.float8_e4m3fn


def bytes_per_block(layers: list[Attention], block_size: int, dtype: torch.dtype) -> int:
    """Bytes of K and V one block holds across all layers (their scales included)."""
    itemsize = torch.empty(0, dtype=dtype).element_size()
    scale_bytes = 4 if is_scaled(dtype) else 0
    return sum(2 * block_size * a.num_kv_heads * (a.head_dim * itemsize + scale_bytes) for a in layers)


def cache_shape(layers: list[Attention], num_blocks: int, block_size: int) -> tuple[int, ...]:
    a = layers[0]
    return (2, len(layers), num_blocks, block_size, a.num_kv_heads, a.head_dim)


def allocate(layers: list[Attention], num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
             ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A zeroed cache (2, layers, blocks, block_size, Hkv, D) and, for e4m3, its scales (2, layers, blocks,
    block_size, Hkv) float32 (else None)."""
    shape = cache_shape(layers, num_blocks, block_size)
    cache = torch.zeros(shape, dtype=dtype, device=device)
    scales = torch.zeros(shape[:-1], dtype=torch.float32, device=device) if is_scaled(dtype) else None
    return cache, scales


def bind(layers: list[Attention], cache: torch.Tensor | None, scales: torch.Tensor | None = None) -> None:
    """Point every layer at its slice of `cache` (2, layers, blocks, block_size, Hkv, D) and of its `scales`
    (an e4m3 cache's); None unbinds."""
    for i, layer in enumerate(layers):
        layer.k_cache, layer.v_cache = (None, None) if cache is None else (cache[0, i], cache[1, i])
        layer.k_scales, layer.v_scales = (None, None) if scales is None else (scales[0, i], scales[1, i])


@contextlib.contextmanager
def throwaway_cache(layers: list[Attention], num_blocks: int, block_size: int, dtype: torch.dtype,
                    device: torch.device):
    """A temporary cache of `num_blocks` bound to the layers; their own views are restored afterwards."""
    saved = [(layer.k_cache, layer.v_cache, layer.k_scales, layer.v_scales) for layer in layers]
    bind(layers, *allocate(layers, num_blocks, block_size, dtype, device))
    try:
        yield
    finally:
        for layer, (k, v, ks, vs) in zip(layers, saved):
            layer.k_cache, layer.v_cache, layer.k_scales, layer.v_scales = k, v, ks, vs


def warmup_batch(lens: list[int], block_size: int) -> StepBatch:
    """A prefill step of sequences of these lengths over consecutive blocks 0.. (every sequence samples)."""
    tables, slots, positions, cu, first = [], [], [], [0], 0
    for n in lens:
        nb = -(-n // block_size)
        tables.append(list(range(first, first + nb)))
        slots.extend(range(first * block_size, first * block_size + n))
        positions.extend(range(n))
        cu.append(cu[-1] + n)
        first += nb
    S = len(lens)
    return StepBatch(
        input_ids=[0] * cu[-1], positions=positions, slot_mapping=slots, cu_seqlens_q=cu, seq_lens=list(lens),
        block_tables=tables, max_seqlen_q=max(lens), logits_indices=[c - 1 for c in cu[1:]],
        logits_seqs=list(range(S)),
        sampling=SamplingBatch(temperatures=[1.0] * S, top_ks=[0] * S, top_ps=[1.0] * S, min_ps=[0.0] * S,
                               seeds=list(range(S)), steps=[0] * S, logprobs=[None] * S))


def blocks_needed(lens: list[int], block_size: int) -> int:
    return sum(-(-n // block_size) for n in lens)


def profile_lens(config: EngineConfig) -> list[int]:
    """The largest step the engine can schedule: a full token budget over as few sequences as fit."""
    n = config.max_num_batched_tokens
    n_seqs = max(1, min(config.max_num_seqs, -(-n // config.max_model_len)))
    lens = [n // n_seqs] * n_seqs
    lens[-1] += n - sum(lens)
    return lens


def num_blocks(config: EngineConfig, per_block: int, run_largest_step: Callable[[], None]) -> int:
    """How many blocks this rank can hold: `num_kvcache_blocks` if given; on CUDA what `gpu_memory_utilization`
    leaves after `run_largest_step` (its activation memory stays reserved by torch's allocator, counted as used,
    so real steps reuse it); on CPU a fixed budget, at most what max_num_seqs full-length sequences need."""
    if config.args.num_kvcache_blocks is not None:
        return config.args.num_kvcache_blocks
    if config.device.type == "cuda":
        torch.cuda.empty_cache()
        run_largest_step()
        free, total = torch.cuda.mem_get_info()
        budget = total * config.args.gpu_memory_utilization - (total - free)
        return max(0, int(budget) // per_block)
    want = -(-config.max_model_len // config.block_size) * config.max_num_seqs
    return max(1, min(want, CPU_KV_CACHE_BYTES // per_block))


def agree(tp: TPGroup, n: int, device: torch.device) -> int:
    """All ranks must use the same block count: the minimum."""
    if tp.size == 1:
        return n
    import torch.distributed as dist
    t = torch.tensor([n], device=device if device.type == "cuda" else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=tp.group)
    return int(t.item())


def check_fits(n: int, config: EngineConfig) -> None:
    if n * config.block_size < config.max_model_len:
        raise ValueError(
            f"the KV cache holds {n} blocks x {config.block_size} tokens = {n * config.block_size} tokens, fewer "
            f"than max_model_len={config.max_model_len}: lower max_model_len, or raise num_kvcache_blocks / "
            f"gpu_memory_utilization")
