"""Serve the app with Hypercorn: bind first (clear errors, port 0 works), then run until
SIGTERM/SIGINT, then shut down gracefully.

Graceful shutdown: on the first signal the app stops admitting completions (503, /health 503),
Hypercorn stops accepting connections and waits up to `graceful_timeout` seconds for in-flight
requests; shortly before that deadline the remaining generations are cancelled, so their streams
end with an error event and `data: [DONE]` rather than a cut connection. A second signal cancels
them at once. Then the lifespan shuts the engine down. Connections still open then (slow
clients) are cut with one log line (`quiet_cancelled_connections`).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
from typing import Any, Protocol, runtime_checkable

from hypercorn.asyncio import serve as hypercorn_serve
from hypercorn.config import Config

from .hypercorn_errors import install_json_error_bodies

log = logging.getLogger("kvshare.server")


class Listeners:
    """The TCP sockets of one server, bound (listening once `make_config` hands them to
    Hypercorn): one per address of a host list (llama-server's `--host 127.0.0.1,::1`), all
    on one port."""

    def __init__(self, socks: list[socket.socket]):
        self.socks = socks

    def getsockname(self) -> Any:
        return self.socks[0].getsockname()

    def close(self) -> None:
        for s in self.socks:
            s.close()

    def listen(self, backlog: int) -> None:
        for s in self.socks:
            s.listen(backlog)

    def detach(self) -> list[int]:
        """The file descriptors, handed over (Hypercorn owns them from here)."""
        return [s.detach() for s in self.socks]


def _bind_one(host: str, port: int, v6only: bool) -> socket.socket:
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, type_, proto, _, addr = infos[0]
    sock = socket.socket(family, type_, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if v6only and family == socket.AF_INET6:  # `::` beside `0.0.0.0` in a list: both bind
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind(addr)
    except BaseException:
        sock.close()
        raise
    return sock


def bind_socket(host: str, port: int) -> Listeners:
    """Bound sockets for `host`, one address or a comma-separated list; port 0 picks one free
    port, the first address's, for all. Raises OSError (e.g. address in use)."""
    hosts = [h.strip().strip("[]") for h in host.split(",") if h.strip()]
    socks: list[socket.socket] = []
    try:
        for h in hosts:
            socks.append(_bind_one(h, port, v6only=len(hosts) > 1))
            port = socks[0].getsockname()[1]
    except BaseException:
        for s in socks:
            s.close()
        raise
    if not socks:
        raise OSError(f"no address to listen on in {host!r}")
    return Listeners(socks)


def socket_url(sock: Listeners, root_path: str = "") -> str:
    host, port = sock.getsockname()[:2]
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}{root_path.rstrip('/')}"


def make_config(sock: Listeners, *, root_path: str = "", graceful_timeout: float = 10.0,
                log_level: str = "INFO", header_timeout: float | None = 30.0) -> Config:
    """Hypercorn's config. `header_timeout` (the server's body timeout): a connection that has
    not sent a complete request head this long after it opened, or after its previous
    response (keep-alive), is closed (Hypercorn's keep_alive_timeout covers both)."""
    config = Config()
    # Listening from here on: the app's startup (which prints "kvshare: serving ... at URL",
    # what a model router or a script waits for) runs before Hypercorn starts accepting, and
    # a client that connects in between must queue in the backlog, not be refused. (Before
    # this, while the model loads, the sockets are bound but refuse connections.)
    sock.listen(config.backlog)
    config.bind = [f"fd://{fd}" for fd in sock.detach()]  # hypercorn owns them from here
    config.root_path = root_path
    config.graceful_timeout = graceful_timeout
    config.accesslog = None  # the app logs one structured line per completion request
    config.errorlog = logging.getLogger("hypercorn.error")  # through the root logger's format
    config.loglevel = log_level.upper()
    config.keep_alive_timeout = header_timeout if header_timeout and header_timeout > 0 else 30.0
    config.h11_max_incomplete_size = 64 * 1024
    return config


