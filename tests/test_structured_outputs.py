"""Structured outputs (xgrammar): on the tiny random model, whose output is noise, every sample of a choice, a
regex and a JSON schema still matches (temperature 1.0, several seeds), with and without async scheduling."""
from __future__ import annotations

import json
import re

import pytest
import torch

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


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async-3-grammar-workers"])
def llm(tiny_ckpt, request):
    """With async scheduling, the sequences' matchers are split over three grammar processes (one elsewhere, as on
    a machine of fewer than 8 CPUs)."""
    with pytest.MonkeyPatch.context() as mp:
        if request.param:
            mp.setattr("nanovllm.engine.structured.grammar_workers", lambda cpus: (3, 1))
        engine = LLM(tiny_ckpt("qwen3"), device="cpu", kvcache_block_size=16, async_scheduling=request.param)
        assert engine.engine.structured is not None  # built now (else at the first structured request)
    yield engine
    assert len(engine.engine.structured.proc.procs) == (3 if request.param else 1)  # (a restarted one too)


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


def test_specs_are_keyed_by_their_text_and_compiled_once_in_the_grammar_process(llm):
    so = llm.engine.structured
    a = so.compile(StructuredOutputsParams(json=SCHEMA))
    assert so.compile(StructuredOutputsParams(json=json.dumps(SCHEMA))) == a
    assert so.compile(StructuredOutputsParams(json={**SCHEMA, "required": ["name"]})) != a
    spec = StructuredOutputsParams(regex=r"[0-9]{3}")
    _gen(llm, spec, n_seeds=3, max_tokens=6)
    before = so.stats()
    outs = _gen(llm, spec, n_seeds=3, max_tokens=6)
    assert all(re.fullmatch(r"[0-9]{3}", o.outputs[0].text) for o in outs)
    # the same spec again: no new grammar; every finished sequence's matcher was dropped
    assert so.stats() == before and before["matchers"] == 0


def _local(llm):
    """An in-process xgrammar compiler over the engine's grammar vocabulary, to check the grammar process against."""
    import xgrammar as xgr
    so = llm.engine.structured
    info = xgr.TokenizerInfo.from_huggingface(llm.get_tokenizer(), vocab_size=so.num_tokens,
                                              stop_token_ids=sorted(llm.engine.eos_token_ids))
    return xgr.GrammarCompiler(info)


