"""Property test: generated request bodies thrown at the running server, with streams running beside them. Never a
5xx, never a hang (every answer within the client's timeout), every 200 well formed, the streams beside
unaffected. Examples are derandomized: CI runs the same bodies every time."""
from __future__ import annotations

import json

import pytest

httpx = pytest.importorskip("httpx")
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from tests.server.server_helpers import CHAT, MODEL, Beside, assert_all_blocks_free  # noqa: E402

# any JSON value, small; text may hold lone surrogates (json.dumps sends them as \\udXXX escapes)
texts = st.text(alphabet=st.characters(exclude_categories=()), max_size=12)
scalars = st.none() | st.booleans() | st.integers(-2 ** 70, 2 ** 70) | st.floats(allow_nan=False) | texts
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(texts, inner,
                                                                                            max_size=3),
                           max_leaves=8)
token_ids = st.lists(st.integers(-2, 600), min_size=0, max_size=12)


# valid values of each field (a body is made of some of them; some bodies get one field of junk)
SAMPLING = {
    "model": st.sampled_from([MODEL, ""]),
    "max_tokens": st.integers(1, 6),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.05, 1),
    "top_k": st.integers(-1, 50),
    "min_p": st.floats(0, 1),
    "seed": st.integers(-2 ** 63, 2 ** 63 - 1),
    "stop": st.one_of(texts.filter(bool), st.lists(texts.filter(bool), max_size=3)),
    "stop_token_ids": st.lists(st.integers(0, 500), max_size=3),
    "n": st.integers(1, 3),
    "stream": st.booleans(),
    "ignore_eos": st.booleans(),
    "min_tokens": st.integers(0, 1),
    "skip_special_tokens": st.booleans(),
    "return_tokens_as_token_ids": st.booleans(),
}
COMPLETION = {
    **SAMPLING,
    "prompt": st.one_of(texts.filter(bool), st.lists(st.integers(0, 500), min_size=1, max_size=12),
                        st.lists(texts.filter(bool), min_size=1, max_size=3)),
    "logprobs": st.integers(0, 5),
    "echo": st.just(False),
}
messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]),
                                           "content": texts}), min_size=1, max_size=3)
CHAT_FIELDS = {
    **SAMPLING,
    "messages": st.one_of(st.just(CHAT), messages),
    "max_completion_tokens": st.integers(1, 6),
    "logprobs": st.booleans(),
    "chat_template_kwargs": st.dictionaries(st.sampled_from(["enable_thinking", "x"]), json_values, max_size=2),
    "response_format": st.just({"type": "text"}),
}


@st.composite
def bodies(draw, fields: dict, always: tuple[str, ...]):
    """`always` and some of the other `fields` with valid values; in a third of the bodies one field holds junk
    (any JSON value, a value out of range) and there may be unknown keys."""
    keys = list(always) + draw(st.lists(st.sampled_from(sorted(set(fields) - set(always))), unique=True,
                                        max_size=6))
    body = {k: draw(fields[k]) for k in keys}
    if draw(st.integers(0, 2)) == 0:
        body[draw(st.sampled_from(sorted(fields)))] = draw(json_values | st.integers(-10, 10 ** 6) | st.floats())
        body.update(draw(st.dictionaries(texts, json_values, max_size=2)))
    if "stream" not in body and draw(st.booleans()):
        body["stream"] = True
    if body.get("stream") is True and draw(st.booleans()):
        body["stream_options"] = {"include_usage": draw(st.booleans())}
    return body


REQUESTS = st.one_of(
    st.tuples(st.just("/v1/completions"), bodies(COMPLETION, ("prompt", "max_tokens"))),
    st.tuples(st.just("/v1/chat/completions"), bodies(CHAT_FIELDS, ("messages", "max_tokens"))),
    st.tuples(st.sampled_from(["/tokenize", "/detokenize"]),
              st.one_of(st.fixed_dictionaries({"prompt": texts}), st.fixed_dictionaries({"messages": messages}),
                        st.fixed_dictionaries({"tokens": st.lists(st.integers(-5, 600), max_size=5)}))),
    st.tuples(st.sampled_from(["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"]),
              json_values),
)


def check_answer(r: httpx.Response, body) -> None:
    assert r.status_code < 500, f"{r.status_code} for {body!r}: {r.text[:500]}"
    if r.status_code != 200:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}
        return
    if r.headers["content-type"].startswith("text/event-stream"):
        events = [e for e in r.text.split("\n\n") if e]
        assert events[-1] == "data: [DONE]", events[-3:]
        for e in events[:-1]:
            obj = json.loads(e.removeprefix("data: "))
            assert "error" not in obj, obj          # a valid request is served, not failed mid-way
    else:
        keys = set(r.json())
        assert {"choices", "usage"} <= keys or keys in ({"tokens", "count", "max_model_len"}, {"prompt"}), keys


def test_generated_bodies_never_5xx_or_hang(srv):
    http = srv.http

    # no explain phase: it traces the test (and so the HTTP client) line by line, which takes minutes here
    @settings(max_examples=80, deadline=None, derandomize=True, database=None,
              phases=(Phase.explicit, Phase.generate, Phase.shrink), suppress_health_check=list(HealthCheck))
    @given(REQUESTS)
    def throw(req):
        path, body = req
        raw = json.dumps(body).encode()              # ensure_ascii: lone surrogates go as escapes
        r = http.post(path, content=raw, headers={"content-type": "application/json"}, timeout=30)
        check_answer(r, body)

    with Beside(srv, repeat=True) as beside:
        throw()
    beside.check()
    assert_all_blocks_free(srv)

