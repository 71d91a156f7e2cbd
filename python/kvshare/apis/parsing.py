"""Request fields every API shares, parsed one way: typed accessors, sampling options, stop
strings, logit bias, `cache_salt`, chat messages, tools and tool choice, output constraints.

Parsing is strict about types (a bool is not a number, a float is not an int) and lenient about
unknown fields (OpenAI clients send `user`, `metadata`, `store`, ... which are ignored). Every
problem raises `APIError` (400 unless stated) naming the offending field in `param`.
"""

from __future__ import annotations

import math
from typing import Any, Callable, overload

from kvshare.server.errors import APIError, bad_request

from .base import ChatInput

MAX_STOP_STRINGS = 16
# Every generated token is checked against every stop string, and text that could still become
# one is held back (engine/output.py): the cost per token grows with their lengths, on the
# engine thread that decodes for everyone (twelve 1 MiB stop strings slowed other users 8x).
MAX_STOP_CHARS = 256  # per stop string
MAX_STOP_TOTAL_CHARS = 1024  # all of them together
MAX_TOP_LOGPROBS = 20
MAX_LOGIT_BIAS = 1024  # entries; each is applied to every sampled token
MAX_TOOLS = 256
CHAT_ROLES = {"system", "developer", "user", "assistant", "tool", "function"}


# --------------------------------------------------------------------------- typed accessors

def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


@overload
def get_int(body: dict, name: str, default: int, *, lo: int | None = None,
            hi: int | None = None) -> int: ...


@overload
def get_int(body: dict, name: str, default: None = None, *, lo: int | None = None,
            hi: int | None = None) -> int | None: ...


def get_int(body: dict, name: str, default: int | None = None, *, lo: int | None = None,
            hi: int | None = None) -> int | None:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, float) and v.is_integer() and math.isfinite(v):
        v = int(v)  # JSON writers sometimes emit 16.0 for 16
    if not is_int(v):
        raise bad_request(f"'{name}' must be an integer, got {json_type(v)}", name)
    if lo is not None and v < lo:
        raise bad_request(f"'{name}' must be >= {lo}, got {v}", name)
    if hi is not None and v > hi:
        raise bad_request(f"'{name}' must be <= {hi}, got {v}", name)
    return v


def get_seed(body: dict, name: str = "seed") -> int | None:
    """A sampling seed: any 64-bit integer (negative ones wrap, as a uint64 cast would);
    -1 means random (llama-server)."""
    seed = get_int(body, name, lo=-(2**63), hi=2**64 - 1)
    if seed is None or seed == -1:
        return None
    return seed % 2**64


@overload
def get_float(body: dict, name: str, default: float, *, lo: float | None = None,
              hi: float | None = None, lo_open: bool = False) -> float: ...


@overload
def get_float(body: dict, name: str, default: None = None, *, lo: float | None = None,
              hi: float | None = None, lo_open: bool = False) -> float | None: ...


def get_float(body: dict, name: str, default: float | None = None, *, lo: float | None = None,
              hi: float | None = None, lo_open: bool = False) -> float | None:
    v = body.get(name)
    if v is None:
        return default
    if not is_number(v) or not math.isfinite(v):
        raise bad_request(f"'{name}' must be a finite number, got {json_type(v)}", name)
    v = float(v)
    if lo is not None and (v < lo or (lo_open and v == lo)):
        raise bad_request(f"'{name}' must be {'>' if lo_open else '>='} {lo}, got {v}", name)
    if hi is not None and v > hi:
        raise bad_request(f"'{name}' must be <= {hi}, got {v}", name)
    return v


def get_bool(body: dict, name: str, default: bool = False) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad_request(f"'{name}' must be a boolean, got {json_type(v)}", name)
    return v


@overload
def get_str(body: dict, name: str, default: str) -> str: ...


@overload
def get_str(body: dict, name: str, default: None = None) -> str | None: ...


