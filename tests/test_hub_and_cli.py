"""Hugging Face model ids from a local hub cache (offline, no network), and the command line's checks."""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys

import pytest

from nanovllm import LLM, SamplingParams

REV = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def hub_cache(tiny_ckpt, tmp_path, monkeypatch):
    """A huggingface_hub cache holding tiny-org/tiny-qwen3 (models--org--name/snapshots/<rev>/ + refs/main), and
    offline mode on: a lookup that misses the cache cannot reach the network."""
    import huggingface_hub.constants as hub_constants
    repo = tmp_path / "hub" / "models--tiny-org--tiny-qwen3"
    shutil.copytree(tiny_ckpt("qwen3"), repo / "snapshots" / REV)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(REV)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    return str(tmp_path / "hub")


def test_hugging_face_id_loads_from_the_local_cache(hub_cache, tiny_ckpt):
    ref = LLM(tiny_ckpt("qwen3"), device="cpu", kvcache_block_size=16)
    want = ref.generate(["Hello"], SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)[0]["token_ids"]
    llm = LLM("tiny-org/tiny-qwen3", download_dir=hub_cache, device="cpu", kvcache_block_size=16,
              trust_remote_code=True)
    assert llm.engine.config.model_dir.endswith(os.path.join("snapshots", REV))
    assert llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)[0]["token_ids"] == want
    same = LLM("tiny-org/tiny-qwen3", download_dir=hub_cache, revision=REV, tokenizer="tiny-org/tiny-qwen3",
               device="cpu", kvcache_block_size=16)
    assert same.engine.config.model_dir == llm.engine.config.model_dir


def test_missing_hugging_face_id_is_one_clear_error(hub_cache):
    with pytest.raises(ValueError, match="'no-org/no-model'.*Hugging Face.*HF_HUB_OFFLINE"):
        LLM("no-org/no-model", download_dir=hub_cache, device="cpu")
    with pytest.raises(ValueError, match="does not exist"):
        LLM("./no/such/dir", device="cpu")
    with pytest.raises(TypeError, match="trust_remote_code"):
        LLM("x", trust_remote_code="yes")


def _cli(*args, timeout=120):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}   # as a user's shell has it
    return subprocess.run([sys.executable, "-m", "nanovllm", *args], capture_output=True, text=True, env=env,
                          timeout=timeout, cwd=os.path.dirname(os.path.dirname(__file__)))


@pytest.mark.parametrize("args, match", [
    (["serve", "--port", "99999"], "--port"),
    (["generate", "--temperature", "-1"], "temperature"),
    (["generate", "--n", "0"], "n must be"),
    pytest.param(["serve", "--attention-backend", "triton"], "triton", marks=pytest.mark.skipif(
        __import__("torch").cuda.is_available(), reason="a GPU is there")),
    pytest.param(["generate", "--attention-backend", "triton"], "triton", marks=pytest.mark.skipif(
        __import__("torch").cuda.is_available(), reason="a GPU is there")),
])
def test_cli_checks_arguments_before_loading(args, match):
    r = _cli(*args)
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and match in lines[0] and "Traceback" not in r.stderr, r.stderr
    assert "tiny model" not in r.stderr                           # nothing was loaded


def test_serve_on_a_port_in_use_fails_before_loading():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        r = _cli("serve", "--host", "127.0.0.1", "--port", str(taken.getsockname()[1]))
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "cannot listen on 127.0.0.1:" in lines[0] and "in use" in lines[0], r.stderr
    assert "tiny model" not in r.stderr                           # nothing was loaded


def test_cli_help_shows_defaults():
    for cmd in ("generate", "serve"):
        r = _cli(cmd, "--help")
        assert r.returncode == 0 and "(default: 256)" in r.stdout      # --max-num-seqs
    assert "(default: 8000)" in r.stdout and "MODEL" in r.stdout


def test_cli_generate_n_logprobs_and_summary(tiny_ckpt, capsys):
    from nanovllm.cli import main
    assert main(["generate", "--model", tiny_ckpt("qwen3"), "--prompt", "Hi", "--n", "2", "--logprobs", "1",
                 "--max-tokens", "3", "--quiet", "--device", "cpu", "--kvcache-block-size", "16"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert sum(line.startswith("Output ") for line in out) == 2 and sum("rank" in line for line in out) == 6
    assert out[-1].startswith("[nanovllm] 1 requests, 6 tokens in ") and out[-1].endswith(" tok/s")


def test_serve_without_a_model_uses_the_tiny_one(monkeypatch, capsys):
    pytest.importorskip("fastapi")
    import types

    import nanovllm.server.cli as serve_cli
    from nanovllm.cli import main
    seen = {}

    def fake_server(app, **kw):   # the app is built over a started engine core; it is not served
        seen.update(app=app, **kw)
        return types.SimpleNamespace(run=lambda sockets: seen.update(bound=[s.getsockname()[1] for s in sockets]))
    monkeypatch.setattr(serve_cli, "make_uvicorn_server", fake_server)
    assert main(["serve", "--port", "8123", "--device", "cpu", "--max-model-len", "256", "--kvcache-block-size", "16",
                 "--num-kvcache-blocks", "32"]) == 0
    err = capsys.readouterr().err
    assert seen["port"] == 8123 and "RANDOM weights" in err and "engine core ready" in err
    assert seen["bound"] == [8123]   # the socket it serves on, bound before the engine core started
    assert seen["app"].state.server.client.info.max_model_len == 256


def test_unusable_tiny_model_dir_and_tp_timeouts_are_one_line_errors(tmp_path, monkeypatch, capsys):
    from nanovllm.cli import main
    from nanovllm.distributed.executor import _env_timeout
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    monkeypatch.setenv("NANOVLLM_TINY_MODEL_DIR", str(blocker / "tiny"))
    assert main(["generate", "--prompt", "hi", "--max-tokens", "2"]) == 2
    assert "could not write the built-in tiny model" in capsys.readouterr().err
    for bad in ("abc", "-5", "nan", "inf"):
        monkeypatch.setenv("NANOVLLM_TP_STEP_TIMEOUT", bad)
        with pytest.raises(ValueError, match="NANOVLLM_TP_STEP_TIMEOUT must be a number of seconds"):
            _env_timeout("NANOVLLM_TP_STEP_TIMEOUT")
    for off in ("", "0", "none"):
        monkeypatch.setenv("NANOVLLM_TP_STEP_TIMEOUT", off)
        assert _env_timeout("NANOVLLM_TP_STEP_TIMEOUT") is None
    monkeypatch.setenv("NANOVLLM_TP_STEP_TIMEOUT", "2.5")
    assert _env_timeout("NANOVLLM_TP_STEP_TIMEOUT") == 2.5
