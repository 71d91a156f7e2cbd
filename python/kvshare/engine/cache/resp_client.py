"""A Redis (RESP2) client in which every command has a deadline: the shared tier's connection.

redis-py's `socket_timeout` bounds each socket read, not a command: a reply that trickles in a
byte at a time never times out, and the thread waiting on it (the engine's, during a restore)
waits forever. Here one deadline covers a whole call: connecting (with AUTH and SELECT),
sending the pipeline and reading every reply. Each socket operation gets what is left of it,
so a call returns or raises `RemoteError` within its timeout plus one scheduling slice.

A call is a pipeline (one or more commands sent together, replies read in order). An error
reply (`-WRONGTYPE ...`, `-OOM ...`) is returned in its place as a `ReplyError`, not raised:
the caller decides what each means. Anything else (refused, reset, a deadline missed, bytes
that are not RESP) raises `RemoteError` and the connection is dropped, since its stream may
hold half a reply. Idle connections are pooled (`max_idle`); threads share one client.

URLs: `redis://[[user]:password@]host[:port][/db]`, `rediss://...` (TLS, verified as the
system trusts), `unix://[[user]:password@]/path[?db=N]`.
"""

from __future__ import annotations

import contextlib
import socket
import ssl
import threading
import time
from collections.abc import Sequence
from urllib.parse import parse_qs, unquote, urlsplit

Arg = bytes | str | int | float
Reply = bytes | int | list | None


class RemoteError(Exception):
    """The call failed as a whole (connection refused or reset, deadline missed, protocol)."""


class DeadlineExceeded(RemoteError):
    """The call's deadline passed before its replies were all read."""


class ReplyError(Exception):
    """An error reply from the server, standing in the pipeline's results for its command."""

    @property
    def wrong_type(self) -> bool:
        return str(self).startswith("WRONGTYPE")


def encode(command: Sequence[Arg]) -> bytes:
    parts = [b"*%d\r\n" % len(command)]
    for a in command:
        b = a if isinstance(a, bytes) else str(a).encode()
        parts.append(b"$%d\r\n" % len(b))
        parts.append(b)
        parts.append(b"\r\n")
    return b"".join(parts)


class _Connection:
    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.buf = bytearray()
        self.pos = 0

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()

    def _left(self, deadline: float) -> float:
        left = deadline - time.monotonic()
        if left <= 0:
            raise DeadlineExceeded("deadline passed")
        return left

    def send(self, data: bytes, deadline: float) -> None:
        self.sock.settimeout(self._left(deadline))
        try:
            self.sock.sendall(data)  # the timeout bounds the whole sendall
        except socket.timeout:
            raise DeadlineExceeded("deadline passed while sending") from None

    def _fill(self, deadline: float) -> None:
        if self.pos and self.pos >= len(self.buf) // 2:
            del self.buf[:self.pos]
            self.pos = 0
        self.sock.settimeout(self._left(deadline))
        try:
            data = self.sock.recv(1 << 18)
        except socket.timeout:
            raise DeadlineExceeded("deadline passed while reading") from None
        if not data:
            raise RemoteError("connection closed by the server")
        self.buf += data

    def _line(self, deadline: float) -> bytes:
        while True:
            end = self.buf.find(b"\r\n", self.pos)
            if end >= 0:
                line = bytes(self.buf[self.pos:end])
                self.pos = end + 2
                return line
            if len(self.buf) - self.pos > 1 << 16:
                raise RemoteError("reply line too long: not a Redis server?")
            self._fill(deadline)

    def _bulk(self, n: int, deadline: float) -> bytes:
        have = len(self.buf) - self.pos
        if have >= n + 2:
            out = bytes(self.buf[self.pos:self.pos + n])
            self.pos += n + 2
            return out
        # a large value: received straight into its own buffer (no growing copies)
        out_buf = bytearray(n + 2)
        out_buf[:have] = self.buf[self.pos:]
        self.buf.clear()
        self.pos = 0
        view = memoryview(out_buf)
        got = have
        while got < n + 2:
            self.sock.settimeout(self._left(deadline))
            try:
                k = self.sock.recv_into(view[got:])
            except socket.timeout:
                raise DeadlineExceeded("deadline passed while reading") from None
            if not k:
                raise RemoteError("connection closed by the server")
            got += k
        if out_buf[n:] != b"\r\n":
            raise RemoteError("malformed bulk reply")
        del view
        del out_buf[n:]
        return bytes(out_buf)

    def reply(self, deadline: float) -> Reply | ReplyError:
        line = self._line(deadline)
        kind, rest = line[:1], line[1:]
        try:
            if kind == b"+":
                return rest
            if kind == b"-":
                return ReplyError(rest.decode("utf-8", "replace"))
            if kind == b":":
                return int(rest)
            if kind == b"$":
                n = int(rest)
                return None if n < 0 else self._bulk(n, deadline)
            if kind == b"*":
                n = int(rest)
                return None if n < 0 else [self.reply(deadline) for _ in range(n)]
        except ValueError:
            pass
        raise RemoteError(f"not a RESP reply: {line[:40]!r}")


