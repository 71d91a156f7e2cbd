"""One model's `kvshare serve` process, started by the router.

It listens on a loopback port it picks itself (`--port 0`); its line `kvshare: serving NAME at
URL` says where, once it serves. Its output is copied to the router's stderr, each line
prefixed with the model's name, and its last lines are kept for the error a failed load
reports. On Linux it gets SIGTERM when the router dies, whatever kills the router (prctl
PR_SET_PDEATHSIG): no child outlives its router. Stopping sends SIGTERM (the server's
graceful shutdown), then SIGKILL after the model's stop timeout."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence

_SERVING = re.compile(r"^kvshare: serving .* at (http://\S+) ")
_PR_SET_PDEATHSIG = 1
TAIL_LINES = 20


def _die_with_parent(parent: int) -> Callable[[], None]:
    def setup() -> None:  # runs in the child between fork and exec
        import ctypes  # noqa: PLC0415

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # the router died before prctl took effect
            os._exit(1)
    return setup


class Child:
    """`on_ready(url)` and `on_exit(returncode)` are called on the event loop that `start` ran
    on; `on_exit` once, after the process is reaped."""

    def __init__(self, name: str, argv: Sequence[str], env: dict[str, str],
                 on_ready: Callable[[str], None], on_exit: Callable[[int], None]):
        self.name = name
        self.argv = list(argv)
        self.env = env
        self.on_ready = on_ready
        self.on_exit = on_exit
        self.proc: subprocess.Popen[bytes] | None = None
        self.tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self.exited = asyncio.Event()
        self.stop_requested = False

    def start(self) -> None:
        """Spawns the process (OSError when it cannot be). Call on the event loop's thread:
        PR_SET_PDEATHSIG fires when the thread that forked ends, and that thread lives as long
        as the router."""
        loop = asyncio.get_running_loop()
        self.proc = subprocess.Popen(
            self.argv, env=self.env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, start_new_session=True,  # the router decides its signals
            preexec_fn=_die_with_parent(os.getpid()) if sys.platform == "linux" else None)
        threading.Thread(target=self._watch, args=(loop,), daemon=True,
                         name=f"child-{self.name}").start()

    def _watch(self, loop: asyncio.AbstractEventLoop) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        ready = False
        for raw in self.proc.stdout:
            line = raw.decode("utf-8", "replace").rstrip()
            self.tail.append(line)
            sys.stderr.write(f"[{self.name}] {line}\n")
            sys.stderr.flush()
            m = _SERVING.match(line) if not ready else None
            if m is not None:
                ready = True
                loop.call_soon_threadsafe(self.on_ready, m.group(1).rstrip("/"))
        code = self.proc.wait()

        def exited() -> None:
            self.exited.set()
            self.on_exit(code)
        with contextlib.suppress(RuntimeError):  # a closed loop: the router is gone already
            loop.call_soon_threadsafe(exited)

    def failure(self) -> str:
        """The child's last error line (`kvshare: error: ...`), else its last line."""
        for line in reversed(self.tail):
            if line.startswith("kvshare: error:"):
                return line.removeprefix("kvshare: error:").strip()
        return self.tail[-1] if self.tail else "no output"

    async def stop(self, timeout: float) -> None:
        """SIGTERM, then SIGKILL after `timeout` seconds; returns once it has exited."""
        if self.proc is None or self.exited.is_set():
            return
        self.stop_requested = True
        self._signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(self.exited.wait(), timeout)
        except asyncio.TimeoutError:
            self._signal(signal.SIGKILL)
            await self.exited.wait()

    def _signal(self, sig: int) -> None:
        assert self.proc is not None
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(sig)
