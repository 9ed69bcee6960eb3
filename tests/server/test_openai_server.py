"""The OpenAI-compatible server, end to end: the HTTP app (in a thread of this process, on 127.0.0.1 and a free
port) and its engine-core process over a tiny random model on CPU, driven by the official `openai` client.

The app in this process lets the tests read the engine's stats as the engine core reports them (KV blocks after
a disconnect). Greedy outputs are compared with the offline engine (`LLM.generate` / `LLM.chat`).
"""
from __future__ import annotations

import asyncio
import json
import random
import sys
import threading

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from nanovllm import SamplingParams  # noqa: E402
from tests.server.server_helpers import (  # noqa: E402
    API_KEY,
    CHAT,
    MAX_MODEL_LEN,
    MODEL,
    PROMPT,
    assert_all_blocks_free,
    offline,
    serve_inproc,
    text_token_ids,
    wait_idle,
)


def random_prompts(n, seed, lo=5, hi=60, vocab=None):
    rng = random.Random(seed)
    vocab = vocab or range(3, 470)
    return [[rng.choice(vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


# --- basics ------------------------------------------------------------------------------------------
def test_models_health_version(srv):
    models = srv.openai.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].max_model_len == MAX_MODEL_LEN
    assert httpx.get(srv.url + "/health").status_code == 200     # no key needed
    assert srv.http.get("/version").json()["version"]


def test_completion_greedy_matches_offline(srv):
    ref = offline(srv, [PROMPT])[0]
    r = srv.openai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0)
    assert r.object == "text_completion" and r.model == MODEL
    assert r.choices[0].text == ref["text"]
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(ref["prompt_token_ids"])
    assert r.usage.completion_tokens == 16
    assert r.usage.total_tokens == r.usage.prompt_tokens + 16


def test_completion_prompt_forms(srv):
    ids = random_prompts(2, seed=1)
    refs = offline(srv, ["Hello there", "Another prompt", ids[0], ids[1]], max_tokens=8)
    r = srv.openai.completions.create(model=MODEL, prompt=["Hello there", "Another prompt"], max_tokens=8,
                                      temperature=0)
    assert [c.text for c in sorted(r.choices, key=lambda c: c.index)] == [refs[0]["text"], refs[1]["text"]]
    r = srv.openai.completions.create(model=MODEL, prompt=ids[0], max_tokens=8, temperature=0)   # token ids
    assert r.choices[0].text == refs[2]["text"] and r.usage.prompt_tokens == len(ids[0])
    r = srv.openai.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0)       # list of ids
    assert [c.text for c in sorted(r.choices, key=lambda c: c.index)] == [refs[2]["text"], refs[3]["text"]]
    assert r.usage.completion_tokens == 16


def test_completion_stream_matches_offline(srv):
    ref = offline(srv, [PROMPT], max_tokens=20)[0]
    chunks = list(srv.openai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=20, temperature=0,
                                                stream=True, stream_options={"include_usage": True}))
    text_chunks = [c for c in chunks if c.choices]
    assert len(text_chunks) >= 10                     # streamed as produced, not in one piece
    assert "".join(c.choices[0].text for c in text_chunks) == ref["text"]
    assert text_chunks[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    assert chunks[-1].usage.prompt_tokens == len(ref["prompt_token_ids"])


def test_chat_matches_offline(srv):
    ref = srv.llm.chat(CHAT, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)[0]
    r = srv.openai.chat.completions.create(model=MODEL, messages=CHAT, max_completion_tokens=16, temperature=0)
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == ref["text"]
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(ref["prompt_token_ids"]) and r.usage.completion_tokens == 16
    # max_tokens (the older name) works too
    r2 = srv.openai.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=16, temperature=0)
    assert r2.choices[0].message.content == ref["text"]


def test_chat_stream(srv):
    ref = srv.llm.chat(CHAT, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0]
    chunks = list(srv.openai.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12, temperature=0,
                                                     stream=True, stream_options={"include_usage": True}))
    assert chunks[0].object == "chat.completion.chunk"
    assert chunks[0].choices[0].delta.role == "assistant"            # the role comes first
    body = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in body) == ref["text"]
    assert body[-1].choices[0].finish_reason == "length"
    assert chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == len(ref["prompt_token_ids"])


