"""Model-runner paths that production uses on CUDA, exercised on CPU."""
from __future__ import annotations

import pytest

from nanovllm import LLM


def test_warmup_forward_runs_on_cpu(tiny_ckpt):
    """The profiling pass used to size the KV cache on CUDA (throwaway cache, logits and sampling)."""
    llm = LLM(tiny_ckpt("qwen3"), device="cpu", kvcache_block_size=16, max_num_batched_tokens=100)
    runner = llm.engine.runner
    runner.warmup([60, 30, 10])
    # the real cache is untouched and generation still works
    out = llm.generate([[1, 2, 3]], use_tqdm=False)
    assert len(out[0]["token_ids"]) == 16


def test_shutdown_releases_the_model_and_refuses_new_steps(tiny_ckpt):
    llm = LLM(tiny_ckpt("qwen3"), device="cpu", kvcache_block_size=16, max_num_batched_tokens=100)
    runner = llm.engine.runner
    assert runner.kv_cache is not None and runner.model is not None
    llm.shutdown()
    assert runner.kv_cache is None and runner.model is None and runner.attn_layers == [] and not runner.is_alive
    llm.shutdown()  # idempotent
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate([[1, 2, 3]], use_tqdm=False)


def test_banned_tokens_without_room_in_the_staging_layout(tiny_ckpt):
    """A CUDA graph's fixed staging layout has no banned (row, token) pairs: the sampler gets them from a separate
    small copy instead (min_tokens in a graph step)."""
    import torch

    from nanovllm.engine.batch import SamplingBatch
    from nanovllm.engine.step_inputs import Layout
    llm = LLM(tiny_ckpt("qwen3"), device="cpu", kvcache_block_size=16, max_num_batched_tokens=100)
    runner = llm.engine.runner
    sb = SamplingBatch(temperatures=[0.0, 1.0], top_ks=[0, 0], top_ps=[1.0, 1.0], min_ps=[0.0, 0.0], seeds=[0, 1],
                       steps=[0, 0], logprobs=[None, None], banned=[(0, 5), (1, 9), (1, 11)])
    layout = Layout.make(4, 4, 1, 4)  # no banned pairs (as a graph's)
    v = layout.views(torch.zeros(layout.nbytes, dtype=torch.uint8))
    t = runner._sampling_tensors(v, sb)
    assert t.banned_rows.tolist() == [0, 1, 1] and t.banned_tokens.tolist() == [5, 9, 11]
    assert t.temperatures.tolist() == [0.0, 0.0]  # (the views themselves, zeros here)


def runner_after_a_step(tiny_ckpt, prompts: list[list[int]], first: int | None = None):
    """The Triton runner of a tiny Qwen3 on the CPU interpreter (16-token blocks, 256-token budget and length), a
    scheduler of its own over its KV blocks, and greedy sequences of `prompts` of which the first `first` (all by
    default) have run one step, their sampled tokens in place. Returns (runner, scheduler, sequences); the rest
    are the caller's to add."""
    from nanovllm.engine.batch import build_step_batch
    from nanovllm.engine.block_manager import BlockManager
    from nanovllm.engine.scheduler import Scheduler
    from nanovllm.engine.sequence import Sequence
    from nanovllm.sampling_params import SamplingParams
    llm = LLM(tiny_ckpt("qwen3"), device="cpu", dtype="float32", attention_backend="triton", kvcache_block_size=16,
              max_num_batched_tokens=256, max_model_len=256)
    runner = llm.engine.runner
    sched = Scheduler(BlockManager(runner.num_kvcache_blocks, 16, False), 8, 256)
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    seqs = [Sequence(i, str(i), p, greedy, 8, frozenset(), 0) for i, p in enumerate(prompts)]
    for s in seqs[:first]:
        sched.add(s)
    step = sched.schedule()
    tokens = runner.execute(build_step_batch(step, 16)).token_ids
    for (s, _), t in zip(sched.on_step_done(step), tokens):
        s.token_ids[-1] = t
    return runner, sched, seqs


def eager_step(runner, batch):
    """Run `batch` eagerly; returns (the logits its sampler saw, the step's result)."""
    eager = []
    sampler = runner.sampler
    runner.sampler = lambda lg, t: (eager.append(lg.clone()), sampler(lg, t))[1]
    try:
        result = runner.execute(batch)
    finally:
        runner.sampler = sampler
    return eager[0], result


