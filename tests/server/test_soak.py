"""A bounded soak: 300 concurrent streams, a third of them disconnected mid-stream. No errors, every other stream
complete, every KV block free at the end (the disconnected ones were aborted, not run to the end)."""
from __future__ import annotations

import asyncio
import json
import random

import pytest

httpx = pytest.importorskip("httpx")

from tests.server.server_helpers import API_KEY, MODEL, assert_all_blocks_free  # noqa: E402

NUM_STREAMS = 300
MAX_TOKENS = 24


def test_300_streams_a_third_disconnected(srv):
    aborted0, errors0 = srv.client.metrics.finished["abort"], srv.client.metrics.finished["error"]
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 470) for _ in range(rng.randint(4, 12))] for _ in range(NUM_STREAMS)]

    async def one(http, i):
        leave = i % 3 == 0
        body = {"model": MODEL, "prompt": prompts[i], "max_tokens": 400 if leave else MAX_TOKENS, "temperature": 0.8,
                "seed": i, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        await asyncio.sleep(rng.random() * 0.5)
        chunks, usage, done = 0, None, False
        async with http.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200, await r.aread()
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                obj = json.loads(line[6:])
                assert "error" not in obj, obj
                if obj.get("usage"):
                    usage = obj["usage"]
                chunks += 1
                if leave and chunks == 3:
                    return "left"                      # the client goes away mid-stream
        assert done and usage["completion_tokens"] == MAX_TOKENS, (i, usage)
        return "done"

    async def main():
        limits = httpx.Limits(max_connections=NUM_STREAMS + 10, max_keepalive_connections=NUM_STREAMS + 10)
        async with httpx.AsyncClient(base_url=srv.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120,
                                     limits=limits) as http:
            return await asyncio.gather(*(one(http, i) for i in range(NUM_STREAMS)))

    results = asyncio.run(main())
    assert results.count("left") == NUM_STREAMS // 3 and results.count("done") == NUM_STREAMS - NUM_STREAMS // 3
    assert_all_blocks_free(srv)
    assert srv.client.metrics.finished["abort"] - aborted0 >= NUM_STREAMS // 3 - 5    # stopped, not run out
    assert srv.client.metrics.finished["error"] == errors0
    assert httpx.get(srv.url + "/health").status_code == 200
