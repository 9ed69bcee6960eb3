"""Two micro-measurements behind the 8B and TP=2 step times (GPU only).

    python benchmarks/comm_gemm_check.py gemm [cublaslt]  # cuBLAS time of Qwen3-8B's decode GEMMs vs batch rows
    python benchmarks/comm_gemm_check.py allreduce # 2 GPUs: all-reduce latency of one layer's (M, 4096) output

gemm: per linear layer of Qwen3-8B (TP=1 and the TP=2 shard), microseconds per call, TFLOP/s and weight GB/s,
and the sum over one decode step (36 layers + LM head).
allreduce: eager and CUDA-graph-captured all-reduce of a (M, 4096) bf16 tensor through NCCL, and through
torch's symmetric-memory one-shot / two-shot kernels (peer-to-peer loads over NVLink; no multicast) when
they are available; and the engine's two-shot + add/RMSNorm against the all-reduce fused into the norm kernel
(``SymmMemAllReduce.add_rms_norm_``), with the fused result's max difference from NCCL + norm.
"""
from __future__ import annotations

import os
import sys
from functools import partial

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

HID, INTER, H, HKV, D, LAYERS, VOCAB = 4096, 12288, 32, 8, 128, 36, 151936


def bench(fn, iters=50):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(iters):
            fn()
    g.replay()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(5):
        g.replay()
    e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e) * 1e3 / (5 * iters)  # us per call


