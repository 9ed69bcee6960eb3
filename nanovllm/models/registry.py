"""Architectures we can run, keyed by the `architectures` entry of config.json."""
from __future__ import annotations

from nanovllm.config import ModelConfig
from nanovllm.layers.context import LayerContext
from nanovllm.layers.rotary import rope_inv_freq
from nanovllm.models.decoder import DecoderForCausalLM, DecoderVariant

MODEL_REGISTRY: dict[str, DecoderVariant] = {
    "Qwen3ForCausalLM": DecoderVariant(qk_norm=True),
    "Qwen2ForCausalLM": DecoderVariant(qkv_bias=True, o_bias=False),
    "LlamaForCausalLM": DecoderVariant(),
    # mixtures of experts (their sparse layers: models.decoder.SparseMoeBlock)
    "Qwen3MoeForCausalLM": DecoderVariant(qk_norm=True),
    "Qwen2MoeForCausalLM": DecoderVariant(o_bias=False),  # q/k/v bias: config's qkv_bias (default true)
    "MixtralForCausalLM": DecoderVariant(checkpoint_renames=((".block_sparse_moe.", ".mlp."),),
                                         expert_names=("w1", "w3", "w2")),
}


def check_supported(cfg: ModelConfig) -> None:
    """Raise ValueError if the engine can't run this model."""
    if cfg.architecture not in MODEL_REGISTRY:
        raise ValueError(f"architecture {cfg.architecture!r} is not supported; supported: "
                         f"{', '.join(sorted(MODEL_REGISTRY))}")
    if cfg.hidden_act != "silu":
        raise ValueError(f"hidden_act {cfg.hidden_act!r} is not supported (only 'silu')")
    if cfg.num_heads % cfg.num_kv_heads:
        raise ValueError(f"num_attention_heads={cfg.num_heads} is not a multiple of "
                         f"num_key_value_heads={cfg.num_kv_heads}")
    rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)  # raises on an unknown scaling type
    # (Mixtral has no use_sliding_window flag: a sliding_window is used when set)
    if cfg.raw.get("sliding_window") and cfg.raw.get("use_sliding_window", cfg.architecture == "MixtralForCausalLM"):
        raise ValueError("sliding-window attention is not supported")


def packed_modules_mapping(cfg: ModelConfig) -> dict[str, tuple[str, object]]:
    """Checkpoint module name -> (the fused module that holds it, its shard id) for this architecture."""
    check_supported(cfg)
    return DecoderForCausalLM.packed_modules_mapping


def build_model(cfg: ModelConfig, ctx: LayerContext) -> DecoderForCausalLM:
    check_supported(cfg)
    return DecoderForCausalLM(cfg, MODEL_REGISTRY[cfg.architecture], ctx)
