"""Decode attention bandwidth for two physical layouts of the paged KV cache (needs CUDA)

    python benchmarks/kv_layout_bench.py

The cache is (num_blocks, block_size, Hkv, D): one token's KV heads are adjacent, so a KV head's tile of keys
is block_size-strided 256-byte rows. The kernels take strides, so the same cache can live as
(num_blocks, Hkv, block_size, D) (each head's block one contiguous run) and be passed as a permuted view. This
times the decode kernel over 8 layers' caches in a CUDA graph for both, with Qwen3-8B's attention shapes, and
a plain read of as many bytes (torch.sum) as the bandwidth to compare with.
"""
from __future__ import annotations

import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from decode_layout import tables_for  # noqa: E402

from nanovllm.engine.gemm_plan import graph_seconds  # noqa: E402
from nanovllm.kernels.attention import paged_decode_attention  # noqa: E402

H, HKV, D, BS, LAYERS = 32, 8, 128, 256, 8


def case(B, ctx, seed):
    rng = random.Random(seed)
    lens = [max(1, int(ctx * rng.uniform(0.5, 1.5))) for _ in range(B)]
    tables, nblocks = tables_for(lens, BS, seed)
    order = sorted(range(B), key=lambda b: -lens[b])
    t = dict(seq_lens=torch.tensor(lens, dtype=torch.int32, device="cuda"),
             tables=torch.tensor(tables, dtype=torch.int32, device="cuda"),
             order=torch.tensor(order, dtype=torch.int32, device="cuda"),
             q=torch.randn(B, H, D, device="cuda", dtype=torch.bfloat16),
             nblocks=nblocks, kv_bytes=sum(lens) * HKV * D * 4)
    return t


def one(B, ctx, variants=None, splits=(1,)):
    scale = D ** -0.5
    c = case(B, ctx, B + ctx)
    slot = [(torch.randn(c["nblocks"], BS, HKV, D, device="cuda", dtype=torch.bfloat16),
             torch.randn(c["nblocks"], BS, HKV, D, device="cuda", dtype=torch.bfloat16)) for _ in range(LAYERS)]
    head = []
    for k, v in slot:
        kh = torch.empty(c["nblocks"], HKV, BS, D, device="cuda", dtype=torch.bfloat16)
        vh = torch.empty_like(kh)
        kh.permute(0, 2, 1, 3).copy_(k)
        vh.permute(0, 2, 1, 3).copy_(v)
        head.append((kh.permute(0, 2, 1, 3), vh.permute(0, 2, 1, 3)))
    out = torch.empty_like(c["q"])
    res = {}
    variants = variants or (("slot-major", ""), ("head-major", ""), ("head-major", "64,4,2"),
                            ("head-major", "128,8,3"))
    for (layout, cfg), ns in ((v, n) for v in variants for n in splits):
        caches = slot if layout == "slot-major" else head
        os.environ["NANOVLLM_DECODE_ATTN"] = cfg
        name = f"{layout} {cfg or 'default'}" + (f" splits {ns}" if ns > 1 else "")

        def run(caches=caches, ns=ns):
            for k, v in caches:
                paged_decode_attention(c["q"], k, v, c["seq_lens"], c["tables"], scale, out=out,
                                       order=c["order"], num_splits=ns)
        t = graph_seconds(run, reps=20) / LAYERS
        res[name] = out.clone()
        os.environ.pop("NANOVLLM_DECODE_ATTN")
        print(f"B={B:3d} ctx~{ctx:5d} {name}: {t * 1e6:7.1f} us/layer, {c['kv_bytes'] / t / 1e9:6.0f} GB/s",
              flush=True)
    if "head-major default" in res:
        print(f"   outputs equal: {torch.equal(res['slot-major default'], res['head-major default'])}")
    flat = [k.view(-1) for k, _ in slot] + [v.view(-1) for _, v in slot]
    n = c["kv_bytes"] // 4  # elements per K (V) tensor: a layer reads as many bytes as its attention
    acc = torch.empty((), device="cuda", dtype=torch.float32)

    def read():
        for x in flat:
            torch.sum(x[:n], dim=0, dtype=torch.float32, out=acc)
    t = graph_seconds(read, reps=20) / LAYERS
    print(f"   torch.sum over the same bytes: {c['kv_bytes'] / t / 1e9:6.0f} GB/s")


def main():
    if "--sweep" in sys.argv:  # the decode kernel's configs and KV splits at a mixed step's few decode rows
        cfgs = [("slot-major", c) for c in ("", "128,4,2", "128,8,2", "64,4,2", "64,4,3", "64,8,3", "32,4,3")]
        for B in (16, 44, 84, 135, 256):
            one(B, 700, cfgs, (1, 2) if B < 100 else (1,))
            torch.cuda.empty_cache()
        return
    for B, ctx in ((256, 400), (256, 1200), (160, 800), (64, 800)):
        one(B, ctx)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
