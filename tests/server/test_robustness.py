"""Requests an abuser would send (issue 21), each against the running server with a long greedy stream beside
it: the bad request gets its status, and the stream neither stalls (> 1 s between chunks) nor changes its text."""
from __future__ import annotations

import time

import pytest

httpx = pytest.importorskip("httpx")

from nanovllm.server.protocol import MAX_WORDS  # noqa: E402
from tests.server.server_helpers import (  # noqa: E402
    CHAT,
    MAX_MODEL_LEN,
    MODEL,
    PROMPT,
    Beside,
    assert_all_blocks_free,
)


def check_error(r, status, param="any", match=None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param != "any":
        assert err["param"] == param, err
    if match is not None:
        assert match in err["message"], err
    return err


def chat(srv, **body):
    return srv.http.post("/v1/chat/completions", json={"model": MODEL, "messages": CHAT, "max_tokens": 4, **body})


def test_client_chat_templates_are_refused_unless_trusted(srv):
    with Beside(srv) as beside:
        for body in ({"chat_template": "{{ 'x' }}"}, {"chat_template_kwargs": {"chat_template": "{{ 'x' }}"}}):
            check_error(chat(srv, **body), 400, "chat_template", "--trust-request-chat-template")
        r = srv.http.post("/tokenize", json={"messages": CHAT, "chat_template": "{{ 'x' }}"})
        check_error(r, 400, "chat_template")
    beside.check()


def test_trusted_chat_template_renders_under_a_time_limit(srv, monkeypatch):
    pre = srv.app.state.server.pre
    monkeypatch.setattr(pre, "trust_request_chat_template", True)
    monkeypatch.setattr(pre, "chat_template_timeout", 1.0)
    tok = srv.llm.tokenizer
    # a trusted template is used
    r = srv.http.post("/tokenize", json={"messages": CHAT, "chat_template": "{{ messages[1]['content'] }}"})
    assert r.status_code == 200 and r.json()["tokens"] == tok.encode(CHAT[1]["content"], add_special_tokens=False)
    forever = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    with Beside(srv) as beside:
        t0 = time.monotonic()
        check_error(chat(srv, chat_template=forever), 400, "messages", "longer than 1s")
        assert time.monotonic() - t0 < 3
        check_error(chat(srv, chat_template_kwargs={"chat_template": forever}), 400, "messages", "longer than 1s")
        # the renders were stopped: the tokenizer threads serve the next requests at once
        for _ in range(3):
            assert srv.http.post("/tokenize", json={"messages": CHAT}).status_code == 200
        check_error(chat(srv, chat_template="{{ raise_exception('no') }}"), 400, "messages", "no")
    beside.check()


def test_body_size_is_capped_and_big_prompts_are_tokenized_off_the_loop(srv):
    limit = srv.app.state.server.max_body
    with Beside(srv) as beside:
        big = b'{"prompt": "' + b"a" * (limit + 10) + b'"}'
        check_error(srv.http.post("/v1/completions", content=big, headers={"content-type": "application/json"}),
                    413, match=str(limit))

        def chunks():                      # no Content-Length: refused as soon as the limit is passed
            yield b'{"prompt": "'
            for _ in range(limit // 65536 + 2):
                yield b"a" * 65536
            yield b'"}'
        check_error(srv.http.post("/v1/completions", content=chunks()), 413)
        # under the limit, a prompt of 1 MB of text: tokenized (a second of work) beside the stream, then 400
        text = "the quick brown fox " * 50_000
        check_error(srv.http.post("/v1/completions", json={"model": MODEL, "prompt": text}), 400, "prompt",
                    f"maximum context length of {MAX_MODEL_LEN}")
    beside.check()


def test_fan_out_is_capped_and_a_big_fan_out_aborts_fast(srv):
    with Beside(srv) as beside:
        r = srv.http.post("/v1/completions", json={"model": MODEL, "prompt": ["hi"] * 1000, "n": 128})
        check_error(r, 400, "prompt", "at most 1024")
        check_error(srv.http.post("/v1/completions", json={"model": MODEL, "prompt": [[1, 2]] * 1025}), 400,
                    "prompt")
        # the most a request may ask for, left by its client: all of it is aborted at once
        with pytest.raises(httpx.TimeoutException):
            srv.http.post("/v1/completions", json={"model": MODEL, "prompt": [[5, 6, 7]] * 8, "n": 128,
                                                   "max_tokens": 100, "ignore_eos": True}, timeout=0.5)
    beside.check()
    assert_all_blocks_free(srv)


def test_lone_surrogates_and_deep_json_are_400(srv):
    with Beside(srv) as beside:
        for path, raw in [
            ("/v1/completions", b'{"model": "%s", "prompt": "a\\ud800b"}' % MODEL.encode()),
            ("/v1/completions", b'{"model": "%s", "prompt": ["ok", "\\udfff"]}' % MODEL.encode()),
            ("/v1/completions", b'{"model": "%s", "prompt": "x", "stop": ["\\ud800"]}' % MODEL.encode()),
            ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\udc00"}]}'),
            ("/tokenize", b'{"prompt": "\\ud800"}'),
            ("/tokenize", b'{"prompt": "raw \xed\xa0\x80 bytes"}'),          # a surrogate encoded as UTF-8
            ("/v1/completions", b"[" * 100_000 + b"]" * 100_000),
            ("/v1/completions", b'{"prompt": "x", "logit_bias": ' + b'{"a": ' * 100_000 + b"1" + b"}" * 100_001),
            ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": '
                                     + b"[" * 100_000 + b"]" * 100_000 + b"}"),
        ]:
            r = srv.http.post(path, content=raw, headers={"content-type": "application/json"})
            check_error(r, 400)
        # a valid pair of surrogate escapes is one character, and fine
        r = srv.http.post("/tokenize", content=b'{"prompt": "\\ud83d\\ude00"}')
        assert r.status_code == 200 and r.json()["tokens"] == srv.llm.tokenizer.encode("\U0001F600")
    beside.check()


def test_max_tokens_past_the_context_and_messages_without_content_are_400(srv):
    n_prompt = len(srv.llm.tokenizer.encode(PROMPT))
    with Beside(srv) as beside:
        r = srv.http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 10_000})
        check_error(r, 400, "max_tokens", f"maximum context length is {MAX_MODEL_LEN} tokens and your request has "
                                          f"{n_prompt} input tokens")
        long_prompt = [5] * (MAX_MODEL_LEN - 6)        # 6 tokens of context left
        r = srv.http.post("/v1/completions", json={"model": MODEL, "prompt": long_prompt, "max_tokens": 6})
        assert r.status_code == 200                      # exactly the context left is fine
        r = srv.http.post("/v1/completions", json={"model": MODEL, "prompt": [5] * MAX_MODEL_LEN, "max_tokens": 1})
        check_error(r, 400, "prompt", "leaves no room for output")   # no context left (vLLM's 400 too)
        r = srv.http.post("/v1/completions", json={"model": MODEL, "prompt": long_prompt, "max_tokens": 7})
        check_error(r, 400, "max_tokens", "(7 > 512 - 506)")
        check_error(chat(srv, max_completion_tokens=MAX_MODEL_LEN), 400, "max_tokens", "is too large")
        r = srv.http.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user"}]})
        check_error(r, 400, "messages.0.content", "required")
        r = srv.http.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user",
                                                                                       "content": None}]})
        check_error(r, 400, "messages.0.content")
        r = srv.http.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"content": "hi"}]})
        check_error(r, 400, "messages.0.role", "'messages.0.role'")
        # a top_k past int32 keeps every token (it used to fail the whole step, the stream beside it too)
        r = srv.http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 3,
                                                   "top_k": 2**31, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        # more stop strings or bad words than the engine core should match on its loop
        for name in ("stop", "bad_words"):
            r = srv.http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 3,
                                                       name: [f"w{i}" for i in range(MAX_WORDS + 1)]})
            check_error(r, 400, name, f"at most {MAX_WORDS}")
    beside.check()
