"""The tensor-parallel group handed to every sharded layer (no global state: each engine owns its own)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from nanovllm.layers.moe_ref import ExpertRows


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    size: int = 1
    group: Any = None  # torch.distributed ProcessGroup when size > 1
    reducer: Any = None  # SymmMemAllReduce on CUDA when available (else NCCL / gloo do every all-reduce)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the ranks. Returns the sum: x itself (reduced in place: NCCL / gloo, or a tensor from
        ``reduce_buffer``), or x copied into the symmetric-memory reducer's next buffer and reduced there. A
        reducer buffer stays valid until the next-but-one all-reduce of this group."""
        if self.size == 1:
            return x
        r = self.reducer
        if r is not None:
            if r.owns(x):
                return r.all_reduce_(x)
            buf = r.buffer(tuple(x.shape), x.dtype) if x.is_contiguous() else None
            if buf is not None:
                buf.copy_(x)
                return r.all_reduce_(buf)
        import torch.distributed as dist
        dist.all_reduce(x, group=self.group)
        return x

    def reduce_buffer(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        """Where a layer may write a partial result for ``all_reduce`` (or ``all_reduce_add_norm``) to sum
        without a copy; None when that path isn't available."""
        if self.size == 1 or self.reducer is None:
            return None
        return self.reducer.buffer(shape, dtype)

    def all_reduce_add_norm(self, partial: torch.Tensor, residual: torch.Tensor, norm) -> tuple[torch.Tensor,
                                                                                               torch.Tensor]:
        """``norm(sum over the ranks of partial, residual)`` -> (normed, new residual), for an RMSNorm module
        ``norm`` and a row-parallel layer's unreduced output ``partial`` (``forward(x, reduce=False)``).

        With two ranks, the symmetric-memory reducer and the Triton kernels (``norm.ops.fused``), the reduction
        runs inside the norm kernel (``SymmMemAllReduce.add_rms_norm_``); otherwise it is an all-reduce followed
        by the norm. On one rank `partial` may be a mixture of experts' `ExpertRows`: the norm's add sums them."""
        if isinstance(partial, ExpertRows):
            if self.size != 1:
                raise ValueError(f"uncombined expert rows reach a {self.size}-rank reduction; only one rank sums "
                                 "them in its norm")
            return norm(partial.rows, residual, rows_per_token=partial.top_k)
        if self.size == 1:
            return norm(partial, residual)
        r = self.reducer
        if r is not None and norm.ops.fused and r.can_fuse_norm(partial):
            return r.add_rms_norm_(partial, residual, norm.weight, norm.eps)
        return norm(self.all_reduce(partial), residual)

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Stack each rank's x (same shape and dtype on every rank) along a new first dim, rank order:
        (size, *x.shape).

        One collective into a single (size * rows, ...) buffer (the layout both NCCL and gloo accept)."""
        if self.size == 1:
            return x.unsqueeze(0)
        import torch.distributed as dist
        x = x.contiguous()
        out = torch.empty((self.size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(out, x, group=self.group)
        return out.view(self.size, *x.shape)

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate each rank's x along the last dim, rank order: ``all_gather``, then a transpose of the
        rank axis next to the last dim."""
        if self.size == 1:
            return x
        out = self.all_gather(x).movedim(0, -2)                  # (..., size, cols)
        return out.reshape(*x.shape[:-1], self.size * x.shape[-1])


def check_tp_supported(tp_size: int, model_cfg, device: torch.device, nnodes: int = 1) -> None:
    """Raise ValueError if this model can't be split over `tp_size` ranks on `device` (`nnodes` nodes of
    tp_size / nnodes ranks each).

    Query heads, the dense MLP's intermediate size and each expert's (moe_intermediate_size, and Qwen2-MoE's
    shared expert's) are split evenly; key/value heads are split evenly, or, when there are fewer of them than
    ranks, replicated (so tp_size must be a multiple of them). The vocabulary is padded to a multiple of
    tp_size, so any size works. Each rank needs its own GPU on its node."""
    if not isinstance(tp_size, int) or isinstance(tp_size, bool) or tp_size < 1:
        raise ValueError(f"tensor_parallel_size must be an int >= 1, got {tp_size!r}")
    if tp_size == 1:
        return
    heads, kv_heads = model_cfg.num_heads, model_cfg.num_kv_heads
    if heads % tp_size:
        raise ValueError(f"num_attention_heads={heads} is not divisible by tensor_parallel_size={tp_size}")
    if kv_heads >= tp_size:
        if kv_heads % tp_size:
            raise ValueError(f"num_key_value_heads={kv_heads} is not divisible by "
                             f"tensor_parallel_size={tp_size}")
    elif tp_size % kv_heads:
        raise ValueError(f"num_key_value_heads={kv_heads} is fewer than tensor_parallel_size={tp_size} and "
                         f"does not divide it, so the key/value heads can't be replicated evenly")
    sparse = [model_cfg.is_moe_layer(i) for i in range(model_cfg.num_layers)]
    sizes = [("moe_intermediate_size", model_cfg.moe_intermediate_size),
             ("shared_expert_intermediate_size", model_cfg.shared_expert_intermediate_size)] if any(sparse) else []
    if not all(sparse):  # a dense layer (every layer of a dense model)
        sizes.append(("intermediate_size", model_cfg.intermediate_size))
    for name, n in sizes:
        if n % tp_size:
            raise ValueError(f"{name}={n} is not divisible by tensor_parallel_size={tp_size}")

    import torch.distributed as dist
    if not dist.is_available():
        raise ValueError(f"tensor_parallel_size={tp_size} needs torch.distributed, which this torch build lacks")
    device = torch.device(device)
    if device.type == "cuda":
        if device.index is not None:
            raise ValueError(f"device={str(device)!r} pins every rank to one GPU; with tensor_parallel_size="
                             f"{tp_size} use device='cuda' (rank r runs on cuda:r; pick GPUs with "
                             f"CUDA_VISIBLE_DEVICES)")
        n, per_node = torch.cuda.device_count(), tp_size // nnodes
        if n < per_node:
            where = f" on each of nnodes={nnodes} nodes" if nnodes > 1 else ""
            raise ValueError(f"tensor_parallel_size={tp_size} needs {per_node} CUDA devices{where}, "
                             f"but only {n} are visible")
        if not dist.is_nccl_available():
            raise ValueError(f"tensor_parallel_size={tp_size} on CUDA needs NCCL, which this torch build lacks")
    elif device.type == "cpu":
        if not dist.is_gloo_available():
            raise ValueError(f"tensor_parallel_size={tp_size} on CPU needs the gloo backend, "
                             f"which this torch build lacks")
    else:
        raise ValueError(f"tensor_parallel_size={tp_size} is not supported on device {str(device)!r}")
