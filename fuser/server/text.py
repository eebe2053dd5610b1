"""Token ids to text for one request: incremental detokenization and stop strings.

The scheduler hands out token ids; the server owes the client text. Decoding each new token on
its own breaks multi-byte characters (a byte-level BPE token may hold half a UTF-8 sequence) and
a decode of the whole output at every token costs O(n^2). The usual window (Hugging Face TGI's
and vLLM's): decode ids[prefix:] and ids[prefix:read]; the text past the shorter one is new,
unless it ends in U+FFFD (an incomplete character: wait for the next token).

Stop strings: the earliest match in the text so far ends the request; the text stops before it
(OpenAI's semantics: the stop string is not returned). While the request runs, the last
len(longest stop) - 1 characters are held back from the stream, so that streamed text never
shows the beginning of a stop string that the next token completes: a stream concatenates to
exactly the non-streamed text.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

REPLACEMENT = "\ufffd"

# Where transformers' fast tokenizers define the decode that `decoder` may bypass.
_BASE_DECODE = ("transformers.tokenization_utils_base", "decode")
_BACKEND_DECODE = ("transformers.tokenization_utils_tokenizers", "_decode")


def _defined_in(cls: type, name: str) -> tuple[str, str]:
    method = getattr(cls, name, None)
    return getattr(method, "__module__", ""), getattr(method, "__name__", "")


def decoder(tokenizer: object, skip_special_tokens: bool) -> Callable[[list[int]], str]:
    """`tokenizer.decode(ids, skip_special_tokens=...)` as a function of a list of ids.

    For a fast tokenizer whose decode is the Rust tokenizer's own (transformers' `decode` and
    `_decode` not overridden, no clean-up of tokenization spaces), it calls the Rust tokenizer
    directly: transformers' Python around it (argument conversion, batching checks) cost more
    than the decoding itself, twice per token of every request. Any other tokenizer decodes
    through its own `decode`."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    cls = type(tokenizer)
    if (backend is not None and hasattr(backend, "decode")
            and not getattr(tokenizer, "clean_up_tokenization_spaces", True)
            and _defined_in(cls, "decode") == _BASE_DECODE
            and _defined_in(cls, "_decode") == _BACKEND_DECODE):
        return lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


class IncrementalDetokenizer:
    """Text of a growing list of token ids, a step's tokens at a time."""

    def __init__(self, tokenizer: object, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.text = ""
        self._prefix = 0  # ids[_prefix:_read] decode to the tail of `text` (context for the next)
        self._read = 0
        self._decode = decoder(tokenizer, skip_special_tokens)

    def add(self, token: int) -> str:
        """Append one token; returns the text it completes ("" while a character is partial)."""
        return self.extend((token,))

    def extend(self, tokens: Iterable[int]) -> str:
        """Append tokens (a step's); returns the text they complete ("" while a character is
        partial), as adding them one at a time would: one decode of the window, or one a
        token where the last leaves a character partial (the text before it is due now)."""
        tokens = [int(t) for t in tokens]
        start = len(self.ids)
        self.ids.extend(tokens)
        delta, partial = self._advance()
        if partial and len(tokens) > 1:
            del self.ids[start:]  # (the window did not move)
            return "".join(self.extend((t,)) for t in tokens)
        return delta

    def _advance(self) -> tuple[str, bool]:
        """Move the window over the ids added: (the new text, whether a character is partial)."""
        before = self._decode(self.ids[self._prefix:self._read])
        after = self._decode(self.ids[self._prefix:])
        if after.endswith(REPLACEMENT):
            return "", True
        if len(after) <= len(before):
            return "", False
        delta = after[len(before):]
        self._prefix, self._read = self._read, len(self.ids)
        self.text += delta
        return delta, False

    def flush(self) -> str:
        """At the end: whatever the window still holds (a trailing partial character too)."""
        before = self._decode(self.ids[self._prefix:self._read])
        after = self._decode(self.ids[self._prefix:])
        delta = after[len(before):] if after.startswith(before) else ""
        self._prefix = self._read = len(self.ids)
        self.text += delta
        return delta


class StopChecker:
    """The text of one request, cut at the earliest stop string.

    feed(delta) after every token; `stopped` turns True at the first match and `text` then ends
    before it. `releasable()` is what may be streamed so far."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.text = ""
        self.stopped = False

    def feed(self, delta: str) -> bool:
        """Add decoded text; True if a stop string now matches (the text is cut before it)."""
        if self.stopped or not delta:
            return self.stopped
        # A match must end inside the new text: start the search far enough back for the
        # longest stop string to straddle the old/new boundary.
        start = max(0, len(self.text) - self.hold)
        self.text += delta
        found = [i for i in (self.text.find(s, start) for s in self.stops) if i >= 0]
        if found:
            self.text = self.text[:min(found)]
            self.stopped = True
        return self.stopped

    def releasable(self, finished: bool) -> int:
        """How many characters of `text` may be sent: all once finished, else all but the held
        back tail that could still begin a stop string."""
        if finished or self.stopped or not self.stops:
            return len(self.text)
        return max(0, len(self.text) - self.hold)
