"""The engine core without HTTP: its messages and their wire format, EngineCore over a tiny model (in this
process), and the process loop over real pipes (in a thread, with the model-free FakeEngineCore)."""
from __future__ import annotations

import multiprocessing as mp
import threading

import pytest

from nanovllm import LLM, SamplingParams, StructuredOutputsParams
from nanovllm.config import EngineArgs
from nanovllm.engine import core_protocol as cp
from nanovllm.engine.core import EngineCore
from nanovllm.engine.core_process import CoreLoop
from nanovllm.utils.fake_core import FakeCoreArgs, FakeEngineCore

KW = dict(device="cpu", max_model_len=256, kvcache_block_size=16, num_kvcache_blocks=64)


# --- wire format -----------------------------------------------------------------------------------------------
def test_every_message_survives_the_wire():
    params = SamplingParams(temperature=0.5, top_k=3, max_tokens=7, stop=["ab", "c"], stop_token_ids=[4], seed=-3,
                            logprobs=2)
    msgs = [
        cp.AddRequest([1, 2, 3], ["a", "b"], [cp.params_to_wire(params), cp.params_to_wire(SamplingParams())]),
        cp.Abort(["a", "b"]), cp.Shutdown(),
        cp.Ready(pid=1, model_dir="/m", max_model_len=64, vocab_size=100, num_kvcache_blocks=8, block_size=16,
                 device="cpu", dtype="float32", tensor_parallel_size=2, worker_pids=[5, 6], startup_seconds=1.5),
        cp.StartupFailed("ValueError", "bad", "tb"),
        cp.StepOutputs(["a", "b"], [7, 8], [cp.Finished(1, "stop", "ab", 5), cp.Finished(0, "length")],
                       [cp.TokenLogprobs(0, -0.5, [7, 9], [-0.5, -1.0])], cp.EngineStats(1, 2, 3, 4, 5, 6, 7, 8, 9)),
        cp.RequestsFailed(["a"], "boom", 500), cp.EngineDead("gone"),
    ]
    for m in msgs:
        allowed = cp.API_MESSAGES if type(m) in cp.API_MESSAGES else cp.CORE_MESSAGES
        assert cp.decode(cp.encode(m), allowed) == m
    assert cp.params_from_wire(msgs[0].params[0]) == params
    with pytest.raises(cp.ProtocolError, match="unexpected Shutdown"):
        cp.decode(cp.encode(cp.Shutdown()), cp.CORE_MESSAGES)        # a message for the other direction
    with pytest.raises(cp.ProtocolError):
        cp.decode(b"not marshal", cp.API_MESSAGES)
    with pytest.raises(cp.ProtocolError):
        cp.decode(cp.encode(cp.Abort(["a"]))[:-3], cp.API_MESSAGES)  # truncated
    with pytest.raises(TypeError, match="not an engine-core message"):
        cp.encode(("Abort", ["a"]))
    with pytest.raises(ValueError, match="unmarshallable"):
        cp.encode(cp.Abort([object()]))                             # plain values only


def test_messages_are_bounded(monkeypatch):
    monkeypatch.setattr(cp, "MAX_MESSAGE_BYTES", 1000)
    with pytest.raises(ValueError, match="exceeds MAX_MESSAGE_BYTES"):
        cp.encode(cp.AddRequest(list(range(1000)), ["a"], [{}]))
    assert [len(c) for c in cp.chunks([str(i) for i in range(20000)])] == [8192, 8192, 3616]


def test_every_sampling_field_survives_the_wire():
    """Issue 20's fields cross the pipe as built-in values and come back equal: StructuredOutputsParams as the dict
    of its fields, logit_bias as {int: float}; params_from_wire validates them again."""
    full = SamplingParams(n=3, best_of=3, presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.3,
                          temperature=0.7, top_p=0.9, top_k=5, min_p=0.1, seed=-5, stop="x", stop_token_ids=[3],
                          bad_words=["the"], include_stop_str_in_output=True, ignore_eos=True, max_tokens=9,
                          min_tokens=2, logprobs=3, prompt_logprobs=1, skip_special_tokens=False,
                          logit_bias={"7": 2.0, 9: -200}, allowed_token_ids=[1, 2, 3])
    specs = [StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "integer"}}}),
             StructuredOutputsParams(json='{"type": "string"}'), StructuredOutputsParams(regex=r"\d+"),
             StructuredOutputsParams(choice=["a", "b"]), StructuredOutputsParams(grammar='root ::= "x"'),
             StructuredOutputsParams(json_object=True)]
    for p in [full] + [SamplingParams(structured_outputs=so) for so in specs]:
        msg = cp.decode(cp.encode(cp.AddRequest([1], ["a"], [cp.params_to_wire(p)])), cp.API_MESSAGES)
        back = cp.params_from_wire(msg.params[0])
        assert back == p and back is not p
    assert cp.params_from_wire(cp.params_to_wire(full)).logit_bias == {7: 2.0, 9: -100.0}
    with pytest.raises(TypeError, match="structured_outputs must be a dict"):
        cp.params_from_wire({"structured_outputs": "regex"})
    with pytest.raises(ValueError, match="exactly one"):
        cp.params_from_wire({"structured_outputs": {"regex": "a", "choice": ["b"]}})
    with pytest.raises(TypeError):
        cp.params_from_wire({"structured_outputs": {"frobnicate": 1}})
    with pytest.raises(TypeError, match="must be a dict"):
        cp.params_from_wire(["n", 2])


