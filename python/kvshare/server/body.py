"""Reading a request's JSON body under the edge limits.

`read_json`: the body under the size limit. Bodies over `SMALL_BODY` reserve their size from a
server-wide body budget before they are read (they wait, unread, while it is spent), so
buffered bodies stay bounded however many clients send at once. Large bodies are parsed in a
worker thread (`edge.run_heavy`), after a check that they hold at most `MAX_JSON_VALUES` JSON
values (a 16 MiB body of `{}`s would otherwise become ~360 MB of Python objects and hold the
GIL for half a second). Strings with lone UTF-16 surrogates (`"\\ud800"`: valid JSON, not valid
Unicode) are rejected with 400 wherever they are.
"""

from __future__ import annotations

import json
import re
from typing import Any

from starlette.requests import ClientDisconnect, Request

from .edge import BODY_TOTAL_FACTOR, HEAVY_BYTES, MiB, BodyTimeout, request_edge, run_heavy
from .errors import APIError, bad_request

# Bodies up to this size are read without reserving the body budget.
SMALL_BODY = 1 * MiB
# JSON values (numbers, strings, arrays, objects, keys) in one request body.
MAX_JSON_VALUES = 1 << 18


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


def body_timeout_error(limit: float | None) -> APIError:
    """The 408 for a body that stopped arriving (`kvshare serve` and `kvshare route`)."""
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
        raise body_timeout_error(edge.limits.body_timeout) from None
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


