"""`hermes`: Hermes 2 Pro / Qwen2.5 / Qwen3 calls, and kvshare's own Gemma and ChatML templates:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

one block per call (several blocks: parallel calls), whitespace around the object free,
"arguments" an object or a JSON string holding one ("parameters" is read too, and a call without
arguments gets `{}`).

Grammar: each block is `<tool_call>\\n` + the JSON object + `\\n</tool_call>`, blocks separated
by one newline; the object is `%json` of {"name": const, "arguments": the tool's parameters
schema} (anyOf over the tools), written as json.dumps writes it. The auto grammar is free text in
which the first `<tool_call>` starts such a block (a lazy lexeme; the free text may not contain
the opener otherwise).
"""

from __future__ import annotations

from typing import Sequence

from kvshare.toolcalls.base import ToolFormat
from kvshare.toolcalls.grammar import MAX_CALLS, lit, pick, repeat
from kvshare.toolcalls.jsoncall import HERMES_HEAD, JsonCallRegion
from kvshare.toolcalls.schema import call_schema, json_rule

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class Hermes(ToolFormat):
    name = "hermes"
    openers = (OPEN,)

    def region(self, opener, sink):
        return JsonCallRegion(self, opener, sink, head=HERMES_HEAD,
                              args_keys=("arguments", "parameters"), closing=CLOSE)

    def _body(self, tools, choice) -> str:
        return json_rule(call_schema(pick(tools, choice), "arguments"))

    def grammar(self, tools: Sequence[dict], choice: str | None = None,
                parallel: bool = True, max_calls: int = MAX_CALLS) -> str:
        return "\n".join([
            "start: " + repeat("call", "\n", parallel and choice is None, max_calls),
            f"call: {lit(OPEN + chr(10))} {self._body(tools, choice)} {lit(chr(10) + CLOSE)}",
        ])

    def auto_grammar(self, tools: Sequence[dict]) -> str | None:
        return "\n".join([
            "start: (before_call call_body)* TEXT",
            "before_call[lazy]: /(?s:.*)<tool_call>/",
            f"call_body: {lit(chr(10))} {self._body(tools, None)} {lit(chr(10) + CLOSE)}",
            "TEXT: /(?s:.*)/ & ~/(?s:.*)<tool_call>(?s:.*)/",
        ])
