"""Misbehaving Redis servers on a loopback port, for the shared tier's deadline tests: each
speaks just enough RESP to be taken for Redis, then fails in one way.

Modes (`FakeRedis.mode`, switchable while it runs; open connections follow at their next
command):
- `trickle`: every command gets a reply that never ends, one byte every 0.3 s;
- `silent`: connections are accepted and read, never answered;
- `reset`: a connection is reset (RST) as soon as a command arrives;
- `empty`: answers as an empty Redis would (PING, EXISTS 0, GET nil, SET OK, ...).
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
import time

TRICKLE_GAP_S = 0.3


_EMPTY_REPLY = {b"PING": b"+PONG\r\n", b"GET": b"$-1\r\n", b"GETEX": b"$-1\r\n",
                b"SET": b"+OK\r\n"}


def _parse_commands(buf: bytes) -> tuple[list[list[bytes]], bytes]:
    """The complete commands (arrays of bulk strings) at the head of `buf`, and the rest."""
    out = []
    while True:
        pos, args = 0, []
        try:
            end = buf.index(b"\r\n", pos)
            n = int(buf[pos + 1:end])
            pos = end + 2
            for _ in range(n):
                end = buf.index(b"\r\n", pos)
                size = int(buf[pos + 1:end])
                if len(buf) < end + 2 + size + 2:
                    return out, buf
                args.append(buf[end + 2:end + 2 + size])
                pos = end + 2 + size + 2
        except ValueError:
            return out, buf
        out.append(args)
        buf = buf[pos:]


class FakeRedis:
    def __init__(self, mode: str):
        self.mode = mode
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(256)
        self.sock.settimeout(0.1)
        self.port = self.sock.getsockname()[1]
        self.connections = 0
        self._stop = threading.Event()
        self._conns: list[socket.socket] = []
        self._threads: list[threading.Thread] = []
        self._accept = threading.Thread(target=self._accept_loop, daemon=True)
        self._accept.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self.connections += 1
            self._conns.append(conn)
            t = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            t.start()
            self._threads.append(t)

    def _serve(self, conn: socket.socket) -> None:
        conn.settimeout(0.1)
        buf = b""
        with contextlib.suppress(OSError):
            while not self._stop.is_set():
                try:
                    data = conn.recv(1 << 16)
                except socket.timeout:
                    continue
                if not data:
                    return
                mode = self.mode
                if mode == "reset":
                    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    conn.close()
                    return
                if mode == "empty":
                    buf += data
                    commands, buf = _parse_commands(buf)
                    conn.sendall(b"".join(_EMPTY_REPLY.get(c[0].upper(), b":0\r\n")
                                          for c in commands))
                elif mode == "trickle":
                    reply = b"$1000000\r\n" + b"x" * 1000000
                    for i in range(len(reply)):
                        if self._stop.wait(TRICKLE_GAP_S):
                            return
                        conn.sendall(reply[i:i + 1])
                # silent: read on, answer nothing

    def close(self) -> None:
        self._stop.set()
        self._accept.join(2)
        for t in self._threads:
            t.join(2)
        for c in self._conns:
            with contextlib.suppress(OSError):
                c.close()
        self.sock.close()


def wait_until(cond, timeout: float, step: float = 0.02) -> float:
    """Seconds until `cond()` held; AssertionError after `timeout`."""
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"not within {timeout} s")
        time.sleep(step)
    return time.monotonic() - t0
