"""What every tool-call format offers (`ToolFormat`).

A format's `parse` is its stream fed the whole text at once and buffered (`collect` of its deltas),
so a parsed output and the concatenation of a stream's deltas agree by construction; the stream
only has to make every decision from the text seen so far, never from where a chunk ended.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Sequence

from kvshare.toolcalls.calls import ParsedOutput, collect
from kvshare.toolcalls.grammar import MAX_CALLS
from kvshare.toolcalls.stream import Region, Sink, ToolCallStream

__all__ = ["ToolFormat"]


class ToolFormat(ABC):
    """One model family's tool-call markup: reading it (`parse`, `stream`) and forcing it
    (`grammar`, `auto_grammar`: llguidance Lark text).

    `tools` (OpenAI `tools` list) is what the readers may consult: only `qwen35` does, to turn
    its raw parameter text into JSON of the declared type. Bind it with `get_format(name, tools)`
    or `fmt.with_tools(tools)`; the grammar methods take their tools explicitly.
    """

    name: str = ""
    # strings that open a call anywhere in the text
    openers: tuple[str, ...] = ()
    # strings that open a call only at the start of the reply or right after another call
    start_openers: tuple[str, ...] = ()
    # openers that begin a call only when what follows parses as one (text that looks like
    # markup: a Markdown fence, a tag, an object); cut off at the very end they stay text
    tentative_openers: tuple[str, ...] = ()
    # characters besides whitespace that may separate consecutive calls (dropped with them)
    separators: str = ""
    # the reply is always in the format's shape when the request has tools: "auto" is
    # constrained too (`generic`)
    forced_auto: bool = False

    def __init__(self, tools: Sequence[dict] | None = None):
        self.tools: list[dict] = list(tools or [])

    def with_tools(self, tools: Sequence[dict] | None) -> "ToolFormat":
        return type(self)(tools)

    def parse(self, text: str) -> ParsedOutput:
        """Split a complete reply. Markup that does not parse stays in `content` as written."""
        s = self.stream(incremental=False)
        return collect(s.feed(text) + s.finish())

    def stream(self, incremental: bool = True) -> ToolCallStream:
        """A reader for one reply arriving in pieces (see `ToolCallStream`)."""
        return ToolCallStream(self, incremental=incremental)

    @abstractmethod
    def region(self, opener: str, sink: Sink) -> Region:
        """A reader for one block of calls starting with `opener` (used by the stream)."""

    @abstractmethod
    def grammar(self, tools: Sequence[dict], choice: str | None = None,
                parallel: bool = True, max_calls: int = MAX_CALLS) -> str:
        """Lark text that admits only calls: one to `max_calls` of any tool (`choice` None, one
        if not `parallel`) or exactly one call of the tool named `choice`; arguments follow the
        tool's `parameters` schema. The grammar ends after the last call it allows."""

    def auto_grammar(self, tools: Sequence[dict]) -> str | None:
        """Lark text for tool_choice "auto": free text, but any call follows the schemas.
        None where the format has no way to say it."""
        return None

    def __repr__(self) -> str:
        return f"<ToolFormat {self.name}>"

