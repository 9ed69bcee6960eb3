"""The fused-MoE kernels (``nanovllm.kernels.moe`` / ``moe_routing``) against their torch references
(``nanovllm.layers.moe_ref``): routing (ties, NaN rows), the expert-sorted layout (experts with no tokens, one
token, several counting chunks), both grouped GEMMs (rows that don't fill a block, padding never read), the
combine, and the whole layer in float32 and bfloat16; with FP8 (e4m3) experts and their per-row scales too."""
import pytest
import torch

from nanovllm.kernels.moe import fused_moe, fused_moe_compile, moe_combine, moe_down, moe_gate_up
from nanovllm.kernels.moe_configs import DEFAULT_BUCKETS, MOE_CONFIGS, GemmTile, MoEConfig, moe_config
from nanovllm.kernels.moe_routing import moe_route, moe_route_align
from nanovllm.layers.moe_ref import (
    MoELayout,
    align_ref,
    combine_ref,
    dequantize_experts,
    down_ref,
    expert_input,
    fused_moe_ref,
    gate_up_ref,
    max_blocks,
    route_ref,
)

POISON = 1 << 30  # in padding rows of a layout: a kernel that read one would address far out of bounds


def _rand(*shape, seed, dtype=torch.float32, device="cpu", scale=1.0):
    return (scale * torch.randn(*shape, generator=torch.Generator().manual_seed(seed))).to(dtype).to(device)


def _poisoned(layout: MoELayout) -> MoELayout:
    ids = torch.where(layout.row_mask(), layout.sorted_ids, torch.full_like(layout.sorted_ids, POISON))
    return MoELayout(ids, layout.block_expert, layout.block_rows, layout.block_m)


@pytest.mark.parametrize("T, E, k, renorm", [(1, 8, 2, True), (37, 8, 2, False), (20, 12, 12, True),
                                             (5, 128, 8, True), (3, 8, 1, False)])
def test_route_matches_reference(device, T, E, k, renorm):
    logits = _rand(T, E, seed=T + E, scale=3.0, device=device)
    w, ids = moe_route(logits, k, renorm)
    wr, idr = route_ref(logits, k, renorm)
    assert ids.dtype == torch.int32 and w.dtype == torch.float32 and ids.shape == w.shape == (T, k)
    assert torch.equal(ids, idr)
    torch.testing.assert_close(w, wr, atol=1e-6, rtol=1e-5)
    if renorm:
        torch.testing.assert_close(w.sum(-1), torch.ones(T, device=device))


@pytest.mark.filterwarnings("ignore:invalid value encountered")  # the NaN row, under the interpreter
def test_route_ties_go_to_the_lower_index(device):
    logits = torch.tensor([[0.0, 1.0, 1.0, 1.0, 0.5, 1.0, 0.0, 0.0],     # four-way tie across the top-2 boundary
                           [2.0] * 8,                                      # everything tied
                           [3.0, 0.0, 3.0, 0.0, 1.0, 1.0, 0.0, 0.0],      # a tie inside the top 2
                           [float("nan")] * 8,                             # garbage (a padding row)
                           [float("inf"), 0.0, float("inf"), 0.0, 0.0, 0.0, 0.0, 0.0]], device=device)
    w, ids = moe_route(logits.to(torch.bfloat16), 2, True)
    assert ids[:3].tolist() == [[1, 2], [0, 1], [0, 2]]
    assert ids[:3].tolist() == route_ref(logits[:3], 2, True)[1].tolist()
    torch.testing.assert_close(w[:3], torch.full((3, 2), 0.5, device=device))
    for row in ids[3:].tolist():  # still two distinct real experts
        assert len(set(row)) == 2 and all(0 <= e < 8 for e in row)
    assert bool(torch.isfinite(w).all())


def _logits(kind: str, T: int, E: int, k: int, device) -> torch.Tensor:
    if kind == "random":  # distinct random experts per token
        return _rand(T, E, seed=T * E + k, scale=3.0, device=device)
    if kind == "two experts":  # every token on experts 5 and 3 (k = 2): the others get none
        logits = torch.full((T, E), -4.0)
        logits[:, 5], logits[:, 3] = 2.0, 1.0
        return logits.to(device)
    raise AssertionError(kind)


