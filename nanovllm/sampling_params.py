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


MAX_LOGPROBS = 20   # the most top tokens `logprobs` / `prompt_logprobs` may ask for (vLLM's default max_logprobs)
MAX_N = 128         # samples per request
_TOP_K_ALL = 2**31 - 1  # a top_k from here on keeps every token (the sampler's top_k is an int32)


def _check_int_list(name: str, value) -> list[int]:
    if not isinstance(value, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise TypeError(f"SamplingParams.{name} must be a list of ints, got {value!r}")
    if any(t < 0 for t in value):
        raise ValueError(f"SamplingParams.{name} must be token ids >= 0, got {list(value)}")
    return list(value)


@dataclass
class StructuredOutputsParams:
    """Constrain the output to a grammar (vLLM's names); exactly one of:

    json: a JSON schema (dict, or its text); json_object: any JSON object; regex: a regular expression;
    choice: one of these strings; grammar: an EBNF grammar (xgrammar's GBNF dialect, rule `root`).
    Compiled with xgrammar when the request is validated: a malformed one is a ValueError."""
    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def __post_init__(self):
        given = [k for k in ("json", "regex", "choice", "grammar", "json_object")
                 if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"StructuredOutputsParams needs exactly one of json, regex, choice, grammar or "
                             f"json_object, got {given or 'none'}")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise TypeError(f"StructuredOutputsParams.json must be a JSON schema (dict or str), got {self.json!r}")
        for k in ("regex", "grammar"):
            v = getattr(self, k)
            if v is not None and (not isinstance(v, str) or not v):
                raise ValueError(f"StructuredOutputsParams.{k} must be a non-empty string, got {v!r}")
        if self.choice is not None:
            if not isinstance(self.choice, (list, tuple)) or not self.choice or \
                    not all(isinstance(c, str) and c for c in self.choice):
                raise ValueError(f"StructuredOutputsParams.choice must be a non-empty list of non-empty strings, "
                                 f"got {self.choice!r}")
            self.choice = list(self.choice)
        if self.json_object is not None and not isinstance(self.json_object, bool):
            raise TypeError(f"StructuredOutputsParams.json_object must be a bool, got {self.json_object!r}")

    @property
    def kind(self) -> str:
        return next(k for k in ("json", "regex", "choice", "grammar", "json_object")
                    if getattr(self, k) not in (None, False))


@dataclass
class SamplingParams:
    """How to pick tokens for one request (vLLM's names and semantics).

    n: samples of the prompt (they share its KV blocks); with a `seed` s, sample i uses seed s + i.
    best_of: only None or n (vLLM V1 dropped best_of > n).
    temperature: 0 means greedy; otherwise logits are divided by it before sampling.
    top_k: keep the k most likely tokens (0 or -1: all). top_p: nucleus mass in (0, 1].
    min_p: drop tokens whose probability is below min_p times the most likely one's.
    presence_penalty / frequency_penalty: subtracted from a token's logit if it occurs in the output / times the
        number of times it does, in [-2, 2]. repetition_penalty: > 0; a logit of a token in the prompt or the
        output is divided by it if positive, multiplied by it otherwise (transformers' definition).
    logit_bias: {token id: bias} added to the logits (clamped to [-100, 100]).
    allowed_token_ids: only these tokens may be sampled. bad_words: strings never generated (each as the tokens
        it encodes to, with and without a leading space; a multi-token word's last token is banned when the
        output ends with the others).
    max_tokens: tokens to generate at most (None: up to the model's context length).
    min_tokens: EOS and stop_token_ids are held back until this many tokens exist.
    ignore_eos: keep going past EOS. stop: strings that end generation (left out of the text unless
        include_stop_str_in_output). stop_token_ids: extra token ids that end generation (included in token_ids,
        like EOS).
    seed: per-request seed; the same seed and prompt give the same tokens whatever else is batched.
    logprobs: return, per output token, the log-probabilities of the sampled token and of this many top tokens
        (0: only the sampled token's). prompt_logprobs: the same for every prompt token (the prompt is then not
        served from the prefix cache).
    skip_special_tokens: leave special tokens out of the returned text.
    structured_outputs: constrain the output to a JSON schema, regex, choice or grammar (StructuredOutputsParams).
    """
    n: int = 1
    best_of: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    structured_outputs: StructuredOutputsParams | None = None
    # normalized copies, filled in __post_init__
    stop_strings: tuple[str, ...] = field(init=False, repr=False)

    def __post_init__(self):
        self.verify()

    def verify(self) -> None:
        """Check every field and normalize the lists (idempotent): construction runs it, and the engine again on
        each request, so that fields changed after construction are checked too."""
        _check_type("n", self.n, (int,))
        _check_type("best_of", self.best_of, (int,), allow_none=True)
        for name in ("presence_penalty", "frequency_penalty", "repetition_penalty", "temperature", "top_p", "min_p"):
            _check_type(name, getattr(self, name), (int, float))
        _check_type("top_k", self.top_k, (int,))
        _check_type("max_tokens", self.max_tokens, (int,), allow_none=True)
        _check_type("min_tokens", self.min_tokens, (int,))
        _check_type("ignore_eos", self.ignore_eos, (bool,))
        _check_type("include_stop_str_in_output", self.include_stop_str_in_output, (bool,))
        _check_type("seed", self.seed, (int,), allow_none=True)
        _check_type("logprobs", self.logprobs, (int,), allow_none=True)
        _check_type("prompt_logprobs", self.prompt_logprobs, (int,), allow_none=True)
        _check_type("skip_special_tokens", self.skip_special_tokens, (bool,))
        if not 1 <= self.n <= MAX_N:
            raise ValueError(f"n must be in [1, {MAX_N}], got {self.n}")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError(f"best_of must be None or equal to n ({self.n}), got {self.best_of}: sampling more "
                             f"than n and keeping the best is not supported (vLLM V1 dropped it too)")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not (0.0 < self.repetition_penalty < float("inf")):
            raise ValueError(f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty}")
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
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and not (0 <= v <= MAX_LOGPROBS):
                raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}], got {v}")
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
            self.stop_token_ids = _check_int_list("stop_token_ids", self.stop_token_ids)
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = _check_int_list("allowed_token_ids", self.allowed_token_ids)
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids must not be empty (None: every token is allowed)")
        if self.bad_words is not None:
            if not isinstance(self.bad_words, (list, tuple)) or not all(isinstance(w, str) for w in self.bad_words):
                raise TypeError(f"SamplingParams.bad_words must be a list of strings, got {self.bad_words!r}")
            if any(not w.strip() for w in self.bad_words):
                raise ValueError(f"bad_words must not contain empty or blank strings, got {self.bad_words!r}")
            self.bad_words = list(self.bad_words)
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise TypeError(f"SamplingParams.logit_bias must be a dict of token id -> bias, "
                                f"got {self.logit_bias!r}")
            bias = {}
            for k, v in self.logit_bias.items():
                # token ids, or their decimal text (OpenAI's JSON has string keys): ASCII digits only
                if isinstance(k, int) and not isinstance(k, bool):
                    tid = k
                elif isinstance(k, str) and k.isascii() and k.isdigit():
                    tid = int(k)
                else:
                    tid = None
                if tid is None or tid < 0:
                    raise ValueError(f"logit_bias keys must be token ids >= 0, got {k!r}")
                if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v:
                    raise TypeError(f"SamplingParams.logit_bias values must be numbers, got {v!r} for {k!r}")
                bias[tid] = min(100.0, max(-100.0, float(v)))
            self.logit_bias = bias
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise TypeError(f"SamplingParams.structured_outputs must be StructuredOutputsParams, "
                            f"got {type(self.structured_outputs).__name__}")
        if self.top_k == -1 or self.top_k >= _TOP_K_ALL:  # at least every token of any vocabulary: all of them
            self.top_k = 0

    @property
    def uses_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0


