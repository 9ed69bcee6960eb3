"""Speculative decoding (n-gram drafts) end to end on the tiny checkpoints: greedy tokens identical to transformers
and to decoding without drafts under every scheduling regime, with drafts accepted; seeded sampling, stop strings,
max_tokens, min_tokens, logprobs, n, streaming and sampling features identical to decoding without drafts while
several tokens land in one step; the prefix cache never holds a rejected draft."""
from __future__ import annotations

import random

import pytest

from nanovllm import LLM, SamplingParams
from nanovllm.engine.sequence import PLACEHOLDER
from tests.conftest import make_prompts

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
MAX_NEW = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)


def spec_prompts() -> list[list[int]]:
    """The parity prompts, and prompts that repeat themselves (one token; a short segment), after which the tiny
    random models often repeat too (so drafts get accepted). 31 prompts: under the default disable_by_batch_size
    for k = 3 (32), so the whole batch speculates."""
    rng = random.Random(1)
    same = [[t] * 8 for t in rng.sample(range(450), 8)]
    period = [rng.sample(range(450), n) * (40 // n) for n in (2, 3, 4, 6, 8, 12)]
    return make_prompts() + same + period


def check_prefix_cache(engine) -> None:
    """Every block a running sequence has registered holds its real tokens (never a draft or a placeholder);
    the block manager's ref counts are consistent."""
    bm = engine.block_manager
    running = engine.scheduler.running
    for seq in running:
        for i in range(seq.num_hashed_blocks):
            blk = bm.blocks[seq.block_table[i]]
            if blk.token_ids is not None:  # (None: the same content was registered by another block first)
                assert blk.token_ids == tuple(seq.token_ids[i * bm.block_size:(i + 1) * bm.block_size])
                assert PLACEHOLDER not in blk.token_ids
        assert seq.num_hashed_blocks * bm.block_size <= seq.num_computed_tokens
    bm.check_invariants(running + list(engine.scheduler.waiting))


def checked_steps(llm: LLM) -> list:
    """Check the prefix cache after every step; returns the list of (drafts scheduled per step) it records."""
    engine, real_step, real_schedule = llm.engine, llm.engine.step, llm.engine.scheduler.schedule
    drafts = []

    def schedule():
        out = real_schedule()
        drafts.append(sum(out.num_drafts))
        return out

    def step():
        r = real_step()
        check_prefix_cache(engine)
        return r
    engine.step, engine.scheduler.schedule = step, schedule
    return drafts


def accepted(llm: LLM) -> int:
    return llm.engine.spec_metrics["num_accepted_tokens"]


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
@pytest.mark.parametrize("kwargs", [
    {},
    {"max_num_batched_tokens": 48, "kvcache_block_size": 32},                    # chunked prefill, drafts cut
    {"kvcache_block_size": 16, "num_kvcache_blocks": 34, "max_model_len": 512},  # preemption
    {"async_scheduling": True, "kvcache_block_size": 16},                        # sync and async steps in turn
    {"scheduling_policy": "balanced", "max_num_batched_tokens": 64, "kvcache_block_size": 16},
], ids=["default", "chunked", "preemption", "async", "balanced"])
def test_greedy_matches_transformers(arch, kwargs, tiny_ckpt, hf_greedy):
    path = tiny_ckpt(arch)
    llm = LLM(path, device="cpu", speculative_config=SPEC, **kwargs)
    drafts = checked_steps(llm)
    prompts = spec_prompts()
    ref = hf_greedy(path, prompts, MAX_NEW)
    for run in (prompts, prompts[::-1]):  # the second time with prefix-cache hits
        outs = llm.generate(run, GREEDY, use_tqdm=False)
        want = ref if run is prompts else ref[::-1]
        for i, (o, r) in enumerate(zip(outs, want)):
            assert o["token_ids"] == r, f"prompt {i} (len {len(run[i])}) diverged"
            assert o["finish_reason"] == "length"
    spec = llm.engine.spec_metrics
    assert spec["num_accepted_tokens"] > 0 and spec["num_draft_tokens"] >= spec["num_accepted_tokens"]
    assert llm.engine.num_generation_tokens == 2 * MAX_NEW * len(prompts)
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and bm.prefix_hits > 0
    if "num_kvcache_blocks" in kwargs:
        assert llm.engine.scheduler.num_preemptions > 0
    if "max_num_batched_tokens" in kwargs:
        assert max(drafts) <= 48


def test_large_batch_does_not_speculate(tiny_ckpt):
    """More running sequences than disable_by_batch_size: no step has drafts until the batch has shrunk."""
    path = tiny_ckpt("qwen3")
    llm = LLM(path, device="cpu", speculative_config={**SPEC, "disable_by_batch_size": 8})
    drafts = checked_steps(llm)
    prompts = spec_prompts()
    params = [SamplingParams(temperature=0.0, max_tokens=4 + i) for i in range(len(prompts))]  # finish in turn
    llm.generate(prompts, params, use_tqdm=False)
    # sequence i finishes with its (4 + i)-th token, sampled by step 3 + i: more than 8 of the 31 run in steps 0..25
    assert sum(drafts[:len(prompts) - 8 + 3]) == 0 and sum(drafts) > 0


def test_triton_backend_under_interpreter(tiny_ckpt, hf_greedy):
    """Verification rows through the Triton kernels (KV store, varlen attention with several query rows per
    sequence next to decode rows) on the CPU interpreter."""
    pytest.importorskip("triton")
    path = tiny_ckpt("qwen3")
    llm = LLM(path, device="cpu", dtype="float32", attention_backend="triton", kvcache_block_size=16,
              speculative_config=SPEC)
    prompts = spec_prompts()[-8:-5] + make_prompts([31], seed=2)
    params = SamplingParams(temperature=0.0, max_tokens=6)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o["token_ids"] for o in outs] == hf_greedy(path, prompts, 6)
    assert accepted(llm) > 0


def test_tensor_parallel(tiny_ckpt, hf_greedy):
    """TP=2 over gloo: every rank verifies the drafts alike; rank 0 reports the accepted counts."""
    path = tiny_ckpt("qwen3")
    prompts = spec_prompts()[-10:]
    with LLM(path, device="cpu", dtype="float32", tensor_parallel_size=2, kvcache_block_size=16,
             max_model_len=256, num_kvcache_blocks=64, speculative_config=SPEC) as llm:
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False)
        assert [o["token_ids"] for o in outs] == hf_greedy(path, prompts, 16)
        assert accepted(llm) > 0


