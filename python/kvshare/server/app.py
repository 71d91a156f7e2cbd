"""The Starlette application: kvshare's HTTP server over an `EngineClient`.

`create_app(engine, settings)` builds the route table and the middleware; the work is done by
the generation pipeline (`pipeline.py`, every API's generation requests) and by the APIs
(`kvshare.apis`, one module each). Its lifespan starts the engine and shuts it down.
"""

from __future__ import annotations

from contextlib import asynccontextmanager
from typing import Callable

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from kvshare.apis import anthropic, openai_chat
from kvshare.apis.anthropic import MessagesApi
from kvshare.apis.base import Api
from kvshare.apis.llama_info import LlamaInfoEndpoints
from kvshare.apis.llama_server import InfillApi, NativeCompletionApi
from kvshare.apis.llama_slots import SlotEndpoints, SlotTable
from kvshare.apis.openai_chat import ChatCompletionsApi
from kvshare.apis.openai_completions import CompletionsApi
from kvshare.apis.openai_format import system_fingerprint
from kvshare.apis.responses import ResponsesApi, ResponseStore, StoredResponseEndpoints
from kvshare.engine.api import EngineClient

from .cors import CORSMiddleware, CORSPolicy
from .edge import EdgeCollector, EdgeLimits, EdgeMiddleware
from .endpoints import ServerEndpoints
from .errors import APIError
from .idle_sleep import IdleSleepMiddleware, SleepingEngine
from .metrics import ServerMetrics
from .middleware import (OPEN_PATHS, AuthMiddleware, RootPathMiddleware, api_error, http_error,
                         route_path, server_error)
from .pipeline import GenerationPipeline, chat_prompt
from .server_tools.routes import ServerTools
from .request_log import RequestLog
from .settings import ServerSettings
from .tenancy import TenantMetrics, build_tenancy
from .webui import WebUI


