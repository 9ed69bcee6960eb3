"""One step's inputs packed into one buffer, so a step costs one host-to-device copy.

`Layout` places every per-step array (token ids, positions, slots, block tables, sampling parameters...)
at a 16-byte aligned offset of a byte buffer; `pack` fills a (pinned) host buffer from a StepBatch; the
runner copies it to the device in one go and reads typed views of it. A decode CUDA graph is captured
over the views of its own fixed layout, so replaying it needs no copy beyond that one.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from nanovllm.engine.batch import StepBatch

_FIELDS: tuple[tuple[str, torch.dtype], ...] = (
    ("seeds", torch.int64),
    ("ids", torch.int32), ("src", torch.int32), ("pos", torch.int32), ("slots", torch.int32),
    ("cu", torch.int32), ("cu_pre", torch.int32), ("seq_lens", torch.int32), ("dec_lens", torch.int32),
    ("tables", torch.int32), ("last", torch.int32),
    ("sample_seqs", torch.int32), ("order", torch.int32),
    ("steps", torch.int32), ("top_ks", torch.int32), ("banned_rows", torch.int32), ("banned_tokens", torch.int32),
    ("temps", torch.float32), ("top_ps", torch.float32), ("min_ps", torch.float32),
)
_NP = {torch.int64: np.int64, torch.int32: np.int32, torch.float32: np.float32}


@dataclass(frozen=True)
class Layout:
    """Byte offsets of each array for T tokens, B sequences, W block-table columns, S sampled rows and NB
    banned (row, token) pairs."""
    T: int
    B: int
    W: int
    S: int
    NB: int
    fields: dict           # name -> (dtype, byte offset, numel)
    nbytes: int

    @classmethod
    def make(cls, T: int, B: int, W: int, S: int, NB: int = 0) -> Layout:
        sizes = {"ids": T, "src": T, "pos": T, "slots": T, "cu": B + 1, "cu_pre": B + 1, "seq_lens": B,
                 "dec_lens": B, "order": B, "tables": B * W,
                 "last": S, "sample_seqs": S, "steps": S, "top_ks": S, "seeds": S, "temps": S, "top_ps": S,
                 "min_ps": S, "banned_rows": NB, "banned_tokens": NB}
        off, fields = 0, {}
        for name, dtype in _FIELDS:
            n = sizes[name]
            fields[name] = (dtype, off, n)
            off += -(-n * dtype.itemsize // 16) * 16
        return cls(T, B, W, S, NB, fields, max(off, 16))

    def views(self, buf: torch.Tensor) -> dict[str, torch.Tensor]:
        """Typed views of a uint8 buffer laid out like this."""
        out = {}
        for name, (dtype, off, n) in self.fields.items():
            out[name] = buf[off:off + n * dtype.itemsize].view(dtype)
        return out


def pack(batch: StepBatch, layout: Layout, host: torch.Tensor) -> None:
    """Write `batch` into the uint8 `host` buffer per `layout`.

    The layout may be larger than the batch (a CUDA-graph size): the extra rows become padding (slot -1,
    sequence length 0) that every kernel skips."""
    raw = host.numpy()
    arr = {}
    for name, (dtype, off, n) in layout.fields.items():
        arr[name] = raw[off:off + n * dtype.itemsize].view(_NP[dtype])
    T, B, S = batch.num_tokens, batch.num_seqs, len(batch.sampling.temperatures)
    arr["ids"][:T] = batch.input_ids
    src = arr["src"]
    src[:] = -1
    if batch.placeholder_pos:
        src[batch.placeholder_pos] = batch.placeholder_rows
    arr["pos"][:T] = batch.positions
    arr["slots"][:T] = batch.slot_mapping
    if layout.T > T:
        arr["ids"][T:] = 0
        arr["pos"][T:] = 0
        arr["slots"][T:] = -1
    cu = arr["cu"]
    cu[:B + 1] = batch.cu_seqlens_q
    if layout.B > B:
        cu[B + 1:] = batch.cu_seqlens_q[-1]
    arr["seq_lens"][:B] = batch.seq_lens
    if layout.B > B:
        arr["seq_lens"][B:] = 0
    nd = B if batch.is_decode else batch.num_decode  # the leading one-token sequences
    if not batch.is_decode:  # a mixed step's split between the decode and the varlen kernel (AttentionMetadata)
        arr["dec_lens"][:nd] = batch.seq_lens[:nd]
        arr["dec_lens"][nd:] = 0
        cu_pre = arr["cu_pre"]
        cu_pre[:nd + 1] = nd
        cu_pre[nd + 1:B + 1] = batch.cu_seqlens_q[nd + 1:]
        cu_pre[B + 1:] = batch.cu_seqlens_q[-1]
    # the decode kernel launches the longest sequences first; padding (and a mixed step's chunks) last
    order = arr["order"]
    order[:nd] = np.argsort(-np.asarray(batch.seq_lens[:nd]), kind="stable")
    order[nd:] = np.arange(nd, layout.B)
    W = layout.W
    tables = arr["tables"]
    tables[:] = 0  # columns past a sequence's last block are never used, but must be valid block ids
    for i, t in enumerate(batch.block_tables):
        tables[i * W:i * W + len(t)] = t
    cu_q = batch.cu_seqlens_q
    arr["last"][:len(batch.sample_rows)] = [cu_q[b + 1] - 1 for b in batch.sample_rows]
    arr["last"][len(batch.sample_rows):] = 0  # a graph's padded rows gather row 0 (valid, unused)
    arr["sample_seqs"][:len(batch.sample_rows)] = batch.sample_rows
    sb = batch.sampling
    arr["steps"][:S] = sb.steps
    arr["top_ks"][:S] = sb.top_ks
    arr["seeds"][:S] = sb.seeds
    arr["temps"][:S] = sb.temperatures
    arr["top_ps"][:S] = sb.top_ps
    arr["min_ps"][:S] = sb.min_ps
    if sb.banned and layout.NB == len(sb.banned):  # (a graph's fixed layout has none: see ModelRunner)
        arr["banned_rows"][:] = [r for r, _ in sb.banned]
        arr["banned_tokens"][:] = [t for _, t in sb.banned]


class Staging:
    """Two host buffers used in turn (pinned on CUDA: filling one never races the copy reading the other)
    and a device buffer for eager steps; both grow on demand."""

    def __init__(self, device: torch.device, nbytes: int = 1 << 16):
        self.device = device
        self.pinned = device.type == "cuda"
        self.hosts = [self._host(nbytes), self._host(nbytes)]
        self.copied = [None, None]  # CUDA event after the copy that last read each host buffer
        self.turn = 0
        self.dev = torch.empty(nbytes, dtype=torch.uint8, device=device) if self.pinned else None

    def _host(self, n: int) -> torch.Tensor:
        return torch.empty(n, dtype=torch.uint8, pin_memory=self.pinned)

    def upload(self, batch: StepBatch, layout: Layout, dev: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """Pack `batch`, copy it to `dev` (default: the eager device buffer) and return device views."""
        self.turn ^= 1
        if self.copied[self.turn] is not None:
            self.copied[self.turn].synchronize()  # normally long done: it is two steps old
        host = self.hosts[self.turn]
        if host.numel() < layout.nbytes:
            host = self.hosts[self.turn] = self._host(max(layout.nbytes, 2 * host.numel()))
        pack(batch, layout, host)
        if not self.pinned:
            return layout.views(host)  # CPU: the host buffer is the device buffer
        if dev is None:
            if self.dev.numel() < layout.nbytes:
                self.dev = torch.empty(max(layout.nbytes, 2 * self.dev.numel()), dtype=torch.uint8,
                                       device=self.device)
            dev = self.dev
        dev[:layout.nbytes].copy_(host[:layout.nbytes], non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self.copied[self.turn] = event
        return layout.views(dev)
