"""Which tool-call format a chat template teaches, from the markup its text contains."""

from __future__ import annotations

__all__ = ["detect_format"]


def detect_format(template_source: str | None) -> str:
    """`harmony` for gpt-oss's `<|channel|>` (llama.cpp's test for its handler); `qwen35` for
    `<function=` with `<parameter=` (Qwen3.5, Qwen3-Coder); `lfm2` for LFM2's
    `<|tool_call_start|>` / `<|tool_list_start|>`; `hermes` for `<tool_call>`; `llama3` for Llama
    3.x headers with `<|python_tag|>` or a `"parameters"` key; else `hermes` (kvshare's built-in
    Gemma and ChatML templates, which render calls as hermes blocks)."""
    src = template_source or ""
    if "<|channel|>" in src:
        return "harmony"
    if "<function=" in src and "<parameter=" in src:
        return "qwen35"
    if "<|tool_call_start|>" in src or "<|tool_list_start|>" in src:
        return "lfm2"
    if "<tool_call>" in src:
        return "hermes"
    if "<|start_header_id|>" in src and ("<|python_tag|>" in src or '"parameters"' in src):
        return "llama3"
    return "hermes"
