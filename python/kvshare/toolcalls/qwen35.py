"""`qwen35`: Qwen3.5 / Qwen3-Coder XML calls:

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

Values are raw text up to the first `</parameter>`, one newline stripped at each end (the
template writes them so). They become JSON through the tool's schema (bind tools with
`get_format("qwen35", tools)`): a string parameter (or one the tools do not declare) stays a
string and streams as it arrives; a typed one is parsed as JSON when the value closes (numbers,
booleans, null, objects, arrays; "True"/"False" for booleans and Python literals for objects are
accepted too) and stays a string if it does not fit. A parameter without a type is JSON if it
parses, else a string. A `<function=...>` block without `<tool_call>` before it is read too
(with a stray `</tool_call>` after it), and one `<tool_call>` may hold several functions.

Grammar: each call is the template's exact layout; parameters come in declaration order, the
required ones always, the optional ones maybe; string values are any text up to
`</parameter>` (enums: one of the values; pattern/length/format are not enforced), other
values are `%json` of the property's schema (booleans also `True`/`False`, as the template
writes them). No undeclared parameter can be written, except for a tool that declares none and
does not forbid them (`{"type": "object"}`): any number of parameters with text values.
"""

from __future__ import annotations

import ast
import json
from typing import Any, Sequence

from kvshare.toolcalls.base import ToolFormat
from kvshare.toolcalls.grammar import MAX_CALLS, lit, pick, repeat
from kvshare.toolcalls.schema import (
    dumps,
    embed,
    enum_values,
    free_form,
    functions,
    json_rule,
    properties,
    types_of,
)
from kvshare.toolcalls.stream import Cursor, Malformed, Region, held

OPEN, CLOSE = "<tool_call>", "</tool_call>"
FN, FN_END = "<function=", "</function>"
PARAM, PARAM_END = "<parameter=", "</parameter>"


def _escape(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)[1:-1]


def _strip1(raw: str) -> str:
    if raw.startswith("\n"):
        raw = raw[1:]
    return raw[:-1] if raw.endswith("\n") else raw


def is_text(schema: dict | None) -> bool:
    """Whether a parameter's value is kept as the raw string."""
    return schema is None or types_of(schema) == {"string"}


def _fits(value: Any, types: set[str]) -> bool:
    if value is None:
        return "null" in types
    if isinstance(value, bool):
        return "boolean" in types
    if isinstance(value, int):
        return "integer" in types or "number" in types
    if isinstance(value, float):
        return "number" in types or ("integer" in types and value.is_integer())
    if isinstance(value, str):
        return "string" in types
    return ("array" if isinstance(value, list) else "object") in types


def convert(value: str, schema: dict | None) -> Any:
    """A parameter's raw text as the JSON value its schema asks for (see the module doc)."""
    if is_text(schema):
        return value
    types = types_of(schema)
    v = value.strip()
    try:
        parsed = json.loads(v)
    except ValueError:
        parsed = value
    if types is None:
        return parsed
    if not isinstance(parsed, str) and _fits(parsed, types):
        if isinstance(parsed, float) and "number" not in types:
            return int(parsed)
        return parsed
    if "boolean" in types and v in ("True", "False"):
        return v == "True"
    if "null" in types and v == "None":
        return None
    if types & {"object", "array"}:
        try:
            lit_value = ast.literal_eval(v)
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            lit_value = None
        if isinstance(lit_value, (dict, list)) and _fits(lit_value, types):
            try:
                return json.loads(json.dumps(lit_value))
            except (TypeError, ValueError):
                pass
    return value


