"""Tools for templates that cannot render them: the conversation rewritten into messages the
template does render (`apply`), in kvshare's generic JSON call format.

A reply in the generic format is one JSON object (`kvshare.toolcalls.generic` reads it; the
constrained decoding forces it whenever the request has tools):

    {"tool_call": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    {"tool_calls": [{"name": "get_weather", ...}, {"name": "get_time", ...}]}
    {"response": "It is sunny in Paris."}

What each polyfill (`kvshare.model.template_caps.polyfills`) renders:
- "tools": the tools, one JSON object per line (name, description, parameters), and the
  three reply shapes above, appended to the system message (a new one when there is none);
  earlier assistant replies without calls are shown as `{"response": ...}` objects, so the
  conversation reads as the model must write;
- "tool_calls": an assistant message's calls as its content, `{"tool_call": ...}` or
  `{"tool_calls": [...]}` (after `"response"` when the message also has text);
- "tool_responses": a tool result as a user message
  `{"tool_response": {"name": ..., "tool_call_id": ..., "content": ...}}` (the name found
  from the call it answers); consecutive results share one user message;
- "system_role": system messages folded into the next user message (a user message of their
  own when none follows).
"""

from __future__ import annotations

import json
from typing import Any, Iterable, Sequence

__all__ = ["apply", "tools_text", "INTRO", "REPLY_RULES"]

INTRO = ("# Tools\n\nYou can call the following tools. Each line is one tool: its name, what "
         "it does, and a JSON schema of its arguments.\n")
REPLY_RULES = (
    "\nReply with one JSON object and nothing else.\n"
    'To answer without a tool: {"response": "<your answer>"}\n'
    'To call several tools at once: {"tool_calls": [<call>, <call>]}\n'
    'Tool results come back as {"tool_response": {"name": ..., "content": ...}}.\n'
    "Whenever a tool can help, call it:\n")


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def tools_text(tools: Sequence[dict]) -> str:
    """The system-message text that declares `tools` (OpenAI tool definitions)."""
    lines = []
    for tool in tools:
        fn = tool.get("function", tool) if isinstance(tool, dict) else {}
        decl = {"name": fn.get("name")}
        if fn.get("description"):
            decl["description"] = fn["description"]
        decl["parameters"] = fn.get("parameters") or {"type": "object", "properties": {}}
        lines.append(_dumps(decl))
    # the last line shows a call of the first tool: small models copy what they saw last
    first = json.loads(lines[0])["name"] if lines else "<tool name>"
    example = '{"tool_call": {"name": %s, "arguments": {<arguments>}}}' % _dumps(first)
    return INTRO + "\n".join(lines) + "\n" + REPLY_RULES + example


def _arguments(call: dict) -> Any:
    args = call.get("arguments")
    if isinstance(args, str):
        try:
            return json.loads(args)
        except ValueError:
            return args
    return dict(args) if isinstance(args, dict) else (args if args is not None else {})


def _calls_text(msg: dict) -> str:
    calls = []
    for tc in msg.get("tool_calls") or ():
        fn = tc.get("function", tc) if isinstance(tc, dict) else {}
        calls.append({"name": fn.get("name"), "arguments": _arguments(fn)})
    obj: dict[str, Any] = {}
    if msg.get("content"):
        obj["response"] = msg["content"]
    if len(calls) == 1:
        obj["tool_call"] = calls[0]
    else:
        obj["tool_calls"] = calls
    return _dumps(obj)


def _call_names(messages: Iterable[dict]) -> dict[str, str]:
    names = {}
    for m in messages:
        for tc in m.get("tool_calls") or ():
            if isinstance(tc, dict) and isinstance(tc.get("id"), str):
                fn = tc.get("function", tc)
                names[tc["id"]] = fn.get("name") if isinstance(fn, dict) else None
    return names


def _response_text(msg: dict, names: dict[str, str]) -> str:
    resp: dict[str, Any] = {}
    call_id = msg.get("tool_call_id")
    name = msg.get("name") or (names.get(call_id) if isinstance(call_id, str) else None)
    if name:
        resp["name"] = name
    if call_id:
        resp["tool_call_id"] = call_id
    resp["content"] = msg.get("content", "")
    return _dumps({"tool_response": resp})


def _with_system(messages: list[dict], text: str) -> list[dict]:
    if messages and messages[0]["role"] == "system":
        first = dict(messages[0])
        first["content"] = (first["content"] + "\n\n" + text) if first["content"] else text
        return [first, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def _fold_system(messages: list[dict]) -> list[dict]:
    out: list[dict] = []
    pending: list[str] = []
    for m in messages:
        if m["role"] == "system":
            if m["content"]:
                pending.append(m["content"])
            continue
        if pending and m["role"] == "user":
            m = {**m, "content": "\n\n".join([*pending, m["content"]] if m["content"] else pending)}
            pending = []
        elif pending:
            out.append({"role": "user", "content": "\n\n".join(pending)})
            pending = []
        out.append(m)
    if pending:
        out.append({"role": "user", "content": "\n\n".join(pending)})
    return out


def apply(messages: list[dict], tools: Sequence[dict] | None, fills: Sequence[str]
          ) -> tuple[list[dict], list[dict] | None]:
    """`(messages, tools)` as the template gets them under the polyfills `fills` (normalized
    messages in, normalized messages out; `tools` None once they are in the system text)."""
    tools = list(tools) if tools else None
    out = list(messages)
    if "tools" in fills and tools:
        out = [{**m, "content": _dumps({"response": m["content"]})}
               if m["role"] == "assistant" and not m.get("tool_calls") else m for m in out]
        out = _with_system(out, tools_text(tools))
        tools = None
    if "tool_calls" in fills:
        out = [{k: v for k, v in {**m, "content": _calls_text(m)}.items() if k != "tool_calls"}
               if m["role"] == "assistant" and m.get("tool_calls") else m for m in out]
    if "tool_responses" in fills:
        names = _call_names(messages)
        merged: list[dict] = []
        for m in out:
            if m["role"] != "tool":
                merged.append(m)
                continue
            text = _response_text(m, names)
            if merged and merged[-1].get("kvshare_results"):
                merged[-1] = {**merged[-1], "content": merged[-1]["content"] + "\n" + text}
            else:
                merged.append({"role": "user", "content": text, "kvshare_results": True})
        out = [{k: v for k, v in m.items() if k != "kvshare_results"} for m in merged]
    if "system_role" in fills:
        out = _fold_system(out)
    return out, tools