def get_str(body: dict, name: str, default: str | None = None) -> str | None:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, str):
        raise bad_request(f"'{name}' must be a string, got {json_type(v)}", name)
    return v


def json_type(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, (int, float)):
        return "number" if math.isfinite(v) else str(v)
    if isinstance(v, str):
        return "string"
    if isinstance(v, list):
        return "array"
    if isinstance(v, dict):
        return "object"
    return type(v).__name__


def is_token_list(v: Any) -> bool:
    return isinstance(v, list) and len(v) > 0 and all(is_int(t) for t in v)


def check_token_ids(tokens: list, vocab_size: int | None, param: str) -> list[int]:
    if not isinstance(tokens, list) or not all(is_int(t) for t in tokens):
        raise bad_request(f"'{param}' must be an array of integer token ids", param)
    for t in tokens:
        if t < 0 or (vocab_size is not None and t >= vocab_size):
            bound = f" [0, {vocab_size})" if vocab_size is not None else " >= 0"
            raise bad_request(f"token id {t} in '{param}' is out of range{bound}", param,
                              "invalid_token_id")
    return tokens


# --------------------------------------------------------------------------- common options

def parse_cache_salt(body: dict, bad: Callable[[str, str], APIError] | None = None
                     ) -> str | None:
    """kvshare's `cache_salt` extension (every API): a non-empty string, hashed into the
    cache keys by the pipeline. `bad(param, message)`: the API's own 400 wording."""
    salt = body.get("cache_salt")
    if salt is None:
        return None
    if not isinstance(salt, str) or not salt:
        if bad is not None:
            raise bad("cache_salt", "Input should be a non-empty string")
        raise bad_request("'cache_salt' must be a non-empty string", "cache_salt")
    return salt


def requested_model(body: dict, model_name: str) -> str:
    """The model name a response echoes. Any name is served by the loaded model (agents
    hard-code names such as gpt-4o-mini, as llama-server, vLLM and SGLang allow); a missing or
    empty `model` means the served model's own name."""
    model = body.get("model")
    if model is None or model == "":
        return model_name
    if not isinstance(model, str):
        raise bad_request(f"'model' must be a string, got {json_type(model)}", "model")
    return model


def parse_logit_bias(body: dict, vocab_size: int | None) -> tuple[tuple[int, float], ...]:
    """OpenAI `logit_bias`: {"token id": bias in [-100, 100]} (llama-server also takes
    [[id, bias], ...])."""
    v = body.get("logit_bias")
    if v is None:
        return ()
    if isinstance(v, dict):
        items = list(v.items())
    elif isinstance(v, list) and all(isinstance(x, list) and len(x) == 2 for x in v):
        items = [(x[0], x[1]) for x in v]
    else:
        raise bad_request("'logit_bias' must be an object mapping token ids to biases",
                          "logit_bias")
    if len(items) > MAX_LOGIT_BIAS:
        raise bad_request(f"'logit_bias' has {len(items)} entries; at most {MAX_LOGIT_BIAS} "
                          "are supported", "logit_bias")
    out = []
    for key, bias in items:
        if isinstance(key, str) and key.strip().lstrip("-").isdigit():
            tok = int(key)
        elif is_int(key):
            tok = key
        else:
            raise bad_request(f"'logit_bias' key {key!r} is not a token id", "logit_bias")
        if tok < 0 or (vocab_size is not None and tok >= vocab_size):
            raise bad_request(f"'logit_bias' token id {tok} is out of range [0, {vocab_size})",
                              "logit_bias", "invalid_token_id")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not math.isfinite(bias):
            raise bad_request(f"'logit_bias' value for token {tok} must be a number",
                              "logit_bias")
        if not -100 <= bias <= 100:
            raise bad_request(f"'logit_bias' value for token {tok} must be in [-100, 100], "
                              f"got {bias}", "logit_bias")
        out.append((tok, float(bias)))
    return tuple(out)


