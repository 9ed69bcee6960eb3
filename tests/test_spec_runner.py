"""The runner's side of speculative decoding on CPU: what a step CUDA graph runs for a verification step (several
logits rows per sequence, more rows than sequences) gives the eager step's logits, and the graphs' layouts have
room for the draft rows."""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from nanovllm.config import SpeculativeConfig
from nanovllm.engine.batch import build_step_batch
from nanovllm.engine.cuda_graphs import CUDAGraphs
from nanovllm.engine.step_inputs import Layout
from tests.test_runner import eager_step, runner_after_a_step

SPEC = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1})


def test_step_graph_layouts_have_rows_for_drafts():
    def config(spec, seqs=8):
        return SimpleNamespace(device=torch.device("cuda"), dtype=torch.bfloat16, attention_backend="triton",
                               max_num_batched_tokens=2048, max_num_seqs=seqs, max_model_len=1024, block_size=16,
                               speculative=spec, quantization=None, model=SimpleNamespace(matmul_params=lambda: 1e9),
                               args=SimpleNamespace(enforce_eager=False, tensor_parallel_size=1))
    plain = CUDAGraphs(config(None), torch.device("cpu"), None, None)
    spec = CUDAGraphs(config(SPEC), torch.device("cpu"), None, None)
    assert plain.layout(("step", 128)).S == 8                                  # one row per sequence
    assert spec.layout(("step", 128)).S == min(128, 8 + SPEC.max_draft_tokens)  # and every draft row
    assert spec.layout(("step", 128)).B == plain.layout(("step", 128)).B == 8
    for g in (plain, spec):
        g.step = dict.fromkeys(g.step_sizes)  # (as if captured)
    verify = SimpleNamespace(is_decode=False, num_seqs=8, num_tokens=40, num_logits=40)
    assert spec.find(verify) == ("step", 128) and plain.find(verify) is None  # (no room: eager)


def test_step_graph_forward_of_a_verification_step_matches_eager(tiny_ckpt):
    """The step graph's body (`_step_forward` over a padded layout: decode rows through the decode kernel, the
    verifying sequences' 1 + k query rows through the varlen kernel, 20 logits rows for 3 sequences), run without
    the graph on the CPU interpreter: the eager step's logits and tokens."""
    pytest.importorskip("triton")
    runner, sched, seqs = runner_after_a_step(tiny_ckpt, [list(range(3 + 7 * i, 12 + 9 * i)) for i in range(3)])
    seqs[1].draft_ids, seqs[2].draft_ids = [5, 6, 7], [8, 9]
    out = sched.schedule()                                   # one decode row, then 1 + 3 and 1 + 2 query rows
    assert out.num_new_tokens == [1, 4, 3] and out.num_drafts == [0, 3, 2] and out.num_decode == 1
    batch = build_step_batch(out, 16)
    assert batch.num_logits == 8 and batch.sampling.drafts.first_rows == [1, 5]
    width = math.ceil(256 / 16)
    runner.graphs = SimpleNamespace(width=width)  # what the step graph's body reads of its CUDAGraphs
    v = runner.staging.upload(batch, Layout.make(128, 4, width, 20))   # S = 20 > B = 4 rows of logits
    logits = runner.model.compute_logits(runner._step_forward(v, 128, 4)[:batch.num_logits])
    runner.graphs = None
    eager, result = eager_step(runner, batch)
    torch.testing.assert_close(logits, eager, atol=1e-4, rtol=1e-4)
    assert logits.argmax(-1).tolist() == result.token_ids
    # the accepted counts are the leading runs of (sample == draft)
    want = []
    for first, k, drafts in ((1, 3, [5, 6, 7]), (5, 2, [8, 9])):
        run = 0
        while run < k and result.token_ids[first + run] == drafts[run]:
            run += 1
        want.append(run)
    assert result.num_accepted == want
