"""`nanovllm serve --data-parallel-size 2`: two engine-core processes behind one API server, on CPU.

Greedy tokens equal the offline engine's whichever core ran them; requests spread over both cores; requests that
share a first KV block go to the same core (its prefix cache hits them); a core killed mid-stream fails its own
stream at once while the other core's stream finishes, and the server turns unhealthy and exits 1. The routing
rule and the GPU split are checked without processes."""
from __future__ import annotations

import os
import re
import signal
import threading
import time

import pytest

httpx = pytest.importorskip("httpx")

from nanovllm import SamplingParams  # noqa: E402
from nanovllm.server.cli import check_serve_args  # noqa: E402
from nanovllm.server.dp_client import choose_core, core_cuda_devices  # noqa: E402
from tests.server.server_helpers import (  # noqa: E402
    MODEL,
    ServerProcess,
    Stream,
    check_error,
    offline,
    text_token_ids,
)

BLOCK = 16     # ENGINE_KW's kvcache_block_size, which ServerProcess passes too


@pytest.fixture(scope="module")
def dp(tiny_path):
    server = ServerProcess(tiny_path, "--data-parallel-size", "2")
    server.core_pids = {int(i): int(pid) for i, pid in
                        re.findall(r"engine core (\d) ready in \S+ \(pid (\d+)", server.output())}
    assert sorted(server.core_pids) == [0, 1], server.output()
    yield server
    server.close()


def per_engine(url: str, name: str) -> dict[int, float]:
    text = httpx.get(url + "/metrics").text
    return {int(m[1]): float(m[2]) for m in re.finditer(rf'^nanovllm:{name}{{.*engine="(\d+)"}} (\S+)$', text, re.M)}


