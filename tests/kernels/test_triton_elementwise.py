"""Triton RMSNorm / add+RMSNorm, SiLU-and-mul and rotary embedding against the torch references."""
import pytest
import torch

from nanovllm.kernels.activation import silu_and_mul
from nanovllm.kernels.norm import add_rms_norm, rms_norm
from nanovllm.kernels.rotary import apply_rotary
from nanovllm.layers.activation import silu_and_mul_ref
from nanovllm.layers.layernorm import add_rms_norm_ref, rms_norm_ref
from nanovllm.layers.rotary import RotaryEmbedding, apply_rotary_ref

# these kernels round like the references; under the CPU interpreter fp32 -> bf16 casts truncate instead of
# rounding, so bf16 may be one ulp off there (exact on GPU).
TOL = {torch.float32: dict(atol=1e-6, rtol=1e-6),
       torch.float16: dict(atol=1e-3, rtol=1e-3),
       torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2)}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _rand(*shape, dtype, device, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype).to(device)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(7, 96), (2, 3, 64)])
def test_rms_norm(device, dtype, shape):
    x = _rand(*shape, dtype=dtype, device=device, seed=0) * 3
    w = _rand(shape[-1], dtype=dtype, device=device, seed=1)
    out = torch.full_like(x, float("nan"))
    assert rms_norm(x, w, 1e-6, out=out) is out
    torch.testing.assert_close(out, rms_norm_ref(x, w, 1e-6), **TOL[dtype])
    torch.testing.assert_close(rms_norm(x, w, 1e-5), rms_norm_ref(x, w, 1e-5), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm(device, dtype):
    x = _rand(5, 80, dtype=dtype, device=device, seed=2)
    r = _rand(5, 80, dtype=dtype, device=device, seed=3)
    w = _rand(80, dtype=dtype, device=device, seed=4)
    ref_n, ref_s = add_rms_norm_ref(x, r, w, 1e-6)
    out, res_out = torch.full_like(x, float("nan")), torch.full_like(x, float("nan"))
    n, s = add_rms_norm(x, r, w, 1e-6, out=out, residual_out=res_out)
    assert n is out and s is res_out
    torch.testing.assert_close(s, ref_s, **TOL[dtype])
    torch.testing.assert_close(n, ref_n, **TOL[dtype])
    # in place into the residual buffer, strided rows (a column slice of a wider tensor)
    xw = _rand(5, 100, dtype=dtype, device=device, seed=5)
    xs = xw[:, 10:90]
    ref_n, ref_s = add_rms_norm_ref(xs, r, w, 1e-6)
    r2 = r.clone()
    n, s = add_rms_norm(xs, r2, w, 1e-6, residual_out=r2)
    assert s is r2
    torch.testing.assert_close(s, ref_s, **TOL[dtype])
    torch.testing.assert_close(n, ref_n, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k", [2, 8])
def test_add_rms_norm_sums_expert_rows(device, dtype, k):
    """rows_per_token=k: each token's k rows (a mixture of experts' uncombined output) are combined as
    combine_ref does, then added and normed; the kernel reads every row (a dropped row changes the sum)."""
    T, N = 6, 80
    rows = _rand(T * k, N, dtype=dtype, device=device, seed=8)
    r = _rand(T, N, dtype=dtype, device=device, seed=9)
    w = _rand(N, dtype=dtype, device=device, seed=10)
    ref_n, ref_s = add_rms_norm_ref(rows, r, w, 1e-6, rows_per_token=k)
    summed = rows.float().view(T, k, N).sum(1).to(dtype)
    torch.testing.assert_close(ref_s, summed + r)  # the reference combines first
    n, s = add_rms_norm(rows, r, w, 1e-6, rows_per_token=k)
    assert n.shape == s.shape == (T, N)
    torch.testing.assert_close(s, ref_s, **TOL[dtype])
    torch.testing.assert_close(n, ref_n, **TOL[dtype])
    n1, s1 = add_rms_norm(rows[::k].contiguous(), r, w, 1e-6)
    assert not torch.allclose(s1, s)
    with pytest.raises(ValueError, match="rows_per_token"):
        add_rms_norm(rows[:-1], r, w, 1e-6, rows_per_token=k)
    with pytest.raises(ValueError, match="rows_per_token"):
        add_rms_norm(rows, r, w, 1e-6, rows_per_token=0)


def test_rms_norm_fp32_weight_promotes(device):
    x = _rand(3, 64, dtype=torch.float16, device=device, seed=6)
    w = _rand(64, dtype=torch.float32, device=device, seed=7)
    ref = rms_norm_ref(x, w, 1e-6)
    out = rms_norm(x, w, 1e-6)
    assert out.dtype == ref.dtype == torch.float32
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(6, 2 * 72), (2, 3, 2 * 64)])
def test_silu_and_mul(device, dtype, shape):
    x = _rand(*shape, dtype=dtype, device=device, seed=8) * 2
    out = torch.full((*shape[:-1], shape[-1] // 2), float("nan"), dtype=dtype, device=device)
    assert silu_and_mul(x, out=out) is out
    torch.testing.assert_close(out, silu_and_mul_ref(x), **TOL[dtype])
    torch.testing.assert_close(silu_and_mul(x), silu_and_mul_ref(x), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("H,Hkv,D", [(4, 2, 64), (3, 1, 32), (2, 2, 80)])
def test_rotary_fused_qkv_inplace(device, dtype, H, Hkv, D):
    T = 7
    rope = RotaryEmbedding(D, 512, 10000.0).to(device)
    cache = rope.cos_sin_cache
    qkv = _rand(T, (H + 2 * Hkv) * D, dtype=dtype, device=device, seed=H + D)
    q = qkv[:, :H * D].view(T, H, D)
    k = qkv[:, H * D:(H + Hkv) * D].view(T, Hkv, D)
    v_before = qkv[:, (H + Hkv) * D:].clone()
    positions = torch.tensor([0, 1, 5, 100, 511, 3, 3], device=device)
    q_ref, k_ref = apply_rotary_ref(q, k, positions, cache)
    q_out, k_out = apply_rotary(q, k, positions, cache)
    assert q_out is q and k_out is k
    torch.testing.assert_close(q, q_ref, **TOL[dtype])
    torch.testing.assert_close(k, k_ref, **TOL[dtype])
    assert torch.equal(qkv[:, (H + Hkv) * D:], v_before)


def test_rotary_out_of_place_and_2d(device):
    T, H, Hkv, D = 5, 4, 2, 32
    rope = RotaryEmbedding(D, 64, 500000.0, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                             "high_freq_factor": 4.0,
                                             "original_max_position_embeddings": 16}).to(device)
    q = _rand(T, H * D, dtype=torch.float32, device=device, seed=11)
    k = _rand(T, Hkv * D, dtype=torch.float32, device=device, seed=12)
    positions = torch.tensor([4, 0, 63, 9, 9], dtype=torch.int32, device=device)
    q_ref, k_ref = apply_rotary_ref(q.view(T, H, D), k.view(T, Hkv, D), positions, rope.cos_sin_cache)
    q0, k0 = q.clone(), k.clone()
    q_out, k_out = apply_rotary(q, k, positions, rope.cos_sin_cache, inplace=False)
    assert torch.equal(q, q0) and torch.equal(k, k0)
    assert q_out.shape == q.shape and k_out.shape == k.shape
    torch.testing.assert_close(q_out.view(T, H, D), q_ref, **TOL[torch.float32])
    torch.testing.assert_close(k_out.view(T, Hkv, D), k_ref, **TOL[torch.float32])
    with pytest.raises(ValueError, match="contiguous"):
        apply_rotary(q.view(T, H, D).transpose(1, 2).contiguous().transpose(1, 2), k, positions,
                     rope.cos_sin_cache)
