"""The OpenAI Responses API: `POST /v1/responses`, `GET /v1/responses/{id}`,
`DELETE /v1/responses/{id}`.

An `Api` (`apis.base`): `ResponsesApi.parse` validates a Responses request and
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
as its cache point (`apis.base.CachePoint`), and a stored request without a previous response
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
import secrets
import time
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from kvshare.engine.api import FinishEvent, TokenEvent
from kvshare.server.errors import APIError
from kvshare.server.pipeline import GenerationPipeline

from .base import ApiFormat, ApiRequest, PromptInfo, RequestContext, sse_event
from .chat_output import ChoiceOutput, OutputRules
from .responses_request import ResponsesRequest, parse_responses_request
from .responses_store import DEFAULT_MAX_ITEMS, ResponseRecord, ResponseStore, owner_of

__all__ = ["DEFAULT_MAX_ITEMS", "ResponseRecord", "ResponseStore", "ResponsesApi",
           "ResponsesFormat", "owner_of"]

# --------------------------------------------------------------------------- the front end

class ResponsesApi:
    """`/v1/responses` (an `Api`), plus the stored-response routes."""

    endpoint = "responses"
    id_prefix = "resp_"

    def __init__(self, store: ResponseStore | None = None):
        self.store = store if store is not None else ResponseStore()

    # ---- POST /v1/responses
    def parse(self, body: dict, ctx: RequestContext) -> ResponsesRequest:
        return parse_responses_request(body, ctx, self.store)

    def make_format(self, rid: str, req: ApiRequest, rules: OutputRules | None,
                    prompt: PromptInfo) -> ApiFormat:
        assert isinstance(req, ResponsesRequest)
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
                cur = self._open
                args = fn.get("arguments")
                if args and cur is not None and cur["index"] == self._calls[i]:
                    cur["text"] += args
                    ev.append({"type": "response.function_call_arguments.delta",
                               "item_id": cur["id"], "output_index": cur["index"],
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

    def __init__(self, rid: str, req: ResponsesRequest, rules: OutputRules | None,
                 prompt: PromptInfo, store: ResponseStore | None = None):
        super().__init__(rid, req.model, req.opts, rules, prompt)
        self.req = req
        self.echo = req.echo
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
        if status == "completed" and any(it["type"] == "function_call"
                                         for it in self._items.items):
            self.client_finish_reason = "tool_calls"  # what the request log records
        resp = self._object(status, list(self._items.items), self._usage(total))
        if self.store is not None and self.req.store:
            conv = list(self.req.conversation)
            conv.append(self._items.assistant_message())
            self.store.put(self.rid, self.req.owner, ResponseRecord(
                response=copy.deepcopy(resp), messages=conv,
                instructions=self.req.instructions, tools=self.req.tools_echo))
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


class StoredResponseEndpoints:
    """`GET` and `DELETE /v1/responses/{response_id}`: a stored response, for its owner only
    (the tenant and the `cache_salt` query parameter)."""

    def __init__(self, pipeline: GenerationPipeline, api: ResponsesApi):
        self.pipeline, self.api = pipeline, api

    def owner(self, request: Request) -> str:
        return owner_of(self.pipeline.context(request), request.query_params.get("cache_salt"))

    async def get(self, request: Request) -> Response:
        return JSONResponse(self.api.get_response(request.path_params["response_id"],
                                                  self.owner(request)))

    async def delete(self, request: Request) -> Response:
        return JSONResponse(self.api.delete_response(request.path_params["response_id"],
                                                     self.owner(request)))
