"""FP8 in the engine on CPU: online FP8 weights, the e4m3 KV cache and a block-FP8 checkpoint (written here) load
and generate, token for token equal to transformers running the same quantization (fake-quantized: quantize
and dequantize exactly as the engine does, tests/fp8_helpers.py), with chunked prefill, prefix hits, preemption
and tensor parallelism; close to the unquantized model; bad values rejected by name."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from nanovllm import LLM, SamplingParams
from nanovllm.config import EngineArgs, EngineConfig
from tests.conftest import make_prompts
from tests.fp8_helpers import assert_same_tokens, greedy, reference_model, write_block_fp8_checkpoint

MAX_NEW = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)
CPU = dict(device="cpu", dtype="float32")
# a tiny Qwen3 whose projections divide into whole 128 x 128 blocks, also per rank at TP=2 (q 512, k/v 256, o_proj
# in 512, gate/up 256, down in 256)
BLOCK_ARCH = dict(hidden_size=128, num_heads=4, num_kv_heads=2, head_dim=128, intermediate_size=256)


def _tokens(path, prompts, params=GREEDY, **kw):
    llm = LLM(path, **{**CPU, **kw})
    try:
        return [o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def refs():
    """refs(path, weights=None, kv=False, ...) -> the fake-quantized transformers model (cached)."""
    cache = {}

    def get(path, weights=None, kv=False, skip=(), tp=1):
        key = (path, weights, kv, skip, tp)
        if key not in cache:
            cache[key] = reference_model(path, weights, kv, skip, tp)
        return cache[key]
    return get


@pytest.fixture(scope="module")
def block_ckpt(tiny_ckpt, tmp_path_factory):
    """(bf16/fp32 source checkpoint, its block-FP8 copy in the Hub's format)."""
    src = tiny_ckpt("qwen3", **BLOCK_ARCH)
    return src, write_block_fp8_checkpoint(src, str(tmp_path_factory.mktemp("fp8") / "qwen3-fp8"))


def _with_quant_config(src, dst, qcfg):
    os.makedirs(dst)
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = qcfg
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f)
    return dst


# --- arguments ---------------------------------------------------------------------------------------------------

