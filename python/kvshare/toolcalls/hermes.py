"""`hermes`: Hermes 2 Pro / Qwen2.5 / Qwen3 calls, and kvshare's own Gemma and ChatML templates:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

one block per call (several blocks: parallel calls), whitespace around the object free,
"arguments" an object or a JSON string holding one ("parameters" is read too, and a call without
arguments gets `{}`).

Small models trained on this format often drop the `<tool_call>` tags: they write the object
bare, in a Markdown fence (around a tag or not), or inside another tag. These are read as llama.cpp's Hermes 2 Pro
parser reads them (`common_chat_parse_hermes_2_pro`: an optional "```json" / "```xml" / "```"
fence, an optional `<function_call>`, `<tool>`, `<tools>`, `<response>`, `<json>`, `<xml>` or
`<JSON>` tag, then `{"name"`), with one difference: an object without a tag or fence is a call
only at the start of the reply, right after another call, or where it is spelled `{"name"`.
Such a lenient block is a call only when its object has a name (one of the request's tools,
where the reader knows them, as llama.cpp's trigger names them) and an "arguments" (or
"parameters") object; anything else in it is content as written. A reply cut off inside one
drops it while what it holds is, or may still become, an object that begins with `{"name"`
(where llama.cpp's lazy grammar takes over), and keeps it as text otherwise. The closing tag and fence are read when present (a reply that ends
right after the object still has its call).

Grammar: each block is `<tool_call>\\n` + the JSON object + `\\n</tool_call>`, blocks separated
by one newline; the object is `%json` of {"name": const, "arguments": the tool's parameters
schema} (anyOf over the tools), written as json.dumps writes it. The auto grammar is free text in
which the first `<tool_call>` starts such a block (a lazy lexeme; the free text may not contain
the opener otherwise). A reply that begins like a bare or fenced call (optional whitespace, an
optional "```json" / "```xml" / "```" line, then `{`) must be one, its object forced by the
schemas as in a block and the fence closed; after it, blocks and text as above. (llama.cpp
triggers its lazy grammar a little later, at `{"name"`; here a reply cannot begin with another
JSON object.)
"""

from __future__ import annotations

from typing import Sequence

from kvshare.toolcalls.base import ToolFormat
from kvshare.toolcalls.grammar import MAX_CALLS, lit, pick, repeat
from kvshare.toolcalls.jsoncall import HERMES_HEAD, JsonCallRegion
from kvshare.toolcalls.schema import call_schema, json_rule
from kvshare.toolcalls.stream import Cursor, Malformed, Truncated

OPEN, CLOSE = "<tool_call>", "</tool_call>"
# llama.cpp's other tags around a Hermes call object, and its fences
TAGS = ("<function_call>", "<tools>", "<tool>", "<response>", "<json>", "<xml>", "<JSON>")
FENCES = ("```json\n", "```xml\n", "```\n")
FENCE_END = "```"
NAMED_OBJECT = '{"name"'


