"""Generated ids -> streamed text, with stop strings.

The text of the whole generation is known at each token, so multi-byte characters split
across tokens come out whole; text that could still become a stop string is held back until
it can't, and a stop string itself is never emitted. Where the tokenizer decodes by
concatenating pieces (`Tokenizer.incremental_decoder`), each token's piece is decoded once
and appended; otherwise the whole generation is decoded again at each token (O(n) a token:
a 2,000-token reply costs ~0.1 ms a token, which at 32 sequences a step is a GPU step's time).
"""

from __future__ import annotations

from typing import Callable, Protocol


class IncrementalDecoder(Protocol):
    """`kvshare.model.tokenizer.StreamDecoder`: text that became complete per token."""

    def feed(self, token_id: int) -> str: ...

    def flush(self) -> str: ...

    @property
    def pending(self) -> bool: ...


class TextAssembler:
    def __init__(self, decode: Callable[[list[int]], str], stop: list[str],
                 stream: IncrementalDecoder | None = None):
        self._decode = decode
        # `stream`: decodes the same text as `decode` one token at a time
        self._stream = stream
        self._text = ""  # with a stream: the complete text so far
        self._stop = [s for s in stop if s]
        self.ids: list[int] = []
        self.emitted = ""
        self.stop_hit: str | None = None  # the stop string that ended generation

    def _text_so_far(self) -> str:
        if self._stream is None:
            return self._decode(self.ids)
        self._text += self._stream.feed(self.ids[-1])
        # an incomplete UTF-8 character reads as U+FFFD at the end, as a full decode gives it
        return self._text + "\ufffd" if self._stream.pending else self._text

    def push(self, token_id: int) -> tuple[str, bool]:
        """Add a token; return (new text to emit, whether a stop string was hit)."""
        self.ids.append(token_id)
        text = self._text_so_far()
        if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for the next token
            return "", False
        # A stop string may straddle earlier output only within its own length.
        search_from = max(0, len(self.emitted) - max((len(s) for s in self._stop), default=0))
        found = [(i, s) for s in self._stop if (i := text.find(s, search_from)) >= 0]
        if found:
            cut, self.stop_hit = min(found, key=lambda f: f[0])
            return self._take(text[:cut]), True
        hold = max((_overlap(text, s) for s in self._stop), default=0)
        return self._take(text[: len(text) - hold]), False

    def flush(self) -> str:
        """At the end of generation, release any held-back text."""
        text = self._decode(self.ids) if self._stream is None else self._text + self._stream.flush()
        return self._take(text.rstrip("\ufffd") if text.endswith("\ufffd") else text)

    def _take(self, upto: str) -> str:
        # Re-decoding can in rare cases change earlier characters (e.g. a space merged by the
        # detokenizer), so `upto` need not extend what was sent: never take that back, just
        # send what follows it.
        if len(upto) <= len(self.emitted):
            return ""
        delta = upto[len(self.emitted):]
        self.emitted = upto
        return delta


def _overlap(text: str, stop: str) -> int:
    """Length of the longest proper prefix of `stop` that `text` ends with. Only prefixes
    ending in `text`'s last character can match, so only those are compared (a scan over every
    prefix length cost O(len(stop)^2) per token)."""
    if not text:
        return 0
    last = text[-1]
    k = min(len(stop) - 1, len(text))
    while k > 0:
        k = stop.rfind(last, 0, k) + 1  # the longest candidate prefix stop[:k] ending in `last`
        if k and text.endswith(stop[:k]):
            return k
        k -= 1
    return 0
