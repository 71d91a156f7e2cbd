"""Bounded resources at the edge: what one client can make the server hold, compute or wait for.

- `EdgeMiddleware` (outermost but the root-path layer): at most `max_connections` requests
  in progress (503 + `Retry-After` beyond it; `/health` and `/metrics` are exempt), and
  deadlines on reading a request body (no gap over `body_timeout` between its pieces, all of
  it within `BODY_TOTAL_FACTOR` times that; a silent client gets 408 and its connection is
  closed). Hypercorn's `keep_alive_timeout` (set to the same value by the launcher) drops a
  client that does not finish its request head in time. `EdgeCollector`: its metrics.
- `read_json`: the request body under the size limit. Bodies over `SMALL_BODY` reserve their
  size from a server-wide body budget before they are read (they wait, unread, while it is
  spent), so buffered bodies stay bounded however many clients send at once. Large bodies are
  parsed in a worker thread, at most `HEAVY_SLOTS` at a time, after a check that they hold at
  most `MAX_JSON_VALUES` JSON values (a 16 MiB body of `{}`s would otherwise become ~360 MB of
  Python objects and hold the GIL for half a second). Strings with lone UTF-16 surrogates
  (`"\\ud800"`: valid JSON, not valid Unicode) are rejected with 400 wherever they are.
- `PromptBounds`: a prompt of C characters has at least C / L tokens, L being the longest token
  text of the vocabulary (every token covers at most L characters of the text it was cut from;
  see `max_token_chars`). A prompt longer than (ctx - 1) * L characters is rejected with the
  usual 400 `context_length_exceeded` without being tokenized, so a prompt is tokenized only
  when it is at most ctx * L characters long: tokenization cost and memory are bounded by the
  context size, not by the body limit. Prompts that fit tokenize exactly as before.
- `run_heavy`: parsing, template rendering and tokenization of large requests run in worker
  threads, at most `HEAVY_SLOTS` at once, so twenty 16 MiB requests cannot multiply the peak
  memory by twenty, and the event loop (and `/health`) stays responsive.
- `install_json_error_bodies`: Hypercorn's own error responses (400 for malformed HTTP, 431 for
  headers over `h11_max_incomplete_size`, 500 when the app fails before responding) get the
  OpenAI error JSON body instead of an empty one.

docs/api.md ("Limits") lists the numbers.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
from collections import deque
from typing import Any, Callable

from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect, Request
from starlette.types import ASGIApp, Receive, Scope, Send

from .errors import APIError, bad_request, error_body

log = logging.getLogger("kvshare.server")

KiB, MiB = 1024, 1024 * 1024

# Bodies up to this size are read without reserving the body budget.
SMALL_BODY = 1 * MiB
# Bodies (and prompts, in characters) over this size are parsed / rendered / tokenized under
# the heavy-work slots; smaller ones cost ~50 ms and ~7 MB at most, and at most 40 of them run
# at once (Starlette's thread pool). At 256 KiB, twenty near-limit prompts (254K characters,
# tokenized) at once took 440-520 MiB.
HEAVY_BYTES = 64 * KiB
# Large requests processed at once (parse, render, tokenize). JSON parsing and template
# rendering hold the GIL, so more of them at once mostly make the event loop wait (on 2 cores,
# /health's worst latency was about twice as high with 2 than with 1); tokenization does not.
HEAVY_SLOTS = max(1, min(4, (os.cpu_count() or 2) // 4))
# Buffered request bodies, all requests together (at least one body of the size limit).
DEFAULT_BODY_BUDGET = 256 * MiB
# JSON values (numbers, strings, arrays, objects, keys) in one request body.
MAX_JSON_VALUES = 1 << 18
# /tokenize: characters of `content` (at least this; more with a context over 256K tokens:
# 4 * ctx), and tokens returned with `with_pieces`.
TOKENIZE_MIN_CHARS = 1 << 20
TOKENIZE_MAX_PIECES = 1 << 17
# /detokenize: token ids in, characters out.
DETOKENIZE_MAX_TOKENS = 1 << 17
DETOKENIZE_MAX_CHARS = 4 * MiB

# The body deadline: no gap of more than `body_timeout` between two pieces of a body (as
# nginx's client_body_timeout), and the whole body within this many times `body_timeout`
# (a client trickling a byte now and then is cut off too).
BODY_TOTAL_FACTOR = 10

EDGE_KEY = "kvshare.edge"  # the per-request `RequestEdge` in the ASGI scope


class BodyTimeout(Exception):
    """Raised by the wrapped `receive` when the request body did not arrive in time."""


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
            try:
                self._waiters.remove(entry)
            except ValueError:
                pass
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
    def from_settings(cls, settings: Any) -> "EdgeLimits":
        return cls(body_timeout=getattr(settings, "body_timeout", 30.0),
                   max_connections=getattr(settings, "max_connections", 1024),
                   max_body_bytes=settings.max_body_bytes,
                   body_budget_bytes=getattr(settings, "body_budget_bytes",
                                             DEFAULT_BODY_BUDGET))


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

        async def timed_receive() -> dict:
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


# --------------------------------------------------------------------------- body reading

def _is_json_type(content_type: str | None) -> bool:
    if not content_type:
        return True  # be lenient with clients that send no content type
    mt = content_type.split(";", 1)[0].strip().lower()
    return mt == "application/json" or (mt.startswith("application/") and mt.endswith("+json"))


_SIMPLE_TYPES = frozenset({"application/x-www-form-urlencoded", "text/plain"})


def _curl_form(content_type: str | None, request: Request) -> bool:
    """`curl -d '{...}'` labels JSON as a form (llama-server reads it anyway): taken as JSON
    when no `Origin` header came with it. A browser page sends these "simple" types to any
    origin without a CORS preflight, and always with an Origin: refusing them then keeps a
    page from driving a keyless local server behind its user's back."""
    mt = (content_type or "").split(";", 1)[0].strip().lower()
    return mt in _SIMPLE_TYPES and "origin" not in request.headers


