"""The sampler's logits processing on the device, batched with per-row values: penalties, logit bias, allowed
and banned tokens, structured-output bitmasks. Nothing here syncs with the host, so it runs under async
scheduling (the previous step's ids never leave the device) and after a CUDA-graph replay.

Per-sequence state lives in `SlotState`, one row per slot (the engine gives each sequence that needs it a slot
when it first samples, `engine/sampling_features.py`):

    counts (C, V) int32    output-token counts: +1 at (slot, sampled id) after every step (a scatter-add)
    prompt (C, V) bool     the prompt's tokens (the repetition penalty covers prompt and output)
    bias   (C, V) float32  logit_bias, -inf outside allowed_token_ids and on one-token bad words: set up once

Each tensor is allocated when a sequence first needs it and grows (doubling) with the slots in use; a step whose
rows use none of it launches nothing here.

vLLM's formulas (`penalties_ref`): with m = prompt | (counts > 0),
    logit = logit / r if logit > 0 else logit * r    where m (r = repetition_penalty; transformers' definition)
    logit -= frequency * counts + presence * (counts > 0)
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from nanovllm.engine.batch import FeatureBatch, LateInputs


def penalties_ref(logits: torch.Tensor, counts: torch.Tensor, prompt: torch.Tensor, presence: torch.Tensor,
                  frequency: torch.Tensor, repetition: torch.Tensor) -> torch.Tensor:
    """(R, V) float32 logits, (R, V) output counts and prompt marks, (R,) penalties -> penalized logits."""
    seen = counts > 0
    r = torch.where(prompt | seen, repetition[:, None], torch.ones_like(logits))
    logits = torch.where(logits > 0, logits / r, logits * r)
    return logits - frequency[:, None] * counts - presence[:, None] * seen


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list as a device tensor without waiting for the device: on CUDA through pinned memory (a copy from
    pageable memory makes the host wait for every kernel already queued, the forward pass included; torch's caching
    host allocator keeps the pinned block until its copy is done)."""
    return torch.tensor(values, dtype=dtype, pin_memory=device.type == "cuda").to(device, non_blocking=True)


