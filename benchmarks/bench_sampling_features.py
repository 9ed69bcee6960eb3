"""Decode step time with sampling features against plain decoding, at one batch size (256 rows by default).

    python benchmarks/bench_sampling_features.py --model benchmarks/models/qwen3-0.6b [--rows 256] [--tokens 128]

Random weights on the given config.json, with the built-in tiny model's tokenizer (structured outputs need one;
the vocabulary past it is masked). Every mode keeps all rows running for --tokens steps (ignore_eos; the JSON
schema is an array of at least 1,000 integers, so no grammar completes), and the median time of its pure-decode
steps is reported: plain, json (a schema on every row: grammar matching overlaps the forward), penalties
(presence + frequency + repetition on every row), bias (logit_bias + allowed_token_ids), n (rows / 4 prompts
with n=4). Target: json within 10% of plain; penalties and n add no host round trip (their step time stays
close to plain's). The modes run in turn --rounds times (default 3) and each reports its median over all rounds:
on the GPU machines (virtual CPUs) the host's speed drifts by up to 1.8x between runs a minute apart, which two
runs one after the other would read as a difference between modes.

    python benchmarks/bench_sampling_features.py --model benchmarks/models/qwen3-0.6b --host-only [--tokenizer DIR]

--host-only (no GPU needed) runs the engine with a stand-in for the model runner: no forward pass, each step's
tokens drawn at random (a constrained row's from its bitmask, like noise from a random model), so the median is the
engine's own host time per decode step (the stand-in's time is left out), with, for json, the medians of sending
the grammar process its job (advance) and of waiting for its masks (masks: the part of its accept + fill that the
engine's own work did not hide). A GPU step overlaps the forward pass with this host work: json's host step must
stay below plain's GPU step.
The engine flag --tokenizer DIR swaps in another tokenizer (a real one shows xgrammar's real mask cost).
--phases (either way) also prints, per mode, the median host time per engine step of each part of the engine:
schedule, build, launch, deferred sample, masks wait (the grammar processes), resolve, on_step_done, and on the GPU
tokens wait (the engine waiting for the device: slack the host has left).
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np
from transformers import AutoTokenizer

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from nanovllm import LLM, SamplingParams, StructuredOutputsParams  # noqa: E402
from nanovllm.cli import add_engine_args, engine_kwargs  # noqa: E402
from nanovllm.config import EngineArgs  # noqa: E402
from nanovllm.engine.executor import StepResult  # noqa: E402
from nanovllm.engine.llm_engine import LLMEngine  # noqa: E402
from nanovllm.utils.tiny_model import ensure_default_tiny_model  # noqa: E402

SCHEMA = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99999}, "minItems": 1000}


def model_dir(config_dir: str, tokenizer_dir: str | None) -> str:
    """The config.json of `config_dir` with the tiny model's tokenizer files beside it, and the EOS of the tokenizer
    that will be used (`tokenizer_dir`, default the tiny one) in generation_config.json, as a real checkpoint's
    agree (config.json's EOS id is past the tiny vocabulary: it would widen the grammar's vocabulary to the padding,
    engine/structured.py)."""
    out = tempfile.mkdtemp(prefix="nanovllm-features-")
    shutil.copy(os.path.join(config_dir, "config.json"), out)
    tiny = ensure_default_tiny_model()
    for name in os.listdir(tiny):
        if name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            shutil.copy(os.path.join(tiny, name), out)
    eos = AutoTokenizer.from_pretrained(tokenizer_dir or tiny).eos_token_id
    with open(os.path.join(out, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": eos}, f)
    return out


class _NoiseStep:
    """A step of `NoiseExecutor`: its tokens are drawn when read."""

    def __init__(self, ex: NoiseExecutor, num_logits: int):
        self.ex, self.n, self.late_rows, self.mask = ex, num_logits, [], None

    def sample(self, late) -> None:
        t = time.perf_counter()
        if late.mask_index is not None:  # what the GPU would copy (the buffer is rewritten by the next fill)
            index = late.mask_index.numpy()
            self.late_rows = np.nonzero(index >= 0)[0].tolist()
            self.mask = late.bitmask.numpy()[index[self.late_rows]].copy()
        self.ex.own += time.perf_counter() - t

    def result(self) -> StepResult:
        t = time.perf_counter()
        rng = self.ex.rng
        toks = [int(x) for x in rng.integers(10, 400, self.n)]
        if self.mask is not None:  # a random allowed id of each constrained row: a random nonzero word, a set bit
            m = self.mask
            w = np.argmax((m != 0) * rng.random(m.shape), axis=1)
            bits = (m[np.arange(len(m)), w].view(np.uint32)[:, None] >> np.arange(32, dtype=np.uint32)) & 1
            b = np.argmax(bits * rng.random(bits.shape), axis=1)
            for row, tok in zip(self.late_rows, (w * 32 + b).tolist()):
                toks[row] = tok
        self.ex.own += time.perf_counter() - t
        return StepResult(token_ids=toks)


class NoiseExecutor:
    """The model runner's stand-in for --host-only: no model; `own` sums its time, to be left out."""

    def __init__(self, num_kvcache_blocks: int):
        self.num_kvcache_blocks = num_kvcache_blocks
        self.load_seconds = self.kv_seconds = self.gemm_plan_seconds = self.capture_seconds = 0.0
        self.is_alive = True
        self.rng = np.random.default_rng(0)
        self.own = 0.0

    def launch(self, batch) -> _NoiseStep:
        return _NoiseStep(self, batch.num_logits)

    def execute(self, batch) -> StepResult:
        return self.launch(batch).result()

    def shutdown(self) -> None:
        self.is_alive = False


