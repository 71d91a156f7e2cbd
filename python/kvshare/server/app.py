"""The Starlette application: kvshare's HTTP server over an `Engine`.

`KVShareServer._generate` is the one generation pipeline every chat API's front end
(`frontend.FrontEnd`: openai_api.py, anthropic.py, responses.py, llama_native.py) runs
through; the rest are the small endpoints (models, health, metrics, tokenize, slots, props).

`create_app(engine, settings)` builds the app; its lifespan starts the engine and shuts it down.
The app only talks to the engine through the contract in `kvshare.engine.api` plus the engine's
tokenizer/template methods, so it can be tested against a fake engine.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from typing import Any, AsyncIterator, Callable

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from kvshare.engine.api import (FinishEvent, GenerationRequest, RenderedChat, RequestRejected,
                               SamplingParams, TokenEvent)
from kvshare.engine.faults import HEADER as FAULT_HEADER
from kvshare.engine.faults import injection_enabled

from kvshare.toolcalls import prompt_opens_reasoning

from . import limits
from . import protocol as P
from .constraints import ToolCalls, compile_constraint, request_constraint
from .errors import HTTP_CODES, APIError, bad_request, error_body
from .anthropic import MessagesApi, count_tokens_request
from .frontend import (ApiFormat, CachePoint, ChatRequest, EngineClient, FrontEnd, PromptInfo,
                       RequestContext, json_bytes)
from .openai_api import ChatCompletionsApi, CompletionFormat
from . import llama_native as N
from .responses import ResponsesApi, ResponseStore, owner_of
from .limits import read_json
from .cors import CORSMiddleware, CORSPolicy
from .metrics import ServerMetrics
from .settings import ServerSettings
from .tenancy import KeyRing, Tenant, TenantMetrics, build_tenancy

log = logging.getLogger("kvshare.server")
request_log = logging.getLogger("kvshare.server.requests")

OPEN_PATHS = frozenset({"/health", "/v1/health"})
# /health answers 503 while one engine step has run longer than this (a hung read or device).
STALL_LIMIT_S = 60.0
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


# --------------------------------------------------------------------------- middleware

def route_path(scope: Scope) -> str:
    """The path the router sees: `path` minus `root_path` when the proxy left the prefix on."""
    path, root = scope.get("path", ""), scope.get("root_path", "")
    if root and path.startswith(root) and (len(path) == len(root) or path[len(root)] == "/"):
        return path[len(root):] or "/"
    return path


_ANTHROPIC_PATHS = frozenset({"/v1/messages", "/messages", "/v1/messages/count_tokens",
                              "/messages/count_tokens"})
_ANTHROPIC_ERRORS = MessagesApi()


def is_anthropic_path(path: str) -> bool:
    return path.rstrip("/") in _ANTHROPIC_PATHS


# llama-server's own endpoints: its error shape ({"error": {"code", "message", "type"}})
# (GET /slots keeps kvshare's OpenAI-shaped 401, as before it took llama-server's shape)
_NATIVE_PATHS = frozenset({"/completion", "/completions", "/infill", "/props",
                           "/apply-template"})


def is_native_path(path: str) -> bool:
    p = path.rstrip("/")
    return p in _NATIVE_PATHS or p.startswith("/slots/")


def error_json(path: str, err: APIError) -> dict:
    """An error body in the shape the API at `path` uses (Anthropic's on /v1/messages,
    llama-server's on its native endpoints, OpenAI's elsewhere)."""
    if is_anthropic_path(path):
        return _ANTHROPIC_ERRORS.error_body(err)
    return N.llama_error_body(err) if is_native_path(path) else err.body()


class RootPathMiddleware:
    """Sets `scope["root_path"]` when the server did not (e.g. a test client)."""

    def __init__(self, app: ASGIApp, root_path: str):
        self.app, self.root_path = app, root_path.rstrip("/")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket") and not scope.get("root_path"):
            scope = dict(scope, root_path=self.root_path)
        await self.app(scope, receive, send)


class AuthMiddleware:
    """Bearer-token auth on everything except /health. The key that matched names the tenant,
    passed on as `scope["state"]["tenant"]` (a `tenancy.Tenant`)."""

    def __init__(self, app: ASGIApp, keys: KeyRing):
        self.app, self.keys = app, keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or route_path(scope) in OPEN_PATHS:
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        given = None
        auth = headers.get(b"authorization")
        if auth is not None:
            scheme, _, value = auth.partition(b" ")
            if scheme.lower() == b"bearer":
                given = value.strip()
        if given is None:
            given = headers.get(b"x-api-key")
        tenant = self.keys.match(given) if given is not None else None
        if tenant is not None:
            state = dict(scope.get("state") or {}, tenant=tenant)
            return await self.app(dict(scope, state=state), receive, send)
        msg = ("Missing API key: send 'Authorization: Bearer <key>'" if given is None
               else "Invalid API key")
        err = APIError(401, msg, code="invalid_api_key", type="authentication_error"
                       if is_anthropic_path(route_path(scope)) else None)
        resp = JSONResponse(error_json(route_path(scope), err), status_code=401,
                            headers={"WWW-Authenticate": "Bearer"})
        await resp(scope, receive, send)


# --------------------------------------------------------------------------- request records

@dataclass
class RequestRecord:
    """What one completion request did; logged as one JSON line and counted in metrics."""

    id: str
    endpoint: str
    t0: float = field(default_factory=time.perf_counter)
    stream: bool = False
    status: int = 200
    prompt_tokens: int | None = None
    finish: FinishEvent | None = None
    error: str | None = None
    done: bool = False
    tenant: str | None = None  # tenancy.Tenant.name (never the key)

    def as_log(self) -> dict:
        d: dict[str, Any] = {"id": self.id, "endpoint": self.endpoint, "status": self.status,
                             "stream": self.stream, "prompt_tokens": self.prompt_tokens}
        if self.tenant is not None:
            d["tenant"] = self.tenant
        f = self.finish
        if f is not None:
            d.update(prompt_tokens=f.prompt_tokens, cache_n=f.timings.cache_n,
                     prompt_n=f.timings.prompt_n, completion_tokens=f.completion_tokens,
                     finish_reason=f.reason, ttft_ms=round(f.time_to_first_token_s * 1e3, 2),
                     prompt_ms=round(f.timings.prompt_ms, 2),
                     restore_ms=round(f.timings.restore_ms, 2),
                     predicted_ms=round(f.timings.predicted_ms, 2))
        d["duration_ms"] = round((time.perf_counter() - self.t0) * 1e3, 2)
        if self.error:
            d["error"] = self.error
        return d


# --------------------------------------------------------------------------- body reading
# `read_json` (size limit, body timeout, body budget, JSON value cap, lone surrogates) lives in
# limits.py with the other edge limits.


class SSEResponse(StreamingResponse):
    """A StreamingResponse that runs `on_close` however the response ends, even when the
    client disconnects before the body iterator was ever started."""

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], None]):
        super().__init__(content, media_type="text/event-stream", headers=SSE_HEADERS)
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        except (OSError, ClientDisconnect):
            pass
        finally:
            self.on_close()


# --------------------------------------------------------------------------- the server

def _early_stop(fmt: ApiFormat, ev: FinishEvent) -> FinishEvent:
    """The cancellation a format asked for (`stop_requested`: llama-server's n_indent,
    t_max_predict_ms) is a normal end at the limit."""
    if ev.reason == "cancelled" and getattr(fmt, "stop_requested", False):
        return replace(ev, reason="length")
    return ev


def _system_fingerprint(engine) -> str:
    """`system_fingerprint` of OpenAI responses: kvshare's version and the model weights'
    fingerprint (what decides the outputs), e.g. "kvshare-0.1.0-3f2a9c1b"."""
    try:
        from kvshare import __version__ as version
    except ImportError:  # pragma: no cover - a build without the extension
        version = "unknown"
    fp = None
    try:
        fp = getattr(getattr(engine, "model", None), "fingerprint", None)
    except Exception:  # noqa: BLE001 - a model without a file (tests)
        fp = None
    return f"kvshare-{version}" + (f"-{fp[:8]}" if isinstance(fp, str) and fp else "")


class KVShareServer:
    def __init__(self, engine: EngineClient, settings: ServerSettings):
        self.engine = engine
        self.settings = settings
        self.metrics = ServerMetrics(engine)
        self.shutting_down = False
        self.started = int(time.time())
        self.active: dict[str, Any] = {}  # request id -> RequestHandle
        self.bounds = limits.PromptBounds(engine)  # prompts too long to fit, untokenized
        self.edge = limits.EdgeLimits.from_settings(settings)
        # cache scope, API keys, public prefixes (tokenized here; TenancyError when bad)
        self.tenancy = build_tenancy(
            settings, lambda text: self.engine.tokenize(text, True, True),
            lambda chat: self._chat_tokens(chat)[0])
        self.tenant_metrics = TenantMetrics(self.metrics.registry, self.tenancy.keyring)
        self.fault_injection = injection_enabled()  # tests only: honour X-Kvshare-Fault
        self.max_n = getattr(getattr(engine, "config", None), "max_n", 8)
        # the chat APIs (frontend.FrontEnd): one pipeline, three request and response shapes
        self.response_store = ResponseStore(ttl_s=settings.response_ttl_s)
        self.system_fingerprint = _system_fingerprint(engine)
        self.apis: dict[str, FrontEnd] = {
            "chat": ChatCompletionsApi(getattr(settings, "reasoning_format", None),
                                       self.system_fingerprint),
            "messages": MessagesApi(), "responses": ResponsesApi(self.response_store),
            # llama-server's native /completion and /infill (llama_native.py)
            "completion": N.NativeCompletionApi(settings), "infill": N.InfillApi(settings)}
        # llama-server's slots, emulated over the shared pool (llama_native.SlotTable)
        parallel = getattr(getattr(engine, "config", None), "parallel", 0)
        self.slot_table = N.SlotTable(parallel if isinstance(parallel, int) else 0)
        # the model's tool-call format (kvshare.toolcalls); None for an engine without a
        # chat template (test fakes)
        template = getattr(engine, "chat_template", None)
        self.tool_calls = (ToolCalls(getattr(template, "source", None), settings.tool_parser)
                           if template is not None or settings.tool_parser else None)

    # ------------------------------------------------------------------ lifecycle
    def begin_shutdown(self) -> None:
        """Refuse new completions (503) and report unhealthy; in-flight ones go on."""
        self.shutting_down = True

    def cancel_all(self) -> None:
        """Cancel every in-flight generation (their streams end with an error event)."""
        for handle in list(self.active.values()):
            handle.cancel()

    # ------------------------------------------------------------------ helpers
    @property
    def vocab_size(self) -> int | None:
        v = getattr(self.engine, "vocab_size", None)
        return v if isinstance(v, int) else None

    def _opens_reasoning(self, tokens: list[int]) -> bool:
        """Whether the prompt ends inside a <think> block the template opened (the reply
        starts with reasoning)."""
        if self.tool_calls is None or not self.tool_calls.thinking:
            return False
        return prompt_opens_reasoning(self.engine.detokenize(tokens[-8:]))

    def _render_chat(self, chat: P.ChatInput, body_bytes: int,
                     cache_point: CachePoint | None = None) -> RenderedChat:
        """The chat as final token ids (rendered and tokenized once, by the engine), after the
        no-tokenization context check (limits.PromptBounds); template errors are 400s."""
        self.bounds.check_chat(chat, self.engine.ctx_size, body_bytes)
        return self._chat_prompt(chat, cache_point)

    def _chat_prompt(self, chat: P.ChatInput,
                     cache_point: CachePoint | None = None) -> RenderedChat:
        cache_after = cache_point.message if cache_point is not None else None
        return self._with_template(chat, lambda msgs, tools, agp, kwargs, more: (
            self.engine.chat_prompt(msgs, tools, add_generation_prompt=agp,
                                    template_kwargs=kwargs, cache_after=cache_after, **more)))

    @staticmethod
    def _with_template(chat: P.ChatInput, call):
        """`call(messages, tools, add_generation_prompt, template_kwargs, options)` with the
        chat's template arguments (tools as the template sees them, `continue_final` as an
        option); a template that rejects the chat is a 400."""
        kwargs = dict(chat.template_kwargs)
        agp = bool(kwargs.pop("add_generation_prompt", True))
        more = {"continue_final": True} if chat.continue_final else {}
        try:
            return call(chat.messages, P.template_tools(chat.tools), agp, kwargs, more)
        except APIError:
            raise
        except (ValueError, TypeError) as e:
            raise bad_request(f"chat template error: {e}", "messages", "invalid_messages") from None
        except Exception as e:
            if type(e).__module__.startswith("jinja2"):
                raise bad_request(f"chat template error: {e}", "messages",
                                  "invalid_messages") from None
            raise

    def _chat_tokens(self, chat: P.ChatInput) -> tuple[list[int], int | None]:
        r = self._chat_prompt(chat)
        return r.tokens, r.first_user_boundary

    def request_context(self, request: Request) -> RequestContext:
        tenant: Tenant | None = (request.scope.get("state") or {}).get("tenant")
        return RequestContext(
            model_name=self.engine.model_name, ctx_size=self.engine.ctx_size,
            vocab_size=self.vocab_size, max_n=self.max_n, tenant=tenant,
            tenant_id=tenant.ident.hex() if tenant is not None else "", engine=self.engine)

    # ------------------------------------------------------------------ completions
    async def chat(self, request: Request) -> Response:
        return await self._generate(request, self.apis["chat"])

    async def messages(self, request: Request) -> Response:
        return await self._generate(request, self.apis["messages"])

    async def responses(self, request: Request) -> Response:
        return await self._generate(request, self.apis["responses"])

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, None)

    def _prompt_tokens(self, pieces: list[str | int]) -> list[int]:
        """A raw prompt of text pieces and token ids (llama-server's mixed prompts): each text
        tokenized with special tokens parsed, BOS only before a leading text piece."""
        ctx = self.engine.ctx_size
        total = sum(len(p) for p in pieces if isinstance(p, str))
        self.bounds.check_text(total, ctx, "prompt")
        ids = [p for p in pieces if not isinstance(p, str)]
        P.check_token_ids(ids, self.vocab_size, "prompt")
        out: list[int] = []
        for i, p in enumerate(pieces):
            if isinstance(p, str):
                out += self.engine.tokenize(p, i == 0, True)
            else:
                out.append(p)
        return out

    async def _completion_prompt(self, request: Request, body: dict,
                                 heavy: bool) -> tuple[list[int], str]:
        """/v1/completions: the prompt's token ids and the echo text."""
        comp = P.parse_completion(body, self.vocab_size)
        pieces: list[str | int] = list(comp.tokens) if comp.tokens is not None else [comp.text]
        tokens = await limits.run_heavy(request, heavy, self._prompt_tokens, pieces)
        echo_text = ""
        if comp.echo:
            echo_text = (comp.text or "" if comp.tokens is None
                         else await run_in_threadpool(self.engine.detokenize, tokens))
        return tokens, echo_text

    async def _generate(self, request: Request, api: FrontEnd | None) -> Response:
        """One generation request through any API: parse (the front end), render and tokenize
        once, compile the constraint, submit, then stream or collect through the front end's
        format. `api` None: the legacy /v1/completions (a prompt, not a chat)."""
        endpoint = api.endpoint if api is not None else "completions"
        rid = (api.id_prefix if api is not None else "cmpl-") + uuid.uuid4().hex[:24]
        ctx = self.request_context(request)
        tenant = ctx.tenant
        rec = RequestRecord(id=rid, endpoint=endpoint,
                            tenant=tenant.name if tenant is not None else None)
        error_body_of = api.error_body if api is not None else APIError.body
        self.metrics.in_flight.inc()
        handed_off = False
        try:
            if self.shutting_down:
                raise APIError(503, "The server is shutting down", code="service_unavailable")
            body = await read_json(request, self.settings)
            heavy = limits.body_size(request) > limits.HEAVY_BYTES
            ctx_size = self.engine.ctx_size
            creq: ChatRequest | None = None
            boundary = cache_point = None
            echo_text = ""
            if api is not None:
                creq = api.parse(body, ctx)
                opts, model, param = creq.opts, creq.model or ctx.model_name, "messages"
                output_c = creq.output
                rec.stream = opts.stream
                if creq.chat is not None:
                    rendered = await limits.run_heavy(
                        request, heavy, self._render_chat, creq.chat, limits.body_size(request),
                        creq.cache_point)
                    tokens, boundary = rendered.tokens, rendered.first_user_boundary
                    cache_point = rendered.cache_point
                else:
                    param = "prompt"
                    tokens = await limits.run_heavy(request, heavy, self._prompt_tokens,
                                                    creq.prompt or [])
            else:
                model = P.requested_model(body, self.engine.model_name)
                opts = P.parse_common(body, ctx_size=ctx_size, chat=False, max_n=self.max_n,
                                      vocab_size=self.vocab_size)
                rec.stream = opts.stream
                output_c = P.parse_output_constraint(body, chat=False)
                tokens, echo_text = await self._completion_prompt(request, body, heavy)
                param = "prompt"
            limits.release_body(request)  # parsed and tokenized: the body budget goes back
            rec.prompt_tokens = n = len(tokens)
            if n == 0:
                raise bad_request("the prompt is empty", param)
            if n >= ctx_size:
                err = bad_request(
                    f"This model's maximum context length is {ctx_size} tokens, but the prompt "
                    f"has {n} tokens (at least one token must be left for the completion)",
                    param, "context_length_exceeded")
                err.details = {"n_prompt_tokens": n, "n_ctx": ctx_size}  # llama-server's
                raise err
            if creq is not None and getattr(api, "wants_prompt_tokens", False):
                creq.extra["prompt_tokens"] = tokens
                creq.extra["slot_of"] = lambda: self.slot_table.slot_of(rid)
            default_max = getattr(self.settings, "default_max_tokens", None)
            if not isinstance(default_max, int) or default_max <= 0:
                default_max = None  # -1 / None: until the context is full
            max_tokens = min(opts.max_tokens or default_max or ctx_size, ctx_size - n)
            chat_in = creq.chat if creq is not None else None
            rules = None
            if chat_in is not None and self.tool_calls is not None:
                rules = self.tool_calls.rules(chat_in, self._opens_reasoning(tokens))
            grammar = None
            constraint = request_constraint(chat_in, output_c, self.tool_calls)
            if constraint is not None:
                grammar = await limits.run_heavy(request, True, compile_constraint,
                                                 self.engine, constraint, rules)
            greq = GenerationRequest(
                prompt_tokens=tokens, max_tokens=max_tokens, sampling=opts.sampling,
                stop=opts.stop, ignore_eos=opts.ignore_eos, logprobs=opts.logprobs,
                top_logprobs=opts.top_logprobs,
                cache_salt=self.tenancy.salt(tenant, opts.cache_salt),
                cache_store=self.tenancy.stores(opts.cache_salt),
                public_prefix_tokens=self.tenancy.public_prefix_tokens(tokens),
                first_user_boundary=boundary, cache_point=cache_point,
                reuse_cache=creq.reuse_cache if creq is not None else True, request_id=rid,
                n=opts.n, grammar=grammar,
                special_text=(rules is not None and rules.tool_format is not None
                              and self.tool_calls.name in ToolCalls.SPECIAL_MARKERS),
                fault=request.headers.get(FAULT_HEADER) if self.fault_injection else None)
            if api is not None:
                bs = self.block_size
                pinned = cache_point - cache_point % bs if cache_point else 0
                fmt: ApiFormat = api.make_format(rid, creq, rules, PromptInfo(n, pinned))
            else:
                fmt = CompletionFormat(rid, model, opts, echo_text)
                fmt.system_fingerprint = self.system_fingerprint
            try:
                handle = self.engine.submit(greq)
            except RequestRejected as e:
                raise bad_request(str(e), param, e.code) from None
            self.active[rid] = handle
            self.slot_table.acquire(rid, greq, creq.extra.get("settings") if creq else None,
                               creq.extra.get("id_slot", -1) if creq else -1)
            if opts.stream:
                handed_off = True

                def on_close() -> None:
                    self._close(rec, handle)
                    self._finish_record(rec)

                return SSEResponse(self._stream(handle, fmt, rec), on_close)
            try:
                return await self._collect(request, handle, fmt, rec)
            finally:
                self._close(rec, handle)
        except APIError as e:
            rec.status, rec.error = e.status, e.message
            return JSONResponse(error_body_of(e), status_code=e.status, headers=e.headers)
        except ClientDisconnect:
            rec.status, rec.error = 499, "client disconnected"
            return Response(status_code=400)
        except Exception as e:  # noqa: BLE001
            log.exception("request %s failed", rid)
            rec.status, rec.error = 500, f"{type(e).__name__}: {e}"
            err = APIError(500, f"Internal server error ({type(e).__name__}); see the server "
                                f"log for request {rid}", code="internal_error")
            return JSONResponse(error_body_of(err), status_code=500)
        finally:
            if not handed_off:
                self._finish_record(rec)

    @property
    def block_size(self) -> int:
        bs = getattr(getattr(self.engine, "config", None), "block_size", None)
        return bs if isinstance(bs, int) and bs > 0 else 1

    def _close(self, rec: RequestRecord, handle) -> None:
        """Idempotent end of a submitted request: cancel it if it is still running."""
        if self.active.pop(rec.id, None) is not None and rec.finish is None:
            handle.cancel()
            if rec.status == 200:
                rec.status, rec.error = 499, "client disconnected"

    def _finish_record(self, rec: RequestRecord) -> None:
        if rec.done:
            return
        rec.done = True
        self.slot_table.release(rec.id, rec.finish)
        m = self.metrics
        m.in_flight.dec()
        m.requests.labels(rec.endpoint, str(rec.status)).inc()
        m.duration.observe(time.perf_counter() - rec.t0)
        fin = rec.finish
        self.tenant_metrics.count(rec.tenant, fin)
        if fin is not None:
            m.finish.labels(fin.reason).inc()
            if fin.completion_tokens > 0:
                m.ttft.observe(fin.time_to_first_token_s)
        request_log.info(json.dumps(rec.as_log(), separators=(",", ":")))

    async def _collect(self, request: Request, handle, fmt: ApiFormat,
                       rec: RequestRecord) -> Response:
        disconnected = asyncio.Event()

        async def watch() -> None:
            while True:
                msg = await request.receive()
                if msg["type"] == "http.disconnect":
                    disconnected.set()
                    handle.cancel()
                    return

        watcher = asyncio.ensure_future(watch())
        choices: dict[int, tuple[list[str], list[TokenEvent]]] = {}
        fins: dict[int, FinishEvent] = {}
        # a format that may end the generation early (llama-server's n_indent)
        observe = getattr(fmt, "watch", None)
        try:
            async for ev in handle:
                if isinstance(ev, FinishEvent):
                    fins[ev.index] = ev = _early_stop(fmt, ev)
                    if ev.reason in ("error", "cancelled"):
                        break
                    continue
                self.slot_table.feed(rec.id, ev)
                if getattr(fmt, "stop_requested", False):
                    continue  # generated before the stop took effect
                texts, events = choices.setdefault(ev.index, ([], []))
                texts.append(ev.text)
                events.append(ev)
                if observe is not None:
                    observe(ev)
                    if getattr(fmt, "stop_requested", False):
                        handle.cancel()
        finally:
            watcher.cancel()
        failed = [f for f in fins.values() if f.reason in ("error", "cancelled")]
        rec.finish = failed[0] if failed else (P.merge_finishes(list(fins.values()))
                                               if fins else None)
        if rec.finish is None:
            raise RuntimeError("the engine ended the request without a FinishEvent")
        if disconnected.is_set():
            rec.status, rec.error = 499, "client disconnected"
            return Response(status_code=499)
        self._check_finish(rec.finish)
        done = {i: ("".join(choices.get(i, ([], []))[0]), choices.get(i, ([], []))[1], f)
                for i, f in fins.items()}
        body = await run_in_threadpool(lambda: json_bytes(fmt.response(done, rec.finish)))
        return Response(body, media_type="application/json")

    @staticmethod
    def _check_finish(fin: FinishEvent) -> None:
        if fin.reason == "error":
            status = fin.error_status if 400 <= fin.error_status < 600 else 500
            headers = None
            if fin.retry_after_s is not None:
                headers = {"Retry-After": str(max(1, round(fin.retry_after_s)))}
            prefix = "generation failed: " if status >= 500 and status != 503 else ""
            raise APIError(status, f"{prefix}{fin.error or 'engine error'}",
                           code=fin.error_cause or "engine_error", headers=headers)
        if fin.reason == "cancelled":
            raise APIError(503, "the request was cancelled (the server is shutting down)",
                           code="cancelled")

    async def _stream(self, handle, fmt: ApiFormat, rec: RequestRecord) -> AsyncIterator[bytes]:
        try:
            for c in fmt.stream_start():
                yield c
            fins: list[FinishEvent] = []
            failed: FinishEvent | None = None
            async for ev in handle:
                if isinstance(ev, FinishEvent):
                    ev = _early_stop(fmt, ev)
                    if ev.reason in ("error", "cancelled"):
                        failed = ev
                        break
                    fins.append(ev)
                    for c in fmt.stream_finish(ev):
                        yield c
                    continue
                self.slot_table.feed(rec.id, ev)
                stopped = getattr(fmt, "stop_requested", False)
                for c in fmt.stream_token(ev):
                    yield c
                if not stopped and getattr(fmt, "stop_requested", False):
                    handle.cancel()
            rec.finish = failed or (P.merge_finishes(fins) if fins else None)
            if rec.finish is None:
                raise RuntimeError("the engine ended the request without a FinishEvent")
            try:
                self._check_finish(rec.finish)
            except APIError as e:
                rec.status, rec.error = e.status, e.message
                for c in fmt.stream_error(e):
                    yield c
            else:
                for c in fmt.stream_end(rec.finish):
                    yield c
        except Exception as e:  # noqa: BLE001 - report in-band, the status line is gone
            log.exception("stream %s failed", rec.id)
            rec.status, rec.error = 500, f"{type(e).__name__}: {e}"
            err = APIError(500, f"Internal server error ({type(e).__name__})",
                           code="internal_error")
            for c in fmt.stream_error(err):
                yield c

    # ------------------------------------------------------------------ other endpoints
    async def count_tokens(self, request: Request) -> Response:
        """Anthropic `/v1/messages/count_tokens`: the prompt's tokens as `/v1/messages` would
        render them."""
        body = await read_json(request, self.settings)
        creq = count_tokens_request(body, self.request_context(request))
        heavy = limits.body_size(request) > limits.HEAVY_BYTES
        rendered = await limits.run_heavy(request, heavy, self._render_chat, creq.chat,
                                          limits.body_size(request))
        return JSONResponse({"input_tokens": len(rendered.tokens)})

    def _response_owner(self, request: Request) -> str:
        return owner_of(self.request_context(request), request.query_params.get("cache_salt"))

    async def get_response(self, request: Request) -> Response:
        return JSONResponse(self.apis["responses"].get_response(
            request.path_params["response_id"], self._response_owner(request)))

    async def delete_response(self, request: Request) -> Response:
        return JSONResponse(self.apis["responses"].delete_response(
            request.path_params["response_id"], self._response_owner(request)))

    async def models(self, request: Request) -> Response:
        e = self.engine
        names = self.settings.aliases or [e.model_name]
        return JSONResponse({"object": "list", "data": [{
            "id": name, "object": "model", "created": self.started,
            "owned_by": "kvshare", "meta": {"n_ctx": e.ctx_size, "n_vocab": self.vocab_size},
        } for name in names]})

    async def health(self, request: Request) -> Response:
        """llama-server's /health ({"status": "ok"}; a 503 carries its error object), with
        kvshare's reasons to be unhealthy (shutting down, an engine step that hangs)."""
        if self.shutting_down:
            return JSONResponse({"status": "shutting down", "error": N.error_object(
                503, "The server is shutting down")}, status_code=503)
        stalled = getattr(self.engine, "stalled_for", lambda: 0.0)()
        if stalled > STALL_LIMIT_S:  # one step should take well under a second or two
            return JSONResponse({"status": "engine stalled", "step_seconds": round(stalled, 1),
                                 "error": N.error_object(
                                     503, f"An engine step has run for {stalled:.0f} s")},
                                status_code=503)
        return JSONResponse({"status": "ok"})

    async def metrics_endpoint(self, request: Request) -> Response:
        data = await run_in_threadpool(self.metrics.render)
        return Response(data, media_type=self.metrics.content_type)

    # ------------------------------------------------------------------ llama-server native
    async def native_completion(self, request: Request) -> Response:
        """llama-server's `/completion` (and `/completions`), llama_native.py."""
        return await self._generate(request, self.apis["completion"])

    async def infill(self, request: Request) -> Response:
        """llama-server's `/infill` (fill-in-the-middle), llama_native.py."""
        return await self._generate(request, self.apis["infill"])

    @staticmethod
    def _llama_error(status: int, message: str, type: str | None = None) -> Response:
        return JSONResponse({"error": N.error_object(status, message, type)},
                            status_code=status)

    def _model_id(self) -> str:
        """What slot files are bound to: the weights' fingerprint (the model name without)."""
        try:
            fp = getattr(getattr(self.engine, "model", None), "fingerprint", None)
        except Exception:  # noqa: BLE001 - a model without a file (tests)
            fp = None
        return fp if isinstance(fp, str) and fp else self.engine.model_name

    async def props(self, request: Request) -> Response:
        """llama-server's `GET /props`."""
        e = self.engine
        tok = getattr(e, "tokenizer", None)
        template = getattr(e, "chat_template", None)
        path = getattr(getattr(e, "model", None), "path", None)
        tools = self.tool_calls is not None and self.tool_calls.name is not None
        try:
            from kvshare import __version__ as version
        except ImportError:  # pragma: no cover
            version = "unknown"
        default_max = getattr(self.settings, "default_max_tokens", None)
        return JSONResponse({
            "default_generation_settings": {"params": N.default_settings(default_max),
                                            "n_ctx": e.ctx_size},
            "total_slots": len(self.slot_table),
            "model_alias": (self.settings.aliases or [e.model_name])[0],
            "model_path": str(path) if path else e.model_name,
            "modalities": {"vision": False, "video": False, "audio": False},
            "endpoint_slots": bool(getattr(self.settings, "slots_endpoint", True)),
            "endpoint_props": False,
            "endpoint_metrics": True,
            "ui": False,
            "chat_template": getattr(template, "source", None) or "",
            "chat_template_caps": {"supports_tools": tools, "supports_tool_calls": tools,
                                   "supports_parallel_tool_calls": tools,
                                   "supports_system_role": True,
                                   "supports_string_content": True},
            "bos_token": getattr(tok, "bos_token", "") or "",
            "eos_token": getattr(tok, "eos_token", "") or "",
            "build_info": f"kvshare-{version}",
            "is_sleeping": False,
            "kvshare": {"version": version, "system_fingerprint": self.system_fingerprint,
                        "block_size": self.block_size},
        })

    async def post_props(self, request: Request) -> Response:
        """llama-server answers this only when started with `--props`; kvshare has no global
        properties to change."""
        return self._llama_error(501, "This server does not support changing global "
                                      "properties. Start it with `--props`")

    def _template_text(self, chat: P.ChatInput) -> str:
        template = getattr(self.engine, "chat_template", None)

        def render(msgs, tools, agp, kwargs, more) -> str:
            if template is not None and hasattr(template, "render"):
                return template.render(msgs, tools=tools, add_generation_prompt=agp, **more,
                                       **kwargs)
            return self.engine.apply_chat_template(msgs, tools, agp, **more, **kwargs)[0]

        return self._with_template(chat, render)

    async def apply_template(self, request: Request) -> Response:
        """llama-server's `/apply-template`: the chat rendered by the model's template (as the
        chat endpoints render it, assistant prefill included), not tokenized."""
        body = await read_json(request, self.settings)
        chat = P.parse_chat(body, reasoning_format=getattr(self.settings,
                                                           "reasoning_format", None))
        self.bounds.check_chat(chat, self.engine.ctx_size, limits.body_size(request))
        heavy = limits.body_size(request) > limits.HEAVY_BYTES
        text = await limits.run_heavy(request, heavy, self._template_text, chat)
        return JSONResponse({"prompt": text})

    async def chat_input_tokens(self, request: Request) -> Response:
        """llama-server's `/v1/chat/completions/input_tokens`: the prompt's token count as
        `/v1/chat/completions` would render it."""
        body = await read_json(request, self.settings)
        chat = P.parse_chat(body, reasoning_format=getattr(self.settings,
                                                           "reasoning_format", None))
        heavy = limits.body_size(request) > limits.HEAVY_BYTES
        rendered = await limits.run_heavy(request, heavy, self._render_chat, chat,
                                          limits.body_size(request))
        return JSONResponse({"input_tokens": len(rendered.tokens),
                             "object": "response.input_tokens"})

    async def slots(self, request: Request) -> Response:
        """llama-server's `GET /slots` (llama_native.SlotTable); 501 with `--no-slots`."""
        if not getattr(self.settings, "slots_endpoint", True):
            return self._llama_error(501, "This server does not support slots endpoint. Start "
                                          "it with `--slots`")
        snap = await run_in_threadpool(self.engine.snapshot)
        live: dict[str, list[dict]] = {}
        for q in snap.get("slots", []):
            live.setdefault(str(q.get("request_id", q.get("id"))), []).append(q)
        if request.query_params.get("fail_on_no_slot") and \
                all(s.rid is not None for s in self.slot_table.slots):
            return self._llama_error(503, "no slot available")
        return JSONResponse(self.slot_table.to_json(self.engine.ctx_size, live))

    async def slot_action(self, request: Request) -> Response:
        """llama-server's `POST /slots/{id}?action=save|restore|erase` (see llama_native's
        docstring for what they mean over kvshare's shared cache)."""
        try:
            directory = getattr(self.settings, "slot_save_path", None)
            if not directory:
                return self._llama_error(501, "This server does not support slots action. "
                                              "Start it with `--slot-save-path`")
            try:
                slot = self.slot_table.get(int(request.path_params["id_slot"]))
            except ValueError:
                slot = None
            if slot is None:
                raise bad_request("Invalid slot ID", "id_slot")
            action = request.query_params.get("action")
            if action not in ("save", "restore", "erase"):
                raise bad_request("Invalid action", "action")
            if action == "erase":
                await self.slot_table.wait_idle(slot)
                n = len(slot.tokens)
                slot.prompt, slot.generated = [], []
                return JSONResponse({"id_slot": slot.id, "n_erased": n})
            body = await read_json(request, self.settings)
            filename = N.check_filename(body.get("filename"))
            path = os.path.join(directory, filename)
            await self.slot_table.wait_idle(slot)
            t0 = time.perf_counter()
            if action == "save":
                tokens = slot.tokens
                nbytes = await run_in_threadpool(N.save_slot_file, path, tokens, self._model_id())
                return JSONResponse({"id_slot": slot.id, "filename": filename,
                                     "n_saved": len(tokens), "n_written": nbytes,
                                     "timings": {"save_ms": (time.perf_counter() - t0) * 1e3}})
            tokens, nread = await run_in_threadpool(N.load_slot_file, path, self._model_id(),
                                                    self.vocab_size)
            if len(tokens) >= self.engine.ctx_size:
                raise bad_request("Unable to restore slot: Restored prompt does not fit in the "
                                  "slot context", "filename")
            if tokens:
                await self._warm(request, tokens)
            slot.prompt, slot.generated = list(tokens), []
            return JSONResponse({"id_slot": slot.id, "filename": filename,
                                 "n_restored": len(tokens), "n_read": nread,
                                 "timings": {"restore_ms": (time.perf_counter() - t0) * 1e3}})
        except OSError as e:
            return self._llama_error(500, f"Unable to access the slot file: {e.strerror or e}")

    async def _warm(self, request: Request, tokens: list[int]) -> None:
        """Compute `tokens` into the cache (one generated token, discarded): a restored slot's
        conversation is then a cached prefix for the tenant that restored it."""
        tenant = self.request_context(request).tenant
        rid = "slot-restore-" + uuid.uuid4().hex[:16]
        greq = GenerationRequest(
            prompt_tokens=list(tokens), max_tokens=1, sampling=SamplingParams(temperature=0.0),
            cache_salt=self.tenancy.salt(tenant, None), cache_store=self.tenancy.stores(None),
            public_prefix_tokens=self.tenancy.public_prefix_tokens(tokens), request_id=rid)
        try:
            handle = self.engine.submit(greq)
        except RequestRejected as e:
            raise bad_request(f"Unable to restore slot: {e}", "filename", e.code) from None
        fin = None
        async for ev in handle:
            if isinstance(ev, FinishEvent):
                fin = ev
        if fin is None or fin.reason in ("error", "cancelled"):
            raise APIError(500, "Unable to restore slot: computing its tokens failed"
                                + (f" ({fin.error})" if fin is not None and fin.error else ""))

    async def cache(self, request: Request) -> Response:
        snap = await run_in_threadpool(self.engine.snapshot)
        return JSONResponse({k: v for k, v in snap.items() if k != "slots"})

    async def tokenize(self, request: Request) -> Response:
        body = await read_json(request, self.settings)
        content = body.get("content")
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise bad_request("'content' must be a string", "content")
        add_special = P.get_bool(body, "add_special", False)
        parse_special = P.get_bool(body, "parse_special", True)
        with_pieces = P.get_bool(body, "with_pieces", False)
        max_chars = limits.tokenize_max_chars(self.engine.ctx_size)
        if len(content) > max_chars:
            raise APIError(413, f"'content' has {len(content)} characters; /tokenize takes at "
                                f"most {max_chars}", param="content", code="request_too_large")

        def work() -> bytes:
            ids = self.engine.tokenize(content, add_special=add_special,
                                       parse_special=parse_special)
            if with_pieces:
                if len(ids) > limits.TOKENIZE_MAX_PIECES:
                    raise bad_request(
                        f"the content has {len(ids)} tokens; 'with_pieces' returns at most "
                        f"{limits.TOKENIZE_MAX_PIECES} (send less text, or no 'with_pieces')",
                        "with_pieces", "response_too_large")
                out: list = [{"id": t, "piece": self.engine.token_piece(t)} for t in ids]
            else:
                out = list(ids)
            return json_bytes({"tokens": out})

        heavy = len(content) > limits.HEAVY_BYTES
        return Response(await limits.run_heavy(request, heavy, work),
                        media_type="application/json")

    async def detokenize(self, request: Request) -> Response:
        body = await read_json(request, self.settings)
        tokens = body.get("tokens")
        if tokens is None:
            tokens = []
        P.check_token_ids(tokens, self.vocab_size, "tokens")
        if len(tokens) > limits.DETOKENIZE_MAX_TOKENS:
            raise APIError(413, f"'tokens' has {len(tokens)} ids; /detokenize takes at most "
                                f"{limits.DETOKENIZE_MAX_TOKENS}", param="tokens",
                           code="request_too_large")

        def work() -> bytes:
            text = self.engine.detokenize(tokens)
            if len(text) > limits.DETOKENIZE_MAX_CHARS:
                raise bad_request(f"the text of these tokens has {len(text)} characters; "
                                  f"/detokenize returns at most {limits.DETOKENIZE_MAX_CHARS}",
                                  "tokens", "response_too_large")
            return json_bytes({"content": text})

        try:
            data = await limits.run_heavy(request, len(tokens) > 4096, work)
        except (IndexError, KeyError, ValueError) as e:
            raise bad_request(f"cannot detokenize: {e}", "tokens", "invalid_token_id") from None
        return Response(data, media_type="application/json")


# --------------------------------------------------------------------------- factory

async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    status = exc.status_code
    msg = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
    if status == 404:
        msg = f"Not found: {request.method} {request.url.path}"
    elif status == 405:
        msg = f"Method {request.method} not allowed on {request.url.path}"
    err = APIError(status, msg, code=HTTP_CODES.get(status))
    return JSONResponse(error_json(route_path(request.scope), err), status_code=status,
                        headers=exc.headers)


async def _api_error(request: Request, exc: Exception) -> Response:
    """An APIError an endpoint raised, in the shape of the API at its path (`error_json`)."""
    assert isinstance(exc, APIError)
    return JSONResponse(error_json(route_path(request.scope), exc), status_code=exc.status,
                        headers=exc.headers)


async def _server_error(request: Request, exc: Exception) -> Response:
    log.error("unhandled error on %s %s", request.method, request.url.path,
              exc_info=(type(exc), exc, exc.__traceback__))
    return JSONResponse(error_body(f"Internal server error ({type(exc).__name__})",
                                   type="server_error", code="internal_error"), status_code=500)


def create_app(engine, settings: ServerSettings | None = None, *,
               on_startup: Callable[[], None] | None = None) -> Starlette:
    """The ASGI app. Its lifespan calls `engine.start()` and, at shutdown, `engine.shutdown()`.
    `app.state.server` is the `KVShareServer` (for `begin_shutdown` / `cancel_all`)."""
    settings = settings or ServerSettings()
    srv = KVShareServer(engine, settings)

    @asynccontextmanager
    async def lifespan(app: Starlette):
        await run_in_threadpool(engine.start)
        if on_startup is not None:
            on_startup()
        try:
            yield
        finally:
            srv.begin_shutdown()
            await run_in_threadpool(engine.shutdown)

    def both(path: str, ep, methods: list[str]) -> list[Route]:
        return [Route("/v1" + path, ep, methods=methods), Route(path, ep, methods=methods)]

    routes = [
        *both("/chat/completions", srv.chat, ["POST"]),
        *both("/chat/completions/input_tokens", srv.chat_input_tokens, ["POST"]),
        # /v1/completions is OpenAI's; /completions and /completion are llama-server's own
        Route("/v1/completions", srv.completions, methods=["POST"]),
        Route("/completions", srv.native_completion, methods=["POST"]),
        Route("/completion", srv.native_completion, methods=["POST"]),
        Route("/infill", srv.infill, methods=["POST"]),
        Route("/props", srv.props, methods=["GET"]),
        Route("/props", srv.post_props, methods=["POST"]),
        Route("/apply-template", srv.apply_template, methods=["POST"]),
        Route("/slots/{id_slot}", srv.slot_action, methods=["POST"]),
        *both("/messages", srv.messages, ["POST"]),
        *both("/messages/count_tokens", srv.count_tokens, ["POST"]),
        *both("/responses", srv.responses, ["POST"]),
        *both("/responses/{response_id}", srv.get_response, ["GET"]),
        *both("/responses/{response_id}", srv.delete_response, ["DELETE"]),
        *both("/models", srv.models, ["GET"]),
        *both("/health", srv.health, ["GET"]),
        Route("/metrics", srv.metrics_endpoint, methods=["GET"]),
        Route("/slots", srv.slots, methods=["GET"]),
        Route("/cache", srv.cache, methods=["GET"]),
        Route("/tokenize", srv.tokenize, methods=["POST"]),
        Route("/detokenize", srv.detokenize, methods=["POST"]),
    ]
    middleware = []
    if settings.root_path:
        middleware.append(Middleware(RootPathMiddleware, root_path=settings.root_path))
    # CORS (cors.py) outside the auth: a browser's preflight carries no key
    middleware.append(Middleware(CORSMiddleware, policy=CORSPolicy(
        settings.cors_origins, settings.cors_methods, settings.cors_headers,
        settings.cors_credentials)))
    # connection limit and body deadline (limits.py), before anything reads the body
    middleware.append(Middleware(limits.EdgeMiddleware, limits=srv.edge,
                                 exempt=OPEN_PATHS | {"/metrics"}, route_path=route_path))
    srv.metrics.registry.register(limits.EdgeCollector(srv.edge))
    if srv.tenancy.keyring is not None:
        middleware.append(Middleware(AuthMiddleware, keys=srv.tenancy.keyring))
    app = Starlette(
        routes=routes, middleware=middleware, lifespan=lifespan,
        exception_handlers={HTTPException: _http_error, APIError: _api_error,
                            Exception: _server_error},
    )
    app.state.server = srv
    return app
