"""From an engine request's token ids to what its client reads: text deltas, logprobs, SSE chunks.

`ChoiceText` detokenizes one choice incrementally (engine/detokenizer.py, as the offline engine does for stop
strings) and holds back the tail that could be the start of a stop string; its final text is the offline result:
the whole output decoded at once, or, after a stop string, the incremental text cut where the engine core found
it. `Chunks` writes an OpenAI SSE chunk: the common case, a text delta without logprobs, from a prebuilt prefix
and suffix around the JSON-escaped text, the rest with json.dumps.
"""
from __future__ import annotations

import json
import math

from nanovllm.engine.detokenizer import IncrementalDetokenizer

SSE_DONE = b"data: [DONE]\n\n"


def finite(x: float) -> float:
    """JSON has no infinities: a -inf log-probability is sent as -9999.0."""
    return x if math.isfinite(x) else -9999.0


def sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class ChoiceText:
    """The text of one choice as its tokens arrive (`RequestState.token_ids`)."""

    def __init__(self, tokenizer, prompt_ids: list[int], params, incremental: bool):
        """`incremental`: detokenize as tokens arrive (streamed, or cut at a stop string); else decode once at the
        end."""
        self.tokenizer = tokenizer
        self.params = params
        self.hold = max((len(s) for s in params.stop_strings), default=1) - 1
        self.detok = IncrementalDetokenizer(tokenizer, prompt_ids, params.skip_special_tokens) \
            if tokenizer is not None and (incremental or params.stop_strings) else None
        self.consumed = 0          # tokens fed to the detokenizer
        self.sent = 0              # characters of text handed out

    def _feed(self, token_ids: list[int]) -> None:
        for t in token_ids[self.consumed:]:
            self.detok.add(t)
        self.consumed = len(token_ids)

    def delta(self, st) -> str:
        """Text not handed out yet for state `st` (a RequestState): all of the rest once it has finished."""
        if self.detok is None:
            return self.final(st) if st.finished else ""
        self._feed(st.token_ids)
        if st.finished:
            final = self.final(st)
            d = final[self.sent:] if len(final) > self.sent else ""
            self.sent = max(self.sent, len(final))
            return d
        end = len(self.detok.text) - self.hold
        if end > self.sent:
            d = self.detok.text[self.sent:end]
            self.sent = end
            return d
        return ""

    def final(self, st) -> str:
        """The finished choice's whole text, as the offline engine gives it."""
        if self.tokenizer is None:
            return ""
        if st.text_len is not None:   # cut before a stop string, in the incremental detokenizer's text
            self._feed(st.token_ids)
            return self.detok.text[:st.text_len]
        final = self.tokenizer.decode(st.token_ids, skip_special_tokens=self.params.skip_special_tokens)
        if self.detok is not None and not final.startswith(self.detok.text[:self.sent]):
            final = self.detok.text   # never contradict what was streamed
        return final


class TokenStrings:
    """Token id -> its text on its own (for logprobs), cached."""

    def __init__(self, tokenizer, limit: int = 1_000_000):
        self.tokenizer = tokenizer
        self.cache: dict[int, str] = {}
        self.limit = limit

    def __call__(self, tid: int, as_id: bool = False) -> str:
        if as_id or self.tokenizer is None:
            return f"token_id:{tid}"
        s = self.cache.get(tid)
        if s is None:
            try:
                s = self.tokenizer.decode([tid], skip_special_tokens=False)
            except Exception:  # noqa: BLE001 - an id past the tokenizer (padded vocabulary)
                s = ""
            if len(self.cache) < self.limit:
                self.cache[tid] = s
        return s


def completion_logprobs(entries, token_str, as_ids: bool, offset: int = 0) -> tuple[dict, int]:
    """/v1/completions' logprobs object for (token id, logprob, top ids, top logprobs) entries, and the text
    offset after them."""
    tokens, lps, tops, offsets = [], [], [], []
    for tok, lp, top_ids, top_lps in entries:
        s = token_str(tok, as_ids)
        tokens.append(s)
        lps.append(finite(lp))
        top = {token_str(t, as_ids): finite(v) for t, v in zip(top_ids, top_lps)}
        top.setdefault(s, finite(lp))
        tops.append(top)
        offsets.append(offset)
        offset += len(s)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}, offset


def chat_logprobs(entries, token_str, as_ids: bool) -> list[dict]:
    out = []
    for tok, lp, top_ids, top_lps in entries:
        s = token_str(tok, as_ids)
        out.append({"token": s, "logprob": finite(lp), "bytes": list(s.encode("utf-8")),
                    "top_logprobs": [{"token": (ts := token_str(t, as_ids)), "logprob": finite(v),
                                      "bytes": list(ts.encode("utf-8"))} for t, v in zip(top_ids, top_lps)]})
    return out


class Chunks:
    """SSE chunks of one streamed response (`kind`: "completion" or "chat")."""

    def __init__(self, kind: str, response_id: str, model: str, created: int, include_usage: bool):
        self.chat = kind == "chat"
        self.head = {"id": response_id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                     "created": created, "model": model}
        self.usage_field = {"usage": None} if include_usage else {}
        prefix = json.dumps(self.head, ensure_ascii=False)[:-1] + ',"choices":[{"index":'
        tail = (',"logprobs":null,"finish_reason":null' + ("" if self.chat else ',"stop_reason":null') + "}]"
                + (',"usage":null' if include_usage else "") + "}\n\n")
        self._prefix = "data: " + prefix
        self._text_key = ',"delta":{"content":' if self.chat else ',"text":'
        self._tail = ("}" if self.chat else "") + tail

    def text(self, index: int, text: str) -> str:
        """A plain text delta (no logprobs, not the last): the hot path."""
        return f"{self._prefix}{index}{self._text_key}{json.dumps(text, ensure_ascii=False)}{self._tail}"

    def choice(self, choice: dict) -> str:
        return sse({**self.head, "choices": [choice], **self.usage_field})

    def usage(self, usage: dict) -> str:
        return sse({**self.head, "choices": [], "usage": usage})
