"""A subprocess with llama-server's bounds (server-tools.cpp run_subprocess): output past
`max_output` bytes is read and dropped (so the child never blocks on a full pipe) and
"[output truncated]" appended; past `timeout_s` the child is killed and the result says so.
The child runs in its own process group and the whole group is killed, so a command's
background children do not outlive its deadline."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from typing import Callable, Sequence

TRUNCATED = "\n[output truncated]"


@dataclass
class RunResult:
    output: str
    exit_code: int = -1
    timed_out: bool = False


def _kill_group(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


def run_bounded(args: Sequence[str], max_output: int, timeout_s: float, cwd: str | None = None,
                on_chunk: Callable[[str], bool] | None = None) -> RunResult:
    """Runs `args` (stdout and stderr together, stdin closed). `on_chunk` gets each piece of
    output as it arrives (up to the cap); returning False kills the child (a client gone)."""
    try:
        proc = subprocess.Popen(list(args), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, cwd=cwd or None,
                                start_new_session=True)
    except OSError:
        return RunResult("failed to spawn process")
    timed_out = threading.Event()

    def expire() -> None:
        timed_out.set()
        _kill_group(proc)

    timer = threading.Timer(timeout_s, expire)
    timer.daemon = True
    timer.start()
    out = bytearray()
    truncated = False
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    try:
        while True:
            chunk = os.read(fd, 4096)
            if not chunk:
                break
            if truncated:
                continue  # keep draining: a child writing into a full pipe never exits
            room = max_output - len(out)
            if len(chunk) > room:
                chunk, truncated = chunk[:room], True
            out += chunk
            if on_chunk is not None and chunk and not on_chunk(
                    chunk.decode("utf-8", "replace")):
                _kill_group(proc)
                break
    finally:
        timer.cancel()
        proc.stdout.close()
        # a grandchild holding the pipe open ends with the group; the child itself is reaped
        deadline = time.monotonic() + 5
        while proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        if proc.poll() is None:
            _kill_group(proc)
        code = proc.wait()
    text = out.decode("utf-8", "replace") + (TRUNCATED if truncated else "")
    return RunResult(text, code, timed_out.is_set())
