"""Tensor parallelism on CPU (gloo): every rank in its own worker process, greedy output identical to
tensor_parallel_size=1 and to transformers; engines don't collide; dead or failing workers surface fast.

Each TP engine costs a couple of process start-ups (importing torch), so engines are shared per module
where a test doesn't destroy its engine.
"""
from __future__ import annotations

import multiprocessing
import os
import signal
import time

import pytest

from nanovllm import LLM, SamplingParams
from nanovllm.config import ModelConfig
from nanovllm.distributed import check_tp_supported
from tests.conftest import make_prompts
from tests.distributed.tp_helpers import assert_killed_headline, assert_workers_gone, engine_cache, gone, ids

MAX_NEW = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)
ENGINE_KW = dict(device="cpu", dtype="float32", max_model_len=256, kvcache_block_size=16,
                 num_kvcache_blocks=48, max_num_seqs=8)

# name -> (arch, checkpoint kwargs, tensor_parallel_size)
CASES = {
    "qwen3": ("qwen3", {}, 2),
    # odd vocabulary: the last rank's vocab shard is padded
    "qwen2": ("qwen2", {"vocab_size": 485}, 2),
    # untied LM head: loaded through its own vocab-parallel weight loader
    "llama": ("llama", {"tie_word_embeddings": False}, 2),
    # 1 KV head over 2 ranks: replicated
    "qwen3-kv1": ("qwen3", {"num_kv_heads": 1}, 2),
    # mixtures of experts: each expert's intermediate dimension split (a dense layer too), the router replicated;
    # Qwen2-MoE's shared expert and its gate
    "qwen3_moe": ("qwen3_moe", {}, 2),
    "qwen2_moe": ("qwen2_moe", {}, 2),
}


def _prompts(seed=0, lens=(1, 5, 17, 40)):
    return make_prompts(lens, seed, high=480)





@pytest.fixture(scope="module")
def engines(tiny_ckpt):
    """engines(name) -> (checkpoint path, a live TP LLM), built on first use, shut down after the module."""
    def build(name):
        arch, kw, tp = CASES[name]
        path = tiny_ckpt(arch, **kw)
        return path, LLM(path, tensor_parallel_size=tp, **ENGINE_KW)

    with engine_cache(build) as get:
        yield get


@pytest.mark.parametrize("name", list(CASES))
def test_greedy_matches_tp1_and_transformers(name, engines, hf_greedy):
    path, llm = engines(name)
    prompts = _prompts()
    tp_out = llm.generate(prompts, GREEDY, use_tqdm=False)
    ref = LLM(path, tensor_parallel_size=1, **ENGINE_KW).generate(prompts, GREEDY, use_tqdm=False)
    assert ids(tp_out) == ids(ref)
    assert ids(tp_out) == hf_greedy(path, prompts, MAX_NEW)
    assert all(len(o["token_ids"]) == MAX_NEW for o in tp_out)
    # every block came back (the driver's block manager is the only one)
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks == llm.engine.runner.num_kvcache_blocks == 48
    assert llm.engine.runner.load_seconds > 0  # start-up timings come back from the ranks


@pytest.mark.parametrize("name", ["qwen3", "qwen2"])
def test_seeded_sampling_matches_tp1(name, engines):
    """Sampled tokens under TP=2 equal TP=1's exactly: plain sampling (each rank reduces its vocabulary shard,
    only per-row partials are exchanged), with min_tokens bans spread over both shards, and a batch mixing in
    top-k / top-p requests (those steps gather the full logits)."""
    path, llm = engines(name)
    prompts = _prompts(11)
    banned = list(range(3, 485, 7))  # held back by min_tokens, in both ranks' shards
    plain = [SamplingParams(temperature=0.8, seed=1, max_tokens=MAX_NEW),
             SamplingParams(temperature=1.3, seed=2, max_tokens=MAX_NEW, stop_token_ids=banned, min_tokens=MAX_NEW),
             SamplingParams(temperature=0.0, max_tokens=MAX_NEW),
             SamplingParams(temperature=1.0, seed=3, max_tokens=MAX_NEW)]
    mixed = [plain[0], SamplingParams(temperature=0.9, top_k=20, seed=4, max_tokens=MAX_NEW),
             SamplingParams(temperature=1.1, top_p=0.8, seed=5, max_tokens=MAX_NEW), plain[3]]
    ref = LLM(path, **ENGINE_KW)
    got_plain = ids(llm.generate(prompts, plain, use_tqdm=False))
    assert got_plain == ids(ref.generate(prompts, plain, use_tqdm=False))
    assert not set(got_plain[1]) & set(banned)
    assert got_plain[0] != ids(ref.generate(prompts[:1], GREEDY, use_tqdm=False))[0]  # it does sample
    got_mixed = ids(llm.generate(prompts, mixed, use_tqdm=False))
    assert got_mixed == ids(ref.generate(prompts, mixed, use_tqdm=False))
    # a seeded request gets the same tokens whether its steps took the shard path or gathered the logits
    assert got_mixed[0] == got_plain[0] and got_mixed[3] == got_plain[3]


