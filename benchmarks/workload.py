"""The offline benchmark workloads, seeded with Python's `random`:

* "reference" (as in nano-vllm's bench.py, the number we report): 256 requests, prompt and output lengths uniform
  in [100, 1024], prompt ids uniform in [0, 10000], seed 0.
* "prefill-heavy" (long prompts, short outputs: RAG, long documents, agents with long histories): 64 requests,
  prompts uniform in [6,000, 8,000] tokens, outputs uniform in [64, 256], ids uniform in [0, 10000], seed 0; needs
  max_model_len >= 8,256. vLLM 0.26 on one H200 measured about 111,000 total tok/s on Qwen3-0.6B and 29,500 on
  Qwen3-8B for 64 prompts of 6-8k tokens.
"""
from __future__ import annotations

from random import Random

PREFILL_HEAVY = dict(num_seqs=64, min_input_len=6000, max_input_len=8000, min_output_len=64, max_output_len=256)
PREFILL_HEAVY_MAX_MODEL_LEN = PREFILL_HEAVY["max_input_len"] + PREFILL_HEAVY["max_output_len"]


def offline_workload(num_seqs: int = 256, max_input_len: int = 1024, max_output_len: int = 1024,
                     seed: int = 0) -> tuple[list[list[int]], list[int]]:
    rng = Random(seed)
    prompts = [[rng.randint(0, 10000) for _ in range(rng.randint(100, max_input_len))] for _ in range(num_seqs)]
    max_tokens = [rng.randint(100, max_output_len) for _ in range(num_seqs)]
    return prompts, max_tokens


def prefill_heavy_workload(num_seqs: int = PREFILL_HEAVY["num_seqs"], seed: int = 0) -> tuple[list[list[int]],
                                                                                                 list[int]]:
    p = PREFILL_HEAVY
    rng = Random(seed)
    prompts = [[rng.randint(0, 10000) for _ in range(rng.randint(p["min_input_len"], p["max_input_len"]))]
               for _ in range(num_seqs)]
    max_tokens = [rng.randint(p["min_output_len"], p["max_output_len"]) for _ in range(num_seqs)]
    return prompts, max_tokens


if __name__ == "__main__":
    p, m = offline_workload()
    print(len(p), sum(map(len, p)), sum(m))  # 256 143_xxx 133_966
    p, m = prefill_heavy_workload()
    print(len(p), sum(map(len, p)), sum(m))
