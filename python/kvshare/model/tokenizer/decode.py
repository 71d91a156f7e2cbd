"""Decoding, shared by every tokenizer family: the bytes each token renders as (llama.cpp's
``token_to_piece``), llama.cpp's ``clean_spaces`` passes of ``llama_detokenize``, and the
incremental decoder for streaming."""

from __future__ import annotations

import codecs
from typing import Iterable, Protocol, Sequence

from kvshare.model.tokenizer.vocab import (ATTR_BYTE, ATTR_CONTROL, ATTR_NORMAL, ATTR_UNKNOWN,
                                           ATTR_USER_DEFINED)


def piece_tables(normal: list[bytes], texts: Sequence[str],
                 attrs: Sequence[int]) -> tuple[list[bytes], list[bytes]]:
    """Every token's piece as llama.cpp's `token_to_piece` renders it with `special` on, and
    with it off (control and unknown tokens empty). `normal` holds the family's rendering of
    each text as a normal token; it is updated in place and returned as the first table."""
    out = normal
    special = ATTR_CONTROL | ATTR_UNKNOWN | ATTR_USER_DEFINED
    for i, attr in enumerate(attrs):
        if attr == ATTR_NORMAL:
            continue
        if attr & special:
            out[i] = texts[i].encode("utf-8")
        elif attr & ATTR_NORMAL:
            pass
        elif attr & ATTR_BYTE:
            try:
                out[i] = bytes([int(texts[i][3:5], 16)])
            except ValueError:
                out[i] = b""
        else:  # unused / undefined: llama.cpp renders nothing
            out[i] = b""
    hidden = ATTR_CONTROL | ATTR_UNKNOWN
    plain = [b"" if attrs[i] & hidden else p for i, p in enumerate(out)]
    return out, plain


def clean_up_tokenization_spaces(text: bytes) -> bytes:
    """llama.cpp's three `clean_spaces` passes, byte for byte."""
    t = bytearray(text)
    if not t:
        return b""
    # pass 1: " ?", " !", " .", " ,"
    out = bytearray(t[:1])
    for i in range(1, len(t)):
        x = t[i]
        if t[i - 1] == 0x20 and x in b"?!.,":
            out.pop()
        out.append(x)
    t = out
    # pass 2: " ' " -> "'" (the space after the apostrophe is skipped and zeroed, so it no
    # longer counts as a space for the next character)
    out = bytearray(t[:1])
    n = len(t)
    i = 1
    while i < n:
        x = t[i]
        if x == 0x27 and i + 1 < n and t[i - 1] == 0x20 and t[i + 1] == 0x20:
            out.pop()
            i += 1
            t[i] = 0
        out.append(x)
        i += 1
    t = out
    # pass 3: " 's", " 'm", " 're", " 've"
    out = bytearray(t[:1])
    n = len(t)
    for i in range(1, n):
        x = t[i]
        if t[i - 1] == 0x20 and x == 0x27 and i + 1 < n:
            x1 = t[i + 1]
            if x1 in b"sm":
                out.pop()
            elif x1 not in b"td" and i + 2 < n:
                x2 = t[i + 2]
                if (x1, x2) in ((0x72, 0x65), (0x76, 0x65)):
                    out.pop()
        out.append(x)
    return bytes(out)



class PieceSource(Protocol):
    """What `StreamDecoder` needs of a tokenizer."""

    def piece_table(self, special: bool = True) -> Sequence[bytes]: ...

    def check_id(self, token_id: int) -> int: ...


class StreamDecoder:
    """Incremental detokenizer for streaming: `feed(id)` returns the text that became complete
    (a multi-byte character split over byte tokens is held back until its last byte arrives);
    `flush()` returns whatever is left (an incomplete character becomes U+FFFD).

    With `skip_special` (the default, as llama-server streams), control tokens render as "".
    """

    def __init__(self, tokenizer: PieceSource, skip_special: bool = True,
                 strip_space_prefix: bool = False):
        self._tok = tokenizer
        self._table = tokenizer.piece_table(special=not skip_special)
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
        # the first token's leading space dropped, as `detokenize` drops it for a model that
        # adds a space prefix
        self._strip_first = strip_space_prefix

    def feed(self, token_id: int) -> str:
        self._tok.check_id(token_id)
        piece = self._table[token_id]
        if self._strip_first:
            self._strip_first = False
            if piece.startswith(b" "):
                piece = piece[1:]
        return self._dec.decode(piece)

    def feed_many(self, ids: Iterable[int]) -> str:
        return "".join(self.feed(t) for t in ids)

    def flush(self) -> str:
        return self._dec.decode(b"", final=True)

    @property
    def pending(self) -> bool:
        """True while an incomplete UTF-8 character is buffered."""
        return bool(self._dec.getstate()[0])

