"""Plain-torch FP8 (e4m3) numerics: the references the FP8 Triton kernels answer to, and the CPU path.

One scheme everywhere: a group of values (a weight row, a token's activations, a 128-wide slice of them, one
token's K or V head) gets the scale ``s = max(amax / 448, FP8_MIN_SCALE)`` in float32 (448 is e4m3's largest
finite value; the floor keeps an all-zero group finite), and each value ``x`` is stored as
``e4m3(clamp(x * (1 / s), -448, 448))``, rounded to nearest, ties to even. Dequantized, ``x ~ q * s``: the largest
magnitude of the group maps to 448, so nothing overflows and the relative error of every value is at most
2^-4 (3 mantissa bits) unless it is below e4m3's normal range (2^-6 * s, values 2^15 times smaller than the
group's largest).

The Triton kernels compute the same float32 operations (the scale and its reciprocal IEEE divisions, ``div_rn``,
then one multiplication per value) and the same rounding, so their fp8 bytes equal these functions' bit for bit.
(The reciprocal, not a division per value: the divisions made the e4m3 writers 2-3x slower on an H200.)
"""
from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
FP8_MIN_SCALE = 2.0 ** -40


def fp8_scale(amax: torch.Tensor) -> torch.Tensor:
    """The scale (float32) of groups whose largest magnitude is ``amax``. (448 as a tensor on amax's device: on
    CUDA torch divides by a Python number as a multiplication by its reciprocal, which is not the IEEE quotient
    and puts about half the scales one ulp off the kernels'.)"""
    amax = amax.float()
    return (amax / amax.new_tensor(FP8_MAX)).clamp(min=FP8_MIN_SCALE)


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """e4m3 of ``x * (1 / scale)`` (``scale`` broadcast against x), saturated to +-448. (The reciprocal as a
    tensor division, IEEE on every device, as the kernels' ``fp8_inverse``.)"""
    return (x.float() * (torch.ones_like(scale) / scale)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row (per-token activations, per-output-channel weights): x (M, K) -> (q (M, K) e4m3, s (M, 1))."""
    s = fp8_scale(x.float().abs().amax(dim=-1, keepdim=True))
    return quantize_fp8(x, s), s


def quantize_groups(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row and per ``group`` consecutive columns: x (M, K), K % group == 0 -> (q (M, K), s (M, K // group))."""
    M, K = x.shape
    if K % group:
        raise ValueError(f"quantize_groups: K={K} is not a multiple of the group size {group}")
    g = x.float().view(M, K // group, group)
    s = fp8_scale(g.abs().amax(dim=-1))
    return quantize_fp8(g, s[..., None]).view(M, K), s


def quantize_blocks(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per (block[0] x block[1]) tile of a weight (N, K) -> (q (N, K), s (ceil(N / b0), ceil(K / b1))): the layout
    of the Hub's block-FP8 checkpoints (``weight`` and ``weight_scale_inv``). Edge tiles may be partial."""
    N, K = w.shape
    b0, b1 = block
    nb, kb = -(-N // b0), -(-K // b1)
    padded = w.float().new_zeros(nb * b0, kb * b1)
    padded[:N, :K] = w.float()
    tiles = padded.view(nb, b0, kb, b1)
    s = fp8_scale(tiles.abs().amax(dim=(1, 3)))                            # (nb, kb)
    q = quantize_fp8(tiles, s[:, None, :, None]).view(nb * b0, kb * b1)[:N, :K].contiguous()
    return q, s


def expand_block_scales(s: torch.Tensor, block: tuple[int, int], shape: tuple[int, int]) -> torch.Tensor:
    """Block scales (ceil(N / b0), ceil(K / b1)) -> one per element (N, K)."""
    N, K = shape
    return s.repeat_interleave(block[0], 0)[:N].repeat_interleave(block[1], 1)[:, :K]


def dequantize(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """q * s in float32 (s broadcast against q)."""
    return q.float() * s


def fp8_linear_rowwise_ref(xq: torch.Tensor, xs: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor,
                           out_dtype: torch.dtype, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``(xq @ wq.T) * xs * ws`` in float32 -> out_dtype: per-token activation scales xs (M, 1), per-channel
    weight scales ws (N,) — what ``torch._scaled_mm`` with row-wise scales computes."""
    y = (xq.float() @ wq.float().t()) * xs * ws.float()[None, :]
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)


def fp8_linear_block_ref(xq: torch.Tensor, xs: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor,
                         block: tuple[int, int], out_dtype: torch.dtype, bias: torch.Tensor | None = None
                         ) -> torch.Tensor:
    """Dequantize and multiply: activations xq (M, K) with scales xs (M, K // block[1]) per token and group,
    weights wq (N, K) with scales ws per (block[0] x block[1]) tile; float32 -> out_dtype."""
    x = dequantize(xq, xs.repeat_interleave(block[1], 1)[:, :xq.shape[1]])
    w = dequantize(wq, expand_block_scales(ws, block, tuple(wq.shape)))
    y = x @ w.t()
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)
