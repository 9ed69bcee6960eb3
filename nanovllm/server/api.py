"""The OpenAI-compatible HTTP API (FastAPI): `build_app(engine, served_model_name, api_key)`.

    POST /v1/completions        POST /v1/chat/completions     GET /v1/models
    GET  /health                GET  /metrics                 POST /tokenize    POST /detokenize

Requests are parsed and validated here, on the event loop (tokenization included), so a bad request is
answered with a 400 before anything reaches the engine and never disturbs the others. Valid ones go to
the AsyncEngine; a client that disconnects (streamed or not) has its requests aborted at once.
"""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import math
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from nanovllm.server import metrics as metrics_mod
from nanovllm.server.async_engine import AsyncEngine, EngineDeadError, RequestAbortedError, RequestFailedError
from nanovllm.server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    bad_request,
    guess_param,
    parse_body,
)

logger = logging.getLogger(__name__)

_RESERVED_TEMPLATE_KWARGS = ("conversation", "tokenize", "add_generation_prompt", "return_dict", "return_tensors")


def _error_response(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


def _finite(x: float) -> float:
    """JSON has no infinities: a -inf log-probability is sent as -9999.0."""
    return x if math.isfinite(x) else -9999.0


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


_SSE_DONE = "data: [DONE]\n\n"


class _ApiKeyMiddleware:
    """Pure ASGI middleware (it does not wrap streamed bodies): a Bearer key on /v1/*, /tokenize, /detokenize."""

    PROTECTED = ("/v1", "/tokenize", "/detokenize")

    def __init__(self, app, api_key: str):
        self.app = app
        self.key = api_key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope.get("method") != "OPTIONS" and \
                scope["path"].startswith(self.PROTECTED):
            auth = b""
            for k, v in scope.get("headers", ()):
                if k == b"authorization":
                    auth = v
                    break
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


class _ChoiceState:
    """Streaming bookkeeping of one choice: text sent so far (with a hold-back for partial stop strings)."""

    def __init__(self, index: int, params):
        self.index = index
        self.params = params
        self.hold = max((len(s) for s in params.stop_strings), default=1) - 1
        self.acc = ""
        self.sent = 0
        self.text_offset = 0
        self.num_tokens = 0
        self.finished = False

    def delta(self, out, decode) -> str:
        self.acc += out.new_text
        self.num_tokens = len(out.token_ids) if out.finished else self.num_tokens + len(out.new_token_ids)
        if out.finished:
            self.finished = True
            if self.params.stop_strings:
                final = out.text           # truncated at the stop string; never shorter than what was sent
            else:
                # The incremental detokenizer holds back a trailing incomplete character; the full decode
                # is what the offline engine returns.
                final = decode(out.token_ids, skip_special_tokens=self.params.skip_special_tokens)
                if not final.startswith(self.acc[:self.sent]):
                    final = self.acc
            d = final[self.sent:] if len(final) > self.sent else ""
            self.sent = max(self.sent, len(final))
            return d
        end = len(self.acc) - self.hold
        if end > self.sent:
            d = self.acc[self.sent:end]
            self.sent = end
            return d
        return ""


class OpenAIServer:
    def __init__(self, engine: AsyncEngine, names: list[str], api_key: str | None):
        self.engine = engine
        self.names = names
        self.api_key = api_key
        self.tokenizer = engine.tokenizer
        self.created = int(time.time())
        self._token_strs: dict[int, str] = {}

    # --- helpers -----------------------------------------------------------------------------------
    def check_model(self, model: str | None) -> str:
        if model is None or model == "":
            return self.names[0]
        if model not in self.names:
            raise APIError(404, f"the model `{model}` does not exist", param="model", code="model_not_found")
        return model

    def need_tokenizer(self, param: str | None = "prompt"):
        if self.tokenizer is None:
            raise bad_request("this server has no tokenizer: only token-id prompts are accepted", param)
        return self.tokenizer

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_str(self, tid: int, as_id: bool = False) -> str:
        if as_id:
            return f"token_id:{tid}"
        s = self._token_strs.get(tid)
        if s is None:
            if self.tokenizer is None:
                return f"token_id:{tid}"
            try:
                s = self.tokenizer.decode([tid], skip_special_tokens=False)
            except Exception:  # noqa: BLE001 - an id past the tokenizer (padded vocabulary)
                s = ""
            if len(self._token_strs) < 1_000_000:
                self._token_strs[tid] = s
        return s

    def encode_prompt(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise bad_request("prompt must not be empty", "prompt")
            return self.need_tokenizer().encode(prompt)
        return list(prompt)

    def chat_prompt(self, conversation: list[dict], add_generation_prompt: bool, kwargs: dict | None) -> list[int]:
        tok = self.need_tokenizer("messages")
        if not getattr(tok, "chat_template", None):
            raise bad_request("this model's tokenizer has no chat template; use /v1/completions", "messages")
        kwargs = {k: v for k, v in (kwargs or {}).items() if k not in _RESERVED_TEMPLATE_KWARGS}
        try:
            text = tok.apply_chat_template(conversation, tokenize=False, add_generation_prompt=add_generation_prompt,
                                           **kwargs)
        except Exception as e:  # noqa: BLE001 - a template that rejects the conversation
            raise bad_request(f"could not apply the chat template: {e}", "messages") from None
        return tok.encode(text, add_special_tokens=False)

    def validate(self, ids: list[int], params):
        if params.stop_strings:
            self.need_tokenizer("stop")
        try:
            return self.engine.engine.validate_request(ids, params)
        except (ValueError, TypeError) as e:
            raise bad_request(str(e), guess_param(str(e)) or "prompt") from None

    def build_requests(self, base_id: str, prompt_ids: list[list[int]], params):
        """(request id, ValidRequest) for every prompt, each with the request's n samples (the engine shares the
        prompt's blocks between them; sample j is seeded with seed + j)."""
        return [(f"{base_id}-{i}", self.validate(ids, params)) for i, ids in enumerate(prompt_ids)]

    @staticmethod
    def choice_index(reqs, n: int) -> dict[str, int]:
        """request id -> index of its sample 0's choice (choice index = prompt * n + sample)."""
        return {rid: k * n for k, (rid, _) in enumerate(reqs)}

    def completion_logprobs(self, entries: list[dict], as_ids: bool, state: _ChoiceState | None = None) -> dict:
        tokens, lps, tops, offsets = [], [], [], []
        off = state.text_offset if state is not None else 0
        for e in entries:
            s = self.token_str(e["token_id"], as_ids)
            tokens.append(s)
            lps.append(_finite(e["logprob"]))
            top = {self.token_str(t, as_ids): _finite(lp) for t, lp in e.get("top") or ()}
            top.setdefault(s, _finite(e["logprob"]))
            tops.append(top)
            offsets.append(off)
            off += len(s)
        if state is not None:
            state.text_offset = off
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}

    def chat_logprobs(self, entries: list[dict], as_ids: bool) -> list[dict]:
        out = []
        for e in entries:
            s = self.token_str(e["token_id"], as_ids)
            out.append({"token": s, "logprob": _finite(e["logprob"]), "bytes": list(s.encode("utf-8")),
                        "top_logprobs": [{"token": (ts := self.token_str(t, as_ids)), "logprob": _finite(lp),
                                          "bytes": list(ts.encode("utf-8"))} for t, lp in e.get("top") or ()]})
        return out

    @staticmethod
    def usage(prompt_tokens: int, completion_tokens: int) -> dict:
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens}

    async def collect(self, request: Request, stream) -> dict:
        """Wait for every request of a non-streamed call; abort them all if the client goes away."""
        watcher = asyncio.create_task(_watch_disconnect(request, stream))
        try:
            finals = {}
            async for out in stream:
                if out.finished:
                    finals[out.request_id, out.index] = out
            return finals
        finally:
            watcher.cancel()
            stream.close()

    # --- /v1/completions ---------------------------------------------------------------------------
    async def _finals(self, request: Request, reqs) -> dict | None:
        """Run non-streamed requests to the end: (request id, sample) -> final output (None: the client went
        away)."""
        try:
            return await self.collect(request, self.engine.submit(reqs, stream=False))
        except RequestAbortedError:
            return None

    async def completions(self, request: Request):
        req: CompletionRequest = parse_body(await request.body(), CompletionRequest)
        model = self.check_model(req.model)
        as_ids = bool(req.return_tokens_as_token_ids)
        req.check()
        prompts = req.prompts()
        params = req.sampling_params(req.max_tokens, req.logprobs, best_of=req.best_of)
        prompt_ids = [self.encode_prompt(p) for p in prompts]
        n = req.num_samples
        base = f"cmpl-{uuid.uuid4().hex}"
        reqs = self.build_requests(base, prompt_ids, params)
        index = self.choice_index(reqs, n)
        n_prompt = sum(len(ids) for ids in prompt_ids)
        created = int(time.time())
        if req.stream:
            return self._stream_response(request, reqs, lambda stream: self._stream_completions(
                stream, reqs, index, base, model, created, n_prompt, req))
        finals = await self._finals(request, reqs)
        if finals is None:
            return Response(status_code=499)
        choices = []
        completion_tokens = sum(len(out.token_ids) for out in finals.values())
        for key in sorted(finals, key=lambda k: index[k[0]] + k[1]):
            out = finals[key]
            choices.append({
                "index": index[key[0]] + key[1], "text": out.text,
                "logprobs": self.completion_logprobs(out.logprobs, as_ids) if req.logprobs is not None else None,
                "finish_reason": out.finish_reason, "stop_reason": out.stop_reason})
        return JSONResponse({"id": base, "object": "text_completion", "created": created, "model": model,
                             "choices": choices, "usage": self.usage(n_prompt, completion_tokens)})

    async def _stream_completions(self, stream, reqs, index, base, model, created, n_prompt, req):
        states = {(rid, j): _ChoiceState(index[rid] + j, valid.params) for rid, valid in reqs
                  for j in range(valid.params.n)}
        as_ids = bool(req.return_tokens_as_token_ids)
        usage_field = {"usage": None} if req.include_usage else {}

        def chunk(choices):
            return _sse({"id": base, "object": "text_completion", "created": created, "model": model,
                         "choices": choices, **usage_field})

        async for out in stream:
            st = states[out.request_id, out.index]
            text = st.delta(out, self.decode)
            if not (text or out.new_token_ids or out.finished):
                continue
            yield chunk([{
                "index": st.index, "text": text,
                "logprobs": self.completion_logprobs(out.new_logprobs or [], as_ids, st) if req.logprobs is not None
                else None,
                "finish_reason": out.finish_reason if out.finished else None,
                "stop_reason": out.stop_reason if out.finished else None}])
        if req.include_usage:
            yield _sse({"id": base, "object": "text_completion", "created": created, "model": model, "choices": [],
                        "usage": self.usage(n_prompt, sum(s.num_tokens for s in states.values()))})
        yield _SSE_DONE

    # --- /v1/chat/completions ----------------------------------------------------------------------
    async def chat_completions(self, request: Request):
        req: ChatCompletionRequest = parse_body(await request.body(), ChatCompletionRequest)
        model = self.check_model(req.model)
        as_ids = bool(req.return_tokens_as_token_ids)
        req.check()
        params = req.sampling_params(req.effective_max_tokens, req.engine_logprobs)
        ids = self.chat_prompt(req.conversation(), req.add_generation_prompt is not False, req.chat_template_kwargs)
        n = req.num_samples
        base = f"chatcmpl-{uuid.uuid4().hex}"
        reqs = self.build_requests(base, [ids], params)
        index = self.choice_index(reqs, n)
        created = int(time.time())
        if req.stream:
            return self._stream_response(request, reqs, lambda stream: self._stream_chat(
                stream, reqs, index, base, model, created, len(ids), req))
        finals = await self._finals(request, reqs)
        if finals is None:
            return Response(status_code=499)
        choices = []
        completion_tokens = sum(len(out.token_ids) for out in finals.values())
        for key in sorted(finals, key=lambda k: index[k[0]] + k[1]):
            out = finals[key]
            choices.append({
                "index": index[key[0]] + key[1], "message": {"role": "assistant", "content": out.text},
                "logprobs": {"content": self.chat_logprobs(out.logprobs, as_ids)} if req.logprobs else None,
                "finish_reason": out.finish_reason, "stop_reason": out.stop_reason})
        return JSONResponse({"id": base, "object": "chat.completion", "created": created, "model": model,
                             "choices": choices, "usage": self.usage(len(ids), completion_tokens)})

    async def _stream_chat(self, stream, reqs, index, base, model, created, n_prompt, req):
        states = {(rid, j): _ChoiceState(index[rid] + j, valid.params) for rid, valid in reqs
                  for j in range(valid.params.n)}
        as_ids = bool(req.return_tokens_as_token_ids)
        usage_field = {"usage": None} if req.include_usage else {}

        def chunk(choices):
            return _sse({"id": base, "object": "chat.completion.chunk", "created": created, "model": model,
                         "choices": choices, **usage_field})

        for st in sorted(states.values(), key=lambda s: s.index):
            yield chunk([{"index": st.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                          "finish_reason": None}])
        async for out in stream:
            st = states[out.request_id, out.index]
            text = st.delta(out, self.decode)
            if not (text or out.new_token_ids or out.finished):
                continue
            yield chunk([{
                "index": st.index, "delta": {"content": text} if text or not out.finished else {},
                "logprobs": {"content": self.chat_logprobs(out.new_logprobs or [], as_ids)} if req.logprobs else None,
                "finish_reason": out.finish_reason if out.finished else None,
                "stop_reason": out.stop_reason if out.finished else None}])
        if req.include_usage:
            yield _sse({"id": base, "object": "chat.completion.chunk", "created": created, "model": model,
                        "choices": [], "usage": self.usage(n_prompt, sum(s.num_tokens for s in states.values()))})
        yield _SSE_DONE

    # --- streaming plumbing ------------------------------------------------------------------------
    def _stream_response(self, request: Request, reqs, make_gen) -> StreamingResponse:
        """SSE of `make_gen(stream)`. The requests are submitted when the body starts, so a response that
        never starts leaks nothing. Engine failures end the stream with an error event; a disconnect (seen
        by our watcher, or by Starlette, which cancels the body) or any other exit aborts what still runs."""
        if not self.engine.is_running:
            raise EngineDeadError("the engine loop is not running")

        async def body():
            try:
                stream = self.engine.submit(reqs, stream=True)
            except EngineDeadError as e:
                yield _sse(APIError(503, str(e), code="engine_unavailable").body())
                yield _SSE_DONE
                return
            gen = make_gen(stream)
            watcher = asyncio.create_task(_watch_disconnect(request, stream))
            try:
                async for piece in gen:
                    yield piece
            except RequestAbortedError:
                return      # the client went away
            except (RequestFailedError, EngineDeadError) as e:
                err = APIError(500, str(e), code="engine_error")
                yield _sse(err.body())
                yield _SSE_DONE
            finally:
                watcher.cancel()
                stream.close()
                await gen.aclose()
        return StreamingResponse(body(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    # --- small endpoints ---------------------------------------------------------------------------
    def models(self) -> dict:
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": self.created, "owned_by": "nanovllm",
             "root": self.engine.engine.config.model_dir, "parent": None, "max_model_len": self.engine.max_model_len}
            for name in self.names]}

    async def tokenize(self, request: Request) -> dict:
        req: TokenizeRequest = parse_body(await request.body(), TokenizeRequest)
        self.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("give exactly one of 'prompt' or 'messages'", "prompt")
        if req.messages is not None:
            conv = [{"role": m.role, "content": m.text(i)} for i, m in enumerate(req.messages)]
            ids = self.chat_prompt(conv, req.add_generation_prompt is not False, req.chat_template_kwargs)
        else:
            add = True if req.add_special_tokens is None else req.add_special_tokens
            ids = self.need_tokenizer().encode(req.prompt, add_special_tokens=add)
        return {"tokens": ids, "count": len(ids), "max_model_len": self.engine.max_model_len}

    async def detokenize(self, request: Request) -> dict:
        req: DetokenizeRequest = parse_body(await request.body(), DetokenizeRequest)
        self.check_model(req.model)
        self.need_tokenizer("tokens")
        V = self.engine.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < V]
        if bad:
            raise bad_request(f"token id {bad[0]} is outside the vocabulary [0, {V})", "tokens")
        try:
            text = self.decode(req.tokens, skip_special_tokens=False)
        except Exception as e:  # noqa: BLE001
            raise bad_request(f"could not detokenize: {e}", "tokens") from None
        return {"prompt": text}


