"""Fused Gumbel-max sampling kernel (``nanovllm.kernels.sampling.sample``) against ``sample_ref``.

Under the CPU interpreter the kernel's ``log`` is numpy's, which differs from torch's CPU ``log`` by an ulp for ~20%
of the arguments; the noise is otherwise bit-identical (hash, division and sums are the same float32 ops). So:
* on random logits the tokens must equal ``sample_ref``'s exactly (an ulp of noise cannot flip a real argmax);
* where scores are deliberately tied to within ulps, the tokens must equal ``_device_ref`` exactly, i.e. the
  reference formula with the log of the kernel's device (numpy under the interpreter, torch = libdevice on CUDA,
  where ``_device_ref`` is ``sample_ref`` itself), and the chosen token's ``sample_ref`` score must be the max
  within a few ulps.
"""
import numpy as np
import pytest
import torch

import nanovllm.kernels as kernels
from nanovllm.kernels.sampling import BLOCK, sample, sample_num_chunks, sample_partial
from nanovllm.layers.sampler import hash_uniform, reduce_partials, sample_partial_ref, sample_ref

# a (seed, step, token) whose top 24 hash bits are all ones: with 24 bits U would round to 1.0 (infinite
# noise); with the 23 bits used, U stays below 1
U_ONE = (2679, 7, 1424)


def _inputs(B, V, seed, device, temps=None):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, V, generator=g) * 3
    if temps is None:
        temps = torch.tensor([0.0, 0.7, 1.0, 1.3, -1.0, 0.05, 2.0, 0.9])[torch.arange(B) % 8]
    seeds = torch.randint(-2**63, 2**63 - 1, (B,), generator=g, dtype=torch.int64)
    steps = torch.randint(0, 2**40, (B,), generator=g, dtype=torch.int64)
    return logits.to(device), temps.float().to(device), seeds.to(device), steps.to(device)


def _scores(logits, temps, seeds, steps, log):
    greedy = temps <= 0
    x = logits / torch.where(greedy, torch.ones_like(temps), temps)[:, None]
    return x - log(-log(hash_uniform(seeds, steps, logits.shape[1])))


def _device_ref(logits, temps, seeds, steps):
    """sample_ref with the log the kernel uses on this device."""
    if logits.is_cuda:
        return sample_ref(logits, temps, seeds, steps)

    def np_log(t):
        with np.errstate(divide="ignore", invalid="ignore"):
            return torch.from_numpy(np.log(t.numpy()))

    ids = _scores(logits, temps, seeds, steps, np_log).argmax(dim=-1)
    return torch.where(temps <= 0, logits.argmax(dim=-1), ids)


@pytest.mark.parametrize("B,V,num_chunks", [(8, 3000, None), (8, 3000, 1), (6, 2049, 2), (5, 2500, 7), (3, 700, None)])
def test_matches_reference(device, B, V, num_chunks):
    logits, temps, seeds, steps = _inputs(B, V, seed=V + B, device=device)
    out = sample(logits, temps, seeds, steps, num_chunks=num_chunks)
    assert out.dtype == torch.int64 and out.shape == (B,) and out.device == logits.device
    assert out.tolist() == sample_ref(logits, temps, seeds, steps).tolist()
    greedy = (temps <= 0).nonzero().flatten()
    assert out[greedy].tolist() == logits[greedy].argmax(dim=-1).tolist()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_logits_read_as_float32(device, dtype):
    # the LM head hands its bf16/fp16 logits straight to the kernel: same tokens as the float32 reference on
    # the upcast values (an exact conversion), for a strided (vocab-sliced) view too
    logits, temps, seeds, steps = _inputs(8, 3000, seed=5, device=device)
    padded = torch.cat([logits, logits[:, :40]], dim=1).to(dtype)
    low = padded[:, :3000]
    ref = sample_ref(low.float(), temps, seeds, steps).tolist()
    assert sample(low, temps, seeds, steps).tolist() == ref
    assert sample(low, temps, seeds, steps, num_chunks=1).tolist() == ref


def test_exact_path_matches_reference(device):
    # the filter pass skipped: every chunk scored exactly (the path taken after a failed verification)
    logits, temps, seeds, steps = _inputs(8, 3000, seed=11, device=device)
    ref = sample_ref(logits, temps, seeds, steps).tolist()
    assert sample(logits, temps, seeds, steps, num_chunks=3, _force_exact=True).tolist() == ref