@pytest.mark.parametrize("rows", [128, 1024])
def test_mixed_graph_forward_matches_the_eager_step(tiny_ckpt, monkeypatch, rows):
    """What a mixed-step CUDA graph runs (`_mixed_forward` over a padded layout: decode rows through the decode
    kernel, the chunk through the varlen kernel's persistent grid (a large step's graph: its one-program-per-tile
    grid), empty padding sequences), run here without the
    graph on the CPU interpreter, then the LM head on the sampled rows as a replay does: the eager step's logits and
    greedy tokens, and the same decode-kernel variant."""
    pytest.importorskip("triton")
    import math
    from types import SimpleNamespace

    import torch

    from nanovllm.engine.batch import build_step_batch
    from nanovllm.engine.step_inputs import Layout
    runner, sched, seqs = runner_after_a_step(tiny_ckpt, [list(range(3 + 7 * i, 40 + 9 * i)) for i in range(3)], 2)
    sched.add(seqs[2])
    out = sched.schedule()                                   # two decode rows, then a 56-token chunk
    assert out.num_new_tokens[:2] == [1, 1] and out.num_new_tokens[2] > 1
    batch = build_step_batch(out, 16)
    width = math.ceil(256 / 16)
    runner.graphs = SimpleNamespace(width=width)  # what the step graph's body reads of its CUDAGraphs
    v = runner.staging.upload(batch, Layout.make(rows, 8, width, 8))
    # the decode kernel's compile-time options in each path (an eager mixed step must reuse the graphs' variant:
    # another would compile mid-run on a GPU)
    variants = []
    decode = runner.backend.k.paged_decode_attention

    def spy(*args, **kw):
        variants.append((kw.get("num_splits"), kw.get("skip_empty"), kw.get("order") is not None))
        return decode(*args, **kw)
    monkeypatch.setattr(runner.backend.k, "paged_decode_attention", spy)  # (the kernels module: restored after)
    persistent = []
    prefill = runner.backend.k.paged_prefill_attention

    def spy_prefill(*args, **kw):
        persistent.append(kw.get("persistent"))
        return prefill(*args, **kw)
    monkeypatch.setattr(runner.backend.k, "paged_prefill_attention", spy_prefill)
    logits = runner.model.compute_logits(runner._step_forward(v, rows, 8)[:batch.num_logits])
    runner.graphs = None
    assert set(persistent) == {rows <= 512}
    graph_variants, variants[:] = set(variants), []
    eager, result = eager_step(runner, batch)
    torch.testing.assert_close(logits, eager, atol=1e-4, rtol=1e-4)
    assert logits.argmax(-1).tolist() == result.token_ids
    assert set(variants) == graph_variants == {(1, True, True)}


def test_graph_sizes():
    """Decode graphs at 1, 2, 4, 8 and every 16 sequences; step graphs every 128 tokens up to 512 where mixed steps
    have graphs at all (CUDA, graphs on, the triton backend); large prefill steps (powers of two from 1024, then
    the token budget) only for a small model per GPU."""
    from types import SimpleNamespace

    import torch

    from nanovllm.engine.cuda_graphs import (
        PREFILL_GRAPH_MAX_WEIGHT_BYTES,
        decode_graph_sizes,
        mixed_graph_sizes,
        prefill_graph_sizes,
    )

    def config(params, budget=8192, tp=1, device="cuda", eager=False, backend="triton", seqs=256):
        return SimpleNamespace(device=torch.device(device), dtype=torch.bfloat16, attention_backend=backend,
                               max_num_batched_tokens=budget, max_num_seqs=seqs, quantization=None,
                               model=SimpleNamespace(matmul_params=lambda: params),
                               args=SimpleNamespace(enforce_eager=eager, tensor_parallel_size=tp))
    small, large = 0.6e9, 8e9  # parameters: 1.2 GB and 16 GB of bf16 weights
    assert 2 * small < PREFILL_GRAPH_MAX_WEIGHT_BYTES < 2 * large / 2
    assert decode_graph_sizes(config(small, seqs=40)) == [1, 2, 4, 8, 16, 32, 40]
    assert decode_graph_sizes(config(small))[-3:] == [224, 240, 256]
    assert mixed_graph_sizes(config(small)) == [128, 256, 384, 512]
    assert mixed_graph_sizes(config(small, budget=300)) == [128, 256]
    assert prefill_graph_sizes(config(small)) == [1024, 2048, 4096, 8192]
    assert prefill_graph_sizes(config(small, budget=6000)) == [1024, 2048, 4096, 6000]
    assert prefill_graph_sizes(config(small, budget=512)) == []
    assert prefill_graph_sizes(config(large)) == prefill_graph_sizes(config(large, tp=2)) == []
    for off in (dict(device="cpu"), dict(eager=True), dict(backend="torch")):
        assert mixed_graph_sizes(config(small, **off)) == prefill_graph_sizes(config(small, **off)) == []


