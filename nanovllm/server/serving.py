"""The OpenAI endpoints: a request body in, engine requests out to the engine core, the response back.

    body (size-capped) -> parse + validate (protocol.py) -> prompts to token ids, off the loop (preprocess.py)
      -> EngineCoreClient.submit -> RequestGroup.changed() per step -> text (streaming.py) -> JSON or SSE

Everything a client can get wrong is answered 400 before the engine core sees the request. A streamed
response submits its requests when its body starts (a response that never starts leaks nothing) and writes one
piece per wake-up: the chunks of every choice that moved. A client that goes away, streamed or not, has its
requests aborted at once.
"""
from __future__ import annotations

import asyncio
import time
import uuid

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from nanovllm.server.core_client import EngineCoreClient, EngineDeadError, RequestFailedError
from nanovllm.server.dp_client import DataParallelClient
from nanovllm.server.preprocess import Preprocessor
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
from nanovllm.server.streaming import (
    SSE_DONE,
    ChoiceText,
    Chunks,
    TokenStrings,
    chat_logprobs,
    completion_logprobs,
    sse,
)


class ServerClosingError(RuntimeError):
    """The server is shutting down: requests still running past the grace period are ended with this."""


def engine_error(e: BaseException) -> APIError:
    """The OpenAI-shaped error for a request the engine could not finish."""
    if isinstance(e, RequestFailedError):
        if e.status >= 500:
            return APIError(e.status, str(e), code="engine_error")
        return APIError(e.status, str(e), param=guess_param(str(e)), code="invalid_value")
    if isinstance(e, ServerClosingError):
        return APIError(503, str(e), code="server_shutting_down")
    return APIError(503, str(e), code="engine_unavailable")


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, or a 413 as soon as it is known to exceed `limit` bytes (declared or received)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"the request body ({declared} bytes) exceeds this server's limit of {limit} bytes",
                       code="request_too_large")
    parts, size = [], 0
    async for part in request.stream():
        size += len(part)
        if size > limit:
            raise APIError(413, f"the request body exceeds this server's limit of {limit} bytes",
                           code="request_too_large")
        parts.append(part)
    return b"".join(parts)


class _Choice:
    """A choice of the response: its engine request and sample, its prompt, its text."""

    __slots__ = ("index", "request_id", "sample", "prompt_ids", "params", "text", "text_offset")

    def __init__(self, index, request_id, sample, prompt_ids, params, tokenizer, incremental):
        self.index, self.request_id, self.sample = index, request_id, sample
        self.prompt_ids, self.params = prompt_ids, params
        self.text = ChoiceText(tokenizer, prompt_ids, params, incremental)
        self.text_offset = 0