# --- EngineCore ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tiny_ckpt):
    path = tiny_ckpt("qwen3")
    llm = LLM(path, **KW)
    yield path, llm
    llm.shutdown()


def run_to_end(core: EngineCore, max_steps: int = 1000) -> tuple[dict, dict]:
    """Step until idle: request id -> tokens, request id -> Finished."""
    tokens, finished = {}, {}
    for _ in range(max_steps):
        if not core.has_work():
            return tokens, finished
        out = core.step()
        assert len(out.request_ids) == len(set(out.request_ids)) == len(out.token_ids)   # a row per request
        for rid, tok in zip(out.request_ids, out.token_ids):
            tokens.setdefault(rid, []).append(tok)
        for f in out.finished:
            finished[out.request_ids[f.index]] = f
    raise AssertionError("the core did not finish")


def add(core, prompt, ids, params):
    return core.add(cp.AddRequest(prompt, ids, [cp.params_to_wire(p) for p in params]))


def test_engine_core_tokens_match_offline(tiny):
    path, llm = tiny
    core = EngineCore.from_args(EngineArgs.from_kwargs(path, **KW))
    try:
        prompts = [[5, 6, 7, 8, 9], list(range(20, 60))]
        greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        seeded = [SamplingParams(temperature=1.0, max_tokens=9, seed=s, ignore_eos=True) for s in (1, 2)]
        assert add(core, prompts[0], ["g"], [greedy]) is None
        assert add(core, prompts[1], ["s1", "s2"], seeded) is None      # two choices sharing one prompt
        tokens, finished = run_to_end(core)
        refs = llm.generate([prompts[0], prompts[1], prompts[1]], [greedy, *seeded], use_tqdm=False)
        assert [tokens[r] for r in ("g", "s1", "s2")] == [ref["token_ids"] for ref in refs]
        assert {r: f.finish_reason for r, f in finished.items()} == {"g": "length", "s1": "length", "s2": "length"}
        st = core.stats()
        assert st.num_free_blocks == st.num_blocks and st.generation_tokens == 30 and not core.has_work()
    finally:
        core.shutdown()


def test_engine_core_stop_strings_logprobs_and_aborts(tiny):
    path, llm = tiny
    tok = llm.tokenizer
    core = EngineCore.from_args(EngineArgs.from_kwargs(path, **KW))
    try:
        prompt = [5, 6, 7, 8, 9]
        base = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                            use_tqdm=False)[0]
        stop = base["text"][6:9]
        p = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop], logprobs=2)
        ref = llm.generate([prompt], p, use_tqdm=False)[0]
        assert ref["finish_reason"] == "stop"
        assert add(core, prompt, ["stop"], [p]) is None
        assert add(core, prompt, ["long"], [SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)]) is None
        lps, finished, tokens = [], {}, {}
        for _ in range(5):
            out = core.step()
            for rid, t in zip(out.request_ids, out.token_ids):
                tokens.setdefault(rid, []).append(t)
            lps += [(out.request_ids[e.index], e) for e in out.logprobs]
            finished.update({out.request_ids[f.index]: f for f in out.finished})
        core.abort(["long"])                         # mid-way: its blocks come back at once
        more, fin = run_to_end(core)
        finished.update(fin)
        tokens["stop"] = tokens.get("stop", []) + more.get("stop", [])
        assert "long" not in more and "long" not in finished
        f = finished["stop"]
        assert (f.finish_reason, f.stop_reason) == ("stop", stop) and tokens["stop"] == ref["token_ids"]
        from nanovllm.engine.detokenizer import IncrementalDetokenizer
        d = IncrementalDetokenizer(tok, prompt)
        for t in tokens["stop"]:
            d.add(t)
        assert d.text[:f.text_len] == ref["text"]    # the API process rebuilds the same text and cuts it there
        assert [e.logprob for r, e in lps if r == "stop"] == pytest.approx(
            [pos[t].logprob for t, pos in zip(ref["token_ids"], ref["logprobs"])][:sum(r == "stop" for r, _ in lps)],
            abs=1e-5)
        assert all(len(e.top_ids) == len(e.top_logprobs) == 2 for _, e in lps)
        st = core.stats()
        assert st.num_free_blocks == st.num_blocks
    finally:
        core.shutdown()


