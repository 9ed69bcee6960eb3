"""Offline throughput on the reference workload (256 requests, temperature 0.6, ignore_eos): the number we report.

    python benchmarks/bench_offline.py --model benchmarks/models/qwen3-0.6b --load-format dummy
    python benchmarks/bench_offline.py --model benchmarks/models/qwen3-0.6b --load-format dummy --workload prefill-heavy

--workload prefill-heavy runs 64 prompts of 6,000-8,000 tokens with 64-256 output tokens instead (workload.py;
max_model_len 8,256 unless given) and reports prompt, output and total tok/s.

`--workload copy --batch B` measures speculative decoding where it pays: greedy answers that copy their prompt
(benchmarks/train_tiny.py's copy prompts, on the model that script trains), B requests at a time (max_num_seqs),
max(4 B, 16) requests in all; compare runs with and without `--speculative-config '{"method": "ngram", ...}'`:

    python benchmarks/train_tiny.py /tmp/copy-model
    python benchmarks/bench_offline.py --model /tmp/copy-model --workload copy --batch 1 \
        --speculative-config '{"method": "ngram", "num_speculative_tokens": 6, "prompt_lookup_max": 4}'

Prints output tok/s, total time, achieved memory bandwidth (the weights each step reads + every scheduled
sequence's KV; over the run, and over the pure decode steps), peak GPU memory and the startup breakdown, and on
NVIDIA GPUs the run's energy, average power and median SM clock (an 8B run on one H200 runs at its 700 W cap, so
its speed follows the clock each GPU holds there). --json appends the numbers as one JSON line; --step-log writes
each step's wall time and rows; --gpu-idle reports how long each GPU sat idle between steps. Warm-up (a short
generate) is excluded.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from nvml import PowerMonitor  # noqa: E402
from workload import PREFILL_HEAVY_MAX_MODEL_LEN, offline_workload, prefill_heavy_workload  # noqa: E402

from nanovllm import LLM, SamplingParams  # noqa: E402
from nanovllm.cli import add_engine_args, engine_kwargs  # noqa: E402
from nanovllm.engine import llm_engine as le  # noqa: E402
from nanovllm.engine.step_timer import ENV as STEP_TIMING_ENV  # noqa: E402


def experts_read(m, tokens: int) -> float:
    """Experts one MoE layer reads in a step of `tokens` tokens, expected under uniform routing:
    E (1 - (1 - k/E)^tokens) (Qwen3-30B-A3B: 8 of 128 at one token, all but 1e-5 of them at 256)."""
    return m.num_experts * (1 - (1 - m.num_experts_per_tok / m.num_experts) ** tokens)


def model_bytes(m, itemsize: int, tokens: int = 1, linear_itemsize: int | None = None) -> float:
    """Bytes of weights a forward pass of `tokens` tokens reads (embedding rows are gathered, so only the LM head
    counts; an MoE layer reads its router, shared expert and the experts its tokens are routed to); the decoder's
    projections at linear_itemsize (1 with FP8 weights; their scales are < 0.1% more), the rest at itemsize."""
    d, q, kv = m.hidden_size, m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim
    expert = 3 * d * m.moe_intermediate_size
    mlp = sum(m.mlp_params(i) - (m.num_experts - experts_read(m, tokens)) * expert if m.is_moe_layer(i)
              else 3 * d * m.intermediate_size for i in range(m.num_layers))
    linear = m.num_layers * (d * (q + 2 * kv) + q * d) + mlp
    norms = m.num_layers * (2 * d + 2 * m.head_dim)
    li = itemsize if linear_itemsize is None else linear_itemsize
    return linear * li + norms * itemsize + itemsize * (m.vocab_size * d + d)


class StepCounter:
    """While installed: one row [wall ms of the engine step that launched it, seqs, tokens, KV tokens, is_decode]
    per step the engine builds (the KV tokens are what the step's attention reads)."""

    def __init__(self, engine):
        self.engine, self.rows = engine, []
        self._build, self._step = le.build_step_batch, engine.step

    def _counting_build(self, out, block_size):
        batch = self._build(out, block_size)
        self.rows.append([0.0, batch.num_seqs, batch.num_tokens, sum(batch.seq_lens), batch.is_decode])
        return batch

    def _timed_step(self):
        n, t = len(self.rows), time.perf_counter()
        r = self._step()
        if len(self.rows) > n:
            self.rows[-1][0] = (time.perf_counter() - t) * 1e3
        return r

    def __enter__(self) -> StepCounter:
        le.build_step_batch, self.engine.step = self._counting_build, self._timed_step
        return self

    def __exit__(self, *exc) -> None:
        le.build_step_batch, self.engine.step = self._build, self._step


def print_step_log(rows: list, kv_bytes_per_token: int) -> None:
    """Mean wall time, rows and KV read per 100 steps."""
    print(f"{'steps':>11s} {'ms/step':>8s} {'seqs':>6s} {'tokens':>7s} {'kv tok':>8s} {'KV GB/s':>8s}")
    for i in range(0, len(rows), 100):
        chunk = rows[i:i + 100]
        ms = sum(r[0] for r in chunk) / len(chunk)
        kv = sum(r[3] for r in chunk) / len(chunk)
        print(f"{i:5d}-{i + len(chunk) - 1:5d} {ms:8.2f} {sum(r[1] for r in chunk) / len(chunk):6.0f} "
              f"{sum(r[2] for r in chunk) / len(chunk):7.0f} {kv:8.0f} {kv * kv_bytes_per_token / ms / 1e6:8.0f}")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True,
                    help="checkpoint dir, or a dir with only config.json (--load-format dummy)")
    ap.add_argument("--workload", choices=("reference", "prefill-heavy", "copy"), default="reference",
                    help="reference: 256 prompts of 100-1024 tokens, temperature 0.6 (default); prefill-heavy: 64 "
                         "prompts of 6-8k tokens with 64-256 output tokens; copy: greedy answers that copy the prompt "
                         "(train_tiny.copy_prompts), for speculative decoding")
    ap.add_argument("--batch", type=int, default=None,
                    help="copy workload: requests at a time (max_num_seqs; default 256); --num-seqs defaults to "
                         "max(4x it, 16)")
    ap.add_argument("--num-seqs", type=int, default=None, help="requests (default: the workload's, 256 or 64)")
    ap.add_argument("--max-input-len", type=int, default=None, help="default: 1024 (reference), 400 (copy)")
    ap.add_argument("--max-output-len", type=int, default=None, help="default: 1024 (reference), 200 (copy: every "
                                                                       "request generates this many)")
    ap.add_argument("--json", default=None, help="append the result as a JSON line to this file")
    ap.add_argument("--label", default="", help="a free-form label stored in the JSON line")
    ap.add_argument("--step-log", default=None, help="write per-step timings (JSON) here and print a summary")
    ap.add_argument("--gpu-idle", action="store_true",
                    help="CUDA: time each step on every rank's device with events (NANOVLLM_STEP_TIMING) and report "
                         "how long each GPU sat idle between steps (waiting for the host or its worker process)")
    add_engine_args(ap)
    ns = ap.parse_args(argv)
    least = {"num_seqs": 1, "batch": 1, "max_input_len": 4 if ns.workload == "copy" else 100,
             "max_output_len": 1 if ns.workload == "copy" else 100}  # (the reference workload's lengths start at 100)
    for name, lo in least.items():
        v = getattr(ns, name)
        if v is not None and v < lo:
            ap.error(f"--{name.replace('_', '-')} must be >= {lo} for the {ns.workload} workload, got {v}")
    if ns.workload == "prefill-heavy":
        if ns.max_input_len is not None or ns.max_output_len is not None:
            ap.error("--max-input-len / --max-output-len belong to the reference workload; prefill-heavy fixes its "
                     "lengths (workload.PREFILL_HEAVY)")
        kwargs = {"max_model_len": PREFILL_HEAVY_MAX_MODEL_LEN, **engine_kwargs(ns)}
        prompts, max_tokens = prefill_heavy_workload(*(() if ns.num_seqs is None else (ns.num_seqs,)))
        params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=m) for m in max_tokens]
    elif ns.workload == "copy":
        import train_tiny  # (benchmarks/)
        kwargs = {"max_model_len": 4096, **engine_kwargs(ns)}
        batch = 256 if ns.batch is None else ns.batch
        kwargs.setdefault("max_num_seqs", batch)
        kwargs["max_model_len"] = min(kwargs["max_model_len"], train_tiny.SEQ_LEN)  # the lengths it was trained on
        out_len = 200 if ns.max_output_len is None else ns.max_output_len
        prompts = train_tiny.copy_prompts(max(4 * batch, 16) if ns.num_seqs is None else ns.num_seqs, seed=0,
                                          max_len=400 if ns.max_input_len is None else ns.max_input_len)
        max_tokens = [out_len] * len(prompts)
        params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=m) for m in max_tokens]
    else:
        kwargs = {"max_model_len": 4096, **engine_kwargs(ns)}
        prompts, max_tokens = offline_workload(*(d if v is None else v for v, d in (
            (ns.num_seqs, 256), (ns.max_input_len, 1024), (ns.max_output_len, 1024))))
        params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=m) for m in max_tokens]

    cuda = torch.cuda.is_available() and kwargs.get("device", "auto") != "cpu"
    timing_dir = None
    if ns.gpu_idle and cuda:
        timing_dir = tempfile.mkdtemp(prefix="nanovllm-steps-")
        os.environ[STEP_TIMING_ENV] = os.path.join(timing_dir, "steps")  # read by every rank's ModelRunner
    t0 = time.perf_counter()
    try:
        llm = LLM(ns.model, **kwargs)
    except (ValueError, TypeError, OSError) as e:  # a bad path or engine argument: one line, not a traceback
        raise SystemExit(f"bench_offline.py: error: {e}") from None
    if llm.engine.vocab_size <= 10_000 and ns.workload != "copy":
        raise SystemExit(f"bench_offline.py: error: the {ns.workload} workload's prompt ids go up to 10,000 and "
                         f"this model's vocabulary has {llm.engine.vocab_size} tokens")
    startup = time.perf_counter() - t0
    eng = llm.engine
    runner = eng.runner
    mcfg = eng.config.model
    itemsize = torch.empty(0, dtype=eng.config.dtype).element_size()
    linear_itemsize = 1 if eng.config.quantization is not None else itemsize  # FP8 weights
    # an e4m3 KV cache: 1 byte per value and a float32 scale per (token, KV head)
    fp8_kv = eng.config.cache_dtype == torch.float8_e4m3fn
    kv_per_token = 2 * mcfg.num_layers * mcfg.num_kv_heads * (mcfg.head_dim * (1 if fp8_kv else itemsize)
                                                               + (4 if fp8_kv else 0))

    llm.generate([[1, 2, 3, 4]] * 4, SamplingParams(max_tokens=8), use_tqdm=False)  # warm-up
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    power = PowerMonitor.open(list(range(kwargs.get("tensor_parallel_size", 1)))) if cuda else None
    with StepCounter(eng) as steps, power or contextlib.nullcontext():
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        if cuda:
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - t
    if ns.step_log:
        with open(ns.step_log, "w") as f:
            json.dump(steps.rows, f)
        print_step_log(steps.rows, kv_per_token)

    n_out = sum(len(o["token_ids"]) for o in outs)
    if n_out != sum(max_tokens):
        raise SystemExit(f"expected {sum(max_tokens)} output tokens, got {n_out}")
    n_steps = len(steps.rows)
    moved = sum(model_bytes(mcfg, itemsize, r[2], linear_itemsize) + r[3] * kv_per_token for r in steps.rows)
    # the pure decode steps alone: bytes they read over their wall time (engine.step, which under async
    # scheduling is the step's share of the run)
    decode = [r for r in steps.rows if r[4]]
    decode_ms = sum(r[0] for r in decode)
    decode_bytes = sum(model_bytes(mcfg, itemsize, r[2], linear_itemsize) + r[3] * kv_per_token for r in decode)
    seconds = lambda name: round(getattr(runner, name, 0.0), 2)  # noqa: E731  (a runner may not record it)
    res = {
        "label": ns.label, "workload": ns.workload, "model": os.path.basename(os.path.normpath(ns.model)),
        "arch": mcfg.architecture,
        "device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
        "engine_args": dict(kwargs),
        "requests": len(prompts), "prompt_tokens": sum(map(len, prompts)), "output_tokens": n_out,
        "elapsed_s": round(elapsed, 3), "output_tok_s": round(n_out / elapsed, 1),
        "prompt_tok_s": round(sum(map(len, prompts)) / elapsed, 1),
        "total_tok_s": round((n_out + sum(map(len, prompts))) / elapsed, 1),
        "steps": n_steps, "achieved_GB_s": round(moved / elapsed / 1e9, 1),
        "decode_steps": len(decode), "decode_GB_s": round(decode_bytes / decode_ms / 1e6, 1) if decode_ms else None,
        "peak_gpu_mem_GiB": round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None,
        "startup_s": round(startup, 2), "load_s": seconds("load_seconds"), "kv_sizing_s": seconds("kv_seconds"),
        "gemm_plan_s": seconds("gemm_plan_seconds"), "cuda_graph_capture_s": seconds("capture_seconds"),
        "kv_blocks": eng.block_manager.num_blocks, "preemptions": eng.scheduler.num_preemptions,
        "async_scheduling": eng.async_scheduling,
    }
    if eng.spec_metrics is not None:
        spec = eng.spec_metrics
        res["spec_decode"] = {k: round(v, 3) for k, v in spec.items()}
        print(f"speculative decoding: {spec['num_accepted_tokens']} of {spec['num_draft_tokens']} draft tokens "
              f"accepted in {spec['num_drafts']} verifications, mean acceptance length "
              f"{spec['mean_acceptance_length']:.2f}")
    if power is not None:
        res.update(power.summary())
        res["J_per_output_token"] = round(res["energy_J"] / n_out, 4)
    print(f"{res['model']}: {n_out} tokens in {elapsed:.2f}s = {res['output_tok_s']:.0f} output tok/s | "
          f"{res['achieved_GB_s']} GB/s over {n_steps} steps ({res['decode_GB_s']} GB/s in the "
          f"{len(decode)} decode steps) | peak {res['peak_gpu_mem_GiB']} GiB | "
          f"startup {startup:.1f}s (model {res['load_s']}s, KV sizing {res['kv_sizing_s']}s, "
          f"GEMM plan {res['gemm_plan_s']}s, graphs {res['cuda_graph_capture_s']}s)")
    if ns.workload == "prefill-heavy":
        print(f"prefill-heavy: {res['prompt_tokens']} prompt + {n_out} output tokens: {res['prompt_tok_s']:.0f} "
              f"prompt, {res['output_tok_s']:.0f} output, {res['total_tok_s']:.0f} total tok/s (vLLM 0.26 on an H200: "
              f"about 111,000 total tok/s on Qwen3-0.6B, 29,500 on Qwen3-8B)")
    if power is not None:
        print(f"energy {res['energy_J']:.0f} J ({res['J_per_output_token'] * 1e3:.1f} mJ per output token) | "
              f"average power {res['avg_power_W']} W | median SM clock {res['sm_mhz_median']} MHz")
    llm.shutdown()  # every rank writes its step timings here
    if timing_dir is not None:
        del os.environ[STEP_TIMING_ENV]
        res["gpu_idle"] = report_gpu_idle(timing_dir, n_steps)
    print(json.dumps(res))
    if ns.json:
        with open(ns.json, "a") as f:
            f.write(json.dumps(res) + "\n")
    return res


