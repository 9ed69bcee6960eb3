"""The server on the GPU: an engine-core process with CUDA graphs and async scheduling behind the HTTP app, its
greedy streams against the offline engine on the same checkpoint (trained: clear margins, so batching order
cannot flip a token), and every KV block free afterwards."""
from __future__ import annotations

import asyncio
import json

import pytest

from nanovllm import LLM, SamplingParams
from tests.gpu.engines import COMMON, free_gpu, random_prompts

pytestmark = pytest.mark.gpu

httpx = pytest.importorskip("httpx")
for _m in ("fastapi", "uvicorn", "openai"):
    pytest.importorskip(_m)

from tests.server.server_helpers import API_KEY, MODEL, assert_all_blocks_free, serve_inproc  # noqa: E402

ENGINE = dict(device="cuda", dtype="float32", max_model_len=1024, **COMMON)


def test_concurrent_greedy_streams_match_offline(trained_ckpt):
    prompts = random_prompts(48, max_len=300, seed=3)
    max_tokens = [16 + (i * 7) % 48 for i in range(len(prompts))]
    with LLM(trained_ckpt, **ENGINE) as llm:
        refs = llm.generate(prompts, [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True)
                                      for m in max_tokens], use_tqdm=False)
    free_gpu()
    srv = serve_inproc(trained_ckpt, **{**ENGINE, "num_kvcache_blocks": None, "kvcache_block_size": 256})
    try:
        async def one(http, i):
            await asyncio.sleep(i * 0.01)                  # arrivals spread: requests join a running batch
            body = {"model": MODEL, "prompt": prompts[i], "max_tokens": max_tokens[i], "temperature": 0,
                    "ignore_eos": True, "stream": True, "logprobs": 0, "return_tokens_as_token_ids": True}
            ids = []
            async with http.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        obj = json.loads(line[6:])
                        assert "error" not in obj, obj
                        ids += [int(t.split(":")[1]) for t in obj["choices"][0]["logprobs"]["tokens"]]
            return ids

        async def main():
            async with httpx.AsyncClient(base_url=srv.url, headers={"Authorization": f"Bearer {API_KEY}"},
                                         timeout=120) as http:
                return await asyncio.gather(*(one(http, i) for i in range(len(prompts))))

        got = asyncio.run(main())
        assert got == [r["token_ids"] for r in refs]
        assert_all_blocks_free(srv)
    finally:
        srv.stop()
        free_gpu()
