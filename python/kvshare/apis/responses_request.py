"""Responses API requests translated into the pipeline's chat (`responses` answers them):
`input` items (messages, function calls and their outputs) after the stored conversation of
`previous_response_id`, `instructions` as the system message, function tools, `tool_choice`,
`text.format`; the echo fields the response object repeats. See `responses`'s docstring for
the whole mapping."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from kvshare.server.errors import APIError, bad_request

from . import parsing as P
from .output_fields import schema_constraint
from .base import ApiRequest, CachePoint, ChatInput, CommonOptions, OutputConstraint, RequestContext
from .responses_store import ResponseStore, owner_of
from .sampling_fields import RESPONSES, parse_sampling

ROLES = ("user", "assistant", "system", "developer")
TEXT_PARTS = ("input_text", "output_text", "text")
# Content parts and input items OpenAI defines that this server cannot take: refused by name.
UNSUPPORTED_PARTS = frozenset({"input_image", "input_file", "input_audio"})
UNSUPPORTED_BODY = ("background", "conversation", "prompt")


# --------------------------------------------------------------------------- validation helpers

def _type_name(v: Any) -> str:
    return P.json_type(v)


def _str_field(obj: dict, name: str, path: str, *, required: bool = True,
               empty_ok: bool = False) -> str | None:
    v = obj.get(name)
    if v is None:
        if required:
            raise bad_request(f"Missing required parameter: '{path}.{name}'.", f"{path}.{name}",
                              "missing_required_parameter")
        return None
    if not isinstance(v, str):
        raise bad_request(f"Invalid type for '{path}.{name}': expected a string, but got "
                          f"{_type_name(v)}.", f"{path}.{name}", "invalid_type")
    if not v and not empty_ok:
        raise bad_request(f"Invalid '{path}.{name}': empty string.", f"{path}.{name}",
                          "empty_string")
    return v


def _text_parts(content: Any, path: str, *, required: bool = True) -> str:
    """A message's (or a function_call_output's) content: a string or a list of text parts."""
    if isinstance(content, str):
        return content
    if content is None:
        if required:
            raise bad_request(f"Missing required parameter: '{path}'.", path,
                              "missing_required_parameter")
        return ""
    if not isinstance(content, list):
        raise bad_request(f"Invalid type for '{path}': expected a string or an array of "
                          f"content parts, but got {_type_name(content)}.", path, "invalid_type")
    texts = []
    for j, part in enumerate(content):
        ppath = f"{path}[{j}]"
        if isinstance(part, str):
            texts.append(part)
            continue
        if not isinstance(part, dict):
            raise bad_request(f"Invalid type for '{ppath}': expected an object, but got "
                              f"{_type_name(part)}.", ppath, "invalid_type")
        ptype = part.get("type")
        if not isinstance(ptype, str):  # an object or array is not hashable: check first
            raise bad_request(f"Invalid type for '{ppath}.type': expected a string, but got "
                              f"{_type_name(ptype)}.", f"{ppath}.type", "invalid_type")
        if ptype in TEXT_PARTS:
            texts.append(_str_field(part, "text", ppath, empty_ok=True) or "")
        elif ptype == "refusal":
            texts.append(_str_field(part, "refusal", ppath, empty_ok=True) or "")
        elif ptype in UNSUPPORTED_PARTS:
            raise bad_request(f"Content parts of type '{ptype}' ('{ppath}.type') are not "
                              "supported by this server: text only.", f"{ppath}.type",
                              "unsupported_content")
        else:
            raise bad_request(f"Invalid value for '{ppath}.type': {ptype!r} is not a supported "
                              "content part type (input_text, output_text).", f"{ppath}.type",
                              "invalid_value")
    return "\n".join(texts)


# --------------------------------------------------------------------------- input items

class _Conversation:
    """Input items as OpenAI chat messages, with the tool call ids seen so far."""

    def __init__(self, messages: list[dict]):
        self.out: list[dict] = messages
        self.call_ids: set[str] = {c.get("id") for m in messages
                                   for c in (m.get("tool_calls") or []) if c.get("id")}
        self._open_assistant: int | None = None  # a message of this input calls may join

    def items(self, items: Any) -> None:
        if isinstance(items, str):
            self.out.append({"role": "user", "content": items})
            return
        if items is None:
            raise bad_request("Missing required parameter: 'input'.", "input",
                              "missing_required_parameter")
        if not isinstance(items, list):
            raise bad_request(f"Invalid type for 'input': expected a string or an array of "
                              f"input items, but got {_type_name(items)}.", "input",
                              "invalid_type")
        if not items:
            raise bad_request("Invalid 'input': empty array. Expected at least one item.",
                              "input", "empty_array")
        for i, item in enumerate(items):
            path = f"input[{i}]"
            if not isinstance(item, dict):
                raise bad_request(f"Invalid type for '{path}': expected an object, but got "
                                  f"{_type_name(item)}.", path, "invalid_type")
            itype = item.get("type", "message")
            if itype == "message":
                self._message(item, path)
            elif itype == "function_call":
                self._function_call(item, path)
            elif itype == "function_call_output":
                self._function_call_output(item, path)
            elif itype == "reasoning":
                continue  # dropped: templates drop past reasoning (see the module docstring)
            elif isinstance(itype, str) and itype in UNSUPPORTED_PARTS:
                raise bad_request(f"Input items of type '{itype}' ('{path}.type') are not "
                                  "supported by this server: text only.", f"{path}.type",
                                  "unsupported_content")
            else:
                raise bad_request(f"Invalid value for '{path}.type': input items of type "
                                  f"{itype!r} are not supported by this server (supported: "
                                  "message, function_call, function_call_output, reasoning).",
                                  f"{path}.type", "invalid_value")

    def _message(self, item: dict, path: str) -> None:
        role = item.get("role")
        if role not in ROLES:
            raise bad_request(f"Invalid value for '{path}.role': {role!r}; supported values "
                              f"are {', '.join(repr(r) for r in ROLES)}.", f"{path}.role",
                              "invalid_value")
        text = _text_parts(item.get("content"), f"{path}.content")
        if role == "developer":
            role = "system"
        self.out.append({"role": role, "content": text})
        self._open_assistant = len(self.out) - 1 if role == "assistant" else None

    def _function_call(self, item: dict, path: str) -> None:
        call_id = _str_field(item, "call_id", path) or ""  # required: never empty here
        name = _str_field(item, "name", path) or ""
        args = _str_field(item, "arguments", path, required=False, empty_ok=True) or ""
        call = {"id": call_id, "type": "function",
                "function": {"name": name, "arguments": args}}
        self.call_ids.add(call_id)
        if self._open_assistant is None:
            self.out.append({"role": "assistant", "content": ""})
            self._open_assistant = len(self.out) - 1
        self.out[self._open_assistant].setdefault("tool_calls", []).append(call)

    def _function_call_output(self, item: dict, path: str) -> None:
        call_id = _str_field(item, "call_id", path)
        if call_id not in self.call_ids:
            raise bad_request(f"No tool call found for function call output with call_id "
                              f"{call_id}.", f"{path}.call_id", "invalid_value")
        output = _text_parts(item.get("output"), f"{path}.output")
        self.out.append({"role": "tool", "tool_call_id": call_id, "content": output})
        self._open_assistant = None


# --------------------------------------------------------------------------- tools and format

def _tools(tools: Any) -> tuple[list[dict] | None, list[dict]]:
    """(chat tools for the pipeline, the tools as the response echoes them)."""
    if tools is None:
        return None, []
    if not isinstance(tools, list):
        raise bad_request(f"Invalid type for 'tools': expected an array, but got "
                          f"{_type_name(tools)}.", "tools", "invalid_type")
    chat: list[dict] = []
    for j, t in enumerate(tools):
        path = f"tools[{j}]"
        if not isinstance(t, dict):
            raise bad_request(f"Invalid type for '{path}': expected an object, but got "
                              f"{_type_name(t)}.", path, "invalid_type")
        ttype = t.get("type")
        if ttype != "function":
            raise bad_request(f"Tool type {ttype!r} ('{path}.type') is not supported by this "
                              "server: only function tools (hosted tools such as web_search "
                              "and file_search run at OpenAI).", f"{path}.type",
                              "unsupported_tool")
        fn: dict = t["function"] if isinstance(t.get("function"), dict) and "name" not in t \
            else t  # also the chat-completions shape
        name = fn.get("name")
        if not isinstance(name, str):
            raise bad_request(f"Missing required parameter: '{path}.name'.", f"{path}.name",
                              "missing_required_parameter")
        entry = {"name": name}
        for key in ("description", "parameters", "strict"):
            if fn.get(key) is not None:
                entry[key] = fn[key]
        chat.append({"type": "function", "function": entry})
    parsed = P.parse_tools(chat)  # names, schemas, limits, duplicates, normalization
    echo = [{"type": "function", "name": c["function"]["name"],
             "description": c["function"].get("description"),
             "parameters": c["function"]["parameters"],
             "strict": c["function"].get("strict")} for c in parsed or []]
    return parsed, echo


def _tool_choice(tc: Any, tools: list[dict] | None) -> tuple[str, Any]:
    """(ChatInput.tool_choice, the value the response echoes)."""
    if tc is None:
        return P.parse_tool_choice(None, tools), "auto"
    if isinstance(tc, str):
        return P.parse_tool_choice(tc, tools), tc
    if isinstance(tc, dict) and tc.get("type") == "function":
        name = tc.get("name")
        if name is None and isinstance(tc.get("function"), dict):
            name = tc["function"].get("name")
        if not isinstance(name, str):
            raise bad_request("Missing required parameter: 'tool_choice.name'.",
                              "tool_choice", "missing_required_parameter")
        choice = P.parse_tool_choice({"type": "function", "function": {"name": name}}, tools)
        return choice, {"type": "function", "name": name}
    what = tc.get("type") if isinstance(tc, dict) else _type_name(tc)
    raise bad_request(f"'tool_choice' {what!r} is not supported by this server: use 'auto', "
                      "'none', 'required' or {\"type\": \"function\", \"name\": ...}.",
                      "tool_choice", "invalid_value")


def _text_format(text: Any) -> tuple[OutputConstraint | None, dict]:
    """(the output constraint, the `text` object the response echoes)."""
    if text is None:
        return None, {"format": {"type": "text"}}
    if not isinstance(text, dict):
        raise bad_request(f"Invalid type for 'text': expected an object, but got "
                          f"{_type_name(text)}.", "text", "invalid_type")
    echo: dict = {}
    if text.get("verbosity") is not None:
        echo["verbosity"] = text["verbosity"]
    fmt = text.get("format")
    if fmt is None:
        echo["format"] = {"type": "text"}
        return None, echo
    if not isinstance(fmt, dict):
        raise bad_request(f"Invalid type for 'text.format': expected an object, but got "
                          f"{_type_name(fmt)}.", "text.format", "invalid_type")
    ftype = fmt.get("type")
    if ftype == "text":
        echo["format"] = {"type": "text"}
        return None, echo
    if ftype == "json_object":
        echo["format"] = {"type": "json_object"}
        return OutputConstraint("json_object", "", "text.format"), echo
    if ftype == "json_schema":
        name = fmt.get("name")
        if name is not None and not isinstance(name, str):
            raise bad_request("Invalid type for 'text.format.name': expected a string.",
                              "text.format.name", "invalid_type")
        schema = fmt.get("schema")
        constraint = schema_constraint({} if schema is None else schema, "text.format.schema")
        strict = fmt.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise bad_request("Invalid type for 'text.format.strict': expected a boolean.",
                              "text.format.strict", "invalid_type")
        out = {"type": "json_schema", "name": name or "response",
               "schema": schema if schema is not None else {}, "strict": strict}
        if isinstance(fmt.get("description"), str):
            out["description"] = fmt["description"]
        echo["format"] = out
        return constraint, echo
    raise bad_request(f"Invalid value for 'text.format.type': {ftype!r}; supported values are "
                      "'text', 'json_object' and 'json_schema'.", "text.format.type",
                      "invalid_value")


def _loose(body: dict, name: str, types: tuple, what: str) -> Any:
    v = body.get(name)
    if v is not None and (not isinstance(v, types) or isinstance(v, bool) and bool not in types):
        raise bad_request(f"Invalid type for '{name}': expected {what}, but got "
                          f"{_type_name(v)}.", name, "invalid_type")
    return v


# --------------------------------------------------------------------------- the request

@dataclass
class ResponsesRequest(ApiRequest):
    """A Responses request: what its response object echoes and what storing it needs."""

    echo: dict = field(default_factory=dict)  # the request fields the response repeats
    store: bool = True
    owner: str = ""  # responses_store.owner_of
    conversation: list[dict] = field(default_factory=list)  # the messages, instructions out
    instructions: str | None = None
    tools_echo: list[dict] | None = None  # the tools in the Responses shape


def _check_body(body: dict) -> dict:
    """The fields that change nothing here but must be well-formed; returns their echo."""
    for name in UNSUPPORTED_BODY:
        v = body.get(name)
        if v is not None and v is not False:
            raise bad_request(f"'{name}' is not supported by this server.", name,
                              "unsupported_parameter")
    metadata = _loose(body, "metadata", (dict,), "an object")
    if metadata is not None and not all(isinstance(v, str) for v in metadata.values()):
        raise bad_request("Invalid 'metadata': values must be strings.", "metadata",
                          "invalid_type")
    user = _loose(body, "user", (str,), "a string")
    truncation = _loose(body, "truncation", (str,), "a string")
    if truncation is not None and truncation not in ("auto", "disabled"):
        raise bad_request(f"Invalid value for 'truncation': {truncation!r}; supported "
                          "values are 'auto' and 'disabled'.", "truncation",
                          "invalid_value")
    reasoning = _reasoning(body)
    include = _loose(body, "include", (list,), "an array")
    if include is not None and not all(isinstance(x, str) for x in include):
        raise bad_request("Invalid 'include': expected an array of strings.", "include",
                          "invalid_type")
    return {"metadata": dict(metadata) if metadata else {}, "user": user,
            "truncation": truncation or "disabled", "reasoning": reasoning}


REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
REASONING_SUMMARIES = ("auto", "concise", "detailed")


def _reasoning(body: dict) -> dict | None:
    """`reasoning` (echoed, not acted on): `effort` and `summary` (or the older
    `generate_summary`) are null or one of OpenAI's values, so the echo is always JSON."""
    reasoning = _loose(body, "reasoning", (dict,), "an object")
    if reasoning is None:
        return None
    for key, allowed in (("effort", REASONING_EFFORTS), ("summary", REASONING_SUMMARIES),
                         ("generate_summary", REASONING_SUMMARIES)):
        v = reasoning.get(key)
        if v is None:
            continue
        if not isinstance(v, str) or v not in allowed:
            shown = repr(v) if isinstance(v, str) else _type_name(v)
            raise bad_request(f"Invalid value for 'reasoning.{key}': {shown[:64]}; supported "
                              f"values are {', '.join(map(repr, allowed))}.",
                              f"reasoning.{key}", "invalid_value")
    return reasoning


