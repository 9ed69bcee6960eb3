"""The scripts in benchmarks/ still run on CPU: bench_offline's numbers and JSON line, the power monitor's
arithmetic (fake NVML), train_tiny's build-train-save-load path (a few steps, small architecture), and
bench_sampling_features --host-only (the engine with a stand-in runner)."""
import json
import os
import sys
import time

import pytest
import torch

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


def test_bench_offline_rejects_bad_arguments_in_one_line(tiny_ckpt, tmp_path, capsys):
    """Lengths below the workload's own (its random lengths start at 100), no requests, a model that is not there
    or whose vocabulary the workload's ids overflow: an error message and a non-zero exit, not a traceback."""
    for args, match in [(["--max-input-len", "50"], "--max-input-len must be >= 100"),
                        (["--max-output-len", "5"], "--max-output-len must be >= 100"),
                        (["--num-seqs", "0"], "--num-seqs must be >= 1"),
                        (["--workload", "copy", "--batch", "0"], "--batch must be >= 1")]:
        with pytest.raises(SystemExit):
            bench_offline.main(["--model", tiny_ckpt("qwen3"), *args])
        assert match in capsys.readouterr().err
    with pytest.raises(SystemExit, match="bench_offline.py: error: .*does not exist"):
        bench_offline.main(["--model", str(tmp_path / "nope"), "--device", "cpu"])
    with pytest.raises(SystemExit, match="this model.s vocabulary has [0-9]+ tokens"):
        bench_offline.main(["--model", tiny_ckpt("qwen3"), "--num-seqs", "1", "--device", "cpu"])


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


def test_kernel_bench_attention_layouts():
    """kernel_bench's attention cases: the paged cache it builds for ours holds the dense tensors SDPA gets (the
    kernel, under the CPU interpreter, matches SDPA on equal fresh prompts and the reference on a chunk over a
    prefix), and its FLOP count is the causal triangle's."""
    import kernel_bench
    import torch.nn.functional as F

    from nanovllm.attention.torch_ref import paged_attention_ref
    from nanovllm.kernels.prefill_config import TileConfig
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    cfg = TileConfig(32, 32, 4, 2, tma=True)
    case = kernel_bench.AttentionCase("2 x 40", [(40, 0)] * 2, 4, 2, 16, device=dev, dtype=torch.float32)
    assert case.dense and case.bucket == "short" and case.flops == 2 * 4 * 4 * 16 * 40 * 40 / 2
    q, k, v = (t.transpose(1, 2) for t in (case.q, case.k, case.v))
    ref = case.reference_rows(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=case.scale,
                                                                      enable_gqa=True))
    torch.testing.assert_close(case.ours(cfg)().clone(), ref, atol=1e-5, rtol=1e-5)
    chunk = kernel_bench.AttentionCase("chunk", [(24, 300), (40, 0)], 4, 2, 16, device=dev, dtype=torch.float32)
    assert not chunk.dense and chunk.flops == 4 * 4 * 16 * (24 * 300 + 24 * 24 / 2 + 40 * 40 / 2)
    want = paged_attention_ref(chunk.q_flat, chunk.k_cache, chunk.v_cache, chunk.cu, chunk.seq_lens, chunk.bt,
                               chunk.scale, chunk.max_q)
    torch.testing.assert_close(chunk.ours(cfg)().clone(), want, atol=1e-5, rtol=1e-5)
    # --kv-cache-dtype fp8: our cache in e4m3 with its scales, SDPA on the dequantized values
    fp8 = kernel_bench.AttentionCase("chunk", [(24, 300), (40, 0)], 4, 2, 16, device=dev, dtype=torch.float32,
                                     kv_fp8=True)
    assert fp8.k_cache.dtype == torch.float8_e4m3fn and fp8.scales[0].shape == fp8.k_cache.shape[:3]
    assert not torch.equal(fp8.k, chunk.k) and torch.allclose(fp8.k, chunk.k, rtol=0.07, atol=1e-6)
    for x, cache, s in ((fp8.k, fp8.k_cache, fp8.scales[0]), (fp8.v, fp8.v_cache, fp8.scales[1])):
        deq = (cache.float() * s[..., None])[fp8.bt[0, :2].long()].reshape(-1, 2, 16)   # sequence 0: 324 tokens
        assert torch.equal(deq[:324], x[0, :324])
    want = paged_attention_ref(fp8.q_flat, fp8.k_cache, fp8.v_cache, fp8.cu, fp8.seq_lens, fp8.bt, fp8.scale,
                               fp8.max_q, k_scales=fp8.scales[0], v_scales=fp8.scales[1])
    torch.testing.assert_close(fp8.ours(cfg)().clone(), want, atol=1e-5, rtol=1e-5)
    with pytest.raises(SystemExit, match="usage"):
        kernel_bench.main(["nope"])
    kernel_bench.main(["--help"])          # the usage, and a normal return (exit status 0)


