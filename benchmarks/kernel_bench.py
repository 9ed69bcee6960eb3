"""Kernel micro-benchmarks on one CUDA GPU, one subcommand per kernel family:

    python3 benchmarks/kernel_bench.py attention            # the varlen prefill kernel beside torch SDPA (and FA3)
    python3 benchmarks/kernel_bench.py attention --sweep    # + every candidate tile config, the best per shape
    python3 benchmarks/kernel_bench.py attention --kv-cache-dtype fp8 [--sweep]   # ours over an e4m3 KV cache
    python3 benchmarks/kernel_bench.py decode [--sweep]     # decode attention over bf16 and e4m3 caches
    python3 benchmarks/kernel_bench.py moe [--tp 1] [--tokens 1 8 256 ...] [--layers 4] [--fp8] [--json moe.json]
    python3 benchmarks/kernel_bench.py fp8act [--model benchmarks/models/qwen3-8b] [--rows 64 256 1024]
    python3 benchmarks/kernel_bench.py kvstore [--heads 32/4,32/8] [--tokens 256 2048]

attention: causal bf16 prefill attention, head_dim 128, 32 query / 8 KV heads (Qwen3-8B, Llama-3-8B) and 16 / 8
(Qwen3-0.6B), at 1,024 / 4,096 / 8,192 / 16,384 tokens and 8 x 8,192; in TFLOP/s with FLOPs = 2 * 2 * H * D *
sum(L^2) / 2 (QK^T and PV over the causal triangle; a chunk of q queries over c cached keys counts q*c + q^2/2).
Ours reads K/V from the engine's paged cache (blocks of 256 tokens, in random order); torch SDPA's cuDNN and flash
backends get dense (B, H, L, D) tensors with enable_gqa (or K/V expanded to every query head, outside the timing,
where a backend refuses it); FlashAttention-3 where `flash_attn_interface` imports. A last shape, a prefill-heavy
step's 2,048-token chunk over a 6,144-token prefix beside a fresh 6,144-token prompt, is ours only. --sweep adds
head_dim 64 at 1k and 8k tokens and times every config of `prefill_config.SWEEP` on every shape, then prints the
best per shape and, per (head_dim, G, bucket), the config with the best geometric mean over the bucket's shapes as
`prefill_config.TABLE` entries to paste. Times are `triton.testing.do_bench` medians; do_bench zeroes a 256 MB
buffer before every call, so each call starts with a cold L2 (the inputs are not reused from cache). Each config
is checked against cuDNN's output on its first shape (relative error < 2e-2; a config over it is marked WRONG and
never wins). Takes about 3-4 minutes on an H200, most of it compiling (one compile per config, head_dim and G).
--kv-cache-dtype fp8: our cache holds e4m3 K/V with per-(token, head) scales (as the engine's with
kv_cache_dtype="fp8"); SDPA and FA3 get the dequantized values in bf16, so the check still compares like with like
(ours takes `prefill_config.E4M3_TABLE`'s tiles there; the sweep's printed entries, keyed like `TABLE`, say
which config would win on an e4m3 cache: E4M3_TABLE is keyed by head_dim and bucket only).

decode: the decode kernel (``paged_decode_attention``) at 256 sequences of 100-2,048 tokens (uniform, seeded),
32 / 8, 32 / 4 and 16 / 8 heads (Qwen3-8B, Qwen3-30B-A3B, Qwen3-0.6B), over a bf16 cache and an e4m3 one with
per-(token, head) scales, launched as a decode graph launches it: the longest sequence first, and the KV splits
the engine takes for the shape (``decode_long_splits`` when the mean context is long, e.g. ``--batch 64 --ctx
6000-8200``); microseconds, achieved TB/s over the bytes read, and the error against ``paged_attention_ref``.
--sweep times every (BLOCK_N, num_warps, num_stages) launch and prints the best, --launches the ones named;
--splits N forces N KV splits.

moe: the fused mixture-of-experts layer (``nanovllm.kernels.moe``) at Qwen3-30B-A3B's shapes (hidden 2048, 128
experts, top-8, expert width 768 / tp) in bf16, random weights (N(0, 0.02), the router too). For each token count
M and each block of rows (block_m) it times every candidate tile of the gate/up GEMM and of the down GEMM on
that block's expert-sorted layout, then the whole layer (routing, layout, both GEMMs, combine) with the best
pair; the best block_m wins. Everything runs in CUDA graphs that cycle over --layers copies of the weights (one
layer's 1.2 GB already exceeds L2; the copies keep a replay from finding the last one's tiles there), as the
decode graphs do. The winner is checked against the torch reference (``fused_moe_ref``, M <= 1024) or the
current table's config. Prints per M: microseconds, achieved TB/s (the experts touched + activations) and
TFLOP/s, the current table's time, and at the end the measured table as an entry of ``MOE_CONFIGS`` in
``nanovllm/kernels/moe_configs.py``, to paste there. --fp8: the experts in e4m3 with per-row scales, as
``quantization="fp8"`` stores them (gate/up on e4m3 activations, down weight-only; bytes and TB/s count one byte
per weight).

fp8act: the activation quantization of the FP8 linear layers at a model's hidden and intermediate sizes (its
config.json), bf16 rows: the add + RMSNorm and the SiLU-and-mul followed by the quantizer (``per_token_quant_fp8``
/ ``per_token_group_quant_fp8``), as two launches, against the kernels that write the e4m3 rows themselves
(``add_rms_norm_fp8`` / ``silu_and_mul_fp8``: what the engine runs), per token and per token and 128 columns.
Microseconds per call in CUDA graphs over 8 input copies; each fused result is checked bit for bit against the
two-launch one.

kvstore: the fused QK-norm + RoPE + KV-cache store (``qkv_norm_rope_store``, one launch a layer between the QKV
projection and attention) at head_dim 128, into a bf16 cache and into an e4m3 one with per-(token, head) scales
(kv_cache_dtype="fp8": each k / v head quantized as it is stored); microseconds per call in CUDA graphs of ten
calls, slots in random order over a 1 GB cache.
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from nanovllm.engine.gemm_plan import graph_seconds  # noqa: E402
from nanovllm.kernels.activation import silu_and_mul, silu_and_mul_fp8  # noqa: E402
from nanovllm.kernels.decode_attention import (  # noqa: E402
    LONG_CONTEXT_TOKENS,
    decode_long_splits,
    paged_decode_attention,
)
from nanovllm.kernels.fp8_quant import per_token_group_quant_fp8, per_token_quant_fp8  # noqa: E402
from nanovllm.kernels.moe import fused_moe, moe_down, moe_gate_up  # noqa: E402
from nanovllm.kernels.moe_configs import GemmTile, MoEConfig, moe_config  # noqa: E402
from nanovllm.kernels.moe_routing import moe_route, moe_route_align  # noqa: E402
from nanovllm.kernels.norm import add_rms_norm, add_rms_norm_fp8  # noqa: E402
from nanovllm.layers.moe_ref import fused_moe_ref  # noqa: E402
from nanovllm.layers.quantization import fp8_ref  # noqa: E402

BLOCK = 256  # the engine's KV block size


def _sdpa_backends():
    from torch.nn.attention import SDPBackend
    return {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}


def _fa3():
    try:
        import flash_attn_interface  # FlashAttention-3 (hopper/ build)
    except ImportError:
        return None
    return flash_attn_interface.flash_attn_func


class AttentionCase:
    """One shape: sequences of (q_len, ctx) with random q/k/v, dense for SDPA and in a paged cache for ours."""

    def __init__(self, label: str, seqs: list[tuple[int, int]], H: int, Hkv: int, D: int, seed: int = 0,
                 device: str = "cuda", dtype: torch.dtype = torch.bfloat16, kv_fp8: bool = False):
        from nanovllm.attention.torch_ref import quantize_kv_ref
        from nanovllm.kernels.prefill_config import bucket
        self.label, self.seqs, self.H, self.Hkv, self.D = label, seqs, H, Hkv, D
        g = torch.Generator(device=device).manual_seed(seed)
        dev, dt = device, dtype
        lens = [q + c for q, c in seqs]
        self.max_q = max(q for q, _ in seqs)
        self.bucket = bucket(self.max_q, 1 << (H // Hkv - 1).bit_length())
        self.flops = sum(4 * H * D * (q * c + q * q / 2) for q, c in seqs)
        self.dense = len(set(seqs)) == 1 and seqs[0][1] == 0    # equal fresh prompts: SDPA / FA3 comparable
        B, L = len(seqs), max(lens)
        # dense (B, L, H|Hkv, D) copies; the paged cache holds the same keys and values
        self.q = torch.randn(B, L, H, D, device=dev, generator=g, dtype=dt)
        self.k = torch.randn(B, L, Hkv, D, device=dev, generator=g, dtype=dt)
        self.v = torch.randn(B, L, Hkv, D, device=dev, generator=g, dtype=dt)
        stored = [(self.k, None), (self.v, None)]      # what our paged cache holds: values, scales
        if kv_fp8:  # e4m3 with scales per (token, head) in our cache; SDPA / FA3 get their dequantized values
            stored = [(x.view(B, L, Hkv, D), s.view(B, L, Hkv))
                      for x, s in (quantize_kv_ref(t.reshape(-1, Hkv, D)) for t in (self.k, self.v))]
            self.k, self.v = ((x.float() * s[..., None]).to(dt) for x, s in stored)
        nblk = [-(-n // BLOCK) for n in lens]
        perm = torch.randperm(sum(nblk) + 1, device=dev, generator=g)
        self.k_cache = torch.zeros(sum(nblk) + 1, BLOCK, Hkv, D, device=dev, dtype=stored[0][0].dtype)
        self.v_cache = torch.zeros_like(self.k_cache)
        self.scales = [torch.ones(self.k_cache.shape[:3], device=dev) for _ in stored] if kv_fp8 else None
        self.bt = torch.full((B, max(nblk)), -1, dtype=torch.int32, device=dev)
        i = 0
        for b, n in enumerate(lens):
            blocks = perm[i:i + nblk[b]]
            i += nblk[b]
            self.bt[b, :nblk[b]] = blocks.int()
            slots = (blocks[:, None] * BLOCK + torch.arange(BLOCK, device=dev)).flatten()[:n]
            for j, (x, s) in enumerate(stored):
                (self.k_cache, self.v_cache)[j].view(-1, Hkv, D)[slots] = x[b, :n]
                if s is not None:
                    self.scales[j].view(-1, Hkv)[slots] = s[b, :n]
        self.q_flat = torch.cat([self.q[b, c:c + q] for b, (q, c) in enumerate(seqs)])
        self.cu = torch.tensor([0, *torch.tensor([q for q, _ in seqs]).cumsum(0).tolist()], dtype=torch.int32,
                               device=dev)
        self.seq_lens = torch.tensor(lens, dtype=torch.int32, device=dev)
        self.out = torch.empty_like(self.q_flat)
        self.scale = D ** -0.5

    def ours(self, config=None):
        from nanovllm.kernels.prefill_attention import paged_prefill_attention
        ks, vs = self.scales or (None, None)
        return lambda: paged_prefill_attention(self.q_flat, self.k_cache, self.v_cache, self.cu, self.seq_lens,
                                               self.bt, self.scale, self.max_q, out=self.out, config=config,
                                               k_scales=ks, v_scales=vs)

    def sdpa(self, backend):
        """SDPA on (B, H, L, D) under one backend, enable_gqa, else K/V expanded (outside the timing)."""
        import torch.nn.functional as F
        from torch.nn.attention import sdpa_kernel
        q, k, v = (t.transpose(1, 2).contiguous() for t in (self.q, self.k, self.v))
        G = self.H // self.Hkv

        def gqa():
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale, enable_gqa=G > 1)
        try:
            gqa()
            return gqa
        except RuntimeError:
            ke, ve = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)

            def expanded():
                with sdpa_kernel(backend):
                    return F.scaled_dot_product_attention(q, ke, ve, is_causal=True, scale=self.scale)
            expanded()
            return expanded

    def fa3(self, flash_attn_func):
        return lambda: flash_attn_func(self.q, self.k, self.v, causal=True, softmax_scale=self.scale)

    def reference_rows(self, fn) -> torch.Tensor:
        """An SDPA fn's output as our flat (T, H, D) rows."""
        o = fn().transpose(1, 2)                                              # (B, L, H, D)
        return torch.cat([o[b, c:c + q] for b, (q, c) in enumerate(self.seqs)])


