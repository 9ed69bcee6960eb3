"""Tests for nanovllm.utils.tiny_model (tiny random HF checkpoints)."""

import json
import os
import sys

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
pytest.importorskip("safetensors")

try:
    import nanovllm  # noqa: F401
except ImportError:  # running without the repo root on sys.path
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from safetensors import safe_open  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from nanovllm.utils.tiny_model import (  # noqa: E402
    EOS_TOKEN,
    build_tiny_checkpoint,
    default_tiny_model_dir,
    ensure_default_tiny_model,
)

ARCHS = ["qwen3", "qwen2", "llama"]
EXPECTED_CLASS = {"qwen3": "Qwen3ForCausalLM", "qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM"}

TEXTS = [
    "Hello world! It's 9:45 and the quick brown fox jumps.",
    "  leading spaces,\ttabs and\nnewlines\n\n  end ",
    "def f(x):\n    return x * 2  # comment\n",
    "Numbers 1234567890 and symbols ~!@#$%^&*()_+{}|:\"<>?",
    "zzqx unseen wordz qqq",
    "",
]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return {arch: build_tiny_checkpoint(str(root / arch), arch) for arch in ARCHS}


def _weight_keys(path):
    keys = set()
    for name in os.listdir(path):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(path, name), "pt") as f:
                keys.update(f.keys())
    return keys


def _load(path):
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    tok = AutoTokenizer.from_pretrained(path)
    return model, tok


@pytest.mark.parametrize("arch", ARCHS)
def test_builds_and_loads(checkpoints, arch):
    path = checkpoints[arch]
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    assert cfg["architectures"] == [EXPECTED_CLASS[arch]]
    assert cfg.get("dtype", cfg.get("torch_dtype")) == "float32"
    assert cfg["tie_word_embeddings"] is True
    with open(os.path.join(path, "generation_config.json")) as f:
        gen_cfg = json.load(f)

    model, tok = _load(path)
    assert type(model).__name__ == EXPECTED_CLASS[arch]
    assert model.dtype == torch.float32
    eos_id = tok.convert_tokens_to_ids(EOS_TOKEN)
    assert tok.eos_token == EOS_TOKEN and tok.pad_token == EOS_TOKEN
    assert tok.eos_token_id == eos_id == cfg["eos_token_id"] == gen_cfg["eos_token_id"]
    assert 400 <= len(tok) <= 600
    vocab = model.config.vocab_size
    assert vocab % 64 == 0 and vocab >= len(tok)
    assert model.config.num_hidden_layers == 2
    assert model.config.num_key_value_heads == 2
    assert getattr(model.config, "head_dim", 16) == 16

    # Tied embeddings: the checkpoint does not store lm_head.weight.
    keys = _weight_keys(path)
    assert "model.embed_tokens.weight" in keys
    assert "lm_head.weight" not in keys
    assert model.get_output_embeddings().weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    # EOS row of the output projection is zeroed (EOS logit is always 0).
    assert torch.all(model.get_output_embeddings().weight[eos_id] == 0)

    # Norm weights are randomized around 1, not all ones.
    norm = model.model.norm.weight
    assert not torch.allclose(norm, torch.ones_like(norm))
    assert abs(norm.mean().item() - 1.0) < 0.1


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_generate(checkpoints, arch):
    model, tok = _load(checkpoints[arch])
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, len(tok) - 3, (3, 9), generator=g)
    with torch.no_grad():
        out = model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=16,
                             do_sample=False, pad_token_id=tok.pad_token_id)
    assert out.shape == (3, 9 + 16)
    new = out[:, 9:]
    assert not torch.any(new == tok.eos_token_id)
    assert len(set(new.flatten().tolist())) >= 8  # not one token repeated forever
    # greedy generate is deterministic and matches a manual argmax loop
    ids = prompts[:1]
    with torch.no_grad():
        for _ in range(4):
            nxt = model(input_ids=ids).logits[:, -1].argmax(-1, keepdim=True)
            ids = torch.cat([ids, nxt], dim=1)
    assert torch.equal(ids[0, 9:], out[0, 9:13])
    text = tok.decode(new[0], skip_special_tokens=True)
    assert isinstance(text, str)


