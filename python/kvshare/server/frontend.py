"""The typed seam between an HTTP API and the generation pipeline.

Three chat APIs share one engine: OpenAI chat completions (`app.py`), Anthropic Messages
(`anthropic.py`) and OpenAI Responses (`responses.py`). Each front end does only two things:

1. `parse(body, ctx) -> ChatRequest`: validate the request and translate it into the one chat
   form the pipeline knows (OpenAI-shaped messages and function tools, `protocol.ChatInput`,
   plus sampling options and an output constraint). Because every API lands here, an agent's
   system prompt and tools render to the same tokens through any of them, and its sessions
   attach to each other's cached prefixes.
2. `make_format(...) -> ApiFormat`: turn the engine's events back into that API's response
   object and stream events.

The pipeline (`KVShareServer._run_chat`) renders and tokenizes the chat once
(`EngineClient.chat_prompt` -> `engine.api.RenderedChat`), compiles the constraint, submits, and drives the format. Errors are
`errors.APIError` everywhere (typed, carrying status and code); each front end renders them in
its own error shape (`ApiFormat.error_body` / `FrontEnd.error_body`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvshare.engine.api import FinishEvent, GenerationRequest, RenderedChat, TokenEvent

from . import protocol as P
from .chat_output import OutputRules
from .errors import APIError


# --------------------------------------------------------------------------- engine side

class EngineClient(Protocol):
    """What the server needs from the engine (kvshare.engine.Engine implements it; tests use
    fakes). Optional extras are read with getattr: `vocab_size`, `config` (block_size, max_n,
    parallel), `chat_template`, `model` (fingerprint), `stalled_for()`."""

    model_name: str
    ctx_size: int

    def chat_prompt(self, messages: list[dict], tools: list[dict] | None, *,
                    add_generation_prompt: bool, template_kwargs: dict,
                    cache_after: int | None) -> RenderedChat: ...

    def tokenize(self, text: str, add_special: bool, parse_special: bool) -> list[int]: ...

    def detokenize(self, tokens: list[int]) -> str: ...

    def token_piece(self, token_id: int) -> str: ...

    def submit(self, req: GenerationRequest): ...  # -> engine.handle.RequestHandle

    def snapshot(self) -> dict: ...  # the pool, tiers, counters and live sequences

    def start(self) -> None: ...

    def shutdown(self, timeout: float = 10.0) -> None: ...


# --------------------------------------------------------------------------- API side

@dataclass(frozen=True)
class CachePoint:
    """Where a request marks a cache breakpoint, in message terms (tokens are found when the
    prompt is rendered): `message` is the index into `ChatInput.messages` whose end is the
    breakpoint; -1 means the prefix before the first user message (a breakpoint on the
    tools or the system prompt)."""

    message: int


@dataclass
class ChatRequest:
    """One API request in the pipeline's terms."""

    chat: P.ChatInput | None  # None: a raw prompt (`prompt`), no chat template
    opts: P.CommonOptions
    output: P.OutputConstraint | None = None
    model: str = ""
    cache_point: CachePoint | None = None
    # A raw prompt when `chat` is None: text pieces and token ids in order (llama-server's
    # mixed prompts); the first piece, when text, gets the model's BOS.
    prompt: list[str | int] | None = None
    # False: compute the whole prompt even if cached (llama-server `cache_prompt: false`).
    reuse_cache: bool = True
    # Opaque to the pipeline: what the front end needs again when formatting (e.g. the
    # Responses API's stored conversation and request echo).
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class RequestContext:
    """What a front end may consult while parsing."""

    model_name: str
    ctx_size: int
    vocab_size: int | None
    max_n: int
    tenant: Any = None  # tenancy.Tenant or None (no API keys configured)
    tenant_id: str = ""  # stable identity for binding stored objects (key name, or "")
    # The engine (EngineClient), for front ends that tokenize themselves (e.g. FIM prompts).
    engine: Any = None


@dataclass(frozen=True)
class PromptInfo:
    """What the pipeline learnt about the prompt, handed to the format."""

    n_tokens: int
    cache_point_tokens: int = 0  # block-aligned tokens pinned at the breakpoint (0: none)


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


class ApiFormat:
    """Builds one request's response body and stream events from engine events.

    The pipeline calls, when streaming: `stream_start()`, `stream_token(ev)` per token event,
    `stream_finish(fin)` per choice's FinishEvent, then `stream_end(total)` on success or
    `stream_error(err)` on failure (the status line is gone; the error goes in-band). Not
    streaming: `response(choices, total)` with choices {index: (text, events, FinishEvent)}.
    Every method returns bytes ready to send (SSE) or a JSON-able dict."""

    def __init__(self, rid: str, model: str, opts: P.CommonOptions, rules: OutputRules | None,
                 prompt: PromptInfo):
        self.rid, self.model, self.opts = rid, model, opts
        self.rules = rules or OutputRules()
        self.prompt = prompt

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

    def response(self, choices: dict[int, tuple[str, list[TokenEvent], FinishEvent]],
                 total: FinishEvent) -> dict:
        raise NotImplementedError


class FrontEnd(Protocol):
    """One chat API."""

    endpoint: str  # metrics / request-log label
    id_prefix: str

    def parse(self, body: dict, ctx: RequestContext) -> ChatRequest: ...

    def make_format(self, rid: str, req: ChatRequest, rules: OutputRules | None,
                    prompt: PromptInfo) -> ApiFormat: ...

    def error_body(self, err: APIError) -> dict: ...
