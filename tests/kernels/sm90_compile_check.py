"""Compile every kernel for an sm_90 (H100/H200) target WITHOUT a GPU and report registers / spills.

The CPU interpreter used by the tests never runs the real compiler, so lowering errors, register spills or
lost vectorisation would go unnoticed there. This script runs Triton's full pipeline (TTIR -> TTGIR -> PTX ->
cubin, ptxas included) ahead of time and prints ``REG`` (registers/thread), ``STACK`` (bytes of spill stack;
should be 0 for the half-precision configs) and shared memory per configuration.

Not collected by pytest (it needs TRITON_INTERPRET unset and takes ~2 min); the varlen kernel is compiled for its
table's choices and, in half precision, for every config of its table and sweep (prefill_config); the attention
kernels and the KV writers also over an e4m3 cache (kv_cache_dtype="fp8", FP8=True). With Triton 3.6
(the H200's) installed beside the venv's: ``pip install --target /tmp/t36 --no-deps triton==3.6.0`` and
``PYTHONPATH=/tmp/t36:$PWD``. Run from the repo root:

    env -u TRITON_INTERPRET python tests/kernels/sm90_compile_check.py [bf16 fp16 fp32]

Pointer and stride arguments are declared 16-divisible, as the JIT specialises them at run time for aligned
tensors; without that hint Triton cannot vectorise the cache loads and the numbers are meaningless.
"""
from __future__ import annotations

import itertools
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

from nanovllm.kernels import activation, ar_norm, fused_qkv, kvcache, moe, moe_routing, norm, rotary  # noqa: E402
from nanovllm.kernels import decode_attention as decode  # noqa: E402
from nanovllm.kernels import prefill_attention as prefill  # noqa: E402
from nanovllm.kernels.prefill_config import E4M3_TABLE, ORDERS, SWEEP, TABLE  # noqa: E402

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
             if sig[n] != "constexpr" and (sig[n].startswith("*") or (n.startswith("stride") and n != "stride_ss")
                                           or n in ("N", "inter", "K", "E", "H"))}  # stride_ss: Hkv (scales)
    t0 = time.time()
    k = triton.compile(ASTSource(fn, sig, constexprs=consts, attrs=attrs), target=TARGET, options=options)
    shown = {a: b for a, b in consts.items() if a in ("G", "BLOCK_M", "BLOCK_N", "HEAD_DIM", "BLOCK_SIZE",
                                                      "SPLIT", "BLOCK", "H", "HKV", "HAS_NORM", "BLOCK_K", "FP8")}
    print(f"  {fn.__name__:24s} {shown} warps={options.get('num_warps')} smem={k.metadata.shared} "
          f"{_resources(k.asm['cubin'])} ({time.time() - t0:.1f}s)")


def cache_types(dt: str, fp8: bool) -> dict:
    """K/V cache pointers (and KS/VS: an e4m3 cache's float32 scales, else the cache again) of the attention
    kernels and the KV writers (KC/VC, KS/VS or KSC/VSC)."""
    c = "fp8e4nv" if fp8 else dt
    s = "fp32" if fp8 else dt
    return {**{n: f"*{c}" for n in ("K", "V", "KC", "VC")}, **{n: f"*{s}" for n in ("KS", "VS", "KSC", "VSC")}}


