"""Driver-side cost of one tensor-parallel step (CPU, model-free workers): not a test, run by hand.

    OMP_NUM_THREADS=1 PYTHONPATH=. python tests/distributed/bench_tp_overhead.py [--old] [--steps 300]

A 256-sequence decode StepBatch (context ~1000 tokens, so 4 blocks of 256 / 63 blocks of 16 per sequence)
goes through a real TPExecutor (pipes, pickling, failure watch) whose workers run the real step loop
(`serve_steps`) over a stand-in runner: no model, an optional simulated device time per step (a queue:
launch returns at once, rank 0's result() waits until the device would be done). Reported:

* codec: pickling the StepMsg once, unpickling it (each worker), the Done(StepResult of 256 ids) both ways;
* sync:  `execute()` per step (= the old protocol's only mode): the whole round trip blocks the driver;
* async: the engine's pattern `h = launch(N+1); h_prev.result()`: what the driver thread spends in the
  executor per step;
* overlap: with a simulated device time per step and simulated driver host work per step (scheduling,
  building the batch, processing tokens), the step period sync vs async.

`--old`: run against a checkout of the previous executor (PYTHONPATH pointing at it first): its workers
are replaced by a stand-in speaking the old protocol (StepMsg -> Done(rank, result)); sync only.
"""
from __future__ import annotations

import argparse
import os
import pickle
import statistics
import time