def test_bad_values_are_named(tiny_ckpt, tmp_path):
    path = tiny_ckpt("qwen3")
    with pytest.raises(ValueError, match="quantization must be None or 'fp8', got 'awq'"):
        EngineArgs(model=path, quantization="awq")
    with pytest.raises(ValueError, match="kv_cache_dtype must be .*'fp8'.*got 'int4'"):
        EngineArgs(model=path, kv_cache_dtype="int4")
    for i, (qcfg, match) in enumerate([
        ({"quant_method": "gptq", "bits": 4}, "quant_method 'gptq' is not supported"),
        ({"quant_method": "awq"}, "'awq'"),
        ({"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [128, 128]}, "'static'"),
        ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "without weight_block_size"),
        ({"quant_method": "fp8", "weight_block_size": [128, 100]}, "powers of two"),
        ({"quant_method": "fp8", "weight_block_size": [128, 128], "fmt": "e5m2"}, "'e5m2'"),
    ]):
        with pytest.raises(ValueError, match=match):
            EngineConfig.resolve(EngineArgs(model=_with_quant_config(path, str(tmp_path / str(i)), qcfg)))


def test_engine_args_and_cli(tiny_ckpt):
    from nanovllm.cli import _HELP, build_parser, engine_kwargs
    cfg = EngineConfig.resolve(EngineArgs(model=tiny_ckpt("qwen3"), device="cpu", quantization="fp8",
                                          kv_cache_dtype="fp8_e4m3"))
    assert cfg.quantization.method == "fp8" and not cfg.quantization.checkpoint
    assert cfg.cache_dtype == torch.float8_e4m3fn
    plain = EngineConfig.resolve(EngineArgs(model=tiny_ckpt("qwen3"), device="cpu"))
    assert plain.quantization is None and plain.cache_dtype == plain.dtype == torch.float32
    ns = build_parser().parse_args(["generate", "--quantization", "fp8", "--kv-cache-dtype", "fp8"])
    assert engine_kwargs(ns) == {"quantization": "fp8", "kv_cache_dtype": "fp8"}
    assert "fp8" in _HELP["quantization"] and "fp8" in _HELP["kv_cache_dtype"]


# --- online FP8 weights ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("arch", ["qwen3", "qwen2"])  # qwen2: q/k/v biases beside the FP8 GEMM
def test_online_fp8_matches_fake_quant_reference(arch, tiny_ckpt, refs):
    path = tiny_ckpt(arch)
    prompts = make_prompts()
    out = _tokens(path, prompts, quantization="fp8", max_num_batched_tokens=128)   # chunked prefill
    ref_model = refs(path, "rows")
    assert_same_tokens(ref_model, prompts, greedy(ref_model, prompts, MAX_NEW), out)


def test_fp8_first_tokens_agree_with_unquantized(tiny_ckpt):
    """How close FP8 stays to the unquantized model: the first greedy token of 64 random prompts.

    An e4m3 value keeps 3 mantissa bits: rounding moves each weight and activation by up to 2^-4 of itself
    (~2.5% RMS), so one quantized projection is off by ~3.5% of its output (two roundings; 3.5% measured). The
    tiny random model chains ten of them (two layers of q/k/v -> o, gate/up -> down) and, unlike a trained
    model, its residual stream does not dilute them (its block outputs are larger than its inputs), so its logits
    move by ~15% of their RMS (~0.35 of 2.3, measured on 200 prompts). A quarter of random prompts have a top-2
    gap below 0.2 (tests/test_tiny_model.py: median ~0.5), so a fifth to a quarter of first tokens flip: 159 of
    200 agree (80%); we assert two thirds of 64. No flip where the gap is large: every prompt whose top-2 gap
    exceeds 1.5 (4x the logit error) agrees. The e4m3 KV cache alone moves the logits by ~4.6%: ~90% agree."""
    path = tiny_ckpt("qwen3")
    prompts = make_prompts([1 + (37 * i) % 300 for i in range(64)], seed=5)
    one = SamplingParams(temperature=0.0, max_tokens=1, logprobs=2)
    llm = LLM(path, **CPU)
    base = llm.generate(prompts, one, use_tqdm=False)
    llm.shutdown()
    top2 = [sorted((lp.logprob for lp in o["logprobs"][0].values()), reverse=True)[:2] for o in base]
    gaps = [a - b for a, b in top2]
    for kw, at_least in ((dict(quantization="fp8"), 2 / 3), (dict(kv_cache_dtype="fp8"), 0.8)):
        out = _tokens(path, prompts, one, **kw)
        agree = [o == b["token_ids"] for o, b in zip(out, base)]
        assert sum(agree) >= at_least * len(prompts), (kw, sum(agree))
        assert all(a or g < 1.5 for a, g in zip(agree, gaps)), (kw, [g for a, g in zip(agree, gaps) if not a])


# --- the e4m3 KV cache -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_fp8_kv_cache_matches_fake_quant_reference(arch, tiny_ckpt, refs):
    """K/V quantized per (token, head) when stored, dequantized when read: the same tokens as transformers with
    K/V fake-quantized the same way, through chunked prefill, preemption (recompute) and prefix-cache hits."""
    path = tiny_ckpt(arch)
    prompts = make_prompts()
    llm = LLM(path, **CPU, kv_cache_dtype="fp8", kvcache_block_size=16, num_kvcache_blocks=34, max_model_len=512,
              max_num_batched_tokens=64)
    ref_model = refs(path, kv=True)
    ref = greedy(ref_model, prompts, MAX_NEW)
    for rerun in (prompts, prompts[::3]):  # the second pass starts from cached prefixes
        out = [o["token_ids"] for o in llm.generate(rerun, GREEDY, use_tqdm=False)]
        assert_same_tokens(ref_model, rerun, [ref[prompts.index(p)] for p in rerun], out)
    assert llm.engine.scheduler.num_preemptions > 0
    llm.shutdown()


def test_fp8_kv_cache_layout_and_sizing(tiny_ckpt, monkeypatch):
    """The cache holds e4m3 values and float32 scales per (token, KV head); a block costs (D + 4) / (D * itemsize)
    of a model-dtype block, so a fixed budget holds that many times more blocks."""
    from nanovllm.engine import kv_cache
    path = tiny_ckpt("qwen3")
    monkeypatch.setattr(kv_cache, "CPU_KV_CACHE_BYTES", 4 << 20)
    counts = {}
    for kv in ("auto", "fp8"):
        llm = LLM(path, **CPU, kv_cache_dtype=kv, kvcache_block_size=16)
        runner = llm.engine.runner
        counts[kv] = runner.num_kvcache_blocks
        layers = runner.attn_layers
        if kv == "fp8":
            assert runner.kv_cache.dtype == torch.float8_e4m3fn
            assert runner.kv_scales.shape == runner.kv_cache.shape[:-1] and runner.kv_scales.dtype == torch.float32
            assert layers[1].k_scales.data_ptr() == runner.kv_scales[0, 1].data_ptr()
        else:
            assert runner.kv_scales is None and layers[0].k_scales is None
        llm.shutdown()
    D = layers[0].head_dim
    assert counts["fp8"] == (4 << 20) // kv_cache.bytes_per_block(layers, 16, torch.float8_e4m3fn)
    assert kv_cache.bytes_per_block(layers, 16, torch.float32) * (D + 4) == \
        kv_cache.bytes_per_block(layers, 16, torch.float8_e4m3fn) * 4 * D
    assert counts["fp8"] > 3 * counts["auto"]  # float32 model: 4 D bytes per value -> D + 4


def test_fp8_kv_and_weights_under_triton_interpreter(tiny_ckpt):
    """The Triton path on an e4m3 cache (fused q/k-norm + RoPE + store, varlen prefill and decode kernels, mixed
    steps) gives the torch backend's tokens, with chunked prefill and prefix hits."""
    path = tiny_ckpt("qwen3")
    prompts = make_prompts([1, 20, 40], seed=2)   # (the interpreter runs each kernel program op by op: few tokens)
    params = SamplingParams(temperature=0.0, max_tokens=4)
    ref = _tokens(path, prompts, params, kv_cache_dtype="fp8")
    llm = LLM(path, **CPU, kv_cache_dtype="fp8", attention_backend="triton", max_num_batched_tokens=32,
              kvcache_block_size=16)
    assert [o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)] == ref
    assert [o["token_ids"] for o in llm.generate(prompts[2:], params, use_tqdm=False)] == ref[2:]
    llm.shutdown()


