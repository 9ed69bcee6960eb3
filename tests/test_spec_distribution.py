"""Seeded sampling with speculative decoding has the model's token distribution: a chi-square goodness-of-fit test
of the first output tokens, sampled with n-gram drafts verified, against their exact probabilities from
transformers' logits; the same test passes without drafts, and the same seeds draw the same tokens either way.

Setup: the tiny random Qwen3, whose next token depends mostly on its last one, and a prompt made of its own greedy
text, so that a sampled token has often occurred in it before and the drafts (what followed it there) are often
accepted; temperature 1 and top_k = 3 (each position has 3 possible tokens: the first 4 output
tokens have at most 81 joint outcomes), 2,000 samples (seeds 0..1999). Outcomes with an expected count below 5
are pooled into one bin. The statistic is compared with the chi-square critical value at significance 1e-3 for
its degrees of freedom (the Wilson-Hilferty approximation, accurate to a fraction of a percent here): a correct
sampler fails this test once in a thousand runs of a different seed set; the seeds here are fixed, so it is
deterministic. (Verifying every draft with the noise of its sequence's first row instead of its own position, a
bug that keeps each position's marginal right, gives chi2 ~270 over 78 degrees of freedom against a critical value
of ~125; accepting a draft the sampler did not draw puts a sample outside the top-k.)
"""
from __future__ import annotations

import math
import random
from collections import Counter

import pytest
import torch

from nanovllm import LLM, SamplingParams

N, K_TOP, TOKENS = 2000, 3, 4
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2,
        "disable_by_batch_size": 256}  # (speculate at the test's batch of 256)


def chi2_critical(df: int, z: float = 3.0902) -> float:
    """Upper critical value of chi-square with df degrees of freedom; z: the standard normal quantile (3.09 for a
    significance of 1e-3). Wilson-Hilferty: (X / df)^(1/3) is close to normal with mean 1 - 2/(9 df)."""
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + z * math.sqrt(a)) ** 3


def exact_probabilities(model, prompt: list[int]) -> dict[tuple, float]:
    """P(first TOKENS output tokens) under temperature 1 and top_k K_TOP, from transformers' float32 logits:
    every outcome, enumerated level by level."""
    probs = {(): 1.0}
    for _ in range(TOKENS):
        prefixes = list(probs)
        ids = torch.tensor([prompt + list(p) for p in prefixes])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[:, -1].float()               # (P, V)
        top = logits.topk(K_TOP, dim=-1)
        p_top = torch.softmax(top.values, dim=-1)
        probs = {pre + (int(t),): probs[pre] * float(q)
                 for pre, ts, qs in zip(prefixes, top.indices, p_top) for t, q in zip(ts, qs)}
    return probs


def chi2(counts: Counter, probs: dict[tuple, float], n: int) -> tuple[float, int]:
    """The statistic and its degrees of freedom, outcomes with an expected count < 5 pooled into one bin."""
    big = [o for o, p in probs.items() if p * n >= 5]
    bins = [(counts[o], probs[o] * n) for o in big]
    rest_obs = n - sum(o for o, _ in bins)
    rest_exp = n - sum(e for _, e in bins)
    if rest_exp >= 1e-9:
        bins.append((rest_obs, rest_exp))
    assert sum(counts[o] for o in counts if o not in probs) == 0, "a sample outside the top-k"
    return sum((o - e) ** 2 / e for o, e in bins), len(bins) - 1


def _samples(llm: LLM, prompt: list[int], seeds) -> list[tuple]:
    params = [SamplingParams(temperature=1.0, top_k=K_TOP, seed=s, max_tokens=TOKENS, ignore_eos=True) for s in seeds]
    outs = llm.generate([prompt] * len(params), params, use_tqdm=False)
    return [tuple(o["token_ids"]) for o in outs]


@pytest.fixture(scope="module")
def setup(tiny_ckpt):
    """(checkpoint, speculating engine, prompt, exact probabilities of the outcomes): the prompt is the one of a few
    (8 random tokens and the model's 40 greedy tokens after them) whose drafts are accepted most often."""
    from transformers import AutoModelForCausalLM
    path = tiny_ckpt("qwen3")
    llm = LLM(path, device="cpu", max_num_seqs=256, speculative_config=SPEC)
    rng = random.Random(1)
    starts = [[rng.randrange(450) for _ in range(8)] for _ in range(6)]
    greedy = llm.generate(starts, SamplingParams(temperature=0.0, max_tokens=40), use_tqdm=False)
    rate = []
    for s, g in zip(starts, greedy):
        before = llm.engine.spec_metrics["num_accepted_tokens"]
        _samples(llm, s + g["token_ids"], range(N, N + 100))  # (other seeds than the test's)
        rate.append(llm.engine.spec_metrics["num_accepted_tokens"] - before)
    best = max(range(len(starts)), key=rate.__getitem__)
    prompt = starts[best] + greedy[best]["token_ids"]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return path, llm, prompt, exact_probabilities(model, prompt)


def test_speculative_sampling_keeps_the_distribution(setup):
    path, spec_llm, prompt, probs = setup
    assert abs(sum(probs.values()) - 1.0) < 1e-4
    before = spec_llm.engine.spec_metrics["num_accepted_tokens"]
    spec = _samples(spec_llm, prompt, range(N))
    accepted = spec_llm.engine.spec_metrics["num_accepted_tokens"] - before
    assert accepted > N // 5  # drafts were verified and often accepted
    stat, df = chi2(Counter(spec), probs, N)
    assert df >= 10 and stat < chi2_critical(df), f"chi2 {stat:.1f} over {df} degrees of freedom"
    plain = _samples(LLM(path, device="cpu", max_num_seqs=256), prompt, range(N))
    stat_plain, df_plain = chi2(Counter(plain), probs, N)
    assert stat_plain < chi2_critical(df_plain)
    # the same seeds draw the same tokens with drafts as without (up to a rare float-rounding near-tie)
    same = sum(a == b for a, b in zip(spec, plain))
    assert same >= N - 3, f"{N - same} of {N} samples differ"
    print(f"chi2 {stat:.1f} (without drafts {stat_plain:.1f}), {df} degrees of freedom, critical "
          f"{chi2_critical(df):.1f}; {accepted} drafts accepted; {same}/{N} samples identical")
