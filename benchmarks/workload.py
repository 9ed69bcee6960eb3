"""The reference offline workload (as in nano-vllm's bench.py): 256 requests, prompt and output lengths
uniform in [100, 1024], prompt ids uniform in [0, 10000], Python's `random` seeded with 0."""
from __future__ import annotations

from random import Random


def offline_workload(num_seqs: int = 256, max_input_len: int = 1024, max_output_len: int = 1024,
                     seed: int = 0) -> tuple[list[list[int]], list[int]]:
    rng = Random(seed)
    prompts = [[rng.randint(0, 10000) for _ in range(rng.randint(100, max_input_len))] for _ in range(num_seqs)]
    max_tokens = [rng.randint(100, max_output_len) for _ in range(num_seqs)]
    return prompts, max_tokens


if __name__ == "__main__":
    p, m = offline_workload()
    print(len(p), sum(map(len, p)), sum(m))  # 256 143_xxx 133_966
