#!/usr/bin/env python
"""Online serving benchmark: the reference workload replayed as Poisson arrivals against the server.

    python benchmarks/online_bench.py --model DIR --load-format dummy --rates 4,16,inf
    python benchmarks/online_bench.py --model path/to/config.json --load-format dummy --rates 8 \\
        --max-model-len 4096 --tensor-parallel-size 2          # unknown flags go to `nanovllm serve`
    python benchmarks/online_bench.py --url http://127.0.0.1:8000 --rates 4,inf   # a server already running
    python benchmarks/online_bench.py --fake-core --rates inf          # the API process alone, on CPU

Workload (fixed): random.Random(0); 256 requests; prompt i is [rng.randint(0, 10000) for _ in
range(rng.randint(100, 1024))], all prompts drawn first, then max_tokens = [rng.randint(100, 1024) for each];
temperature 0.6, ignore_eos. Prompts are token ids, sent to /v1/completions, streamed, with
stream_options.include_usage. For each rate (requests/s; `inf` sends everything at once) it reports request
and token throughput, TTFT, TPOT ((latency - TTFT) / (output tokens - 1)), inter-chunk latency and end-to-end
latency (mean, p50, p99), prints a table and writes everything to --output (JSON).

Without --url the script starts `nanovllm serve` itself (a subprocess on 127.0.0.1, a free port) and stops it
at the end. --model may be a checkpoint directory or a config.json file (a directory holding just that file
is made for it; use --load-format dummy). The prompts are token ids, so any tokenizer will do: if the model
directory has none and --tokenizer is not given, a tiny tokenizer is built and used (outputs are then
detokenized as gibberish, which does not matter here).

The client is spread over --client-procs processes (requests dealt round-robin, one arrival schedule), so
that parsing hundreds of streams does not make the client the bottleneck. For a server it started, the script
also reports the CPU time its API process and its engine-core process spent per output token (`cpu` in the
results): the API process's share is what HTTP, detokenization and SSE cost.

--fake-core serves the same API in front of an engine core without a model (nanovllm/utils/fake_core.py: every
running request gets a made-up token per step, --fake-step-seconds apart, 0 = as fast as it can), so the numbers
are the API process's own: its tok/s ceiling and its CPU per token, on any machine.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import re
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "benchmarks"))

from workload import offline_workload  # noqa: E402

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


# --- workload -----------------------------------------------------------------------------------------
def reference_workload(num_requests: int = 256, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    """The reference workload (benchmarks/workload.py, always drawn for 256 requests; the first `num_requests`
    are returned)."""
    prompts, max_tokens = offline_workload(256, seed=seed)
    return prompts[:num_requests], max_tokens[:num_requests]


def arrival_times(n: int, rate: float, seed: int) -> list[float]:
    """Poisson process: exponential gaps with mean 1/rate (all at 0 for an infinite rate)."""
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(f"arrivals-{seed}-{rate}")
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


# --- statistics -----------------------------------------------------------------------------------------
def percentile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    k = (len(s) - 1) * q / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def summary(xs: list[float]) -> dict:
    return {"mean": statistics.fmean(xs) if xs else None, "p50": percentile(xs, 50), "p99": percentile(xs, 99),
            "max": max(xs) if xs else None}


# --- one request ----------------------------------------------------------------------------------------
async def send_one(client, url: str, headers: dict, payload: dict) -> dict:
    t0 = time.perf_counter()
    rec = {"ok": False, "ttft": None, "latency": None, "output_tokens": 0, "prompt_tokens": 0, "itl": [],
           "error": None}
    last = None
    try:
        async with client.stream("POST", url, json=payload, headers=headers) as r:
            if r.status_code != 200:
                body = (await r.aread()).decode(errors="replace")
                rec["error"] = f"HTTP {r.status_code}: {body[:300]}"
                return rec
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:].strip()
                if data == "[DONE]":
                    break
                obj = json.loads(data)
                if "error" in obj:
                    rec["error"] = str(obj["error"].get("message"))
                    return rec
                if obj.get("choices"):
                    now = time.perf_counter()
                    if rec["ttft"] is None:
                        rec["ttft"] = now - t0
                    else:
                        rec["itl"].append(now - last)
                    last = now
                if obj.get("usage"):
                    rec["output_tokens"] = obj["usage"]["completion_tokens"]
                    rec["prompt_tokens"] = obj["usage"]["prompt_tokens"]
        rec["latency"] = time.perf_counter() - t0
        rec["ok"] = rec["ttft"] is not None
        if not rec["ok"]:
            rec["error"] = "no tokens received"
    except Exception as e:  # noqa: BLE001 - a failed request is reported, not fatal
        rec["error"] = f"{type(e).__name__}: {e}"
    return rec


def _shard(args) -> list[dict]:
    """One client process's requests (indices `idx`), sent at `start_wall + arrivals[i]` (time.time())."""
    base_url, model, api_key, prompts, max_tokens, idx, arrivals, start_wall, temperature, max_conc, timeout = args
    return asyncio.run(_send_shard(base_url, model, api_key, prompts, max_tokens, idx, arrivals, start_wall,
                                   temperature, max_conc, timeout))


