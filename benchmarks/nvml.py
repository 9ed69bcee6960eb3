"""GPU energy and SM clock from NVIDIA's NVML, through ctypes (no Python package needed: libnvidia-ml.so.1 only).

On one H200 the Qwen3-8B run draws the full 700 W for its whole length, so its speed follows the SM clock the
GPU holds under that cap (benchmarks/RESULTS.md). bench_offline.py records both with ``PowerMonitor``.
"""
from __future__ import annotations

import ctypes
import statistics
import threading
import time

NVML_CLOCK_SM = 1


class NVML:
    """The NVML calls the benchmarks need, for one GPU (found by the UUID torch reports for ``cuda_index``)."""

    def __init__(self, cuda_index: int = 0):
        self.lib = ctypes.CDLL("libnvidia-ml.so.1")
        self._check(self.lib.nvmlInit_v2(), "nvmlInit_v2")
        self.handle = ctypes.c_void_p()
        index = self._nvml_index(cuda_index)
        self._check(self.lib.nvmlDeviceGetHandleByIndex_v2(ctypes.c_uint(index), ctypes.byref(self.handle)),
                    "nvmlDeviceGetHandleByIndex_v2")

    @staticmethod
    def _check(rc: int, what: str) -> None:
        if rc != 0:
            raise RuntimeError(f"{what} failed with NVML code {rc}")

    def _nvml_index(self, cuda_index: int) -> int:
        """NVML numbers GPUs by PCI order, CUDA (by default) fastest first: match them by UUID."""
        import torch
        want = str(getattr(torch.cuda.get_device_properties(cuda_index), "uuid", ""))
        count = ctypes.c_uint()
        self._check(self.lib.nvmlDeviceGetCount_v2(ctypes.byref(count)), "nvmlDeviceGetCount_v2")
        buf = ctypes.create_string_buffer(96)
        for i in range(count.value):
            h = ctypes.c_void_p()
            if self.lib.nvmlDeviceGetHandleByIndex_v2(ctypes.c_uint(i), ctypes.byref(h)) != 0:
                continue
            if self.lib.nvmlDeviceGetUUID(h, buf, ctypes.c_uint(len(buf))) == 0 and want and \
                    buf.value.decode().removeprefix("GPU-") == want.removeprefix("GPU-"):
                return i
        return cuda_index

    def energy_mj(self) -> int:
        """Energy used since the driver loaded, in millijoules."""
        v = ctypes.c_ulonglong()
        self._check(self.lib.nvmlDeviceGetTotalEnergyConsumption(self.handle, ctypes.byref(v)),
                    "nvmlDeviceGetTotalEnergyConsumption")
        return v.value

    def sm_clock_mhz(self) -> int:
        v = ctypes.c_uint()
        self._check(self.lib.nvmlDeviceGetClockInfo(self.handle, ctypes.c_int(NVML_CLOCK_SM), ctypes.byref(v)),
                    "nvmlDeviceGetClockInfo")
        return v.value


class PowerMonitor:
    """Energy (J) of each listed GPU over a ``with`` block, and the median SM clock of samples every
    ``interval`` seconds. ``PowerMonitor.open(...)`` returns None where NVML is missing (no NVIDIA driver)."""

    def __init__(self, gpus: list[NVML], interval: float = 0.2):
        self.gpus, self.interval = gpus, interval
        self.clocks: list[list[int]] = [[] for _ in gpus]
        self.energy_j: list[float] = []
        self.seconds = 0.0
        self._stop = threading.Event()

    @classmethod
    def open(cls, cuda_indices: list[int], interval: float = 0.2) -> PowerMonitor | None:
        try:
            gpus = [NVML(i) for i in cuda_indices]
            for g in gpus:  # (a GPU without an energy counter fails here, not in the middle of a run)
                g.energy_mj()
                g.sm_clock_mhz()
            return cls(gpus, interval)
        except (OSError, RuntimeError, AttributeError):
            return None

    def _sample(self) -> None:
        while not self._stop.wait(self.interval):
            for g, c in zip(self.gpus, self.clocks):
                c.append(g.sm_clock_mhz())

    def __enter__(self) -> PowerMonitor:
        self._e0 = [g.energy_mj() for g in self.gpus]
        self._t0 = time.perf_counter()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.seconds = time.perf_counter() - self._t0
        self.energy_j = [(g.energy_mj() - e0) / 1e3 for g, e0 in zip(self.gpus, self._e0)]
        self._stop.set()
        self._thread.join()

    def summary(self) -> dict:
        """{"energy_J": total over the GPUs, "avg_power_W": per GPU, "sm_mhz_median": per GPU}."""
        s = max(self.seconds, 1e-9)
        return {"energy_J": round(sum(self.energy_j), 1),
                "avg_power_W": [round(e / s, 1) for e in self.energy_j],
                "sm_mhz_median": [statistics.median(c) if c else None for c in self.clocks]}
