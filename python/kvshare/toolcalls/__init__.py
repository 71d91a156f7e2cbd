"""Tool calls in each model family's markup: reading complete replies (`parse`), reading streams
into OpenAI deltas (`stream`), and llguidance Lark grammars that force valid calls (`grammar`,
`auto_grammar`); reasoning split out (`ReasoningSplitter`); the format told from a chat
template (`detect_format`). Pure Python, no server or engine imports.

    fmt = get_format("qwen35", tools)          # tools: the request's OpenAI `tools`
    out = fmt.parse(text)                      # ParsedOutput(content, tool_calls)
    s = fmt.stream(); deltas = s.feed(piece) ... + s.finish()
    lark = fmt.grammar(tools, choice=None, parallel=True)

The deltas of a stream add up (content joined, calls accumulated by index) to `parse` of the
same text, ids aside (each call gets a fresh `call_...` id when it is announced). See
`stream.py` for what incremental streaming does with a block that breaks after a call was
announced, and each format's module for what its grammar enforces. `harmony` (gpt-oss) is the
whole reply's format, channels included: its deltas carry `reasoning_content` too (the analysis
channel), and its `parse` fills `ParsedOutput.reasoning`.
"""

from __future__ import annotations

from typing import Sequence

from kvshare.toolcalls.base import ToolFormat
from kvshare.toolcalls.calls import ParsedOutput, ToolCall, collect, new_call_id
from kvshare.toolcalls.detect import detect_format
from kvshare.toolcalls.generic import Generic
from kvshare.toolcalls.harmony import Harmony
from kvshare.toolcalls.grammar import allow_reasoning
from kvshare.toolcalls.hermes import Hermes
from kvshare.toolcalls.lfm2 import Lfm2
from kvshare.toolcalls.llama3 import Llama3
from kvshare.toolcalls.qwen35 import Qwen35
from kvshare.toolcalls.reasoning import (
    ReasoningSplitter,
    prompt_opens_reasoning,
    template_has_thinking,
)
from kvshare.toolcalls.stream import ToolCallStream

__all__ = [
    "ToolCall", "ParsedOutput", "ToolFormat", "ToolCallStream", "FORMATS", "get_format",
    "detect_format", "collect", "new_call_id", "allow_reasoning", "ReasoningSplitter",
    "template_has_thinking", "prompt_opens_reasoning",
]

_FORMATS: dict[str, type[ToolFormat]] = {f.name: f for f in (Hermes, Qwen35, Lfm2, Llama3,
                                                              Harmony, Generic)}
FORMATS: tuple[str, ...] = tuple(_FORMATS)


def get_format(name: str, tools: Sequence[dict] | None = None) -> ToolFormat:
    """The format called `name` (a `--tool-parser` value), reading with `tools` in mind."""
    cls = _FORMATS.get(name)
    if cls is None:
        raise ValueError(f"unknown tool-call format {name!r}; known: {', '.join(FORMATS)}")
    return cls(tools)