def test_kernel_bench_moe_sweep_block(monkeypatch):
    """kernel_bench moe's sweep of one block size over (weights, scales) copies, as bench_moe builds them: the
    layout, each GEMM's candidates and the layer with the winners run (the CPU interpreter on a tiny shape, two
    candidates a GEMM; the timer stands in for CUDA graphs) and the winner is the faster candidate."""
    import kernel_bench

    from nanovllm.kernels.moe_configs import GemmTile
    g = torch.Generator().manual_seed(0)
    E, H, inter, k, T = 4, 32, 16, 2, 6
    x = torch.randn(T, H, generator=g)
    logits = torch.randn(T, E, generator=g)
    weights, _ = kernel_bench.moe_route(logits, k, True)
    w13 = [(0.1 * torch.randn(E, 2 * inter, H, generator=g), None)]
    w2 = [(0.1 * torch.randn(E, H, inter, generator=g), None)]
    slow, fast = GemmTile(16, 16, 4, 2), GemmTile(32, 16, 4, 2)
    monkeypatch.setattr(kernel_bench, "tiles", lambda block_m, operands: [slow, fast])
    runs = []

    def seconds(fn, copies):
        runs.append(fn())
        return 1.0 if len(runs) % 2 else 0.5  # the second candidate of each GEMM is faster
    monkeypatch.setattr(kernel_bench, "_seconds", seconds)
    total, cfg, t_up, t_down, nb = kernel_bench.sweep_block(x, logits, weights, w13, w2, k, 16)
    assert cfg.block_m == 16 and cfg.gate_up == fast and cfg.down == fast and (t_up, t_down) == (0.5, 0.5)
    assert len(runs) == 5 and nb >= 1  # two candidates per GEMM, then the layer


@pytest.mark.parametrize("group", [None, 16])
def test_kernel_bench_fp8act_cases(group):
    """kernel_bench fp8act's two ways to quantize each activation (the plain kernel + the quantizer, and the fused
    kernel) give the same bytes (the CPU interpreter on a tiny shape)."""
    import kernel_bench
    cases = kernel_bench.fp8act_cases(48, 32, 3, "cpu", copies=2, group=group)
    assert set(cases) == {"add + RMSNorm", "SiLU-and-mul"}
    for two, one in cases.values():
        (q2, s2), (q1, s1) = two(), one()
        assert q1.dtype == torch.float8_e4m3fn and s1.shape == (3, 1 if group is None else q1.shape[1] // group)
        assert torch.equal(q1.view(torch.uint8), q2.view(torch.uint8)) and torch.equal(s1, s2)


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "e4m3"])
def test_kernel_bench_kvstore_call(monkeypatch, cache_dtype):
    """kernel_bench kvstore's timed call stores every token's K/V (the CPU interpreter on a tiny shape; the timer
    stands in for CUDA graphs and runs the ten calls once)."""
    import kernel_bench

    from nanovllm.kernels import fused_qkv
    stored = []
    real = fused_qkv.qkv_norm_rope_store

    def spy(*args, **kw):
        stored.append((args[6], args[7], kw["k_scales"]))
        return real(*args, **kw)
    monkeypatch.setattr(fused_qkv, "qkv_norm_rope_store", spy)

    def seconds(fn, reps):
        fn()
        return 2e-5
    monkeypatch.setattr(kernel_bench, "graph_seconds", seconds)
    assert kernel_bench.kvstore_us(4, 2, 5, cache_dtype, D=16, bs=4, device="cpu", cache_bytes=0) == pytest.approx(2.0)
    assert len(stored) == 10
    kc, vc, ks = stored[-1]
    assert kc.dtype == cache_dtype and kc.shape == (2, 4, 2, 16)      # 5 tokens: two blocks of 4 slots
    written = kc.view(torch.uint8).reshape(8, -1).ne(0).any(1).sum().item()
    assert written == 5 and (ks is None) == (cache_dtype == torch.bfloat16)


def test_fp8_gemm_bench_shapes_and_candidates():
    """fp8_gemm_bench's projections of Qwen3-8B and its candidate tilings (each pipeline within shared memory,
    no more rows per tile than the step has, at least 16)."""
    import fp8_gemm_bench
    shapes = fp8_gemm_bench.projections(os.path.join(ROOT, "benchmarks", "models", "qwen3-8b", "config.json"))
    assert shapes == {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}
    for rows in (1, 16, 64, 256):
        cands = fp8_gemm_bench.candidates(rows)
        assert cands and all(c.block_m <= max(16, rows) for c in cands)
        assert all((c.block_m + c.block_n) * c.block_k * c.num_stages <= 200 * 1024 for c in cands)


