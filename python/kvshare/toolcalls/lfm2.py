"""`lfm2`: LFM2 / LFM2.5 pythonic calls between special tokens:

    <|tool_call_start|>[get_weather(city='Paris', days=3), get_time(tz="UTC")]<|tool_call_end|>

Arguments are keyword arguments whose values are Python literals, read with
`ast.literal_eval` (never eval); a value that is not one is read as JSON (the LFM2.5 template
writes dicts with `tojson`, so `true`/`null` appear), and a quoted string with raw newlines in
it (the template does not escape them) has them escaped first. Values become JSON (tuples as
lists); anything else (sets, bytes, NaN, positional arguments) makes the block content. The
JSON form llama.cpp's LFM2 template asks for, `[{"name": ..., "arguments": {...}}]`, is read
too (its calls are reported when the block ends).

The special tokens must reach the reader as text: decode with them rendered.

Grammar: `<|tool_call_start|>[` calls separated by ", " `]<|tool_call_end|>` (the tokens as
special tokens of the vocabulary); each call `name(` its parameters in declaration order,
required ones always, optional ones maybe, as `key=value` separated by ", " `)`. Values by
type: strings as a Python string literal in either quote (enums: one of the values; when the
schema has a pattern, length or format, a JSON-style double-quoted string that follows it),
integers and numbers as `%json` (bounds enforced), booleans `True`/`False`, null `None`, arrays
and objects (and anything else) as `%json` of the property's schema, so nested booleans are
written `true` (read fine, though LFM2 would write `True`). A tool that declares no parameters
and does not forbid them (`{"type": "object"}`) takes any keyword arguments. Python strings
may hold raw newlines and tabs but no other control character, and only the escapes
`ast.literal_eval` reads to text JSON can hold (`\\n`, `\\'`, `\\x41`, `\\u00e9`, ...; no
`\\N{...}`, no lone surrogates). Not enforced: the `\\/` a JSON-style string may contain stays
a backslash and a slash in Python.
"""

from __future__ import annotations

import ast
import json
import re
import warnings
from typing import Any, Sequence

from kvshare.toolcalls.base import ToolFormat
from kvshare.toolcalls.grammar import MAX_CALLS, lit, pick, repeat
from kvshare.toolcalls.scan import JsonScanner, PyLiteralScanner
from kvshare.toolcalls.schema import (
    dumps,
    embed,
    enum_values,
    free_form,
    json_rule,
    properties,
    types_of,
)
from kvshare.toolcalls.stream import Cursor, Malformed, Region

OPEN, CLOSE = "<|tool_call_start|>", "<|tool_call_end|>"
_NAME = re.compile(r"[A-Za-z_][\w.\-]*")
_KEY = re.compile(r"[A-Za-z_]\w*")
_CONTROL = re.compile(r"[\x00-\x08\x0a-\x1f]")
# a Python string literal in either quote: any character but the quote, a backslash or a
# control character other than tab and newline (the LFM2.5 template does not escape newlines),
# or an escape that ast.literal_eval reads to a character JSON can hold
_PY_STR_BODY = ("(?:[^{q}\\\\\\x00-\\x08\\x0b-\\x1f]"
                "|\\\\(?:[\\\\'\"abfnrtv0-7]|x[0-9a-fA-F]{{2}}"
                "|u(?:[0-9a-cA-Ce-fE-F][0-9a-fA-F]{{3}}|[dD][0-7][0-9a-fA-F]{{2}})))*")
PY_STR = "/" + "|".join(q + _PY_STR_BODY.format(q=q) + q for q in "\"'") + "/"


def literal(text: str) -> Any:
    """A pythonic argument value (see the module doc); raises Malformed."""
    text = text.strip()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # invalid escape sequences in strings
        try:
            return ast.literal_eval(text)
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            pass
        try:
            return json.loads(text)
        except ValueError:
            pass
        if len(text) >= 2 and text[0] in "'\"" and text[-1] == text[0] and _CONTROL.search(text):
            try:
                return ast.literal_eval(_CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text))
            except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
                pass
    raise Malformed("not a Python literal")


def _dumps(value: Any) -> str:
    try:
        return dumps(value)
    except (TypeError, ValueError):
        raise Malformed("value has no JSON form") from None


