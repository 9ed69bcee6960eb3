"""Async scheduling under tensor parallelism (CPU, gloo): `TPExecutor.launch` keeps a step queued on every
rank while the engine schedules the next one.

* engine level: greedy tokens identical to tensor_parallel_size=1 and transformers with chunked prefill
  and with preemption; seeded sampling with stop strings (and logprobs) identical to a synchronous run;
  a worker killed mid-generation surfaces as RuntimeError within seconds; shutdown leaves nothing;
* protocol level, with a model-free stand-in worker (`fake_worker.py`, the real `serve_steps` loop):
  results in step order whatever the order of `result()` calls, placeholders, flushes, steps without
  sampled rows, `execute()` between launches, dropped handles, a rank raising mid-pipeline.
"""
from __future__ import annotations

import functools
import os
import random
import re
import signal
import time

import pytest

from nanovllm import LLM, SamplingParams
from nanovllm.engine.batch import SamplingBatch, StepBatch
from tests.conftest import make_prompts
from tests.distributed.fake_worker import FAIL_TOKEN, PEER_ERROR, sample
from tests.distributed.tp_helpers import assert_killed_headline, assert_workers_gone, engine_cache, ids

MAX_NEW = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)
BASE_KW = dict(device="cpu", dtype="float32", max_num_seqs=8)

# name -> (arch, checkpoint kwargs, engine kwargs)
CASES = {
    # prompts longer than the 48-token budget are prefilled in chunks, mixed with decodes
    "qwen3-chunked": ("qwen3", {}, dict(max_model_len=256, kvcache_block_size=16, num_kvcache_blocks=48,
                                        max_num_batched_tokens=48)),
    # 9 blocks of 16 tokens for ~260 prompt tokens: sequences are preempted and recomputed
    "llama-preempt": ("llama", {"tie_word_embeddings": False},
                      dict(kvcache_block_size=16, num_kvcache_blocks=9, max_model_len=120)),
}


def _prompts(seed=0, lens=(1, 15, 31, 47, 63, 100)):
    return make_prompts(lens, seed, high=450)





@pytest.fixture(scope="module")
def async_engines(tiny_ckpt):
    """async_engines(name) -> (path, TP=2 LLM with async scheduling, engine kwargs); shut down at the end."""
    def build(name):
        arch, ckpt_kw, kw = CASES[name]
        path = tiny_ckpt(arch, **ckpt_kw)
        kw = {**BASE_KW, **kw}
        return path, LLM(path, tensor_parallel_size=2, async_scheduling=True, **kw), kw

    with engine_cache(build) as get:
        yield get


# --- engine level ----------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(CASES))
def test_async_greedy_matches_tp1_and_transformers(name, async_engines, hf_greedy):
    path, llm, kw = async_engines(name)
    eng = llm.engine
    assert eng.async_scheduling and eng.config.async_scheduling
    seen = []
    real = eng.scheduler.schedule

    def spy():
        out = real()
        if out:
            seen.append([(s.num_computed_tokens, n, s.num_tokens)
                         for s, n in zip(out.seqs, out.num_new_tokens, strict=True)])
        return out

    eng.scheduler.schedule = spy
    prompts = _prompts()
    try:
        got = ids(llm.generate(prompts, GREEDY, use_tqdm=False))
    finally:
        del eng.scheduler.schedule
    assert got == ids(LLM(path, **kw).generate(prompts, GREEDY, use_tqdm=False))
    assert got == hf_greedy(path, prompts, MAX_NEW)
    if "max_num_batched_tokens" in kw:
        assert all(sum(n for _, n, _ in step) <= 48 for step in seen)
        assert any(c > 0 and c + n < t for step in seen for c, n, t in step)  # a prompt split in chunks
    else:
        assert eng.scheduler.num_preemptions > 0
    bm = eng.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    runner = eng.runner
    assert eng._inflight is None and runner._acked[0] == runner._sent  # nothing left behind
    assert runner._pending <= {1}  # rank 1's last ack is read with the next step


