"""Linear layers that shard themselves over a tensor-parallel group, each running its GEMM through a method.

The layer owns the sharding: each parameter carries a `weight_loader(param, checkpoint_tensor, shard_id=None)`
that copies this rank's slice of a checkpoint tensor into place, so loading fused or sharded weights is one call
per checkpoint tensor. The layer's `LinearMethod` (chosen when the model is built, from its quantization) owns
how the weight is stored and multiplied: `UnquantizedLinearMethod` here, the FP8 methods in
`nanovllm.layers.quantization`. A method's extra parameters (scales) that shard with the weight load through the
layer's `shard_slice`. With a group of size 1 every layer is a plain linear.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.distributed.group import TPGroup
from nanovllm.layers.quantization.fp8_rows import Fp8RowsSpec


def _divide(n: int, d: int, what: str) -> int:
    if n % d:
        raise ValueError(f"{what}={n} is not divisible by tensor_parallel_size={d}")
    return n // d


class LinearMethod(Protocol):
    """How a linear layer stores its weight and computes ``x @ W.T (+ bias)``."""

    # the `Fp8Rows` apply also takes for x (quantized so by the norm or activation that produced it); None: none
    fp8_rows: Fp8RowsSpec | None

    def create_weights(self, layer: LinearBase, in_features: int, out_features: int) -> None:
        """Register the layer's parameters (at least ``weight``, with the layer's ``weight_loader``)."""

    def process_weights_after_loading(self, layer: LinearBase) -> None:
        """Called once the checkpoint (or random weights) is in place: repack or quantize."""

    def apply(self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None,
              out: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ W.T (+ bias)`` for x (N, in_features) -> (N, out_features), into ``out`` when given."""


@dataclass(frozen=True)
class ShardSlice:
    """Where this rank's part of one checkpoint tensor goes, along the dimension the layer shards: elements
    ``src .. src + size`` of the checkpoint tensor land at ``dst .. dst + size`` of the parameter."""
    dim: int   # 0: output features (column-parallel layers), 1: input features (row-parallel)
    dst: int
    src: int
    size: int


class GemmPlan:
    """Per weight shape and row count, a faster GEMM than torch's default (filled at startup on CUDA by
    ``nanovllm.engine.gemm_plan.plan_gemms`` for the CUDA-graph batch sizes; empty elsewhere)."""

    def __init__(self):
        self.choices: dict[tuple[int, int], dict[int, object]] = {}  # (N, K) -> {rows: backend (x, w, out)}

    def lookup(self, weight: torch.Tensor, rows: int):
        by_rows = self.choices.get(tuple(weight.shape))
        return None if by_rows is None else by_rows.get(rows)


class UnquantizedLinearMethod:
    """Weights in the model's dtype; torch's GEMM, or the plan's choice for a planned row count."""

    fp8_rows = None

    def __init__(self, plan: GemmPlan | None = None):
        self.plan = plan if plan is not None else GemmPlan()

    def create_weights(self, layer, in_features, out_features):
        layer.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        layer.weight.weight_loader = layer.weight_loader

    def process_weights_after_loading(self, layer):
        pass

    def apply(self, layer, x, bias, out=None):
        w = layer.weight
        gemm = self.plan.lookup(w, x.shape[0]) if self.plan.choices and x.dim() == 2 and bias is None else None
        if gemm is not None:
            return gemm(x, w, out)
        if out is None:
            return F.linear(x, w, bias)
        if bias is None:
            return torch.mm(x, w.t(), out=out)
        return torch.addmm(bias, x, w.t(), out=out)


