"""FP8 kernels against their torch references: the activation quantizers and the e4m3 rounding (bit for bit), the
norms and SiLU-and-mul that quantize their output (bit for bit the unfused kernels followed by the quantizer), the
W8A8 GEMM (row-wise and block-wise scales), the e4m3 KV-cache writers (store kernel and fused q/k-norm + RoPE +
store: bit for bit) and the attention kernels reading an e4m3 cache (the varlen kernel's variants included: pointer
and TMA loads, packed or one head per program, the launch orders, the persistent grid)."""
from dataclasses import replace

import pytest
import torch

from nanovllm.attention.torch_ref import paged_attention_ref, quantize_kv_ref, store_kvcache_ref
from nanovllm.kernels.activation import silu_and_mul, silu_and_mul_fp8
from nanovllm.kernels.decode_attention import paged_decode_attention
from nanovllm.kernels.fp8_gemm import Fp8GemmConfig, w8a8_gemm
from nanovllm.kernels.fp8_quant import (
    fp8_quant_empty,
    padded_group_rows,
    per_token_group_quant_fp8,
    per_token_quant_fp8,
)
from nanovllm.kernels.fused_qkv import qkv_norm_rope_store
from nanovllm.kernels.kvcache import store_kvcache
from nanovllm.kernels.norm import add_rms_norm, add_rms_norm_fp8, rms_norm, rms_norm_fp8
from nanovllm.kernels.prefill_attention import paged_prefill_attention
from nanovllm.kernels.prefill_config import TileConfig
from nanovllm.layers.activation import silu_and_mul_ref
from nanovllm.layers.fused_qkv_ref import qkv_norm_rope_store_ref
from nanovllm.layers.layernorm import add_rms_norm_ref, rms_norm_ref
from nanovllm.layers.quantization import fp8_ref
from nanovllm.layers.rotary import RotaryEmbedding
from tests.kernels.test_triton_attention import DECODE, MIXED, TOL, VARIANT_SPECS, VARIANTS, check_variant, make_batch