def _word(cur: Cursor, rx: re.Pattern) -> str:
    """An identifier at the cursor (it must be followed by something else)."""
    m = rx.match(cur.text, cur.pos)
    if m is None:
        cur.char()  # at the end: wait
        raise Malformed("expected a name")
    if m.end() == len(cur.text):
        cur.more()
    cur.pos = m.end()
    return m.group()


class PythonicRegion(Region):
    def __init__(self, fmt, opener, sink):
        super().__init__(fmt, opener, sink)
        self.phase = "open"
        self.nargs = 0
        self.scan: PyLiteralScanner | JsonScanner | None = None
        self.vstart = 0

    def run(self, cur: Cursor) -> int:
        # each phase reads what it can and names the next one (`_to`, a checkpoint)
        while self.phase != "close":
            self._PHASES[self.phase](self, cur)
        cur.ws()
        cur.expect(CLOSE)
        return cur.pos

    def _open(self, cur: Cursor) -> None:
        """`[`, then a pythonic call's name, a JSON call object, or `]` (no calls)."""
        cur.ws()
        cur.expect("[")
        list_start = cur.pos - 1
        cur.ws()
        c = cur.char()
        if c == "{":
            self.scan, self.vstart = JsonScanner(list_start), list_start
            self._to("json", cur)
        elif c == "]":
            cur.pos += 1
            self._to("close", cur)
        else:
            self._to("name", cur)

    def _name(self, cur: Cursor) -> None:
        cur.ws()
        name = _word(cur, _NAME)
        cur.ws()
        cur.expect("(")
        self.nargs = 0
        self.sink.begin(name)
        self._to("args", cur)

    def _args(self, cur: Cursor) -> None:
        """`)` ending the call, or the next `key=` (its value follows)."""
        cur.ws()
        if cur.char() == ")":
            cur.pos += 1
            self.sink.args("}" if self.nargs else "{}")
            self._to("after", cur)
            return
        key = _word(cur, _KEY)
        cur.ws()
        cur.expect("=")
        cur.ws()
        cur.char()
        self.key, self.vstart = key, cur.pos
        self.scan = PyLiteralScanner(cur.pos)
        self._to("value", cur)

    def _value(self, cur: Cursor) -> None:
        end = self.scan.run(cur.text)
        if end is None:
            cur.more()
        value = _dumps(literal(cur.text[self.vstart:end]))
        self.nargs += 1
        self.sink.args(("{" if self.nargs == 1 else ", ") + dumps(self.key) + ": " + value)
        cur.pos = end
        if cur.text[end] == ",":
            cur.pos += 1
        self._to("args", cur)

    def _after(self, cur: Cursor) -> None:
        """`,` and another call, or `]`."""
        cur.ws()
        if cur.choose(",", "]") == "]":
            self._to("close", cur)
        else:
            self._to("name", cur)

    def _json(self, cur: Cursor) -> None:
        end = self.scan.run(cur.text)
        if end is None:
            cur.more()
        self._json_calls(cur.text[self.vstart:end])
        cur.pos = end
        self._to("close", cur)

    _PHASES = {"open": _open, "name": _name, "args": _args, "value": _value, "after": _after,
               "json": _json}

    def _to(self, phase: str, cur: Cursor) -> None:
        self.phase, self.pos = phase, cur.pos

    def _json_calls(self, text: str) -> None:
        try:
            calls = json.loads(text)
        except ValueError:
            raise Malformed("invalid JSON") from None
        out = []
        for call in calls:
            name = call.get("name") if isinstance(call, dict) else None
            if not isinstance(name, str) or not name:
                raise Malformed("not a call object")
            args = call.get("arguments", {})
            if isinstance(args, str):
                try:
                    ok = isinstance(json.loads(args), dict)
                except ValueError:
                    ok = False
            else:
                ok, args = isinstance(args, dict), _dumps(args)
            if not ok:
                raise Malformed("arguments are not an object")
            out.append((name, args))
        for name, args in out:
            self.sink.begin(name)
            self.sink.args(args)


def _py_str(s: str) -> str:
    """A Python literal for `s` the way the LFM2.5 template writes strings, when it can."""
    if "'" not in s and "\\" not in s and "\n" not in s:
        return "'" + s + "'"
    return json.dumps(s, ensure_ascii=False)


