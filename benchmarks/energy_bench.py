"""Energy per unit of work of the kernels a Qwen3-8B step is made of (needs CUDA and NVIDIA's NVML).

    python benchmarks/energy_bench.py [--seconds 2.0]

An 8B run on one H200 draws its full 700 W for the whole run, so its speed is set by the SM clock the GPU
holds under that cap (RESULTS run 19-20), that is by the energy each step spends. This prints, per kernel at
the workload's shapes, the time per call, the average power, the energy per call and per unit of work (per TB
read for attention, per TFLOP for GEMMs) and the median SM clock while it ran. Each case is a CUDA graph of
many calls replayed for ``--seconds``; energy comes from NVML's total-energy counter (mJ), read before and
after.

The cases:
* ``decode attention``: the engine's decode kernel over 256 (and 44) sequences of ~600-1,100 tokens, 32 query
  heads on 8 KV heads (Qwen3-8B), against a plain ``torch.sum`` over as many bytes (a stream with next to no math);
* ``GEMMs``: the four projections of a layer at 256 rows with 36 layers' own weights (as a step reads them),
  and the gate/up projection at 4,096 rows (a prefill chunk's rate).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from functools import partial

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from decode_layout import decode_case  # noqa: E402
from nvml import NVML  # noqa: E402

from nanovllm.kernels.attention import paged_decode_attention  # noqa: E402


def measure(nvml: NVML, name: str, fn, work: float, unit: str, seconds: float) -> None:
    """Replay a graph of `fn` calls for about `seconds`; print time, power and energy per call, the rate in
    T`unit`/s and the energy in J per T`unit` (`work` = `unit`s per call: bytes read or FLOPs)."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    per = max(time.perf_counter() - t0, 1e-5)
    reps = max(1, min(200, int(0.05 / per)))              # ~50 ms per replay
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    clocks = []
    e0, t0 = nvml.energy_mj(), time.perf_counter()
    n = 0
    while time.perf_counter() - t0 < seconds:
        graph.replay()
        n += 1
        if n % 2 == 0:
            clocks.append(nvml.sm_clock_mhz())  # the host runs ahead of the device: sampled while it works
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    dt, de = time.perf_counter() - t0, (nvml.energy_mj() - e0) / 1e3
    calls = n * reps
    us, watts, mj = dt / calls * 1e6, de / dt, de / calls * 1e3
    rate, per_unit = work / (dt / calls) / 1e12, de / (work * calls / 1e12)  # T<unit>/s, J per T<unit>
    mhz = statistics.median(clocks) if clocks else None
    print(f"{name:44s} {us:9.1f} us {rate:7.2f} T{unit}/s {watts:6.0f} W {mj:8.3f} mJ/call "
          f"{per_unit:7.2f} J/T{unit}  SM {mhz} MHz", flush=True)
    del graph


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=2.0)
    ns = ap.parse_args()
    nvml = NVML(torch.cuda.current_device())
    dev = "cuda"
    print(f"{torch.cuda.get_device_name()}: idle SM clock {nvml.sm_clock_mhz()} MHz", flush=True)
    for B in (256, 44):
        q, k, v, sl, bt, _, nbytes = decode_case(B, 600, 1100, 32)
        measure(nvml, f"decode attention {B} seqs ({nbytes / 1e6:.0f} MB)",
                partial(paged_decode_attention, q, k, v, sl, bt, 128 ** -0.5), nbytes, "B", ns.seconds)
        flat = torch.randn(nbytes // 2, device=dev, dtype=torch.bfloat16)
        measure(nvml, f"torch.sum over the same bytes ({B})", partial(torch.sum, flat, dtype=torch.float32), nbytes,
                "B", ns.seconds)
    H, L = 4096, 36
    shapes = {"qkv": (6144, H), "o": (H, H), "gate_up": (24576, H), "down": (H, 12288)}
    ws = {n: [torch.randn(s, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(L)] for n, s in shapes.items()}
    for M in (256,):
        xs = {n: torch.randn(M, s[1], device=dev, dtype=torch.bfloat16) for n, s in shapes.items()}
        for n, (N, K) in shapes.items():
            x, wl = xs[n], ws[n]
            out = torch.empty(M, N, device=dev, dtype=torch.bfloat16)

            def layers(x=x, wl=wl, out=out):
                for w in wl:
                    torch.mm(x, w.t(), out=out)
            measure(nvml, f"{n} GEMM x{L} layers, {M} rows", layers, 2 * M * N * K * L, "FLOP", ns.seconds)
    M = 4096
    x = torch.randn(M, H, device=dev, dtype=torch.bfloat16)
    out = torch.empty(M, 24576, device=dev, dtype=torch.bfloat16)
    w = ws["gate_up"][0]
    measure(nvml, f"gate_up GEMM, {M} rows", lambda: torch.mm(x, w.t(), out=out), 2 * M * 24576 * H, "FLOP",
            ns.seconds)


if __name__ == "__main__":
    main()
