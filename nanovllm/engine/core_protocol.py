"""The typed messages between the API server process and the engine-core process, and their wire format.

    API process -> engine core:  AddRequest, Abort, Shutdown
    engine core -> API process:  Ready (or StartupFailed) once, then StepOutputs (one per step, and one when the
                                 core goes idle), RequestsFailed, EngineDead (its last word before exiting)

The engine core reports token ids, never text: the API process detokenizes. A StepOutputs message holds every
sample the step advanced, as columns (request ids, the token each got, which of the request's n samples it is),
plus the few that finished and the logprobs asked for, so a step costs the core one message whatever the batch
size. A sequence that got several tokens in one step (accepted drafts of speculative decoding) has a row for each.

Wire format: one message per `Connection.send_bytes` (the pipe's own length-prefixed framing), encoded by
`marshal` as (tag, field values in declaration order). marshal is the standard library's serializer for built-in
values only (int, float, str, bytes, bool, None, tuple, list, dict, set): it is fast (C), refuses anything else
("unmarshallable object"), and loading it never builds arbitrary objects or runs code, unlike pickle. Both
processes run the same code, so the dataclasses below are the schema: there are no versions. Nested records
travel as tuples.

SamplingParams travel as their constructor arguments (`params_to_wire`), StructuredOutputsParams as a dict of its
fields; the engine core builds (and so validates) them again.

Sizes are bounded: an AddRequest carries one prompt (at most max_model_len tokens) and its engine requests; an
Abort at most MAX_IDS_PER_MESSAGE ids (larger sets are split); StepOutputs one row per token the step emitted (at
most max_num_seqs x (1 + the speculative tokens), with at most 20 top logprobs each). `recv` refuses anything over
MAX_MESSAGE_BYTES.
"""
from __future__ import annotations

import dataclasses
import marshal
from dataclasses import dataclass, field

from nanovllm.sampling_params import SamplingParams, StructuredOutputsParams

MAX_MESSAGE_BYTES = 64 << 20     # a 10M-token prompt still fits; recv_bytes refuses a longer message
MAX_IDS_PER_MESSAGE = 8192       # request ids per Abort / RequestsFailed (more are sent as several messages)


class ProtocolError(RuntimeError):
    """A message that is not one of this module's, or does not fit its type."""


# --- API process -> engine core ----------------------------------------------------------------------------
@dataclass(frozen=True)
class AddRequest:
    """One prompt and the engine requests sampling from it (usually one: its SamplingParams.n samples are one
    engine request). `params[i]` are request i's SamplingParams as `params_to_wire` gives them."""
    prompt_token_ids: list[int]
    request_ids: list[str]
    params: list[dict]


@dataclass(frozen=True)
class Abort:
    request_ids: list[str]


@dataclass(frozen=True)
class Shutdown:
    pass


# --- engine core -> API process ----------------------------------------------------------------------------
@dataclass(frozen=True)
class Ready:
    """The engine core is up: what the API process needs to know about the engine it talks to."""
    pid: int
    model_dir: str
    max_model_len: int
    vocab_size: int
    num_kvcache_blocks: int
    block_size: int
    device: str
    dtype: str
    tensor_parallel_size: int
    worker_pids: list[int]        # tensor-parallel worker processes (empty with one rank)
    startup_seconds: float


@dataclass(frozen=True)
class StartupFailed:
    exc_type: str                 # e.g. "ValueError" for a configuration error
    message: str
    traceback: str


@dataclass(frozen=True)
class EngineStats:
    """Counters and gauges of the engine (for /metrics and /health), as of the message that carries them."""
    num_running: int = 0
    num_waiting: int = 0
    num_free_blocks: int = 0
    num_blocks: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    num_preemptions: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0
    spec_decode: bool = False      # speculative decoding is on: the three counters below count
    spec_num_drafts: int = 0       # sequence-steps that verified draft tokens
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0

    @property
    def kv_usage(self) -> float:
        """Fraction of KV blocks held by live sequences."""
        return 1.0 - self.num_free_blocks / self.num_blocks if self.num_blocks else 0.0


@dataclass(frozen=True)
class Finished:
    """Row `index` of a StepOutputs finished (the last row of its sequence): finish_reason "stop" | "length" |
    "abort" (its token broke its grammar). `stop_reason` is the stop string or
    stop token id (None for EOS); after a stop string, `text_len` is the length of the output text, cut before it,
    in characters of the incremental detokenizer's text (engine/detokenizer.py), which the API process rebuilds."""
    index: int
    finish_reason: str
    stop_reason: str | int | None = None
    text_len: int | None = None


@dataclass(frozen=True)
class TokenLogprobs:
    """Row `index`'s token log-probability and the top alternatives asked for (SamplingParams.logprobs)."""
    index: int
    logprob: float
    top_ids: list[int]
    top_logprobs: list[float]


