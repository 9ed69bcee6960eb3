"""The zero-copy all-reduce path of the row-parallel layers (``TPGroup.reduce_buffer``), one process.

The real reducer (``SymmMemAllReduce``) needs CUDA peers; here a stand-in with the same buffer logic plays
rank 0 of two ranks and adds a given "peer partial" when asked to reduce. Checks that the layer writes its
partial (with the bias, rank 0 only) into the reducer's buffer, that the result is the two-rank sum, that
the two buffers alternate, and that whatever doesn't fit falls back to ``all_reduce``."""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from nanovllm.distributed.group import TPGroup
from nanovllm.distributed.symm_allreduce import SymmMemAllReduce
from nanovllm.layers.layernorm import RMSNorm, add_rms_norm_ref
from nanovllm.layers.linear import RowParallelLinear
from nanovllm.layers.ops import TORCH_OPS


class FakeHandle:
    """A symmetric-memory handle whose 'peer buffer' is the stub's ``peer`` tensor; records the calls."""

    def __init__(self, reducer):
        self.reducer, self.calls = reducer, []

    def get_buffer(self, rank, shape, dtype):
        self.calls.append(("get_buffer", rank, shape, dtype))
        return self.reducer.peer

    def barrier(self, channel=0):
        self.calls.append(("barrier",))


class StubReducer(SymmMemAllReduce):
    """SymmMemAllReduce's buffer logic over plain CPU tensors; the 'peer' contributes ``peer``."""

    def __init__(self, max_numel, dtype=torch.float32, world_size=2):
        self.world_size, self.dtype, self.max_numel = world_size, dtype, max_numel
        self.bufs = [torch.full((max_numel,), float("nan"), dtype=dtype) for _ in range(2)]
        self._next = 0
        self.peer = None
        self.reduced = []
        self.rank, self.fuse_norm, self.programs = 0, False, 256
        self.sig, self.peer_sig = torch.zeros(4, dtype=torch.int32), torch.zeros(4, dtype=torch.int32)
        self.handles = [FakeHandle(self), FakeHandle(self)]

    def all_reduce_(self, t):
        self.reduced.append(t)
        t += self.peer
        return t


def _layer(tp, seed=0, bias=True):
    g = torch.Generator().manual_seed(seed)
    layer = RowParallelLinear(8, 16, bias=bias, tp=tp)  # 4 input features per rank
    with torch.no_grad():
        layer.weight.copy_(torch.randn(16, 4, generator=g))
        if bias:
            layer.bias.copy_(torch.randn(16, generator=g))
    return layer


def test_row_parallel_writes_into_the_reduce_buffer_and_sums():
    reducer = StubReducer(max_numel=64 * 16)
    tp = TPGroup(rank=0, size=2, group=None, reducer=reducer)
    layer = _layer(tp)
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(1))
    reducer.peer = torch.randn(5, 16, generator=torch.Generator().manual_seed(2))  # rank 1's partial
    y = layer(x)
    want = F.linear(x, layer.weight, layer.bias) + reducer.peer
    torch.testing.assert_close(y, want)
    assert len(reducer.reduced) == 1 and y.data_ptr() == reducer.bufs[0].data_ptr()  # no copy: in the buffer
    # the next reduction uses the other buffer, so y stays valid until the one after
    y2 = layer(x)
    assert y2.data_ptr() == reducer.bufs[1].data_ptr()
    torch.testing.assert_close(y, want)
    assert layer(x).data_ptr() == reducer.bufs[0].data_ptr()


def test_rank_1_adds_no_bias():
    reducer = StubReducer(max_numel=64 * 16)
    layer = _layer(TPGroup(rank=1, size=2, group=None, reducer=reducer))
    x = torch.randn(3, 4)
    reducer.peer = torch.zeros(3, 16)
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight))


@pytest.mark.parametrize("rows,dtype", [(100, torch.float32),   # too many elements for the buffers
                                        (3, torch.bfloat16)])   # not the reducer's dtype
def test_what_does_not_fit_goes_through_all_reduce(rows, dtype):
    calls = []

    class Group(TPGroup):
        def all_reduce(self, x):  # the NCCL/gloo path, observed
            calls.append(x.shape)
            return x

    reducer = StubReducer(max_numel=64 * 16)
    layer = _layer(Group(rank=0, size=2, group=None, reducer=reducer)).to(dtype)
    x = torch.randn(rows, 4).to(dtype)
    y = layer(x)
    assert calls == [(rows, 16)] and reducer.reduced == []
    torch.testing.assert_close(y, F.linear(x, layer.weight, layer.bias))


def test_fits_needs_the_dtype_room_and_16_bytes_per_rank():
    r = StubReducer(max_numel=1024, dtype=torch.bfloat16, world_size=2)
    assert r.fits(1024, torch.bfloat16) and r.fits(16, torch.bfloat16)
    assert not r.fits(1025, torch.bfloat16)            # too big
    assert not r.fits(1024, torch.float32)             # other dtype
    assert not r.fits(8, torch.bfloat16)               # 16 bytes: 8 per rank
    assert not r.fits(0, torch.bfloat16)
    assert r.buffer((4, 4), torch.bfloat16).shape == (4, 4)
    assert r.buffer((3, 3), torch.bfloat16) is None


def test_single_rank_and_no_reducer_have_no_reduce_buffer():
    assert TPGroup().reduce_buffer((4, 16), torch.float32) is None
    assert TPGroup(rank=0, size=2, group=None).reduce_buffer((4, 16), torch.float32) is None
    x = torch.randn(2, 3)
    assert TPGroup().all_reduce(x) is x


