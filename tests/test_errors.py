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


def test_requests_that_would_leave_nothing_to_sample(llm):
    """allowed_token_ids emptied by bad_words, or holding only ids that min_tokens holds back: a ValueError up
    front (before, such a row sampled token 0, which the request did not allow)."""
    tok = llm.tokenizer
    (amp,) = tok.encode("&", add_special_tokens=False)
    eos = sorted(llm.engine.eos_token_ids)[0]
    with pytest.raises(ValueError, match="bad_words ban every token of allowed_token_ids"):
        llm.generate([[1, 2]], SamplingParams(allowed_token_ids=[amp], bad_words=["&"]), use_tqdm=False)
    with pytest.raises(ValueError, match="min_tokens=3"):
        llm.generate([[1, 2]], SamplingParams(allowed_token_ids=[eos], min_tokens=3, max_tokens=5), use_tqdm=False)
    with pytest.raises(ValueError, match="min_tokens=2"):
        llm.generate([[1, 2]], SamplingParams(allowed_token_ids=[7], stop_token_ids=[7], min_tokens=2),
                     use_tqdm=False)
    # what is left is sampled: EOS after min_tokens, the allowed id that is not held back before it
    out = llm.generate([[1, 2]], SamplingParams(allowed_token_ids=[eos, 7], min_tokens=2, max_tokens=5),
                       use_tqdm=False)[0]["token_ids"]
    assert out[:2] == [7, 7] and set(out) <= {7, eos}
    # ignore_eos: EOS is an ordinary token, so it is not held back
    out = llm.generate([[1, 2]], SamplingParams(allowed_token_ids=[eos], min_tokens=2, max_tokens=3,
                                                ignore_eos=True), use_tqdm=False)[0]["token_ids"]
    assert out == [eos] * 3


def test_fields_changed_after_construction_are_checked(llm):
    params = SamplingParams(max_tokens=3)
    params.n = 0                        # used to hang generate(): no samples to wait for
    with pytest.raises(ValueError, match="n must be"):
        llm.generate([[1, 2, 3]], params, use_tqdm=False)
    params.n, params.temperature = 1, -1.0
    with pytest.raises(ValueError, match="temperature"):
        llm.generate([[1, 2, 3]], params, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_top_k_beyond_int32_keeps_every_token(llm):
    """A top_k past any vocabulary means all tokens; one beyond int32 used to fail the whole step (every request
    in it) when the sampler's inputs were packed."""
    assert SamplingParams(top_k=2**31).top_k == 0 and SamplingParams(top_k=2**70).top_k == 0
    greedy = SamplingParams(max_tokens=4, temperature=0.0)
    want = llm.generate([[1, 2, 3]], greedy, use_tqdm=False)[0]["token_ids"]
    outs = llm.generate([[1, 2, 3]] * 2, [SamplingParams(max_tokens=4, top_k=2**31, seed=1), greedy],
                        use_tqdm=False)
    assert len(outs[0]["token_ids"]) == 4 and outs[1]["token_ids"] == want


@pytest.mark.parametrize("bias", [{"1_0": 1.0}, {" 10": 1.0}, {"١": 1.0}, {(1,): 1.0}, {None: 1.0}, {1.0: 2.0}])
def test_logit_bias_keys_are_token_ids(bias):
    with pytest.raises(ValueError, match="logit_bias keys"):
        SamplingParams(logit_bias=bias)
    assert SamplingParams(logit_bias={"10": 1.0, 11: -1.0}).logit_bias == {10: 1.0, 11: -1.0}


def test_chat_messages_are_checked(llm):
    for messages, match in [([{"role": "user", "content": None}], "message 0: content"),
                            ([{"role": "user", "content": "hi"}, {"role": None, "content": "x"}], "message 1: role"),
                            ([{"role": "user", "content": 5}], "message 0: content")]:
        with pytest.raises(TypeError, match=match):
            llm.chat(messages, use_tqdm=False)
    with pytest.raises(TypeError, match="chat_template_kwargs"):
        llm.chat([{"role": "user", "content": "hi"}], chat_template_kwargs="x", use_tqdm=False)


def test_engine_args_types(tiny_ckpt):
    path = tiny_ckpt("qwen3")
    with pytest.raises(ValueError, match="cuda:N"):
        LLM(path, device="cuda:x")
    for name in ("dtype", "kv_cache_dtype", "device"):
        with pytest.raises(TypeError, match=f"{name} must be a string"):
            LLM(path, **{name: ["x"]})


def test_bad_words_are_deduplicated_in_order(llm):
    from nanovllm.engine.sampling_features import bad_words_token_ids
    tok = llm.tokenizer
    ids = bad_words_token_ids(tok, ["&", "&", " &", "a b"])
    alone = tuple(tok.encode("&", add_special_tokens=False))
    spaced = tuple(tok.encode(" &", add_special_tokens=False))
    assert ids[:2] == list(dict.fromkeys([alone, spaced]))[:2] and len(ids) == len(set(ids))
    assert ids[0] == alone


def test_prompt_dicts_are_checked(llm):
    with pytest.raises(ValueError, match="multi_modal_data"):
        llm.generate([{"prompt": "hi", "multi_modal_data": {"image": None}}], use_tqdm=False)
    with pytest.raises(TypeError, match="prompt_token_ids must be a list"):
        llm.generate([{"prompt_token_ids": "hi"}], use_tqdm=False)
    with pytest.raises(ValueError, match=r"\[1, 'a'\]"):
        llm.generate([{1: "x", "a": 2}], use_tqdm=False)
    out = llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=2), use_tqdm=False)
    assert len(out[0]["token_ids"]) == 2