def pairs_to_device(pairs: list[tuple[int, int]], dtype: torch.dtype, device: torch.device
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, token) pairs as two device tensors (rows, tokens), in one `to_device` copy."""
    flat = to_device([r for r, _ in pairs] + [t for _, t in pairs], dtype, device)
    return flat[:len(pairs)], flat[len(pairs):]


def apply_token_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    """logits[rows[i], t] = -inf where bit t of row i of the (R, W) int32 bitmask is 0, and for every t >= 32 W
    (ids the mask does not cover: the tail of a vocabulary padded past the tokenizer's ids), in place.

    The int32 words are read as little-endian bytes: token 8 * byte + bit. The work is the constrained rows' alone
    (a gather, the mask, a scatter): a step with a few structured requests among many rows pays for those few."""
    V = logits.shape[1]
    n = min(V, bitmask.shape[1] * 32)
    b = bitmask.contiguous().view(torch.uint8)                                       # (R, W * 4)
    shifts = torch.arange(8, dtype=torch.uint8, device=logits.device)
    banned = ((b[:, :, None] >> shifts) & 1).view(b.shape[0], -1)[:, :n] == 0          # (R, n)
    sub = logits[rows]                                                               # (R, V), a copy
    sub[:, :n].masked_fill_(banned, float("-inf"))
    sub[:, n:] = float("-inf")
    logits[rows] = sub


@dataclass
class DeviceFeatures:
    """One step's feature rows on the device (from a FeatureBatch)."""
    rows: torch.Tensor          # (R,) int64 logits rows
    slots: torch.Tensor         # (R,) int64
    presence: torch.Tensor      # (R,) float32
    frequency: torch.Tensor
    repetition: torch.Tensor
    penalized: bool
    biased: bool


class SlotState:
    """Per-sequence sampler state on the device, by slot (see the module docstring)."""

    def __init__(self, vocab_size: int, device: torch.device):
        self.vocab_size = vocab_size
        self.device = device
        self.capacity = 0
        self.counts: torch.Tensor | None = None
        self.prompt: torch.Tensor | None = None
        self.bias: torch.Tensor | None = None

    def _grow(self, t: torch.Tensor | None, dtype: torch.dtype, capacity: int) -> torch.Tensor:
        new = torch.zeros(capacity, self.vocab_size, dtype=dtype, device=self.device)
        if t is not None:
            new[:t.shape[0]] = t
        return new

    def _ensure(self, max_slot: int, penalized: bool, biased: bool) -> None:
        if max_slot >= self.capacity:
            self.capacity = max(8, 2 * self.capacity, max_slot + 1)
            if self.counts is not None:
                self.counts = self._grow(self.counts, torch.int32, self.capacity)
                self.prompt = self._grow(self.prompt, torch.bool, self.capacity)
            if self.bias is not None:
                self.bias = self._grow(self.bias, torch.float32, self.capacity)
        if penalized and self.counts is None:
            self.counts = self._grow(None, torch.int32, self.capacity)
            self.prompt = self._grow(None, torch.bool, self.capacity)
        if biased and self.bias is None:
            self.bias = self._grow(None, torch.float32, self.capacity)

    def _ints(self, xs: list[int]) -> torch.Tensor:
        return to_device(xs, torch.int64, self.device)

    def prepare(self, fb: FeatureBatch) -> DeviceFeatures:
        """Set up this step's new slots and return its rows' tensors (a handful of small host-to-device copies)."""
        self._ensure(max(fb.slots), fb.penalized or any(fb.init_penalized),
                     fb.biased or any(fb.init_allow_only) or bool(fb.bias_slots))
        if fb.init_slots:
            init = self._ints(fb.init_slots)
            if self.counts is not None:
                self.counts[init] = 0
                self.prompt[init] = False
                if fb.prompt_slots:
                    self.prompt[self._ints(fb.prompt_slots), self._ints(fb.prompt_tokens)] = True
            if self.bias is not None:
                start = to_device([float("-inf") if a else 0.0 for a in fb.init_allow_only], torch.float32,
                                  self.device)
                self.bias[init] = start[:, None]
                if fb.allow_slots:
                    self.bias[self._ints(fb.allow_slots), self._ints(fb.allow_tokens)] = 0.0
                if fb.bias_slots:
                    vals = to_device(fb.bias_values, torch.float32, self.device)
                    self.bias.index_put_((self._ints(fb.bias_slots), self._ints(fb.bias_tokens)), vals,
                                         accumulate=True)
        pens = to_device([fb.presence, fb.frequency, fb.repetition], torch.float32, self.device)
        idx = self._ints(fb.rows + fb.slots)
        R = len(fb.rows)
        return DeviceFeatures(rows=idx[:R], slots=idx[R:], presence=pens[0], frequency=pens[1], repetition=pens[2],
                              penalized=fb.penalized, biased=fb.biased)

    def apply(self, logits: torch.Tensor, f: DeviceFeatures) -> None:
        """Bias, then penalties, on the feature rows of (S, V) float32 logits, in place."""
        if not (f.biased or f.penalized):
            return
        x = logits[f.rows]                                                            # (R, V)
        if f.biased:
            x = x + self.bias[f.slots]
        if f.penalized:
            x = penalties_ref(x, self.counts[f.slots], self.prompt[f.slots], f.presence, f.frequency, f.repetition)
        logits[f.rows] = x

    def record(self, f: DeviceFeatures, token_ids: torch.Tensor) -> None:
        """Count the step's sampled ids (still on the device) for the next step's penalties."""
        if self.counts is not None and f.penalized:
            ones = torch.ones_like(f.slots, dtype=torch.int32)
            self.counts.index_put_((f.slots, token_ids[f.rows]), ones, accumulate=True)


def mask_for_kernel(late: LateInputs, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """A deferred step's bitmask as the fused sampling kernel takes it (nanovllm.kernels.sample): the (R, W) words and
    the (num_logits,) int32 bitmask row of each logits row (-1: unconstrained), both copied to the device as they are
    (asynchronous: the grammar process's buffer is page-locked on CUDA)."""
    return late.bitmask.to(device, non_blocking=True), late.mask_index.to(device, non_blocking=True)


def apply_late(logits: torch.Tensor, late: LateInputs, device: torch.device, masks: bool = True) -> None:
    """A deferred step's masks (unless `masks` is False: the sampling kernel applies them, `mask_for_kernel`) and
    bans (engine-filled once the previous step's tokens were known), in place. Every copy is asynchronous (the
    bitmask is pinned on CUDA: engine/grammar_worker.py), so the host goes on to the next step while the forward
    pass runs."""
    if late.mask_index is not None and masks:
        rows = (late.mask_index >= 0).nonzero().flatten()
        if rows.numel():
            bitmask = late.bitmask[late.mask_index[rows].long()]
            if device.type == "cuda":  # (pinned: a copy from pageable memory would wait for the forward pass)
                rows, bitmask = rows.pin_memory(), bitmask.pin_memory()
            apply_token_bitmask(logits, rows.to(device, non_blocking=True), bitmask.to(device, non_blocking=True))
    if late.banned:
        rows, tokens = pairs_to_device(late.banned, torch.int64, device)
        logits[rows, tokens] = float("-inf")
