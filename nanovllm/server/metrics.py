"""Server metrics in the Prometheus text exposition format (version 0.0.4), written by hand.

No dependency on prometheus_client: the few metric kinds needed here (counters, gauges, histograms with
fixed buckets) are simple to render. Request latencies are measured in the API process, as its clients see
them (from the request's submission to its tokens' arrival); the engine's gauges and counters come from the
EngineStats of the engine core's latest message (summed over the cores of a data-parallel server, which adds
a few series per core, labelled `engine`).
"""
from __future__ import annotations

import math
import threading
from dataclasses import dataclass

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
                0.4, 0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0)


def _escape_label(v: str) -> str:
    return str(v).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(labels: dict) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{k}="{_escape_label(v)}"' for k, v in labels.items()) + "}"


def _num(v: float) -> str:
    if isinstance(v, bool):
        v = int(v)
    if isinstance(v, int):
        return str(v)
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(float(v))


class Histogram:
    def __init__(self, buckets: tuple[float, ...]):
        self.bounds = tuple(sorted(buckets))
        self.counts = [0] * (len(self.bounds) + 1)   # last: +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, v: float) -> None:
        for i, b in enumerate(self.bounds):
            if v <= b:
                self.counts[i] += 1
                break
        else:
            self.counts[-1] += 1
        self.sum += v
        self.count += 1

    def lines(self, name: str, labels: dict) -> list[str]:
        out, acc = [], 0
        for b, c in zip(self.bounds + (math.inf,), self.counts, strict=True):
            acc += c
            out.append(f"{name}_bucket{_labels({**labels, 'le': _num(float(b))})} {acc}")
        out.append(f"{name}_sum{_labels(labels)} {_num(self.sum)}")
        out.append(f"{name}_count{_labels(labels)} {self.count}")
        return out


@dataclass(frozen=True)
class EngineShare:
    """One engine core's part behind a data-parallel server (server/dp_client.py), for the `engine`-labelled
    metrics: engine requests the router sent it, samples of them in flight, its prefix cache hits and queries."""
    engine: int
    routed: int
    in_flight: int
    prefix_hits: int
    prefix_queries: int


class ServerMetrics:
    """Request-level metrics recorded by the API process; gauges and engine counters come from EngineStats."""

    FINISH_REASONS = ("stop", "length", "abort", "error")

    def __init__(self):
        self.lock = threading.Lock()
        self.ttft = Histogram(TTFT_BUCKETS)
        self.tpot = Histogram(TPOT_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)
        self.finished = dict.fromkeys(self.FINISH_REASONS, 0)

    def record_finished(self, reason: str | None, ttft: float | None, tpot: float | None, e2e: float | None):
        with self.lock:
            key = reason if reason in self.finished else "error"
            self.finished[key] += 1
            if ttft is not None:
                self.ttft.observe(max(0.0, ttft))
            if tpot is not None:
                self.tpot.observe(max(0.0, tpot))
            if e2e is not None:
                self.e2e.observe(max(0.0, e2e))

    def record_aborted(self, n: int = 1) -> None:
        with self.lock:
            self.finished["abort"] += n

    def render(self, stats, model_name: str, engines: tuple[EngineShare, ...] = ()) -> str:
        """The exposition text; `stats` is the engine's latest EngineStats (engine/core_protocol.py), summed over
        the cores of a data-parallel server, whose `engines` add a series per core (label `engine`)."""
        lab = {"model_name": model_name}
        lines: list[str] = []

        def metric(name, kind, help_, samples):
            lines.append(f"# HELP {name} {help_}")
            lines.append(f"# TYPE {name} {kind}")
            lines.extend(samples)

        def simple(name, kind, help_, value, extra=None):
            metric(name, kind, help_, [f"{name}{_labels({**lab, **(extra or {})})} {_num(value)}"])

        simple("nanovllm:num_requests_running", "gauge", "Requests in the running batch.", stats.num_running)
        simple("nanovllm:num_requests_waiting", "gauge", "Requests waiting to be scheduled.", stats.num_waiting)
        simple("nanovllm:kv_cache_usage_perc", "gauge", "Fraction of KV cache blocks in use (0 to 1).",
               float(stats.kv_usage))
        simple("nanovllm:kv_cache_free_blocks", "gauge", "Free KV cache blocks.", stats.num_free_blocks)
        simple("nanovllm:kv_cache_total_blocks", "gauge", "KV cache blocks in all.", stats.num_blocks)
        simple("nanovllm:prompt_tokens_total", "counter", "Prompt tokens computed (prefill).",
               stats.prompt_tokens)
        simple("nanovllm:generation_tokens_total", "counter", "Tokens generated.", stats.generation_tokens)
        simple("nanovllm:num_preemptions_total", "counter", "Sequences preempted for lack of KV blocks.",
               stats.num_preemptions)
        simple("nanovllm:prefix_cache_queries_total", "counter", "Prefix cache lookups.", stats.prefix_queries)
        simple("nanovllm:prefix_cache_hits_total", "counter", "Prefix cache hits.", stats.prefix_hits)
        if stats.spec_decode:  # speculative decoding (vLLM's names)
            simple("nanovllm:spec_decode_num_drafts_total", "counter", "Sequence-steps that verified draft tokens.",
                   stats.spec_num_drafts)
            simple("nanovllm:spec_decode_num_draft_tokens_total", "counter", "Draft tokens verified.",
                   stats.spec_num_draft_tokens)
            simple("nanovllm:spec_decode_num_accepted_tokens_total", "counter", "Draft tokens accepted.",
                   stats.spec_num_accepted_tokens)
        if engines:
            for name, kind, help_, attr in (
                    ("nanovllm:engine_requests_routed_total", "counter",
                     "Engine requests the data-parallel router sent to the core.", "routed"),
                    ("nanovllm:engine_requests_in_flight", "gauge",
                     "Sequences sent to the core and not finished (what the router balances).", "in_flight"),
                    ("nanovllm:engine_prefix_cache_hits_total", "counter", "Prefix cache hits of the core.",
                     "prefix_hits"),
                    ("nanovllm:engine_prefix_cache_queries_total", "counter", "Prefix cache lookups of the core.",
                     "prefix_queries")):
                metric(name, kind, help_, [f"{name}{_labels({**lab, 'engine': str(e.engine)})} "
                                           f"{_num(getattr(e, attr))}" for e in engines])
        with self.lock:
            metric("nanovllm:request_success_total", "counter", "Requests finished, by finish reason.",
                   [f"nanovllm:request_success_total{_labels({**lab, 'finished_reason': r})} {n}"
                    for r, n in self.finished.items()])
            metric("nanovllm:time_to_first_token_seconds", "histogram",
                   "Time from request arrival to its first token.",
                   self.ttft.lines("nanovllm:time_to_first_token_seconds", lab))
            metric("nanovllm:time_per_output_token_seconds", "histogram",
                   "Mean time between output tokens of a request, after the first.",
                   self.tpot.lines("nanovllm:time_per_output_token_seconds", lab))
            metric("nanovllm:e2e_request_latency_seconds", "histogram",
                   "Time from request arrival to its last token.",
                   self.e2e.lines("nanovllm:e2e_request_latency_seconds", lab))
        return "\n".join(lines) + "\n"
