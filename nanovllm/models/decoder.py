"""The Llama-style decoder shared by Llama 3.x, Qwen2/2.5, Qwen3 and their mixtures of experts (Qwen3-MoE,
Qwen2-MoE, Mixtral).

They differ only in small switches: Qwen2 has q/k/v biases (and no o_proj bias), Qwen3 normalizes each query
and key head (q_norm / k_norm) before RoPE, Llama 3 scales RoPE frequencies; the MoE models replace the dense
MLP of their sparse layers by `SparseMoeBlock` (`make_mlp` picks per layer from the config). Every layer is
built from one `LayerContext`: its tensor-parallel group (size 1 = no sharding), its kernels, the attention
backend, the MoE method, and each linear layer's method, asked for by the layer's checkpoint name (its
quantization may differ from layer to layer).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.attention.backend import AttentionMetadata, OutputRows
from nanovllm.config import ModelConfig
from nanovllm.layers.attention import Attention
from nanovllm.layers.context import LayerContext
from nanovllm.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from nanovllm.layers.layernorm import RMSNorm
from nanovllm.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from nanovllm.layers.moe import FusedMoE, Router
from nanovllm.layers.moe_ref import ExpertRows
from nanovllm.layers.quantization.fp8_rows import Fp8Rows
from nanovllm.layers.rotary import RotaryEmbedding
from nanovllm.models.loader import packed_target


@dataclass(frozen=True)
class DecoderVariant:
    qk_norm: bool = False          # Qwen3
    qkv_bias: bool | None = None   # None: config's attention_bias
    o_bias: bool | None = None     # None: config's attention_bias
    # checkpoint names: (old, new) substrings replaced first (Mixtral's block_sparse_moe is our mlp), and an
    # expert's gate, up and down projections
    checkpoint_renames: tuple[tuple[str, str], ...] = ()
    expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")


class DecoderAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, variant: DecoderVariant, ctx: LayerContext, prefix: str):
        super().__init__()
        d = cfg.head_dim
        qkv_bias = cfg.attention_bias if variant.qkv_bias is None else variant.qkv_bias
        o_bias = cfg.attention_bias if variant.o_bias is None else variant.o_bias
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, d, cfg.num_heads, cfg.num_kv_heads, qkv_bias, ctx.tp,
                                          ctx.linear(f"{prefix}.qkv_proj"))
        self.num_heads, self.num_kv_heads, self.head_dim = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads, d
        self.q_size, self.kv_size = self.num_heads * d, self.num_kv_heads * d
        self.o_proj = RowParallelLinear(cfg.num_heads * d, cfg.hidden_size, o_bias, ctx.tp,
                                        ctx.linear(f"{prefix}.o_proj"))
        self.rotary_emb = RotaryEmbedding(d, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling, ctx.ops)
        self.attn = Attention(self.num_heads, d, self.num_kv_heads, d ** -0.5, ctx.attention)
        if variant.qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps, ctx.ops)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps, ctx.ops)
        else:
            self.q_norm = self.k_norm = None
        # QK-norm + RoPE + KV store in one kernel (Triton), or None: the three one after the other
        self.fused_qkv = ctx.ops.qkv_norm_rope_store
        if self.fused_qkv is not None and self.q_norm is not None and self.q_norm.eps != self.k_norm.eps:
            raise ValueError("the fused qkv kernel needs q_norm and k_norm to share one eps")

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata,
                reduce: bool = True, out_rows: OutputRows | None = None) -> torch.Tensor:
        """reduce=False: this rank's partial sum of the output (see ``TPGroup.all_reduce_add_norm``).
        out_rows: store every row's K/V, but attend and project only these rows: returns (S, hidden)."""
        T = x.shape[0]
        qkv = self.qkv_proj(x)                                                   # (T, (H + 2Hkv) D)
        if self.fused_qkv is not None:
            qn, kn = self.q_norm, self.k_norm
            q = self.fused_qkv(qkv, positions, self.rotary_emb.cos_sin_cache,
                               None if qn is None else qn.weight, None if kn is None else kn.weight,
                               0.0 if qn is None else qn.eps, self.attn.k_cache, self.attn.v_cache,
                               meta.slot_mapping, self.num_heads, self.num_kv_heads, self.head_dim,
                               k_scales=self.attn.k_scales, v_scales=self.attn.v_scales)  # (T, H, D)
        else:
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = q.reshape(T, self.num_heads, self.head_dim)
            k = k.reshape(T, self.num_kv_heads, self.head_dim)
            if self.q_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = self.rotary_emb(positions, q, k)
            self.attn.store(k, v, meta)
        if out_rows is not None:
            q, meta = q[out_rows.rows], out_rows.meta
        return self.o_proj(self.attn.attend(q, meta), reduce)                   # (T | S, hidden)


