"""Triton store_kvcache against store_kvcache_ref."""
import pytest
import torch

from nanovllm.attention.torch_ref import store_kvcache_ref
from nanovllm.kernels.kvcache import store_kvcache


def _case(T, Hkv, D, num_blocks, block_size, dtype, device, seed, fused=False, kv_dtype=None):
    g = torch.Generator().manual_seed(seed)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:T]
    slots[::3] = -1  # padding tokens
    if fused:  # key/value as slices of a fused qkv projection output (T, (H + 2 Hkv) * D)
        H = 2 * Hkv
        qkv = torch.randn(T, (H + 2 * Hkv) * D, generator=g).to(kv_dtype or dtype).to(device)
        key = qkv[:, H * D:(H + Hkv) * D].view(T, Hkv, D)
        value = qkv[:, (H + Hkv) * D:].view(T, Hkv, D)
    else:
        key = torch.randn(T, Hkv, D, generator=g).to(kv_dtype or dtype).to(device)
        value = torch.randn(T, Hkv, D, generator=g).to(kv_dtype or dtype).to(device)
    k_cache = torch.full((num_blocks, block_size, Hkv, D), float("nan"), dtype=dtype, device=device)
    v_cache = torch.full_like(k_cache, float("nan"))
    return key, value, k_cache, v_cache, slots.to(device)


@pytest.mark.parametrize("T,Hkv,D,num_blocks,block_size,dtype,kv_dtype,fused,slot_dtype", [
    (13, 2, 32, 4, 16, torch.float32, None, False, torch.int64),
    (20, 3, 64, 3, 32, torch.float16, None, True, torch.int32),
    (9, 1, 16, 2, 48, torch.bfloat16, None, False, torch.int32),
    (11, 2, 24, 2, 16, torch.float16, torch.float32, True, torch.int64),  # cast on store, non-pow2 head_dim
])
def test_store_kvcache(device, T, Hkv, D, num_blocks, block_size, dtype, kv_dtype, fused, slot_dtype):
    key, value, k_cache, v_cache, slots = _case(T, Hkv, D, num_blocks, block_size, dtype, device, seed=T,
                                                fused=fused, kv_dtype=kv_dtype)
    slots = slots.to(slot_dtype)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    store_kvcache_ref(key, value, k_ref, v_ref, slots)
    store_kvcache(key, value, k_cache, v_cache, slots)
    # untouched slots stay NaN in both; written ones match exactly
    torch.testing.assert_close(k_cache, k_ref, atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(v_cache, v_ref, atol=0, rtol=0, equal_nan=True)


def test_store_kvcache_strided_cache(device):
    # the per-layer cache is a slice of a bigger (2, layers, ...) allocation
    key, value, _, _, slots = _case(10, 2, 16, 3, 16, torch.float32, device, seed=1)
    full = torch.zeros(2, 3, 3, 16, 2, 16, device=device)
    k_cache, v_cache = full[0, 1], full[1, 1]
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    store_kvcache_ref(key, value, k_ref, v_ref, slots)
    store_kvcache(key, value, k_cache, v_cache, slots)
    torch.testing.assert_close(k_cache, k_ref, atol=0, rtol=0)
    torch.testing.assert_close(v_cache, v_ref, atol=0, rtol=0)
    assert (full[:, [0, 2]] == 0).all()


def test_store_kvcache_errors(device):
    key, value, k_cache, v_cache, slots = _case(8, 2, 16, 2, 16, torch.float32, device, seed=2)
    with pytest.raises(ValueError, match="contiguous"):
        store_kvcache(key.transpose(1, 2).contiguous().transpose(1, 2), value, k_cache, v_cache, slots)
    with pytest.raises(ValueError, match="slot_mapping"):
        store_kvcache(key, value, k_cache, v_cache, slots[:-1])
    with pytest.raises(ValueError, match="slot_mapping"):
        store_kvcache(key, value, k_cache, v_cache, slots.float())
    with pytest.raises(ValueError, match="heads"):
        store_kvcache(key[:, :1], value[:, :1], k_cache, v_cache, slots)
    store_kvcache(key[:0], value[:0], k_cache, v_cache, slots[:0])  # empty batch is a no-op
