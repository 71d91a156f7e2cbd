"""The Anthropic Messages API: `POST /v1/messages` and `POST /v1/messages/count_tokens`.

A front end (`frontend.FrontEnd`): `MessagesApi.parse` validates a Messages request and
translates it into the one chat form the pipeline knows (OpenAI-shaped messages and function
tools), and `MessagesFormat` turns the engine's events back into a `message` object or the
Messages stream (`message_start`, `content_block_*`, `message_delta`, `message_stop`).

Translation (Anthropic -> OpenAI chat):

- `system` (a string or text blocks, joined with "\\n") -> one system message, first.
- Consecutive messages of one role are one turn (Anthropic combines them), so their blocks are
  merged before translating. A user turn's blocks become, in order: a user message per run of
  text blocks (joined with "\\n") and a `tool` message per `tool_result` block. An assistant
  turn becomes one assistant message: its text blocks joined, its `tool_use` blocks as
  `tool_calls` (`arguments` = the input as JSON text). `thinking` / `redacted_thinking` blocks
  in the history are dropped (chat templates drop past reasoning; the signature cannot be
  verified here). A final assistant message (text, no tool_use) is a prefill, as in
  Anthropic's API: its turn is left open and the reply continues its text (the response holds
  only the continuation).
- A `tool_result` with `is_error: true` reads "Error: <content>" (the tool message has no error
  flag, and the model should see that the call failed). Its `tool_use_id` must name a
  `tool_use` of an earlier assistant message (400 otherwise; Anthropic asks for the one just
  before, this server for any earlier one).
- `tools` (custom tools only) -> function tools (`input_schema` -> `parameters`; `strict`
  kept, so strict tools get the auto grammar); `tool_choice` auto/any/tool/none ->
  "auto"/"required"/"function:NAME"/"none"; `disable_parallel_tool_use` -> one call at most.
- `cache_control` breakpoints (at most 4): the last one becomes the request's `CachePoint`
  (the OpenAI message holding the marked block; -1 for tools / system).
- Images, documents and server tools are refused (400) by name; unknown fields are ignored.
- A top-level `cache_control` marks the end of the last message (Anthropic: "the last
  cacheable block"). `output_config.format` (json_schema) constrains the reply to the schema.
- kvshare extension: `cache_salt` (a string) as on /v1/chat/completions.

Output:

- Tool calls come back as `tool_use` blocks with ids `toolu_<24 hex>`. Arguments that are not
  a JSON object (never for a call the tool-call parser accepted) are kept under
  `{"_raw": text}` instead of being lost.
- The model's reasoning (`<think>`) comes back as `thinking` blocks (with an empty signature)
  only when the request enables `thinking` (type "enabled" or "adaptive"), as Claude does;
  otherwise it is dropped from the content (its tokens still count in `output_tokens`).
  `thinking.type` "enabled"/"adaptive" also sets the template's `enable_thinking` to true,
  "disabled" sets it to false.
- `stop_reason`: "tool_use" when a call completed (even if max_tokens then cut the reply),
  else "max_tokens", else "stop_sequence" when `FinishEvent.stop_string` is one of the
  request's `stop_sequences` (echoed in `stop_sequence`), else "end_turn".
- Errors: `{"type": "error", "error": {"type", "message"}}`, the type from the HTTP status
  (`error_type`); in a stream, an `error` event.
- Whitespace-only text is never a block (the API refuses such blocks when they are sent back).
- Blocks come in the order the model wrote them (text after a call is a text block after the
  tool_use block), streamed or not: both are read by the same reader (`MessagesFormat`). One
  difference remains: a call cut off inside its arguments (max_tokens) has been announced by
  the time a stream learns it is broken, so the stream keeps its tool_use block (partial input),
  while the whole reply leaves it out; in both its markup follows as text.
- `usage`: the prompt is `input_tokens + cache_creation_input_tokens + cache_read_input_tokens`:
  read = prompt tokens reused from the cache, creation = the tokens up to the breakpoint that
  this request computed and pinned, input = the rest. `message_start` carries the whole prompt
  as `input_tokens` (the cache figures are known at the end); the final `message_delta`
  carries the full usage, which the SDK takes over.
"""

from __future__ import annotations

import hashlib
import json
import math
import secrets
from typing import Any

from kvshare.engine.api import FinishEvent, SamplingParams, TokenEvent

