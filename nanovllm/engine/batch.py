"""The typed message from scheduler to model runner (and, under tensor parallelism, to every worker).

`StepBatch` is plain Python data (ints, floats, lists): it pickles, crosses process boundaries, and is
turned into a handful of flat device tensors by the runner in one go.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from nanovllm.engine.scheduler import SchedulerOutput
from nanovllm.engine.sequence import PLACEHOLDER


@dataclass
class SamplingBatch:
    """Sampling parameters of the step's logits rows, row by row."""
    temperatures: list[float] = field(default_factory=list)
    top_ks: list[int] = field(default_factory=list)
    top_ps: list[float] = field(default_factory=list)
    min_ps: list[float] = field(default_factory=list)
    seeds: list[int] = field(default_factory=list)
    steps: list[int] = field(default_factory=list)        # output position being sampled
    banned: list[tuple[int, int]] = field(default_factory=list)  # (row, token id) held back (min_tokens)
    logprobs: list[int | None] = field(default_factory=list)


@dataclass
class StepBatch:
    input_ids: list[int]          # (T,) tokens to compute, sequences back to back
    positions: list[int]          # (T,)
    slot_mapping: list[int]       # (T,) KV cache slot of each token
    cu_seqlens_q: list[int]       # (B + 1,)
    seq_lens: list[int]           # (B,) cached tokens per sequence after this step
    block_tables: list[list[int]]  # (B, *) ragged
    max_seqlen_q: int
    # token rows (indices into T) whose logits are computed and sampled, in order, and the sequence (index into
    # B) of each. Today one row per sampling sequence, its last; a sequence verifying k draft tokens would have
    # 1 + k consecutive rows. `sampling` has one entry per row.
    logits_indices: list[int]
    logits_seqs: list[int]
    sampling: SamplingBatch
    # the leading decode rows (see SchedulerOutput.num_decode): a mixed step's attention runs them through the
    # decode kernel and the rest through the varlen kernel; all of them: a pure decode step
    num_decode: int = 0
    # async scheduling: input_ids[placeholder_pos[i]] is row placeholder_rows[i] of the previous step's
    # sampled ids, still on the device
    placeholder_pos: list[int] = field(default_factory=list)
    placeholder_rows: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    @property
    def num_logits(self) -> int:
        return len(self.logits_indices)

    @property
    def is_decode(self) -> bool:
        """Every sequence is a decode row (one token, its last; every row is sampled)."""
        return self.num_decode == self.num_seqs > 0


def build_step_batch(out: SchedulerOutput, block_size: int) -> StepBatch:
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    cu = [0]
    seq_lens: list[int] = []
    tables: list[list[int]] = []
    logits_indices: list[int] = []
    logits_seqs: list[int] = []
    sb = SamplingBatch()
    ph_pos: list[int] = []
    ph_rows: list[int] = []
    for b, (seq, n) in enumerate(zip(out.seqs, out.num_new_tokens)):
        start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
        if seq.token_ids[end - 1] == PLACEHOLDER:  # only ever the last token, sampled by the step in flight
            ph_pos.append(len(input_ids) + n - 1)
            ph_rows.append(seq.pending_row)
        input_ids.extend(seq.token_ids[start:end])
        positions.extend(range(start, end))
        table = seq.block_table
        pos = start
        while pos < end:  # one contiguous run of slots per block
            blk, off = divmod(pos, block_size)
            run = min(end - pos, block_size - off)
            base = table[blk] * block_size + off
            slots.extend(range(base, base + run))
            pos += run
        cu.append(cu[-1] + n)
        seq_lens.append(end)
        tables.append(table)
        if end == seq.num_tokens:
            row = len(logits_indices)
            logits_indices.append(cu[-1] - 1)
            logits_seqs.append(b)
            p = seq.params
            step = seq.num_output_tokens
            sb.temperatures.append(float(p.temperature))
            sb.top_ks.append(p.top_k)
            sb.top_ps.append(float(p.top_p))
            sb.min_ps.append(float(p.min_p))
            sb.seeds.append(seq.noise_seed)
            sb.steps.append(step)
            sb.logprobs.append(p.logprobs)
            if step < p.min_tokens:
                sb.banned.extend((row, t) for t in seq.stop_ids)
    return StepBatch(input_ids=input_ids, positions=positions, slot_mapping=slots, cu_seqlens_q=cu,
                     seq_lens=seq_lens, block_tables=tables, max_seqlen_q=max(out.num_new_tokens, default=0),
                     logits_indices=logits_indices, logits_seqs=logits_seqs, sampling=sb,
                     num_decode=out.num_decode, placeholder_pos=ph_pos, placeholder_rows=ph_rows)
