"""`harmony`: gpt-oss's reply format (OpenAI harmony). The prompt ends with `<|start|>assistant`;
the reply is one or more messages, each a header, `<|message|>` and a body:

    <|channel|>analysis<|message|>The user wants the weather.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}

The channel decides what a body is: `analysis` is reasoning (`reasoning_content`), `final`
and `commentary` without a recipient (a preamble) are `content`, and a message to
`functions.NAME` is a call of NAME whose body is its JSON arguments (streamed as written). The
recipient may stand in the channel part (`<|channel|>commentary to=functions.NAME`, what
gpt-oss writes) or before it (` to=functions.NAME<|channel|>commentary`, how its template
renders past calls); the content type (` <|constrain|>json` or ` json`) is optional. As
llama.cpp reads it (common/chat.cpp, `common_chat_params_init_gpt_oss`): a stray
`<|channel|>commentary to=assistant` before the real channel is ignored, and a message to any
other recipient (a built-in tool such as `python` or `container.exec`) is dropped. A body ends
at `<|end|>` (another message follows after `<|start|>assistant`), `<|call|>`, `<|return|>` or
the end of the reply; `<|call|>` and `<|return|>` end generation, so they are never in the
text. A reply that does not open with a header is plain content until one appears.

The markers `<|start|>`, `<|channel|>`, `<|message|>`, `<|constrain|>` and (in a vocabulary
with `<|call|>` and `<|return|>`) `<|end|>` are user-defined tokens, as llama.cpp makes them:
they are decoded as their text without `GenerationRequest.special_text`, and a grammar
writes them as text literals (which the one token produces).

No partial markup reaches a client: a header, a terminator or a call the reply ends inside is
dropped (the messages before it stand); a call whose arguments are not a JSON object becomes
content as written, header included.

Grammar: any number of analysis or preamble messages (each ended by `<|end|><|start|>assistant`),
then the calls: each the recipient in either place, channel `commentary` or `analysis`, the
content type optional, the arguments `%json` of the tool's schema; one to `max_calls` of them
(one if not parallel, or for a named tool), separated by `<|end|><|start|>assistant`. After a
call the grammar accepts the end, so gpt-oss's `<|call|>` (an end-of-generation token) ends the
turn where it writes one, which it does after its first call; its template renders one call
per assistant message. The auto grammar ends with the calls or a `final` message of any text.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Sequence

from kvshare.toolcalls.base import ToolFormat
from kvshare.toolcalls.calls import ParsedOutput, collect
from kvshare.toolcalls.grammar import MAX_CALLS, lit, pick, regex_lit, repeat
from kvshare.toolcalls.scan import JsonScanner
from kvshare.toolcalls.schema import embed, json_rule
from kvshare.toolcalls.stream import Malformed, ToolCallStream, _append, held

__all__ = ["Harmony", "HarmonyStream"]

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
END, CALL, RETURN = "<|end|>", "<|call|>", "<|return|>"
# what ends a message body
TERMINATORS = (END, CALL, RETURN)
# what a header may begin with: at the start of the reply, or after `<|start|>` (its role)
LEADS = (CHANNEL, MESSAGE, " to=", CONSTRAIN)
ROLE = "assistant"
_MAX_HEADER = 256
_WS = " \t\r\n"
# the parts of a header, in any order: recipients, channels, content types
_PART = re.compile(r"\s*to=(?P<to>[^\s<]+)|<\|channel\|>(?P<channel>[\w-]+)"
                   r"|\s*<\|constrain\|>(?P<ctype>[\w-]+)|\s+(?P<bare>[\w-]+)")


@dataclass
@dataclass
class _Header:
    kind: str  # "reasoning" | "content" | "call" | "drop"
    name: str = ""


def _header(text: str) -> _Header:
    """What the message whose header (before `<|message|>`) is `text` holds; Malformed if it
    is not a header."""
    pos, recipient, channel = 0, "", ""
    while pos < len(text):
        m = _PART.match(text, pos)
        if m is None or m.end() == pos:
            raise Malformed("not a harmony header")
        if m["to"]:
            recipient = m["to"]
        elif m["channel"]:
            channel = m["channel"]
        pos = m.end()
    if recipient.startswith("functions."):
        name = recipient[len("functions."):]
        if not name:
            raise Malformed("no function name")
        return _Header("call", name)
    if recipient and recipient != "assistant":
        return _Header("drop")  # a built-in tool's call: not one of the request's tools
    return _Header("reasoning" if channel == "analysis" else "content")


def _end_of_body(buf: str, start: int) -> tuple[int, str]:
    """The first terminator at or after `start`: (offset, terminator), (-1, "") if none."""
    best, which = -1, ""
    for t in TERMINATORS:
        i = buf.find(t, start)
        if i >= 0 and (best < 0 or i < best):
            best, which = i, t
    return best, which


def _held(buf: str, tags: Sequence[str]) -> int:
    return max(held(buf, t) for t in tags)


class HarmonyStream(ToolCallStream):
    """`ToolCallStream`'s contract for harmony replies: `feed` / `finish` return
    `chat.completion.chunk` deltas, with `{"reasoning_content": ...}` for the analysis channel
    besides content and calls; `has_calls` and `broken_calls` as there."""

    def __init__(self, fmt, incremental: bool = True):
        super().__init__(fmt, incremental)
        # "head": a header may start here (`_role`: after `<|start|>`, which the role follows);
        # "text": plain content; "body": a message's body (`_msg`); "after": past a terminator
        self._state = "head"
        self._role = False
        self._first = True  # at the very start of the reply
        self._msg = _Header("content")
        self._scan: JsonScanner | None = None
        self._sent = 0  # argument text sent so far (offset in `_buf`)
        self._raw = ""  # the message as written from its header (content if it breaks)
        self._call_deltas: list[dict] = []

    def feed(self, text: str) -> list[dict]:
        if self._finished:
            raise RuntimeError("feed() after finish()")
        if text:
            self._buf += text
            self._run(final=False)
        return self._take()

    def finish(self) -> list[dict]:
        if not self._finished:
            self._finished = True
            self._run(final=True)
        return self._take()

    # ---- the loop -------------------------------------------------------------------------

    def _run(self, final: bool) -> None:
        step = {"head": self._head, "text": self._text_mode, "body": self._body,
                "after": self._after}
        while step[self._state](final):
            pass

    def _head(self, final: bool) -> bool:
        """A header (after the role when `_role`): read up to `<|message|>`."""
        buf = self._buf
        lead = len(ROLE) if self._role else 0
        if self._role and not buf.startswith(ROLE):
            if ROLE.startswith(buf):
                if final:
                    self._buf = ""  # a cut-off `<|start|>assistant`
                return False
            return self._not_markup()
        rest = buf[lead:]
        if not any(rest.startswith(x) for x in LEADS):
            if any(x.startswith(rest) for x in LEADS):  # (empty, or a lead in part)
                if not final:
                    return False
                if self._first and len(rest) == 1:  # "<" alone is a reply, not markup
                    return self._not_markup()
                self._buf = ""
                return False
            return self._not_markup()
        i = buf.find(MESSAGE, lead)
        if i < 0:
            if final:
                self._buf = ""  # the reply ended inside a header: dropped
                return False
            return self._not_markup() if len(rest) > _MAX_HEADER else False
        try:
            self._msg = _header(buf[lead:i])
        except Malformed:
            return self._not_markup()
        self._raw = (START if self._role else "") + buf[:i + len(MESSAGE)]
        self._first = self._role = False
        self._buf = buf[i + len(MESSAGE):]
        self._state, self._scan, self._sent = "body", None, 0
        return True

    def _not_markup(self) -> bool:
        """What was taken for a header is not one: content as written (a leading marker
        included, so that reading goes on after it), then plain text."""
        skip = START if self._role else ""
        if not skip and self._buf.startswith(CHANNEL):
            skip = CHANNEL
            self._buf = self._buf[len(CHANNEL):]
        self._content(skip)
        self._first = self._role = False
        self._state = "text"
        return True

    def _text_mode(self, final: bool) -> bool:
        """Plain content, until a header opens (`<|channel|>` or `<|start|>`)."""
        buf = self._buf
        i, which = -1, ""
        for o in (CHANNEL, START):
            j = buf.find(o)
            if j >= 0 and (i < 0 or j < i):
                i, which = j, o
        if i >= 0:
            self._content(buf[:i])
            if which == START:
                self._buf, self._role = buf[i + len(START):], True
            else:
                self._buf = buf[i:]
            self._state = "head"
            return True
        keep = _held(buf, (CHANNEL, START))
        if final:
            keep = keep if keep >= 2 else 0  # ("a <" keeps its "<")
        self._content(buf[:len(buf) - keep])
        self._buf = "" if final else buf[len(buf) - keep:]
        return False

    def _body(self, final: bool) -> bool:
        return self._call(final) if self._msg.kind == "call" else self._text_body(final)

    def _text_body(self, final: bool) -> bool:
        buf = self._buf
        i, which = _end_of_body(buf, 0)
        if i >= 0:
            self._say(buf[:i])
            self._terminated(i, which)
            return True
        keep = _held(buf, TERMINATORS)
        if final:
            keep = keep if keep >= 2 else 0  # a terminator cut off at the end is markup
        cut = len(buf) - keep
        self._say(buf[:cut])
        self._buf = "" if final else buf[cut:]
        return False

    def _say(self, text: str) -> None:
        if not text:
            return
        if self._msg.kind == "reasoning":
            self._reasoning(text)
        elif self._msg.kind == "content":
            self._content(text)

    def _reasoning(self, text: str) -> None:
        _append(self._out, {"reasoning_content": text})

    def _content(self, text: str) -> None:
        if text:
            self._content_sent = True
            _append(self._out, {"content": text})

    def _terminated(self, i: int, which: str) -> None:
        """A message ended at offset `i` with `which`."""
        self._buf, self._state = self._buf[i + len(which):], "after"

    def _after(self, final: bool) -> bool:
        """Past `<|end|>` (or a stop token written as text): `<|start|>` and the next message,
        else plain content."""
        buf = self._buf.lstrip(_WS)
        if buf.startswith(START):
            self._buf, self._role, self._state = buf[len(START):], True, "head"
            return True
        if START.startswith(buf):  # nothing yet, or `<|start|>` in part
            if final:
                self._buf = ""
            return False
        self._state = "text"
        return True

    # ---- a call's arguments ---------------------------------------------------------------

    def _call(self, final: bool) -> bool:
        try:
            return self._read_call(final)
        except _Cut:
            if self._incremental and self._scan is not None:
                self.broken_calls.append(self._index)
            self._call_deltas, self._buf = [], ""
            return False
        except Malformed:
            if self._incremental and self._scan is not None:
                self.broken_calls.append(self._index)
            self._call_deltas = []
            self._content(self._raw)  # the message as written: header, then its body
            self._msg = _Header("content")
            return True

    def _read_call(self, final: bool) -> bool:
        """The arguments object, streamed as written, then the message's end."""
        buf = self._buf
        if self._scan is None:
            j = len(buf) - len(buf.lstrip(_WS))
            if j == len(buf):
                if final:
                    raise _Cut()
                return False
            if buf[j] != "{":
                raise Malformed("arguments are not a JSON object")
            self._scan, self._sent = JsonScanner(j), j
            self._announce(self._msg.name)
        end = self._scan.run(buf)
        upto = self._scan.pos if end is None else end
        if upto > self._sent:
            self._args(buf[self._sent:upto])
            self._sent = upto
        if end is None:
            if final:
                raise _Cut()
            return False
        try:
            args = json.loads(buf[:end])
        except ValueError:
            raise Malformed("invalid JSON") from None
        if not isinstance(args, dict):
            raise Malformed("arguments are not an object")
        k = end + len(buf[end:]) - len(buf[end:].lstrip(_WS))
        i, which = _end_of_body(buf, k)
        if i == k:
            self._complete()
            self._terminated(i, which)
            return True
        rest = buf[k:]
        if _held(rest, TERMINATORS) < len(rest):
            raise Malformed("text after the arguments")
        if not final:
            return False  # (nothing yet, or a terminator in part)
        self._complete()  # a terminator cut off at the end is dropped
        self._buf = ""
        return False

    def _announce(self, name: str) -> None:
        self._index = self._next_index
        self._next_index += 1
        self._call_delta({"tool_calls": [{"index": self._index, "id": _new_id(), "type": "function",
                                          "function": {"name": name, "arguments": ""}}]})

    def _args(self, fragment: str) -> None:
        self._call_delta({"tool_calls": [{"index": self._index,
                                          "function": {"arguments": fragment}}]})

    def _call_delta(self, delta: dict) -> None:
        _append(self._out if self._incremental else self._call_deltas, delta)

    def _complete(self) -> None:
        self.has_calls = True
        for d in self._call_deltas:
            _append(self._out, d)
        self._call_deltas = []


