"""The stream reader every format shares: text passes through as content, call blocks go to the
format's `Region` reader, and the OpenAI deltas come out.

What reaches the client is decided by the text so far, never by where a chunk ended: text that
could still begin a call opener is held back (like a stop string), and so is whitespace that
would be dropped if a call followed. The content of a reply with calls is its text without the
call blocks and without the whitespace that touches them: whitespace before a block, between
blocks and after the last one goes; whitespace after a block that leads into more text stays
only when content was sent before ("A\\n<call>\\nB" reads "A\\nB", "<call>\\n\\nB" reads "B").

A block that turns out malformed becomes content exactly as written, and reading goes on right
after its opener. A block the reply ends inside (cut off by max_tokens) is dropped: the calls
before it stand, and no partial markup reaches the client. In incremental mode (the default) a call's name and its
argument fragments go out as soon as they are known, so a block that fails *after* a call was
announced leaves that call as sent (its index is in `broken_calls`; the block's raw text still
follows as content, which is the same in both modes). With `incremental=False` a block's calls
go out only once the whole block has parsed, and the deltas always add up to `parse()`.
"""

from __future__ import annotations

from typing import Protocol

from kvshare.toolcalls.calls import new_call_id

__all__ = ["ToolCallStream", "Region", "Cursor", "NeedMore", "Malformed", "Truncated", "Sink",
           "Markup", "held"]

WS = " \t\r\n"


class NeedMore(Exception):
    """The block's text so far is a valid beginning; wait for more."""


class Malformed(Exception):
    """The block cannot be a call: it is content as written."""


class Truncated(Malformed):
    """The reply ended inside the block: the block is dropped."""


class Cursor:
    """A position in a block's text with the small reads the format readers need; reading past
    the end raises `NeedMore` (or `Malformed` once the text is final)."""

    __slots__ = ("text", "pos", "final")

    def __init__(self, text: str, pos: int, final: bool):
        self.text, self.pos, self.final = text, pos, final

    def more(self):
        raise Truncated("truncated") if self.final else NeedMore()

    def ws(self) -> None:
        t, n, i = self.text, len(self.text), self.pos
        while i < n and t[i] in WS:
            i += 1
        self.pos = i

    def char(self) -> str:
        if self.pos >= len(self.text):
            self.more()
        return self.text[self.pos]

    def expect(self, lit: str) -> None:
        if self.text.startswith(lit, self.pos):
            self.pos += len(lit)
            return
        rest = self.text[self.pos:]
        if len(rest) < len(lit) and lit.startswith(rest):
            self.more()
        raise Malformed(f"expected {lit!r}")

    def choose(self, *lits: str) -> str:
        """Consume whichever of `lits` is here."""
        rest = self.text[self.pos:]
        for lit in lits:
            if rest.startswith(lit):
                self.pos += len(lit)
                return lit
        if any(len(rest) < len(lit) and lit.startswith(rest) for lit in lits):
            self.more()
        raise Malformed(f"expected one of {lits!r}")

    def until(self, lit: str, forbid: str = "") -> str:
        """The text up to `lit` (consumed); `forbid` characters may not come before it."""
        i = self.text.find(lit, self.pos)
        seen = self.text[self.pos:] if i < 0 else self.text[self.pos:i]
        if forbid and any(c in seen for c in forbid):
            raise Malformed(f"unexpected character before {lit!r}")
        if i < 0:
            self.more()
        self.pos = i + len(lit)
        return seen


class Sink:
    """Where a region reports what it read (implemented by `ToolCallStream`)."""

    def begin(self, name: str) -> None:  # a call's name is known
        raise NotImplementedError

    def args(self, fragment: str) -> None:  # more of the current call's arguments text
        raise NotImplementedError

    def text(self, fragment: str) -> None:  # reply text found inside a block (generic format)
        raise NotImplementedError


class Markup(Protocol):
    """What the stream reads of a format (`kvshare.toolcalls.base.ToolFormat`, which is built
    on this module): where call blocks open, and a reader for one block."""

    openers: tuple[str, ...]
    start_openers: tuple[str, ...]
    tentative_openers: tuple[str, ...]
    separators: str

    def region(self, opener: str, sink: Sink) -> Region: ...


class Region:
    """Reads one call block from its opener on. `run` reads from `self.pos` and moves
    `self.pos` forward only past what it has reported to the sink (its checkpoints), so a
    `NeedMore` resumes there; it returns the block's end offset once the block is complete."""

    def __init__(self, fmt: Markup, opener: str, sink: Sink):
        self.fmt, self.opener, self.sink = fmt, opener, sink
        self.pos = len(opener)

    def advance(self, text: str, final: bool) -> int | None:
        """The block's end offset in `text` when complete, None to wait; raises `Malformed`."""
        cur = Cursor(text, self.pos, final)
        try:
            return self.run(cur)
        except NeedMore:
            return None

    def run(self, cur: Cursor) -> int:
        raise NotImplementedError

    # each call is announced complete (name and whole arguments at once), so the calls of a
    # block cut off later stand
    complete_calls = False

    def is_markup(self) -> bool:
        """Whether the text read so far is surely call markup (a cut-off block is dropped),
        rather than possibly a plain answer that starts like one (then it is content)."""
        return True