@pytest.mark.parametrize("arch", ARCHS)
def test_logit_gap_not_flat(checkpoints, arch):
    model = AutoModelForCausalLM.from_pretrained(checkpoints[arch]).eval()
    stats = logit_gap_stats(model, num_prompts=128)
    assert stats["frac_gt_1e-3"] >= 0.95
    assert stats["median"] > 0.05


def test_qwen2_biases_nonzero(checkpoints):
    model = AutoModelForCausalLM.from_pretrained(checkpoints["qwen2"])
    names = [n for n, _ in model.named_parameters() if n.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias"))]
    assert len(names) == 3 * model.config.num_hidden_layers
    params = dict(model.named_parameters())
    for n in names:
        assert torch.all(params[n] != 0), n
        assert params[n].abs().mean() > 1e-2, n
    assert "model.layers.0.self_attn.q_proj.bias" in _weight_keys(checkpoints["qwen2"])


def _rope_dict(cfg):
    """Llama-3 rope parameters from a config dict/object (transformers 4.x or 5.x)."""
    get = cfg.get if isinstance(cfg, dict) else (lambda k: getattr(cfg, k, None))
    rope = dict(get("rope_parameters") or get("rope_scaling") or {})
    rope.setdefault("rope_theta", get("rope_theta"))
    rope.setdefault("rope_type", rope.get("type"))
    return rope


def test_llama_rope_scaling(checkpoints):
    path = checkpoints["llama"]
    with open(os.path.join(path, "config.json")) as f:
        raw = json.load(f)
    for cfg in (raw, AutoConfig.from_pretrained(path)):
        rope = _rope_dict(cfg)
        assert rope["rope_type"] == "llama3"
        assert rope["factor"] == 8.0
        assert rope["low_freq_factor"] == 1.0
        assert rope["high_freq_factor"] == 4.0
        assert rope["original_max_position_embeddings"] < raw["max_position_embeddings"]
        assert rope["rope_theta"] == 500000.0


def test_qwen_rope_default(checkpoints):
    for arch in ("qwen3", "qwen2"):
        with open(os.path.join(checkpoints[arch], "config.json")) as f:
            rope = _rope_dict(json.load(f))
        assert rope["rope_type"] in (None, "default")
        assert rope["rope_theta"] == 1000000.0


def test_chat_template(checkpoints):
    tok = AutoTokenizer.from_pretrained(checkpoints["qwen3"])
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n"
                    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n")
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=False)
    assert text.endswith("Hi there<|im_end|>\n")
    ids = tok.encode(text)
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>")
    assert tok.convert_tokens_to_ids("<|im_end|>") in ids


@pytest.mark.parametrize("arch", ARCHS)
def test_tokenizer_round_trip(checkpoints, arch):
    from tokenizers import Tokenizer

    path = checkpoints[arch]
    tok = AutoTokenizer.from_pretrained(path)
    raw = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
    for text in TEXTS + ["<|im_start|>user\nhi<|im_end|>\n<|endoftext|>"]:
        ids = tok.encode(text)
        # whichever tokenizer class transformers picks, it agrees with tokenizer.json
        assert ids == raw.encode(text).ids
        assert tok.decode(ids) == text
    ids = tok.encode("The quick brown fox jumps over the lazy dog.")
    assert len(ids) < 0.6 * len("The quick brown fox jumps over the lazy dog.")  # merges were learned
    assert tok.decode(ids[:3]) + tok.decode(ids[3:]) == "The quick brown fox jumps over the lazy dog."


def test_sharded_checkpoint(tmp_path, checkpoints):
    path = build_tiny_checkpoint(str(tmp_path / "sharded"), "qwen3", max_shard_size="20KB")
    assert os.path.isfile(os.path.join(path, "model.safetensors.index.json"))
    shards = [n for n in os.listdir(path) if n.endswith(".safetensors")]
    assert len(shards) > 1
    with open(os.path.join(path, "model.safetensors.index.json")) as f:
        index = json.load(f)
    assert set(index["weight_map"].values()) == set(shards)
    assert "lm_head.weight" not in index["weight_map"]
    # same seed -> same weights as the unsharded checkpoint
    a = AutoModelForCausalLM.from_pretrained(path).eval()
    b = AutoModelForCausalLM.from_pretrained(checkpoints["qwen3"]).eval()
    ids = torch.arange(10).unsqueeze(0)
    with torch.no_grad():
        assert torch.equal(a(input_ids=ids).logits, b(input_ids=ids).logits)