@runtime_checkable
class Lifecycle(Protocol):
    """What the launcher drives at shutdown (`app.KVShareServer`)."""

    body_timeout: float | None

    def begin_shutdown(self) -> None: ...

    def cancel_all(self) -> None: ...

    def in_flight(self) -> int: ...


async def serve_app(app: Any, sock: Listeners, *, root_path: str = "",
                    graceful_timeout: float = 10.0, log_level: str = "INFO",
                    stop: asyncio.Event | None = None,
                    install_signal_handlers: bool = True,
                    server: Lifecycle | None = None,
                    header_timeout: float | None = None) -> None:
    """Serve until `stop` is set (or, with `install_signal_handlers`, SIGTERM/SIGINT).
    `server`: what to tell about the shutdown (kvshare's `app.state.server`; None: nothing,
    e.g. the router). `header_timeout`: see `make_config` (default: the server's body
    timeout, else 30 s)."""
    loop = asyncio.get_running_loop()
    stop = stop or asyncio.Event()
    if server is None:  # kvshare's app carries its server; the router's app has none
        found = getattr(getattr(app, "state", None), "server", None)
        server = found if isinstance(found, Lifecycle) else None
    config = make_config(sock, root_path=root_path, graceful_timeout=graceful_timeout,
                         log_level=log_level,
                         header_timeout=header_timeout
                         or (server.body_timeout if server is not None else None) or 30.0)
    install_json_error_bodies()  # Hypercorn's own 400/431/500 get an OpenAI error body
    signals = 0

    def on_signal(signame: str) -> None:
        nonlocal signals
        signals += 1
        if signals == 1:
            log.info("%s received: shutting down (in-flight requests get up to %.0f s)",
                     signame, graceful_timeout)
            stop.set()
        elif server is not None:
            log.info("%s received again: cancelling in-flight requests", signame)
            server.cancel_all()

    installed = []
    if install_signal_handlers:
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                loop.add_signal_handler(sig, on_signal, sig.name)
                installed.append(sig)
            except (NotImplementedError, RuntimeError):  # not the main thread / platform
                pass

    async def shutdown_trigger() -> None:
        await stop.wait()
        if server is not None:
            server.begin_shutdown()

            def cancel_late() -> None:
                if server.in_flight():
                    log.info("graceful timeout near: cancelling %d in-flight request(s)",
                             server.in_flight())
                server.cancel_all()

            loop.call_later(max(graceful_timeout - 1.0, graceful_timeout * 0.8), cancel_late)

    quiet_cancelled_connections(loop, stop)
    try:
        await hypercorn_serve(app, config, shutdown_trigger=shutdown_trigger)
    finally:
        for sig in installed:
            loop.remove_signal_handler(sig)


def quiet_cancelled_connections(loop: asyncio.AbstractEventLoop, stop: asyncio.Event) -> None:
    """One log line, not a traceback per connection, for connections cut at shutdown.

    Hypercorn cancels the task of every connection still open when it stops (a slow client
    in the middle of its request head or body); asyncio's stream callback then asks the
    cancelled task for its exception, which raises CancelledError into the loop's exception
    handler: a 30-line traceback for each. Once shutdown has begun, those are expected; any
    other error still goes to the handler that was there."""
    previous = loop.get_exception_handler()
    told = False

    def handler(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        nonlocal told
        if stop.is_set() and isinstance(context.get("exception"), asyncio.CancelledError):
            if not told:
                told = True
                log.info("shutdown: closing the connections still open")
            return
        if previous is not None:
            previous(loop, context)
        else:
            loop.default_exception_handler(context)

    loop.set_exception_handler(handler)


def run(app: Any, sock: Listeners, **kwargs: Any) -> None:
    asyncio.run(serve_app(app, sock, **kwargs))
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
