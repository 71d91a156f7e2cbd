"""A call written as one JSON object, `{"name": ..., "arguments": {...}}` (hermes) or
`{"name": ..., "parameters": {...}}` (llama3), read as it arrives.

When the object begins with its name (`{"name": "f", "arguments": {` within its first 512
characters) the call is announced there and its arguments object streams out exactly as written;
otherwise (keys in another order, arguments given as a JSON string) the call is reported when
the object ends, its arguments re-serialized. Either way the whole object must then be valid
JSON with a non-empty string name and an object for arguments (a string holding one counts).
"""

from __future__ import annotations

import json
import re

from kvshare.toolcalls.scan import JsonScanner
from kvshare.toolcalls.schema import dumps
from kvshare.toolcalls.stream import Cursor, Malformed, Region

__all__ = ["JsonCallRegion"]

_STR = r'"((?:[^"\\\x00-\x1f]|\\.)*)"'
HERMES_HEAD = re.compile(r'\{\s*"name"\s*:\s*' + _STR + r'\s*,\s*"(?:arguments|parameters)"\s*:\s*')
LLAMA3_HEAD = re.compile(r'\{\s*(?:"type"\s*:\s*"function"\s*,\s*)?"name"\s*:\s*' + _STR
                         + r'\s*,\s*"(?:parameters|arguments)"\s*:\s*')
_HEAD_WINDOW = 512


class JsonCallRegion(Region):
    """One JSON call object after `opener` (or starting with it, `inline`), then `closing`."""

    def __init__(self, fmt, opener, sink, *, head: re.Pattern, args_keys: tuple[str, ...],
                 closing: str | None, inline: bool = False, args_required: bool = False,
                 names: frozenset[str] | None = None):
        super().__init__(fmt, opener, sink)
        self.names = names  # when set, a call of another name is not a call
        self.head, self.args_keys, self.closing = head, args_keys, closing
        self.args_required = args_required
        self.phase = "open"
        self.inline = inline
        if inline:
            self.pos = 0
        self.obj: JsonScanner | None = None
        self.obj_start = 0
        self.streaming: bool | None = None  # None: not decided yet
        self.headed = False  # the object opened with a declared name and an arguments key
        self.name = ""
        self.args: JsonScanner | None = None
        self.args_start = self.sent = 0

    def is_markup(self) -> bool:
        # a bare object (llama3) is a call only once it opened with a name and arguments
        return not self.inline or self.headed

    def run(self, cur: Cursor) -> int:
        if self.phase == "open":
            cur.ws()
            if cur.char() != "{":
                raise Malformed("expected a JSON object")
            self.obj_start = self.pos = cur.pos
            self.obj = JsonScanner(cur.pos)
            self.phase = "object"
        if self.phase == "object":
            text = cur.text
            if self.streaming is None:
                self._head(text, ended=False)
            if self.streaming:
                end = self.args.run(text)
                upto = self.args.pos if end is None else end
                if upto > self.sent:
                    self.sink.args(text[self.sent:upto])
                    self.sent = upto
            end = self.obj.run(text)
            if end is None:
                cur.more()
            if self.streaming is None:
                self._head(text[:end], ended=True)
            self._finish_object(text, end)
            self.pos = cur.pos = end
            self.phase = "close"
        if self.closing:
            cur.ws()
            cur.expect(self.closing)
        return cur.pos

    def _head(self, text: str, ended: bool) -> None:
        """Decide from the object's first 512 characters whether it opens with its name and
        an arguments object (then announce it and stream the arguments)."""
        stop = min(len(text), self.obj_start + _HEAD_WINDOW)
        m = self.head.match(text, self.obj_start, stop)
        if m is None or m.end() >= stop:
            if ended or stop - self.obj_start >= _HEAD_WINDOW:
                self.streaming = False
            return
        # the name is read here either way: an undeclared one fails now, as it would at the
        # object's end, and a reply cut off after a declared one was cutting a call
        try:
            self.name = json.loads('"' + m.group(1) + '"')
        except ValueError:
            raise Malformed("bad name string") from None
        if not self.name:
            raise Malformed("empty name")
        self._check_name(self.name)
        self.headed = True
        self.streaming = text[m.end()] == "{"
        if self.streaming:
            self.sink.begin(self.name)
            self.args_start = self.sent = m.end()
            self.args = JsonScanner(m.end())

    def _check_name(self, name: str) -> None:
        if self.names is not None and name not in self.names:
            raise Malformed("not a declared tool")

    def _finish_object(self, text: str, end: int) -> None:
        try:
            obj = json.loads(text[self.obj_start:end])
        except ValueError:
            raise Malformed("invalid JSON") from None
        if not isinstance(obj, dict):
            raise Malformed("not an object")
        name = obj.get("name")
        if not isinstance(name, str) or not name:
            raise Malformed("no name")
        self._check_name(name)
        key = next((k for k in self.args_keys if k in obj), None)
        if key is None and self.args_required:
            raise Malformed("no arguments")
        value = obj[key] if key is not None else {}
        if self.streaming:
            if name != self.name or not isinstance(value, dict):
                raise Malformed("call changed after it was announced")
            return
        if isinstance(value, str):
            try:
                parsed = json.loads(value)
            except ValueError:
                raise Malformed("arguments string is not JSON") from None
            if not isinstance(parsed, dict):
                raise Malformed("arguments are not an object")
            args = value
        elif isinstance(value, dict):
            try:
                args = dumps(value)
            except ValueError:  # NaN / Infinity, which json.loads reads
                raise Malformed("arguments are not JSON") from None
        else:
            raise Malformed("arguments are not an object")
        self.sink.begin(name)
        self.sink.args(args)
