"""Structured outputs (xgrammar): on the tiny random model, whose output is noise, every sample of a choice, a
regex and a JSON schema still matches (temperature 1.0, several seeds), with and without async scheduling."""
from __future__ import annotations

import json
import re

import pytest

pytest.importorskip("xgrammar")

from nanovllm import LLM, SamplingParams, StructuredOutputsParams  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z]{1,8}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    },
    "required": ["name", "age", "ok"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{2,5}-\d{1,3}(\.\d)?"
CHOICES = ["yes", "no", "maybe not"]


def check_schema(text: str) -> None:
    """A hand-written validator of SCHEMA (strict JSON parsing)."""
    obj = json.loads(text)
    assert isinstance(obj, dict) and set(obj) <= set(SCHEMA["properties"]) and {"name", "age", "ok"} <= set(obj)
    assert isinstance(obj["name"], str) and re.fullmatch(r"[a-z]{1,8}", obj["name"])
    assert isinstance(obj["age"], int) and not isinstance(obj["age"], bool) and 0 <= obj["age"] <= 120
    assert isinstance(obj["ok"], bool)
    if "tags" in obj:
        assert isinstance(obj["tags"], list) and len(obj["tags"]) <= 3 and set(obj["tags"]) <= {"a", "b", "c"}


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def llm(tiny_ckpt, request):
    return LLM(tiny_ckpt("qwen3"), device="cpu", kvcache_block_size=16, async_scheduling=request.param)


def _gen(llm, spec, n_seeds=4, max_tokens=60, **kw):
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=max_tokens, structured_outputs=spec, **kw)
              for s in range(n_seeds)]
    # a plain request rides along in the same batch
    outs = llm.generate(["Answer:"] * n_seeds + ["Hello"], params + [SamplingParams(temperature=1.0, max_tokens=8)],
                        use_tqdm=False)
    return outs[:n_seeds]


def test_choice(llm):
    outs = _gen(llm, StructuredOutputsParams(choice=CHOICES), n_seeds=6)
    assert all(o["text"] in CHOICES and o["finish_reason"] == "stop" for o in outs)


def test_regex(llm):
    for o in _gen(llm, StructuredOutputsParams(regex=REGEX)):
        assert re.fullmatch(REGEX, o["text"]) and o["finish_reason"] == "stop", o["text"]


def test_json_schema_and_n(llm):
    outs = _gen(llm, StructuredOutputsParams(json=SCHEMA), max_tokens=120, n=2)
    texts = [c.text for o in outs for c in o.outputs]
    assert len(texts) == 8 and len(set(texts)) > 1
    for o in outs:
        for c in o.outputs:
            assert c.finish_reason == "stop", c.text
            check_schema(c.text)


def test_json_object_and_grammar(llm):
    for o in _gen(llm, StructuredOutputsParams(json_object=True), n_seeds=2, max_tokens=200):
        if o["finish_reason"] == "stop":          # (an unbounded object may run out of tokens)
            assert isinstance(json.loads(o["text"]), dict)
        else:
            assert o["text"].startswith("{")
    grammar = 'root ::= "(" num ("+" num)* ")"\nnum ::= [1-9] [0-9]?'
    for o in _gen(llm, StructuredOutputsParams(grammar=grammar), n_seeds=3):
        assert re.fullmatch(r"\([1-9][0-9]?(\+[1-9][0-9]?)*\)", o["text"]), o["text"]


def test_malformed_specs_are_value_errors(llm):
    for spec, match in ((StructuredOutputsParams(regex="[a-"), "regex"),
                        (StructuredOutputsParams(json="{not json"), "json"),
                        (StructuredOutputsParams(json={"type": "nonsense"}), "json"),
                        (StructuredOutputsParams(grammar="root ::= "), "grammar")):
        with pytest.raises(ValueError, match=match):
            llm.generate(["x"], SamplingParams(structured_outputs=spec), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["b"])
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="choice"):
        StructuredOutputsParams(choice=[])


def test_grammar_cache_is_keyed_by_the_spec(llm):
    so = llm.engine.structured
    a = so.compile(StructuredOutputsParams(json=SCHEMA))
    assert so.compile(StructuredOutputsParams(json=json.dumps(SCHEMA))) is a
    assert so.compile(StructuredOutputsParams(json={**SCHEMA, "required": ["name"]})) is not a
