"""The OpenAI Responses API: `POST /v1/responses`, `GET /v1/responses/{id}`,
`DELETE /v1/responses/{id}`.

A front end (`frontend.FrontEnd`): `ResponsesApi.parse` validates a Responses request and
translates it into the one chat form the pipeline knows (OpenAI chat messages and function
tools), and `ResponsesFormat` turns the engine's events back into a `response` object or the
Responses stream (`response.created`, `response.in_progress`, `response.output_item.*`,
`response.content_part.*`, `response.output_text.*`, `response.function_call_arguments.*`,
`response.completed` / `response.incomplete`).

Translation (Responses -> OpenAI chat):

- `instructions` (a string) -> a system message, first. As OpenAI specifies, the instructions
  of a previous response are not carried over: a client re-sends them every turn.
- `input`: a string is one user message. A list holds items:
  `message` items (or items without `type`) with role user / assistant / system / developer
  (developer -> system) and a string or a list of text parts (`input_text`, `output_text`,
  `text`, `refusal`; joined with "\\n"); `function_call` items -> `tool_calls` of an assistant
  message (merged into the assistant message right before them, so a reply of text + calls
  sent back renders as the one message it was); `function_call_output` items -> `tool`
  messages (a `call_id` that no earlier `function_call` of the conversation declared is a 400);
  `reasoning` items are dropped (chat templates drop past reasoning). Images, files, audio and
  any other item type are refused (400) by name.
- `previous_response_id`: the stored conversation of that response (its input and output as
  chat messages, without its instructions) goes between this request's instructions and its
  new input. A response that does not exist, has expired, or belongs to another tenant (API
  key) or `cache_salt` is a 404 `previous_response_not_found` (the same answer for all three).
- `tools`: function tools only (`{"type": "function", "name", "description", "parameters",
  "strict"}`; a chat-completions-shaped `{"type": "function", "function": {...}}` is taken
  too); hosted tools (web_search, file_search, ...) are a 400. `tool_choice` "auto" / "none" /
  "required" / `{"type": "function", "name"}`; `parallel_tool_calls`.
- `text.format`: text / json_object / json_schema -> the output constraint.
- `max_output_tokens` (absent: until the context is full), `temperature` (0-2), `top_p`,
  `stream`, `store` (default true). `metadata`, `user`, `truncation`, `reasoning`, `include`,
  `service_tier`, `prompt_cache_key`, ... are checked loosely and ignored (echoed where the
  response object has them). `background`, `conversation` and `prompt` are refused (400):
  ignoring them would silently answer a different request.
- kvshare extensions: `cache_salt` (a string) as on /v1/chat/completions; it also scopes the
  stored responses (GET / DELETE take it as a query parameter); `chat_template_kwargs`.

Caching: a request that continues a stored response marks the end of the stored conversation
as its cache point (`frontend.CachePoint`), and a stored request without a previous response
marks the end of its input, so the KV of the conversation so far is pinned for the next turn.

Output:

- Items in the order the reply produced them: a `reasoning` item (the model's `<think>` text as
  `content` [{"type": "reasoning_text"}], empty `summary`) when the model reasons, `message`
  items (one `output_text` part each) and `function_call` items (`call_id` = the parser's
  `call_...` id, `id` = `fc_` + the same hex). Text after a call is a new message item.
  Whitespace-only text never makes an item of its own; a reply with no item at all is one
  empty message. The whole (non-streamed) response is built by feeding the same events through
  the same machinery as the stream, so it and the stream's `response.completed` agree item by
  item (ids included).
- `status` "incomplete" with `incomplete_details.reason` "max_output_tokens" when the reply was
  cut by `max_output_tokens` (or the context's end); the last item is then "incomplete" too.
- `usage.input_tokens_details.cached_tokens`: prompt tokens reused from the cache;
  `cache_write_tokens`: tokens up to the cache point this request computed and pinned;
  `output_tokens_details.reasoning_tokens`: the generated tokens that produced reasoning text
  (approximate: a token is counted when it produced reasoning text).
- A failure after the stream began is an `error` event (`ResponseErrorEvent`: type, code,
  message, param, sequence_number), which the openai SDK yields as a typed event and the
  Agents SDK treats as a terminal failure. Errors before it are OpenAI's error body with the
  HTTP status.
- When `store` is true (the default) the response is kept in the `ResponseStore` (for GET,
  DELETE and `previous_response_id`) with its conversation: the request's chat messages
  (without the instructions) plus the reply as an assistant message (text and `tool_calls`,
  with the ids the client saw; reasoning dropped). Streams store at `response.completed`
  (a stream the client left early is not stored).
"""