@dataclass
class BeamSearchParams:
    """`LLM.beam_search`'s parameters (vLLM's names and defaults; ``nanovllm.beam_search`` has the algorithm).

    beam_width: beams kept per prompt (each step scores the top 2 * beam_width next tokens of every beam, so at
        most MAX_LOGPROBS / 2); max_tokens: tokens generated per beam; ignore_eos: an EOS token neither ends a beam
        nor is set apart; temperature: 0 scores the top tokens only, > 0 adds each beam's sampled token to its
        candidates; length_penalty: a beam's score is its cumulative logprob / its length ** length_penalty;
        include_stop_str_in_output: accepted for vLLM's scripts, no effect (a beam's text decodes all its tokens).
    """
    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self):
        for name, types in (("beam_width", (int,)), ("max_tokens", (int,)), ("ignore_eos", (bool,)),
                            ("temperature", (int, float)), ("length_penalty", (int, float)),
                            ("include_stop_str_in_output", (bool,))):
            v = getattr(self, name)
            if (isinstance(v, bool) and bool not in types) or not isinstance(v, types):
                raise TypeError(f"BeamSearchParams.{name} must be {' or '.join(t.__name__ for t in types)}, "
                                f"got {type(v).__name__} {v!r}")
        if not 1 <= self.beam_width <= MAX_LOGPROBS // 2:
            raise ValueError(f"beam_width must be in [1, {MAX_LOGPROBS // 2}], got {self.beam_width}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not (self.temperature >= 0.0) or self.temperature == float("inf"):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not (abs(self.length_penalty) < float("inf")):
            raise ValueError(f"length_penalty must be a finite number, got {self.length_penalty}")
