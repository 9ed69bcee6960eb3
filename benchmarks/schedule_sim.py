"""Run the real scheduler over the reference workload with a per-step cost model instead of a GPU.

    python benchmarks/schedule_sim.py                 # fcfs and balanced, Qwen3-8B TP=1 on an H200
    python benchmarks/schedule_sim.py --step 32 64 128

No model runs: each step's sampled tokens are resolved at once and a request stops at its max_tokens (the
workload's ignore_eos). A step costs (milliseconds, Qwen3-8B on one H200, from benchmarks/RESULTS.md runs 16-17):
  * the weight GEMMs at its row count (a mixed step's padded to its graph size): run 16's measured per-step GEMM time up
    to 256 rows, then 21.3 us per row (run 17 call 6); an eager step over 512 rows at 190 ms per 8,192 tokens;
  * the LM head (sampled rows, >= the 0.29 ms weight read), ~1 ms of norms, activations and sampling;
  * decode attention: every one-token row's context at 147,456 bytes per token and 3.9 TB/s;
  * 0.8 ms for the varlen kernel in a step with chunks (what the decode kernel does not hide, run 17).
It is a model: it puts the fcfs run at 13.8 s (measured 13.7) and balanced at 13.0 (measured 13.1-13.3, run 17).
"balanced + hold" holds each request's last prompt token until it must start (the default). Use it to compare
admission rules before spending GPU time, not as a measurement.
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from workload import offline_workload  # noqa: E402  (benchmarks/)

from nanovllm.engine.block_manager import BlockManager  # noqa: E402
from nanovllm.engine.scheduler import Scheduler  # noqa: E402
from nanovllm.engine.sequence import Sequence  # noqa: E402
from nanovllm.sampling_params import SamplingParams  # noqa: E402

KV_BYTES_PER_TOKEN = 2 * 36 * 8 * 128 * 2   # Qwen3-8B: K and V, 36 layers, 8 KV heads, head_dim 128, bf16
GEMM_ROWS = [0, 8, 96, 192, 256]
GEMM_MS = [3.60, 3.64, 3.91, 4.91, 5.66]    # run 16's sweep (best library per shape) and run 17's profile


def gemm_ms(rows: int) -> float:
    if rows <= 256:
        return float(np.interp(rows, GEMM_ROWS, GEMM_MS))
    return GEMM_MS[-1] + (rows - 256) * 0.0213


def step_ms(rows: int, sampled: int, decode_ctx: int, has_chunks: bool, sizes: list[int]) -> float:
    if rows > max(sizes, default=0):  # an eager step of a big prefill chunk
        return 190.0 * rows / 8192 + decode_ctx * KV_BYTES_PER_TOKEN / 3.9e9
    if has_chunks:  # a mixed graph's rows (pure decode steps replay graphs of every 16 rows: ~no padding)
        rows = min((s for s in sizes if s >= rows), default=rows)
    return (gemm_ms(rows) + max(0.29, sampled * 0.0017) + 1.0 + decode_ctx * KV_BYTES_PER_TOKEN / 3.9e9
            + (0.8 if has_chunks else 0.0))


def simulate(policy: str, sizes: list[int], budget: int = 8192, kv_blocks: int = 3071,
             hold: bool = True) -> tuple[float, int, list]:
    prompts, max_tokens = offline_workload()
    sched = Scheduler(BlockManager(kv_blocks, 256, True), 256, budget, policy, step_sizes=sizes,
                      hold_last_tokens=hold)
    for i, (p, m) in enumerate(zip(prompts, max_tokens)):
        sched.add(Sequence(i, str(i), p, SamplingParams(max_tokens=m, ignore_eos=True), m, frozenset(), 0))
    total, rows = 0.0, []
    while sched.has_unfinished():
        out = sched.schedule()
        ctx = sum(s.num_computed_tokens + 1 for s, n in zip(out.seqs, out.num_new_tokens) if n == 1)
        chunks = any(n > 1 for n in out.num_new_tokens)
        sampled = sched.on_step_done(out)
        for seq, _ in sampled:
            seq.token_ids[-1] = 1
            if seq.num_output_tokens >= seq.max_tokens:
                sched.finish(seq, "length")
        total += step_ms(out.num_tokens, len(sampled), ctx, chunks, sizes)
        rows.append(out.num_tokens)
    return total / 1000, len(rows), rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--step", type=int, nargs="+", default=[128], help="mixed-graph size steps to try")
    ns = ap.parse_args()
    out_tokens = sum(offline_workload()[1])
    for policy, hold in (("fcfs", False), ("balanced", False), ("balanced", True)):
        for step in ns.step:
            sizes = list(range(step, 513, step))
            s, n, rows = simulate(policy, sizes, hold=hold)
            per100 = [round(sum(rows[i:i + 100]) / len(rows[i:i + 100])) for i in range(0, n, 100)]
            name = policy + (" + hold" if hold else "")
            print(f"{name:16s} graphs every {step:3d} rows: {s:6.2f} s, {out_tokens / s:7.0f} tok/s, {n} steps; "
                  f"tokens per step by 100 steps {per100}")


if __name__ == "__main__":
    main()
