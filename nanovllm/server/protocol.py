"""Request bodies of the OpenAI-compatible API (pydantic models) and the errors they raise.

Like OpenAI, fields the server does not know are ignored; a known field with the wrong type is a 400
(validation is strict: "1" is not an int, true is not a number). Values are range-checked by
SamplingParams itself, whose ValueError/TypeError also becomes a 400. A body that is not JSON, nests deeper
than Python's parser goes, or holds a lone UTF-16 surrogate (which no tokenizer or UTF-8 writer can take) is a
400 too.
"""
from __future__ import annotations

import json
import re
import sys
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from nanovllm.sampling_params import MAX_LOGPROBS, MAX_N, SamplingParams, StructuredOutputsParams

MAX_CHOICES = 1024   # prompts x n of one request: each choice is a sequence of the engine
# stop strings, and bad words, of one request: the engine core tokenizes the bad words and matches the stop strings
# on its loop, where every other request waits (20,000 bad words: 0.7 s of tokenizing)
MAX_WORDS = 1024


class APIError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    _TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
              405: "invalid_request_error", 413: "invalid_request_error", 422: "invalid_request_error",
              500: "internal_server_error", 503: "service_unavailable"}

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None):  # noqa: A002 - OpenAI's field name
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or self._TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param, code="invalid_value" if param else None)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Strict):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class _GenerationRequest(_Strict):
    """Fields shared by /v1/completions and /v1/chat/completions."""
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    n: int | None = 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool | None = False
    min_tokens: int | None = 0
    skip_special_tokens: bool | None = True
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[int] | None = None          # vLLM's extensions from here on
    bad_words: list[str] | None = None
    include_stop_str_in_output: bool | None = False
    # OpenAI's {"type": "text" | "json_object" | "json_schema", "json_schema": {"name", "schema", "strict"}}
    response_format: dict[str, Any] | None = None
    # vLLM's {"json" | "regex" | "choice" | "grammar" | "json_object": ...}
    structured_outputs: dict[str, Any] | None = None
    user: str | None = None
    return_tokens_as_token_ids: bool | None = False   # vLLM's extension: logprob tokens as "token_id:ID"

    def check_common(self) -> None:
        n = 1 if self.n is None else self.n
        if not 1 <= n <= MAX_N:
            raise bad_request(f"n must be between 1 and {MAX_N}, got {n}", "n")
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed when stream is true", "stream_options")

    def structured(self) -> StructuredOutputsParams | None:
        """response_format / structured_outputs as StructuredOutputsParams (a 400 if malformed)."""
        if self.structured_outputs is not None and self.response_format not in (None, {"type": "text"}):
            raise bad_request("give response_format or structured_outputs, not both", "response_format")
        if self.structured_outputs is not None:
            try:
                return StructuredOutputsParams(**self.structured_outputs)
            except (ValueError, TypeError) as e:
                raise bad_request(f"structured_outputs: {e}", "structured_outputs") from None
        rf = self.response_format
        if rf is None:
            return None
        kind = rf.get("type")
        if kind == "text":
            return None
        if kind == "json_object":
            return StructuredOutputsParams(json_object=True)
        if kind == "json_schema":
            js = rf.get("json_schema")
            schema = js.get("schema") if isinstance(js, dict) else None
            if not isinstance(schema, dict):
                raise bad_request("response_format.json_schema.schema must be a JSON schema object", "response_format")
            return StructuredOutputsParams(json=schema)
        raise bad_request(f"response_format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
                          "response_format")

    @property
    def num_samples(self) -> int:
        return 1 if self.n is None else self.n

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def sampling_params(self, max_tokens: int | None, logprobs: int | None, **extra) -> SamplingParams:
        return make_sampling_params(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k is None else self.top_k,
            min_p=0.0 if self.min_p is None else self.min_p,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens or 0,
            ignore_eos=bool(self.ignore_eos),
            stop=self.stop or None,
            stop_token_ids=self.stop_token_ids or None,
            seed=self.seed,
            logprobs=logprobs,
            skip_special_tokens=True if self.skip_special_tokens is None else self.skip_special_tokens,
            n=self.num_samples,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            logit_bias=self.logit_bias or None,
            allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words or None,
            include_stop_str_in_output=bool(self.include_stop_str_in_output),
            structured_outputs=self.structured(),
            **extra,
        )


_PARAM_NAMES = ("temperature", "top_p", "top_k", "min_p", "max_tokens", "min_tokens", "ignore_eos", "stop_token_ids",
                "stop", "seed", "logprobs", "skip_special_tokens", "n", "best_of", "presence_penalty",
                "frequency_penalty", "repetition_penalty", "logit_bias", "allowed_token_ids", "bad_words",
                "include_stop_str_in_output", "structured_outputs")


def make_sampling_params(**kw) -> SamplingParams:
    try:
        return SamplingParams(**kw)
    except (ValueError, TypeError) as e:
        raise bad_request(str(e), guess_param(str(e))) from None