def test_stream_without_usage_has_no_usage_chunk(srv):
    chunks = list(srv.openai.completions.create(model=MODEL, prompt="abc", max_tokens=4, temperature=0, stream=True))
    assert all(c.choices for c in chunks) and all(c.usage is None for c in chunks)


def test_stop_strings_and_stop_token_ids(srv):
    base = offline(srv, [PROMPT], max_tokens=24)[0]
    stop = base["text"][6:9]
    assert stop.strip() and "\ufffd" not in stop
    ref = offline(srv, [PROMPT], max_tokens=24, stop=[stop])[0]
    assert ref["finish_reason"] == "stop"
    r = srv.openai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop])
    assert r.choices[0].text == ref["text"] and r.choices[0].finish_reason == "stop"
    assert r.choices[0].model_extra["stop_reason"] == stop
    chunks = list(srv.openai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0,
                                                stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == ref["text"]     # no part of the stop string leaks
    assert chunks[-1].choices[0].finish_reason == "stop"
    # a stop token id: generation ends on it (and it is counted)
    tok = base["token_ids"][4]
    r = srv.openai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0,
                                      extra_body={"stop_token_ids": [tok]})
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == base["token_ids"].index(tok) + 1


def test_n_samples_with_seed(srv):
    kw = dict(temperature=1.0, top_p=0.9, top_k=50, min_p=0.01, max_tokens=10)
    refs = [offline(srv, [PROMPT], **kw, seed=1234 + i)[0]["text"] for i in range(3)]
    assert len(set(refs)) > 1
    r = srv.openai.completions.create(model=MODEL, prompt=PROMPT, n=3, seed=1234, temperature=1.0, top_p=0.9,
                                      max_tokens=10, extra_body={"top_k": 50, "min_p": 0.01})
    assert [c.text for c in sorted(r.choices, key=lambda c: c.index)] == refs
    assert r.usage.completion_tokens == 30
    got = {}
    for c in srv.openai.completions.create(model=MODEL, prompt=PROMPT, n=3, seed=1234, temperature=1.0,
                                           top_p=0.9, max_tokens=10, stream=True,
                                           extra_body={"top_k": 50, "min_p": 0.01}):
        for ch in c.choices:
            got[ch.index] = got.get(ch.index, "") + ch.text
    assert [got[i] for i in range(3)] == refs
    chat = srv.openai.chat.completions.create(model=MODEL, messages=CHAT, n=2, temperature=0, max_tokens=6)
    assert len(chat.choices) == 2 and chat.choices[0].message.content == chat.choices[1].message.content


def test_ignore_eos_and_min_tokens(srv):
    base = offline(srv, [PROMPT], max_tokens=12)[0]
    tok = base["token_ids"][2]
    # a stop token is held back until min_tokens tokens exist
    ref = offline(srv, [PROMPT], max_tokens=12, min_tokens=6, stop_token_ids=[tok], ignore_eos=True)[0]
    assert len(ref["token_ids"]) > 3
    r = srv.openai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0,
                                      extra_body={"min_tokens": 6, "ignore_eos": True, "stop_token_ids": [tok]})
    assert r.choices[0].text == ref["text"] and r.choices[0].finish_reason == ref["finish_reason"]
    assert r.usage.completion_tokens == len(ref["token_ids"])