def report_gpu_idle(timing_dir: str, n_steps: int) -> dict:
    """Per rank: device time inside the timed run's steps and the gaps between them (the rank files hold the
    warm-up's steps too: the last n_steps rows are the run's), by batch size."""
    out = {}
    for name in sorted(os.listdir(timing_dir)):
        with open(os.path.join(timing_dir, name)) as f:
            rows = json.load(f)[-n_steps:]
        rank = name.rsplit(".", 2)[-2]
        gaps = [b[0] - a[1] for a, b in zip(rows, rows[1:])]  # before each step but the first
        busy = sum(r[1] - r[0] for r in rows)
        buckets = {}
        for gap, r in zip(gaps, rows[1:]):
            key = "prefill" if not r[4] else f"decode {min(r[2] // 64 * 64, 192):3d}+"
            b = buckets.setdefault(key, [0, 0.0, 0.0])
            b[0] += 1
            b[1] += gap
            b[2] += r[1] - r[0]
        print(f"{rank}: {busy / 1e3:.3f} s inside {len(rows)} steps, {sum(gaps) / 1e3:.3f} s idle between them "
              f"(median gap {sorted(gaps)[len(gaps) // 2] * 1e3:.0f} us, {sum(g > 0.05 for g in gaps)} gaps > 50 us)")
        for key in sorted(buckets):
            n, idle, inside = buckets[key]
            print(f"    {key:12s} {n:5d} steps: {inside / n:7.3f} ms/step on the device, idle before {idle / n:6.3f} "
                  f"ms/step ({idle / 1e3:.3f} s)")
        out[rank] = {"busy_s": round(busy / 1e3, 3), "idle_s": round(sum(gaps) / 1e3, 3),
                     "by_kind": {k: {"steps": v[0], "idle_s": round(v[1] / 1e3, 3), "busy_s": round(v[2] / 1e3, 3)}
                                 for k, v in buckets.items()}}
    shutil.rmtree(timing_dir, ignore_errors=True)
    return out


if __name__ == "__main__":
    main()