from . import protocol as P
from .chat_output import ChoiceOutput, OutputRules
from .errors import APIError, bad_request
from .frontend import (ApiFormat, CachePoint, ChatRequest, PromptInfo, RequestContext,
                       sse_event)

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
ERROR_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 402: "billing_error",
    403: "permission_error", 404: "not_found_error", 409: "conflict_error",
    413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
    503: "overloaded_error", 504: "timeout_error", 529: "overloaded_error",
}


def error_type(status: int) -> str:
    """Anthropic's `error.type` for an HTTP status (other 4xx: invalid_request_error, other
    5xx: api_error)."""
    t = ERROR_TYPES.get(status)
    if t is not None:
        return t
    return "api_error" if status >= 500 else "invalid_request_error"


def anthropic_error(err: APIError) -> dict:
    """`{"type": "error", "error": {"type": ..., "message": ...}}`."""
    return {"type": "error", "error": {"type": error_type(err.status), "message": err.message}}


# --------------------------------------------------------------------------- validation helpers

def _bad(path: str, message: str) -> APIError:
    """A 400 worded as Anthropic words them ("messages.0.content: ...")."""
    return bad_request(f"{path}: {message}", path.split(".")[0])


def _type_name(v: Any) -> str:
    return P._json_type(v)


def _int(body: dict, name: str, *, lo: int, required: bool = False) -> int | None:
    v = body.get(name)
    if v is None:
        if required:
            raise _bad(name, "Field required")
        return None
    if isinstance(v, float) and v.is_integer() and math.isfinite(v):
        v = int(v)
    if not P._is_int(v):
        raise _bad(name, f"Input should be a valid integer, got {_type_name(v)}")
    if v < lo:
        raise _bad(name, f"Input should be greater than or equal to {lo}")
    return v


def _number(body: dict, name: str, default: float, lo: float, hi: float) -> float:
    v = body.get(name)
    if v is None:
        return default
    if not P._is_number(v) or not math.isfinite(v):
        raise _bad(name, f"Input should be a valid number, got {_type_name(v)}")
    if v < lo:
        raise _bad(name, f"Input should be greater than or equal to {lo:g}")
    if v > hi:
        raise _bad(name, f"Input should be less than or equal to {hi:g}")
    return float(v)


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
            path = f"messages.{i}"
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
                blocks = [({"type": "text", "text": content}, f"{path}.content")]
            elif isinstance(content, list):
                if not content and role == "user":
                    raise _bad(f"{path}.content", "a user message needs at least one content "
                                                  "block")
                blocks = [(b, f"{path}.content.{j}") for j, b in enumerate(content)]
            elif content is None:
                raise _bad(f"{path}.content", "Field required")
            else:
                raise _bad(f"{path}.content", f"Input should be a string or a list of content "
                                              f"blocks, got {_type_name(content)}")
            if turns and turns[-1][0] == role:
                turns[-1][1].extend(blocks)  # consecutive turns of one role are one turn
            else:
                turns.append((role, blocks))
        for role, blocks in turns:
            if role == "user":
                self._user(blocks)
            else:
                self._assistant(blocks)

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
            if not name or len(name) > 64 or not set(name) <= P._TOOL_NAME_CHARS:
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
        return P._parse_tools(out)  # count limit, duplicate names, normalization

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


def _output_format(body: dict) -> P.OutputConstraint | None:
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
    return P._schema_constraint(schema, "output_config.format.schema")


def _parse(body: Any, ctx: RequestContext, *, generate: bool) -> ChatRequest:
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
    chat = P.ChatInput(messages=tr.out, tools=tools, template_kwargs=kwargs,
                       tool_choice=tool_choice, parallel_tool_calls=parallel,
                       continue_final=prefill)

    if generate:
        max_tokens = _int(body, "max_tokens", lo=1, required=True)
        sampling = SamplingParams(
            temperature=_number(body, "temperature", 1.0, 0.0, 1.0),
            top_p=_number(body, "top_p", 1.0, 0.0, 1.0),
            top_k=_int(body, "top_k", lo=0) or 0)
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
    salt = body.get("cache_salt")
    cache_salt = None
    if salt is not None:
        if not isinstance(salt, str) or not salt:
            raise _bad("cache_salt", "Input should be a non-empty string")
        cache_salt = hashlib.sha256(salt.encode("utf-8")).digest()
    opts = P.CommonOptions(max_tokens=max_tokens, sampling=sampling, stop=stop, stream=stream,
                           cache_salt=cache_salt)
    extra = {"tool_names": [t["function"]["name"] for t in tools or []],
             "thinking": thinking in ("enabled", "adaptive")}
    return ChatRequest(chat=chat, opts=opts, output=_output_format(body), model=model,
                       cache_point=tr.cache_point(), extra=extra)


