"""How the server fails and stops: a step that raises (the requests in flight fail, the server goes on), an engine
core that dies or stalls (503 everywhere, exit status 1), and SIGTERM (drain, then exit status 0).

The stall test stops a tensor-parallel worker with SIGSTOP, which used to hang the server while /health said
200; the step watchdog turns it into an engine error."""
from __future__ import annotations

import os
import signal
import sys
import threading
import time
from types import SimpleNamespace

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

sys.path.append(os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                             "benchmarks"))  # (after the installed packages: no shadowing)

from online_bench import spawned_children  # noqa: E402

from nanovllm import SamplingParams  # noqa: E402
from tests.server.faulty_core import POISON, make_faulty_core  # noqa: E402
from tests.server.server_helpers import (  # noqa: E402
    MODEL,
    PROMPT,
    ServerProcess,
    Stream,
    assert_all_blocks_free,
    check_error,
    serve_inproc,
)


def running(url: str) -> int:
    text = httpx.get(url + "/metrics").text
    return int(float(next(line for line in text.splitlines()
                          if line.startswith("nanovllm:num_requests_running")).split()[-1]))


def gone(pid: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except OSError:
            return True
        time.sleep(0.05)
    return False


# --- in this process: a core that fails, then dies ------------------------------------------------------------
@pytest.fixture(scope="module")
def faulty(tiny_path):
    srv = serve_inproc(tiny_path, make_core=make_faulty_core)
    stops = []
    srv.app.state.lifecycle.stop = lambda: stops.append(time.monotonic())   # stay up to be looked at
    srv.stops = stops
    yield srv
    srv.stop()


def test_failed_step_fails_the_requests_in_flight_and_the_server_goes_on(faulty, srv):
    r = faulty.http.post("/v1/completions", json={"model": MODEL, "prompt": POISON + [1, 2], "max_tokens": 10})
    check_error(r, 500, "engine_error")
    assert "simulated device failure" in r.json()["error"]["message"]
    assert_all_blocks_free(faulty)
    with pytest.raises(openai.APIError, match="simulated"):     # a streamed request gets an error event
        list(faulty.openai.completions.create(model=MODEL, prompt=POISON + [3], max_tokens=10, stream=True))
    assert_all_blocks_free(faulty)
    ref = srv.llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)[0]
    r = faulty.openai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0)
    assert r.choices[0].text == ref["text"]
    assert httpx.get(faulty.url + "/health").status_code == 200
    assert faulty.client.metrics.finished["error"] == 2


def test_dead_engine_core_is_503_and_the_server_asks_to_stop(faulty):
    stream = Stream(faulty.url, headers=faulty.http.headers, max_tokens=450)
    non_streamed = {}
    t = threading.Thread(target=lambda: non_streamed.update(r=faulty.http.post(
        "/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 450, "ignore_eos": True})))
    t.start()
    time.sleep(0.2)
    os.kill(faulty.client.pid, signal.SIGKILL)
    stream.join()
    t.join(30)
    assert stream.status == 200 and stream.text and stream.done, stream.error
    assert stream.error is not None and stream.error["code"] == "engine_unavailable"
    check_error(non_streamed["r"], 503, "engine_unavailable")
    assert httpx.get(faulty.url + "/health").status_code == 503
    check_error(faulty.http.post("/v1/completions", json={"model": MODEL, "prompt": "x"}), 503, "engine_unavailable")
    err = check_error(faulty.http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]}),
                      503)
    assert "exited" in err["message"] and "SIGKILL" in err["message"]
    deadline = time.monotonic() + 10
    while not faulty.stops and time.monotonic() < deadline:
        time.sleep(0.05)
    assert faulty.stops and faulty.app.state.lifecycle.exit_code == 1


