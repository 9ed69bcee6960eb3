"""Prompts in, validated engine requests out, with the tokenizer's work done off the event loop.

Tokenizing a large prompt or rendering a chat template takes time the event loop cannot give: every stream
would stall behind it. So that work runs in `TokenizerWorkers`, threads with a copy of the tokenizer each (a
fast tokenizer must not be used by two threads at once; its encoding releases the GIL). A chat template renders
under a time limit: past it the request is a 400 at once, and the render is interrupted by an exception raised
in its thread (`PyThreadState_SetAsyncExc`), which lands at the template's next Python bytecode: a runaway Jinja
loop stops; a single long C call (a huge string repeat) cannot be cut short and runs to its end first. Client
templates are refused unless the operator trusts them (`--trust-request-chat-template`).

The checks that need the engine's limits (vocabulary, context length) are made here too, and a structured-output
spec is parsed (not compiled: that needs the vocabulary's token masks, the engine core's job), so that a bad
request is a 400 before anything reaches the engine core: `max_tokens` past the context left is a 400 naming the limit,
as vLLM's and OpenAI's servers answer (the offline `LLM` stops such a request at the context's end instead, as
vLLM's offline engine does).
"""
from __future__ import annotations

import asyncio
import copy
import ctypes
import logging
import queue
import threading

from nanovllm.server.protocol import MAX_CHOICES, MAX_WORDS, APIError, bad_request

logger = logging.getLogger(__name__)

_RESERVED_TEMPLATE_KWARGS = ("conversation", "tokenize", "add_generation_prompt", "return_dict", "return_tensors")
_QUEUED, _RUNNING, _DONE, _CANCELLED = range(4)


class _Interrupted(BaseException):
    """Raised inside a worker thread whose job's caller gave up (a BaseException: templates' `except Exception`
    must not swallow it)."""


def _set_async_exc(thread_id: int, exc) -> None:
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id), ctypes.py_object(exc) if exc else None)


class _Job:
    __slots__ = ("fn", "args", "future", "loop", "lock", "state", "thread")

    def __init__(self, fn, args, loop):
        self.fn, self.args, self.loop = fn, args, loop
        self.future = loop.create_future()
        self.lock = threading.Lock()
        self.state = _QUEUED
        self.thread = 0


def _settle(fut: asyncio.Future, result, exc) -> None:
    if not fut.done():
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(result)


class TokenizerWorkers:
    """Threads for tokenizer work, each with its own copy of the tokenizer. `await run(fn, *args)` runs
    `fn(tokenizer, *args)` in one of them; with `timeout`, a job still running past it is interrupted."""

    def __init__(self, tokenizer, num_threads: int = 2):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._threads = []
        for i in range(num_threads):
            t = threading.Thread(target=self._work, args=(copy.deepcopy(tokenizer),), daemon=True,
                                 name=f"nanovllm-tokenizer-{i}")
            t.start()
            self._threads.append(t)

    async def run(self, fn, *args, timeout: float | None = None):
        """TimeoutError past `timeout`; a cancelled caller interrupts its job too."""
        job = _Job(fn, args, asyncio.get_running_loop())
        self._queue.put(job)
        try:
            return await asyncio.wait_for(job.future, timeout)
        except BaseException:
            self._interrupt(job)
            raise

    def close(self) -> None:
        for _ in self._threads:
            self._queue.put(None)

    @staticmethod
    def _interrupt(job: _Job) -> None:
        with job.lock:
            if job.state == _QUEUED:
                job.state = _CANCELLED
            elif job.state == _RUNNING:
                _set_async_exc(job.thread, _Interrupted)

    def _work(self, tokenizer) -> None:
        me = threading.get_ident()
        while True:
            job = self._queue.get()
            if job is None:
                return
            try:
                self._run(job, tokenizer, me)
            except _Interrupted:   # its caller has given up and waits for nothing
                pass

    @staticmethod
    def _run(job: _Job, tokenizer, me: int) -> None:
        with job.lock:
            if job.state == _CANCELLED:
                return
            job.state, job.thread = _RUNNING, me
        result = exc = None
        try:
            result = job.fn(tokenizer, *job.args)
        except Exception as e:  # noqa: BLE001 - handed to the caller
            exc = e
        finally:
            with job.lock:
                job.state = _DONE
            _set_async_exc(me, None)   # an interrupt that came too late is dropped here, not in the next job
        try:
            job.loop.call_soon_threadsafe(_settle, job.future, result, exc)
        except RuntimeError:   # the event loop is closed
            pass


def _check_spec(tok, check, spec) -> None:
    check(spec)


def _encode(tok, text: str, add_special_tokens: bool) -> list[int]:
    return tok.encode(text, add_special_tokens=add_special_tokens)


def _render_chat(tok, conversation, add_generation_prompt: bool, template: str | None, kwargs: dict) -> list[int]:
    if template is not None:
        kwargs = {**kwargs, "chat_template": template}
    text = tok.apply_chat_template(conversation, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs)
    return tok.encode(text, add_special_tokens=False)