def test_long_context_decode_steps_replay_their_own_graph():
    """A decode size with long-context KV splits gets a second graph; a step replays it when its mean context is
    at least the threshold, the plain one otherwise and at sizes without one."""
    from types import SimpleNamespace

    import torch

    from nanovllm.engine.cuda_graphs import CUDAGraphs

    cfg = SimpleNamespace(device=torch.device("cuda"), dtype=torch.bfloat16, attention_backend="triton",
                          max_num_batched_tokens=2048, max_num_seqs=64, max_model_len=8192, block_size=256,
                          speculative=None, quantization=None, model=SimpleNamespace(matmul_params=lambda: 1e9),
                          args=SimpleNamespace(enforce_eager=False, tensor_parallel_size=1))
    g = CUDAGraphs(cfg, torch.device("cpu"), None, None, lambda b: 4 if b >= 32 else None, 4096)
    assert g.long_splits == {32: 4, 48: 4, 64: 4}
    assert g.layout(("decode-long", 48)) is g.layout(("decode", 48))     # one staging layout per size
    g.decode, g.decode_long = dict.fromkeys(g.decode_sizes), dict.fromkeys(g.long_splits)  # (as if captured)

    def step(lens):
        return SimpleNamespace(is_decode=True, num_seqs=len(lens), seq_lens=lens, num_logits=len(lens),
                               num_tokens=len(lens))
    assert g.find(step([4096] * 40)) == ("decode-long", 48)
    assert g.find(step([4095] * 40)) == ("decode", 48)
    assert g.find(step([8000] * 20 + [100] * 20)) == ("decode", 48)       # mean 4,050
    assert g.find(step([8000] * 21 + [100] * 19)) == ("decode-long", 48)  # mean 4,248
    assert g.find(step([8000] * 10)) == ("decode", 16)                    # no long graph at 16


def test_eager_decode_steps_take_the_long_context_splits(tiny_ckpt, monkeypatch):
    """Without graphs a decode step takes the same rule: its mean context at or above the threshold (lowered here
    to 32 tokens, as the tiny model's contexts are short) sends the long-context splits to the decode kernel (the
    Triton kernels on the CPU interpreter, float32); greedy tokens equal the torch backend's."""
    pytest.importorskip("triton")
    from nanovllm import SamplingParams
    from nanovllm.kernels import decode_attention

    path = tiny_ckpt("qwen3")
    prompts = [[(7 * i + 3 * j) % 200 + 5 for j in range(40 + 9 * i)] for i in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    kw = dict(device="cpu", dtype="float32", kvcache_block_size=16, max_num_batched_tokens=256, max_model_len=256)
    ref = [o["token_ids"] for o in LLM(path, attention_backend="torch", **kw).generate(prompts, params,
                                                                                      use_tqdm=False)]
    monkeypatch.setattr(decode_attention, "LONG_CONTEXT_TOKENS", 32)
    llm = LLM(path, attention_backend="triton", **kw)
    runner = llm.engine.runner
    assert runner.long_context_tokens == 32
    seen = []
    backend = runner.attn_layers[0].backend   # (the Triton kernels' package, shared by every layer)
    kernel = backend.k.paged_decode_attention

    def spy(*args, **kwargs):
        seen.append(kwargs.get("num_splits"))
        return kernel(*args, **kwargs)
    monkeypatch.setattr(backend.k, "paged_decode_attention", spy)
    out = [o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)]
    assert seen and set(seen) == {4}, seen   # every decode step: mean context >= 32, four splits
    assert out == ref
