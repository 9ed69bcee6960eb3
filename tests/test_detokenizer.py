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