from __future__ import annotations

import copy
import hashlib
import secrets
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable

from kvshare.engine.api import FinishEvent, SamplingParams, TokenEvent

from . import protocol as P
from .chat_output import ChoiceOutput, OutputRules
from .errors import APIError, bad_request
from .frontend import (ApiFormat, CachePoint, ChatRequest, PromptInfo, RequestContext,
                       sse_event)

DEFAULT_MAX_ITEMS = 10000
ROLES = ("user", "assistant", "system", "developer")
TEXT_PARTS = ("input_text", "output_text", "text")
# Content parts and input items OpenAI defines that this server cannot take: refused by name.
UNSUPPORTED_PARTS = frozenset({"input_image", "input_file", "input_audio"})
UNSUPPORTED_BODY = ("background", "conversation", "prompt")


# --------------------------------------------------------------------------- ownership

def owner_of(ctx: RequestContext, cache_salt: str | None) -> str:
    """Who a stored response belongs to: the tenant (API key) and the request's `cache_salt`
    (its SHA-256, as the KV cache derives it). A response is only visible to the same pair."""
    salt = hashlib.sha256(cache_salt.encode("utf-8")).hexdigest() if cache_salt else ""
    return f"{ctx.tenant_id}:{salt}"


def _owner(ctx: RequestContext, cache_salt: bytes | None) -> str:
    return f"{ctx.tenant_id}:{cache_salt.hex() if cache_salt else ''}"


# --------------------------------------------------------------------------- the store

@dataclass
class ResponseRecord:
    """One stored response: the object as returned to the client, and its conversation as
    OpenAI chat messages (the input without the instructions, plus this response's output as
    an assistant message), with the instructions and tools (Responses shape) it used.

    The message dicts are shared with the records of the responses that continue this one
    (a chain of N turns holds each message once, not N times) and are never mutated."""

    response: dict
    messages: list[dict]
    instructions: str | None = None
    tools: list[dict] | None = None


class ResponseStore:
    """Stored responses in memory, by id. A record is visible only to its owner (`owner_of`):
    an id of another owner reads exactly as an unknown one. Records expire `ttl_s` seconds
    after they were stored (None or 0: never); at most `max_items` are kept (the oldest go
    first). Thread-safe."""

    def __init__(self, ttl_s: float | None = None, max_items: int = DEFAULT_MAX_ITEMS, *,
                 clock: Callable[[], float] = time.monotonic):
        self.ttl_s = ttl_s if ttl_s else None
        self.max_items = max(1, int(max_items))
        self._clock = clock
        self._lock = threading.Lock()
        # id -> (owner, stored at, record); insertion order = age
        self._items: OrderedDict[str, tuple[str, float, ResponseRecord]] = OrderedDict()

    def _expired(self, stored_at: float, now: float) -> bool:
        return self.ttl_s is not None and now - stored_at >= self.ttl_s

    def _prune(self, now: float) -> None:
        while self._items:
            _owner_, at, _rec = next(iter(self._items.values()))
            if not self._expired(at, now):
                break
            self._items.popitem(last=False)

    def put(self, resp_id: str, owner: str, record: ResponseRecord) -> None:
        with self._lock:
            now = self._clock()
            self._items.pop(resp_id, None)
            self._items[resp_id] = (owner, now, record)
            self._prune(now)
            while len(self._items) > self.max_items:
                self._items.popitem(last=False)

    def get(self, resp_id: str, owner: str) -> ResponseRecord | None:
        with self._lock:
            hit = self._items.get(resp_id)
            if hit is None or hit[0] != owner:
                return None
            if self._expired(hit[1], self._clock()):
                del self._items[resp_id]
                return None
            return hit[2]

    def delete(self, resp_id: str, owner: str) -> bool:
        with self._lock:
            hit = self._items.get(resp_id)
            if hit is None or hit[0] != owner:
                return False
            del self._items[resp_id]
            return not self._expired(hit[1], self._clock())

    def __len__(self) -> int:
        with self._lock:
            self._prune(self._clock())
            return len(self._items)


