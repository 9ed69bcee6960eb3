"""The energy accounting of benchmarks/ (RESULTS run 21): FLOPs per row, reading energy_bench's log, and the
power monitor's arithmetic with a fake NVML."""
import os
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.append(os.path.join(ROOT, "benchmarks"))  # (after the installed packages: no shadowing)

import energy_model  # noqa: E402
from nvml import PowerMonitor  # noqa: E402

from nanovllm.config import ModelConfig  # noqa: E402


def test_per_row_flops_qwen3_8b():
    cfg = ModelConfig.from_dir(os.path.join(ROOT, "benchmarks", "models", "qwen3-8b"))
    proj, head = energy_model.per_row_flops(cfg)
    H, L = 4096, 36
    assert proj == {"qkv": 2 * H * (32 + 16) * 128 * L, "o": 2 * H * H * L, "gate_up": 2 * H * 2 * 12288 * L,
                    "down": 2 * 12288 * H * L}
    assert head == 2 * H * 151936
    # ~2 x the 6.95 B parameters of the projections
    assert sum(proj.values()) == pytest.approx(13.9e9, rel=0.01)
    assert sum(proj.values()) + head == 2 * cfg.matmul_params()


@pytest.mark.parametrize("extra, message", [(["--reinit-uniform", "-1"], "positive number"),
                                            (["--reinit-uniform", "nan"], "positive number"),
                                            (["--reinit-uniform", "1e-3", "--tensor-parallel-size", "2"],
                                             "tensor_parallel_size=1")])
def test_bench_offline_rejects_bad_reinit_before_start_up(extra, message, capsys):
    import bench_offline
    with pytest.raises(SystemExit) as e:
        bench_offline.main(["--model", os.path.join(ROOT, "benchmarks", "models", "qwen3-0.6b"), *extra])
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_read_rates_from_a_recorded_log():
    log = os.path.join(ROOT, "benchmarks", "results", "2026-11-30-run21-call3-energy.log")
    kv, gemm = energy_model.read_rates(log)
    assert kv == 152.96
    assert gemm == {"qkv": 1.32, "o": 1.43, "gate_up": 1.15, "down": 1.37}


def test_read_rates_rejects_other_text(tmp_path):
    p = tmp_path / "x.log"
    p.write_text("decode attention 256 seqs (900 MB)  1 us  4 TB/s  600 W  1 mJ/call  150.00 J/TB\n")
    with pytest.raises(ValueError, match="256-row GEMM"):
        energy_model.read_rates(str(p))


class FakeGPU:
    def __init__(self, joules_per_read, mhz):
        self.mj, self.step, self.mhz = 0, joules_per_read * 1000, mhz

    def energy_mj(self):
        self.mj += self.step
        return self.mj

    def sm_clock_mhz(self):
        return self.mhz


def test_power_monitor_sums_gpus():
    mon = PowerMonitor([FakeGPU(5, 1500), FakeGPU(7, 1600)], interval=0.001)
    with mon:
        time.sleep(0.02)
    s = mon.summary()
    # each GPU's counter is read once at entry and once at exit: one step apart
    assert s["energy_J"] == 12.0
    assert len(s["avg_power_W"]) == 2 and s["avg_power_W"][0] < s["avg_power_W"][1]
    assert s["sm_mhz_median"] == [1500, 1600]