def test_two_engines_alive_do_not_collide(engines):
    (pa, a), (pb, b) = engines("qwen3"), engines("qwen3-kv1")
    ra, rb = a.engine.runner, b.engine.runner
    assert not set(ra.worker_pids) & set(rb.worker_pids)
    # interleave steps of both engines, with different prompts (so different batches)
    pr_a, pr_b = _prompts(1, (3, 9)), _prompts(2, (7, 2, 20))
    for i, p in enumerate(pr_a):
        a.engine.add_request(f"a{i}", p, GREEDY)
    for i, p in enumerate(pr_b):
        b.engine.add_request(f"b{i}", p, GREEDY)
    done: dict = {}
    while a.engine.has_unfinished_requests() or b.engine.has_unfinished_requests():
        for eng in (a.engine, b.engine):
            if eng.has_unfinished_requests():
                for out in eng.step()[0]:
                    done[out.request_id] = out.token_ids
    got_a = [done[f"a{i}"] for i in range(len(pr_a))]
    got_b = [done[f"b{i}"] for i in range(len(pr_b))]
    assert got_a == ids(LLM(pa, **ENGINE_KW).generate(pr_a, GREEDY, use_tqdm=False))
    assert got_b == ids(LLM(pb, **ENGINE_KW).generate(pr_b, GREEDY, use_tqdm=False))


def test_interrupted_step_leaves_executor_in_sync(engines, monkeypatch):
    """Ctrl-C while waiting for a step: the next call drains the late replies and stays in step."""
    import nanovllm.distributed.executor as ex
    path, llm = engines("qwen3")
    real_wait, calls = ex.mp_wait, []

    def interrupting_wait(objs, timeout=None):
        if not calls and 0 in llm.engine.runner._pending:  # a step is in flight
            calls.append(1)
            raise KeyboardInterrupt
        return real_wait(objs, timeout)

    monkeypatch.setattr(ex, "mp_wait", interrupting_wait)
    prompts = _prompts(7, (5, 12))
    with pytest.raises(KeyboardInterrupt):
        llm.generate(prompts, GREEDY, use_tqdm=False)
    assert calls and llm.engine.runner.is_alive and 0 in llm.engine.runner._pending
    monkeypatch.setattr(ex, "mp_wait", real_wait)
    got = ids(llm.generate(prompts, GREEDY, use_tqdm=False))
    assert got == ids(LLM(path, **ENGINE_KW).generate(prompts, GREEDY, use_tqdm=False))


_EXIT_SCRIPT = """
import sys
from nanovllm import LLM
if __name__ == "__main__":
    llm = LLM(sys.argv[1], tensor_parallel_size=2, device="cpu", dtype="float32", max_model_len=64,
              kvcache_block_size=16, num_kvcache_blocks=8)
    print(*llm.engine.runner.worker_pids, flush=True)
    # exits without calling shutdown()
"""


