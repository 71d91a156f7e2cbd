"""The generation pipeline: the one path from an API's parsed request to the engine and back.

Every generation endpoint of every API (`kvshare.apis`) runs `GenerationPipeline.handle`:

1. read the body (`body.read_json`, under the edge limits) and let the API parse it into an
   `ApiRequest` (`Api.parse`);
2. prepare, the same for every API: render the chat with the model's template and tokenize it
   once (or tokenize a raw prompt, BOS before a leading text piece), settle `max_tokens`
   (the request's, else `--n-predict`, clamped to what fits), the tenant's cache salt and
   the public prefix, the tool-call rules and the output constraint (compiled to a grammar),
   and the cache hints (first-user boundary, cache breakpoint);
3. submit to the engine (`EngineClient.submit`, the only check of what the engine accepts);
4. collect the events into one response, or stream them, through the API's `ApiFormat`.

The pipeline is the only caller of `EngineClient.submit` (a slot restore's warm-up included).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import replace
from typing import AsyncIterator, Callable

from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from kvshare.apis.base import (Api, ApiFormat, ApiRequest, CachePoint, ChatInput, Choices,
                               PromptInfo, RequestContext, json_bytes)
from kvshare.apis.parsing import check_token_ids, template_tools
from kvshare.apis.prompt_list import PromptListRequest
from kvshare.engine.api import (EngineClient, EngineHandle, FinishEvent, GenerationRequest,
                                RenderedChat, RequestRejected, SamplingParams, TokenEvent)
from kvshare.engine.faults import HEADER as FAULT_HEADER
from kvshare.engine.faults import injection_enabled
from kvshare.engine.reasoning_budget import ReasoningBudget
from kvshare.model.template_context import THINK_END, THINK_START
from kvshare.toolcalls import prompt_opens_reasoning

from . import body
from .constraints import ToolCalls, compile_constraint, describe_template, request_constraint
from .edge import HEAVY_BYTES, body_size, release_body, run_heavy
from .errors import APIError, bad_request
from .prompt_bounds import PromptBounds
from .submission import Prepared, merge_finishes
from .request_log import RequestLog, RequestRecord
from .settings import ServerSettings
from .tenancy import Tenancy, Tenant, hash_salt

log = logging.getLogger("kvshare.server")

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


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


# --------------------------------------------------------------------------- chat rendering

def with_template(chat: ChatInput, call):
    """`call(messages, tools, add_generation_prompt, template_kwargs, continue_final)` with
    the chat's template arguments (tools as the template sees them); a template that rejects
    the chat is a 400."""
    kwargs = dict(chat.template_kwargs)
    agp = bool(kwargs.pop("add_generation_prompt", True))
    try:
        return call(chat.messages, template_tools(chat.tools), agp, kwargs, chat.continue_final)
    except APIError:
        raise
    except (ValueError, TypeError) as e:
        raise bad_request(f"chat template error: {e}", "messages", "invalid_messages") from None
    except Exception as e:
        if type(e).__module__.startswith("jinja2"):
            raise bad_request(f"chat template error: {e}", "messages",
                              "invalid_messages") from None
        raise


def chat_prompt(engine: EngineClient, chat: ChatInput,
                cache_point: CachePoint | None = None) -> RenderedChat:
    """The chat as final token ids, rendered and tokenized once by the engine."""
    cache_after = cache_point.message if cache_point is not None else None
    return with_template(chat, lambda msgs, tools, agp, kwargs, cont: engine.chat_prompt(
        msgs, tools, add_generation_prompt=agp, template_kwargs=kwargs,
        cache_after=cache_after, continue_final=cont))


def chat_text(engine: EngineClient, chat: ChatInput) -> str:
    """The chat rendered by the model's template, not tokenized."""
    return with_template(chat, lambda msgs, tools, agp, kwargs, cont: engine.render_chat(
        msgs, tools, add_generation_prompt=agp, template_kwargs=kwargs, continue_final=cont))


