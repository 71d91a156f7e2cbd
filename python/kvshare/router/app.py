"""`kvshare route`'s ASGI app: a reverse proxy that sends each request to the replica holding
its shared prefix.

It renders nothing: per request it reads the body (bounded), computes the prefix key
(prefix.py), asks `PrefixPolicy` (policy.py) for a backend among the healthy ones
(backends.py), forwards the request and passes the answer back as it arrives (an SSE stream is
never buffered). What it answers itself:
- GET /health: its own health (200 while any backend is healthy) and each backend's;
- GET /v1/models: the union of the healthy backends' model lists;
- GET /metrics: its own metrics (metrics.py), not a replica's;
- its own failures, in the error shape of the API at the request's path (the replicas' own
  `error_json`): 401 bad key, 408 body stopped arriving, 413 body too big, 503 nothing healthy
  or too many requests in progress, 502 the backend failed, 504 its response headers did not
  come within `timeout`.
Everything else, whatever the method or path, is proxied.

What a client or a backend can hold is bounded as in `kvshare serve`, with the same code:
`EdgeMiddleware` (server/edge.py: requests in progress, the body's gap and total deadlines),
Hypercorn's header timeout (launcher.py), and here a total deadline on a backend's response
headers (httpx's timeouts are per read: a backend trickling its headers never hits them).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import math
import time
from collections.abc import Callable
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Scope

from kvshare.server.body import body_timeout_error
from kvshare.server.edge import BodyTimeout, EdgeLimits, EdgeMiddleware
from kvshare.server.errors import APIError
from kvshare.server.middleware import error_json, is_anthropic_path
from kvshare.apis.llama_server import error_object

from .backends import Backend, BackendSet
from .metrics import RouterMetrics
from .passthrough import (RESPONSE_DROP, BodyTooLarge, Passthrough, drop_hop_by_hop,
                          forwarded_headers, proxy_client, read_body, upstream_url)
from .policy import Choice, PrefixPolicy
from .prefix import RESPONSES_PATHS, prefix_key, strip_root
from .sticky import IdPeeker, ResponseOwners, response_id_in_path

log = logging.getLogger("kvshare.router")

OPEN_PATHS = frozenset({"/health", "/v1/health"})  # as `kvshare serve`: no key needed
MODELS_PATHS = frozenset({"/v1/models", "/models"})
METHODS = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]

PARSE_OFF_LOOP = 256 * 1024  # bodies bigger than this are parsed on a worker thread


@dataclass(frozen=True)
class RouterSettings:
    backends: list[str]
    api_keys: tuple[str, ...] = ()
    health_interval: float = 2.0
    load_factor: float = 1.0
    overload_factor: float = 1.5
    spill_min: int = 32  # a backend with fewer requests in flight is never overloaded
    # upstream read timeout (the longest silence of a replica), and the deadline for its
    # response headers as a whole
    timeout: float = 600.0
    connect_timeout: float = 5.0
    max_body: int = 32 * 1024 * 1024
    root_path: str = ""
    response_owners: int = 100_000  # response ids remembered for previous_response_id
    # as `kvshare serve`'s flags: a client's request head and the gaps in its body (the whole
    # body: BODY_TOTAL_FACTOR x this), and requests in progress
    body_timeout: float = 30.0
    max_connections: int = 1024


def _error(path: str, status: int, message: str, code: str,
           headers: dict[str, str] | None = None, type: str | None = None) -> JSONResponse:
    """An error the router itself produces, in the shape of the API at `path`."""
    err = APIError(status, message, code=code, type=type)
    return JSONResponse(error_json(path, err), status_code=status, headers=headers)


class Router:
    def __init__(self, settings: RouterSettings):
        self.settings = settings
        urls = [u.rstrip("/") for u in settings.backends]  # a path is appended to each
        self.policy = PrefixPolicy(urls, load_factor=settings.load_factor,
                                   overload_factor=settings.overload_factor,
                                   spill_min=settings.spill_min)
        self.metrics = RouterMetrics(self.policy.backends)
        self.owners = ResponseOwners(settings.response_owners)
        self._keys = [k.encode() for k in settings.api_keys]
        self.client: httpx.AsyncClient | None = None
        self.backends = BackendSet(self.policy.backends, client=None,  # type: ignore[arg-type]
                                   interval=settings.health_interval,
                                   on_change=self._on_change)
        self._health_task: asyncio.Task | None = None

    # ---- lifecycle
    async def start(self) -> None:
        s = self.settings
        self.client = proxy_client(s.timeout, s.connect_timeout, keepalive=256)
        self.backends.client = self.client
        # before serving: a backend that does not answer yet is down from the start, not
        # found out by the first requests sent to it
        await self.backends.check_all(first=True)
        self._health_task = asyncio.create_task(self.backends.run())

    async def stop(self) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
            with suppress(asyncio.CancelledError):
                await self._health_task
        if self.client is not None:
            await self.client.aclose()

    def _on_change(self, b: Backend) -> None:
        self.metrics.up.labels(b.url).set(1 if b.healthy else 0)

    # ---- request entry
    def path_of(self, scope: Scope) -> str:
        return strip_root(scope.get("path", ""), self.settings.root_path or
                          scope.get("root_path", ""))

    async def handle(self, request: Request) -> Any:
        path = self.path_of(request.scope)
        method = request.method
        if path in OPEN_PATHS and method in ("GET", "HEAD"):
            return self.health()
        denied = self.check_auth(request, path)
        if denied is not None:
            # read the body first: answered with its body unread, the connection would be
            # closed under a client that reuses it for its next request
            try:
                await self.read_body(request)
            except (BodyTooLarge, ClientDisconnect, BodyTimeout):
                denied.headers["Connection"] = "close"
            return denied
        if method in ("GET", "HEAD") and path in MODELS_PATHS:
            return await self.models(request, path)
        if method in ("GET", "HEAD") and path == "/metrics":
            data = await run_in_threadpool(self.metrics.render)
            return Response(data, media_type="text/plain; version=0.0.4; charset=utf-8")
        try:
            body = await self.read_body(request)
        except BodyTooLarge:
            return _error(path, 413, "Request body is larger than the limit of "
                          f"{self.settings.max_body} bytes", "request_too_large",
                          headers={"Connection": "close"})
        except ClientDisconnect:
            return Response(status_code=400)  # nobody is listening
        except BodyTimeout:
            return self._body_timeout(path)
        return await self.forward(request, path, body)

    def _body_timeout(self, path: str) -> JSONResponse:
        err = body_timeout_error(self.settings.body_timeout)
        return JSONResponse(error_json(path, err), status_code=err.status, headers=err.headers)

    def check_auth(self, request: Request, path: str) -> Response | None:
        """None when no keys are configured or the request carries one of them (as `kvshare
        serve` checks: Authorization: Bearer, else x-api-key); else the 401."""
        if not self._keys:
            return None
        given: bytes | None = None
        auth = request.headers.get("authorization")
        if auth is not None:
            scheme, _, value = auth.partition(" ")
            if scheme.lower() == "bearer":
                given = value.strip().encode()
        if given is None and "x-api-key" in request.headers:
            given = request.headers["x-api-key"].encode()
        if given is not None:
            ok = False
            for k in self._keys:  # every key compared: the time does not tell which matched
                ok |= hmac.compare_digest(given, k)
            if ok:
                return None
        msg = ("Missing API key: send 'Authorization: Bearer <key>'" if given is None
               else "Invalid API key")
        return _error(path, 401, msg, "invalid_api_key", headers={"WWW-Authenticate": "Bearer"},
                      type="authentication_error" if is_anthropic_path(path) else None)

    async def read_body(self, request: Request) -> bytes:
        return await read_body(request, self.settings.max_body)

    # ---- routing
    @staticmethod
    def _json(request: Request, body: bytes) -> dict | None:
        ctype = request.headers.get("content-type", "").lower()
        # curl -d sends x-www-form-urlencoded; the replicas read such a body as JSON too
        if "json" not in ctype and body[:64].lstrip()[:1] != b"{":
            return None
        try:
            value = json.loads(body)
        except (ValueError, RecursionError):
            return None  # the backend answers it with its own 400
        return value if isinstance(value, dict) else None

    async def parse(self, request: Request, body: bytes) -> dict | None:
        if not body:
            return None
        if len(body) > PARSE_OFF_LOOP:  # a 32 MiB body takes the event loop ~0.1 s
            return await run_in_threadpool(self._json, request, body)
        return self._json(request, body)

    def choose(self, method: str, path: str, doc: dict | None,
               exclude: frozenset[str] = frozenset()) -> tuple[Choice | None, bool]:
        """(where the request goes, whether it had a prefix key); (None, _) when nothing is
        healthy."""
        healthy = [u for u in self.backends.healthy() if u not in exclude]
        # a stored response lives on the replica that produced it: follow-ups go there
        rid = response_id_in_path(path)
        if rid is None and doc is not None and path.rstrip("/") in RESPONSES_PATHS:
            prev = doc.get("previous_response_id")
            rid = prev if isinstance(prev, str) else None
        if rid is not None:
            owner = self.owners.get(rid)
            if owner is not None and owner in healthy:
                return Choice(owner, "response"), False
        key = prefix_key(path, doc) if doc is not None else None
        choice = self.policy.choose(key, self.backends.inflight(), healthy,
                                    now=time.monotonic())
        return choice, key is not None

    def _upstream_headers(self, request: Request) -> list[tuple[bytes, bytes]]:
        return forwarded_headers(request)

    def _target(self, request: Request, backend: str) -> str:
        return upstream_url(request, backend,
                            self.settings.root_path or request.scope.get("root_path", ""))

    async def forward(self, request: Request, path: str, body: bytes) -> Any:
        assert self.client is not None, "the router has not started"
        doc = await self.parse(request, body)
        headers = self._upstream_headers(request)
        method = request.method
        tried: set[str] = set()
        for _attempt in range(2):  # the first choice, and once more after a connect error
            choice, keyed = self.choose(method, path, doc, frozenset(tried))
            if choice is None:
                return self._unavailable(path)
            backend = choice.backend
            tried.add(backend)
            upstream_req = self.client.build_request(
                method, self._target(request, backend), headers=headers,
                content=body if body else None)
            self.backends.begin(backend)
            self.metrics.inflight.labels(backend).inc()
            t0 = time.perf_counter()
            try:
                upstream = await asyncio.wait_for(
                    self.client.send(upstream_req, stream=True), self.settings.timeout)
            except asyncio.TimeoutError:
                # the request was sent: no retry (it may be running)
                self._done(backend)
                self.metrics.error(backend, "header_timeout")
                log.warning("%s %s via %s: no response headers within %g s", method, path,
                            backend, self.settings.timeout)
                return _error(path, 504, "The backend sent no response headers within "
                              f"{self.settings.timeout:g} s", "gateway_timeout")
            except (httpx.ConnectError, httpx.ConnectTimeout) as e:
                # nothing reached the backend: it is down, and the request may go elsewhere
                self._done(backend)
                self.metrics.error(backend, "connect")
                self.backends.mark_down(backend, f"{type(e).__name__}: {e}")
                continue
            except httpx.HTTPError as e:
                # the request was (maybe) sent: repeating it could run it twice
                self._done(backend)
                self.metrics.error(backend, "upstream")
                log.warning("%s %s via %s failed: %s: %s", method, path, backend,
                            type(e).__name__, e)
                return _error(path, 502, f"The backend failed: {type(e).__name__}",
                              "bad_gateway")
            except BaseException:
                self._done(backend)
                raise
            self.metrics.latency.labels(backend).observe(time.perf_counter() - t0)
            self.metrics.routed(backend, choice.reason, keyed, choice.at_home)
            log.debug("%s %s -> %s (%s) %d", method, path, backend, choice.reason,
                      upstream.status_code)
            if upstream.status_code >= 500:
                self.metrics.error(backend, "status_5xx")
            return self._passthrough(upstream, backend, method, path)
        if not self.backends.healthy():  # both tries found their backend down: now none is up
            return self._unavailable(path)
        return _error(path, 502, "No backend could be reached", "bad_gateway")

    def _unavailable(self, path: str) -> JSONResponse:
        self.metrics.error("none", "no_backend")
        n = len(self.backends.backends)
        return _error(path, 503, f"No healthy backend (of {n}) can take the request",
                      "service_unavailable", headers={"Retry-After": str(max(1, math.ceil(
                          self.settings.health_interval)))})

    def _done(self, backend: str) -> None:
        self.backends.end(backend)
        self.metrics.inflight.labels(backend).dec()

    def _passthrough(self, upstream: httpx.Response, backend: str, method: str,
                     path: str) -> Passthrough:
        on_chunk = None
        if (method == "POST" and path.rstrip("/") in RESPONSES_PATHS
                and upstream.status_code == 200):
            peeker = IdPeeker()

            def on_chunk(chunk: bytes) -> None:
                if not peeker.done and peeker.feed(chunk):
                    self.owners.put(peeker.found, backend)  # type: ignore[arg-type]

        def on_done(failure: str | None) -> None:
            self._done(backend)
            if failure is not None:
                self.metrics.error(backend, "stream")
                log.warning("%s %s via %s: the response broke off: %s", method, path, backend,
                            failure)

        # ASGI wants lower-case header names; duplicates (Set-Cookie) are kept
        headers = [(k.lower(), v) for k, v in drop_hop_by_hop(upstream.headers.raw,
                                                                RESPONSE_DROP)]
        return Passthrough(upstream, headers, on_chunk, on_done)

    # ---- router-owned endpoints
    def health(self) -> JSONResponse:
        backends = [{"url": b.url, "healthy": b.healthy, "inflight": b.inflight}
                    for b in self.backends.backends.values()]
        if any(b["healthy"] for b in backends):
            return JSONResponse({"status": "ok", "backends": backends})
        return JSONResponse({"status": "unavailable", "backends": backends,
                             "error": error_object(503, "No backend is healthy")},
                            status_code=503)

    async def models(self, request: Request, path: str) -> Response:
        """The union by `id` of the healthy backends' model lists (first listed wins)."""
        assert self.client is not None
        healthy = self.backends.healthy()
        if not healthy:
            return self._unavailable(path)
        headers = self._upstream_headers(request)

        async def ask(url: str) -> httpx.Response | None:
            try:
                return await self.client.get(f"{url}/v1/models", headers=headers,
                                             timeout=max(5.0, self.backends.check_timeout))
            except (httpx.ConnectError, httpx.ConnectTimeout) as e:
                self.metrics.error(url, "connect")
                self.backends.mark_down(url, f"{type(e).__name__}: {e}")
            except httpx.HTTPError:
                self.metrics.error(url, "upstream")
            return None

        answers = await asyncio.gather(*(ask(u) for u in healthy))
        data: dict[str, Any] = {}
        refused: httpx.Response | None = None
        answered = False
        for r in answers:
            if r is None:
                continue
            if r.status_code != 200:
                refused = refused or r
                continue
            try:
                items = r.json().get("data")
            except (ValueError, AttributeError):
                continue
            answered = True
            for m in items if isinstance(items, list) else ():
                if isinstance(m, dict) and isinstance(m.get("id"), str):
                    data.setdefault(m["id"], m)
        if not answered and refused is not None:  # e.g. every backend wants a key: say so
            return Response(refused.content, status_code=refused.status_code,
                            headers={k: v for k, v in refused.headers.items()
                                     if k.lower() in ("content-type", "www-authenticate")})
        if not answered:
            return _error(path, 502, "No backend answered /v1/models", "bad_gateway")
        return JSONResponse({"object": "list", "data": list(data.values())})


def create_app(settings: RouterSettings, on_startup: Callable[[], None] | None = None
               ) -> Starlette:
    router = Router(settings)

    @asynccontextmanager
    async def lifespan(app: Starlette):
        await router.start()
        if on_startup is not None:
            on_startup()
        try:
            yield
        finally:
            await router.stop()

    limits = EdgeLimits(body_timeout=settings.body_timeout,
                        max_connections=settings.max_connections,
                        max_body_bytes=settings.max_body)
    app = Starlette(routes=[Route("/{path:path}", router.handle, methods=METHODS)],
                    lifespan=lifespan,
                    middleware=[Middleware(EdgeMiddleware, limits=limits,
                                           exempt=OPEN_PATHS | {"/metrics"},
                                           route_path=router.path_of)])
    app.state.router = router
    app.state.edge = limits
    return app
