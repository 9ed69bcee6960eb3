"""The per-row-count GEMM plan of the linear layers (``GemmPlan`` of ``UnquantizedLinearMethod``,
``nanovllm.engine.gemm_plan``).

The real timing needs CUDA (the benchmarks run it on the GPU); here a fake timing function drives the choice
(the margin, per-shape assignment, bias layers left alone, configs that don't build skipped). Also: a planned
backend is used for exactly the row counts it names and never with a bias, row-parallel layers write it into
the reducer's buffer, and the backend / candidate descriptions are checked."""
import pytest
import torch

from nanovllm import LLM
from nanovllm.distributed.group import TPGroup
from nanovllm.engine.gemm_plan import GemmBackend, describe, plan_gemms, triton_candidates
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


def _plan(layer, by_rows: dict) -> None:
    layer.method.plan.choices[tuple(layer.weight.shape)] = by_rows


def _planned(layer) -> dict:
    return layer.method.plan.choices.get(tuple(layer.weight.shape), {})


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
    _plan(layer, {4: rec})
    for rows in (3, 4, 5, 4):
        x = torch.randn(rows, 16)
        torch.testing.assert_close(layer(x), x @ layer.weight.t())
    assert rec.rows == [4, 4]


def test_plan_skipped_with_a_bias():
    layer = _layer(ColumnParallelLinear, bias=True)
    rec = Recording()
    _plan(layer, {4: rec})
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
    _plan(layer, {4: rec})
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


class FakeTimes:
    """A stand-in for the CUDA-graph timing: seconds by (backend name or None, rows), 1.0 otherwise; records
    how many weights each timing covered."""

    def __init__(self, times):
        self.times = times
        self.weights_per_call = []

    def __call__(self, backend, x, weights, out):
        self.weights_per_call.append(len(weights))
        assert out.shape == (x.shape[0], weights[0].shape[0])
        return self.times.get((None if backend is None else str(backend), x.shape[0]), 1.0)


def _model():
    tp = TPGroup()
    return torch.nn.ModuleList([ColumnParallelLinear(64, 32, False, tp), ColumnParallelLinear(64, 32, False, tp),
                                RowParallelLinear(32, 16, False, tp), ColumnParallelLinear(64, 32, True, tp)])


def test_plan_takes_a_candidate_only_beyond_the_margin():
    model = _model()
    fake = FakeTimes({("cublaslt", 4): 0.90,    # 10% faster: taken
                      ("cublaslt", 8): 0.97,    # 3% faster: a near-tie, the default stays
                      (None, 1): 2.0, ("cublaslt", 1): 1.5})  # slower default at 1 row: taken
    plan = plan_gemms(model, [1, 4, 8], use_triton=False, time_fn=fake)
    lt = GemmBackend("cublaslt")
    assert plan == {(32, 64): {1: lt, 4: lt}, (16, 32): {1: lt, 4: lt}}
    assert _planned(model[0]) == _planned(model[1]) == {1: lt, 4: lt}   # every layer of the shape
    assert _planned(model[2]) == {1: lt, 4: lt}
    assert _planned(model[3]) == {}                                     # has a bias: never planned
    # the (32, 64) shape is timed over both of its layers' weights; cuBLAS (the default) is not timed twice
    assert sorted(set(fake.weights_per_call)) == [1, 2] and len(fake.weights_per_call) == 2 * 3 * 2


def test_plan_skips_triton_configs_that_do_not_build(monkeypatch):
    from nanovllm.engine import gemm_plan as gp
    assert triton_candidates(4, 64) == []          # K=64: no Triton tile fits
    model = torch.nn.ModuleList([ColumnParallelLinear(512, 32, False, TPGroup())])
    good, bad = triton_candidates(4, 512)
    monkeypatch.setattr(gp, "_precompile", lambda backends, dtype, device: {bad})
    fake = FakeTimes({(str(bad), 4): 0.1, (str(good), 4): 0.5, ("cublaslt", 4): 0.8})
    plan = plan_gemms(model, [4], use_triton=True, time_fn=fake)
    assert plan == {(32, 512): {4: good}}          # the fastest that builds


def test_plan_rejects_a_bad_margin():
    with pytest.raises(ValueError, match="margin must be in"):
        plan_gemms(_model(), [4], use_triton=False, margin=1.5, time_fn=FakeTimes({}))


def test_engine_plans_only_with_cuda_graphs(tiny_ckpt):
    """The plan is made for the CUDA-graph batch sizes: none on CPU (no graphs), and every layer of the model
    shares the runner's plan."""
    from nanovllm.layers.linear import LinearBase
    llm = LLM(tiny_ckpt("qwen3"), device="cpu", dtype="float32", kvcache_block_size=16)
    runner = llm.engine.runner
    assert runner.graphs is None and runner.gemm_plan.choices == {}
    layers = [m for m in runner.model.modules() if isinstance(m, LinearBase)]
    assert layers and all(m.method.plan is runner.gemm_plan for m in layers)
    llm.shutdown()