def test_workers_gone_after_interpreter_exit_without_shutdown(tiny_ckpt, tmp_path):
    import subprocess
    import sys
    script = tmp_path / "exit_without_shutdown.py"
    script.write_text(_EXIT_SCRIPT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in [os.getcwd(), os.environ.get("PYTHONPATH")] if p)}
    proc = subprocess.run([sys.executable, str(script), tiny_ckpt("qwen3")], capture_output=True, text=True,
                          timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    pids = [int(x) for x in proc.stdout.split()]
    assert len(pids) == 2
    deadline = time.monotonic() + 5
    while not all(gone(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(gone(p) for p in pids)


def test_tp4_replicated_kv_heads_and_clean_shutdown(tiny_ckpt):
    # 8 query heads, 2 KV heads over 4 ranks: each KV head is kept by 2 ranks
    path = tiny_ckpt("llama", num_heads=8, num_kv_heads=2, head_dim=8)
    prompts = _prompts(3, (4, 19))
    ref = LLM(path, **ENGINE_KW).generate(prompts, GREEDY, use_tqdm=False)
    llm = LLM(path, tensor_parallel_size=4, **ENGINE_KW)
    pids = llm.engine.runner.worker_pids
    assert len(pids) == 4
    try:
        assert ids(llm.generate(prompts, GREEDY, use_tqdm=False)) == ids(ref)
    finally:
        t0 = time.monotonic()
        llm.shutdown()
        llm.shutdown()  # idempotent
    assert time.monotonic() - t0 < 20
    assert_workers_gone(pids)
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate(prompts, GREEDY, use_tqdm=False)


@pytest.mark.parametrize("victim", [1, 0])
def test_killed_worker_raises_fast(tiny_ckpt, victim):
    """The headline names the killed rank, though the survivor's collective fails too ("connection reset by
    peer") and its report may reach the driver first."""
    path = tiny_ckpt("qwen3")
    llm = LLM(path, tensor_parallel_size=2, **ENGINE_KW)
    runner = llm.engine.runner
    pids = runner.worker_pids
    try:
        llm.generate(_prompts(4, (6,)), GREEDY, use_tqdm=False)
        os.kill(pids[victim], signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(RuntimeError) as info:
            llm.generate(_prompts(5, (6, 3)), GREEDY, use_tqdm=False)
        assert time.monotonic() - t0 < 5  # the failure grace (1s) and reaping, with room for a loaded machine
        assert_killed_headline(info.value, victim, pids[victim])
        assert not runner.is_alive
        assert_workers_gone(pids)  # the executor killed the surviving rank and reaped both
        with pytest.raises(RuntimeError, match="has failed"):
            llm.generate(_prompts(6, (2,)), GREEDY, use_tqdm=False)
    finally:
        llm.shutdown()
    assert_workers_gone(pids)


def test_worker_exception_carries_traceback(tiny_ckpt):
    path = tiny_ckpt("qwen3")
    llm = LLM(path, tensor_parallel_size=2, **ENGINE_KW)
    runner = llm.engine.runner
    pids = runner.worker_pids
    try:
        from nanovllm.engine.batch import SamplingBatch, StepBatch
        # a block table entry far outside the cache: every rank fails inside the forward
        bad = StepBatch(input_ids=[1, 2], positions=[0, 1], slot_mapping=[10 ** 9, 10 ** 9 + 1],
                        cu_seqlens_q=[0, 2], seq_lens=[2], block_tables=[[10 ** 7]], max_seqlen_q=2,
                        logits_indices=[], logits_seqs=[], sampling=SamplingBatch())
        t0 = time.monotonic()
        with pytest.raises(RuntimeError) as info:
            runner.execute(bad)
        assert time.monotonic() - t0 < 15  # "within seconds", with room for a loaded 2-core CI machine
        msg = str(info.value)
        assert "tensor-parallel worker rank" in msg and "raised" in msg
        assert "Traceback (most recent call last)" in msg and "worker.py" in msg
        assert_workers_gone(pids)
    finally:
        llm.shutdown()


def test_init_error_is_a_value_error_and_leaves_nothing(tiny_ckpt):
    path = tiny_ckpt("qwen3")
    before = {p.pid for p in multiprocessing.active_children()}
    # 4 blocks x 16 tokens can't hold max_model_len=256: every rank refuses while starting
    with pytest.raises(ValueError, match="max_model_len=256") as info:
        LLM(path, tensor_parallel_size=2, **{**ENGINE_KW, "num_kvcache_blocks": 4})
    assert "rank" in str(info.value)
    time.sleep(0.1)
    assert {p.pid for p in multiprocessing.active_children()} <= before


_MOE = {"architectures": ["Qwen3MoeForCausalLM"], "num_experts": 8, "num_experts_per_tok": 2,
        "moe_intermediate_size": 32}


def _cfg(**kw) -> ModelConfig:
    base = {"architectures": ["Qwen3ForCausalLM"], "vocab_size": 512, "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2}
    return ModelConfig.from_dict({**base, **kw})


@pytest.mark.parametrize("tp, kw, match", [
    (3, {}, "num_attention_heads=4"),
    (4, {"num_attention_heads": 12, "num_key_value_heads": 3}, "num_key_value_heads=3"),
    (4, {"num_attention_heads": 8, "num_key_value_heads": 6}, "num_key_value_heads=6"),
    (2, {"intermediate_size": 129}, "intermediate_size=129"),
    (2, {**_MOE, "moe_intermediate_size": 33}, "moe_intermediate_size=33"),
    (2, {**_MOE, "mlp_only_layers": [0], "intermediate_size": 129}, "intermediate_size=129"),
    (2, {**_MOE, "architectures": ["Qwen2MoeForCausalLM"], "shared_expert_intermediate_size": 47},
     "shared_expert_intermediate_size=47"),
])
def test_check_tp_supported_rejects(tp, kw, match):
    import torch
    with pytest.raises(ValueError, match=match):
        check_tp_supported(tp, _cfg(**kw), torch.device("cpu"))


def test_check_tp_supported_accepts_and_checks_devices():
    import torch
    check_tp_supported(1, _cfg(), torch.device("cpu"))
    check_tp_supported(2, _cfg(), torch.device("cpu"))
    check_tp_supported(4, _cfg(), torch.device("cpu"))  # 2 KV heads replicated over 4 ranks
    check_tp_supported(8, _cfg(num_attention_heads=8, num_key_value_heads=1), torch.device("cpu"))
    # every layer sparse: the unused dense intermediate_size need not split
    check_tp_supported(2, _cfg(**_MOE, intermediate_size=129), torch.device("cpu"))
    with pytest.raises(ValueError, match="cuda:1"):
        check_tp_supported(2, _cfg(), torch.device("cuda", 1))
    if torch.cuda.device_count() < 64:
        with pytest.raises(ValueError, match="needs 64 CUDA devices"):
            check_tp_supported(64, _cfg(num_attention_heads=64, num_key_value_heads=64,
                                        intermediate_size=128 * 64), torch.device("cuda"))


def test_llm_rejects_indivisible_heads(tiny_ckpt):
    with pytest.raises(ValueError, match="num_attention_heads=4 is not divisible by tensor_parallel_size=3"):
        LLM(tiny_ckpt("qwen3"), tensor_parallel_size=3, **ENGINE_KW)
