"""Per-request sampling parameters, validated on construction (vLLM's names and defaults)."""
from __future__ import annotations

from dataclasses import dataclass, field


def _check_type(name: str, value, types: tuple, *, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    # bool is an int subclass; never accept it where a number is meant
    if isinstance(value, bool) and bool not in types:
        raise TypeError(f"SamplingParams.{name} must be {' or '.join(t.__name__ for t in types)}, got {value!r}")
    if not isinstance(value, types):
        raise TypeError(f"SamplingParams.{name} must be {' or '.join(t.__name__ for t in types)}, "
                        f"got {type(value).__name__} {value!r}")


@dataclass
class SamplingParams:
    """How to pick tokens for one request.

    temperature: 0 means greedy; otherwise logits are divided by it before sampling.
    top_k: keep the k most likely tokens (0 or -1: all). top_p: nucleus mass in (0, 1].
    min_p: drop tokens whose probability is below min_p times the most likely one's.
    max_tokens: tokens to generate at most (None: up to the model's context length).
    min_tokens: EOS and stop_token_ids are held back until this many tokens exist.
    ignore_eos: keep going past EOS. stop: strings that end generation (excluded from the text).
    stop_token_ids: extra token ids that end generation (included in token_ids, like EOS).
    seed: per-request seed; the same seed and prompt give the same tokens whatever else is batched.
    logprobs: also return the log-probability of each sampled token and of this many top tokens (0: only
        the sampled token's).
    skip_special_tokens: leave special tokens out of the returned text.
    """
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    max_tokens: int | None = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    logprobs: int | None = None
    skip_special_tokens: bool = True
    # normalized copies, filled in __post_init__
    stop_strings: tuple[str, ...] = field(init=False, repr=False)

    def __post_init__(self):
        _check_type("temperature", self.temperature, (int, float))
        _check_type("top_p", self.top_p, (int, float))
        _check_type("top_k", self.top_k, (int,))
        _check_type("min_p", self.min_p, (int, float))
        _check_type("max_tokens", self.max_tokens, (int,), allow_none=True)
        _check_type("min_tokens", self.min_tokens, (int,))
        _check_type("ignore_eos", self.ignore_eos, (bool,))
        _check_type("seed", self.seed, (int,), allow_none=True)
        _check_type("logprobs", self.logprobs, (int,), allow_none=True)
        _check_type("skip_special_tokens", self.skip_special_tokens, (bool,))
        if not (self.temperature >= 0.0) or self.temperature == float("inf"):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (disabled) or >= 1, got {self.top_k}")
        if not (0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if self.seed is not None and not (-(2**63) <= self.seed < 2**63):
            raise ValueError(f"seed must fit in 64 bits, got {self.seed}")
        if self.logprobs is not None and not (0 <= self.logprobs <= 20):
            raise ValueError(f"logprobs must be in [0, 20], got {self.logprobs}")
        stop = self.stop
        if stop is None:
            stops: tuple[str, ...] = ()
        elif isinstance(stop, str):
            stops = (stop,)
        elif isinstance(stop, (list, tuple)) and all(isinstance(s, str) for s in stop):
            stops = tuple(stop)
        else:
            raise TypeError(f"SamplingParams.stop must be a string or a list of strings, got {stop!r}")
        if any(s == "" for s in stops):
            raise ValueError("SamplingParams.stop must not contain an empty string")
        self.stop_strings = stops
        if self.stop_token_ids is not None:
            if not isinstance(self.stop_token_ids, (list, tuple)) or not all(
                    isinstance(t, int) and not isinstance(t, bool) for t in self.stop_token_ids):
                raise TypeError(f"SamplingParams.stop_token_ids must be a list of ints, got {self.stop_token_ids!r}")
            if any(t < 0 for t in self.stop_token_ids):
                raise ValueError(f"stop_token_ids must be >= 0, got {self.stop_token_ids}")
            self.stop_token_ids = list(self.stop_token_ids)
        if self.top_k == -1:
            self.top_k = 0
