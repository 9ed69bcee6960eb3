"""Where a profiled step's device time goes between kernels (reads the trace of NANOVLLM_PROFILE_STEPS).

    python benchmarks/kernel_gaps.py PREFIX.rank0.trace.json [--steps N]

Kernels on the GPU in launch order. A step's span is from its first kernel's start to its last kernel's end;
"busy" is the summed kernel time, the rest is gaps: the GPU between one kernel's end and the next one's
start (launch latency inside a CUDA graph, the drain/fill of a grid). Prints busy/gap per step (steps are
split where the GPU idled > 200 us) and the largest gap totals by (previous kernel -> next kernel).
"""
from __future__ import annotations

import argparse
import json
from collections import defaultdict


def short(name: str) -> str:
    name = name.split("(")[0].split("<")[0]
    return name[:40]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("--split-us", type=float, default=200.0)
    args = ap.parse_args()
    with open(args.trace) as f:
        events = json.load(f)["traceEvents"]
    kernels = sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    steps, cur = [], []
    for k in kernels:
        if cur and k["ts"] - (cur[-1]["ts"] + cur[-1]["dur"]) > args.split_us:
            steps.append(cur)
            cur = []
        cur.append(k)
    if cur:
        steps.append(cur)
    pairs: dict[tuple[str, str], list[float]] = defaultdict(list)
    for i, st in enumerate(steps):
        span = st[-1]["ts"] + st[-1]["dur"] - st[0]["ts"]
        busy = sum(k["dur"] for k in st)
        for a, b in zip(st, st[1:]):
            pairs[(short(a["name"]), short(b["name"]))].append(b["ts"] - (a["ts"] + a["dur"]))
        print(f"step {i}: {len(st)} kernels, span {span / 1e3:.3f} ms, busy {busy / 1e3:.3f} ms, "
              f"gaps {(span - busy) / 1e3:.3f} ms ({100 * (span - busy) / span:.1f}%)")
    print("gap totals by kernel pair (us, all steps): total  count  mean")
    for (a, b), g in sorted(pairs.items(), key=lambda kv: -sum(kv[1]))[:15]:
        print(f"  {sum(g):8.1f} {len(g):5d} {sum(g) / len(g):6.2f}  {a} -> {b}")


if __name__ == "__main__":
    main()
