"""The skinny GEMM (``nanovllm.kernels.matmul.linear``) against its float32 reference, for every tiling kind:
plain, swapped (weight on the MMA's M side) and split-K with the in-kernel reduction."""
import pytest
import torch

from nanovllm.kernels.matmul import MatmulConfig, linear, linear_ref, workspace_numel

CONFIGS = [
    MatmulConfig(16, 32, 32),                          # plain
    MatmulConfig(32, 16, 32, swap=True),               # swapped
    MatmulConfig(16, 64, 16, splits=4),                # split-K, plain
    MatmulConfig(64, 32, 32, splits=2, swap=True),     # split-K, swapped
]
# (M, N, K): one row; rows and outputs that don't fill a tile; several tiles both ways
SHAPES = [(1, 48, 64), (5, 80, 128), (33, 64, 256), (70, 96, 128)]


def _rand(*shape, dtype, device, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype).to(device)


def _one_ulp(ref: torch.Tensor) -> torch.Tensor:
    """bf16/fp16: the kernel and the reference may round a float32 sum of another order to the next value."""
    if ref.dtype == torch.float32:
        return torch.full_like(ref, 1e-4)
    mant = 7 if ref.dtype == torch.bfloat16 else 10
    return torch.exp2(torch.floor(torch.log2(ref.float().abs().clamp(min=1e-3))) - mant) * 1.01 + 1e-3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"{'swap' if c.swap else 'plain'}-s{c.splits}")
@pytest.mark.parametrize("M, N, K", SHAPES)
def test_linear_matches_reference(device, dtype, cfg, M, N, K):
    x = _rand(M, K, dtype=dtype, device=device, seed=M)
    w = _rand(N, K, dtype=dtype, device=device, seed=N + 1)
    ws = torch.full((workspace_numel(M, N, cfg) + 1,), float("nan"), device=device)  # must be overwritten
    cnt = torch.zeros(cfg.tiles(M, N), dtype=torch.int32, device=device)
    y = linear(x, w, cfg, workspace=ws, counters=cnt)
    ref = linear_ref(x, w)
    assert y.shape == (M, N) and y.dtype == dtype
    err = (y.float() - ref.float()).abs()
    assert bool((err <= _one_ulp(ref)).all()), f"max err {err.max().item()}"
    assert cnt.abs().sum().item() == 0  # counters left at zero for the next launch
    # a second launch on the same counters gives the same bits (deterministic split reduction)
    y2 = linear(x, w, cfg, workspace=ws, counters=cnt)
    assert torch.equal(y, y2)


def test_linear_writes_into_out_and_handles_empty(device):
    x = _rand(3, 32, dtype=torch.float32, device=device, seed=0)
    w = _rand(16, 32, dtype=torch.float32, device=device, seed=1)
    out = torch.empty(3, 16, device=device)
    assert linear(x, w, MatmulConfig(16, 16, 16), out) is out
    torch.testing.assert_close(out, linear_ref(x, w), atol=1e-4, rtol=1e-4)
    assert linear(x[:0], w, MatmulConfig(16, 16, 16)).shape == (0, 16)


def test_linear_rejects_bad_inputs(device):
    x = torch.zeros(4, 64, device=device)
    w = torch.zeros(32, 64, device=device)
    cfg = MatmulConfig(16, 16, 16)
    with pytest.raises(ValueError, match="x .M, K. and w .N, K."):
        linear(x, torch.zeros(32, 48, device=device), cfg)
    with pytest.raises(ValueError, match="share a dtype"):
        linear(x, w.half(), cfg)
    with pytest.raises(ValueError, match="K=64 is not a multiple"):
        linear(x, w, MatmulConfig(16, 16, 128))
    with pytest.raises(ValueError, match="needs a workspace"):
        linear(x, w, MatmulConfig(16, 16, 16, splits=2))
    with pytest.raises(ValueError, match="counters must be int32"):
        linear(x, w, MatmulConfig(16, 16, 16, splits=2), workspace=torch.zeros(1024, device=device),
               counters=torch.zeros(1, dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match="out must be"):
        linear(x, w, cfg, torch.empty(4, 31, device=device))
    with pytest.raises(TypeError, match="MatmulConfig"):
        linear(x, w, (16, 16, 16))
    with pytest.raises(ValueError, match="block_n must be a power of two"):
        MatmulConfig(16, 24, 16)
    with pytest.raises(ValueError, match="splits must be a positive int"):
        MatmulConfig(16, 16, 16, splits=0)
