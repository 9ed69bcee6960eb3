"""Speculative decoding on the GPU: verification steps through the step CUDA graphs (several logits rows per
sequence) and the Triton kernels give the tokens of decoding without drafts, and drafts are accepted where the text
copies itself.

* float32, random weights, the mixed workload made self-repeating: greedy and seeded sampling identical with and
  without speculation, with some steps replayed from step graphs with more logits rows than sequences;
* bf16, the model trained on the copy task (clear margins): copy prompts' greedy answers identical (>= 98% of the
  sequences: bf16 logits of a differently shaped batch can flip a rare near-tie), most drafts accepted.
"""
import random

import pytest

from nanovllm import LLM, SamplingParams
from tests.gpu.engines import ARCH, MIXED_ENGINE, free_gpu, same_sequences

pytestmark = pytest.mark.gpu

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def repeating_workload(n: int = 24, seed: int = 0):
    """Prompts that repeat a short segment (the random model then often repeats too), varied lengths."""
    rng = random.Random(seed)
    prompts = [rng.sample(range(480), rng.randint(1, 12)) * rng.randint(2, 30) for _ in range(n)]
    greedy = [SamplingParams(temperature=0.0, max_tokens=rng.randint(8, 80), ignore_eos=True) for _ in prompts]
    sampled = [SamplingParams(temperature=0.7, seed=i, max_tokens=40, ignore_eos=True) for i in range(n)]
    return prompts, greedy, sampled


def _run(path, prompts, params, **kw):
    with LLM(path, **kw) as llm:
        graphs = llm.engine.runner.graphs
        keys = []
        find = graphs.find

        def spy(batch):
            key = find(batch)
            keys.append((key, batch.num_logits > batch.num_seqs))
            return key
        graphs.find = spy
        outs = [o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)]
        spec = llm.engine.spec_metrics
    free_gpu()
    return outs, spec, keys


def test_verification_steps_in_graphs_match_plain_decoding(tiny_ckpt):
    path = tiny_ckpt("qwen3", **ARCH)
    prompts, greedy, sampled = repeating_workload()
    for params in (greedy, sampled):
        plain, _, _ = _run(path, prompts, params, dtype="float32", **MIXED_ENGINE)
        spec, metrics, keys = _run(path, prompts, params, dtype="float32", speculative_config=SPEC, **MIXED_ENGINE)
        assert spec == plain, "speculative vs plain decoding: " + same_sequences(spec, plain)
        assert metrics["num_accepted_tokens"] > 0
        # verification steps (more logits rows than sequences) replayed step graphs
        assert any(key is not None and key[0] == "step" and multi for key, multi in keys)


def test_copy_model_bf16(trained_ckpt, capsys):
    import train_tiny  # (benchmarks/, on the path through tests/gpu/conftest.py)

    prompts = train_tiny.copy_prompts(32, seed=1, max_len=400)
    params = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
    kw = dict(dtype="bfloat16", max_model_len=640, gpu_memory_utilization=0.3, max_num_seqs=8)  # (<= 14 = 128 // 9)
    plain, _, _ = _run(trained_ckpt, prompts, params, **kw)
    spec_cfg = {"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    spec, metrics, _ = _run(trained_ckpt, prompts, params, speculative_config=spec_cfg, **kw)
    same = sum(a == b for a, b in zip(spec, plain))
    with capsys.disabled():
        print(f"\ncopy model, bf16: {same_sequences(spec, plain)}; {metrics}")
    assert same >= 0.98 * len(prompts)
    assert metrics["mean_acceptance_length"] >= 4.0
