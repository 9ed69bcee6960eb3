"""The per-row-count GEMM plan of the linear layers (``LinearBase.gemm_plan``, ``nanovllm.engine.gemm_plan``).

Timing the candidates needs CUDA (run on the GPU by the benchmarks); here: a planned backend is used for
exactly the row counts it names and never with a bias, row-parallel layers write it into the reducer's
buffer, and the backend / candidate descriptions are checked."""
import pytest
import torch

from nanovllm.distributed.group import TPGroup
from nanovllm.engine.gemm_plan import GemmBackend, describe, triton_candidates
from nanovllm.layers.linear import ColumnParallelLinear, RowParallelLinear


class Recording:
    """A stand-in backend: computes x @ w.T and remembers the row counts it saw."""

    def __init__(self):
        self.rows = []

    def __call__(self, x, w, out=None):
        self.rows.append(x.shape[0])
        y = x @ w.t()
        if out is None:
            return y
        out.copy_(y)
        return out


def _layer(cls, bias):
    torch.manual_seed(0)
    layer = cls(16, 8, bias, TPGroup())
    layer.weight.data.normal_()
    if bias:
        layer.bias.data.normal_()
    return layer


@pytest.mark.parametrize("cls", [ColumnParallelLinear, RowParallelLinear])
def test_plan_used_for_its_row_counts_only(cls):
    layer = _layer(cls, bias=False)
    rec = Recording()
    layer.gemm_plan = {4: rec}
    for rows in (3, 4, 5, 4):
        x = torch.randn(rows, 16)
        torch.testing.assert_close(layer(x), x @ layer.weight.t())
    assert rec.rows == [4, 4]


def test_plan_skipped_with_a_bias():
    layer = _layer(ColumnParallelLinear, bias=True)
    rec = Recording()
    layer.gemm_plan = {4: rec}
    x = torch.randn(4, 16)
    torch.testing.assert_close(layer(x), x @ layer.weight.t() + layer.bias)
    assert rec.rows == []


def test_row_parallel_plan_writes_into_the_reduce_buffer():
    class BufferGroup(TPGroup):
        def reduce_buffer(self, shape, dtype):
            return buf[: shape[0]]

    buf = torch.full((8, 8), float("nan"))
    layer = RowParallelLinear(16, 8, False, BufferGroup())
    layer.weight.data.normal_()
    rec = Recording()
    layer.gemm_plan = {4: rec}
    x = torch.randn(4, 16)
    y = layer(x, reduce=False)
    assert y.data_ptr() == buf.data_ptr() and rec.rows == [4]
    torch.testing.assert_close(y, x @ layer.weight.t())


def test_backend_checks_and_descriptions():
    from nanovllm.kernels.matmul import MatmulConfig
    with pytest.raises(ValueError, match="unknown GEMM backend 'cutlass'"):
        GemmBackend("cutlass")
    with pytest.raises(ValueError, match="a config goes with 'triton'"):
        GemmBackend("triton")
    with pytest.raises(ValueError, match="a config goes with 'triton'"):
        GemmBackend("cublas", MatmulConfig(16, 64, 128))
    assert str(GemmBackend("cublaslt")) == "cublaslt"
    assert str(GemmBackend("triton", MatmulConfig(16, 64, 128, swap=True, num_stages=5))) == "triton:swap16x64x128s1st5"
    plan = {(8, 16): {4: GemmBackend("cublaslt"), 1: GemmBackend("cublas")}}
    assert describe(plan) == "8x16: 1=cublas, 4=cublaslt"
    assert describe({}) == "default everywhere"


def test_triton_candidates():
    assert triton_candidates(33, 4096) == []            # beyond the rows where the kernel won
    c = triton_candidates(8, 4096)
    assert {(b.config.block_m, b.config.block_k) for b in c} == {(16, 128), (16, 256)}
    assert all(b.config.swap and b.config.fits(4096) for b in c)
    assert triton_candidates(32, 4096) == c             # one compile per config, whatever the rows
    assert {b.config.block_k for b in triton_candidates(8, 384)} == {128}  # 256 does not divide K=384
