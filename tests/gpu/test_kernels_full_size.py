"""Every public Triton kernel at full size (Qwen3-8B's shapes) against its torch reference, on the GPU.

Shapes: hidden 4096, MLP 12288, 32 query / 8 KV heads of 128, KV blocks of 256 tokens, 256 decode sequences with
contexts of 100-2048 tokens (a few of 4-8k), prefill chunks of up to 4096 tokens, vocabulary 151,936. Inputs are
fresh random tensors per test; output buffers start as NaN (or -1 for ids), so a row a kernel leaves unwritten
fails, and every cache slot no sequence owns holds NaN, so a kernel that reads past a sequence's length fails.
Errors are ||out - ref|| / ||ref|| against the reference run in float32 on the same inputs upcast: bf16 within
1e-2, float32 within 1e-5 (the kernels' float32 dots are IEEE, no TF32). KV stores and samplers are exact.
"""
import pytest
import torch

from nanovllm import kernels
from nanovllm.attention.torch_ref import paged_attention_ref, store_kvcache_ref
from nanovllm.layers.activation import silu_and_mul_ref
from nanovllm.layers.fused_qkv_ref import qkv_norm_rope_store_ref
from nanovllm.layers.layernorm import add_rms_norm_ref, rms_norm_ref
from nanovllm.layers.rotary import RotaryEmbedding, apply_rotary_ref
from nanovllm.layers.sampler import reduce_partials, sample_partial_ref, sample_ref

pytestmark = pytest.mark.gpu

DEV = "cuda"
HIDDEN, INTER, H, HKV, D, BLOCK, BATCH, VOCAB = 4096, 12288, 32, 8, 128, 256, 256, 151936
TOL = {torch.bfloat16: 1e-2, torch.float32: 1e-5}
DTYPES = pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])


@pytest.fixture(autouse=True)
def _seed_and_exact_reference():
    """A seed per test, and float32 references without TF32 (whatever an earlier test set)."""
    torch.manual_seed(0)
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


def poisoned(*shape, dtype):
    return torch.full(shape, float("nan"), device=DEV, dtype=dtype)


def check(name, out, ref, dtype):
    """out fully written (no NaN left) and within the dtype's relative error of ref."""
    assert not out.isnan().any(), f"{name}: {int(out.isnan().sum())} output elements not written (NaN)"
    err = ((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30)).item()
    assert err < TOL[dtype], f"{name}: relative error {err:.2e} >= {TOL[dtype]:.0e} ({dtype})"


def paged_cache(seq_lens, dtype, block_size=BLOCK):
    """K/V caches holding each sequence's blocks in random order, NaN in every slot no sequence owns; the block
    tables (-1 padded; a sequence of length 0 owns no block); the reference's float32 caches, those slots 0."""
    nblk = [-(-n // block_size) for n in seq_lens]
    total = sum(nblk) + 4
    perm = torch.randperm(total, device=DEV)
    bt = torch.full((len(seq_lens), max(nblk) + 1), -1, dtype=torch.int32, device=DEV)
    owned = torch.zeros(total, block_size, dtype=torch.bool, device=DEV)
    i = 0
    for b, (n, nb) in enumerate(zip(seq_lens, nblk)):
        if nb == 0:
            continue
        blocks = perm[i:i + nb]
        i += nb
        bt[b, :nb] = blocks.int()
        owned[blocks] = True
        owned[blocks[-1], n - (nb - 1) * block_size:] = False
    unowned = ~owned[:, :, None, None]
    caches = []
    for _ in range(2):
        c = torch.randn(total, block_size, HKV, D, device=DEV).to(dtype)
        caches += [c.masked_fill(unowned, float("nan")), c.float().masked_fill(unowned, 0.0)]
    k, k_ref, v, v_ref = caches
    return k, v, bt, k_ref, v_ref


# --- attention ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("batch, lo, hi, block_size, splits", [
    (BATCH, 100, 2048, BLOCK, None),      # the workload's decode steps (+ 8 padding rows of a CUDA graph)
    (8, 4000, 8000, BLOCK, None),         # few long sequences: the split-KV path
    (8, 4000, 8000, BLOCK, 1),            # ... forced into one pass
    (BATCH, 100, 2048, 16, None),         # small blocks
])
@DTYPES
def test_decode_attention(batch, lo, hi, block_size, splits, dtype):
    if dtype == torch.float32 and block_size != BLOCK:
        pytest.skip("float32 is checked at the engine's block size")
    lens = torch.randint(lo, hi + 1, (batch,)).tolist() + ([0] * 8 if batch == BATCH else [])
    k, v, bt, k_ref, v_ref = paged_cache(lens, dtype, block_size)
    B = len(lens)
    q = torch.randn(B, H, D, device=DEV).to(dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEV)
    order = torch.argsort(seq_lens, descending=True).int()  # longest first, as the engine launches them
    scale = D ** -0.5
    out = kernels.paged_decode_attention(q, k, v, seq_lens, bt, scale, poisoned(B, H, D, dtype=dtype),
                                         num_splits=splits, order=order)
    cu = torch.arange(B + 1, dtype=torch.int32, device=DEV)
    ref = paged_attention_ref(q.float(), k_ref, v_ref, cu, seq_lens, bt, scale, 1)
    check(f"decode B={batch} ctx [{lo}, {hi}] block {block_size} splits {splits}", out, ref, dtype)
    if batch == BATCH:
        assert (out[-8:] == 0).all(), "padding sequences (length 0) must give zeros"