def _time(fn) -> float:
    import triton
    return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")


def _cases(sweep: bool, kv_fp8: bool = False) -> list[AttentionCase]:
    shapes = [("1,024", [(1024, 0)]), ("4,096", [(4096, 0)]), ("8,192", [(8192, 0)]), ("16,384", [(16384, 0)]),
              ("8 x 8,192", [(8192, 0)] * 8), ("chunk+prompt", [(2048, 6144), (6144, 0)])]
    heads = [(32, 8, 128), (16, 8, 128)]
    cases = [AttentionCase(label, seqs, H, Hkv, D, kv_fp8=kv_fp8) for H, Hkv, D in heads for label, seqs in shapes]
    if sweep:
        cases += [AttentionCase(label, seqs, 32, 8, 64, kv_fp8=kv_fp8) for label, seqs in shapes[:1] + shapes[2:3]]
    return cases


def _tflops(case: AttentionCase, ms: float) -> float:
    return case.flops / (ms * 1e-3) / 1e12


def attention(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(prog="kernel_bench.py attention", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sweep", action="store_true", help="time every candidate config of prefill_config.SWEEP")
    ap.add_argument("--configs", default="", help="with --sweep: comma-separated config names to keep (default all)")
    ap.add_argument("--kv-cache-dtype", choices=("auto", "fp8"), default="auto",
                    help="fp8: our paged cache in e4m3 with per-(token, head) scales (default: bf16)")
    ns = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("kernel_bench.py attention needs a CUDA GPU")
    from nanovllm.kernels.prefill_config import SWEEP, tile_config
    t_start = time.perf_counter()
    fa3 = _fa3()
    cases = _cases(ns.sweep, ns.kv_cache_dtype == "fp8")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, FlashAttention-3: "
          f"{'yes' if fa3 else 'not importable'}; TFLOP/s, causal, bf16"
          + (" (ours over an e4m3 KV cache; the others over its dequantized values)"
             if ns.kv_cache_dtype == "fp8" else ""))
    rows = []
    for case in cases:
        row = {"ours": _tflops(case, _time(case.ours()))}
        if case.dense:
            for name, backend in _sdpa_backends().items():
                try:
                    row[name] = _tflops(case, _time(case.sdpa(backend)))
                except RuntimeError as e:  # a backend that refuses the shape
                    row[name] = f"n/a ({str(e).splitlines()[0][:40]})"
            if fa3 is not None:
                row["fa3"] = _tflops(case, _time(case.fa3(fa3)))
        rows.append(row)
    for (H, Hkv, D) in sorted({(c.H, c.Hkv, c.D) for c in cases}, reverse=True):
        print(f"\n{H} query / {Hkv} KV heads, head_dim {D} (ours: "
              f"{tile_config(D, 1 << (H // Hkv - 1).bit_length(), 8192, torch.bfloat16).name} for long prompts)")
        print(f"| {'tokens':12s} | ours (paged varlen) | FlashAttention-3 | torch SDPA, cuDNN | torch SDPA, flash |")
        print("|---|---|---|---|---|")
        for case, row in zip(cases, rows):
            if (case.H, case.Hkv, case.D) == (H, Hkv, D):
                cells = [row.get(k, "-") for k in ("ours", "fa3", "cudnn", "flash")]
                print(f"| {case.label:12s} | " + " | ".join(f"{c:.0f}" if isinstance(c, float) else c
                                                           for c in cells) + " |")
    print(f"\n({time.perf_counter() - t_start:.0f} s so far)")
    if ns.sweep:
        keep = {n for n in ns.configs.split(",") if n}
        configs = [c for c in SWEEP if not keep or c.name in keep]
        _sweep(cases, configs)
    print(f"total {time.perf_counter() - t_start:.0f} s")


def _sweep(cases: list[AttentionCase], configs) -> None:
    """Time every config on every case; print the best per case and the table entries per (D, G, bucket)."""
    results: dict[tuple[int, str], float] = {}      # (case index, config name) -> TFLOP/s (0: wrong or failed)
    checked: set[tuple[int, int, str]] = set()
    for cfg in configs:
        t0 = time.perf_counter()
        for i, case in enumerate(cases):
            key = (case.D, case.H // case.Hkv, cfg.name)
            try:
                fn = case.ours(cfg)
                if key not in checked and case.dense:
                    checked.add(key)
                    ref = case.reference_rows(case.sdpa(_sdpa_backends()["cudnn"])).float()
                    err = ((fn().float() - ref).norm() / ref.norm()).item()
                    if not err < 2e-2:
                        print(f"  {cfg.name}: WRONG on {case.label} (relative error {err:.2e})")
                        results[(i, cfg.name)] = 0.0
                        continue
                results[(i, cfg.name)] = _tflops(case, _time(fn))
            except Exception as e:  # a config that fails to compile or launch loses, the sweep goes on
                print(f"  {cfg.name}: failed on {case.label}: {type(e).__name__}: {str(e).splitlines()[0][:80]}")
                results[(i, cfg.name)] = 0.0
        print(f"  {cfg.name:36s} {time.perf_counter() - t0:5.1f} s")
    print("\nbest config per shape (TFLOP/s; the next two after it)")
    for i, case in enumerate(cases):
        ranked = sorted(((results.get((i, c.name), 0.0), c.name) for c in configs), reverse=True)
        head = f"{case.H}/{case.Hkv} D{case.D} {case.label}"
        print(f"  {head:28s} " + ", ".join(f"{n} {t:.0f}" for t, n in ranked[:3]))
    print("\nprefill_config.TABLE entries (best geometric mean over each bucket's shapes, relative to each shape's "
          "best):")
    groups: dict[tuple[int, int, str], list[int]] = {}
    for i, case in enumerate(cases):
        g_pad = 1 << (case.H // case.Hkv - 1).bit_length()
        groups.setdefault((case.D, g_pad, case.bucket), []).append(i)
    best_of = {i: max(max(results.get((i, c.name), 0.0) for c in configs), 1e-9) for i in range(len(cases))}

    def score(cfg, idx):
        rel = [results.get((i, cfg.name), 0.0) / best_of[i] for i in idx]
        return math.exp(sum(math.log(max(r, 1e-6)) for r in rel) / len(rel))
    for (D, g_pad, bucket), idx in sorted(groups.items(), reverse=True):
        best = max(configs, key=lambda c: score(c, idx))
        print(f"    ({D}, {g_pad}, {bucket!r}, \"bf16\"): {best.code()},  # {score(best, idx):.3f} of the per-shape "
              f"best")


TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 384, 512, 1024, 2048, 4096, 8192)  # moe: the default token counts


def block_ms(tokens: int) -> tuple[int, ...]:
    """The rows per expert block worth trying at this many tokens (each expert gets ~tokens * k / E rows)."""
    if tokens <= 64:
        return (16,)
    if tokens <= 512:
        return (16, 32, 64)
    return (32, 64, 128)


def tiles(block_m: int, operands: int) -> list[GemmTile]:
    """Candidate tiles of a GEMM that loads `operands` weight tiles per step (gate/up: 2, down: 1): decode-sized
    blocks stream the weights (wide k-tiles, deep pipelines, or two stages so that two programs share an SM and
    one streams while the other starts); large blocks are compute tiles. Those over ~200 KB of shared memory are
    left out (they do not build)."""
    if block_m <= 32:
        grid = itertools.product((32, 64, 128, 256), (64, 128, 256), (4, 8), (2, 3, 4, 5))
    else:
        grid = itertools.product((64, 128, 256), (32, 64, 128), (4, 8), (3, 4))
    return [GemmTile(bn, bk, warps, stages) for bn, bk, warps, stages in grid
            if (block_m * bk + operands * bk * bn) * 2 * stages <= 200 * 1024]


def _try(fn):
    try:
        return fn()
    except Exception as e:  # out of resources on this GPU: not a candidate
        return e


def _seconds(fn, copies: int) -> float:
    """Seconds per weight copy of fn (a CUDA graph over all copies); inf when the config does not run here."""
    r = _try(lambda: graph_seconds(fn) / copies)
    return r if isinstance(r, float) else float("inf")


def layer_seconds(x, logits, w13, w2, k, cfg: MoEConfig) -> float:
    """The whole fused layer (routing, layout, GEMMs, combine) with cfg, per weight copy. w13 / w2: lists of
    (weights, per-row scales or None) copies."""
    return _seconds(lambda: [fused_moe(x, logits, a, b, k, True, config=cfg, w13_scale=sa, w2_scale=sb)
                             for (a, sa), (b, sb) in zip(w13, w2)], len(w13))


def sweep_block(x, logits, weights, w13, w2, k: int, block_m: int):
    """The best tile of each GEMM on the layout of `block_m`-row blocks, then the whole layer with them:
    (layer seconds, config, gate_up seconds, down seconds, blocks in the layout)."""
    _, _, layout = moe_route_align(logits, k, True, block_m)  # (the same weights and ids as the caller's)
    up_tiles, down_tiles = tiles(block_m, 2), tiles(block_m, 1)
    with ThreadPoolExecutor(16) as pool:  # compile side by side (the compiler runs in subprocesses)
        list(pool.map(lambda t: _try(lambda: moe_gate_up(x, w13[0][0], layout, k, t, w13[0][1])), up_tiles))
        h = moe_gate_up(x, w13[0][0], layout, k, up_tiles[0], w13[0][1])
        list(pool.map(lambda t: _try(lambda: moe_down(h, w2[0][0], layout, weights, t, w2[0][1])), down_tiles))
    gu = {t: _seconds(lambda t=t: [moe_gate_up(x, w, layout, k, t, sc) for w, sc in w13], len(w13))
          for t in up_tiles}
    dn = {t: _seconds(lambda t=t: [moe_down(h, w, layout, weights, t, sc) for w, sc in w2], len(w2))
          for t in down_tiles}
    cfg = MoEConfig(block_m, min(gu, key=gu.get), min(dn, key=dn.get))
    return layer_seconds(x, logits, w13, w2, k, cfg), cfg, gu[cfg.gate_up], dn[cfg.down], layout.block_expert.numel()


def bench_moe(ns) -> dict:
    dev = torch.device("cuda")
    E, H, k = ns.experts, ns.hidden, ns.top_k
    inter = ns.inter // ns.tp
    dt = torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(0)

    def rand(*shape):
        return (0.02 * torch.randn(*shape, generator=gen, device=dev)).to(dt)

    def experts(n, kk):  # (weights, per-row scales): bf16 and None, or e4m3 and float32 (E, n) as Fp8MoEMethod
        w = rand(E, n, kk)
        if not ns.fp8:
            return w, None
        q, sc = fp8_ref.quantize_rows(w.view(E * n, kk))
        return q.view(E, n, kk), sc.view(E, n)

    w13 = [experts(2 * inter, H) for _ in range(ns.layers)]
    w2 = [experts(H, inter) for _ in range(ns.layers)]
    router = rand(E, H)
    expert_bytes = 3 * H * inter * (1 if ns.fp8 else 2)
    print(f"fused MoE: E={E} H={H} I={inter} (tp={ns.tp}) top-{k}, {'FP8 (e4m3) experts' if ns.fp8 else 'bf16'}, "
          f"{ns.layers} weight copies, {expert_bytes * E / 1e9:.2f} GB of experts per layer; "
          f"{torch.cuda.get_device_name()}")
    rows, table = [], []
    for M in ns.tokens:
        x = torch.randn(M, H, generator=gen, device=dev).to(dt)
        logits = F.linear(x, router)
        weights, ids = moe_route(logits, k, True)
        touched = torch.unique(ids).numel()
        t0 = time.perf_counter()
        total, cfg, t_gu, t_dn, nb = min((sweep_block(x, logits, weights, w13, w2, k, bm)
                                          for bm in block_ms(M)), key=lambda r: r[0])
        current = moe_config(M, E, H, inter)
        t_cur = layer_seconds(x, logits, w13, w2, k, current)
        scales = dict(w13_scale=w13[0][1], w2_scale=w2[0][1])
        y = fused_moe(x, logits, w13[0][0], w2[0][0], k, True, config=cfg, **scales)
        ref = fused_moe_ref(x, logits, w13[0][0], w2[0][0], k, True, **scales) if M <= 1024 else \
            fused_moe(x, logits, w13[0][0], w2[0][0], k, True, config=current, **scales)
        err = ((y.float() - ref.float()).norm() / ref.float().norm()).item()
        moved = touched * expert_bytes + 2 * M * H * 2 + M * k * (2 * inter + 2 * H) * 2
        row = {"tokens": M, "experts_touched": touched, "max_blocks": nb, "config": str(cfg), "us": total * 1e6,
               "gate_up_us": t_gu * 1e6, "down_us": t_dn * 1e6, "TB_s": moved / total / 1e12,
               "TFLOP_s": 2 * M * k * 3 * H * inter / total / 1e12, "current_us": t_cur * 1e6,
               "current": str(current), "rel_err": err, "sweep_s": time.perf_counter() - t0}
        rows.append(row)
        table.append((M, cfg))
        print(f"M={M:5d} experts {touched:3d} | best {cfg} | {total * 1e6:8.1f} us (gate_up {t_gu * 1e6:7.1f}, "
              f"down {t_dn * 1e6:7.1f}) {row['TB_s']:5.2f} TB/s {row['TFLOP_s']:6.1f} TFLOP/s | table now "
              f"{t_cur * 1e6:8.1f} us | rel err {err:.1e} | {row['sweep_s']:.0f}s", flush=True)
        if err > 1e-2:
            print(f"WARNING: M={M}: the best config's output is off by {err:.1e} (relative)")
    print_table(table, (E, H, inter), ns.tp)
    return {"shape": [E, H, inter, k], "rows": rows}


def print_table(table: list[tuple[int, MoEConfig]], key: tuple[int, int, int], tp: int) -> None:
    """The measured configs as moe_configs.py buckets: consecutive token counts with one config make one bucket
    (up to the last of them; the last bucket covers every larger step)."""
    buckets = []
    for M, cfg in table:
        if buckets and buckets[-1][1] == cfg:
            buckets[-1] = (M, cfg)
        else:
            buckets.append((M, cfg))
    buckets[-1] = (1 << 30, buckets[-1][1])
    print("\n# an entry of MOE_CONFIGS in nanovllm/kernels/moe_configs.py")
    print(f"    # measured on {torch.cuda.get_device_name()} by benchmarks/kernel_bench.py moe --tp {tp}")
    print(f"    {key}: (")
    for M, c in buckets:
        up, dn = c.gate_up, c.down
        print(f"        ({M}, _c({c.block_m}, ({up.block_n}, {up.block_k}, {up.num_warps}, {up.num_stages}), "
              f"({dn.block_n}, {dn.block_k}, {dn.num_warps}, {dn.num_stages}))),")
    print("    ),")


def moe(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(prog="kernel_bench.py moe", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tp", type=int, default=1, help="the expert width per rank is 768 / tp")
    ap.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS))
    ap.add_argument("--layers", type=int, default=4, help="weight copies cycled through (to miss L2)")
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=768)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--fp8", action="store_true", help="FP8 experts (e4m3, per-row scales: quantization='fp8')")
    ap.add_argument("--json", default=None, help="write the rows here")
    ns = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("kernel_bench.py moe needs a CUDA GPU")
    if ns.inter % ns.tp:
        ap.error(f"--inter {ns.inter} is not divisible by --tp {ns.tp}")
    res = bench_moe(ns)
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(res, f, indent=1)


class DecodeCase:
    """decode: a decode step's attention: B sequences of one query each over contexts uniform in [lo, hi], K/V in the
    engine's paged cache (blocks of 256 tokens in random order), bf16 or e4m3 with per-(token, head) scales."""

    def __init__(self, B: int, lo: int, hi: int, H: int, Hkv: int, D: int, kv_fp8: bool, seed: int = 0):
        from nanovllm.attention.torch_ref import quantize_kv_ref
        g = torch.Generator().manual_seed(seed)
        self.lens = torch.randint(lo, hi + 1, (B,), generator=g, dtype=torch.int32)
        self.H, self.Hkv, self.D, self.kv_fp8 = H, Hkv, D, kv_fp8
        nblk = (self.lens + BLOCK - 1) // BLOCK
        total = int(nblk.sum())
        perm = torch.randperm(total, generator=g).int()
        self.bt = torch.full((B, int(nblk.max())), -1, dtype=torch.int32)
        i = 0
        for b, n in enumerate(nblk.tolist()):
            self.bt[b, :n] = perm[i:i + n]
            i += n
        dev = "cuda"
        k = torch.randn(total * BLOCK, Hkv, D, device=dev, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        self.scales = (None, None)
        if kv_fp8:
            (k, ks), (v, vs) = quantize_kv_ref(k), quantize_kv_ref(v)
            self.scales = (ks.view(total, BLOCK, Hkv), vs.view(total, BLOCK, Hkv))
        self.k_cache, self.v_cache = k.view(total, BLOCK, Hkv, D), v.view(total, BLOCK, Hkv, D)
        # the engine's launch: longest first, and its KV splits for the shape (None: the kernel's default)
        self.order = torch.argsort(self.lens, descending=True, stable=True).int().to(dev)
        long = self.lens.float().mean().item() >= LONG_CONTEXT_TOKENS
        self.splits = decode_long_splits(B, Hkv, self.bt.shape[1], BLOCK, torch.device(dev)) if long else None
        self.bt, self.lens = self.bt.to(dev), self.lens.to(dev)
        self.q = torch.randn(B, H, D, device=dev, dtype=torch.bfloat16)
        self.out = torch.empty_like(self.q)
        tokens = int(self.lens.sum())
        self.bytes = tokens * Hkv * (2 * D * k.element_size() + (8 if kv_fp8 else 0))

    def run(self, num_splits=None, **kw):
        ks, vs = self.scales
        splits = num_splits or self.splits
        return lambda: paged_decode_attention(self.q, self.k_cache, self.v_cache, self.lens, self.bt,
                                              self.D ** -0.5, out=self.out, k_scales=ks, v_scales=vs,
                                              order=self.order, num_splits=splits, **kw)

    def reference(self) -> torch.Tensor:
        from nanovllm.attention.torch_ref import paged_attention_ref
        B = self.q.shape[0]
        cu = torch.arange(B + 1, dtype=torch.int32, device=self.q.device)
        ks, vs = self.scales
        q = self.q.float() if self.kv_fp8 else self.q
        return paged_attention_ref(q, self.k_cache, self.v_cache, cu, self.lens, self.bt,
                                   self.D ** -0.5, 1, k_scales=ks, v_scales=vs)


def decode(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(prog="kernel_bench.py decode", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--ctx", default="100-2048", help="context lengths, uniform in lo-hi")
    ap.add_argument("--heads", default="32/8,32/4,16/8", help="query/KV heads, comma-separated (head_dim 128)")
    ap.add_argument("--sweep", action="store_true", help="every (BLOCK_N, num_warps, num_stages) launch too")
    ap.add_argument("--launches", default="", help="BLOCK_N-warps-stages,... to time beside the default (e.g. "
                    "64-2-7: Triton gives the K/V loads one more shared-memory buffer for every two stages past 3)")
    ap.add_argument("--cache", choices=("both", "bf16", "e4m3"), default="both", help="which KV caches to time")
    ap.add_argument("--splits", type=int, default=None, help="KV splits (default: the engine's for the shape)")
    ns = ap.parse_args(argv)
    if ns.splits is not None and ns.splits < 1:
        ap.error(f"--splits must be >= 1, got {ns.splits}")
    items = [x.split("-") for x in ns.launches.split(",") if x]
    if not all(len(x) == 3 and all(v.isdigit() for v in x) for x in items):
        ap.error(f"--launches takes BLOCK_N-warps-stages items, got {ns.launches!r}")
    extra = [tuple(map(int, x)) for x in items]
    if not torch.cuda.is_available():
        raise SystemExit("kernel_bench.py decode needs a CUDA GPU")
    lo, hi = map(int, ns.ctx.split("-"))
    launches = [None]
    if ns.sweep:
        launches += [(bn, w, s) for bn in (64, 128, 256) for w in (1, 2, 4, 8) for s in (1, 2, 3, 4)]
    launches += [x for x in extra if x not in launches]
    print(f"{torch.cuda.get_device_name()}: decode attention, {ns.batch} sequences of {lo}-{hi} tokens, "
          f"head_dim 128; TB/s counts the K/V (and scale) bytes read once")
    for hh in ns.heads.split(","):
        H, Hkv = map(int, hh.split("/"))
        for fp8 in {"both": (False, True), "bf16": (False,), "e4m3": (True,)}[ns.cache]:
            case = DecodeCase(ns.batch, lo, hi, H, Hkv, 128, fp8)
            ref = case.reference().float()
            best = None
            for launch in launches:
                splits = ns.splits or case.splits
                name = f"{H}/{Hkv} {'e4m3' if fp8 else 'bf16'} {str(launch or 'default'):14s} splits {splits or 'auto'}"
                try:
                    fn = case.run(num_splits=ns.splits, launch=launch)
                    fn()
                    err = ((case.out.float() - ref).abs().max() / ref.abs().max()).item()
                    us = _time(fn) * 1e3
                except Exception as e:  # a launch that fails to compile or run loses, the sweep goes on
                    print(f"{name} failed: {type(e).__name__}")
                    continue
                if launch is not None and (best is None or us < best[0]):
                    best = (us, launch)
                print(f"{name} {us:8.1f} us {case.bytes / us / 1e6:6.2f} TB/s  rel err {err:.1e}", flush=True)
            if best:
                print(f"{H}/{Hkv} {'e4m3' if fp8 else 'bf16'} best: {best[1]} {best[0]:.1f} us")
            del case, ref
            torch.cuda.empty_cache()


def fp8act_cases(hidden: int, inter: int, rows: int, device, copies: int = 8, group: int | None = None) -> dict:
    """name -> (two launches, one launch), each a function over `copies` inputs returning the last (q, s): the
    add + RMSNorm before q/k/v and gate/up (hidden wide) and the SiLU-and-mul before down (inter wide)."""
    g = torch.Generator(device="cpu").manual_seed(rows)
    xs = [torch.randn(rows, hidden, generator=g).bfloat16().to(device) for _ in range(copies)]
    r = torch.randn(rows, hidden, generator=g).bfloat16().to(device)
    w = torch.randn(hidden, generator=g).bfloat16().to(device)
    gu = [torch.randn(rows, 2 * inter, generator=g).bfloat16().to(device) for _ in range(copies)]

    def quant(y):
        return per_token_quant_fp8(y) if group is None else per_token_group_quant_fp8(y, group)
    return {
        "add + RMSNorm": (lambda: [quant(add_rms_norm(x, r, w, 1e-6)[0]) for x in xs][-1],
                          lambda: [add_rms_norm_fp8(x, r, w, 1e-6, group=group)[0] for x in xs][-1]),
        "SiLU-and-mul": (lambda: [quant(silu_and_mul(x)) for x in gu][-1],
                         lambda: [silu_and_mul_fp8(x, group) for x in gu][-1]),
    }


def fp8act(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(prog="kernel_bench.py fp8act", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="benchmarks/models/qwen3-8b", help="a directory with config.json")
    ap.add_argument("--rows", type=int, nargs="+", default=[64, 256, 1024])
    ns = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("kernel_bench.py fp8act needs a CUDA GPU")
    with open(os.path.join(ns.model, "config.json")) as f:
        cfg = json.load(f)
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    print(f"{torch.cuda.get_device_name()}: FP8 activation quantization, hidden {hidden}, intermediate {inter}, "
          "bf16 rows; us per call (CUDA graphs over 8 inputs)")
    for group in (None, 128):
        for M in ns.rows:
            for name, (two, one) in fp8act_cases(hidden, inter, M, "cuda", group=group).items():
                (q2, s2), (q1, s1) = two(), one()
                same = torch.equal(q1.view(torch.uint8), q2.view(torch.uint8)) and torch.equal(s1, s2)
                t2, t1 = graph_seconds(two, reps=20) / 8 * 1e6, graph_seconds(one, reps=20) / 8 * 1e6
                print(f"{'per token' if group is None else f'groups of {group}':12s} M={M:5d} {name:14s} "
                      f"+ quantizer {t2:7.2f} us | fused {t1:7.2f} us ({t2 / t1:.2f}x)"
                      + ("" if same else "  DIFFERENT BYTES"), flush=True)


def kvstore_us(H: int, Hkv: int, T: int, cache_dtype: torch.dtype, D: int = 128, bs: int = 256,
               device: str = "cuda", cache_bytes: int = 1 << 30) -> float:
    """Microseconds of one ``qkv_norm_rope_store`` of T tokens into a paged cache of `cache_dtype` (e4m3: with
    per-(token, head) scales) of about `cache_bytes`, slots in random order; CUDA graphs of ten calls."""
    from nanovllm.kernels.fused_qkv import qkv_norm_rope_store
    g = torch.Generator(device=device).manual_seed(T)
    blocks = max(cache_bytes // (2 * bs * Hkv * D * 2), -(-T // bs))
    qkv = torch.randn(T, (H + 2 * Hkv) * D, device=device, generator=g).bfloat16()
    pos = torch.randint(0, 4096, (T,), device=device, generator=g)
    cos_sin = torch.randn(4096, D, device=device, generator=g)
    qw, kw = (torch.randn(D, device=device, generator=g).bfloat16() for _ in range(2))
    slots = torch.randperm(blocks * bs, device=device, generator=g)[:T]
    q_out = torch.empty(T, H, D, device=device, dtype=torch.bfloat16)
    kc = torch.zeros(blocks, bs, Hkv, D, device=device, dtype=cache_dtype)
    vc = torch.zeros_like(kc)
    ks, vs = ((torch.ones(blocks, bs, Hkv, device=device) for _ in range(2))
              if cache_dtype == torch.float8_e4m3fn else (None, None))

    def ten():  # ten calls a replay: a graph's own launch gap is not the kernel's
        for _ in range(10):
            qkv_norm_rope_store(qkv, pos, cos_sin, qw, kw, 1e-6, kc, vc, slots, H, Hkv, D, q_out=q_out,
                                k_scales=ks, v_scales=vs)
    return graph_seconds(ten, reps=20) / 10 * 1e6


def kvstore(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(prog="kernel_bench.py kvstore", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", default="32/4,32/8", help="query/KV heads, comma-separated (head_dim 128)")
    ap.add_argument("--tokens", type=int, nargs="+", default=[256, 2048])
    ns = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("kernel_bench.py kvstore needs a CUDA GPU")
    print(f"{torch.cuda.get_device_name()}: QK-norm + RoPE + KV store, head_dim 128; us per call (CUDA graphs)")
    for hh in ns.heads.split(","):
        H, Hkv = map(int, hh.split("/"))
        for T in ns.tokens:
            bf, e4 = (kvstore_us(H, Hkv, T, dt) for dt in (torch.bfloat16, torch.float8_e4m3fn))
            print(f"{H}/{Hkv} T={T:5d}: bf16 cache {bf:6.2f} us | e4m3 cache {e4:6.2f} us ({e4 / bf:.2f}x)",
                  flush=True)


COMMANDS = {"attention": attention, "moe": moe, "decode": decode, "fp8act": fp8act, "kvstore": kvstore}



def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in (["-h"], ["--help"]):
        print(f"usage: kernel_bench.py {{{','.join(COMMANDS)}}} [options]\n\n" + (__doc__ or ""))
        return
    if not argv or argv[0] not in COMMANDS:
        raise SystemExit(f"usage: kernel_bench.py {{{','.join(COMMANDS)}}} [options]  (got {argv[:1]})\n\n"
                         + (__doc__ or ""))
    COMMANDS[argv[0]](argv[1:])


if __name__ == "__main__":
    main()
