"""What a tool call is once read: `ToolCall`, a reply split into text and calls
(`ParsedOutput`), the deltas of a stream added up as a client does (`collect`), and the ids
calls get (`new_call_id`).

Plain data, below both the stream reader (`stream.py`, which gives calls their ids) and the
formats (`base.py`, whose `parse` collects a stream's deltas).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import Iterable

__all__ = ["ToolCall", "ParsedOutput", "collect", "new_call_id"]


@dataclass
class ToolCall:
    """One call: `arguments` is the text of a JSON object."""

    id: str
    name: str
    arguments: str
    type: str = "function"

    def to_openai(self) -> dict:
        """The `message.tool_calls[i]` object of a chat.completion."""
        return {"id": self.id, "type": self.type,
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ParsedOutput:
    """A reply split into its text (markup of the calls removed) and its calls, and the
    reasoning a format carries in its own markup (harmony's analysis channel; "" otherwise)."""

    content: str
    tool_calls: list[ToolCall] = field(default_factory=list)
    reasoning: str = ""


def new_call_id() -> str:
    """`call_` and 24 random hex digits, as OpenAI's ids look."""
    return "call_" + secrets.token_hex(12)


def collect(deltas: Iterable[dict]) -> ParsedOutput:
    """Accumulate `chat.completion.chunk` deltas the way a client does: content joined, tool calls
    by index (id and name from their first delta, arguments concatenated)."""
    content: list[str] = []
    calls: dict[int, ToolCall] = {}
    for delta in deltas:
        if delta.get("content"):
            content.append(delta["content"])
        for tc in delta.get("tool_calls") or ():
            call = calls.get(tc["index"])
            fn = tc.get("function") or {}
            if call is None:
                call = calls[tc["index"]] = ToolCall(tc.get("id", ""), fn.get("name", ""), "")
            call.arguments += fn.get("arguments") or ""
    return ParsedOutput("".join(content), [calls[i] for i in sorted(calls)])
