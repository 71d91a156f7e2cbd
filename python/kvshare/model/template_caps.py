"""What a chat template can render, found by rendering probe conversations (llama.cpp's
template caps, minja's render probes): each probe carries a needle in the one place a
capability shows (a system message's content, a tool's name, a call's argument key, a tool
result) and the capability is there when the needle is in the output. A probe the template
raises on counts as "not supported".

| capability              | probe                                                          |
|-------------------------|----------------------------------------------------------------|
| `system_role`           | a system message before a user message: its content printed    |
| `tools`                 | one tool declared: its name printed                            |
| `tool_calls`            | an assistant call with arguments as a JSON string or an object: |
|                         | the argument key printed                                       |
| `object_arguments`      | the same with arguments as an object (kvshare hands templates   |
|                         | both: a parsed object whose text is its JSON)                  |
| `parallel_tool_calls`   | two calls in one assistant message: both names printed         |
| `tool_responses`        | a tool result after a call: its content printed                |
| `generation_prompt`     | `add_generation_prompt` changes the output                     |

`polyfills(caps)` names what kvshare renders for a template that lacks a capability
(`kvshare.model.tool_polyfill`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any, Callable, Sequence

__all__ = ["TemplateCaps", "detect_caps", "polyfills", "POLYFILLS"]

Render = Callable[[Sequence[dict], Sequence[dict] | None, bool], str]

_USER = "<kvshare user needle>"
_SYSTEM = "<kvshare system needle>"
_TOOL_NAME = "kvshare_needle_tool"
_ARG_KEY = "kvshare_argument_needle"
_RESULT = "<kvshare tool result needle>"
_CALL_ID = "call_1___"  # 9 characters: Mistral's templates refuse other lengths

_PROBE_TOOL = {"type": "function", "function": {
    "name": _TOOL_NAME, "description": "A tool.",
    "parameters": {"type": "object", "properties": {"arg": {"type": "string"}},
                   "required": ["arg"]}}}


@dataclass(frozen=True)
class TemplateCaps:
    """What a template renders by itself (the module docstring says how each is found)."""

    system_role: bool = True
    tools: bool = True
    tool_calls: bool = True
    object_arguments: bool = True
    parallel_tool_calls: bool = True
    tool_responses: bool = True
    generation_prompt: bool = True

    def as_dict(self) -> dict[str, bool]:
        """`{"supports_system_role": ..., ...}`, the names llama-server's /props uses."""
        return {f"supports_{k}": v for k, v in asdict(self).items()}


# what kvshare renders in place of a missing capability, in the order they apply
POLYFILLS = ("system_role", "tools", "tool_calls", "tool_responses")


def polyfills(caps: TemplateCaps) -> tuple[str, ...]:
    """The polyfills a template with `caps` gets: "tools" (the tools described in the system
    message), "tool_calls" (past calls as the generic JSON the model writes), "tool_responses"
    (results as user messages naming their call; also whenever calls are polyfilled, since
    the template cannot tie a result to a call it did not print), "system_role" (the system
    message folded into the first user message)."""
    on = {"system_role": not caps.system_role,
          "tools": not caps.tools,
          "tool_calls": not caps.tool_calls,
          "tool_responses": not caps.tool_responses or not caps.tool_calls}
    return tuple(p for p in POLYFILLS if on[p])


def _call(name: str, arguments: Any) -> dict:
    return {"id": _CALL_ID, "type": "function",
            "function": {"name": name, "arguments": arguments}}


def detect_caps(render: Render) -> TemplateCaps:
    """Probe a template through `render(messages, tools, add_generation_prompt) -> text`
    (without kvshare's polyfills), which may raise."""

    def out(messages: list[dict], tools: list[dict] | None = None, agp: bool = False) -> str:
        try:
            return render(messages, tools, agp)
        except Exception:  # noqa: BLE001 - a probe the template refuses shows nothing
            return ""

    user = {"role": "user", "content": _USER}
    system_role = _SYSTEM in out([{"role": "system", "content": _SYSTEM}, user])
    tools = _TOOL_NAME in out([user], [_PROBE_TOOL])
    args = {_ARG_KEY: "value"}

    def calls_msg(*calls: dict) -> dict:
        return {"role": "assistant", "content": "", "tool_calls": list(calls)}

    def shows_args(text: str) -> bool:
        return f'"{_ARG_KEY}"' in text or f"'{_ARG_KEY}'" in text

    as_text = shows_args(out([user, calls_msg(_call(_TOOL_NAME, json.dumps(args)))]))
    as_object = shows_args(out([user, calls_msg(_call(_TOOL_NAME, args))]))
    tool_calls = as_text or as_object
    parallel = responses = False
    if tool_calls:
        two = out([user, calls_msg(_call("kvshare_tool_a", args), _call("kvshare_tool_b", args))])
        parallel = "kvshare_tool_a" in two and "kvshare_tool_b" in two
        result = {"role": "tool", "tool_call_id": _CALL_ID, "name": _TOOL_NAME,
                  "content": _RESULT}
        responses = _RESULT in out([user, calls_msg(_call(_TOOL_NAME, args)), result])
    generation_prompt = out([user], agp=True) != out([user], agp=False)
    return TemplateCaps(system_role=system_role, tools=tools, tool_calls=tool_calls,
                        object_arguments=as_object, parallel_tool_calls=parallel,
                        tool_responses=responses, generation_prompt=generation_prompt)