def test_first_signal_drains_and_a_second_one_stops_at_once():
    """SIGINT and SIGTERM reach the same handler (uvicorn's capture_signals): the first one drains, the next one
    stops the server at once."""
    from nanovllm.server.cli import make_uvicorn_server

    drains = []

    async def drain():
        pass

    loop = SimpleNamespace(call_soon_threadsafe=lambda fn: fn(),
                           create_task=lambda coro: (coro.close(), drains.append(1)))
    life = SimpleNamespace(loop=loop, drain=drain, stop=None)
    server = make_uvicorn_server(SimpleNamespace(state=SimpleNamespace(lifecycle=life)))
    server.started = True
    server.handle_exit(signal.SIGINT, None)
    assert drains == [1] and not server.should_exit
    server.handle_exit(signal.SIGTERM, None)
    assert server.should_exit and server.force_exit and drains == [1]
    server.should_exit = False
    life.stop()                                  # what the lifecycle calls once drained
    assert server.should_exit


# --- `nanovllm serve` as a process -----------------------------------------------------------------------------
def test_sigterm_drains_then_ends_what_is_left_and_exits_0(tiny_path):
    server = ServerProcess(tiny_path, "--max-model-len", "2048", "--graceful-shutdown-timeout", "2")
    try:
        long_stream = Stream(server.url, max_tokens=2000)
        results = {}

        def post(name, **body):
            results[name] = httpx.post(server.url + "/v1/completions", timeout=60,
                                       json={"model": MODEL, "prompt": PROMPT, "ignore_eos": True, **body})
        long_post = threading.Thread(target=post, args=("long",), kwargs={"max_tokens": 2000})
        long_post.start()
        deadline = time.monotonic() + 20
        while running(server.url) < 2:             # both long ones in the engine
            assert time.monotonic() < deadline, "the requests never ran"
            time.sleep(0.02)
        short_post = threading.Thread(target=post, args=("short",), kwargs={"max_tokens": 60})
        short_post.start()
        while running(server.url) < 3 and "short" not in results:     # the short one in flight too (or done)
            assert time.monotonic() < deadline, "the short request never ran"
            time.sleep(0.01)
        threads = [long_post, short_post]
        server.proc.send_signal(signal.SIGTERM)
        time.sleep(0.2)
        check_error(httpx.get(server.url + "/health"), 503, "server_shutting_down")      # still listening: 503
        check_error(httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "x"}), 503,
                    "server_shutting_down")
        for t in threads:
            t.join(30)
        long_stream.join()
        assert results["short"].status_code == 200, results["short"].text  # finished within the grace period
        assert results["short"].json()["usage"]["completion_tokens"] == 60
        check_error(results["long"], 503, "server_shutting_down")  # ended when it was over
        assert long_stream.status == 200 and long_stream.text and long_stream.done
        assert long_stream.error["code"] == "server_shutting_down"
        assert server.wait(30) == 0, server.output()
    finally:
        server.close()


def test_stalled_tensor_parallel_worker_trips_the_watchdog(tiny_path):
    server = ServerProcess(tiny_path, "--tensor-parallel-size", "2", "--engine-step-timeout", "2")
    stopped = None
    try:
        (core,) = spawned_children(server.proc.pid)
        workers = spawned_children(core)
        assert len(workers) == 2
        stream = Stream(server.url, max_tokens=450)
        stopped = workers[1]
        os.kill(stopped, signal.SIGSTOP)
        t0 = time.monotonic()
        stream.join()
        assert 1.5 < time.monotonic() - t0 < 10
        assert stream.error is not None and stream.error["code"] == "engine_unavailable" and stream.done
        assert "no progress" in stream.error["message"]
        check_error(httpx.get(server.url + "/health"), 503, "engine_unavailable")
        check_error(httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "x"}), 503,
                    "engine_unavailable")
        assert server.wait(30) == 1, server.output()
        assert gone(core) and all(gone(w) for w in workers)      # the core and its workers, the stopped one too
        stopped = None
    finally:
        if stopped is not None:
            os.kill(stopped, signal.SIGKILL)
        server.close()
