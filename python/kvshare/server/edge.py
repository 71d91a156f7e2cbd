"""The edge middleware: what one client can make the server hold or wait for before a request
reaches an endpoint.

`EdgeMiddleware` (inside the root-path and CORS layers, before auth): at most
`max_connections` requests in progress (503 + `Retry-After` beyond it; `/health` and `/metrics` are exempt), and deadlines on
reading a request body (no gap over `body_timeout` between its pieces, all of it within
`BODY_TOTAL_FACTOR` times that; a silent client gets 408 and its connection is closed).
Hypercorn's `keep_alive_timeout` (set to the same value by the launcher) drops a client that
does not finish its request head in time. `EdgeCollector`: its metrics. Each request carries a
`RequestEdge` (its share of the body budget). `run_heavy`: parsing, template rendering and
tokenization of large requests run in worker threads, at most `HEAVY_SLOTS` at once, so twenty
16 MiB requests cannot multiply the peak memory by twenty, and the event loop (and `/health`)
stays responsive.

docs/api.md ("Limits") lists the numbers.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
from collections import deque
from typing import Any, Callable

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .errors import APIError, error_body
from .settings import ServerSettings

log = logging.getLogger("kvshare.server")

KiB, MiB = 1024, 1024 * 1024

# Large requests processed at once (parse, render, tokenize). JSON parsing and template
# rendering hold the GIL, so more of them at once mostly make the event loop wait (on 2 cores,
# /health's worst latency was about twice as high with 2 than with 1); tokenization does not.
HEAVY_SLOTS = max(1, min(4, (os.cpu_count() or 2) // 4))
# Bodies (and prompts, in characters) over this size are parsed / rendered / tokenized under
# the heavy-work slots; smaller ones cost ~50 ms and ~7 MB at most, and at most 40 of them run
# at once (Starlette's thread pool). At 256 KiB, twenty near-limit prompts (254K characters,
# tokenized) at once took 440-520 MiB.
HEAVY_BYTES = 64 * KiB
# Buffered request bodies, all requests together (at least one body of the size limit).
DEFAULT_BODY_BUDGET = 256 * MiB
# The body deadline: no gap of more than `body_timeout` between two pieces of a body (as
# nginx's client_body_timeout), and the whole body within this many times `body_timeout`
# (a client trickling a byte now and then is cut off too).
BODY_TOTAL_FACTOR = 10

EDGE_KEY = "kvshare.edge"  # the per-request `RequestEdge` in the ASGI scope


class BodyTimeout(Exception):
    """A request body stopped arriving (raised from the middleware's receive wrapper; the body
    reader turns it into a 408)."""


# --------------------------------------------------------------------------- async slots

class Slots:
    """A FIFO counting semaphore with weighted acquisitions (bytes of a budget, or slots).
    Futures are created in the running loop at each wait, so one instance serves any loop
    (test clients run an app on several loops in turn). Event-loop use only."""

    def __init__(self, capacity: int):
        self.capacity = max(1, int(capacity))
        self.used = 0
        self._waiters: deque[tuple[int, asyncio.Future]] = deque()

    def _clamp(self, n: int) -> int:
        return max(0, min(int(n), self.capacity))

    async def acquire(self, n: int = 1, timeout: float | None = None) -> bool:
        """Take `n` units (at most the capacity); False if `timeout` seconds passed first."""
        n = self._clamp(n)
        if not self._waiters and self.used + n <= self.capacity:
            self.used += n
            return True
        fut = asyncio.get_running_loop().create_future()
        entry = (n, fut)
        self._waiters.append(entry)
        try:
            await asyncio.wait_for(fut, timeout)
            return True
        except asyncio.TimeoutError:
            if fut.done() and not fut.cancelled():  # granted as the timeout fired
                self.release(n)
            return False
        except BaseException:
            if fut.done() and not fut.cancelled():
                self.release(n)
            raise
        finally:
            with contextlib.suppress(ValueError):
                self._waiters.remove(entry)
            self._grant()

    def release(self, n: int = 1) -> None:
        self.used = max(0, self.used - self._clamp(n))
        self._grant()

    def _grant(self) -> None:
        while self._waiters:
            n, fut = self._waiters[0]
            if fut.done():
                self._waiters.popleft()
                continue
            if self.used + n > self.capacity:
                return
            self._waiters.popleft()
            self.used += n
            fut.set_result(True)


# --------------------------------------------------------------------------- limits + middleware

class EdgeLimits:
    """Server-wide counters and budgets (one per app)."""

    def __init__(self, *, body_timeout: float | None = 30.0, max_connections: int = 1024,
                 max_body_bytes: int = 16 * MiB, body_budget_bytes: int = DEFAULT_BODY_BUDGET,
                 heavy_slots: int = HEAVY_SLOTS):
        self.body_timeout = body_timeout if body_timeout and body_timeout > 0 else None
        self.max_connections = max(1, int(max_connections))
        self.in_flight = 0
        self.body_budget = Slots(max(body_budget_bytes, max_body_bytes))
        self.heavy = Slots(heavy_slots)
        self.rejected_busy = 0  # 503: over max_connections, or the body budget stayed spent
        self.timed_out = 0  # 408: a body stopped arriving

    @classmethod
    def from_settings(cls, settings: ServerSettings) -> "EdgeLimits":
        return cls(body_timeout=settings.body_timeout,
                   max_connections=settings.max_connections,
                   max_body_bytes=settings.max_body_bytes,
                   body_budget_bytes=settings.body_budget_bytes)


class RequestEdge:
    """One request's view: its body deadline, body size and budget reservation."""

    def __init__(self, limits: EdgeLimits):
        self.limits = limits
        self.deadline: float | None = None
        self.body_done = False
        self.timed_out = False
        self.body_bytes = 0
        self.reserved = 0

    async def reserve(self, n: int) -> None:
        """Reserve `n` bytes of the body budget for this request's body (once)."""
        if self.reserved or n <= 0:
            return
        lim = self.limits
        n = min(n, lim.body_budget.capacity)
        if not await lim.body_budget.acquire(n, lim.body_timeout):
            lim.rejected_busy += 1
            raise APIError(503, "The server is busy reading other large requests; retry "
                                "shortly", code="service_unavailable",
                           headers={"Retry-After": "1", "Connection": "close"})
        self.reserved = n

    def release(self) -> None:
        if self.reserved:
            self.limits.body_budget.release(self.reserved)
            self.reserved = 0