class RespClient:
    def __init__(self, url: str, timeout_s: float, max_idle: int = 4):
        self.timeout_s = float(timeout_s)
        self.max_idle = max_idle
        self._idle: list[_Connection] = []
        self._lock = threading.Lock()
        self._closed = False
        u = urlsplit(url)
        self._scheme = u.scheme
        if u.scheme not in ("redis", "rediss", "unix"):
            raise ValueError(f"unsupported Redis URL scheme {u.scheme!r}")
        query = parse_qs(u.query)
        self._user = unquote(u.username) if u.username else None
        self._password = unquote(u.password) if u.password is not None else None
        if u.scheme == "unix":
            self._path = unquote(u.path)
            db = query.get("db", ["0"])[0]
        else:
            self._host, self._port = u.hostname or "127.0.0.1", u.port or 6379
            db = (u.path or "/").strip("/") or query.get("db", ["0"])[0]
        self._db = int(db)

    def _connect(self, deadline: float) -> _Connection:
        left = deadline - time.monotonic()
        if left <= 0:
            raise DeadlineExceeded("deadline passed before connecting")
        try:
            if self._scheme == "unix":
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.settimeout(left)
                sock.connect(self._path)
            else:
                sock = socket.create_connection((self._host, self._port), timeout=left)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                if self._scheme == "rediss":
                    sock.settimeout(max(0.001, deadline - time.monotonic()))
                    sock = ssl.create_default_context().wrap_socket(
                        sock, server_hostname=self._host)
        except socket.timeout:
            raise DeadlineExceeded("deadline passed while connecting") from None
        except (OSError, ssl.SSLError) as e:
            raise RemoteError(f"cannot connect: {e}") from None
        conn = _Connection(sock)
        hello: list[list[Arg]] = []
        if self._password is not None:
            hello.append(["AUTH", self._user, self._password] if self._user
                         else ["AUTH", self._password])
        if self._db:
            hello.append(["SELECT", self._db])
        if hello:
            try:
                for r in self._exchange(conn, hello, deadline):
                    if isinstance(r, ReplyError):
                        raise RemoteError(f"connection set-up refused: {r}")
            except BaseException:
                conn.close()
                raise
        return conn

    @staticmethod
    def _exchange(conn: _Connection, commands: Sequence[Sequence[Arg]], deadline: float
                  ) -> list[Reply | ReplyError]:
        try:
            conn.send(b"".join(encode(c) for c in commands), deadline)
            return [conn.reply(deadline) for _ in commands]
        except RemoteError:
            raise
        except (OSError, ssl.SSLError) as e:
            raise RemoteError(f"{type(e).__name__}: {e}") from None

    def call(self, commands: Sequence[Sequence[Arg]], timeout_s: float | None = None
             ) -> list[Reply | ReplyError]:
        """Send `commands` as one pipeline and return their replies in order, all within
        `timeout_s` (default: the client's) from now; RemoteError otherwise."""
        if not commands:
            return []
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        conn = None
        with self._lock:
            if self._idle:
                conn = self._idle.pop()
        reused = conn is not None
        if conn is None:
            conn = self._connect(deadline)
        try:
            replies = self._exchange(conn, commands, deadline)
        except DeadlineExceeded:
            conn.close()  # a half-read reply may be left in its stream
            raise
        except RemoteError:
            conn.close()
            if not reused:
                raise
            # An idle connection the server closed meanwhile (Redis restarted): the others are
            # as stale. The commands the tier sends are idempotent: once more on a fresh one.
            self._drop_idle()
            conn = self._connect(deadline)
            try:
                replies = self._exchange(conn, commands, deadline)
            except BaseException:
                conn.close()
                raise
        except BaseException:
            conn.close()
            raise
        with self._lock:
            if not self._closed and len(self._idle) < self.max_idle:
                self._idle.append(conn)
                conn = None
        if conn is not None:
            conn.close()
        return replies

    def _drop_idle(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for c in idle:
            c.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self._drop_idle()
