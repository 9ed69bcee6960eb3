"""The kernels a model's layers call, chosen once when the model is built: the plain-torch references, or their
Triton kernels (with the triton attention backend). A layer receives its `Ops` in its constructor and calls
through it; nothing is swapped in later."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from nanovllm.layers.activation import silu_and_mul_ref
from nanovllm.layers.layernorm import add_rms_norm_ref, rms_norm_ref
from nanovllm.layers.moe_ref import fused_moe_ref
from nanovllm.layers.rotary import apply_rotary_ref


@dataclass(frozen=True)
class Ops:
    name: str                                   # "torch" | "triton"
    rms_norm: Callable                          # (x, weight, eps) -> normed
    # (x, residual, weight, eps, *, rows_per_token=1) -> (normed, x + residual); k rows per token summed first
    add_rms_norm: Callable
    apply_rotary: Callable                      # (q, k, positions, cos_sin_cache) -> (q, k) rotated
    silu_and_mul: Callable                      # (T, 2I) [gate | up] -> (T, I)
    # q/k-norm + RoPE + KV-cache store in one launch (nanovllm.kernels.qkv_norm_rope_store's signature); None:
    # the attention layer runs the norms, the rotary embedding and the backend's store one after the other
    qkv_norm_rope_store: Callable | None = None
    # the sampler's fused kernels (nanovllm.kernels.sample / sample_partial); None: its torch paths
    sample: Callable | None = None
    sample_partial: Callable | None = None
    # the mixture-of-experts feed-forward: (x, router_logits, w13, w2, top_k, renormalize, out=None, *,
    # combine=True) -> (T, H); combine=False: the (T * top_k, H) weighted expert rows, not yet summed
    fused_moe: Callable = fused_moe_ref
    # (w13, w2, top_k, renormalize) -> compiles every kernel variant fused_moe may pick for those weights; None: none
    fused_moe_compile: Callable | None = None
    # the same norms and SiLU-and-mul quantizing their rows for an FP8 linear layer, per token or (group=g) per token
    # and g columns: -> (e4m3 q, float32 scales) (add_rms_norm_fp8: with the sum); None: the layer quantizes its input
    rms_norm_fp8: Callable | None = None
    add_rms_norm_fp8: Callable | None = None
    silu_and_mul_fp8: Callable | None = None

    @property
    def fused(self) -> bool:
        """Whether these are the Triton kernels (the two-rank all-reduce fuses into their norm)."""
        return self.name == "triton"


TORCH_OPS = Ops("torch", rms_norm_ref, add_rms_norm_ref, apply_rotary_ref, silu_and_mul_ref)


def triton_ops() -> Ops:
    """The Triton kernels (imports triton; raises ImportError without it)."""
    from nanovllm import kernels
    return Ops("triton", kernels.rms_norm, kernels.add_rms_norm, kernels.apply_rotary, kernels.silu_and_mul,
               qkv_norm_rope_store=kernels.qkv_norm_rope_store, sample=kernels.sample,
               sample_partial=kernels.sample_partial, fused_moe=kernels.fused_moe,
               fused_moe_compile=kernels.fused_moe_compile, rms_norm_fp8=kernels.rms_norm_fp8,
               add_rms_norm_fp8=kernels.add_rms_norm_fp8, silu_and_mul_fp8=kernels.silu_and_mul_fp8)


def select_ops(attention_backend: str) -> Ops:
    """The Triton kernels with the triton attention backend (the default on CUDA; on CPU they run only under
    TRITON_INTERPRET=1, for tests), the torch references with the torch backend."""
    return triton_ops() if attention_backend == "triton" else TORCH_OPS