def test_options(tmp_path):
    p = build_tiny_checkpoint(tmp_path / "untied", "llama", tie_word_embeddings=False, vocab_size=600,
                              seed=3, num_layers=1)
    keys = _weight_keys(p)
    assert "lm_head.weight" in keys
    model = AutoModelForCausalLM.from_pretrained(p)
    assert model.config.vocab_size == 600 and model.config.num_hidden_layers == 1
    assert model.config.tie_word_embeddings is False

    # seeds matter; the same seed reproduces
    s1 = build_tiny_checkpoint(tmp_path / "s1", "qwen3", seed=1)
    s1b = build_tiny_checkpoint(tmp_path / "s1b", "qwen3", seed=1)
    s2 = build_tiny_checkpoint(tmp_path / "s2", "qwen3", seed=2)
    w = {}
    for name, p in (("s1", s1), ("s1b", s1b), ("s2", s2)):
        with safe_open(os.path.join(p, "model.safetensors"), "pt") as f:
            w[name] = f.get_tensor("model.layers.0.self_attn.q_proj.weight")
    assert torch.equal(w["s1"], w["s1b"])
    assert not torch.equal(w["s1"], w["s2"])
    assert abs(w["s1"].std().item() - 0.3) < 0.05  # default init_std

    with pytest.raises(ValueError, match="mistral"):
        build_tiny_checkpoint(tmp_path / "bad", "mistral")
    with pytest.raises(ValueError):
        build_tiny_checkpoint(tmp_path / "small", "qwen3", vocab_size=100)
    with pytest.raises(FileExistsError):
        build_tiny_checkpoint(s1, "qwen3")
    assert build_tiny_checkpoint(s1, "qwen3", seed=2, overwrite=True) == s1
    with safe_open(os.path.join(s1, "model.safetensors"), "pt") as f:
        assert torch.equal(f.get_tensor("model.layers.0.self_attn.q_proj.weight"), w["s2"])
    # an existing empty directory is fine
    (tmp_path / "empty").mkdir()
    build_tiny_checkpoint(tmp_path / "empty", "qwen2")
    assert not [n for n in os.listdir(tmp_path) if ".tmp-" in n or ".trash-" in n]


def test_ensure_default_tiny_model(tmp_path, monkeypatch):
    monkeypatch.delenv("NANOVLLM_TINY_MODEL_DIR", raising=False)
    monkeypatch.setenv("NANOVLLM_CACHE", str(tmp_path / "cache"))
    expected = default_tiny_model_dir()
    assert expected == str(tmp_path / "cache" / "tiny-qwen3-random")
    path = ensure_default_tiny_model()
    assert path == expected
    cfg_file = os.path.join(path, "config.json")
    mtime = os.stat(cfg_file).st_mtime_ns
    assert ensure_default_tiny_model() == path  # reused, not rebuilt
    assert os.stat(cfg_file).st_mtime_ns == mtime
    model, tok = _load(path)
    assert type(model).__name__ == "Qwen3ForCausalLM"

    # an incomplete directory (e.g. a crashed build) is replaced
    os.remove(os.path.join(path, "model.safetensors"))
    assert ensure_default_tiny_model() == path
    assert os.path.isfile(os.path.join(path, "model.safetensors"))
    AutoModelForCausalLM.from_pretrained(path)


def logit_gap_stats(model, *, num_prompts=64, prompt_len=12, seed=1234, vocab_limit=None):
    """Top-1 minus top-2 next-token logit gap for random prompts.

    Returns a dict with min / median / mean and the fraction of prompts whose
    gap exceeds 1e-3, 1e-2 and 1e-1.  ``model`` is a transformers causal LM.
    """
    import torch

    vocab = vocab_limit or model.config.vocab_size
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (num_prompts, prompt_len), generator=gen)
    with torch.no_grad():
        logits = model(input_ids=ids).logits[:, -1, :].float()
    top2 = logits.topk(2, dim=-1).values
    gap = top2[:, 0] - top2[:, 1]
    return {
        "min": gap.min().item(),
        "median": gap.median().item(),
        "mean": gap.mean().item(),
        "frac_gt_1e-3": (gap > 1e-3).float().mean().item(),
        "frac_gt_1e-2": (gap > 1e-2).float().mean().item(),
        "frac_gt_1e-1": (gap > 1e-1).float().mean().item(),
        "logit_std": logits.std().item(),
    }