def test_async_seeded_sampling_stop_strings_and_logprobs_match_sync(async_engines):
    path, llm, kw = async_engines("qwen3-chunked")
    prompts = _prompts(3, (2, 9, 30, 55, 4, 17, 70, 8))
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=20, stop=["ll", "or"], logprobs=2)
              for i in range(len(prompts))]
    a = llm.generate(prompts, params, use_tqdm=False)
    b = LLM(path, async_scheduling=False, **kw).generate(prompts, params, use_tqdm=False)
    assert [(o["token_ids"], o["text"], o["finish_reason"]) for o in a] == \
        [(o["token_ids"], o["text"], o["finish_reason"]) for o in b]
    assert {o["finish_reason"] for o in a} == {"stop", "length"}
    for oa, ob in zip(a, b, strict=True):
        for tok, ea, eb in zip(oa["token_ids"], oa["logprobs"], ob["logprobs"], strict=True):
            assert ea[tok].logprob == pytest.approx(eb[tok].logprob, abs=1e-4)
            assert sorted(ea, key=lambda t: ea[t].rank) == sorted(eb, key=lambda t: eb[t].rank)


def test_async_interrupted_wait_leaves_executor_in_step(async_engines, monkeypatch):
    """Ctrl-C while the driver waits for a report (a step launched behind it): the next generate() reads
    the late reports, drops the abandoned step's result and comes out right."""
    import nanovllm.distributed.executor as ex
    path, llm, kw = async_engines("qwen3-chunked")
    runner = llm.engine.runner
    real_wait, calls, first = ex.mp_wait, [], runner._sent

    def interrupting_wait(objs, timeout=None):
        if not calls and runner._sent >= first + 3:
            calls.append(runner._sent)
            raise KeyboardInterrupt
        return real_wait(objs, timeout)

    monkeypatch.setattr(ex, "mp_wait", interrupting_wait)
    prompts = _prompts(7, (5, 12, 60))
    with pytest.raises(KeyboardInterrupt):
        llm.generate(prompts, GREEDY, use_tqdm=False)
    assert calls and runner.is_alive and runner._pending
    monkeypatch.setattr(ex, "mp_wait", real_wait)
    got = ids(llm.generate(prompts, GREEDY, use_tqdm=False))
    assert got == ids(LLM(path, **kw).generate(prompts, GREEDY, use_tqdm=False))
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_async_killed_worker_mid_generation_raises_fast(tiny_ckpt):
    # rank 1: not the rank whose report the driver waits for; rank 0 hangs in a collective without it
    victim = 1
    _, _, kw = CASES["qwen3-chunked"]
    llm = LLM(tiny_ckpt("qwen3"), tensor_parallel_size=2, async_scheduling=True, **{**BASE_KW, **kw})
    eng, runner = llm.engine, llm.engine.runner
    pids = runner.worker_pids
    try:
        for i, p in enumerate(_prompts(5, (6, 3, 50))):
            eng.add_request(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=40))
        for _ in range(4):
            eng.step()
        assert eng._inflight is not None and runner._sent > runner._acked[0]  # a step is in flight
        os.kill(pids[victim], signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(RuntimeError) as info:
            while eng.has_unfinished_requests():
                eng.step()
        assert time.monotonic() - t0 < 5  # the failure grace (1s) and reaping, with room for a loaded machine
        assert_killed_headline(info.value, victim, pids[victim])  # not rank 0's "connection reset by peer"
        assert not runner.is_alive
        assert_workers_gone(pids)  # the surviving rank (stuck in a collective) was killed and reaped
        with pytest.raises(RuntimeError, match="has failed"):
            llm.generate(_prompts(6, (2,)), GREEDY, use_tqdm=False)
    finally:
        llm.shutdown()
    assert_workers_gone(pids)


@pytest.mark.parametrize("tp", [1, 2])
def test_async_scheduling_auto_rule(tp, tiny_ckpt, monkeypatch):
    """Auto: on for CUDA whatever the TP size, off on CPU; explicit True/False win everywhere."""
    import torch
    import torch.distributed as dist

    from nanovllm.config import EngineArgs, EngineConfig
    path = tiny_ckpt("qwen3")

    def resolve(**kw):
        return EngineConfig.resolve(EngineArgs(model=path, tensor_parallel_size=tp, **kw)).async_scheduling

    assert resolve(device="cpu") is False
    assert resolve(device="cpu", async_scheduling=True) is True
    assert resolve(device="cpu", async_scheduling=False) is False
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    assert resolve(device="cuda") is True
    assert resolve(device="cuda", async_scheduling=False) is False


# --- protocol level (model-free workers) ---------------------------------------------------------
def _decode(ids: list[int], pos: int, placeholders: bool = False, sample_rows=None) -> StepBatch:
    """A decode step of len(ids) sequences; with `placeholders`, row b's input is the previous step's
    sampled id of row b. `sample_rows`: the sequences that sample (default: all)."""
    n = len(ids)
    rows = list(range(n)) if sample_rows is None else sample_rows
    return StepBatch(input_ids=list(ids), positions=[pos] * n, slot_mapping=list(range(n)),
                     cu_seqlens_q=list(range(n + 1)), seq_lens=[pos + 1] * n, block_tables=[[b] for b in range(n)],
                     max_seqlen_q=1, logits_indices=list(rows), logits_seqs=list(rows),
                     num_decode=n if sample_rows is None else 0,
                     sampling=SamplingBatch(temperatures=[0.0] * len(rows), top_ks=[0] * len(rows),
                                            top_ps=[1.0] * len(rows), min_ps=[0.0] * len(rows),
                                            seeds=list(rows), steps=[0] * len(rows), logprobs=[None] * len(rows)),
                     placeholder_pos=list(range(n)) if placeholders else [],
                     placeholder_rows=list(range(n)) if placeholders else [])


def _executor(tiny_ckpt, **fake_kw):
    from nanovllm.config import EngineArgs, EngineConfig
    from nanovllm.distributed.executor import TPExecutor
    from tests.distributed.fake_worker import fake_worker
    config = EngineConfig.resolve(EngineArgs(model=tiny_ckpt("qwen3"), device="cpu", tensor_parallel_size=2))
    assert not config.async_scheduling  # the auto rule: async on CUDA only (any TP size)
    return TPExecutor(config, worker_fn=functools.partial(fake_worker, **fake_kw))


@pytest.fixture(scope="module")
def fake_executor(tiny_ckpt):
    ex = _executor(tiny_ckpt, device_time=0.002)
    yield ex
    pids = ex.worker_pids
    ex.shutdown()
    assert_workers_gone(pids)


def test_protocol_pipelined_results_in_order(fake_executor):
    ex = fake_executor
    ids, handles, expected = [5, 9, 14], [], []
    h = ex.launch(_decode(ids, 3))
    expected.append(sample(_decode(ids, 3), []))
    for pos in range(4, 10):  # the engine's pattern: launch N+1 (placeholders from N), then read N
        batch = _decode([0, 0, 0], pos, placeholders=True)
        nxt = ex.launch(batch)
        expected.append(sample(batch, expected[-1]))
        handles.append(h)
        assert h.result().token_ids == expected[-2]
        assert ex._acked[0] == h.step and "pending" in repr(nxt)  # N+1 stays unreported: no flush yet
        h = nxt
    handles.append(h)
    assert h.result().token_ids == expected[-1]  # no successor: a flush
    assert [x.result().token_ids for x in handles] == expected  # results are kept by their handles
    # sync use right after launch, then a step with placeholders reading it
    a = ex.launch(_decode([7, 8], 0))
    assert a.result().token_ids == sample(_decode([7, 8], 0), [])
    b = ex.launch(_decode([0, 0], 1, placeholders=True))
    assert b.result().token_ids == sample(_decode([0, 0], 1, placeholders=True), a.result().token_ids)


def test_protocol_out_of_order_reads_empty_steps_execute_and_dropped_handles(fake_executor):
    from nanovllm.engine.executor import StepResult
    ex = fake_executor
    h0 = ex.launch(_decode([1, 2], 0))
    h1 = ex.launch(_decode([3], 0, sample_rows=[]))  # a prefill chunk that samples nothing
    h2 = ex.launch(_decode([4, 5], 0))
    assert h2.result().token_ids == sample(_decode([4, 5], 0), [])  # reads 0 and 1 on the way
    assert h1.result() == StepResult(token_ids=[])
    assert h0.result().token_ids == sample(_decode([1, 2], 0), [])
    # execute() while a launched step is unreported, then a late result()
    h3 = ex.launch(_decode([6], 0))
    assert ex.execute(_decode([7], 0)).token_ids == sample(_decode([7], 0), [])
    assert h3.result().token_ids == sample(_decode([6], 0), [])
    # a dropped handle (e.g. an interrupted engine step): its result is read and discarded
    ex.launch(_decode([8], 0))
    h5 = ex.launch(_decode([9], 0))
    assert h5.result().token_ids == sample(_decode([9], 0), [])
    assert len(ex._handles) == 0
    assert ex.execute(_decode([1], 0)).token_ids == sample(_decode([1], 0), [])
    assert ex.is_alive


def test_protocol_random_interleavings(fake_executor):
    """Random launches (with placeholders when the latest step sampled), execute()s, result() calls on any
    outstanding handle in any order, and dropped handles: every result is the one simulated locally."""
    ex = fake_executor
    rng = random.Random(1)
    outstanding: list = []          # (handle, expected token ids)
    last_sampled: list[int] = []    # the latest non-empty sampled ids
    for _ in range(300):
        op = rng.random()
        if op < 0.45:
            n = rng.randint(1, 4)
            ph = bool(last_sampled) and n <= len(last_sampled) and rng.random() < 0.6
            rows = sorted(rng.sample(range(n), rng.randint(0, n)))
            batch = _decode([rng.randrange(500) for _ in range(n)], rng.randrange(50), ph, rows)
            h = ex.launch(batch)
            want = sample(batch, last_sampled)
            outstanding.append((h, want))
            last_sampled = want or last_sampled
        elif op < 0.55:
            batch = _decode([rng.randrange(500)], rng.randrange(50))
            want = sample(batch, last_sampled)
            assert ex.execute(batch).token_ids == want
            last_sampled = want
        elif op < 0.9 and outstanding:
            h, want = outstanding.pop(rng.randrange(len(outstanding)))
            assert h.result().token_ids == want, h
        elif outstanding:
            outstanding.pop(rng.randrange(len(outstanding)))  # dropped unread
    for h, want in outstanding:
        assert h.result().token_ids == want
    assert ex.is_alive and ex._acked[0] == ex._sent


def test_protocol_rank_raising_mid_pipeline(fake_executor):
    """Last test on the shared executor: rank 1 raises while launching a step (with one in flight)."""
    ex = fake_executor
    pids = ex.worker_pids
    h = ex.launch(_decode([1], 0))
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"rank 1 .*raised ValueError: fake failure at step"):
        for pos in range(1, 10):
            nxt = ex.launch(_decode([FAIL_TOKEN] if pos == 3 else [0], pos, placeholders=pos != 3))
            h.result()
            h = nxt
    assert time.monotonic() - t0 < 15  # "within seconds", with room for a loaded 2-core CI machine
    assert_workers_gone(pids)
    with pytest.raises(RuntimeError, match="has failed"):
        ex.launch(_decode([1], 0))
    # the last handle either kept the result that arrived before the failure (timing-dependent: it may have
    # been read while the driver collected the failing step) or reports the failure; it never hangs
    try:
        h.result()
    except RuntimeError as e:
        assert "has failed" in str(e)


