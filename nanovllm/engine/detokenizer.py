"""Incremental detokenization: text deltas as tokens arrive, for stop strings and streaming.

Decoding a suffix of token ids on its own can differ from the same tokens decoded in context (a leading
space swallowed, half of a multi-byte character). So each new token is decoded together with a few
tokens before it, and only the text beyond that prefix's own decoding is new; a delta that ends in an
incomplete character (U+FFFD) is held back until the next token completes it.

With a fast (Rust) tokenizer, `tokenizers`' DecodeStream does this over the output alone (~2 µs a token
instead of two Python-level decodes): the text it has produced is always a prefix of decoding the output
ids, which is the offline result.
"""
from __future__ import annotations

_CONTEXT = 5  # tokens decoded before the new ones, for context


def _decode_stream(tokenizer, skip: bool):
    """A `tokenizers` DecodeStream (fast, in Rust) over the output alone, so its text is what decoding the
    output ids gives (the offline result); None if unavailable."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None, None
    try:
        from tokenizers.decoders import DecodeStream
        return DecodeStream(skip_special_tokens=skip), backend
    except (ImportError, TypeError):  # older tokenizers: no DecodeStream, or no prefix argument
        return None, None


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.text = ""
        self._stream, self._backend = _decode_stream(tokenizer, skip_special_tokens)
        self.ids: list[int] = list(prompt_ids[-_CONTEXT:])
        self.prefix_offset = 0              # start of the context window in self.ids
        self.read_offset = len(self.ids)    # tokens before this are already in self.text

    def add(self, token_id: int) -> str:
        """Append one token; return the new text it completes (possibly empty)."""
        if self._stream is not None:
            delta = self._stream.step(self._backend, token_id) or ""
            self.text += delta
            return delta
        self.ids.append(token_id)
        dec = self.tokenizer.decode
        prefix = dec(self.ids[self.prefix_offset:self.read_offset], skip_special_tokens=self.skip)
        full = dec(self.ids[self.prefix_offset:], skip_special_tokens=self.skip)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            delta = full[len(prefix):]
            self.prefix_offset = max(self.read_offset, len(self.ids) - _CONTEXT)
            self.read_offset = len(self.ids)
            self.text += delta
            return delta
        return ""


def find_stop(text: str, new_len: int, stops: tuple[str, ...]) -> int:
    """Index where the earliest stop string starts in `text`, looking only where the last `new_len`
    characters could have completed one; -1 if none."""
    best = -1
    for s in stops:
        start = max(0, len(text) - new_len - len(s) + 1)
        i = text.find(s, start)
        if i != -1 and (best == -1 or i < best):
            best = i
    return best
