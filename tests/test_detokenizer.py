"""Incremental detokenization: what streams out must be what the offline decode gives."""
from __future__ import annotations

import random

import pytest
from transformers import AutoTokenizer

from nanovllm.engine.detokenizer import IncrementalDetokenizer, find_stop


@pytest.fixture(scope="module")
def tok(tiny_ckpt):
    return AutoTokenizer.from_pretrained(tiny_ckpt("qwen3"))


@pytest.mark.parametrize("fast", [True, False])
def test_text_deltas_rebuild_the_decode(tok, fast):
    prompt = tok.encode("Once upon a time")
    out = tok.encode(" there was a small engine that could stream text, one token at a time: done!")
    d = IncrementalDetokenizer(tok, prompt)
    if not fast:
        d._stream = None  # the pure-Python path (tokenizers without DecodeStream)
    assert "".join(d.add(t) for t in out) == tok.decode(out) == d.text


def test_random_ids_stream_a_prefix_of_the_decode(tok):
    """Arbitrary byte-level tokens (invalid UTF-8 included): never text that the final decode lacks."""
    rng = random.Random(0)
    V = len(tok)
    for _ in range(200):
        out = [rng.randrange(V) for _ in range(rng.randint(1, 30))]
        d = IncrementalDetokenizer(tok, [rng.randrange(V)])
        for t in out:
            d.add(t)
        assert tok.decode(out, skip_special_tokens=True).startswith(d.text)


def test_find_stop_looks_only_where_new_text_can_complete_a_stop():
    assert find_stop("hello world", 5, ("wor",)) == 6
    assert find_stop("hello world", 1, ("hel",)) == -1       # complete before the new character
    assert find_stop("abcabc", 3, ("ca", "bc")) == 2          # the earliest start wins


def _stream(engine, rid, prompt, params):
    """LLMEngine.step() streaming: (joined new_token_ids, joined new_text, new_logprobs count, the final output)."""
    engine.add_request(rid, prompt, params, stream=True)
    ids, text, n_lp, final = [], "", 0, None
    while engine.has_unfinished_requests():
        for o in engine.step()[0]:
            ids += o.new_token_ids
            text += o.new_text
            n_lp += len(o.new_logprobs or [])
            if o.finished:
                final = o
    return ids, text, n_lp, final


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_engine_streams_join_up_to_the_final_output(tiny_ckpt, async_scheduling):
    """What LLMEngine.step() streams joins up to the final output: ids (not the placeholder of the step in flight
    under async scheduling), logprobs, and text, a stop string's start held back until it cannot be one; and the
    final text is the same whether a detokenizer followed the request (stream, stop strings) or not."""
    from nanovllm import LLM, SamplingParams
    engine = LLM(tiny_ckpt("qwen3"), device="cpu", max_model_len=256, kvcache_block_size=16,
                 async_scheduling=async_scheduling).engine
    rng = random.Random(1)
    checked = 0
    for case in range(12):
        prompt = [rng.randrange(1, 400) for _ in range(rng.randrange(3, 30))]
        plain = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0)
        ids, text, n_lp, final = _stream(engine, f"p{case}", prompt, plain)
        assert ids == final.token_ids and n_lp == len(ids) == 8 and text == final.text
        engine.add_request(f"q{case}", prompt, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
        while engine.has_unfinished_requests():      # the same tokens without a detokenizer: the same text
            quiet = [o for o in engine.step()[0] if o.finished] or None
        assert quiet[0].token_ids == final.token_ids and quiet[0].text == final.text
        # a stop string taken from the middle of that text: the stream must not show its start
        full = final.text
        if len(full) < 6:
            continue
        i = rng.randrange(1, len(full) - 4)
        stop = full[i:i + 3]
        ids2, text2, _, final2 = _stream(engine, f"s{case}", prompt, SamplingParams(
            temperature=0.0, max_tokens=8, ignore_eos=True, stop=[stop, "\x00never"]))
        assert text2 == final2.text == full[:full.index(stop)] and final2.stop_reason == stop
        checked += 1
    assert checked >= 4