def test_logprobs(srv):
    ref = offline(srv, [PROMPT], max_tokens=6, logprobs=3)[0]
    r = srv.openai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert lp.token_logprobs == pytest.approx([pos[t].logprob for t, pos in zip(ref["token_ids"], ref["logprobs"])],
                                              abs=1e-4)
    assert all(len(t) >= 3 for t in lp.top_logprobs[:1]) and all(v <= 0 for v in lp.token_logprobs)
    assert "".join(lp.tokens) == r.choices[0].text or "\ufffd" in "".join(lp.tokens)
    c = srv.openai.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=5, temperature=0, logprobs=True,
                                           top_logprobs=2)
    content = c.choices[0].logprobs.content
    assert len(content) == 5 and all(len(t.top_logprobs) == 2 for t in content)
    assert content[0].top_logprobs[0].logprob >= content[0].top_logprobs[1].logprob
    streamed = [c for c in srv.openai.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=5, temperature=0, logprobs=True, stream=True) if c.choices]
    toks = [t for c in streamed if c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [t.logprob for t in toks] == pytest.approx([t.logprob for t in content], abs=1e-4)


def test_tokenize_detokenize(srv):
    tok = srv.llm.tokenizer
    r = srv.http.post("/tokenize", json={"prompt": PROMPT})
    assert r.status_code == 200 and r.json()["tokens"] == tok.encode(PROMPT)
    assert r.json()["count"] == len(tok.encode(PROMPT)) and r.json()["max_model_len"] == MAX_MODEL_LEN
    r = srv.http.post("/detokenize", json={"tokens": tok.encode(PROMPT)})
    assert r.status_code == 200 and r.json()["prompt"] == tok.decode(tok.encode(PROMPT))
    r = srv.http.post("/tokenize", json={"messages": CHAT})
    assert r.json()["tokens"] == srv.llm.apply_chat_template(CHAT)
    assert srv.http.post("/detokenize", json={"tokens": [10 ** 9]}).status_code == 400
    assert srv.http.post("/tokenize", json={}).status_code == 400


# --- online batching ---------------------------------------------------------------------------------
def test_64_concurrent_streams_match_offline(srv):
    prompts = random_prompts(64, seed=2, vocab=text_token_ids(srv.llm.tokenizer))
    max_tokens = [8 + (i % 9) for i in range(64)]
    refs = srv.llm.generate(prompts, [SamplingParams(temperature=0, max_tokens=m) for m in max_tokens],
                            use_tqdm=False)
    max_running = 0

    async def one(client, i):
        await asyncio.sleep(random.Random(i).random() * 0.2)     # staggered: requests join a running batch
        text, finish, usage, n_chunks, ids = "", None, None, 0, []
        stream = await client.completions.create(
            model=MODEL, prompt=prompts[i], max_tokens=max_tokens[i], temperature=0, stream=True, logprobs=0,
            stream_options={"include_usage": True}, extra_body={"return_tokens_as_token_ids": True})
        async for c in stream:
            if c.choices:
                n_chunks += 1
                text += c.choices[0].text
                ids += [int(t.split(":")[1]) for t in c.choices[0].logprobs.tokens]
                finish = c.choices[0].finish_reason or finish
            if c.usage:
                usage = c.usage
        return text, finish, usage, n_chunks, ids

    async def watch(done):
        nonlocal max_running
        while not done.is_set():
            max_running = max(max_running, srv.client.stats.num_running)
            await asyncio.sleep(0.005)

    async def main():
        client = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)
        done = asyncio.Event()
        w = asyncio.create_task(watch(done))
        try:
            return await asyncio.gather(*(one(client, i) for i in range(64)))
        finally:
            done.set()
            await w
            await client.close()

    results = asyncio.run(main())
    for i, (text, finish, usage, n_chunks, ids) in enumerate(results):
        assert ids == refs[i]["token_ids"], f"request {i}"
        assert text == refs[i]["text"], f"request {i}"
        assert finish == "length" and usage.completion_tokens == max_tokens[i]
        assert usage.prompt_tokens == len(prompts[i])
        assert 1 <= n_chunks <= max_tokens[i]     # a chunk per step at most (one that fell behind carries several)
    assert max_running > 1                                        # they really were batched together
    assert_all_blocks_free(srv)


def _counter(srv, key):
    return getattr(srv.client.stats, key)


def test_disconnect_mid_stream_frees_blocks(srv):
    wait_idle(srv)
    aborted0 = srv.client.metrics.finished["abort"]
    gen0 = _counter(srv, "generation_tokens")
    stream = srv.openai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=450, temperature=0, stream=True,
                                           extra_body={"ignore_eos": True})
    it = iter(stream)
    for _ in range(3):
        next(it)
    # the request is in flight and holds KV blocks
    assert srv.client.stats.num_free_blocks < srv.client.stats.num_blocks
    stream.close()                                                # the client goes away mid-stream
    assert_all_blocks_free(srv)
    assert srv.client.metrics.finished["abort"] == aborted0 + 1
    assert _counter(srv, "generation_tokens") - gen0 < 450        # it was stopped, not run to the end


def test_disconnect_non_streamed_frees_blocks(srv):
    wait_idle(srv)
    aborted0 = srv.client.metrics.finished["abort"]
    gen0 = _counter(srv, "generation_tokens")
    with pytest.raises(httpx.TimeoutException):
        srv.http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 450,
                                               "temperature": 0, "n": 2}, timeout=0.5)
    assert_all_blocks_free(srv)
    assert srv.client.metrics.finished["abort"] == aborted0 + 2
    assert _counter(srv, "generation_tokens") - gen0 < 900


