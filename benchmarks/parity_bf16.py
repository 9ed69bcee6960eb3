"""bf16 on the GPU: do the Triton kernels + CUDA graphs give the same greedy tokens as the torch backend?

    python benchmarks/parity_bf16.py                      # random checkpoint, random prompts
    python benchmarks/parity_bf16.py --model trained      # copy-task checkpoint (benchmarks/train_tiny.py)
    python benchmarks/parity_bf16.py --model trained --small --dtype float32 --num-prompts 4   # CPU smoke test

Builds a small checkpoint (head_dim 128, GQA 4:1), generates greedy continuations with the torch
backend (eager, plain-torch paged attention), then asks each engine for the next token at every position
of those continuations (teacher forcing: the same context for both) and reports how often they agree.
Free-running agreement (positions before the first divergence) is printed too; in bf16 one near-tie
flips everything after it, so it understates agreement.

--model random (default): random weights and random prompts; the logits are near-ties almost everywhere
(top-2 gaps of a few bf16 ulps), so a few percent of positions disagree between two correct engines.
--model trained: the same architecture trained for --train-steps steps on a periodic-copy task (on the GPU
when there is one, else the CPU) and prompts of that task (copy_prompts), where every next token is
predicted by a clear margin, as in a real model. --small uses a smaller architecture (CPU runs).
"""
from __future__ import annotations

import os
import random
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from train_tiny import ARCH, SMALL_ARCH, STEPS, copy_prompts, train_copy_checkpoint  # noqa: E402  (benchmarks/)

from nanovllm import LLM, SamplingParams  # noqa: E402
from nanovllm.utils.tiny_model import build_tiny_checkpoint  # noqa: E402

N_PROMPTS, N_NEW = 64, 32


def main():
    import argparse
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--num-prompts", type=int, default=N_PROMPTS)
    ap.add_argument("--model", choices=("random", "trained"), default="random",
                    help="random weights + random prompts, or a copy-task-trained checkpoint + copy prompts")
    ap.add_argument("--train-steps", type=int, default=STEPS, help="training steps for --model trained")
    ap.add_argument("--small", action="store_true", help=f"smaller architecture (CPU runs): {SMALL_ARCH}")
    ns = ap.parse_args()
    arch = SMALL_ARCH if ns.small else ARCH
    detail = f" ({ns.train_steps} copy-task training steps)" if ns.model == "trained" else ""
    print(f"model={ns.model}{detail}, arch={arch}, dtype={ns.dtype}, {ns.num_prompts} prompts x {N_NEW} tokens")
    path = os.path.join(tempfile.mkdtemp(), "m")
    if ns.model == "trained":
        import torch
        device = "cuda" if torch.cuda.is_available() else "cpu"
        # --small: shorter training sequences and prompts, so that a CPU run takes minutes
        train_kw, max_len = (dict(batch_size=8, seq_len=256), 200) if ns.small else ({}, 600)
        path = train_copy_checkpoint(path, ns.train_steps, device, **train_kw, **arch)
        prompts = copy_prompts(ns.num_prompts, seed=0, max_len=max_len)
    else:
        path = build_tiny_checkpoint(path, "qwen3", **arch)
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
    print(f"teacher-forced, triton-graphs vs torch-eager: {agree}/{len(a)} positions agree "
          f"({100 * agree / len(a):.2f}%)")
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
