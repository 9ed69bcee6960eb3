"""The parts of a Hugging Face config.json the engine needs (`ModelConfig`), parsed without transformers' config
classes (their field names moved between versions), including the mixture-of-experts fields."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ModelConfig:
    """The parts of a Hugging Face config.json that the engine needs."""
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    hidden_act: str
    torch_dtype: str | None
    eos_token_ids: tuple[int, ...]
    # mixture of experts (num_experts 0: every layer dense); see is_moe_layer and _parse_moe
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False                 # renormalize the top-k routing weights to sum to 1
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    shared_expert_intermediate_size: int = 0     # Qwen2-MoE's always-on expert (0: none)
    raw: dict = field(repr=False, compare=False, default_factory=dict)

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Whether layer `layer_idx`'s feed-forward block is the mixture of experts (transformers' rule)."""
        return (self.num_experts > 0 and layer_idx not in self.mlp_only_layers
                and (layer_idx + 1) % self.decoder_sparse_step == 0)

    def mlp_params(self, layer_idx: int) -> int:
        """Weights of one layer's feed-forward block. A mixture-of-experts layer counts every expert (and its
        router, and the shared expert with its gate): a decode step of many sequences reads them all (at 256
        sequences routing 8 of 128 experts each, an expert is left idle with probability (1 - 8/128)^256 ~ 1e-7)."""
        h = self.hidden_size
        if not self.is_moe_layer(layer_idx):
            return 3 * h * self.intermediate_size
        shared = 3 * h * self.shared_expert_intermediate_size + h if self.shared_expert_intermediate_size else 0
        return self.num_experts * (3 * h * self.moe_intermediate_size + h) + shared

    def matmul_params(self) -> int:
        """Weights every token is multiplied with: the decoder's projections and the LM head (not the embedding
        table, which is only indexed). A decode step reads them all once (for a mixture of experts: every
        expert, see mlp_params)."""
        attn = self.hidden_size * (self.num_heads + 2 * self.num_kv_heads) * self.head_dim \
            + self.num_heads * self.head_dim * self.hidden_size
        mlp = sum(self.mlp_params(i) for i in range(self.num_layers))
        return self.num_layers * attn + mlp + self.vocab_size * self.hidden_size

    @classmethod
    def from_dir(cls, model_dir: str) -> ModelConfig:
        path = os.path.join(model_dir, "config.json")
        if not os.path.isfile(path):
            raise ValueError(f"model directory {model_dir!r} has no config.json")
        with open(path) as f:
            cfg = json.load(f)
        return cls.from_dict(cfg, source=path)

    @classmethod
    def from_dict(cls, cfg: dict, source: str = "config") -> ModelConfig:
        archs = cfg.get("architectures") or []
        if not archs:
            raise ValueError(f"{source} lists no 'architectures'")
        arch = archs[0]

        def get(key, default=None, required=False):
            if key in cfg and cfg[key] is not None:
                return cfg[key]
            if required:
                raise ValueError(f"{source} lacks required field {key!r}")
            return default

        hidden = int(get("hidden_size", required=True))
        heads = int(get("num_attention_heads", required=True))
        # rope: transformers 4.x writes rope_theta + rope_scaling; 5.x writes rope_parameters
        rope_params = get("rope_parameters") or {}
        scaling = get("rope_scaling") or None
        if scaling is None and rope_params.get("rope_type", "default") != "default":
            scaling = dict(rope_params)
        theta = float(get("rope_theta", rope_params.get("rope_theta", 10000.0)))
        eos = get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        num_layers = int(get("num_hidden_layers", required=True))
        intermediate = int(get("intermediate_size", required=True))
        # Qwen2-MoE names its q/k/v bias flag qkv_bias (true by default)
        bias_default = get("qkv_bias", True) if arch == "Qwen2MoeForCausalLM" else arch == "Qwen2ForCausalLM"
        return cls(
            architecture=arch,
            vocab_size=int(get("vocab_size", required=True)),
            hidden_size=hidden,
            intermediate_size=intermediate,
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=int(get("num_key_value_heads", heads)),
            head_dim=int(get("head_dim", hidden // heads)),
            rms_norm_eps=float(get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(get("tie_word_embeddings", False)),
            attention_bias=bool(get("attention_bias", bias_default)),
            mlp_bias=bool(get("mlp_bias", False)),
            hidden_act=str(get("hidden_act", "silu")),
            torch_dtype=get("torch_dtype", get("dtype")),
            eos_token_ids=eos_ids,
            **_parse_moe(cfg, arch, num_layers, intermediate, source),
            raw=cfg,
        )


# the mixture-of-experts architectures (their config.json fields are parsed by _parse_moe)
MOE_ARCHITECTURES = ("Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM", "MixtralForCausalLM")


def _parse_moe(cfg: dict, arch: str, num_layers: int, intermediate: int, source: str) -> dict:
    """The mixture-of-experts fields of an MoE architecture's config.json, checked (ValueError naming the bad
    one); {} for the dense architectures. The expert count is num_experts (Qwen) or num_local_experts (Mixtral;
    transformers 5 writes it for Qwen too). Mixtral's experts are intermediate_size wide, every layer of it is
    sparse and its top-k weights are always renormalized. Fields transformers would fill from its class defaults
    (num_experts_per_tok, moe_intermediate_size, ...) are required rather than guessed."""
    if arch not in MOE_ARCHITECTURES:
        return {}
    mixtral = arch == "MixtralForCausalLM"

    def get(key, default=None, lo=None):
        v = cfg.get(key)
        if v is None:
            if default is None:
                raise ValueError(f"{source}: {arch} needs {key!r}")
            v = default
        if lo is not None and (isinstance(v, bool) or not isinstance(v, int) or v < lo):
            raise ValueError(f"{source}: {key} must be an int >= {lo}, got {v!r}")
        return v

    a, b = cfg.get("num_experts"), cfg.get("num_local_experts")
    if a is not None and b is not None and a != b:
        raise ValueError(f"{source}: num_experts={a!r} and num_local_experts={b!r} disagree")
    num_experts = get("num_experts" if b is None else "num_local_experts", lo=0)
    if num_experts == 0:  # transformers builds every layer dense then
        return {}
    top_k = get("num_experts_per_tok", lo=1)
    if top_k > num_experts:
        raise ValueError(f"{source}: num_experts_per_tok={top_k} exceeds num_experts={num_experts}")
    norm = True if mixtral else get("norm_topk_prob", False)
    if not isinstance(norm, bool):
        raise ValueError(f"{source}: norm_topk_prob must be true or false, got {norm!r}")
    only = [] if mixtral else get("mlp_only_layers", [])
    if not isinstance(only, (list, tuple)):
        raise ValueError(f"{source}: mlp_only_layers must be a list of layer indices, got {only!r}")
    for i in only:
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < num_layers:
            raise ValueError(f"{source}: mlp_only_layers entry {i!r} is not a layer index in [0, {num_layers})")
    shared = get("shared_expert_intermediate_size", lo=1) if arch == "Qwen2MoeForCausalLM" else 0
    return dict(
        num_experts=num_experts, num_experts_per_tok=top_k,
        moe_intermediate_size=intermediate if mixtral else get("moe_intermediate_size", lo=1),
        norm_topk_prob=norm, decoder_sparse_step=1 if mixtral else get("decoder_sparse_step", 1, lo=1),
        mlp_only_layers=tuple(sorted(set(only))), shared_expert_intermediate_size=shared,
    )
