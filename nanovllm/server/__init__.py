"""OpenAI-compatible HTTP server (`nanovllm serve`): an API process in front of an engine-core process (or of
several: `dp_client`, docs/scale-out.md).

See docs/server.md. `core_client`, `dp_client`, `config` and `metrics` are importable without the server extra;
`api` and `serving` need FastAPI, and `cli` imports FastAPI/uvicorn only when the `serve` command runs.
"""
from nanovllm.server.config import ServerConfig
from nanovllm.server.core_client import EngineCoreClient, EngineDeadError, RequestFailedError
from nanovllm.server.dp_client import DataParallelClient

__all__ = ["DataParallelClient", "EngineCoreClient", "EngineDeadError", "RequestFailedError", "ServerConfig"]
