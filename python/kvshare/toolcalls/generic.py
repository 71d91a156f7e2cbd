"""`generic`: kvshare's JSON call format for chat templates without tool support (the tool
polyfill, `kvshare.model.tool_polyfill`, teaches it in the system message). The whole reply
is one JSON object:

    {"tool_call": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    {"tool_calls": [{"name": "get_weather", ...}, {"name": "get_time", ...}]}
    {"response": "It is sunny in Paris."}

"response" is the reply's text (sent as content as it arrives, JSON escapes decoded);
"tool_call" is one call, each element of "tool_calls" one of several, each announced once
its object is complete. "response" may come before the calls (how past replies with both
text and calls are shown).

Grammar: `%json` of the object. Forced (`required`, a named function): "tool_call", or, when
parallel, "tool_calls" with two to `max_calls` (a separate key, so that one call, what small
models should mostly make, is not a list they keep adding to). Auto: any of those or
{"response": string}; the
format forces it whenever a request has tools (`forced_auto`), since a model following the
system message's instructions writes one of the two and a small one would otherwise drift.
`response_grammar` (tool_choice "none"): the response object alone.
"""

from __future__ import annotations

import json
import re
from typing import Sequence

from kvshare.toolcalls.base import ToolFormat
from kvshare.toolcalls.grammar import MAX_CALLS, pick
from kvshare.toolcalls.scan import JsonScanner
from kvshare.toolcalls.schema import JSON_STYLE, call_schema, dumps, json_rule
from kvshare.toolcalls.stream import Cursor, Malformed, Region

__all__ = ["Generic"]

# a run of complete string characters and escapes (a lone trailing backslash is incomplete)
_STR_RUN = re.compile(r'(?:[^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})*')
_HIGH_SURROGATE_END = re.compile(r"\\u[dD][89abAB][0-9a-fA-F]{2}$")
_KEYS = ('"tool_calls"', '"tool_call"', '"response"')
_RESPONSE = {"type": "object", "properties": {"response": {"type": "string"}},
             "required": ["response"], "additionalProperties": False}


class GenericRegion(Region):
    """The reply's one object, from its `{`."""

    complete_calls = True

    def __init__(self, fmt, opener, sink):
        super().__init__(fmt, opener, sink)
        self.pos = 0
        self.phase = "open"
        self.seen: set[str] = set()
        self.scanner: JsonScanner | None = None
        self.call_start = 0

    def run(self, cur: Cursor) -> int:
        while True:
            if self.phase == "open":
                cur.ws()
                cur.expect("{")
                self.phase = "key"
            elif self.phase == "key":
                self._key(cur)
            elif self.phase in ("call", "single"):
                self._call(cur)
            elif self.phase == "next_call":
                cur.ws()
                self.phase = "call" if cur.choose(",", "]") == "," else "after_value"
            elif self.phase == "text":
                self._text(cur)
            else:  # after_value
                cur.ws()
                if cur.choose(",", "}") == "}":
                    return cur.pos
                self.phase = "key"
            self.pos = cur.pos

    def _key(self, cur: Cursor) -> None:
        cur.ws()
        key = cur.choose(*_KEYS).strip('"')
        kind = "calls" if key.startswith("tool_call") else key
        if kind in self.seen:
            raise Malformed(f"{key!r} given twice")
        cur.ws()
        cur.expect(":")
        cur.ws()
        if key == "tool_calls":
            cur.expect("[")
        elif key == "response":
            cur.expect('"')
        self.seen.add(kind)  # only now: a NeedMore above reads the key again
        self.phase = {"tool_calls": "call", "tool_call": "single"}.get(key, "text")

    def _call(self, cur: Cursor) -> None:
        if self.scanner is None:
            cur.ws()
            if cur.char() != "{":
                raise Malformed("expected a call object")
            self.pos = self.call_start = cur.pos
            self.scanner = JsonScanner(cur.pos)
        end = self.scanner.run(cur.text)
        if end is None:
            cur.pos = len(cur.text)
            cur.more()
        name, args = _call_object(cur.text[self.call_start:end])
        self.sink.begin(name)
        self.sink.args(args)
        self.scanner = None
        cur.pos = end
        self.phase = "next_call" if self.phase == "call" else "after_value"

    def _text(self, cur: Cursor) -> None:
        m = _STR_RUN.match(cur.text, cur.pos)
        end = m.end()
        run = cur.text[cur.pos:end]
        if len(cur.text) - end < 6 and not cur.final and _HIGH_SURROGATE_END.search(run):
            end -= 6  # the low half of a surrogate pair may follow
            run = run[:-6]
        if run:
            self.sink.text(json.loads('"' + run + '"'))
        self.pos = cur.pos = end  # what was sent is not read again
        if cur.char() != '"':
            if cur.text[cur.pos] == "\\":  # an escape not complete yet
                cur.more()
            raise Malformed("control character or bad escape in the response")
        cur.pos += 1
        self.phase = "after_value"


def _call_object(text: str) -> tuple[str, str]:
    """(name, arguments JSON text) of one call object."""
    try:
        obj = json.loads(text)
    except ValueError:
        raise Malformed("invalid JSON") from None
    name = obj.get("name") if isinstance(obj, dict) else None
    args = obj.get("arguments", {}) if isinstance(obj, dict) else None
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            raise Malformed("arguments string is not JSON") from None
    if not isinstance(name, str) or not name or not isinstance(args, dict):
        raise Malformed("not a call object")
    try:
        return name, dumps(args)
    except ValueError:
        raise Malformed("arguments are not JSON") from None


class Generic(ToolFormat):
    name = "generic"
    start_openers = ("{",)
    forced_auto = True

    def region(self, opener, sink):
        return GenericRegion(self, opener, sink)

    @staticmethod
    def _schema(tools: Sequence[dict], choice: str | None, most: int, response: bool) -> str:
        """`start: %json` of the reply: one call (`tool_call`), two to `most` (`tool_calls`),
        or (`response`) an answer."""
        call = call_schema(pick(tools, choice), "arguments")
        defs = call.pop("$defs", None)
        call.pop("x-guidance", None)
        one = {"type": "object", "properties": {"tool_call": call},
               "required": ["tool_call"], "additionalProperties": False}
        branches = [one]
        if most > 1:
            calls = {"type": "array", "items": call, "minItems": 2, "maxItems": most}
            branches.append({"type": "object", "properties": {"tool_calls": calls},
                             "required": ["tool_calls"], "additionalProperties": False})
        if response:
            branches.append(_RESPONSE)
        schema: dict = dict(one) if len(branches) == 1 else {"anyOf": branches}
        if defs:
            schema["$defs"] = defs
        return "start: " + json_rule({**schema, "x-guidance": JSON_STYLE})

    def grammar(self, tools: Sequence[dict], choice: str | None = None,
                parallel: bool = True, max_calls: int = MAX_CALLS) -> str:
        most = max_calls if parallel and choice is None else 1
        return self._schema(tools, choice, most, response=False)

    def auto_grammar(self, tools: Sequence[dict], max_calls: int = MAX_CALLS) -> str | None:
        return self._schema(tools, None, max_calls, response=True)

    @staticmethod
    def response_grammar() -> str:
        return "start: " + json_rule({**_RESPONSE, "x-guidance": JSON_STYLE})
