"""Fused QK-norm + RoPE + KV-store kernel against its torch reference, and in the engine (CPU interpreter)."""
import os

import pytest
import torch

from nanovllm import LLM, SamplingParams
from nanovllm.kernels.fused_qkv import qkv_norm_rope_store
from nanovllm.layers.fused_qkv_ref import qkv_norm_rope_store_ref
from nanovllm.layers.rotary import RotaryEmbedding
from tests.conftest import make_prompts

# A few ulps: the kernel rounds at every op like the reference (bf16 is bit-exact when fp32 -> bf16 casts round
# to nearest), but the CPU interpreter truncates those casts, and the float32 norm reduction order differs. The
# bf16 atol is 2 ulps of RoPE's products (|x| < 8), which a result of their cancellation can be off by.
TOL = {torch.float32: dict(atol=2e-6, rtol=2e-6),
       torch.float16: dict(atol=2 ** -8, rtol=2 ** -9),
       torch.bfloat16: dict(atol=2 ** -4, rtol=2 ** -6)}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
NUM_BLOCKS, BLOCK_SIZE, MAX_POS = 4, 4, 256


def _rand(*shape, dtype, device, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to(device)


def _case(T, H, Hkv, D, dtype, device, seed, norm, pad=0, wdtype=None):
    """qkv (T, width) as a column slice of a (T, width + pad) tensor, positions, norm weights, cos/sin cache."""
    width = (H + 2 * Hkv) * D
    qkv = _rand(T, width + pad, dtype=dtype, device=device, seed=seed, scale=2.0)[:, pad:]
    g = torch.Generator().manual_seed(seed + 1)
    positions = torch.randint(0, MAX_POS, (T,), generator=g).to(device)
    wdtype = wdtype or dtype
    qw = (1 + 0.3 * _rand(D, dtype=torch.float32, device=device, seed=seed + 2)).to(wdtype) if norm else None
    kw = (1 + 0.3 * _rand(D, dtype=torch.float32, device=device, seed=seed + 3)).to(wdtype) if norm else None
    cs = RotaryEmbedding(D, MAX_POS, 10000.0).cos_sin_cache.to(device)
    return qkv, positions, qw, kw, cs


def _nan_cache(Hkv, D, dtype, device):
    return torch.full((NUM_BLOCKS, BLOCK_SIZE, Hkv, D), float("nan"), dtype=dtype, device=device)


def _run_both(qkv, positions, cs, qw, kw, slots, H, Hkv, D, cache_dtype=None, eps=1e-6):
    """Kernel and reference from NaN-poisoned outputs; returns ((q, kc, vc) kernel, (q, kc, vc) reference)."""
    dev = qkv.device
    cache_dtype = cache_dtype or qkv.dtype
    out_dtype = qkv.dtype if qw is None else torch.promote_types(qw.dtype, qkv.dtype)
    res = []
    for fn in (qkv_norm_rope_store, qkv_norm_rope_store_ref):
        kc, vc = _nan_cache(Hkv, D, cache_dtype, dev), _nan_cache(Hkv, D, cache_dtype, dev)
        q_out = torch.full((qkv.shape[0], H, D), float("nan"), dtype=out_dtype, device=dev)
        q = fn(qkv, positions, cs, qw, kw, eps, kc, vc, slots, H, Hkv, D, q_out=q_out)
        assert q is q_out
        res.append((q, kc, vc))
    return res


def _check(got, ref, slots, dtype, v_exact=True):
    (q, kc, vc), (q_ref, kc_ref, vc_ref) = got, ref
    assert not q.isnan().any(), "q_out not fully written"
    torch.testing.assert_close(q, q_ref, **TOL[dtype])
    # exactly the slots in slot_mapping are written (every element of them); the rest stay NaN
    written = torch.zeros(NUM_BLOCKS * BLOCK_SIZE, dtype=torch.bool)
    written[slots[slots >= 0].long().cpu()] = True
    for c in (kc, vc):
        nan_rows = c.isnan().reshape(NUM_BLOCKS * BLOCK_SIZE, -1).cpu()
        assert torch.equal(nan_rows.all(1), ~written) and not nan_rows[written].any()
    torch.testing.assert_close(kc, kc_ref, equal_nan=True, **TOL[dtype])
    vtol = dict(atol=0, rtol=0) if v_exact else TOL[dtype]  # v is copied as is (cast to the cache dtype)
    torch.testing.assert_close(vc, vc_ref, equal_nan=True, **vtol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("norm", [True, False], ids=["qknorm", "nonorm"])
@pytest.mark.parametrize("H,Hkv", [(4, 4), (4, 2), (8, 2)])
def test_matches_reference(device, dtype, norm, H, Hkv):
    T, D = 6, 32
    qkv, positions, qw, kw, cs = _case(T, H, Hkv, D, dtype, device, seed=H * 10 + Hkv, norm=norm, pad=24)
    assert qkv.stride(0) > qkv.shape[1]  # strided rows
    slots = torch.tensor([5, 0, -1, 15, 9, -1], device=device)
    got, ref = _run_both(qkv, positions, cs, qw, kw, slots, H, Hkv, D)
    _check(got, ref, slots, dtype)


@pytest.mark.parametrize("D", [80, 128])
def test_head_dims_int32_and_decode(device, D):
    """Non-power-of-two half (80), Qwen3's 128 with GQA 2; int32 positions / slots; contiguous qkv; T=1."""
    H, Hkv = 4, 2
    qkv, positions, qw, kw, cs = _case(5, H, Hkv, D, torch.float32, device, seed=D, norm=True)
    slots = torch.tensor([12, -1, 3, 4, 1], dtype=torch.int32, device=device)
    got, ref = _run_both(qkv, positions.int(), cs, qw, kw, slots, H, Hkv, D)
    _check(got, ref, slots, torch.float32)
    got, ref = _run_both(qkv[2:3], positions[2:3], cs, qw, kw, slots[2:3], H, Hkv, D)
    _check(got, ref, slots[2:3], torch.float32)


def test_promotion_cache_cast_and_default_out(device):
    """float32 norm weights with bf16 activations -> float32 q / RoPE (as the reference promotes), cast to a
    bf16 cache; q_out allocated by the op (contiguous)."""
    H, Hkv, D, T = 4, 2, 32, 4
    qkv, positions, qw, kw, cs = _case(T, H, Hkv, D, torch.bfloat16, device, seed=7, norm=True,
                                       wdtype=torch.float32)
    slots = torch.tensor([2, 7, 8, -1], device=device)
    got, ref = _run_both(qkv, positions, cs, qw, kw, slots, H, Hkv, D)
    assert got[0].dtype == ref[0].dtype == torch.float32
    _check(got, ref, slots, torch.bfloat16)
    kc = _nan_cache(Hkv, D, torch.bfloat16, device)
    q = qkv_norm_rope_store(qkv, positions, cs, qw, kw, 1e-6, kc, kc.clone(), slots, H, Hkv, D)
    assert q.shape == (T, H, D) and q.is_contiguous() and q.dtype == torch.float32
    assert torch.equal(q, got[0])
    # an fp32 input written to a bf16 cache is cast like store_kvcache_ref
    qkv32, *_ = _case(T, H, Hkv, D, torch.float32, device, seed=8, norm=False)
    got, ref = _run_both(qkv32, positions, cs, None, None, slots, H, Hkv, D, cache_dtype=torch.bfloat16)
    _check(got, ref, slots, torch.bfloat16, v_exact=False)


def test_empty_and_errors(device):
    H, Hkv, D = 4, 2, 16
    qkv, positions, qw, kw, cs = _case(3, H, Hkv, D, torch.float32, device, seed=1, norm=True)
    kc = _nan_cache(Hkv, D, torch.float32, device)
    vc = kc.clone()
    slots = torch.tensor([0, 1, 2], device=device)
    q = qkv_norm_rope_store(qkv[:0], positions[:0], cs, qw, kw, 1e-6, kc, vc, slots[:0], H, Hkv, D)
    assert q.shape == (0, H, D) and kc.isnan().all()
    args = [qkv, positions, cs, qw, kw, 1e-6, kc, vc, slots, H, Hkv, D]

    def bad(i, value, match):
        a = list(args)
        a[i] = value
        with pytest.raises(ValueError, match=match):
            qkv_norm_rope_store(*a)

    bad(0, qkv[:, :-D], "qkv must be")
    bad(0, qkv.t().contiguous().t(), "contiguous last dim")
    bad(0, qkv.int(), "unsupported dtype")
    bad(1, positions[:2], "positions must be")
    bad(1, positions.float(), "int32/int64")
    bad(2, cs[:, :D // 2], "cos_sin_cache must be")
    bad(4, None, "both q_norm_weight and k_norm_weight")
    bad(4, kw[:-1], "k_norm_weight must be")
    bad(4, kw.half(), "dtypes differ")
    bad(6, kc[..., :1, :], "k_cache/v_cache")
    bad(7, vc.transpose(0, 1).contiguous().transpose(0, 1), "same strides")
    bad(8, slots[:2], "slot_mapping must be")
    bad(11, 15, "even head_dim")
    with pytest.raises(ValueError, match="q_out must be"):
        qkv_norm_rope_store(*args, q_out=torch.empty(3, H, D, dtype=torch.float16, device=device))


# --- engine integration: DecoderAttention's fused path (one op + backend.attend) -------------------------------

PROMPTS = make_prompts([1, 5, 17], seed=3)
GREEDY = SamplingParams(temperature=0.0, max_tokens=4)


def _counting(op):
    calls = []

    def wrapped(*args, **kwargs):
        calls.append(args[0].shape[0])
        return op(*args, **kwargs)

    return wrapped, calls


@pytest.fixture(scope="module")
def torch_tokens(tiny_ckpt):
    """Greedy token ids of the unfused torch-backend engine, per arch."""
    cache = {}

    def get(arch):
        if arch not in cache:
            llm = LLM(tiny_ckpt(arch), device="cpu", dtype="float32", kvcache_block_size=16)
            cache[arch] = [o["token_ids"] for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
        return cache[arch]

    return get


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") in ("", "0"),
                    reason="a device=\"cpu\" engine can run Triton kernels only under TRITON_INTERPRET=1")
@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_engine_fused_triton(arch, tiny_ckpt, torch_tokens, monkeypatch):
    """The triton attention backend builds every attention layer with the fused kernel (prefill and decode steps,
    then backend.attend) and gives the torch engine's greedy tokens."""
    from nanovllm import kernels
    calls = []
    op = kernels.qkv_norm_rope_store

    def counting(*args, **kwargs):
        calls.append(args[0].shape[0])
        return op(*args, **kwargs)
    monkeypatch.setattr(kernels, "qkv_norm_rope_store", counting)  # (picked up when the model is built)
    llm = LLM(tiny_ckpt(arch), device="cpu", dtype="float32", attention_backend="triton", kvcache_block_size=16)
    model = llm.engine.runner.model
    calls.clear()  # (the warm-up steps)
    toks = [o["token_ids"] for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert toks == torch_tokens(arch)
    # one prefill step (all prompts' tokens) and decode steps (one token per sequence), every layer
    n = model.config.num_layers
    assert calls[:n] == [sum(map(len, PROMPTS))] * n and calls[n:] == [len(PROMPTS)] * n * (GREEDY.max_tokens - 1)


def test_engine_fused_reference_path(tiny_ckpt, torch_tokens):
    """The same integration path with the torch reference op and the torch backend's attend (no interpreter)."""
    import dataclasses

    from nanovllm.attention.backend import TorchAttentionBackend
    from nanovllm.config import ModelConfig
    from nanovllm.engine.kv_cache import bind, cache_shape
    from nanovllm.layers.attention import Attention
    from nanovllm.layers.context import LayerContext
    from nanovllm.layers.ops import TORCH_OPS
    from nanovllm.models.loader import load_safetensors
    from nanovllm.models.registry import build_model
    path = tiny_ckpt("qwen3")
    op, calls = _counting(qkv_norm_rope_store_ref)
    ops = dataclasses.replace(TORCH_OPS, qkv_norm_rope_store=op)
    llm = LLM(path, device="cpu", dtype="float32", kvcache_block_size=16)
    runner = llm.engine.runner
    model = build_model(ModelConfig.from_dir(path), LayerContext(attention=TorchAttentionBackend(), ops=ops))
    load_safetensors(model, path)
    runner.model = model.eval()
    runner.attn_layers = [m for m in model.modules() if isinstance(m, Attention)]
    bind(runner.attn_layers, runner.kv_cache)
    assert tuple(runner.kv_cache.shape) == cache_shape(runner.attn_layers, runner.num_kvcache_blocks, 16)
    toks = [o["token_ids"] for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert calls and toks == torch_tokens("qwen3")
