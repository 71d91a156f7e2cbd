"""The Anthropic Messages API: `POST /v1/messages` and `POST /v1/messages/count_tokens`.

An `Api` (`apis.base`): `MessagesApi.parse` validates a Messages request and
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

import json
import secrets

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from kvshare.engine.api import FinishEvent, TokenEvent
from kvshare.server.body import read_json
from kvshare.server.errors import APIError
from kvshare.server.pipeline import GenerationPipeline

from .anthropic_request import MessagesRequest, count_tokens_request, parse_messages_request
from .base import ApiFormat, ApiRequest, CommonOptions, PromptInfo, RequestContext, sse_event
from .chat_output import ChoiceOutput, OutputRules

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

    def __init__(self, rid: str, model: str, opts: CommonOptions, rules: OutputRules | None,
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
        """(stop_reason, stop_sequence). A reply cut by max_tokens is `max_tokens` even when
        it holds complete calls (the cut-off one was dropped), as chat's `length`; the
        request log records `tool_calls` for `tool_use`, as for chat."""
        if fin.reason == "length":
            return "max_tokens", None
        if calls:
            self.client_finish_reason = "tool_calls"
            return "tool_use", None
        seq = fin.stop_string
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

    def _open_index(self) -> int:
        assert self._open is not None, "a block was just started"
        return self._open[0]

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
                index = self._open_index()
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
                    index = self._open_index()
                    self._blocks[index]["text"] += text
                    out.append(self._delta(index, {"type": "text_delta", "text": text}))
            for c in d.get("tool_calls") or ():
                i = c.get("index", 0)
                fn = c.get("function") or {}
                if i not in self._calls:
                    self._ws = ""
                    out += self._start({"type": "tool_use", "id": tool_use_id(c.get("id")),
                                        "name": fn.get("name") or "", "input": {}})
                    self._calls[i] = self._open_index()
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
        broken = {self._calls[i] for i in self._out.broken_calls if i in self._calls}
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
    """`/v1/messages` (an `Api`)."""

    endpoint = "messages"
    id_prefix = "msg_"

    def parse(self, body: dict, ctx: RequestContext) -> MessagesRequest:
        return parse_messages_request(body, ctx, generate=True)

    def count_tokens(self, body: dict, ctx: RequestContext) -> MessagesRequest:
        return count_tokens_request(body, ctx)

    def make_format(self, rid: str, req: ApiRequest, rules: OutputRules | None,
                    prompt: PromptInfo) -> ApiFormat:
        thinking = isinstance(req, MessagesRequest) and req.thinking
        return MessagesFormat(rid, req.model, req.opts, rules, prompt, thinking=thinking)

    def error_body(self, err: APIError) -> dict:
        return anthropic_error(err)


async def count_tokens(pipeline: GenerationPipeline, request: Request) -> Response:
    """`/v1/messages/count_tokens`: the prompt's tokens as `/v1/messages` would render them."""
    body = await read_json(request, pipeline.settings)
    req = count_tokens_request(body, pipeline.context(request))
    tokens, _ = await pipeline.request_tokens(request, req)
    return JSONResponse({"input_tokens": len(tokens)})
