"""The packed per-step inputs: one buffer, typed views, padding rows that every kernel skips."""
from __future__ import annotations

import torch

from nanovllm.engine.batch import SamplingBatch, StepBatch
from nanovllm.engine.step_inputs import Layout, Staging


def _decode_batch(seq_lens):
    B = len(seq_lens)
    return StepBatch(
        input_ids=list(range(B)), positions=[n - 1 for n in seq_lens], slot_mapping=list(range(B)),
        cu_seqlens_q=list(range(B + 1)), seq_lens=list(seq_lens), block_tables=[[i] for i in range(B)],
        max_seqlen_q=1, is_decode=True, sample_rows=list(range(B)),
        sampling=SamplingBatch(temperatures=[0.0] * B, top_ks=[0] * B, top_ps=[1.0] * B, min_ps=[0.0] * B,
                               seeds=[0] * B, steps=[0] * B, logprobs=[None] * B))


def test_decode_order_longest_first_then_padding():
    batch = _decode_batch([5, 90, 17, 90, 1])
    layout = Layout.make(8, 8, 2, 8)  # a CUDA-graph size larger than the batch: rows 5..7 are padding
    v = Staging(torch.device("cpu")).upload(batch, layout)
    assert v["order"].tolist() == [1, 3, 2, 0, 4, 5, 6, 7]  # ties keep batch order (stable)
    assert v["seq_lens"].tolist() == [5, 90, 17, 90, 1, 0, 0, 0]
    assert v["slots"].tolist() == [0, 1, 2, 3, 4, -1, -1, -1]
    assert v["sample_seqs"][:5].tolist() == [0, 1, 2, 3, 4]