class LinearBase(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPGroup,
                 method: LinearMethod | None = None):
        """method: None is UnquantizedLinearMethod()."""
        super().__init__()
        self.tp = tp
        self.in_features, self.out_features = in_features, out_features
        self.method = method = method if method is not None else UnquantizedLinearMethod()
        method.create_weights(self, in_features, out_features)
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def shard_slice(self, shard_id=None) -> ShardSlice | None:
        """This rank's slice of the checkpoint tensor `shard_id` names (None: the whole tensor, unsharded)."""
        return None

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        s = self.shard_slice(shard_id)
        if s is None or s.dim >= param.dim():  # unsharded (or a row-parallel layer's bias: whole on every rank)
            _copy(param.data, loaded)
            return
        _copy(param.data.narrow(s.dim, s.dst, s.size), loaded.narrow(s.dim, s.src, s.size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x, self.bias)


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"checkpoint tensor of shape {tuple(src.shape)} does not fit parameter {tuple(dst.shape)}")
    dst.copy_(src)


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks; no communication."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPGroup,
                 method: LinearMethod | None = None):
        super().__init__(in_features, _divide(out_features, tp.size, "output features"), bias, tp, method)

    def shard_slice(self, shard_id=None):
        n = self.out_features
        return ShardSlice(0, 0, self.tp.rank * n, n)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs stored side by side (gate and up projections)."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool, tp: TPGroup,
                 method: LinearMethod | None = None):
        self.output_sizes = list(output_sizes)
        for i, n in enumerate(self.output_sizes):  # each part is split on its own
            _divide(n, tp.size, f"output features of part {i}")
        super().__init__(in_features, sum(output_sizes), bias, tp, method)

    def shard_slice(self, shard_id=None):
        if not isinstance(shard_id, int) or not 0 <= shard_id < len(self.output_sizes):
            raise ValueError(f"bad shard id {shard_id!r} for merged linear of {len(self.output_sizes)} parts")
        size = self.output_sizes[shard_id] // self.tp.size
        offset = sum(self.output_sizes[:shard_id]) // self.tp.size
        return ShardSlice(0, offset, self.tp.rank * size, size)


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q, k, v projections. Query heads are split across ranks; key/value heads too, or replicated
    when there are fewer of them than ranks (each rank keeps the one its query heads use)."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool,
                 tp: TPGroup, method: LinearMethod | None = None):
        self.head_dim = head_dim
        self.num_heads = _divide(num_heads, tp.size, "num_attention_heads")
        if num_kv_heads >= tp.size:
            self.num_kv_heads = _divide(num_kv_heads, tp.size, "num_key_value_heads")
            self.kv_start = tp.rank * self.num_kv_heads
        else:
            if tp.size % num_kv_heads:
                raise ValueError(f"tensor_parallel_size={tp.size} must be a multiple of "
                                 f"num_key_value_heads={num_kv_heads} to replicate them")
            self.num_kv_heads = 1
            self.kv_start = tp.rank * num_kv_heads // tp.size
        out = (self.num_heads + 2 * self.num_kv_heads) * head_dim
        LinearBase.__init__(self, hidden_size, out, bias, tp, method)

    def shard_slice(self, shard_id=None):
        d = self.head_dim
        q_size, kv_size = self.num_heads * d, self.num_kv_heads * d
        if shard_id == "q":
            return ShardSlice(0, 0, self.tp.rank * q_size, q_size)
        if shard_id in ("k", "v"):
            return ShardSlice(0, q_size if shard_id == "k" else q_size + kv_size, self.kv_start * d, kv_size)
        raise ValueError(f"bad shard id {shard_id!r} for qkv projection (want 'q', 'k' or 'v')")


class RowParallelLinear(LinearBase):
    """Input features split across ranks; partial outputs summed with an all-reduce."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPGroup,
                 method: LinearMethod | None = None):
        super().__init__(_divide(in_features, tp.size, "input features"), out_features, bias, tp, method)

    def shard_slice(self, shard_id=None):
        # (the bias, 1-D, is whole on every rank: added once, by rank 0, after the reduce)
        n = self.in_features
        return ShardSlice(1, 0, self.tp.rank * n, n)

    def forward(self, x: torch.Tensor, reduce: bool = True) -> torch.Tensor:
        """The summed output; with reduce=False this rank's partial sum, for ``TPGroup.all_reduce_add_norm``."""
        bias = self.bias if self.tp.rank == 0 else None
        # the partial product goes straight into the reducer's buffer when there is one (no copy to reduce it)
        buf = self.tp.reduce_buffer((x.shape[0], self.out_features), x.dtype) if x.dim() == 2 else None
        y = self.method.apply(self, x, bias, buf)
        return self.tp.all_reduce(y) if reduce else y
