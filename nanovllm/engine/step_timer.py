"""Step diagnostics for benchmarks, off unless asked for through the environment.

``NANOVLLM_STEP_TIMING=<prefix>``: device-side timing of every step.

The runner records a CUDA event before a step's first device work and after its last. At shutdown it writes
``<prefix>.rank<r>.json``: one ``[start_ms, end_ms, seqs, tokens, is_decode]`` row per step, times relative
to the first step's start. A gap between one step's end and the next one's start is time this GPU had none
of our work queued: waiting for the host (scheduling, or under tensor parallelism the worker process that
launches the step). Recording costs two event records per step and no synchronization.
"""
from __future__ import annotations

import json
import os

import torch

ENV = "NANOVLLM_STEP_TIMING"
PROFILE_ENV = "NANOVLLM_PROFILE_STEPS"


class StepTimer:
    """``NANOVLLM_STEP_TIMING``: CUDA events around every step of this runner (see the module docstring)."""

    def __init__(self, prefix: str, rank: int):
        self.path = f"{prefix}.rank{rank}.json"
        self.rows: list[tuple] = []  # (start event, end event, seqs, tokens, is_decode)

    @classmethod
    def from_env(cls, device: torch.device, rank: int) -> StepTimer | None:
        prefix = os.environ.get(ENV)
        if not prefix or device.type != "cuda":
            return None
        return cls(prefix, rank)

    def start(self) -> torch.cuda.Event:
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        return e

    def end(self, start: torch.cuda.Event, seqs: int, tokens: int, is_decode: bool) -> None:
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        self.rows.append((start, e, seqs, tokens, is_decode))

    def write(self) -> None:
        """Wait for the device and write the file (called once, at shutdown)."""
        if not self.rows:
            return
        torch.cuda.synchronize()
        t0 = self.rows[0][0]
        out = [[round(t0.elapsed_time(a), 4), round(t0.elapsed_time(b), 4), n, t, d] for a, b, n, t, d in self.rows]
        with open(self.path, "w") as f:
            json.dump(out, f)
        self.rows = []


class StepProfiler:
    """``NANOVLLM_PROFILE_STEPS=<prefix>:<first>:<count>[:decode|:prefill][,...]``: torch.profiler over steps
    first .. first + count - 1 of this runner (counting only decode, or only prefill/mixed, steps when the
    kind is given), then ``<prefix>.rank<r>.txt`` gets the kernel table (by device time) and
    ``<prefix>.rank<r>.trace.json`` the timeline (Chrome trace format). Under tensor
    parallelism every rank profiles its own steps: the table shows one rank's GPU, collectives included."""

    def __init__(self, prefix: str, first: int, count: int, kind: str | None, rank: int):
        self.path = f"{prefix}.rank{rank}.txt"
        self.first, self.count, self.kind = first, count, kind
        self.seen = 0
        self.prof = None

    @classmethod
    def from_env(cls, device: torch.device, rank: int) -> list[StepProfiler]:
        """One profiler per comma-separated spec (each with its own prefix and kind)."""
        env = os.environ.get(PROFILE_ENV)
        if not env or device.type != "cuda":
            return []
        out = []
        for spec in env.split(","):
            parts = spec.split(":")
            if len(parts) not in (3, 4) or not parts[0] or not parts[1].isdigit() or not parts[2].isdigit() or \
                    int(parts[2]) < 1 or (len(parts) == 4 and parts[3] not in ("decode", "prefill")):
                raise ValueError(f"{PROFILE_ENV}: each spec must be <prefix>:<first step>:<steps>[:decode|:prefill], "
                                 f"got {spec!r}")
            out.append(cls(parts[0], int(parts[1]), int(parts[2]), parts[3] if len(parts) == 4 else None, rank))
        return out

    def _counts(self, is_decode: bool) -> bool:
        return self.kind is None or (self.kind == "decode") == is_decode

    def before(self, is_decode: bool) -> None:
        if self._counts(is_decode) and self.seen == self.first and self.prof is None:
            self.prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                           torch.profiler.ProfilerActivity.CUDA])
            self.prof.__enter__()

    def after(self, is_decode: bool) -> None:
        if not self._counts(is_decode):
            return
        self.seen += 1
        if self.prof is not None and self.seen == self.first + self.count:
            torch.cuda.synchronize()
            self.prof.__exit__(None, None, None)
            with open(self.path, "w") as f:
                f.write(f"{self.count} {self.kind or 'any'} steps from step {self.first} of that kind\n")
                f.write(self.prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=40))
            # the timeline too (kernel start/duration), for gaps between kernels
            self.prof.export_chrome_trace(self.path[:-len(".txt")] + ".trace.json")
            self.prof = None
