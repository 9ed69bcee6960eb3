"""The transformers config of each tiny-model architecture (`nanovllm.utils.tiny_model`): dense Qwen3 / Qwen2 /
Llama 3 and the mixtures of experts Qwen3-MoE, Qwen2-MoE and Mixtral, across transformers 4.x and 5.x."""

from __future__ import annotations

import inspect

# arch -> (transformers config class, model class)
ARCH_CLASSES = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
}
MOE_ARCHS = ("qwen3_moe", "qwen2_moe", "mixtral")


def _config_class(arch: str):
    import transformers

    cfg_name, model_name = ARCH_CLASSES[arch]
    return getattr(transformers, cfg_name), getattr(transformers, model_name), model_name


def _init_params(cls) -> tuple[set[str], bool]:
    """(parameter names of ``cls.__init__``, whether it also takes ``**kwargs``)."""
    params = inspect.signature(cls.__init__).parameters
    var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    return set(params), var_kw


def _uses_rope_parameters(cfg_cls) -> bool:
    """transformers >= 5 configs take ``rope_parameters`` (with rope_theta inside)."""
    names, _ = _init_params(cfg_cls)
    if "rope_parameters" in names:
        return True
    try:
        import transformers

        return int(transformers.__version__.split(".")[0]) >= 5
    except Exception:  # pragma: no cover
        return False


def _moe_kwargs(arch: str, moe: dict) -> dict:
    """The expert fields of an MoE arch from ``moe`` (num_experts, num_experts_per_tok, moe_intermediate_size,
    mlp_only_layers, norm_topk_prob, shared_expert_intermediate_size) in that arch's names."""
    if arch == "mixtral":  # every layer sparse, experts intermediate_size wide, weights always renormalized
        return dict(num_local_experts=moe["num_experts"], num_experts_per_tok=moe["num_experts_per_tok"],
                    intermediate_size=moe["moe_intermediate_size"], sliding_window=None)
    kw = dict(num_experts=moe["num_experts"], num_experts_per_tok=moe["num_experts_per_tok"],
              moe_intermediate_size=moe["moe_intermediate_size"], mlp_only_layers=list(moe["mlp_only_layers"]),
              decoder_sparse_step=1, norm_topk_prob=moe["norm_topk_prob"])
    if arch == "qwen2_moe":
        kw.update(shared_expert_intermediate_size=moe["shared_expert_intermediate_size"], qkv_bias=True)
    return kw


def make_config(arch, *, vocab_size, hidden_size, num_layers, num_heads, num_kv_heads,
                head_dim, intermediate_size, max_position_embeddings,
                tie_word_embeddings, eos_id, init_std, moe=None):
    """(transformers config, model class) of a tiny `arch` model; ``moe``: the expert fields of an MoE arch."""
    import torch

    cfg_cls, model_cls, model_name = _config_class(arch)
    kwargs = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        hidden_act="silu",
        max_position_embeddings=max_position_embeddings,
        initializer_range=init_std,
        rms_norm_eps=1e-6,
        use_cache=True,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        attention_dropout=0.0,
    )
    if arch == "llama":
        rope_theta = 500000.0
        rope_scaling = {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": max(16, max_position_embeddings // 4),
        }
        kwargs.update(attention_bias=False, mlp_bias=False)
    else:
        rope_theta = 1000000.0
        rope_scaling = None
        if arch != "mixtral":
            kwargs.update(use_sliding_window=False, sliding_window=None, max_window_layers=num_layers)
        if arch in ("qwen3", "qwen3_moe"):
            kwargs.update(attention_bias=False)
    if arch in MOE_ARCHS:
        kwargs.update(_moe_kwargs(arch, moe))

    names, var_kw = _init_params(cfg_cls)
    accepted = None if var_kw else names
    if _uses_rope_parameters(cfg_cls):
        # transformers >= 5: rope_theta lives inside rope_parameters.
        rope = {"rope_type": "default"} if rope_scaling is None else dict(rope_scaling)
        rope["rope_theta"] = rope_theta
        kwargs["rope_parameters"] = rope
    else:
        kwargs["rope_theta"] = rope_theta
        kwargs["rope_scaling"] = rope_scaling

    extra = {}
    if accepted is not None:
        extra = {k: v for k, v in kwargs.items() if k not in accepted}
        kwargs = {k: v for k, v in kwargs.items() if k in accepted}
    config = cfg_cls(**kwargs)
    for k, v in extra.items():
        # e.g. head_dim for Qwen2Config in transformers 5 (read with getattr).
        if k in ("head_dim",):
            setattr(config, k, v)
    config.architectures = [model_name]
    # float32 checkpoint; the attribute name changed in transformers 5.
    if hasattr(config, "dtype") or "dtype" in names:
        config.dtype = torch.float32
    else:
        config.torch_dtype = torch.float32
    return config, model_cls
