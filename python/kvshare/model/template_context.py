"""The variables a chat template sees besides `messages`, as llama-server passes them
(common/chat.cpp `common_chat_template_direct_apply`, `common_chat_extra_context`):

| variable                | value                                                             |
|-------------------------|-------------------------------------------------------------------|
| `bos_token`/`eos_token` | the model's BOS / EOS text                                        |
| `add_generation_prompt` | whether the prompt ends with the assistant turn's opening         |
| `tools`                 | the request's tool definitions (OpenAI shape), None without tools |
| `functions`             | the same tools in OpenAI's older `functions` shape (each tool's   |
|                         | `function` object), for templates written against it; `[]` when  |
|                         | there are none                                                    |
| `enable_thinking`       | True unless turned off (`--reasoning off`, a request's            |
|                         | `chat_template_kwargs`), as llama-server's default                |
| `date_string`           | today as "%d %b %Y" ("26 Jul 2024"), what Llama 3.x prints         |
| `datetime`              | today as "%b %d %Y"                                               |
| `strftime_now(fmt)`     | the local time now, formatted (a global of the Jinja environment) |

With `enable_thinking` off, a generation prompt that still opens a `<think>` block (templates
that always open one: DeepSeek-R1, QwQ) gets it closed (`close_thinking`), as llama-server's
prompt does, so the reply starts as the answer.

Later sources win: these defaults, then the template's server-wide variables
(`ChatTemplate.extra_context`: `--reasoning`), then the request's `chat_template_kwargs`;
`messages`, `tools`, `add_generation_prompt` are always the renderer's. Dates are read at each
render, so a server running past midnight prints the new day.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Mapping, Sequence


def strftime_now(fmt: str) -> str:
    """The local time now, formatted (HF's and llama.cpp's `strftime_now`)."""
    return datetime.now().strftime(fmt)


def defaults() -> dict[str, Any]:
    """The variables every render starts from (see the module docstring)."""
    now = datetime.now()
    return {"enable_thinking": True, "date_string": now.strftime("%d %b %Y"),
            "datetime": now.strftime("%b %d %Y")}


def functions_of(tools: Sequence[Any] | None) -> list[Any]:
    """`tools` in OpenAI's older `functions` shape: each tool's `function` object (a tool
    without one is passed as it is)."""
    out = []
    for t in tools or ():
        fn = t.get("function") if isinstance(t, Mapping) else None
        out.append(fn if isinstance(fn, Mapping) else t)
    return out


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


def close_thinking(prompt: str) -> str:
    """`prompt` with a reasoning block its end left open closed (see the module docstring)."""
    i = prompt.rfind(THINK_START)
    if i >= 0 and prompt.find(THINK_END, i) < 0:
        return prompt + THINK_END
    return prompt
