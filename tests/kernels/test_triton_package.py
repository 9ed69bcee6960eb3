"""The kernels package: lazy imports, and the Triton `Ops` the layers are built with."""
import subprocess
import sys
from pathlib import Path

import torch

import nanovllm.kernels as kernels
from nanovllm.layers.activation import silu_and_mul_ref
from nanovllm.layers.layernorm import RMSNorm, add_rms_norm_ref, rms_norm_ref


def test_package_import_is_lazy():
    code = ("import sys, nanovllm.kernels as k; "
            "assert not any(m.startswith('nanovllm.kernels.') for m in sys.modules), sorted(sys.modules); "
            "assert 'triton' not in sys.modules")
    root = Path(__file__).resolve().parents[2]
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root)


def test_triton_ops_namespace(device):
    from nanovllm.layers.ops import TORCH_OPS, select_ops, triton_ops
    assert kernels.triton_available()
    ops = triton_ops()
    assert ops.fused and not TORCH_OPS.fused
    assert select_ops("triton") == ops and select_ops("torch") is TORCH_OPS
    for name in ("rms_norm", "add_rms_norm", "apply_rotary", "silu_and_mul", "qkv_norm_rope_store", "sample",
                 "sample_partial"):
        assert getattr(ops, name) is getattr(kernels, name)
    for name in ("store_kvcache", "paged_prefill_attention", "paged_decode_attention"):
        assert callable(getattr(kernels, name))
    x = torch.randn(4, 32, device=device)
    r = torch.randn(4, 32, device=device)
    norm = RMSNorm(32, 1e-6, ops).to(device)
    with torch.no_grad():
        norm.weight.normal_()
    with torch.no_grad():
        torch.testing.assert_close(norm(x), rms_norm_ref(x, norm.weight, norm.eps), atol=1e-6, rtol=1e-6)
        n, s = norm(x, r)
        n_ref, s_ref = add_rms_norm_ref(x, r, norm.weight, norm.eps)
    torch.testing.assert_close(n, n_ref, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(s, s_ref, atol=0, rtol=0)
    torch.testing.assert_close(ops.silu_and_mul(x), silu_and_mul_ref(x), atol=1e-6, rtol=1e-6)