# --------------------------------------------------------------------------- validation helpers

def _type_name(v: Any) -> str:
    return P._json_type(v)


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
        if ptype in TEXT_PARTS:
            texts.append(_str_field(part, "text", ppath, empty_ok=True))
        elif ptype == "refusal":
            texts.append(_str_field(part, "refusal", ppath, empty_ok=True))
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
        call_id = _str_field(item, "call_id", path)
        name = _str_field(item, "name", path)
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
        fn = t.get("function") if isinstance(t.get("function"), dict) and "name" not in t \
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
    parsed = P._parse_tools(chat)  # names, schemas, limits, duplicates, normalization
    echo = [{"type": "function", "name": c["function"]["name"],
             "description": c["function"].get("description"),
             "parameters": c["function"]["parameters"],
             "strict": c["function"].get("strict")} for c in parsed or []]
    return parsed, echo


def _tool_choice(tc: Any, tools: list[dict] | None) -> tuple[str, Any]:
    """(ChatInput.tool_choice, the value the response echoes)."""
    if tc is None:
        return P._parse_tool_choice(None, tools), "auto"
    if isinstance(tc, str):
        return P._parse_tool_choice(tc, tools), tc
    if isinstance(tc, dict) and tc.get("type") == "function":
        name = tc.get("name")
        if name is None and isinstance(tc.get("function"), dict):
            name = tc["function"].get("name")
        if not isinstance(name, str):
            raise bad_request("Missing required parameter: 'tool_choice.name'.",
                              "tool_choice", "missing_required_parameter")
        choice = P._parse_tool_choice({"type": "function", "function": {"name": name}}, tools)
        return choice, {"type": "function", "name": name}
    what = tc.get("type") if isinstance(tc, dict) else _type_name(tc)
    raise bad_request(f"'tool_choice' {what!r} is not supported by this server: use 'auto', "
                      "'none', 'required' or {\"type\": \"function\", \"name\": ...}.",
                      "tool_choice", "invalid_value")


def _text_format(text: Any) -> tuple[P.OutputConstraint | None, dict]:
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
        return P.OutputConstraint("json_object", "", "text.format"), echo
    if ftype == "json_schema":
        name = fmt.get("name")
        if name is not None and not isinstance(name, str):
            raise bad_request("Invalid type for 'text.format.name': expected a string.",
                              "text.format.name", "invalid_type")
        schema = fmt.get("schema")
        constraint = P._schema_constraint({} if schema is None else schema, "text.format.schema")
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


# --------------------------------------------------------------------------- the front end

