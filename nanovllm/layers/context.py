"""What every layer of a model is built with: one object handed down the model's constructors."""
from __future__ import annotations

from dataclasses import dataclass, field

from nanovllm.attention.backend import AttentionBackend
from nanovllm.distributed.group import TPGroup
from nanovllm.layers.linear import LinearMethod, UnquantizedLinearMethod
from nanovllm.layers.moe import MoEMethod, UnquantizedMoEMethod
from nanovllm.layers.ops import TORCH_OPS, Ops
from nanovllm.layers.quantization import QuantizationMethods


@dataclass(frozen=True)
class LayerContext:
    attention: AttentionBackend                  # paged attention over the KV cache
    tp: TPGroup = field(default_factory=TPGroup)  # the tensor-parallel group the layers shard over
    ops: Ops = TORCH_OPS                         # norms, RoPE, activation, sampling kernels
    # how a linear layer stores and multiplies its weight in the model dtype
    linear_method: LinearMethod = field(default_factory=UnquantizedLinearMethod)
    # how every mixture-of-experts layer stores and multiplies its experts (its quantization)
    moe_method: MoEMethod = field(default_factory=UnquantizedMoEMethod)
    # the quantized layers' methods (None: nothing is quantized)
    quantization: QuantizationMethods | None = None

    def linear(self, prefix: str) -> LinearMethod:
        """The method of the linear layer at checkpoint name `prefix` (fused layers by their fused name,
        ``model.layers.0.self_attn.qkv_proj``): the quantization's, or the model dtype's where it has none."""
        method = self.quantization.linear_method(prefix) if self.quantization is not None else None
        return self.linear_method if method is None else method