@pytest.mark.parametrize("kind, T, E, k", [("random", 1, 8, 2), ("random", 37, 8, 2), ("random", 100, 16, 4),
                                           ("random", 50, 12, 3), ("random", 260, 8, 1),
                                           ("two experts", 70, 8, 2), ("random", 300, 128, 8),
                                           ("random", 8, 128, 8), ("random", 1000, 16, 2),
                                           ("random", 2100, 16, 2)])
@pytest.mark.parametrize("block_m", [16, 64])
def test_route_align_matches_reference(device, kind, T, E, k, block_m):
    """Chunks of one 8-token routing tile up to 1,024 tokens: T=300, E=128, k=8: 38 chunks (two scan steps of the
    scatter); T=1000, k=2: 125 chunks (four scan steps), 16 pairs each, less than one scattering step; T=2100, k=2:
    88 chunks of three tiles; T=8: one chunk labels all of its 64 blocks, BLOCK_B at a time."""
    logits = _logits(kind, T, E, k, device)
    w, ids, lay = moe_route_align(logits, k, True, block_m)
    wr, idr = route_ref(logits, k, True)
    assert torch.equal(ids, idr)
    torch.testing.assert_close(w, wr, atol=1e-6, rtol=1e-5)
    ref = align_ref(ids, E, block_m)
    assert lay.block_expert.numel() == max_blocks(T * k, E, block_m)
    assert torch.equal(lay.block_expert, ref.block_expert) and torch.equal(lay.block_rows, ref.block_rows)
    real = ref.row_mask()
    assert torch.equal(lay.sorted_ids[real], ref.sorted_ids[real])
    # every pair exactly once, in a block of its expert
    assert sorted(lay.sorted_ids[real].tolist()) == list(range(T * k))
    experts = lay.block_expert.long().repeat_interleave(block_m)[real]
    assert torch.equal(ids.flatten()[lay.sorted_ids[real].long()].long(), experts)
    live = lay.block_expert >= 0
    assert bool((lay.block_rows[live] > 0).all()) and not bool(live[live.long().sum():].any())
    if kind == "two experts":
        assert set(lay.block_expert[live].tolist()) == {3, 5}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T, E, H, inter, k, block_m", [(1, 8, 64, 32, 2, 16), (37, 8, 64, 48, 2, 16),
                                                        (50, 16, 48, 32, 4, 32)])
def test_grouped_gemms_and_combine_match_reference(device, dtype, T, E, H, inter, k, block_m):
    """gate/up (SiLU-and-mul fused) and down (routing weight fused) over a layout whose padding entries are
    poison and whose padding rows of the intermediate are NaN: neither is read. H=48: a K that is no multiple of
    the k-tile; inter=48: outputs that don't fill an n-tile."""
    x = _rand(T, H, seed=1, dtype=dtype, device=device)
    w13 = _rand(E, 2 * inter, H, seed=2, dtype=dtype, device=device, scale=0.2)
    w2 = _rand(E, H, inter, seed=3, dtype=dtype, device=device, scale=0.2)
    weights, ids = route_ref(_rand(T, E, seed=4, device=device), k, True)
    layout = align_ref(ids, E, block_m)
    tile = GemmTile(32, 32)
    real = layout.row_mask()
    h = moe_gate_up(x, w13, _poisoned(layout), k, tile)
    h_ref = gate_up_ref(x, w13, layout, k)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(h[real].float(), h_ref[real].float(), **tol)
    h[~real] = float("nan")
    pairs = moe_down(h, w2, _poisoned(layout), weights, tile)
    torch.testing.assert_close(pairs.float(), down_ref(h_ref, w2, layout, weights).float(), **tol)
    out, want = moe_combine(pairs, k), combine_ref(pairs, k)
    if dtype == torch.float32:
        assert torch.equal(out, want)  # the same float32 sums in the same order
    else:  # (the interpreter rounds float32 to bfloat16 by truncation: one unit in the last place)
        torch.testing.assert_close(out.float(), want.float(), atol=1e-6, rtol=2 ** -7)


