"""On the GPU: does the balanced scheduler (mixed-step CUDA graphs, decode + varlen kernels in one step) give
the tokens of the fcfs scheduler?

    python benchmarks/policy_check.py [--dtype float32]

A small random Qwen3 checkpoint (head_dim 128, GQA 4:1), prompts and output lengths of assorted sizes, greedy.
Engine A: fcfs, eager (no CUDA graphs). Engine B: balanced, CUDA graphs (mixed steps replay the mixed graphs).
Engine C: fcfs, CUDA graphs, with the large prefill steps' graphs (NANOVLLM_PREFILL_GRAPHS=1: steps of up to the
2,048-token budget replay graphs of 1,024 and 2,048 tokens). In float32 B and C must agree with A on (nearly)
every token; the script prints the agreement and how many steps replayed a mixed (or large) graph. A last run
with min_tokens checks that banned tokens reach the sampler from a graph step.
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from nanovllm import LLM, SamplingParams  # noqa: E402
from nanovllm.engine.model_runner import MIXED_MAX_TOKENS  # noqa: E402
from nanovllm.utils.tiny_model import build_tiny_checkpoint  # noqa: E402

ARCH = dict(hidden_size=512, intermediate_size=1024, num_layers=4, num_heads=8, num_kv_heads=2, head_dim=128,
            vocab_size=512)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--num-prompts", type=int, default=96)
    ap.add_argument("--tensor-parallel-size", type=int, default=1)
    ns = ap.parse_args()
    path = build_tiny_checkpoint(os.path.join(tempfile.mkdtemp(), "m"), "qwen3", **ARCH)
    rng = random.Random(0)
    prompts = [[rng.randrange(480) for _ in range(rng.randint(1, 700))] for _ in range(ns.num_prompts)]
    params = [SamplingParams(temperature=0.0, max_tokens=rng.randint(1, 120), ignore_eos=True) for _ in prompts]
    inputs = [{"prompt_token_ids": p} for p in prompts]
    common = dict(dtype=ns.dtype, max_model_len=1024, max_num_batched_tokens=2048, gpu_memory_utilization=0.3,
                  tensor_parallel_size=ns.tensor_parallel_size)
    runs = {}
    for name, kw in (("fcfs eager", dict(scheduling_policy="fcfs", enforce_eager=True)),
                     ("balanced graphs", dict(scheduling_policy="balanced")),
                     ("fcfs graphs", dict(scheduling_policy="fcfs"))):
        os.environ["NANOVLLM_PREFILL_GRAPHS"] = "1" if name == "fcfs graphs" else "0"
        llm = LLM(path, **common, **kw)
        runner = llm.engine.runner
        replays = {"mixed": 0, "large": 0}
        if getattr(runner, "mixed_graphs", None):  # (in this process: not under tensor parallelism)
            for rows, g in runner.mixed_graphs.items():
                orig = g.replay

                def counted(orig=orig, replays=replays, kind="mixed" if rows <= MIXED_MAX_TOKENS else "large"):
                    replays[kind] += 1
                    orig()
                g.replay = counted
        outs = llm.generate(inputs, params, use_tqdm=False)
        runs[name] = [o["token_ids"] for o in outs]
        print(f"{name}: mixed-graph replays {replays['mixed']}, large-step graph replays {replays['large']} (counted "
              f"without tensor parallelism), scheduler step sizes {llm.engine.scheduler.step_sizes}")
        if name == "balanced graphs":
            stop = [SamplingParams(temperature=0.0, max_tokens=40, min_tokens=30, stop_token_ids=[t])
                    for t in range(8)]
            res = llm.generate(inputs[:8], stop, use_tqdm=False)
            lens = [len(o["token_ids"]) for o in res]
            print(f"min_tokens=30 with stop ids: output lengths {lens} (each must be >= 30)")
            assert all(n >= 30 for n in lens), lens
        llm.shutdown()
    os.environ.pop("NANOVLLM_PREFILL_GRAPHS")
    a = runs["fcfs eager"]
    for name in ("balanced graphs", "fcfs graphs"):
        b = runs[name]
        same = sum(x == y for x, y in zip(a, b))
        pos = sum(len(x) for x in a)
        agree = sum(sum(p == q for p, q in zip(x, y)) for x, y in zip(a, b))
        print(f"{name} vs fcfs eager: sequences identical: {same}/{len(a)}; positions identical: {agree}/{pos} "
              f"({100 * agree / pos:.2f}%)")


if __name__ == "__main__":
    main()