def _timeout_error(limit: float | None) -> APIError:
    return APIError(408, f"The request body stopped arriving (nothing for {limit:g} s, or "
                         f"not complete after {BODY_TOTAL_FACTOR * (limit or 0):g} s)",
                    code="request_timeout", headers={"Connection": "close"})


async def read_json(request: Request, settings: Any) -> dict:
    """Read a JSON object body under the size limit: a declared Content-Length over the limit,
    or a chunked body that grows past it, gets 413 without being held in memory; a body that
    does not arrive within the body timeout gets 408; see the module doc for the rest."""
    content_type = request.headers.get("content-type")
    if not _is_json_type(content_type) and not _curl_form(content_type, request):
        raise APIError(415, f"Content-Type must be application/json, not {content_type!r} "
                            "(with curl, add -H 'Content-Type: application/json')",
                       code="unsupported_media_type")
    edge = request_edge(request)
    limit = settings.max_body_bytes
    too_large = APIError(413, f"Request body is larger than the limit of {limit} bytes",
                         code="request_too_large", headers={"Connection": "close"})
    cl = request.headers.get("content-length")
    declared = None
    if cl is not None:
        try:
            declared = int(cl)
        except ValueError:
            raise bad_request("invalid Content-Length header") from None
        if declared < 0:
            raise bad_request("invalid Content-Length header")
        if declared > limit:
            if declared <= settings.max_discard_bytes:
                await _discard(request, settings.max_discard_bytes)
            raise too_large
        if declared > SMALL_BODY:
            await edge.reserve(declared)
    # The chunks are kept as they arrive and joined off the event loop: allocating (and
    # zero-filling) a 16 MiB buffer up front took ~35 ms of the event loop per request (twenty
    # at once stalled /health for 0.3-0.5 s), and growing one chunk by chunk copies it again.
    chunks: list[bytes] = []
    n = 0
    try:
        async for chunk in request.stream():
            k = len(chunk)
            if n + k > limit:
                chunks.clear()
                await _discard(request, settings.max_discard_bytes)
                raise too_large
            if k:
                chunks.append(chunk)
            n += k
            if declared is None and n > SMALL_BODY and not edge.reserved:
                await edge.reserve(limit)
    except BodyTimeout:
        raise _timeout_error(edge.limits.body_timeout) from None
    edge.body_bytes = n
    if not n:
        raise bad_request("request body is empty; expected a JSON object")
    if n <= HEAVY_BYTES:
        return parse_json_body(b"".join(chunks))
    return await run_heavy(request, True, _join_and_parse, chunks)


