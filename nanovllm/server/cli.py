"""`nanovllm serve MODEL [--host] [--port] [--api-key] [--served-model-name] [server limits] [engine args]`.

With several nodes (`--nnodes N --node-rank R --master-addr A`, docs/scale-out.md) node 0 serves as usual and the
others run `nanovllm serve MODEL --headless ...`: only their tensor-parallel ranks (distributed/headless.py).

Two processes: this one (HTTP, tokenization, detokenization) and the engine core it starts (the engine and its
tensor-parallel workers), see docs/server.md; with --data-parallel-size D, D engine cores (docs/scale-out.md).
Importing this module needs neither FastAPI nor uvicorn (the server is an optional extra); they are imported
when the command runs, with a clear message if they are missing.
Exit status: 0 after a clean shutdown (SIGTERM/SIGINT), 1 if the engine died, 2 for a bad configuration.
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
import time

INSTALL_HINT = "the server needs the optional 'server' extra: pip install -e '.[server]' (FastAPI + uvicorn)"


def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    from nanovllm.cli import HelpFormatter, add_engine_args
    from nanovllm.server.config import ServerConfig
    from nanovllm.server.dp_client import AFFINITY_SLACK

    d = ServerConfig()
    p = subparsers.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API",
                              formatter_class=HelpFormatter,
                              description="Serve MODEL over an OpenAI-compatible HTTP API "
                                          "(/v1/completions, /v1/chat/completions, /v1/models, /metrics...).")
    p.add_argument("model", metavar="MODEL", nargs="?", default=None,
                   help="checkpoint directory or Hugging Face id (default: a built-in tiny model, random weights)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (loopback only by default)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on")
    p.add_argument("--api-key", default=None,   # (the environment's key is read later: --help must not show it)
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: $NANOVLLM_API_KEY, else none)")
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="model name(s) clients use in 'model' (default: the MODEL path)")
    p.add_argument("--max-request-body-bytes", type=int, default=d.max_request_body_bytes,
                   help="larger request bodies are refused with 413")
    p.add_argument("--trust-request-chat-template", action="store_true",
                   help="let requests bring their own chat template (default: refused with 400)")
    p.add_argument("--chat-template-timeout", type=float, default=d.chat_template_timeout,
                   help="seconds a chat template may take to render")
    p.add_argument("--engine-step-timeout", type=float, default=d.engine_step_timeout,
                   help="seconds without a finished step, with requests in flight, after which the engine counts "
                        "as stalled and the server exits with status 1")
    p.add_argument("--graceful-shutdown-timeout", type=float, default=d.graceful_shutdown_timeout,
                   help="on SIGTERM/SIGINT, seconds requests in flight get to finish")
    p.add_argument("--data-parallel-size", "-dp", type=int, default=d.data_parallel_size,
                   help="engine cores behind this server, each with --tensor-parallel-size GPUs of its own (core i: "
                        "GPUs i*tp..(i+1)*tp-1 of those visible; on CPU all run on the CPU); a request goes to the "
                        "least-loaded core, or to the core that was last sent its first KV block unless that core's "
                        f"load exceeds the least by more than {AFFINITY_SLACK} sequences")
    p.add_argument("--uvicorn-log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug", "trace"], help="uvicorn's log level")
    p.add_argument("--disable-access-log", action="store_true", help="do not log every HTTP request")
    p.add_argument("--headless", action="store_true",
                   help="a node other than the leader (--node-rank >= 1): run only its tensor-parallel ranks, no API "
                        "server, until the leader shuts down")
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
    config = server_config(ns)   # the server's own limits
    kwargs = engine_kwargs(ns)
    node_rank, nnodes = kwargs.get("node_rank") or 0, kwargs.get("nnodes") or 1
    if ns.headless and node_rank == 0:
        raise ValueError(f"--headless runs a node other than the leader: give --node-rank 1..nnodes-1 "
                         f"(nnodes={nnodes}, node_rank=0); node 0 runs nanovllm serve without --headless")
    if node_rank > 0 and not ns.headless:
        raise ValueError(f"node_rank={node_rank}: only node 0 serves the API; run the other nodes with --headless")
    check_engine_args(ns.model, {"scheduling_policy": "fcfs", **kwargs})
    if config.data_parallel_size > 1:
        from nanovllm.config import EngineArgs
        data_parallel_envs(EngineArgs.from_kwargs(ns.model or ".", **kwargs), config.data_parallel_size)


def data_parallel_envs(args, data_parallel_size: int) -> list[dict[str, str]]:
    """Each engine core's environment (its GPUs); ValueError if this machine has too few GPUs for them all."""
    from nanovllm.config import resolve_device
    from nanovllm.server.dp_client import core_envs
    device = resolve_device(args)
    if device.type == "cuda" and device.index is not None:
        raise ValueError(f"--device {args.device} pins every engine core to one GPU; with --data-parallel-size "
                         f"{data_parallel_size} use --device cuda (core i gets its own GPUs; choose them with "
                         f"CUDA_VISIBLE_DEVICES)")
    return core_envs(data_parallel_size, args.tensor_parallel_size, device.type)


def server_config(ns: argparse.Namespace):
    from nanovllm.server.config import ServerConfig
    return ServerConfig(served_model_names=tuple(ns.served_model_name or ()),
                        api_key=ns.api_key or os.environ.get("NANOVLLM_API_KEY") or None,
                        max_request_body_bytes=ns.max_request_body_bytes,
                        trust_request_chat_template=ns.trust_request_chat_template,
                        chat_template_timeout=ns.chat_template_timeout, engine_step_timeout=ns.engine_step_timeout,
                        graceful_shutdown_timeout=ns.graceful_shutdown_timeout,
                        data_parallel_size=ns.data_parallel_size)