class _Cut(Exception):
    """The reply ended inside a call: it is dropped."""


def _new_id() -> str:
    from kvshare.toolcalls.calls import new_call_id

    return new_call_id()


class Harmony(ToolFormat):
    name = "harmony"

    def region(self, opener, sink):
        raise NotImplementedError("harmony replies are read whole by HarmonyStream")

    def stream(self, incremental: bool = True) -> ToolCallStream:
        return HarmonyStream(self, incremental=incremental)

    def parse(self, text: str) -> ParsedOutput:
        """The reply's content, calls and reasoning."""
        s = self.stream(incremental=False)
        deltas = s.feed(text) + s.finish()
        out = collect(deltas)
        reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
        return ParsedOutput(out.content, out.tool_calls, reasoning)

    @staticmethod
    def _rules(tools: Sequence[dict], choice: str | None) -> list[str]:
        """`pre`: an analysis or preamble message and the next message's start; `call`: one
        call of the tools (or of `choice`)."""
        header = (f"{lit(CHANNEL)} (\"commentary\" | \"analysis\")")
        ctype = f"({lit(' ' + CONSTRAIN + 'json')} | \" json\")?"
        rules, alts = [], []
        for i, (name, params) in enumerate(pick(tools, choice)):
            to = lit(" to=functions." + name)
            rules.append(f"c{i}: ({to} {header} | {header} {to}) {ctype} {lit(MESSAGE)} "
                         f"{json_rule(embed(params))}")
            alts.append(f"c{i}")
        # a body ends at the first `<|end|>`, as the reader ends it
        return [f"call: {' | '.join(alts)}",
                f"pre: {lit(CHANNEL)} (\"analysis\" | \"commentary\") {lit(MESSAGE)} pre_body "
                f"{lit(START + ROLE)}",
                f"pre_body[lazy]: /(?s:.*){regex_lit(END)}/",
                *rules]

    def grammar(self, tools: Sequence[dict], choice: str | None = None,
                parallel: bool = True, max_calls: int = MAX_CALLS) -> str:
        calls = repeat("call", END + START + ROLE, parallel and choice is None, max_calls)
        return "\n".join([f"start: pre* {calls}", *self._rules(tools, choice)])

    def auto_grammar(self, tools: Sequence[dict]) -> str | None:
        return "\n".join([
            f"start: pre* ({repeat('call', END + START + ROLE, True)} | final)",
            f"final: {lit(CHANNEL + 'final' + MESSAGE)} /(?s:.*)/",
            *self._rules(tools, None),
        ])
