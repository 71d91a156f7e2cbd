"""Small pieces of llguidance Lark text the formats' grammars share, and `allow_reasoning`,
which lets a forced grammar start with a thinking block."""

from __future__ import annotations

import json
from typing import Sequence

from kvshare.toolcalls.schema import functions

__all__ = ["lit", "pick", "repeat", "allow_reasoning", "MAX_CALLS"]


def lit(text: str) -> str:
    """A Lark string literal (JSON escapes, which llguidance reads)."""
    return json.dumps(text, ensure_ascii=False)


def regex_lit(text: str) -> str:
    """`text` escaped for use inside a Lark /regex/."""
    out = []
    for c in text:
        if c in "\\.+*?()|[]{}^$#&-~/":
            out.append("\\" + c)
        elif c == "\n":
            out.append("\\n")
        else:
            out.append(c)
    return "".join(out)


def pick(tools: Sequence[dict], choice: str | None) -> list[tuple[str, dict]]:
    """The (name, parameters) a grammar may call: all tools, or the one named `choice`."""
    fns = functions(tools)
    if not fns:
        raise ValueError("a tool-call grammar needs at least one tool")
    if choice is None:
        return fns
    chosen = [f for f in fns if f[0] == choice]
    if not chosen:
        raise ValueError(f"tool_choice names {choice!r}, which is not among the tools")
    return chosen


MAX_CALLS = 8  # `--max-parallel-tool-calls`' default


def repeat(item: str, sep: str, many: bool, most: int = MAX_CALLS) -> str:
    """`item`, or (`many`) one to `most` `item`s separated by the literal `sep`. Bounded, so
    that a forced reply ends: after the last call the grammar is complete and the engine ends
    the turn (a small model otherwise goes on calling)."""
    if not many or most <= 1:
        return item
    return f"{item} ({lit(sep)} {item}){{0,{most - 1}}}"


def allow_reasoning(grammar: str, *, opened: bool = False, start: str = "<think>",
                    end: str = "</think>", special: bool = False) -> str:
    """`grammar` preceded by a reasoning block: `start` ... `end` (optional), or, when the
    prompt already opened it (`opened`), the rest of the block up to `end` (required). The
    block holds any text (no special tokens); whitespace may follow it. `special`: the tags
    are special tokens of the vocabulary (written `<...>` in Lark) rather than text.

    For a reasoning model, wrap the forced grammars with this: without it a model whose prompt
    opened `<think>` must write its calls inside the block, where they are reasoning, not
    calls; and an auto grammar would force a call the model merely mentions while thinking."""
    lines = grammar.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("start:"):
            lines[i] = "kvshare_answer:" + line[len("start:"):]
            break
    else:
        raise ValueError("grammar has no start rule")
    if special:
        body = [f"kvshare_think_body: /(?s:.*)/ {end}"]
        open_tag = start
    else:
        body = [f"kvshare_think_body[lazy]: /(?s:.*){regex_lit(end)}/"]
        open_tag = lit(start)
    head = ("start: kvshare_think_body KVSHARE_WS? kvshare_answer" if opened else
            f"start: ({open_tag} kvshare_think_body KVSHARE_WS?)? kvshare_answer")
    return "\n".join([head, *body, "KVSHARE_WS: /[ \\t\\r\\n]+/", *lines])
