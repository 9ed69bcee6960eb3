"""Where a step's time goes: the reference workload with per-GPU step timings and kernel tables of chosen steps.

    python benchmarks/profile_step.py --model benchmarks/models/qwen3-0.6b --load-format dummy
    python benchmarks/profile_step.py --model benchmarks/models/qwen3-8b --load-format dummy --decode-at 600 \\
        --tensor-parallel-size 2                  # any other flag goes to bench_offline.py (engine flags too)

Runs bench_offline.py with --gpu-idle (each GPU's device time inside each kind of step and its idle time
before it) and the runner's step profiler (NANOVLLM_PROFILE_STEPS) over --decode-steps decode steps from decode
step --decode-at and one prefill (or mixed) step --prefill-at, then prints rank 0's kernel table of each (top
--rows kernels by device time). Steps are counted from the runner's start, warm-up included. Every rank writes
its own table and a Chrome trace into --out. The profiled steps slow the run: its tok/s is not a result.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_offline import main as bench_main  # noqa: E402

from nanovllm.engine.step_timer import PROFILE_ENV  # noqa: E402


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                 allow_abbrev=False)  # (the rest goes to bench_offline: no prefix matching)
    ap.add_argument("--decode-at", type=int, default=100, help="first profiled decode step")
    ap.add_argument("--decode-steps", type=int, default=3)
    ap.add_argument("--prefill-at", type=int, default=2, help="the profiled prefill/mixed step")
    ap.add_argument("--rows", type=int, default=25, help="kernels printed per table")
    ap.add_argument("--out", default=None, help="directory for the tables and traces (default: a new temp dir)")
    ns, bench_args = ap.parse_known_args(argv)
    out = ns.out or tempfile.mkdtemp(prefix="nanovllm-profile-")
    os.makedirs(out, exist_ok=True)
    specs = {"decode": f"{out}/decode:{ns.decode_at}:{ns.decode_steps}:decode",
             "prefill": f"{out}/prefill:{ns.prefill_at}:1:prefill"}
    os.environ[PROFILE_ENV] = ",".join(specs.values())
    try:
        bench_main([*bench_args, "--gpu-idle", "--label", "profiled"])
    finally:
        del os.environ[PROFILE_ENV]
    for kind in specs:
        path = f"{out}/{kind}.rank0.txt"
        if not os.path.exists(path):
            print(f"\n{kind}: no table (no CUDA, or the run had fewer such steps)")
            continue
        with open(path) as f:
            lines = f.read().splitlines()
        print(f"\n{kind} ({path}):")
        print("\n".join(lines[:ns.rows + 4]))  # our header, the table's header (3 lines), the top rows
    print(f"\ntables and Chrome traces of every rank: {out}")


if __name__ == "__main__":
    main()
