"""Triton GPU kernels for the hot paths of the engine.

Importing this package never imports triton: the kernel modules are loaded lazily on first use, so CPU-only
installs without triton can still ``import nanovllm``. Check :func:`triton_available` before using them.

Public kernels (each mirrors a torch reference elsewhere in the package):

* ``store_kvcache(key, value, k_cache, v_cache, slot_mapping)``           -> None (in place)
* ``paged_prefill_attention(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale, max_seqlen_q,
  out=None)``                                                             -> (T, H, D)
* ``paged_decode_attention(q, k_cache, v_cache, seq_lens, block_tables, scale, out=None, *, num_splits=None,
  workspace=None)``                                                       -> (B, H, D)
* ``rms_norm(x, weight, eps)``, ``add_rms_norm(x, residual, weight, eps)`` -> normed / (normed, x + residual)
* ``silu_and_mul(x)``                                                     -> (..., I)
* ``rms_norm_fp8(x, weight, eps, group=None)``, ``add_rms_norm_fp8(x, residual, weight, eps, group=None)``,
  ``silu_and_mul_fp8(x, group=None)``: the same, their rows quantized for an FP8 GEMM, per token or per token and
  ``group`` columns -> (e4m3 q, float32 scales (M, 1) or (M, K // group)) (with the sum)
* ``apply_rotary(q, k, positions, cos_sin_cache)``                        -> (q_rot, k_rot) (in place by default)
* ``sample(logits, temperatures, seeds, steps, out=None)``                -> (B,) int64 (Gumbel-max, no filters)
* ``sample_partial(logits, temperatures, seeds, steps, vocab_start=0)``  -> ((B,) float32 best scores, (B,) int64
  global ids) over a vocabulary slice (reference ``nanovllm.layers.sampler.sample_partial_ref``)
* ``qkv_norm_rope_store(qkv, positions, cos_sin_cache, q_norm_weight, k_norm_weight, eps, k_cache, v_cache,
  slot_mapping, num_heads, num_kv_heads, head_dim, q_out=None)``          -> (T, H, D) q; k/v into the cache
  (QK-norm + RoPE + KV store in one launch; reference ``nanovllm.layers.fused_qkv_ref``)
* ``fused_moe(x, router_logits, w13, w2, top_k, renormalize, out=None, *, config=None, w13_scale=None,
  w2_scale=None, block=None)`` -> (T, H) the mixture-of-experts feed-forward (routing, expert-sorted layout,
  grouped GEMMs, combine; e4m3 experts with per-row or per-tile scales, gate/up on e4m3 activations; reference
  ``nanovllm.layers.moe_ref.fused_moe_ref``); ``fused_moe_compile(w13, w2, top_k, renormalize, ...)`` compiles
  every kernel variant its tile table can pick for that weight shape
* ``per_token_quant_fp8(x)``, ``per_token_group_quant_fp8(x, group)``   -> (e4m3 q, float32 scales)
* ``w8a8_gemm(xq, xs, wq, ws, out_dtype, block=None, bias=None, out=None, config=None)`` -> (M, N): scaled FP8
  GEMM, row-wise or block-wise scales, a given tiling or the default (references in
  ``nanovllm.layers.quantization.fp8_ref``)

The KV-cache kernels (store, fused store, attention) also take an e4m3 cache with per-(token, head) scales.

``nanovllm.layers.ops.triton_ops()`` bundles them for the layers, which pick them when the model is built.
"""
from __future__ import annotations

import functools
import importlib
import importlib.util

__all__ = [
    "triton_available",
    "store_kvcache", "paged_prefill_attention", "paged_decode_attention", "decode_workspace_numel",
    "rms_norm", "add_rms_norm", "silu_and_mul", "rms_norm_fp8", "add_rms_norm_fp8", "silu_and_mul_fp8",
    "apply_rotary", "sample", "sample_partial",
    "qkv_norm_rope_store", "fused_moe", "fused_moe_compile", "per_token_quant_fp8", "per_token_group_quant_fp8",
    "w8a8_gemm",
]

# public name -> submodule that defines it
_LAZY = {
    "store_kvcache": "kvcache",
    "paged_prefill_attention": "prefill_attention",
    "paged_decode_attention": "decode_attention",
    "decode_workspace_numel": "decode_attention",
    "rms_norm": "norm",
    "add_rms_norm": "norm",
    "silu_and_mul": "activation",
    "rms_norm_fp8": "norm",
    "add_rms_norm_fp8": "norm",
    "silu_and_mul_fp8": "activation",
    "apply_rotary": "rotary",
    "sample": "sampling",
    "sample_partial": "sampling",
    "qkv_norm_rope_store": "fused_qkv",
    "fused_moe": "moe",
    "fused_moe_compile": "moe",
    "per_token_quant_fp8": "fp8_quant",
    "per_token_group_quant_fp8": "fp8_quant",
    "w8a8_gemm": "fp8_gemm",
}

@functools.cache
def triton_available() -> bool:
    """True when the triton package can be imported (it may still need a GPU or TRITON_INTERPRET=1 to run)."""
    if importlib.util.find_spec("triton") is None:
        return False
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # a broken install counts as unavailable
        return False
    return True


def _load(name: str):
    if not triton_available():
        raise ImportError(f"nanovllm.kernels.{name} needs the 'triton' package, which is not installed")
    module = importlib.import_module(f"{__name__}.{_LAZY[name]}")
    return getattr(module, name)


def __getattr__(name: str):
    if name in _LAZY:
        fn = _load(name)
        globals()[name] = fn  # cache: later lookups skip __getattr__
        return fn
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