class KVShareServer:
    """The server's parts, wired once: the pipeline, the APIs and the endpoints."""

    def __init__(self, engine: EngineClient, settings: ServerSettings):
        self.engine, self.settings = engine, settings
        info = engine.info
        self.metrics = ServerMetrics(engine)
        self.edge = EdgeLimits.from_settings(settings)
        # cache scope, API keys, public prefixes (tokenized here; TenancyError when bad)
        self.tenancy = build_tenancy(settings, lambda text: engine.tokenize(text, True, True),
                                     lambda chat: chat_prompt(engine, chat).tokens)
        self.tenant_metrics = TenantMetrics(self.metrics.registry, self.tenancy.keyring)
        # llama-server's slots, emulated over the shared pool (apis.llama_slots)
        self.slot_table = SlotTable(info.parallel)
        # the page at / and its state (webui.py); it follows the requests beside the slots
        self.webui = WebUI(engine, self.tenancy.keyring) if settings.webui else None
        observer = (self.webui.observer(self.slot_table) if self.webui is not None
                    else self.slot_table)
        self.pipeline = GenerationPipeline(
            engine, settings, self.tenancy,
            RequestLog(self.metrics, self.tenant_metrics, observer))
        fingerprint = system_fingerprint(info.fingerprint)
        self.response_store = ResponseStore(ttl_s=settings.response_ttl_s)
        self.chat = ChatCompletionsApi(settings.reasoning_format, fingerprint)
        self.completions = CompletionsApi(engine, fingerprint)
        self.messages = MessagesApi()
        self.responses = ResponsesApi(self.response_store)
        self.native = NativeCompletionApi(engine, settings.default_max_tokens)
        self.infill = InfillApi(engine, settings.default_max_tokens)
        self.stored_responses = StoredResponseEndpoints(self.pipeline, self.responses)
        self.slots = SlotEndpoints(self.pipeline, self.slot_table)
        self.llama_info = LlamaInfoEndpoints(self.pipeline, len(self.slot_table), fingerprint)
        self.server = ServerEndpoints(self.pipeline, self.metrics)
        # /tools and /cors-proxy (llama-server's --tools, MCP servers, --ui-mcp-proxy)
        self.tools = ServerTools(settings.tools, settings)

    @property
    def body_timeout(self) -> float | None:
        return self.settings.body_timeout

    def in_flight(self) -> int:
        """Generations submitted and not yet ended."""
        return len(self.pipeline.active)

    def begin_shutdown(self) -> None:
        """Refuse new completions (503) and report unhealthy; in-flight ones go on."""
        self.pipeline.shutting_down = True

    def cancel_all(self) -> None:
        """Cancel every in-flight generation (their streams end with an error event)."""
        self.pipeline.cancel_all()

    def generate(self, api: Api) -> Callable[[Request], object]:
        """The endpoint of one generation API: the pipeline with that API."""
        async def endpoint(request: Request) -> Response:
            return await self.pipeline.handle(request, api)
        return endpoint

    def routes(self) -> list[Route]:
        pipeline = self.pipeline

        def both(path: str, ep, methods: list[str]) -> list[Route]:
            return [Route("/v1" + path, ep, methods=methods), Route(path, ep, methods=methods)]

        async def input_tokens(request: Request) -> Response:
            return await openai_chat.input_tokens(pipeline, self.chat, request)

        async def count_tokens(request: Request) -> Response:
            return await anthropic.count_tokens(pipeline, request)

        info, server = self.llama_info, self.server
        return [
            # OpenAI
            *both("/chat/completions", self.generate(self.chat), ["POST"]),
            *both("/chat/completions/input_tokens", input_tokens, ["POST"]),
            Route("/v1/completions", self.generate(self.completions), methods=["POST"]),
            *both("/responses", self.generate(self.responses), ["POST"]),
            *both("/responses/{response_id}", self.stored_responses.get, ["GET"]),
            *both("/responses/{response_id}", self.stored_responses.delete, ["DELETE"]),
            # Anthropic
            *both("/messages", self.generate(self.messages), ["POST"]),
            *both("/messages/count_tokens", count_tokens, ["POST"]),
            # llama-server (/completions and /completion are its own)
            Route("/completions", self.generate(self.native), methods=["POST"]),
            Route("/completion", self.generate(self.native), methods=["POST"]),
            Route("/infill", self.generate(self.infill), methods=["POST"]),
            Route("/props", info.props, methods=["GET"]),
            Route("/props", info.post_props, methods=["POST"]),
            Route("/apply-template", info.apply_template, methods=["POST"]),
            Route("/tokenize", info.tokenize, methods=["POST"]),
            Route("/detokenize", info.detokenize, methods=["POST"]),
            Route("/slots", self.slots.list, methods=["GET"]),
            Route("/slots/{id_slot}", self.slots.action, methods=["POST"]),
            # the server's own
            *both("/models", server.models, ["GET"]),
            *both("/health", server.health, ["GET"]),
            Route("/metrics", server.metrics_endpoint, methods=["GET"]),
            Route("/cache", server.cache, methods=["GET"]),
            *self.tools.routes(),
            *(self.webui.routes() if self.webui is not None else []),
        ]

    def middleware(self) -> list[Middleware]:
        settings = self.settings
        layers = []
        if settings.root_path:
            layers.append(Middleware(RootPathMiddleware, root_path=settings.root_path))
        # CORS (cors.py) outside the auth: a browser's preflight carries no key
        layers.append(Middleware(CORSMiddleware, policy=CORSPolicy(
            settings.cors_origins, settings.cors_methods, settings.cors_headers,
            settings.cors_credentials)))
        # connection limit and body deadline (edge.py), before anything reads the body
        layers.append(Middleware(EdgeMiddleware, limits=self.edge,
                                 exempt=OPEN_PATHS | {"/metrics"}, route_path=route_path))
        # the page's own files, before auth: they hold no data (its state is behind the key)
        if self.webui is not None:
            layers.append(self.webui.middleware())
        if self.tenancy.keyring is not None:
            layers.append(Middleware(AuthMiddleware, keys=self.tenancy.keyring))
        # idle sleep (`--sleep-idle-seconds`), innermost: a refused request wakes nothing
        if isinstance(self.engine, SleepingEngine):
            layers.append(Middleware(IdleSleepMiddleware, engine=self.engine))
        return layers


def create_app(engine: EngineClient, settings: ServerSettings | None = None, *,
               on_startup: Callable[[], None] | None = None) -> Starlette:
    """The ASGI app. Its lifespan calls `engine.start()` and, at shutdown, `engine.shutdown()`.
    `app.state.server` is the `KVShareServer` (for `begin_shutdown` / `cancel_all`)."""
    settings = settings or ServerSettings()
    srv = KVShareServer(engine, settings)
    srv.metrics.registry.register(EdgeCollector(srv.edge))

    @asynccontextmanager
    async def lifespan(app: Starlette):
        await run_in_threadpool(engine.start)
        await run_in_threadpool(srv.tools.start)  # MCP servers: spawned to list their tools
        if on_startup is not None:
            on_startup()
        try:
            yield
        finally:
            srv.begin_shutdown()
            srv.tools.shutdown()
            await run_in_threadpool(engine.shutdown)

    app = Starlette(
        routes=srv.routes(), middleware=srv.middleware(), lifespan=lifespan,
        exception_handlers={HTTPException: http_error, APIError: api_error,
                            Exception: server_error},
    )
    app.state.server = srv
    return app
