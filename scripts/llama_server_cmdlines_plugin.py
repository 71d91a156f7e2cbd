"""pytest plugin for scripts/extract_llama_server_cmdlines.py: run inside llama.cpp's
tools/server/tests, it records the argument list and environment each test's
`ServerProcess.start()` would launch llama-server with, and launches nothing.

`start()` builds its arguments and calls `subprocess.Popen`; here that call records them and
stops `start()`, which then returns as if the server were up. The test's first request then
fails, so a launch after a test's first request is not seen (llama.cpp's tests launch before
they ask). Nothing is downloaded: `load_all` (the presets' warm-up) is skipped and `wget` is a
stand-in (the LoRA and draft-model files keep their names)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from typing import Any

_wget = types.ModuleType("wget")
_wget.download = lambda url, out=None: out  # type: ignore[attr-defined]
sys.modules.setdefault("wget", _wget)

RECORDS: list[dict[str, Any]] = []
_current: dict[str, str] = {"test": ""}
# set by utils.ServerProcess.start() for every launch: not the test's choice
_HARNESS_ENV = ("LLAMA_SERVER_DEBUG_FAKE_TIMING", "LLAMA_CACHE")


class _Launched(Exception):
    pass


class _NoServer(Exception):
    pass


def _record_popen(args: Any, **kw: Any) -> Any:
    env = kw.get("env") or {}
    extra = {k: str(v) for k, v in env.items()
             if k not in _HARNESS_ENV and os.environ.get(k) != v}
    RECORDS.append({"test": _current["test"], "argv": [str(a) for a in args[1:]],
                    "env": extra})
    raise _Launched


def pytest_configure(config: Any) -> None:
    import utils  # llama.cpp's tools/server/tests/utils.py

    utils.ServerPreset.load_all = staticmethod(lambda: None)
    start = utils.ServerProcess.start

    def recording_start(self: Any, *a: Any, **kw: Any) -> None:
        real = subprocess.Popen
        subprocess.Popen = _record_popen  # type: ignore[misc, assignment]
        try:
            start(self, *a, **kw)
        except _Launched:
            pass
        finally:
            subprocess.Popen = real  # type: ignore[misc]

    def no_server(self: Any, *a: Any, **kw: Any) -> Any:
        raise _NoServer("recording only: no server runs")

    utils.ServerProcess.start = recording_start
    utils.ServerProcess.stop = lambda self: None
    for name in ("make_request", "make_stream_request", "make_any_request"):
        if hasattr(utils.ServerProcess, name):
            setattr(utils.ServerProcess, name, no_server)


def pytest_runtest_setup(item: Any) -> None:
    _current["test"] = item.nodeid


def pytest_unconfigure(config: Any) -> None:
    out = os.environ.get("KVSHARE_CMDLINES_OUT")
    if out:
        with open(out, "w") as f:
            json.dump(RECORDS, f)
