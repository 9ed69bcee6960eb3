"""Sharded layers, one process: build every rank's shard with a group whose collectives do nothing, then
combine the per-rank outputs by hand (sum for all-reduce, concat for all-gather) and compare with the
unsharded layer. Cheap coverage of tp = 2, 4, 8 (and of KV-head replication) without process groups."""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from nanovllm.distributed.group import TPGroup
from nanovllm.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from nanovllm.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)


@dataclass(frozen=True)
class LocalGroup(TPGroup):
    """Collectives are left to the test: all_reduce returns this rank's partial result unchanged, and
    all_gather_last_dim returns this rank's part."""

    def all_reduce(self, x):
        return x

    def all_gather_last_dim(self, x):
        return x


def _ranks(tp):
    return [LocalGroup(r, tp) for r in range(tp)]


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def _load(layer, *pairs):
    for tensor, shard in pairs:
        layer.weight.weight_loader(layer.weight, tensor, shard)


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("bias", [False, True])
def test_column_and_row(tp, bias):
    g = _gen(1)
    w1, b1 = torch.randn(32, 16, generator=g), torch.randn(32, generator=g)
    w2, b2 = torch.randn(16, 32, generator=g), torch.randn(16, generator=g)
    x = torch.randn(5, 16, generator=g)
    h_full = torch.nn.functional.linear(x, w1, b1 if bias else None)
    y_full = torch.nn.functional.linear(h_full, w2, b2 if bias else None)
    parts, y = [], torch.zeros(5, 16)
    for grp in _ranks(tp):
        col, row = ColumnParallelLinear(16, 32, bias, grp), RowParallelLinear(32, 16, bias, grp)
        col.weight.weight_loader(col.weight, w1)
        row.weight.weight_loader(row.weight, w2)
        if bias:
            col.bias.weight_loader(col.bias, b1)
            row.bias.weight_loader(row.bias, b2)
        h = col(x)
        parts.append(h)
        y += row(h)  # all-reduce by hand
    torch.testing.assert_close(torch.cat(parts, -1), h_full)
    torch.testing.assert_close(y, y_full)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_merged_gate_up(tp):
    g = _gen(2)
    gate, up = torch.randn(24, 8, generator=g), torch.randn(24, 8, generator=g)
    x = torch.randn(3, 8, generator=g)
    gates, ups = [], []
    for grp in _ranks(tp):
        m = MergedColumnParallelLinear(8, [24, 24], False, grp)
        _load(m, (gate, 0), (up, 1))
        a, b = m(x).chunk(2, dim=-1)
        gates.append(a)
        ups.append(b)
    torch.testing.assert_close(torch.cat(gates, -1), x @ gate.T)
    torch.testing.assert_close(torch.cat(ups, -1), x @ up.T)


def test_merged_rejects_part_not_divisible():
    with pytest.raises(ValueError, match="part 0"):
        MergedColumnParallelLinear(8, [3, 3], False, LocalGroup(0, 2))  # 6 splits in 2, 3 does not


@pytest.mark.parametrize("heads, kv_heads, tp", [(4, 2, 1), (4, 2, 2), (4, 4, 4), (4, 2, 4), (8, 1, 4),
                                                 (8, 2, 8), (8, 4, 2)])
@pytest.mark.parametrize("bias", [False, True])
def test_qkv_heads_and_kv_replication(heads, kv_heads, tp, bias):
    d, hidden = 4, 16
    g = _gen(3)
    wq, wk, wv = (torch.randn(n * d, hidden, generator=g) for n in (heads, kv_heads, kv_heads))
    bq, bk, bv = (torch.randn(n * d, generator=g) for n in (heads, kv_heads, kv_heads))
    x = torch.randn(2, hidden, generator=g)
    q_full = (x @ wq.T + (bq if bias else 0)).view(2, heads, d)
    k_full = (x @ wk.T + (bk if bias else 0)).view(2, kv_heads, d)
    v_full = (x @ wv.T + (bv if bias else 0)).view(2, kv_heads, d)
    group = heads // kv_heads
    q_parts = []
    for grp in _ranks(tp):
        m = QKVParallelLinear(hidden, d, heads, kv_heads, bias, grp)
        _load(m, (wq, "q"), (wk, "k"), (wv, "v"))
        if bias:
            for t, s in ((bq, "q"), (bk, "k"), (bv, "v")):
                m.bias.weight_loader(m.bias, t, s)
        h, hkv = m.num_heads, m.num_kv_heads
        assert h == heads // tp and hkv == max(1, kv_heads // tp)
        q, k, v = m(x).split([h * d, hkv * d, hkv * d], dim=-1)
        q, k, v = q.view(2, h, d), k.view(2, hkv, d), v.view(2, hkv, d)
        q_parts.append(q)
        # every local query head must find, at local kv index (head // local group), the KV head that
        # its global head uses in the unsharded model
        local_group = h // hkv
        for i in range(h):
            global_kv = (grp.rank * h + i) // group
            torch.testing.assert_close(k[:, i // local_group], k_full[:, global_kv])
            torch.testing.assert_close(v[:, i // local_group], v_full[:, global_kv])
    torch.testing.assert_close(torch.cat(q_parts, 1), q_full)


@pytest.mark.parametrize("vocab, tp", [(64, 1), (64, 2), (61, 2), (61, 4), (5, 4), (7, 8)])
def test_vocab_parallel_embedding_and_head(vocab, tp):
    g = _gen(4)
    w = torch.randn(vocab, 8, generator=g)
    ids = torch.arange(vocab).flip(0)
    h = torch.randn(3, 8, generator=g)
    emb, logits = torch.zeros(vocab, 8), []
    for grp in _ranks(tp):
        e = VocabParallelEmbedding(vocab, 8, grp)
        e.weight.weight_loader(e.weight, w)
        emb += e(ids)  # all-reduce by hand
        head = ParallelLMHead(vocab, 8, grp)
        head.weight.weight_loader(head.weight, w)
        logits.append(torch.nn.functional.linear(h, head.weight))  # this rank's (padded) slice
    torch.testing.assert_close(emb, w[ids])
    torch.testing.assert_close(torch.cat(logits, -1)[:, :vocab], h @ w.T)