def _check_finite(value: Any, path: str) -> None:
    """400 for NaN or ±Infinity anywhere in `value` (what the response echoes): JSON has no
    such numbers, and the response is written only after the whole reply was generated."""
    stack = [(value, path)]
    while stack:
        v, p = stack.pop()
        if isinstance(v, float) and not math.isfinite(v):
            raise bad_request(f"Invalid value for '{p}': {v} is not a JSON number.", p,
                              "invalid_value")
        if isinstance(v, dict):
            stack.extend((x, f"{p}.{k}") for k, x in v.items())
        elif isinstance(v, list):
            stack.extend((x, f"{p}[{i}]") for i, x in enumerate(v))


def _template_kwargs(body: dict) -> dict:
    kwargs = body.get("chat_template_kwargs")
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict):
        raise bad_request("'chat_template_kwargs' must be an object", "chat_template_kwargs")
    return {k: v for k, v in kwargs.items() if k not in ("messages", "tools")}


def _stored_messages(store: ResponseStore, prev_id: str | None, owner: str) -> list[dict]:
    if prev_id is None:
        return []
    rec = store.get(prev_id, owner)
    if rec is None:
        raise APIError(404, f"Previous response with id '{prev_id}' not found.",
                       param="previous_response_id", code="previous_response_not_found")
    return list(rec.messages)  # the message dicts are shared, never mutated


