"""What every layer of a model is built with: one object handed down the model's constructors."""
from __future__ import annotations

from dataclasses import dataclass, field

from nanovllm.attention.backend import AttentionBackend
from nanovllm.distributed.group import TPGroup
from nanovllm.layers.linear import LinearMethod, UnquantizedLinearMethod
from nanovllm.layers.moe import MoEMethod, UnquantizedMoEMethod
from nanovllm.layers.ops import TORCH_OPS, Ops


@dataclass(frozen=True)
class LayerContext:
    attention: AttentionBackend                  # paged attention over the KV cache
    tp: TPGroup = field(default_factory=TPGroup)  # the tensor-parallel group the layers shard over
    ops: Ops = TORCH_OPS                         # norms, RoPE, activation, sampling kernels
    # how every linear layer stores and multiplies its weight (its quantization)
    linear_method: LinearMethod = field(default_factory=UnquantizedLinearMethod)
    # how every mixture-of-experts layer stores and multiplies its experts (its quantization)
    moe_method: MoEMethod = field(default_factory=UnquantizedMoEMethod)