class DecoderMLP(nn.Module):
    """The dense SwiGLU feed-forward block (intermediate_size None: the config's)."""

    def __init__(self, cfg: ModelConfig, ctx: LayerContext, prefix: str, intermediate_size: int | None = None):
        super().__init__()
        if cfg.hidden_act != "silu":
            raise ValueError(f"hidden_act {cfg.hidden_act!r} is not supported (only 'silu')")
        inter = cfg.intermediate_size if intermediate_size is None else intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [inter] * 2, cfg.mlp_bias, ctx.tp,
                                                       ctx.linear(f"{prefix}.gate_up_proj"))
        self.down_proj = RowParallelLinear(inter, cfg.hidden_size, cfg.mlp_bias, ctx.tp,
                                           ctx.linear(f"{prefix}.down_proj"))
        self.act = ctx.ops.silu_and_mul
        spec = self.down_proj.method.fp8_rows
        if spec is not None and ctx.ops.silu_and_mul_fp8 is not None:  # quantized for the FP8 down projection
            self.act = _fp8_rows_of(ctx.ops.silu_and_mul_fp8, spec.group)

    def forward(self, x: torch.Tensor, reduce: bool = True) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)), reduce)


def _fp8_rows_of(silu_and_mul_fp8, group: int | None):
    def act(x: torch.Tensor) -> Fp8Rows:
        return Fp8Rows(*silu_and_mul_fp8(x, group), x.dtype, group)
    return act


class SparseMoeBlock(nn.Module):
    """A mixture-of-experts feed-forward block: the router (``gate``, replicated, in the model's dtype) scores
    every expert, each token runs through its top-k (``experts``, a `FusedMoE`); Qwen2-MoE adds an always-on
    ``shared_expert`` scaled by sigmoid(``shared_expert_gate`` x)."""

    def __init__(self, cfg: ModelConfig, ctx: LayerContext, prefix: str):
        super().__init__()
        self.tp = ctx.tp
        self.gate = Router(cfg.num_experts, cfg.hidden_size)
        self.experts = FusedMoE(cfg.num_experts, cfg.num_experts_per_tok, cfg.hidden_size, cfg.moe_intermediate_size,
                                cfg.norm_topk_prob, ctx.tp, ctx.ops, ctx.moe_method)
        self.shared_expert = self.shared_expert_gate = None
        if cfg.shared_expert_intermediate_size:
            self.shared_expert = DecoderMLP(cfg, ctx, f"{prefix}.shared_expert", cfg.shared_expert_intermediate_size)
            self.shared_expert_gate = Router(1, cfg.hidden_size)

    def forward(self, x: torch.Tensor, reduce: bool = True) -> torch.Tensor | ExpertRows:
        """(T, H) -> the block's output; reduce=False: this rank's partial sum, for ``all_reduce_add_norm``,
        which on one rank is the experts' uncombined `ExpertRows` (the norm's add sums them)."""
        logits = F.linear(x, self.gate.weight)                                   # (T, E)
        if self.shared_expert is None and self.tp.size == 1 and not reduce:
            return self.experts(x, logits, combine=False)
        if self.shared_expert is None:
            # the experts' sum straight into the reducer's buffer when there is one (no copy to reduce it)
            out = self.experts(x, logits, self.tp.reduce_buffer((x.shape[0], x.shape[1]), x.dtype))
        else:  # one reducer buffer per block (as a dense MLP): the shared expert's, the routed sum added in place
            routed = self.experts(x, logits)
            out = self.shared_expert(x, reduce=False)
            out.mul_(torch.sigmoid(F.linear(x, self.shared_expert_gate.weight))).add_(routed)
        return self.tp.all_reduce(out) if reduce else out


