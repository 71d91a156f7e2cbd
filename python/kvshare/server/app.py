"""The Starlette application: OpenAI-compatible completions over a kvshare `Engine`.

`create_app(engine, settings)` builds the app; its lifespan starts the engine and shuts it down.
The app only talks to the engine through the contract in `kvshare.engine.api` plus the engine's
tokenizer/template methods, so it can be tested against a fake engine.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from kvshare.engine.api import FinishEvent, GenerationRequest, TokenEvent
from kvshare.engine.faults import HEADER as FAULT_HEADER
from kvshare.engine.faults import injection_enabled

from kvshare.toolcalls import prompt_opens_reasoning

from . import limits
from . import protocol as P
from .chat_output import ChoiceOutput, OutputRules
from .constraints import ToolCalls, compile_constraint, request_constraint
from .errors import HTTP_CODES, APIError, bad_request, error_body
from .limits import read_json
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
        resp = JSONResponse(error_body(msg, code="invalid_api_key"), status_code=401,
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


# --------------------------------------------------------------------------- formats

def _json_bytes(obj: Any) -> bytes:
    """What JSONResponse would send (built off the event loop for large responses)."""
    return json.dumps(obj, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()


def _sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


class _Format:
    """Builds one endpoint's response objects and stream chunks (every choice of a request:
    events carry their choice's `index`)."""

    object_full = object_chunk = ""

    def __init__(self, rid: str, model: str, opts: P.CommonOptions):
        self.rid, self.model, self.opts = rid, model, opts
        self.created = int(time.time())

    def _base(self, obj: str) -> dict:
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": None}

    def final_extras(self, total: FinishEvent, chunk: dict) -> dict:
        """The last choice's finish chunk carries the request's usage and timings."""
        chunk.update(usage=P.usage(total), timings=total.timings.as_dict())
        return chunk

    def choice(self, i: int, text: str, events: list[TokenEvent], fin: FinishEvent) -> dict:
        raise NotImplementedError

    def response(self, choices: dict[int, tuple[str, list[TokenEvent], FinishEvent]],
                 total: FinishEvent) -> dict:
        """The whole (non-streamed) response: each choice in index order, then the totals."""
        r = self._base(self.object_full)
        r.update(choices=[self.choice(i, *choices[i]) for i in sorted(choices)],
                 usage=P.usage(total), timings=total.timings.as_dict())
        return r

    def usage_chunk(self, fin: FinishEvent) -> dict:
        c = self._base(self.object_chunk)
        c.update(choices=[], usage=P.usage(fin), timings=fin.timings.as_dict())
        return c


class ChatFormat(_Format):
    object_full, object_chunk = "chat.completion", "chat.completion.chunk"

    def __init__(self, rid: str, model: str, opts: P.CommonOptions,
                 rules: OutputRules | None = None):
        super().__init__(rid, model, opts)
        self.rules = rules or OutputRules()
        self._outputs: dict[int, ChoiceOutput] = {}

    def _out(self, index: int) -> ChoiceOutput:
        out = self._outputs.get(index)
        if out is None:
            out = self._outputs[index] = ChoiceOutput(self.rules)
        return out

    def _chunk(self, delta: dict, index: int = 0, finish: str | None = None,
               logprobs: Any = None) -> dict:
        c = self._base(self.object_chunk)
        c["choices"] = [{"index": index, "delta": delta, "logprobs": logprobs,
                         "finish_reason": finish}]
        return c

    def start_chunks(self) -> list[dict]:
        return [self._chunk({"role": "assistant", "content": ""}, i)
                for i in range(self.opts.n)]

    def token_chunks(self, ev: TokenEvent) -> list[dict]:
        entry = P.chat_logprob_entry(ev) if self.opts.logprobs else None
        deltas = self._out(ev.index).feed(ev.text)
        lp = {"content": [entry]} if entry is not None else None
        if not deltas:
            return [self._chunk({}, ev.index, logprobs=lp)] if lp is not None else []
        chunks = [self._chunk(d, ev.index) for d in deltas]
        if lp is not None:
            chunks[-1]["choices"][0]["logprobs"] = lp
        return chunks

    def finish_chunks(self, fin: FinishEvent) -> list[dict]:
        out = self._out(fin.index)
        chunks = [self._chunk(d, fin.index) for d in out.finish()]
        chunks.append(self._chunk({}, fin.index, P.finish_reason(fin, out.has_calls)))
        return chunks

    def choice(self, i: int, text: str, events: list[TokenEvent], fin: FinishEvent) -> dict:
        logprobs = None
        if self.opts.logprobs:
            logprobs = {"content": [e for e in map(P.chat_logprob_entry, events) if e]}
        message, calls = ChoiceOutput.message(self.rules, text)
        return {"index": i, "message": message, "logprobs": logprobs,
                "finish_reason": P.finish_reason(fin, calls)}


