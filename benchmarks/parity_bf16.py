"""bf16 on the GPU: do the Triton kernels + CUDA graphs give the same greedy tokens as the torch backend?

    python benchmarks/parity_bf16.py

Builds a small random checkpoint (head_dim 128, GQA 4:1), generates greedy continuations with the torch
backend (eager, plain-torch paged attention), then asks each engine for the next token at every position
of those continuations (teacher forcing: the same context for both) and reports how often they agree.
Free-running agreement (positions before the first divergence) is printed too; in bf16 one near-tie
flips everything after it, so it understates agreement.
"""
from __future__ import annotations

import os
import random
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from nanovllm import LLM, SamplingParams  # noqa: E402
from nanovllm.utils.tiny_model import build_tiny_checkpoint  # noqa: E402

N_PROMPTS, N_NEW = 64, 32


def main():
    import argparse
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--num-prompts", type=int, default=N_PROMPTS)
    ns = ap.parse_args()
    print(f"dtype={ns.dtype}, {ns.num_prompts} prompts x {N_NEW} tokens")
    path = build_tiny_checkpoint(os.path.join(tempfile.mkdtemp(), "m"), "qwen3", hidden_size=512, num_layers=4,
                                 num_heads=8, num_kv_heads=2, head_dim=128, intermediate_size=1024)
    rng = random.Random(0)
    prompts = [[rng.randrange(480) for _ in range(rng.randint(1, 600))] for _ in range(ns.num_prompts)]
    greedy = SamplingParams(temperature=0.0, max_tokens=N_NEW)
    one = SamplingParams(temperature=0.0, max_tokens=1, logprobs=2)
    engines = {"torch-eager": dict(attention_backend="torch", enforce_eager=True), "triton-graphs": dict()}
    free, forced, gaps = {}, {}, {}
    ref = None
    for name, kw in engines.items():
        llm = LLM(path, dtype=ns.dtype, kvcache_block_size=16, max_num_seqs=128, **kw)
        free[name] = [o["token_ids"] for o in llm.generate(prompts, greedy, use_tqdm=False)]
        if ref is None:
            ref = free[name]
        contexts = [p + r[:k] for p, r in zip(prompts, ref) for k in range(len(r))]
        outs = llm.generate(contexts, one, use_tqdm=False)
        forced[name] = [o["token_ids"][0] for o in outs]
        gaps[name] = [o["logprobs"][0]["top"][0][1] - o["logprobs"][0]["top"][1][1] for o in outs]
        llm.shutdown()
        del llm
    want = [t for r in ref for t in r]
    for name in engines:
        agree = sum(a == b for a, b in zip(forced[name], want))
        print(f"{name:14s} teacher-forced next token == torch-eager continuation: {agree}/{len(want)} "
              f"({100 * agree / len(want):.2f}%)")
    a, b, gap = forced["torch-eager"], forced["triton-graphs"], gaps["torch-eager"]
    agree = sum(x == y for x, y in zip(a, b))
    print(f"teacher-forced, triton-graphs vs torch-eager: {agree}/{len(a)} positions agree ({100 * agree / len(a):.2f}%)")
    for thr in (0.01, 0.05, 0.1):
        clear = [(x, y) for x, y, g in zip(a, b, gap) if g > thr]
        ok = sum(x == y for x, y in clear)
        print(f"  where torch's top-2 logprob gap > {thr}: {ok}/{len(clear)} ({100 * ok / max(len(clear), 1):.2f}%)")
    near = sorted(g for x, y, g in zip(a, b, gap) if x != y)
    q = [near[int(f * (len(near) - 1))] for f in (0.5, 0.9, 1.0)] if near else []
    print(f"  top-2 gap (torch) at the {len(near)} disagreements: median/p90/max {[round(g, 4) for g in q]}; "
          f"exact ties: {sum(g == 0 for g in near)}")
    a, b = free["torch-eager"], free["triton-graphs"]
    prefix = sum(next((i for i, (s, t) in enumerate(zip(x, y)) if s != t), len(x)) for x, y in zip(a, b))
    print(f"free-running: {prefix}/{len(want)} positions agree before the first divergence, "
          f"{sum(x == y for x, y in zip(a, b))}/{len(a)} sequences identical")


if __name__ == "__main__":
    main()
