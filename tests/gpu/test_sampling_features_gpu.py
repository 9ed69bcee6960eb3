"""On the GPU, at full size: penalties, biases and structured-output masks give the CPU's tokens (float32), and a
JSON schema holds for 256 concurrent requests under async scheduling and CUDA graphs."""
from __future__ import annotations

import json

import pytest
import torch

from nanovllm import LLM, SamplingParams, StructuredOutputsParams
from tests.conftest import make_prompts

pytestmark = pytest.mark.gpu


def test_penalties_and_masks_match_cpu(tiny_ckpt):
    prompts = make_prompts([9, 33, 70, 5], seed=13)
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, frequency_penalty=0.7,
                             repetition_penalty=1.3, n=2),
              SamplingParams(temperature=0, max_tokens=24, logit_bias={5: 4.0}, allowed_token_ids=list(range(200))),
              SamplingParams(temperature=0, max_tokens=24, bad_words=["the", "time"], presence_penalty=1.0),
              SamplingParams(temperature=0, max_tokens=24, structured_outputs=StructuredOutputsParams(
                  regex=r"[a-z]{3,9}( [a-z]{2,7}){2}"))]
    outs = {}
    for device in ("cpu", "cuda"):
        llm = LLM(tiny_ckpt("qwen3"), device=device, dtype="float32", kvcache_block_size=16)
        outs[device] = [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params, use_tqdm=False)]
        llm.shutdown()
    assert outs["cuda"] == outs["cpu"]


def test_json_schema_at_256_concurrent_requests(tiny_ckpt):
    schema = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                                               "tag": {"enum": ["x", "y", "z"]}},
              "required": ["id", "tag"], "additionalProperties": False}
    llm = LLM(tiny_ckpt("qwen3"), kvcache_block_size=16, max_num_seqs=256)
    assert llm.engine.async_scheduling
    outs = llm.generate(make_prompts([20] * 256, seed=1), [SamplingParams(
        temperature=1.0, seed=i, max_tokens=40, structured_outputs=StructuredOutputsParams(json=schema))
        for i in range(256)], use_tqdm=False)
    for o in outs:
        obj = json.loads(o["text"])
        assert set(obj) == {"id", "tag"} and 0 <= obj["id"] <= 999 and obj["tag"] in "xyz"
    assert torch.cuda.is_available()