def test_many_seeds(device):
    B, V = 48, 700
    logits, _, seeds, steps = _inputs(B, V, seed=5, device=device)
    temps = torch.linspace(0.3, 2.5, B, device=device)
    steps[:8] = torch.arange(8, device=device)  # small steps / seeds too
    seeds[:8] = torch.arange(8, device=device) - 3
    assert sample(logits, temps, seeds, steps).tolist() == sample_ref(logits, temps, seeds, steps).tolist()


def test_greedy_ties_and_special_values(device):
    V = 3000
    logits = torch.randn(6, V, generator=torch.Generator().manual_seed(3))
    logits[0, [2500, 1029, 5]] = 9.0                  # ties across lanes and chunks -> lowest index
    logits[1] = float("-inf")                         # all -inf -> 0
    logits[2, [1700, 40]] = float("nan")              # NaN is the max, first one wins
    logits[3, [2999, 1500]] = float("inf")
    logits[4] = 0.0
    logits[4, 7] = -0.0                               # -0 == +0: index 0
    logits[5, 2048] = 50.0                            # first element of the last (partial) tile
    logits = logits.to(device)
    temps = torch.zeros(6, device=device)
    seeds = torch.arange(6, device=device)
    ref = logits.argmax(dim=-1).tolist()
    assert ref == [5, 0, 40, 1500, 0, 2048]
    for nc in (1, 3):
        assert sample(logits, temps, seeds, seeds, num_chunks=nc).tolist() == ref


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy (interpreter) on log(0), inf - inf
def test_sampled_special_values(device):
    seed, step, tok = U_ONE
    V = 2200
    logits, _, seeds, steps = _inputs(11, V, seed=4, device=device)
    temps = torch.full((11,), 0.8, device=device)
    assert float(hash_uniform(torch.tensor([seed]), torch.tensor([step]), V)[0, tok]) == 1.0 - 2.0 ** -24
    logits[0, ::2] = float("-inf")                    # banned tokens
    logits[1] = float("-inf")                         # everything banned -> 0
    logits[2, [1800, 300]] = float("nan")             # NaN wins, the first one
    logits[3, [2100, 900]] = float("inf")             # +inf wins, the first one
    seeds[4], steps[4] = seed, step                   # the largest U: finite noise
    seeds[5], steps[5] = seed, step
    logits[5, tok] = float("-inf")                    # ... which never lifts a banned token
    logits[6] *= 1e30                                 # huge scores
    logits[7] *= 1e-30                                # tiny scores: the noise decides
    logits[8] = 1.0                                   # flat: the noise decides
    temps[9] = float("nan")                           # NaN temperature: NaN scores -> 0 (not greedy)
    temps[10] = float("inf")                          # infinite temperature: the noise alone decides
    ref = sample_ref(logits, temps, seeds, steps).tolist()
    assert ref[1:4] == [0, 300, 900] and ref[5] != tok and ref[9] == 0
    for nc in (1, 3):
        assert sample(logits, temps, seeds, steps, num_chunks=nc).tolist() == ref


def test_near_ties(device):
    """Scores equal to within ulps: the filter cannot separate them, the exact pass decides (lowest index)."""
    B, V = 4, 2100
    _, _, seeds, steps = _inputs(B, V, seed=8, device=device)
    temps = torch.tensor([1.0, 0.7, 1.9, 0.3], device=device)
    log = torch.log if device == "cuda" else (lambda t: torch.from_numpy(np.log(t.numpy())))
    gumbel = -log(-log(hash_uniform(seeds, steps, V)))
    logits = -gumbel * temps[:, None]                 # x / T + g == 0 up to rounding, for every token
    logits[:, 1::3] -= 1e-3                           # a third of the vocabulary clearly out
    logits[3, 1234] += 2e-6                           # a lead far below the filter's margin
    tokens = sample(logits, temps, seeds, steps, num_chunks=3)
    assert tokens.tolist() == _device_ref(logits, temps, seeds, steps).tolist()
    ref_scores = _scores(logits, temps, seeds, steps, torch.log)
    picked = ref_scores.gather(1, tokens[:, None]).squeeze(1)
    torch.testing.assert_close(picked, ref_scores.max(dim=-1).values, atol=1e-6, rtol=0)
    if device == "cuda":
        assert tokens.tolist() == sample_ref(logits, temps, seeds, steps).tolist()