FP8 = torch.float8_e4m3fn


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_quant_rounding_is_torchs(device):
    """Every rounding case of e4m3 through the per-token quantizer (scale 1: one value of 448 per row): ties to
    even at every binade (the carry into the next one included), values a hair either side of them, subnormals,
    signed zeros."""
    codes = torch.arange(256, dtype=torch.uint8)
    vals = codes[(codes & 0x7F) < 0x7F].view(FP8).float().unique()            # every finite value
    mids = (vals[1:] + vals[:-1]) / 2
    up, down = torch.full_like(mids, 1e9), torch.full_like(mids, -1e9)
    x = torch.cat([vals, mids, mids.nextafter(up), mids.nextafter(down), torch.tensor([447.9, -447.99, -0.0])])
    rows = -(-x.numel() // 255)
    x = torch.cat([x, torch.zeros(rows * 255 - x.numel())]).view(rows, 255)
    x = torch.cat([x, torch.full((rows, 1), 448.0)], 1).to(device)         # amax 448 -> scale exactly 1
    q, s = per_token_quant_fp8(x)
    assert (s == 1).all()
    assert _bits_equal(q, x.clamp(-448, 448).to(FP8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("M,K", [(5, 64), (3, 5000), (2, 8320)])  # one tile / non-power-of-two / two passes
def test_per_token_quant(device, dtype, M, K):
    g = torch.Generator().manual_seed(K)
    x = torch.randn(M, K, generator=g) * 10.0 ** torch.empty(M, 1).uniform_(-4, 3, generator=g)
    x[0] = 0.0  # an all-zero row: the minimum scale, zeros
    x = x.to(dtype).to(device)
    q, s = per_token_quant_fp8(x)
    q_ref, s_ref = fp8_ref.quantize_rows(x)
    assert _bits_equal(q, q_ref) and torch.equal(s, s_ref)
    assert (q[0].float() == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("M,K,group", [(4, 384, 128), (3, 8192, 128), (2, 96, 32)])
def test_per_token_group_quant(device, dtype, M, K, group):
    g = torch.Generator().manual_seed(K + group)
    x = (torch.randn(M, K, generator=g) * 10.0 ** torch.empty(M, K // group).uniform_(-3, 3, generator=g)
         .repeat_interleave(group, 1)).to(dtype).to(device)
    q, s = per_token_group_quant_fp8(x, group)
    _check_group_layout(q, s)
    q_ref, s_ref = fp8_ref.quantize_groups(x, group)
    assert _bits_equal(q, q_ref) and torch.equal(s, s_ref)
    with pytest.raises(ValueError, match="group size"):
        per_token_group_quant_fp8(x, 48)


def _check_group_layout(q: torch.Tensor, s: torch.Tensor) -> None:
    """Per-token-and-group rows laid out for torch._scaled_mm's block-wise scaling: q the first M rows of a buffer
    padded to a multiple of 4 rows, s column-major over the padded rows (`padded_group_rows` finds both)."""
    M, K = q.shape
    m_pad = -(-M // 4) * 4
    padded = padded_group_rows(q, s)
    assert padded is not None and s.stride() == (1, m_pad)
    qp, sp = padded
    assert qp.shape == (m_pad, K) and sp.shape == (m_pad, s.shape[1]) and torch.equal(sp[:M], s)
    assert qp.data_ptr() == q.data_ptr() and _bits_equal(qp[:M], q)


def test_padded_group_rows_refuses_other_layouts():
    q, s = fp8_quant_empty(5, 256, 128, "cpu")
    assert padded_group_rows(q, s)[0].shape == (8, 256)
    assert padded_group_rows(q.contiguous(), s.contiguous()) is None      # a copy: no padding rows, row-major
    assert padded_group_rows(q[1:], s[1:]) is None                        # a view past the buffer's start
    assert padded_group_rows(torch.zeros(8, 256, dtype=FP8), torch.zeros(8, 2).t().contiguous().t()) is not None


def _check_quantized(qs, unfused: torch.Tensor, ref: torch.Tensor, group: int | None = None) -> None:
    """A quantizing kernel's (q, s) against the quantizer on the unfused kernel's output (per token, or per token
    and `group` columns): bit for bit. Against the torch reference: within e4m3's rounding (the unfused kernels
    match their references to an ulp, tested with them: the norms' float32 sums run in another order, exp and the
    division round their own way, the interpreter truncates float32 -> bf16)."""
    q, s = qs
    M, K = q.shape
    assert q.dtype == FP8 and s.shape == (M, 1 if group is None else K // group) and s.dtype == torch.float32
    if group is None:
        q_un, s_un = per_token_quant_fp8(unfused)
    else:
        q_un, s_un = per_token_group_quant_fp8(unfused, group)
        _check_group_layout(q, s)
    assert _bits_equal(q, q_un) and torch.equal(s, s_un)
    g = K if group is None else group
    ref = ref.float().view(M, K // g, g)
    err = (q.float().view(M, K // g, g) * s[..., None] - ref).abs() / ref.abs().amax(-1, keepdim=True).clamp(min=1e-30)
    assert err.max() <= 2 ** -4 * 1.05, err.max()  # half an e4m3 ulp of the group's largest value, and the scale


@pytest.mark.parametrize("group", [None, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,N,k", [(6, 96, 1), (3, 1000, 1), (4, 128, 3)])  # k: expert rows summed per token
def test_norms_quantizing_their_rows(device, dtype, T, N, k, group):
    if group is not None and N % group:
        with pytest.raises(ValueError, match="group size"):
            rms_norm_fp8(torch.ones(2, N, device=device), torch.ones(N, device=device), 1e-6, group=group)
        return
    g = torch.Generator().manual_seed(T * N + k)
    x = (torch.randn(T * k, N, generator=g) * 4).to(dtype).to(device)
    x[:, :N // 3] *= 1e-3  # groups of very different magnitudes
    r = torch.randn(T, N, generator=g).to(dtype).to(device)
    w = torch.randn(N, generator=g).to(dtype).to(device)
    x[0] = 0.0
    if k == 1:
        _check_quantized(rms_norm_fp8(x, w, 1e-6, group=group), rms_norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6),
                         group=group)
    qs, summed = add_rms_norm_fp8(x, r, w, 1e-6, rows_per_token=k, group=group)
    normed, summed_un = add_rms_norm(x, r, w, 1e-6, rows_per_token=k)
    _check_quantized(qs, normed, add_rms_norm_ref(x, r, w, 1e-6, rows_per_token=k)[0], group=group)
    assert torch.equal(summed, summed_un)
    r2 = r.clone()  # the sum in place of the residual, as the decoder layers update it
    assert add_rms_norm_fp8(x, r2, w, 1e-6, residual_out=r2, rows_per_token=k, group=group)[1] is r2
    assert torch.equal(r2, summed)
    with pytest.raises(ValueError, match="2-D"):
        rms_norm_fp8(x.view(1, *x.shape), w, 1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("M,inter,group", [(5, 72, None), (3, 1500, None), (2, 5000, None),  # one tile / any I /
                                           (3, 96, 32), (2, 4608, 128)])                   # two passes; groups
def test_silu_and_mul_quantizing_its_rows(device, dtype, M, inter, group):
    g = torch.Generator().manual_seed(M + inter)
    x = (torch.randn(M, 2 * inter, generator=g) * 3).to(dtype).to(device)
    x[:, inter // 2:inter] *= 1e-3  # groups of very different magnitudes
    x[1, :inter] = 0.0  # a zero row: the minimum scale
    _check_quantized(silu_and_mul_fp8(x, group), silu_and_mul(x), silu_and_mul_ref(x), group)
    with pytest.raises(ValueError, match="even"):
        silu_and_mul_fp8(x[:, :-1].contiguous())
    with pytest.raises(ValueError, match="2-D"):
        silu_and_mul_fp8(x.view(1, *x.shape))
    with pytest.raises(ValueError, match="group size"):
        silu_and_mul_fp8(x, 48)


GEMM_TOL = {torch.float32: dict(atol=1e-2, rtol=1e-3) if torch.cuda.is_available() else dict(atol=1e-4, rtol=1e-4),
            torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("M,N,K", [(5, 96, 256), (40, 200, 384), (70, 160, 136)])  # decode / mid / large-M tiles
def test_w8a8_gemm_rowwise(device, dtype, M, N, K):
    g = torch.Generator().manual_seed(M + N + K)
    x = torch.randn(M, K, generator=g).to(dtype).to(device)
    wq, ws = fp8_ref.quantize_rows((torch.randn(N, K, generator=g) * 0.05).to(device))
    ws = ws.view(-1)
    bias = torch.randn(N, generator=g).to(dtype).to(device)
    xq, xs = per_token_quant_fp8(x)
    out = torch.full((M, N), float("nan"), dtype=dtype, device=device)
    res = w8a8_gemm(xq, xs, wq, ws, dtype, bias=bias, out=out)
    assert res is out
    torch.testing.assert_close(out, fp8_ref.fp8_linear_rowwise_ref(xq, xs, wq, ws, dtype, bias), **GEMM_TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("M,N,K,block", [(3, 256, 384, (128, 128)), (33, 200, 256, (128, 128)),
                                         (80, 96, 192, (32, 64))])  # partial last weight block (N=200)
def test_w8a8_gemm_blockwise(device, dtype, M, N, K, block):
    g = torch.Generator().manual_seed(M + N + K)
    x = torch.randn(M, K, generator=g).to(dtype).to(device)
    w = torch.randn(N, K, generator=g) * 10.0 ** torch.empty(N, 1).uniform_(-2, 0, generator=g)
    wq, ws = fp8_ref.quantize_blocks(w.to(device), block)
    xq, xs = per_token_group_quant_fp8(x, block[1])
    out = w8a8_gemm(xq, xs, wq, ws, dtype, block=block)
    ref = fp8_ref.fp8_linear_block_ref(xq, xs, wq, ws, block, dtype)
    torch.testing.assert_close(out, ref, **GEMM_TOL[dtype])
    assert xs.stride(0) == 1 and torch.equal(w8a8_gemm(xq, xs.contiguous(), wq, ws, dtype, block=block), out)
    # what FP8 costs against the unquantized product: a few percent of its magnitude
    exact = x.float() @ w.to(device).t()
    assert (out.float() - exact).abs().max() < 0.08 * exact.abs().max()


@pytest.mark.parametrize("config", [Fp8GemmConfig(16, 32, 256, 4, 5), Fp8GemmConfig(64, 64, 128, 4, 3)])
def test_w8a8_gemm_given_tiling(device, config):
    """A tiling given explicitly (fp8_gemm_bench's candidates): the same product, K not a multiple of its k-tile,
    N not of its n-tile."""
    g = torch.Generator().manual_seed(7)
    xq, xs = per_token_quant_fp8(torch.randn(40, 320, generator=g).to(device))
    wq, ws = fp8_ref.quantize_rows((torch.randn(200, 320, generator=g) * 0.05).to(device))
    out = w8a8_gemm(xq, xs, wq, ws.view(-1), torch.float32, config=config)
    torch.testing.assert_close(out, fp8_ref.fp8_linear_rowwise_ref(xq, xs, wq, ws.view(-1), torch.float32),
                               **GEMM_TOL[torch.float32])
    xg, xgs = per_token_group_quant_fp8(torch.randn(8, 256, generator=g).to(device), 128)
    wb, wbs = fp8_ref.quantize_blocks(torch.randn(64, 256, generator=g).to(device), (128, 128))
    with pytest.raises(ValueError, match="block_k == 128"):
        w8a8_gemm(xg, xgs, wb, wbs, torch.float32, block=(128, 128), config=Fp8GemmConfig(16, 32, 256))
    with pytest.raises(ValueError, match="block_n must be a power of two"):
        Fp8GemmConfig(16, 48)


def test_w8a8_gemm_errors(device):
    xq, xs = per_token_quant_fp8(torch.randn(4, 64, device=device))
    wq, ws = fp8_ref.quantize_rows(torch.randn(32, 64, device=device))
    with pytest.raises(ValueError, match="ws must be float32"):
        w8a8_gemm(xq, xs, wq, ws, torch.float32)                      # (N, 1) instead of (N,)
    with pytest.raises(ValueError, match="xq must be"):
        w8a8_gemm(xq.float(), xs, wq, ws.view(-1), torch.float32)
    with pytest.raises(ValueError, match="powers of two"):
        w8a8_gemm(xq, xs, wq, ws.view(-1), torch.float32, block=(128, 48))


# --- the e4m3 KV cache -------------------------------------------------------------------------------------------

def _fp8_cache(num_blocks, block_size, Hkv, D, device):
    """An e4m3 cache and its scales, NaN everywhere (so an unwritten slot compares NaN)."""
    cache = torch.full((num_blocks, block_size, Hkv, D), float("nan"), device=device).to(FP8)
    return cache, torch.full((num_blocks, block_size, Hkv), float("nan"), device=device)


def _assert_same_cache(a, b):
    assert _bits_equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,Hkv,D,block_size", [(13, 2, 32, 16), (9, 3, 24, 48)])  # non-power-of-two head_dim
def test_store_kvcache_fp8(device, dtype, T, Hkv, D, block_size):
    g = torch.Generator().manual_seed(T)
    num_blocks = 3
    slots = torch.randperm(num_blocks * block_size, generator=g)[:T]
    slots[::3] = -1
    # one head per token at a very different scale (unnormalized V): per-(token, head) scales keep it exact
    key = (torch.randn(T, Hkv, D, generator=g) * torch.tensor([1e-3, 30.0, 1.0])[:Hkv, None]).to(dtype)
    value = torch.randn(T, Hkv, D, generator=g).to(dtype)
    key[1] = 0.0
    key, value, slots = key.to(device), value.to(device), slots.to(device)
    kc, ks = _fp8_cache(num_blocks, block_size, Hkv, D, device)
    vc, vs = _fp8_cache(num_blocks, block_size, Hkv, D, device)
    refs = [t.clone() for t in (kc, vc, ks, vs)]
    store_kvcache(key, value, kc, vc, slots, ks, vs)
    store_kvcache_ref(key, value, refs[0], refs[1], slots, refs[2], refs[3])
    _assert_same_cache(kc, refs[0])
    _assert_same_cache(vc, refs[1])
    torch.testing.assert_close(ks, refs[2], atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(vs, refs[3], atol=0, rtol=0, equal_nan=True)
    # dequantized, every stored head is within e4m3's relative step of what was stored
    written = slots >= 0
    flat = kc.view(-1, Hkv, D)[slots[written]].float() * ks.view(-1, Hkv)[slots[written]][..., None]
    k = key[written].float()
    assert ((flat - k).abs() <= k.abs().amax(-1, keepdim=True) * 2.0 ** -4).all()


def test_kv_scale_errors(device):
    key = torch.randn(4, 2, 16, device=device)
    kc, ks = _fp8_cache(2, 16, 2, 16, device)
    slots = torch.arange(4, device=device)
    with pytest.raises(ValueError, match="needs k_scales"):
        store_kvcache(key, key, kc, kc.clone(), slots)
    with pytest.raises(ValueError, match="KV scales go with"):
        store_kvcache(key, key, kc.float(), kc.float(), slots, ks, ks.clone())
    with pytest.raises(ValueError, match="needs v_scales"):
        store_kvcache(key, key, kc, kc.clone(), slots, ks, ks[:, :8])


@pytest.mark.parametrize("dtype,norm", [(torch.float32, True), (torch.bfloat16, True), (torch.float32, False)])
def test_fused_qkv_store_fp8(device, dtype, norm):
    """v is copied as is, so its e4m3 codes and scales are the reference's bit for bit. k after the norm and RoPE
    is within the fused kernel's tolerance of the reference's (tests/kernels/test_triton_fused_qkv.py); each side
    is then within half an e4m3 step (2^-4 relative) of its own k, so the dequantized keys agree to that sum."""
    from tests.kernels.test_triton_fused_qkv import TOL as FUSED_TOL
    g = torch.Generator().manual_seed(3)
    T, H, Hkv, D, block_size = 11, 4, 2, 32, 16
    rope = RotaryEmbedding(D, 512, 10000.0, None)
    qkv = torch.randn(T, (H + 2 * Hkv) * D, generator=g).to(dtype).to(device)
    pos = torch.randint(0, 500, (T,), generator=g).to(device)
    slots = torch.randperm(3 * block_size, generator=g)[:T].to(device)
    slots[2] = -1
    w = [(1 + 0.1 * torch.randn(D, generator=g)).to(dtype).to(device) for _ in range(2)] if norm else [None, None]
    cs = rope.cos_sin_cache.to(device)
    kc, ks = _fp8_cache(3, block_size, Hkv, D, device)
    vc, vs = _fp8_cache(3, block_size, Hkv, D, device)
    refs = [t.clone() for t in (kc, vc, ks, vs)]
    q = qkv_norm_rope_store(qkv, pos, cs, w[0], w[1], 1e-6, kc, vc, slots, H, Hkv, D, k_scales=ks, v_scales=vs)
    q_ref = qkv_norm_rope_store_ref(qkv, pos, cs, w[0], w[1], 1e-6, refs[0], refs[1], slots, H, Hkv, D,
                                    k_scales=refs[2], v_scales=refs[3])
    torch.testing.assert_close(q, q_ref, **FUSED_TOL[dtype])
    _assert_same_cache(vc, refs[1])
    torch.testing.assert_close(vs, refs[3], atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(ks, refs[2], equal_nan=True, **FUSED_TOL[dtype])
    written = slots[slots >= 0]
    s_ref = refs[2].view(-1, Hkv)[written][..., None]
    k = kc.view(-1, Hkv, D)[written].float() * ks.view(-1, Hkv)[written][..., None]
    k_ref = refs[0].view(-1, Hkv, D)[written].float() * s_ref
    tol = FUSED_TOL[dtype]
    bound = tol["atol"] + (tol["rtol"] + 2.0 ** -3) * k_ref.abs() + 2.0 ** -9 * s_ref
    assert ((k - k_ref).abs() <= 1.01 * bound).all()
    if dtype == torch.float32:  # k within 2e-6 of the reference's: the codes differ only at rounding boundaries
        assert (kc.view(torch.uint8) != refs[0].view(torch.uint8)).float().mean() < 0.01


def _fp8_batch(specs, H, Hkv, D, block_size, dtype, device, seed):
    """make_batch's caches quantized per (token, head); the reference gets the same with NaN (unowned slots) as 0."""
    batch = make_batch(specs, H, Hkv, D, block_size, torch.float32, device, seed=seed)
    batch["q"] = batch["q"].to(dtype)
    for name in ("k", "v"):
        c = batch.pop(f"{name}_cache")
        q, s = quantize_kv_ref(c.reshape(-1, Hkv, D))
        batch[f"{name}_cache"], batch[f"{name}_scales"] = q.view(c.shape), s.view(c.shape[:3])
    return batch


def _fp8_reference(batch, scale):
    clean = {n: batch[n].float().nan_to_num(0.0).to(FP8) if n.endswith("cache") else batch[n].nan_to_num(0.0)
             for n in ("k_cache", "v_cache", "k_scales", "v_scales")}
    return paged_attention_ref(batch["q"], clean["k_cache"], clean["v_cache"], batch["cu_seqlens_q"],
                               batch["seq_lens"], batch["block_tables"], scale, batch["max_seqlen_q"],
                               k_scales=clean["k_scales"], v_scales=clean["v_scales"])


@pytest.mark.parametrize("block_size,H,Hkv,D,dtype", [
    (16, 4, 2, 32, torch.float32),    # per-key block lookup
    (64, 8, 2, 16, torch.float32),    # one block per KV tile
    (32, 4, 1, 64, torch.bfloat16),
])
def test_prefill_attention_fp8_cache(device, block_size, H, Hkv, D, dtype):
    batch = _fp8_batch(MIXED, H, Hkv, D, block_size, dtype, device, seed=D)
    scale = D ** -0.5
    out = torch.full_like(batch["q"], float("nan"))
    paged_prefill_attention(batch["q"], batch["k_cache"], batch["v_cache"], batch["cu_seqlens_q"], batch["seq_lens"],
                            batch["block_tables"], scale, batch["max_seqlen_q"], out=out,
                            k_scales=batch["k_scales"], v_scales=batch["v_scales"])
    assert not out.isnan().any()
    torch.testing.assert_close(out, _fp8_reference(batch, scale), **TOL[dtype])


def _fp8_prefill(batch, scale, config=None, persistent=False):
    out = torch.full_like(batch["q"], float("nan"))
    paged_prefill_attention(batch["q"], batch["k_cache"], batch["v_cache"], batch["cu_seqlens_q"], batch["seq_lens"],
                            batch["block_tables"], scale, batch["max_seqlen_q"], out=out, config=config,
                            persistent=persistent, k_scales=batch["k_scales"], v_scales=batch["v_scales"])
    return out


@pytest.mark.parametrize("config", VARIANTS, ids=lambda c: c.name)
def test_prefill_variants_fp8_cache(device, config, monkeypatch):
    """Every kind of varlen variant on an e4m3 cache whose unowned slots hold NaN (values and scales), on the
    boundaries of causal block skipping (test_triton_attention's VARIANT_SPECS): the TMA ones through a descriptor
    over the e4m3 cache (scales through pointers) exactly when the config asks; each matches the reference and
    the same config's pointer twin bit for bit (the two paths differ in how the bytes arrive, not in arithmetic)."""
    batch = _fp8_batch(VARIANT_SPECS, 4, 2, 32, 32, torch.float32, device, seed=config.block_m + config.block_n)
    out = check_variant(monkeypatch, config, lambda: _fp8_prefill(batch, 0.3, config), _fp8_reference(batch, 0.3))
    if config.tma:
        assert torch.equal(out, _fp8_prefill(batch, 0.3, replace(config, tma=False)))


@pytest.mark.parametrize("pack", [True, False], ids=["pack", "nopack"])
def test_prefill_fp8_cache_half_queries_tma(device, pack):
    """The engine's case: bf16 queries over an e4m3 cache through TMA tiles (GQA 4, head_dim 64), packed or one
    query head per program; and fp16 queries on the pointer path (a block size that is no multiple of block_n)."""
    specs = [(70, 23), (1, 1), (40, 40), (0, 0), (130, 64)]
    cfg = TileConfig(64, 32, 4, 2, tma=True, pack_gqa=pack, order="sorted")
    for dtype, block_size in ((torch.bfloat16, 64), (torch.float16, 48)):
        batch = _fp8_batch(specs, 8, 2, 64, block_size, dtype, device, seed=block_size + pack)
        out = _fp8_prefill(batch, 0.125, cfg)
        torch.testing.assert_close(out, _fp8_reference(batch, 0.125).to(dtype), **TOL[dtype])


def test_prefill_fp8_cache_persistent_grid(device, monkeypatch):
    """The persistent grid (mixed-step CUDA graphs) on an e4m3 cache, TMA tiles: leading rows that belong to no
    sequence stay untouched, fewer programs than tiles, results as on the one-program-per-tile grid."""
    from nanovllm.kernels import prefill_attention as attention
    specs = [(40, 1)] * 3 + [(100, 37), (48, 48), (0, 1), (70, 5), (50, 20)]
    batch = _fp8_batch(specs, 4, 2, 16, 32, torch.float32, device, seed=17)
    shifted = dict(batch, cu_seqlens_q=batch["cu_seqlens_q"].clone())
    shifted["cu_seqlens_q"][:4] = 3      # rows 0-2: the first three sequences get no queries
    cfg = TileConfig(32, 16, 4, 2, tma=True, order="sorted")
    tiles = _fp8_prefill(shifted, 0.25, cfg)
    monkeypatch.setattr(attention, "sm_count", lambda _device: 2)
    out = _fp8_prefill(shifted, 0.25, cfg, persistent=True)
    assert out[:3].isnan().all() and tiles[:3].isnan().all()
    torch.testing.assert_close(out[3:], _fp8_reference(batch, 0.25)[3:], **TOL[torch.float32])
    assert torch.equal(out[3:], tiles[3:])


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("block_size,H,Hkv,D,dtype", [
    (16, 4, 2, 32, torch.float32),
    (256, 4, 1, 32, torch.float32),
    (32, 4, 1, 64, torch.bfloat16),
])
def test_decode_attention_fp8_cache(device, block_size, H, Hkv, D, dtype, num_splits):
    batch = _fp8_batch(DECODE, H, Hkv, D, block_size, dtype, device, seed=D + 1)
    scale = D ** -0.5
    out = torch.full_like(batch["q"], float("nan"))
    paged_decode_attention(batch["q"], batch["k_cache"], batch["v_cache"], batch["seq_lens"], batch["block_tables"],
                           scale, out=out, num_splits=num_splits, k_scales=batch["k_scales"],
                           v_scales=batch["v_scales"])
    assert not out.isnan().any()
    torch.testing.assert_close(out, _fp8_reference(batch, scale), **TOL[dtype])


def test_attention_fp8_cache_needs_scales(device):
    batch = _fp8_batch(DECODE, 4, 2, 32, 16, torch.float32, device, seed=0)
    with pytest.raises(ValueError, match="needs k_scales"):
        paged_decode_attention(batch["q"], batch["k_cache"], batch["v_cache"], batch["seq_lens"],
                               batch["block_tables"], 0.2)