def make_batch(n: int = 256, ctx: int = 1000, block_size: int = 256, step: int = 0, placeholders: bool = True):
    from nanovllm.engine.batch import SamplingBatch, StepBatch
    nb = -(-(ctx + 1) // block_size)
    tables = [[s * nb + j for j in range(nb)] for s in range(n)]
    slots = [tables[s][ctx // block_size] * block_size + ctx % block_size for s in range(n)]
    return StepBatch(input_ids=[0] * n, positions=[ctx] * n, slot_mapping=slots, cu_seqlens_q=list(range(n + 1)),
                     seq_lens=[ctx + 1] * n, block_tables=tables, max_seqlen_q=1, is_decode=True,
                     sample_rows=list(range(n)),
                     sampling=SamplingBatch(temperatures=[0.7] * n, top_ks=[50] * n, top_ps=[0.95] * n,
                                            min_ps=[0.0] * n, seeds=[(s * 2654435761) % (1 << 63) for s in range(n)],
                                            steps=[step] * n, logprobs=[None] * n),
                     placeholder_pos=list(range(n)) if placeholders else [],
                     placeholder_rows=list(range(n)) if placeholders else [])


def old_fake_worker(spec, conn):
    """The previous worker loop (StepMsg -> execute -> Done(rank, result)) over a model-free runner."""
    from nanovllm.distributed.protocol import Done, Ready, ShutdownMsg, decode_driver_message
    from nanovllm.engine.model_runner import StepResult
    device_time = float(os.environ.get("BENCH_DEVICE_TIME", "0"))
    conn.send(Ready(spec.rank, os.getpid(), 64, {}))
    while True:
        msg = decode_driver_message(conn.recv_bytes())
        if isinstance(msg, ShutdownMsg):
            break
        if device_time:
            time.sleep(device_time)
        n = len(msg.batch.sample_rows)
        conn.send(Done(spec.rank, StepResult(token_ids=list(range(n))) if spec.rank == 0 else None))
    conn.close()
    os._exit(0)


class _MinPending:
    def __init__(self, rank, n, ready_at):
        self.rank, self.n, self.ready_at = rank, n, ready_at
        self.event = self if rank == 0 else None

    def query(self) -> bool:
        return time.perf_counter() >= self.ready_at

    def result(self):
        from nanovllm.engine.model_runner import StepResult
        if self.rank != 0:
            return None
        delay = self.ready_at - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        return StepResult(token_ids=list(range(self.n)))


class _MinRunner:
    """As little work as old_fake_worker does, behind the new step loop; a device queue of `device_time`."""

    def __init__(self, rank, device_time):
        self.rank, self.device_time, self.free_at = rank, device_time, 0.0

    def launch(self, batch, prev=None):
        self.free_at = max(time.perf_counter(), self.free_at) + self.device_time
        return _MinPending(self.rank, len(batch.sample_rows), self.free_at)


def new_min_worker(spec, conn, device_time: float = 0.0):
    from nanovllm.distributed.protocol import Ready
    from nanovllm.distributed.worker import serve_steps
    conn.send(Ready(spec.rank, os.getpid(), 64, {}))
    serve_steps(conn, spec.rank, _MinRunner(spec.rank, device_time))
    conn.close()
    os._exit(0)


def _busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _config(model_dir: str):
    from nanovllm.config import EngineArgs, EngineConfig
    return EngineConfig.resolve(EngineArgs(model=model_dir, device="cpu", tensor_parallel_size=2,
                                           max_model_len=2048, max_num_seqs=256))


def _fmt(xs) -> str:
    xs = sorted(xs)
    return f"median {statistics.median(xs) * 1e6:7.0f} us   p90 {xs[int(0.9 * len(xs))] * 1e6:7.0f} us"


def codec(block_size: int) -> None:
    from nanovllm.distributed.protocol import StepMsg, encode
    from nanovllm.engine.model_runner import StepResult
    batch = make_batch(block_size=block_size)
    try:
        msg = StepMsg(batch, 0)
    except TypeError:  # the old protocol: StepMsg(batch)
        msg = StepMsg(batch)
    enc, dec = [], []
    for _ in range(200):
        t = time.perf_counter()
        data = encode(msg)
        enc.append(time.perf_counter() - t)
        t = time.perf_counter()
        pickle.loads(memoryview(data)[1:] if data[:1] != b"\x80" else data)  # new: a kind byte first
        dec.append(time.perf_counter() - t)
    res = StepResult(token_ids=list(range(100000, 100256)))
    rt = []
    for _ in range(200):
        t = time.perf_counter()
        pickle.loads(pickle.dumps(res, protocol=pickle.HIGHEST_PROTOCOL))
        rt.append(time.perf_counter() - t)
    print(f"  codec (block_size {block_size}, {len(data)} bytes): pickle StepMsg {_fmt(enc)} | "
          f"unpickle {_fmt(dec)} | Done result pickle+unpickle {_fmt(rt)}")


def run(old: bool, steps: int, model_dir: str, device_time: float, host_time: float) -> None:
    import functools

    import nanovllm.distributed.executor as ex_mod
    config = _config(model_dir)
    os.environ["BENCH_DEVICE_TIME"] = str(device_time)
    if old:
        ex_mod.worker_main = old_fake_worker  # the Process target is looked up at construction time
        ex = ex_mod.TPExecutor(config)
    else:
        ex = ex_mod.TPExecutor(config, worker_fn=functools.partial(new_min_worker, device_time=device_time))
    try:
        batch = make_batch()
        label = f"device {device_time * 1e3:.0f} ms, host {host_time * 1e3:.0f} ms"
        ex.execute(make_batch(placeholders=False))  # every later step's placeholders read the previous one
        for _ in range(20):
            ex.execute(batch)
        per, cpu, t0 = [], [], time.perf_counter()
        for _ in range(steps):
            _busy(host_time)
            t, c = time.perf_counter(), time.thread_time()
            ex.execute(batch)
            per.append(time.perf_counter() - t)
            cpu.append(time.thread_time() - c)
        period = (time.perf_counter() - t0) / steps
        print(f"  sync  execute()        [{label}]: driver blocked {_fmt(per)} | driver CPU {_fmt(cpu)} | "
              f"step period {period * 1e3:6.2f} ms")
        if old:
            return
        h = ex.launch(batch)
        for _ in range(20):
            nxt = ex.launch(batch, h)
            h.result()
            h = nxt
        per, cpu, t0 = [], [], time.perf_counter()
        for _ in range(steps):
            _busy(host_time)
            t, c = time.perf_counter(), time.thread_time()
            nxt = ex.launch(batch, h)
            h.result()
            per.append(time.perf_counter() - t)
            cpu.append(time.thread_time() - c)
            h = nxt
        period = (time.perf_counter() - t0) / steps
        h.result()
        print(f"  async launch+result()  [{label}]: driver blocked {_fmt(per)} | driver CPU {_fmt(cpu)} | "
              f"step period {period * 1e3:6.2f} ms")
    finally:
        ex.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--old", action="store_true")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--model", default=None, help="a checkpoint dir (config.json only is enough)")
    args = ap.parse_args()
    import nanovllm
    model = args.model
    if model is None:
        from nanovllm.utils.tiny_model import build_tiny_checkpoint
        model = build_tiny_checkpoint("/tmp/nanovllm-bench-tiny", "qwen3", overwrite=True)
    print(f"nanovllm from {os.path.dirname(nanovllm.__file__)}")
    codec(256)
    codec(16)
    run(args.old, args.steps, model, 0.0, 0.0)
    run(args.old, max(50, args.steps // 4), model, 0.008, 0.005)


if __name__ == "__main__":
    main()