def test_prefill_heavy_workload_and_mode(tiny_ckpt, capsys):
    """The prefill-heavy workload: seeded, 64 prompts of 6,000-8,000 tokens with 64-256 outputs, and
    bench_offline's mode for it (its own max_model_len, prompt/output/total tok/s; the reference workload's length
    flags rejected). One request on the CPU."""
    import workload
    prompts, max_tokens = workload.prefill_heavy_workload()
    assert len(prompts) == 64 and (prompts, max_tokens) == workload.prefill_heavy_workload()
    assert all(6000 <= len(p) <= 8000 for p in prompts) and all(64 <= m <= 256 for m in max_tokens)
    assert workload.PREFILL_HEAVY_MAX_MODEL_LEN >= max(map(len, prompts)) + max(max_tokens)
    assert workload.offline_workload()[0][:3] == workload.offline_workload()[0][:3]  # the reference is unchanged
    path = tiny_ckpt("qwen3", vocab_size=10240, max_position_embeddings=9000)
    with pytest.raises(SystemExit):
        bench_offline.main(["--model", path, "--workload", "prefill-heavy", "--max-input-len", "100"])
    res = bench_offline.main(["--model", path, "--workload", "prefill-heavy", "--num-seqs", "1", "--device", "cpu"])
    assert res["workload"] == "prefill-heavy" and res["engine_args"]["max_model_len"] == 8256
    assert 6000 <= res["prompt_tokens"] <= 8000 and 64 <= res["output_tokens"] <= 256
    assert res["prompt_tok_s"] > 0 and res["total_tok_s"] > res["output_tok_s"]
    assert "prompt," in capsys.readouterr().out


def test_host_only_bench_runs_the_engine_on_its_masks(capsys):
    """bench_sampling_features.py --host-only: the engine (async scheduling) with a stand-in runner that draws each
    constrained row's token from the mask it was handed; it raises if any request broke its grammar. --phases adds
    the engine's parts per step, the grammar processes' wait among them, and puts every method back afterwards."""
    pytest.importorskip("xgrammar")
    import bench_sampling_features

    from nanovllm.engine import grammar_worker, llm_engine
    before = (llm_engine.build_step_batch, grammar_worker.GrammarProcess.collect)
    model = os.path.join(ROOT, "benchmarks", "models", "qwen3-0.6b")
    res = bench_sampling_features.main(["--model", model, "--host-only", "--rows", "16", "--tokens", "12",
                                        "--modes", "plain,json", "--rounds", "2", "--phases"])
    assert set(res) == {"plain", "json"} and all(v > 0 for v in res.values())
    plain, json_ = [line for line in capsys.readouterr().out.splitlines() if "phases" in line]
    assert "schedule" in plain and "build" in plain and "masks wait" not in plain
    assert "masks wait" in json_ and "deferred sample" in json_
    assert (llm_engine.build_step_batch, grammar_worker.GrammarProcess.collect) == before


def test_sampling_bench_rejects_zero_rounds(capsys):
    import bench_sampling_features
    model = os.path.join(ROOT, "benchmarks", "models", "qwen3-0.6b")
    with pytest.raises(SystemExit):
        bench_sampling_features.main(["--model", model, "--host-only", "--rounds", "0"])
    assert "--rounds must be at least 1, got 0" in capsys.readouterr().err


def test_kernel_bench_decode_rejects_zero_splits(capsys):
    import kernel_bench
    with pytest.raises(SystemExit):
        kernel_bench.main(["decode", "--splits", "0"])
    assert "--splits must be >= 1, got 0" in capsys.readouterr().err


def test_train_tiny_and_online_bench_reject_bad_arguments_in_one_line(tmp_path, monkeypatch, capsys):
    (tmp_path / "exists").mkdir()
    for args, match in [(["--batch-size", "0"], "--batch-size must be >= 1"),
                        (["--seq-len", "0"], "--seq-len must be >= 1"), (["--steps", "0"], "--steps must be >= 1")]:
        monkeypatch.setattr(sys, "argv", ["train_tiny.py", str(tmp_path / "m"), "--device", "cpu", *args])
        with pytest.raises(SystemExit):
            train_tiny.main()
        assert match in capsys.readouterr().err
    monkeypatch.setattr(sys, "argv", ["train_tiny.py", str(tmp_path / "exists"), "--device", "cpu"])
    with pytest.raises(SystemExit):
        train_tiny.main()
    assert "give --overwrite" in capsys.readouterr().err
    pytest.importorskip("httpx")
    import online_bench
    with pytest.raises(SystemExit, match="no server answers at http://127.0.0.1:1"):
        online_bench.main(["--url", "http://127.0.0.1:1", "--rates", "inf", "--output", str(tmp_path / "o.json")])
