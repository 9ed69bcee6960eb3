"""Kernel micro-benchmarks on one CUDA GPU, one subcommand per kernel family:

    python3 benchmarks/kernel_bench.py attention            # the varlen prefill kernel beside torch SDPA (and FA3)
    python3 benchmarks/kernel_bench.py attention --sweep    # + every candidate tile config, the best per shape

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
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

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
                 device: str = "cuda", dtype: torch.dtype = torch.bfloat16):
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
        nblk = [-(-n // BLOCK) for n in lens]
        perm = torch.randperm(sum(nblk) + 1, device=dev, generator=g)
        self.k_cache = torch.zeros(sum(nblk) + 1, BLOCK, Hkv, D, device=dev, dtype=dt)
        self.v_cache = torch.zeros_like(self.k_cache)
        self.bt = torch.full((B, max(nblk)), -1, dtype=torch.int32, device=dev)
        i = 0
        for b, n in enumerate(lens):
            blocks = perm[i:i + nblk[b]]
            i += nblk[b]
            self.bt[b, :nblk[b]] = blocks.int()
            slots = (blocks[:, None] * BLOCK + torch.arange(BLOCK, device=dev)).flatten()[:n]
            self.k_cache.view(-1, Hkv, D)[slots] = self.k[b, :n]
            self.v_cache.view(-1, Hkv, D)[slots] = self.v[b, :n]
        self.q_flat = torch.cat([self.q[b, c:c + q] for b, (q, c) in enumerate(seqs)])
        self.cu = torch.tensor([0, *torch.tensor([q for q, _ in seqs]).cumsum(0).tolist()], dtype=torch.int32,
                               device=dev)
        self.seq_lens = torch.tensor(lens, dtype=torch.int32, device=dev)
        self.out = torch.empty_like(self.q_flat)
        self.scale = D ** -0.5

    def ours(self, config=None):
        from nanovllm.kernels.prefill_attention import paged_prefill_attention
        return lambda: paged_prefill_attention(self.q_flat, self.k_cache, self.v_cache, self.cu, self.seq_lens,
                                               self.bt, self.scale, self.max_q, out=self.out, config=config)

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


def _cases(sweep: bool) -> list[AttentionCase]:
    shapes = [("1,024", [(1024, 0)]), ("4,096", [(4096, 0)]), ("8,192", [(8192, 0)]), ("16,384", [(16384, 0)]),
              ("8 x 8,192", [(8192, 0)] * 8), ("chunk+prompt", [(2048, 6144), (6144, 0)])]
    heads = [(32, 8, 128), (16, 8, 128)]
    cases = [AttentionCase(label, seqs, H, Hkv, D) for H, Hkv, D in heads for label, seqs in shapes]
    if sweep:
        cases += [AttentionCase(label, seqs, 32, 8, 64) for label, seqs in shapes[:1] + shapes[2:3]]
    return cases


def _tflops(case: AttentionCase, ms: float) -> float:
    return case.flops / (ms * 1e-3) / 1e12


def attention(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(prog="kernel_bench.py attention", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sweep", action="store_true", help="time every candidate config of prefill_config.SWEEP")
    ap.add_argument("--configs", default="", help="with --sweep: comma-separated config names to keep (default all)")
    ns = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("kernel_bench.py attention needs a CUDA GPU")
    from nanovllm.kernels.prefill_config import SWEEP, tile_config
    t_start = time.perf_counter()
    fa3 = _fa3()
    cases = _cases(ns.sweep)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, FlashAttention-3: "
          f"{'yes' if fa3 else 'not importable'}; TFLOP/s, causal, bf16")
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


COMMANDS = {"attention": attention}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in COMMANDS:
        raise SystemExit(f"usage: kernel_bench.py {{{','.join(COMMANDS)}}} [options]  (got {argv[:1]})\n\n"
                         + (__doc__ or ""))
    COMMANDS[argv[0]](argv[1:])


if __name__ == "__main__":
    main()
