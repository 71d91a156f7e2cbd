"""The moment a server says it serves: the app's startup (where `kvshare serve` prints
"kvshare: serving ... at URL", the line a model router or a script waits for) runs before
Hypercorn accepts connections, so the sockets must already listen then; a client that
connects in that window is queued and answered, not refused (launcher.make_config)."""

from __future__ import annotations

import asyncio
import socket
import threading

from kvshare.server.app import create_app
from kvshare.server.launcher import bind_socket, serve_app
from kvshare.server.settings import ServerSettings

from fake_engine import FakeEngine


def test_a_client_connecting_at_the_ready_line_is_answered():
    listeners = bind_socket("127.0.0.1", 0)
    port = listeners.getsockname()[1]
    # while the model loads (before serve_app) the bound socket refuses
    probe = socket.socket()
    assert probe.connect_ex(("127.0.0.1", port)) != 0
    probe.close()
    early: list[socket.socket | BaseException] = []

    def ready() -> None:  # what `kvshare serve` prints its line from
        c = socket.socket()
        c.settimeout(10)
        try:
            c.connect(("127.0.0.1", port))
            early.append(c)
        except OSError as e:
            c.close()
            early.append(e)

    app = create_app(FakeEngine(), ServerSettings(), on_startup=ready)
    loop = asyncio.new_event_loop()
    stop: list[asyncio.Event] = []
    started = threading.Event()

    async def main():
        stop.append(asyncio.Event())
        started.set()
        await serve_app(app, listeners, graceful_timeout=1.0, stop=stop[0],
                        install_signal_handlers=False)

    thread = threading.Thread(target=loop.run_until_complete, args=(main(),), daemon=True)
    thread.start()
    started.wait(5)
    try:
        for _ in range(200):
            if early:
                break
            threading.Event().wait(0.05)
        assert early and isinstance(early[0], socket.socket), early
        c = early[0]
        c.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        reply = b""
        while chunk := c.recv(4096):
            reply += chunk
        c.close()
        assert reply.startswith(b"HTTP/1.1 200"), reply[:200]
    finally:
        loop.call_soon_threadsafe(stop[0].set)
        thread.join(15)
