"""The web UI's MCP CORS proxy (server-cors-proxy.h), served only with `--ui-mcp-proxy`:
`GET|POST /cors-proxy?url=http(s)://host[:port]/path` forwards the request to that URL and
streams the answer back. Only the request headers named `X-Llama-Server-Proxy-Header-<Name>`
are sent on, as `<Name>` (so the caller's API key and cookies never leave); redirects are
followed; the answer's status, body and headers come back without the hop-by-hop ones and
the target's `Access-Control-*` (this server's CORS policy applies). A URL without a host,
with a password, or of another scheme is a 500 in llama-server's error shape, as there.
A request body is held to the server's --max-body-mib (413). Read and write deadlines:
600 s, as llama-server's. The body comes back decoded (without
its Content-Encoding)."""

from __future__ import annotations

from urllib.parse import urlsplit

import httpx
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from kvshare.router.passthrough import BodyTooLarge, read_body

PROXY_HEADER_PREFIX = "x-llama-server-proxy-header-"
TIMEOUT_S = 600.0
_STRIPPED = frozenset({"server", "transfer-encoding", "content-length", "keep-alive",
                       "connection", "content-encoding"})


class ProxyError(ValueError):
    pass


def target_url(url: str) -> str:
    """The URL to forward to; ProxyError (llama.cpp's message) when it is not usable."""
    parts = urlsplit(url)
    if not parts.hostname:
        raise ProxyError("invalid target URL: missing host")
    if parts.password:
        raise ProxyError("authentication in target URL is not supported")
    if parts.scheme not in ("http", "https"):
        raise ProxyError("unsupported URL scheme in target URL: " + parts.scheme)
    return url if parts.path else parts._replace(path="/").geturl()


def forwarded_headers(request: Request) -> dict[str, str]:
    out = {}
    for k, v in request.headers.items():
        k = k.lower()
        if k.startswith(PROXY_HEADER_PREFIX) and len(k) > len(PROXY_HEADER_PREFIX):
            out[k[len(PROXY_HEADER_PREFIX):]] = v
    return out


async def proxy(request: Request, max_body: int) -> Response:
    """Forward `request` (its body at most `max_body` bytes: else a 413) to its `url`."""
    try:
        url = target_url(request.query_params.get("url", ""))
    except ProxyError as e:
        return JSONResponse({"error": {"code": 500, "message": str(e), "type": "server_error"}},
                            status_code=500)
    try:
        body = await read_body(request, max_body) if request.method == "POST" else None
    except BodyTooLarge:
        return JSONResponse({"error": {"code": 413, "message": "Request body is larger than "
                                       f"the limit of {max_body} bytes",
                                       "type": "invalid_request_error"}},
                            status_code=413, headers={"Connection": "close"})
    client = httpx.AsyncClient(follow_redirects=True, timeout=TIMEOUT_S)
    try:
        upstream = await client.send(client.build_request(
            request.method, url, headers=forwarded_headers(request), content=body),
            stream=True)
    except httpx.HTTPError as e:
        await client.aclose()
        return JSONResponse({"error": {"code": 500, "message": f"proxy request failed: {e}",
                                       "type": "server_error"}}, status_code=500)
    headers = {k: v for k, v in upstream.headers.items()
               if k.lower() not in _STRIPPED and not k.lower().startswith("access-control-")}

    async def close() -> None:
        await upstream.aclose()
        await client.aclose()

    if upstream.status_code in (204, 304):
        await close()
        return Response(status_code=upstream.status_code, headers=headers)
    return StreamingResponse(upstream.aiter_bytes(), status_code=upstream.status_code,
                             headers=headers, background=BackgroundTask(close))
