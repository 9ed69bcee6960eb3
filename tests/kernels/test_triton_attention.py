"""Triton paged attention (prefill/mixed and decode) against paged_attention_ref."""
import pytest
import torch
import triton
import triton.language as tl

from nanovllm.attention.torch_ref import paged_attention_ref
from nanovllm.kernels.decode_attention import (
    LONG_CONTEXT_TOKENS,
    decode_long_splits,
    decode_num_splits,
    decode_workspace_numel,
    paged_decode_attention,
)
from nanovllm.kernels.prefill_attention import _sorted_tile, paged_prefill_attention
from nanovllm.kernels.prefill_config import TileConfig

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5),
       torch.float16: dict(atol=5e-3, rtol=5e-3),
       # the CPU interpreter truncates fp32 -> bf16 instead of rounding; allow ~2 bf16 ulps
       torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}


def make_batch(specs, H, Hkv, D, block_size, dtype, device, seed=0, extra_cols=2, strided=False):
    """specs: list of (seq_len, q_len). Returns kernel inputs plus NaN-free copies of the caches for the ref.

    Blocks are handed out in random order; every cache slot that no sequence owns (the tail of each last block
    and unused blocks) holds NaN, so a kernel that reads past seq_len produces NaN.
    """
    g = torch.Generator().manual_seed(seed)
    nblk = [-(-s // block_size) for s, _ in specs]
    num_blocks = sum(nblk) + 3
    perm = torch.randperm(num_blocks, generator=g)
    max_blocks = max(nblk + [1]) + extra_cols
    bt = torch.full((len(specs), max_blocks + 3), -1, dtype=torch.int32)
    k_cache = torch.full((num_blocks, block_size, Hkv, D), float("nan"))
    v_cache = torch.full_like(k_cache, float("nan"))
    i = 0
    for b, (s, _) in enumerate(specs):
        bt[b, :nblk[b]] = perm[i:i + nblk[b]]
        i += nblk[b]
        for j in range(nblk[b]):
            n = min(block_size, s - j * block_size)
            k_cache[bt[b, j], :n] = torch.randn(n, Hkv, D, generator=g)
            v_cache[bt[b, j], :n] = torch.randn(n, Hkv, D, generator=g)
    # strided views are taken on the device: .to(device) of a non-dense view makes a contiguous copy
    bt = bt.to(device)
    bt = bt[:, :max_blocks] if strided else bt[:, :max_blocks].contiguous()
    q_lens = torch.tensor([ql for _, ql in specs])
    cu = torch.zeros(len(specs) + 1, dtype=torch.int32)
    cu[1:] = q_lens.cumsum(0)
    T = int(cu[-1])
    if strided:  # q as the leading slice of a fused qkv projection
        q = torch.randn(T, H + 2 * Hkv, D, generator=g).to(device=device, dtype=dtype)[:, :H]
    else:
        q = torch.randn(T, H, D, generator=g).to(device=device, dtype=dtype)
    seq_lens = torch.tensor([s for s, _ in specs], dtype=torch.int32)
    to = lambda t: t.to(device)  # noqa: E731
    k_cache, v_cache = (to(t.to(dtype)) for t in (k_cache, v_cache))
    return dict(q=q, k_cache=k_cache, v_cache=v_cache, cu_seqlens_q=to(cu), seq_lens=to(seq_lens),
                block_tables=bt, max_seqlen_q=int(q_lens.max()) if len(specs) else 0)


def reference(batch, scale):
    return paged_attention_ref(batch["q"], batch["k_cache"].nan_to_num(0.0), batch["v_cache"].nan_to_num(0.0),
                               batch["cu_seqlens_q"], batch["seq_lens"], batch["block_tables"], scale,
                               batch["max_seqlen_q"])


def run_prefill(batch, scale, config=None, persistent=False):
    out = torch.full_like(batch["q"], float("nan"))
    res = paged_prefill_attention(batch["q"], batch["k_cache"], batch["v_cache"], batch["cu_seqlens_q"],
                                  batch["seq_lens"], batch["block_tables"], scale, batch["max_seqlen_q"], out=out,
                                  config=config, persistent=persistent)
    assert res is out
    return out


# (seq_len, q_len): long prefill, decode, chunked prefill over a cached prefix, padding, exact block multiple,
# short tail chunk of a long context, a chunk starting just below a KV-tile boundary
MIXED = [(37, 37), (50, 1), (70, 20), (0, 1), (32, 32), (130, 3), (72, 10)]


@pytest.mark.parametrize("block_size,H,Hkv,D,dtype", [
    (16, 2, 2, 64, torch.float32),    # MHA, per-key block lookup (block_size < BLOCK_N)
    (32, 4, 2, 32, torch.float32),    # GQA 2
    (64, 8, 2, 16, torch.float32),    # GQA 4, one block per KV tile
    (48, 6, 2, 32, torch.float32),    # GQA 3 (padded heads), block_size not a power of two
    (16, 8, 2, 128, torch.float16),
    (32, 4, 1, 64, torch.bfloat16),   # MQA-style GQA 4
])
def test_prefill_mixed_batch(device, block_size, H, Hkv, D, dtype):
    batch = make_batch(MIXED, H, Hkv, D, block_size, dtype, device, seed=block_size + D)
    scale = D ** -0.5
    out = run_prefill(batch, scale)
    ref = reference(batch, scale)
    assert not out.isnan().any()
    torch.testing.assert_close(out, ref, **TOL[dtype])
    pad = batch["cu_seqlens_q"][3]
    assert (out[pad] == 0).all()  # seq_len 0 -> zeros


@pytest.mark.parametrize("persistent", [False, True])
def test_prefill_more_sequences_than_one_lookup_block(device, persistent):
    """More sequences than the kernel's tile -> sequence search handles at once (it loops; the persistent grid's
    tile numbering carries across those blocks)."""
    from nanovllm.kernels.prefill_attention import _PREFILL_BLOCK_B
    n = _PREFILL_BLOCK_B + 9
    specs = [(3 + i % 5, 1 + i % 2) for i in range(n)]
    batch = make_batch(specs, 2, 1, 16, 16, torch.float32, device, seed=11)
    out = paged_prefill_attention(batch["q"], batch["k_cache"], batch["v_cache"], batch["cu_seqlens_q"],
                                  batch["seq_lens"], batch["block_tables"], 0.25, batch["max_seqlen_q"],
                                  persistent=persistent)
    torch.testing.assert_close(out, reference(batch, 0.25), **TOL[torch.float32])


def test_prefill_strided_inputs_and_long_sequence(device):
    # q is a view of a fused qkv tensor, block_tables is a column slice; one sequence spans several KV tiles
    # with a multi-tile query block, the other is a single long-context decode.
    specs = [(200, 150), (300, 1)]
    batch = make_batch(specs, 4, 2, 32, 16, torch.float32, device, seed=7, strided=True)
    assert not batch["q"].is_contiguous() and not batch["block_tables"].is_contiguous()
    out = run_prefill(batch, 0.2)
    torch.testing.assert_close(out, reference(batch, 0.2), **TOL[torch.float32])


def test_prefill_decode_only_batch_matches_decode_kernel(device):
    specs = [(1, 1), (17, 1), (0, 1), (96, 1)]
    batch = make_batch(specs, 4, 2, 32, 16, torch.float32, device, seed=3)
    ref = reference(batch, 0.3)
    torch.testing.assert_close(run_prefill(batch, 0.3), ref, **TOL[torch.float32])
    dec = paged_decode_attention(batch["q"], batch["k_cache"], batch["v_cache"], batch["seq_lens"],
                                 batch["block_tables"], 0.3)
    torch.testing.assert_close(dec, ref, **TOL[torch.float32])


def test_prefill_leading_rows_without_sequence(device):
    """cu_seqlens_q[0] > 0 and zero-length sequences in front (the varlen half of a mixed step, whose first
    rows belong to the decode kernel): the rows before cu[0] stay untouched, however many query tiles they span
    (the programs that cover them find no sequence), and the sequences after them are exact."""
    specs = [(40, 1)] * 70 + [(90, 50), (33, 7)]          # 70 one-token rows (> two query tiles), then chunks
    batch = make_batch(specs, 4, 1, 32, 16, torch.float32, device, seed=5)
    ref = reference(batch, 0.3)
    cu = batch["cu_seqlens_q"].clone()
    cu[:71] = 70                                           # sequences 0..69: no queries
    out = torch.full_like(batch["q"], float("nan"))
    paged_prefill_attention(batch["q"], batch["k_cache"], batch["v_cache"], cu, batch["seq_lens"],
                            batch["block_tables"], 0.3, batch["max_seqlen_q"], out=out)
    assert out[:70].isnan().all()
    torch.testing.assert_close(out[70:], ref[70:], **TOL[torch.float32])


@pytest.mark.parametrize("block_size,H,Hkv,D,dtype", [
    (16, 8, 2, 32, torch.float32),    # GQA 4, per-key block lookup
    (64, 6, 2, 16, torch.float32),    # GQA 3 (padded heads), one block per KV tile
    (32, 4, 1, 64, torch.bfloat16),
])
def test_prefill_persistent_grid_matches_reference(device, monkeypatch, block_size, H, Hkv, D, dtype):
    """The persistent grid (a fixed number of programs looping over exactly numbered query tiles): short chunks
    over long prefixes, a fresh prompt, padding (seq_len 0) and leading sequences without queries (a mixed step's
    decode rows), with more tiles than programs. Rows outside cu[0]..cu[-1] stay untouched, the rest matches the
    reference and the one-program-per-tile grid."""
    from nanovllm.kernels import prefill_attention as attention
    specs = [(40, 1)] * 3 + [(300, 37), (96, 96), (0, 1), (133, 5), (70, 20)]
    batch = make_batch(specs, H, Hkv, D, block_size, dtype, device, seed=D + block_size)
    ref = reference(batch, D ** -0.5)
    cu = batch["cu_seqlens_q"].clone()
    cu[:4] = 3                                             # the three one-token rows: no sequence's queries
    args = (batch["q"], batch["k_cache"], batch["v_cache"], cu, batch["seq_lens"], batch["block_tables"], D ** -0.5,
            batch["max_seqlen_q"])
    tiles = torch.full_like(batch["q"], float("nan"))
    paged_prefill_attention(*args, out=tiles)                  # one program per possible tile
    out = torch.full_like(batch["q"], float("nan"))
    monkeypatch.setattr(attention, "sm_count", lambda _device: 2)  # 2-4 programs per KV head for its 8-13 tiles:
    res = paged_prefill_attention(*args, out=out, persistent=True)  # every program loops over several tiles
    assert res is out
    assert out[:3].isnan().all()
    assert not out[3:].isnan().any()
    torch.testing.assert_close(out[3:], ref[3:], **TOL[dtype])
    assert (out[3 + 37 + 96] == 0).all()  # seq_len 0 -> zeros
    torch.testing.assert_close(out[3:], tiles[3:], **TOL[dtype])


def test_prefill_defaults_allocate_output(device):
    batch = make_batch([(20, 5)], 2, 1, 16, 16, torch.float32, device, seed=11)
    out = paged_prefill_attention(batch["q"], batch["k_cache"], batch["v_cache"], batch["cu_seqlens_q"],
                                  batch["seq_lens"], batch["block_tables"], 0.25, batch["max_seqlen_q"])
    torch.testing.assert_close(out, reference(batch, 0.25), **TOL[torch.float32])


DECODE = [(1, 1), (37, 1), (0, 1), (300, 1), (64, 1)]


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("block_size,H,Hkv,D,dtype", [
    (16, 2, 2, 64, torch.float32),
    (32, 4, 2, 32, torch.float32),
    (64, 8, 2, 16, torch.float32),
    (256, 4, 1, 32, torch.float32),
    (16, 8, 2, 128, torch.float16),
    (32, 4, 1, 64, torch.bfloat16),
])
def test_decode(device, block_size, H, Hkv, D, dtype, num_splits):
    batch = make_batch(DECODE, H, Hkv, D, block_size, dtype, device, seed=block_size * 3 + D)
    scale = D ** -0.5
    q = batch["q"]
    out = torch.full_like(q, float("nan"))
    res = paged_decode_attention(q, batch["k_cache"], batch["v_cache"], batch["seq_lens"], batch["block_tables"],
                                 scale, out=out, num_splits=num_splits)
    assert res is out
    assert not out.isnan().any()
    torch.testing.assert_close(out, reference(batch, scale), **TOL[dtype])
    assert (out[2] == 0).all()


def test_decode_split_counts_share_one_variant(device, monkeypatch):
    """The KV split count is a runtime argument: every count > 1 launches the decode and reduce kernels with the
    same compile-time options (a graph capture over many batch sizes, each with its own count, compiles one split
    variant instead of one per count: cold start-up, benchmarks/RESULTS.md run 19), and each count is exact,
    also past the reduce kernel's padded width (40 > 32)."""
    from nanovllm.kernels import decode_attention as attention

    launches = []

    class Spy:
        def __init__(self, name, fn):
            self.name, self.fn = name, fn

        def __getitem__(self, grid):
            def launch(*args, **kw):
                launches.append((self.name, tuple(sorted(kw.items()))))
                return self.fn[grid](*args, **kw)
            return launch
    for name in ("_decode_kernel", "_decode_reduce_kernel"):
        fn = getattr(attention, name)
        monkeypatch.setattr(attention, name, Spy(name, fn))
        params = getattr(fn, "params", None)  # a compiled (not interpreted) kernel: the count is not specialized
        if params is not None:
            assert "num_splits" in {p.name for p in params if p.do_not_specialize}
    batch = make_batch([(700, 1), (1, 1), (0, 1), (333, 1)], 4, 2, 32, 16, torch.float32, device, seed=5)
    args = (batch["q"], batch["k_cache"], batch["v_cache"], batch["seq_lens"], batch["block_tables"], 0.3)
    ref = reference(batch, 0.3)
    options = {}
    for splits in (2, 5, 16, 40):
        launches.clear()
        torch.testing.assert_close(paged_decode_attention(*args, num_splits=splits), ref, **TOL[torch.float32])
        for name, kw in launches:
            options.setdefault(name, set()).add(kw)
    assert {name: len(kws) for name, kws in options.items()} == {"_decode_kernel": 1, "_decode_reduce_kernel": 2}
    # (the reduce kernel's width is padded to 32 up to 32 splits: 40 needs the next power of two)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_launch_order(device, num_splits):
    # a launch order (longest first, as the engine passes it) changes which program takes which sequence,
    # never the result: bit-identical to batch order
    batch = make_batch(DECODE, 4, 2, 32, 16, torch.float32, device, seed=21)
    args = (batch["q"], batch["k_cache"], batch["v_cache"], batch["seq_lens"], batch["block_tables"], 0.4)
    plain = paged_decode_attention(*args, num_splits=num_splits)
    order = torch.argsort(batch["seq_lens"].cpu(), descending=True, stable=True).to(torch.int32)
    assert not torch.equal(order, torch.arange(len(order), dtype=torch.int32))
    out = paged_decode_attention(*args, num_splits=num_splits, order=order.to(batch["q"].device))
    assert torch.equal(out, plain)
    torch.testing.assert_close(out, reference(batch, 0.4), **TOL[torch.float32])
    with pytest.raises(ValueError, match="order"):
        paged_decode_attention(*args, order=order[:-1].to(batch["q"].device))
    with pytest.raises(ValueError, match="order"):
        paged_decode_attention(*args, order=order.float().to(batch["q"].device))


@pytest.mark.parametrize("launch", [(16, 2, 2), (32, 1, 1), (64, 8, 3)])
def test_decode_launch_override(device, launch):
    # a (BLOCK_N, num_warps, num_stages) launch from a benchmark's sweep changes the tiling, not the result;
    # anything else is a ValueError naming it
    batch = make_batch(DECODE, 4, 2, 32, 16, torch.float32, device, seed=8)
    args = (batch["q"], batch["k_cache"], batch["v_cache"], batch["seq_lens"], batch["block_tables"], 0.3)
    torch.testing.assert_close(paged_decode_attention(*args, launch=launch), reference(batch, 0.3),
                               **TOL[torch.float32])
    for bad in [(24, 4, 2), (64, 3, 2), (64, 4, 0)]:
        with pytest.raises(ValueError, match="launch"):
            paged_decode_attention(*args, launch=bad)


def test_decode_many_splits_and_workspace(device):
    # more splits than some sequences have tiles (empty splits), a caller-provided (oversized) workspace
    batch = make_batch(DECODE, 4, 2, 32, 16, torch.float32, device, seed=5, strided=True)
    B, H, D = batch["q"].shape
    ws = torch.full((decode_workspace_numel(B + 2, H, D, 8),), float("nan"), device=device)
    out = paged_decode_attention(batch["q"], batch["k_cache"], batch["v_cache"], batch["seq_lens"],
                                 batch["block_tables"], 0.2, num_splits=8, workspace=ws)
    torch.testing.assert_close(out, reference(batch, 0.2), **TOL[torch.float32])
    with pytest.raises(ValueError, match="workspace"):
        paged_decode_attention(batch["q"], batch["k_cache"], batch["v_cache"], batch["seq_lens"],
                               batch["block_tables"], 0.2, num_splits=8, workspace=ws[:10])


def test_decode_auto_split_path(device):
    # small batch, long static context -> the heuristic splits; result must not depend on it
    batch = make_batch([(200, 1), (0, 1)], 2, 1, 16, 16, torch.float32, device, seed=9, extra_cols=40)
    assert decode_num_splits(2, 1, batch["block_tables"].shape[1], 16, batch["q"].device) > 1
    out = paged_decode_attention(batch["q"], batch["k_cache"], batch["v_cache"], batch["seq_lens"],
                                 batch["block_tables"], 0.5)
    torch.testing.assert_close(out, reference(batch, 0.5), **TOL[torch.float32])


def test_decode_num_splits_heuristic():
    cpu = torch.device("cpu")
    assert decode_num_splits(256, 8, 512, 16, cpu) == 1          # big batch fills the GPU
    assert decode_num_splits(1, 8, 2048, 16, cpu) > 1            # one long sequence: split
    assert decode_num_splits(1, 8, 4, 16, cpu) == 1              # short context: never split
    assert decode_num_splits(1, 1, 100000, 16, cpu) <= 32


def test_decode_long_splits_rule():
    """Long contexts split a batch of up to four waves of programs in four (a graph per choice), where the default
    would split less; a full batch, a model length no longer than the long-context mean, or a batch the default
    already splits as much keep the default (None)."""
    cpu = torch.device("cpu")  # (132 SMs)
    assert LONG_CONTEXT_TOKENS == 4096
    assert decode_num_splits(64, 8, 33, 256, cpu) == 1 and decode_long_splits(64, 8, 33, 256, cpu) == 4
    assert decode_num_splits(32, 8, 33, 256, cpu) == 2 and decode_long_splits(32, 8, 33, 256, cpu) == 4
    assert decode_long_splits(66, 8, 33, 256, cpu) == 4 and decode_long_splits(67, 8, 33, 256, cpu) is None
    assert decode_long_splits(256, 8, 33, 256, cpu) is None    # 2,048 programs: the tail is short
    assert decode_long_splits(64, 8, 16, 256, cpu) is None     # max_model_len 4,096: no mean context above it
    assert decode_long_splits(8, 8, 33, 256, cpu) is None      # the default splits in 5 already


@pytest.mark.parametrize("splits", [None, 4])
def test_backend_decode_step_takes_the_metadata_splits(device, monkeypatch, splits):
    """A decode step's metadata carries the KV splits (a decode graph's choice) to the decode kernel, None its
    default; the result is the reference's either way."""
    from nanovllm.attention.backend import AttentionMetadata, TritonAttentionBackend
    batch = make_batch(DECODE, 4, 2, 32, 16, torch.float32, device, seed=5)
    seen = []
    real = paged_decode_attention

    def spy(*args, **kw):
        seen.append(kw["num_splits"])
        return real(*args, **kw)
    be = TritonAttentionBackend()
    monkeypatch.setattr(be.k, "paged_decode_attention", spy)
    T = batch["q"].shape[0]
    meta = AttentionMetadata(torch.full((T,), -1, dtype=torch.int32, device=device), batch["cu_seqlens_q"],
                             batch["seq_lens"], batch["block_tables"], 1, is_decode=True, decode_splits=splits)
    out = be.attend(batch["q"], batch["k_cache"], batch["v_cache"], meta, 0.3)
    assert seen == [splits]
    torch.testing.assert_close(out, reference(batch, 0.3), **TOL[torch.float32])


def test_argument_checks(device):
    batch = make_batch([(20, 5)], 4, 2, 32, 16, torch.float32, device)
    args = (batch["cu_seqlens_q"], batch["seq_lens"], batch["block_tables"], 0.1, 5)
    with pytest.raises(ValueError, match="multiple"):
        paged_prefill_attention(batch["q"][:, :3], batch["k_cache"], batch["v_cache"], *args)
    with pytest.raises(ValueError, match="dtype"):
        paged_prefill_attention(batch["q"].half(), batch["k_cache"], batch["v_cache"], *args)
    with pytest.raises(ValueError, match="contiguous"):
        paged_prefill_attention(batch["q"].transpose(1, 2).contiguous().transpose(1, 2), batch["k_cache"],
                                batch["v_cache"], *args)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_skip_empty_leaves_rows_untouched(device, num_splits):
    batch = make_batch(DECODE, 4, 2, 32, 16, torch.float32, device, seed=4)
    out = torch.full_like(batch["q"], float("nan"))
    paged_decode_attention(batch["q"], batch["k_cache"], batch["v_cache"], batch["seq_lens"], batch["block_tables"],
                           0.3, out=out, num_splits=num_splits, skip_empty=True)
    empty = batch["seq_lens"] == 0
    assert empty.any() and out[empty].isnan().all()
    torch.testing.assert_close(out[~empty], reference(batch, 0.3)[~empty], **TOL[torch.float32])


@pytest.mark.parametrize("splits", [1, 3])
def test_backend_mixed_step_split(device, splits):
    """The Triton backend's mixed step: the leading one-token sequences through the decode kernel (decode_lens),
    the rest through the varlen kernel (prefill_cu: no queries for the one-token ones), empty padding sequences
    at the end as in a CUDA graph. Equal to the reference over the whole batch."""
    from nanovllm.attention.backend import AttentionMetadata, TritonAttentionBackend
    specs = [(40, 1), (300, 1), (17, 1), (1, 1), (90, 50), (33, 7), (130, 1), (0, 0), (0, 0)]
    nd = 4
    batch = make_batch(specs, 4, 2, 32, 16, torch.float32, device, seed=9, strided=True)
    dec_lens = batch["seq_lens"].clone()
    dec_lens[nd:] = 0
    prefill_cu = batch["cu_seqlens_q"].clone()
    prefill_cu[:nd + 1] = nd
    T = batch["q"].shape[0]
    meta = AttentionMetadata(torch.full((T,), -1, dtype=torch.int32, device=device), batch["cu_seqlens_q"],
                             batch["seq_lens"], batch["block_tables"], batch["max_seqlen_q"], is_decode=False,
                             decode_lens=dec_lens, prefill_cu=prefill_cu, decode_splits=splits)
    out = TritonAttentionBackend().attend(batch["q"], batch["k_cache"], batch["v_cache"], meta, 0.3)
    torch.testing.assert_close(out, reference(batch, 0.3), **TOL[torch.float32])


# --- the varlen kernel's variants (prefill_config.TileConfig) ---------------------------------------------------
# (seq_len, q_len): padding with and without a query, first and later decode rows, a fresh prompt over several
# tiles, a chunk starting mid-block over a cached prefix (47 % 32 = 15), one starting on a block (and tile)
# boundary, a short tail chunk, the second chunk of a prompt longer than one chunk (31 tokens cached)
VARIANT_SPECS = [(0, 1), (1, 1), (45, 1), (40, 40), (70, 23), (96, 32), (0, 0), (33, 17), (81, 50)]
VARIANTS = [TileConfig(bm, bn, 4, st, tma=tma, pack_gqa=pack, order=order)
            for bm, bn, st, tma, pack, order in [
                (16, 16, 1, False, True, "natural"),
                (32, 16, 2, False, True, "reverse"),
                (32, 32, 2, False, False, "sorted"),
                (16, 32, 3, True, True, "sorted"),
                (32, 16, 2, True, False, "reverse"),
                (64, 32, 2, True, True, "natural"),
            ]]


@pytest.mark.parametrize("config", VARIANTS, ids=lambda c: c.name)
def test_prefill_variants_match_reference(device, config, monkeypatch):
    """Every kind of variant (tile shapes, stages, pointer or TMA K/V loads, packed or one head per program, the
    three launch orders) on the boundaries of causal block skipping: the unmasked loop's end falls before, on and
    after KV-tile and block boundaries; chunks over cached prefixes; padding and decode rows. The TMA path is
    taken exactly when the config asks (block_size 32 is a multiple of every block_n here)."""
    batch = make_batch(VARIANT_SPECS, 4, 2, 32, 32, torch.float32, device, seed=config.block_m + config.block_n)
    check_variant(monkeypatch, config, lambda: run_prefill(batch, 0.3, config), reference(batch, 0.3))


def check_variant(monkeypatch, config, run, ref):
    """`run()`, a varlen prefill with `config` over VARIANT_SPECS, with the TMA descriptors watched: it takes the
    TMA path exactly when the config asks, writes no NaN, matches `ref` and gives the seq_len-0 row zeros.
    Returns its output."""
    from nanovllm.kernels import prefill_attention as attention
    used = []
    real = attention._kv_descriptors
    monkeypatch.setattr(attention, "_kv_descriptors", lambda *a: used.append(real(*a)) or used[-1])
    out = run()
    assert (used[0] is not None) == config.tma
    assert not out.isnan().any()
    torch.testing.assert_close(out, ref, **TOL[torch.float32])
    assert (out[0] == 0).all()  # seq_len 0 -> zeros
    return out


@pytest.mark.parametrize("H,Hkv,D,dtype", [
    (4, 4, 16, torch.float32),      # G 1
    (6, 2, 32, torch.float32),      # G 3 (padded to 4)
    (8, 4, 32, torch.bfloat16),     # G 2
    (8, 2, 64, torch.float16),      # G 4, head_dim 64
    (8, 1, 128, torch.bfloat16),    # G 8, head_dim 128
])
@pytest.mark.parametrize("pack", [True, False], ids=["pack", "nopack"])
def test_prefill_gqa_groups_dtypes_head_dims(device, H, Hkv, D, dtype, pack):
    """GQA groups 1/2/3/4/8 packed along M or one query head per program, head_dim 16-128, the three dtypes,
    through TMA tiles of 64 rows (two physical blocks per tile would not be TMA: block_size 64 here)."""
    specs = [(70, 23), (1, 1), (40, 40), (0, 0), (130, 64)]
    batch = make_batch(specs, H, Hkv, D, 64, dtype, device, seed=H * D + Hkv)
    cfg = TileConfig(64, 32, 4, 2, tma=True, pack_gqa=pack, order="sorted")
    out = run_prefill(batch, D ** -0.5, cfg)
    torch.testing.assert_close(out, reference(batch, D ** -0.5), **TOL[dtype])


@pytest.mark.parametrize("config", [TileConfig(32, 16, 4, 2, tma=True, order="sorted"),
                                    TileConfig(16, 32, 4, 2, pack_gqa=False)], ids=lambda c: c.name)
def test_prefill_variants_on_the_persistent_grid(device, monkeypatch, config):
    """The persistent grid (mixed-step CUDA graphs) with the variants' loads and head slots: leading rows that
    belong to no sequence stay untouched, fewer programs than tiles, results as on the one-program-per-tile grid
    (whose launch order the persistent grid ignores)."""
    from nanovllm.kernels import prefill_attention as attention
    specs = [(40, 1)] * 3 + [(100, 37), (48, 48), (0, 1), (70, 5), (50, 20)]
    batch = make_batch(specs, 4, 2, 16, 32, torch.float32, device, seed=17)
    cu = batch["cu_seqlens_q"].clone()
    cu[:4] = 3
    args = (batch["q"], batch["k_cache"], batch["v_cache"], cu, batch["seq_lens"], batch["block_tables"], 0.25,
            batch["max_seqlen_q"])
    tiles = paged_prefill_attention(*args, out=torch.full_like(batch["q"], float("nan")), config=config)
    monkeypatch.setattr(attention, "sm_count", lambda _device: 2)
    out = paged_prefill_attention(*args, out=torch.full_like(batch["q"], float("nan")), persistent=True,
                                  config=config)
    assert out[:3].isnan().all() and tiles[:3].isnan().all()
    torch.testing.assert_close(out[3:], reference(batch, 0.25)[3:], **TOL[torch.float32])
    assert torch.equal(out[3:], tiles[3:])


def test_prefill_launch_orders_are_bit_identical(device):
    """A launch order moves tiles between programs, never changes a tile's arithmetic."""
    batch = make_batch([(70, 23), (96, 32), (0, 1), (81, 50)], 4, 2, 16, 32, torch.float32, device, seed=2)
    outs = [run_prefill(batch, 0.3, TileConfig(32, 16, 4, 2, order=o)) for o in ("natural", "reverse", "sorted")]
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


@triton.jit
def _sorted_tiles_kernel(CU, SEQ_LENS, OUT, num_seqs, BLOCK_Q: tl.constexpr, BLOCK_B: tl.constexpr):
    """(sequence, tile) of every rank of the "sorted" launch order."""
    r = tl.program_id(0)
    b, qb = _sorted_tile(CU, SEQ_LENS, num_seqs, r, BLOCK_Q, BLOCK_B)
    tl.store(OUT + 2 * r, b)
    tl.store(OUT + 2 * r + 1, qb)


@pytest.mark.parametrize("block_b", [4, 16])
def test_sorted_order_is_heaviest_first(device, block_b):
    """The "sorted" order's rank -> tile map, against a sort on the host: every tile once, by level (keys read,
    in units of BLOCK_Q, counted from each sequence's end) descending, ties by sequence; ranks past the last tile
    get no sequence. Sequences: a long chunk over a prefix, short prompts, decode rows, sequences without
    queries (a mixed step's decode rows in prefill_cu), padding; with block_b 4 the search loops over blocks."""
    specs = [(300, 37), (8, 8), (0, 0), (45, 1), (130, 64), (50, 0), (17, 17), (0, 1), (64, 64), (9, 3)]
    q_lens = [q for _, q in specs]
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    seq_lens = torch.tensor([s for s, _ in specs], dtype=torch.int32)
    BQ = 8
    want = []
    for b, (s, q) in enumerate(specs):
        n = -(-q // BQ)
        top = max(-(-s // BQ), n)
        want += [(-(top - (n - 1 - j)), b, j) for j in range(n)]
    want = [(b, j) for _, b, j in sorted(want)]
    extra = 5
    out = torch.full((2 * (len(want) + extra),), -7, dtype=torch.int32, device=device)
    _sorted_tiles_kernel[(len(want) + extra,)](cu.to(device), seq_lens.to(device), out, len(specs), BLOCK_Q=BQ,
                                               BLOCK_B=block_b)
    got = out.view(-1, 2).cpu().tolist()
    assert [tuple(t) for t in got[:len(want)]] == want
    assert all(b == -1 for b, _ in got[len(want):])


def test_table_configs_match_reference(device):
    """Every distinct config of the table (the Hopper tiles: 64/128 x 128, TMA) on a small batch, at its own
    head_dim and GQA group, with the engine's block size."""
    from nanovllm.kernels.prefill_config import TABLE
    seen = set()
    for (D, g_pad, _, dt), cfg in sorted(TABLE.items(), key=lambda kv: kv[1].name):
        if (cfg, D) in seen or dt != "bf16" or g_pad != 4:
            continue
        seen.add((cfg, D))
        batch = make_batch([(150, 70), (7, 1), (0, 0), (40, 40)], 4, 1, D, 256, torch.bfloat16, device, seed=D)
        out = run_prefill(batch, D ** -0.5, cfg)
        torch.testing.assert_close(out, reference(batch, D ** -0.5), **TOL[torch.bfloat16])
    assert len(seen) >= 2


def test_tile_config_choice():
    from nanovllm.kernels.prefill_config import TABLE, bucket, tile_config
    assert bucket(1, 8) == "decode" and bucket(8, 4) == "decode" and bucket(9, 4) == "short"
    assert bucket(1024, 1) == "short" and bucket(1025, 1) == "long"
    for key in [(128, 4, "long", "bf16"), (64, 4, "short", "fp16")]:
        D, g, b, dt = key
        lens = {"short": 512, "long": 8192}[b]
        assert tile_config(D, g, lens, {"bf16": torch.bfloat16, "fp16": torch.float16}[dt]) == TABLE[key]
    # a GQA group the table lacks takes the nearest one's entry
    assert tile_config(128, 8, 8192, torch.bfloat16) == TABLE[(128, 4, "long", "bf16")]
    assert tile_config(128, 1, 8192, torch.bfloat16) == TABLE[(128, 2, "long", "bf16")]
    # over an e4m3 cache: E4M3_TABLE's pointer-load tiles at head_dim 128 (half-precision queries only)
    from nanovllm.kernels.prefill_config import E4M3_TABLE
    for b, lens in (("short", 512), ("long", 8192)):
        for g in (4, 8):
            cfg = tile_config(128, g, lens, torch.bfloat16, kv_fp8=True)
            assert cfg == E4M3_TABLE[(128, b)] and not cfg.tma
            assert tile_config(128, g, lens, torch.bfloat16) != cfg
    assert tile_config(64, 4, 8192, torch.bfloat16, kv_fp8=True) == TABLE[(64, 4, "long", "bf16")]
    assert tile_config(128, 4, 8192, torch.float32, kv_fp8=True) == tile_config(128, 4, 8192, torch.float32)
    dec = tile_config(128, 8, 1, torch.bfloat16)             # not in the table: the heuristic's short tiles
    assert dec.block_m == 32 and not dec.tma
    assert tile_config(16, 1, 4096, torch.float32) == TileConfig(64, 32, 4, 2)  # float32: small exact tiles
    assert tile_config(16, 128, 1, torch.float32).block_m == 128  # at least one query of every packed head


def test_tile_config_validation_and_names():
    with pytest.raises(ValueError, match="block_n"):
        TileConfig(64, 48, 4, 2)
    with pytest.raises(ValueError, match="order"):
        TileConfig(64, 64, 4, 2, order="random")
    with pytest.raises(ValueError, match="warp_specialize"):
        TileConfig(64, 64, 4, 2, warp_specialize=True)
    with pytest.raises(ValueError, match="num_warps"):
        TileConfig(64, 64, 3, 2)
    cfg = TileConfig(128, 128, 8, 3, tma=True, pack_gqa=False, order="sorted")
    assert cfg.name == "m128n128w8s3-tma-nopack-sorted"
    assert eval(cfg.code()) == cfg  # a sweep's table entry reads back as the same config


def test_prefill_tma_falls_back_to_pointers(device):
    """TMA only where a KV tile is one box of the flattened cache: a block size that is no multiple of block_n,
    or a cache whose rows are not dense, takes the pointer path (same results)."""
    from nanovllm.kernels.prefill_attention import _kv_descriptors
    cfg = TileConfig(32, 32, 4, 2, tma=True)
    batch = make_batch([(70, 23), (40, 40)], 4, 2, 16, 48, torch.float32, device, seed=8)
    assert _kv_descriptors(batch["k_cache"], batch["v_cache"], cfg) is None       # 48 % 32 != 0
    torch.testing.assert_close(run_prefill(batch, 0.3, cfg), reference(batch, 0.3), **TOL[torch.float32])
    batch = make_batch([(70, 23), (40, 40)], 4, 2, 16, 32, torch.float32, device, seed=8)
    assert _kv_descriptors(batch["k_cache"], batch["v_cache"], cfg) is not None
    wide_k = torch.cat([batch["k_cache"], batch["k_cache"]], dim=2)[:, :, :2]      # head stride 2 * Hkv * D
    wide_v = torch.cat([batch["v_cache"], batch["v_cache"]], dim=2)[:, :, :2]
    assert _kv_descriptors(wide_k, wide_v, cfg) is None
    wide = dict(batch, k_cache=wide_k, v_cache=wide_v)
    torch.testing.assert_close(run_prefill(wide, 0.3, cfg), reference(batch, 0.3), **TOL[torch.float32])


def test_prefill_rejects_bad_scale_and_config(device):
    batch = make_batch([(20, 5)], 4, 2, 16, 16, torch.float32, device)
    with pytest.raises(ValueError, match="scale"):
        run_prefill(batch, 0.0)
    with pytest.raises(TypeError, match="TileConfig"):
        run_prefill(batch, 0.3, config=(64, 64, 4, 2))
    with pytest.raises(ValueError, match="block_m"):
        run_prefill(make_batch([(20, 5)], 32, 1, 16, 16, torch.float32, device), 0.3, TileConfig(16, 16, 4, 1))
