"""The FP8 linear methods (see ``nanovllm.layers.quantization`` for when each is used).

Both quantize the activations on the fly (no calibration): per token for the online method, per token and
``bk`` columns for the block method. With ``use_kernels`` they run the Triton quantizers and, on CUDA,
``torch._scaled_mm``: with row-wise scales (online), or with 1 x 128 activation and 128 x 128 weight scales
(checkpoint; cuBLASLt's block-wise scaling, where this torch and GPU run it, else the Triton block GEMM);
otherwise the torch references of ``fp8_ref`` (quantize, dequantize, multiply in float32): the same math, which the
CPU tests run.
"""
from __future__ import annotations

import torch
from torch import nn

from nanovllm.layers.linear import LinearBase
from nanovllm.layers.moe import UnquantizedMoEMethod
from nanovllm.layers.quantization import fp8_ref
from nanovllm.layers.quantization.fp8_ref import FP8_DTYPE
from nanovllm.layers.quantization.fp8_rows import Fp8Rows, Fp8RowsSpec


def _into(y: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    if out is None:
        return y
    out.copy_(y)
    return out


def _check_rows(x, group: int | None) -> None:
    """Pre-quantized rows must be quantized as the method quantizes its input (per token, or per `group` columns)."""
    if isinstance(x, Fp8Rows) and x.group != group:
        raise ValueError(f"FP8 rows quantized per {x.group or 'token'} columns reach a layer that quantizes per "
                         f"{group or 'token'}")


def _scaled_mm_fits(w: torch.Tensor) -> bool:
    """Whether ``torch._scaled_mm`` takes products with weight w (N, K): on CUDA, K and N multiples of 16 (and a
    bf16 output, checked per call: its CUTLASS row-wise path, used below cuBLAS 12.9, takes no other in some torch
    versions; fp16 / float32 outputs go through the Triton GEMM)."""
    return w.is_cuda and w.shape[0] % 16 == 0 and w.shape[1] % 16 == 0


class Fp8LinearMethod:
    """Online FP8: the checkpoint's weight loads in the model dtype and is quantized once it is in place (random
    weights too): e4m3 with one float32 scale per output channel. Each product quantizes its input per token,
    unless the kernel before it did (`Fp8Rows`, with the Triton kernels: the norms and SiLU-and-mul)."""

    def __init__(self, use_kernels: bool):
        self.use_kernels = use_kernels
        self.fp8_rows = Fp8RowsSpec() if use_kernels else None

    def create_weights(self, layer, in_features, out_features):
        layer.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)  # model dtype
        layer.weight.weight_loader = layer.weight_loader

    def process_weights_after_loading(self, layer):
        q, s = fp8_ref.quantize_rows(layer.weight.data)
        layer.weight = nn.Parameter(q, requires_grad=False)                  # (N, K) e4m3
        layer.weight_scale = nn.Parameter(s.view(-1), requires_grad=False)   # (N,) float32
        layer.fp8_scaled_mm = self.use_kernels and _scaled_mm_fits(q)

    def apply(self, layer, x, bias, out=None):
        w, ws = layer.weight, layer.weight_scale
        _check_rows(x, None)
        if not self.use_kernels:
            xq, xs = (x.q, x.scale) if isinstance(x, Fp8Rows) else fp8_ref.quantize_rows(x)
            return _into(fp8_ref.fp8_linear_rowwise_ref(xq, xs, w, ws, x.dtype, bias), out)
        from nanovllm import kernels
        xq, xs = (x.q, x.scale) if isinstance(x, Fp8Rows) else kernels.per_token_quant_fp8(x)
        if not (layer.fp8_scaled_mm and x.dtype == torch.bfloat16):
            return kernels.w8a8_gemm(xq, xs, w, ws, x.dtype, bias=bias, out=out)
        kw = {} if out is None else {"out": out}
        # fast accumulation: the tensor cores' own accumulator within each K step, as vLLM's FP8 GEMMs run (1.03x
        # a Qwen3-8B layer at 256 rows, 1.09x at 1,024; the relative error 2-3e-3 against 1.7e-3: RESULTS.md)
        y = torch._scaled_mm(xq, w.t(), scale_a=xs, scale_b=ws.view(1, -1), out_dtype=x.dtype, use_fast_accum=True,
                             **kw)
        return y if bias is None else y.add_(bias)


