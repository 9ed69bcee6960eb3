"""The OpenAI-compatible HTTP app (FastAPI) over an EngineCoreClient (or a DataParallelClient of several):
`build_app(client, tokenizer, config)`.

    POST /v1/completions        POST /v1/chat/completions     GET /v1/models
    GET  /health                GET  /metrics                 POST /tokenize    POST /detokenize   GET /version

Around the routes (serving.py): an API-key check, and the server's lifecycle (`Lifecycle`):
- serving: /health is 200;
- draining (SIGTERM/SIGINT, `Lifecycle.drain`): new requests are 503, /health is 503; requests in flight get up
  to `graceful_shutdown_timeout` seconds to finish, then open streams end with an SSE error event and the others
  with an OpenAI-shaped 503; then the server stops (exit code 0);
- engine dead (the engine core exited, reported EngineDead, or stalled past the watchdog): requests in flight end
  with an error at once, new ones are 503, /health is 503; once the requests in flight have been answered (and
  DEAD_LINGER_S has passed) the server stops with exit code 1, so that a supervisor restarts it.
"""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from nanovllm.server.config import ServerConfig
from nanovllm.server.core_client import EngineCoreClient, EngineDeadError, RequestFailedError
from nanovllm.server.dp_client import DataParallelClient
from nanovllm.server.metrics import CONTENT_TYPE
from nanovllm.server.preprocess import Preprocessor
from nanovllm.server.protocol import APIError
from nanovllm.server.serving import OpenAIServer, ServerClosingError, engine_error

logger = logging.getLogger(__name__)

EXIT_LINGER_S = 5.0   # after failing what was in flight, how long the server waits for those answers to go out
DEAD_LINGER_S = 1.0   # a dead server answers 503 for at least this long (health checks see 503, not a closed port)


def _error_response(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


def _header(scope, name: bytes) -> bytes:
    for k, v in scope.get("headers", ()):
        if k == name:
            return v
    return b""


class _ApiKeyMiddleware:
    """Pure ASGI middleware (it does not wrap streamed bodies): a Bearer key on /v1/*, /tokenize, /detokenize."""

    PROTECTED = ("/v1", "/tokenize", "/detokenize")

    def __init__(self, app, api_key: str):
        self.app = app
        self.key = api_key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope.get("method") != "OPTIONS" and \
                scope["path"].startswith(self.PROTECTED):
            auth = _header(scope, b"authorization")
            scheme, _, token = auth.partition(b" ")
            if not auth:
                err = APIError(401, "missing API key: send it as 'Authorization: Bearer KEY'", code="invalid_api_key")
            elif scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.key):
                err = APIError(401, "incorrect API key provided", code="invalid_api_key")
            else:
                err = None
            if err is not None:
                await _error_response(err)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class Lifecycle:
    """Whether the server takes requests, and how it stops (see the module docstring). `stop` is set by whoever
    runs the server: a callable that makes it exit (uvicorn's should_exit)."""

    GUARDED = ("/v1", "/tokenize", "/detokenize")

    def __init__(self, client: EngineCoreClient | DataParallelClient, graceful_shutdown_timeout: float):
        self.client = client
        self.grace = graceful_shutdown_timeout
        self.active = 0              # guarded HTTP requests being answered
        self.draining = False
        self.exit_code = 0
        self.stop = None
        self.loop: asyncio.AbstractEventLoop | None = None    # the server's, once it runs
        self._stopping = False

    @property
    def serving(self) -> bool:
        return not self.draining and self.client.is_alive

    def refusal(self) -> APIError:
        if self.draining:
            return APIError(503, "the server is shutting down", code="server_shutting_down")
        return APIError(503, f"the engine is not running: {self.client.dead_reason or 'it stopped'}",
                        code="engine_unavailable")

    def middleware(self, app):
        async def asgi(scope, receive, send):
            if scope["type"] != "http" or not scope["path"].startswith(self.GUARDED):
                await app(scope, receive, send)
                return
            if not self.serving:
                await _error_response(self.refusal())(scope, receive, send)
                return
            self.active += 1
            try:
                await app(scope, receive, send)
            finally:
                self.active -= 1
        return asgi

    async def _until_answered(self, timeout: float) -> bool:
        """Wait until no guarded request is being answered (True), or `timeout` seconds (False)."""
        deadline = self.loop.time() + timeout
        while self.active and self.loop.time() < deadline:
            await asyncio.sleep(0.05)
        return not self.active

    def _request_stop(self) -> None:
        if self.stop is not None:
            self.stop()

    async def drain(self) -> None:
        """Stop taking requests, give those in flight the grace period, end the rest, then stop the server."""
        if self.draining or self._stopping:
            return
        self.draining = True
        logger.info("shutting down: %d request(s) in flight get up to %gs to finish", self.active, self.grace)
        if not await self._until_answered(self.grace):
            n = self.client.fail_all(ServerClosingError("the server is shutting down and ended this request"))
            logger.warning("grace period over: ended %d request(s) still running", n)
            await self._until_answered(EXIT_LINGER_S)
        self._stopping = True
        self._request_stop()

    def engine_died(self, reason: str) -> None:
        """The client's death callback (on the event loop): exit non-zero once in flight requests are answered."""
        self.exit_code = 1
        logger.error("the engine is dead (%s): the server stops once the requests in flight are answered", reason)

        async def stop_later():
            await asyncio.gather(self._until_answered(max(self.grace, EXIT_LINGER_S)), asyncio.sleep(DEAD_LINGER_S))
            self._stopping = True
            self._request_stop()
        asyncio.get_running_loop().create_task(stop_later())


