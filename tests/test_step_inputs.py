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
        max_seqlen_q=1, logits_indices=list(range(B)), logits_seqs=list(range(B)), num_decode=B,
        sampling=SamplingBatch(temperatures=[0.0] * B, top_ks=[0] * B, top_ps=[1.0] * B, min_ps=[0.0] * B,
                               seeds=[0] * B, steps=[0] * B, logprobs=[None] * B))


def test_decode_order_longest_first_then_padding():
    batch = _decode_batch([5, 90, 17, 90, 1])
    layout = Layout.make(8, 8, 2, 8)  # a CUDA-graph size larger than the batch: rows 5..7 are padding
    v = Staging(torch.device("cpu")).upload(batch, layout)
    assert v.order.tolist() == [1, 3, 2, 0, 4, 5, 6, 7]  # ties keep batch order (stable)
    assert v.seq_lens.tolist() == [5, 90, 17, 90, 1, 0, 0, 0]
    assert v.slots.tolist() == [0, 1, 2, 3, 4, -1, -1, -1]
    assert v.logits_seqs[:5].tolist() == [0, 1, 2, 3, 4]
    assert v.cu.tolist() == [0, 1, 2, 3, 4, 5, 5, 5, 5]


def test_mixed_step_split_fields_and_graph_padding():
    """A mixed step packed into a larger (CUDA-graph) layout: the decode kernel's lengths (one-token sequences
    only), the varlen kernel's offsets (no queries for them), padded sampled rows gather row 0. Banned tokens
    (min_tokens) don't fit a graph layout: they are left to the runner instead of failing."""
    B = 3  # two decode rows, then a 4-token chunk
    batch = StepBatch(
        input_ids=[1, 2, 3, 4, 5, 6], positions=[9, 20, 0, 1, 2, 3], slot_mapping=list(range(6)),
        cu_seqlens_q=[0, 1, 2, 6], seq_lens=[10, 21, 4], block_tables=[[0], [1], [2]], max_seqlen_q=4,
        logits_indices=[0, 1, 5], logits_seqs=[0, 1, 2],
        sampling=SamplingBatch(temperatures=[0.0] * B, top_ks=[0] * B, top_ps=[1.0] * B, min_ps=[0.0] * B,
                               seeds=[0] * B, steps=[0] * B, logprobs=[None] * B, banned=[(0, 5), (2, 7)]),
        num_decode=2)
    stage = Staging(torch.device("cpu"))
    layout = Layout.make(8, 5, 2, 5)
    stage.hosts[1][:] = 0xFF  # stale bytes from an earlier step
    v = stage.upload(batch, layout)
    assert v.dec_lens.tolist() == [10, 21, 0, 0, 0]
    assert v.cu_pre.tolist() == [2, 2, 2, 6, 6, 6]
    assert v.cu.tolist() == [0, 1, 2, 6, 6, 6]
    assert v.logits_indices.tolist() == [0, 1, 5, 0, 0]
    assert v.order.tolist() == [1, 0, 2, 3, 4]  # the decode rows longest first, then the chunk and padding
    assert v.banned_rows.numel() == 0
    # an eager layout has room for them
    v = stage.upload(batch, Layout.make(6, 3, 1, 3, 2))
    assert v.banned_rows.tolist() == [0, 2] and v.banned_tokens.tolist() == [5, 7]
    assert v.cu_pre.tolist() == [2, 2, 2, 6]


def test_ragged_block_tables_fill_their_rows_and_zero_the_rest():
    """Tables of 3, 0, 1 and 2 blocks in a 4-column layout with a padding row: each row starts at its own column
    0, and every entry past a table (stale bytes before) is block 0."""
    batch = _decode_batch([600, 1, 200, 300])
    batch.block_tables = [[7, 8, 9], [], [5], [11, 12]]
    stage = Staging(torch.device("cpu"))
    stage.hosts[1][:] = 0xFF
    v = stage.upload(batch, Layout.make(5, 5, 4, 5))
    assert v.block_tables(5, 4).tolist() == [[7, 8, 9, 0], [0, 0, 0, 0], [5, 0, 0, 0], [11, 12, 0, 0], [0] * 4]
    empty = _decode_batch([])
    assert stage.upload(empty, Layout.make(2, 2, 3, 2)).block_tables(2, 3).tolist() == [[0] * 3] * 2
