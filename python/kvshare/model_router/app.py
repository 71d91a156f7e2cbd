"""The router's ASGI app: llama-server's router endpoints (tools/server/README.md "Using
multiple models", server-models.cpp server_models_routes), and every other request passed on
to the `kvshare serve` child of the model it names.

- GET /health: the router's own health.
- GET /models, /v1/models: every model with its `status` ({value, args[, preset][, failed,
  exit_code]}), `source`, `aliases`, `tags`.
- POST /models/load {"model"}: starts loading (returns at once: {"success": true});
  POST /models/unload {"model"}: stops the model's child.
- GET /props: the router's own (`role: router`); with ?model=NAME that model's.
- POST (and PUT, PATCH) requests go to the model their JSON body's `model` names; GET, HEAD and
  DELETE requests to the one their ?model= query names. A model that is not loaded is loaded
  first, unless autoload is off (`--no-models-autoload`; ?autoload=true|false per request).
  The answer, streamed or not, is passed on as it arrives (router/passthrough.py).
Errors in llama-server's words: 400 `model name is missing from the request`, `model 'X' not
found`, `model is not loaded`; in the shape of the API at the path (server/middleware.py
error_json). API keys guard everything but /health, as `kvshare serve`'s; the key goes on to
the child, which checks it too (its tenant keeps its own cache scope). CORS as `kvshare
serve`'s (server/cors.py, the --cors-* flags): preflights are answered by the router.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from kvshare import __version__
from kvshare.apis.llama_request import error_object
from kvshare.router.passthrough import (RESPONSE_DROP, BodyTooLarge, Passthrough,
                                        drop_hop_by_hop, forwarded_headers, proxy_client,
                                        read_body, upstream_url)
from kvshare.server.cors import CORSMiddleware, CORSPolicy
from kvshare.server.body import body_timeout_error
from kvshare.server.edge import BodyTimeout, EdgeLimits, EdgeMiddleware
from kvshare.server.errors import APIError
from kvshare.server.middleware import AuthMiddleware, error_json, route_path
from kvshare.server.tenancy import KeyRing

from .pool import LoadFailed, ModelPool, ModelState

log = logging.getLogger("kvshare.model_router")

METHODS = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]
BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
HEALTH_PATHS = frozenset({"/health", "/v1/health"})
MODELS_PATHS = frozenset({"/models", "/v1/models"})


@dataclass(frozen=True)
class ModelRouterSettings:
    models_max: int = 4
    autoload: bool = True
    max_body: int = 16 * 1024 * 1024
    timeout: float = 600.0  # the longest silence of a child's answer
    connect_timeout: float = 5.0
    body_timeout: float | None = 30.0  # a request body's longest pause (then 408)
    max_connections: int = 1024  # requests in progress (then 503)


def _router_error(status: int, message: str) -> JSONResponse:
    """An error of the router's own endpoints: llama-server's shape."""
    return JSONResponse({"error": error_object(status, message)}, status_code=status)


def _api_error(path: str, status: int, message: str, type: str | None = None) -> JSONResponse:
    """An error about a request to route: the shape of the API at `path`."""
    return JSONResponse(error_json(path, APIError(status, message, type=type)),
                        status_code=status)


def _autoload(request: Request, default: bool) -> bool:
    value = request.query_params.get("autoload")
    return default if not value else value in ("true", "1")


class ModelRouter:
    def __init__(self, pool: ModelPool, settings: ModelRouterSettings):
        self.pool = pool
        self.settings = settings
        self.client: httpx.AsyncClient | None = None
        self.started = int(time.time())
        self._tasks: set[asyncio.Task] = set()

    async def start(self) -> None:
        s = self.settings
        self.client = proxy_client(s.timeout, s.connect_timeout, keepalive=64)
        for st in self.pool.models.values():
            if st.entry.load_on_startup:
                await self.pool.load(st)

    async def stop(self) -> None:
        await self.pool.stop_all()
        if self.client is not None:
            await self.client.aclose()

    # ---- entry
    async def handle(self, request: Request) -> Any:
        path = route_path(request.scope)
        method = request.method
        if method in ("GET", "HEAD"):
            if path in HEALTH_PATHS:
                return JSONResponse({"status": "ok"})
            if path in MODELS_PATHS:
                return self.list_models()
            if path == "/props" and "model" not in request.query_params:
                return self.props()
        try:
            body = (await read_body(request, self.settings.max_body) if method in BODY_METHODS
                    else b"")
        except BodyTooLarge:
            return _api_error(path, 413, "Request body is larger than the limit of "
                              f"{self.settings.max_body} bytes")
        except ClientDisconnect:
            return Response(status_code=400)
        except BodyTimeout:
            err = body_timeout_error(self.settings.body_timeout)
            return JSONResponse(error_json(path, err), status_code=err.status,
                                headers=err.headers)
        if method == "POST" and path in ("/models/load", "/models/unload"):
            doc = self._json(body)
            name = doc.get("model") if isinstance(doc, dict) else None
            return await (self.load(name) if path == "/models/load" else self.unload(name))
        if method in BODY_METHODS:
            doc = self._json(body)
            if doc is None:
                return _api_error(path, 400, "the request body is not a JSON object")
            name = doc.get("model")
        else:
            name = request.query_params.get("model")
        return await self.route(request, path, name, body)

    @staticmethod
    def _json(body: bytes) -> dict | None:
        try:
            doc = json.loads(body) if body else None
        except (ValueError, RecursionError):
            return None
        return doc if isinstance(doc, dict) else None

    # ---- routing
    async def route(self, request: Request, path: str, name: Any, body: bytes) -> Any:
        if not isinstance(name, str) or not name:
            return _api_error(path, 400, "model name is missing from the request")
        s = self.pool.find(name)
        if s is None:
            return _api_error(path, 400, f"model '{name}' not found")
        if not s.running and not _autoload(request, self.settings.autoload):
            return _api_error(path, 400, "model is not loaded")
        self.pool.begin(s)  # counted from here: an eviction must not pick it while it loads
        try:
            await self.pool.ensure_loaded(s)
        except LoadFailed as e:
            self.pool.end(s)
            return _api_error(path, 503, str(e))
        except BaseException:
            self.pool.end(s)
            raise
        return await self._forward(request, path, s, body)

    async def _forward(self, request: Request, path: str, s: ModelState, body: bytes) -> Any:
        assert self.client is not None and s.url is not None
        url = upstream_url(request, s.url, request.scope.get("root_path", ""))
        upstream_req = self.client.build_request(request.method, url,
                                                 headers=forwarded_headers(request),
                                                 content=body or None)
        try:
            upstream = await self.client.send(upstream_req, stream=True)
        except httpx.HTTPError as e:
            self.pool.end(s)
            log.warning("%s %s via model %s failed: %s: %s", request.method, path,
                        s.entry.name, type(e).__name__, e)
            return _api_error(path, 502, f"the server of model '{s.entry.name}' failed: "
                              f"{type(e).__name__}")
        except BaseException:
            self.pool.end(s)
            raise

        def on_done(failure: str | None) -> None:
            self.pool.end(s)
            if failure is not None:
                log.warning("%s %s via model %s: the response broke off: %s",
                            request.method, path, s.entry.name, failure)

        headers = [(k.lower(), v) for k, v in drop_hop_by_hop(upstream.headers.raw,
                                                                RESPONSE_DROP)]
        return Passthrough(upstream, headers, None, on_done)

    # ---- router endpoints
    def list_models(self) -> JSONResponse:
        data = []
        for s in self.pool.models.values():
            e = s.entry
            status: dict[str, Any] = {"value": s.status, "args": s.argv}
            if e.preset_text is not None:
                status["preset"] = e.preset_text
            if s.failed:
                status["exit_code"] = s.exit_code
                status["failed"] = True
            data.append({"id": e.name, "aliases": e.aliases, "tags": e.tags,
                         "object": "model", "owned_by": "kvshare", "created": self.started,
                         "status": status,
                         "architecture": {"input_modalities": ["text"],
                                          "output_modalities": ["text"]},
                         "source": e.source, "can_remove": False})
        return JSONResponse({"data": data, "object": "list"})

    def props(self) -> JSONResponse:
        return JSONResponse({
            "role": "router", "max_instances": self.settings.models_max,
            "models_autoload": self.settings.autoload,
            # what llama-server answers for the web UI's sake: no model of its own
            "model_alias": "llama-server", "model_path": "none",
            "default_generation_settings": {"params": {}, "n_ctx": 0},
            "build_info": f"kvshare {__version__}"})

    async def load(self, name: Any) -> JSONResponse:
        s = self.pool.find(name) if isinstance(name, str) else None
        if s is None:
            return _router_error(404, "model is not found")
        if s.running:
            return _router_error(400, "model is already running")
        # as llama-server: the answer does not wait for the load (GET /models tells)
        task = asyncio.create_task(self.pool.load(s))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return JSONResponse({"success": True})

    async def unload(self, name: Any) -> JSONResponse:
        s = self.pool.find(name) if isinstance(name, str) else None
        if s is None:
            return _router_error(400, "model is not found")
        if not s.running:
            return _router_error(400, "model is not running")
        await self.pool.unload(s)
        return JSONResponse({"success": True})


def create_app(pool: ModelPool, settings: ModelRouterSettings, keys: KeyRing | None,
               cors: CORSPolicy | None = None,
               on_startup: Callable[[], None] | None = None) -> Starlette:
    router = ModelRouter(pool, settings)

    @asynccontextmanager
    async def lifespan(app: Starlette):
        await router.start()
        if on_startup is not None:
            on_startup()
        try:
            yield
        finally:
            await router.stop()

    # CORS outside the key check, as `kvshare serve`: a browser's preflight carries no key and
    # is answered here (a child's own CORS headers on an answer are replaced by the router's)
    # outermost, as in `kvshare serve` and `kvshare route`: requests in progress and body
    # deadlines are bounded before anything reads a body
    limits = EdgeLimits(body_timeout=settings.body_timeout,
                        max_connections=settings.max_connections,
                        max_body_bytes=settings.max_body)
    middleware = [Middleware(EdgeMiddleware, limits=limits, exempt=HEALTH_PATHS,
                             route_path=route_path),
                  Middleware(CORSMiddleware, policy=cors or CORSPolicy())]
    if keys:
        middleware.append(Middleware(AuthMiddleware, keys=keys))
    app = Starlette(routes=[Route("/{path:path}", router.handle, methods=METHODS)],
                    lifespan=lifespan, middleware=middleware)
    app.state.model_router = router
    return app