@pytest.mark.parametrize("q_lens, ctx, persistent", [
    ([2048] * 4, [0] * 4, False),                              # an 8,192-token prefill step
    ([512, 1000, 37, 1], [1024, 0, 300, 2000], False),         # chunks over cached prefixes, a 1-token query
    ([512, 1000, 37, 1], [1024, 0, 300, 2000], True),          # ... on the persistent grid (mixed-step graphs)
    ([4096], [1000], False),                                   # one long chunk over a long prefix
])
@DTYPES
def test_prefill_attention(q_lens, ctx, persistent, dtype):
    lens = [c + n for c, n in zip(ctx, q_lens)]
    k, v, bt, k_ref, v_ref = paged_cache(lens, dtype)
    T = sum(q_lens)
    q = torch.randn(T, H, D, device=DEV).to(dtype)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=DEV)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEV)
    scale = D ** -0.5
    out = kernels.paged_prefill_attention(q, k, v, cu, seq_lens, bt, scale, max(q_lens),
                                          poisoned(T, H, D, dtype=dtype), persistent=persistent)
    ref = paged_attention_ref(q.float(), k_ref, v_ref, cu, seq_lens, bt, scale, max(q_lens))
    check(f"prefill q {q_lens} ctx {ctx} persistent {persistent}", out, ref, dtype)