async def _send_shard(base_url, model, api_key, prompts, max_tokens, idx, arrivals, start_wall, temperature,
                      max_concurrency, timeout) -> list[dict]:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    url = base_url.rstrip("/") + "/v1/completions"
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    limits = httpx.Limits(max_connections=len(idx) + 8, max_keepalive_connections=len(idx) + 8)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=60), limits=limits) as client:
        # a first request before the run starts: the client's lazy imports and first connection (~0.1 s) would
        # otherwise land in the TTFT of each client process's first request (the tail of TTFT at low rates)
        try:
            await client.get(base_url.rstrip("/") + "/health", headers=headers)
        except httpx.HTTPError:
            pass

        async def one(i):
            delay = start_wall + arrivals[i] - time.time()
            if delay > 0:
                await asyncio.sleep(delay)
            payload = {"model": model, "prompt": prompts[i], "max_tokens": max_tokens[i],
                       "temperature": temperature, "ignore_eos": True, "stream": True,
                       "stream_options": {"include_usage": True}}
            if sem is None:
                rec = await send_one(client, url, headers, payload)
            else:
                async with sem:
                    rec = await send_one(client, url, headers, payload)
            rec["end_wall"] = time.time()
            rec["arrival_s"] = arrivals[i]
            return rec

        return await asyncio.gather(*(one(i) for i in idx))