def test_strided_inputs_and_out(device):
    B, V = 5, 1500
    logits, temps, seeds, steps = _inputs(B, V, seed=9, device=device)
    wide = torch.full((B, V + 11), float("nan"), device=device)
    wide[:, 3:3 + V] = logits
    view = wide[:, 3:3 + V]                           # row stride V + 11, last dim contiguous
    t2 = torch.stack([temps, temps], 1)[:, 0]         # stride-2 vectors
    s2 = torch.stack([seeds, seeds], 1)[:, 0]
    out = torch.full((B,), -1, dtype=torch.int64, device=device)
    ref = sample_ref(logits, temps, seeds, steps).tolist()
    assert sample(view, t2, s2, steps, out=out) is out
    assert out.tolist() == ref
    # int32 seeds / steps are sign-extended, like the reference's .long()
    s32, st32 = (seeds % 1000 - 500).int(), (steps % 1000).int()
    assert sample(logits, temps, s32, st32).tolist() == sample_ref(logits, temps, s32.long(), st32.long()).tolist()


def test_distribution(device):
    """Frequencies over rows with different seeds follow softmax(logits / T).

    Under the interpreter a kernel program costs ~20 ms, so the kernel itself samples a few hundred rows (checked
    token by token against the reference) and the frequencies are checked on 100k reference rows; on CUDA the kernel
    samples 100k rows itself.
    """
    base = torch.tensor([1.0, 0.5, 2.0, -1.0, 0.0, 1.5, -3.0], device=device)
    T = 0.8
    probs = torch.softmax(base / T, dim=-1).cpu()

    def freqs(tokens):
        return torch.bincount(tokens.cpu(), minlength=base.numel()).double() / tokens.numel()

    N = 100_000
    seeds = torch.arange(N, device=device) * 7919 + 12345
    steps = torch.arange(N, device=device) % 23
    temps = torch.full((N,), T, device=device)
    logits = base.expand(N, -1)                       # row stride 0
    ref = sample_ref(logits, temps, seeds, steps)
    torch.testing.assert_close(freqs(ref), probs.double(), atol=0.01, rtol=0)
    n = N if device == "cuda" else 96
    tokens = sample(logits[:n], temps[:n], seeds[:n], steps[:n])
    assert tokens.tolist() == ref[:n].tolist()
    torch.testing.assert_close(freqs(tokens), probs.double(), atol=0.01 if n == N else 0.12, rtol=0)


