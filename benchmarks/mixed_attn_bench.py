"""Attention of a balanced-policy mixed step, kernel by kernel (needs CUDA)

    python benchmarks/mixed_attn_bench.py

A mixed step of Qwen3-8B's attention shapes (32 query heads, 8 KV heads, head_dim 128, bf16, 256-token
blocks) laid out as a mixed CUDA graph lays it out: the one-token sequences first (decode kernel), then the
prompt chunks (varlen kernel), then empty padding sequences up to the graph's capacity. Three cases, from the
balanced runs' profiles (benchmarks/RESULTS.md run 17): early in the run (78 decode rows + a 178-token chunk in
256 rows) and mid-run (206 decode rows + 178 chunk tokens in 384 rows, in one chunk or two).

Each variant runs over 8 layers' own caches (so nothing stays in L2 between layers) inside a CUDA graph, as the
engine does, and prints microseconds per layer: the decode kernel alone (launch order, NANOVLLM_DECODE_ATTN
configs), the varlen kernel alone (one program per possible tile, or the persistent grid), the two one after the
other, and the two side by side on two streams (the backend's way; "ovd": the decode kernel on the side
stream). `--tiles`: the varlen kernel's tile configs (NANOVLLM_PREFILL_ATTN) on the persistent grid instead,
alone and side by side with the decode kernel. Every variant's output is checked against the float32 torch
reference.

    python benchmarks/mixed_attn_bench.py --tiles
"""
from __future__ import annotations

import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from decode_layout import tables_for  # noqa: E402

from nanovllm.attention.torch_ref import paged_attention_ref  # noqa: E402
from nanovllm.engine.gemm_plan import graph_seconds  # noqa: E402
from nanovllm.kernels.attention import paged_decode_attention, paged_prefill_attention  # noqa: E402

H, HKV, D, BS, LAYERS = 32, 8, 128, 256, 8


def make_case(dec_lens, chunks, rows, capacity, seed, dev="cuda"):
    """dec_lens: decode sequences' lengths; chunks: (prefix, chunk) pairs; rows: graph rows; capacity: graph
    sequences."""
    lens = list(dec_lens) + [p + c for p, c in chunks]
    tables, nblocks = tables_for(lens, BS, seed)
    B = len(lens)
    tables += [[0] * len(tables[0])] * (capacity - B)
    ks = [torch.randn(nblocks, BS, HKV, D, device=dev, dtype=torch.bfloat16) for _ in range(LAYERS)]
    vs = [torch.randn_like(k) for k in ks]
    q = torch.randn(rows, H, D, device=dev, dtype=torch.bfloat16)
    Bd = len(dec_lens)
    seq_lens = torch.zeros(capacity, dtype=torch.int32)
    seq_lens[:B] = torch.tensor(lens)
    d_lens = torch.zeros(capacity, dtype=torch.int32)
    d_lens[:Bd] = torch.tensor(dec_lens)
    cu_pre = torch.full((capacity + 1,), Bd, dtype=torch.int32)
    for j, (_, c) in enumerate(chunks):
        cu_pre[Bd + j + 1:] += c
    cu_all = cu_pre.clone()
    cu_all[:Bd + 1] = torch.arange(Bd + 1)
    t = lambda x: x.to(dev)  # noqa: E731
    case = dict(q=q, ks=ks, vs=vs, seq_lens=t(seq_lens), dec_lens=t(d_lens), cu_pre=t(cu_pre), cu_all=t(cu_all),
                tables=t(torch.tensor(tables, dtype=torch.int32)), Bd=Bd, used=int(cu_pre[-1]), rows=rows,
                kv_bytes=sum(dec_lens) * HKV * D * 4)
    ref = paged_attention_ref(q[:case["used"]].float(), ks[0].float(), vs[0].float(), t(cu_all[:B + 1]),
                              t(seq_lens[:B]), case["tables"][:B], D ** -0.5, max(c for _, c in chunks))
    case["ref"] = ref
    order = sorted(range(Bd), key=lambda b: -dec_lens[b]) + list(range(Bd, capacity))  # as the runner packs it
    case["order"] = t(torch.tensor(order, dtype=torch.int32))
    return case


def variant(case, kind, side, persistent=False, dec_splits=1, order=False):
    scale = D ** -0.5
    rows, cap = case["rows"], case["dec_lens"].shape[0]
    out = torch.empty_like(case["q"])

    def pre(layer):
        paged_prefill_attention(case["q"], case["ks"][layer], case["vs"][layer], case["cu_pre"], case["seq_lens"],
                                case["tables"], scale, rows, out=out, persistent=persistent)

    def dec(layer):
        # as the backend: the graph's every sequence, the non-decode ones with length 0 (left untouched)
        paged_decode_attention(case["q"][:cap], case["ks"][layer], case["vs"][layer], case["dec_lens"],
                               case["tables"], scale, out=out[:cap], num_splits=dec_splits, skip_empty=True,
                               order=case["order"] if order else None)

    def run():
        for layer in range(LAYERS):
            if kind == "dec":
                dec(layer)
            elif kind == "pre":
                pre(layer)
            elif kind == "seq":
                pre(layer)
                dec(layer)
            else:  # "ov": varlen on the side stream, launched first (the backend); "ovd": the decode kernel there
                main = torch.cuda.current_stream()
                side.wait_stream(main)
                first, second = (pre, dec) if kind == "ov" else (dec, pre)
                with torch.cuda.stream(side):
                    first(layer)
                second(layer)
                main.wait_stream(side)
    return run, out


