"""The engine's host work per step, without a model (runs anywhere, no GPU needed)

    python benchmarks/host_overhead.py [--steps-prefill 18] [--steps-decode 200]

The reference workload through the real engine (scheduler, step batches, packing of the step's inputs,
result handling) on the built-in tiny model, with the runner's launch replaced by one that packs the step's
inputs as the real one does and returns random tokens at once. Prints milliseconds per step for the fcfs
prefill phase (8,192-token chunks) and for decode steps, split by phase. What is left of a real step's host
time beyond this is the model's launch (eager steps) or a graph replay.
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_offline import timed  # noqa: E402
from workload import offline_workload  # noqa: E402

import nanovllm.engine.llm_engine as llm_engine  # noqa: E402
from nanovllm import LLM, SamplingParams  # noqa: E402
from nanovllm.engine.model_runner import StepResult  # noqa: E402
from nanovllm.engine.step_inputs import Layout  # noqa: E402
from nanovllm.utils.tiny_model import ensure_default_tiny_model  # noqa: E402


class _Done:
    def __init__(self, n: int, vocab: int):
        self.n, self.vocab = n, vocab

    def result(self) -> StepResult:
        return StepResult(token_ids=[random.randrange(self.vocab) for _ in range(self.n)])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps-prefill", type=int, default=18)
    ap.add_argument("--steps-decode", type=int, default=200)
    ns = ap.parse_args()
    llm = LLM(ensure_default_tiny_model(), device="cpu", dtype="float32", max_num_batched_tokens=8192,
              kvcache_block_size=256, max_model_len=4096, num_kvcache_blocks=4500, enforce_eager=True)
    eng, runner = llm.engine, llm.engine.runner
    eng.async_scheduling = True  # as on a GPU
    vocab = 500
    spent = {}  # phase -> milliseconds

    def launch(batch, prev=None):
        width = max((len(t) for t in batch.block_tables), default=1)
        runner.staging.upload(batch, Layout.make(batch.num_tokens, batch.num_seqs, width, len(batch.sample_rows),
                                                 len(batch.sampling.banned)))
        return _Done(len(batch.sample_rows), vocab)

    runner.launch = timed(spent, "pack", launch)
    eng.scheduler.schedule = timed(spent, "schedule", eng.scheduler.schedule)
    eng.scheduler.on_step_done = timed(spent, "on_step_done", eng.scheduler.on_step_done)
    eng._resolve = timed(spent, "resolve", eng._resolve)
    build = llm_engine.build_step_batch
    llm_engine.build_step_batch = timed(spent, "build_step_batch", build)
    try:
        prompts, max_tokens = offline_workload()
        for i, (p, m) in enumerate(zip(prompts, max_tokens)):
            eng.add_request(str(i), [t % vocab for t in p], SamplingParams(temperature=0.6, ignore_eos=True,
                                                                           max_tokens=m))
        for name, n in (("prefill (8,192-token steps)", ns.steps_prefill), ("decode (256 rows)", ns.steps_decode)):
            spent.clear()
            t0 = time.perf_counter()
            for _ in range(n):
                eng.step()
            total = (time.perf_counter() - t0) / n * 1e3
            parts = ", ".join(f"{k} {v / n:.2f}" for k, v in spent.items())
            print(f"{name}: {total:.2f} ms per step on the host ({parts})")
    finally:
        llm_engine.build_step_batch = build
        llm.shutdown()


if __name__ == "__main__":
    main()