def test_grammar_process_masks_match_xgrammar_in_process(llm):
    """The grammar's vocabulary is the tokenizer's ids (the model's padding is no special token to xgrammar), and
    the masks the grammar process writes into the shared buffer (rows of a fill in order; fewer rows, then more)
    are xgrammar's own, step after step, as matchers here and there accept the same tokens."""
    import xgrammar as xgr

    from nanovllm.engine.grammar_worker import compile_spec
    so = llm.engine.structured
    tok = llm.get_tokenizer()
    assert llm.engine.vocab_size > len(tok) and so.num_tokens == len(tok)
    compiler = _local(llm)
    specs = [StructuredOutputsParams(json=SCHEMA), StructuredOutputsParams(regex=REGEX),
             StructuredOutputsParams(choice=CHOICES), StructuredOutputsParams(json_object=True),
             StructuredOutputsParams(regex=".*")]  # (allows any token: xgrammar sets the bits past the vocabulary)
    local = {}
    for i, spec in enumerate(specs * 2):
        sid = 10**6 + i  # ids the engine's sequences do not reach
        so.add(sid, so.compile(spec))
        local[sid] = xgr.GrammarMatcher(compile_spec(compiler, *so.compile(spec)))
    g = torch.Generator().manual_seed(0)
    tail = so.num_tokens % 32  # bits past the vocabulary: cleared (xgrammar may set them)
    for step in range(6):
        live = [sid for sid, m in local.items() if not m.is_terminated()]
        want = live[:3] if step % 2 else live
        pairs = [(sid, 2 * i + 1) for i, sid in enumerate(want)]  # logits rows 1, 3, 5...: the even ones plain
        mask, index = so.masks(want, [r for _, r in pairs], 2 * len(want) + 1)
        assert mask.shape == (len(want), (len(tok) + 31) // 32) and index.shape == (2 * len(want) + 1,)
        assert index[::2].eq(-1).all() and sorted(index[1::2].tolist()) == list(range(len(want)))
        assert not (mask[:, -1] >> tail).any()
        accepts = []
        for sid, row in pairs:
            fresh = xgr.allocate_token_bitmask(1, so.num_tokens)
            local[sid].fill_next_token_bitmask(fresh)
            fresh[0, -1] &= (1 << tail) - 1
            assert torch.equal(mask[index[row]], fresh[0])
            bits = [t for t in range(so.num_tokens) if fresh[0, t // 32] >> (t % 32) & 1]
            accepts.append((sid, bits[int(torch.randint(len(bits), (1,), generator=g))]))
        so.advance([s for s, _ in accepts], [t for _, t in accepts], None)  # a random allowed token each
        assert all(local[sid].accept_token(t) for sid, t in accepts)
    assert not so.take_broken()
    for sid in local:
        so.drop(sid)
    assert so.stats()["matchers"] == 0


def test_a_token_that_breaks_its_grammar_and_a_grammar_that_fails_to_compile_are_reported(llm):
    so = llm.engine.structured
    so.add(2 * 10**6, so.compile(StructuredOutputsParams(choice=CHOICES)))
    so.add(2 * 10**6 + 1, ("regex", "(unclosed"))  # past the checks: the child's compile fails
    mask, index = so.masks([2 * 10**6, 2 * 10**6 + 1], [0, 1], 2)
    assert index.tolist() == [0, -1]  # no mask without a grammar
    bits = [t for t in range(so.num_tokens) if mask[0, t // 32] >> (t % 32) & 1]
    bad = next(t for t in range(so.num_tokens) if t not in bits)
    so.advance([2 * 10**6], [bad], None)
    so.masks([2 * 10**6], [0], 1)
    broken = so.take_broken()
    assert broken[2 * 10**6] == "its token breaks its grammar"
    assert broken[2 * 10**6 + 1].startswith("its grammar failed to compile")
    so.drop(2 * 10**6)
    so.drop(2 * 10**6 + 1)


def test_the_engine_aborts_a_sequence_whose_grammar_broke(llm):
    """A sequence reported broken (its token broke the grammar, or its grammar did not compile) finishes with
    "abort" in the step that gave it a token; the other requests go on."""
    eng = llm.engine
    eng.add_request("broken", "Answer:", SamplingParams(temperature=1.0, seed=1, max_tokens=30,
                                                      structured_outputs=StructuredOutputsParams(json=SCHEMA)))
    eng.add_request("fine", "Answer:", SamplingParams(temperature=1.0, seed=2, max_tokens=5,
                                                    structured_outputs=StructuredOutputsParams(regex=REGEX)))
    seq = eng.requests["broken"][0]
    done = {}
    for step in range(40):
        if step == 2:
            eng.structured.broken[seq.seq_id] = "a test"
        for out in eng.step()[0]:
            if out.finished:
                done[out.request_id] = out.finish_reason
        if not eng.has_unfinished_requests():
            break
    assert done == {"broken": "abort", "fine": done["fine"]} and done["fine"] in ("stop", "length")
    assert seq.num_output_tokens < 30 and eng.structured.stats()["matchers"] == 0


def test_bitmask_narrower_than_the_vocabulary_bans_the_tail():
    from nanovllm.layers.logits_processing import apply_token_bitmask
    x = torch.randn(3, 100)
    mask = torch.zeros(2, 2, dtype=torch.int32)  # covers ids 0..63
    mask[0, 0], mask[1, 1] = 0b1011, 1 << 4      # row 2: ids 0, 1, 3; row 0: id 36
    y = x.clone()
    apply_token_bitmask(y, torch.tensor([2, 0]), mask)
    assert torch.equal(y[1], x[1])
    assert torch.isfinite(y[2]).nonzero().flatten().tolist() == [0, 1, 3]
    assert torch.isfinite(y[0]).nonzero().flatten().tolist() == [36] and y[0, 36] == x[0, 36]



def test_late_masks_apply_in_the_logits_dtype():
    """A deferred step's masks and bans are -inf: applied to bf16 logits in place (no float32 copy), the ids are the
    float32 logits' (the fused sampler reads any dtype)."""
    from dataclasses import replace

    from nanovllm.engine.batch import LateInputs
    from nanovllm.layers.sampler import Sampler
    from tests.test_sampling import _tensors
    V = 100
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(1)).bfloat16()
    mask = torch.zeros(2, 3, dtype=torch.int32)
    mask[0, 0], mask[1, 2] = 0b110, 0b1011  # row 1: ids 1, 2; row 3: ids 64, 65, 67
    late = LateInputs(bitmask=mask, mask_index=torch.tensor([-1, 0, -1, 1], dtype=torch.int32), banned=[(3, 65)])
    for temps in ([1.0], [0.0]):
        t = replace(_tensors(4, temps), late=late)
        want = Sampler()(logits.float(), t).token_ids
        x = logits.clone()
        got = Sampler()(x, t).token_ids
        assert torch.equal(got, want) and x.dtype == torch.bfloat16
        assert torch.isfinite(x[1]).nonzero().flatten().tolist() == [1, 2]
        assert torch.isfinite(x[3]).nonzero().flatten().tolist() == [64, 67]
        assert got[1] in (1, 2) and got[3] in (64, 67)


class _FakeBatch:
    """A stand-in for xgrammar's BatchGrammarMatcher: records its fills, each costing `cost` on the fake clock."""

    def __init__(self, threads, log, clock, cost):
        self.threads, self.log, self.clock, self.cost = threads, log, clock, cost

    def batch_fill_next_token_bitmask(self, matchers, mask, indices=None):
        self.log.append(self.threads)
        self.clock[0] += self.cost[self.threads] * len(matchers)


def _chooser(cost, threads=4):
    from types import SimpleNamespace

    from nanovllm.engine.grammar_worker import FillChooser
    log, clock = [], [0.0]
    xgr = SimpleNamespace(BatchGrammarMatcher=lambda t: _FakeBatch(t, log, clock, cost))
    return FillChooser(xgr, threads=threads, threads_from=1e-3, probe_every=8, clock=lambda: clock[0]), log


def test_fill_chooser_stays_on_one_thread_for_cheap_fills():
    fc, log = _chooser({1: 1e-6, 4: 1e-7})      # 16 rows: 16 us a fill, under threads_from
    for _ in range(20):
        fc.fill([None] * 16, None)
    assert log == [1] * 20
    one, log = _chooser({1: 1e-3}, threads=1)   # one thread allowed: one mode, however slow
    for _ in range(3):
        one.fill([None] * 16, None)
    assert log == [1] * 3 and one.choice(16) == 0


@pytest.mark.parametrize("faster", [1, 4])
def test_fill_chooser_times_both_modes_for_costly_fills(faster):
    """Fills over threads_from: each mode timed, the faster per row fills, the other timed again every probe_every
    fills (and taken over once it has become the faster)."""
    slower = 5 - faster
    cost = {faster: 1e-4, slower: 3e-4}          # 16 rows: 1.6 / 4.8 ms a fill
    fc, log = _chooser(cost)
    for _ in range(24):
        fc.fill([None] * 16, None)
    assert log[:2] == [1, 4]                                       # both timed first
    assert [i for i, t in enumerate(log[2:], 2) if t == slower] == [8, 16]   # then probed every 8 fills
    cost[faster], cost[slower] = cost[slower], cost[faster]       # the other mode becomes the faster one
    log.clear()
    for _ in range(16):
        fc.fill([None] * 16, None)
    assert log[-4:] == [slower] * 4                                # taken over after its probe


def test_fill_modes_give_the_same_masks(llm):
    """One thread or two, xgrammar's masks are the same (the chooser only picks the faster)."""
    import xgrammar as xgr

    from nanovllm.engine.grammar_worker import FillChooser, compile_spec
    so = llm.engine.structured
    compiler = _local(llm)
    fc = FillChooser(xgr, threads=2, threads_from=0.0)  # every fill "costly": both modes run
    specs = [StructuredOutputsParams(json=SCHEMA), StructuredOutputsParams(regex=REGEX)]
    matchers = [xgr.GrammarMatcher(compile_spec(compiler, *so.compile(s))) for s in specs for _ in range(3)]
    masks = []
    for _ in range(2):
        mask = xgr.allocate_token_bitmask(len(matchers), so.num_tokens)
        fc.fill(matchers, mask)
        masks.append(mask)
    assert fc._cost[0] is not None and fc._cost[1] is not None   # both modes ran
    assert torch.equal(masks[0], masks[1]) and masks[0].any()


def test_the_grammar_process_ends_with_the_engine(tiny_ckpt):
    """shutdown() stops the child; its shared buffer's file was unlinked as soon as both processes mapped it."""
    import glob
    import os
    before = set(glob.glob(os.path.join("/dev/shm", "nanovllm-bitmask-*")))
    llm = LLM(tiny_ckpt("qwen3"), device="cpu", kvcache_block_size=16)
    out = llm.generate(["Answer:"], SamplingParams(temperature=1.0, seed=0, max_tokens=10,
                                                    structured_outputs=StructuredOutputsParams(choice=CHOICES)),
                       use_tqdm=False)
    assert out[0].outputs[0].text in CHOICES
    children = llm.engine.structured.proc.procs
    assert children and all(c.poll() is None for c in children)
    assert set(glob.glob(os.path.join("/dev/shm", "nanovllm-bitmask-*"))) == before
    llm.shutdown()
    assert all(c.wait(timeout=10) == 0 for c in children)


def test_a_dead_grammar_process_finishes_its_sequences_and_a_new_one_takes_over(llm):
    """Killed mid-generation, the grammar process takes its constrained sequences with it (they finish "abort"); the
    plain request beside them finishes normally, and the next structured request runs on a new process."""
    eng = llm.engine
    spec = StructuredOutputsParams(json=SCHEMA)
    for i in range(2):
        eng.add_request(f"kill-{i}", "Answer:", SamplingParams(temperature=1.0, seed=i, max_tokens=40,
                                                             structured_outputs=spec))
    eng.add_request("kill-plain", "Hello", SamplingParams(temperature=1.0, seed=5, max_tokens=12, ignore_eos=True))
    old = eng.structured.proc
    done = {}
    for step in range(60):
        if step == 3:
            old.procs[0].kill()
            old.procs[0].wait()
        for out in eng.step()[0]:
            if out.finished:
                done[out.request_id] = out
        if not eng.has_unfinished_requests():
            break
    assert {r: o.finish_reason for r, o in done.items()} == {"kill-0": "abort", "kill-1": "abort",
                                                             "kill-plain": "length"}
    assert len(done["kill-plain"].token_ids) == 12
    assert eng.structured.proc is not old
    outs = _gen(llm, StructuredOutputsParams(choice=CHOICES), n_seeds=2)
    assert all(o["text"] in CHOICES and o["finish_reason"] == "stop" for o in outs)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_schemas_hold_through_preemption(tiny_ckpt, async_scheduling):
    """A KV cache too small for the batch preempts constrained sequences (their tokens recomputed later): each
    matcher keeps its state, and every finished output still validates."""
    llm = LLM(tiny_ckpt("qwen3"), device="cpu", kvcache_block_size=16, num_kvcache_blocks=34, max_model_len=512,
              async_scheduling=async_scheduling)
    spec = StructuredOutputsParams(json=SCHEMA)
    ps = [SamplingParams(temperature=1.0, seed=s, max_tokens=150, structured_outputs=spec) for s in range(6)]
    ps += [SamplingParams(temperature=1.0, seed=9, max_tokens=100, ignore_eos=True)] * 3
    outs = llm.generate(["Answer: " * 20] * 9, ps, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].finish_reason for o in outs] == ["stop"] * 6 + ["length"] * 3
    for o in outs[:6]:
        check_schema(o.outputs[0].text)
    assert llm.engine.structured.stats()["matchers"] == 0
    llm.shutdown()


def test_grammar_workers_by_cpus():
    """A grammar process per 4 CPUs (at most 4), and half the CPUs' fill threads split between them."""
    from nanovllm.engine.structured import grammar_workers
    assert [grammar_workers(c) for c in (1, 2, 7, 8, 16, 64)] == [(1, 1), (1, 1), (1, 3), (2, 2), (4, 2), (4, 8)]


def test_a_grammar_process_needs_a_worker():
    from nanovllm.engine.grammar_worker import GrammarProcess
    for bad in (0, True, 1.5):
        with pytest.raises(ValueError, match="workers >= 1"):
            GrammarProcess("{}", 10, 4, threads=1, pin_memory=False, workers=bad)


def test_spec_errors_name_the_spec_without_the_compiler_source_location():
    from nanovllm.engine.structured import _spec_error
    e = _spec_error("json", RuntimeError("[12:00:01] /project/cpp/json_schema_converter.cc:5082: Unsupported "
                                         "type bogus"))
    assert str(e) == "structured_outputs.json is not valid: Unsupported type bogus"