def test_maybe_create_is_off_on_cpu_and_for_other_dtypes():
    args = (None, 0, 2, 1024)
    assert SymmMemAllReduce.maybe_create(*args, torch.float32, torch.device("cpu")) is None
    assert SymmMemAllReduce.maybe_create(*args, torch.float16, torch.device("cuda")) is None
    assert SymmMemAllReduce.maybe_create(None, 0, 1, 1024, torch.float32, torch.device("cuda")) is None


def test_all_reduce_copies_into_the_buffer_when_it_fits():
    # the embedding's path: its output isn't written in place, so it is copied into the buffer first
    reducer = StubReducer(max_numel=64 * 16)
    tp = TPGroup(rank=0, size=2, group=None, reducer=reducer)
    x = torch.randn(4, 16)
    reducer.peer = torch.ones(4, 16)
    y = tp.all_reduce(x)
    torch.testing.assert_close(y, x + 1)
    assert y.data_ptr() == reducer.bufs[0].data_ptr() and len(reducer.reduced) == 1


class StubNorm(RMSNorm):
    """An RMSNorm built with ops marked as the Triton kernels (``ops.fused``, which is when TP may fuse) that run
    the torch references."""

    def __init__(self, n, fused=True):
        super().__init__(n, 1e-5, dataclasses.replace(TORCH_OPS, name="triton") if fused else TORCH_OPS)
        with torch.no_grad():
            self.weight.copy_(torch.randn(n, generator=torch.Generator().manual_seed(7)))


@pytest.fixture
def fake_kernel(monkeypatch):
    """Stands in for the two-rank kernel (tested under the interpreter in tests/kernels): the reference, with
    the arguments recorded."""
    from nanovllm.kernels import ar_norm
    calls = []

    def fake(x, peer, residual, weight, eps, sig_in, sig_out, max_programs):
        assert max_programs == 256
        calls.append((x, peer, sig_in, sig_out))
        return add_rms_norm_ref(x + peer, residual, weight, eps)

    monkeypatch.setattr(ar_norm, "two_rank_add_rms_norm", fake)
    return calls


def _fused_setup(rows=5, fuse=True):
    reducer = StubReducer(max_numel=64 * 16)
    reducer.fuse_norm = fuse
    tp = TPGroup(rank=0, size=2, group=None, reducer=reducer)
    layer = _layer(tp)
    x = torch.randn(rows, 4, generator=torch.Generator().manual_seed(1))
    reducer.peer = torch.randn(rows, 16, generator=torch.Generator().manual_seed(2))
    residual = torch.randn(rows, 16, generator=torch.Generator().manual_seed(3))
    want = add_rms_norm_ref(F.linear(x, layer.weight, layer.bias) + reducer.peer, residual, StubNorm(16).weight,
                            1e-5)
    return reducer, tp, layer, x, residual, want


def test_all_reduce_fused_into_the_norm(fake_kernel):
    reducer, tp, layer, x, residual, want = _fused_setup()
    partial = layer(x, reduce=False)
    assert partial.data_ptr() == reducer.bufs[0].data_ptr() and reducer.reduced == []  # written, not reduced
    normed, res = tp.all_reduce_add_norm(partial, residual, StubNorm(16))
    torch.testing.assert_close(normed, want[0])
    torch.testing.assert_close(res, want[1])
    assert reducer.reduced == []                                                       # no two-shot kernel
    assert reducer.handles[0].calls == [("get_buffer", 1, (5, 16), torch.float32)]     # the peer's partial
    (got_x, got_peer, sig_in, sig_out), = fake_kernel
    assert got_x is partial and got_peer is reducer.peer
    assert sig_in is reducer.sig and sig_out is reducer.peer_sig


@pytest.mark.parametrize("case", ["fusion_off", "no_triton_norm"])
def test_all_reduce_then_norm_when_not_fused(fake_kernel, case):
    reducer, tp, layer, x, residual, want = _fused_setup(fuse=case != "fusion_off")
    norm = StubNorm(16, fused=case != "no_triton_norm")
    normed, res = tp.all_reduce_add_norm(layer(x, reduce=False), residual, norm)
    torch.testing.assert_close(normed, want[0])
    torch.testing.assert_close(res, want[1])
    assert len(reducer.reduced) == 1 and fake_kernel == []                             # the two-shot path


def test_unreduced_partial_outside_the_buffers_goes_through_all_reduce(fake_kernel):
    calls = []

    class Group(TPGroup):
        def all_reduce(self, x):
            calls.append(x.shape)
            return x + 1

    reducer = StubReducer(max_numel=4)  # too small: the layer returns a plain tensor
    reducer.fuse_norm = True
    tp = Group(rank=0, size=2, group=None, reducer=reducer)
    layer = _layer(tp)
    x, residual = torch.randn(3, 4), torch.randn(3, 16)
    partial = layer(x, reduce=False)
    torch.testing.assert_close(partial, F.linear(x, layer.weight, layer.bias))
    norm = StubNorm(16, fused=False)
    normed, _ = tp.all_reduce_add_norm(partial, residual, norm)
    assert calls == [(3, 16)] and fake_kernel == []
    torch.testing.assert_close(normed, add_rms_norm_ref(partial + 1, residual, norm.weight, 1e-5)[0])


def test_single_rank_all_reduce_add_norm_is_the_norm():
    norm, x, r = StubNorm(16, fused=False), torch.randn(2, 16), torch.randn(2, 16)
    torch.testing.assert_close(TPGroup().all_reduce_add_norm(x, r, norm)[0], add_rms_norm_ref(x, r, norm.weight,
                                                                                               1e-5)[0])
