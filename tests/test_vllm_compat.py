"""Drop-in for vLLM (and nano-vllm) users: result types, n, penalties, biases, allowed/bad tokens, logprobs.

Penalties and biases are checked against plain-torch references of vLLM's formulas driven by transformers' logits
(greedy, float32), and repetition_penalty against `transformers.generate(repetition_penalty=...)` itself.
"""
from __future__ import annotations

import pickle

import pytest
import torch

from nanovllm import LLM, CompletionOutput, Logprob, RequestOutput, SamplingParams
from nanovllm.layers.logits_processing import apply_token_bitmask, penalties_ref
from tests.conftest import make_prompts


@pytest.fixture(scope="module")
def llm(tiny_ckpt):
    return LLM(tiny_ckpt("qwen3"), device="cpu", kvcache_block_size=16)


@pytest.fixture(scope="module")
def hf_model(tiny_ckpt):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(tiny_ckpt("qwen3"), dtype=torch.float32).eval()


def _hf_greedy(model, prompt: list[int], n: int, process) -> list[int]:
    """Greedy decoding with transformers' logits and `process(logits, prompt, out) -> logits` at every step."""
    out: list[int] = []
    for _ in range(n):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + out])).logits[0, -1].float()
        out.append(int(process(logits, prompt, out).argmax()))
    return out


def _vllm_formula(logits, prompt, out, p: SamplingParams):
    """vLLM's logits processing, written out: bias / allowed tokens, then the three penalties."""
    V = logits.numel()
    x = logits.clone()
    if p.allowed_token_ids is not None:
        keep = torch.zeros(V, dtype=torch.bool)
        keep[p.allowed_token_ids] = True
        x[~keep] = float("-inf")
    for t, b in (p.logit_bias or {}).items():
        x[t] += b
    counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=V).float()
    in_prompt = torch.zeros(V, dtype=torch.bool)
    in_prompt[prompt] = True
    seen = (counts > 0) | in_prompt
    r = p.repetition_penalty
    x = torch.where(seen, torch.where(x > 0, x / r, x * r), x)
    return x - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).float()


def test_vllm_style_script_runs_unchanged(llm):
    prompts = ["Hello, my name is", "The capital of France is"]
    outs = llm.generate(prompts, SamplingParams(temperature=0.8, top_p=0.95, max_tokens=8, seed=0), use_tqdm=False)
    assert all(isinstance(o, RequestOutput) for o in outs)
    for prompt, o in zip(prompts, outs):
        assert o.prompt == prompt and o.finished and o.request_id
        assert o.prompt_token_ids == llm.get_tokenizer().encode(prompt) and o.prompt_logprobs is None
        c = o.outputs[0]
        assert isinstance(c, CompletionOutput) and len(o.outputs) == 1 and c.index == 0
        assert c.finish_reason == "length" and c.finished() and len(c.token_ids) == 8
        assert c.text == llm.get_tokenizer().decode(c.token_ids, skip_special_tokens=True)
        assert c.cumulative_logprob is None and c.logprobs is None
        # nano-vllm's dict access: the first completion
        assert o["text"] == c.text and o["token_ids"] == c.token_ids and o["finish_reason"] == "length"
        assert o["prompt_token_ids"] == o.prompt_token_ids and "text" in o
    with pytest.raises(KeyError, match="nope"):
        outs[0]["nope"]
    assert pickle.loads(pickle.dumps(outs)) == outs           # plain data (it crosses processes)