class OpenAIServer:
    def __init__(self, client: EngineCoreClient | DataParallelClient, tokenizer, names: list[str], pre: Preprocessor,
                 max_request_body_bytes: int):
        self.client = client
        self.tokenizer = tokenizer
        self.names = names
        self.pre = pre
        self.max_body = max_request_body_bytes
        self.token_str = TokenStrings(tokenizer)
        self.created = int(time.time())

    def check_model(self, model: str | None) -> str:
        if model is None or model == "":
            return self.names[0]
        if model not in self.names:
            raise APIError(404, f"the model `{model}` does not exist", param="model", code="model_not_found")
        return model

    def _check_alive(self) -> None:
        if not self.client.is_alive:
            raise EngineDeadError(self.client.dead_reason or "the engine is not running")

    async def _parse(self, request: Request, cls):
        return parse_body(await read_body(request, self.max_body), cls)

    def _choices(self, base: str, prompt_ids: list[list[int]], params, incremental: bool) -> list[_Choice]:
        """One engine request per prompt, with the params' n samples (the engine shares the prompt's blocks between
        them; sample j is seeded with seed + j); one choice per prompt x sample, index = prompt * n + sample."""
        out = []
        n = params.n
        for i, ids in enumerate(prompt_ids):
            self.pre.check_params(ids, params)
            out += [_Choice(i * n + j, f"{base}-{i}", j, ids, params, self.tokenizer, incremental) for j in range(n)]
        return out

    def _submit(self, choices: list[_Choice], stream: bool):
        prompts = [(c.prompt_ids, [(c.request_id, c.params)]) for c in choices if c.sample == 0]
        return self.client.submit(prompts, stream=stream)

    async def _collect(self, request: Request, choices: list[_Choice]):
        """Run non-streamed requests to the end: (request id, sample) -> finished state (None: the client went
        away)."""
        group = self._submit(choices, stream=False)
        watcher = asyncio.create_task(_watch_disconnect(request, group))
        try:
            while not group.finished:
                await group.changed()
            return {(st.request_id, st.sample): st for st in group.states}
        except ClientGone:
            return None
        finally:
            watcher.cancel()
            group.close()

    # --- /v1/completions ---------------------------------------------------------------------------
    async def completions(self, request: Request):
        req: CompletionRequest = await self._parse(request, CompletionRequest)
        model = self.check_model(req.model)
        req.check()
        prompts = req.prompts()
        self.pre.check_fan_out(len(prompts), req.num_samples)
        params = req.sampling_params(req.max_tokens, req.logprobs, best_of=req.best_of)
        await self.pre.check_structured(params)
        prompt_ids = [await self.pre.prompt_ids(p) for p in prompts]
        base = f"cmpl-{uuid.uuid4().hex}"
        choices = self._choices(base, prompt_ids, params, incremental=bool(req.stream))
        self._check_alive()
        n_prompt = sum(len(ids) for ids in prompt_ids)
        created = int(time.time())
        as_ids = bool(req.return_tokens_as_token_ids)
        if req.stream:
            chunks = Chunks("completion", base, model, created, req.include_usage)
            return self._stream(request, choices, chunks, n_prompt, req.logprobs is not None, as_ids)
        finals = await self._collect(request, choices)
        if finals is None:
            return Response(status_code=499)
        out = []
        for c in choices:
            st = finals[c.request_id, c.sample]
            out.append({"index": c.index, "text": c.text.final(st),
                        "logprobs": completion_logprobs(st.logprobs, self.token_str, as_ids)[0]
                        if req.logprobs is not None else None,
                        "finish_reason": st.finish_reason, "stop_reason": st.stop_reason})
        completion_tokens = sum(len(st.token_ids) for st in finals.values())
        return JSONResponse({"id": base, "object": "text_completion", "created": created, "model": model,
                             "choices": out, "usage": _usage(n_prompt, completion_tokens)})

    # --- /v1/chat/completions ----------------------------------------------------------------------
    async def chat_completions(self, request: Request):
        req: ChatCompletionRequest = await self._parse(request, ChatCompletionRequest)
        model = self.check_model(req.model)
        req.check()
        self.pre.check_fan_out(1, req.num_samples)
        params = req.sampling_params(req.effective_max_tokens, req.engine_logprobs)
        await self.pre.check_structured(params)
        ids = await self.pre.chat_ids(req.conversation(), req.add_generation_prompt is not False,
                                      req.chat_template_kwargs, req.chat_template)
        base = f"chatcmpl-{uuid.uuid4().hex}"
        choices = self._choices(base, [ids], params, incremental=bool(req.stream))
        self._check_alive()
        created = int(time.time())
        as_ids = bool(req.return_tokens_as_token_ids)
        if req.stream:
            chunks = Chunks("chat", base, model, created, req.include_usage)
            return self._stream(request, choices, chunks, len(ids), bool(req.logprobs), as_ids)
        finals = await self._collect(request, choices)
        if finals is None:
            return Response(status_code=499)
        out = []
        for c in choices:
            st = finals[c.request_id, c.sample]
            out.append({"index": c.index, "message": {"role": "assistant", "content": c.text.final(st)},
                        "logprobs": {"content": chat_logprobs(st.logprobs, self.token_str, as_ids)}
                        if req.logprobs else None,
                        "finish_reason": st.finish_reason, "stop_reason": st.stop_reason})
        completion_tokens = sum(len(st.token_ids) for st in finals.values())
        return JSONResponse({"id": base, "object": "chat.completion", "created": created, "model": model,
                             "choices": out, "usage": _usage(len(ids), completion_tokens)})

    # --- streaming ---------------------------------------------------------------------------------
    def _stream(self, request: Request, choices: list[_Choice], chunks: Chunks, n_prompt: int, logprobs: bool,
                as_ids: bool) -> StreamingResponse:
        """The SSE response. Its requests are submitted when the body starts; engine failures end it with an
        error event; a disconnect (Starlette cancels the body) or any other exit aborts what still runs."""
        by_key = {(c.request_id, c.sample): c for c in choices}
        sent = dict.fromkeys(by_key, 0)     # tokens whose logprobs went out

        def piece(st) -> str:
            key = st.request_id, st.sample
            c = by_key[key]
            text = c.text.delta(st)
            if not (text or st.finished or len(st.token_ids) > sent[key]):
                return ""
            new_lp = st.logprobs[sent[key]:] if logprobs else None
            sent[key] = len(st.token_ids)
            if not logprobs and not st.finished:
                return chunks.text(c.index, text)
            choice = {"index": c.index}
            if chunks.chat:
                choice["delta"] = {"content": text} if text or not st.finished else {}
                choice["logprobs"] = {"content": chat_logprobs(new_lp, self.token_str, as_ids)} if logprobs else None
            else:
                choice["text"] = text
                if logprobs:
                    choice["logprobs"], c.text_offset = completion_logprobs(new_lp, self.token_str, as_ids,
                                                                            c.text_offset)
                else:
                    choice["logprobs"] = None
            choice["finish_reason"] = st.finish_reason
            choice["stop_reason"] = st.stop_reason
            return chunks.choice(choice)

        async def body():
            try:
                group = self._submit(choices, stream=True)
            except EngineDeadError as e:
                yield sse(engine_error(e).body()).encode()
                yield SSE_DONE
                return
            try:
                if chunks.chat:
                    yield "".join(chunks.choice({"index": c.index, "delta": {"role": "assistant", "content": ""},
                                                 "logprobs": None, "finish_reason": None})
                                  for c in choices).encode()
                while not group.finished:
                    out = "".join(piece(st) for st in await group.changed())
                    if out:
                        yield out.encode()
                if chunks.usage_field:
                    yield chunks.usage(_usage(n_prompt, sum(len(st.token_ids) for st in group.states))).encode()
                yield SSE_DONE
            except (RequestFailedError, EngineDeadError, ServerClosingError) as e:
                yield sse(engine_error(e).body()).encode()
                yield SSE_DONE
            finally:
                group.close()

        return StreamingResponse(body(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    # --- small endpoints ---------------------------------------------------------------------------
    def models(self) -> dict:
        info = self.client.info
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": self.created, "owned_by": "nanovllm",
             "root": info.model_dir, "parent": None, "max_model_len": info.max_model_len} for name in self.names]}

    async def tokenize(self, request: Request) -> dict:
        req: TokenizeRequest = await self._parse(request, TokenizeRequest)
        self.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("give exactly one of 'prompt' or 'messages'", "prompt")
        if req.messages is not None:
            conv = [{"role": m.role, "content": m.text(i)} for i, m in enumerate(req.messages)]
            ids = await self.pre.chat_ids(conv, req.add_generation_prompt is not False, req.chat_template_kwargs,
                                          req.chat_template)
        else:
            add = True if req.add_special_tokens is None else req.add_special_tokens
            ids = await self.pre.encode(req.prompt, add_special_tokens=add)
        return {"tokens": ids, "count": len(ids), "max_model_len": self.client.info.max_model_len}

    async def detokenize(self, request: Request) -> dict:
        req: DetokenizeRequest = await self._parse(request, DetokenizeRequest)
        self.check_model(req.model)
        tok = self.pre.need_tokenizer("tokens")
        V = self.client.info.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < V]
        if bad:
            raise bad_request(f"token id {bad[0]} is outside the vocabulary [0, {V})", "tokens")
        try:
            text = tok.decode(req.tokens, skip_special_tokens=False)
        except Exception as e:  # noqa: BLE001
            raise bad_request(f"could not detokenize: {e}", "tokens") from None
        return {"prompt": text}


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


async def _watch_disconnect(request: Request, group) -> None:
    """Wake the group's reader when the client disconnects (the body has been read already)."""
    try:
        while True:
            msg = await request.receive()
            if msg.get("type") == "http.disconnect":
                group.fail(ClientGone())
                return
    except asyncio.CancelledError:
        raise
    except Exception:  # noqa: BLE001 - receive() not usable: rely on the response side's detection
        return


class ClientGone(RuntimeError):
    """The client of a non-streamed request disconnected."""