def _join_and_parse(chunks: list[bytes]) -> dict:
    buf = b"".join(chunks)
    chunks.clear()  # the pieces go as soon as the whole exists
    return parse_json_body(buf)


async def _discard(request: Request, cap: int) -> None:
    n = 0
    try:
        async for chunk in request.stream():
            n += len(chunk)
            if n > cap:
                return
    except (ClientDisconnect, RuntimeError, BodyTimeout):
        return


# --------------------------------------------------------------------------- JSON parsing

_STRUCTURAL = (b",", b":", b"[", b"{")
_WINDOW = 1 << 20  # count in windows: no C call holds the GIL for long


def json_value_count(data: bytes | bytearray, cap: int = MAX_JSON_VALUES) -> int:
    """An upper bound of the JSON values (and keys) in `data`, without parsing: 1 + the
    structural characters `,:[{` outside strings (every value or key but the top one follows
    one of them; an empty container has one with nothing after it, so this is at most twice
    the real count). Stops counting a little past `cap`.

    First an upper bound (the structural characters anywhere, C speed, window by window);
    only a body where that exceeds `cap` (lots of commas in text, or really many values) is
    scanned string by string, a loop in Python that lets other threads (the event loop) run."""
    bound = 1
    for start in range(0, len(data), _WINDOW):
        end = start + _WINDOW
        bound += sum(data.count(c, start, end) for c in _STRUCTURAL)
    if bound <= cap:
        return bound
    return count_outside_strings(data, cap)


def count_outside_strings(data: bytes | bytearray, cap: int) -> int:
    """1 + the structural characters outside JSON strings, stopping once past `cap` (or once
    there are more than `cap` strings, each a value or key of valid JSON). A Python-level loop
    over the strings: other threads (the event loop) run meanwhile."""
    # Drop escaped backslashes, then escaped quotes: every quote left delimits a string.
    clean = bytes(data).replace(b"\\\\", b"").replace(b'\\"', b"")
    n, strings, pos, end = 1, 0, 0, len(clean)
    while n <= cap and strings <= cap:
        q = clean.find(b'"', pos)
        stop = end if q < 0 else q
        n += sum(clean.count(c, pos, stop) for c in _STRUCTURAL)
        if q < 0:
            break
        close = clean.find(b'"', q + 1)
        strings += 1
        if close < 0:
            break
        pos = close + 1
    return max(n, strings)


# A lone surrogate comes from a \uD800-\uDFFF escape (paired escapes become one character);
# raw surrogate bytes are invalid UTF-8 and rejected when the body is decoded.
_SURROGATE = re.compile("[\ud800-\udfff]")


def find_lone_surrogate(obj: Any) -> str | None:
    """The path (e.g. `messages[0].content`) of the first string or key in `obj` holding a lone
    surrogate, or None."""
    stack: list[tuple[Any, str]] = [(obj, "")]
    while stack:
        v, path = stack.pop()
        if isinstance(v, str):
            if not v.isascii() and _SURROGATE.search(v):
                return path or "body"
        elif isinstance(v, dict):
            for k, x in v.items():
                sub = f"{path}.{k}" if path else str(k)
                if not k.isascii() and _SURROGATE.search(k):
                    return (path + ".<key>") if path else "<key>"
                stack.append((x, sub))
        elif isinstance(v, list):
            stack.extend((x, f"{path}[{i}]") for i, x in enumerate(v))
    return None


