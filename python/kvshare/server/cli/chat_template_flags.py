"""The chat template `--chat-template` / `--chat-template-file` choose: a template kvshare has
built in (by llama.cpp's name for it), an inline Jinja template or a file; without either
flag, the model file's own. And the variables every render of it gets from llama-server's
`--reasoning`: `off` renders with `enable_thinking` false, `on` with true, `auto` leaves the
default (kvshare.model.template_context); a request's `chat_template_kwargs` still wins.
(`--reasoning-budget` changes no rendering: the engine ends thinking after it,
engine/reasoning_budget.py.)"""

from __future__ import annotations

import argparse
import os
from typing import Any



class TemplateError(Exception):
    pass


class TemplateChoice(tuple[str, str]):
    """What the flags choose: (Jinja source, name), the source "" for the model file's own
    template, and `context`, the template variables every render gets."""

    context: dict[str, Any]

    def __new__(cls, source: str, name: str, context: dict[str, Any] | None = None):
        self = super().__new__(cls, (source, name))
        self.context = dict(context or {})
        return self


_TRUTHY, _FALSEY = ("on", "enabled", "true", "1"), ("off", "disabled", "false", "0")


def reasoning_mode(s: str) -> str:
    """`--reasoning`: on, off or auto (llama-server's other spellings of on and off too)."""
    v = s.strip().lower()
    if v in _TRUTHY:
        return "on"
    if v in _FALSEY:
        return "off"
    if v == "auto":
        return "auto"
    raise ValueError(s)


reasoning_mode.__name__ = "reasoning mode (on, off or auto)"


def reasoning_budget(s: str) -> int:
    """`--reasoning-budget`: -1 (unlimited) or a token count."""
    n = int(s)
    if n < -1:
        raise ValueError(s)
    return n


reasoning_budget.__name__ = "reasoning budget (-1 or a token count)"


def _reasoning_context(args: argparse.Namespace) -> dict[str, Any]:
    from kvshare.model.template_context import thinking_setting

    return thinking_setting(getattr(args, "reasoning", None))


def _read_template_file(file: str) -> str:
    try:
        with open(file, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise TemplateError(f"cannot read --chat-template-file {file}: "
                            f"{getattr(e, 'strerror', None) or e}") from e


def _named_or_inline(value: str) -> tuple[str, str]:
    """(Jinja source, name) of a `--chat-template` value: a built-in template by llama.cpp's
    name for it (kvshare.model.builtin_templates), else an inline Jinja template (Jinja tags,
    or text of more than one word)."""
    from kvshare.model.builtin_templates import BUILTIN_TEMPLATES

    key = value.strip()
    if key in BUILTIN_TEMPLATES:
        return BUILTIN_TEMPLATES[key], "gemma3" if key == "gemma" else key
    # Any text is a Jinja template to llama-server (text without tags renders as itself);
    # a single word that is not a built-in name is refused instead: a misspelt name.
    if "{{" in value or "{%" in value or len(key.split()) > 1:
        return value, "inline"
    raise TemplateError(
        f"--chat-template {value!r} is neither a template kvshare has built in "
        f"({', '.join(sorted(BUILTIN_TEMPLATES))}) nor a Jinja template")


def chat_template_override(args: argparse.Namespace) -> TemplateChoice | None:
    """The template of `--chat-template` / `--chat-template-file`, checked to compile, with the
    reasoning flags' variables; None: the model file's template as it is. `TemplateError`
    (one line) when unusable."""
    from kvshare.model import chat_template as ct

    context = _reasoning_context(args)
    file = getattr(args, "chat_template_file", None)
    value = getattr(args, "chat_template", None)
    if file is not None:
        source = _read_template_file(file)
        flag, name = f"--chat-template-file {file}", f"from {os.path.basename(file)}"
    elif value is not None:
        flag = "--chat-template"
        source, name = _named_or_inline(value)
    else:
        return TemplateChoice("", "", context) if context else None
    try:
        ct.ChatTemplate(source)
    except ct.ChatTemplateError as e:
        msg = str(e).splitlines()[0] if str(e) else "empty chat template"
        raise TemplateError(f"cannot use {flag}: {msg}") from e
    return TemplateChoice(source, name, context)


def model_chat_template(path: str, tokenizer: Any, override: tuple[str, str] | None) -> Any:
    """The ChatTemplate the engine renders with: the override (with the model's BOS/EOS
    handling) or the model file's."""
    from kvshare.model.builtin_templates import BUILTIN_TEMPLATES
    from kvshare.model.chat_template import ChatTemplate

    if override is None or not override[0]:
        template = ChatTemplate.from_gguf(path, tokenizer)
    else:
        source, name = override
        template = ChatTemplate(source, bos_token=tokenizer.bos_token,
                                eos_token=tokenizer.eos_token, add_bos=tokenizer.add_bos,
                                add_eos=tokenizer.add_eos,
                                name=name if name in BUILTIN_TEMPLATES else "custom")
    template.extra_context.update(getattr(override, "context", {}))
    return template


def describe_template(args: argparse.Namespace, template: Any,
                      override: tuple[str, str] | None) -> str:
    """Where the chat template came from, for the startup line."""
    tname = getattr(template, "name", "?")
    thinking = getattr(template, "extra_context", {}).get("enable_thinking")
    note = "" if thinking is None else f", enable_thinking {str(thinking).lower()}"
    if override is not None and override[0]:
        return f"{override[1]} (from --chat-template" + (
            "-file)" if getattr(args, "chat_template_file", None) else ")") + note
    if tname == "gguf":
        return "from the file" + note
    return f"{tname} (built in: the file has none)" + note
