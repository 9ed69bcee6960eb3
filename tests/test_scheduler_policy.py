"""The scheduling policies on a simulated run (no model): every step's sampled tokens are resolved at once and
each request stops at its max_tokens, as with ignore_eos."""
from __future__ import annotations

import random

import pytest

from nanovllm.engine.batch import build_step_batch
from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.scheduler import Scheduler, is_decode_row
from nanovllm.engine.sequence import Sequence
from nanovllm.sampling_params import SamplingParams

SIZES = [128, 256, 384, 512]


def workload(n=48, seed=0):
    rng = random.Random(seed)
    prompts = [[rng.randrange(1000) for _ in range(rng.randint(20, 300))] for _ in range(n)]
    return prompts, [rng.randint(10, 200) for _ in range(n)]


def simulate(policy, prompts, max_tokens, budget=2048, step_sizes=SIZES, stop_ids=frozenset(), blocks=4096,
             finished=None, decode_rows=None):
    """Run the scheduler to the end; return each step's (sequences, tokens) and the admission order. The sampled
    token is never one of `stop_ids` (which only make the lengths unknown to the scheduler). `finished`: filled
    with each request's last step. `decode_rows`: filled with each step's decode-row flags, in step order, and its
    `num_decode`."""
    sched = Scheduler(BlockManager(blocks, 16, True), 256, budget, policy, step_sizes=step_sizes)
    for i, (p, m) in enumerate(zip(prompts, max_tokens)):
        sched.add(Sequence(i, str(i), p, SamplingParams(max_tokens=m, ignore_eos=True), m, stop_ids, 0))
    steps, admitted = [], []
    while sched.has_unfinished():
        out = sched.schedule()
        assert out, "no progress"
        admitted += [s.seq_id for s, n in zip(out.seqs, out.num_new_tokens)
                     if s.num_computed_tokens == 0 and s.seq_id not in admitted]
        steps.append(list(zip(out.seqs, out.num_new_tokens)))
        if decode_rows is not None:
            decode_rows.append(([is_decode_row(s, n) for s, n in zip(out.seqs, out.num_new_tokens)], out.num_decode))
        for seq, _ in sched.on_step_done(out):
            seq.token_ids[-1] = 7
            if seq.num_output_tokens >= seq.max_tokens:
                sched.finish(seq, "length")
                if finished is not None:
                    finished[seq.seq_id] = len(steps) - 1
    return steps, admitted


def test_balanced_admits_longest_first_and_finishes_in_the_fewest_steps():
    prompts, max_tokens = workload()
    steps, admitted = simulate("balanced", prompts, max_tokens)
    assert [max_tokens[i] for i in admitted] == sorted(max_tokens, reverse=True)
    # no request was held back long enough to lengthen the run: it is exactly as long as the longest request
    assert len(steps) == max(max_tokens)
    fcfs_steps, fcfs_admitted = simulate("fcfs", prompts, max_tokens)
    assert fcfs_admitted == list(range(len(prompts)))
    assert len(fcfs_steps) > len(steps)


def test_balanced_spreads_prefill_and_fills_step_sizes():
    prompts, max_tokens = workload()
    sizes = [32, 64, 96, 128]  # this workload's average step is ~65 tokens
    steps, _ = simulate("balanced", prompts, max_tokens, step_sizes=sizes)
    fcfs_steps, _ = simulate("fcfs", prompts, max_tokens, step_sizes=sizes)
    with_prefill = lambda run: sum(any(n > 1 for _, n in st) for st in run)  # noqa: E731
    # fcfs prefills everything in the first few steps; balanced in most steps
    assert with_prefill(fcfs_steps) <= 8
    assert with_prefill(steps) > len(steps) // 2
    # a step that prefills holds a step size of tokens, unless a request had to start at once with its whole
    # prompt (its max_tokens as long as the run's remaining steps) or nothing was left to prefill
    tokens = [sum(n for _, n in st) for st in steps[1:]]
    prefilling = [t for t, st in zip(tokens, steps[1:]) if any(n > 1 for _, n in st)]
    assert sum(t in sizes for t in prefilling) >= 0.8 * len(prefilling)


def test_balanced_holds_last_prompt_tokens_so_requests_finish_together():
    """Prompts are computed ahead, but each request's last prompt token (which samples its first token) waits
    until the request must start: every request then finishes in the run's last step, so the tail is as full as
    the rest. When the KV cache could not hold every request at full length there is no hold: requests start
    when their prompt is done and finish at different steps."""
    prompts, max_tokens = workload()
    tokens = lambda run: [sum(n for _, n in st) for st in run]  # noqa: E731
    done, done_tight = {}, {}
    steps, _ = simulate("balanced", prompts, max_tokens, finished=done)
    assert len(steps) == max(max_tokens)
    last = len(steps) - 1
    assert set(done.values()) == {last}
    # the last 20 steps decode every request
    assert tokens(steps)[-20:] == [len(prompts)] * 20
    # not enough KV cache for every request at its full length: no hold, many finish early
    tight, _ = simulate("balanced", prompts, max_tokens, blocks=600, finished=done_tight)
    assert sum(d < len(tight) - 20 for d in done_tight.values()) > len(prompts) // 2


