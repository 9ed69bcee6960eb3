"""The varlen prefill kernel at full size on the GPU, for every tile config it can be given: each distinct config
of `prefill_config.TABLE` (what the engine runs) and of `prefill_config.SWEEP` (what kernel_bench may put there),
against the float32 reference on the same inputs.

Shapes (32 query / 8 KV heads of 128, KV blocks of 256 tokens, bf16): one 8,192-token prompt; a batch of chunked
prefills over ~8k cached prefixes (chunks starting mid-block and on a block boundary, a one-token query, a
padding sequence), also on the persistent grid; 8 prompts of 2,048 tokens. Output buffers start as NaN and every
cache slot no sequence owns holds NaN (tests/gpu/test_kernels_full_size.py's helpers). Every config also reads an
e4m3 cache (kv_cache_dtype="fp8": per-(token, head) scales; TMA configs through an fp8 descriptor) on the chunked
shape, against the reference over the dequantized cache (tests/gpu/test_fp8_gpu.py covers the table's choices).
"""
import pytest
import torch

from nanovllm import kernels
from nanovllm.attention.torch_ref import paged_attention_ref
from nanovllm.kernels.prefill_config import E4M3_TABLE, SWEEP, TABLE
from tests.gpu.test_fp8_gpu import _fp8_paged_cache
from tests.gpu.test_kernels_full_size import DEV, HKV, D, check, paged_cache, poisoned

pytestmark = pytest.mark.gpu

H = 32
CONFIGS = sorted({*TABLE.values(), *E4M3_TABLE.values(), *SWEEP}, key=lambda c: c.name)
SHAPES = {  # name -> (q_lens, cached prefix lengths)
    "prompt 8192": ([8192], [0]),
    "chunks over 8k": ([1024, 512, 37, 1, 0], [8192, 7900, 8100, 8191, 0]),
    "8 x 2048": ([2048] * 8, [0] * 8),
}


@pytest.fixture(scope="module")
def cases():
    """Inputs and the float32 reference per shape, built once (the reference at 8k takes a while)."""
    torch.manual_seed(0)
    out = {}
    for name, (q_lens, ctx) in SHAPES.items():
        lens = [c + n for c, n in zip(ctx, q_lens)]
        k, v, bt, k_ref, v_ref = paged_cache(lens, torch.bfloat16)
        T = sum(q_lens)
        q = torch.randn(T, H, D, device=DEV).to(torch.bfloat16)
        cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=DEV)
        seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEV)
        ref = paged_attention_ref(q.float(), k_ref, v_ref, cu, seq_lens, bt, D ** -0.5, max(q_lens))
        out[name] = (q, k, v, cu, seq_lens, bt, max(q_lens), ref)
    return out


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.name)
def test_prefill_config_full_size(cases, shape, config):
    q, k, v, cu, seq_lens, bt, max_q, ref = cases[shape]
    assert k.shape[2] == HKV
    T = q.shape[0]
    out = kernels.paged_prefill_attention(q, k, v, cu, seq_lens, bt, D ** -0.5, max_q,
                                          poisoned(T, H, D, dtype=torch.bfloat16), config=config)
    check(f"prefill {shape} {config.name}", out, ref, torch.bfloat16)
    if shape == "chunks over 8k":
        out = kernels.paged_prefill_attention(q, k, v, cu, seq_lens, bt, D ** -0.5, max_q,
                                              poisoned(T, H, D, dtype=torch.bfloat16), config=config,
                                              persistent=True)
        check(f"prefill {shape} {config.name} persistent", out, ref, torch.bfloat16)


def test_prefill_default_choice_full_size(cases):
    """The engine's call (the table's choice for each shape's bucket)."""
    for shape, (q, k, v, cu, seq_lens, bt, max_q, ref) in cases.items():
        out = kernels.paged_prefill_attention(q, k, v, cu, seq_lens, bt, D ** -0.5, max_q,
                                              poisoned(q.shape[0], H, D, dtype=torch.bfloat16))
        check(f"prefill {shape} (table)", out, ref, torch.bfloat16)


@pytest.fixture(scope="module")
def fp8_case():
    """The chunked shape over an e4m3 cache (NaN, values and scales, where no sequence owns a slot) and the
    float32 reference over its dequantized values."""
    torch.manual_seed(1)
    q_lens, ctx = SHAPES["chunks over 8k"]
    lens = [c + n for c, n in zip(ctx, q_lens)]
    bt, cache, (rk, rks, rv, rvs) = _fp8_paged_cache(lens)
    T = sum(q_lens)
    q = torch.randn(T, H, D, device=DEV).to(torch.bfloat16)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=DEV)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEV)
    ref = paged_attention_ref(q.float(), rk, rv, cu, seq_lens, bt, D ** -0.5, max(q_lens), k_scales=rks,
                              v_scales=rvs)
    return q, cache, cu, seq_lens, bt, max(q_lens), ref


@pytest.mark.parametrize("persistent", [False, True], ids=["tiles", "persistent"])
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.name)
def test_prefill_config_fp8_cache_full_size(fp8_case, config, persistent):
    q, (kq, ks, vq, vs), cu, seq_lens, bt, max_q, ref = fp8_case
    out = kernels.paged_prefill_attention(q, kq, vq, cu, seq_lens, bt, D ** -0.5, max_q,
                                          poisoned(q.shape[0], H, D, dtype=torch.bfloat16), config=config,
                                          persistent=persistent, k_scales=ks, v_scales=vs)
    check(f"prefill e4m3 cache {config.name}{' persistent' if persistent else ''}", out, ref, torch.bfloat16)
