"""Helpers for the server tests: the real two-process server (an engine-core process over a tiny random model on
CPU, the HTTP app on 127.0.0.1 and a free port), and a long stream that watches for stalls beside a bad request.

`serve_inproc` runs the HTTP app in a thread of the test process (so a test can look at the client's stats and
metrics); `serve_subprocess` runs `nanovllm serve` as its own process (for signals and exit codes). Either way
the engine core is its own process.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
import uvicorn

from nanovllm import SamplingParams
from nanovllm.config import EngineArgs
from nanovllm.server.api import build_app
from nanovllm.server.cli import load_tokenizer
from nanovllm.server.config import ServerConfig
from nanovllm.server.core_client import EngineCoreClient

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
API_KEY = "sk-test-key"
MODEL = "tiny-qwen3"
MAX_MODEL_LEN = 512
ENGINE_KW = dict(device="cpu", max_model_len=MAX_MODEL_LEN, kvcache_block_size=16, num_kvcache_blocks=640)
PROMPT = "The quick brown fox jumps over the lazy dog"
CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hello to the world."}]
MAX_GAP_S = 1.0      # a stream beside a bad request must never wait longer than this between chunks


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A running in-process server: `url`, `client` (EngineCoreClient), `app`, `http` (httpx, with the key),
    `openai` (the official client), `llm` (offline reference on the same checkpoint, if asked for)."""

    def stop(self):
        self.http.close()
        self.openai.close()
        self.uvicorn.should_exit = True
        self.thread.join(30)
        self.client.close()


def serve_inproc(path: str, *, config: ServerConfig | None = None, make_core=None, step_timeout=60.0,
                 **engine_kw) -> Server:
    srv = Server()
    srv.path = path
    kw = {"step_timeout": step_timeout} if make_core is None else {"step_timeout": step_timeout,
                                                                   "make_core": make_core}
    srv.client = EngineCoreClient(EngineArgs.from_kwargs(path, **{**ENGINE_KW, **engine_kw}), **kw)
    srv.client.start(timeout=120)
    config = config or ServerConfig(served_model_names=(MODEL,), api_key=API_KEY)
    srv.app = build_app(srv.client, load_tokenizer(path, required=True), config)
    srv.app.state.lifecycle.stop = lambda: setattr(srv.uvicorn, "should_exit", True)
    port = free_port()
    srv.uvicorn = uvicorn.Server(uvicorn.Config(srv.app, host="127.0.0.1", port=port, log_level="warning",
                                                timeout_graceful_shutdown=2))
    srv.thread = threading.Thread(target=srv.uvicorn.run, daemon=True)
    srv.thread.start()
    deadline = time.monotonic() + 30
    while not srv.uvicorn.started:
        assert srv.thread.is_alive() and time.monotonic() < deadline, "server did not start"
        time.sleep(0.02)
    srv.url = f"http://127.0.0.1:{port}"
    srv.openai = openai.OpenAI(base_url=srv.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)
    srv.http = httpx.Client(base_url=srv.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60)
    return srv


def offline(srv, prompts, **kw):
    kw.setdefault("temperature", 0.0)
    kw.setdefault("max_tokens", 16)
    return srv.llm.generate(prompts, SamplingParams(**kw), use_tqdm=False)


def wait_idle(srv, timeout=20.0):
    """Wait until the server has no request in flight and the engine core reports itself idle; its KV blocks."""
    deadline = time.monotonic() + timeout
    c = srv.client
    while c.num_live or c.stats.num_running or c.stats.num_waiting or srv.app.state.lifecycle.active:
        assert time.monotonic() < deadline, f"not idle: {c.num_live} live, {c.stats}"
        time.sleep(0.01)
    while c.stats.num_free_blocks != c.stats.num_blocks and time.monotonic() < deadline:
        time.sleep(0.01)      # the core's idle report may trail the last finish by a moment
    return c.stats.num_free_blocks, c.stats.num_blocks


def assert_all_blocks_free(srv):
    free, total = wait_idle(srv)
    assert free == total, f"{total - free} KV blocks still held"


def text_token_ids(tok):
    """Ids that decode to printable ASCII on their own: prompts made of them end in whole characters, so
    the streamed text (detokenized in the prompt's context) equals the offline text (decoded alone)."""
    return [i for i in range(len(tok)) if (s := tok.decode([i])) and s.isascii() and s.isprintable()]