CONFIGS = [MoEConfig(16, GemmTile(32, 32), GemmTile(32, 32)),
           MoEConfig(32, GemmTile(64, 16, num_stages=2), GemmTile(16, 64)),
           MoEConfig(64, GemmTile(16, 64, num_warps=8), GemmTile(64, 32))]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"m{c.block_m}")
@pytest.mark.parametrize("T, E, k, renorm, skew", [(1, 8, 2, True, False), (45, 8, 2, True, True),
                                                   (33, 16, 4, False, False)])
def test_fused_moe_matches_reference(device, dtype, cfg, T, E, k, renorm, skew):
    """The whole layer; skew: the router favours two experts, so most experts receive no token."""
    H, inter = 64, 32
    x = _rand(T, H, seed=T, dtype=dtype, device=device)
    logits = _rand(T, E, seed=T + 1, device=device)
    if skew:
        logits[:, :2] += 8.0
    w13 = _rand(E, 2 * inter, H, seed=5, dtype=dtype, device=device, scale=0.2)
    w2 = _rand(E, H, inter, seed=6, dtype=dtype, device=device, scale=0.2)
    out = torch.full((T, H), float("nan"), dtype=dtype, device=device)
    y = fused_moe(x, logits.to(dtype), w13, w2, k, renorm, out, config=cfg)
    assert y is out
    ref = fused_moe_ref(x, logits.to(dtype), w13, w2, k, renorm)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=2e-2)
    torch.testing.assert_close(y.float(), ref.float(), **tol)
    assert torch.equal(fused_moe(x, logits.to(dtype), w13, w2, k, renorm, config=cfg), y)  # deterministic
    # uncombined: each token's weighted expert rows, which combine to the layer's output
    rows = fused_moe(x, logits.to(dtype), w13, w2, k, renorm, config=cfg, combine=False)
    rows_ref = fused_moe_ref(x, logits.to(dtype), w13, w2, k, renorm, combine=False)
    assert rows.shape == rows_ref.shape == (T * k, H)
    torch.testing.assert_close(rows.float(), rows_ref.float(), **tol)
    torch.testing.assert_close(combine_ref(rows, k).float(), y.float(), **tol)  # (the interpreter truncates)
    assert torch.equal(combine_ref(rows_ref, k), ref)


def _fp8_experts(E, H, inter, device, seed=5):
    """Random experts quantized as Fp8MoEMethod does: (w13 e4m3, its scales (E, 2I), w2 e4m3, scales (E, H))."""
    from nanovllm.layers.quantization import fp8_ref
    out = []
    for i, (n, k) in enumerate(((2 * inter, H), (H, inter))):
        w = _rand(E * n, k, seed=seed + i, scale=0.2)
        q, sc = fp8_ref.quantize_rows(w)
        out += [q.view(E, n, k).to(device), sc.view(E, n).to(device)]
    return out


def _check_fp8_layer(x, logits, k, cfg, w13, s13, w2, s2, block, layer_tol=None):
    """The FP8 experts' grouped GEMMs step by step and the whole layer against the references on the dequantized
    experts (bf16 / float32 tolerances by x's dtype; `layer_tol` for the layer if looser); returns the reference
    layer output."""
    tol = dict(atol=1e-5, rtol=1e-5) if x.dtype == torch.float32 else dict(atol=3e-2, rtol=2e-2)
    weights, ids = route_ref(logits, k, True)
    layout = align_ref(ids, w13.shape[0], cfg.block_m)
    real = layout.row_mask()
    h = moe_gate_up(x, w13, _poisoned(layout), k, cfg.gate_up, s13, block)
    h_ref = gate_up_ref(x, w13, layout, k, s13, block)
    torch.testing.assert_close(h[real].float(), h_ref[real].float(), **tol)
    pairs = moe_down(h_ref, w2, _poisoned(layout), weights, cfg.down, s2, block)
    torch.testing.assert_close(pairs.float(), down_ref(h_ref, w2, layout, weights, s2, block).float(), **tol)
    y = fused_moe(x, logits, w13, w2, k, True, config=cfg, w13_scale=s13, w2_scale=s2, block=block)
    ref = fused_moe_ref(x, logits, w13, w2, k, True, w13_scale=s13, w2_scale=s2, block=block)
    torch.testing.assert_close(y.float(), ref.float(), **(layer_tol or tol))
    return ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cfg", CONFIGS[:2], ids=lambda c: f"m{c.block_m}")