def held(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper beginning of `tag` (text to hold
    back because it may still become `tag`)."""
    first = tag[0]
    i = text.find(first, max(0, len(text) - len(tag) + 1))
    while i >= 0:
        if tag.startswith(text[i:]):
            return len(text) - i
        i = text.find(first, i + 1)
    return 0


class ToolCallStream(Sink):
    """Turns a reply arriving in pieces into `chat.completion.chunk` deltas:
    `{"content": ...}`, a call's first delta `{"tool_calls": [{"index", "id", "type",
    "function": {"name", "arguments": ""}}]}`, then `{"tool_calls": [{"index", "function":
    {"arguments": fragment}}]}`. `feed` returns the deltas the new text allows, `finish` the
    rest (a block left open becomes content). `has_calls`: a complete call was sent (the
    finish_reason is "tool_calls"); `broken_calls`: indices of calls announced in a block that
    then failed (incremental mode only; their arguments stop where the block broke)."""

    def __init__(self, fmt: Markup, incremental: bool = True):
        self._fmt = fmt
        self._incremental = incremental
        self._buf = ""  # text not yet decided; a region's text starts at its offset 0
        self._region: Region | None = None
        self._region_after_call = False  # the region opened right after a call
        self._opener = ""
        self._lead_ws = ""  # whitespace held before the region (dropped if it parses)
        self._next_index = 0
        self._index = -1  # index of the call being read
        self._block: list[dict] = []  # the region's deltas (buffered mode)
        self._block_calls = 0
        self._out: list[dict] = []
        self._content_sent = False
        self._after_call = False
        self._fresh = True  # nothing decided yet: start openers allowed
        self._finished = False
        self.has_calls = False
        self.broken_calls: list[int] = []

    # ---- public ---------------------------------------------------------------------------

    def feed(self, text: str) -> list[dict]:
        if self._finished:
            raise RuntimeError("feed() after finish()")
        if text:
            self._buf += text
            self._pump(final=False)
        return self._take()

    def finish(self) -> list[dict]:
        if not self._finished:
            self._finished = True
            self._pump(final=True)
        return self._take()

    # ---- Sink -----------------------------------------------------------------------------

    def begin(self, name: str) -> None:
        self._index = self._next_index
        self._next_index += 1
        self._block_calls += 1
        self._emit({"tool_calls": [{"index": self._index, "id": new_call_id(), "type": "function",
                                    "function": {"name": name, "arguments": ""}}]})

    def args(self, fragment: str) -> None:
        if fragment:
            self._emit({"tool_calls": [{"index": self._index,
                                        "function": {"arguments": fragment}}]})

    def text(self, fragment: str) -> None:
        # out at once in both modes: text stays even when the block is cut off later
        if fragment:
            self._content_sent = True
            _append(self._out, {"content": fragment})

    # ---- the loop -------------------------------------------------------------------------

    def _pump(self, final: bool) -> None:
        while True:
            if self._region is not None:
                try:
                    end = self._region.advance(self._buf, final)
                except Truncated:
                    # right after a call, a cut-off block is the next call's beginning
                    if self._region.is_markup() or self._region_after_call:
                        self._drop()
                        return
                    self._fail()
                    continue
                except Malformed:
                    self._fail()
                    continue
                if end is None:
                    return
                self._commit(end)
                continue
            if not self._buf or not self._text(final):
                return

    def _separators(self) -> str:
        return WS + (self._fmt.separators if self._after_call else "")

    def _text(self, final: bool) -> bool:
        """Text mode: emit what is surely content; start a region at an opener (True)."""
        buf = self._buf
        starts = self._fmt.start_openers if (self._fresh or self._after_call) else ()
        lead = 0  # separators at the start, where a start opener may follow
        if starts:
            seps = self._separators()
            while lead < len(buf) and buf[lead] in seps:
                lead += 1
        pos, opener = self._first_opener(buf, starts, lead)
        if pos >= 0:
            self._open_region(pos, opener, at_start=opener in starts and pos == lead)
            return True
        if final:
            # an opener cut off at the very end is markup too: dropped (one character of it
            # only right after a call, where text cannot follow: "a < b" keeps its "<"), but
            # not a tentative one (a reply may end with "```", a fence's end) unless it follows
            # a call
            cut = max((held(buf, o) for o in self._fmt.openers
                       if self._after_call or o not in self._fmt.tentative_openers),
                      default=0)
            if cut >= 2 or (cut and self._after_call):
                buf = buf[:-cut].rstrip(WS)
            if not (self._after_call and buf.strip(self._separators()) == ""):
                self._content(buf)  # (separators after the last call are dropped)
            self._buf = ""
            return False
        if starts and lead == len(buf):
            return False  # only separators so far: a start opener may still follow
        self._hold_back(buf, starts, lead)
        return False

    def _first_opener(self, buf: str, starts: tuple[str, ...], lead: int) -> tuple[int, str]:
        """`(offset, opener)` of the first call opener in `buf`, `(-1, "")` if none: an opener
        anywhere, or one of `starts` right after the `lead` separators."""
        pos, opener = -1, ""
        for o in self._fmt.openers:
            i = buf.find(o)
            if i >= 0 and (pos < 0 or i < pos):
                pos, opener = i, o
        for o in starts:
            if buf.startswith(o, lead) and (pos < 0 or lead <= pos):
                pos, opener = lead, o
        return pos, opener

    def _open_region(self, pos: int, opener: str, at_start: bool) -> None:
        """Send the text before the opener at `pos` (less the whitespace touching it, held in
        case the block parses; all of it for a start opener) and start reading the block."""
        buf = self._buf
        pre = buf[:pos]
        if at_start:
            body, ws = "", pre
        else:
            body = pre.rstrip(WS)
            ws = pre[len(body):]
        self._content(body)
        self._lead_ws, self._opener = ws, opener
        self._region_after_call = self._after_call
        self._buf = buf[pos:]
        self._block, self._block_calls = [], 0
        self._region = self._fmt.region(opener, self)

    def _hold_back(self, buf: str, starts: tuple[str, ...], lead: int) -> None:
        """Send the text that is surely content: all but an end that may still become an
        opener, and the whitespace before it (dropped if a call follows)."""
        keep = max((held(buf, o) for o in self._fmt.openers), default=0)
        if starts and lead < len(buf):
            rest = buf[lead:]
            if any(o.startswith(rest) for o in starts):
                keep = max(keep, len(rest))
        cut = len(buf) - keep
        while cut > 0 and buf[cut - 1] in WS:
            cut -= 1
        if self._after_call and buf[:cut].strip(self._separators()) == "":
            cut = 0
        self._content(buf[:cut])
        self._buf = buf[cut:]

    def _content(self, text: str) -> None:
        if not text:
            return
        if self._after_call and not self._content_sent:
            text = text.lstrip(WS)
        self._after_call = False
        self._fresh = False
        if text:
            self._content_sent = True
            self._emit({"content": text})

    def _commit(self, end: int) -> None:
        if self._block_calls:
            self.has_calls = True
        if not self._incremental:
            self._out.extend(self._block)
        self._block, self._block_calls = [], 0
        self._buf = self._buf[end:]
        self._region, self._lead_ws = None, ""
        self._after_call, self._fresh = True, False

    def _drop(self) -> None:
        """The reply ended inside the block: it goes, whitespace before it included (a
        block of complete calls keeps those)."""
        if self._region is not None and self._region.complete_calls:
            self.has_calls = self.has_calls or self._block_calls > 0
        elif self._incremental:
            self.broken_calls += range(self._next_index - self._block_calls, self._next_index)
        self._block, self._block_calls = [], 0
        self._region, self._lead_ws, self._buf = None, "", ""

    def _fail(self) -> None:
        if self._incremental:
            self.broken_calls += range(self._next_index - self._block_calls, self._next_index)
        self._block, self._block_calls = [], 0
        self._region = None
        # the opener is content now, as written (whitespace before it included)
        text = self._lead_ws + self._opener
        self._buf = self._buf[len(self._opener):]
        self._lead_ws = ""
        self._content(text)

    # ---- output ---------------------------------------------------------------------------

    def _emit(self, delta: dict) -> None:
        block = (self._region is not None and not self._incremental
                 and not self._region.complete_calls)
        _append(self._block if block else self._out, delta)

    def _take(self) -> list[dict]:
        out, self._out = self._out, []
        return out


def _append(out: list[dict], delta: dict) -> None:
    """Append, merging with the previous delta when both are content or both are argument
    fragments of the same call."""
    if out:
        last = out[-1]
        if "content" in delta and "content" in last:
            last["content"] += delta["content"]
            return
        tc, ltc = delta.get("tool_calls"), last.get("tool_calls")
        if (tc and ltc and "id" not in tc[0] and "id" not in ltc[0]
                and tc[0]["index"] == ltc[0]["index"]):
            ltc[0]["function"]["arguments"] += tc[0]["function"]["arguments"]
            return
    out.append(delta)