class Beside:
    """Long greedy streams running in a thread while a test misbehaves: `check()` asserts that none waited more
    than MAX_GAP_S between chunks and that each one's text is the offline engine's. With `repeat`, streams follow
    one another until the block ends (for tests that take longer than one stream)."""

    MAX_TOKENS = 200

    def __init__(self, srv, max_tokens: int = MAX_TOKENS, repeat: bool = False):
        self.srv = srv
        self.max_tokens = max_tokens
        self.repeat = repeat
        refs = srv.__dict__.setdefault("beside_refs", {})
        if max_tokens not in refs:
            refs[max_tokens] = offline(srv, [PROMPT], max_tokens=max_tokens, ignore_eos=True)[0]["text"]
        self.ref = refs[max_tokens]
        self.texts, self.max_gap, self.error = [], 0.0, None
        self.started = threading.Event()
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        try:
            with httpx.Client(base_url=self.srv.url, headers={"Authorization": f"Bearer {API_KEY}"},
                              timeout=60) as http:
                while True:
                    self._one(http)
                    if not self.repeat or self.done.is_set():
                        return
        except BaseException as e:  # noqa: BLE001 - reported by check()
            self.error = e
            self.started.set()

    def _one(self, http):
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": self.max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True}
        text, last = "", None
        with http.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200, r.read()
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                now = time.monotonic()
                if last is not None:
                    self.max_gap = max(self.max_gap, now - last)
                last = now
                self.started.set()
                obj = json.loads(line[6:])
                assert "error" not in obj, obj
                text += obj["choices"][0]["text"]
        self.texts.append(text)

    def __enter__(self):
        self.thread.start()
        assert self.started.wait(30), "the stream beside never started"
        return self

    def __exit__(self, *exc):
        self.done.set()
        self.thread.join(120)

    def check(self):
        assert self.error is None, f"the stream beside failed: {self.error!r}"
        assert self.max_gap < MAX_GAP_S, f"the stream beside stalled for {self.max_gap:.2f}s"
        assert self.texts and all(t == self.ref for t in self.texts), "the stream beside changed its text"


def check_error(r, status, code=None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if code is not None:
        assert err["code"] == code, err
    return err


class Stream:
    """A streamed completion read in a thread: its text, and the error event that ended it (if one did)."""

    def __init__(self, url: str, headers: dict | None = None, **body):
        self.url, self.headers = url, headers or {}
        self.body = {"model": MODEL, "prompt": PROMPT, "temperature": 0, "ignore_eos": True, "stream": True, **body}
        self.text, self.error, self.done, self.status, self.exc = "", None, False, None, None
        self.first = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        assert self.first.wait(30), "the stream never started"

    def _run(self):
        try:
            with httpx.stream("POST", self.url + "/v1/completions", json=self.body, headers=self.headers,
                              timeout=60) as r:
                self.status = r.status_code
                if r.status_code != 200:
                    self.error = json.loads(r.read())["error"]
                for line in r.iter_lines():
                    if line == "data: [DONE]":
                        self.done = True
                    elif line.startswith("data: "):
                        obj = json.loads(line[6:])
                        if "error" in obj:
                            self.error = obj["error"]
                        else:
                            self.text += obj["choices"][0]["text"]
                    self.first.set()
        except Exception as e:  # noqa: BLE001 - looked at by the test
            self.exc = e
        finally:
            self.first.set()

    def join(self, timeout=30):
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the stream did not end"
        assert self.exc is None, f"the stream broke: {self.exc!r}"
        return self


# --- `nanovllm serve` as a process ---------------------------------------------------------------------------
class ServerProcess:
    def __init__(self, path: str, *args: str, timeout: float = 120.0):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "nanovllm", "serve", path, "--port", str(self.port), "--served-model-name",
               MODEL, "--uvicorn-log-level", "warning", "--disable-access-log", "--device", "cpu",
               "--max-model-len", str(MAX_MODEL_LEN), "--kvcache-block-size", "16", "--num-kvcache-blocks", "640",
               *args]
        env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        self.log: list[str] = []
        self._reader = threading.Thread(target=self._read_log, daemon=True)
        self._reader.start()
        deadline = time.monotonic() + timeout
        while True:
            assert self.proc.poll() is None, f"server exited ({self.proc.returncode}):\n{self.output()}"
            assert time.monotonic() < deadline, f"server did not become healthy:\n{self.output()}"
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)

    def _read_log(self):
        for line in self.proc.stdout:
            self.log.append(line.decode(errors="replace"))

    def output(self) -> str:
        return "".join(self.log[-200:])

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"server did not exit within {timeout}s:\n{self.output()}")

    def close(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