def _param_of(path: str) -> str:
    return re.split(r"[.\[]", path, maxsplit=1)[0]


def parse_json_body(buf: bytes | bytearray) -> dict:
    """Parse a request body (any size; large ones run in a worker thread): at most
    `MAX_JSON_VALUES` values, an object at the top, no lone surrogates."""
    if len(buf) > HEAVY_BYTES:
        n = json_value_count(buf)
        if n > MAX_JSON_VALUES:
            raise APIError(413, f"The request body holds more than {MAX_JSON_VALUES} JSON "
                                "values (numbers, strings, arrays, objects)",
                           code="request_too_large")
    try:
        text = buf.decode(json.detect_encoding(buf))  # strict: no surrogates, no bad bytes
    except UnicodeDecodeError as e:
        raise bad_request(f"the request body is not valid UTF-8 (byte {e.start}: {e.reason})",
                          code="invalid_json") from None
    escapes = "\\ud" in text or "\\uD" in text
    try:
        body = json.loads(text)
    except (ValueError, RecursionError) as e:
        msg = str(e).encode("ascii", "backslashreplace").decode()
        raise bad_request(f"malformed JSON in request body: {msg}", code="invalid_json") from None
    del text
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object")
    if escapes:
        path = find_lone_surrogate(body)
        if path is not None:
            path = path.encode("utf-8", "backslashreplace").decode()
            raise bad_request(f"'{path}' holds a lone UTF-16 surrogate (e.g. \"\\ud800\" "
                              "without its pair): JSON strings must be valid Unicode",
                              _param_of(path), "invalid_json")
    return body


# --------------------------------------------------------------------------- prompt bounds

def max_token_chars(tokenizer: Any) -> int | None:
    """The longest token text of a kvshare `Tokenizer` in characters (GPT-2 byte-level texts
    have one character per byte), or None when it cannot be known."""
    texts = getattr(tokenizer, "_texts", None)
    if texts is None:
        n = getattr(tokenizer, "vocab_size", None)
        token_text = getattr(tokenizer, "token_text", None)
        if not isinstance(n, int) or token_text is None:
            return None
        texts = (token_text(i) for i in range(n))
    return max(1, max((len(t) for t in texts), default=1))


