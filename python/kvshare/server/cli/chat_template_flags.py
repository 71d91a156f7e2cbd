"""The chat template `--chat-template` / `--chat-template-file` choose: a template kvshare has
built in (by llama.cpp's name for it), an inline Jinja template or a file; without either
flag, the model file's own."""

from __future__ import annotations

import argparse
import os
from typing import Any



class TemplateError(Exception):
    pass


def _read_template_file(file: str) -> str:
    try:
        with open(file, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise TemplateError(f"cannot read --chat-template-file {file}: "
                            f"{getattr(e, 'strerror', None) or e}") from e


def _named_or_inline(value: str) -> tuple[str, str]:
    """(Jinja source, name) of a `--chat-template` value: a built-in template by llama.cpp's
    name for it (kvshare.model.builtin_templates), else an inline Jinja template."""
    from kvshare.model.builtin_templates import BUILTIN_TEMPLATES

    key = value.strip()
    if key in BUILTIN_TEMPLATES:
        return BUILTIN_TEMPLATES[key], "gemma3" if key == "gemma" else key
    if "{{" in value or "{%" in value:
        return value, "inline"
    raise TemplateError(
        f"--chat-template {value!r} is neither a template kvshare has built in "
        f"({', '.join(sorted(BUILTIN_TEMPLATES))}) nor a Jinja template")


def chat_template_override(args: argparse.Namespace) -> tuple[str, str] | None:
    """(Jinja source, name) of `--chat-template` / `--chat-template-file`, checked to compile;
    None: the model file's template. `TemplateError` (one line) when unusable."""
    from kvshare.model import chat_template as ct

    file = getattr(args, "chat_template_file", None)
    value = getattr(args, "chat_template", None)
    if file is not None:
        source = _read_template_file(file)
        flag, name = f"--chat-template-file {file}", f"from {os.path.basename(file)}"
    elif value is not None:
        flag = "--chat-template"
        source, name = _named_or_inline(value)
    else:
        return None
    try:
        ct.ChatTemplate(source)
    except ct.ChatTemplateError as e:
        msg = str(e).splitlines()[0] if str(e) else "empty chat template"
        raise TemplateError(f"cannot use {flag}: {msg}") from e
    return source, name


def model_chat_template(path: str, tokenizer: Any, override: tuple[str, str] | None) -> Any:
    """The ChatTemplate the engine renders with: the override (with the model's BOS/EOS
    handling) or the model file's."""
    from kvshare.model.builtin_templates import BUILTIN_TEMPLATES
    from kvshare.model.chat_template import ChatTemplate

    if override is None:
        return ChatTemplate.from_gguf(path, tokenizer)
    source, name = override
    return ChatTemplate(source, bos_token=tokenizer.bos_token, eos_token=tokenizer.eos_token,
                        add_bos=tokenizer.add_bos, add_eos=tokenizer.add_eos,
                        name=name if name in BUILTIN_TEMPLATES else "custom")


def describe_template(args: argparse.Namespace, template: Any,
                      override: tuple[str, str] | None) -> str:
    """Where the chat template came from, for the startup line."""
    tname = getattr(template, "name", "?")
    if override is not None:
        return f"{override[1]} (from --chat-template" + (
            "-file)" if getattr(args, "chat_template_file", None) else ")")
    if tname == "gguf":
        return "from the file"
    return f"{tname} (built in: the file has none)"
