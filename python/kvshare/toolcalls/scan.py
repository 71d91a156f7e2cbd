"""Resumable scanners that find where a value ends in text still arriving: a JSON object or
array (`JsonScanner`), a Python literal argument (`PyLiteralScanner`). They keep their state
between calls, so a long value is read once however many pieces it comes in."""

from __future__ import annotations

import re

from kvshare.toolcalls.stream import Malformed

__all__ = ["JsonScanner", "PyLiteralScanner"]

# outside strings, JSON has only punctuation, whitespace, numbers and true/false/null
_JSON_OUT = frozenset(" \t\r\n,:0123456789+-.eEtruefalsn")
_JSON_STR_RUN = re.compile(r'[^"\\\x00-\x1f]*')
_PY_OUT = frozenset(" \t\r\n.+-:_")
_PY_CLOSE = {"(": ")", "[": "]", "{": "}"}


class JsonScanner:
    """Finds the end of the JSON object or array that starts at `start` (its first character
    must be `{` or `[`). Raises `Malformed` at the first character that cannot be JSON there
    (a control character inside a string included: the text must stay strict JSON)."""

    __slots__ = ("pos", "stack", "in_str", "esc", "end")

    def __init__(self, start: int):
        self.pos, self.stack, self.in_str, self.esc = start, [], False, False
        self.end: int | None = None

    def run(self, text: str) -> int | None:
        """The offset just past the value, or None if it has not ended yet."""
        if self.end is not None:
            return self.end
        i, n, stack, in_str, esc = self.pos, len(text), self.stack, self.in_str, self.esc
        while i < n:
            c = text[i]
            if in_str:
                if esc:
                    esc = False
                elif c == "\\":
                    esc = True
                elif c == '"':
                    in_str = False
                elif c < " ":
                    raise Malformed("control character in a JSON string")
                else:
                    i = _JSON_STR_RUN.match(text, i).end()
                    continue
            elif c == '"':
                in_str = True
            elif c == "{" or c == "[":
                stack.append("}" if c == "{" else "]")
            elif c == "}" or c == "]":
                if not stack or stack.pop() != c:
                    raise Malformed("unbalanced JSON")
                if not stack:
                    self.end = i + 1
                    return self.end
            elif c not in _JSON_OUT:
                raise Malformed(f"{c!r} in JSON")
            i += 1
        self.pos, self.in_str, self.esc = i, in_str, esc
        return None


class PyLiteralScanner:
    """Finds the end of a Python literal used as a call argument: the offset of the `,` or `)`
    that ends it at bracket depth 0 (not consumed). Strings in single, double or triple quotes
    with backslash escapes; anything outside strings but names, numbers and brackets is
    `Malformed`."""

    __slots__ = ("pos", "stack", "quote", "esc")

    def __init__(self, start: int):
        self.pos, self.stack, self.quote, self.esc = start, [], "", False

    def run(self, text: str) -> int | None:
        i, n, stack = self.pos, len(text), self.stack
        end = None
        while i < n:
            if self.quote:
                i, closed = self._string(text, i)
                if not closed:
                    break
                continue
            c = text[i]
            if c == "'" or c == '"':
                if i + 3 > n and (c * 3).startswith(text[i:]):
                    break  # one quote, an empty string or a triple quote: wait
                self.quote = c * 3 if text.startswith(c * 3, i) else c
                i += len(self.quote)
                continue
            if c in _PY_CLOSE:
                stack.append(_PY_CLOSE[c])
            elif c == ")" or c == "]" or c == "}":
                if not stack:
                    if c != ")":
                        raise Malformed("unbalanced brackets")
                    end = i
                    break
                if stack.pop() != c:
                    raise Malformed("unbalanced brackets")
            elif c == ",":
                if not stack:
                    end = i
                    break
            elif not (c.isalnum() or c in _PY_OUT):
                raise Malformed(f"{c!r} in a Python literal")
            i += 1
        self.pos = i
        return end

    def _string(self, text: str, i: int) -> tuple[int, bool]:
        """Read on inside the string opened by `self.quote`, from `i`: `(offset past its
        closing quote, True)`, or `(where to resume, False)` when the text ends first."""
        n, quote, esc = len(text), self.quote, self.esc
        while i < n:
            c = text[i]
            if esc:
                esc = False
            elif c == "\\":
                esc = True
            elif c == quote[0]:
                if len(quote) == 1:
                    self.quote, self.esc = "", False
                    return i + 1, True
                if text.startswith(quote, i):
                    self.quote, self.esc = "", False
                    return i + 3, True
                if i + 3 > n and quote.startswith(text[i:]):
                    break  # maybe the closing triple quote: wait
            i += 1
        self.esc = esc
        return i, False