class LenientCallRegion(JsonCallRegion):
    """A call object bare (opener `{` or `{"name"`), after a fence (then maybe a tag), or after
    a tag; the matching closing tag and fence are read after it when present."""

    def __init__(self, fmt, opener, sink):
        inline = opener.startswith("{")
        names = frozenset(t["function"]["name"] for t in fmt.tools if "function" in t)
        super().__init__(fmt, opener, sink, head=HERMES_HEAD,
                         args_keys=("arguments", "parameters"), closing=None, inline=inline,
                         args_required=True, names=names or None)
        self.fence = opener in FENCES
        self.tag = opener if opener in TAGS else ""  # (after a fence: also <tool_call>)
        self.tag_read = not self.fence  # a fence may be followed by a tag
        self._text = ""

    def is_markup(self) -> bool:
        # cut off, the block is a call (dropped) once its object opened with `{"name"`, the
        # point where llama.cpp's lazy grammar takes over, and while it still may (a reply
        # cut off inside "```json\n{" ends without the fragment); arguments given as a string
        # are a call's too
        if self.headed:
            return True
        rest = "".join(self._text[len(self.opener) if not self.inline else 0:].split())
        if self.fence:
            for tag in (OPEN,) + TAGS:
                if rest.startswith(tag) or tag.startswith(rest):
                    rest = rest[len(tag):]
                    break
        return rest.startswith(NAMED_OBJECT) or NAMED_OBJECT.startswith(rest)

    def advance(self, text: str, final: bool) -> int | None:
        self._text = text
        return super().advance(text, final)

    def run(self, cur: Cursor) -> int:
        if not self.tag_read:
            cur.ws()
            rest = cur.text[cur.pos:]
            for tag in (OPEN,) + TAGS:
                if rest.startswith(tag):
                    self.tag = tag
                    cur.pos += len(tag)
                    break
            else:
                if any(len(rest) < len(t) and t.startswith(rest) for t in (OPEN,) + TAGS):
                    cur.more()
            self.tag_read, self.pos = True, cur.pos
        super().run(cur)
        for closing in ("</" + self.tag[1:] if self.tag else "",
                        FENCE_END if self.fence else ""):
            if closing:
                self._close(cur, closing)
        return cur.pos

    @staticmethod
    def _close(cur: Cursor, closing: str) -> None:
        """Read `closing` after optional whitespace. A reply that ends first, or text other
        than `closing`, leaves the call standing (the block then ends at the object)."""
        start = cur.pos
        cur.ws()
        if cur.pos == len(cur.text) and cur.final:
            return
        try:
            cur.expect(closing)
        except Truncated:  # the reply ends inside the closing: it goes with the block
            cur.pos = len(cur.text)
        except Malformed:
            cur.pos = start


class Hermes(ToolFormat):
    name = "hermes"
    openers = (OPEN, NAMED_OBJECT) + TAGS + FENCES
    tentative_openers = (NAMED_OBJECT,) + TAGS + FENCES
    start_openers = ("{",)

    def region(self, opener, sink):
        if opener == OPEN:
            return JsonCallRegion(self, opener, sink, head=HERMES_HEAD,
                                  args_keys=("arguments", "parameters"), closing=CLOSE)
        return LenientCallRegion(self, opener, sink)

    def _body(self, tools, choice) -> str:
        return json_rule(call_schema(pick(tools, choice), "arguments"))

    def grammar(self, tools: Sequence[dict], choice: str | None = None,
                parallel: bool = True, max_calls: int = MAX_CALLS) -> str:
        return "\n".join([
            "start: " + repeat("call", "\n", parallel and choice is None, max_calls),
            f"call: {lit(OPEN + chr(10))} {self._body(tools, choice)} {lit(chr(10) + CLOSE)}",
        ])

    def auto_grammar(self, tools: Sequence[dict]) -> str | None:
        body = self._body(tools, None)
        # A reply that opens like a call (whitespace, an optional fence line, then `{`: llama.cpp
        # triggers its lazy grammar at `{"name"`) is one. The text lexemes that start the reply
        # exclude that opening outright, since llguidance cannot keep a text lexeme and the
        # nested %json grammar alive side by side; FIRST_BEFORE is the lazy `before_call` as a
        # plain lexeme (ending at the first <tool_call>) for the same reason.
        lead = r"[ \t\r\n]*(```(json|xml)?\n)?\{(?s:.*)"
        no_call = r"(?s:.*)<tool_call>(?s:.*)"
        return "\n".join([
            "start: lead calls | FIRST_BEFORE call_body calls | FIRST_TEXT",
            "calls: (before_call call_body)* TEXT",
            f"lead: LEAD_WS? {body} | LEAD_WS? FENCE {body} {lit(chr(10) + FENCE_END)}",
            "LEAD_WS: /[ \\t\\r\\n]+/",
            "FENCE: /```(json|xml)?\\n/",
            "FIRST_BEFORE: /(?s:.*)<tool_call>/ & ~/(?s:.*)<tool_call>(?s:.+)/ & ~/" + lead + "/",
            "before_call[lazy]: /(?s:.*)<tool_call>/",
            f"call_body: {lit(chr(10))} {body} {lit(chr(10) + CLOSE)}",
            f"FIRST_TEXT: /(?s:.*)/ & ~/{no_call}/ & ~/{lead}/",
            f"TEXT: /(?s:.*)/ & ~/{no_call}/",
        ])