def _block_scaled_mm_runs(device: torch.device) -> bool:
    """Whether ``torch._scaled_mm`` takes 1 x 128 activation and 128 x 128 weight scales here (cuBLASLt's block-wise
    scaling: CUDA >= 12.9 on Hopper; other torch builds and GPUs refuse it): one small product tried."""
    q = torch.zeros((4, 256), dtype=FP8_DTYPE, device=device)
    try:
        torch._scaled_mm(q, torch.zeros((256, 256), dtype=FP8_DTYPE, device=device).t(),
                         scale_a=torch.ones((2, 4), dtype=torch.float32, device=device).t(),
                         scale_b=torch.ones((2, 2), dtype=torch.float32, device=device).t(), out_dtype=torch.bfloat16)
    except (RuntimeError, ValueError, NotImplementedError):
        return False
    return True


def _block_scaled_mm(xq: torch.Tensor, xs: torch.Tensor, w: torch.Tensor, ws: torch.Tensor, group: int,
                     out_dtype: torch.dtype, out: torch.Tensor | None) -> torch.Tensor:
    """(xq * xs) @ (w * ws).T through ``torch._scaled_mm`` with block-wise scales: xq (M, K) e4m3 and xs (M, K /
    128) as the group quantizers lay them out (rows padded to a multiple of 4, scales column-major: what cuBLASLt
    takes; rows laid out otherwise are copied so), w (N, K) e4m3 with ws (N / 128, K / 128)."""
    from nanovllm.kernels.fp8_quant import fp8_quant_empty, padded_group_rows
    M, K = xq.shape
    if M == 0:
        return _into(torch.empty((0, w.shape[0]), dtype=out_dtype, device=xq.device), out)
    padded = padded_group_rows(xq, xs)
    if padded is None:
        q, s = fp8_quant_empty(M, K, group, xq.device)
        q.copy_(xq)
        s.copy_(xs)
        padded = padded_group_rows(q, s)
    qp, sp = padded
    if qp.shape[0] == M and out is not None:
        return torch._scaled_mm(qp, w.t(), scale_a=sp, scale_b=ws.t(), out_dtype=out_dtype, out=out)
    y = torch._scaled_mm(qp, w.t(), scale_a=sp, scale_b=ws.t(), out_dtype=out_dtype)
    return _into(y[:M], out)  # (the padding rows' products are dropped)