# --- errors ------------------------------------------------------------------------------------------
LONG = "word " * (MAX_MODEL_LEN + 50)

BAD_COMPLETIONS = [
    ({"prompt": PROMPT, "temperature": -1}, "temperature"),
    ({"prompt": PROMPT, "temperature": "hot"}, "temperature"),
    ({"prompt": PROMPT, "top_p": 0}, "top_p"),
    ({"prompt": PROMPT, "top_p": 1.5}, "top_p"),
    ({"prompt": PROMPT, "top_k": -2}, "top_k"),
    ({"prompt": PROMPT, "min_p": 2}, "min_p"),
    ({"prompt": PROMPT, "max_tokens": 0}, "max_tokens"),
    ({"prompt": PROMPT, "max_tokens": "ten"}, "max_tokens"),
    ({"prompt": PROMPT, "max_tokens": 4, "min_tokens": 8}, "min_tokens"),
    ({"prompt": PROMPT, "n": 0}, "n"),
    ({"prompt": PROMPT, "logprobs": 50}, "logprobs"),
    ({"prompt": PROMPT, "seed": "x"}, "seed"),
    ({"prompt": PROMPT, "seed": 2 ** 70}, "seed"),
    ({"prompt": PROMPT, "stop": 5}, "stop"),
    ({"prompt": PROMPT, "stop": [""]}, "stop"),
    ({"prompt": PROMPT, "stop_token_ids": [10 ** 7]}, "stop_token_ids"),
    ({"prompt": PROMPT, "stream": "yes"}, "stream"),
    ({"prompt": PROMPT, "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": PROMPT, "echo": True}, "echo"),
    ({"prompt": PROMPT, "ignore_eos": 1}, "ignore_eos"),
    ({"prompt": LONG}, "prompt"),                                 # longer than the context
    ({"prompt": [1] * (MAX_MODEL_LEN + 1)}, "prompt"),
    ({"prompt": [1, 10 ** 6]}, "prompt"),                         # token id outside the vocabulary
    ({"prompt": [1, -1]}, "prompt"),
    ({"prompt": [1, "a"]}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": 3}, "prompt"),
    ({}, "prompt"),
]


def _check_error(r, status, param="any"):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param != "any":
        assert err["param"] == param, err
    return err


@pytest.mark.parametrize("body,param", BAD_COMPLETIONS, ids=[str(i) for i in range(len(BAD_COMPLETIONS))])
def test_bad_completion_requests_are_400(srv, body, param):
    r = srv.http.post("/v1/completions", json={"model": MODEL, **body})
    _check_error(r, 400, param)


BAD_CHAT = [
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"content": "no role"}]}, "messages"),
    ({"messages": CHAT, "top_logprobs": 2}, "top_logprobs"),
    ({"messages": CHAT, "logprobs": True, "top_logprobs": 99}, "top_logprobs"),
    ({"messages": CHAT, "max_completion_tokens": -1}, "max_tokens"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, None),
    ({"messages": [{"role": "user", "content": LONG}]}, "prompt"),
]


@pytest.mark.parametrize("body,param", BAD_CHAT, ids=[str(i) for i in range(len(BAD_CHAT))])
def test_bad_chat_requests_are_400(srv, body, param):
    r = srv.http.post("/v1/chat/completions", json={"model": MODEL, **body})
    err = _check_error(r, 400)
    if param is not None:
        assert err["param"] and err["param"].startswith(param), err


def test_malformed_json_and_non_object(srv):
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize"):
        _check_error(srv.http.post(path, content=b'{"prompt": "x",', headers={"content-type": "application/json"}),
                     400)
        _check_error(srv.http.post(path, content=b"\xff\xfe", headers={"content-type": "application/json"}), 400)
        _check_error(srv.http.post(path, json=["not", "an", "object"]), 400)


def test_unknown_fields_are_ignored(srv):
    r = srv.http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2, "frobnicate": {"a": 1}})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def test_unknown_model_is_404(srv):
    with pytest.raises(openai.NotFoundError) as e:
        srv.openai.completions.create(model="no-such-model", prompt="hi", max_tokens=2)
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        srv.openai.chat.completions.create(model="no-such-model", messages=CHAT, max_tokens=2)
    _check_error(srv.http.get("/v1/no-such-route"), 404)


