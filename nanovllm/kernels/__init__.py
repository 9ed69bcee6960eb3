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
* ``apply_rotary(q, k, positions, cos_sin_cache)``                        -> (q_rot, k_rot) (in place by default)
* ``sample(logits, temperatures, seeds, steps, out=None)``                -> (B,) int64 (Gumbel-max, no filters)
* ``sample_partial(logits, temperatures, seeds, steps, vocab_start=0)``  -> ((B,) float32 best scores, (B,) int64
  global ids) over a vocabulary slice (reference ``nanovllm.layers.sampler.sample_partial_ref``)
* ``qkv_norm_rope_store(qkv, positions, cos_sin_cache, q_norm_weight, k_norm_weight, eps, k_cache, v_cache,
  slot_mapping, num_heads, num_kv_heads, head_dim, q_out=None)``          -> (T, H, D) q; k/v into the cache
  (QK-norm + RoPE + KV store in one launch; reference ``nanovllm.layers.fused_qkv_ref``)

:class:`TritonOps` bundles them as methods so an instance can be assigned to a module's ``.fused`` attribute.
"""
from __future__ import annotations

import importlib
import importlib.util

__all__ = [
    "TritonOps", "triton_available",
    "store_kvcache", "paged_prefill_attention", "paged_decode_attention", "decode_workspace_numel",
    "rms_norm", "add_rms_norm", "silu_and_mul", "apply_rotary", "sample", "sample_partial",
    "qkv_norm_rope_store",
]

# public name -> submodule that defines it
_LAZY = {
    "store_kvcache": "kvcache",
    "paged_prefill_attention": "attention",
    "paged_decode_attention": "attention",
    "decode_workspace_numel": "attention",
    "rms_norm": "norm",
    "add_rms_norm": "norm",
    "silu_and_mul": "activation",
    "apply_rotary": "rotary",
    "sample": "sampling",
    "sample_partial": "sampling",
    "qkv_norm_rope_store": "fused_qkv",
}

_available: bool | None = None


def triton_available() -> bool:
    """True when the triton package can be imported (it may still need a GPU or TRITON_INTERPRET=1 to run)."""
    global _available
    if _available is None:
        if importlib.util.find_spec("triton") is None:
            _available = False
        else:
            try:
                import triton  # noqa: F401
                import triton.language  # noqa: F401
                _available = True
            except Exception:  # a broken install counts as unavailable
                _available = False
    return _available


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


class TritonOps:
    """Namespace of the fused kernels, meant to be assigned to modules' ``.fused`` attribute.

    Construction imports the kernel modules (and thus triton); it raises ImportError without triton.
    """

    def __init__(self):
        self._rms_norm = _load("rms_norm")
        self._add_rms_norm = _load("add_rms_norm")
        self._apply_rotary = _load("apply_rotary")
        self._silu_and_mul = _load("silu_and_mul")
        self._store_kvcache = _load("store_kvcache")
        self._prefill = _load("paged_prefill_attention")
        self._decode = _load("paged_decode_attention")
        self._sample = _load("sample")
        self._sample_partial = _load("sample_partial")
        self._qkv_norm_rope_store = _load("qkv_norm_rope_store")

    def rms_norm(self, x, weight, eps):
        return self._rms_norm(x, weight, eps)

    def add_rms_norm(self, x, residual, weight, eps):
        return self._add_rms_norm(x, residual, weight, eps)

    def apply_rotary(self, q, k, positions, cos_sin_cache):
        return self._apply_rotary(q, k, positions, cos_sin_cache)

    def silu_and_mul(self, x):
        return self._silu_and_mul(x)

    def store_kvcache(self, key, value, k_cache, v_cache, slot_mapping):
        return self._store_kvcache(key, value, k_cache, v_cache, slot_mapping)

    def paged_prefill_attention(self, q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale,
                                max_seqlen_q, out=None, **kwargs):
        return self._prefill(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale, max_seqlen_q,
                             out=out, **kwargs)

    def paged_decode_attention(self, q, k_cache, v_cache, seq_lens, block_tables, scale, out=None, **kwargs):
        return self._decode(q, k_cache, v_cache, seq_lens, block_tables, scale, out=out, **kwargs)

    def sample(self, logits, temperatures, seeds, steps, out=None):
        return self._sample(logits, temperatures, seeds, steps, out=out)

    def sample_partial(self, logits, temperatures, seeds, steps, vocab_start=0):
        return self._sample_partial(logits, temperatures, seeds, steps, vocab_start=vocab_start)

    def qkv_norm_rope_store(self, qkv, positions, cos_sin_cache, q_norm_weight, k_norm_weight, eps, k_cache,
                            v_cache, slot_mapping, num_heads, num_kv_heads, head_dim, q_out=None):
        return self._qkv_norm_rope_store(qkv, positions, cos_sin_cache, q_norm_weight, k_norm_weight, eps,
                                         k_cache, v_cache, slot_mapping, num_heads, num_kv_heads, head_dim,
                                         q_out=q_out)