class CompletionFormat(_Format):
    object_full = object_chunk = "text_completion"

    def __init__(self, rid: str, model: str, opts: P.CommonOptions, echo_text: str):
        super().__init__(rid, model, opts)
        self.echo_text = echo_text
        self.offsets: dict[int, int] = {}

    def _chunk(self, text: str, index: int = 0, finish: str | None = None,
               logprobs: Any = None) -> dict:
        c = self._base(self.object_chunk)
        c["choices"] = [{"index": index, "text": text, "logprobs": logprobs,
                         "finish_reason": finish}]
        return c

    def start_chunks(self) -> list[dict]:
        return [self._chunk(self.echo_text, i) for i in range(self.opts.n)] \
            if self.echo_text else []

    def token_chunks(self, ev: TokenEvent) -> list[dict]:
        lp = None
        if self.opts.logprobs:
            lp = P.LegacyLogprobs(self.offsets.get(ev.index, len(self.echo_text)))
            if lp.add(ev):
                self.offsets[ev.index] = lp.offset
            else:
                lp = None
        if not ev.text and lp is None:
            return []
        return [self._chunk(ev.text, ev.index, logprobs=lp.as_dict() if lp else None)]

    def finish_chunks(self, fin: FinishEvent) -> list[dict]:
        return [self._chunk("", fin.index, P.finish_reason(fin))]

    def choice(self, i: int, text: str, events: list[TokenEvent], fin: FinishEvent) -> dict:
        logprobs = None
        if self.opts.logprobs:
            lp = P.LegacyLogprobs(len(self.echo_text))
            for e in events:
                lp.add(e)
            logprobs = lp.as_dict()
        return {"index": i, "text": self.echo_text + text, "logprobs": logprobs,
                "finish_reason": P.finish_reason(fin)}


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