def load_tokenizer(path: str, required: bool):
    """The tokenizer the API process uses (the engine core loads its own); None if there is none and none is
    required (random-weight benchmarks on a bare config.json: token-id prompts only)."""
    from transformers import AutoTokenizer
    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as e:  # noqa: BLE001 - surfaced as a clear user error
        if required:
            raise ValueError(f"could not load a tokenizer from {path!r}: {e}") from e
        logging.getLogger(__name__).warning("no tokenizer in %s: only token-id prompts are accepted", path)
        return None


def make_uvicorn_server(app, **config):
    """A uvicorn server whose first SIGTERM/SIGINT drains the app (`Lifecycle.drain`) instead of stopping at
    once; a second one stops it at once."""
    import uvicorn

    life = app.state.lifecycle

    class Server(uvicorn.Server):
        signalled = False

        def handle_exit(self, sig, frame):
            # (not uvicorn's: it would re-raise the signal after a graceful exit, so the exit status would not be 0)
            if self.signalled or not self.started:
                self.should_exit = True
                self.force_exit = self.signalled
                return
            self.signalled = True
            loop = life.loop
            loop.call_soon_threadsafe(lambda: loop.create_task(life.drain()))

    server = Server(uvicorn.Config(app, **config))
    life.stop = lambda: setattr(server, "should_exit", True)
    return server


def listen_socket(host: str, port: int) -> socket.socket:
    """The server's socket, bound before the engine cores start: the port is held from then on (their worker
    processes open ports of their own: a port picked free and bound only after them could be taken meanwhile), and
    a port in use is an error at once, not after the model has loaded. ValueError naming the address."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port} (--host / --port): {e.strerror or e}") from None
    return sock


def headless_command(ns: argparse.Namespace) -> int:
    """`nanovllm serve --headless`: this node's tensor-parallel ranks until the leader shuts down (0), fails (1)."""
    from nanovllm.cli import default_model
    from nanovllm.distributed.headless import NodeFailed, run_headless

    check_serve_args(ns)
    ns.model = default_model(ns.model)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s [headless] %(name)s: %(message)s")
    try:
        return run_headless(server_engine_args(ns))
    except (NodeFailed, RuntimeError) as e:
        print(f"nanovllm serve --headless: {e}", file=sys.stderr)
        return 1


def serve_command(ns: argparse.Namespace) -> int:
    if ns.headless:
        return headless_command(ns)
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        print(f"nanovllm serve: {INSTALL_HINT} (missing: {e.name})", file=sys.stderr)
        return 1
    check_serve_args(ns)
    sock = listen_socket(ns.host, ns.port)
    try:
        return _serve(ns, sock)
    finally:
        sock.close()


def _serve(ns: argparse.Namespace, sock: socket.socket) -> int:
    """The server on `sock` until it stops: engine cores, the app, uvicorn. Returns the exit status."""
    from nanovllm.cli import default_model
    from nanovllm.server.api import build_app
    from nanovllm.server.core_client import EngineCoreClient
    from nanovllm.server.dp_client import DataParallelClient
    from nanovllm.utils.hub import resolve_model_dir

    ns.model = default_model(ns.model)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # the pipe threads (core_client.py) wait for the GIL while the event loop works: at most 1 ms, not Python's
    # default 5 ms, between a request and its hand-off to the engine core (or a step's outputs and the loop)
    sys.setswitchinterval(0.001)
    args = server_engine_args(ns)
    config = server_config(ns)
    # the API process's own tokenizer, from where the engine core finds it too (a Hugging Face id: its cache)
    tok_dir = resolve_model_dir(args.tokenizer, args.tokenizer_revision, args.download_dir, "tokenizer") \
        if args.tokenizer is not None else resolve_model_dir(args.model, args.revision, args.download_dir)
    tokenizer = load_tokenizer(tok_dir, required=args.load_format != "dummy")
    t0 = time.perf_counter()
    dp = config.data_parallel_size
    if dp == 1:
        client = EngineCoreClient(args, step_timeout=config.engine_step_timeout)
    else:
        client = DataParallelClient(args, dp, step_timeout=config.engine_step_timeout,
                                    envs=data_parallel_envs(args, dp))
    signal.signal(signal.SIGTERM, signal.default_int_handler)   # a SIGTERM during start-up stops it cleanly too
    try:
        client.start()
        for i, c in enumerate(client.cores if dp > 1 else [client]):
            env = " ".join(f"{k}={v}" for k, v in (c.env or {}).items())
            print(f"[nanovllm] engine core{f' {i}' if dp > 1 else ''} ready in {time.perf_counter() - t0:.1f}s "
                  f"(pid {c.info.pid}, device={c.info.device}{', ' + env if env else ''}, dtype={c.info.dtype}, "
                  f"max_model_len={c.info.max_model_len}, kv blocks={c.info.num_kvcache_blocks})", file=sys.stderr)
        app = build_app(client, tokenizer, config)
        names = ", ".join(app.state.server.names)
        print(f"[nanovllm] serving {names} on http://{ns.host}:{ns.port}/v1"
              + (" (API key required)" if config.api_key else ""), file=sys.stderr)
        server = make_uvicorn_server(app, host=ns.host, port=ns.port, log_level=ns.uvicorn_log_level,
                                     access_log=not ns.disable_access_log, timeout_keep_alive=30,
                                     timeout_graceful_shutdown=5)
        server.run(sockets=[sock])
        return app.state.lifecycle.exit_code
    except KeyboardInterrupt:
        return 0
    finally:
        client.close()