def parse_stop(body: dict) -> list[str]:
    """`stop`: a string or an array of strings (empty ones dropped), within the limits."""
    stop_v = body.get("stop")
    if stop_v is None:
        stop: list[str] = []
    elif isinstance(stop_v, str):
        stop = [stop_v]
    elif isinstance(stop_v, list) and all(isinstance(s, str) for s in stop_v):
        stop = list(stop_v)
    else:
        raise bad_request("'stop' must be a string or an array of strings", "stop")
    if len(stop) > MAX_STOP_STRINGS:
        raise bad_request(f"at most {MAX_STOP_STRINGS} stop strings are supported", "stop")
    longest = max((len(s) for s in stop), default=0)
    if longest > MAX_STOP_CHARS:
        raise bad_request(f"a stop string has {longest} characters; at most "
                          f"{MAX_STOP_CHARS} are supported", "stop")
    total = sum(len(s) for s in stop)
    if total > MAX_STOP_TOTAL_CHARS:
        raise bad_request(f"the stop strings have {total} characters together; at most "
                          f"{MAX_STOP_TOTAL_CHARS} are supported", "stop")
    return [s for s in stop if s]


# --------------------------------------------------------------------------- chat

def _content_text(content: Any, i: int) -> str | None:
    param, where = "messages", f"messages[{i}].content"
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if isinstance(part, str):
                parts.append(part)
                continue
            if not isinstance(part, dict):
                raise bad_request(f"'{where}[{j}]' must be an object", param)
            ptype = part.get("type")
            if ptype in ("text", "input_text"):
                text = part.get("text")
                if not isinstance(text, str):
                    raise bad_request(f"'{where}[{j}].text' must be a string", param)
                parts.append(text)
            else:
                raise bad_request(f"content part type {ptype!r} is not supported (text only)",
                                  param)
        return "\n".join(parts)
    raise bad_request(f"'{where}' must be a string, an array of content parts or null",
                      param)


_RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "tools", "continue_final", "strip_bos",
                                       "boundary", "cache_after", "tokenizer"})


def parse_messages(messages: Any) -> list[dict]:
    """OpenAI chat `messages`: each a role and text content (content parts joined);
    `developer` is a system message."""
    if messages is None:
        raise bad_request("'messages' is required", "messages")
    if not isinstance(messages, list):
        raise bad_request(f"'messages' must be an array, got {json_type(messages)}", "messages")
    if not messages:
        raise bad_request("'messages' must contain at least one message", "messages")
    return [_message(m, i) for i, m in enumerate(messages)]


def _message(m: Any, i: int) -> dict:
    if not isinstance(m, dict):
        raise bad_request(f"'messages[{i}]' must be an object", "messages")
    role = m.get("role")
    if not isinstance(role, str):
        raise bad_request(f"'messages[{i}].role' is required and must be a string", "messages")
    if role not in CHAT_ROLES:
        raise bad_request(f"'messages[{i}].role' {role!r} is not one of "
                          f"{sorted(CHAT_ROLES)}", "messages")
    msg = dict(m)
    content = _content_text(m.get("content"), i)
    if content is None:
        if role in ("user", "system", "developer"):
            raise bad_request(f"'messages[{i}].content' is required for role {role!r}",
                              "messages")
        content = ""
    msg["content"] = content
    if role == "developer":
        msg["role"] = "system"
    if msg.get("tool_calls") is not None and not isinstance(msg["tool_calls"], list):
        raise bad_request(f"'messages[{i}].tool_calls' must be an array", "messages")
    return msg


