"""`nanovllm serve MODEL [--host] [--port] [--api-key] [--served-model-name] [engine args]`.

Importing this module needs neither FastAPI nor uvicorn (the server is an optional extra); they are
imported when the command runs, with a clear message if they are missing.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import time

INSTALL_HINT = "the server needs the optional 'server' extra: pip install -e '.[server]' (FastAPI + uvicorn)"


def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    from nanovllm.cli import HelpFormatter, add_engine_args

    p = subparsers.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API",
                              formatter_class=HelpFormatter,
                              description="Serve MODEL over an OpenAI-compatible HTTP API "
                                          "(/v1/completions, /v1/chat/completions, /v1/models, /metrics...).")
    p.add_argument("model", metavar="MODEL", nargs="?", default=None,
                   help="checkpoint directory or Hugging Face id (default: a built-in tiny model, random weights)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (loopback only by default)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on")
    p.add_argument("--api-key", default=os.environ.get("NANOVLLM_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: $NANOVLLM_API_KEY, else none)")
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="model name(s) clients use in 'model' (default: the MODEL path)")
    p.add_argument("--uvicorn-log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug", "trace"])
    p.add_argument("--disable-access-log", action="store_true", help="do not log every HTTP request")
    add_engine_args(p)
    p.set_defaults(func=serve_command)
    return p


def server_engine_args(ns: argparse.Namespace):
    """The engine arguments of `nanovllm serve`: the flags given, with the fcfs scheduling policy unless one is
    asked for (requests arrive over time and each waits for its first token: prefill as early as possible)."""
    from nanovllm.cli import engine_kwargs
    from nanovllm.config import EngineArgs
    return EngineArgs.from_kwargs(ns.model, **{"scheduling_policy": "fcfs", **engine_kwargs(ns)})


def check_serve_args(ns: argparse.Namespace) -> None:
    """Network and engine flags checked before the model loads (ValueError naming the flag)."""
    from nanovllm.cli import check_engine_args, engine_kwargs
    if not 1 <= ns.port <= 65535:
        raise ValueError(f"--port must be in 1..65535, got {ns.port}")
    if not ns.host:
        raise ValueError("--host must not be empty")
    check_engine_args(ns.model, {"scheduling_policy": "fcfs", **engine_kwargs(ns)})


def serve_command(ns: argparse.Namespace) -> int:
    try:
        import fastapi  # noqa: F401
        import uvicorn
    except ImportError as e:
        print(f"nanovllm serve: {INSTALL_HINT} (missing: {e.name})", file=sys.stderr)
        return 1
    from nanovllm.cli import default_model
    from nanovllm.engine.llm_engine import LLMEngine
    from nanovllm.server.api import build_app

    check_serve_args(ns)
    ns.model = default_model(ns.model)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    t0 = time.perf_counter()
    engine = LLMEngine(server_engine_args(ns))
    print(f"[nanovllm] engine ready in {time.perf_counter() - t0:.1f}s (device={engine.config.device}, "
          f"dtype={engine.config.dtype}, max_model_len={engine.config.max_model_len}, "
          f"kv blocks={engine.block_manager.num_blocks})", file=sys.stderr)
    try:
        app = build_app(engine, ns.served_model_name, ns.api_key)
        names = ", ".join(app.state.server.names)
        print(f"[nanovllm] serving {names} on http://{ns.host}:{ns.port}/v1"
              + (" (API key required)" if ns.api_key else ""), file=sys.stderr)
        uvicorn.run(app, host=ns.host, port=ns.port, log_level=ns.uvicorn_log_level,
                    access_log=not ns.disable_access_log, timeout_keep_alive=30, timeout_graceful_shutdown=5)
    finally:
        engine.shutdown()
    return 0
