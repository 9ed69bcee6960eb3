"""Mixture-of-experts models: greedy tokens identical to transformers (float32, CPU) on tiny random Qwen3-MoE (one
dense layer, one sparse), Qwen2-MoE (a shared expert, no renormalization) and Mixtral checkpoints, by default and
with prefix hits here; chunked prefill, preemption and text prompts run in tests/test_parity.py over the MoE
architectures too; the Triton MoE kernels in the engine under the interpreter; the expert weights' loading, config
checks and the MoE weight count."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from nanovllm import LLM, SamplingParams
from nanovllm.config import ModelConfig
from tests.conftest import make_prompts
from tests.test_parity import _check

MOE_ARCHS = ["qwen3_moe", "qwen2_moe", "mixtral"]


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_default_settings(arch, tiny_ckpt, hf_greedy):
    path = tiny_ckpt(arch)
    llm = LLM(path, device="cpu", dtype="float32")
    kinds = [type(layer.mlp).__name__ for layer in llm.engine.runner.model.model.layers]
    assert kinds == (["SparseMoeBlock"] * 2 if arch == "mixtral" else ["DecoderMLP", "SparseMoeBlock"])
    outs = _check(llm, path, make_prompts(), hf_greedy)
    assert all(o["finish_reason"] == "length" for o in outs)


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe"])
def test_prefix_cache_hits(arch, tiny_ckpt, hf_greedy):
    path = tiny_ckpt(arch)
    llm = LLM(path, device="cpu", kvcache_block_size=16)
    prompts = make_prompts()
    _check(llm, path, prompts, hf_greedy)
    hits = llm.engine.block_manager.prefix_hits
    _check(llm, path, prompts[::-1], hf_greedy)
    assert llm.engine.block_manager.prefix_hits - hits == sum(len(p) > 16 for p in prompts)


def test_triton_moe_kernels_in_the_engine(tiny_ckpt, hf_greedy):
    """The Triton path (routing, sorted layout, grouped GEMMs, combine, with the Triton attention) under the CPU
    interpreter: chunked prefill mixed with decodes, then prefix hits."""
    pytest.importorskip("triton")
    from nanovllm import kernels
    path = tiny_ckpt("qwen3_moe")
    llm = LLM(path, device="cpu", dtype="float32", attention_backend="triton", max_num_batched_tokens=48,
              kvcache_block_size=32)
    assert llm.engine.runner.model.model.layers[1].mlp.experts.fused_moe is kernels.fused_moe
    prompts = make_prompts([1, 15, 31, 47, 63, 100], seed=2)
    params = SamplingParams(temperature=0.0, max_tokens=6)
    _check(llm, path, prompts, hf_greedy, params)
    _check(llm, path, prompts[:3], hf_greedy, params)  # prefix hits


def test_expert_checkpoint_errors(tiny_ckpt, tmp_path):
    """A checkpoint missing one expert's tensor, or with one of the wrong shape, is a ValueError naming it."""
    from safetensors.torch import load_file, save_file
    src = tiny_ckpt("qwen3_moe")
    name = "model.layers.1.mlp.experts.5.up_proj.weight"
    for case in ("missing", "shape"):
        dst = tmp_path / case
        shutil.copytree(src, dst)
        tensors = load_file(os.path.join(dst, "model.safetensors"))
        if case == "missing":
            del tensors[name]
        else:
            tensors[name] = tensors[name][:, :-1].contiguous()
        save_file(tensors, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
        with pytest.raises(ValueError, match=r"\(5, 'up'\)" if case == "missing" else "expert 5 up"):
            LLM(str(dst), device="cpu")


def test_dummy_weights_replicate_the_router(tiny_ckpt):
    """load_format="dummy" fills the stacked experts and the router; a router (replicated under tensor
    parallelism) is drawn the same on every rank, a rank's expert shards from its own seed."""
    from nanovllm.models.loader import init_dummy
    llm = LLM(tiny_ckpt("qwen3_moe"), device="cpu", load_format="dummy")
    model = llm.engine.runner.model
    moe = model.model.layers[1].mlp
    w13, gate = moe.experts.w13.clone(), moe.gate.weight.clone()
    assert 0.015 < w13.std().item() < 0.025 and 0.015 < gate.std().item() < 0.025
    init_dummy(model, 0, rank=1)
    assert torch.equal(moe.gate.weight, gate) and not torch.equal(moe.experts.w13, w13)
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0]["token_ids"]) == 4


def _cfg(**over) -> dict:
    cfg = {"architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
           "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "num_experts": 8,
           "num_experts_per_tok": 2, "moe_intermediate_size": 16}
    cfg.update(over)
    return {k: v for k, v in cfg.items() if v is not None}


