"""CORS: lets web pages on allowed origins call the API from a browser.

A pure ASGI middleware, outside the auth middleware (a browser sends its preflight without the
`Authorization` header, so preflights are answered without a key):

- a preflight (`OPTIONS` with `Origin` and `Access-Control-Request-Method`) gets 200 with an
  empty body, as llama-server answers every preflight; from an allowed origin it carries
  `Access-Control-Allow-Origin: <origin>`, the allowed methods, the allowed headers (by
  default the ones the browser asked for), `Access-Control-Allow-Credentials`,
  `Access-Control-Max-Age` and `Vary: Origin`; from any other origin only `Vary: Origin`, so
  the browser refuses the page's request without the server saying more;
- any other request from an allowed origin is served as usual, its response (errors, a 401 and
  SSE streams included) carrying `Access-Control-Allow-Origin: <origin>`; from another origin it
  is served without that header, so the browser does not let the page read it;
- a request without `Origin` (curl, SDKs, servers) is untouched.

Allowed origins: loopback ones (`http(s)://localhost`, `127.0.0.1`, `[::1]`, any port) always;
`--cors-origins` adds more (exact `scheme://host[:port]`), `*` allows every origin. llama-server
differs: by default it echoes any `Origin` (see docs/llama-server.md).
"""

from __future__ import annotations

from typing import Iterable
from urllib.parse import urlsplit

from starlette.types import ASGIApp, Message, Receive, Scope, Send

DEFAULT_METHODS = "GET, POST, DELETE, OPTIONS"
# When the preflight names no headers (or --cors-headers is not set and the browser asks for
# none): what a page calling the OpenAI or Anthropic API sends.
DEFAULT_HEADERS = ("Authorization, Content-Type, X-Api-Key, anthropic-version, anthropic-beta, "
                   "OpenAI-Organization, OpenAI-Project, X-Request-Id")
MAX_AGE_S = 600
LOOPBACK_HOSTS = frozenset({"localhost", "127.0.0.1", "::1"})


def normalize_origin(origin: str) -> str:
    """`scheme://host[:port]` lowercased, without a trailing slash ("*" stays "*")."""
    return origin.strip().rstrip("/").lower()


def is_loopback_origin(origin: str) -> bool:
    """`http(s)://localhost|127.0.0.1|[::1]` with any port (and nothing after it)."""
    try:
        parts = urlsplit(origin.strip())
        host = parts.hostname
        parts.port  # noqa: B018 - raises ValueError on a bad port
    except ValueError:
        return False
    return (parts.scheme in ("http", "https") and host in LOOPBACK_HOSTS
            and parts.path in ("", "/") and not parts.query and not parts.fragment
            and not parts.username and not parts.password)


def parse_origins(value: str | Iterable[str] | None) -> list[str]:
    """A comma-separated list (or a list of such) as normalized origins. llama-server's
    special value `localhost` means the loopback origins, which kvshare always allows."""
    if value is None:
        return []
    items = [value] if isinstance(value, str) else list(value)
    out: list[str] = []
    for item in items:
        for o in str(item).split(","):
            o = normalize_origin(o)
            if o and o != "localhost" and o not in out:
                out.append(o)
    return out


class CORSPolicy:
    def __init__(self, origins: Iterable[str] = (), methods: str | None = None,
                 headers: str | None = None, credentials: bool = True,
                 max_age: int = MAX_AGE_S):
        self.origins = frozenset(parse_origins(list(origins)))
        self.any_origin = "*" in self.origins
        self.methods = methods or DEFAULT_METHODS
        # None or "*": echo what the browser asks for (a literal "*" is not honoured by
        # browsers for requests with credentials)
        self.headers = None if headers in (None, "", "*") else headers
        self.credentials = credentials
        self.max_age = max_age

    def allows(self, origin: str) -> bool:
        if self.any_origin:
            return True
        if origin == "null":
            return False
        return is_loopback_origin(origin) or normalize_origin(origin) in self.origins


def _header(scope: Scope, name: bytes) -> bytes | None:
    for k, v in scope.get("headers") or ():
        if k.lower() == name:
            return v
    return None


class CORSMiddleware:
    def __init__(self, app: ASGIApp, policy: CORSPolicy):
        self.app = app
        self.policy = policy

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        raw = _header(scope, b"origin")
        if raw is None:
            return await self.app(scope, receive, send)
        origin = raw.decode("latin-1").strip()
        allowed = self.policy.allows(origin)
        if scope.get("method") == "OPTIONS" and _header(
                scope, b"access-control-request-method") is not None:
            return await self._preflight(scope, send, origin, allowed)
        extra: list[tuple[bytes, bytes]] = []
        if allowed:
            extra.append((b"access-control-allow-origin", raw.strip()))
            if self.policy.credentials:
                extra.append((b"access-control-allow-credentials", b"true"))

        async def send_with_cors(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers") or ()
                           if k.lower() not in (b"access-control-allow-origin",
                                                b"access-control-allow-credentials")]
                headers = _add_vary(headers) + extra
                message = dict(message, headers=headers)
            await send(message)

        await self.app(scope, receive, send_with_cors)

    async def _preflight(self, scope: Scope, send: Send, origin: str, allowed: bool) -> None:
        headers: list[tuple[bytes, bytes]] = [(b"vary", b"Origin"), (b"content-length", b"0")]
        if not allowed:
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            await send({"type": "http.response.body", "body": b""})
            return
        p = self.policy
        asked = _header(scope, b"access-control-request-headers")
        allow_headers = p.headers
        if allow_headers is None:
            allow_headers = asked.decode("latin-1").strip() if asked and asked.strip() \
                else DEFAULT_HEADERS
        headers += [
            (b"access-control-allow-origin", origin.encode("latin-1")),
            (b"access-control-allow-methods", p.methods.encode("latin-1")),
            (b"access-control-allow-headers", allow_headers.encode("latin-1")),
            (b"access-control-max-age", str(p.max_age).encode()),
        ]
        if p.credentials:
            headers.append((b"access-control-allow-credentials", b"true"))
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": b""})


def _add_vary(headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """`Vary: Origin` merged into an existing Vary header."""
    out, merged = [], False
    for k, v in headers:
        if k.lower() == b"vary" and not merged:
            names = [x.strip().lower() for x in v.split(b",")]
            if b"origin" not in names and b"*" not in names:
                v = v + b", Origin"
            merged = True
        out.append((k, v))
    if not merged:
        out.append((b"vary", b"Origin"))
    return out