def parse_chat(body: dict, *, reasoning_format: str | None = None) -> ChatInput:
    """A chat request's messages, tools and template options. `reasoning_format`: the
    default when the request gives none (the server's `--reasoning-format`).

    A final assistant message is continued (llama-server's assistant prefill: the prompt ends
    inside its turn, the reply goes on from its text) unless `continue_final_message` is
    false; vLLM's `continue_final_message` / `add_generation_prompt` are honoured (both true
    is a 400, and continuing needs a final assistant message without tool calls)."""
    out = parse_messages(body.get("messages"))
    tools = parse_tools(body.get("tools"))
    tool_choice = parse_tool_choice(body.get("tool_choice"), tools)
    parallel = get_bool(body, "parallel_tool_calls", True)
    reasoning_format = get_str(body, "reasoning_format", reasoning_format or "auto")
    if reasoning_format not in ("none", "auto", "deepseek", "deepseek-legacy"):
        raise bad_request("'reasoning_format' must be 'none', 'auto' or 'deepseek'",
                          "reasoning_format")

    kwargs = body.get("chat_template_kwargs")
    if kwargs is None:
        kwargs = {}
    if not isinstance(kwargs, dict):
        raise bad_request("'chat_template_kwargs' must be an object", "chat_template_kwargs")
    thinking = kwargs.get("enable_thinking")
    if thinking is not None and not isinstance(thinking, bool):  # llama-server's check
        raise bad_request('invalid type for "enable_thinking" (expected boolean, got '
                          f"{json_type(thinking)})", "chat_template_kwargs")
    # names the renderer takes for itself are not template variables
    kwargs = {k: v for k, v in kwargs.items() if k not in _RESERVED_TEMPLATE_KWARGS}
    continue_final = _continuation(body, out, kwargs)
    # llama-server reads reasoning_budget_tokens, else thinking_budget_tokens; -1: the server's
    budget = get_int(body, "reasoning_budget_tokens", -1, lo=-1, hi=2**31 - 1)
    if budget == -1:
        budget = get_int(body, "thinking_budget_tokens", -1, lo=-1, hi=2**31 - 1)
    message = body.get("reasoning_budget_message")
    if message is not None and not isinstance(message, str):
        raise bad_request("'reasoning_budget_message' must be a string",
                          "reasoning_budget_message")
    return ChatInput(messages=out, tools=tools, template_kwargs=kwargs, tool_choice=tool_choice,
                     parallel_tool_calls=parallel, reasoning_format=reasoning_format,
                     continue_final=continue_final, reasoning_budget=budget,
                     reasoning_budget_message=message)


def _continuation(body: dict, messages: list[dict], kwargs: dict) -> bool:
    """Whether the prompt continues the final message (see `parse_chat`); sets
    kwargs["add_generation_prompt"] from the request's top-level field."""
    agp = body.get("add_generation_prompt")
    if agp is not None and not isinstance(agp, bool):
        raise bad_request(f"'add_generation_prompt' must be a boolean, got {json_type(agp)}",
                          "add_generation_prompt")
    cfm = body.get("continue_final_message")
    if cfm == "content":  # llama-server's spelling of true
        cfm = True
    elif isinstance(cfm, str):
        raise bad_request("'continue_final_message' must be a boolean (or \"content\"); "
                          "continuing reasoning_content is not supported",
                          "continue_final_message")
    elif cfm is not None and not isinstance(cfm, bool):
        raise bad_request(f"'continue_final_message' must be a boolean, got {json_type(cfm)}",
                          "continue_final_message")
    last = messages[-1]
    if cfm is None:  # llama-server: a final assistant message is a prefill
        cont = last["role"] == "assistant"
        if cont and len(messages) >= 2 and messages[-2]["role"] == "assistant":
            raise bad_request("Cannot have 2 or more assistant messages at the end of the list.",
                              "messages")
    elif cfm:
        if agp is True:
            raise bad_request("Cannot set both add_generation_prompt and continue_final_message "
                              "to true.", "continue_final_message")
        if last["role"] != "assistant":
            raise bad_request("'continue_final_message' needs a final assistant message to "
                              f"continue (the last message is {last['role']!r})",
                              "continue_final_message")
        cont = True
    else:
        cont = False
    if cont:
        if last.get("tool_calls"):
            raise bad_request("Cannot continue an assistant message that contains tool calls.",
                              "messages")
        kwargs["add_generation_prompt"] = False
    elif agp is not None:
        kwargs["add_generation_prompt"] = agp
    return cont