def _json_response_parts(status: int, body: dict, headers: dict[str, str] | None = None
                         ) -> tuple[dict, dict]:
    data = json.dumps(body, separators=(",", ":")).encode()
    hdrs = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    for k, v in (headers or {}).items():
        hdrs.append((k.lower().encode("latin-1"), v.encode("latin-1")))
    return ({"type": "http.response.start", "status": status, "headers": hdrs},
            {"type": "http.response.body", "body": data})


class EdgeMiddleware:
    """At most `max_connections` requests in progress (paths in `exempt` are not counted) and
    a deadline on each request body. Put it outermost."""

    def __init__(self, app: ASGIApp, limits: EdgeLimits, exempt: frozenset[str] = frozenset(),
                 route_path: Callable[[Scope], str] | None = None):
        self.app, self.limits, self.exempt = app, limits, exempt
        self.route_path = route_path or (lambda scope: scope.get("path", ""))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        lim = self.limits
        counted = 0 if self.route_path(scope) in self.exempt else 1
        if counted and lim.in_flight >= lim.max_connections:
            lim.rejected_busy += 1
            start, body = _json_response_parts(
                503, error_body(f"The server is at its limit of {lim.max_connections} "
                                "requests in progress; retry shortly", type="server_error",
                                code="service_unavailable"),
                {"Retry-After": "1", "Connection": "close"})
            await send(start)
            await send(body)
            return
        edge = RequestEdge(lim)
        scope = dict(scope)
        scope[EDGE_KEY] = edge
        loop = asyncio.get_running_loop()
        timeout = lim.body_timeout

        async def timed_receive() -> Message:
            if edge.body_done or timeout is None:
                return await receive()
            now = loop.time()
            if edge.deadline is None:
                edge.deadline = now + timeout * BODY_TOTAL_FACTOR
            remaining = min(timeout, edge.deadline - now)
            if remaining <= 0 or edge.timed_out:
                raise BodyTimeout()
            try:
                msg = await asyncio.wait_for(receive(), remaining)
            except asyncio.TimeoutError:
                if not edge.timed_out:
                    edge.timed_out = True
                    lim.timed_out += 1
                raise BodyTimeout() from None
            if msg.get("type") != "http.request" or not msg.get("more_body", False):
                edge.body_done = True
            return msg

        lim.in_flight += counted
        try:
            await self.app(scope, timed_receive, send)
        finally:
            lim.in_flight -= counted
            edge.release()


class EdgeCollector:
    """Prometheus view of `EdgeLimits` (registered on the app's registry)."""

    def __init__(self, limits: EdgeLimits):
        self.limits = limits

    def describe(self):
        return []

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        lim = self.limits
        yield GaugeMetricFamily("kvshare_http_requests_in_progress",
                                "HTTP requests in progress (/health, /metrics not counted)",
                                value=lim.in_flight)
        yield GaugeMetricFamily("kvshare_http_max_connections",
                                "Requests in progress allowed (--max-connections)",
                                value=lim.max_connections)
        yield GaugeMetricFamily("kvshare_body_budget_bytes_used",
                                "Bytes of the request-body budget reserved by large bodies",
                                value=lim.body_budget.used)
        c = CounterMetricFamily("kvshare_edge_rejected", "Requests refused at the edge",
                                labels=["reason"])
        c.add_metric(["busy"], lim.rejected_busy)
        c.add_metric(["body_timeout"], lim.timed_out)
        yield c


def request_edge(request: Request) -> RequestEdge:
    edge = request.scope.get(EDGE_KEY)
    if edge is None:  # an app without the middleware (not built by create_app)
        edge = RequestEdge(EdgeLimits())
        request.scope[EDGE_KEY] = edge
    return edge


def release_body(request: Request) -> None:
    """The request is done with its body (parsed and tokenized): give its budget back."""
    edge = request.scope.get(EDGE_KEY)
    if edge is not None:
        edge.release()


def body_size(request: Request) -> int:
    edge = request.scope.get(EDGE_KEY)
    return edge.body_bytes if edge is not None else 0


async def run_heavy(request: Request, heavy: bool, fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(*args)` in a worker thread; with `heavy`, under one of the heavy-work slots."""
    if not heavy:
        return await run_in_threadpool(fn, *args)
    slots = request_edge(request).limits.heavy
    await slots.acquire(1)
    try:
        return await run_in_threadpool(fn, *args)
    finally:
        slots.release(1)
        if slots.used == 0:
            await _trim_heap()


_last_trim = 0.0


async def _trim_heap() -> None:
    """Hand the heap that large requests freed back to the OS (glibc keeps it otherwise: the
    server's RSS would stay at its peak). At most every half second; ctypes drops the GIL."""
    global _last_trim
    now = asyncio.get_running_loop().time()
    if now - _last_trim < 0.5:
        return
    _last_trim = now
    await run_in_threadpool(_malloc_trim)


def _malloc_trim() -> None:
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except Exception:  # noqa: BLE001 - not glibc
        pass