async def run_rate(base_url: str, model: str, api_key: str | None, prompts, max_tokens, rate: float, seed: int,
                   temperature: float, max_concurrency: int | None, timeout: float, client_procs: int = 1) -> dict:
    """Replay the requests at `rate`; with client_procs > 1 the requests are dealt round-robin to that many
    client processes (max_concurrency is then per process, divided evenly)."""
    n = len(prompts)
    arrivals = arrival_times(n, rate, seed)
    procs = max(1, min(client_procs, n))
    start_wall = time.time() + (1.0 if procs > 1 else 0.0)   # time for the client processes to start
    conc = -(-max_concurrency // procs) if max_concurrency else None
    shards = [(base_url, model, api_key, prompts, max_tokens, list(range(k, n, procs)), arrivals, start_wall,
               temperature, conc, timeout) for k in range(procs)]
    if procs == 1:
        recs = await _send_shard(*shards[0])
    else:
        import concurrent.futures
        import multiprocessing as mp
        with concurrent.futures.ProcessPoolExecutor(procs, mp_context=mp.get_context("spawn")) as pool:
            parts = await asyncio.get_running_loop().run_in_executor(None, lambda: list(pool.map(_shard, shards)))
        recs = [r for part in parts for r in part]
    duration = max(r["end_wall"] for r in recs) - start_wall
    ok = [r for r in recs if r["ok"]]
    out_tokens = sum(r["output_tokens"] for r in ok)
    in_tokens = sum(r["prompt_tokens"] for r in ok)
    tpot = [(r["latency"] - r["ttft"]) / (r["output_tokens"] - 1) for r in ok if r["output_tokens"] > 1]
    errors = [r["error"] for r in recs if not r["ok"]]
    return {
        "rate": "inf" if math.isinf(rate) else rate,
        "num_requests": n, "completed": len(ok), "failed": len(errors), "errors": sorted(set(errors))[:10],
        "client_procs": procs,
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "output_token_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "prompt_tokens": in_tokens, "output_tokens": out_tokens,
        "expected_output_tokens": sum(max_tokens),
        "ttft_s": summary([r["ttft"] for r in ok]),
        "tpot_s": summary(tpot),
        "itl_s": summary([x for r in ok for x in r["itl"]]),
        "latency_s": summary([r["latency"] for r in ok]),
        # the tail's requests: when they arrived (seconds into the run) tells a cold start from a load spike
        "ttft_slowest": [{"ttft_s": r["ttft"], "arrival_s": r["arrival_s"], "prompt_tokens": r["prompt_tokens"]}
                         for r in sorted(ok, key=lambda r: r["ttft"], reverse=True)[:5]],
    }


# --- server ---------------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prepare_model(model: str, tmp: str) -> str:
    """A checkpoint directory for --model (a config.json file gets a directory of its own)."""
    if os.path.isfile(model):
        d = os.path.join(tmp, "model")
        os.makedirs(d, exist_ok=True)
        shutil.copy(model, os.path.join(d, "config.json"))
        gen = os.path.join(os.path.dirname(os.path.abspath(model)), "generation_config.json")
        if os.path.isfile(gen):
            shutil.copy(gen, d)
        return d
    if not os.path.isdir(model):
        sys.exit(f"online_bench: --model {model!r} is neither a directory nor a config.json file")
    return model


def fallback_tokenizer(tmp: str) -> str:
    sys.path.insert(0, REPO)
    from nanovllm.utils.tiny_model import build_tiny_checkpoint
    print("[bench] the model directory has no tokenizer and --tokenizer was not given: using a tiny built-in "
          "tokenizer (prompts are token ids; output text is not looked at)", file=sys.stderr)
    return str(build_tiny_checkpoint(os.path.join(tmp, "tiny-tokenizer"), "qwen3", overwrite=True))


def start_server(model_dir: str, port: int, name: str, api_key: str | None, extra: list[str], log_path: str,
                 timeout: float, cmd: list[str] | None = None) -> subprocess.Popen:
    if cmd is None:
        cmd = [sys.executable, "-m", "nanovllm", "serve", model_dir, "--host", "127.0.0.1", "--port", str(port),
               "--served-model-name", name, "--disable-access-log", "--uvicorn-log-level", "warning"] + extra
        if api_key:
            cmd += ["--api-key", api_key]
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    print(f"[bench] starting: {shlex.join(cmd)}\n[bench] server log: {log_path}", file=sys.stderr)
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    import httpx
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            log.close()
            with open(log_path) as f:
                tail = f.read()[-4000:]
            sys.exit(f"online_bench: the server exited with code {proc.returncode}:\n{tail}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            stop_server(proc)
            sys.exit(f"online_bench: the server did not become healthy within {timeout:.0f}s (log: {log_path})")
        time.sleep(0.5)


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


def scrape_metrics(base_url: str) -> dict:
    import httpx
    try:
        text = httpx.get(base_url.rstrip("/") + "/metrics", timeout=10).text
    except httpx.HTTPError:
        return {}
    out = {}
    for name in ("num_preemptions_total", "prefix_cache_hits_total", "prefix_cache_queries_total",
                 "prompt_tokens_total", "generation_tokens_total"):
        m = re.search(rf"^nanovllm:{name}(?:{{[^}}]*}})? (\S+)$", text, re.M)
        if m:
            out[name] = float(m.group(1))
    # the server's own TTFT (API process: request in -> first token out), as requests at or under each bound
    for m in re.finditer(r'^nanovllm:time_to_first_token_seconds_bucket{(?:[^}]*,)?le="([^"]+)"[^}]*} (\S+)$', text,
                         re.M):
        if m.group(1) in ("0.02", "0.04", "0.1"):
            out[f"ttft_le_{m.group(1)}s"] = out.get(f"ttft_le_{m.group(1)}s", 0.0) + float(m.group(2))
    return out


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of a process so far (Linux /proc), None if unknown."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


def spawned_children(pid: int) -> list[int]:
    """The processes `pid` started through multiprocessing: the API process's engine cores (several with
    --data-parallel-size), an engine core's tensor-parallel workers. (Not its resource tracker, which is started
    without spawn_main.)"""
    pids = []
    try:
        for d in os.listdir("/proc"):
            if not d.isdigit():
                continue
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                with open(f"/proc/{d}/cmdline", "rb") as f:
                    cmd = f.read()
            except (OSError, IndexError, ValueError):
                continue
            if ppid == pid and b"spawn_main" in cmd:
                pids.append(int(d))
    except OSError:
        pass
    return pids


def cpu_seconds_of(pids: list[int]) -> float | None:
    """The CPU time of several processes together (the engine cores), None if any is unknown."""
    times = [cpu_seconds(p) for p in pids]
    return None if not times or None in times else sum(times)


def serve_fake_core(argv: list[str]) -> int:
    """The API server in front of a FakeEngineCore (this script runs itself with --serve-fake-core)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--served-model-name", required=True)
    ap.add_argument("--fake-step-seconds", type=float, default=0.0)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ns = ap.parse_args(argv)
    sys.path.insert(0, REPO)
    from nanovllm.server.api import build_app
    from nanovllm.server.cli import load_tokenizer, make_uvicorn_server
    from nanovllm.server.config import ServerConfig
    from nanovllm.server.core_client import EngineCoreClient
    from nanovllm.utils.fake_core import FakeCoreArgs, FakeEngineCore

    sys.setswitchinterval(0.001)      # as `nanovllm serve` does
    tok = load_tokenizer(ns.tokenizer, required=True)
    text_ids = tuple(i for i in range(len(tok)) if (t := tok.decode([i])).isascii() and t.isprintable() and t)
    args = FakeCoreArgs(token_ids=text_ids, vocab_size=10240, max_model_len=4096, max_num_seqs=ns.max_num_seqs,
                        step_seconds=ns.fake_step_seconds)
    client = EngineCoreClient(args, make_core=FakeEngineCore.from_args)
    client.start()
    try:
        app = build_app(client, tok, ServerConfig(served_model_names=(ns.served_model_name,)))
        make_uvicorn_server(app, host="127.0.0.1", port=ns.port, log_level="warning", access_log=False).run()
    finally:
        client.close()
    return 0


# --- main -----------------------------------------------------------------------------------------------
def fmt_ms(x) -> str:
    return "-" if x is None else f"{x * 1000:.1f}"


def _us(x) -> str:
    return "-" if x is None else f"{x:.1f}"


def print_table(results: list[dict]) -> None:
    head = ["rate", "ok/n", "dur s", "req/s", "out tok/s", "tot tok/s", "TTFT p50", "TTFT p99", "TPOT p50",
            "TPOT p99", "ITL p50", "E2E p50 s", "preempt", "API us/tok", "core us/tok"]
    rows = []
    for r in results:
        rows.append([str(r["rate"]), f"{r['completed']}/{r['num_requests']}", f"{r['duration_s']:.1f}",
                     f"{r['request_throughput']:.2f}", f"{r['output_token_throughput']:.0f}",
                     f"{r['total_token_throughput']:.0f}", fmt_ms(r["ttft_s"]["p50"]), fmt_ms(r["ttft_s"]["p99"]),
                     fmt_ms(r["tpot_s"]["p50"]), fmt_ms(r["tpot_s"]["p99"]), fmt_ms(r["itl_s"]["p50"]),
                     "-" if r["latency_s"]["p50"] is None else f"{r['latency_s']['p50']:.2f}",
                     str(int(r.get("server", {}).get("num_preemptions_total", 0))),
                     _us(r.get("cpu", {}).get("api_us_per_output_token")),
                     _us(r.get("cpu", {}).get("engine_core_us_per_output_token"))])
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(head)]
    print("  ".join(h.rjust(w) for h, w in zip(head, widths, strict=True)))
    print("  ".join("-" * w for w in widths))
    for row in rows:
        print("  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)))
    print("(TTFT, TPOT, ITL in ms; CPU time of the server's processes per output token in us)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False,
                                 epilog="Any other --flags are passed to `nanovllm serve` (engine args).")
    ap.add_argument("--model", help="checkpoint directory or config.json (required unless --url)")
    ap.add_argument("--url", help="benchmark a running server at this base URL instead of starting one")
    ap.add_argument("--served-model-name", default="bench-model",
                    help="the model name to serve / send (with --url: default is the server's first model)")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--rates", default="4,16,inf", help="comma-separated request rates per second (inf: all at once)")
    ap.add_argument("--num-requests", type=int, default=256, help="replay only the first N requests (max 256)")
    ap.add_argument("--max-tokens-cap", type=int, default=None,
                    help="cap every request's max_tokens (smoke tests only; the reference run leaves it off)")
    ap.add_argument("--temperature", type=float, default=0.6)
    ap.add_argument("--arrival-seed", type=int, default=0, help="seed of the Poisson arrivals")
    ap.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight (default: none)")
    ap.add_argument("--num-warmup", type=int, default=2, help="short requests sent before measuring")
    ap.add_argument("--request-timeout", type=float, default=3600.0)
    ap.add_argument("--startup-timeout", type=float, default=1200.0)
    ap.add_argument("--output", default="online_bench_results.json", help="JSON results file")
    ap.add_argument("--client-procs", type=int, default=4, help="client processes the requests are spread over")
    ap.add_argument("--fake-core", action="store_true",
                    help="serve with a model-free engine core (measures the API process alone; --model not needed)")
    ap.add_argument("--fake-step-seconds", type=float, default=0.0,
                    help="--fake-core: seconds per simulated step (0: as fast as the API process takes them)")
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["--serve-fake-core"]:
        return serve_fake_core(argv[1:])
    ns, extra = ap.parse_known_args(argv)
    if not ns.url and not ns.model and not ns.fake_core:
        ap.error("give --model (to start a server), --url (to use a running one) or --fake-core")
    if ns.client_procs < 1:
        ap.error("--client-procs must be >= 1")
    if not 1 <= ns.num_requests <= 256:
        ap.error("--num-requests must be in [1, 256]")
    try:
        rates = [float(r) for r in ns.rates.split(",") if r.strip()]
    except ValueError:
        ap.error(f"bad --rates {ns.rates!r}")
    if not rates or any(not r > 0 for r in rates):
        ap.error("rates must be > 0 (or inf)")
    try:
        import httpx  # noqa: F401
    except ImportError:
        sys.exit("online_bench: needs httpx (pip install httpx)")

    prompts, max_tokens = reference_workload(ns.num_requests)
    if ns.max_tokens_cap:
        max_tokens = [min(m, ns.max_tokens_cap) for m in max_tokens]

    tmp = tempfile.mkdtemp(prefix="nanovllm-bench-")
    proc = None
    try:
        if ns.url:
            base_url = ns.url
            import httpx
            headers = {"Authorization": f"Bearer {ns.api_key}"} if ns.api_key else {}
            model = ns.served_model_name
            if model == "bench-model":
                try:
                    r = httpx.get(base_url.rstrip("/") + "/v1/models", headers=headers, timeout=30)
                except httpx.HTTPError as e:
                    raise SystemExit(f"online_bench.py: error: no server answers at {base_url}: {e}") from None
                if r.status_code != 200:
                    raise SystemExit(f"online_bench.py: error: {base_url}/v1/models answered {r.status_code} "
                                     f"({r.text[:200]}){' (give --api-key)' if r.status_code == 401 else ''}")
                model = r.json()["data"][0]["id"]
        elif ns.fake_core:
            port = _free_port()
            tok_dir = next((a.split("=", 1)[1] if "=" in a else extra[k + 1] for k, a in enumerate(extra)
                            if a.startswith("--tokenizer")), None) or fallback_tokenizer(tmp)
            cmd = [sys.executable, os.path.abspath(__file__), "--serve-fake-core", "--port", str(port), "--tokenizer",
                   tok_dir, "--served-model-name", ns.served_model_name, "--fake-step-seconds",
                   str(ns.fake_step_seconds)]
            proc = start_server("", port, ns.served_model_name, None, [], os.path.join(tmp, "server.log"),
                                ns.startup_timeout, cmd=cmd)
            base_url = f"http://127.0.0.1:{port}"
            model = ns.served_model_name
        else:
            model_dir = prepare_model(ns.model, tmp)
            has_tok_flag = any(a == "--tokenizer" or a.startswith("--tokenizer=") for a in extra)
            if not has_tok_flag and not any(os.path.exists(os.path.join(model_dir, f)) for f in TOKENIZER_FILES):
                extra = extra + ["--tokenizer", fallback_tokenizer(tmp)]
            port = _free_port()
            proc = start_server(model_dir, port, ns.served_model_name, ns.api_key, extra,
                                os.path.join(tmp, "server.log"), ns.startup_timeout)
            base_url = f"http://127.0.0.1:{port}"
            model = ns.served_model_name

        if ns.num_warmup:
            k = min(ns.num_warmup, len(prompts))
            warm = asyncio.run(run_rate(base_url, model, ns.api_key, prompts[:k], [8] * k, math.inf, ns.arrival_seed,
                                        ns.temperature, None, ns.request_timeout))
            if warm["failed"]:
                print(f"[bench] warmup failed: {warm['errors']}", file=sys.stderr)
                return 1

        results = []
        for rate in rates:
            print(f"[bench] rate {rate:g} req/s: {len(prompts)} requests ...", file=sys.stderr)
            before = scrape_metrics(base_url)
            pids = {} if proc is None else {"api": [proc.pid], "engine_core": spawned_children(proc.pid)}
            cpu0 = {k: cpu_seconds_of(p) for k, p in pids.items()}
            res = asyncio.run(run_rate(base_url, model, ns.api_key, prompts, max_tokens, rate, ns.arrival_seed,
                                       ns.temperature, ns.max_concurrency, ns.request_timeout, ns.client_procs))
            after = scrape_metrics(base_url)
            res["server"] = {k: after[k] - before.get(k, 0.0) for k in after}
            res["cpu"] = {}
            for k, t0 in cpu0.items():
                t1 = cpu_seconds_of(pids[k])
                if t0 is not None and t1 is not None:
                    res["cpu"][f"{k}_s"] = t1 - t0
                    res["cpu"][f"{k}_us_per_output_token"] = (t1 - t0) / max(res["output_tokens"], 1) * 1e6
            results.append(res)
            if res["failed"]:
                print(f"[bench]   {res['failed']} failed: {res['errors']}", file=sys.stderr)
        print_table(results)
        report = {
            "workload": {"num_requests": len(prompts), "seed": 0, "temperature": ns.temperature,
                         "ignore_eos": True, "prompt_tokens": sum(map(len, prompts)),
                         "max_tokens": sum(max_tokens), "max_tokens_cap": ns.max_tokens_cap},
            "server": {"url": ns.url, "model": "fake-core" if ns.fake_core else ns.model, "extra_args": extra,
                       "fake_step_seconds": ns.fake_step_seconds if ns.fake_core else None},
            "arrival_seed": ns.arrival_seed, "max_concurrency": ns.max_concurrency,
            "results": results,
        }
        with open(ns.output, "w") as f:
            json.dump(report, f, indent=2)
        print(f"[bench] results written to {ns.output}", file=sys.stderr)
        return 0 if all(r["failed"] == 0 for r in results) else 1
    finally:
        if proc is not None:
            stop_server(proc)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