def test_balanced_holds_back_only_requests_of_known_length():
    """A request that may stop early (EOS or stop ids here) is scheduled exactly as under fcfs."""
    prompts, max_tokens = workload()
    steps, admitted = simulate("balanced", prompts, max_tokens, stop_ids=frozenset({999}))
    fcfs_steps, fcfs_admitted = simulate("fcfs", prompts, max_tokens, stop_ids=frozenset({999}))
    assert admitted == fcfs_admitted == list(range(len(prompts)))
    as_ids = lambda run: [[(s.seq_id, n) for s, n in st] for st in run]  # noqa: E731
    assert as_ids(steps) == as_ids(fcfs_steps)


def test_decode_rows_come_first():
    prompts, max_tokens = workload(24, seed=3)
    for policy in ("fcfs", "balanced"):
        flags = []
        simulate(policy, prompts, max_tokens, budget=256, decode_rows=flags)
        mixed = 0
        for rows, num_decode in flags:
            assert rows == sorted(rows, reverse=True)  # every decode row before every other sequence
            assert num_decode == sum(rows)
            mixed += any(rows) and not all(rows)
        assert mixed > 0


def test_step_batch_counts_leading_decode_rows():
    bm = BlockManager(64, 16, True)
    sched = Scheduler(bm, 8, 64)
    a = Sequence(0, "a", list(range(10)), SamplingParams(max_tokens=5), 5, frozenset(), 0)
    sched.add(a)
    out = sched.schedule()
    sched.on_step_done(out)
    a.token_ids[-1] = 3
    sched.add(Sequence(1, "b", list(range(40)), SamplingParams(max_tokens=5), 5, frozenset(), 0))
    out = sched.schedule()
    assert out.num_new_tokens == [1, 40]
    batch = build_step_batch(out, 16)
    assert batch.num_decode == 1 and not batch.is_decode


def test_bad_policy():
    with pytest.raises(ValueError, match="'lifo'"):
        Scheduler(BlockManager(8, 16, True), 4, 64, "lifo")


def test_auto_policy():
    import os

    import torch

    from nanovllm.config import ModelConfig, auto_scheduling_policy
    models = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "models")
    big = ModelConfig.from_dir(os.path.join(models, "qwen3-8b"))
    small = ModelConfig.from_dir(os.path.join(models, "qwen3-0.6b"))
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert auto_scheduling_policy(big, torch.bfloat16, 1, cuda) == "balanced"   # 16.4 GB per GPU
    assert auto_scheduling_policy(big, torch.bfloat16, 2, cuda) == "fcfs"       # 8.2 GB per GPU
    from nanovllm.layers.quantization import resolve_quantization
    fp8 = resolve_quantization("fp8", None)
    assert auto_scheduling_policy(big, torch.bfloat16, 1, cuda, fp8) == "balanced"  # 8.2 GB on one GPU
    assert auto_scheduling_policy(small, torch.bfloat16, 1, cuda) == "fcfs"
    assert auto_scheduling_policy(big, torch.bfloat16, 1, cpu) == "fcfs"


def test_engine_policy_args(tiny_ckpt):
    from nanovllm import LLM
    from nanovllm.cli import build_parser
    from nanovllm.server.cli import server_engine_args
    path = tiny_ckpt("qwen3")
    with pytest.raises(ValueError, match="scheduling_policy.*'lifo'"):
        LLM(path, device="cpu", scheduling_policy="lifo")
    assert LLM(path, device="cpu").engine.scheduler.policy == "fcfs"  # auto: fcfs off CUDA
    assert LLM(path, device="cpu", scheduling_policy="balanced").engine.scheduler.policy == "balanced"
    # the server schedules fcfs unless told otherwise
    pytest.importorskip("fastapi")
    parser = build_parser()
    assert server_engine_args(parser.parse_args(["serve", path])).scheduling_policy == "fcfs"
    ns = parser.parse_args(["serve", path, "--scheduling-policy", "balanced"])
    assert server_engine_args(ns).scheduling_policy == "balanced"


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_balanced_hold_in_the_engine_gives_fcfs_tokens(tiny_ckpt, monkeypatch, async_scheduling):
    """End to end on a tiny model (float32, CPU): the balanced policy with its last-token hold computes prompts
    ahead and starts requests late, and every request's greedy tokens are those of fcfs (whose tokens the
    parity tests check against transformers)."""
    from nanovllm import LLM
    path = tiny_ckpt("qwen3")
    prompts = [[(7 * i + j) % 200 + 3 for j in range(n)] for i, n in enumerate([5, 40, 17, 90, 33, 61])]
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (3, 24, 9, 30, 14, 6)]
    ref = LLM(path, device="cpu", dtype="float32", scheduling_policy="fcfs").generate(prompts, params,
                                                                                     use_tqdm=False)
    llm = LLM(path, device="cpu", dtype="float32", scheduling_policy="balanced", max_num_batched_tokens=64,
              async_scheduling=async_scheduling)
    sched = llm.engine.scheduler
    held = []  # per step: sequences whose last prompt token waited (running, one prompt token left, unscheduled)
    schedule = sched.schedule

    def spy():
        out = schedule()
        scheduled = {id(s) for s in out.seqs}
        held.append(sum(1 for s in sched.running if id(s) not in scheduled and not s.num_output_tokens
                        and s.num_tokens - s.num_computed_tokens == 1))
        return out
    monkeypatch.setattr(sched, "schedule", spy)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o["token_ids"] for o in outs] == [o["token_ids"] for o in ref]
    assert [len(o["token_ids"]) for o in outs] == [3, 24, 9, 30, 14, 6]
    # requests waited with only their last prompt token left (13 request-steps, up to 2 at once, here)
    assert max(held) >= 2 and sum(held) >= 10