class Fp8BlockLinearMethod:
    """A block-FP8 checkpoint's layer: ``weight`` (N, K) e4m3 and ``weight_scale_inv`` (ceil(N / bn), ceil(K / bk))
    float32, the dequantization multiplier of each bn x bk tile (the Hub's name, despite the "inv"). Both load
    through the layer's sharding: a fused or tensor-parallel layer's scales shard with its rows / columns, which
    must then fall on whole tiles. On CUDA its products run through ``torch._scaled_mm``'s block-wise scaling
    (1.8-1.9x the Triton block GEMM at Qwen3-8B's sizes on an H200: RESULTS.md) where this torch and GPU take it,
    for bf16 models with 128 x 128 tiles and whole tiles; otherwise through the Triton GEMM."""

    def __init__(self, block: tuple[int, int], use_kernels: bool):
        self.block = tuple(block)
        self.use_kernels = use_kernels
        self.fp8_rows = Fp8RowsSpec(self.block[1]) if use_kernels else None
        self._block_mm_runs: dict[torch.device, bool] = {}   # per device: _block_scaled_mm_runs

    def create_weights(self, layer, in_features, out_features):
        bn, bk = self.block
        if in_features % bk:
            raise ValueError(f"{type(layer).__name__}: {in_features} input features per rank are not a multiple of "
                             f"the checkpoint's weight_block_size {bk} (per-token activation groups of {bk})")
        layer.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=FP8_DTYPE), requires_grad=False)
        layer.weight.weight_loader = _fp8_weight_loader(layer)
        layer.weight.dummy_init = _dummy_fp8
        layer.weight_scale_inv = nn.Parameter(torch.empty(-(-out_features // bn), -(-in_features // bk),
                                                          dtype=torch.float32), requires_grad=False)
        layer.weight_scale_inv.weight_loader = _block_scale_loader(layer, self.block)
        layer.weight_scale_inv.dummy_init = _dummy_scale

    def process_weights_after_loading(self, layer):
        w = layer.weight
        layer.fp8_block_scaled_mm = False
        if self.use_kernels and w.is_cuda and self.block == (128, 128) and w.shape[0] % 128 == 0:
            if w.device not in self._block_mm_runs:
                self._block_mm_runs[w.device] = _block_scaled_mm_runs(w.device)
            layer.fp8_block_scaled_mm = self._block_mm_runs[w.device]

    def apply(self, layer, x, bias, out=None):
        w, ws, bk = layer.weight, layer.weight_scale_inv, self.block[1]
        _check_rows(x, bk)
        if not self.use_kernels:
            xq, xs = (x.q, x.scale) if isinstance(x, Fp8Rows) else fp8_ref.quantize_groups(x, bk)
            return _into(fp8_ref.fp8_linear_block_ref(xq, xs, w, ws, self.block, x.dtype, bias), out)
        from nanovllm import kernels
        xq, xs = (x.q, x.scale) if isinstance(x, Fp8Rows) else kernels.per_token_group_quant_fp8(x, bk)
        if not (layer.fp8_block_scaled_mm and x.dtype == torch.bfloat16):
            return kernels.w8a8_gemm(xq, xs, w, ws, x.dtype, block=self.block, bias=bias, out=out)
        y = _block_scaled_mm(xq, xs, w, ws, bk, x.dtype, out)
        return y if bias is None else y.add_(bias)


class Fp8MoEMethod(UnquantizedMoEMethod):
    """Online FP8 experts: the experts load in the model dtype (this rank's slices) and are quantized once in
    place, e4m3 with one float32 scale per expert and output row (``w13_scale`` (E, 2I), ``w2_scale`` (E, H)).
    The gate/up products quantize their input per token and run on FP8 tensor cores; the down products take the
    SiLU-and-mul rows in the model dtype (weight-only). A decode step's experts are bound by the bytes of their
    weights (``docs/moe.md``), which this halves; the router stays in the model dtype."""

    block: tuple[int, int] | None = None   # per-row scales (Fp8BlockMoEMethod: a checkpoint's tiles)

    def process_weights_after_loading(self, layer):
        dtype = layer.w13.dtype  # the model's (the activations')
        for name in ("w13", "w2"):
            w = getattr(layer, name)
            E, N, K = w.shape
            q, s = fp8_ref.quantize_rows(w.data.reshape(E * N, K))
            setattr(layer, name, nn.Parameter(q.view(E, N, K), requires_grad=False))
            setattr(layer, f"{name}_scale", nn.Parameter(s.view(E, N), requires_grad=False))
        self.compile_kernels(layer, dtype, w13_scale=layer.w13_scale, w2_scale=layer.w2_scale)

    def apply(self, layer, x, router_logits, out=None, combine=True):
        return layer.fused_moe(x, router_logits, layer.w13, layer.w2, layer.top_k, layer.renormalize, out=out,
                               w13_scale=layer.w13_scale, w2_scale=layer.w2_scale, block=self.block,
                               combine=combine)


class Fp8BlockMoEMethod(Fp8MoEMethod):
    """A block-FP8 checkpoint's experts (Qwen3-30B-A3B-FP8): e4m3 ``w13`` (E, 2I, H) / ``w2`` (E, H, I) as stored
    and each projection's ``weight_scale_inv`` tiles stacked beside them, ``w13_scale`` (E, 2I / bn, H / bk)
    ([gate | up] tiles) and ``w2_scale`` (E, H / bn, I / bk), float32. As ``Fp8MoEMethod``, with the gate/up
    input quantized per token and bk columns: the grouped GEMMs scale each k-tile's products by their tile's
    scale (and by the rows' activation scales). This rank's slice of I must fall on whole
    tiles (ValueError otherwise, naming the sizes)."""

    def __init__(self, block: tuple[int, int]):
        super().__init__()
        self.block = tuple(block)

    def create_weights(self, layer):
        E, H, inter = layer.num_experts, layer.hidden_size, layer.intermediate_size
        bn, bk = self.block
        self.dtype = torch.get_default_dtype()  # the model's (built under it): the activations
        if inter % bn or inter % bk:
            raise ValueError(f"the experts' intermediate size per rank ({inter} = moe_intermediate_size / "
                             f"tensor_parallel_size {layer.tp.size}) is not a multiple of the checkpoint's "
                             f"weight_block_size {list(self.block)}: its tiles would be split between ranks")
        if H % bk:
            raise ValueError(f"the hidden size {H} is not a multiple of the checkpoint's weight_block_size {bk} "
                             f"(the experts' input is quantized per token and {bk} columns)")
        shapes = {"w13": (2 * inter, H), "w2": (H, inter)}
        for name, shards in (("w13", ("gate", "up")), ("w2", ("down",))):
            n, k = shapes[name]
            ids = frozenset((e, s) for e in range(E) for s in shards)
            w = nn.Parameter(torch.empty(E, n, k, dtype=FP8_DTYPE), requires_grad=False)
            w.weight_loader, w.shard_ids, w.dummy_init = _fp8_expert_loader(layer), ids, _dummy_fp8
            sc = nn.Parameter(torch.empty(E, -(-n // bn), -(-k // bk), dtype=torch.float32), requires_grad=False)
            sc.weight_loader, sc.shard_ids, sc.dummy_init = self._scale_loader(layer), ids, _dummy_scale
            setattr(layer, name, w)
            setattr(layer, f"{name}_scale", sc)

    def _scale_loader(self, layer):
        """One expert projection's checkpoint tiles (rows of tiles x columns of tiles) into this rank's slice of
        the stacked scales: gate / up rows I / bn each, down's columns I / bk, cut like the weights."""
        bn, bk = self.block
        inter, H, r = layer.intermediate_size, layer.hidden_size, layer.tp.rank
        full = inter * layer.tp.size

        def load(param, loaded, shard_id):
            e, which = shard_id
            want = (-(-H // bn), full // bk) if which == "down" else (full // bn, -(-H // bk))
            if tuple(loaded.shape) != want:
                raise ValueError(f"expert {e} {which} scales of shape {tuple(loaded.shape)}, want {want} "
                                 f"(weight_block_size {list(self.block)})")
            if which == "down":
                param.data[e].copy_(loaded.narrow(1, r * inter // bk, inter // bk))
            else:
                n = inter // bn
                param.data[e].narrow(0, 0 if which == "gate" else n, n).copy_(loaded.narrow(0, r * n, n))
        return load

    def process_weights_after_loading(self, layer):  # (stored quantized: nothing to quantize)
        self.compile_kernels(layer, self.dtype, w13_scale=layer.w13_scale, w2_scale=layer.w2_scale, block=self.block)


def _fp8_expert_loader(layer):
    def load(param, loaded, shard_id):
        if loaded.dtype != FP8_DTYPE:
            raise ValueError(f"the fp8 checkpoint format stores expert weights as float8_e4m3fn, found {loaded.dtype}")
        layer.weight_loader(param, loaded, shard_id)
    return load


def _fp8_weight_loader(layer: LinearBase):
    def load(param, loaded, shard_id=None):
        if loaded.dtype != FP8_DTYPE:
            raise ValueError(f"the fp8 checkpoint format stores this {type(layer).__name__} weight as float8_e4m3fn, "
                             f"found {loaded.dtype} (a module kept unquantized belongs in quantization_config's "
                             f"modules_to_not_convert)")
        layer.weight_loader(param, loaded, shard_id)
    return load


def _block_scale_loader(layer: LinearBase, block: tuple[int, int]):
    """Loads a checkpoint's tile scales into the layer's scale parameter along the layer's own ``shard_slice``,
    in units of tiles."""
    def load(param, loaded, shard_id=None):
        s = layer.shard_slice(shard_id)
        if s is None:
            if param.shape != loaded.shape:
                raise ValueError(f"checkpoint scales of shape {tuple(loaded.shape)} do not fit {tuple(param.shape)}")
            param.data.copy_(loaded)
            return
        b = block[s.dim]
        local = layer.out_features if s.dim == 0 else layer.in_features
        # a slice must start on a tile and end on one, or at the end of both the checkpoint tensor and the parameter
        # (a partial last tile); otherwise two slices (fused parts, ranks) would share a tile and its one scale
        ends_src = s.src + s.size > (loaded.shape[s.dim] - 1) * b
        ok = s.src % b == 0 and s.dst % b == 0 and (s.size % b == 0 or (ends_src and s.dst + s.size == local))
        if not ok:
            what = "rows" if s.dim == 0 else "columns"
            raise ValueError(
                f"{type(layer).__name__} (shard {shard_id!r}): {what} {s.src}..{s.src + s.size} of the checkpoint "
                f"tensor (to {s.dst}.. of this rank's {local}) do not fall on whole {b}-wide weight blocks, so they "
                f"can't take their block scales with them; with tensor_parallel_size={layer.tp.size} this layer's "
                f"parts are not multiples of {b} (use a tensor_parallel_size that keeps them so)")
        n = -(-s.size // b)
        dst = param.data.narrow(s.dim, s.dst // b, n)
        src = loaded.narrow(s.dim, s.src // b, n)
        if dst.shape != src.shape:
            raise ValueError(f"checkpoint scales of shape {tuple(src.shape)} do not fit {tuple(dst.shape)}")
        dst.copy_(src)
    return load


def _dummy_fp8(p: torch.Tensor, gen: torch.Generator) -> None:
    """Random e4m3 values spread over the format's range (with _dummy_scale: weights ~ N(0, 0.02))."""
    p.copy_((torch.randn(p.shape, generator=gen, device=p.device) * 64.0).clamp(-448.0, 448.0).to(FP8_DTYPE))


def _dummy_scale(p: torch.Tensor, gen: torch.Generator) -> None:
    p.fill_(0.02 / 64.0)
