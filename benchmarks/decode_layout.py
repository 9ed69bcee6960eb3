"""Does the KV-cache layout or the decode grid order change attention bandwidth? (needs CUDA)

    python benchmarks/decode_layout.py

Token-major cache = (num_blocks, block_size, Hkv, D), the engine's layout: one key's heads are adjacent, so a
program (one KV head) reads 256-byte rows 2 KB apart. Head-major = (num_blocks, Hkv, block_size, D) storage
passed to the kernels as a transposed view (they take strides): a program reads one contiguous run per tile.
Times the decode kernel at the workload's shapes for a few launch configs and both grid orders, and the
prefill kernel on a prefill chunk, in both layouts; every result is checked against the torch reference.
"""
from __future__ import annotations

import os
import random
import sys
from functools import partial

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import triton  # noqa: E402

from nanovllm.attention.torch_ref import paged_attention_ref  # noqa: E402
from nanovllm.kernels.attention import paged_decode_attention, paged_prefill_attention  # noqa: E402


def make_cache(nblocks, bs, Hkv, D, head_major, dev):
    if head_major:
        k = torch.randn(nblocks, Hkv, bs, D, device=dev, dtype=torch.bfloat16)
        return k.transpose(1, 2), torch.randn_like(k).transpose(1, 2)
    k = torch.randn(nblocks, bs, Hkv, D, device=dev, dtype=torch.bfloat16)
    return k, torch.randn_like(k)


def tables_for(lens, bs, seed):
    nb = [-(-n // bs) for n in lens]
    perm = random.Random(seed).sample(range(sum(nb) + 4), sum(nb) + 4)
    tables, i = [], 0
    for n in nb:
        tables.append(perm[i:i + n] + [0] * (max(nb) - n))
        i += n
    return tables, sum(nb) + 4


def decode_case(B, lo, hi, H, head_major=False, Hkv=8, D=128, bs=256, dev="cuda"):
    """B sequences of random length in [lo, hi] (blocks in random order): (q, k, v, seq_lens, block_tables,
    float32 reference output, KV bytes read)."""
    rng = random.Random(B + hi)
    lens = [rng.randint(lo, hi) for _ in range(B)]
    tables, nblocks = tables_for(lens, bs, B)
    k, v = make_cache(nblocks, bs, Hkv, D, head_major, dev)
    q = torch.randn(B, H, D, device=dev, dtype=torch.bfloat16)
    sl = torch.tensor(lens, dtype=torch.int32, device=dev)
    bt = torch.tensor(tables, dtype=torch.int32, device=dev)
    ref = paged_attention_ref(q.float(), k.float(), v.float(), torch.arange(B + 1, dtype=torch.int32, device=dev),
                              sl, bt, D ** -0.5, 1)
    return q, k, v, sl, bt, ref, sum(lens) * Hkv * D * 2 * 2


def main():
    dev = "cuda"
    shapes = [(256, 100, 2048, 32), (256, 100, 2048, 16), (128, 600, 2048, 32), (32, 1200, 2048, 32)]
    configs = [(64, 4, 2), (128, 4, 3), (128, 4, 4), (64, 4, 3), (128, 8, 3), (64, 2, 3)]
    for head_major in (False, True):
        cases = [decode_case(*s, head_major=head_major) for s in shapes]
        for cfg in configs:
            for heads_first in (0, 1):
                os.environ["NANOVLLM_DECODE_ATTN"] = ",".join(map(str, (*cfg, heads_first)))
                gbs, errs = [], []
                for q, k, v, sl, bt, ref, nbytes in cases:
                    fn = partial(paged_decode_attention, q, k, v, sl, bt, q.shape[-1] ** -0.5)
                    errs.append(((fn().float() - ref).norm() / ref.norm()).item())
                    ms = triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")
                    gbs.append(nbytes / ms / 1e6)
                print(f"decode {'head' if head_major else 'tok '}-major cfg={cfg} heads_first={heads_first}: "
                      + " ".join(f"{g:6.0f}" for g in gbs) + f" GB/s  max err {max(errs):.1e}", flush=True)
        del cases
        os.environ.pop("NANOVLLM_DECODE_ATTN", None)
        # a prefill chunk like the benchmark's: 14 prompts of ~585 tokens, 32/8 heads, no cached prefix
        for lens in ([585] * 14, [2048] * 4):
            tables, nblocks = tables_for(lens, 256, 1)
            k, v = make_cache(nblocks, 256, 8, 128, head_major, dev)
            T = sum(lens)
            q = torch.randn(T, 32, 128, device=dev, dtype=torch.bfloat16)
            cu = torch.tensor([0] + list(__import__("itertools").accumulate(lens)), dtype=torch.int32, device=dev)
            sl = torch.tensor(lens, dtype=torch.int32, device=dev)
            bt = torch.tensor(tables, dtype=torch.int32, device=dev)
            fn = partial(paged_prefill_attention, q, k, v, cu, sl, bt, 128 ** -0.5, max(lens))
            ref = paged_attention_ref(q.float(), k.float(), v.float(), cu, sl, bt, 128 ** -0.5, max(lens))
            err = ((fn().float() - ref).norm() / ref.norm()).item()
            ms = triton.testing.do_bench(fn, warmup=5, rep=30, return_mode="median")
            flops = sum(4 * n * (n + 1) / 2 * 32 * 128 for n in lens)
            print(f"prefill {'head' if head_major else 'tok '}-major {len(lens)}x{lens[0]}: {ms * 1e3:7.1f} us "
                  f"{flops / ms / 1e9:5.0f} TFLOP/s err {err:.1e}", flush=True)


if __name__ == "__main__":
    main()
