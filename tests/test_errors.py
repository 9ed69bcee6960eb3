"""Bad input: a clear ValueError/TypeError naming the value, raised before the engine changes state."""
from __future__ import annotations

import json
import os

import pytest

from nanovllm import LLM, SamplingParams
from nanovllm.cli import main as cli_main


@pytest.fixture(scope="module")
def llm(tiny_ckpt):
    return LLM(tiny_ckpt("qwen3"), device="cpu", max_model_len=256, kvcache_block_size=16)


@pytest.mark.parametrize("kwargs, match", [
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"min_p": 1.5}, "min_p"),
    ({"top_k": -2}, "top_k"),
    ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
    ({"stop": [""]}, "stop"),
    ({"logprobs": 50}, "logprobs"),
])
def test_sampling_params_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs", [{"temperature": "hot"}, {"max_tokens": 2.5}, {"stop": 3},
                                    {"stop_token_ids": ["a"]}, {"ignore_eos": 1}, {"top_k": True}])
def test_sampling_params_types(kwargs):
    with pytest.raises(TypeError, match=next(iter(kwargs))):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("prompt, match", [
    ("", "empty"),
    ([], "empty"),
    ([1, 2, 100000], "100000"),
    ([-1], "-1"),
    (list(range(10)) * 30, "300 tokens.*max_model_len=256"),
])
def test_bad_prompts(llm, prompt, match):
    with pytest.raises(ValueError, match=match):
        llm.generate([prompt], use_tqdm=False)


def test_bad_prompt_types(llm):
    with pytest.raises(TypeError):
        llm.generate([[1, "a"]], use_tqdm=False)
    with pytest.raises(TypeError):
        llm.generate(42, use_tqdm=False)
    with pytest.raises(ValueError, match="2 sampling_params for 3 prompts"):
        llm.generate(["a", "b", "c"], [SamplingParams(), SamplingParams()], use_tqdm=False)
    with pytest.raises(ValueError, match="stop_token_ids"):
        llm.generate(["a"], SamplingParams(stop_token_ids=[10**6]), use_tqdm=False)


def test_bad_request_changes_nothing(llm):
    good = [1, 2, 3, 4]
    with pytest.raises(ValueError, match="prompt 1"):
        llm.generate([good, [10**7]], SamplingParams(max_tokens=4), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks
    out = llm.generate([good], SamplingParams(max_tokens=4), use_tqdm=False)
    assert len(out[0]["token_ids"]) == 4


def test_engine_args(tiny_ckpt, tmp_path):
    path = tiny_ckpt("qwen3")
    with pytest.raises(TypeError, match="max_num_seq'"):
        LLM(path, max_num_seq=4)
    with pytest.raises(ValueError, match="kvcache_block_size"):
        LLM(path, kvcache_block_size=20)
    with pytest.raises(ValueError, match="device"):
        LLM(path, device="tpu")
    with pytest.raises(ValueError, match="dtype"):
        LLM(path, dtype="int8")
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        LLM(path, gpu_memory_utilization=1.5)
    with pytest.raises(ValueError, match="max_model_len=100000"):
        LLM(path, max_model_len=100000)
    with pytest.raises(ValueError, match="fewer than max_model_len"):
        LLM(path, kvcache_block_size=16, num_kvcache_blocks=2, max_model_len=64)
    with pytest.raises(ValueError, match="does not exist"):
        LLM(str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        LLM(path, tensor_parallel_size=0)


def test_unsupported_architecture(tiny_ckpt, tmp_path):
    src = tiny_ckpt("qwen3")
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        LLM(str(tmp_path))


def test_missing_weights(tiny_ckpt, tmp_path):
    src = tiny_ckpt("qwen3")
    for name in os.listdir(src):
        if not name.endswith(".safetensors"):
            (tmp_path / name).write_bytes(open(os.path.join(src, name), "rb").read())
    with pytest.raises(ValueError, match="safetensors"):
        LLM(str(tmp_path))


def test_cli_reports_errors(tmp_path, capsys):
    assert cli_main(["generate", "--model", str(tmp_path / "missing"), "--quiet"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_cli_engine_flags():
    from nanovllm.cli import build_parser, engine_kwargs
    ns = build_parser().parse_args(["generate", "--no-async-scheduling", "--enforce-eager", "--max-model-len", "64"])
    assert engine_kwargs(ns) == {"async_scheduling": False, "enforce_eager": True, "max_model_len": 64}
    assert engine_kwargs(build_parser().parse_args(["generate"])) == {}
