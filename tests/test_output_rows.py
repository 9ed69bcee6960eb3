"""Prefill steps run the last decoder layer for the sampled rows only (``OutputRows``).

Every row's K/V must still reach the cache, and the sampled rows' logits must equal those of the full
forward; these tests pin both, on a schedule that mixes decode rows, whole prompts and a prompt split over
several chunks (a chunk that samples nothing)."""
from __future__ import annotations

import pytest
import torch

from nanovllm import LLM, SamplingParams
from tests.conftest import make_prompts


def _run(path, prompts, trim: bool, arch_kwargs=None):
    """Generate with the engine; trim=False runs every step's last layer on all rows (as a full forward does),
    by handing the model no OutputRows."""
    llm = LLM(path, device="cpu", dtype="float32", max_num_batched_tokens=96, max_num_seqs=8,
              kvcache_block_size=16, **(arch_kwargs or {}))
    runner = llm.engine.runner
    if not trim:
        forward = runner.model.forward
        runner.model.forward = lambda ids, pos, meta, rows=None: (
            forward(ids, pos, meta) if rows is None else forward(ids, pos, meta)[rows.rows])
    mlp_rows: list[int] = []
    hook = runner.model.model.layers[-1].mlp.register_forward_pre_hook(lambda m, a: mlp_rows.append(a[0].shape[0]))
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=3)
    outs = llm.generate(prompts, params, use_tqdm=False)
    hook.remove()
    llm.shutdown()
    return outs, mlp_rows


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_trimmed_last_layer_matches_full(tiny_ckpt, arch):
    path = tiny_ckpt(arch)
    prompts = make_prompts([5, 40, 200, 17, 64, 3, 130])  # 200 and 130 span several 96-token chunks
    full, full_rows = _run(path, prompts, trim=False)
    trim, trim_rows = _run(path, prompts, trim=True)
    for a, b in zip(full, trim):
        assert a["token_ids"] == b["token_ids"]
        assert [sorted(pos) for pos in a["logprobs"]] == [sorted(pos) for pos in b["logprobs"]]
        lp_a = torch.tensor([[pos[t].logprob for t in sorted(pos)] for pos in a["logprobs"]])
        lp_b = torch.tensor([[pos[t].logprob for t in sorted(pos)] for pos in b["logprobs"]])
        torch.testing.assert_close(lp_b, lp_a, rtol=0, atol=1e-4)
    # the full forward gives the last MLP every row of a prefill chunk; the trimmed one only the sampled rows
    assert max(full_rows) == 96
    assert max(trim_rows) <= 8 and sum(trim_rows) < sum(full_rows) // 3


def test_sampled_rows_out_of_order(tiny_ckpt):
    """A step whose sampled sequences are not the first ones (sequence 1 is a partial prompt chunk that
    samples nothing): each sampled row must attend over its own sequence."""
    from nanovllm.engine.batch import SamplingBatch, StepBatch

    llm = LLM(tiny_ckpt("qwen3"), device="cpu", dtype="float32", kvcache_block_size=16)
    runner = llm.engine.runner
    lens = [7, 20, 33]            # sequence 1's chunk is not its prompt's end: only 0 and 2 sample
    last = [6, 7 + 20 + 33 - 1]
    prompts = make_prompts(lens, seed=3)
    tables, slots, positions, cu, first = [], [], [], [0], 0
    for n in lens:
        nb = -(-n // 16)
        tables.append(list(range(first, first + nb)))
        slots.extend(range(first * 16, first * 16 + n))  # the sequence's blocks are consecutive
        positions.extend(range(n))
        cu.append(cu[-1] + n)
        first += nb
    batch = StepBatch(
        input_ids=[t for p in prompts for t in p], positions=positions, slot_mapping=slots, cu_seqlens_q=cu,
        seq_lens=list(lens), block_tables=tables, max_seqlen_q=max(lens), logits_indices=last, logits_seqs=[0, 2],
        sampling=SamplingBatch(temperatures=[0.0] * 2, top_ks=[0] * 2, top_ps=[1.0] * 2, min_ps=[0.0] * 2,
                               seeds=[0, 1], steps=[0] * 2, logprobs=[5, 5]))
    results = {True: runner.execute(batch)}
    forward = runner.model.forward
    runner.model.forward = lambda ids, pos, meta, rows=None: forward(ids, pos, meta)[rows.rows]  # untrimmed
    results[False] = runner.execute(batch)
    llm.shutdown()
    assert results[True].token_ids == results[False].token_ids
    assert results[True].top_ids == results[False].top_ids
    torch.testing.assert_close(torch.tensor(results[True].top_logprobs), torch.tensor(results[False].top_logprobs),
                               rtol=0, atol=1e-5)
