"""One step's inputs packed into one buffer, so a step costs one host-to-device copy.

`Layout` places every per-step array (token ids, positions, slots, block tables, sampling parameters...)
at a 16-byte aligned offset of a byte buffer; `pack` fills a (pinned) host buffer from a StepBatch; the
runner copies it to the device in one go and reads `StepInputs`, typed views of it. A CUDA graph is captured
over the views of its own fixed layout, so replaying it needs no copy beyond that one.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from itertools import chain

import numpy as np
import torch

from nanovllm.engine.batch import StepBatch


@dataclass
class StepInputs:
    """Views into one step's packed buffer (T token rows, B sequences, W block-table columns, S logits rows,
    NB banned pairs). Padding rows of a CUDA-graph layout: slot -1, sequence length 0, which every kernel skips."""
    seeds: torch.Tensor          # (S,) int64 sampling-noise seed of each logits row
    ids: torch.Tensor            # (T,) int32 token ids (placeholders: 0, see `src`)
    src: torch.Tensor            # (T,) int32 row of the previous step's sampled ids to read instead, or -1
    pos: torch.Tensor            # (T,) int32 positions
    slots: torch.Tensor          # (T,) int32 KV-cache slot of each token, -1 = padding
    cu: torch.Tensor             # (B + 1,) int32 query offsets
    cu_pre: torch.Tensor         # (B + 1,) int32 query offsets without the decode rows (mixed steps)
    seq_lens: torch.Tensor       # (B,) int32 cached tokens per sequence after the step, 0 = padding
    dec_lens: torch.Tensor       # (B,) int32 the decode rows' lengths, 0 for the others (mixed steps)
    tables: torch.Tensor         # (B * W,) int32 block tables, row-major
    logits_indices: torch.Tensor  # (S,) int32 token rows whose logits are computed
    logits_seqs: torch.Tensor    # (S,) int32 the sequence of each of those rows
    order: torch.Tensor          # (B,) int32 decode launch order: longest first, then the rest
    steps: torch.Tensor          # (S,) int32 output position being sampled
    top_ks: torch.Tensor         # (S,) int32
    banned_rows: torch.Tensor    # (NB,) int32 with banned_tokens: (row, token) pairs held back (min_tokens)
    banned_tokens: torch.Tensor  # (NB,) int32
    temps: torch.Tensor          # (S,) float32
    top_ps: torch.Tensor         # (S,) float32
    min_ps: torch.Tensor         # (S,) float32

    def block_tables(self, B: int, W: int) -> torch.Tensor:
        return self.tables.view(B, W)


_DTYPES: dict[str, torch.dtype] = {
    f.name: (torch.int64 if f.name == "seeds" else torch.float32 if f.name in ("temps", "top_ps", "min_ps")
             else torch.int32) for f in fields(StepInputs)}
_NP = {torch.int64: np.int64, torch.int32: np.int32, torch.float32: np.float32}


@dataclass(frozen=True)
class Layout:
    """Byte offsets of each array for T tokens, B sequences, W block-table columns, S logits rows and NB
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
                 "dec_lens": B, "order": B, "tables": B * W, "logits_indices": S, "logits_seqs": S, "steps": S,
                 "top_ks": S, "seeds": S, "temps": S, "top_ps": S, "min_ps": S, "banned_rows": NB,
                 "banned_tokens": NB}
        off, placed = 0, {}
        for name, dtype in _DTYPES.items():
            n = sizes[name]
            placed[name] = (dtype, off, n)
            off += -(-n * dtype.itemsize // 16) * 16
        return cls(T, B, W, S, NB, placed, max(off, 16))

    def views(self, buf: torch.Tensor) -> StepInputs:
        """Typed views of a uint8 buffer laid out like this."""
        return StepInputs(**{name: buf[off:off + n * dtype.itemsize].view(dtype)
                             for name, (dtype, off, n) in self.fields.items()})


def pack(batch: StepBatch, layout: Layout, host: torch.Tensor) -> None:
    """Write `batch` into the uint8 `host` buffer per `layout`.

    The layout may be larger than the batch (a CUDA-graph size): the extra rows become padding (slot -1,
    sequence length 0) that every kernel skips."""
    raw = host.numpy()
    arr = {name: raw[off:off + n * dtype.itemsize].view(_NP[dtype])
           for name, (dtype, off, n) in layout.fields.items()}
    T, B, S = batch.num_tokens, batch.num_seqs, batch.num_logits
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
    cu[B + 1:] = batch.cu_seqlens_q[-1]
    arr["seq_lens"][:B] = batch.seq_lens
    arr["seq_lens"][B:] = 0
    nd = batch.num_decode  # the leading decode rows
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
    tables = arr["tables"]
    tables[:] = 0  # columns past a sequence's last block are never used, but must be valid block ids
    if B:  # the ragged tables in one assignment: entry j of row i goes to i * W + j
        lens = np.fromiter(map(len, batch.block_tables), dtype=np.int64, count=B)
        flat = np.fromiter(chain.from_iterable(batch.block_tables), dtype=np.int32, count=int(lens.sum()))
        row_base = np.arange(B) * layout.W - (np.cumsum(lens) - lens)  # row start minus its entries' flat start
        tables[np.arange(flat.size) + np.repeat(row_base, lens)] = flat
    arr["logits_indices"][:S] = batch.logits_indices
    arr["logits_indices"][S:] = 0  # a graph's padded rows gather row 0 (valid, unused)
    arr["logits_seqs"][:S] = batch.logits_seqs
    arr["logits_seqs"][S:] = 0
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

    def upload(self, batch: StepBatch, layout: Layout, dev: torch.Tensor | None = None) -> StepInputs:
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
