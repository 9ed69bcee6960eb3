"""How much of a power-capped run's energy its GEMMs and KV reads account for, at their standalone energies.

    python benchmarks/energy_model.py --steps steps8.json --energy-log energy.log --measured-j 8540 \
        [--model benchmarks/models/qwen3-8b]

``--steps`` is ``bench_offline.py --step-log``'s per-step list ([ms, sequences, tokens, KV tokens, decode]);
``--energy-log`` is ``energy_bench.py``'s output on the same machine (J per TB of the decode kernel at 256
sequences, J per TFLOP of each projection at 256 rows); ``--measured-j`` the run's energy (``bench_offline``'s
``energy_J``, or average power x time). Prints the run's projection FLOPs (every token row through every layer,
plus the LM head on one row per sequence), its KV bytes and the energy those cost at the measured rates,
against the measured total (RESULTS run 21).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from nanovllm.config import ModelConfig  # noqa: E402


def per_row_flops(cfg: ModelConfig) -> tuple[dict[str, float], float]:
    """FLOPs per token row of each projection over all layers, and of the LM head (together twice
    ``cfg.matmul_params()``)."""
    H, L = cfg.hidden_size, cfg.num_layers
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    proj = {"qkv": 2 * H * (q + 2 * kv) * L, "o": 2 * q * H * L, "gate_up": 2 * H * 2 * cfg.intermediate_size * L,
            "down": 2 * cfg.intermediate_size * H * L}
    return proj, 2 * H * cfg.vocab_size


def read_rates(path: str) -> tuple[float, dict[str, float]]:
    """(J per TB of the decode kernel at 256 sequences, {projection: J per TFLOP at 256 rows})."""
    kv_j, gemm_j = None, {}
    for line in open(path):
        m = re.search(r"([\d.]+) J/T(B|FLOP)", line)
        if not m:
            continue
        if line.startswith("decode attention 256"):
            kv_j = float(m.group(1))
        g = re.match(r"(\w+) GEMM x\d+ layers, 256 rows", line)
        if g:
            gemm_j[g.group(1)] = float(m.group(1))
    if kv_j is None or set(gemm_j) != {"qkv", "o", "gate_up", "down"}:
        raise ValueError(f"{path}: no decode-attention or 256-row GEMM lines from energy_bench.py")
    return kv_j, gemm_j


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", required=True)
    ap.add_argument("--energy-log", required=True)
    ap.add_argument("--measured-j", type=float, required=True)
    ap.add_argument("--model", default="benchmarks/models/qwen3-8b", help="a directory with config.json")
    ns = ap.parse_args()
    cfg = ModelConfig.from_dir(ns.model)
    proj, head = per_row_flops(cfg)
    kv_j, gemm_j = read_rates(ns.energy_log)
    steps = json.load(open(ns.steps))
    rows, sampled = sum(s[2] for s in steps), sum(s[1] for s in steps)
    kv_bytes = sum(s[3] for s in steps) * 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2  # bf16 K and V
    gemm = {n: rows * f / 1e12 * gemm_j[n] for n, f in proj.items()}
    # the LM head at the four projections' mean rate
    mean_j = sum(gemm.values()) / sum(rows * f / 1e12 for f in proj.values())
    head_j = sampled * head / 1e12 * mean_j
    kv = kv_bytes / 1e12 * kv_j
    total = sum(gemm.values()) + head_j + kv
    print(f"{len(steps)} steps, {rows} token rows, {sampled} sampled rows, {kv_bytes / 1e12:.2f} TB of KV read")
    for n, j in gemm.items():
        print(f"  {n:8s} {rows * proj[n] / 1e15:6.3f} PFLOP x {gemm_j[n]:.2f} J/TFLOP = {j / 1e3:6.2f} kJ")
    print(f"  LM head  {sampled * head / 1e15:6.3f} PFLOP x {mean_j:.2f} J/TFLOP = {head_j / 1e3:6.2f} kJ")
    print(f"  KV reads {kv_bytes / 1e12:6.2f} TB    x {kv_j:.0f} J/TB    = {kv / 1e3:6.2f} kJ")
    print(f"model {total / 1e3:.2f} kJ against {ns.measured_j / 1e3:.2f} kJ measured ({total / ns.measured_j:.1%}); "
          f"the rest ({(ns.measured_j - total) / 1e3:.2f} kJ) is the small kernels, the prompt chunks' attention "
          f"and whatever ran below its standalone efficiency")


if __name__ == "__main__":
    main()