def time_graph(run, reps=30):
    """Microseconds per layer of `run` (all LAYERS layers), replayed from a CUDA graph."""
    return graph_seconds(run, reps) / LAYERS * 1e6


def main():
    if not torch.cuda.is_available():
        raise SystemExit("needs CUDA")
    rng = random.Random(0)
    cases = {
        "early: 78 decode (ctx 100-1300) + 178-token chunk over 750, 256 rows":
            make_case([rng.randint(100, 1300) for _ in range(78)], [(750, 178)], 256, 256, 1),
        "mid: 206 decode (ctx 200-1400) + 178 chunk tokens over 600, 384 rows":
            make_case([rng.randint(200, 1400) for _ in range(206)], [(600, 178)], 384, 256, 2),
        "mid, two chunks: 206 decode + 120 over 900 and 58 over 300, 384 rows":
            make_case([rng.randint(200, 1400) for _ in range(206)], [(900, 120), (300, 58)], 384, 256, 3),
    }
    side = torch.cuda.Stream()
    for name, case in cases.items():
        print(f"== {name}  (decode KV {case['kv_bytes'] / 1e6:.0f} MB per layer)")
        # (kind, persistent varlen grid, decode splits, longest-first decode order, NANOVLLM_DECODE_ATTN,
        #  NANOVLLM_PREFILL_ATTN); --tiles: the varlen kernel's tile configs on the persistent grid instead
        if "--tiles" in sys.argv:
            variants = [("dec", False, 1, True, "", ""), ("dec", False, 1, True, "64,4,2", "")]
            for pcfg in ("", "64,64,4,2", "64,64,4,3", "32,64,4,2", "64,128,4,2", "128,128,8,2"):
                variants += [("pre", True, 1, True, "", pcfg), ("ov", True, 1, True, "", pcfg),
                             ("ov", True, 1, True, "64,4,2", pcfg)]
        else:
            variants = [("dec", False, 1, False, "", ""), ("dec", False, 1, True, "", ""),
                        ("dec", False, 2, True, "", ""),
                        ("dec", False, 1, True, "64,4,2", ""), ("dec", False, 1, True, "64,4,3", ""),
                        ("dec", False, 1, True, "128,4,2", ""), ("dec", False, 1, True, "128,8,3", ""),
                        ("pre", False, 1, False, "", ""), ("pre", True, 1, False, "", ""),
                        ("seq", False, 1, False, "", ""), ("seq", True, 1, True, "", ""),
                        ("ov", False, 1, False, "", ""), ("ov", True, 1, False, "", ""),
                        ("ov", True, 1, True, "", ""), ("ovd", True, 1, True, "", ""),
                        ("ov", True, 1, True, "64,4,2", ""), ("ov", True, 1, True, "128,4,2", "")]
        for kind, persistent, dec_splits, order, cfg, pcfg in variants:
            for name, value in (("NANOVLLM_DECODE_ATTN", cfg), ("NANOVLLM_PREFILL_ATTN", pcfg)):
                if value:
                    os.environ[name] = value
                else:
                    os.environ.pop(name, None)
            run, out = variant(case, kind, side, persistent, dec_splits, order)
            us = time_graph(run)
            used, Bd = case["used"], case["Bd"]
            rows = slice(0, Bd) if kind == "dec" else slice(Bd, used) if kind == "pre" else slice(0, used)
            # check: the same variant eagerly over layer 0's cache (the reference's)
            run_l0, out0 = variant(dict(case, ks=case["ks"][:1] * LAYERS, vs=case["vs"][:1] * LAYERS), kind, side,
                                   persistent, dec_splits, order)
            run_l0()
            torch.cuda.synchronize()
            err = (out0[rows].float() - case["ref"][rows]).abs().max().item()
            extra = f"  decode {case['kv_bytes'] / us / 1e6:.2f} TB/s" if kind == "dec" else ""
            print(f"  {kind:4s} varlen {'persistent' if persistent else 'tile grid '}, decode splits {dec_splits}"
                  f"{' longest first' if order else ''}{' cfg ' + cfg if cfg else ''}"
                  f"{' varlen tiles ' + pcfg if pcfg else ''}: {us:7.1f} us/layer  max err {err:.4f}{extra}")
        os.environ.pop("NANOVLLM_DECODE_ATTN", None)
        os.environ.pop("NANOVLLM_PREFILL_ATTN", None)


if __name__ == "__main__":
    main()