def test_api_key(srv):
    bad = openai.OpenAI(base_url=srv.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model=MODEL, prompt="hi", max_tokens=2)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    bad.close()
    _check_error(httpx.post(srv.url + "/v1/completions", json={"model": MODEL, "prompt": "hi"}), 401)
    _check_error(httpx.get(srv.url + "/v1/models"), 401)
    _check_error(httpx.post(srv.url + "/tokenize", json={"prompt": "hi"}), 401)
    assert httpx.get(srv.url + "/metrics").status_code == 200       # metrics and health stay open


def test_openai_client_raises_bad_request(srv):
    with pytest.raises(openai.BadRequestError) as e:
        srv.openai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=-1)
    assert e.value.status_code == 400 and e.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError):
        srv.openai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, stream=True, top_p=7)
    with pytest.raises(openai.BadRequestError):
        srv.openai.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, stream=True, temperature=-2)


def test_bad_requests_do_not_disturb_others(srv):
    ref = offline(srv, [PROMPT], max_tokens=40)[0]
    results = {}

    def good():
        chunks = srv.openai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0, stream=True)
        results["text"] = "".join(c.choices[0].text for c in chunks)

    t = threading.Thread(target=good)
    t.start()
    for body, _ in BAD_COMPLETIONS[:12]:
        assert srv.http.post("/v1/completions", json={"model": MODEL, **body}).status_code == 400
    assert srv.http.post("/v1/completions", content=b"{{{").status_code == 400
    t.join(60)
    assert results["text"] == ref["text"]
    assert_all_blocks_free(srv)