def guess_param(message: str) -> str | None:
    m = re.match(r"(?:SamplingParams\.)?([a-z_]+)", message)
    if m and m.group(1) in _PARAM_NAMES:
        return m.group(1)
    if m and m.group(1) == "prompt":
        return "prompt"
    if m and m.group(1) in ("StructuredOutputsParams", "structured_outputs"):
        return "structured_outputs"
    return None


class CompletionRequest(_GenerationRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16            # OpenAI's default for the legacy completions endpoint
    logprobs: int | None = None
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = None

    def check(self) -> None:
        self.check_common()
        if self.echo:
            raise bad_request("echo is not supported by this server", "echo")
        if self.suffix:
            raise bad_request("suffix is not supported by this server", "suffix")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise bad_request(f"logprobs must be between 0 and {MAX_LOGPROBS}, got {self.logprobs}", "logprobs")

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise bad_request("prompt must not be empty", "prompt")
        if isinstance(p[0], int):
            return [list(p)]
        return list(p)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    # Messages may carry fields this server does not use (name, tool_calls...): ignored.
    model_config = ConfigDict(extra="ignore", strict=True)
    role: str
    content: str | list[dict[str, Any]] | None = None

    def text(self, i: int) -> str:
        c = self.content
        if c is None:
            raise bad_request(f"messages[{i}].content is required (a string or a list of text parts)",
                              f"messages.{i}.content")
        if isinstance(c, str):
            return c
        out = []
        for j, part in enumerate(c):
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad_request(f"messages[{i}].content[{j}]: only text content parts are supported",
                                  f"messages.{i}.content.{j}")
            out.append(part["text"])
        return "".join(out)


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    add_generation_prompt: bool | None = True
    chat_template: str | None = None                  # vLLM's: a client's own template (only if trusted)
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None

    def check(self) -> None:
        self.check_common()
        if not self.messages:
            raise bad_request("messages must not be empty", "messages")
        if self.top_logprobs is not None:
            if not self.logprobs:
                raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
            if not 0 <= self.top_logprobs <= MAX_LOGPROBS:
                raise bad_request(f"top_logprobs must be between 0 and {MAX_LOGPROBS}, got {self.top_logprobs}",
                                  "top_logprobs")
        if self.tools:
            raise bad_request("tools are not supported by this server", "tools")

    @property
    def effective_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def engine_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def conversation(self) -> list[dict]:
        return [{"role": m.role, "content": m.text(i)} for i, m in enumerate(self.messages)]


class TokenizeRequest(_Strict):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool | None = True
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int] = Field(default_factory=list)


_FRIENDLY = {
    "prompt": "prompt must be a string, a list of strings, a list of token ids or a list of lists of token ids",
    "stop": "stop must be a string or a list of strings",
}


# a surrogate as a \uD800-\uDFFF escape, or encoded as UTF-8 bytes (json.loads lets those through too)
_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")


def _lone_surrogate_path(obj) -> str | None:
    """Where a string holding a lone surrogate sits in a parsed body (a dotted path, printable), or None.
    Iterative: the body may be deep."""
    stack = [(obj, "")]
    while stack:
        x, path = stack.pop()
        if isinstance(x, str):
            try:
                x.encode("utf-8")
            except UnicodeEncodeError:
                return path or "(the body)"
        elif isinstance(x, dict):
            for k, v in x.items():
                name = k.encode("utf-8", "backslashreplace").decode("utf-8")
                key_path = f"{path}.{name}" if path else name
                stack.append((k, key_path))
                stack.append((v, key_path))
        elif isinstance(x, list):
            stack.extend((v, f"{path}.{i}") for i, v in enumerate(x))
    return None


def parse_body(raw: bytes, model_cls: type[BaseModel]):
    """JSON bytes -> a validated request model, or an APIError(400)."""
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None
    except RecursionError:
        raise APIError(400, f"the request body nests deeper than {sys.getrecursionlimit()} levels",
                       code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object", code="invalid_json")
    # rare: a pair of escapes is a valid character, a lone surrogate is not text
    if _SURROGATE.search(raw) and (where := _lone_surrogate_path(data)) is not None:
        raise APIError(400, f"{where}: a string holds a lone UTF-16 surrogate, which is not valid text",
                       param=where.split(".")[0], code="invalid_value")
    try:
        return model_cls.model_validate(data)
    except RecursionError:
        raise APIError(400, "the request body nests too deep", code="invalid_json") from None
    except ValidationError as e:
        err = e.errors()[0]
        loc = err.get("loc") or ()
        param = str(loc[0]) if loc else None
        top = ".".join(str(x) for x in loc) if loc else None
        if err.get("type") == "missing":  # the field's whole path: messages.0.role, not messages
            raise APIError(400, f"missing required field {top!r}", param=top, code="missing_required_field") \
                from None
        if param in _FRIENDLY and len(loc) > 1 and not isinstance(loc[1], int):
            msg = _FRIENDLY[param]     # a union: pydantic reports every alternative
        else:
            msg = f"{top}: {err.get('msg')}" if top else str(err.get("msg"))
        raise APIError(400, msg, param=param, code="invalid_type") from None