@pytest.mark.parametrize("fault", ["kill", "raise"])
def test_protocol_headline_names_the_failing_rank_not_the_survivor(tiny_ckpt, fault):
    """Rank 1 dies (or raises) only after rank 0 reported losing its peer, as a real collective does: the
    headline names rank 1 all the same, and rank 0's error is listed under it."""
    ex = _executor(tiny_ckpt, fault=fault, peer_error=True)
    pids = ex.worker_pids
    try:
        assert ex.execute(_decode([1], 0)).token_ids == sample(_decode([1], 0), [])
        t0 = time.monotonic()
        with pytest.raises(RuntimeError) as info:
            ex.execute(_decode([FAIL_TOKEN], 1))
        assert time.monotonic() - t0 < 5
    finally:
        ex.shutdown()
    lines = str(info.value).splitlines()
    if fault == "kill":
        assert_killed_headline(info.value, 1, pids[1])
    else:
        assert re.fullmatch(rf"tensor-parallel worker rank 1 \(pid {pids[1]}\) raised ValueError: fake failure "
                            rf"at step 1", lines[0]), lines[0]
        assert "--- traceback of rank 1 ---" in lines and "fake_worker.py" in str(info.value)
    assert lines[1] == f"  rank 0 also raised RuntimeError: {PEER_ERROR}"
    assert_workers_gone(pids)