def _summary(outs):
    return [[(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in o.outputs] for o in outs]


def _assert_same_logprobs(a, b):
    for oa, ob in zip(a, b):
        for ca, cb in zip(oa.outputs, ob.outputs):
            assert (ca.logprobs is None) == (cb.logprobs is None)
            if ca.logprobs is None:
                continue
            assert len(ca.logprobs) == len(ca.token_ids)  # one entry per emitted token
            for pa, pb in zip(ca.logprobs, cb.logprobs):
                assert list(pa) == list(pb)
                for t in pa:
                    assert pa[t].rank == pb[t].rank and abs(pa[t].logprob - pb[t].logprob) < 1e-4
            assert abs(ca.cumulative_logprob - cb.cumulative_logprob) < 1e-3


def test_seeded_sampling_and_request_options_match_no_speculation(tiny_ckpt):
    """Seeded sampling draws the same tokens with drafts as without (the drafts are verified with the noise of
    the positions they stand at), while stops, max_tokens, min_tokens, logprobs and n hold when several tokens
    are emitted in one step."""
    path = tiny_ckpt("qwen3")
    prompts = spec_prompts()
    eos = 7  # (an ordinary token of the tiny vocabulary, as a stop id)
    params = []
    for i in range(len(prompts)):
        kind = i % 5
        t = [0.3, 0.8][i % 2]
        if kind == 0:
            params.append(SamplingParams(temperature=t, seed=i, max_tokens=30, stop=["ab", "e ", "s"]))
        elif kind == 1:
            params.append(SamplingParams(temperature=t, seed=i, max_tokens=1 + i % 6))
        elif kind == 2:
            params.append(SamplingParams(temperature=t, seed=i, max_tokens=20, logprobs=2, n=2))
        elif kind == 3:
            params.append(SamplingParams(temperature=t, seed=i, max_tokens=20, min_tokens=6,
                                         stop_token_ids=[prompts[i][-1], eos]))
        else:
            params.append(SamplingParams(temperature=t, seed=i, max_tokens=20, top_k=5, top_p=0.9, logprobs=0,
                                         include_stop_str_in_output=True, stop=["a"]))
    base = LLM(path, device="cpu").generate(prompts, params, use_tqdm=False)
    llm = LLM(path, device="cpu", speculative_config=SPEC)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert _summary(outs) == _summary(base)
    _assert_same_logprobs(outs, base)
    assert accepted(llm) > 0
    reasons = {c.finish_reason for o in outs for c in o.outputs}
    assert reasons == {"stop", "length"}
    for o, p in zip(outs, params):
        for c in o.outputs:
            assert len(c.token_ids) <= p.max_tokens
            if p.min_tokens:
                assert len(c.token_ids) >= p.min_tokens or c.finish_reason == "length"


def _stream(llm: LLM, prompts) -> tuple[dict, int]:
    """Stream greedy requests to the end: request id -> (tokens and text from the deltas, final output), and the
    most tokens one delta carried."""
    engine = llm.engine
    for i, p in enumerate(prompts):
        engine.add_request(f"s{i}", p, SamplingParams(temperature=0.0, max_tokens=MAX_NEW), stream=True)
    got = {f"s{i}": ([], "", None) for i in range(len(prompts))}
    biggest = 0
    while engine.has_unfinished_requests():
        for out in engine.step()[0]:
            ids, text, _ = got[out.request_id]
            got[out.request_id] = (ids + out.new_token_ids, text + out.new_text, out if out.finished else None)
            biggest = max(biggest, len(out.new_token_ids))
    return got, biggest


def test_streaming_gets_several_tokens_per_step(tiny_ckpt):
    path = tiny_ckpt("qwen3")
    prompts = spec_prompts()[-14:]
    got, biggest = _stream(LLM(path, device="cpu", speculative_config=SPEC), prompts)
    base, one = _stream(LLM(path, device="cpu"), prompts)
    assert biggest > 1 and one == 1
    for rid, (ids, text, final) in got.items():
        assert ids == final.token_ids == base[rid][0] and len(ids) == MAX_NEW
        assert text == base[rid][1] and final.text == base[rid][2].text


def test_sampling_features(tiny_ckpt):
    """logit_bias and allowed_token_ids (static per sequence) speculate and match; penalties (whose counts would
    have to include the drafts) do not speculate and match too."""
    path = tiny_ckpt("llama")
    prompts = spec_prompts()[-14:]
    base = LLM(path, device="cpu")
    llm = LLM(path, device="cpu", speculative_config=SPEC)
    allowed = sorted({t for p in prompts for t in p})[:40]
    static = [SamplingParams(temperature=0.5, seed=i, max_tokens=16, logit_bias={p[0]: 3.0, p[-1]: -2.0})
              if i % 2 else SamplingParams(temperature=0.0, max_tokens=16, allowed_token_ids=allowed + p[:1])
              for i, p in enumerate(prompts)]
    assert _summary(llm.generate(prompts, static, use_tqdm=False)) == \
        _summary(base.generate(prompts, static, use_tqdm=False))
    assert accepted(llm) > 0
    drafts = checked_steps(llm)
    penal = [SamplingParams(temperature=0.0, max_tokens=16, presence_penalty=0.5, repetition_penalty=1.2)] * 5
    assert _summary(llm.generate(prompts[:5], penal, use_tqdm=False)) == \
        _summary(base.generate(prompts[:5], penal, use_tqdm=False))
    assert sum(drafts) == 0


def test_structured_outputs_ride_along(tiny_ckpt):
    """A grammar-constrained request (a deferred step: no drafts for it) in the same batches as speculating
    ones, with and without async scheduling."""
    pytest.importorskip("xgrammar")
    from nanovllm import StructuredOutputsParams
    path = tiny_ckpt("qwen3")
    prompts = spec_prompts()[-8:] + ["Answer:"]
    regex = StructuredOutputsParams(regex=r"[a-z]{2,6}-\d{1,3}")
    params = [SamplingParams(temperature=0.0, max_tokens=20)] * 8 + [
        SamplingParams(temperature=1.0, seed=3, max_tokens=40, structured_outputs=regex)]
    base = LLM(path, device="cpu").generate(prompts, params, use_tqdm=False)
    for async_scheduling in (False, True):
        llm = LLM(path, device="cpu", speculative_config=SPEC, async_scheduling=async_scheduling)
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert _summary(outs) == _summary(base)
        assert accepted(llm) > 0


def test_context_limit(tiny_ckpt):
    """Generating up to max_model_len: the last verification steps are cut to the room left, never past it."""
    path = tiny_ckpt("qwen3")
    prompts = spec_prompts()[-14:]
    params = SamplingParams(temperature=0.0, max_tokens=None)
    base = LLM(path, device="cpu", max_model_len=64, kvcache_block_size=16).generate(prompts, params, use_tqdm=False)
    llm = LLM(path, device="cpu", max_model_len=64, kvcache_block_size=16, speculative_config=SPEC)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert _summary(outs) == _summary(base)
    assert all(len(p) + len(o["token_ids"]) == 64 and o["finish_reason"] == "length" for p, o in zip(prompts, outs))
    assert accepted(llm) > 0


def test_server_stats_have_the_counters(tiny_ckpt):
    """The engine core's stats (what the API process's /metrics renders) carry the speculative counters."""
    from nanovllm.config import EngineArgs
    from nanovllm.engine.core import EngineCore
    from nanovllm.engine.core_protocol import CORE_MESSAGES, StepOutputs, decode, encode
    from nanovllm.server.metrics import ServerMetrics
    core = EngineCore.from_args(EngineArgs(model=tiny_ckpt("qwen3"), device="cpu", speculative_config=SPEC))
    engine = core.engine
    try:
        for i, p in enumerate(spec_prompts()[-6:]):
            engine.add_request(str(i), p, GREEDY)
        while engine.has_unfinished_requests():
            engine.step()
        stats = decode(encode(StepOutputs([], [], stats=core.stats())), CORE_MESSAGES).stats   # over the wire
        spec = engine.spec_metrics
        assert stats.spec_decode and spec["num_accepted_tokens"] > 0
        assert (stats.spec_num_drafts, stats.spec_num_draft_tokens, stats.spec_num_accepted_tokens) == \
            (spec["num_drafts"], spec["num_draft_tokens"], spec["num_accepted_tokens"])
        text = ServerMetrics().render(stats, "m")
        n = spec["num_accepted_tokens"]
        assert f'nanovllm:spec_decode_num_accepted_tokens_total{{model_name="m"}} {n}' in text
    finally:
        core.shutdown()