def test_validation(device):
    logits, temps, seeds, steps = _inputs(3, 100, seed=1, device=device)
    with pytest.raises(ValueError, match="float32, bfloat16 or float16, got torch.float64"):
        sample(logits.double(), temps, seeds, steps)
    with pytest.raises(ValueError, match=r"\(B, V\)"):
        sample(logits[0], temps, seeds, steps)
    with pytest.raises(ValueError, match="contiguous"):
        sample(torch.randn(200, 3, device=device).t(), temps, seeds, steps)
    with pytest.raises(ValueError, match="temperatures"):
        sample(logits, temps[:2], seeds, steps)
    with pytest.raises(ValueError, match="temperatures must be float32"):
        sample(logits, temps.double(), seeds, steps)
    with pytest.raises(ValueError, match="seeds"):
        sample(logits, temps, seeds.float(), steps)
    with pytest.raises(ValueError, match="steps"):
        sample(logits, temps, seeds, steps[:, None])
    with pytest.raises(ValueError, match="one device"):
        sample(logits, temps, seeds, steps.to("meta"))
    with pytest.raises(ValueError, match="out"):
        sample(logits, temps, seeds, steps, out=torch.empty(3, dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match="empty vocabulary"):
        sample(logits[:, :0], temps, seeds, steps)
    with pytest.raises(ValueError, match="num_chunks"):
        sample(logits, temps, seeds, steps, num_chunks=0)
    assert sample(logits[:0], temps[:0], seeds[:0], steps[:0]).shape == (0,)


def test_num_chunks_from_shapes():
    V = 151936
    n_tiles = -(-V // BLOCK)
    for B in (1, 2, 8, 64, 256, 512):
        nc = sample_num_chunks(B, V, "cpu")           # off CUDA: an H100/H200's 132 SMs
        per = -(-n_tiles // nc)
        assert 1 <= nc <= n_tiles and (nc - 1) * per < n_tiles  # no empty chunk
        assert B * nc >= min(4 * 132, B * n_tiles)    # enough programs for the GPU
        assert per * BLOCK <= 16 * 1024               # no program streams more than MAX_CHUNK
    assert sample_num_chunks(4, 700, "cpu") == 1


def _check_partial(got, ref, temps):
    """Ids equal; scores equal for greedy rows and, on CUDA, for all (under the interpreter the noise's log is
    numpy's, an ulp away from torch's CPU log)."""
    (sc, ids), (ref_sc, ref_ids) = got, ref
    assert ids.dtype == torch.int64 and sc.dtype == torch.float32
    assert ids.tolist() == ref_ids.tolist()
    greedy = temps <= 0
    torch.testing.assert_close(sc[greedy], ref_sc[greedy], atol=0, rtol=0, equal_nan=True)
    tol = 0 if sc.is_cuda else 1e-6
    torch.testing.assert_close(sc, ref_sc, atol=tol, rtol=tol, equal_nan=True)


@pytest.mark.parametrize("V,tp,num_chunks,exact", [(2500, 2, None, False), (2500, 3, 2, False),
                                                   (1100, 2, 1, False), (2100, 2, 2, True)])
def test_partials_over_vocab_shards(device, V, tp, num_chunks, exact):
    """Each shard's kernel partial is the reference partial (global ids, global noise); reduced over the shards
    they give the kernel's and the reference's full-row tokens."""
    logits, temps, seeds, steps = _inputs(6, V, seed=V + tp, device=device)
    size = -(-V // tp)
    padded = torch.full((6, size * tp), 1e4, device=device)  # a padded tail that would win if it were read
    padded[:, :V] = logits
    scores, ids = [], []
    for r in range(tp):
        s, n = r * size, min(size, V - r * size)
        got = sample_partial(padded[:, s:s + n], temps, seeds, steps, vocab_start=s, num_chunks=num_chunks,
                             _force_exact=exact)
        _check_partial(got, sample_partial_ref(padded[:, s:s + n], temps, seeds, steps, s), temps)
        scores.append(got[0])
        ids.append(got[1])
    tokens = reduce_partials(torch.stack(scores), torch.stack(ids)).tolist()
    assert tokens == sample_ref(logits, temps, seeds, steps).tolist()
    assert tokens == sample(logits, temps, seeds, steps).tolist()


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy (interpreter) on log(0), inf - inf
def test_partial_special_values_and_offsets(device):
    seed, step, tok = U_ONE
    V = 1300
    logits, _, seeds, steps = _inputs(7, V, seed=12, device=device)
    temps = torch.tensor([0.0, 0.8, 0.8, 0.0, 0.8, 0.8, 0.0], device=device)
    logits[0, [700, 1299]] = float("nan")                 # greedy NaN: the first
    logits[1] = float("-inf")                             # all banned: the slice's first id, score -inf
    logits[2, [5, 1030]] = float("inf")                   # sampled +inf: the first
    logits[3, [1, 1024]] = 77.0                           # greedy tie across tiles
    seeds[4], steps[4] = seed, step                       # the largest U lands in this slice (vocab_start 1400)
    logits[5, 17] = float("nan")                          # sampled NaN
    for start, nc in ((1400, 1), (1400, 2), (1, 2), (2**30, 1)):
        got = sample_partial(logits, temps, seeds, steps, vocab_start=start, num_chunks=nc)
        ref = sample_partial_ref(logits, temps, seeds, steps, start)
        _check_partial(got, ref, temps)
        assert got[1][:4].tolist() == [start + 700, start, start + 5, start + 1]
        assert got[1][5] == start + 17 and got[0][1] == float("-inf") and got[0][5] != got[0][5]
    assert hash_uniform(seeds[4:5], steps[4:5], V, 1400)[0, tok - 1400] == 1.0 - 2.0 ** -24


def test_partial_validation(device):
    logits, temps, seeds, steps = _inputs(3, 100, seed=1, device=device)
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="vocab_start"):
            sample_partial(logits, temps, seeds, steps, vocab_start=bad)
    with pytest.raises(ValueError, match="out_scores"):
        sample_partial(logits, temps, seeds, steps, out_scores=torch.empty(3, dtype=torch.float64, device=device))
    with pytest.raises(ValueError, match="too large"):
        sample_partial(logits, temps, seeds, steps, vocab_start=2**31 - 100)
    with pytest.raises(ValueError, match="sample_partial: logits have an empty vocabulary"):
        sample_partial(logits[:, :0], temps, seeds, steps)
    out, out_s = torch.empty(3, dtype=torch.int64, device=device), torch.empty(3, device=device)
    sc, ids = sample_partial(logits, temps, seeds, steps, vocab_start=5, out=out, out_scores=out_s)
    assert sc is out_s and ids is out
    e_sc, e_ids = sample_partial(logits[:0], temps[:0], seeds[:0], steps[:0])
    assert e_sc.shape == e_ids.shape == (0,)


def test_sampler_shard_path_uses_the_kernel(device):
    """The Sampler of each of 2 ranks (threads) runs the kernel on its shard; the ids are the full sampler's."""
    import threading

    from nanovllm.layers.sampler import Sampler
    from tests.test_vocab_parallel_sampling import _tensors, run_ranks
    lock, calls = threading.Lock(), []

    def fused_partial(*args, **kw):
        with lock:  # one interpreter run at a time
            calls.append(kw["vocab_start"])
            return sample_partial(*args, **kw)

    logits = torch.randn(4, 301, generator=torch.Generator().manual_seed(13)) * 2
    t = _tensors([0.0, 0.8, 1.2, 0.5], banned=[(1, 200)], seed=2)
    want = Sampler()(logits.clone(), t).token_ids.tolist()
    t = type(t)(**{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in vars(t).items()})
    outs, gathers = run_ranks(logits.to(device), t, 2, fused_partial=fused_partial)
    assert sorted(calls) == [0, 151] and gathers["all_gather_last_dim"] == 0
    assert all(o.token_ids.tolist() == want for o in outs)


def test_package_exports(device):
    assert "sample" in kernels.__all__
    assert kernels.sample is sample
    from nanovllm.layers.ops import triton_ops
    ops = triton_ops()
    logits, temps, seeds, steps = _inputs(2, 300, seed=2, device=device)
    assert ops.sample(logits, temps, seeds, steps).tolist() == sample_ref(logits, temps, seeds, steps).tolist()
    assert kernels.sample_partial is sample_partial
    got = ops.sample_partial(logits[:, 100:], temps, seeds, steps, vocab_start=100)
    assert got[1].tolist() == sample_partial_ref(logits[:, 100:], temps, seeds, steps, 100)[1].tolist()


def _pack_bits(bits):
    """(R, 32 W) bool -> (R, W) int32 words, bit t % 32 of word t // 32 = token t (xgrammar's layout)."""
    R, n = bits.shape
    weights = torch.tensor([1 << i for i in range(32)], dtype=torch.int64)
    words = (bits.view(R, n // 32, 32).long() * weights).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _random_bitmask(R, W, seed, density=0.1):
    """(R, W) int32 words with about `density` of the bits set, and at least one set bit per row."""
    g = torch.Generator().manual_seed(seed)
    bits = torch.rand(R, W * 32, generator=g) < density
    bits[torch.arange(R), torch.randint(W * 32, (R,), generator=g)] = True
    return _pack_bits(bits)


@pytest.mark.parametrize("B,V,W,num_chunks,exact", [(8, 3000, 94, None, False), (6, 2049, 40, 3, False),
                                                      (5, 2500, 79, 1, False), (8, 3000, 94, 2, True)])
def test_bitmask_matches_masking_then_reference(device, B, V, W, num_chunks, exact):
    # rows with a mask sample as sample_ref after apply_token_bitmask (banned tokens and those past 32 W at -inf);
    # W = 40 covers only 1,280 of 2,049 ids; greedy rows (temperature <= 0) are masked too
    from nanovllm.layers.logits_processing import apply_token_bitmask
    logits, temps, seeds, steps = _inputs(B, V, seed=B * V, device=device)
    rows = [r for r in range(B) if r % 3 != 1]
    bitmask = _random_bitmask(len(rows), W, seed=W)
    index = torch.full((B,), -1, dtype=torch.int32)
    index[rows] = torch.arange(len(rows), dtype=torch.int32)
    masked = logits.cpu().clone()
    apply_token_bitmask(masked, torch.tensor(rows), bitmask)
    want = sample_ref(masked, temps.cpu(), seeds.cpu(), steps.cpu()).tolist()
    got = sample(logits, temps, seeds, steps, bitmask=bitmask.to(device), mask_index=index.to(device),
                 num_chunks=num_chunks, _force_exact=exact)
    assert got.tolist() == want
    assert got.tolist() != sample(logits, temps, seeds, steps).tolist()  # the masks changed some rows
    allowed = [torch.isfinite(masked[r]).nonzero().flatten().tolist() for r in rows]
    assert all(got[r].item() in ok for r, ok in zip(rows, allowed))


def test_bitmask_validation(device):
    logits, temps, seeds, steps = _inputs(3, 300, seed=4, device=device)
    mask = torch.zeros(2, 10, dtype=torch.int32, device=device)
    index = torch.tensor([0, -1, 1], dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="bitmask and mask_index go together"):
        sample(logits, temps, seeds, steps, bitmask=mask)
    with pytest.raises(ValueError, match="bitmask must be an \\(R, W\\) int32 tensor"):
        sample(logits, temps, seeds, steps, bitmask=mask.long(), mask_index=index)
    with pytest.raises(ValueError, match="mask_index must be a \\(3,\\) int32 tensor"):
        sample(logits, temps, seeds, steps, bitmask=mask, mask_index=index[:2])


def test_sampler_applies_late_masks_in_the_kernel(device):
    """The Sampler with the fused kernel hands a deferred step's bitmask to it (the logits are not masked in place:
    one pass) and samples the torch path's tokens; bans still apply as -inf."""
    from dataclasses import replace

    from nanovllm.engine.batch import LateInputs
    from nanovllm.layers.ops import TORCH_OPS
    from nanovllm.layers.sampler import Sampler
    from tests.test_sampling import _tensors
    V = 300
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(3)) * 2
    bitmask = _random_bitmask(2, 10, seed=8, density=0.3)
    late = LateInputs(bitmask=bitmask, mask_index=torch.tensor([1, -1, -1, 0], dtype=torch.int32),
                      banned=[(3, int(torch.isfinite(_masked_row(logits, bitmask[0])).nonzero()[0]))])
    ops = replace(TORCH_OPS, sample=sample)
    for temps in ([0.0, 0.9, 1.3, 0.0], [0.0] * 4):
        t = replace(_tensors(4, temps), late=late)
        want = Sampler()(logits.clone(), t).token_ids.tolist()
        td = type(t)(**{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in vars(t).items()})
        x = logits.to(device)
        got = Sampler(ops)(x, td).token_ids.tolist()
        assert got == want
        assert torch.isfinite(x[0]).all()  # the mask went to the kernel, not into the logits


def _masked_row(logits, words):
    from nanovllm.layers.logits_processing import apply_token_bitmask
    x = logits[:1].clone()
    apply_token_bitmask(x, torch.tensor([0]), words[None])
    return x[0]


def test_bitmask_banning_whole_chunks(device):
    # the allowed ids all in the last of 3 chunks (the first two banned entirely: their partials are -inf without
    # an exact pass), or a row with every id banned (the reference's argmax of -inf: id 0)
    from nanovllm.layers.logits_processing import apply_token_bitmask
    B, V, W = 4, 3000, 94
    logits, temps, seeds, steps = _inputs(B, V, seed=21, device=device, temps=torch.tensor([0.8, 0.0, 1.1, 0.5]))
    bits = torch.zeros(B, W * 32, dtype=torch.bool)
    bits[:3, 2600:2990:7] = True
    bits[1, 2000] = True  # greedy row: its one allowed id outside the last chunk too
    bitmask = _pack_bits(bits)  # row 3: nothing allowed
    masked = logits.cpu().clone()
    apply_token_bitmask(masked, torch.arange(B), bitmask)
    want = sample_ref(masked, temps.cpu(), seeds.cpu(), steps.cpu()).tolist()
    got = sample(logits, temps, seeds, steps, bitmask=bitmask.to(device),
                 mask_index=torch.arange(B, dtype=torch.int32, device=device), num_chunks=3)
    assert got.tolist() == want and want[3] == 0
    assert all(2600 <= t < 2990 for t in want[::2]) and want[1] in range(2000, 2990)