def test_n_samples_are_distinct_reproducible_and_share_the_prompt(llm):
    prompt = make_prompts([70], seed=5)[0]                     # 4 full 16-token blocks
    p = SamplingParams(n=3, temperature=1.0, seed=42, max_tokens=12)
    bm = llm.engine.block_manager
    hits0 = bm.prefix_hits
    a = llm.generate([prompt], p, use_tqdm=False)[0]
    assert bm.prefix_hits - hits0 == 2                         # samples 1 and 2 reuse sample 0's prompt blocks
    assert [c.index for c in a.outputs] == [0, 1, 2]
    ids = [c.token_ids for c in a.outputs]
    assert len({tuple(t) for t in ids}) == 3                   # distinct
    b = llm.generate([prompt], p, use_tqdm=False)[0]
    assert [c.token_ids for c in b.outputs] == ids             # reproducible
    # sample i is seeded with seed + i (vLLM's rule): the same as n separate requests
    single = llm.generate([prompt] * 3, [SamplingParams(temperature=1.0, seed=42 + i, max_tokens=12)
                                         for i in range(3)], use_tqdm=False)
    assert [o["token_ids"] for o in single] == ids
    # greedy samples are all the same; a mix of requests with n in one call comes back in order
    mixed = llm.generate([prompt, [5, 6, 7]], [SamplingParams(n=2, temperature=0, max_tokens=5),
                                               SamplingParams(n=4, temperature=0.7, max_tokens=3)], use_tqdm=False)
    assert len(mixed[0].outputs) == 2 and mixed[0].outputs[0].token_ids == mixed[0].outputs[1].token_ids
    assert len(mixed[1].outputs) == 4 and all(len(c.token_ids) == 3 for c in mixed[1].outputs)


def test_repetition_penalty_matches_transformers(tiny_ckpt, hf_greedy, llm):
    from transformers import AutoModelForCausalLM
    path = tiny_ckpt("qwen3")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = make_prompts([6, 40], seed=8)
    for rep in (1.5, 0.7):
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=20, repetition_penalty=rep,
                                                    ignore_eos=True), use_tqdm=False)
        for prompt, o in zip(prompts, outs):
            ids = torch.tensor([prompt])
            with torch.no_grad():
                g = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, do_sample=False,
                                   repetition_penalty=rep, pad_token_id=0, eos_token_id=None)
            assert o["token_ids"] == g[0, len(prompt):].tolist(), rep
    plain = llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False)
    assert plain[0]["token_ids"] != outs[0]["token_ids"]      # the penalty did something


@pytest.mark.parametrize("kw", [
    dict(presence_penalty=1.5),
    dict(frequency_penalty=0.8),
    dict(presence_penalty=-0.5, frequency_penalty=1.2, repetition_penalty=1.2),
    dict(logit_bias={7: 5.0, 11: 3.5, 300: -100}),
    dict(allowed_token_ids=[3, 9, 40, 41, 200, 201, 202]),
    dict(allowed_token_ids=[3, 9, 40, 200], logit_bias={9: 2.0, 5: 50.0}, frequency_penalty=0.5),
])
def test_penalties_and_biases_match_vllm_formula(llm, hf_model, kw):
    p = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True, **kw)
    prompts = make_prompts([9, 33], seed=13)
    # a penalized request next to plain ones, greedy and sampled, in one batch
    outs = llm.generate(prompts + [[1, 2, 3]], [p, p, SamplingParams(temperature=0.9, max_tokens=10)],
                        use_tqdm=False)
    plain = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=14, ignore_eos=True), use_tqdm=False)
    for prompt, o in zip(prompts, outs):
        want = _hf_greedy(hf_model, prompt, 14, lambda x, pr, out: _vllm_formula(x, pr, out, p))
        assert o["token_ids"] == want, kw
        if p.allowed_token_ids:
            assert set(o["token_ids"]) <= set(p.allowed_token_ids)
    assert [o["token_ids"] for o in outs[:2]] != [o["token_ids"] for o in plain]   # the feature did something


def test_async_scheduling_gives_the_same_tokens(tiny_ckpt, llm):
    """With async scheduling (the GPU's default) each step is scheduled before the previous one's tokens are read:
    penalty counts stay on the device and bad-word bans are filled late (a deferred step); same tokens."""
    prompts = make_prompts([9, 33, 5], seed=13)
    tok = llm.get_tokenizer()
    word = next(w for w in ("the", "time", "upon", "and") if len(tok.encode(" " + w, add_special_tokens=False)) > 1)
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, frequency_penalty=0.7, n=2),
              SamplingParams(temperature=0.8, seed=1, max_tokens=12, bad_words=[word], repetition_penalty=1.3),
              SamplingParams(temperature=0.8, seed=2, max_tokens=12, logit_bias={5: 4.0}, logprobs=1)]
    a = LLM(tiny_ckpt("qwen3"), device="cpu", kvcache_block_size=16, async_scheduling=True).generate(
        prompts, params, use_tqdm=False)
    b = llm.generate(prompts, params, use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in a] == [[c.token_ids for c in o.outputs] for o in b]