class ResponsesApi:
    """`/v1/responses` as a front end (frontend.FrontEnd), plus the stored-response routes."""

    endpoint = "responses"
    id_prefix = "resp_"

    def __init__(self, store: ResponseStore | None = None):
        self.store = store if store is not None else ResponseStore()

    # ---- POST /v1/responses
    def parse(self, body: dict, ctx: RequestContext) -> ChatRequest:  # noqa: C901
        if not isinstance(body, dict):
            raise bad_request("the request body must be a JSON object")
        model = P.requested_model(body, ctx.model_name)
        for name in UNSUPPORTED_BODY:
            v = body.get(name)
            if v is not None and v is not False:
                raise bad_request(f"'{name}' is not supported by this server.", name,
                                  "unsupported_parameter")

        # sampling and options ----------------------------------------------------------
        max_tokens = P.get_int(body, "max_output_tokens", lo=1)
        temperature = P.get_float(body, "temperature", None, lo=0.0, hi=2.0)
        top_p = P.get_float(body, "top_p", None, lo=0.0, hi=1.0)
        stream = P.get_bool(body, "stream", False)
        store = P.get_bool(body, "store", True)
        parallel = P.get_bool(body, "parallel_tool_calls", True)
        instructions = P.get_str(body, "instructions")
        prev_id = P.get_str(body, "previous_response_id")
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
        reasoning = _loose(body, "reasoning", (dict,), "an object")
        include = _loose(body, "include", (list,), "an array")
        if include is not None and not all(isinstance(x, str) for x in include):
            raise bad_request("Invalid 'include': expected an array of strings.", "include",
                              "invalid_type")
        salt = body.get("cache_salt")
        cache_salt = None
        if salt is not None:
            if not isinstance(salt, str) or not salt:
                raise bad_request("'cache_salt' must be a non-empty string", "cache_salt")
            cache_salt = hashlib.sha256(salt.encode("utf-8")).digest()
        kwargs = body.get("chat_template_kwargs")
        if kwargs is None:
            kwargs = {}
        if not isinstance(kwargs, dict):
            raise bad_request("'chat_template_kwargs' must be an object", "chat_template_kwargs")
        kwargs = {k: v for k, v in kwargs.items() if k not in ("messages", "tools")}

        # tools and output ----------------------------------------------------------------
        tools, tools_echo = _tools(body.get("tools"))
        tool_choice, tool_choice_echo = _tool_choice(body.get("tool_choice"), tools)
        output, text_echo = _text_format(body.get("text"))

        # the conversation ----------------------------------------------------------------
        owner = _owner(ctx, cache_salt)
        stored: list[dict] = []
        if prev_id is not None:
            rec = self.store.get(prev_id, owner)
            if rec is None:
                raise APIError(404, f"Previous response with id '{prev_id}' not found.",
                               param="previous_response_id",
                               code="previous_response_not_found")
            stored = list(rec.messages)  # the message dicts are shared, never mutated
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
        elif store:
            cache_point = CachePoint(len(messages) - 1)

        chat = P.ChatInput(messages=messages, tools=tools, template_kwargs=kwargs,
                           tool_choice=tool_choice, parallel_tool_calls=parallel)
        opts = P.CommonOptions(
            max_tokens=max_tokens,
            sampling=SamplingParams(temperature=1.0 if temperature is None else temperature,
                                    top_p=1.0 if top_p is None else top_p),
            stream=stream, cache_salt=cache_salt)
        echo = {
            "instructions": instructions, "tools": tools_echo, "tool_choice": tool_choice_echo,
            "parallel_tool_calls": parallel, "text": text_echo,
            "temperature": 1.0 if temperature is None else temperature,
            "top_p": 1.0 if top_p is None else top_p, "max_output_tokens": max_tokens,
            "previous_response_id": prev_id, "store": store,
            "metadata": dict(metadata) if metadata else {}, "user": user,
            "truncation": truncation or "disabled", "reasoning": reasoning,
        }
        extra = {"store": store, "owner": owner, "previous_response_id": prev_id,
                 "echo": echo, "conversation": messages[n_head:],
                 "instructions": instructions, "tools": tools_echo}
        return ChatRequest(chat=chat, opts=opts, output=output, model=model,
                           cache_point=cache_point, extra=extra)

    def make_format(self, rid: str, req: ChatRequest, rules: OutputRules | None,
                    prompt: PromptInfo) -> ApiFormat:
        return ResponsesFormat(rid, req, rules, prompt, self.store)

    def error_body(self, err: APIError) -> dict:
        return err.body()

    # ---- GET / DELETE /v1/responses/{id}
    def get_response(self, resp_id: str, owner: str) -> dict:
        rec = self.store.get(resp_id, owner)
        if rec is None:
            raise _not_found(resp_id)
        return copy.deepcopy(rec.response)

    def delete_response(self, resp_id: str, owner: str) -> dict:
        if not self.store.delete(resp_id, owner):
            raise _not_found(resp_id)
        return {"id": resp_id, "object": "response.deleted", "deleted": True}

    @staticmethod
    def owner_of(ctx: RequestContext, cache_salt: str | None) -> str:
        return owner_of(ctx, cache_salt)


