"""The variables a chat template sees besides `messages`, as llama-server passes them
(common/chat.cpp `common_chat_template_direct_apply`, `common_chat_extra_context`):

| variable                | value                                                             |
|-------------------------|-------------------------------------------------------------------|
| `bos_token`/`eos_token` | the model's BOS / EOS text                                        |
| `add_generation_prompt` | whether the prompt ends with the assistant turn's opening         |
| `tools`                 | the request's tool definitions (OpenAI shape), None without tools |
| `functions`             | the request's tools as JSON text (2-space indent), "" without:    |
|                         | what llama.cpp's FireFunction v2 handler passed, the one template |
|                         | of its models/templates that reads it (`+ "\n" + functions`)     |
| `enable_thinking`       | `--reasoning on` / `off`, a request's `chat_template_kwargs`;     |
|                         | else (`--reasoning auto`) whether llama-server counts the         |
|                         | template as one that thinks (`supports_thinking`)                 |
| `date_string`           | today as "%d %b %Y" ("26 Jul 2024"), what Llama 3.x prints         |
| `datetime`              | today as "%b %d %Y"                                               |
| `strftime_now(fmt)`     | the local time now, formatted (a global of the Jinja environment) |

The rendered text is the template's own: llama-server adds nothing to it (a template whose
generation prompt opens `<think>` whatever `enable_thinking` says keeps it open).

Later sources win: these defaults, then the template's server-wide variables
(`ChatTemplate.extra_context`: `--reasoning`), then the request's `chat_template_kwargs`;
`messages`, `tools`, `add_generation_prompt` are always the renderer's. Dates are read at each
render, so a server running past midnight prints the new day.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any, Callable, Sequence


def strftime_now(fmt: str) -> str:
    """The local time now, formatted (HF's and llama.cpp's `strftime_now`)."""
    return datetime.now().strftime(fmt)


def defaults() -> dict[str, Any]:
    """The variables every render starts from (see the module docstring; `enable_thinking`
    is then the template's `ChatTemplate.thinking_by_default` unless set)."""
    now = datetime.now()
    return {"enable_thinking": True, "date_string": now.strftime("%d %b %Y"),
            "datetime": now.strftime("%b %d %Y")}


def functions_text(tools: Sequence[Any] | None) -> str:
    """`functions` of a render: the tools as JSON text indented by 2 (nlohmann's `dump(2)`,
    keys in order, non-ASCII as is), "" without tools."""
    return json.dumps(list(tools), indent=2, ensure_ascii=False) if tools else ""


def thinking_setting(reasoning: str | None) -> dict[str, Any]:
    """The server-wide template variables of `--reasoning on|off|auto`: `enable_thinking`
    False for off, True for on, nothing (the default) for auto. (`--reasoning-budget`, even 0,
    renders nothing differently in llama-server: its sampler forces the end of thinking.)"""
    if reasoning == "off":
        return {"enable_thinking": False}
    if reasoning == "on":
        return {"enable_thinking": True}
    return {}


THINK_START, THINK_END = "<think>", "</think>"

# What llama.cpp's template analysis renders (common/chat-diff-analyzer.cpp): text no template
# would write itself, so where it lands in the output shows the template's structure.
_USER_MSG = "U_USER_MSG Hello END_U"
_ASSISTANT_MSG = "A_ASST_MSG I can help END_A"
_THINKING = "REASON_PART I am thinking END_R"

# Render(messages, add_generation_prompt, enable_thinking, tools) -> the text, or None if it
# fails
Render = Callable[[list, bool, bool, "list | None"], "str | None"]
_TOOL = {"type": "function", "function": {
    "name": "FFF_FIRST_FUN_F", "description": "Test function",
    "parameters": {"type": "object", "properties": {"AA_ARG_FST_AA": {"type": "string"}},
                   "required": ["AA_ARG_FST_AA"]}}}
_CALL = {"id": "call00001", "type": "function", "function": {
    "name": "FFF_FIRST_FUN_F", "arguments": {"AA_ARG_FST_AA": "VVVV"}}}


def _markers(text: str) -> list[tuple[bool, str]]:
    """`text` cut into (is_marker, piece): a marker runs from `<` to `>` or `[` to `]`
    (llama.cpp's segmentize_markers); pieces of whitespace only are left out."""
    out: list[tuple[bool, str]] = []
    opener, border = "", 0
    for i, c in enumerate(text):
        if not opener and c in "<[":
            if border < i:
                out.append((False, text[border:i]))
            border, opener = i, c
        elif opener and c == (">" if opener == "<" else "]"):
            out.append((True, text[border:i + 1]))
            border, opener = i + 1, ""
    if border < len(text):
        out.append((False, text[border:]))
    return [(m, v) for m, v in out if v.strip()]


def _diff(a: str, b: str) -> tuple[str, str]:
    """What `a` and `b` have each of their own between their common prefix and suffix."""
    if b.startswith(a):
        return "", b[len(a):]
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    a, b = a[n:], b[n:]
    m = 0
    while m < min(len(a), len(b)) and a[-1 - m] == b[-1 - m]:
        m += 1
    return a[:len(a) - m], b[:len(b) - m]


def _shows_reasoning(render: Render) -> bool:
    """An assistant message's `reasoning_content` is rendered, followed by a marker
    (`...</think>`): llama.cpp's compare_reasoning_presence."""
    user = {"role": "user", "content": _USER_MSG}
    plain = render([user, {"role": "assistant", "content": _ASSISTANT_MSG}], False, True, None)
    shown = render([user, {"role": "assistant", "content": _ASSISTANT_MSG,
                           "reasoning_content": _THINKING}], False, True, None)
    if plain is None or shown is None or _THINKING not in _diff(plain, shown)[1]:
        return False
    return _marker_follows(shown)


def _marker_follows(text: str) -> bool:
    after = _markers(text[text.index(_THINKING) + len(_THINKING):])
    return bool(after) and after[0][0]


def _shows_reasoning_with_tool_calls(render: Render) -> bool:
    """`reasoning_content` is rendered only beside tool calls, followed by a marker:
    llama.cpp's compare_reasoning_scope (its TOOLS_ONLY mode, e.g. Gemma 4)."""
    user = {"role": "user", "content": _USER_MSG}
    alone = render([user, {"role": "assistant", "content": _ASSISTANT_MSG,
                           "reasoning_content": _THINKING}], False, True, [_TOOL])
    calls = render([user, {"role": "assistant", "content": None, "reasoning_content": _THINKING,
                           "tool_calls": [_CALL]}], False, True, [_TOOL])
    if alone is None or calls is None or _THINKING in alone or _THINKING not in calls:
        return False
    return _marker_follows(calls)


def _thinking_switch_adds_markers(render: Render) -> bool:
    """`enable_thinking` changes the generation prompt by markers at its end (`<think>` when
    on, `<think></think>` when off, or two markers after a changed system text):
    llama.cpp's compare_thinking_enabled."""
    user = {"role": "user", "content": _USER_MSG}
    off, on = render([user], True, False, None), render([user], True, True, None)
    if off is None or on is None:
        return False
    left, right = _diff(off, on)
    if not left.strip() and right.strip():
        return on.endswith(right.strip())
    if not right.strip() and left.strip():
        return off.endswith(left.strip())
    if left.strip() and right.strip():
        for base, extended in ((on, off), (off, on)):
            anchor = base[-64:]
            pos = extended.rfind(anchor)
            if pos < 0 or pos + len(anchor) >= len(extended):
                continue
            extra = _markers(extended[pos + len(anchor):].strip())
            if len(extra) == 2 and extra[0][0] and extra[1][0]:
                return True
    return False


def supports_thinking(source: str, render: Render) -> bool:
    """Whether llama-server counts the template as one that thinks, which is what
    `--reasoning auto` (the default) renders `enable_thinking` as (server_context:
    `common_chat_templates_support_enable_thinking`): its analysis of the template
    (common/chat-diff-analyzer.cpp) finds reasoning markers around a rendered
    `reasoning_content`, or at the end of the generation prompt when `enable_thinking`
    changes, or it is one of the templates llama.cpp names (old Qwen / DeepSeek-R1 templates
    that split content on `</think>`, Granite 3.3, Nemotron Nano v2)."""
    if ("content.split('</think>')" in source and "reasoning_content" not in source
            and "<SPECIAL_12>" not in source):
        return True
    if "Write your thoughts between <think></think> and write your response between " \
            "<response></response>" in source:
        return True
    if all(m in source for m in ("<SPECIAL_10>", "<SPECIAL_11>", "<SPECIAL_12>",
                                 "<TOOL_RESPONSE>")):
        return True
    return (_shows_reasoning(render) or _thinking_switch_adds_markers(render)
            or _shows_reasoning_with_tool_calls(render))