TOOL_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-.")


def parse_tools(tools: Any) -> list[dict] | None:
    """OpenAI `tools`: function tools with a name (letters, digits, _ - ., at most 64, as
    OpenAI requires), an optional description and a `parameters` JSON schema object.
    Returned normalized (`type` and `parameters` filled in, keys in one order, unknown keys
    dropped) so equal tool lists render equal prompts (the shared prefix) whichever API or
    client sent them."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise bad_request("'tools' must be an array", "tools")
    if len(tools) > MAX_TOOLS:
        raise bad_request(f"'tools' has {len(tools)} entries; at most {MAX_TOOLS} are "
                          "supported", "tools")
    out = []
    seen: set[str] = set()
    for j, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if (not isinstance(t, dict) or t.get("type", "function") != "function"
                or not isinstance(fn, dict) or not isinstance(fn.get("name"), str)):
            raise bad_request(f"'tools[{j}]' must be {{\"type\": \"function\", "
                              f"\"function\": {{\"name\": ..., ...}}}}", "tools")
        name = fn["name"]
        if not name or len(name) > 64 or not set(name) <= TOOL_NAME_CHARS:
            raise bad_request(f"'tools[{j}].function.name' {name!r} must be 1-64 letters, "
                              "digits, '_', '-' or '.'", "tools")
        if name in seen:
            raise bad_request(f"'tools' declares the function {name!r} twice", "tools")
        seen.add(name)
        params = fn.get("parameters")
        if params is None:
            params = {"type": "object", "properties": {}}
        if not isinstance(params, dict):
            raise bad_request(f"'tools[{j}].function.parameters' must be a JSON schema object",
                              "tools")
        desc = fn.get("description")
        if desc is not None and not isinstance(desc, str):
            raise bad_request(f"'tools[{j}].function.description' must be a string", "tools")
        strict = fn.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise bad_request(f"'tools[{j}].function.strict' must be a boolean", "tools")
        # canonical key order, unknown keys dropped: the same tool sent through any API (or
        # by clients that order keys differently) renders the same tokens
        norm_fn: dict = {"name": name}
        if desc is not None:
            norm_fn["description"] = desc
        norm_fn["parameters"] = params
        if strict is not None:
            norm_fn["strict"] = strict
        norm = {"type": "function", "function": norm_fn}
        out.append(norm)
    return out or None


def template_tools(tools: list[dict] | None) -> list[dict] | None:
    """Tools as the chat template sees them: `strict` is the server's business (whether the
    arguments are enforced by a grammar), not the model's, and leaving it out keeps the
    rendered prefix the same whichever API or client flag sent the tools."""
    if not tools:
        return tools
    return [{**t, "function": {k: v for k, v in t["function"].items() if k != "strict"}}
            for t in tools]


def parse_tool_choice(tc: Any, tools: list[dict] | None) -> str:
    if tc is None:
        return "auto" if tools else "none"
    if isinstance(tc, str):
        if tc not in ("none", "auto", "required"):
            raise bad_request(f"'tool_choice' {tc!r} is not one of 'none', 'auto', 'required' "
                              "or a function", "tool_choice")
        if tc == "required" and not tools:
            raise bad_request("'tool_choice' is 'required' but no 'tools' are given",
                              "tool_choice")
        return tc
    fn = tc.get("function") if isinstance(tc, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise bad_request("'tool_choice' must be 'none', 'auto', 'required' or "
                          "{\"type\": \"function\", \"function\": {\"name\": ...}}",
                          "tool_choice")
    names = [t["function"]["name"] for t in tools or []]
    if name not in names:
        raise bad_request(f"'tool_choice' names the function {name!r}, which is not in "
                          f"'tools' ({', '.join(names) or 'none declared'})", "tool_choice")
    return "function:" + name
