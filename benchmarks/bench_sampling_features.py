"""Decode step time with sampling features against plain decoding, at one batch size (256 rows by default).

    python benchmarks/bench_sampling_features.py --model benchmarks/models/qwen3-0.6b [--rows 256] [--tokens 128]

Random weights on the given config.json, with the built-in tiny model's tokenizer (structured outputs need one;
the vocabulary past it is masked). Every mode keeps all rows running for --tokens steps (ignore_eos; the JSON
schema is an array of at least 1,000 integers, so no grammar completes), and the median time of its pure-decode
steps is reported: plain, json (a schema on every row: grammar matching overlaps the forward), penalties
(presence + frequency + repetition on every row), bias (logit_bias + allowed_token_ids), n (rows / 4 prompts
with n=4). Target: json within 10% of plain; penalties and n add no host round trip (their step time stays
close to plain's).
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from nanovllm import LLM, SamplingParams, StructuredOutputsParams  # noqa: E402
from nanovllm.cli import add_engine_args, engine_kwargs  # noqa: E402
from nanovllm.utils.tiny_model import ensure_default_tiny_model  # noqa: E402

SCHEMA = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99999}, "minItems": 1000}


def model_dir(config_dir: str) -> str:
    """The config.json of `config_dir` with the tiny model's tokenizer files beside it."""
    out = tempfile.mkdtemp(prefix="nanovllm-features-")
    shutil.copy(os.path.join(config_dir, "config.json"), out)
    tiny = ensure_default_tiny_model()
    for name in os.listdir(tiny):
        if name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            shutil.copy(os.path.join(tiny, name), out)
    return out


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
    add_engine_args(ap)
    args = ap.parse_args(argv)
    path = model_dir(args.model)
    llm = LLM(path, **{"load_format": "dummy", "max_num_seqs": args.rows, **engine_kwargs(args)})
    R, T = args.rows, args.tokens
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
    llm.generate(prompts[:8], SamplingParams(max_tokens=8), use_tqdm=False)  # warm-up
    res = {}
    for name in args.modes.split(","):
        times = decode_step_times(llm, *modes[name])
        res[name] = statistics.median(times) * 1e3
        print(f"{name:10s} decode step median {res[name]:.3f} ms over {len(times)} steps"
              + (f"  ({res[name] / res['plain']:.3f}x plain)" if "plain" in res and name != "plain" else ""))
    llm.shutdown()
    shutil.rmtree(path, ignore_errors=True)
    return res


if __name__ == "__main__":
    main()
