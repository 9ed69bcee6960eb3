"""Small host-side helpers shared by the kernel wrappers (argument checks, launch-size helpers)."""
from __future__ import annotations

import os

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
CACHE_DTYPES = (*FLOAT_DTYPES, torch.float8_e4m3fn)  # a KV cache: the model dtype, or e4m3 with scales


def next_pow2(n: int) -> int:
    n = int(n)
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def is_pow2(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0


def check_tiling(obj, tiles: tuple[str, ...], counts: tuple[str, ...] = ("num_warps", "num_stages")) -> None:
    """A tile-config dataclass's fields: `tiles` powers of two >= 16 (tl.dot's smallest), `counts` positive
    ints; ValueError naming the class, the field and the value."""
    cls = type(obj).__name__
    for name in tiles:
        v = getattr(obj, name)
        if isinstance(v, bool) or not isinstance(v, int) or v < 16 or not is_pow2(v):
            raise ValueError(f"{cls}.{name} must be a power of two >= 16, got {v!r}")
    for name in counts:
        v = getattr(obj, name)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{cls}.{name} must be a positive int, got {v!r}")


def check_scale_block(fn: str, block: tuple[int, int]) -> None:
    """A block-scaled weight's (bn, bk) tile: two powers of two >= 16; ValueError naming `fn` and the block."""
    if len(block) != 2 or any(isinstance(b, bool) or not isinstance(b, int) or b < 16 or not is_pow2(b)
                              for b in block):
        raise ValueError(f"{fn}: block sizes must be powers of two >= 16, got {block}")


def interpreting() -> bool:
    """True under the Triton CPU interpreter (TRITON_INTERPRET set and not 0)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def upcast_dots(dtype: torch.dtype) -> bool:
    """Whether a kernel should upcast its dot operands to float32: bfloat16 under the CPU interpreter, which
    multiplies bfloat16 dot operands as their raw uint16 bits."""
    return dtype == torch.bfloat16 and interpreting()


def dot_precision(dtype: torch.dtype) -> str | None:
    """``tl.dot``'s input_precision: exact float32 products for float32 inputs (no TF32), so float32 results
    match the references tightly; the default otherwise."""
    return "ieee" if dtype == torch.float32 else None


def check_float(name: str, t: torch.Tensor) -> None:
    if t.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name}: unsupported dtype {t.dtype}; expected one of float32/float16/bfloat16")


def check_int(name: str, t: torch.Tensor) -> None:
    if t.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name}: expected an int32/int64 tensor, got {t.dtype}")


def check_last_contiguous(name: str, t: torch.Tensor) -> None:
    if t.dim() > 0 and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name}: the last dimension must be contiguous (stride 1), got strides {tuple(t.stride())}"
                         f" for shape {tuple(t.shape)}; call .contiguous() first")


def check_same_device(**tensors: torch.Tensor) -> None:
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) > 1:
        raise ValueError(f"all tensors must be on one device, got {devices}")


_SM_COUNT: dict = {}


def sm_count(device: torch.device) -> int:
    """Number of SMs of a CUDA device (host query, cached); 132 (an H100/H200) elsewhere."""
    if device.type != "cuda":
        return 132
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


_CAPABILITY: dict = {}


def device_capability(device: torch.device) -> tuple[int, int]:
    """(major, minor) compute capability of a CUDA device (host query, cached); (0, 0) elsewhere."""
    if device.type != "cuda":
        return (0, 0)
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _CAPABILITY:
        _CAPABILITY[idx] = tuple(torch.cuda.get_device_capability(idx))
    return _CAPABILITY[idx]


def check_kv_scales(fn: str, k_cache: torch.Tensor, v_cache: torch.Tensor, k_scales: torch.Tensor | None,
                    v_scales: torch.Tensor | None) -> tuple[bool, int, int]:
    """An e4m3 KV cache comes with float32 scales per (block, slot, KV head), (num_blocks, block_size, Hkv) views
    with the same strides and a contiguous head dim; a cache in a float dtype without. Returns (fp8, the scales'
    block stride, their slot stride)."""
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    if v_cache.dtype != k_cache.dtype:
        raise ValueError(f"{fn}: k_cache and v_cache dtypes differ ({k_cache.dtype} vs {v_cache.dtype})")
    if not fp8:
        if k_scales is not None or v_scales is not None:
            raise ValueError(f"{fn}: KV scales go with a float8_e4m3fn cache, not {k_cache.dtype}")
        return False, 0, 0
    want = tuple(k_cache.shape[:3])
    for name, s in (("k_scales", k_scales), ("v_scales", v_scales)):
        if s is None or s.dtype != torch.float32 or tuple(s.shape) != want or (want[2] > 1 and s.stride(2) != 1):
            raise ValueError(f"{fn}: a float8_e4m3fn cache needs {name}: float32 {want} (num_blocks, block_size, "
                             f"num_kv_heads) with a contiguous last dim, got "
                             f"{None if s is None else (s.dtype, tuple(s.shape), s.stride())}")
    if k_scales.stride() != v_scales.stride():
        raise ValueError(f"{fn}: k_scales and v_scales must have the same strides, got {k_scales.stride()} and "
                         f"{v_scales.stride()}")
    check_same_device(k_cache=k_cache, k_scales=k_scales, v_scales=v_scales)
    return True, k_scales.stride(0), k_scales.stride(1)


def check_cache(name: str, t: torch.Tensor) -> None:
    if t.dtype not in CACHE_DTYPES:
        raise ValueError(f"{name}: unsupported KV-cache dtype {t.dtype}; expected float32/float16/bfloat16 or "
                         f"float8_e4m3fn")
