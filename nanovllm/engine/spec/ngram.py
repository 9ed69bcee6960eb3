"""N-gram (prompt lookup) proposer: drafts copied from what followed an earlier occurrence of the sequence's tail.

For a history h of L tokens (prompt and output, the last one just sampled), find the longest n in
[prompt_lookup_min, prompt_lookup_max] for which the tail h[L-n:] occurred earlier in h, take its latest earlier
occurrence, ending at position p < L - 1, and propose the tokens that followed it: h[p+1], h[p+2], ... (k of them).
When fewer than k follow (p is close to the end, as in a short repeating pattern), the proposal continues the
same pattern: the tokens after p are repeated, as the matched occurrence would go on if the sequence keeps
repeating itself.

Vectorized, no Python loop over the history: the candidate positions are where the last token occurred before
(one comparison over the history), then each candidate's match is extended backwards one position at a time for
up to prompt_lookup_max positions, all candidates at once. A few numpy calls per sequence: microseconds for
histories of thousands of tokens.
"""
from __future__ import annotations

import numpy as np


def longest_match(h: np.ndarray, n_min: int, n_max: int) -> int:
    """End position p < len(h) - 1 of the latest earlier occurrence of the longest tail of h of length in
    [n_min, n_max], or -1 if none (h: 1-D int array)."""
    L = h.shape[0]
    if L < 2 or n_min > L - 1:
        return -1
    cand = np.flatnonzero(h[:L - 1] == h[L - 1])                 # occurrences of the last token before it
    if cand.size == 0:
        return -1
    length = np.ones(cand.size, dtype=np.int64)                  # matched tail length at each candidate
    alive = np.ones(cand.size, dtype=bool)
    for j in range(1, min(n_max, L - 1)):
        q = cand - j
        ok = alive & (q >= 0)
        ok[ok] = h[q[ok]] == h[L - 1 - j]
        if not ok.any():
            break
        length += ok
        alive = ok
    best = int(length.max())
    if best < n_min:
        return -1
    return int(cand[np.flatnonzero(length == best)[-1]])


class NgramProposer:
    """Prompt lookup (module docstring): up to k drafts per sequence."""

    def __init__(self, k: int, n_min: int, n_max: int):
        if not 1 <= n_min <= n_max or k < 1:
            raise ValueError(f"need k >= 1 and 1 <= n_min <= n_max, got k={k}, n_min={n_min}, n_max={n_max}")
        self.k, self.n_min, self.n_max = k, n_min, n_max

    def propose(self, histories: list[np.ndarray], max_drafts: list[int]) -> list[list[int]]:
        out = []
        for h, m in zip(histories, max_drafts):
            p = longest_match(h, self.n_min, self.n_max)
            if p < 0:
                out.append([])
                continue
            follow = h[p + 1:]                                   # 1 <= len(follow) <= L - 1
            out.append(np.resize(follow, min(self.k, m)).tolist())  # repeats `follow` when it is shorter
        return out
