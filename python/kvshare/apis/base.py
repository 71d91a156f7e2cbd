"""The typed seam between an API and the generation pipeline (`kvshare.server.pipeline`).

Every API (one module each in this package) does two things:

1. `parse(body, ctx) -> ApiRequest`: validate the request and translate it into the one form
   the pipeline knows: a chat (OpenAI-shaped messages and function tools, `ChatInput`) or a raw
   prompt, plus `CommonOptions` (sampling, stop, stream, ...) and an output constraint. Because
   every API lands here, an agent's system prompt and tools render to the same tokens through
   any of them, and its sessions attach to each other's cached prefixes. An API that needs
   more of its request back when it answers subclasses `ApiRequest` with typed fields.
2. `make_format(rid, req, rules, prompt) -> ApiFormat`: turn the engine's events back into
   that API's response object and stream events.

The pipeline settles what is the same for every API (the model's defaults, the tenant's cache
salt, `max_tokens`, BOS, the output constraint, the cache hints), renders and tokenizes once,
submits, and drives the format. Errors are `server.errors.APIError` everywhere (typed, carrying
status and code); each API renders them in its own error shape (`Api.error_body`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Protocol

from kvshare.engine.api import FinishEvent, SamplingParams, TokenEvent
from kvshare.server.errors import APIError

from .chat_output import OutputRules

# --------------------------------------------------------------------------- the request


@dataclass
class CommonOptions:
    """Generation options every API sets (each with its own names and defaults)."""

    max_tokens: int | None  # None: the server's default (`--n-predict`), else until ctx is full
    sampling: SamplingParams
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    cache_salt: str | None = None  # the request's `cache_salt` (hashed by the pipeline)
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    # logprobs from the distribution after the sampler chain (llama-server's
    # `post_sampling_probs`), not the model's raw one
    post_sampling_probs: bool = False
    n: int = 1  # choices


@dataclass
class ChatInput:
    messages: list[dict]
    tools: list[dict] | None
    template_kwargs: dict
    # "none", "auto", "required", or "function:<name>" of the one function the model must call
    tool_choice: str = "auto"
    parallel_tool_calls: bool = True
    # llama-server's reasoning_format: "none" keeps <think>...</think> in content; "auto" /
    # "deepseek" split it into reasoning_content when the template thinks
    reasoning_format: str = "auto"
    # The prompt continues the last (assistant) message instead of opening a new turn:
    # llama-server's assistant prefill, vLLM's `continue_final_message`.
    continue_final: bool = False
    # llama-server's reasoning budget: tokens a thinking block may take before its end is
    # forced (`reasoning_budget_tokens`, `thinking_budget_tokens`; -1: the server's
    # --reasoning-budget), and the text forced before the end tag (None: the server's).
    reasoning_budget: int = -1
    reasoning_budget_message: str | None = None


@dataclass(frozen=True)
class OutputConstraint:
    """What a request forces the output to be (compiled into a grammar for the engine):
    kind is "json_schema" (source: the schema as JSON text), "json_object", "lark" or
    "gbnf"; `param` names the request field it came from (for errors)."""

    kind: str
    source: str
    param: str


@dataclass(frozen=True)
class CachePoint:
    """Where a request marks a cache breakpoint, in message terms (tokens are found when the
    prompt is rendered): `message` is the index into `ChatInput.messages` whose end is the
    breakpoint; -1 means the prefix before the first user message (a breakpoint on the
    tools or the system prompt)."""

    message: int


@dataclass
class ApiRequest:
    """One API request in the pipeline's terms."""

    chat: ChatInput | None  # None: a raw prompt (`prompt`), no chat template
    opts: CommonOptions
    output: OutputConstraint | None = None
    model: str = ""
    cache_point: CachePoint | None = None
    # A raw prompt when `chat` is None: text pieces and token ids in order (llama-server's
    # mixed prompts); the first piece, when text, gets the model's BOS.
    prompt: list[str | int] | None = None
    # False: compute the whole prompt even if cached (llama-server `cache_prompt: false`).
    reuse_cache: bool = True
    # llama-server's `id_slot`: the slot the request prefers (-1: any), and the settings its
    # slot shows in `GET /slots` (None: derived from the engine request).
    id_slot: int = -1
    slot_params: dict | None = None
    # llama-server's `n_keep` / `n_discard` (context shift; None: the server's --keep).
    n_keep: int | None = None
    n_discard: int = 0


