"""`llama3`: Llama 3.1 / 3.2 JSON calls: the reply itself is the call,

    {"name": "get_weather", "parameters": {"city": "Paris"}}

optionally after `<|python_tag|>` (which, unlike a bare `{`, may also follow text). A bare
object counts only at the start of the reply or right after another call; several calls are
separated by `;` and/or whitespace. `"type": "function"` may come first, "arguments" is read
like "parameters", and an object without a name and one of them is content (a JSON answer).

Grammar: one call object, or several separated by "; " when parallel, each `%json` of
{"name": const, "parameters": the tool's schema} written as json.dumps writes it; no
`<|python_tag|>` (the templates' own rendering of past calls has none). The auto grammar is
either that or free text that does not begin with `{`.
"""

from __future__ import annotations

from typing import Sequence

from kvshare.toolcalls.base import ToolFormat
from kvshare.toolcalls.grammar import MAX_CALLS, pick, repeat
from kvshare.toolcalls.jsoncall import LLAMA3_HEAD, JsonCallRegion
from kvshare.toolcalls.schema import call_schema, json_rule

PYTHON_TAG = "<|python_tag|>"


class Llama3(ToolFormat):
    name = "llama3"
    openers = (PYTHON_TAG,)
    start_openers = ("{",)
    separators = ";"

    def region(self, opener, sink):
        return JsonCallRegion(self, opener, sink, head=LLAMA3_HEAD,
                              args_keys=("parameters", "arguments"), closing=None,
                              inline=opener == "{", args_required=True)

    def _calls(self, tools, choice, parallel: bool, max_calls: int = MAX_CALLS) -> list[str]:
        return [repeat("call", "; ", parallel and choice is None, max_calls),
                f"call: {json_rule(call_schema(pick(tools, choice), 'parameters'))}"]

    def grammar(self, tools: Sequence[dict], choice: str | None = None,
                parallel: bool = True, max_calls: int = MAX_CALLS) -> str:
        calls, call = self._calls(tools, choice, parallel, max_calls)
        return "\n".join([f"start: {calls}", call])

    def auto_grammar(self, tools: Sequence[dict]) -> str | None:
        calls, call = self._calls(tools, None, True)
        return "\n".join([
            f"start: {calls} | TEXT",
            call,
            "TEXT: /(?s:.*)/ & ~/[ \\t\\r\\n]*\\{(?s:.*)/",
        ])