# --- metrics -----------------------------------------------------------------------------------------
def test_metrics_parse_as_prometheus(srv):
    parser = pytest.importorskip("prometheus_client.parser")
    srv.openai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0)
    r = httpx.get(srv.url + "/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    fams = {f.name: f for f in parser.text_string_to_metric_families(r.text)}
    for name in ("nanovllm:num_requests_running", "nanovllm:num_requests_waiting", "nanovllm:kv_cache_usage_perc"):
        assert fams[name].type == "gauge"
    for name in ("nanovllm:prompt_tokens", "nanovllm:generation_tokens"):
        assert fams[name].type == "counter" and fams[name].samples[0].value > 0
    for name in ("nanovllm:time_to_first_token_seconds", "nanovllm:time_per_output_token_seconds"):
        fam = fams[name]
        assert fam.type == "histogram"
        count = next(s.value for s in fam.samples if s.name.endswith("_count"))
        inf = next(s.value for s in fam.samples if s.name.endswith("_bucket") and s.labels["le"] == "+Inf")
        assert count > 0 and inf == count
    assert fams["nanovllm:num_requests_running"].samples[0].labels["model_name"] == MODEL


def test_speculative_server_matches_offline_and_exposes_its_counters(srv):
    """A server with n-gram speculative decoding: streamed and non-streamed greedy tokens (as ids, from the
    logprobs) and seeded n-sample texts are the offline engine's without drafts; /metrics has vLLM's spec_decode
    counters, drafts counted."""
    parser = pytest.importorskip("prometheus_client.parser")
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    s = serve_inproc(srv.path, speculative_config=spec)
    try:
        ids = [11, 12, 13] * 6
        ref = offline(srv, [ids], max_tokens=30, ignore_eos=True)[0]
        body = dict(model=MODEL, prompt=ids, max_tokens=30, temperature=0, logprobs=0,
                    extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
        r = s.openai.completions.create(**body)
        assert [int(t.split(":")[1]) for t in r.choices[0].logprobs.tokens] == ref["token_ids"]
        streamed = [t for c in s.openai.completions.create(**body, stream=True) if c.choices and c.choices[0].logprobs
                    for t in c.choices[0].logprobs.tokens]
        assert [int(t.split(":")[1]) for t in streamed] == ref["token_ids"]
        refs = offline(srv, [PROMPT], n=3, seed=5, temperature=1.0, max_tokens=12)[0]
        r = s.openai.completions.create(model=MODEL, prompt=PROMPT, n=3, seed=5, temperature=1.0, max_tokens=12)
        assert [c.text for c in sorted(r.choices, key=lambda c: c.index)] == [c.text for c in refs.outputs]
        fams = {f.name: f for f in parser.text_string_to_metric_families(httpx.get(s.url + "/metrics").text)}
        values = {n: fams[f"nanovllm:spec_decode_num_{n}"].samples[0].value
                  for n in ("drafts", "draft_tokens", "accepted_tokens")}
        assert values["draft_tokens"] >= values["drafts"] > 0 and values["draft_tokens"] >= values["accepted_tokens"]
        assert_all_blocks_free(s)
    finally:
        s.stop()
    assert "nanovllm:spec_decode" not in httpx.get(srv.url + "/metrics").text     # not without it


# --- cli ---------------------------------------------------------------------------------------------
def test_cli_serve_parser():
    from nanovllm.cli import build_parser
    ns = build_parser().parse_args(["serve", "/some/model", "--port", "9001", "--api-key", "k",
                                    "--served-model-name", "m", "--max-model-len", "64", "--device", "cpu"])
    assert ns.command == "serve" and ns.model == "/some/model" and ns.port == 9001 and ns.host == "127.0.0.1"
    assert ns.api_key == "k" and ns.served_model_name == ["m"] and ns.max_model_len == 64 and callable(ns.func)


def test_cli_serve_without_fastapi(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "fastapi", None)      # as if the extra were not installed
    from nanovllm.cli import main
    assert main(["serve", "/some/model"]) == 1
    assert "pip install" in capsys.readouterr().err


def test_sse_wire_format(srv):
    with srv.http.stream("POST", "/v1/chat/completions",
                         json={"model": MODEL, "messages": CHAT, "max_tokens": 3, "stream": True}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = "".join(r.iter_text())
    events = [e for e in raw.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    first = json.loads(events[0][6:])
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}


# --- the online benchmark's client side -------------------------------------------------------------------
def _bench_module():
    """benchmarks/online_bench.py, imported once under its own name (its client processes import it too)."""
    import importlib
    import os
    bench_dir = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks")
    if os.path.abspath(bench_dir) not in map(os.path.abspath, sys.path):
        sys.path.append(os.path.abspath(bench_dir))
    return importlib.import_module("online_bench")


def test_bench_workload_and_client(srv):
    bench = _bench_module()
    prompts, max_tokens = bench.reference_workload()
    assert len(prompts) == len(max_tokens) == 256
    assert all(100 <= len(p) <= 1024 and all(0 <= t <= 10000 for t in p) for p in prompts)
    assert all(100 <= m <= 1024 for m in max_tokens)
    rng = random.Random(0)
    first = [rng.randint(0, 10000) for _ in range(rng.randint(100, 1024))]
    assert prompts[0] == first and bench.reference_workload(3)[0] == prompts[:3]
    arr = bench.arrival_times(2000, 50.0, 0)
    assert arr == sorted(arr) and 30 < arr[-1] < 50            # mean gap 1/50 s
    assert bench.arrival_times(3, float("inf"), 0) == [0.0, 0.0, 0.0]
    assert bench.percentile([1, 2, 3, 4], 50) == 2.5
    # the client against the live server (prompts that fit the tiny vocabulary)
    res = asyncio.run(bench.run_rate(srv.url, MODEL, API_KEY, random_prompts(6, seed=9), [5, 6, 7, 5, 6, 7],
                                     rate=100.0, seed=0, temperature=0.6, max_concurrency=4, timeout=60))
    assert res["completed"] == 6 and res["failed"] == 0 and res["output_tokens"] == 36
    assert res["ttft_s"]["p50"] > 0 and res["tpot_s"]["p99"] > 0 and res["request_throughput"] > 0
    bad = asyncio.run(bench.run_rate(srv.url, MODEL, "wrong-key", [[1, 2, 3]], [4], rate=float("inf"), seed=0,
                                     temperature=0.6, max_concurrency=None, timeout=60))
    assert bad["failed"] == 1 and "401" in bad["errors"][0]


def test_bench_fake_core_mode_measures_the_api_process(tmp_path):
    """online_bench --fake-core: the API server before a model-free engine core, driven by two client processes;
    the report has the API process's CPU per token."""
    bench = _bench_module()
    out = tmp_path / "fake.json"
    assert bench.main(["--fake-core", "--num-requests", "8", "--max-tokens-cap", "12", "--rates", "inf",
                       "--client-procs", "2", "--num-warmup", "1", "--output", str(out)]) == 0
    (res,) = json.loads(out.read_text())["results"]
    assert res["completed"] == 8 and res["failed"] == 0 and res["client_procs"] == 2
    assert res["output_tokens"] == 8 * 12 and res["server"]["generation_tokens_total"] == 8 * 12
    assert res["cpu"]["api_us_per_output_token"] > 0 and "engine_core_s" in res["cpu"]


# --- vLLM's sampling fields and structured outputs ---------------------------------------------------------------
def test_penalties_bias_and_bad_words_match_offline(srv):
    kw = dict(max_tokens=12, frequency_penalty=0.8, presence_penalty=0.3, repetition_penalty=1.2)
    ref = offline(srv, [PROMPT], **kw, logit_bias={7: 3.0}, allowed_token_ids=list(range(3, 300)))[0]
    r = srv.openai.completions.create(model=MODEL, prompt=PROMPT, temperature=0, logit_bias={"7": 3.0},
                                      extra_body={"repetition_penalty": 1.2, "allowed_token_ids": list(range(3, 300))},
                                      max_tokens=12, frequency_penalty=0.8, presence_penalty=0.3)
    assert r.choices[0].text == ref["text"]
    ref = offline(srv, [PROMPT], max_tokens=12, n=3, seed=9, temperature=1.0, bad_words=["the"])[0]
    r = srv.openai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, n=3, seed=9, temperature=1.0,
                                      extra_body={"bad_words": ["the"]})
    assert [c.text for c in sorted(r.choices, key=lambda c: c.index)] == [c.text for c in ref.outputs]
    assert _check_error(srv.http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "logit_bias": {"7": 1},
                                                               "frequency_penalty": 5}), 400, "frequency_penalty")
    _check_error(srv.http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "logit_bias": {"99999": 1}}),
                 400, "logit_bias")


SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "pattern": "^[A-Z][a-z]{1,6}$"},
                                           "pop": {"type": "integer", "minimum": 0, "maximum": 9999}},
          "required": ["city", "pop"], "additionalProperties": False}


def test_structured_outputs_through_the_openai_client(srv):
    import re
    fmt = {"type": "json_schema", "json_schema": {"name": "town", "schema": SCHEMA, "strict": True}}
    r = srv.openai.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=80, temperature=1.0, n=4, seed=3,
                                           response_format=fmt)
    for c in r.choices:
        obj = json.loads(c.message.content)
        assert set(obj) == {"city", "pop"} and re.fullmatch(r"[A-Z][a-z]{1,6}", obj["city"])
        assert isinstance(obj["pop"], int) and 0 <= obj["pop"] <= 9999 and c.finish_reason == "stop"
    r = srv.openai.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=200, temperature=1.0, seed=1,
                                           response_format={"type": "json_object"})
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    for seed in range(3):
        r = srv.openai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=20, temperature=1.0, seed=seed,
                                          extra_body={"structured_outputs": {"choice": ["red", "green", "blue"]}})
        assert r.choices[0].text in ("red", "green", "blue")
        r = srv.openai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=20, temperature=1.0, seed=seed,
                                          extra_body={"structured_outputs": {"regex": r"\d{3}-[a-z]{2}"}})
        assert re.fullmatch(r"\d{3}-[a-z]{2}", r.choices[0].text)
    chunks = list(srv.openai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=20, temperature=1.0, seed=5,
                                                stream=True, extra_body={"structured_outputs": {"regex": r"[a-z]{4}"}}))
    assert re.fullmatch(r"[a-z]{4}", "".join(c.choices[0].text for c in chunks if c.choices))


def test_malformed_structured_outputs_are_400(srv):
    bad = [({"structured_outputs": {"regex": "[a-"}}, "structured_outputs"),
           ({"structured_outputs": {"json": "{nope"}}, "structured_outputs"),
           ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
           ({"structured_outputs": {"frobnicate": 1}}, "structured_outputs"),
           ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
           ({"response_format": {"type": "yaml"}}, "response_format")]
    for body, param in bad:
        _check_error(srv.http.post("/v1/completions", json={"model": MODEL, "prompt": "x", **body}), 400, param)
        _check_error(srv.http.post("/v1/chat/completions", json={"model": MODEL, "messages": CHAT, **body}), 400, param)
    # parsed before a stream starts: a 400 too, not an error event in a 200 stream
    _check_error(srv.http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "stream": True,
                                                        "structured_outputs": {"regex": "[a-"}}), 400,
                 "structured_outputs")
    assert_all_blocks_free(srv)
