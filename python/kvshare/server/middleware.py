"""The ASGI layers around the routes that are the server's own: the mount prefix behind a
reverse proxy (`RootPathMiddleware`), API-key auth naming the tenant (`AuthMiddleware`), and
errors in the shape of the API at the request's path (`error_json` and the handlers)."""

from __future__ import annotations

import logging

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from kvshare.apis.anthropic import anthropic_error
from kvshare.apis.llama_request import llama_error_body

from .errors import HTTP_CODES, APIError, error_body
from .tenancy import KeyRing

log = logging.getLogger("kvshare.server")

OPEN_PATHS = frozenset({"/health", "/v1/health"})
_ANTHROPIC_PATHS = frozenset({"/v1/messages", "/messages", "/v1/messages/count_tokens",
                              "/messages/count_tokens"})
# llama-server's own endpoints: its error shape ({"error": {"code", "message", "type"}})
# (GET /slots keeps kvshare's OpenAI-shaped 401, as before it took llama-server's shape)
_NATIVE_PATHS = frozenset({"/completion", "/completions", "/infill", "/props",
                           "/apply-template"})


def route_path(scope: Scope) -> str:
    """The path the router sees: `path` minus `root_path` when the proxy left the prefix on."""
    path, root = scope.get("path", ""), scope.get("root_path", "")
    if root and path.startswith(root) and (len(path) == len(root) or path[len(root)] == "/"):
        return path[len(root):] or "/"
    return path


def is_anthropic_path(path: str) -> bool:
    return path.rstrip("/") in _ANTHROPIC_PATHS


def is_native_path(path: str) -> bool:
    p = path.rstrip("/")
    return p in _NATIVE_PATHS or p.startswith("/slots/")


def error_json(path: str, err: APIError) -> dict:
    """An error body in the shape the API at `path` uses (Anthropic's on /v1/messages,
    llama-server's on its native endpoints, OpenAI's elsewhere)."""
    if is_anthropic_path(path):
        return anthropic_error(err)
    return llama_error_body(err) if is_native_path(path) else err.body()


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


async def http_error(request: Request, exc: Exception) -> Response:
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


async def api_error(request: Request, exc: Exception) -> Response:
    """An APIError an endpoint raised, in the shape of the API at its path (`error_json`)."""
    assert isinstance(exc, APIError)
    return JSONResponse(error_json(route_path(request.scope), exc), status_code=exc.status,
                        headers=exc.headers)


async def server_error(request: Request, exc: Exception) -> Response:
    log.error("unhandled error on %s %s", request.method, request.url.path,
              exc_info=(type(exc), exc, exc.__traceback__))
    return JSONResponse(error_body(f"Internal server error ({type(exc).__name__})",
                                   type="server_error", code="internal_error"), status_code=500)
