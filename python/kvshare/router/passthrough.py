"""Proxying pieces shared by kvshare's routers (`kvshare route`'s replica router, router/app.py,
and the multi-model router, model_router/): which headers pass a proxy, the request body read
under the size limit, the upstream URL, the upstream client, and an ASGI response that passes
an upstream response on as it arrives (an SSE stream is never buffered)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from urllib.parse import quote

import anyio
import httpx
from starlette.requests import Request
from starlette.types import Receive, Scope, Send

from .prefix import strip_root

# Hop-by-hop headers (RFC 9110 7.6.1) concern one connection, not the request: never
# forwarded either way. Host and Content-Length are set anew for the backend's connection.
HOP_BY_HOP = frozenset({"connection", "keep-alive", "transfer-encoding", "te", "upgrade",
                        "trailer", "host", "content-length"})
# Hypercorn adds its own Date and Server to every response; the backend's would repeat them.
RESPONSE_DROP = frozenset({"date", "server"})


def drop_hop_by_hop(headers: Iterable[tuple[bytes, bytes]],
                     also: frozenset[str] = frozenset()) -> list[tuple[bytes, bytes]]:
    """`headers` minus the hop-by-hop ones, Proxy-*, those the Connection header names and
    `also`."""
    headers = list(headers)
    named = {t.strip().lower() for k, v in headers if k.lower() == b"connection"
             for t in v.decode("latin-1").split(",")}
    out = []
    for k, v in headers:
        name = k.decode("latin-1").lower()
        if name in HOP_BY_HOP or name in named or name in also or name.startswith("proxy-"):
            continue
        out.append((k, v))
    return out


class Passthrough:
    """An ASGI response that passes an upstream (streamed) response on chunk by chunk, as it
    arrives. The upstream response is closed when it ends, when the client disconnects, or
    when passing it on fails; `on_done` runs once in every case."""

    def __init__(self, upstream: httpx.Response, headers: list[tuple[bytes, bytes]],
                 on_chunk: Callable[[bytes], None] | None,
                 on_done: Callable[[str | None], None]):
        self.upstream = upstream
        self.headers = headers
        self.on_chunk = on_chunk
        self.on_done = on_done

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        failure: str | None = None
        try:
            await send({"type": "http.response.start", "status": self.upstream.status_code,
                        "headers": self.headers})
            async with anyio.create_task_group() as tg:
                async def watch_disconnect() -> None:
                    # the request body was read already: the next message is the disconnect
                    while (await receive())["type"] != "http.disconnect":
                        pass
                    tg.cancel_scope.cancel()  # stops the copy below: the stream is closed

                tg.start_soon(watch_disconnect)
                try:
                    async for chunk in self.upstream.aiter_raw():
                        if self.on_chunk is not None:
                            self.on_chunk(chunk)
                        await send({"type": "http.response.body", "body": chunk,
                                    "more_body": True})
                except httpx.HTTPError as e:
                    failure = f"{type(e).__name__}: {e}"
                else:
                    await send({"type": "http.response.body", "body": b"",
                                "more_body": False})
                tg.cancel_scope.cancel()
            # On a failure the response is left incomplete: the server then closes the
            # connection, so the client sees a cut stream rather than a short one that looks
            # whole.
        finally:
            with anyio.CancelScope(shield=True):
                await self.upstream.aclose()
            self.on_done(failure)


def forwarded_headers(request: Request) -> list[tuple[bytes, bytes]]:
    """The client's request headers for the backend: hop-by-hop ones dropped, X-Forwarded-*
    set anew."""
    # X-Forwarded-* are set below; Expect: 100-continue was for the router, which has
    # the whole body already
    headers = drop_hop_by_hop(request.scope.get("headers") or [],
                              frozenset({"x-forwarded-for", "x-forwarded-proto",
                                         "x-forwarded-host", "expect"}))
    client = request.client.host if request.client else None
    prior = request.headers.get("x-forwarded-for")
    if client is not None:
        headers.append((b"x-forwarded-for",
                        (f"{prior}, {client}" if prior else client).encode("latin-1")))
    elif prior:
        headers.append((b"x-forwarded-for", prior.encode("latin-1")))
    proto = request.headers.get("x-forwarded-proto") or request.url.scheme
    headers.append((b"x-forwarded-proto", proto.encode("latin-1")))
    host = request.headers.get("x-forwarded-host") or request.headers.get("host")
    if host:
        headers.append((b"x-forwarded-host", host.encode("latin-1")))
    return headers


def proxy_client(timeout: float, connect_timeout: float, keepalive: int) -> httpx.AsyncClient:
    """The upstream client of a router: no pool limit (the servers' own admission control
    bounds concurrency, and a proxy that queues requests in its pool hides that load), no
    redirects or proxy settings from the environment, and none of httpx's default request
    headers: without Accept-Encoding from the client, an upstream must not compress what is
    passed back unchanged."""
    client = httpx.AsyncClient(
        timeout=httpx.Timeout(timeout, connect=connect_timeout),
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=keepalive),
        follow_redirects=False, trust_env=False)
    for name in ("accept", "accept-encoding", "user-agent"):
        client.headers.pop(name, None)
    return client


DISCARD_LIMIT = 8 * 1024 * 1024  # a too-big body up to this much more is read and dropped


class BodyTooLarge(Exception):
    """A request body over the router's limit (its answer is a 413)."""


async def read_body(request: Request, limit: int) -> bytes:
    """The whole request body, at most `limit` bytes (else BodyTooLarge, after reading and
    dropping up to DISCARD_LIMIT more so the client gets to read the 413)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        if int(declared) <= limit + DISCARD_LIMIT:
            async for _ in request.stream():
                pass
        raise BodyTooLarge
    chunks: list[bytes] = []
    n = 0
    too_big = False
    async for chunk in request.stream():  # one pass: a request's stream reads once
        n += len(chunk)
        if too_big or n > limit:
            too_big = True
            chunks.clear()
            if n > limit + DISCARD_LIMIT:
                break
            continue
        chunks.append(chunk)
    if too_big:
        raise BodyTooLarge
    return b"".join(chunks)


def upstream_url(request: Request, base: str, root_path: str) -> str:
    """`base` + the path as the client sent it (percent-encoding kept) less the router's mount
    `root_path`, + its query string."""
    raw = request.scope.get("raw_path")
    path = raw.decode("latin-1") if raw else quote(request.scope.get("path", "/"))
    path = strip_root(path, root_path)
    query = request.scope.get("query_string") or b""
    return base + path + (f"?{query.decode('latin-1')}" if query else "")
