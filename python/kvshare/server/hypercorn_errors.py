"""Hypercorn's own error responses (400 for malformed HTTP, 431 for headers over
`h11_max_incomplete_size`, 500 when the app fails before responding) get the OpenAI error JSON
body instead of an empty one (`install_json_error_bodies`, called by the launcher)."""

from __future__ import annotations

import json

from .errors import error_body

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

    # the patch itself: Hypercorn has no public hook for its own error responses
    setattr(h11_cls, "_send_error_response", h11_error)  # noqa: B010
    setattr(stream_cls, "_send_error_response", stream_error)  # noqa: B010
    _installed = True
    return True


