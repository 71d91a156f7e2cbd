"""Anthropic Messages requests translated into the pipeline's chat (`anthropic` answers
them): system blocks, user / assistant turns of content blocks, `tool_use` / `tool_result`
blocks as OpenAI tool calls and tool messages, `cache_control` breakpoints, tools with
`input_schema`, `tool_choice`, `thinking`, `output_config.format`. Errors are worded as
Anthropic words them (`messages.0.content: ...`); see `anthropic`'s docstring for the whole
mapping."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from kvshare.engine.api import SamplingParams
from kvshare.server.errors import APIError, bad_request

from . import parsing as P
from .output_fields import schema_constraint
from .base import ApiRequest, CachePoint, ChatInput, CommonOptions, OutputConstraint, RequestContext
from .sampling_fields import NumberReader, Range, anthropic_dialect, parse_sampling

MAX_BREAKPOINTS = 4  # cache_control blocks per request (Anthropic's limit)
ROLES = ("user", "assistant")
# Block types Anthropic defines that this server cannot take (no vision, no documents, no server
# tools): refused by name rather than as unknown.
UNSUPPORTED_BLOCKS = frozenset({
    "image", "document", "search_result", "container_upload", "server_tool_use",
    "web_search_tool_result", "web_fetch_tool_result", "code_execution_tool_result",
    "bash_code_execution_tool_result", "text_editor_code_execution_tool_result",
    "tool_search_tool_result", "mcp_tool_use", "mcp_tool_result", "tool_reference",
})

@dataclass
class MessagesRequest(ApiRequest):
    """A Messages request: whether it asked for thinking (the reply's `thinking` blocks)."""

    thinking: bool = False


# --------------------------------------------------------------------------- validation helpers

def _bad(path: str, message: str) -> APIError:
    """A 400 worded as Anthropic words them ("messages.0.content: ...")."""
    return bad_request(f"{path}: {message}", path.split(".")[0])


def _type_name(v: Any) -> str:
    return P.json_type(v)


def _int(body: dict, name: str, *, lo: int, required: bool = False) -> int | None:
    v = body.get(name)
    if v is None:
        if required:
            raise _bad(name, "Field required")
        return None
    if isinstance(v, float) and v.is_integer() and math.isfinite(v):
        v = int(v)
    if not P.is_int(v):
        raise _bad(name, f"Input should be a valid integer, got {_type_name(v)}")
    if v < lo:
        raise _bad(name, f"Input should be greater than or equal to {lo}")
    return v


def _number(body: dict, name: str, default: float, lo: float, hi: float) -> float:
    v = body.get(name)
    if v is None:
        return default
    if not P.is_number(v) or not math.isfinite(v):
        raise _bad(name, f"Input should be a valid number, got {_type_name(v)}")
    if v < lo:
        raise _bad(name, f"Input should be greater than or equal to {lo:g}")
    if v > hi:
        raise _bad(name, f"Input should be less than or equal to {hi:g}")
    return float(v)


class _AnthropicNumbers(NumberReader):
    """Sampling numbers with Anthropic's wording of a bad value."""

    def number(self, body: dict, name: str, r: Range) -> float | None:
        lo = -math.inf if r.lo is None else r.lo
        hi = math.inf if r.hi is None else r.hi
        return None if body.get(name) is None else _number(body, name, 0.0, lo, hi)

    def integer(self, body: dict, name: str, r: Range) -> int | None:
        return _int(body, name, lo=-(2**63) if r.lo is None else int(r.lo))


_SAMPLING = anthropic_dialect(_AnthropicNumbers())


def _bool(obj: dict, name: str, path: str, default: bool = False) -> bool:
    v = obj.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise _bad(path, f"Input should be a valid boolean, got {_type_name(v)}")
    return v


def _stop_sequences(body: dict) -> list[str]:
    v = body.get("stop_sequences")
    if v is None:
        return []
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise _bad("stop_sequences", "Input should be a valid list of strings")
    if len(v) > P.MAX_STOP_STRINGS:
        raise _bad("stop_sequences", f"at most {P.MAX_STOP_STRINGS} stop sequences are "
                                     "supported")
    longest = max((len(s) for s in v), default=0)
    if longest > P.MAX_STOP_CHARS:
        raise _bad("stop_sequences", f"a stop sequence has {longest} characters; at most "
                                     f"{P.MAX_STOP_CHARS} are supported")
    total = sum(len(s) for s in v)
    if total > P.MAX_STOP_TOTAL_CHARS:
        raise _bad("stop_sequences", f"the stop sequences have {total} characters together; "
                                     f"at most {P.MAX_STOP_TOTAL_CHARS} are supported")
    return [s for s in v if s]


def _thinking(body: dict) -> str | None:
    """The requested `thinking.type` ("enabled", "adaptive", "disabled") or None."""
    v = body.get("thinking")
    if v is None:
        return None
    if not isinstance(v, dict):
        raise _bad("thinking", f"Input should be an object, got {_type_name(v)}")
    t = v.get("type")
    if t not in ("enabled", "disabled", "adaptive"):
        raise _bad("thinking.type", "Input should be 'enabled', 'adaptive' or 'disabled'")
    return t


# --------------------------------------------------------------------------- the translation

class _Translator:
    """One request's system, messages and tools in OpenAI terms, with its cache breakpoints."""

    def __init__(self) -> None:
        self.out: list[dict] = []
        self.n_breakpoints = 0
        self.prefix_breakpoint = False  # on tools or system
        self.message_breakpoint: int | None = None  # index into `out`
        self.tool_use_ids: set[str] = set()

    # ---- cache_control
    def _cache_control(self, block: dict, path: str) -> bool:
        cc = block.get("cache_control")
        if cc is None:
            return False
        where = f"{path}.cache_control" if path else "cache_control"
        if not isinstance(cc, dict):
            raise _bad(where, f"Input should be an object, got {_type_name(cc)}")
        if cc.get("type") != "ephemeral":
            raise _bad(f"{where}.type", "Input should be 'ephemeral'")
        ttl = cc.get("ttl")
        if ttl is not None and ttl not in ("5m", "1h"):
            raise _bad(f"{where}.ttl", "Input should be '5m' or '1h'")
        self.n_breakpoints += 1
        if self.n_breakpoints > MAX_BREAKPOINTS:
            raise bad_request(f"A maximum of {MAX_BREAKPOINTS} blocks with cache_control may "
                              f"be provided. Found {self.n_breakpoints}.", "cache_control")
        return True

    def _mark(self, index: int) -> None:
        self.message_breakpoint = index  # messages come in order: the last one wins

    # ---- system
    def system(self, system: Any) -> None:
        if system is None:
            return
        if isinstance(system, str):
            if system:
                self.out.append({"role": "system", "content": system})
            return
        if not isinstance(system, list):
            raise _bad("system", f"Input should be a string or a list of text blocks, got "
                                 f"{_type_name(system)}")
        texts = []
        for j, b in enumerate(system):
            path = f"system.{j}"
            if not isinstance(b, dict):
                raise _bad(path, "Input should be an object")
            if b.get("type") != "text":
                raise _bad(f"{path}.type", f"system blocks must be text blocks, got "
                                           f"{b.get('type')!r}")
            texts.append(self._text(b, path))
            if self._cache_control(b, path):
                self.prefix_breakpoint = True
        if texts:
            self.out.append({"role": "system", "content": "\n".join(texts)})

    @staticmethod
    def _text(b: dict, path: str) -> str:
        t = b.get("text")
        if not isinstance(t, str):
            raise _bad(f"{path}.text", "Field required" if t is None
                       else f"Input should be a valid string, got {_type_name(t)}")
        return t

    # ---- messages
    def messages(self, messages: Any) -> None:
        if messages is None:
            raise _bad("messages", "Field required")
        if not isinstance(messages, list):
            raise _bad("messages", f"Input should be a valid list, got {_type_name(messages)}")
        if not messages:
            raise _bad("messages", "at least one message is required")
        turns: list[tuple[str, list[tuple[dict, str]]]] = []  # (role, [(block, path)])
        for i, m in enumerate(messages):
            role, blocks = self._turn(m, f"messages.{i}")
            if turns and turns[-1][0] == role:
                turns[-1][1].extend(blocks)  # consecutive turns of one role are one turn
            else:
                turns.append((role, blocks))
        for role, blocks in turns:
            if role == "user":
                self._user(blocks)
            else:
                self._assistant(blocks)

    @staticmethod
    def _turn(m: Any, path: str) -> tuple[str, list[tuple[dict, str]]]:
        """One message's role and its content blocks with their paths."""
        if not isinstance(m, dict):
            raise _bad(path, "Input should be an object")
        role = m.get("role")
        if role not in ROLES:
            hint = (" (use the top-level 'system' parameter for a system prompt)"
                    if role == "system" else "")
            raise _bad(f"{path}.role", f"Input should be 'user' or 'assistant', got "
                                       f"{role!r}{hint}")
        content = m.get("content")
        if isinstance(content, str):
            return role, [({"type": "text", "text": content}, f"{path}.content")]
        if isinstance(content, list):
            if not content and role == "user":
                raise _bad(f"{path}.content", "a user message needs at least one content "
                                              "block")
            return role, [(b, f"{path}.content.{j}") for j, b in enumerate(content)]
        if content is None:
            raise _bad(f"{path}.content", "Field required")
        raise _bad(f"{path}.content", f"Input should be a string or a list of content "
                                      f"blocks, got {_type_name(content)}")

    def _block_type(self, b: Any, path: str, allowed: tuple[str, ...]) -> str:
        if not isinstance(b, dict):
            raise _bad(path, f"Input should be an object, got {_type_name(b)}")
        t = b.get("type")
        if not isinstance(t, str):
            raise _bad(f"{path}.type", "Field required")
        if t in allowed:
            return t
        if t in UNSUPPORTED_BLOCKS:
            raise _bad(f"{path}.type", f"content blocks of type {t!r} are not supported by "
                                       f"this server (supported: {', '.join(allowed)})")
        if t in ("tool_use", "tool_result", "thinking", "redacted_thinking", "text"):
            role = "assistant" if t in ("tool_use", "thinking", "redacted_thinking") else "user"
            raise _bad(f"{path}.type", f"{t!r} blocks are only allowed in {role} messages")
        raise _bad(f"{path}.type", f"unknown content block type {t!r}")

    def _user(self, blocks: list[tuple[dict, str]]) -> None:
        texts: list[str] = []
        marked = False

        def flush() -> None:
            nonlocal marked
            if texts:
                self.out.append({"role": "user", "content": "\n".join(texts)})
                if marked:
                    self._mark(len(self.out) - 1)
                texts.clear()
                marked = False

        for b, path in blocks:
            t = self._block_type(b, path, ("text", "tool_result"))
            if t == "text":
                texts.append(self._text(b, path))
                marked = self._cache_control(b, path) or marked
                continue
            flush()
            msg, inner_mark = self._tool_result(b, path)
            self.out.append(msg)
            if self._cache_control(b, path) or inner_mark:
                self._mark(len(self.out) - 1)
        flush()

    def _tool_result(self, b: dict, path: str) -> tuple[dict, bool]:
        """The tool message, and whether a block inside its content is a breakpoint."""
        tid = b.get("tool_use_id")
        if not isinstance(tid, str) or not tid:
            raise _bad(f"{path}.tool_use_id", "Field required" if tid is None
                       else "Input should be a non-empty string")
        if tid not in self.tool_use_ids:
            raise _bad(f"{path}.tool_use_id", f"tool_result block(s) provided when previous "
                                              f"message does not contain a matching tool_use "
                                              f"block (no tool_use with id {tid!r})")
        content = b.get("content")
        marked = False
        if content is None:
            text = ""
        elif isinstance(content, str):
            text = content
        elif isinstance(content, list):
            parts = []
            for k, p in enumerate(content):
                ppath = f"{path}.content.{k}"
                self._block_type(p, ppath, ("text",))
                parts.append(self._text(p, ppath))
                marked = self._cache_control(p, ppath) or marked
            text = "\n".join(parts)
        else:
            raise _bad(f"{path}.content", f"Input should be a string or a list of text "
                                          f"blocks, got {_type_name(content)}")
        if _bool(b, "is_error", f"{path}.is_error"):
            text = f"Error: {text}" if text else "Error"
        return {"role": "tool", "tool_call_id": tid, "content": text}, marked

    def _assistant(self, blocks: list[tuple[dict, str]]) -> None:
        texts: list[str] = []
        calls: list[dict] = []
        marked = False
        for b, path in blocks:
            t = self._block_type(b, path, ("text", "tool_use", "thinking", "redacted_thinking"))
            if t == "text":
                texts.append(self._text(b, path))
            elif t == "tool_use":
                calls.append(self._tool_use(b, path))
            # thinking / redacted_thinking: dropped (see the module docstring)
            marked = self._cache_control(b, path) or marked
        msg: dict = {"role": "assistant", "content": "\n".join(texts)}
        if calls:
            msg["tool_calls"] = calls
        self.out.append(msg)
        if marked:
            self._mark(len(self.out) - 1)

    def _tool_use(self, b: dict, path: str) -> dict:
        tid, name, inp = b.get("id"), b.get("name"), b.get("input")
        if not isinstance(tid, str) or not tid:
            raise _bad(f"{path}.id", "Field required" if tid is None
                       else "Input should be a non-empty string")
        if not isinstance(name, str) or not name:
            raise _bad(f"{path}.name", "Field required" if name is None
                       else "Input should be a non-empty string")
        if inp is None:
            raise _bad(f"{path}.input", "Field required")
        if not isinstance(inp, dict):
            raise _bad(f"{path}.input", f"Input should be an object, got {_type_name(inp)}")
        self.tool_use_ids.add(tid)
        return {"id": tid, "type": "function",
                "function": {"name": name, "arguments": json.dumps(inp, ensure_ascii=False)}}

    # ---- tools
    def tools(self, tools: Any) -> list[dict] | None:
        if tools is None:
            return None
        if not isinstance(tools, list):
            raise _bad("tools", f"Input should be a valid list, got {_type_name(tools)}")
        out = []
        for j, t in enumerate(tools):
            path = f"tools.{j}"
            if not isinstance(t, dict):
                raise _bad(path, f"Input should be an object, got {_type_name(t)}")
            ttype = t.get("type")
            if ttype not in (None, "custom"):
                raise _bad(f"{path}.type", f"tool type {ttype!r} is not supported by this "
                                           "server: only custom tools (name, description, "
                                           "input_schema); server tools run at Anthropic")
            name = t.get("name")
            if not isinstance(name, str):
                raise _bad(f"{path}.name", "Field required" if name is None
                           else f"Input should be a valid string, got {_type_name(name)}")
            if not name or len(name) > 64 or not set(name) <= P.TOOL_NAME_CHARS:
                raise _bad(f"{path}.name", f"{name!r} must be 1-64 letters, digits, '_', '-' "
                                           "or '.'")
            schema = t.get("input_schema")
            if schema is None:
                raise _bad(f"{path}.input_schema", "Field required")
            if not isinstance(schema, dict):
                raise _bad(f"{path}.input_schema", f"Input should be a JSON schema object, "
                                                   f"got {_type_name(schema)}")
            desc = t.get("description")
            if desc is not None and not isinstance(desc, str):
                raise _bad(f"{path}.description", f"Input should be a valid string, got "
                                                  f"{_type_name(desc)}")
            fn: dict = {"name": name}
            if desc is not None:
                fn["description"] = desc
            fn["parameters"] = schema
            if _bool(t, "strict", f"{path}.strict"):
                fn["strict"] = True
            out.append({"type": "function", "function": fn})
            if self._cache_control(t, path):
                self.prefix_breakpoint = True
        return P.parse_tools(out)  # count limit, duplicate names, normalization

    def top_level(self, body: dict) -> None:
        """A top-level `cache_control` marks the last cacheable block: the end of the last
        message (one of the 4 breakpoints)."""
        if body.get("cache_control") is not None and self._cache_control(body, ""):
            self._mark(len(self.out) - 1)

    def cache_point(self) -> CachePoint | None:
        if self.message_breakpoint is not None:
            return CachePoint(self.message_breakpoint)
        if self.prefix_breakpoint:
            return CachePoint(-1)
        return None


def _tool_choice(tc: Any, tools: list[dict] | None) -> tuple[str, bool]:
    """(ChatInput.tool_choice, parallel_tool_calls)."""
    names = [t["function"]["name"] for t in tools or []]
    if tc is None:
        return ("auto" if tools else "none"), True
    if not isinstance(tc, dict):
        raise _bad("tool_choice", f"Input should be an object, got {_type_name(tc)}")
    ttype = tc.get("type")
    parallel = not _bool(tc, "disable_parallel_tool_use", "tool_choice.disable_parallel_tool_use")
    if ttype == "auto":
        return ("auto" if tools else "none"), parallel
    if ttype == "none":
        return "none", parallel
    if ttype in ("any", "tool") and not tools:
        raise _bad("tool_choice", f"tool_choice {ttype!r} requires 'tools'")
    if ttype == "any":
        return "required", parallel
    if ttype == "tool":
        name = tc.get("name")
        if not isinstance(name, str):
            raise _bad("tool_choice.name", "Field required")
        if name not in names:
            raise _bad("tool_choice.name", f"tool {name!r} is not in 'tools' "
                                           f"({', '.join(names)})")
        return "function:" + name, parallel
    raise _bad("tool_choice.type", "Input should be 'auto', 'any', 'tool' or 'none'")


def _output_format(body: dict) -> OutputConstraint | None:
    """Structured outputs: `output_config.format` {"type": "json_schema", "schema": {...}}
    (other `output_config` fields, e.g. `effort`, are ignored)."""
    oc = body.get("output_config")
    if oc is None:
        return None
    if not isinstance(oc, dict):
        raise _bad("output_config", f"Input should be an object, got {_type_name(oc)}")
    fmt = oc.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
        raise _bad("output_config.format", "Input should be {\"type\": \"json_schema\", "
                                           "\"schema\": {...}}")
    schema = fmt.get("schema")
    if schema is None:
        raise _bad("output_config.format.schema", "Field required")
    return schema_constraint(schema, "output_config.format.schema")


def parse_messages_request(body: Any, ctx: RequestContext, *, generate: bool) -> MessagesRequest:
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    model = body.get("model")
    if model is None or model == "":
        model = ctx.model_name
    elif not isinstance(model, str):
        raise _bad("model", f"Input should be a valid string, got {_type_name(model)}")

    tr = _Translator()
    tools = tr.tools(body.get("tools"))
    tr.system(body.get("system"))
    tr.messages(body.get("messages"))
    tr.top_level(body)
    tool_choice, parallel = _tool_choice(body.get("tool_choice"), tools)
    thinking = _thinking(body)
    kwargs: dict = {}
    if thinking is not None:
        kwargs["enable_thinking"] = thinking != "disabled"
    # A final assistant message is a prefill: the reply continues its text (Anthropic's
    # semantics), unless it holds tool calls (then it is a past turn awaiting results).
    last = tr.out[-1] if tr.out else None
    prefill = (last is not None and last["role"] == "assistant" and not last.get("tool_calls")
               and bool(last.get("content")))
    if prefill:
        kwargs["add_generation_prompt"] = False
    # llama-server: thinking enabled spends at most its budget_tokens (default 10000) thinking
    budget = -1
    if thinking == "enabled":
        given = _int(body["thinking"], "budget_tokens", lo=0)
        budget = 10000 if given is None else given
    chat = ChatInput(messages=tr.out, tools=tools, template_kwargs=kwargs,
                       tool_choice=tool_choice, parallel_tool_calls=parallel,
                       continue_final=prefill, reasoning_budget=budget)

    if generate:
        max_tokens = _int(body, "max_tokens", lo=1, required=True)
        sampling = parse_sampling(body, _SAMPLING, ctx_size=ctx.ctx_size,
                                  server_defaults=ctx.sampling_defaults)
        stop = _stop_sequences(body)
        stream = _bool(body, "stream", "stream")
        meta = body.get("metadata")
        if meta is not None:
            if not isinstance(meta, dict):
                raise _bad("metadata", f"Input should be an object, got {_type_name(meta)}")
            uid = meta.get("user_id")
            if uid is not None and not isinstance(uid, str):
                raise _bad("metadata.user_id", "Input should be a valid string")
    else:
        max_tokens, sampling, stop, stream = None, SamplingParams(), [], False
    cache_salt = P.parse_cache_salt(body, _bad)
    opts = CommonOptions(max_tokens=max_tokens, sampling=sampling, stop=stop, stream=stream,
                           cache_salt=cache_salt)
    return MessagesRequest(chat=chat, opts=opts, output=_output_format(body), model=model,
                           cache_point=tr.cache_point(),
                           thinking=thinking in ("enabled", "adaptive"))


def count_tokens_request(body: Any, ctx: RequestContext) -> MessagesRequest:
    """`/v1/messages/count_tokens`: the same request as /v1/messages without `max_tokens` (and
    without the generation options, which do not change the prompt)."""
    return parse_messages_request(body, ctx, generate=False)