def _not_found(resp_id: str) -> APIError:
    return APIError(404, f"Response with id '{resp_id}' not found.", param=None,
                    code="not_found")


# --------------------------------------------------------------------------- the output

def _hex_of(call_id: str | None) -> str:
    if call_id and call_id.startswith("call_") and len(call_id) > 5:
        return call_id[5:]
    return secrets.token_hex(12)


class _Items:
    """A reply's output items, built from ChoiceOutput deltas as they arrive. Every change is
    returned as Responses stream events (dicts without `sequence_number`); the same object
    gives the final `output` list and the reply as an OpenAI assistant message."""

    def __init__(self) -> None:
        self.items: list[dict] = []  # finished items, in output order
        self._open: dict | None = None  # {"kind", "index", "id", "text", ...}
        self._ws = {"message": "", "reasoning": ""}  # leading blank text held back
        self._calls: dict[int, int] = {}  # ChoiceOutput call index -> output index
        self._n = 0

    # ---- items
    def _start(self, kind: str, **extra: Any) -> tuple[dict, list[dict]]:
        ev = self.close("completed")
        prefix = {"message": "msg_", "reasoning": "rs_", "function_call": "fc_"}[kind]
        item_id = prefix + (extra.pop("hex", None) or secrets.token_hex(12))
        self._open = op = {"kind": kind, "index": self._n, "id": item_id, "text": "", **extra}
        self._n += 1
        ev.append({"type": "response.output_item.added", "output_index": op["index"],
                   "item": self._item(op, "in_progress")})
        if kind == "message":
            ev.append({"type": "response.content_part.added", "item_id": item_id,
                       "output_index": op["index"], "content_index": 0,
                       "part": {"type": "output_text", "text": "", "annotations": []}})
        elif kind == "reasoning":
            ev.append({"type": "response.content_part.added", "item_id": item_id,
                       "output_index": op["index"], "content_index": 0,
                       "part": {"type": "reasoning_text", "text": ""}})
        return op, ev

    @staticmethod
    def _item(op: dict, status: str) -> dict:
        kind, done = op["kind"], status != "in_progress"
        if kind == "message":
            content = [{"type": "output_text", "text": op["text"], "annotations": [],
                        "logprobs": []}] if done else []
            return {"id": op["id"], "type": "message", "status": status, "role": "assistant",
                    "content": content}
        if kind == "reasoning":
            content = [{"type": "reasoning_text", "text": op["text"]}] if done else []
            return {"id": op["id"], "type": "reasoning", "status": status, "summary": [],
                    "content": content}
        return {"id": op["id"], "type": "function_call", "status": status,
                "call_id": op["call_id"], "name": op["name"],
                "arguments": op["text"] if done else ""}

    def close(self, status: str) -> list[dict]:
        op, self._open = self._open, None
        if op is None:
            return []
        idx, iid, text = op["index"], op["id"], op["text"]
        ev: list[dict] = []
        if op["kind"] == "message":
            ev.append({"type": "response.output_text.done", "item_id": iid, "output_index": idx,
                       "content_index": 0, "text": text, "logprobs": []})
            ev.append({"type": "response.content_part.done", "item_id": iid,
                       "output_index": idx, "content_index": 0,
                       "part": {"type": "output_text", "text": text, "annotations": [],
                                "logprobs": []}})
        elif op["kind"] == "reasoning":
            ev.append({"type": "response.reasoning_text.done", "item_id": iid,
                       "output_index": idx, "content_index": 0, "text": text})
            ev.append({"type": "response.content_part.done", "item_id": iid,
                       "output_index": idx, "content_index": 0,
                       "part": {"type": "reasoning_text", "text": text}})
        else:
            ev.append({"type": "response.function_call_arguments.done", "item_id": iid,
                       "output_index": idx, "name": op["name"], "arguments": text})
        item = self._item(op, status)
        self.items.append(item)
        ev.append({"type": "response.output_item.done", "output_index": idx, "item": item})
        return ev

    def _text(self, kind: str, text: str) -> list[dict]:
        ev: list[dict] = []
        op = self._open
        if op is None or op["kind"] != kind:
            if not (self._ws[kind] + text).strip():
                self._ws[kind] += text  # no blank items: wait for real text
                return []
            text, self._ws[kind] = self._ws[kind] + text, ""
            op, ev = self._start(kind)
        op["text"] += text
        if kind == "message":
            ev.append({"type": "response.output_text.delta", "item_id": op["id"],
                       "output_index": op["index"], "content_index": 0, "delta": text,
                       "logprobs": []})
        else:
            ev.append({"type": "response.reasoning_text.delta", "item_id": op["id"],
                       "output_index": op["index"], "content_index": 0, "delta": text})
        return ev

    def feed(self, deltas: list[dict]) -> list[dict]:
        ev: list[dict] = []
        for d in deltas:
            if d.get("reasoning_content"):
                ev += self._text("reasoning", d["reasoning_content"])
            if d.get("content"):
                ev += self._text("message", d["content"])
            for c in d.get("tool_calls") or ():
                i = c.get("index", 0)
                fn = c.get("function") or {}
                if i not in self._calls:
                    self._ws["message"] = ""
                    call_id = c.get("id") or ("call_" + secrets.token_hex(12))
                    op, start = self._start("function_call", hex=_hex_of(call_id),
                                            call_id=call_id, name=fn.get("name") or "")
                    ev += start
                    self._calls[i] = op["index"]
                op = self._open
                args = fn.get("arguments")
                if args and op is not None and op["index"] == self._calls[i]:
                    op["text"] += args
                    ev.append({"type": "response.function_call_arguments.delta",
                               "item_id": op["id"], "output_index": op["index"],
                               "delta": args})
        return ev

    def finish(self, status: str) -> list[dict]:
        """Close the open item with `status`; a reply without any item gets an empty
        message."""
        if self._open is None and not self.items:
            op, ev = self._start("message")
            op["text"] = self._ws["message"]
            if op["text"]:
                ev.append({"type": "response.output_text.delta", "item_id": op["id"],
                           "output_index": op["index"], "content_index": 0,
                           "delta": op["text"], "logprobs": []})
            return ev + self.close(status)
        return self.close(status)

    # ---- results
    def assistant_message(self) -> dict:
        """The reply as an OpenAI chat assistant message (reasoning dropped)."""
        text = "".join(it["content"][0]["text"] for it in self.items if it["type"] == "message")
        msg: dict = {"role": "assistant", "content": text}
        calls = [{"id": it["call_id"], "type": "function",
                  "function": {"name": it["name"], "arguments": it["arguments"]}}
                 for it in self.items if it["type"] == "function_call"]
        if calls:
            msg["tool_calls"] = calls
        return msg