def test_fp8_experts_match_reference(device, dtype, cfg):
    """e4m3 experts with per-row scales (online FP8: x quantized per token for gate/up), step by step and the
    whole layer, against the references multiplying by the dequantized weights; H=48: a reduction no multiple of
    the k-tile."""
    T, E, k, H, inter = 29, 8, 2, 48, 32
    w13, s13, w2, s2 = _fp8_experts(E, H, inter, device)
    x = _rand(T, H, seed=1, dtype=dtype, device=device)
    logits = _rand(T, E, seed=2, device=device).to(dtype)
    ref = _check_fp8_layer(x, logits, k, cfg, w13, s13, w2, s2, None)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=2e-2)
    # the scales matter (the product without them is off by their size, ~1e-3 here); on the dequantized experts
    # and gate/up inputs the reference is the unquantized layer
    assert not torch.allclose(ref.float(), fused_moe_ref(x, logits, w13.to(dtype), w2.to(dtype), k, True).float(),
                              **tol)
    deq = fused_moe_ref(expert_input(x, s13, None).to(dtype), logits, dequantize_experts(w13, s13).to(dtype),
                        dequantize_experts(w2, s2).to(dtype), k, True)
    torch.testing.assert_close(ref.float(), deq.float(), **tol)
    assert fused_moe_compile(w13, w2, k, True, s13, s2, dtype) == len(set(c for _, c in DEFAULT_BUCKETS))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cfg", [CONFIGS[0], MoEConfig(16, GemmTile(32, 64), GemmTile(16, 16))],
                         ids=["k-tile = block", "k-tiles clamped / within a block"])
def test_block_fp8_experts_match_reference(device, dtype, cfg):
    """A block-FP8 checkpoint's experts (one scale per 32 x 32 tile; H=96: 3 tiles, no power of two): each k-tile's
    products scaled by its tile's scale and x's per-token scale of those columns, against the reference on the
    dequantized experts."""
    from nanovllm.layers.quantization import fp8_ref
    T, E, k, H, inter, block = 29, 8, 2, 96, 64, (32, 32)
    qs = []
    for i, (n, kk) in enumerate(((2 * inter, H), (H, inter))):
        w = _rand(E, n, kk, seed=7 + i, scale=0.1) * torch.logspace(-0.5, 0.5, kk)   # tiles of other scales
        q, sc = zip(*(fp8_ref.quantize_blocks(we, block) for we in w))
        qs += [torch.stack(q).to(device), torch.stack(sc).to(device)]
    w13, s13, w2, s2 = qs
    x = _rand(T, H, seed=1, dtype=dtype, device=device)
    logits = _rand(T, E, seed=2, device=device).to(dtype)
    # float32: the kernel sums each k-tile's scaled partial product, the reference multiplies the dequantized
    # weights at once; over both GEMMs that rounds apart by ~1e-4 of the output (1e-5 per step)
    ref = _check_fp8_layer(x, logits, k, cfg, w13, s13, w2, s2, block,
                           dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else None)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=2e-2)
    # the tiles' scales matter: per-row scales of their mean give another layer
    rows = (s13.repeat_interleave(32, 1).mean(-1).contiguous(),
            s2.repeat_interleave(32, 1)[:, :H].mean(-1).contiguous())
    other = fused_moe_ref(x, logits, w13, w2, k, True, w13_scale=rows[0], w2_scale=rows[1])
    assert not torch.allclose(ref.float(), other.float(), **tol)
    layout = align_ref(route_ref(logits, k, True)[1], E, cfg.block_m)
    with pytest.raises(ValueError, match="whole 32-row tiles"):
        moe_gate_up(x, w13[:, :96].contiguous(), layout, k, cfg.gate_up, s13[:, :3].contiguous(), block)
    with pytest.raises(ValueError, match="hidden size 80 must be whole 32-column tiles"):
        moe_gate_up(x[:, :80].contiguous(), w13[:, :, :80].contiguous(), layout, k, cfg.gate_up, s13, block)
    with pytest.raises(ValueError, match=r"scales must be contiguous float32 \(8, 4, 3\)"):
        moe_gate_up(x, w13, layout, k, cfg.gate_up, s13[:, :, :2].contiguous(), block)
    with pytest.raises(ValueError, match="describes FP8 experts' scales"):
        fused_moe(x, logits, w13.to(dtype), w2.to(dtype), k, True, block=block)


