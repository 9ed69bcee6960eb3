"""The kernels package: lazy imports and the TritonOps namespace."""
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
    assert kernels.triton_available()
    ops = kernels.TritonOps()
    for name in ("rms_norm", "add_rms_norm", "apply_rotary", "silu_and_mul", "store_kvcache",
                 "paged_prefill_attention", "paged_decode_attention"):
        assert callable(getattr(ops, name))
        assert callable(getattr(kernels, name))
    x = torch.randn(4, 32, device=device)
    r = torch.randn(4, 32, device=device)
    norm = RMSNorm(32).to(device)
    with torch.no_grad():
        norm.weight.normal_()
    norm.fused = ops
    with torch.no_grad():
        torch.testing.assert_close(norm(x), rms_norm_ref(x, norm.weight, norm.eps), atol=1e-6, rtol=1e-6)
        n, s = norm(x, r)
        n_ref, s_ref = add_rms_norm_ref(x, r, norm.weight, norm.eps)
    torch.testing.assert_close(n, n_ref, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(s, s_ref, atol=0, rtol=0)
    torch.testing.assert_close(ops.silu_and_mul(x), silu_and_mul_ref(x), atol=1e-6, rtol=1e-6)