def _value_rule(schema: dict, params: dict) -> str:
    """The Lark for one argument value (see the module doc)."""
    enum = enum_values(schema)
    if enum is not None:
        alts = []
        for v in enum:
            if isinstance(v, str):
                alts.append(lit(_py_str(v)))
                if _py_str(v).startswith("'"):
                    alts.append(lit(json.dumps(v, ensure_ascii=False)))
            elif v is None or isinstance(v, bool):
                alts.append(lit(repr(v)))
            else:
                alts.append(lit(json.dumps(v, ensure_ascii=False)))
        return "(" + " | ".join(alts) + ")"
    types = types_of(schema)
    if types is None:
        return json_rule(embed(schema, params))
    alts = []
    for t in sorted(types):
        if t == "string":
            if any(k in schema for k in ("pattern", "minLength", "maxLength", "format")):
                alts.append(json_rule(embed({**schema, "type": "string"}, params)))
            else:
                alts.append("PY_STR")
        elif t == "boolean":
            alts += ['"True"', '"False"']
        elif t == "null":
            alts.append('"None"')
        else:  # numbers (bounds enforced), arrays, objects: JSON
            alts.append(json_rule(embed({**schema, "type": t}, params)))
    return "(" + " | ".join(alts) + ")" if len(alts) > 1 else alts[0]


def _args_rules(prefix: str, items: list[tuple[str, bool]]) -> tuple[str, list[str]]:
    """An expression for keyword arguments `items` ((rule, required), in order) separated by
    ", ", and the rules it uses: `{prefix}_r{j}` is arguments j.. each after ", ",
    `{prefix}_f{j}` arguments j.. with the first one bare."""
    rules: list[str] = []
    rest = first = ""  # the rules for j + 1 ("" past the last argument)
    for j in range(len(items) - 1, -1, -1):
        rule, required = items[j]
        inner = f"{rule} {rest}".strip()
        piece = f'", " {rule}'
        if required:
            r, f = f"{piece} {rest}".strip(), inner
        else:  # (an optional `first` may itself be empty: then so is this one)
            r = f"({piece})? {rest}".strip()
            f = f"({inner} | {first})" if first else f"({inner})?"
        rules += [f"{prefix}_r{j}: {r}", f"{prefix}_f{j}: {f}"]
        rest, first = f"{prefix}_r{j}", f"{prefix}_f{j}"
    return first, rules


class Lfm2(ToolFormat):
    name = "lfm2"
    openers = (OPEN,)

    def region(self, opener, sink):
        return PythonicRegion(self, opener, sink)

    def _calls(self, tools, choice) -> list[str]:
        rules, alts = [], []
        for i, (name, params) in enumerate(pick(tools, choice)):
            items, required = properties(params)
            args = []
            for j, (key, schema) in enumerate(items):
                rules.append(f"a{i}_{j}: {lit(key + '=')} {_value_rule(schema, params)}")
                args.append((f"a{i}_{j}", key in required))
            expr, helper = _args_rules(f"args{i}", args)
            if free_form(params):
                expr, helper = '(free_arg (", " free_arg)*)?', []
            rules += helper
            rules.append(f"c{i}: " + " ".join(x for x in (lit(name + "("), expr, lit(")")) if x))
            alts.append(f"c{i}")
        free_value = json_rule(embed({"type": ["number", "array", "object"]}))
        return [f"call: {' | '.join(alts)}", *rules,
                f'free_arg: PY_KEY "=" (PY_STR | "True" | "False" | "None" | {free_value})',
                "PY_KEY: /[A-Za-z_][A-Za-z0-9_]*/",
                f"PY_STR: {PY_STR}"]

    def grammar(self, tools: Sequence[dict], choice: str | None = None,
                parallel: bool = True, max_calls: int = MAX_CALLS) -> str:
        return "\n".join([
            f"start: {OPEN} \"[\" {repeat('call', ', ', parallel and choice is None, max_calls)} \"]\" "
            f"{CLOSE}",
            *self._calls(tools, choice),
        ])

    def auto_grammar(self, tools: Sequence[dict]) -> str | None:
        return "\n".join([
            f"start: TEXT ({OPEN} \"[\" {repeat('call', ', ', True)} \"]\" {CLOSE} TEXT)*",
            "TEXT: /(?s:.*)/",
            *self._calls(tools, None),
        ])