class XmlCallRegion(Region):
    """One `<tool_call>` block (or a bare `<function=...>` block)."""

    def __init__(self, fmt: "Qwen35", opener, sink):
        super().__init__(fmt, opener, sink)
        self.phase = "open" if opener == OPEN else "name"
        self.fn = self.key = ""
        self.schema: dict | None = None
        self.nargs = 0
        self.vstart = self.vsent = self.search = 0

    def run(self, cur: Cursor) -> int:
        while True:
            if self.phase == "open":
                cur.ws()
                cur.expect(FN)
                self._to("name", cur)
            elif self.phase == "name":
                name = cur.until(">", forbid="<\n").strip()
                if not name:
                    raise Malformed("empty function name")
                self.fn, self.nargs = name, 0
                self.sink.begin(name)
                self._to("body", cur)
            elif self.phase == "body":
                cur.ws()
                if cur.choose(PARAM, FN_END) == FN_END:
                    self.sink.args("}" if self.nargs else "{}")
                    self._to("after" if self.opener == OPEN else "bare_end", cur)
                    continue
                key = cur.until(">", forbid="<\n").strip()
                if not key:
                    raise Malformed("empty parameter name")
                self.key, self.schema = key, self.fmt.param_schema(self.fn, key)
                if is_text(self.schema):
                    self.sink.args(self._sep() + dumps(key) + ': "')
                self.vstart = self.search = cur.pos
                self.vsent = 0
                self._to("value", cur)
            elif self.phase == "value":
                self._value(cur)
                self._to("body", cur)
            elif self.phase == "bare_end":  # a `</tool_call>` left over from the template
                end = cur.pos
                cur.ws()
                rest = cur.text[cur.pos:]
                if rest.startswith(CLOSE):
                    return cur.pos + len(CLOSE)
                if CLOSE.startswith(rest) and not cur.final:
                    cur.more()
                return end
            else:  # after a function: another one, or the end of the block
                cur.ws()
                if cur.choose(FN, CLOSE) == CLOSE:
                    return cur.pos
                self._to("name", cur)

    def _to(self, phase: str, cur: Cursor) -> None:
        self.phase, self.pos = phase, cur.pos

    def _sep(self) -> str:
        self.nargs += 1
        return "{" if self.nargs == 1 else ", "

    def _value(self, cur: Cursor) -> None:
        text = cur.text
        i = text.find(PARAM_END, self.search)
        if i < 0:
            self.search = max(self.vstart, len(text) - len(PARAM_END) + 1)
            if is_text(self.schema):
                self._stream(text)
            cur.more()
        value = _strip1(text[self.vstart:i])
        if is_text(self.schema):
            self.sink.args(_escape(value[self.vsent:]) + '"')
        else:
            converted = dumps(convert(value, self.schema))
            key = dumps(self.key)
            self.sink.args(self._sep() + key + ": " + converted)
        cur.pos = i + len(PARAM_END)

    def _stream(self, text: str) -> None:
        """Send the part of an unfinished string value that is surely part of it (not its
        leading newline, nor an end that may still become "\\n</parameter>")."""
        if len(text) <= self.vstart:
            return
        start = self.vstart + (text[self.vstart] == "\n")
        tail = text[max(start, len(text) - len(PARAM_END)):]
        safe = len(text) - max(held(tail, "\n" + PARAM_END), held(tail, PARAM_END)) - start
        if safe > self.vsent:
            self.sink.args(_escape(text[start + self.vsent:start + safe]))
            self.vsent = safe


def _param_rule(key: str, schema: dict, params: dict) -> str:
    head, end = lit(f"{PARAM}{key}>\n"), lit(f"\n{PARAM_END}\n")
    if is_text(schema) or "string" in (types_of(schema) or ()):
        enum = enum_values(schema)
        if enum and all(isinstance(v, str) for v in enum):
            return f"{head} ({' | '.join(lit(v) for v in enum)}) {end}"
        return f"{head} text_value {lit(chr(10))}"
    if types_of(schema) == {"boolean"} and enum_values(schema) is None:
        # the template writes past booleans with `| string`: True / False
        return f'{head} ("true" | "false" | "True" | "False") {end}'
    return f"{head} {json_rule(embed(schema, params))} {end}"


class Qwen35(ToolFormat):
    name = "qwen35"
    openers = (OPEN, FN)

    def __init__(self, tools: Sequence[dict] | None = None):
        super().__init__(tools)
        self._props = {name: dict(properties(params)[0]) for name, params in functions(self.tools)}

    def param_schema(self, function: str, key: str) -> dict | None:
        """The declared schema of a parameter, None if the tools do not declare it."""
        return self._props.get(function, {}).get(key)

    def region(self, opener, sink):
        return XmlCallRegion(self, opener, sink)

    def _functions(self, tools, choice) -> list[str]:
        rules = []
        alts = []
        for i, (name, params) in enumerate(pick(tools, choice)):
            items, required = properties(params)
            parts = ["free_param*"] if free_form(params) else []
            for j, (key, schema) in enumerate(items):
                rules.append(f"p{i}_{j}: {_param_rule(key, schema, params)}")
                parts.append(f"p{i}_{j}" + ("" if key in required else "?"))
            body = " ".join([lit(f"{FN}{name}>\n"), *parts, lit(FN_END + "\n")])
            rules.append(f"fn{i}: {body}")
            alts.append(f"fn{i}")
        return [f"fn: {' | '.join(alts)}", *rules,
                f"free_param: {lit(PARAM)} PARAM_KEY {lit('>' + chr(10))} text_value {lit(chr(10))}",
                "PARAM_KEY: /[A-Za-z_][A-Za-z0-9_.\\-]*/",
                "text_value[lazy]: /(?s:.*)<\\/parameter>/"]

    def grammar(self, tools: Sequence[dict], choice: str | None = None,
                parallel: bool = True, max_calls: int = MAX_CALLS) -> str:
        return "\n".join([
            "start: " + repeat("call", "\n", parallel and choice is None, max_calls),
            f"call: {lit(OPEN + chr(10))} fn {lit(CLOSE)}",
            *self._functions(tools, choice),
        ])

    def auto_grammar(self, tools: Sequence[dict]) -> str | None:
        return "\n".join([
            "start: (before_call call_body)* TEXT",
            "before_call[lazy]: BEFORE_CALL",
            "BEFORE_CALL: /(?s:.*)<tool_call>/ & ~/(?s:.*)<function=(?s:.*)/",
            f"call_body: {lit(chr(10))} fn {lit(CLOSE)}",
            "TEXT: /(?s:.*)/ & ~/(?s:.*)(<tool_call>|<function=)(?s:.*)/",
            *self._functions(tools, None),
        ])
