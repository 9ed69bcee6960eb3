"""Vocabulary-parallel embedding and LM head: each rank holds a contiguous slice of the vocabulary."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.distributed.group import TPGroup
from nanovllm.layers.sampler import VocabShard


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, tp: TPGroup):
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.shard_size = -(-vocab_size // tp.size)  # last shard padded
        self.vocab_start = tp.rank * self.shard_size
        self.weight = nn.Parameter(torch.empty(self.shard_size, hidden_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if loaded.shape[0] != self.vocab_size or loaded.shape[1] != param.shape[1]:
            raise ValueError(f"checkpoint tensor of shape {tuple(loaded.shape)} does not fit a "
                             f"({self.vocab_size}, {param.shape[1]}) embedding")
        n = max(0, min(self.shard_size, self.vocab_size - self.vocab_start))  # a tail rank may hold only padding
        param.data[:n].copy_(loaded[self.vocab_start:self.vocab_start + n])
        param.data[n:].zero_()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.vocab_start
        mine = (local >= 0) & (local < self.shard_size)
        y = F.embedding(local.clamp(0, self.shard_size - 1), self.weight) * mine.unsqueeze(-1).to(self.weight.dtype)
        return self.tp.all_reduce(y)


class ParallelLMHead(VocabParallelEmbedding):
    """Hidden states -> logits in the model's dtype: the sampler reads them as float32 (exactly) in its fused
    kernel, and converts them itself where it needs a float32 copy.

    ``forward(hidden)`` gives the full-vocabulary logits on every rank (an all-gather under TP);
    ``forward(hidden, gather=False)`` this rank's (N, shard_size) slice, padding included, which the sampler
    reduces across ranks itself (``vocab_shard()`` describes it)."""

    def forward(self, hidden: torch.Tensor, gather: bool = True) -> torch.Tensor:
        logits = F.linear(hidden, self.weight)
        return self.vocab_shard().gather(logits) if gather else logits

    def vocab_shard(self) -> VocabShard:
        return VocabShard(self.tp, self.vocab_start, self.shard_size, self.vocab_size)