def finish_error(fin: FinishEvent) -> APIError | None:
    """The error a failed or cancelled generation ends with (None when it succeeded)."""
    if fin.reason == "error":
        status = fin.error_status if 400 <= fin.error_status < 600 else 500
        headers = None
        if fin.retry_after_s is not None:
            headers = {"Retry-After": str(max(1, round(fin.retry_after_s)))}
        prefix = "generation failed: " if status >= 500 and status != 503 else ""
        return APIError(status, f"{prefix}{fin.error or 'engine error'}",
                        code=fin.error_cause or "engine_error", headers=headers)
    if fin.reason == "cancelled":
        return APIError(503, "the request was cancelled (the server is shutting down)",
                        code="cancelled")
    return None


# --------------------------------------------------------------------------- the pipeline

class GenerationPipeline:
    def __init__(self, engine: EngineClient, settings: ServerSettings, tenancy: Tenancy,
                 requests: RequestLog):
        self.engine, self.settings, self.tenancy = engine, settings, tenancy
        self.info = engine.info
        self.requests = requests
        self.slots = requests.observer
        self.bounds = PromptBounds(self.info.max_token_chars)
        self.fault_injection = injection_enabled()  # tests only: honour X-Kvshare-Fault
        template = self.info.chat_template
        # the model's tool-call format (kvshare.toolcalls); None without a chat template
        self.tool_calls = (ToolCalls(template or None, settings.tool_parser,
                                     self.info.template_polyfills,
                                     settings.max_parallel_tool_calls)
                           if template or settings.tool_parser else None)
        if template:
            log.info("chat template: %s", describe_template(self.info, self.tool_calls))
        self.active: dict[str, EngineHandle] = {}
        self.shutting_down = False

    # ------------------------------------------------------------------ context
    def context(self, request: Request) -> RequestContext:
        tenant: Tenant | None = (request.scope.get("state") or {}).get("tenant")
        return RequestContext(
            model_name=(self.settings.aliases or [self.info.name])[0],  # --alias, as llama-server
            ctx_size=self.info.ctx_size,
            vocab_size=self.info.vocab_size, max_n=self.info.max_n, tenant=tenant,
            tenant_id=tenant.ident.hex() if tenant is not None else "",
            sampling_defaults=self.settings.sampling_defaults, n_keep=self.settings.n_keep)

    # ------------------------------------------------------------------ prompts
    def render_chat(self, chat: ChatInput, body_bytes: int,
                    cache_point: CachePoint | None = None) -> RenderedChat:
        """The chat as token ids, after the no-tokenization context check."""
        if self.bounds.may_exceed(body_bytes, self.info.ctx_size):
            text = chat_text(self.engine, chat)
            self.bounds.check_text(len(text), self.info.ctx_size, "messages")
            del text
        return chat_prompt(self.engine, chat, cache_point)

    def prompt_tokens(self, pieces: list[str | int]) -> list[int]:
        """A raw prompt of text pieces and token ids (llama-server's mixed prompts): each text
        tokenized with special tokens parsed, BOS only before a leading text piece."""
        ctx = self.info.ctx_size
        self.bounds.check_text(sum(len(p) for p in pieces if isinstance(p, str)), ctx, "prompt")
        check_token_ids([p for p in pieces if not isinstance(p, str)], self.info.vocab_size,
                        "prompt")
        out: list[int] = []
        for i, p in enumerate(pieces):
            if isinstance(p, str):
                out += self.engine.tokenize(p, i == 0, True)
            else:
                out.append(p)
        return out

    async def request_tokens(self, request: Request, req: ApiRequest
                             ) -> tuple[list[int], RenderedChat | None]:
        """The request's prompt as token ids (and the rendered chat, for a chat)."""
        size = body_size(request)
        heavy = size > HEAVY_BYTES
        if req.chat is not None:
            rendered = await run_heavy(request, heavy, self.render_chat, req.chat, size,
                                       req.cache_point)
            return rendered.tokens, rendered
        return await run_heavy(request, heavy, self.prompt_tokens, req.prompt or []), None

    # ------------------------------------------------------------------ one request
    async def handle(self, request: Request, api: Api) -> Response:
        """One generation request through `api`: parse, prepare, submit, then stream or
        collect through the API's format. Errors come back in the API's own shape."""
        rid = api.id_prefix + uuid.uuid4().hex[:24]
        ctx = self.context(request)
        rec = RequestRecord(id=rid, endpoint=api.endpoint,
                            tenant=ctx.tenant.name if ctx.tenant is not None else None)
        self.requests.start(rec)
        handed_off = False
        try:
            if self.shutting_down:
                raise APIError(503, "The server is shutting down", code="service_unavailable")
            req = api.parse(await body.read_json(request, self.settings), ctx)
            rec.stream = req.opts.stream
            handle: EngineHandle
            if isinstance(req, PromptListRequest) and req.parts:  # several prompts
                from .prompt_list import submit_list  # (it builds on this module)
                prepared, handle = await submit_list(self, request, api, rid, req,
                                                     ctx.tenant, rec)
            else:
                prepared = await self.prepare(request, api, rid, req, ctx.tenant, rec)
                handle = self.submit(prepared.greq, "messages" if req.chat else "prompt")
            rec.submitted_at = time.perf_counter()
            self.active[rid] = handle
            self.slots.acquire(rid, prepared.greq, req.slot_params, req.id_slot, ctx.tenant)
            if req.opts.stream:
                handed_off = True

                def on_close() -> None:
                    self.close(rec, handle)
                    self.requests.finish(rec)

                return SSEResponse(self.stream(handle, prepared.fmt, rec), on_close)
            try:
                return await self.collect(request, handle, prepared.fmt, rec)
            finally:
                self.close(rec, handle)
        except APIError as e:
            rec.status, rec.error = e.status, e.message
            return JSONResponse(api.error_body(e), status_code=e.status, headers=e.headers)
        except ClientDisconnect:
            rec.status, rec.error = 499, "client disconnected"
            return Response(status_code=400)
        except Exception as e:  # noqa: BLE001
            log.exception("request %s failed", rid)
            rec.status, rec.error = 500, f"{type(e).__name__}: {e}"
            err = APIError(500, f"Internal server error ({type(e).__name__}); see the server "
                                f"log for request {rid}", code="internal_error")
            return JSONResponse(api.error_body(err), status_code=500)
        finally:
            if not handed_off:
                self.requests.finish(rec)

    async def prepare(self, request: Request, api: Api, rid: str, req: ApiRequest,
                      tenant: Tenant | None, rec: RequestRecord) -> Prepared:
        """Everything between the parsed request and the engine, the same for every API."""
        tokens, rendered = await self.request_tokens(request, req)
        release_body(request)  # parsed and tokenized: the body budget goes back
        rec.prompt_tokens = n = len(tokens)
        rules = None
        if req.chat is not None and self.tool_calls is not None:
            rules = self.tool_calls.rules(req.chat, self.opens_reasoning(tokens))
        grammar = None
        constraint = request_constraint(req.chat, req.output, self.tool_calls)
        if constraint is not None:
            grammar = await run_heavy(request, True, compile_constraint, self.engine,
                                      constraint, rules)
        opts = req.opts
        salt = hash_salt(opts.cache_salt)
        cache_point = rendered.cache_point if rendered is not None else None
        greq = GenerationRequest(
            prompt_tokens=tokens, max_tokens=self.max_tokens(opts.max_tokens, n),
            sampling=opts.sampling, stop=opts.stop, ignore_eos=opts.ignore_eos,
            logprobs=opts.logprobs, top_logprobs=opts.top_logprobs,
            post_sampling_probs=opts.post_sampling_probs,
            cache_salt=self.tenancy.salt(tenant, salt), cache_store=self.tenancy.stores(salt),
            public_prefix_tokens=self.tenancy.public_prefix_tokens(tokens),
            first_user_boundary=rendered.first_user_boundary if rendered else None,
            cache_point=cache_point, reuse_cache=req.reuse_cache, request_id=rid, n=opts.n,
            grammar=grammar,
            reasoning_budget=self.reasoning_budget(req.chat, tokens),
            n_keep=self.settings.n_keep if req.n_keep is None else req.n_keep,
            n_discard=req.n_discard,
            special_text=(rules is not None and rules.tool_format is not None
                          and self.tool_calls is not None
                          and self.tool_calls.name in ToolCalls.SPECIAL_MARKERS),
            fault=request.headers.get(FAULT_HEADER) if self.fault_injection else None)
        bs = max(1, self.info.block_size)
        pinned = cache_point - cache_point % bs if cache_point else 0
        prompt = PromptInfo(n, pinned, tuple(tokens), lambda: self.slots.slot_of(rid))
        return Prepared(greq, api.make_format(rid, req, rules, prompt))

    def max_tokens(self, requested: int | None, n_prompt: int) -> int:
        """The request's limit, else the server's default (`--n-predict`; none or -1: until
        the context is full), never past the context (unless the context shifts: then at
        most a context's worth of tokens)."""
        default = self.settings.default_max_tokens
        if default is not None and default <= 0:
            default = None
        ctx = self.info.ctx_size
        if self.info.context_shift:
            return requested or default or ctx
        return min(requested or default or ctx, ctx - n_prompt)

    def submit(self, greq: GenerationRequest, param: str) -> EngineHandle:
        try:
            return self.engine.submit(greq)
        except RequestRejected as e:
            err = bad_request(str(e), param, e.code)
            err.details = e.details
            raise err from None

    def reasoning_budget(self, chat: ChatInput | None, tokens: list[int]
                         ) -> ReasoningBudget | None:
        """A chat's reasoning budget as the engine forces it: the request's, else the
        server's; None when unlimited (-1), for a raw prompt, or when the template has no
        `<think>` ... `</think>` block (llama-server forces only a template's own end tag)."""
        if chat is None:
            return None
        budget = chat.reasoning_budget
        if budget < 0:
            budget = self.settings.reasoning_budget
        source = self.info.chat_template or ""
        if budget < 0 or THINK_END not in source:
            return None
        message = chat.reasoning_budget_message
        if message is None:
            message = self.settings.reasoning_budget_message
        end = tuple(self.engine.tokenize(THINK_END, False, True))
        forced = (tuple(self.engine.tokenize(message, False, True)) if message else ()) + end
        return ReasoningBudget(start=tuple(self.engine.tokenize(THINK_START, False, True)),
                               ends=(end,), forced=forced, budget=budget,
                               opened=prompt_opens_reasoning(
                                   self.engine.detokenize(tokens[-8:])))

    def opens_reasoning(self, tokens: list[int]) -> bool:
        """Whether the prompt ends inside a <think> block the template opened (the reply
        starts with reasoning)."""
        if self.tool_calls is None or not self.tool_calls.thinking:
            return False
        return prompt_opens_reasoning(self.engine.detokenize(tokens[-8:]))

    # ------------------------------------------------------------------ answering
    def close(self, rec: RequestRecord, handle: EngineHandle) -> None:
        """Idempotent end of a submitted request: cancel it if it is still running."""
        if self.active.pop(rec.id, None) is not None and rec.finish is None:
            handle.cancel()
            if rec.status == 200:
                rec.status, rec.error = 499, "client disconnected"

    def cancel_all(self) -> None:
        """Cancel every in-flight generation (their streams end with an error event)."""
        for handle in list(self.active.values()):
            handle.cancel()

    @staticmethod
    def _early_stop(fmt: ApiFormat, ev: FinishEvent) -> FinishEvent:
        """The cancellation a format asked for (`stop_requested`: llama-server's n_indent,
        t_max_predict_ms) is a normal end at the limit."""
        if ev.reason == "cancelled" and fmt.stop_requested:
            return replace(ev, reason="length")
        return ev

    async def collect(self, request: Request, handle: EngineHandle, fmt: ApiFormat,
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
        texts: dict[int, list[str]] = {}
        events: dict[int, list[TokenEvent]] = {}
        fins: dict[int, FinishEvent] = {}
        try:
            async for ev in handle:
                if isinstance(ev, FinishEvent):
                    fins[ev.index] = ev = self._early_stop(fmt, ev)
                    if ev.reason in ("error", "cancelled"):
                        break
                    continue
                self.slots.feed(rec.id, ev)
                if fmt.stop_requested:
                    continue  # generated before the stop took effect
                texts.setdefault(ev.index, []).append(ev.text)
                events.setdefault(ev.index, []).append(ev)
                fmt.watch(ev)
                if fmt.stop_requested:
                    handle.cancel()
        finally:
            watcher.cancel()
        failed = [f for f in fins.values() if f.reason in ("error", "cancelled")]
        rec.finish = failed[0] if failed else (merge_finishes(list(fins.values()))
                                               if fins else None)
        if rec.finish is None:
            raise RuntimeError("the engine ended the request without a FinishEvent")
        if disconnected.is_set():
            rec.status, rec.error = 499, "client disconnected"
            return Response(status_code=499)
        err = finish_error(rec.finish)
        if err is not None:
            raise err
        done: Choices = {i: ("".join(texts.get(i, [])), events.get(i, []), f)
                         for i, f in fins.items()}
        total = rec.finish
        body_bytes = await run_in_threadpool(lambda: json_bytes(fmt.response(done, total)))
        rec.client_finish_reason = fmt.client_finish_reason
        return Response(body_bytes, media_type="application/json")

    async def stream(self, handle: EngineHandle, fmt: ApiFormat,
                     rec: RequestRecord) -> AsyncIterator[bytes]:
        try:
            for c in fmt.stream_start():
                yield c
            fins: list[FinishEvent] = []
            failed: FinishEvent | None = None
            async for ev in handle:
                if isinstance(ev, FinishEvent):
                    ev = self._early_stop(fmt, ev)
                    if ev.reason in ("error", "cancelled"):
                        failed = ev
                        break
                    fins.append(ev)
                    for c in fmt.stream_finish(ev):
                        yield c
                    continue
                self.slots.feed(rec.id, ev)
                stopped = fmt.stop_requested
                for c in fmt.stream_token(ev):
                    yield c
                if not stopped and fmt.stop_requested:
                    handle.cancel()
            rec.finish = failed or (merge_finishes(fins) if fins else None)
            if rec.finish is None:
                raise RuntimeError("the engine ended the request without a FinishEvent")
            err = finish_error(rec.finish)
            if err is not None:
                rec.status, rec.error = err.status, err.message
                for c in fmt.stream_error(err):
                    yield c
            else:
                for c in fmt.stream_end(rec.finish):
                    yield c
                rec.client_finish_reason = fmt.client_finish_reason
        except Exception as e:  # noqa: BLE001 - report in-band, the status line is gone
            log.exception("stream %s failed", rec.id)
            rec.status, rec.error = 500, f"{type(e).__name__}: {e}"
            err = APIError(500, f"Internal server error ({type(e).__name__})",
                           code="internal_error")
            for c in fmt.stream_error(err):
                yield c

    # ------------------------------------------------------------------ slot restore
    async def warm(self, tokens: list[int], cache_salt: bytes | None, cache_store: bool) -> None:
        """Compute `tokens` into the cache under `cache_salt` (one generated token, discarded):
        a restored slot's conversation is then a cached prefix for the tenant whose keys
        those are (the caller's to choose: only a tenant's own slot files restore)."""
        greq = GenerationRequest(
            prompt_tokens=list(tokens), max_tokens=1, sampling=SamplingParams(temperature=0.0),
            cache_salt=cache_salt, cache_store=cache_store,
            public_prefix_tokens=self.tenancy.public_prefix_tokens(tokens),
            request_id="slot-restore-" + uuid.uuid4().hex[:16])
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