def count_tokens_request(body: Any, ctx: RequestContext) -> ChatRequest:
    """`/v1/messages/count_tokens`: the same request as /v1/messages without `max_tokens` (and
    without the generation options, which do not change the prompt)."""
    return _parse(body, ctx, generate=False)


# --------------------------------------------------------------------------- the output

def tool_use_id(openai_id: str | None) -> str:
    """`toolu_` + the 24 hex digits of the parser's `call_...` id (a fresh one otherwise)."""
    if openai_id and openai_id.startswith("call_") and len(openai_id) > 5:
        return "toolu_" + openai_id[5:]
    return "toolu_" + secrets.token_hex(12)


def tool_input(arguments: str | None) -> dict:
    """A call's `input` object from its JSON arguments text (see the module docstring)."""
    raw = arguments or ""
    if not raw.strip():
        return {}
    try:
        v = json.loads(raw)
    except ValueError:
        return {"_raw": raw}
    if isinstance(v, str):  # double-encoded arguments
        try:
            v2 = json.loads(v)
        except ValueError:
            v2 = None
        if isinstance(v2, dict):
            return v2
    return v if isinstance(v, dict) else {"_raw": raw}


def usage(total: FinishEvent, prompt: PromptInfo) -> dict:
    read = max(0, total.timings.cache_n)
    creation = max(0, prompt.cache_point_tokens - read)
    inp = total.prompt_tokens - read - creation
    if inp < 0:
        creation, inp = max(0, creation + inp), 0
    return {"input_tokens": inp, "output_tokens": total.completion_tokens,
            "cache_creation_input_tokens": creation, "cache_read_input_tokens": read}


