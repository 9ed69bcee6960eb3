"""Where does a step's time go? Host-side breakdown of engine.step() plus a kernel table.

    python benchmarks/profile_step.py --model benchmarks/models/qwen3-0.6b --load-format dummy

Runs the reference workload's first --num-seqs requests (outputs capped at --max-output-len) and reports
mean milliseconds per step in: schedule, batch build, launch (host work to enqueue the step; with
async scheduling off this includes waiting for the GPU), resolve (waiting for the sampled ids of a step
and processing them) and the whole step. Then profiles a few decode steps with torch.profiler and
prints the top kernels by GPU time.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from workload import offline_workload  # noqa: E402

from nanovllm import LLM, SamplingParams  # noqa: E402
from nanovllm.cli import add_engine_args, engine_kwargs  # noqa: E402
from nanovllm.engine import llm_engine as le  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--max-output-len", type=int, default=300)
    ap.add_argument("--trace", default=None, help="write a chrome trace here")
    add_engine_args(ap)
    ns = ap.parse_args()
    llm = LLM(ns.model, **{"max_model_len": 4096, **engine_kwargs(ns)})
    eng = llm.engine
    prompts, max_tokens = offline_workload(ns.num_seqs, 1024, ns.max_output_len)
    for i, (p, m) in enumerate(zip(prompts, max_tokens)):
        eng.add_request(f"r{i}", p, SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=m))

    cur = defaultdict(float)

    def timed(name, fn):
        def wrapper(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                cur[name] += (time.perf_counter() - t) * 1e3
        return wrapper

    eng.scheduler.schedule = timed("schedule", eng.scheduler.schedule)
    le.build_step_batch = timed("build", le.build_step_batch)
    for name in ("launch", "execute"):
        if hasattr(eng.runner, name):
            setattr(eng.runner, name, timed("launch", getattr(eng.runner, name)))
    eng._resolve = timed("resolve", eng._resolve)
    last_kind = {"k": "start"}
    real_build = le.build_step_batch

    def kind_build(out, bs):
        b = real_build(out, bs)
        last_kind["k"] = f"decode B>={len(b.seq_lens) // 32 * 32:3d}" if b.is_decode else "mixed/prefill"
        return b

    le.build_step_batch = kind_build
    acc = defaultdict(lambda: defaultdict(float))
    counts = defaultdict(int)
    n_steps = 0
    while eng.has_unfinished_requests():
        cur.clear()
        t = time.perf_counter()
        eng.step()
        cur["step"] = (time.perf_counter() - t) * 1e3
        key = last_kind["k"]
        for k, v in cur.items():
            acc[key][k] += v
        counts[key] += 1
        n_steps += 1
        if n_steps == 60 and torch.cuda.is_available():
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                    torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    eng.step()
                torch.cuda.synchronize()
            print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=25))
            if ns.trace:
                prof.export_chrome_trace(ns.trace)
    print(f"async_scheduling={eng.async_scheduling}")
    cols = ("schedule", "build", "launch", "resolve", "step")
    print(f"{'step kind':20s} {'n':>5s} " + " ".join(f"{c:>9s}" for c in cols) + "  (ms/step)")
    for key in sorted(acc):
        n = counts[key]
        print(f"{key:20s} {n:5d} " + " ".join(f"{acc[key][c] / n:9.3f}" for c in cols))


if __name__ == "__main__":
    main()