class PromptBounds:
    """The no-tokenization context check (see the module doc). Works with any engine; with one
    that has no kvshare tokenizer (test fakes) it checks nothing."""

    def __init__(self, engine: Any):
        self.engine = engine
        self._max: int | None | bool = False  # False: not computed yet

    @property
    def max_chars_per_token(self) -> int | None:
        if self._max is False:
            tok = getattr(self.engine, "tokenizer", None)
            try:
                self._max = max_token_chars(tok) if tok is not None else None
            except Exception:  # noqa: BLE001 - an unusual tokenizer: no bound
                log.debug("no token length bound", exc_info=True)
                self._max = None
        return self._max  # type: ignore[return-value]

    def limit_chars(self, ctx: int) -> int | None:
        """Prompts longer than this many characters certainly have >= ctx tokens."""
        per = self.max_chars_per_token
        return None if per is None else (ctx - 1) * per

    def check_text(self, n_chars: int, ctx: int, param: str) -> None:
        limit = self.limit_chars(ctx)
        if limit is not None and n_chars > limit:
            per = self.max_chars_per_token
            at_least = -(-n_chars // per)  # type: ignore[operator]
            raise bad_request(
                f"This model's maximum context length is {ctx} tokens, but the prompt has at "
                f"least {at_least} tokens ({n_chars} characters; no token of this model is "
                f"longer than {per} characters)", param, "context_length_exceeded")

    def check_chat(self, chat: Any, ctx: int, body_bytes: int) -> None:
        """For a chat request whose body could render past the limit: render the template
        (no tokenization) and check the text's length. Template errors are left to the real
        render, which reports them."""
        limit = self.limit_chars(ctx)
        if limit is None or body_bytes <= limit:
            return
        template = getattr(self.engine, "chat_template", None)
        render = getattr(template, "render", None)
        if render is None:
            return
        kwargs = dict(chat.template_kwargs)
        agp = kwargs.pop("add_generation_prompt", True)
        try:
            text = render(chat.messages, tools=chat.tools, add_generation_prompt=bool(agp),
                          **kwargs)
        except Exception:  # noqa: BLE001
            return
        n = len(text)
        del text
        self.check_text(n, ctx, "messages")


def tokenize_max_chars(ctx: int) -> int:
    return max(TOKENIZE_MIN_CHARS, 4 * ctx)


# --------------------------------------------------------------------------- Hypercorn errors

_REASONS = {400: "Bad request: malformed HTTP", 404: "Not found",
            408: "Request timeout", 413: "Request too large",
            431: "Request header fields too large", 500: "Internal server error",
            501: "Not implemented"}


def _error_json(status: int) -> bytes:
    msg = _REASONS.get(status, "HTTP error")
    body = error_body(msg, type="server_error" if status >= 500 else "invalid_request_error",
                      code={400: "bad_request", 404: "not_found", 413: "request_too_large",
                            431: "headers_too_large", 500: "internal_error"}.get(status))
    return json.dumps(body, separators=(",", ":")).encode()


_installed = False


def install_json_error_bodies() -> bool:
    """Give Hypercorn's own error responses an OpenAI error JSON body (they are empty). The
    two `_send_error_response` methods (HTTP/1.1 protocol and the ASGI stream) are replaced
    with versions that send the same status and headers plus the body; on an unknown
    Hypercorn version nothing is changed. Returns whether the bodies are installed."""
    global _installed
    if _installed:
        return True
    try:
        import h11
        from hypercorn.protocol import h11 as hc_h11
        from hypercorn.protocol import http_stream as hc_stream
        from hypercorn.protocol.events import Body, EndBody, Response
        from hypercorn.protocol.http_stream import ASGIHTTPState

        h11_cls, stream_cls = hc_h11.H11Protocol, hc_stream.HTTPStream
        for cls in (h11_cls, stream_cls):
            if not callable(getattr(cls, "_send_error_response", None)):
                return False
        if not callable(getattr(h11_cls, "_send_h11_event", None)):
            return False
    except Exception:  # noqa: BLE001
        return False

    def headers_for(data: bytes) -> list[tuple[bytes, bytes]]:
        return [(b"content-type", b"application/json"),
                (b"content-length", str(len(data)).encode()), (b"connection", b"close")]

    async def h11_error(self, status_code: int) -> None:
        data = _error_json(status_code)
        await self._send_h11_event(h11.Response(
            status_code=status_code,
            headers=headers_for(data) + list(self.config.response_headers("h11"))))
        await self._send_h11_event(h11.Data(data=data))
        await self._send_h11_event(h11.EndOfMessage())

    async def stream_error(self, status_code: int) -> None:
        from time import time

        data = _error_json(status_code)
        await self.send(Response(stream_id=self.stream_id, headers=headers_for(data),
                                 status_code=status_code))
        await self.send(Body(stream_id=self.stream_id, data=data))
        await self.send(EndBody(stream_id=self.stream_id))
        self.state = ASGIHTTPState.CLOSED
        await self.config.log.access(
            self.scope, {"status": status_code, "headers": []}, time() - self.start_time)

    h11_cls._send_error_response = h11_error
    stream_cls._send_error_response = stream_error
    _installed = True
    return True


def raise_fd_limit(wanted: int) -> None:
    """Raise the soft open-files limit towards `wanted` (each connection is a descriptor)."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != resource.RLIM_INFINITY and soft < wanted:
            new = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
            resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
    except (ImportError, ValueError, OSError):
        pass
