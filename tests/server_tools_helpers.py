"""A real `kvshare` process on loopback (the tiny model) for the server-tools tests."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import httpx

from tier_helpers import ROOT, TINY_MODEL, _clean_env, served_url, stop_server, wait_healthy


@contextlib.contextmanager
def kvshare_server(args: list[str], log: Path, headers: dict[str, str] | None = None
                   ) -> Iterator[tuple[httpx.Client, subprocess.Popen]]:
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvshare.server.cli", "-m", str(TINY_MODEL), "--port", "0",
             "--parallel", "1", "--ctx-size", "512", *args],
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env=_clean_env(), cwd=ROOT)
    try:
        with httpx.Client(base_url=served_url(proc, log), timeout=60,
                          headers=headers or {}) as c:
            wait_healthy(c, proc, log)
            yield c, proc
    finally:
        stop_server(proc)
