"""Small host-side helpers shared by the kernel wrappers (argument checks, launch-size helpers)."""
from __future__ import annotations

import os

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def next_pow2(n: int) -> int:
    n = int(n)
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def is_pow2(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0


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