class HostOnlyEngine(LLMEngine):
    def _make_runner(self) -> NoiseExecutor:
        return NoiseExecutor(self.config.args.num_kvcache_blocks)


def _timed(f, record):
    """f, calling record(seconds) after each call."""
    def timed(*args, **kwargs):
        t = time.perf_counter()
        try:
            return f(*args, **kwargs)
        finally:
            record(time.perf_counter() - t)
    return timed


class Phases:
    """--phases: the engine's host time in each of its parts, per engine step (the parts wrapped while a mode runs;
    `report` gives each part's median over the steps of every round). "masks wait": reading the grammar processes'
    replies (the part of their accept + fill that the engine's own work did not hide); "tokens wait": the engine
    waiting for a step's sampled tokens (the device; absent with --host-only); the rest is host work. A step also pays
    what is not listed (the loop, outputs)."""

    def __init__(self):
        self.steps: list[dict[str, float]] = []  # per engine step: seconds by part

    def _parts(self, engine) -> list[tuple[object, str, str]]:
        from nanovllm.engine import grammar_worker, llm_engine, model_runner
        return [(engine.scheduler, "schedule", "schedule"), (llm_engine, "build_step_batch", "build"),
                (engine.runner, "launch", "launch"), (engine, "_sample_inflight", "deferred sample"),
                (grammar_worker.GrammarProcess, "collect", "masks wait"), (engine, "_resolve", "resolve"),
                (engine.scheduler, "on_step_done", "on_step_done"), (model_runner.PendingStep, "result", "tokens wait")]

    def run(self, engine, fn, *args):
        """fn(*args) with the parts timed, step by step."""
        saved = []
        for obj, attr, label in self._parts(engine):
            saved.append((obj, attr, obj.__dict__.get(attr)))
            setattr(obj, attr, _timed(getattr(obj, attr), functools.partial(self._add, label)))
        step = engine.step

        def counted():
            self.steps.append({})
            return step()
        engine.step = counted
        try:
            return fn(*args)
        finally:
            del engine.step
            for obj, attr, original in saved:
                if original is None:
                    delattr(obj, attr)  # an instance's wrapper over its class's method
                else:
                    setattr(obj, attr, original)

    def _add(self, label: str, seconds: float) -> None:
        if self.steps:
            cur = self.steps[-1]
            cur[label] = cur.get(label, 0.0) + seconds

    def report(self) -> str:
        labels = dict.fromkeys(k for s in self.steps for k in s)
        return ", ".join(f"{k} {statistics.median(s.get(k, 0.0) for s in self.steps) * 1e3:.3f}" for k in labels)


def host_step_times(engine: HostOnlyEngine, prompts, params, timers: dict) -> list[float]:
    """Host time of each pure decode step (the stand-in's left out); `timers` collects the grammar process's
    advance (send a job) and masks (wait for its reply) times."""
    base = len(engine.requests)
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(f"r{base}-{i}", p, sp)
    so = engine._structured  # built by the first structured request
    if so is not None:
        for name in ("advance", "masks"):  # sending a step's job; waiting for (and reading) the masks
            setattr(so, name, _timed(getattr(type(so), name).__get__(so), timers.setdefault(name, []).append))
    times, broke = [], 0
    while engine.has_unfinished_requests():
        own, t = engine.runner.own, time.perf_counter()
        outs, num_prefill, num_sampled = engine.step()
        if not num_prefill and num_sampled:
            times.append(time.perf_counter() - t - (engine.runner.own - own))
        broke += sum(o.finish_reason == "abort" for o in outs)
    if broke:  # the stand-in draws from the masks it was handed: a broken grammar means a wrong mask
        raise RuntimeError(f"{broke} requests broke their grammar")
    return times[2:-2]


