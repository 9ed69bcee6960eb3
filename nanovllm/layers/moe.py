"""The fused mixture-of-experts layer: every expert's weights stacked in two parameters, each expert's
intermediate dimension sharded over the tensor-parallel ranks, computed by a method chosen at build time.

Parameters (unquantized): ``w13`` (E, 2 I_shard, H), each expert's [gate | up] projection rows of this rank, and
``w2`` (E, H, I_shard), its down projection's columns of this rank (column- and row-parallel like a dense MLP).
Their ``weight_loader(param, tensor, (expert, "gate" | "up" | "down"))`` places one expert's checkpoint tensor
(``experts.{e}.gate_proj.weight`` ...); ``param.shard_ids`` lists the shards a checkpoint must provide.

The layer's `MoEMethod` (from the `LayerContext`, as a linear layer's `LinearMethod`) owns how the experts are
stored and multiplied: `UnquantizedMoEMethod` today, through the `fused_moe` of the layer's `Ops` (the torch
reference `nanovllm.layers.moe_ref.fused_moe_ref`, or the Triton kernels `nanovllm.kernels.moe.fused_moe`).
The output is this rank's partial sum, reduced by the caller (``TPGroup.all_reduce_add_norm``).
"""
from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from nanovllm.distributed.group import TPGroup
from nanovllm.layers.moe_ref import ExpertRows
from nanovllm.layers.ops import TORCH_OPS, Ops

EXPERT_SHARDS = ("gate", "up", "down")


class MoEMethod(Protocol):
    """How a `FusedMoE` layer stores its experts and computes their routed sum."""

    def create_weights(self, layer: FusedMoE) -> None:
        """Register the layer's expert parameters, each with the layer's ``weight_loader`` and ``shard_ids``."""

    def process_weights_after_loading(self, layer: FusedMoE) -> None:
        """Called once the checkpoint (or random weights) is in place: repack or quantize."""

    def apply(self, layer: FusedMoE, x: torch.Tensor, router_logits: torch.Tensor,
              out: torch.Tensor | None = None, combine: bool = True) -> torch.Tensor:
        """(T, H) x and (T, E) router logits -> (T, H) this rank's partial sum, into ``out`` when given;
        combine=False: the (T * top_k, H) weighted expert rows instead (``fused_moe``'s)."""


class UnquantizedMoEMethod:
    """Experts in the model's dtype, multiplied by the layer's ``fused_moe`` kernel."""

    def __init__(self):
        self._compiled: set = set()  # the weight shapes whose kernel variants are compiled (once per shape)

    def create_weights(self, layer):
        E, H, inter = layer.num_experts, layer.hidden_size, layer.intermediate_size
        layer.w13 = nn.Parameter(torch.empty(E, 2 * inter, H), requires_grad=False)
        layer.w2 = nn.Parameter(torch.empty(E, H, inter), requires_grad=False)
        for p, shards in ((layer.w13, ("gate", "up")), (layer.w2, ("down",))):
            p.weight_loader = layer.weight_loader
            p.shard_ids = frozenset((e, s) for e in range(E) for s in shards)

    def process_weights_after_loading(self, layer):
        self.compile_kernels(layer, layer.w13.dtype)

    def compile_kernels(self, layer, dtype: torch.dtype, **scales) -> None:
        """On CUDA, compile every kernel variant a step may pick for the layer's experts (Triton; activations of
        `dtype`; `scales`: a quantized method's ``w13_scale`` / ``w2_scale`` / ``block``), once per shape: none is
        then compiled mid-run by the first step of its size."""
        key = (tuple(layer.w13.shape), dtype, layer.w13.device, layer.top_k, layer.renormalize)
        if layer.fused_moe_compile is not None and layer.w13.is_cuda and key not in self._compiled:
            self._compiled.add(key)
            layer.fused_moe_compile(layer.w13, layer.w2, layer.top_k, layer.renormalize, dtype=dtype, **scales)

    def apply(self, layer, x, router_logits, out=None, combine=True):
        return layer.fused_moe(x, router_logits, layer.w13, layer.w2, layer.top_k, layer.renormalize, out=out,
                               combine=combine)


class FusedMoE(nn.Module):
    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int, renormalize: bool,
                 tp: TPGroup, ops: Ops = TORCH_OPS, method: MoEMethod | None = None):
        """intermediate_size: one expert's full width (split over the ranks of `tp`). method None: unquantized."""
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k={top_k} must be in [1, num_experts={num_experts}]")
        if intermediate_size % tp.size:
            raise ValueError(f"moe_intermediate_size={intermediate_size} is not divisible by "
                             f"tensor_parallel_size={tp.size}")
        self.tp = tp
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size // tp.size
        self.fused_moe, self.fused_moe_compile = ops.fused_moe, ops.fused_moe_compile
        self.method = method = method if method is not None else UnquantizedMoEMethod()
        method.create_weights(self)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id) -> None:
        """Copy this rank's slice of expert `e`'s checkpoint tensor into `param`; shard_id = (e, "gate" | "up" |
        "down"): gate/up (I, H) go to rows [0, I_shard) / [I_shard, 2 I_shard) of w13[e], down (H, I) to w2[e]."""
        if (not isinstance(shard_id, tuple) or len(shard_id) != 2 or shard_id[1] not in EXPERT_SHARDS
                or isinstance(shard_id[0], bool) or not isinstance(shard_id[0], int)
                or not 0 <= shard_id[0] < self.num_experts):
            raise ValueError(f"bad expert shard id {shard_id!r}: want (expert in [0, {self.num_experts}), "
                             f"one of {EXPERT_SHARDS})")
        e, which = shard_id
        n, r = self.intermediate_size, self.tp.rank
        full = n * self.tp.size
        if which == "down":
            want, dst, dim = (self.hidden_size, full), param.data[e], 1
        else:
            want, dst, dim = (full, self.hidden_size), param.data[e].narrow(0, 0 if which == "gate" else n, n), 0
        if tuple(loaded.shape) != want:
            raise ValueError(f"expert {e} {which} tensor of shape {tuple(loaded.shape)}, want {want}")
        src = loaded.narrow(dim, r * n, n)
        if dst.shape != src.shape:
            raise ValueError(f"expert {e} {which} slice {tuple(src.shape)} does not fit parameter {tuple(dst.shape)}")
        dst.copy_(src)

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor, out: torch.Tensor | None = None,
                combine: bool = True) -> torch.Tensor | ExpertRows:
        """(T, H) x, (T, E) router logits -> (T, H) this rank's partial sum (into `out` when given); combine=False:
        its `ExpertRows`, for the add + RMSNorm that follows to sum."""
        if not combine:
            return ExpertRows(self.method.apply(self, x, router_logits, combine=False), self.top_k)
        return self.method.apply(self, x, router_logits, out)


class Router(nn.Module):
    """A replicated (out, H) weight in the model's dtype, multiplied with a plain ``F.linear`` by its owner:
    the experts' router, and Qwen2-MoE's shared-expert gate."""

    def __init__(self, out_features: int, hidden_size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, hidden_size), requires_grad=False)
        self.weight.replicated = True  # the same on every rank (random weights too: see init_dummy)