@pytest.mark.parametrize("T", [BATCH, 8192])
@DTYPES
def test_store_kvcache(T, dtype):
    num_blocks = T // BLOCK * 2 + 4
    k_cache = torch.randn(num_blocks, BLOCK, HKV, D, device=DEV).to(dtype)
    v_cache = torch.randn_like(k_cache)
    slots = torch.randperm(num_blocks * BLOCK, device=DEV)[:T]
    slots[::17] = -1  # padding rows of a CUDA graph: skipped
    qkv = torch.randn(T, (H + 2 * HKV) * D, device=DEV).to(dtype)  # key/value as slices of a fused projection
    key = qkv[:, H * D:(H + HKV) * D].view(T, HKV, D)
    value = qkv[:, (H + HKV) * D:].view(T, HKV, D)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    kernels.store_kvcache(key, value, k_cache, v_cache, slots)
    store_kvcache_ref(key, value, k_ref, v_ref, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


# --- elementwise and norms -------------------------------------------------------------------------------
@pytest.mark.parametrize("T", [BATCH, 8192])
@DTYPES
def test_rms_norms(T, dtype):
    x = torch.randn(T, HIDDEN, device=DEV).to(dtype)
    r = torch.randn(T, HIDDEN, device=DEV).to(dtype)
    w = (1 + 0.1 * torch.randn(HIDDEN, device=DEV)).to(dtype)
    out = kernels.rms_norm(x, w, 1e-6, out=poisoned(T, HIDDEN, dtype=dtype))
    check("rms_norm", out, rms_norm_ref(x.float(), w.float(), 1e-6), dtype)
    y, s = kernels.add_rms_norm(x, r, w, 1e-6, out=poisoned(T, HIDDEN, dtype=dtype),
                                residual_out=poisoned(T, HIDDEN, dtype=dtype))
    y_ref, s_ref = add_rms_norm_ref(x.float(), r.float(), w.float(), 1e-6)
    check("add_rms_norm (normed)", y, y_ref, dtype)
    check("add_rms_norm (sum)", s, s_ref, dtype)


@pytest.mark.parametrize("T", [BATCH, 8192])
@DTYPES
def test_silu_and_mul(T, dtype):
    g = torch.randn(T, 2 * INTER, device=DEV).to(dtype)
    out = kernels.silu_and_mul(g, out=poisoned(T, INTER, dtype=dtype))
    check("silu_and_mul", out, silu_and_mul_ref(g.float()), dtype)


@DTYPES
def test_apply_rotary(dtype):
    T = BATCH
    rope = RotaryEmbedding(D, 40960, 1e6).to(DEV)
    pos = torch.randint(0, 4000, (T,), device=DEV)
    qkv = torch.randn(T, H + 2 * HKV, D, device=DEV).to(dtype)
    q, k = qkv[:, :H], qkv[:, H:H + HKV]  # strided views of a fused projection, rotated in place
    q_ref, k_ref = apply_rotary_ref(q.float(), k.float(), pos, rope.cos_sin_cache)
    qo, ko = kernels.apply_rotary(q, k, pos, rope.cos_sin_cache)
    check("apply_rotary q", qo, q_ref, dtype)
    check("apply_rotary k", ko, k_ref, dtype)
    assert qo.data_ptr() == q.data_ptr()


@pytest.mark.parametrize("qk_norm", [True, False], ids=["qwen3", "llama"])
@DTYPES
def test_qkv_norm_rope_store(qk_norm, dtype):
    T, num_blocks = BATCH, 64
    qkv = torch.randn(T, (H + 2 * HKV) * D, device=DEV).to(dtype)
    pos = torch.randint(0, 4000, (T,), device=DEV)
    rope = RotaryEmbedding(D, 40960, 1e6).to(DEV)
    wq = wk = wq_ref = wk_ref = None  # Llama / Qwen2: no per-head norms
    if qk_norm:
        wq, wk = ((1 + 0.1 * torch.randn(D, device=DEV)).to(dtype) for _ in range(2))
        wq_ref, wk_ref = wq.float(), wk.float()
    slots = torch.randperm(num_blocks * BLOCK, device=DEV)[:T]
    slots[::13] = -1
    k_cache = torch.randn(num_blocks, BLOCK, HKV, D, device=DEV).to(dtype)  # slots not written keep these
    v_cache = torch.randn_like(k_cache)
    k_ref, v_ref = k_cache.float(), v_cache.float()
    before = k_cache.clone(), v_cache.clone()
    q_ref = qkv_norm_rope_store_ref(qkv.float(), pos, rope.cos_sin_cache, wq_ref, wk_ref, 1e-6, k_ref, v_ref,
                                    slots, H, HKV, D)
    q = kernels.qkv_norm_rope_store(qkv, pos, rope.cos_sin_cache, wq, wk, 1e-6, k_cache, v_cache, slots, H, HKV, D,
                                    q_out=poisoned(T, H, D, dtype=dtype))
    check("qkv_norm_rope_store q", q, q_ref, dtype)
    written = torch.zeros(num_blocks * BLOCK, dtype=torch.bool, device=DEV)
    written[slots[slots >= 0]] = True
    for name, cache, ref, old in (("k", k_cache, k_ref, before[0]), ("v", v_cache, v_ref, before[1])):
        flat, flat_ref, flat_old = (c.view(num_blocks * BLOCK, HKV, D) for c in (cache, ref, old))
        check(f"qkv_norm_rope_store {name} cache", flat[written], flat_ref[written], dtype)
        assert torch.equal(flat[~written], flat_old[~written]), f"{name} cache: a slot not in slot_mapping changed"


# --- sampling ----------------------------------------------------------------------------------------------
def sampling_inputs(B):
    logits = torch.randn(B, VOCAB, device=DEV) * 3
    temps = torch.full((B,), 0.6, device=DEV)
    temps[::7] = 0.0  # greedy rows
    seeds = torch.randint(0, 2**62, (B,), device=DEV)
    steps = torch.randint(0, 1000, (B,), device=DEV)
    return logits, temps, seeds, steps


@pytest.mark.parametrize("B", [BATCH, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_sample_is_exact(B, dtype):
    logits, temps, seeds, steps = sampling_inputs(B)
    logits = logits.to(dtype)  # the kernel reads bf16 logits as float32, exactly
    out = kernels.sample(logits, temps, seeds, steps, out=torch.full((B,), -1, dtype=torch.int64, device=DEV))
    assert torch.equal(out, sample_ref(logits.float(), temps, seeds, steps))


def test_sample_partial_over_two_vocab_shards_is_exact():
    """TP=2's vocabulary-parallel sampling: each shard's partial is the reference's (global ids and noise), and
    the reduced partials give sample_ref's tokens over the whole row."""
    logits, temps, seeds, steps = sampling_inputs(BATCH)
    half = VOCAB // 2
    scores, ids = [], []
    for start in (0, half):
        sc, idx = kernels.sample_partial(logits[:, start:start + half], temps, seeds, steps, vocab_start=start)
        ref_sc, ref_idx = sample_partial_ref(logits[:, start:start + half], temps, seeds, steps, vocab_start=start)
        assert torch.equal(idx, ref_idx)
        torch.testing.assert_close(sc, ref_sc, atol=0, rtol=0, equal_nan=True)
        scores.append(sc)
        ids.append(idx)
    tokens = reduce_partials(torch.stack(scores), torch.stack(ids))
    assert torch.equal(tokens, sample_ref(logits, temps, seeds, steps))
