"""The scripts in benchmarks/ still run on CPU: bench_offline's numbers and JSON line, the power monitor's
arithmetic (fake NVML), and train_tiny's build-train-save-load path (a few steps, small architecture)."""
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.append(os.path.join(ROOT, "benchmarks"))  # (after the installed packages: no shadowing)

import bench_offline  # noqa: E402
import train_tiny  # noqa: E402
from nvml import PowerMonitor  # noqa: E402

from nanovllm import LLM, SamplingParams  # noqa: E402


def test_bench_offline_small_workload(tiny_ckpt, tmp_path, capsys):
    path = tiny_ckpt("qwen3", vocab_size=10240)  # the workload's prompt ids go up to 10,000
    out, steps = tmp_path / "bench.jsonl", tmp_path / "steps.json"
    res = bench_offline.main(["--model", path, "--num-seqs", "3", "--max-input-len", "120", "--max-output-len", "105",
                              "--json", str(out), "--label", "cpu", "--step-log", str(steps), "--device", "cpu"])
    assert res["requests"] == 3 and res["output_tokens"] >= 3 * 100 and res["output_tok_s"] > 0
    assert res["label"] == "cpu" and res["device"] == "cpu" and res["achieved_GB_s"] > 0
    assert json.loads(out.read_text().splitlines()[-1]) == res
    rows = json.loads(steps.read_text())
    assert len(rows) == res["steps"] and sum(r[2] for r in rows) == res["prompt_tokens"] + res["output_tokens"] - 3
    assert "output tok/s" in capsys.readouterr().out


def test_bench_offline_copy_workload_with_speculation(tiny_ckpt, capsys):
    spec = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 3}'
    res = bench_offline.main(["--model", tiny_ckpt("qwen3"), "--workload", "copy", "--batch", "2", "--num-seqs", "3",
                              "--max-input-len", "60", "--max-output-len", "12", "--device", "cpu",
                              "--speculative-config", spec])
    assert res["workload"] == "copy" and res["requests"] == 3 and res["output_tokens"] == 3 * 12
    assert res["engine_args"]["max_num_seqs"] == 2 and res["spec_decode"]["num_drafts"] >= 0
    assert "mean acceptance length" in capsys.readouterr().out


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


def test_train_tiny_checkpoint_loads(tmp_path):
    path = train_tiny.train_copy_checkpoint(str(tmp_path / "m"), steps=2, device="cpu", batch_size=2, seq_len=64,
                                            log_every=1, **train_tiny.SMALL_ARCH)
    with open(os.path.join(path, train_tiny.META_FILE)) as f:
        meta = json.load(f)
    assert meta["steps"] == 2 and 0.0 <= meta["accuracy"] <= 1.0
    llm = LLM(path, device="cpu")
    prompts = train_tiny.copy_prompts(2, seed=0, max_len=40)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    assert [len(o["token_ids"]) for o in outs] == [4, 4]