def test_penalties_with_sampling_change_nothing_else(llm):
    """A sampled (temperature 1) penalized request: its own seed stream, tokens reproducible, and the plain
    requests batched with it unchanged."""
    prompts = make_prompts([12, 50, 7], seed=2)
    plain = [SamplingParams(temperature=1.0, seed=i, max_tokens=10) for i in range(3)]
    ref = llm.generate(prompts, plain, use_tqdm=False)
    pen = SamplingParams(temperature=1.0, seed=7, max_tokens=10, frequency_penalty=2.0, logit_bias={3: -100})
    a = llm.generate(prompts + [prompts[0]], plain + [pen], use_tqdm=False)
    b = llm.generate([prompts[0]], pen, use_tqdm=False)
    assert [o["token_ids"] for o in a[:3]] == [o["token_ids"] for o in ref]
    assert a[3]["token_ids"] == b[0]["token_ids"] and 3 not in a[3]["token_ids"]


def test_bad_words(llm):
    tok = llm.get_tokenizer()
    prompt = "Once upon a time"
    base = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=30), use_tqdm=False)[0]
    words = base["text"].split()
    multi = next(w for w in words if len(tok.encode(" " + w, add_special_tokens=False)) > 1)
    single = next(w for w in words if len(tok.encode(" " + w, add_special_tokens=False)) == 1 and w != multi)
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=30, bad_words=[multi, single]),
                       use_tqdm=False)[0]
    ids = out["token_ids"]
    for w in (multi, single):
        for text in (w, " " + w):
            seq = tok.encode(text, add_special_tokens=False)
            assert not any(ids[i:i + len(seq)] == seq for i in range(len(ids))), (w, text)
    assert ids != base["token_ids"]


def test_logprobs_and_prompt_logprobs_format(llm, hf_model):
    prompt = make_prompts([20], seed=4)[0]
    o = llm.generate([prompt], SamplingParams(temperature=0.7, seed=3, max_tokens=6, logprobs=2, prompt_logprobs=3),
                     use_tqdm=False)[0]
    c = o.outputs[0]
    assert len(c.logprobs) == 6
    with torch.no_grad():
        full = torch.log_softmax(hf_model(torch.tensor([prompt + c.token_ids])).logits[0].float(), dim=-1)
    for i, (tok, pos) in enumerate(zip(c.token_ids, c.logprobs)):
        assert tok in pos and all(isinstance(lp, Logprob) for lp in pos.values())
        row = full[len(prompt) - 1 + i]
        assert pos[tok].logprob == pytest.approx(row[tok].item(), abs=1e-4)      # raw logits' log-softmax
        assert pos[tok].rank == int((row > row[tok]).sum()) + 1
        assert pos[tok].decoded_token == llm.get_tokenizer().decode([tok])
        top = sorted((lp for t, lp in pos.items() if lp.rank <= 2), key=lambda lp: lp.rank)
        assert [lp.rank for lp in top] == [1, 2] and len(pos) in (2, 3)
    assert c.cumulative_logprob == pytest.approx(sum(pos[t].logprob for t, pos in zip(c.token_ids, c.logprobs)))
    plp = o.prompt_logprobs
    assert len(plp) == len(prompt) and plp[0] is None
    for p in range(1, len(prompt)):
        pos, tok = plp[p], prompt[p]
        assert pos[tok].logprob == pytest.approx(full[p - 1, tok].item(), abs=1e-4)
        assert pos[tok].rank == int((full[p - 1] > full[p - 1, tok]).sum()) + 1
        assert len(pos) in (3, 4)
    # prompt log-probabilities across chunked prefill (and with the prompt in the prefix cache) are the same
    small = LLM(llm.engine.config.model_dir, device="cpu", kvcache_block_size=16, max_num_batched_tokens=8)
    again = small.generate([prompt], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=0),
                           use_tqdm=False)[0]
    for p in range(1, len(prompt)):
        assert again.prompt_logprobs[p][prompt[p]].logprob == pytest.approx(plp[p][prompt[p]].logprob, abs=1e-4)


