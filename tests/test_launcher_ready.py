"""The moment a server says it serves: the app's startup (where `kvshare serve` prints
"kvshare: serving ... at URL", the line a model router or a script waits for) runs before
Hypercorn accepts connections, so the sockets must already listen then; a client that
connects in that window is queued and answered, not refused (launcher.make_config)."""

from __future__ import annotations

import socket
import threading

from kvshare.server.app import create_app
from kvshare.server.launcher import bind_socket
from kvshare.server.settings import ServerSettings

from fake_engine import FakeEngine
from test_host_list import serving_in_thread


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
    with serving_in_thread(app, listeners):
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