class Preprocessor:
    """Tokenization, chat templates and the engine-limit checks of one server."""

    def __init__(self, tokenizer, *, vocab_size: int, max_model_len: int, trust_request_chat_template: bool = False,
                 chat_template_timeout: float = 5.0, num_threads: int = 2, tensor_parallel_size: int = 1):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.tensor_parallel_size = tensor_parallel_size
        self.trust_request_chat_template = trust_request_chat_template
        self.chat_template_timeout = chat_template_timeout
        self.workers = TokenizerWorkers(tokenizer, num_threads) if tokenizer is not None else None

    def close(self) -> None:
        if self.workers is not None:
            self.workers.close()

    def need_tokenizer(self, param: str | None = "prompt"):
        if self.tokenizer is None:
            raise bad_request("this server has no tokenizer: only token-id prompts are accepted", param)
        return self.tokenizer

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.need_tokenizer()
        return await self.workers.run(_encode, text, add_special_tokens)

    async def prompt_ids(self, prompt) -> list[int]:
        """A completion prompt (text, or token ids) as checked token ids."""
        if isinstance(prompt, str):
            if not prompt:
                raise bad_request("prompt must not be empty", "prompt")
            ids = await self.encode(prompt)
        else:
            ids = list(prompt)
        self.check_prompt(ids)
        return ids

    async def chat_ids(self, conversation: list[dict], add_generation_prompt: bool, kwargs: dict | None,
                       template: str | None = None) -> list[int]:
        """A conversation through the chat template (the model's, or a trusted client's) as checked token ids."""
        tok = self.need_tokenizer("messages")
        kwargs = {k: v for k, v in (kwargs or {}).items() if k not in _RESERVED_TEMPLATE_KWARGS}
        if "chat_template" in kwargs:
            if template is not None:
                raise bad_request("give the chat template once: chat_template or chat_template_kwargs.chat_template",
                                  "chat_template")
            template = kwargs.pop("chat_template")
        if template is not None:
            if not self.trust_request_chat_template:
                raise bad_request("this server does not accept chat templates from requests (the operator can allow "
                                  "them with --trust-request-chat-template)", "chat_template")
            if not isinstance(template, str) or not template:
                raise bad_request("chat_template must be a non-empty string", "chat_template")
        elif not getattr(tok, "chat_template", None):
            raise bad_request("this model's tokenizer has no chat template; use /v1/completions", "messages")
        try:
            ids = await self.workers.run(_render_chat, conversation, add_generation_prompt, template, kwargs,
                                         timeout=self.chat_template_timeout)
        except TimeoutError:
            raise bad_request(f"the chat template took longer than {self.chat_template_timeout:g}s to render",
                              "messages") from None
        except APIError:
            raise
        except Exception as e:  # noqa: BLE001 - a template that rejects the conversation
            raise bad_request(f"could not apply the chat template: {type(e).__name__}: {e}", "messages") from None
        self.check_prompt(ids)
        return ids

    # --- checks --------------------------------------------------------------------------------------
    def check_prompt(self, ids: list[int]) -> None:
        if not ids:
            raise bad_request("prompt is empty (no tokens)", "prompt")
        V, L = self.vocab_size, self.max_model_len
        if len(ids) >= L:      # first: it costs nothing, however long the prompt. vLLM's rule: no room, no request
            raise bad_request(f"the prompt has {len(ids)} tokens, which leaves no room for output within this "
                              f"model's maximum context length of {L} tokens", "prompt")
        if min(ids) < 0 or max(ids) >= V:
            bad = next(t for t in ids if not 0 <= t < V)
            raise bad_request(f"prompt token id {bad} is outside the vocabulary [0, {V})", "prompt")

    def check_params(self, ids: list[int], params) -> None:
        """What SamplingParams cannot check alone: `max_tokens` against the context left after this prompt, token
        ids (stop, allowed, biased) against the vocabulary, stop strings and bad words against the tokenizer."""
        L = self.max_model_len
        room = L - len(ids)  # >= 1: check_prompt refused the prompts that leave none
        if params.max_tokens is not None and params.max_tokens > room:
            raise bad_request(f"'max_tokens' is too large: {params.max_tokens}. This model's maximum context length "
                              f"is {L} tokens and your request has {len(ids)} input tokens "
                              f"({params.max_tokens} > {L} - {len(ids)})", "max_tokens")
        V = self.vocab_size
        if params.stop_token_ids and any(t >= V for t in params.stop_token_ids):
            raise bad_request(f"stop_token_ids {params.stop_token_ids} include ids outside the vocabulary [0, {V})",
                              "stop_token_ids")
        for name, toks in (("allowed_token_ids", params.allowed_token_ids), ("logit_bias", params.logit_bias)):
            if toks and max(toks) >= V:   # (logit_bias: its keys)
                raise bad_request(f"{name} include token id {max(toks)}, outside the vocabulary [0, {V})", name)
        for name, words in (("stop", params.stop_strings), ("bad_words", params.bad_words)):
            if words and len(words) > MAX_WORDS:
                raise bad_request(f"{name} holds {len(words)} strings; a request may give at most {MAX_WORDS}", name)
        if params.stop_strings:
            self.need_tokenizer("stop")
        if params.bad_words:
            self.need_tokenizer("bad_words")

    async def check_structured(self, params) -> None:
        """A structured-output spec parsed (off the event loop: a schema may be large); a 400 if it is malformed
        or this engine cannot constrain its output."""
        spec = params.structured_outputs
        if spec is None:
            return
        self.need_tokenizer("structured_outputs")
        if self.tensor_parallel_size > 1:
            raise bad_request("structured_outputs are not supported with tensor_parallel_size > 1 yet",
                              "structured_outputs")
        from nanovllm.engine.structured import check_spec
        try:
            await self.workers.run(_check_spec, check_spec, spec)
        except ValueError as e:
            raise bad_request(str(e), "structured_outputs") from None

    @staticmethod
    def check_fan_out(num_prompts: int, n: int) -> None:
        if num_prompts * n > MAX_CHOICES:
            raise bad_request(f"this request asks for {num_prompts} prompt(s) x n={n} = {num_prompts * n} completions; "
                              f"a request may ask for at most {MAX_CHOICES}", "n" if num_prompts == 1 else "prompt")
