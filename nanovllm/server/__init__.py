"""OpenAI-compatible HTTP server (`nanovllm serve`): an API process in front of an engine-core process.

See docs/server.md. `core_client`, `config` and `metrics` are importable without the server extra; `api` and
`serving` need FastAPI, and `cli` imports FastAPI/uvicorn only when the `serve` command runs.
"""
from nanovllm.server.config import ServerConfig
from nanovllm.server.core_client import EngineCoreClient, EngineDeadError, RequestFailedError

__all__ = ["EngineCoreClient", "EngineDeadError", "RequestFailedError", "ServerConfig"]