def total(url: str, name: str, **labels) -> float:
    text = httpx.get(url + "/metrics").text
    out = 0.0
    for line in text.splitlines():
        if line.startswith(f"nanovllm:{name}{{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            out += float(line.split()[-1])
    return out


def complete(url: str, prompt: list[int], max_tokens: int) -> list[int]:
    r = httpx.post(url + "/v1/completions", timeout=60, json={
        "model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "logprobs": 0,
        "return_tokens_as_token_ids": True})
    assert r.status_code == 200, r.text
    return [int(t.split(":")[1]) for t in r.json()["choices"][0]["logprobs"]["tokens"]]


def test_greedy_tokens_match_offline_and_both_cores_serve(dp, srv):
    vocab = text_token_ids(srv.llm.tokenizer)
    prompts = [[vocab[(7 * i + 3 * j) % len(vocab)] for j in range(5 + 3 * i)] for i in range(8)]
    max_tokens = [10 + i for i in range(8)]
    refs = srv.llm.generate(prompts, [SamplingParams(temperature=0, max_tokens=m) for m in max_tokens],
                            use_tqdm=False)
    routed0 = per_engine(dp.url, "engine_requests_routed_total")
    got: dict[int, list[int]] = {}
    threads = [threading.Thread(target=lambda i=i: got.__setitem__(i, complete(dp.url, prompts[i], max_tokens[i])))
               for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for i in range(8):
        assert got.get(i) == refs[i]["token_ids"], f"request {i}"
    routed = per_engine(dp.url, "engine_requests_routed_total")
    sent = [routed[e] - routed0.get(e, 0) for e in (0, 1)]
    assert sum(sent) == 8 and min(sent) >= 2, sent            # least-loaded: neither core is left idle
    for i in (0, 5):                                           # one at a time too (the idle cores take turns)
        assert complete(dp.url, prompts[i], max_tokens[i]) == refs[i]["token_ids"]
    # /metrics sums the cores (this module's server is fresh: these requests are all it ran)
    assert total(dp.url, "request_success_total", finished_reason="length") == 10
    assert total(dp.url, "generation_tokens_total") == sum(max_tokens) + max_tokens[0] + max_tokens[5]
    assert total(dp.url, "kv_cache_total_blocks") == 2 * 640
    try:
        from prometheus_client.parser import text_string_to_metric_families
    except ImportError:
        return
    fams = {f.name: f for f in text_string_to_metric_families(httpx.get(dp.url + "/metrics").text)}
    assert fams["nanovllm:engine_requests_routed"].type == "counter"
    assert sorted(s.labels["engine"] for s in fams["nanovllm:engine_requests_in_flight"].samples) == ["0", "1"]


def test_requests_sharing_a_first_block_go_to_the_same_core(dp, srv):
    vocab = text_token_ids(srv.llm.tokenizer)
    prefix = [vocab[(11 * j + 5) % len(vocab)] for j in range(BLOCK + 4)]
    routed0 = per_engine(dp.url, "engine_requests_routed_total")
    hits0 = per_engine(dp.url, "engine_prefix_cache_hits_total")
    for k in range(6):
        complete(dp.url, prefix + [vocab[k], vocab[k + 1]], 4)
    routed = per_engine(dp.url, "engine_requests_routed_total")
    hits = per_engine(dp.url, "engine_prefix_cache_hits_total")
    sent = {e: routed[e] - routed0.get(e, 0) for e in (0, 1)}
    home = max(sent, key=sent.get)
    assert sent[home] == 6 and sent[1 - home] == 0, sent
    assert hits[home] - hits0.get(home, 0) >= 5           # the five after the first found its block cached
    assert hits[1 - home] == hits0.get(1 - home, 0)
    # a prompt shorter than one block has no affinity: idle cores take turns
    short = [vocab[1], vocab[2], vocab[3]]
    for _ in range(2):
        complete(dp.url, short, 2)
    after = per_engine(dp.url, "engine_requests_routed_total")
    assert [after[e] - routed[e] for e in (0, 1)] == [1, 1]


def test_routing_rule():
    assert choose_core([0, 0], None, 16, 0) == 0 and choose_core([0, 0], None, 16, 1) == 1   # ties: round robin
    assert choose_core([3, 1, 1], None, 16, 0) == 1 and choose_core([3, 1, 1], None, 16, 2) == 2
    assert choose_core([17, 1], 0, 16, 1) == 0        # affinity within the slack
    assert choose_core([18, 1], 0, 16, 0) == 1        # ... not past it: the least-loaded core
    assert choose_core([5, 5], 1, 0, 0) == 1


def test_gpu_split_and_validation(tiny_path):
    assert core_cuda_devices(2, 2, ["0", "1", "2", "3"]) == [["0", "1"], ["2", "3"]]
    assert core_cuda_devices(3, 1, ["GPU-a", "GPU-b", "GPU-c"]) == [["GPU-a"], ["GPU-b"], ["GPU-c"]]
    with pytest.raises(ValueError, match=r"--data-parallel-size 2 x --tensor-parallel-size 2 needs 4 CUDA devices, "
                                         r"but 3 are visible"):
        core_cuda_devices(2, 2, ["0", "1", "2"])
    from nanovllm.cli import build_parser
    for bad in ("0", "-1"):
        ns = build_parser().parse_args(["serve", tiny_path, "--data-parallel-size", bad, "--device", "cpu"])
        with pytest.raises(ValueError, match="data_parallel_size must be an int >= 1"):
            check_serve_args(ns)
    with pytest.raises(SystemExit):                    # argparse: not an int
        build_parser().parse_args(["serve", tiny_path, "--data-parallel-size", "two"])


def test_a_killed_core_fails_its_requests_and_the_server_exits_1(dp, srv):
    """Last: it ends the server."""
    ref = offline(srv, ["second stream, elsewhere"], max_tokens=120, ignore_eos=True)[0]["text"]
    first = Stream(dp.url, prompt="first stream: a long one", max_tokens=450)
    deadline = time.monotonic() + 10
    while max(per_engine(dp.url, "engine_requests_in_flight").values()) < 1:
        assert time.monotonic() < deadline, "the first stream never ran"
        time.sleep(0.01)
    victim = max((load, e) for e, load in per_engine(dp.url, "engine_requests_in_flight").items())[1]
    second = Stream(dp.url, prompt="second stream, elsewhere", max_tokens=120)
    assert per_engine(dp.url, "engine_requests_in_flight")[1 - victim] == 1    # the idle core took it
    os.kill(dp.core_pids[victim], signal.SIGKILL)
    first.join(10)
    assert first.status == 200 and first.done and first.error["code"] == "engine_unavailable", first.error
    assert f"engine core {victim} of 2" in first.error["message"] and "SIGKILL" in first.error["message"]
    check_error(httpx.get(dp.url + "/health"), 503, "engine_unavailable")
    check_error(httpx.post(dp.url + "/v1/completions", json={"model": MODEL, "prompt": "x"}), 503,
                "engine_unavailable")
    second.join(30)                                    # the other core finishes what it holds
    assert second.error is None and second.done and second.text == ref, second.error
    assert dp.wait(30) == 1, dp.output()