def make_mlp(cfg: ModelConfig, layer_idx: int, ctx: LayerContext) -> nn.Module:
    """Layer `layer_idx`'s feed-forward block: a module with ``forward(x, reduce) -> (T, hidden)`` partial sums
    (``reduce=False``: this rank's, for ``TPGroup.all_reduce_add_norm``): the mixture of experts for the sparse
    layers of an MoE model (``ModelConfig.is_moe_layer``), the dense MLP otherwise."""
    prefix = f"model.layers.{layer_idx}.mlp"
    return SparseMoeBlock(cfg, ctx, prefix) if cfg.is_moe_layer(layer_idx) else DecoderMLP(cfg, ctx, prefix)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, variant: DecoderVariant, layer_idx: int, ctx: LayerContext):
        super().__init__()
        self.tp = ctx.tp
        self.self_attn = DecoderAttention(cfg, variant, ctx, f"model.layers.{layer_idx}.self_attn")
        self.mlp = make_mlp(cfg, layer_idx, ctx)
        # each norm quantizes its rows itself where it feeds an online FP8 projection (one launch less)
        mlp_in = self.mlp.gate_up_proj if isinstance(self.mlp, DecoderMLP) else None
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ctx.ops,
                                       fp8_out=self.self_attn.qkv_proj.method.fp8_rows)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ctx.ops,
                                                fp8_out=None if mlp_in is None else mlp_in.method.fp8_rows)

    def forward(self, positions, hidden, residual, meta, out_rows: OutputRows | None = None):
        """hidden: the embeddings (residual None, first layer) or the previous layer's output as this rank's
        partial sum; returns this layer's output the same way. Each partial sum is reduced over the TP ranks
        together with the residual add + RMSNorm that follows it (``TPGroup.all_reduce_add_norm``).
        With out_rows, only those rows come out (every row's K/V is still stored)."""
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.tp.all_reduce_add_norm(hidden, residual, self.input_layernorm)
        hidden = self.self_attn(positions, hidden, meta, reduce=False, out_rows=out_rows)
        if out_rows is not None:
            residual = residual[out_rows.rows]
        hidden, residual = self.tp.all_reduce_add_norm(hidden, residual, self.post_attention_layernorm)
        return self.mlp(hidden, reduce=False), residual


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig, variant: DecoderVariant, ctx: LayerContext):
        super().__init__()
        self.tp = ctx.tp
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, ctx.tp)
        self.layers = nn.ModuleList([DecoderLayer(cfg, variant, i, ctx) for i in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ctx.ops)

    def forward(self, input_ids, positions, meta, out_rows: OutputRows | None = None):
        """The final hidden states (T, hidden); with out_rows (S rows), those rows only: the last layer then
        attends and runs its MLP for them alone (the rest of the step only writes the KV cache there)."""
        hidden, residual = self.embed_tokens(input_ids), None       # (T, hidden)
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            hidden, residual = layer(positions, hidden, residual, meta, out_rows if i == last else None)
        hidden, _ = self.tp.all_reduce_add_norm(hidden, residual, self.norm)
        return hidden


_EXPERT_WEIGHT = re.compile(r"\.experts\.(\d+)\.([A-Za-z0-9_]+)\.weight(_scale_inv)?$")


class DecoderForCausalLM(nn.Module):
    # checkpoint name -> (fused parameter name, shard id)
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, cfg: ModelConfig, variant: DecoderVariant, ctx: LayerContext):
        super().__init__()
        self.config = cfg
        self.variant = variant
        self.model = DecoderModel(cfg, variant, ctx)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, ctx.tp)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                out_rows: OutputRows | None = None) -> torch.Tensor:
        return self.model(input_ids, positions, meta, out_rows)

    def checkpoint_target(self, name: str) -> tuple[str, object]:
        """A checkpoint tensor's (parameter name, shard id): an expert's projection goes to the stacked ``w13`` /
        ``w2`` of its layer with shard (expert, "gate" | "up" | "down"), a block-FP8 checkpoint's tile scales
        (``weight_scale_inv``) to ``w13_scale`` / ``w2_scale``; the rest as packed_modules_mapping says."""
        for old, new in self.variant.checkpoint_renames:
            name = name.replace(old, new)
        m = _EXPERT_WEIGHT.search(name)
        if m and m.group(2) in self.variant.expert_names:
            shard = ("gate", "up", "down")[self.variant.expert_names.index(m.group(2))]
            param = ("w2" if shard == "down" else "w13") + ("_scale" if m.group(3) else "")
            return f"{name[:m.start()]}.experts.{param}", (int(m.group(1)), shard)
        return packed_target(name, self.packed_modules_mapping)

    def compute_logits(self, hidden: torch.Tensor, gather: bool = True) -> torch.Tensor:
        """(N, vocab) logits in the model's dtype; with gather=False this rank's (N, vocab shard) slice only."""
        return self.lm_head(hidden, gather)