def prefill_variant(cfg, D: int, G: int, bs: int, dt: str, prec, persistent: bool = False, fp8: bool = False):
    """Compile the varlen kernel for one TileConfig (TMA descriptors where the config and block size allow; over
    an e4m3 cache with fp8)."""
    g_pad = triton.next_power_of_2(G)
    hpp = g_pad if cfg.pack_gqa else 1
    tma = cfg.tma and bs % cfg.block_n == 0
    types = {**{n: f"*{dt}" for n in ("Q", "Out")}, **cache_types(dt, fp8), "CU": "*i32", "SEQ_LENS": "*i32",
             "BT": "*i32", "qk_scale": "fp32"}
    consts = dict(G=G, HPP=hpp, SLOTS_PER_KV=-(-G // hpp), BLOCK_Q=cfg.block_m // hpp, BLOCK_M=cfg.block_m,
                  BLOCK_N=cfg.block_n, HEAD_DIM=D, BLOCK_SIZE=bs, BLOCK_B=64, PERSISTENT=persistent,
                  ORDER=ORDERS.index(cfg.order), STAGES=cfg.num_stages, WS=cfg.warp_specialize and tma, PREC=prec,
                  UPCAST=False, USE_TMA=tma, FP8=fp8)
    if tma:
        types["KD"] = types["VD"] = f"tensordesc<{'fp8e4nv' if fp8 else dt}[{cfg.block_n}, {D}]>"
    else:
        consts["KD"] = consts["VD"] = None
    print(f"    {cfg.name}{' persistent' if persistent else ''}{' e4m3 cache' if fp8 else ''}")
    build(prefill._prefill_kernel, types, consts, num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def check_prefill_configs(dt: str) -> None:
    """Every config of the varlen kernel's table and sweep at the engine's block size, for head_dim 128 (GQA 4 and
    2) and 64, and the short-prompt config on the persistent grid (mixed-step graphs); on an e4m3 cache, every
    config at head_dim 128, GQA 4, and the table's choices for the other shapes."""
    from nanovllm.kernels._common import dot_precision
    prec = dot_precision(DTYPES[dt])
    configs = sorted({*TABLE.values(), *SWEEP}, key=lambda c: c.name)
    print(f"== varlen prefill configs, {dt}")
    for D, G in [(128, 4), (128, 2), (64, 4)]:
        for cfg in configs:
            prefill_variant(cfg, D, G, 256, dt, prec)
        prefill_variant(prefill.tile_config(D, G, 512, DTYPES[dt]), D, G, 256, dt, prec, persistent=True)
    print(f"== varlen prefill configs, {dt} queries over an e4m3 KV cache")
    for cfg in sorted({*configs, *E4M3_TABLE.values()}, key=lambda c: c.name):
        prefill_variant(cfg, 128, 4, 256, dt, prec, fp8=True)
    for D, G, mq in [(128, 2, 8192), (64, 4, 8192), (128, 8, 1)]:
        prefill_variant(prefill.tile_config(D, G, mq, DTYPES[dt], kv_fp8=True), D, G, 256, dt, prec, fp8=True)
    prefill_variant(prefill.tile_config(128, 4, 512, DTYPES[dt], kv_fp8=True), 128, 4, 256, dt, prec,
                    persistent=True, fp8=True)


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
        for splits, fp8 in itertools.product((1, 8), (False, True)):
            block_n, warps, stages = decode._decode_launch(D, dtype, fp8)
            build(decode._decode_kernel, {"Q": f"*{dt}", "Out": f"*{dt}", **cache_types(dt, fp8), "PART_O": "*fp32",
                                          "PART_LSE": "*fp32", "SEQ_LENS": "*i32", "ORDER": "*i32", "BT": "*i32",
                                          "qk_scale": "fp32"},
                  dict(G=G, BLOCK_G=max(16, g_pad), BLOCK_N=block_n, HEAD_DIM=D,
                       BLOCK_SIZE=bs, SPLIT=splits > 1, PREC=prec, UPCAST=False,
                       USE_ORDER=splits == 1, SKIP_EMPTY=splits == 8, FP8=fp8),
                  num_warps=warps, num_stages=stages)
        build(decode._decode_reduce_kernel, {"PART_O": "*fp32", "PART_LSE": "*fp32", "Out": f"*{dt}"},
              dict(SPLITS_PAD=32, HEAD_DIM=D, SKIP_EMPTY=True), num_warps=4)
    for fp8 in (False, True):
        build(kvcache._store_kvcache_kernel, {**cache_types(dt, fp8), "K": f"*{dt}", "V": f"*{dt}", "SLOTS": "*i64"},
              dict(BLOCK_SIZE=16, HEAD_DIM=128, D_PAD=128, BLOCK_H=8, FP8=fp8), num_warps=4)
    for has_res, group, fp8_out, qgroup in ((False, 1, False, 0), (True, 1, False, 0), (True, 8, False, 0),
                                            (True, 1, True, 0), (True, 1, True, 128)):
        y = "*fp8e4nv" if fp8_out else f"*{dt}"
        build(norm._rms_norm_kernel, {"X": f"*{dt}", "R": f"*{dt}", "W": f"*{dt}", "Y": y, "S": f"*{dt}",
                                      "YS": "*fp32", "eps": "fp32"},
              dict(HAS_RES=has_res, GROUP=group, BLOCK=4096, Y_DTYPE=norm._TL_DTYPES[DTYPES[dt]], FP8_OUT=fp8_out,
                   QGROUP=qgroup),
              num_warps=norm._fp8_num_warps(4096) if fp8_out else norm._num_warps(4096))
    build(ar_norm._two_rank_add_rms_norm_kernel, {"X": f"*{dt}", "P": f"*{dt}", "R": f"*{dt}", "W": f"*{dt}",
                                                  "Y": f"*{dt}", "S": f"*{dt}", "SIG_IN": "*i32", "SIG_OUT": "*i32",
                                                  "eps": "fp32"},
          dict(BLOCK=4096), num_warps=8)
    build(activation._silu_and_mul_kernel, {"X": f"*{dt}", "Y": f"*{dt}"}, dict(BLOCK=1024), num_warps=4)
    build(rotary._rotary_kernel, {"Q": f"*{dt}", "K": f"*{dt}", "QO": f"*{dt}", "KO": f"*{dt}", "POS": "*i64",
                                  "CS": "*fp32"},
          dict(HALF=64, HALF_PAD=64, BLOCK_H=32), num_warps=4)
    # Qwen3-0.6B (16/8 heads), Llama-3-8B (32/8), an odd head_dim; with and without QK-norm; Qwen3-0.6B on an
    # e4m3 cache
    for H, Hkv, D, has_norm, fp8 in [(16, 8, 128, True, False), (32, 8, 128, False, False), (12, 2, 80, True, False),
                                     (16, 8, 128, True, True)]:
        block_h, n_qb, _ = fused_qkv.launch_config(H, Hkv, D)
        build(fused_qkv._qkv_norm_rope_store_kernel,
              {"QKV": f"*{dt}", "POS": "*i64", "CS": "*fp32", "QW": f"*{dt}", "KW": f"*{dt}", "QO": f"*{dt}",
               **cache_types(dt, fp8), "SLOTS": "*i64", "eps": "fp32"},
              dict(H=H, HKV=Hkv, HEAD_DIM=D, HALF=D // 2, HALF_PAD=triton.next_power_of_2(D // 2), BLOCK_H=block_h,
                   NUM_QB=n_qb, BLOCK_SIZE=16, HAS_NORM=has_norm, FP8=fp8), num_warps=4)

    check_moe(dt)


def check_moe(dt: str) -> None:
    """The fused-MoE kernels at Qwen3-30B-A3B's shapes (E=128, top-8, H=2048, I=768), every tile of the default
    table (BLOCK_M >= 64 should show wgmma in the PTX)."""
    from nanovllm.kernels.moe_configs import DEFAULT_BUCKETS
    i32 = {n: "*i32" for n in ("IDS", "COUNTS", "RANKS", "OFFSETS", "BLOCK_EXPERT", "BLOCK_ROWS", "SORTED")}
    build(moe_routing._route_kernel, {"LOGITS": f"*{dt}", "WEIGHTS": "*fp32", **i32},
          dict(TOP_K=8, RENORM=True, COUNT=True, BLOCK_T=moe_routing.BLOCK_T, BLOCK_E=128, K_PAD=8),
          num_warps=4)
    build(moe_routing._scatter_kernel, i32, dict(BLOCK_M=32, BLOCK_P=moe_routing.BLOCK_P, BLOCK_E=128,
                                                 SCAN_C=moe_routing.SCAN_C, BLOCK_B=moe_routing.BLOCK_B),
          num_warps=4)
    build(moe._combine_kernel, {"P": f"*{dt}", "OUT": f"*{dt}"}, dict(TOP_K=8, BLOCK_H=1024), num_warps=4)
    # FP8 experts (weight-only): e4m3 weights with float32 scales (WS) per row, or per 128 x 128 tile (a block-FP8
    # checkpoint's: k-tiles of at most 128)
    for fp8, scale_block in ((False, 0), (True, 0), (True, 128)):
        w, ws = ("fp8e4nv", "fp32") if fp8 else (dt, dt)
        ptrs = {**i32, "X": f"*{w}" if fp8 else f"*{dt}", "XS": "*fp32" if fp8 else f"*{dt}", "W": f"*{w}",
                "WS": f"*{ws}", "OUT": f"*{dt}", "A": f"*{dt}", "TOPW": "*fp32"}
        for cfg in dict.fromkeys(c for _, c in DEFAULT_BUCKETS):
            for fn, tile in ((moe._gate_up_kernel, cfg.gate_up.fit(768, 2048, 1 if fp8 else DTYPES[dt].itemsize)),
                             (moe._down_kernel, cfg.down.fit(2048, 768, DTYPES[dt].itemsize))):
                if scale_block:
                    tile = tile.fit(tile.block_n, scale_block)
                gate_up_fp8 = fp8 and fn is moe._gate_up_kernel  # (e4m3 on both sides: no precision flag)
                consts = dict(BLOCK_M=cfg.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, EVEN_K=True,
                              UPCAST=False, PRECISION="ieee" if dt == "fp32" and not gate_up_fp8 else None, FP8=fp8,
                              SCALE_BN=scale_block, SCALE_BK=scale_block)
                if fn is moe._gate_up_kernel:
                    consts["TOP_K"] = 8
                build(fn, ptrs, consts, num_warps=tile.num_warps, num_stages=tile.num_stages)


if __name__ == "__main__":
    for name in sys.argv[1:] or ["bf16"]:
        check(name)
        if name != "fp32":
            check_prefill_configs(name)
    print("all kernels compiled for sm_90")
