"""The Llama-style decoder shared by Llama 3.x, Qwen2/2.5 and Qwen3.

The three differ only in small switches: Qwen2 has q/k/v biases (and no o_proj bias), Qwen3 normalizes
each query and key head (q_norm / k_norm) before RoPE, Llama 3 scales RoPE frequencies. Every layer is
built from one `LayerContext`: its tensor-parallel group (size 1 = no sharding), its kernels, the attention
backend and each linear layer's method, asked for by the layer's checkpoint name (its quantization may differ
from layer to layer). `make_mlp` is where a layer's feed-forward block is chosen (dense today).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from nanovllm.attention.backend import AttentionMetadata, OutputRows
from nanovllm.config import ModelConfig
from nanovllm.layers.attention import Attention
from nanovllm.layers.context import LayerContext
from nanovllm.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from nanovllm.layers.layernorm import RMSNorm
from nanovllm.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from nanovllm.layers.rotary import RotaryEmbedding


@dataclass(frozen=True)
class DecoderVariant:
    qk_norm: bool = False          # Qwen3
    qkv_bias: bool | None = None   # None: config's attention_bias
    o_bias: bool | None = None     # None: config's attention_bias


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
    """The dense SwiGLU feed-forward block."""

    def __init__(self, cfg: ModelConfig, ctx: LayerContext, prefix: str):
        super().__init__()
        if cfg.hidden_act != "silu":
            raise ValueError(f"hidden_act {cfg.hidden_act!r} is not supported (only 'silu')")
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [cfg.intermediate_size] * 2, cfg.mlp_bias,
                                                       ctx.tp, ctx.linear(f"{prefix}.gate_up_proj"))
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, cfg.mlp_bias, ctx.tp,
                                           ctx.linear(f"{prefix}.down_proj"))
        self.act = ctx.ops.silu_and_mul

    def forward(self, x: torch.Tensor, reduce: bool = True) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)), reduce)


def make_mlp(cfg: ModelConfig, layer_idx: int, ctx: LayerContext) -> nn.Module:
    """Layer `layer_idx`'s feed-forward block: a module with ``forward(x, reduce) -> (T, hidden)`` partial sums
    (``reduce=False``: this rank's, for ``TPGroup.all_reduce_add_norm``). Every layer is dense today; a
    mixture-of-experts block would be picked here from the config (per-layer sparsity)."""
    return DecoderMLP(cfg, ctx, f"model.layers.{layer_idx}.mlp")


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, variant: DecoderVariant, layer_idx: int, ctx: LayerContext):
        super().__init__()
        self.tp = ctx.tp
        self.self_attn = DecoderAttention(cfg, variant, ctx, f"model.layers.{layer_idx}.self_attn")
        self.mlp = make_mlp(cfg, layer_idx, ctx)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ctx.ops)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ctx.ops)

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


class DecoderForCausalLM(nn.Module):
    # checkpoint name -> (fused parameter name, shard id)
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, cfg: ModelConfig, variant: DecoderVariant, ctx: LayerContext):
        super().__init__()
        self.config = cfg
        self.model = DecoderModel(cfg, variant, ctx)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, ctx.tp)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                out_rows: OutputRows | None = None) -> torch.Tensor:
        return self.model(input_ids, positions, meta, out_rows)

    def compute_logits(self, hidden: torch.Tensor, gather: bool = True) -> torch.Tensor:
        """(N, vocab) logits in the model's dtype; with gather=False this rank's (N, vocab shard) slice only."""
        return self.lm_head(hidden, gather)
