"""How much faster than torch's GEMM is the best of cuBLASLt's candidate algorithms at decode row counts?
(needs CUDA)

    python benchmarks/cublaslt_search.py [--rows 128,192,256,384,512] [--algos 64]

torch picks cuBLASLt's first heuristic algorithm (or cuBLAS's own choice); cuBLASLt can return a ranked list
of candidates (tile shapes, split-K, stream-K...). This asks for up to ``--algos`` of them through ctypes for
each of Qwen3-8B's four projections and times each candidate over 36 layers' weights in a CUDA graph (as the
engine's GEMM plan times its candidates), against torch.mm under both BLAS preferences.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from nanovllm.engine.gemm_plan import graph_seconds  # noqa: E402

CUDA_R_16BF, CUDA_R_32F, COMPUTE_32F = 14, 0, 68
DESC_TRANSA, DESC_TRANSB = 3, 4
PREF_MAX_WORKSPACE = 1
OP_N, OP_T = 0, 1


class HeuristicResult(ctypes.Structure):
    _fields_ = [("algo", ctypes.c_uint64 * 8), ("workspace", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


def load_cublaslt():
    torch.mm(torch.ones(8, 8, device="cuda"), torch.ones(8, 8, device="cuda"))  # make torch load its cuBLAS(Lt)
    with open("/proc/self/maps") as f:
        paths = {line.split()[-1] for line in f if "libcublasLt" in line}
    if not paths:
        raise RuntimeError("libcublasLt is not loaded in this process")
    return ctypes.CDLL(sorted(paths)[0])


class Lt:
    def __init__(self, workspace_bytes=32 << 20):
        self.lib = load_cublaslt()
        self.handle = ctypes.c_void_p()
        self._ok(self.lib.cublasLtCreate(ctypes.byref(self.handle)), "cublasLtCreate")
        self.ws = torch.empty(workspace_bytes, dtype=torch.uint8, device="cuda")
        self.alpha, self.beta = ctypes.c_float(1.0), ctypes.c_float(0.0)

    @staticmethod
    def _ok(status, what):
        if status != 0:
            raise RuntimeError(f"{what} failed with cuBLAS status {status}")

    def _layout(self, rows, cols, ld):
        lay = ctypes.c_void_p()
        self._ok(self.lib.cublasLtMatrixLayoutCreate(ctypes.byref(lay), CUDA_R_16BF, ctypes.c_uint64(rows),
                                                     ctypes.c_uint64(cols), ctypes.c_int64(ld)), "layout")
        return lay

    def problem(self, M, N, K):
        """y (M, N) = x (M, K) @ w (N, K).T in row-major, i.e. column-major y^T = w^T(op T) x^T."""
        desc = ctypes.c_void_p()
        self._ok(self.lib.cublasLtMatmulDescCreate(ctypes.byref(desc), COMPUTE_32F, CUDA_R_32F), "desc")
        for attr, val in ((DESC_TRANSA, OP_T), (DESC_TRANSB, OP_N)):
            v = ctypes.c_int32(val)
            self._ok(self.lib.cublasLtMatmulDescSetAttribute(desc, attr, ctypes.byref(v), ctypes.c_size_t(4)),
                     "desc attr")
        a, b, c = self._layout(K, N, K), self._layout(K, M, K), self._layout(N, M, N)
        return desc, a, b, c

    def candidates(self, prob, count):
        desc, a, b, c = prob
        pref = ctypes.c_void_p()
        self._ok(self.lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "pref")
        ws = ctypes.c_uint64(self.ws.numel())
        self._ok(self.lib.cublasLtMatmulPreferenceSetAttribute(pref, PREF_MAX_WORKSPACE, ctypes.byref(ws),
                                                             ctypes.c_size_t(8)), "pref attr")
        res = (HeuristicResult * count)()
        n = ctypes.c_int(0)
        self._ok(self.lib.cublasLtMatmulAlgoGetHeuristic(self.handle, desc, a, b, c, c, pref, count, res,
                                                          ctypes.byref(n)), "heuristic")
        return [res[i] for i in range(n.value) if res[i].state == 0]

    def matmul(self, prob, cand, x, w, y):
        desc, a, b, c = prob
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        self._ok(self.lib.cublasLtMatmul(self.handle, desc, ctypes.byref(self.alpha), ctypes.c_void_p(w.data_ptr()),
                                         a, ctypes.c_void_p(x.data_ptr()), b, ctypes.byref(self.beta),
                                         ctypes.c_void_p(y.data_ptr()), c, ctypes.c_void_p(y.data_ptr()), c,
                                         ctypes.byref(cand.algo), ctypes.c_void_p(self.ws.data_ptr()),
                                         ctypes.c_size_t(self.ws.numel()), stream), "matmul")


SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="128,192,256,320,384,512")
    ap.add_argument("--algos", type=int, default=64)
    ap.add_argument("--layers", type=int, default=36)
    a = ap.parse_args()
    lt = Lt()
    torch.manual_seed(0)
    print("us per layer (36 layers' weights in one CUDA graph); best Lt candidate vs torch default / cublaslt")
    tot = {}
    for name, (N, K) in SHAPES.items():
        ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(a.layers)]
        for M in (int(r) for r in a.rows.split(",")):
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            y = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
            ref = torch.mm(x, ws[0].t()).float()

            def lib(name_, x=x, y=y, ws=ws):
                def fn():
                    prev = torch.backends.cuda.preferred_blas_library()
                    torch.backends.cuda.preferred_blas_library(name_)
                    try:
                        for w in ws:
                            torch.mm(x, w.t(), out=y)
                    finally:
                        torch.backends.cuda.preferred_blas_library(prev)
                return fn
            t_cublas = graph_seconds(lib("cublas")) / a.layers * 1e6
            t_lt = graph_seconds(lib("cublaslt")) / a.layers * 1e6
            prob = lt.problem(M, N, K)
            cands = lt.candidates(prob, a.algos)
            best, best_i, times = float("inf"), -1, []
            for i, cand in enumerate(cands):
                try:
                    lt.matmul(prob, cand, x, ws[0], y)
                    torch.cuda.synchronize()
                    err = (y.float() - ref).abs().max().item()
                    run = lambda p=prob, c=cand, x=x, y=y, ws=ws: [lt.matmul(p, c, x, w, y) for w in ws]  # noqa: E731
                    t = graph_seconds(run) / a.layers * 1e6
                except RuntimeError as e:
                    times.append(f"#{i}:fail")
                    print(f"  candidate {i}: {e}")
                    continue
                if err > 0.05 * ref.abs().max().item():
                    times.append(f"#{i}:WRONG")
                    continue
                times.append(f"{t:.1f}")
                if t < best:
                    best, best_i = t, i
            flops = 2 * M * N * K
            base = min(t_cublas, t_lt)
            tot.setdefault(M, [0.0, 0.0])
            tot[M][0] += base
            tot[M][1] += min(base, best)
            print(f"{name:8s} M={M:4d}: cublas {t_cublas:6.1f} lt {t_lt:6.1f} | best of {len(cands)} Lt candidates "
                  f"#{best_i} {best:6.1f} us ({flops / best / 1e6:5.0f} TFLOP/s, {base / best:4.2f}x) "
                  f"[{' '.join(times[:12])}]", flush=True)
    for M, (b, c) in tot.items():
        print(f"M={M}: four projections per layer {b:.1f} us (best library) -> {c:.1f} us with the search "
              f"({b / c:.3f}x); per 36-layer step {36 * (b - c) / 1e3:.3f} ms saved")


if __name__ == "__main__":
    main()
