"""Compile every kernel for an sm_90 (H100/H200) target WITHOUT a GPU and report registers / spills.

The CPU interpreter used by the tests never runs the real compiler, so lowering errors, register spills or
lost vectorisation would go unnoticed there. This script runs Triton's full pipeline (TTIR -> TTGIR -> PTX ->
cubin, ptxas included) ahead of time and prints ``REG`` (registers/thread), ``STACK`` (bytes of spill stack;
should be 0 for the half-precision configs) and shared memory per configuration.

Not collected by pytest (it needs TRITON_INTERPRET unset and takes ~2 min); the varlen kernel is compiled for its
table's choices and, in half precision, for every config of its table and sweep (prefill_config). With Triton 3.6
(the H200's) installed beside the venv's: ``pip install --target /tmp/t36 --no-deps triton==3.6.0`` and
``PYTHONPATH=/tmp/t36:$PWD``. Run from the repo root:

    env -u TRITON_INTERPRET python tests/kernels/sm90_compile_check.py [bf16 fp16 fp32]

Pointer and stride arguments are declared 16-divisible, as the JIT specialises them at run time for aligned
tensors; without that hint Triton cannot vectorise the cache loads and the numbers are meaningless.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    sys.exit("unset TRITON_INTERPRET to run the compile check")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from nanovllm.kernels import activation, ar_norm, fused_qkv, kvcache, norm, rotary  # noqa: E402
from nanovllm.kernels import decode_attention as decode  # noqa: E402
from nanovllm.kernels import prefill_attention as prefill  # noqa: E402
from nanovllm.kernels.prefill_config import ORDERS, SWEEP, TABLE  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _resources(cubin: bytes) -> str:
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not tool.exists():
        return "(no cuobjdump)"
    with tempfile.NamedTemporaryFile("wb", suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        out = subprocess.run([str(tool), "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    finally:
        os.unlink(f.name)
    return " ".join(re.findall(r"REG:\d+|STACK:\d+", out))


def build(fn, types: dict, consts: dict, **options) -> None:
    sig = {n: ("constexpr" if n in consts else types.get(n, "i32")) for n in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
             if sig[n] != "constexpr" and (sig[n].startswith("*") or n.startswith("stride") or n in ("N", "inter"))}
    t0 = time.time()
    k = triton.compile(ASTSource(fn, sig, constexprs=consts, attrs=attrs), target=TARGET, options=options)
    shown = {a: b for a, b in consts.items() if a in ("G", "HEAD_DIM", "BLOCK_SIZE",
                                                      "SPLIT", "BLOCK", "H", "HKV", "HAS_NORM")}
    print(f"  {fn.__name__:24s} {shown} warps={options.get('num_warps')} smem={k.metadata.shared} "
          f"{_resources(k.asm['cubin'])} ({time.time() - t0:.1f}s)")


def prefill_variant(cfg, D: int, G: int, bs: int, dt: str, prec, persistent: bool = False) -> None:
    """Compile the varlen kernel for one TileConfig (TMA descriptors where the config and block size allow)."""
    g_pad = triton.next_power_of_2(G)
    hpp = g_pad if cfg.pack_gqa else 1
    tma = cfg.tma and bs % cfg.block_n == 0
    types = {**{n: f"*{dt}" for n in ("Q", "K", "V", "Out")}, "CU": "*i32", "SEQ_LENS": "*i32", "BT": "*i32",
             "qk_scale": "fp32"}
    consts = dict(G=G, HPP=hpp, SLOTS_PER_KV=-(-G // hpp), BLOCK_Q=cfg.block_m // hpp, BLOCK_M=cfg.block_m,
                  BLOCK_N=cfg.block_n, HEAD_DIM=D, BLOCK_SIZE=bs, BLOCK_B=64, PERSISTENT=persistent,
                  ORDER=ORDERS.index(cfg.order), STAGES=cfg.num_stages, WS=cfg.warp_specialize and tma, PREC=prec,
                  UPCAST=False, USE_TMA=tma)
    if tma:
        types["KD"] = types["VD"] = f"tensordesc<{dt}[{cfg.block_n}, {D}]>"
    else:
        consts["KD"] = consts["VD"] = None
    print(f"    {cfg.name}{' persistent' if persistent else ''}")
    build(prefill._prefill_kernel, types, consts, num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def check_prefill_configs(dt: str) -> None:
    """Every config of the varlen kernel's table and sweep at the engine's block size, for head_dim 128 (GQA 4 and
    2) and 64, and the short-prompt config on the persistent grid (mixed-step graphs)."""
    from nanovllm.kernels._common import dot_precision
    prec = dot_precision(DTYPES[dt])
    print(f"== varlen prefill configs, {dt}")
    for D, G in [(128, 4), (128, 2), (64, 4)]:
        for cfg in sorted({*TABLE.values(), *SWEEP}, key=lambda c: c.name):
            prefill_variant(cfg, D, G, 256, dt, prec)
        prefill_variant(prefill.tile_config(D, G, 512, DTYPES[dt]), D, G, 256, dt, prec, persistent=True)


def check(dt: str) -> None:
    dtype = DTYPES[dt]
    from nanovllm.kernels._common import dot_precision
    prec = dot_precision(dtype)
    print(f"== {dt} (triton {triton.__version__})")
    # (head_dim, GQA group, block_size, max_seqlen_q): the varlen kernel's table choice for each
    for D, G, bs, mq in [(128, 4, 16, 512), (128, 8, 256, 1), (64, 1, 16, 2048), (128, 7, 32, 4),
                         (256, 2, 16, 512)]:
        g_pad = triton.next_power_of_2(G)
        prefill_variant(prefill.tile_config(D, g_pad, mq, dtype), D, G, bs, dt, prec)
        ptrs = {n: f"*{dt}" for n in ("Q", "K", "V", "Out")}
        for splits in (1, 8):
            build(decode._decode_kernel, {**ptrs, "PART_O": "*fp32", "PART_LSE": "*fp32", "SEQ_LENS": "*i32",
                                             "ORDER": "*i32", "BT": "*i32", "qk_scale": "fp32"},
                  dict(G=G, BLOCK_G=max(16, g_pad), BLOCK_N=decode._decode_block_n(D, dtype), HEAD_DIM=D,
                       BLOCK_SIZE=bs, SPLIT=splits > 1, PREC=prec, UPCAST=False,
                       USE_ORDER=splits == 1, SKIP_EMPTY=splits == 8),
                  num_warps=4, num_stages=2)
        build(decode._decode_reduce_kernel, {"PART_O": "*fp32", "PART_LSE": "*fp32", "Out": f"*{dt}"},
              dict(SPLITS_PAD=32, HEAD_DIM=D, SKIP_EMPTY=True), num_warps=4)
    build(kvcache._store_kvcache_kernel, {"K": f"*{dt}", "V": f"*{dt}", "KC": f"*{dt}", "VC": f"*{dt}",
                                          "SLOTS": "*i64"},
          dict(BLOCK_SIZE=16, HEAD_DIM=128, D_PAD=128, BLOCK_H=8), num_warps=4)
    for has_res in (False, True):
        build(norm._rms_norm_kernel, {"X": f"*{dt}", "R": f"*{dt}", "W": f"*{dt}", "Y": f"*{dt}", "S": f"*{dt}",
                                      "eps": "fp32"},
              dict(HAS_RES=has_res, BLOCK=4096), num_warps=norm._num_warps(4096))
    build(ar_norm._two_rank_add_rms_norm_kernel, {"X": f"*{dt}", "P": f"*{dt}", "R": f"*{dt}", "W": f"*{dt}",
                                                  "Y": f"*{dt}", "S": f"*{dt}", "SIG_IN": "*i32", "SIG_OUT": "*i32",
                                                  "eps": "fp32"},
          dict(BLOCK=4096), num_warps=8)
    build(activation._silu_and_mul_kernel, {"X": f"*{dt}", "Y": f"*{dt}"}, dict(BLOCK=1024), num_warps=4)
    build(rotary._rotary_kernel, {"Q": f"*{dt}", "K": f"*{dt}", "QO": f"*{dt}", "KO": f"*{dt}", "POS": "*i64",
                                  "CS": "*fp32"},
          dict(HALF=64, HALF_PAD=64, BLOCK_H=32), num_warps=4)
    # Qwen3-0.6B (16/8 heads), Llama-3-8B (32/8), an odd head_dim; with and without QK-norm
    for H, Hkv, D, has_norm in [(16, 8, 128, True), (32, 8, 128, False), (12, 2, 80, True)]:
        block_h, n_qb, _ = fused_qkv.launch_config(H, Hkv, D)
        build(fused_qkv._qkv_norm_rope_store_kernel,
              {"QKV": f"*{dt}", "POS": "*i64", "CS": "*fp32", "QW": f"*{dt}", "KW": f"*{dt}", "QO": f"*{dt}",
               "KC": f"*{dt}", "VC": f"*{dt}", "SLOTS": "*i64", "eps": "fp32"},
              dict(H=H, HKV=Hkv, HEAD_DIM=D, HALF=D // 2, HALF_PAD=triton.next_power_of_2(D // 2), BLOCK_H=block_h,
                   NUM_QB=n_qb, BLOCK_SIZE=16, HAS_NORM=has_norm), num_warps=4)


if __name__ == "__main__":
    for name in sys.argv[1:] or ["bf16"]:
        check(name)
        if name != "fp32":
            check_prefill_configs(name)
    print("all kernels compiled for sm_90")