def build_app(client: EngineCoreClient | DataParallelClient, tokenizer, config: ServerConfig | None = None) -> FastAPI:
    """The FastAPI app over a started EngineCoreClient (attached to the app's event loop at start-up; closing it
    is its owner's job). `tokenizer`: the model's (None: token-id prompts only).

    `app.state`: `client`, `server` (OpenAIServer), `lifecycle` (set `lifecycle.stop` to let the app stop its
    server)."""
    config = config or ServerConfig()
    info = client.info
    if info is None:
        raise RuntimeError("start() the engine-core client before building the app")
    names = list(config.served_model_names) or [info.model_dir]
    pre = Preprocessor(tokenizer, vocab_size=info.vocab_size, max_model_len=info.max_model_len,
                       trust_request_chat_template=config.trust_request_chat_template,
                       chat_template_timeout=config.chat_template_timeout,
                       tensor_parallel_size=info.tensor_parallel_size)
    server = OpenAIServer(client, tokenizer, names, pre, config.max_request_body_bytes)
    life = Lifecycle(client, config.graceful_shutdown_timeout)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        life.loop = asyncio.get_running_loop()
        client.add_death_callback(life.engine_died)
        client.attach(life.loop)
        try:
            yield
        finally:
            pre.close()

    app = FastAPI(title="nanovllm OpenAI-compatible server", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.client = client
    app.state.server = server
    app.state.lifecycle = life
    app.add_middleware(life.middleware)     # inner: the key is checked first
    if config.api_key:
        app.add_middleware(_ApiKeyMiddleware, api_key=config.api_key)

    @app.exception_handler(APIError)
    async def _api_error(request, e: APIError):
        return _error_response(e)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, e: StarletteHTTPException):
        return _error_response(APIError(e.status_code, str(e.detail)))

    @app.exception_handler(EngineDeadError)
    async def _dead(request, e):
        return _error_response(engine_error(e))

    @app.exception_handler(RequestFailedError)
    async def _failed(request, e):
        return _error_response(engine_error(e))

    @app.exception_handler(ServerClosingError)
    async def _closing(request, e):
        return _error_response(engine_error(e))

    @app.exception_handler(ClientDisconnect)
    async def _gone(request, e):
        return Response(status_code=499)      # the client left before its request was read: nothing to do

    @app.exception_handler(Exception)
    async def _internal(request, e):
        logger.exception("unhandled error serving %s", request.url.path)
        return _error_response(APIError(500, f"internal server error: {type(e).__name__}"))

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await server.completions(request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await server.chat_completions(request)

    @app.get("/v1/models")
    async def models():
        return server.models()

    @app.get("/health")
    async def health():
        if not life.serving:
            return _error_response(life.refusal())
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics():
        return Response(client.render_metrics(names[0]), media_type=CONTENT_TYPE)

    @app.post("/tokenize")
    async def tokenize(request: Request):
        return await server.tokenize(request)

    @app.post("/detokenize")
    async def detokenize(request: Request):
        return await server.detokenize(request)

    @app.get("/version")
    async def version():
        from nanovllm import __version__
        return {"version": __version__}

    return app
