"""The varlen prefill kernel at full size on the GPU, for every tile config it can be given: each distinct config
of `prefill_config.TABLE` (what the engine runs) and of `prefill_config.SWEEP` (what kernel_bench may put there),
against the float32 reference on the same inputs.

Shapes (32 query / 8 KV heads of 128, KV blocks of 256 tokens, bf16): one 8,192-token prompt; a batch of chunked
prefills over ~8k cached prefixes (chunks starting mid-block and on a block boundary, a one-token query, a
padding sequence), also on the persistent grid; 8 prompts of 2,048 tokens. Output buffers start as NaN and every
cache slot no sequence owns holds NaN (tests/gpu/test_kernels_full_size.py's helpers).
"""
import pytest
import torch

from nanovllm import kernels
from nanovllm.attention.torch_ref import paged_attention_ref
from nanovllm.kernels.prefill_config import SWEEP, TABLE
from tests.gpu.test_kernels_full_size import DEV, HKV, D, check, paged_cache, poisoned

pytestmark = pytest.mark.gpu

H = 32
CONFIGS = sorted({*TABLE.values(), *SWEEP}, key=lambda c: c.name)
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