def test_fp8_experts_reject_bad_scales(device):
    w13, s13, w2, s2 = _fp8_experts(4, 32, 16, device)
    x, lg = torch.zeros(3, 32, device=device), torch.zeros(3, 4, device=device)
    with pytest.raises(ValueError, match="come together"):
        fused_moe(x, lg, w13, w2, 2, True, w13_scale=s13)
    with pytest.raises(ValueError, match="w13 with scales must be float8_e4m3fn"):
        fused_moe(x, lg, w13.float(), w2, 2, True, w13_scale=s13, w2_scale=s2)
    with pytest.raises(ValueError, match=r"weight scales must be contiguous float32 \(4, 32\)"):
        fused_moe(x, lg, w13, w2, 2, True, w13_scale=s13[:, :16], w2_scale=s2)
    with pytest.raises(ValueError, match="come with their scales"):
        moe_gate_up(x, w13, align_ref(torch.zeros(3, 2, dtype=torch.int32), 4, 16), 2, GemmTile(16, 16))
    with pytest.raises(ValueError, match="block sizes must be powers of two >= 16"):
        moe_gate_up(x, w13, align_ref(torch.zeros(3, 2, dtype=torch.int32), 4, 16), 2, GemmTile(16, 16),
                    torch.ones(4, 2, 2, device=device), block=(16, 24))


def test_fused_moe_rejects_bad_inputs(device):
    x = torch.zeros(4, 64, device=device)
    w13, w2, lg = torch.zeros(8, 64, 64, device=device), torch.zeros(8, 64, 32, device=device), torch.zeros(4, 8)
    lg = lg.to(device)
    with pytest.raises(ValueError, match="shapes disagree"):
        fused_moe(x, lg, w13, w2[:, :, :16], 2, True)
    with pytest.raises(ValueError, match="router_logits must be"):
        fused_moe(x, lg[:, :4], w13, w2, 2, True)
    with pytest.raises(ValueError, match="share a dtype"):
        fused_moe(x, lg, w13.to(torch.bfloat16), w2, 2, True)
    with pytest.raises(ValueError, match="top_k"):
        fused_moe(x, lg, w13, w2, 9, True)
    with pytest.raises(ValueError, match="out must be"):
        fused_moe(x, lg, w13, w2, 2, True, torch.zeros(4, 32, device=device))
    assert fused_moe(x[:0], lg[:0], w13, w2, 2, True).shape == (0, 64)
    with pytest.raises(ValueError, match="takes no out"):
        fused_moe(x, lg, w13, w2, 2, True, torch.zeros(4, 64, device=device), combine=False)


def test_config_table_lookup(device):
    assert moe_config(1, 128, 2048, 768) is DEFAULT_BUCKETS[0][1]                # the measured table's first bucket
    assert moe_config(10 ** 6, 128, 2048, 768) is MOE_CONFIGS[128, 2048, 768][-1][1]
    assert moe_config(300, 128, 2048, 768).block_m == 64
    assert moe_config(10 ** 6, 8, 64, 32) is DEFAULT_BUCKETS[-1][1]               # a shape not in the table
    assert [moe_config(n, 8, 64, 32).block_m for n in (16, 17, 128, 129, 512, 513)] == [16, 16, 16, 32, 32, 64]
    assert GemmTile(128, 256).fit(32, 48) == GemmTile(32, 64)
    assert GemmTile(128, 256).fit(1024, 2048, itemsize=4) == GemmTile(128, 128)  # float32: bf16's shared memory
    with pytest.raises(ValueError, match="block_n"):
        GemmTile(24, 64)
    with pytest.raises(ValueError, match="block_m"):
        MoEConfig(8, GemmTile(16, 16), GemmTile(16, 16))
    w13, w2 = torch.zeros(8, 64, 64, device=device), torch.zeros(8, 64, 32, device=device)
    assert fused_moe_compile(w13, w2, 2, True) == len(set(c for _, c in DEFAULT_BUCKETS)) == 4
