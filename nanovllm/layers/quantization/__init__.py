"""Quantization: which weights are stored how, resolved from the engine's `quantization` argument and the
checkpoint's `quantization_config`, and the method object each linear layer runs with.

Two FP8 (e4m3) schemes, both with dynamic activation scales:
* online (``quantization="fp8"`` on a bf16/fp16 checkpoint): every decoder projection is quantized when the
  weights are in place, one scale per output channel; activations per token (``fp8.Fp8LinearMethod``);
* checkpoint (config.json's ``quantization_config.quant_method == "fp8"``, the Qwen3-*-FP8 layout): e4m3 weights
  with a ``weight_scale_inv`` per 128 x 128 tile, activations per token and 128 columns
  (``fp8.Fp8BlockLinearMethod``); modules the checkpoint lists in ``modules_to_not_convert`` / ``ignored_layers``
  stay in the model dtype.
The embeddings, norms and the LM head are never quantized (they are not linear layers here).

`QuantizationConfig` is the resolved choice (in `EngineConfig`); `QuantizationMethods` hands each layer its
method by checkpoint name (`LayerContext.linear`), and every mixture-of-experts layer its experts' method
(``moe_method``: FP8 experts: ``fp8.Fp8MoEMethod`` online, ``fp8.Fp8BlockMoEMethod`` from a
block-FP8 checkpoint).
"""
from __future__ import annotations

from dataclasses import dataclass

SUPPORTED = ("fp8",)             # EngineArgs.quantization values (vLLM's names)
CHECKPOINT_METHODS = ("fp8",)    # quantization_config.quant_method values we load


@dataclass(frozen=True)
class QuantizationConfig:
    method: str                                   # "fp8"
    checkpoint: bool                              # weights stored quantized (else quantized at load time)
    weight_block_size: tuple[int, int] | None     # checkpoint: (rows, cols) of a tile sharing one scale
    ignored: tuple[str, ...] = ()                 # checkpoint module names kept in the model dtype

    def is_ignored(self, name: str) -> bool:
        """Whether module `name` (a checkpoint name) is listed as unquantized: an entry matches whole dotted
        components (``lm_head``, ``model.layers.0.mlp.gate``, ``layers.3``)."""
        return any(f".{e}." in f".{name}." for e in self.ignored)


def resolve_quantization(requested: str | None, hf_config: dict | None) -> QuantizationConfig | None:
    """The quantization the engine runs: the checkpoint's own if it has a ``quantization_config``, else the
    requested online one (or none). Raises ValueError naming an unsupported method or setting."""
    if requested is not None and requested not in SUPPORTED:
        raise ValueError(f"quantization {requested!r} is not supported; supported: None or "
                         + ", ".join(map(repr, SUPPORTED)))
    if not hf_config:
        return None if requested is None else QuantizationConfig(requested, checkpoint=False, weight_block_size=None)
    if not isinstance(hf_config, dict):
        raise ValueError(f"config.json's quantization_config must be an object, got {hf_config!r}")
    method = hf_config.get("quant_method")
    if method not in CHECKPOINT_METHODS:
        raise ValueError(f"the checkpoint's quantization_config.quant_method {method!r} is not supported; "
                         f"supported: {', '.join(map(repr, CHECKPOINT_METHODS))}")
    if requested is not None and requested != method:
        raise ValueError(f"quantization={requested!r} does not match the checkpoint's quant_method {method!r}")
    scheme = hf_config.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise ValueError(f"fp8 checkpoints with activation_scheme {scheme!r} are not supported (only 'dynamic')")
    fmt = hf_config.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ValueError(f"fp8 checkpoints of fmt {fmt!r} are not supported (only 'e4m3')")
    block = hf_config.get("weight_block_size")
    if block is None:
        raise ValueError("fp8 checkpoints without weight_block_size (one scale per tensor) are not supported; "
                         "the block-wise format ([128, 128]) is")
    if (not isinstance(block, (list, tuple)) or len(block) != 2
            or not all(isinstance(b, int) and b >= 16 and b & (b - 1) == 0 for b in block)):
        raise ValueError(f"quantization_config.weight_block_size must be two powers of two >= 16, got {block!r}")
    ignored = []
    for key in ("modules_to_not_convert", "ignored_layers"):
        names = hf_config.get(key) or []
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise ValueError(f"quantization_config.{key} must be a list of module names, got {names!r}")
        ignored += names
    return QuantizationConfig(method, checkpoint=True, weight_block_size=(block[0], block[1]),
                              ignored=tuple(ignored))


class QuantizationMethods:
    """The methods of one model's quantized layers: ``linear_method(prefix)`` for the linear layer at checkpoint
    name `prefix` (fused layers by their fused name, e.g. ``model.layers.0.self_attn.qkv_proj``), or None where it
    stays in the model dtype."""

    def __init__(self, config: QuantizationConfig, use_kernels: bool, packed_modules: dict[str, tuple[str, object]]):
        """use_kernels: the Triton kernels (and ``torch._scaled_mm`` on CUDA), else the torch references.
        packed_modules: the model's ``packed_modules_mapping`` (checkpoint part -> (fused name, shard id))."""
        from nanovllm.layers.quantization.fp8 import Fp8BlockLinearMethod, Fp8LinearMethod
        self.config = config
        self.parts: dict[str, list[str]] = {}
        for part, (fused, _) in packed_modules.items():
            self.parts.setdefault(fused, []).append(part)
        if config.checkpoint:
            self.method = Fp8BlockLinearMethod(config.weight_block_size, use_kernels)
        else:
            self.method = Fp8LinearMethod(use_kernels)

    def moe_method(self):
        """The method of every mixture-of-experts layer's experts: online FP8 (``fp8.Fp8MoEMethod``: quantized
        per expert and row when loaded) or a block-FP8 checkpoint's tiles (``fp8.Fp8BlockMoEMethod``); both
        run gate/up on e4m3 activations and down weight-only."""
        from nanovllm.layers.quantization.fp8 import Fp8BlockMoEMethod, Fp8MoEMethod
        if self.config.checkpoint:
            return Fp8BlockMoEMethod(self.config.weight_block_size)
        return Fp8MoEMethod()

    def linear_method(self, prefix: str):
        parent, _, name = prefix.rpartition(".")
        names = [f"{parent}.{p}" if parent else p for p in self.parts.get(name, [name])]
        skipped = [self.config.is_ignored(n) for n in names]
        if all(skipped):
            return None
        if any(skipped):
            raise ValueError(f"the checkpoint quantizes some of {', '.join(names)} but not all; they are fused into "
                             f"one layer ({prefix}) here")
        return self.method
