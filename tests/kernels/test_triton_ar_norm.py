"""The two-rank all-reduce + add + RMSNorm kernel (``nanovllm.kernels.ar_norm``) against the reference.

One process plays this rank; the peer is played by its partial (a plain tensor) and by pre-set counters: the
kernel must bump the peer's counter of each of its programs once, take one signal off each of its own, and
compute ``add_rms_norm_ref(x + peer, residual)``."""
import pytest
import torch

from nanovllm.kernels.ar_norm import DEFAULT_PROGRAMS, MAX_PROGRAMS, num_programs, two_rank_add_rms_norm
from nanovllm.layers.layernorm import add_rms_norm_ref

# bf16: the CPU interpreter truncates instead of rounding, twice here (x + peer, then + residual), so a sum
# that cancels can be off by an ulp of |x + peer| (up to ~0.06 at these magnitudes); exact rounding on GPU
TOL = {torch.float32: dict(atol=1e-6, rtol=1e-6), torch.bfloat16: dict(atol=7e-2, rtol=1.6e-2)}


def _rand(*shape, dtype, device, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype).to(device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, cap", [(1, DEFAULT_PROGRAMS), (7, DEFAULT_PROGRAMS), (7, 3),
                                       (DEFAULT_PROGRAMS + 44, DEFAULT_PROGRAMS)])  # programs looping over rows
def test_two_rank_add_rms_norm(device, dtype, rows, cap):
    N = 48
    x, peer, res = (_rand(rows, N, dtype=dtype, device=device, seed=s) for s in (1, 2, 3))
    w = _rand(N, dtype=dtype, device=device, seed=4)
    G = num_programs(rows, cap)
    sig_in = torch.zeros(MAX_PROGRAMS, dtype=torch.int32, device=device)
    sig_in[:G] = 1          # the peer has signalled every program
    sig_in[0] = 2           # ... and program 0 once more (the peer ran a reduction ahead)
    sig_out = torch.zeros(MAX_PROGRAMS, dtype=torch.int32, device=device)
    normed, new_res = two_rank_add_rms_norm(x, peer, res, w, 1e-6, sig_in, sig_out, max_programs=cap)
    want_n, want_s = add_rms_norm_ref(x + peer, res, w, 1e-6)
    torch.testing.assert_close(new_res, want_s, **TOL[dtype])
    torch.testing.assert_close(normed, want_n, **TOL[dtype])
    expect_out = torch.zeros(MAX_PROGRAMS, dtype=torch.int32)
    expect_out[:G] = 1
    assert sig_out.cpu().tolist() == expect_out.tolist()       # one signal per program to the peer
    expect_in = torch.zeros(MAX_PROGRAMS, dtype=torch.int32)
    expect_in[0] = 1
    assert sig_in.cpu().tolist() == expect_in.tolist()         # one signal taken per program, the extra kept


def test_num_programs_depends_on_rows_only():
    D = DEFAULT_PROGRAMS
    assert [num_programs(m) for m in (0, 1, 5, D, 10 * D)] == [1, 1, 5, D, D]
    assert [num_programs(m, MAX_PROGRAMS) for m in (5, 10 * MAX_PROGRAMS)] == [5, MAX_PROGRAMS]


def test_argument_checks(device):
    x = torch.zeros(2, 8, device=device)
    w = torch.ones(8, device=device)
    sig = torch.zeros(MAX_PROGRAMS, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="one \\(M, N\\) shape"):
        two_rank_add_rms_norm(x, x[:1], x, w, 1e-6, sig, sig)
    with pytest.raises(ValueError, match="share a dtype"):
        two_rank_add_rms_norm(x, x.half(), x, w, 1e-6, sig, sig)
    with pytest.raises(ValueError, match="weight"):
        two_rank_add_rms_norm(x, x, x, w[:4], 1e-6, sig, sig)
    with pytest.raises(ValueError, match="counters"):
        two_rank_add_rms_norm(x, x, x, w, 1e-6, sig[:8], sig)
    with pytest.raises(ValueError, match="max_programs"):
        two_rank_add_rms_norm(x, x, x, w, 1e-6, sig, sig, max_programs=MAX_PROGRAMS + 1)
    with pytest.raises(ValueError, match="max_programs"):
        two_rank_add_rms_norm(x, x, x, w, 1e-6, sig, sig, max_programs=0)
