"""The typed message from scheduler to model runner (and, under tensor parallelism, to every worker).

`StepBatch` is plain Python data (ints, floats, lists): it pickles, crosses process boundaries, and is
turned into a handful of flat device tensors by the runner in one go.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from nanovllm.engine.scheduler import SchedulerOutput
from nanovllm.engine.sequence import PLACEHOLDER


@dataclass
class FeatureBatch:
    """The logits rows whose sequence keeps sampler state in a slot of the runner (penalties, logit_bias,
    allowed_token_ids, one-token bad words; `layers/logits_processing.py`), and the slots set up this step."""
    rows: list[int] = field(default_factory=list)          # logits rows
    slots: list[int] = field(default_factory=list)         # their sequence's slot
    presence: list[float] = field(default_factory=list)
    frequency: list[float] = field(default_factory=list)
    repetition: list[float] = field(default_factory=list)
    penalized: bool = False        # some row has a penalty
    biased: bool = False           # some row has a bias (logit_bias, allowed_token_ids, one-token bad words)
    # slots new this step, initialised on the device before sampling: counts zeroed and prompt tokens marked
    # (penalties); bias row zeroed, or -inf but for the allowed tokens, then the (token, bias) entries added
    init_slots: list[int] = field(default_factory=list)
    init_penalized: list[bool] = field(default_factory=list)
    init_allow_only: list[bool] = field(default_factory=list)  # allowed_token_ids: the row starts at -inf
    prompt_slots: list[int] = field(default_factory=list)      # (slot, prompt token) pairs
    prompt_tokens: list[int] = field(default_factory=list)
    allow_slots: list[int] = field(default_factory=list)       # (slot, allowed token) pairs
    allow_tokens: list[int] = field(default_factory=list)
    bias_slots: list[int] = field(default_factory=list)        # (slot, token, bias) entries; -inf bans
    bias_tokens: list[int] = field(default_factory=list)
    bias_values: list[float] = field(default_factory=list)


@dataclass
class DraftBatch:
    """Speculative decoding: the sequences of the step that verify draft tokens. Sequence i has 1 + num_drafts[i]
    consecutive logits rows from first_rows[i]: row first_rows[i] + j samples the token after draft j - 1 (after its
    last real token for j = 0), and draft j is accepted iff every draft before it was and row first_rows[i] + j
    sampled it (layers/sampler.py `accepted_drafts`)."""
    first_rows: list[int] = field(default_factory=list)
    num_drafts: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)   # (N, max num_drafts) row-major, padded with -1

    @property
    def width(self) -> int:
        return max(self.num_drafts, default=0)


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
    features: FeatureBatch | None = None  # None: no row keeps sampler state
    # some row's token mask (structured outputs) or bans (multi-token bad words) depend on the previous step's
    # tokens: the runner stops before sampling until the engine hands them over (PendingStep.sample)
    deferred: bool = False
    # the deferred rows: structured outputs' (seq_ids and logits rows, for the grammar process) and multi-token
    # bad words' (logits rows)
    grammar_sids: list[int] = field(default_factory=list)
    grammar_rows: list[int] = field(default_factory=list)
    bad_word_rows: list[int] = field(default_factory=list)
    drafts: DraftBatch | None = None  # None: no sequence verifies draft tokens


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
    # B) of each: one row per sampling sequence, its last, or 1 + k consecutive rows for a sequence verifying k
    # draft tokens (SamplingBatch.drafts). `sampling` has one entry per row.
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
    # prompt_logprobs: token rows whose next prompt token's log-probability is wanted, that token, the sequence
    # (index into B) of each row, and the most top tokens asked for
    prompt_lp_rows: list[int] = field(default_factory=list)
    prompt_lp_targets: list[int] = field(default_factory=list)
    prompt_lp_seqs: list[int] = field(default_factory=list)
    prompt_lp_k: int = 0

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


@dataclass
class LateInputs:
    """What a deferred step's sampler gets once the previous step's tokens are known: structured outputs' token
    bitmasks (xgrammar's int32 words, bit j of word w = token 32 w + j allowed) with the bitmask row of each logits
    row, and banned (row, token) pairs (multi-token bad words)."""
    bitmask: object = None          # (R, W) int32 CPU tensor, or None; ids >= 32 W are never allowed
    mask_index: object = None       # (num_logits,) int32 CPU tensor: row of `bitmask` for each logits row, -1: none
    banned: list[tuple[int, int]] = field(default_factory=list)


def _add_features(fb: FeatureBatch, row: int, seq) -> None:
    p = seq.params
    fb.rows.append(row)
    fb.slots.append(seq.sampler_slot)
    fb.presence.append(float(p.presence_penalty))
    fb.frequency.append(float(p.frequency_penalty))
    fb.repetition.append(float(p.repetition_penalty))
    fb.penalized |= p.uses_penalties
    fb.biased |= seq.static_bias is not None
    if not seq.slot_fresh:
        return
    seq.slot_fresh = False
    s = seq.sampler_slot
    fb.init_slots.append(s)
    fb.init_penalized.append(p.uses_penalties)
    fb.init_allow_only.append(p.allowed_token_ids is not None)
    if p.uses_penalties:
        prompt = sorted(set(seq.prompt_token_ids))
        fb.prompt_slots.extend([s] * len(prompt))
        fb.prompt_tokens.extend(prompt)
    if seq.static_bias is not None:
        allowed, entries = seq.static_bias
        fb.allow_slots.extend([s] * len(allowed))
        fb.allow_tokens.extend(allowed)
        fb.bias_slots.extend([s] * len(entries))
        fb.bias_tokens.extend(t for t, _ in entries)
        fb.bias_values.extend(v for _, v in entries)


def _add_draft_rows(sb: SamplingBatch, db: DraftBatch, row: int, seq, k: int) -> None:
    """Sampling parameters of the 1 + k logits rows from `row` of a sequence verifying k drafts."""
    p, n = seq.params, k + 1
    db.first_rows.append(row)
    db.num_drafts.append(k)
    sb.temperatures.extend([float(p.temperature)] * n)
    sb.top_ks.extend([p.top_k] * n)
    sb.top_ps.extend([float(p.top_p)] * n)
    sb.min_ps.extend([float(p.min_p)] * n)
    sb.seeds.extend([seq.noise_seed] * n)
    sb.steps.extend(range(seq.num_output_tokens, seq.num_output_tokens + n))
    sb.logprobs.extend([p.logprobs] * n)


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
    fb = FeatureBatch()
    db = DraftBatch()
    plp_rows: list[int] = []
    plp_targets: list[int] = []
    plp_seqs: list[int] = []
    plp_k = 0
    num_drafts = out.num_drafts or [0] * len(out.seqs)
    for b, (seq, n, k) in enumerate(zip(out.seqs, out.num_new_tokens, num_drafts)):
        start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
        real_end = end - k  # then k draft tokens
        toks, table = seq.token_ids, seq.block_table
        if toks[real_end - 1] == PLACEHOLDER:  # only ever the last token, sampled by the step in flight
            ph_pos.append(len(input_ids) + n - k - 1)
            ph_rows.append(seq.pending_row)
        if n == 1:  # one token (decode, or a prompt's last): most rows of most steps
            input_ids.append(toks[start])
            positions.append(start)
            slots.append(table[start // block_size] * block_size + start % block_size)
        else:
            input_ids.extend(toks[start:real_end])
            if k:
                input_ids.extend(seq.draft_ids[:k])
            positions.extend(range(start, end))
            pos = start
            while pos < end:  # one contiguous run of slots per block
                blk, off = divmod(pos, block_size)
                run = min(end - pos, block_size - off)
                base = table[blk] * block_size + off
                slots.extend(range(base, base + run))
                pos += run
        if seq.prompt_logprobs is not None:  # rows q predict prompt token q + 1; skip those already recorded
            first, last = max(start, len(seq.prompt_logprobs) - 1), min(end, seq.num_prompt_tokens - 1)
            if first < last:
                plp_rows.extend(range(cu[-1] + first - start, cu[-1] + last - start))
                plp_targets.extend(seq.token_ids[first + 1:last + 1])
                plp_seqs.extend([b] * (last - first))
                plp_k = max(plp_k, seq.params.prompt_logprobs)
        cu.append(cu[-1] + n)
        seq_lens.append(end)
        tables.append(table)
        if real_end == len(toks):
            row = len(logits_indices)
            p = seq.params
            step = real_end - seq.num_prompt_tokens  # (num_output_tokens)
            if not k:  # one logits row: its last token's
                logits_indices.append(cu[-1] - 1)
                logits_seqs.append(b)
                sb.temperatures.append(float(p.temperature))
                sb.top_ks.append(p.top_k)
                sb.top_ps.append(float(p.top_p))
                sb.min_ps.append(float(p.min_p))
                sb.seeds.append(seq.noise_seed)
                sb.steps.append(step)
                sb.logprobs.append(p.logprobs)
            else:  # its last real token's row, then one per draft: row j samples output position step + j
                logits_indices.extend(range(cu[-1] - 1 - k, cu[-1]))
                logits_seqs.extend([b] * (k + 1))
                _add_draft_rows(sb, db, row, seq, k)
            if step < p.min_tokens:  # stop ids held back in the rows sampling positions below min_tokens
                for j in range(min(k + 1, p.min_tokens - step)):
                    sb.banned.extend((row + j, t) for t in seq.stop_ids)
            if seq.sampler_slot is not None:
                for j in range(k + 1):
                    _add_features(fb, row + j, seq)
            if seq.grammar is not None:
                sb.grammar_sids.append(seq.seq_id)
                sb.grammar_rows.append(row)
            if seq.bad_word_ids:
                sb.bad_word_rows.append(row)
            sb.deferred |= seq.deferred_sampling
    if fb.rows:
        sb.features = fb
    if db.first_rows:
        w = db.width
        for i, k in zip(db.first_rows, db.num_drafts):
            db.tokens.extend(out.seqs[logits_seqs[i]].draft_ids[:k] + [-1] * (w - k))
        sb.drafts = db
    return StepBatch(input_ids=input_ids, positions=positions, slot_mapping=slots, cu_seqlens_q=cu,
                     seq_lens=seq_lens, block_tables=tables, max_seqlen_q=max(out.num_new_tokens, default=0),
                     logits_indices=logits_indices, logits_seqs=logits_seqs, sampling=sb,
                     num_decode=out.num_decode, placeholder_pos=ph_pos, placeholder_rows=ph_rows,
                     prompt_lp_rows=plp_rows, prompt_lp_targets=plp_targets, prompt_lp_seqs=plp_seqs,
                     prompt_lp_k=plp_k)