@dataclass(frozen=True)
class RequestContext:
    """What an API may consult while parsing."""

    model_name: str
    ctx_size: int
    vocab_size: int | None
    max_n: int
    tenant: Any = None  # tenancy.Tenant or None (no API keys configured)
    tenant_id: str = ""  # stable identity for binding stored objects (key name, or "")
    # The server's sampling defaults (llama-server's --temp, --top-k, ...) by SamplingParams
    # name: what a request that leaves a field out gets (apis/sampling_fields.py).
    sampling_defaults: Mapping[str, float | int] = field(default_factory=dict)
    # llama-server's --keep: n_keep of a request that gives none.
    n_keep: int = 0


@dataclass(frozen=True)
class PromptInfo:
    """What the pipeline learnt about the prompt, handed to the format."""

    n_tokens: int
    cache_point_tokens: int = 0  # block-aligned tokens pinned at the breakpoint (0: none)
    tokens: tuple[int, ...] = ()  # the prompt's token ids
    # llama-server's slot the request holds now (-1: none, or still waiting for one)
    slot_of: Callable[[], int] = field(default=lambda: -1)


# --------------------------------------------------------------------------- the answer

def json_bytes(obj: Any) -> bytes:
    """What JSONResponse would send (built off the event loop for large responses)."""
    return json.dumps(obj, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()


def sse_data(obj: Any) -> bytes:
    """`data: {json}` (OpenAI chat/completions framing)."""
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


def sse_event(name: str, obj: Any) -> bytes:
    """`event: name` + `data: {json}` (Anthropic and Responses framing)."""
    return (b"event: " + name.encode() + b"\ndata: "
            + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n")


Choices = dict[int, tuple[str, list[TokenEvent], FinishEvent]]


class ApiFormat:
    """Builds one request's response body and stream events from engine events.

    The pipeline calls, when streaming: `stream_start()`, `stream_token(ev)` per token event,
    `stream_finish(fin)` per choice's FinishEvent, then `stream_end(total)` on success or
    `stream_error(err)` on failure (the status line is gone; the error goes in-band). Not
    streaming: `response(choices, total)` with choices {index: (text, events, FinishEvent)}.
    Every method returns bytes ready to send (SSE) or a JSON-able dict.

    `watch(ev)` sees every token event first; a format that ends a generation early on what
    it sees (llama-server's `n_indent`, `t_max_predict_ms`) sets `stop_requested`: the
    pipeline cancels the request and reports the end as reaching the limit."""

    stop_requested = False
    # The finish reason the client was told, when the API's differs from the engine's (e.g.
    # "tool_calls"); the request log records it.
    client_finish_reason: str | None = None

    def __init__(self, rid: str, model: str, opts: CommonOptions, rules: OutputRules | None,
                 prompt: PromptInfo):
        self.rid, self.model, self.opts = rid, model, opts
        self.rules = rules or OutputRules()
        self.prompt = prompt

    def watch(self, ev: TokenEvent) -> None:
        """See a token event before it is formatted (does nothing by default)."""

    def stream_start(self) -> list[bytes]:
        return []

    def stream_token(self, ev: TokenEvent) -> list[bytes]:
        raise NotImplementedError

    def stream_finish(self, fin: FinishEvent) -> list[bytes]:
        return []

    def stream_end(self, total: FinishEvent) -> list[bytes]:
        raise NotImplementedError

    def stream_error(self, err: APIError) -> list[bytes]:
        raise NotImplementedError

    def response(self, choices: Choices, total: FinishEvent) -> dict:
        raise NotImplementedError


class Api(Protocol):
    """One generation API: its request parser, response format and error shape."""

    endpoint: str  # metrics / request-log label
    id_prefix: str

    def parse(self, body: dict, ctx: RequestContext) -> ApiRequest: ...

    def make_format(self, rid: str, req: ApiRequest, rules: OutputRules | None,
                    prompt: PromptInfo) -> ApiFormat: ...

    def error_body(self, err: APIError) -> dict: ...