def gemm():
    dev = "cuda"
    if len(sys.argv) > 2:  # e.g. cublaslt
        torch.backends.cuda.preferred_blas_library(sys.argv[2])
        print("preferred BLAS library:", torch.backends.cuda.preferred_blas_library())
    for tp in (1, 2):
        shapes = {"qkv": ((H + 2 * HKV) * D // tp, HID), "o": (HID, H * D // tp),
                  "gate_up": (2 * INTER // tp, HID), "down": (HID, INTER // tp)}
        print(f"--- TP={tp} shard (bf16, weight (N, K), x (M, K))")
        for M in (1, 16, 64, 128, 192, 256, 8192):
            tot = 0.0
            row = []
            for name, (N, K) in shapes.items():
                w = torch.randn(N, K, device=dev, dtype=torch.bfloat16) * 0.02
                x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
                out = torch.empty(M, N, device=dev, dtype=torch.bfloat16)
                us = bench(lambda x=x, w=w, out=out: torch.mm(x, w.t(), out=out), iters=20 if M > 1000 else 50)
                tot += us
                row.append(f"{name} {us:7.1f}us {2 * M * N * K / us / 1e6:5.0f}TF {N * K * 2 / us / 1e3:5.0f}GB/s")
            wh = torch.randn(VOCAB // tp, HID, device=dev, dtype=torch.bfloat16) * 0.02
            xh = torch.randn(min(M, 256), HID, device=dev, dtype=torch.bfloat16)
            head = bench(lambda xh=xh, wh=wh: torch.mm(xh, wh.t()), iters=20)
            print(f"M={M:5d} | " + " | ".join(row) + f" | step: {LAYERS * tot / 1e3:6.2f} ms + head {head:6.1f}us")


def _ar_worker(rank, world, port, q):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch.distributed as dist
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    lines = []
    group_name = dist.group.WORLD.group_name
    symm = None
    try:
        import torch.distributed._symmetric_memory as symm_mem
        buf = symm_mem.empty((8192, HID), dtype=torch.bfloat16, device="cuda")
        symm_mem.rendezvous(buf, group_name)
        symm = buf
    except Exception as e:  # noqa: BLE001 - report and go on with NCCL only
        lines.append(f"symm_mem unavailable: {type(e).__name__}: {e}")
    from nanovllm.distributed.symm_allreduce import SymmMemAllReduce
    from nanovllm.kernels.norm import add_rms_norm
    reducer = SymmMemAllReduce.maybe_create(dist.group.WORLD, rank, world, 8192 * HID, torch.bfloat16,
                                            torch.device("cuda", rank))
    lines.append(f"SymmMemAllReduce: {'none' if reducer is None else f'fuse_norm={reducer.fuse_norm}'}")
    for M in (1, 16, 64, 128, 256, 512, 2048, 8192):
        x = torch.randn(M, HID, device="cuda", dtype=torch.bfloat16)
        y = x.clone()  # (the repeated sums overflow it; x stays)
        res = {"nccl": bench(lambda y=y: dist.all_reduce(y), iters=72)}
        if symm is not None:
            v = symm[:M]
            v.copy_(x)
            out = torch.empty_like(x)
            ops = torch.ops.symm_mem
            for name, fn in (("one_shot", partial(ops.one_shot_all_reduce_out, v, "sum", group_name, out)),
                             ("two_shot", partial(ops.two_shot_all_reduce_, v, "sum", group_name))):
                try:
                    res[name] = bench(fn, iters=72)
                except Exception as e:  # noqa: BLE001
                    res[name] = f"{type(e).__name__}: {str(e)[:120]}"
            # correctness of one-shot against NCCL
            try:
                v.copy_(x)
                ref = x.clone()
                dist.all_reduce(ref)
                torch.ops.symm_mem.one_shot_all_reduce_out(v, "sum", group_name, out)
                torch.cuda.synchronize()
                res["one_shot_max_err"] = float((out.float() - ref.float()).abs().max())
            except Exception as e:  # noqa: BLE001
                res["one_shot_max_err"] = f"{type(e).__name__}"
        if reducer is not None and M <= 8192:
            # the engine's path: two-shot in the buffer then the add + RMSNorm kernel, vs both fused in one kernel
            t = reducer.buffer((M, HID), torch.bfloat16)
            resid = torch.randn(M, HID, device="cuda", dtype=torch.bfloat16)
            w = torch.randn(HID, device="cuda", dtype=torch.bfloat16)
            t.copy_(x)
            res["twoshot+norm"] = bench(lambda t=t, r=resid, w=w: add_rms_norm(reducer.all_reduce_(t), r, w, 1e-6),
                                        iters=72)
            t.copy_(x)
            if reducer.fuse_norm:
                res["fused"] = bench(lambda t=t, r=resid, w=w: reducer.add_rms_norm_(t, r, w, 1e-6), iters=72)
                default = reducer.programs
                for progs in (512, 1024) if M > 256 else ():  # more programs: more peer loads in flight
                    reducer.programs = progs
                    res[f"fused/{progs}"] = bench(lambda t=t, r=resid, w=w: reducer.add_rms_norm_(t, r, w, 1e-6),
                                                  iters=72)
                reducer.programs = default
                got = reducer.add_rms_norm_(t, resid, w, 1e-6)
                ref_sum = x.clone()
                dist.all_reduce(ref_sum)
                want = add_rms_norm(ref_sum, resid, w, 1e-6)
                torch.cuda.synchronize()
                res["fused_max_err"] = max(float((g.float() - h.float()).abs().max()) for g, h in zip(got, want))
        parts = [f"{k} {r:.1f}us" if isinstance(r, float) and "err" not in k else f"{k} {r}"
                 for k, r in res.items()]
        lines.append(f"M={M:5d} ({M * HID * 2 / 1e6:6.2f} MB): " + ", ".join(parts))
    if rank == 0:
        q.put("\n".join(lines))
    dist.barrier()
    dist.destroy_process_group()


def allreduce():
    import socket

    import torch.multiprocessing as mp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_ar_worker, args=(r, 2, port, q)) for r in range(2)]
    for p in procs:
        p.start()
    print(q.get(timeout=300))
    for p in procs:
        p.join(60)


if __name__ == "__main__":
    {"gemm": gemm, "allreduce": allreduce}[sys.argv[1]]()