def test_include_stop_str_in_output(llm):
    prompt = "Once upon a time"
    text = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=30), use_tqdm=False)[0]["text"]
    stop = text[8:11]
    cut = text.find(stop)
    a = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=30, stop=stop), use_tqdm=False)[0]
    b = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=30, stop=stop, include_stop_str_in_output=True),
                     use_tqdm=False)[0]
    assert a["text"] == text[:cut] and b["text"] == text[:cut + len(stop)] and b["stop_reason"] == stop


@pytest.mark.parametrize("kwargs, match", [
    ({"n": 0}, "n"), ({"best_of": 3}, "best_of"), ({"presence_penalty": 3}, "presence_penalty"),
    ({"frequency_penalty": -2.5}, "frequency_penalty"), ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"logit_bias": {"x": 1.0}}, "logit_bias"), ({"logit_bias": {-1: 1.0}}, "logit_bias"),
    ({"allowed_token_ids": []}, "allowed_token_ids"), ({"allowed_token_ids": [-3]}, "allowed_token_ids"),
    ({"bad_words": [" "]}, "bad_words"), ({"prompt_logprobs": 21}, "prompt_logprobs"),
])
def test_bad_values_name_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_bad_types_and_unknown_fields():
    with pytest.raises(TypeError, match="frobnicate"):
        SamplingParams(frobnicate=1)
    for kw in ({"n": 2.0}, {"bad_words": "word"}, {"logit_bias": [1]}, {"structured_outputs": {"json": {}}},
               {"include_stop_str_in_output": 1}):
        with pytest.raises(TypeError, match=next(iter(kw))):
            SamplingParams(**kw)
    p = SamplingParams(logit_bias={"5": 300, 6: -1000})           # OpenAI's string keys; vLLM's clamp
    assert p.logit_bias == {5: 100.0, 6: -100.0}


def test_ids_outside_the_vocabulary_are_rejected(llm):
    V = llm.engine.vocab_size
    for p, match in ((SamplingParams(logit_bias={V: 1.0}), "logit_bias"),
                     (SamplingParams(allowed_token_ids=[1, V + 5]), "allowed_token_ids")):
        with pytest.raises(ValueError, match=match):
            llm.generate([[1, 2]], p, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_penalty_and_bitmask_references():
    logits = torch.tensor([[2.0, -1.0, 0.5, 0.0], [1.0, 1.0, -2.0, 3.0]])
    counts = torch.tensor([[2, 0, 0, 1], [0, 0, 0, 0]], dtype=torch.int32)
    prompt = torch.tensor([[False, True, False, False], [True, False, True, False]])
    got = penalties_ref(logits, counts, prompt, torch.tensor([0.5, 1.0]), torch.tensor([0.25, 0.0]),
                        torch.tensor([2.0, 4.0]))
    want = torch.tensor([[2.0 / 2 - 0.5 - 0.5, -1.0 * 2, 0.5, 0.0 - 0.25 - 0.5],
                         [1.0 / 4, 1.0, -2.0 * 4, 3.0]])
    torch.testing.assert_close(got, want)
    V = 70
    x = torch.randn(3, V)
    mask = torch.zeros(2, 3, dtype=torch.int32)
    allowed = [[0, 5, 31, 32, 63, 64, 69], [33]]
    for r, toks in enumerate(allowed):
        for t in toks:
            mask[r, t // 32] |= (1 << (t % 32)) if t % 32 < 31 else -(1 << 31)
    y = x.clone()
    apply_token_bitmask(y, torch.tensor([2, 0]), mask)
    assert torch.equal(y[1], x[1])
    for r, toks in zip((2, 0), allowed):
        assert torch.isfinite(y[r]).nonzero().flatten().tolist() == toks and torch.equal(y[r, toks], x[r, toks])
