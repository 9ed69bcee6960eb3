"""The public result types of `LLM.generate` / `LLM.chat`, shaped like vLLM's: `RequestOutput` (one per prompt)
holding one `CompletionOutput` per sample, and `Logprob`.

They are plain, picklable data. nano-vllm's dict-style access keeps working: `out["text"]`, `out["token_ids"]`,
`out["finish_reason"]`, ... read the first completion (see `RequestOutput.__getitem__`).
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """The log-probability of one token at one position, its rank in the distribution (1 = most likely) and its
    text. Log-probabilities are those of the model's raw logits (before penalties, biases, masks and temperature:
    vLLM's default `raw_logprobs`)."""
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# one position: token id -> Logprob; the sampled (or prompt) token is always there, plus the top `logprobs` ones
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    """One sample of a request."""
    index: int                                   # which of the request's `n` samples
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None             # sum of the sampled tokens' logprobs (None unless logprobs asked)
    logprobs: list[PositionLogprobs] | None      # one dict per output token (None unless logprobs asked)
    finish_reason: str | None = None             # "stop" | "length" | "abort"
    stop_reason: int | str | None = None         # the stop string or stop token id that ended it (None: EOS)

    def finished(self) -> bool:
        return self.finish_reason is not None


# dict-style keys of nano-vllm (and of this engine before RequestOutput): the first completion's fields
_LEGACY_KEYS = ("text", "token_ids", "finish_reason", "stop_reason", "logprobs", "prompt_token_ids", "request_id")


@dataclass
class RequestOutput:
    """The result of one prompt: its `n` samples in `outputs`, in index order."""
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[PositionLogprobs | None] | None   # None for the first prompt token (nothing predicts it)
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0                               # prompt tokens served by the prefix cache
    metrics: dict = field(default_factory=dict, repr=False)

    def __getitem__(self, key: str):
        """nano-vllm's dict access: `out["text"]`, `out["token_ids"]`, `out["finish_reason"]`, `out["stop_reason"]`
        and `out["logprobs"]` (vLLM's format) read the first completion; `out["prompt_token_ids"]` and
        `out["request_id"]` the request."""
        if key not in _LEGACY_KEYS:
            raise KeyError(f"{key!r} (RequestOutput keys: {', '.join(_LEGACY_KEYS)}; "
                           f"or use its attributes: outputs[i].text, ...)")
        if key in ("prompt_token_ids", "request_id"):
            return getattr(self, key)
        return getattr(self.outputs[0], key)

    def keys(self) -> tuple[str, ...]:
        return _LEGACY_KEYS

    def __contains__(self, key) -> bool:
        return key in _LEGACY_KEYS