def parse_responses_request(body: dict, ctx: RequestContext, store: ResponseStore
                            ) -> ResponsesRequest:
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    model = P.requested_model(body, ctx.model_name)
    echo = _check_body(body)
    max_tokens = P.get_int(body, "max_output_tokens", lo=1)
    sampling = parse_sampling(body, RESPONSES, ctx_size=ctx.ctx_size,
                              server_defaults=ctx.sampling_defaults)
    temperature, top_p = sampling.temperature, sampling.top_p
    stream = P.get_bool(body, "stream", False)
    keep = P.get_bool(body, "store", True)
    parallel = P.get_bool(body, "parallel_tool_calls", True)
    instructions = P.get_str(body, "instructions")
    prev_id = P.get_str(body, "previous_response_id")
    cache_salt = P.parse_cache_salt(body)
    kwargs = _template_kwargs(body)
    tools, tools_echo = _tools(body.get("tools"))
    tool_choice, tool_choice_echo = _tool_choice(body.get("tool_choice"), tools)
    output, text_echo = _text_format(body.get("text"))

    # the conversation: instructions, the stored turns, then this request's input items
    owner = owner_of(ctx, cache_salt)
    stored = _stored_messages(store, prev_id, owner)
    messages: list[dict] = []
    if instructions:
        messages.append({"role": "system", "content": instructions})
    n_head = len(messages)
    conv = _Conversation(messages + stored)
    conv.items(body.get("input"))
    messages = conv.out
    if len(messages) == n_head:  # only reasoning items
        raise bad_request("Invalid 'input': no message to respond to.", "input",
                          "invalid_value")
    cache_point = None
    if stored:
        cache_point = CachePoint(n_head + len(stored) - 1)
    elif keep:
        cache_point = CachePoint(len(messages) - 1)

    chat = ChatInput(messages=messages, tools=tools, template_kwargs=kwargs,
                     tool_choice=tool_choice, parallel_tool_calls=parallel)
    opts = CommonOptions(max_tokens=max_tokens, sampling=sampling, stream=stream,
                         cache_salt=cache_salt)
    echo.update(instructions=instructions, tools=tools_echo, tool_choice=tool_choice_echo,
                parallel_tool_calls=parallel, text=text_echo, temperature=temperature,
                top_p=top_p, max_output_tokens=max_tokens, previous_response_id=prev_id,
                store=keep)
    for name in ("reasoning", "metadata", "tools", "text"):
        _check_finite(echo.get(name), name)
    return ResponsesRequest(chat=chat, opts=opts, output=output, model=model,
                            cache_point=cache_point, echo=echo, store=keep, owner=owner,
                            conversation=messages[n_head:], instructions=instructions,
                            tools_echo=tools_echo)
