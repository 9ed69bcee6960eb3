"""Full-size GPU check of the Triton kernels against the torch references, with timings.

    python benchmarks/kernel_check.py            (needs CUDA)

For each kernel: relative error ||out - ref|| / ||ref|| against the reference run in float32 on upcast
inputs, and the median time (triton.testing.do_bench) with the bytes it must move -> GB/s.
"""
from __future__ import annotations

import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import triton  # noqa: E402

from nanovllm import kernels  # noqa: E402
from nanovllm.attention.torch_ref import paged_attention_ref  # noqa: E402
from nanovllm.layers.activation import silu_and_mul_ref  # noqa: E402
from nanovllm.layers.layernorm import add_rms_norm_ref  # noqa: E402
from nanovllm.layers.rotary import RotaryEmbedding, apply_rotary_ref  # noqa: E402

dev = torch.device("cuda")
rows = []


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def report(name, err, ms, nbytes=None, flops=None, tol=2e-2):
    extra = ""
    if nbytes:
        extra += f" {nbytes / ms / 1e6:8.1f} GB/s"
    if flops:
        extra += f" {flops / ms / 1e9:8.1f} TFLOP/s"
    ok = "ok " if err < tol else "BAD"
    rows.append(f"{ok} {name:48s} rel_err={err:.2e} {ms * 1e3:9.1f} us{extra}")
    print(rows[-1], flush=True)


def make_cache(lens, H, Hkv, D, block_size, dtype):
    nblocks = [-(-n // block_size) for n in lens]
    total = sum(nblocks) + 8
    perm = torch.randperm(total, device=dev)
    tables, i = [], 0
    width = max(nblocks)
    for nb in nblocks:
        tables.append(perm[i:i + nb].tolist() + [-1] * (width - nb))
        i += nb
    k = torch.randn(total, block_size, Hkv, D, device=dev, dtype=dtype)
    v = torch.randn(total, block_size, Hkv, D, device=dev, dtype=dtype)
    bt = torch.tensor(tables, dtype=torch.int32, device=dev)
    return k, v, bt


def check_decode(B, lo, hi, H=16, Hkv=8, D=128, block_size=256, dtype=torch.bfloat16, splits=None):
    rng = random.Random(B * 7 + hi)
    lens = [rng.randint(lo, hi) for _ in range(B)]
    k, v, bt = make_cache(lens, H, Hkv, D, block_size, dtype)
    q = torch.randn(B, H, D, device=dev, dtype=dtype)
    sl = torch.tensor(lens, dtype=torch.int32, device=dev)
    cu = torch.arange(B + 1, dtype=torch.int32, device=dev)
    scale = D ** -0.5
    ref = paged_attention_ref(q.float(), k.float(), v.float(), cu, sl, bt, scale, 1)
    fn = lambda: kernels.paged_decode_attention(q, k, v, sl, bt, scale, num_splits=splits)  # noqa: E731
    out = fn()
    ms = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
    nbytes = sum(lens) * Hkv * D * 2 * q.element_size()
    report(f"decode B={B} ctx[{lo},{hi}] H={H}/{Hkv} bs={block_size} sp={splits}", rel(out, ref), ms, nbytes)


def check_prefill(lens, ctx, H=16, Hkv=8, D=128, block_size=256, dtype=torch.bfloat16):
    seq_lens = [c + n for c, n in zip(ctx, lens)]
    k, v, bt = make_cache(seq_lens, H, Hkv, D, block_size, dtype)
    T = sum(lens)
    q = torch.randn(T, H, D, device=dev, dtype=dtype)
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0).tolist()), dtype=torch.int32, device=dev)
    sl = torch.tensor(seq_lens, dtype=torch.int32, device=dev)
    scale = D ** -0.5
    ref = paged_attention_ref(q.float(), k.float(), v.float(), cu, sl, bt, scale, max(lens))
    fn = lambda: kernels.paged_prefill_attention(q, k, v, cu, sl, bt, scale, max(lens))  # noqa: E731
    out = fn()
    ms = triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")
    flops = sum(4 * n * (c + n / 2) * H * D for n, c in zip(lens, ctx))
    report(f"prefill {len(lens)} seqs q={max(lens)} ctx={max(ctx)} H={H}/{Hkv}", rel(out, ref), ms, flops=flops)


