"""What a client or a backend can hold in `kvshare route` (issue 45): the same limits and error
shapes as `kvshare serve` (server/edge.py, launcher.py's header timeout), and a total deadline
for a backend's response headers.

- 200 half-sent bodies are answered 408 and closed within the body timeout + 5 s;
- a chunked body whose next chunk never comes likewise; a body trickling a byte at a time is
  cut at 10x the body timeout;
- a request head that never ends is closed within the header timeout;
- over --max-connections requests in progress get 503 (/health still answers);
- a backend that trickles its response headers gets the client a 504 at --timeout;
- shutdown with slow connections open logs one line, not a CancelledError traceback each
  (launcher.py, shared with `kvshare serve`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import selectors
import socket
import threading
import time

import httpx
import pytest

from kvshare.router.app import RouterSettings, create_app
from kvshare.server.launcher import bind_socket, serve_app, socket_url

BODY_TIMEOUT = 1.0


class Served:
    """The router under Hypercorn in a background thread, as `kvshare route` runs it."""

    def __init__(self, settings: RouterSettings):
        self.app = create_app(settings)
        sock = bind_socket("127.0.0.1", 0)
        self.port = sock.getsockname()[1]
        self.url = socket_url(sock)
        self.loop = asyncio.new_event_loop()
        self.stop_event: asyncio.Event | None = None
        ready = threading.Event()

        async def main():
            self.stop_event = asyncio.Event()
            ready.set()
            await serve_app(self.app, sock, graceful_timeout=1.0, log_level="WARNING",
                            stop=self.stop_event, install_signal_handlers=False,
                            header_timeout=settings.body_timeout)

        self.thread = threading.Thread(target=self.loop.run_until_complete, args=(main(),),
                                       daemon=True)
        self.thread.start()
        ready.wait(5)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                httpx.get(f"{self.url}/health", timeout=1)
                return
            except httpx.HTTPError:
                time.sleep(0.02)
        raise RuntimeError("router did not start")

    def stop(self) -> None:
        if self.thread.is_alive():
            assert self.stop_event is not None
            self.loop.call_soon_threadsafe(self.stop_event.set)
            self.thread.join(10)


class RawBackend:
    """A replica stand-in on a raw socket: /health answers at once; any other request is held
    (`hold`) or answered with response headers trickled a byte every 0.3 s (`trickle`)."""

    def __init__(self, mode: str):
        self.mode = mode
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.sock.settimeout(0.1)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.stop_flag = threading.Event()
        self.held: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.stop_flag.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        self.held.append(conn)
        with contextlib.suppress(OSError):
            while not self.stop_flag.is_set():
                head = b""
                while b"\r\n\r\n" not in head:
                    data = conn.recv(65536)
                    if not data:
                        return
                    head += data
                if head.split(b" ", 2)[1] == b"/health":
                    body = b'{"status":"ok"}'
                    conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                                 b"content-length: %d\r\n\r\n%s" % (len(body), body))
                    continue
                if self.mode == "trickle":
                    for b in b"HTTP/1.1 200 OK\r\n" + b"x-pad: " + b"a" * 10000:
                        if self.stop_flag.wait(0.3):
                            return
                        conn.sendall(bytes([b]))
                self.stop_flag.wait(60)
                return

    def close(self) -> None:
        self.stop_flag.set()
        for c in self.held:
            with contextlib.suppress(OSError):
                c.close()
        self.sock.close()


@pytest.fixture
def routed():
    made: list = []

    def make(mode: str = "hold", **kw) -> tuple[Served, RawBackend]:
        backend = RawBackend(mode)
        kw.setdefault("body_timeout", BODY_TIMEOUT)
        router = Served(RouterSettings(backends=[backend.url], health_interval=0.5, **kw))
        made.extend([router, backend])
        return router, backend

    yield make
    for m in reversed(made):
        m.stop() if isinstance(m, Served) else m.close()


def _wait_closed(socks: list[socket.socket], t0: float, limit_s: float
                 ) -> tuple[list[float | None], list[bytes]]:
    """When (seconds after `t0`) each socket was closed by the server, and what it sent; read
    as it arrives (a server that closes a connection whose request it did not finish reading
    may reset it, and a reset drops what the client has not read yet)."""
    sel = selectors.DefaultSelector()
    for i, s in enumerate(socks):
        s.setblocking(False)
        sel.register(s, selectors.EVENT_READ, i)
    when: list[float | None] = [None] * len(socks)
    data = [b""] * len(socks)
    left = len(socks)
    while left and time.monotonic() - t0 < limit_s:
        for key, _ in sel.select(0.2):
            try:
                chunk = key.fileobj.recv(65536)  # type: ignore[union-attr]
            except BlockingIOError:
                continue
            except OSError:
                chunk = b""
            if chunk:
                data[key.data] += chunk
            else:
                when[key.data] = time.monotonic() - t0
                sel.unregister(key.fileobj)
                left -= 1
    sel.close()
    return when, data


def _open(router: Served, head: bytes) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", router.port), timeout=5)
    s.sendall(head)
    return s


POST = (b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
        b"content-type: application/json\r\n")


def test_200_half_sent_bodies_are_closed_within_the_body_timeout(routed):
    router, _ = routed()
    t0 = time.monotonic()
    socks = [_open(router, POST + b"content-length: 1000\r\n\r\n" + b'{"model": "m", ')
             for _ in range(200)]
    try:
        when, answers = _wait_closed(socks, t0, BODY_TIMEOUT + 5)
    finally:
        for s in socks:
            s.close()
    assert all(w is not None for w in when), sum(w is None for w in when)
    assert all(a.startswith(b"HTTP/1.1 408") for a in answers), answers[0][:200]
    body = json.loads(answers[0].split(b"\r\n\r\n", 1)[1])
    assert body["error"]["code"] == "request_timeout"  # serve's shape and code
    assert min(when) >= BODY_TIMEOUT * 0.95 and max(when) < BODY_TIMEOUT + 5  # type: ignore


def test_a_chunked_body_that_stops_is_closed(routed):
    router, _ = routed()
    t0 = time.monotonic()
    s = _open(router, POST + b"transfer-encoding: chunked\r\n\r\n5\r\n{\"a\":\r\n")
    with s:
        when, got = _wait_closed([s], t0, BODY_TIMEOUT + 5)
    assert got[0].startswith(b"HTTP/1.1 408"), got[0][:200]
    assert when[0] is not None and when[0] < BODY_TIMEOUT + 5


def test_a_trickling_body_is_cut_at_its_total_deadline(routed):
    router, _ = routed(body_timeout=0.3)  # whole body within 10 x 0.3 s
    s = _open(router, POST + b"content-length: 1000\r\n\r\n")
    t0 = time.monotonic()
    got = b""
    with s:
        s.settimeout(0.1)
        while time.monotonic() - t0 < 8:
            with contextlib.suppress(OSError):
                s.sendall(b" ")
            try:
                data = s.recv(65536)
                if not data:
                    break
                got += data
            except socket.timeout:
                pass
            except OSError:
                break
    took = time.monotonic() - t0
    assert got.startswith(b"HTTP/1.1 408"), got[:200]
    assert 2.5 < took < 3.0 + 2.0, took


def test_a_request_head_that_never_ends_is_closed(routed):
    router, _ = routed()
    t0 = time.monotonic()
    s = _open(router, b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n")
    with s:
        when, _ = _wait_closed([s], t0, BODY_TIMEOUT + 5)
    assert when[0] is not None and when[0] < BODY_TIMEOUT + 5


def test_max_connections(routed):
    router, _ = routed("hold", max_connections=2, timeout=30)
    held = [_open(router, POST + b"content-length: 2\r\n\r\n{}") for _ in range(2)]
    try:
        time.sleep(0.5)  # both are in progress at the (holding) backend
        r = httpx.post(f"{router.url}/v1/chat/completions", json={}, timeout=5)
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "service_unavailable"
        assert httpx.get(f"{router.url}/health", timeout=5).status_code == 200  # not counted
    finally:
        for s in held:
            s.close()


def test_a_backend_trickling_its_headers_gets_504_at_the_deadline(routed):
    router, _ = routed("trickle", timeout=2.0)
    t0 = time.monotonic()
    r = httpx.post(f"{router.url}/v1/chat/completions", json={"model": "m"}, timeout=30)
    took = time.monotonic() - t0
    assert r.status_code == 504, r.text
    assert r.json()["error"]["code"] == "gateway_timeout"
    assert 1.9 < took < 3.0, took
    # in llama-server's shape on its own endpoints, as every router error
    r = httpx.post(f"{router.url}/completion", json={"prompt": "x"}, timeout=30)
    assert r.status_code == 504 and r.json()["error"]["code"] == 504


def test_shutdown_with_slow_connections_open_logs_one_line(caplog):
    backend = RawBackend("hold")
    router = Served(RouterSettings(backends=[backend.url], body_timeout=30.0))
    socks = [_open(router, POST + b"content-length: 1000\r\n\r\n{") for _ in range(20)]
    try:
        time.sleep(0.5)
        with caplog.at_level("INFO"):
            router.stop()
            time.sleep(0.2)
    finally:
        for s in socks:
            s.close()
        backend.close()
    assert not router.thread.is_alive()
    errors = [r for r in caplog.records if r.levelname == "ERROR"]
    assert not errors, errors[0].getMessage()
    said = [r for r in caplog.records if "closing the connections still open" in r.getMessage()]
    assert len(said) == 1