@pytest.mark.parametrize("scheme", ["online", "block"])
def test_fp8_under_triton_interpreter_norms_quantize_rows(scheme, tiny_ckpt, block_ckpt):
    """FP8 with the Triton kernels (CPU interpreter), online and from a block-FP8 checkpoint: the norms before
    q/k/v and gate/up and the SiLU-and-mul before down hand their rows over quantized as the projection quantizes
    (`Fp8Rows`, per token or per token and 128 columns: no quantizer launch in those projections; o_proj, after the
    attention, quantizes its own), and the tokens are the torch backend's, with chunked prefill and prefix hits."""
    from nanovllm.layers.quantization.fp8_rows import Fp8Rows
    path, kw, group = (tiny_ckpt("qwen3"), dict(quantization="fp8"), None) if scheme == "online" else \
        (block_ckpt[1], {}, 128)
    prompts = make_prompts([1, 20, 40], seed=2)
    params = SamplingParams(temperature=0.0, max_tokens=4)
    ref = _tokens(path, prompts, params, **kw)
    llm = LLM(path, **CPU, **kw, attention_backend="triton", max_num_batched_tokens=32, kvcache_block_size=16)
    seen: dict[str, set] = {}

    def record(kind):
        return lambda module, args: seen.setdefault(kind, set()).add(
            args[0].group if isinstance(args[0], Fp8Rows) else "plain")
    for name, mod in llm.engine.runner.model.named_modules():
        if name.endswith("_proj"):
            mod.register_forward_pre_hook(record(name.rsplit(".", 1)[1]))
    assert [o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)] == ref
    assert [o["token_ids"] for o in llm.generate(prompts[2:], params, use_tqdm=False)] == ref[2:]
    llm.shutdown()
    assert seen == {"qkv_proj": {group}, "o_proj": {"plain"}, "gate_up_proj": {group}, "down_proj": {group}}, seen