def check_small_ops(T=256, hidden=4096, inter=12288, H=32, Hkv=8, D=128, dtype=torch.bfloat16):
    x = torch.randn(T, hidden, device=dev, dtype=dtype)
    r = torch.randn(T, hidden, device=dev, dtype=dtype)
    w = 1 + 0.1 * torch.randn(hidden, device=dev, dtype=dtype)
    y_ref, s_ref = add_rms_norm_ref(x.float(), r.float(), w.float(), 1e-6)
    y, s = kernels.add_rms_norm(x, r, w, 1e-6)
    ms = triton.testing.do_bench(lambda: kernels.add_rms_norm(x, r, w, 1e-6), return_mode="median")
    report(f"add_rms_norm T={T} hidden={hidden}", max(rel(y, y_ref), rel(s, s_ref)), ms, 4 * x.numel() * 2)
    g = torch.randn(T, 2 * inter, device=dev, dtype=dtype)
    ms = triton.testing.do_bench(lambda: kernels.silu_and_mul(g), return_mode="median")
    report(f"silu_and_mul T={T} I={inter}", rel(kernels.silu_and_mul(g), silu_and_mul_ref(g.float())), ms,
           3 * T * inter * 2)
    rope = RotaryEmbedding(D, 40960, 1e6).to(dev)
    pos = torch.randint(0, 4000, (T,), device=dev)
    q = torch.randn(T, H, D, device=dev, dtype=dtype)
    k = torch.randn(T, Hkv, D, device=dev, dtype=dtype)
    qr, kr = apply_rotary_ref(q.float(), k.float(), pos, rope.cos_sin_cache)
    qo, ko = kernels.apply_rotary(q.clone(), k.clone(), pos, rope.cos_sin_cache)
    ms = triton.testing.do_bench(lambda: kernels.apply_rotary(q, k, pos, rope.cos_sin_cache), return_mode="median")
    report(f"apply_rotary T={T} H={H}/{Hkv}", max(rel(qo, qr), rel(ko, kr)), ms, 2 * (q.numel() + k.numel()) * 2)


def check_sampler(B=256, V=151936):
    from nanovllm.layers.sampler import sample_ref
    logits = torch.randn(B, V, device=dev) * 3
    temps = torch.full((B,), 0.6, device=dev)
    temps[::7] = 0.0
    seeds = torch.randint(0, 2**62, (B,), device=dev)
    steps = torch.randint(0, 1000, (B,), device=dev)
    ref = sample_ref(logits, temps, seeds, steps)
    out = kernels.sample(logits, temps, seeds, steps)
    mism = (out != ref).float().mean().item()
    ms = triton.testing.do_bench(lambda: kernels.sample(logits, temps, seeds, steps), return_mode="median")
    ms_ref = triton.testing.do_bench(lambda: sample_ref(logits, temps, seeds, steps), return_mode="median")
    report(f"sample B={B} V={V} (torch ref {ms_ref * 1e3:.0f} us)", mism, ms, logits.numel() * 4, tol=1e-9)


def check_fused_qkv(T=256, H=16, Hkv=8, D=128, num_blocks=64, block_size=256, dtype=torch.bfloat16):
    from nanovllm.layers.fused_qkv_ref import qkv_norm_rope_store_ref
    qkv = torch.randn(T, (H + 2 * Hkv) * D, device=dev, dtype=dtype)
    pos = torch.randint(0, 4000, (T,), device=dev)
    rope = RotaryEmbedding(D, 40960, 1e6).to(dev)
    wq = 1 + 0.1 * torch.randn(D, device=dev, dtype=dtype)
    wk = 1 + 0.1 * torch.randn(D, device=dev, dtype=dtype)
    slots = torch.randperm(num_blocks * block_size, device=dev)[:T]
    kc = torch.zeros(num_blocks, block_size, Hkv, D, device=dev, dtype=dtype)
    vc = torch.zeros_like(kc)
    kr, vr = kc.float(), vc.float()
    q_ref = qkv_norm_rope_store_ref(qkv.float(), pos, rope.cos_sin_cache, wq.float(), wk.float(), 1e-6, kr, vr,
                                    slots, H, Hkv, D)
    fn = lambda: kernels.qkv_norm_rope_store(qkv, pos, rope.cos_sin_cache, wq, wk, 1e-6, kc, vc, slots,  # noqa: E731
                                             H, Hkv, D)
    q = fn()
    err = max(rel(q, q_ref), rel(kc, kr), rel(vc, vr))
    ms = triton.testing.do_bench(fn, return_mode="median")
    report(f"qkv_norm_rope_store T={T} H={H}/{Hkv}", err, ms, 2 * qkv.numel() * 2)


def main():
    torch.manual_seed(0)
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__)
    check_sampler()
    check_sampler(B=4)
    check_fused_qkv()
    check_small_ops()
    check_decode(256, 100, 2048)                      # the workload's decode shape (0.6B / 8B: 8 kv heads)
    check_decode(256, 100, 2048, H=32)                # 8B: 32 query heads
    check_decode(64, 500, 1500)
    check_decode(8, 4000, 8000)                       # few long sequences: split-KV path
    check_decode(8, 4000, 8000, splits=1)
    check_decode(256, 100, 2048, block_size=16)
    check_prefill([2048] * 4, [0] * 4)
    check_prefill([512, 1000, 37, 1], [1024, 0, 300, 2000])
    check_prefill([8192], [0], H=32)
    print("\n".join(["", "summary:"] + rows))


if __name__ == "__main__":
    main()