async def _watch_disconnect(request: Request, stream) -> None:
    """Abort the stream's requests when the client disconnects (the body has been read already)."""
    try:
        while True:
            msg = await request.receive()
            if msg.get("type") == "http.disconnect":
                stream.close()
                return
    except asyncio.CancelledError:
        raise
    except Exception:  # noqa: BLE001 - receive() not usable: rely on the response side's detection
        return


def build_app(engine, served_model_name: str | list[str] | None = None, api_key: str | None = None) -> FastAPI:
    """The FastAPI app over an LLMEngine (wrapped, and owned: shut down with the app) or an AsyncEngine.

    `app.state.engine` is the AsyncEngine (its `.engine` the LLMEngine), for in-process tests."""
    owns = not isinstance(engine, AsyncEngine)
    aeng = AsyncEngine(engine) if owns else engine
    if served_model_name is None or served_model_name == [] or served_model_name == "":
        names = [aeng.engine.config.model_dir]
    elif isinstance(served_model_name, str):
        names = [served_model_name]
    else:
        names = list(served_model_name)
    server = OpenAIServer(aeng, names, api_key)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        aeng.start()
        try:
            yield
        finally:
            if owns:
                await asyncio.get_running_loop().run_in_executor(None, aeng.shutdown)

    app = FastAPI(title="nanovllm OpenAI-compatible server", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.engine = aeng
    app.state.server = server
    if api_key:
        app.add_middleware(_ApiKeyMiddleware, api_key=api_key)

    @app.exception_handler(APIError)
    async def _api_error(request, e: APIError):
        return _error_response(e)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, e: StarletteHTTPException):
        return _error_response(APIError(e.status_code, str(e.detail)))

    @app.exception_handler(EngineDeadError)
    async def _dead(request, e):
        return _error_response(APIError(503, str(e), code="engine_unavailable"))

    @app.exception_handler(RequestFailedError)
    async def _failed(request, e):
        return _error_response(APIError(500, str(e), code="engine_error"))

    @app.exception_handler(ClientDisconnect)
    async def _gone(request, e):
        return Response(status_code=499)      # the client left before its request was read: nothing to do

    @app.exception_handler(Exception)
    async def _internal(request, e):
        logger.exception("unhandled error serving %s", request.url.path)
        return _error_response(APIError(500, f"internal server error: {type(e).__name__}: {e}"))

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
        if not aeng.is_running:
            return _error_response(APIError(503, "the engine loop is not running", code="engine_unavailable"))
        if not aeng.engine.runner.is_alive:      # e.g. a tensor-parallel worker died
            return _error_response(APIError(503, "the model executor has failed", code="engine_unavailable"))
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics():
        text = aeng.metrics.render(aeng.stats, names[0])
        return Response(text, media_type=metrics_mod.CONTENT_TYPE)

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