def decode_step_times(llm: LLM, prompts, params) -> list[float]:
    times = []
    engine = llm.engine
    step = engine.step

    def timed():
        t = time.perf_counter()
        out = step()
        if not out[1] and out[2]:  # a pure decode step: no prompt tokens, some tokens sampled
            times.append(time.perf_counter() - t)
        return out
    engine.step = timed
    try:
        llm.generate(prompts, params, use_tqdm=False)
    finally:
        engine.step = step
    return times[2:-2]   # the pipeline's first and last steps are not full


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a directory with config.json (benchmarks/models/...)")
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--modes", default="plain,json,penalties,bias,n")
    ap.add_argument("--rounds", type=int, default=3, help="the modes run in turn this many times")
    ap.add_argument("--host-only", action="store_true", help="no model: the engine's host time per step")
    ap.add_argument("--phases", action="store_true", help="also the engine's host time per step in each of its parts")
    add_engine_args(ap)
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error(f"--rounds must be at least 1, got {args.rounds}")
    path = model_dir(args.model, args.tokenizer)
    R, T = args.rows, args.tokens
    kwargs = {"load_format": "dummy", "max_num_seqs": R, **engine_kwargs(args)}
    if args.host_only:
        blocks = R * (-(-(64 + T) // 16) + 1)  # enough at the smallest block size (the stand-in holds no cache)
        engine = HostOnlyEngine(EngineArgs.from_kwargs(path, **{
            "device": "cpu", "async_scheduling": True, "num_kvcache_blocks": blocks, **kwargs}))
    else:
        llm = LLM(path, **kwargs)
    prompts = [[(17 * i + 3 * j) % 400 + 10 for j in range(64)] for i in range(R)]
    base = dict(temperature=1.0, max_tokens=T, ignore_eos=True)
    modes = {
        "plain": (prompts, [SamplingParams(seed=i, **base) for i in range(R)]),
        "json": (prompts, [SamplingParams(seed=i, structured_outputs=StructuredOutputsParams(json=SCHEMA), **base)
                           for i in range(R)]),
        "penalties": (prompts, [SamplingParams(seed=i, presence_penalty=0.5, frequency_penalty=0.5,
                                               repetition_penalty=1.1, **base) for i in range(R)]),
        "bias": (prompts, [SamplingParams(seed=i, logit_bias={5: 2.0, 9: -3.0}, allowed_token_ids=list(range(400)),
                                          **base) for i in range(R)]),
        "n": (prompts[:R // 4], [SamplingParams(seed=i, n=4, **base) for i in range(R // 4)]),
    }
    res, what = {}, "host time per decode step" if args.host_only else "decode step"
    if not args.host_only:
        llm.generate(prompts[:8], SamplingParams(max_tokens=8), use_tqdm=False)  # warm-up
    names = args.modes.split(",")
    times: dict[str, list[float]] = {name: [] for name in names}
    rounds: dict[str, list[float]] = {name: [] for name in names}
    timers: dict[str, dict[str, list[float]]] = {name: {} for name in names}
    phases = {name: Phases() for name in names}
    for _ in range(args.rounds):
        for name in names:
            if args.host_only:
                fn, fn_args = host_step_times, (engine, *modes[name], timers[name])
            else:
                fn, fn_args = decode_step_times, (llm, *modes[name])
            t = phases[name].run(engine if args.host_only else llm.engine, fn, *fn_args) if args.phases \
                else fn(*fn_args)
            times[name] += t
            rounds[name].append(statistics.median(t) * 1e3)
    for name in names:
        res[name] = statistics.median(times[name]) * 1e3
        parts = "".join(f", {k} {statistics.median(v) * 1e3:.3f}" for k, v in timers[name].items() if v)
        per_round = " / ".join(f"{r:.2f}" for r in rounds[name])
        vs_plain = ""
        if "plain" in res and name != "plain":  # also per round: plain and this mode ran back to back
            paired = [r / p for r, p in zip(rounds[name], rounds["plain"])]
            vs_plain = (f"  ({res[name] / res['plain']:.3f}x plain; per round "
                        f"{' / '.join(f'{x:.2f}' for x in paired)}, median {statistics.median(paired):.3f}x)")
        print(f"{name:10s} {what} median {res[name]:.3f} ms over {len(times[name])} steps (rounds: {per_round})"
              + parts + vs_plain)
        if args.phases:
            print(f"{'':10s} phases, median ms per engine step: {phases[name].report()}")
    (engine if args.host_only else llm).shutdown()
    shutil.rmtree(path, ignore_errors=True)
    return res


if __name__ == "__main__":
    main()