def test_engine_core_n_samples_and_drafts_match_offline(tiny):
    """n samples are one engine request: its rows carry their sample index. With speculative decoding a sequence
    gets a row per accepted token of a step (several rows of one sample in one message); every sample's tokens and
    logprobs are the offline engine's (which decodes without drafts), and the stats carry the draft counters."""
    path, llm = tiny
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    core = EngineCore.from_args(EngineArgs.from_kwargs(path, **KW, speculative_config=spec))
    try:
        prompts = [[5, 6, 7, 8, 9], [11, 12, 13] * 6]
        sampled = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=16, ignore_eos=True, logprobs=1)
        greedy = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
        refs = llm.generate(prompts, [sampled, greedy], use_tqdm=False)
        assert add(core, prompts[0], ["s"], [sampled]) is None and add(core, prompts[1], ["g"], [greedy]) is None
        tokens, lps, finished, several = {}, {}, {}, False
        while core.has_work():
            out = cp.decode(cp.encode(core.step()), cp.CORE_MESSAGES)
            keys = list(zip(out.request_ids, out.samples or [0] * len(out.request_ids)))
            several |= len(keys) != len(set(keys))
            for k, t in zip(keys, out.token_ids):
                tokens.setdefault(k, []).append(t)
            for e in out.logprobs:
                lps.setdefault(keys[e.index], []).append(e.logprob)
            for f in out.finished:
                assert keys[f.index] not in finished and f.index == max(i for i, k in enumerate(keys)
                                                                        if k == keys[f.index])
                finished[keys[f.index]] = f.finish_reason
        want = {("s", j): refs[0].outputs[j].token_ids for j in range(3)} | {("g", 0): refs[1]["token_ids"]}
        assert tokens == want and set(finished) == set(want)
        for j, c in enumerate(refs[0].outputs):
            assert lps["s", j] == pytest.approx([pos[t].logprob for t, pos in zip(c.token_ids, c.logprobs)], abs=1e-5)
        st = core.stats()
        assert several and st.spec_decode and st.spec_num_accepted_tokens > 0
        assert st.num_free_blocks == st.num_blocks
    finally:
        core.shutdown()


def test_engine_core_rejects_bad_adds_whole(tiny):
    path, _ = tiny
    core = EngineCore.from_args(EngineArgs.from_kwargs(path, **KW))
    try:
        ok = SamplingParams(max_tokens=4)
        assert add(core, [1, 2], ["a"], [ok]) is None
        for prompt, ids, params, what in [
            ([1] * 300, ["b"], [ok], "max_model_len"),                       # longer than the context
            ([1, 10 ** 6], ["b"], [ok], "vocabulary"),
            ([1, 2], ["b", "a"], [ok, ok], "already in use"),                # one id taken: none is added
            ([1, 2], ["c", "c"], [ok, ok], "already in use"),
            ([1, 2], ["b"], [{"temperature": -1}], "temperature"),           # raw params, validated again
        ]:
            wire = [cp.params_to_wire(p) if isinstance(p, SamplingParams) else p for p in params]
            failed = core.add(cp.AddRequest(prompt, ids, wire))
            assert failed is not None and failed.status == 400 and what in failed.message
            assert failed.request_ids == ids
        assert set(core.engine.requests) == {"a"}
    finally:
        core.shutdown()


def test_failed_step_fails_everything_and_the_core_goes_on(tiny, monkeypatch):
    path, llm = tiny
    core = EngineCore.from_args(EngineArgs.from_kwargs(path, **KW))
    try:
        p = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        add(core, [5, 6, 7], ["a", "b"], [p, p])
        core.step()
        runner = core.engine.runner
        real = runner.execute
        monkeypatch.setattr(runner, "execute", lambda batch: (_ for _ in ()).throw(RuntimeError("device fell over")))
        with pytest.raises(RuntimeError, match="device fell over"):
            core.step()
        assert core.executor_alive
        failed = core.fail_all("the engine failed")
        assert [(sorted(f.request_ids), f.status) for f in failed] == [(["a", "b"], 500)]
        assert not core.has_work() and core.stats().num_free_blocks == core.stats().num_blocks
        monkeypatch.setattr(runner, "execute", real)
        add(core, [5, 6, 7], ["c"], [p])
        tokens, _ = run_to_end(core)
        assert tokens["c"] == llm.generate([[5, 6, 7]], p, use_tqdm=False)[0]["token_ids"]
    finally:
        core.shutdown()


