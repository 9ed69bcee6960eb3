"""Fused Gumbel-max sampling: ``sample_ref`` (``nanovllm.layers.sampler``) without top-k / top-p / min-p filters.

For each row ``b`` the token is ``argmax(logits[b])`` when ``temperatures[b] <= 0`` (greedy) and otherwise
``argmax(logits[b] / T_b + G)`` with Gumbel noise ``G_v = -log(-log(U_v))``, ``U = hash_uniform(seeds, steps, V)``
(splitmix64 of ``seed * golden + step * c + v``, top 23 bits). argmax follows torch: ties go to the lowest index
and NaN counts as the maximum (the first NaN wins).

Exactness
---------
The tokens are those of the reference on the same device, not merely "close": every score that can decide the
argmax is the reference's float32 value, bit for bit:

* the hash runs in uint64 (wrapping multiplies, logical shifts), so ``U`` has the reference's bits;
* ``logits / T`` is an IEEE division (``tl.div_rn``; a plain ``/`` compiles to an approximate division);
* ``log`` is libdevice ``__nv_logf``, which is what CUDA's ``logf`` (so torch's ``log`` on CUDA) compiles to. Under
  the CPU interpreter ``tl.log`` (numpy) stands in; it can differ from torch's CPU log by an ulp.

Exact scores cost ~107 SASS instructions per logit on sm_90 (two accurate logs, a 64-bit hash, an IEEE division
with its slow-path check), which would make the kernel compute-bound at ~2.5x the time it takes to stream the
logits from HBM. So the streaming pass is a *filter* (~44 instructions per logit): it computes a cheap score
(``x * (1/T)`` and the noise from hardware ``lg2.approx``, with a series for ``-log(u)`` near ``u = 1``) within
~8.5e-6 + 2^-21.4 |score| of the exact one (see ``_score_approx``), and keeps per lane the best cheap score, its index
and the runner-up. If the chunk's best beats every other cheap score by more than ``_MARGIN_ABS + _MARGIN_REL *
(|best| + |second|)`` (over twice the sum of two error bounds), it is the exact argmax too and only its exact score is
recomputed (one element). Otherwise (near-ties, NaN, some +-inf cases; with continuous noise roughly 1e-4 of the
chunks) the program re-scores its chunk exactly. A chunk whose cheap scores are all -inf (every token banned by a
structured-output bitmask, or -inf logits) needs neither: its exact scores are -inf too. Either way the partial
(max, argmax) is exact. Greedy rows compare the raw logits.

``U`` takes the top 23 bits, so it is always in (0, 1): the noise is always finite.

Work split
----------
Each row's vocabulary is cut into ``num_chunks`` chunks of whole ``BLOCK`` tiles; program ``(b, c)`` streams chunk
``c`` of row ``b`` once (twice on the rare exact re-scoring) and writes a partial ``(max, argmax)``; a tiny second
kernel reduces the ``(B, num_chunks)`` partials (with one chunk the first kernel writes the token directly). The
chunk count depends on shapes and the device's SM count only, never on values: no host sync, CUDA-graph safe. The
tokens do not depend on it.

Vocabulary slices
-----------------
``sample_partial`` runs the same kernels on a slice of the vocabulary (one tensor-parallel rank's shard): column
``j`` is global token ``vocab_start + j``, folded into the hash base (``seed * golden + step * c + vocab_start``
wraps mod 2^64 exactly like the reference's ``+ token``), and it returns the exact per-row ``(max score, global
argmax)`` instead of the token, for the ranks to reduce (``nanovllm.layers.sampler.reduce_partials``).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from nanovllm.kernels._common import check_int, check_same_device, interpreting, next_pow2, sm_count

BLOCK = 1024            # vocabulary tile per loop iteration (8 logits per thread with 4 warps)
NUM_WARPS = 4
MAX_CHUNK = 16 * 1024   # a program streams at most ~this many logits (many short programs balance the load)
PROGRAMS_PER_SM = 4     # at least this many programs per SM overall (small batches split rows further)

# Verification margin: a cheap score is within ~8.5e-6 + 2^-21.4 |score| of the exact one (see _score_approx); the
# cheap winner must lead the runner-up by more than the sum of both bounds (1.7e-5 + ...), with room to spare.
_MARGIN_ABS = 4e-5
_MARGIN_REL = 2.0 ** -20


# ----------------------------------------------------------------------------------------------------------------
# device helpers
# ----------------------------------------------------------------------------------------------------------------

@triton.jit
def _uniform(base, offs, GPU: tl.constexpr):
    """U for tokens ``offs`` (int32, >= 0) of a row with hash base ``seed*golden + step*c`` (uint64): the bits of
    ``hash_uniform``."""
    h = base + offs.to(tl.uint32).to(tl.uint64)
    h = h ^ (h >> 30)
    h = h * 0xBF58476D1CE4E5B9
    h = h ^ (h >> 27)
    h = h * 0x94D049BB133111EB
    # splitmix64 ends with h ^= h >> 31, which leaves the top 33 bits unchanged: U uses the top 23
    top = (h >> 32).to(tl.uint32) >> 9
    if GPU:  # opaque to LLVM, which would otherwise fold the shifts into a slow 64-bit int -> float conversion
        f = tl.inline_asm_elementwise("cvt.rn.f32.u32 $0, $1;", "=r,r", [top], dtype=tl.float32, is_pure=True,
                                      pack=1)
    else:
        f = top.to(tl.float32)
    return (f + 0.5) * (1.0 / 8388608.0)  # exact, as in the reference


@triton.jit
def _gumbel_exact(u, GPU: tl.constexpr):
    """-log(-log(u)) as the reference computes it."""
    if GPU:  # __nv_logf: torch's log on CUDA (the interpreter has no libdevice)
        g = -libdevice.log(-libdevice.log(u))
    else:
        g = -tl.log(-tl.log(u))
    return g


@triton.jit
def _score_approx(x, rcp, u, GPU: tl.constexpr):
    """x / T - log(-log(u)) within ~8.5e-6 + 2^-21.4 |score| of the exact score; +inf at u = 1 like the exact one.

    With l = -log2(u) (``nlog2_u``; -log(u) = ln2 * l), the noise is -ln2 * log2(l) - ln2 * log2(ln2):
    * l for u <= 15/16: -lg2.approx(u), absolute error <= 2^-22 on [0.5, 1) (CUDA's bound for __log2f) and <= 2 ulp
      below, i.e. relative error <= 2^-22 / |log2(15/16)| ~ 2.6e-6;
    * above 15/16: the series (d + d^2/2 + ... + d^5/5) / ln2 in d = 1 - u (exact by Sterbenz; truncation
      <= d^5/6 < 1.6e-7 relative), avoiding lg2.approx's absolute (not relative) error near 1;
    * log2(l) by lg2.approx again: <= 2^-22 absolute on [0.5, 2], <= 2 ulp elsewhere.
    Over all 2^24 values of U with those worst-case errors injected, the noise is within 3.3e-6 of the true
    -log(-log(u)); the exact noise (two __nv_logf, <= 1 ulp each) is within ~2e-6 of it. x * (1/T) is within
    2^-22.4 |x/T| <= 2^-22.4 (|score| + 16) of the IEEE quotient, and the sums round once or twice more.
    """
    d = 1.0 - u
    ser = d * (1.4426950408889634 + d * (0.7213475204444817 + d * (0.48089834696298783
                                                                     + d * (0.36067376022224085
                                                                            + d * 0.28853900817779268))))
    if GPU:  # lg2.approx (the interpreter has no libdevice)
        nlog2_u = tl.where(d < 0.0625, ser, -libdevice.fast_log2f(u))
        log2_l = libdevice.fast_log2f(nlog2_u)
    else:
        nlog2_u = tl.where(d < 0.0625, ser, -tl.log2(u))
        log2_l = tl.log2(nlog2_u)
    return log2_l * -0.6931471805599453 + (x * rcp + 0.36651292058166435)  # -ln2 * log2(ln2) = 0.3665...


@triton.jit
def _better(x, best):
    """x beats the running best seen at a lower index (torch.argmax order: NaN above all, ties keep the first)."""
    return (x > best) | ((x != x) & (best == best))


@triton.jit
def _argmax_lanes(vals, idxs):
    """Reduce per-lane (best, index) to (max, lowest index of the max) with NaN as the maximum."""
    isnan = vals != vals
    any_nan = tl.max(isnan.to(tl.int32), axis=0) > 0
    m = tl.max(tl.where(isnan, float("-inf"), vals), axis=0)
    hit = tl.where(any_nan, isnan, vals == m)
    idx = tl.min(tl.where(hit, idxs, 2147483647), axis=0)
    val = tl.where(any_nan, float("nan"), m)
    return val, idx


@triton.jit
def _banned(x, offs, mrow, n_bits, constrained, HAS_MASK: tl.constexpr):
    """x with -inf where a constrained row's bitmask bans the token (bit ``offs % 32`` of word ``offs // 32`` is 0,
    or ``offs >= n_bits``: ids the mask does not cover), as ``apply_token_bitmask`` does before sampling."""
    if HAS_MASK:
        words = tl.load(mrow + (offs >> 5), mask=offs < tl.where(constrained, n_bits, 0), other=0)
        allowed = ((words >> (offs & 31)) & 1) != 0
        x = tl.where(constrained, tl.where(allowed, x, float("-inf")), x)
    return x


@triton.jit
def _greedy_tile(lrow, s, lanes, end, best, best_i, mrow, n_bits, constrained, MASKED: tl.constexpr,
                 HAS_MASK: tl.constexpr):
    offs = s + lanes
    if MASKED:
        x = tl.load(lrow + offs, mask=offs < end, other=float("-inf"), eviction_policy="evict_first").to(tl.float32)
    else:
        x = tl.load(lrow + offs, eviction_policy="evict_first").to(tl.float32)
    x = _banned(x, offs, mrow, n_bits, constrained, HAS_MASK)
    upd = _better(x, best)
    return tl.where(upd, x, best), tl.where(upd, offs, best_i)


@triton.jit
def _exact_chunk(lrow, start, end, lanes, t, base, mrow, n_bits, constrained, BLOCK: tl.constexpr,
                 GPU: tl.constexpr, HAS_MASK: tl.constexpr):
    """(exact max score, lowest argmax) over tokens [start, end) of a sampled row."""
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_i = start + lanes
    for s in range(start, end, BLOCK):
        offs = s + lanes
        mask = offs < end
        x = tl.load(lrow + offs, mask=mask, other=0.0).to(tl.float32)
        x = _banned(x, offs, mrow, n_bits, constrained, HAS_MASK)
        score = tl.div_rn(x, t) + _gumbel_exact(_uniform(base, offs, GPU), GPU)
        score = tl.where(mask, score, float("-inf"))
        upd = _better(score, best)
        best = tl.where(upd, score, best)
        best_i = tl.where(upd, offs, best_i)
    return _argmax_lanes(best, best_i)


@triton.jit
def _approx_tile(lrow, s, lanes, end, rcp, base, best, second, best_i, mrow, n_bits, constrained,
                 MASKED: tl.constexpr, GPU: tl.constexpr, HAS_MASK: tl.constexpr):
    offs = s + lanes
    if MASKED:
        mask = offs < end
        x = tl.load(lrow + offs, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
    else:
        x = tl.load(lrow + offs, eviction_policy="evict_first").to(tl.float32)
    x = _banned(x, offs, mrow, n_bits, constrained, HAS_MASK)
    a = _score_approx(x, rcp, _uniform(base, offs, GPU), GPU)
    # NaN (NaN logit, or -inf logit + inf noise) would be invisible to '>': rank it as +inf, so it wins or ties
    # (a tie at +inf fails verification and the exact pass, which knows NaN > inf, decides)
    a = tl.where(a != a, float("inf"), a)
    if MASKED:
        a = tl.where(mask, a, float("-inf"))
    upd = a > best
    second = tl.maximum(second, tl.minimum(a, best))  # runner-up of the lane: whatever is not its best
    return tl.where(upd, a, best), second, tl.where(upd, offs, best_i)


# ----------------------------------------------------------------------------------------------------------------
# kernels
# ----------------------------------------------------------------------------------------------------------------

@triton.jit(do_not_specialize=["offset"])
def _sample_chunk_kernel(
    L, TEMP, SEED, STEP, PART_V, PART_I, OUT, OUT_V, MASK, MASK_IDX, V, offset, chunk_len, mask_words,
    stride_l, stride_t, stride_seed, stride_step, stride_out, stride_out_v, margin_abs, margin_rel,
    BLOCK: tl.constexpr, SINGLE: tl.constexpr, FORCE_EXACT: tl.constexpr, GPU: tl.constexpr,
    PARTIAL: tl.constexpr, HAS_MASK: tl.constexpr,
):
    """Column j < V of row ``row`` is global token ``offset + j``: the noise and the ids written are global (the
    offset is folded into the hash base: ``seed*golden + step*c + offset + j`` wraps alike). PARTIAL also writes
    the winner's score (OUT_V). HAS_MASK: row ``row`` with ``MASK_IDX[row] >= 0`` samples only the tokens its
    bitmask row (``mask_words`` int32 words of MASK) allows."""
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    start = chunk * chunk_len
    end = tl.minimum(start + chunk_len, V)
    full_end = start + ((end - start) // BLOCK) * BLOCK  # tiles below full_end need no mask
    lrow = L + row.to(tl.int64) * stride_l
    lanes = tl.arange(0, BLOCK)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_i = start + lanes
    if HAS_MASK:
        mi = tl.load(MASK_IDX + row)
        constrained = mi >= 0
        mrow = MASK + tl.maximum(mi, 0).to(tl.int64) * mask_words
    else:
        constrained = False
        mrow = MASK
    n_bits = mask_words * 32
    t = tl.load(TEMP + row * stride_t)
    if t <= 0:  # greedy: argmax of the raw logits (a NaN temperature samples, as in the reference)
        for s in range(start, full_end, BLOCK):
            best, best_i = _greedy_tile(lrow, s, lanes, end, best, best_i, mrow, n_bits, constrained, False,
                                            HAS_MASK)
        if full_end < end:
            best, best_i = _greedy_tile(lrow, full_end, lanes, end, best, best_i, mrow, n_bits, constrained,
                                            True, HAS_MASK)
        val, idx = _argmax_lanes(best, best_i)
    else:
        seed = tl.load(SEED + row * stride_seed).to(tl.int64).to(tl.uint64, bitcast=True)
        step = tl.load(STEP + row * stride_step).to(tl.int64).to(tl.uint64, bitcast=True)
        base = seed * 0x9E3779B97F4A7C15 + step * 0xD1B54A32D192ED03
        base += offset.to(tl.int64).to(tl.uint64, bitcast=True)
        if FORCE_EXACT:
            val, idx = _exact_chunk(lrow, start, end, lanes, t, base, mrow, n_bits, constrained, BLOCK, GPU,
                                        HAS_MASK)
        else:
            # filter pass: cheap scores, per-lane best / runner-up
            rcp = tl.div_rn(1.0, t)
            second = tl.full([BLOCK], float("-inf"), tl.float32)
            for s in range(start, full_end, BLOCK):
                best, second, best_i = _approx_tile(lrow, s, lanes, end, rcp, base, best, second, best_i,
                                                    mrow, n_bits, constrained, False, GPU, HAS_MASK)
            if full_end < end:
                best, second, best_i = _approx_tile(lrow, full_end, lanes, end, rcp, base, best, second, best_i,
                                                    mrow, n_bits, constrained, True, GPU, HAS_MASK)
            m = tl.max(best, axis=0)
            w = tl.min(tl.where(best == m, best_i, 2147483647), axis=0)
            sec = tl.max(tl.where(best_i == w, second, best), axis=0)  # best of everything but the winner
            lead = (m - sec) > margin_abs + margin_rel * (tl.abs(m) + tl.abs(sec))
            ok = (m > sec) & ((sec == float("-inf")) | ((m == float("inf")) & (sec < 1e30)) | lead)
            if m == float("-inf"):  # every cheap score is -inf (banned tokens, -inf logits; the noise is finite):
                val = float("-inf")  # so is every exact one, and the first index wins, as in the exact pass
                idx = start
            elif ok:  # the cheap winner is the exact winner: recompute its exact score only
                x = tl.load(lrow + w).to(tl.float32)
                val = tl.div_rn(x, t) + _gumbel_exact(_uniform(base, w, GPU), GPU)
                idx = w
            else:  # near-tie or special values: exact scores for the whole chunk
                val, idx = _exact_chunk(lrow, start, end, lanes, t, base, mrow, n_bits, constrained, BLOCK, GPU,
                                        HAS_MASK)
    if SINGLE:
        tl.store(OUT + row * stride_out, idx.to(tl.int64) + offset)
        if PARTIAL:
            tl.store(OUT_V + row * stride_out_v, val)
    else:
        nc = tl.num_programs(1)
        tl.store(PART_V + row * nc + chunk, val)
        tl.store(PART_I + row * nc + chunk, idx)


@triton.jit(do_not_specialize=["num_chunks", "offset"])
def _sample_reduce_kernel(PART_V, PART_I, OUT, OUT_V, num_chunks, offset, stride_out, stride_out_v,
                          BLOCK_C: tl.constexpr, PARTIAL: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK_C)
    mask = offs < num_chunks
    v = tl.load(PART_V + row * num_chunks + offs, mask=mask, other=float("-inf"))
    i = tl.load(PART_I + row * num_chunks + offs, mask=mask, other=2147483647)
    val, idx = _argmax_lanes(v, i)
    tl.store(OUT + row * stride_out, idx.to(tl.int64) + offset)
    if PARTIAL:
        tl.store(OUT_V + row * stride_out_v, val)


# ----------------------------------------------------------------------------------------------------------------
# host wrapper
# ----------------------------------------------------------------------------------------------------------------

def sample_num_chunks(batch: int, vocab_size: int, device: torch.device | str = "cuda") -> int:
    """Vocabulary chunks per row, from shapes (and the SM count) only: enough programs to fill the GPU
    (>= PROGRAMS_PER_SM per SM) and none streaming more than ~MAX_CHUNK logits; whole tiles, no empty chunk."""
    n_tiles = triton.cdiv(vocab_size, BLOCK)
    want = max(triton.cdiv(PROGRAMS_PER_SM * sm_count(torch.device(device)), max(batch, 1)),
               triton.cdiv(vocab_size, MAX_CHUNK))
    per_chunk = max(1, n_tiles // want)  # rounding the chunk length down keeps >= want chunks
    return triton.cdiv(n_tiles, per_chunk)


def sample(logits: torch.Tensor, temperatures: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor,
           out: torch.Tensor | None = None, *, bitmask: torch.Tensor | None = None,
           mask_index: torch.Tensor | None = None, num_chunks: int | None = None,
           _force_exact: bool = False) -> torch.Tensor:
    """Gumbel-max sampling in one pass over the logits: the tokens of ``sample_ref`` without filters.

    Args:
        logits: (B, V) float32, bfloat16 or float16 (read as float32, which is exact: the tokens are those of
            ``sample_ref(logits.float(), ...)``); rows may be strided (e.g. a column slice) but the last dim
            must be contiguous.
        temperatures: (B,) float32; rows with T <= 0 take the argmax of the logits.
        seeds, steps: (B,) int64 (int32 is sign-extended, like ``.long()``): noise seeds and output positions.
        out: optional (B,) int64 output buffer.
        bitmask, mask_index: structured outputs' token masks, both or neither: (R, W) int32 words (bit t % 32 of
            word t // 32 set = token t allowed) and (B,) int32, the bitmask row of each logits row (-1: none). A
            masked row samples as ``sample_ref`` does after ``apply_token_bitmask`` (layers/logits_processing.py):
            banned tokens and those >= 32 W are -inf.
        num_chunks: vocabulary chunks per row (default ``sample_num_chunks(B, V)``); the tokens do not depend on
            it. ``_force_exact`` skips the filter pass (tests).
    Returns (B,) int64 token ids. CUDA-graph safe: no host sync; launch sizes and allocations depend on shapes only.
    """
    return _launch("sample", logits, temperatures, seeds, steps, out, False, None, 0, num_chunks, _force_exact,
                   bitmask, mask_index)[0]


def sample_partial(logits: torch.Tensor, temperatures: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor,
                   *, vocab_start: int = 0, out: torch.Tensor | None = None, out_scores: torch.Tensor | None = None,
                   num_chunks: int | None = None, _force_exact: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``sample`` over a slice of the vocabulary, stopped before the choice: ``sample_partial_ref``
    (``nanovllm.layers.sampler``), i.e. one rank's share of vocabulary-parallel sampling.

    Args:
        logits: (B, n), as for ``sample``: column j is global token ``vocab_start + j`` (slice a padded tail off).
        vocab_start: the global id of column 0 (>= 0): the noise and the returned ids are those of the full row.
        out, out_scores: optional (B,) int64 / float32 output buffers.
        Others as for ``sample``.
    Returns ((B,) float32 best scores, (B,) int64 global ids): per row the exact maximum of the scores ``sample``
    compares (the raw logit for greedy rows) and its first occurrence (NaN counts as the maximum).
    """
    if not isinstance(vocab_start, int) or isinstance(vocab_start, bool) or vocab_start < 0:
        raise ValueError(f"sample_partial: vocab_start must be an int >= 0, got {vocab_start!r}")
    ids, scores = _launch("sample_partial", logits, temperatures, seeds, steps, out, True, out_scores, vocab_start,
                          num_chunks, _force_exact)
    return scores, ids


