"""OpenAI-compatible HTTP server (`nanovllm serve`), built on an asynchronous wrapper of LLMEngine.

Only `async_engine` and `metrics` are importable without the server extra; `api` needs FastAPI and
`cli` imports FastAPI/uvicorn only when the `serve` command runs.
"""
from nanovllm.server.async_engine import AsyncEngine, EngineDeadError, RequestAbortedError, RequestFailedError

__all__ = ["AsyncEngine", "EngineDeadError", "RequestAbortedError", "RequestFailedError"]