# --- the process loop, over real pipes --------------------------------------------------------------------------
class _Loop:
    """CoreLoop in a thread between two pipes; `send` / `recv` are the API process's side."""

    def __init__(self, core):
        self.core = core
        core_in, self.to_core = mp.Pipe(duplex=False)
        self.from_core, core_out = mp.Pipe(duplex=False)
        self.code = None
        self.thread = threading.Thread(target=self._run, args=(core_in, core_out), daemon=True)
        self.thread.start()

    def _run(self, core_in, core_out):
        self.code = CoreLoop(self.core, core_in, core_out).run()

    def send(self, msg):
        cp.send(self.to_core, msg)

    def recv(self, timeout=10):
        assert self.from_core.poll(timeout), "the core loop sent nothing"
        return cp.recv(self.from_core, cp.CORE_MESSAGES)


def test_core_loop_serves_aborts_reports_idle_and_stops():
    core = FakeEngineCore(FakeCoreArgs(token_ids=(10, 11, 12), vocab_size=50, max_num_seqs=2))
    loop = _Loop(core)
    p, forever = (cp.params_to_wire(SamplingParams(max_tokens=m)) for m in (3, 10 ** 6))
    loop.send(cp.AddRequest([1, 2], ["a", "b", "c"], [p, p, forever]))
    rows, finished = [], []
    while True:
        out = loop.recv()
        rows += list(zip(out.request_ids, out.token_ids))
        finished += [out.request_ids[f.index] for f in out.finished]
        if "a" in finished and "b" in finished:
            break
    assert [r for r, _ in rows[:2]] == ["a", "b"] and "c" not in [r for r, _ in rows[:6]]   # max_num_seqs=2
    assert len(rows) == 6
    loop.send(cp.Abort(["c"]))
    while True:                                           # c runs until the abort lands; then the idle report
        out = loop.recv()
        if not out.request_ids and out.stats.num_running == 0:
            break
        assert not out.finished
    assert out.stats.num_waiting == 0
    loop.send(cp.AddRequest([1], ["d"], [forever]))
    assert loop.recv().request_ids == ["d"]
    loop.send(cp.Shutdown())
    loop.thread.join(10)
    assert loop.code == 0


def test_core_loop_step_failures():
    class Flaky(FakeEngineCore):
        fail_next = False
        executor_alive = True

        def step(self):
            if self.fail_next:
                self.fail_next = False
                raise RuntimeError("simulated")
            return super().step()

    core = Flaky(FakeCoreArgs(token_ids=(10,), vocab_size=50))
    loop = _Loop(core)
    p = cp.params_to_wire(SamplingParams(max_tokens=10 ** 6))     # runs until the failure
    loop.send(cp.AddRequest([1], ["a"], [p]))
    assert loop.recv().request_ids == ["a"]
    core.fail_next = True
    while not isinstance(out := loop.recv(), cp.RequestsFailed):
        pass
    assert out.request_ids == ["a"] and out.status == 500 and "simulated" in out.message
    loop.send(cp.AddRequest([1], ["b"], [p]))          # it carries on
    while not (out := loop.recv()).request_ids:
        pass
    assert out.request_ids == ["b"]
    core.executor_alive = False                        # now the executor is gone: the core gives up
    core.fail_next = True
    while not isinstance(out := loop.recv(), cp.EngineDead):
        pass
    assert "simulated" in out.message
    loop.thread.join(10)
    assert loop.code == 1


def test_fake_core_serves_n_samples():
    core = FakeEngineCore(FakeCoreArgs(token_ids=(10, 11, 12), vocab_size=50))
    assert core.add(cp.AddRequest([1, 2], ["a"], [cp.params_to_wire(SamplingParams(n=2, max_tokens=2))])) is None
    out = core.step()
    assert out.request_ids == ["a", "a"] and out.samples == [0, 1] and not out.finished
    out = core.step()
    assert [out.samples[f.index] for f in out.finished] == [0, 1] and not core.has_work()
    core.add(cp.AddRequest([1], ["b"], [cp.params_to_wire(SamplingParams(n=3, max_tokens=5))]))
    core.step()
    core.abort(["b"])
    assert not core.has_work() and not core.num_samples