@dataclass(frozen=True)
class StepOutputs:
    """One engine step: row i is sample `samples[i]` of request `request_ids[i]`, which got token `token_ids[i]`
    (`samples` is empty when every row is sample 0, as without n > 1)."""
    request_ids: list[str]
    token_ids: list[int]
    finished: list[Finished] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    stats: EngineStats = field(default_factory=EngineStats)
    samples: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class RequestsFailed:
    """These requests are over: rejected on arrival (status 400, e.g. the engine's own validation) or failed while
    running (status 500: a step raised; the engine core dropped every request it held and carries on)."""
    request_ids: list[str]
    message: str
    status: int


@dataclass(frozen=True)
class EngineDead:
    """The engine core cannot go on (its executor failed) and exits after this message."""
    message: str


API_MESSAGES = (AddRequest, Abort, Shutdown)
CORE_MESSAGES = (Ready, StartupFailed, StepOutputs, RequestsFailed, EngineDead)
_TAGS = {cls: i for i, cls in enumerate(API_MESSAGES + CORE_MESSAGES)}
_CLASSES = {i: cls for cls, i in _TAGS.items()}
_FIELDS = {cls: tuple(f.name for f in dataclasses.fields(cls)) for cls in (*_TAGS, EngineStats)}


# --- SamplingParams ----------------------------------------------------------------------------------------
_PARAM_FIELDS = tuple(f.name for f in dataclasses.fields(SamplingParams) if f.init)


_STRUCTURED_FIELDS = tuple(f.name for f in dataclasses.fields(StructuredOutputsParams))


def params_to_wire(p: SamplingParams) -> dict:
    """A SamplingParams as its constructor arguments, built-in values only (StructuredOutputsParams as the dict of
    its fields that are set; logit_bias is {int: float} already); `params_from_wire` validates them again."""
    d = {name: getattr(p, name) for name in _PARAM_FIELDS}
    so = p.structured_outputs
    if so is not None:
        d["structured_outputs"] = {k: v for k in _STRUCTURED_FIELDS if (v := getattr(so, k)) is not None}
    return d


def params_from_wire(d: dict) -> SamplingParams:
    """The SamplingParams of `params_to_wire`'s dict (ValueError/TypeError if it is not a valid one)."""
    if not isinstance(d, dict):
        raise TypeError(f"sampling parameters must be a dict, got {type(d).__name__}")
    so = d.get("structured_outputs")
    if so is not None:
        if not isinstance(so, dict):
            raise TypeError(f"structured_outputs must be a dict, got {type(so).__name__}")
        d = {**d, "structured_outputs": StructuredOutputsParams(**so)}
    return SamplingParams(**d)


# --- encoding ----------------------------------------------------------------------------------------------
def encode(msg) -> bytes:
    cls = type(msg)
    tag = _TAGS.get(cls)
    if tag is None:
        raise TypeError(f"not an engine-core message: {cls.__name__}")
    if cls is StepOutputs:
        values = (msg.request_ids, msg.token_ids,
                  [(f.index, f.finish_reason, f.stop_reason, f.text_len) for f in msg.finished],
                  [(t.index, t.logprob, t.top_ids, t.top_logprobs) for t in msg.logprobs],
                  tuple(getattr(msg.stats, n) for n in _FIELDS[EngineStats]), msg.samples)
    else:
        values = tuple(getattr(msg, n) for n in _FIELDS[cls])
    data = marshal.dumps((tag, values))
    if len(data) > MAX_MESSAGE_BYTES:
        raise ValueError(f"{cls.__name__} message of {len(data)} bytes exceeds MAX_MESSAGE_BYTES={MAX_MESSAGE_BYTES}")
    return data


def decode(data: bytes, allowed: tuple[type, ...]):
    """A message of one of the `allowed` types (API_MESSAGES or CORE_MESSAGES), or ProtocolError."""
    try:
        tag, values = marshal.loads(data)
        cls = _CLASSES[tag]
        if cls not in allowed:
            raise ProtocolError(f"unexpected {cls.__name__} message")
        if cls is StepOutputs:
            ids, toks, fin, lps, stats, samples = values
            return StepOutputs(ids, toks, [Finished(*f) for f in fin], [TokenLogprobs(*t) for t in lps],
                               EngineStats(*stats), samples)
        return cls(*values)
    except ProtocolError:
        raise
    except (ValueError, TypeError, KeyError, EOFError) as e:
        raise ProtocolError(f"malformed engine-core message: {type(e).__name__}: {e}") from None


def send(conn, msg) -> None:
    conn.send_bytes(encode(msg))


def recv(conn, allowed: tuple[type, ...]):
    """The next message on `conn` (blocking); EOFError once the other end is closed."""
    return decode(conn.recv_bytes(MAX_MESSAGE_BYTES), allowed)


def chunks(ids: list[str], size: int = MAX_IDS_PER_MESSAGE):
    """`ids` in pieces of at most `size` (an Abort or RequestsFailed per piece)."""
    for i in range(0, len(ids), size):
        yield ids[i:i + size]