class KVShareServer:
    def __init__(self, engine, settings: ServerSettings):
        self.engine = engine
        self.settings = settings
        self.metrics = ServerMetrics(engine)
        self.shutting_down = False
        self.started = int(time.time())
        self.active: dict[str, Any] = {}  # request id -> RequestHandle
        self._bos: int | None | bool = False  # False: not probed yet
        self.bounds = limits.PromptBounds(engine)  # prompts too long to fit, untokenized
        self.edge = limits.EdgeLimits.from_settings(settings)
        # cache scope, API keys, public prefixes (tokenized here; TenancyError when bad)
        self.tenancy = build_tenancy(
            settings, lambda text: self.engine.tokenize(text, True, True),
            lambda chat: self._chat_tokens(chat)[0])
        self.tenant_metrics = TenantMetrics(self.metrics.registry, self.tenancy.keyring)
        self.fault_injection = injection_enabled()  # tests only: honour X-Kvshare-Fault
        self.max_n = getattr(getattr(engine, "config", None), "max_n", 8)
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

    def _bos_id(self) -> int | None:
        if self._bos is False:
            try:
                ids = self.engine.tokenize("", add_special=True, parse_special=True)
                self._bos = ids[0] if len(ids) == 1 else None
            except Exception:
                self._bos = None
        return self._bos  # type: ignore[return-value]

    def _opens_reasoning(self, tokens: list[int]) -> bool:
        """Whether the prompt ends inside a <think> block the template opened (the reply
        starts with reasoning)."""
        if self.tool_calls is None or not self.tool_calls.thinking:
            return False
        return prompt_opens_reasoning(self.engine.detokenize(tokens[-8:]))

    def _bounded_chat_tokens(self, chat: P.ChatInput,
                             body_bytes: int) -> tuple[list[int], int | None]:
        """`_chat_tokens`, after the no-tokenization context check (limits.PromptBounds)."""
        self.bounds.check_chat(chat, self.engine.ctx_size, body_bytes)
        return self._chat_tokens(chat)

    def _chat_tokens(self, chat: P.ChatInput) -> tuple[list[int], int | None]:
        kwargs = dict(chat.template_kwargs)
        agp = kwargs.pop("add_generation_prompt", True)
        try:
            text, boundary = self.engine.apply_chat_template(
                chat.messages, tools=chat.tools, add_generation_prompt=bool(agp), **kwargs)
        except APIError:
            raise
        except (ValueError, TypeError) as e:
            raise bad_request(f"chat template error: {e}", "messages", "invalid_messages") from None
        except Exception as e:
            if type(e).__module__.startswith("jinja2"):
                raise bad_request(f"chat template error: {e}", "messages",
                                  "invalid_messages") from None
            raise
        tokens = self.engine.tokenize(text, add_special=True, parse_special=True)
        bos = self._bos_id()
        # A template that renders the BOS text itself plus the tokenizer's BOS would give two.
        if bos is not None and len(tokens) >= 2 and tokens[0] == bos and tokens[1] == bos:
            tokens = tokens[1:]
            if boundary:
                boundary -= 1
        return tokens, boundary

    # ------------------------------------------------------------------ completions
    async def chat(self, request: Request) -> Response:
        return await self._generate(request, "chat")

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, "completions")

    async def _generate(self, request: Request, endpoint: str) -> Response:
        chat = endpoint == "chat"
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        tenant: Tenant | None = (request.scope.get("state") or {}).get("tenant")
        rec = RequestRecord(id=rid, endpoint=endpoint,
                            tenant=tenant.name if tenant is not None else None)
        self.metrics.in_flight.inc()
        handed_off = False
        try:
            if self.shutting_down:
                raise APIError(503, "The server is shutting down", code="service_unavailable")
            body = await read_json(request, self.settings)
            model = P.requested_model(body, self.engine.model_name)
            ctx = self.engine.ctx_size
            opts = P.parse_common(body, ctx_size=ctx, chat=chat, max_n=self.max_n,
                                  vocab_size=self.vocab_size)
            rec.stream = opts.stream
            boundary = None
            echo_text = ""
            chat_in = None
            heavy = limits.body_size(request) > limits.HEAVY_BYTES
            output_c = P.parse_output_constraint(body, chat=chat)
            if chat:
                chat_in = P.parse_chat(body)
                tokens, boundary = await limits.run_heavy(
                    request, heavy, self._bounded_chat_tokens, chat_in,
                    limits.body_size(request))
                param = "messages"
            else:
                comp = P.parse_completion(body, self.vocab_size)
                param = "prompt"
                if comp.tokens is not None:
                    tokens = list(comp.tokens)
                    if comp.echo:
                        echo_text = await run_in_threadpool(self.engine.detokenize, tokens)
                else:
                    self.bounds.check_text(len(comp.text), ctx, param)
                    tokens = await limits.run_heavy(request, heavy, self.engine.tokenize,
                                                    comp.text, True, True)
                    if comp.echo:
                        echo_text = comp.text or ""
            limits.release_body(request)  # parsed and tokenized: the body budget goes back
            rec.prompt_tokens = n = len(tokens)
            if n == 0:
                raise bad_request("the prompt is empty", param)
            if n >= ctx:
                raise bad_request(
                    f"This model's maximum context length is {ctx} tokens, but the prompt has "
                    f"{n} tokens (at least one token must be left for the completion)", param,
                    "context_length_exceeded")
            max_tokens = min(opts.max_tokens or ctx, ctx - n)
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
                first_user_boundary=boundary, request_id=rid, n=opts.n, grammar=grammar,
                special_text=(rules is not None and rules.tool_format is not None
                              and self.tool_calls.name in ToolCalls.SPECIAL_MARKERS),
                fault=request.headers.get(FAULT_HEADER) if self.fault_injection else None)
            fmt = (ChatFormat(rid, model, opts, rules) if chat
                   else CompletionFormat(rid, model, opts, echo_text))
            try:
                handle = self.engine.submit(greq)
            except ValueError as e:
                code = "context_length_exceeded" if "context" in str(e).lower() else None
                raise bad_request(str(e), param, code) from None
            self.active[rid] = handle
            if opts.stream:
                handed_off = True

                def on_close() -> None:
                    self._close(rec, handle)
                    self._finish_record(rec)

                return SSEResponse(self._stream(handle, fmt, opts, rec), on_close)
            try:
                return await self._collect(request, handle, fmt, rec)
            finally:
                self._close(rec, handle)
        except APIError as e:
            rec.status, rec.error = e.status, e.message
            return e.response()
        except ClientDisconnect:
            rec.status, rec.error = 499, "client disconnected"
            return Response(status_code=400)
        except Exception as e:  # noqa: BLE001
            log.exception("request %s failed", rid)
            rec.status, rec.error = 500, f"{type(e).__name__}: {e}"
            return APIError(500, f"Internal server error ({type(e).__name__}); see the server "
                                 f"log for request {rid}", code="internal_error").response()
        finally:
            if not handed_off:
                self._finish_record(rec)

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

    async def _collect(self, request: Request, handle, fmt: _Format,
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
        try:
            async for ev in handle:
                if isinstance(ev, FinishEvent):
                    fins[ev.index] = ev
                    if ev.reason in ("error", "cancelled"):
                        break
                    continue
                texts, events = choices.setdefault(ev.index, ([], []))
                texts.append(ev.text)
                events.append(ev)
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
        body = await run_in_threadpool(lambda: _json_bytes(fmt.response(done, rec.finish)))
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

    async def _stream(self, handle, fmt: _Format, opts: P.CommonOptions,
                      rec: RequestRecord) -> AsyncIterator[bytes]:
        try:
            for c in fmt.start_chunks():
                yield _sse(c)
            fins: list[FinishEvent] = []
            last: dict | None = None
            failed: FinishEvent | None = None
            async for ev in handle:
                if isinstance(ev, FinishEvent):
                    if ev.reason in ("error", "cancelled"):
                        failed = ev
                        break
                    fins.append(ev)
                    chunks = fmt.finish_chunks(ev)
                    for c in chunks[:-1]:
                        yield _sse(c)
                    if last is not None:
                        yield _sse(last)
                    last = chunks[-1]  # held: the very last one carries usage and timings
                    continue
                for c in fmt.token_chunks(ev):
                    yield _sse(c)
            rec.finish = failed or (P.merge_finishes(fins) if fins else None)
            if rec.finish is None:
                raise RuntimeError("the engine ended the request without a FinishEvent")
            try:
                self._check_finish(rec.finish)
            except APIError as e:
                rec.status, rec.error = e.status, e.message
                yield _sse(e.body())
            else:
                yield _sse(fmt.final_extras(rec.finish, last))
                if opts.include_usage:
                    yield _sse(fmt.usage_chunk(rec.finish))
            yield b"data: [DONE]\n\n"
        except Exception as e:  # noqa: BLE001 - report in-band, the status line is gone
            log.exception("stream %s failed", rec.id)
            rec.status, rec.error = 500, f"{type(e).__name__}: {e}"
            yield _sse(error_body(f"Internal server error ({type(e).__name__})",
                                  type="server_error", code="internal_error"))
            yield b"data: [DONE]\n\n"

    # ------------------------------------------------------------------ other endpoints
    async def models(self, request: Request) -> Response:
        e = self.engine
        names = self.settings.aliases or [e.model_name]
        return JSONResponse({"object": "list", "data": [{
            "id": name, "object": "model", "created": self.started,
            "owned_by": "kvshare", "meta": {"n_ctx": e.ctx_size, "n_vocab": self.vocab_size},
        } for name in names]})

    async def health(self, request: Request) -> Response:
        if self.shutting_down:
            return JSONResponse({"status": "shutting down"}, status_code=503)
        stalled = getattr(self.engine, "stalled_for", lambda: 0.0)()
        if stalled > STALL_LIMIT_S:  # one step should take well under a second or two
            return JSONResponse({"status": "engine stalled", "step_seconds": round(stalled, 1)},
                                status_code=503)
        return JSONResponse({"status": "ok"})

    async def metrics_endpoint(self, request: Request) -> Response:
        data = await run_in_threadpool(self.metrics.render)
        return Response(data, media_type=self.metrics.content_type)

    async def slots(self, request: Request) -> Response:
        snap = await run_in_threadpool(self.engine.snapshot)
        return JSONResponse(snap.get("slots", []))

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
            return _json_bytes({"tokens": out})

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
            return _json_bytes({"content": text})

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
    return JSONResponse(error_body(msg, type="invalid_request_error" if status < 500
                                   else "server_error", code=HTTP_CODES.get(status)),
                        status_code=status, headers=exc.headers)


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    return exc.response()


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
        *both("/completions", srv.completions, ["POST"]),
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
