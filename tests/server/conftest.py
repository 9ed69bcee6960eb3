"""Fixtures of the server tests (helpers in server_helpers.py): one tiny checkpoint, one server shared by the tests
that need no special set-up, with an offline LLM on the same checkpoint as the reference."""
from __future__ import annotations

import importlib.util

import pytest

from nanovllm import LLM
from nanovllm.utils.tiny_model import build_tiny_checkpoint

# without the server extra (and the test clients) there is nothing to test here
if any(importlib.util.find_spec(m) is None for m in ("fastapi", "uvicorn", "openai", "httpx")):
    collect_ignore_glob = ["test_*.py"]
else:
    from tests.server.server_helpers import ENGINE_KW, serve_inproc


@pytest.fixture(scope="session")
def tiny_path(tmp_path_factory) -> str:
    return str(build_tiny_checkpoint(tmp_path_factory.mktemp("tiny-server"), "qwen3", overwrite=True))


@pytest.fixture(scope="session")
def srv(tiny_path):
    """One server for the functional, abuse, property and soak tests, with an offline reference `llm`."""
    s = serve_inproc(tiny_path)
    s.llm = LLM(tiny_path, **ENGINE_KW)
    yield s
    s.stop()
    s.llm.shutdown()