@pytest.mark.parametrize("over, match", [
    ({"num_experts_per_tok": 9}, "num_experts_per_tok=9 exceeds num_experts=8"),
    ({"num_experts_per_tok": None}, "needs 'num_experts_per_tok'"),
    ({"moe_intermediate_size": None}, "needs 'moe_intermediate_size'"),
    ({"moe_intermediate_size": 0}, "moe_intermediate_size must be an int >= 1"),
    ({"num_experts": -1}, "num_experts must be an int >= 0"),
    ({"num_local_experts": 4}, "disagree"),
    ({"decoder_sparse_step": 0}, "decoder_sparse_step"),
    ({"mlp_only_layers": [4]}, r"mlp_only_layers entry 4 .*\[0, 4\)"),
    ({"mlp_only_layers": 1}, "mlp_only_layers must be a list"),
    ({"norm_topk_prob": "yes"}, "norm_topk_prob"),
    ({"architectures": ["Qwen2MoeForCausalLM"]}, "needs 'shared_expert_intermediate_size'"),
])
def test_moe_config_errors(over, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_dict(_cfg(**over))


def test_moe_layer_rule_and_mixtral_fields():
    c = ModelConfig.from_dict(_cfg(decoder_sparse_step=2, mlp_only_layers=[3]))
    assert [c.is_moe_layer(i) for i in range(4)] == [False, True, False, False]
    assert not ModelConfig.from_dict(_cfg(num_experts=0)).is_moe_layer(1)  # transformers: all dense then
    m = ModelConfig.from_dict(_cfg(architectures=["MixtralForCausalLM"], num_experts=None, num_local_experts=8,
                                   moe_intermediate_size=None, mlp_only_layers=[1], norm_topk_prob=False))
    assert (m.num_experts, m.moe_intermediate_size, m.norm_topk_prob, m.mlp_only_layers) == (8, 64, True, ())
    dense = ModelConfig.from_dict(_cfg(architectures=["Qwen3ForCausalLM"]))  # MoE keys are no Qwen3 fields
    assert dense.num_experts == 0 and not dense.is_moe_layer(0)


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_matmul_params_count_every_expert(arch, tiny_ckpt):
    """ModelConfig.matmul_params (the weights a decode step reads: every expert) equals transformers' parameter
    count less the norms and biases (the tied embedding counts once, as the LM head)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    path = tiny_ckpt(arch)
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    want = sum(p.numel() for n, p in hf.named_parameters() if p.dim() > 1)
    assert ModelConfig.from_dir(path).matmul_params() == want


def test_qwen3_30b_a3b_config():
    """The benchmark's model: 48 sparse layers of 128 experts, top-8; ~30.5B weights read per decode step."""
    path = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "models", "qwen3-30b-a3b")
    c = ModelConfig.from_dir(path)
    assert (c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size, c.norm_topk_prob) == (128, 8, 768, True)
    assert all(c.is_moe_layer(i) for i in range(c.num_layers))
    experts = 48 * 128 * 3 * 2048 * 768
    assert c.matmul_params() - experts == 48 * (2048 * 40 * 128 + 4096 * 2048 + 128 * 2048) + 151936 * 2048
    with open(os.path.join(path, "config.json")) as f:
        assert json.load(f)["architectures"] == ["Qwen3MoeForCausalLM"]


def test_expert_kernels_compile_once_per_shape():
    """What a MoE method asks `fused_moe_compile` for on CUDA (no GPU here: a stand-in layer): once per weight
    shape and activation dtype, with a quantized method's scales, in arguments the real function takes."""
    import inspect
    from types import SimpleNamespace

    from nanovllm.kernels.moe import fused_moe_compile
    from nanovllm.layers.moe import UnquantizedMoEMethod
    calls = []
    w = SimpleNamespace(shape=(8, 64, 32), device="cuda:0", is_cuda=True)
    layer = SimpleNamespace(w13=w, w2=w, top_k=2, renormalize=True,
                            fused_moe_compile=lambda *a, **k: calls.append((a, k)))
    method = UnquantizedMoEMethod()
    for dtype in (torch.bfloat16, torch.bfloat16, torch.float16):
        method.compile_kernels(layer, dtype, w13_scale="s13", w2_scale="s2", block=(128, 128))
    assert [k["dtype"] for _, k in calls] == [torch.bfloat16, torch.float16]
    args, kwargs = calls[0]
    bound = inspect.signature(fused_moe_compile).bind(*args, **kwargs).arguments
    assert bound["w13_scale"] == "s13" and bound["w2_scale"] == "s2" and bound["block"] == (128, 128)