def _launch(fn, logits, temperatures, seeds, steps, out, partial, out_v, offset, num_chunks, force_exact,
            bitmask=None, mask_index=None):
    """Validate and launch: the ids (+ offset) into ``out`` and, when ``partial``, the scores into ``out_v``."""
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2:
        raise ValueError(f"{fn}: logits must be a (B, V) tensor, got "
                         f"{tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__}")
    if logits.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"{fn}: logits must be float32, bfloat16 or float16, got {logits.dtype}")
    B, V = logits.shape
    if V == 0:
        raise ValueError(f"{fn}: logits have an empty vocabulary (shape {tuple(logits.shape)})")
    if offset + V >= 2**31 - 2 * BLOCK:
        raise ValueError(f"{fn}: vocabulary size {offset + V} too large (token ids are int32 inside the kernel)")
    if logits.stride(1) != 1 and V > 1:
        raise ValueError(f"{fn}: the last dim of logits must be contiguous (stride 1), got strides "
                         f"{tuple(logits.stride())} for shape {tuple(logits.shape)}; call .contiguous() first")
    for name, t in (("temperatures", temperatures), ("seeds", seeds), ("steps", steps)):
        if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.shape[0] != B:
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{fn}: {name} must be a ({B},) tensor (one per logits row), got {got}")
    if temperatures.dtype != torch.float32:
        raise ValueError(f"{fn}: temperatures must be float32, got {temperatures.dtype}")
    check_int(f"{fn}: seeds", seeds)
    check_int(f"{fn}: steps", steps)
    check_same_device(logits=logits, temperatures=temperatures, seeds=seeds, steps=steps)
    has_mask = bitmask is not None or mask_index is not None
    if has_mask:
        if bitmask is None or mask_index is None:
            raise ValueError(f"{fn}: bitmask and mask_index go together (got only "
                             f"{'bitmask' if bitmask is not None else 'mask_index'})")
        if not isinstance(bitmask, torch.Tensor) or bitmask.dim() != 2 or bitmask.dtype != torch.int32:
            got = (tuple(bitmask.shape), bitmask.dtype) if isinstance(bitmask, torch.Tensor) else type(bitmask).__name__
            raise ValueError(f"{fn}: bitmask must be an (R, W) int32 tensor, got {got}")
        if (not isinstance(mask_index, torch.Tensor) or mask_index.shape != (B,)
                or mask_index.dtype != torch.int32):
            got = (tuple(mask_index.shape), mask_index.dtype) if isinstance(mask_index, torch.Tensor) \
                else type(mask_index).__name__
            raise ValueError(f"{fn}: mask_index must be a ({B},) int32 tensor, got {got}")
        check_same_device(logits=logits, bitmask=bitmask, mask_index=mask_index)
        bitmask = bitmask.contiguous()
        mask_index = mask_index.contiguous()
    if out is None:
        out = torch.empty(B, dtype=torch.int64, device=logits.device)
    else:
        if not isinstance(out, torch.Tensor) or out.shape != (B,) or out.dtype != torch.int64:
            got = (tuple(out.shape), out.dtype) if isinstance(out, torch.Tensor) else type(out).__name__
            raise ValueError(f"{fn}: out must be a ({B},) int64 tensor, got {got}")
        check_same_device(logits=logits, out=out)
    if partial and out_v is None:
        out_v = torch.empty(B, dtype=torch.float32, device=logits.device)
    elif partial:
        if not isinstance(out_v, torch.Tensor) or out_v.shape != (B,) or out_v.dtype != torch.float32:
            got = (tuple(out_v.shape), out_v.dtype) if isinstance(out_v, torch.Tensor) else type(out_v).__name__
            raise ValueError(f"{fn}: out_scores must be a ({B},) float32 tensor, got {got}")
        check_same_device(logits=logits, out_scores=out_v)
    if B == 0:
        return out, out_v
    n_tiles = triton.cdiv(V, BLOCK)
    if num_chunks is None:
        num_chunks = sample_num_chunks(B, V, logits.device)
    num_chunks = int(num_chunks)
    if num_chunks < 1:
        raise ValueError(f"{fn}: num_chunks must be >= 1, got {num_chunks}")
    per_chunk = triton.cdiv(n_tiles, min(num_chunks, n_tiles))  # tiles per chunk
    num_chunks = triton.cdiv(n_tiles, per_chunk)                  # so that no chunk is empty
    single = num_chunks == 1
    if single:
        part_v = part_i = out  # unused
    else:
        part_v = torch.empty(B * num_chunks, dtype=torch.float32, device=logits.device)
        part_i = torch.empty(B * num_chunks, dtype=torch.int32, device=logits.device)
    ov = out_v if partial else out  # unused unless partial
    mask, mask_idx, words = (bitmask, mask_index, bitmask.shape[1]) if has_mask else (temperatures, temperatures, 0)
    _sample_chunk_kernel[(B, num_chunks)](
        logits, temperatures, seeds, steps, part_v, part_i, out, ov, mask, mask_idx, V, offset, per_chunk * BLOCK,
        words, logits.stride(0), temperatures.stride(0), seeds.stride(0), steps.stride(0), out.stride(0),
        ov.stride(0), _MARGIN_ABS, _MARGIN_REL,
        BLOCK=BLOCK, SINGLE=single, FORCE_EXACT=bool(force_exact), GPU=not interpreting(), PARTIAL=partial,
        HAS_MASK=has_mask, num_warps=NUM_WARPS,
    )
    if not single:
        _sample_reduce_kernel[(B,)](part_v, part_i, out, ov, num_chunks, offset, out.stride(0), ov.stride(0),
                                    BLOCK_C=next_pow2(triton.cdiv(V, BLOCK)), PARTIAL=partial,
                                    num_warps=1)  # one variant per V
    return out, out_v