class ResponsesFormat(ApiFormat):
    """One request's `response` object or Responses stream (one choice: no `n`)."""

    def __init__(self, rid: str, req: ChatRequest, rules: OutputRules | None,
                 prompt: PromptInfo, store: ResponseStore | None = None):
        super().__init__(rid, req.model, req.opts, rules, prompt)
        self.req = req
        self.extra = req.extra
        self.echo = req.extra.get("echo") or {}
        self.store = store
        self.created_at = int(time.time())
        self._seq = 0
        self._out = ChoiceOutput(self.rules)
        self._items = _Items()
        self._fin: FinishEvent | None = None
        self._reasoning_tokens = 0

    # ---- the response object
    def _object(self, status: str, output: list[dict], usage: dict | None) -> dict:
        e = self.echo
        return {
            "id": self.rid, "object": "response", "created_at": self.created_at,
            "status": status, "background": False, "error": None,
            "incomplete_details": ({"reason": "max_output_tokens"} if status == "incomplete"
                                   else None),
            "instructions": e.get("instructions"),
            "max_output_tokens": e.get("max_output_tokens"), "max_tool_calls": None,
            "model": self.model, "output": output,
            "parallel_tool_calls": e.get("parallel_tool_calls", True),
            "previous_response_id": e.get("previous_response_id"),
            "reasoning": e.get("reasoning"), "store": e.get("store", True),
            "temperature": e.get("temperature", 1.0),
            "text": e.get("text", {"format": {"type": "text"}}),
            "tool_choice": e.get("tool_choice", "auto"), "tools": e.get("tools", []),
            "top_p": e.get("top_p", 1.0), "truncation": e.get("truncation", "disabled"),
            "usage": usage, "user": e.get("user"), "metadata": e.get("metadata", {}),
            "completed_at": int(time.time()) if status == "completed" else None,
        }

    def _usage(self, total: FinishEvent) -> dict:
        cached = max(0, total.timings.cache_n)
        return {
            "input_tokens": total.prompt_tokens,
            "input_tokens_details": {
                "cached_tokens": cached,
                "cache_write_tokens": max(0, self.prompt.cache_point_tokens - cached)},
            "output_tokens": total.completion_tokens,
            "output_tokens_details": {
                "reasoning_tokens": min(self._reasoning_tokens, total.completion_tokens)},
            "total_tokens": total.prompt_tokens + total.completion_tokens,
        }

    def _complete(self, fin: FinishEvent, total: FinishEvent) -> tuple[dict, list[dict]]:
        """The final response object (stored when `store`) and the closing item events."""
        status = "incomplete" if fin.reason == "length" else "completed"
        events = self._items.finish(status)
        resp = self._object(status, list(self._items.items), self._usage(total))
        if self.store is not None and self.extra.get("store"):
            conv = list(self.extra.get("conversation") or [])
            conv.append(self._items.assistant_message())
            self.store.put(self.rid, self.extra.get("owner", ""), ResponseRecord(
                response=copy.deepcopy(resp), messages=conv,
                instructions=self.extra.get("instructions"), tools=self.extra.get("tools")))
        return resp, events

    def _feed(self, text: str) -> list[dict]:
        deltas = self._out.feed(text)
        if any(d.get("reasoning_content") for d in deltas):
            self._reasoning_tokens += 1
        return self._items.feed(deltas)

    def error_body(self, err: APIError) -> dict:
        return err.body()

    # ---- whole
    def response(self, choices: dict[int, tuple[str, list[TokenEvent], FinishEvent]],
                 total: FinishEvent) -> dict:
        text, events, fin = choices[min(choices)]
        # the same events through the same machinery as a stream: the two agree
        if events and "".join(e.text for e in events) == text:
            for e in events:
                self._feed(e.text)
        else:
            self._reasoning_tokens = 0
            self._items.feed(self._out.feed(text))
        self._items.feed(self._out.finish())
        resp, _events = self._complete(fin, total)
        return resp

    # ---- stream
    def _sse(self, events: list[dict]) -> list[bytes]:
        out = []
        for ev in events:
            ev["sequence_number"] = self._seq
            self._seq += 1
            out.append(sse_event(ev["type"], ev))
        return out

    def stream_start(self) -> list[bytes]:
        start = self._object("in_progress", [], None)
        return self._sse([{"type": "response.created", "response": start},
                          {"type": "response.in_progress", "response": copy.deepcopy(start)}])

    def stream_token(self, ev: TokenEvent) -> list[bytes]:
        if ev.index != 0 or not ev.text:
            return []
        return self._sse(self._feed(ev.text))

    def stream_finish(self, fin: FinishEvent) -> list[bytes]:
        if fin.index != 0 or fin.reason in ("error", "cancelled"):
            return []
        self._fin = fin
        return self._sse(self._items.feed(self._out.finish()))

    def stream_end(self, total: FinishEvent) -> list[bytes]:
        resp, events = self._complete(self._fin or total, total)
        kind = "response.incomplete" if resp["status"] == "incomplete" else "response.completed"
        return self._sse(events + [{"type": kind, "response": resp}])

    def stream_error(self, err: APIError) -> list[bytes]:
        return self._sse([{"type": "error", "code": err.code or err.type,
                           "message": err.message, "param": err.param}])