class MessagesFormat(ApiFormat):
    """One request's `message` object or Messages stream (one choice: Anthropic has no `n`).

    Both are built by one reader of the reply (`_events`: `ChoiceOutput` deltas -> content
    blocks), fed token by token when streaming and the whole text at once otherwise, so a
    streamed reply and the whole one have the same blocks in the same order (ChoiceOutput
    decides from the text so far, never from where a chunk ended)."""

    def __init__(self, rid: str, model: str, opts: P.CommonOptions, rules: OutputRules | None,
                 prompt: PromptInfo, *, thinking: bool = False):
        super().__init__(rid, model, opts, rules, prompt)
        self.thinking = thinking
        self._out = ChoiceOutput(self.rules)
        self._blocks: list[dict] = []  # the content so far (tool_use: "input" filled at the end)
        self._args: dict[int, str] = {}  # block index -> a tool_use's arguments text so far
        self._open: tuple[int, str] | None = None  # (index, type) of the open block
        self._calls: dict[int, int] = {}  # OpenAI call index -> block index
        self._ws = ""  # leading whitespace of a text run, held until non-blank text
        self._fin: FinishEvent | None = None

    # ---- common
    def stop(self, fin: FinishEvent, calls: bool) -> tuple[str, str | None]:
        """(stop_reason, stop_sequence)."""
        if calls:
            return "tool_use", None
        if fin.reason == "length":
            return "max_tokens", None
        seq = getattr(fin, "stop_string", None)
        if seq and seq in self.opts.stop:
            return "stop_sequence", seq
        return "end_turn", None

    def _message(self, content: list, stop_reason: str | None, stop_sequence: str | None,
                 use: dict) -> dict:
        return {"id": self.rid, "type": "message", "role": "assistant", "model": self.model,
                "content": content, "stop_reason": stop_reason,
                "stop_sequence": stop_sequence, "usage": use}

    def error_body(self, err: APIError) -> dict:
        return anthropic_error(err)

    # ---- the reader: ChoiceOutput deltas -> blocks (and their stream events)
    def _close(self) -> list[bytes]:
        if self._open is None:
            return []
        index = self._open[0]
        self._open = None
        return [sse_event("content_block_stop", {"type": "content_block_stop", "index": index})]

    def _start(self, block: dict) -> list[bytes]:
        out = self._close()
        index = len(self._blocks)
        self._blocks.append(dict(block))
        self._open = (index, block["type"])
        out.append(sse_event("content_block_start", {"type": "content_block_start",
                                                     "index": index, "content_block": block}))
        return out

    @staticmethod
    def _delta(index: int, delta: dict) -> bytes:
        return sse_event("content_block_delta", {"type": "content_block_delta", "index": index,
                                                 "delta": delta})

    def _events(self, deltas: list[dict]) -> list[bytes]:
        out: list[bytes] = []
        for d in deltas:
            r = d.get("reasoning_content")
            if r and self.thinking:
                if self._open is None or self._open[1] != "thinking":
                    out += self._start({"type": "thinking", "thinking": "", "signature": ""})
                index = self._open[0]
                self._blocks[index]["thinking"] += r
                out.append(self._delta(index, {"type": "thinking_delta", "thinking": r}))
            text = d.get("content")
            if text:
                if self._open is None or self._open[1] != "text":
                    if not (self._ws + text).strip():
                        self._ws += text  # no blank text blocks: wait for real text
                        text = ""
                    else:
                        text, self._ws = self._ws + text, ""
                        out += self._start({"type": "text", "text": ""})
                if text:
                    index = self._open[0]
                    self._blocks[index]["text"] += text
                    out.append(self._delta(index, {"type": "text_delta", "text": text}))
            for c in d.get("tool_calls") or ():
                i = c.get("index", 0)
                fn = c.get("function") or {}
                if i not in self._calls:
                    self._ws = ""
                    out += self._start({"type": "tool_use", "id": tool_use_id(c.get("id")),
                                        "name": fn.get("name") or "", "input": {}})
                    self._calls[i] = self._open[0]
                    self._args[self._calls[i]] = ""
                args = fn.get("arguments")
                if args:
                    self._args[self._calls[i]] += args
                    out.append(self._delta(self._calls[i], {"type": "input_json_delta",
                                                            "partial_json": args}))
        return out

    # ---- whole
    def response(self, choices: dict[int, tuple[str, list[TokenEvent], FinishEvent]],
                 total: FinishEvent) -> dict:
        text, _events, fin = choices[min(choices)]
        self._events(self._out.feed(text))
        self._events(self._out.finish())
        # calls announced in a block that then broke (cut off by max_tokens): their markup
        # follows as text; a stream had already sent them (see the module docstring)
        reader = getattr(self._out, "_tools", None)
        broken = {self._calls[i] for i in getattr(reader, "broken_calls", ()) if i in self._calls}
        content: list[dict] = []
        for index, block in enumerate(self._blocks):
            if block["type"] == "tool_use":
                raw = self._args.get(index, "")
                try:
                    json.loads(raw or "{}")
                except ValueError:
                    broken.add(index)
                if index in broken:
                    continue
                block["input"] = tool_input(raw)
            elif content and block["type"] == content[-1]["type"] == "text":
                content[-1]["text"] += block["text"]  # they were split by a dropped call
                continue
            content.append(block)
        reason, seq = self.stop(fin, self._out.has_calls)
        return self._message(content, reason, seq, usage(total, self.prompt))

    # ---- stream
    def stream_start(self) -> list[bytes]:
        start = self._message([], None, None, {
            "input_tokens": self.prompt.n_tokens, "output_tokens": 0,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0})
        return [sse_event("message_start", {"type": "message_start", "message": start}),
                sse_event("ping", {"type": "ping"})]

    def stream_token(self, ev: TokenEvent) -> list[bytes]:
        if ev.index != 0 or not ev.text:
            return []
        return self._events(self._out.feed(ev.text))

    def stream_finish(self, fin: FinishEvent) -> list[bytes]:
        if fin.index != 0 or fin.reason in ("error", "cancelled"):
            return []
        self._fin = fin
        return self._events(self._out.finish())

    def stream_end(self, total: FinishEvent) -> list[bytes]:
        out = self._close()
        reason, seq = self.stop(self._fin or total, self._out.has_calls)
        out.append(sse_event("message_delta", {
            "type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": seq},
            "usage": usage(total, self.prompt)}))
        out.append(sse_event("message_stop", {"type": "message_stop"}))
        return out

    def stream_error(self, err: APIError) -> list[bytes]:
        return [sse_event("error", anthropic_error(err))]


class MessagesApi:
    """`/v1/messages` as a front end (frontend.FrontEnd)."""

    endpoint = "messages"
    id_prefix = "msg_"

    def parse(self, body: dict, ctx: RequestContext) -> ChatRequest:
        return _parse(body, ctx, generate=True)

    def count_tokens(self, body: dict, ctx: RequestContext) -> ChatRequest:
        return count_tokens_request(body, ctx)

    def make_format(self, rid: str, req: ChatRequest, rules: OutputRules | None,
                    prompt: PromptInfo) -> ApiFormat:
        return MessagesFormat(rid, req.model, req.opts, rules, prompt,
                              thinking=bool(req.extra.get("thinking")))

    def error_body(self, err: APIError) -> dict:
        return anthropic_error(err)
