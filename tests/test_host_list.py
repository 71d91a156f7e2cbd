"""llama-server's `--host 127.0.0.1,::1`: a comma-separated host list is listened on at each
address, one port for all (launcher.bind_socket, flag_types.host)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from typing import Iterator

import httpx
import pytest

from kvshare.server.app import create_app
from kvshare.server.cli import flag_types
from kvshare.server.launcher import bind_socket, serve_app
from kvshare.server.settings import ServerSettings

from fake_engine import FakeEngine


def ipv6_loopback() -> bool:
    if not socket.has_ipv6:
        return False
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


def test_host_flag_takes_a_list_and_refuses_socket_paths():
    assert flag_types.host("127.0.0.1") == "127.0.0.1"
    assert flag_types.host("127.0.0.1, ::1") == "127.0.0.1,::1"
    for bad in ("", "127.0.0.1,", "/tmp/llama.sock", "llama.sock"):
        with pytest.raises(ValueError):
            flag_types.host(bad)


def test_llama_server_host_list_parses():
    from kvshare.server.cli.parser import build_parser
    args = build_parser().parse_args(["serve", "--host", "127.0.0.1,::1", "--port", "0"])
    assert args.host == "127.0.0.1,::1"


def test_bind_list_shares_one_port():
    hosts = "127.0.0.1,::1" if ipv6_loopback() else "127.0.0.1,localhost"
    listeners = bind_socket(hosts, 0)
    try:
        ports = {s.getsockname()[1] for s in listeners.socks}
        assert len(listeners.socks) == 2 and len(ports) == 1 and 0 not in ports
    finally:
        listeners.close()


@pytest.mark.skipif(not ipv6_loopback(), reason="no IPv6 loopback here")
def test_server_answers_on_each_address():
    listeners = bind_socket("127.0.0.1,::1", 0)
    port = listeners.getsockname()[1]
    with serving_in_thread(create_app(FakeEngine(), ServerSettings()), listeners):
        for base in (f"http://127.0.0.1:{port}", f"http://[::1]:{port}"):
            for _ in range(100):
                try:
                    r = httpx.get(base + "/health", timeout=2)
                    break
                except httpx.HTTPError:
                    threading.Event().wait(0.05)
            assert r.status_code == 200 and r.json()["status"] == "ok", base


@contextlib.contextmanager
def serving_in_thread(app, listeners) -> Iterator[None]:
    """`serve_app(app, listeners)` on its own event loop in a thread, stopped on exit."""
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
        yield
    finally:
        loop.call_soon_threadsafe(stop[0].set)
        thread.join(15)