# --- FP8 experts (mixture of experts) -----------------------------------------------------------------------------

@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe"])  # qwen2_moe: a shared expert (an FP8 linear MLP)
def test_fp8_experts_match_fake_quant_reference(arch, tiny_ckpt, refs):
    """quantization="fp8" on a mixture of experts: the experts stored e4m3 with per-(expert, row) scales, the
    router in the model dtype; the tokens of transformers with the same fake quantization (experts per row, their
    gate/up input per token, the dense projections and Qwen2-MoE's shared expert per token and channel), with
    chunked prefill."""
    from nanovllm.layers.quantization.fp8 import Fp8MoEMethod
    path = tiny_ckpt(arch)
    prompts = make_prompts()
    llm = LLM(path, **CPU, quantization="fp8", max_num_batched_tokens=128)
    block = llm.engine.runner.model.model.layers[1].mlp
    E, inter, H = block.experts.num_experts, block.experts.intermediate_size, block.experts.hidden_size
    assert isinstance(block.experts.method, Fp8MoEMethod) and block.gate.weight.dtype == torch.float32
    assert block.experts.w13.dtype == block.experts.w2.dtype == torch.float8_e4m3fn
    assert block.experts.w13_scale.shape == (E, 2 * inter) and block.experts.w2_scale.shape == (E, H)
    out = [o["token_ids"] for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    llm.shutdown()
    ref_model = refs(path, "rows")
    assert_same_tokens(ref_model, prompts, greedy(ref_model, prompts, MAX_NEW), out)


def test_fp8_experts_triton_kernels_and_tensor_parallel(tiny_ckpt, refs):
    """FP8 experts through the Triton MoE kernels (CPU interpreter) give the torch backend's tokens; at TP=2 (each
    rank quantizes its slice of the experts) the tokens of the reference quantizing per rank."""
    path = tiny_ckpt("qwen3_moe")
    prompts = make_prompts([1, 20, 40], seed=2)
    params = SamplingParams(temperature=0.0, max_tokens=4)
    ref = _tokens(path, prompts, params, quantization="fp8")
    llm = LLM(path, **CPU, quantization="fp8", attention_backend="triton", max_num_batched_tokens=32,
              kvcache_block_size=16)
    from nanovllm import kernels
    assert llm.engine.runner.model.model.layers[1].mlp.experts.fused_moe is kernels.fused_moe
    assert [o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)] == ref
    llm.shutdown()
    prompts = make_prompts([1, 5, 17, 40], high=480)
    llm = LLM(path, **CPU, tensor_parallel_size=2, quantization="fp8", max_model_len=256, kvcache_block_size=16,
              num_kvcache_blocks=48, max_num_seqs=8)
    out = [o["token_ids"] for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    llm.shutdown()
    ref_model = refs(path, "rows", tp=2)
    assert_same_tokens(ref_model, prompts, greedy(ref_model, prompts, MAX_NEW), out)


def test_block_fp8_moe_checkpoint_loads_and_generates(tiny_ckpt, refs, tmp_path):
    """A block-FP8 mixture of experts (the Qwen3-30B-A3B-FP8 layout: every expert's projections e4m3 with their
    weight_scale_inv tiles, the router kept): the tokens of transformers fake-quantizing the same tiles, with the
    torch backend and through the Triton kernels (CPU interpreter), and at TP=2 (the tiles follow the ranks)."""
    from nanovllm import kernels
    from nanovllm.layers.quantization.fp8 import Fp8BlockMoEMethod
    src = tiny_ckpt("qwen3_moe")
    path = write_block_fp8_checkpoint(src, str(tmp_path / "moe-fp8"), block=(16, 16))
    prompts = make_prompts([1, 5, 17, 40], high=480)
    llm = LLM(path, **CPU)
    experts = llm.engine.runner.model.model.layers[1].mlp.experts
    assert isinstance(experts.method, Fp8BlockMoEMethod) and experts.w13.dtype == torch.float8_e4m3fn
    assert experts.w13_scale.shape == (8, 2 * 32 // 16, 64 // 16) and experts.w2_scale.shape == (8, 64 // 16, 2)
    out = [o["token_ids"] for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    llm.shutdown()
    ref_model = refs(src, (16, 16))
    assert_same_tokens(ref_model, prompts, greedy(ref_model, prompts, MAX_NEW), out)
    params = SamplingParams(temperature=0.0, max_tokens=4)
    ref = [o[:4] for o in out]
    llm = LLM(path, **CPU, attention_backend="triton", max_num_batched_tokens=32, kvcache_block_size=16)
    assert llm.engine.runner.model.model.layers[1].mlp.experts.fused_moe is kernels.fused_moe
    assert [o["token_ids"] for o in llm.generate(prompts[:3], params, use_tqdm=False)] == ref[:3]
    llm.shutdown()
    llm = LLM(path, **CPU, tensor_parallel_size=2, max_model_len=256, kvcache_block_size=16, num_kvcache_blocks=48,
              max_num_seqs=8)
    assert [o["token_ids"] for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == out  # the same numerics
    llm.shutdown()


def test_block_fp8_moe_tiles_must_not_split(tiny_ckpt, tmp_path):
    """Experts 32 wide cannot hold 64-wide tiles: refused by name, before any weight loads."""
    path = write_block_fp8_checkpoint(tiny_ckpt("qwen3_moe"), str(tmp_path / "moe-fp8"), block=(64, 64))
    with pytest.raises(ValueError, match=r"intermediate size per rank \(32 .* not a multiple .* \[64, 64\]"):
        LLM(path, **CPU)


def test_block_fp8_moe_hidden_size_must_be_whole_tiles(tiny_ckpt, tmp_path):
    """The experts' input is quantized per token and bk columns: a hidden size of 48 with 32-wide tiles is refused
    by name when the model is built (the attention and the dense layer stay unquantized, so only the experts ask)."""
    src = tiny_ckpt("qwen3_moe", hidden_size=48, head_dim=12)
    dense = [f"model.layers.{i}.self_attn.{p}_proj" for i in (0, 1) for p in "qkvo"]
    dense += [f"model.layers.0.mlp.{p}_proj" for p in ("gate", "up", "down")]
    path = write_block_fp8_checkpoint(src, str(tmp_path / "moe-fp8"), block=(16, 32), not_converted=tuple(dense))
    with pytest.raises(ValueError, match=r"hidden size 48 is not a multiple of the checkpoint's weight_block_size 32"):
        LLM(path, **CPU)


def test_block_fp8_moe_checkpoint_errors(tiny_ckpt, tmp_path):
    """An expert weight stored unquantized, or tile scales of the wrong shape: a ValueError naming the tensor."""
    from safetensors.torch import load_file, save_file
    good = write_block_fp8_checkpoint(tiny_ckpt("qwen3_moe"), str(tmp_path / "good"), block=(16, 16))
    name = "model.layers.1.mlp.experts.3.up_proj.weight"
    for case, change in (("bf16", lambda t: {name: t[name].float()}),
                         ("scales", lambda t: {name + "_scale_inv": t[name + "_scale_inv"][:1]})):
        path = str(tmp_path / case)
        shutil.copytree(good, path)
        tensors = load_file(os.path.join(path, "model.safetensors"))
        tensors.update(change(tensors))
        save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
        match = "stores expert weights as float8_e4m3fn" if case == "bf16" else r"expert 3 up scales of shape \(1, 4\)"
        with pytest.raises(ValueError, match=match) as e:
            LLM(path, **CPU)
        assert name in str(e.value)


# --- block-FP8 checkpoints ---------------------------------------------------------------------------------------

def test_block_fp8_checkpoint_loads_and_generates(block_ckpt, refs):
    from nanovllm.layers.quantization.fp8 import Fp8BlockLinearMethod
    src, path = block_ckpt
    prompts = make_prompts()
    llm = LLM(path, **CPU, max_num_batched_tokens=128)
    cfg = llm.engine.config.quantization
    assert cfg.checkpoint and cfg.weight_block_size == (128, 128)
    qkv = llm.engine.runner.model.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv.method, Fp8BlockLinearMethod) and qkv.weight.dtype == torch.float8_e4m3fn
    # q, k and v (and their tile scales) landed side by side in the fused layer, as written
    from safetensors.torch import load_file
    ck = load_file(os.path.join(path, "model.safetensors"))
    names = [f"model.layers.0.self_attn.{p}_proj" for p in "qkv"]
    assert torch.equal(qkv.weight.view(torch.uint8), torch.cat([ck[f"{n}.weight"] for n in names]).view(torch.uint8))
    assert torch.equal(qkv.weight_scale_inv, torch.cat([ck[f"{n}.weight_scale_inv"] for n in names]))
    out = [o["token_ids"] for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    llm.shutdown()
    ref_model = refs(src, (128, 128))
    assert_same_tokens(ref_model, prompts, greedy(ref_model, prompts, MAX_NEW), out)
    # asking for fp8 explicitly is the checkpoint's own; random weights in the checkpoint's format run too
    assert _tokens(path, prompts[:4], quantization="fp8") == out[:4]
    assert all(len(t) == MAX_NEW for t in _tokens(path, prompts[:2], load_format="dummy"))


def test_block_fp8_modules_not_converted(block_ckpt, refs, tmp_path):
    from nanovllm.layers.linear import UnquantizedLinearMethod
    src, _ = block_ckpt
    keep = ("model.layers.1.mlp.down_proj",)
    path = write_block_fp8_checkpoint(src, str(tmp_path / "keep"), not_converted=keep)
    llm = LLM(path, **CPU)
    down = llm.engine.runner.model.model.layers[1].mlp.down_proj
    assert isinstance(down.method, UnquantizedLinearMethod) and down.weight.dtype == torch.float32
    prompts = make_prompts()[:8]
    out = [o["token_ids"] for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    llm.shutdown()
    ref_model = refs(src, (128, 128), skip=keep)
    assert_same_tokens(ref_model, prompts, greedy(ref_model, prompts, MAX_NEW), out)
    # q kept but k and v quantized: they are one fused layer here
    partial = write_block_fp8_checkpoint(src, str(tmp_path / "partial"),
                                         not_converted=("model.layers.0.self_attn.q_proj",))
    with pytest.raises(ValueError, match="quantizes some of .*q_proj.*but not all"):
        LLM(partial, **CPU)
    # a projection stored unquantized that the config does not list
    unlisted = str(tmp_path / "unlisted")
    shutil.copytree(path, unlisted)
    with open(os.path.join(unlisted, "config.json")) as f:
        cfg = json.load(f)
    del cfg["quantization_config"]["modules_to_not_convert"]
    with open(os.path.join(unlisted, "config.json"), "w") as f:
        json.dump(cfg, f)
    with pytest.raises(ValueError, match="model.layers.1.mlp.down_proj.weight.*float8_e4m3fn, found torch.float32"):
        LLM(unlisted, **CPU)


def test_block_scales_shard_with_tensor_parallelism():
    """Each rank's tile scales follow its rows (column-parallel, fused parts) or columns (row-parallel): the
    ranks' outputs put together equal the unsharded layer's; a split that cuts tiles is refused."""
    from nanovllm.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
    from nanovllm.layers.quantization import fp8_ref
    from nanovllm.layers.quantization.fp8 import Fp8BlockLinearMethod
    from tests.distributed.test_sharded_layers import LocalGroup
    method = Fp8BlockLinearMethod((128, 128), use_kernels=False)
    g = torch.Generator().manual_seed(0)

    def quantized(*shape):
        return fp8_ref.quantize_blocks(torch.randn(*shape, generator=g), (128, 128))

    q, k, v = quantized(512, 128), quantized(256, 128), quantized(256, 128)
    gate, up, down = quantized(256, 128), quantized(256, 128), quantized(128, 256)
    x = torch.randn(3, 128, generator=g)

    def build(tp, rank):
        grp = LocalGroup(rank, tp)
        layers = []
        specs = ((QKVParallelLinear, (128, 128, 4, 2), ((q, "q"), (k, "k"), (v, "v"))),
                 (MergedColumnParallelLinear, (128, [256, 256]), ((gate, 0), (up, 1))),
                 (RowParallelLinear, (256, 128), ((down, None),)))
        for cls, args, parts in specs:
            layer = cls(*args, False, grp, method)
            for (w, s), shard in parts:
                layer.weight.weight_loader(layer.weight, w, shard)
                layer.weight_scale_inv.weight_loader(layer.weight_scale_inv, s, shard)
            layers.append(layer)
        return layers

    full = build(1, 0)
    ranks = [build(2, r) for r in range(2)]
    d = 128
    per_rank = [r[0](x) for r in ranks]  # [q (2 heads) | k (1 head) | v (1 head)] per rank
    ref = full[0](x)
    for name, lo, n in (("q", 0, 256), ("k", 512, 128), ("v", 768, 128)):
        off = {"q": 0, "k": 256, "v": 384}[name]
        torch.testing.assert_close(torch.cat([o[:, off:off + n] for o in per_rank], 1), ref[:, lo:lo + 2 * n])
    torch.testing.assert_close(torch.cat([r[1](x) for r in ranks], 1)[:, [*range(128), *range(256, 384),
                                                                        *range(128, 256), *range(384, 512)]],
                               full[1](x))
    h = torch.randn(3, 256, generator=g)
    torch.testing.assert_close(sum(r[2](h[:, i * d:(i + 1) * d]) for i, r in enumerate(ranks)), full[2](h),
                               atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="do not fall on whole 128-wide weight blocks"):
        build(4, 1)   # gate/up: 64 rows per rank
    with pytest.raises(ValueError, match="64 input features per rank are not a multiple of .* 128"):
        RowParallelLinear(256, 128, False, LocalGroup(0, 4), method)


def test_fp8_tensor_parallel(tiny_ckpt, block_ckpt, refs):
    """TP=2 over gloo, with the e4m3 KV cache: online FP8 equals transformers quantizing the same way (each rank of
    a row-parallel layer quantizes its own slice of the input features, weights and activations); the block-FP8
    checkpoint too (its tiles and activation groups follow the ranks: the same numerics as TP=1)."""
    engine = dict(**CPU, max_model_len=256, kvcache_block_size=16, num_kvcache_blocks=48, max_num_seqs=8)
    prompts = make_prompts([1, 5, 17, 40], high=480)
    path = tiny_ckpt("qwen3")
    llm = LLM(path, tensor_parallel_size=2, quantization="fp8", kv_cache_dtype="fp8", **engine)
    out = [o["token_ids"] for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    llm.shutdown()
    ref_model = refs(path, "rows", kv=True, tp=2)
    assert_same_tokens(ref_model, prompts, greedy(ref_model, prompts, MAX_NEW), out)
    src, block = block_ckpt
    llm = LLM(block, tensor_parallel_size=2, kv_cache_dtype="fp8", **engine)
    out = [o["token_ids"] for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    llm.shutdown()
    ref_model = refs(src, (128, 128), kv=True)
    assert_same_tokens(ref_model, prompts, greedy(ref_model, prompts, MAX_NEW), out)
