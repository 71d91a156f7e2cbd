"""Helpers for the tier integration tests (tests/test_tiers_integration.py): real `kvshare serve`
processes on loopback ports with real cache directories, an httpx client per server, cold-run
references and output comparison.

Two ways to start a server, both running the real CLI (`kvshare.server.cli.main(argv)`: argument
parsing, model load, engine, tiers, Hypercorn on a socket) in its own process:

- `SubprocessLauncher`: `python -m kvshare.server.cli serve ...`, exactly as a user runs it.
- `ForkLauncher`: a "zygote" process (this file run as a script) imports kvshare, numpy, numba,
  Starlette and Hypercorn once, then forks one child per server that calls `cli.main(argv)`.
  Start-up drops from ~3-6 s (mostly imports) to a fraction of a second, which is what makes
  50 kill -9 / restart cycles affordable. The zygote holds no threads, files or sockets of the
  server: every server state (model, engine, disk store, its `.lock`) is created in the child.

`KVSHARE_TIER_TEST_NO_FORK=1` makes every server a plain subprocess (slower; same checks).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TINY_MODEL = ROOT / "tests" / "data" / "models" / "tiny-qwen3-chat.gguf"
STARTUP_TIMEOUT = float(os.environ.get("KVSHARE_TEST_STARTUP_TIMEOUT", "120"))
_SERVING = re.compile(r"kvshare: serving \S+ at (http://[^\s]+) ")


def served_url(proc: subprocess.Popen, log: Path, seconds: float = 120) -> str:
    """The URL a server started with `--port 0` says it serves at (its start-up line in
    `log`): the OS picks the port as the server binds it, where a free port picked by the
    test, closed and then passed could be taken in between. The server exiting or the time
    running out fails with its log."""
    deadline = time.monotonic() + seconds
    while True:
        m = _SERVING.search(log.read_text(errors="replace"))
        if m:
            return m.group(1)
        assert proc.poll() is None, log.read_text()
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.05)


def wait_healthy(c: Any, proc: subprocess.Popen, log: Path,
                 seconds: float = 120) -> None:
    """Poll /health through `c` until 200; the server exiting or the time running out fails
    with its log."""
    import httpx  # noqa: PLC0415

    deadline = time.monotonic() + seconds
    while True:
        assert proc.poll() is None, log.read_text()
        try:
            if c.get("/health").status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.05)


def stop_server(proc: subprocess.Popen) -> None:
    """SIGTERM a server process and wait for it (30 s), then SIGKILL it (10 s more)."""
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


def keepalive_limits(args) -> Any:
    """An httpx client's pool for a server started with `args`. The server closes a keep-alive
    connection idle for --body-timeout (30 s by default); a pooled connection reused just as
    the server closes it fails with "Server disconnected without sending a response" (seen in
    CI after a ~30 s gap between two requests, and with --body-timeout 1 after a 1 s wait):
    idle connections are dropped well before the server drops them."""
    import httpx  # noqa: PLC0415

    body_timeout = 30.0
    if "--body-timeout" in args:
        body_timeout = float(args[list(args).index("--body-timeout") + 1])
    return httpx.Limits(keepalive_expiry=body_timeout / 3)


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("KVSHARE_")}


# ---------------------------------------------------------------------------- launchers

class SubprocessLauncher:
    """Each server is `python -m kvshare.server.cli serve ...`."""

    def __init__(self):
        self._procs: dict[int, subprocess.Popen] = {}

    def spawn(self, argv: list[str], log_path: str, env: dict[str, str] | None = None) -> int:
        with open(log_path, "ab") as log:
            proc = subprocess.Popen([sys.executable, "-m", "kvshare.server.cli", *argv],
                                    stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, env={**_clean_env(), **(env or {})})
        self._procs[proc.pid] = proc
        return proc.pid

    def poll(self, pid: int) -> int | None:
        return self._procs[pid].poll()

    def wait(self, pid: int, timeout: float) -> int:
        rc = self._procs[pid].wait(timeout)
        del self._procs[pid]
        return rc

    def close(self) -> None:
        for proc in list(self._procs.values()):
            if proc.poll() is None:
                proc.kill()
            proc.wait(10)
        self._procs.clear()


class ForkLauncher:
    """Servers forked from a pre-imported zygote process (see the module docstring)."""

    def __init__(self):
        self._zygote = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--zygote"],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        env=_clean_env(), text=True, bufsize=1)
        self._exited: dict[int, int] = {}
        ready = self._zygote.stdout.readline()
        if ready.strip() != "ready":
            raise RuntimeError(f"zygote failed to start: {ready!r}")

    def _call(self, **cmd) -> dict:
        self._zygote.stdin.write(json.dumps(cmd) + "\n")
        self._zygote.stdin.flush()
        line = self._zygote.stdout.readline()
        if not line:
            raise RuntimeError("the zygote process died")
        return json.loads(line)

    def spawn(self, argv: list[str], log_path: str, env: dict[str, str] | None = None) -> int:
        return int(self._call(cmd="spawn", argv=argv, log=log_path, env=env or {})["pid"])

    def poll(self, pid: int) -> int | None:
        if pid in self._exited:
            return self._exited[pid]
        rc = self._call(cmd="poll", pid=pid)["rc"]
        if rc is not None:
            self._exited[pid] = rc
        return rc

    def wait(self, pid: int, timeout: float) -> int:
        if pid in self._exited:
            return self._exited.pop(pid)
        rc = self._call(cmd="wait", pid=pid, timeout=timeout)["rc"]
        if rc is None:
            raise subprocess.TimeoutExpired(f"server {pid}", timeout)
        return rc

    def close(self) -> None:
        if self._zygote.poll() is None:
            self._zygote.stdin.close()  # EOF: the zygote kills and reaps what is left, exits
            try:
                self._zygote.wait(20)
            except subprocess.TimeoutExpired:
                self._zygote.kill()
                self._zygote.wait(10)


def make_launcher(fork: bool = True):
    if fork and os.environ.get("KVSHARE_TIER_TEST_NO_FORK", "") not in ("1", "true", "yes"):
        return ForkLauncher()
    return SubprocessLauncher()


def _zygote_main() -> None:  # pragma: no cover - runs in the zygote process
    import kvshare.engine.engine  # noqa: F401  everything the server imports, once
    import kvshare.model.chat_template  # noqa: F401
    import kvshare.model.llama  # noqa: F401
    import kvshare.model.loader  # noqa: F401
    import kvshare.model.tokenizer  # noqa: F401
    import kvshare.server.app  # noqa: F401
    import kvshare.server.launcher  # noqa: F401  (pre-import only)
    from kvshare.server import cli

    children: set[int] = set()
    out = sys.stdout

    def reply(**kw) -> None:
        out.write(json.dumps(kw) + "\n")
        out.flush()

    def reap(pid: int, block: bool) -> int | None:
        done, status = os.waitpid(pid, 0 if block else os.WNOHANG)
        if done == 0:
            return None
        children.discard(pid)
        return os.waitstatus_to_exitcode(status)

    reply_ready = "ready\n"
    out.write(reply_ready)
    out.flush()
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "spawn":
            out.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                rc = 1
                try:
                    fd = os.open(cmd["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
                    os.dup2(fd, 1)
                    os.dup2(fd, 2)
                    os.close(fd)
                    null = os.open(os.devnull, os.O_RDONLY)
                    os.dup2(null, 0)
                    os.close(null)
                    # The signal dispositions of a fresh `python -m kvshare.server.cli` (what
                    # SubprocessLauncher runs and users run): Python's start-up makes SIGINT
                    # raise KeyboardInterrupt and *ignores* SIGPIPE, so a write to a socket
                    # whose peer is gone raises BrokenPipeError. With SIGPIPE at SIG_DFL (as
                    # this code once set it) a server whose Redis writer or reader was sending
                    # when `redis_server.stop()` killed Redis died of SIGPIPE (exit -13, no
                    # traceback in its log) and its in-flight requests got "Server
                    # disconnected without sending a response" (test_replicas.py::
                    # test_redis_killed_mid_run_every_request_still_succeeds, 1 run in 3-9).
                    signal.signal(signal.SIGINT, signal.default_int_handler)
                    signal.signal(signal.SIGTERM, signal.SIG_DFL)
                    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
                    os.environ.update(cmd.get("env") or {})  # e.g. a test hook of the writer
                    sys.argv = ["kvshare", *cmd["argv"]]
                    rc = cli.main(cmd["argv"]) or 0
                except SystemExit as e:
                    rc = e.code if isinstance(e.code, int) else 1
                except BaseException:
                    import traceback

                    traceback.print_exc()
                finally:
                    try:
                        sys.stdout.flush()
                        sys.stderr.flush()
                    finally:
                        os._exit(rc)
            children.add(pid)
            reply(pid=pid)
        elif cmd["cmd"] == "poll":
            reply(rc=reap(cmd["pid"], False))
        elif cmd["cmd"] == "wait":
            deadline = time.monotonic() + float(cmd["timeout"])
            rc = reap(cmd["pid"], False)
            while rc is None and time.monotonic() < deadline:
                time.sleep(0.01)
                rc = reap(cmd["pid"], False)
            reply(rc=rc)
    for pid in list(children):
        try:
            os.kill(pid, signal.SIGKILL)
            reap(pid, True)
        except OSError:
            pass


# ---------------------------------------------------------------------------- a server

class Server:
    """One `kvshare serve` process (port chosen by the OS and read from its log)."""

    def __init__(self, launcher, *args: str, model: Path | str = TINY_MODEL, log_dir: str | None = None,
                 env: dict[str, str] | None = None):
        import httpx

        self.launcher = launcher
        self.args = ["serve", "--host", "127.0.0.1", "--port", "0", "--model", str(model),
                     "--log-level", "warning", *args]
        fd, self.log_path = tempfile.mkstemp(prefix="kvshare-tier-", suffix=".log", dir=log_dir)
        os.close(fd)
        self.pid: int | None = None
        self.rc: int | None = None
        self.url = ""
        self.started_s = 0.0
        t0 = time.monotonic()
        self.pid = launcher.spawn(self.args, self.log_path, env)
        deadline = t0 + STARTUP_TIMEOUT
        while not self.url:
            m = _SERVING.search(self.log())
            if m:
                self.url = m.group(1)
                break
            rc = launcher.poll(self.pid)
            if rc is not None:
                self.rc = rc
                raise RuntimeError(f"server exited with {rc} at start-up:\n{self.log()}")
            if time.monotonic() > deadline:
                self.kill9()
                raise RuntimeError(f"server not up after {STARTUP_TIMEOUT} s:\n{self.log()}")
            time.sleep(0.01)
        self.client = httpx.Client(base_url=self.url, timeout=httpx.Timeout(300.0, connect=5.0),
                                   limits=keepalive_limits(args))
        while True:
            try:
                if self.client.get("/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                self.kill9()
                raise RuntimeError(f"server not healthy after {STARTUP_TIMEOUT} s:\n{self.log()}")
            time.sleep(0.01)
        self.started_s = time.monotonic() - t0

    # ---- process control
    def log(self) -> str:
        return Path(self.log_path).read_text(errors="replace")[-8000:]

    def alive(self) -> bool:
        return self.pid is not None and self.rc is None and self.launcher.poll(self.pid) is None

    def kill9(self) -> int:
        """SIGKILL, no drain: whatever the disk writer was doing is cut off."""
        if self.pid is not None and self.rc is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
            self.rc = self.launcher.wait(self.pid, 30)
        self._close_client()
        return self.rc

    def terminate(self, timeout: float = 60.0) -> int:
        """SIGTERM: graceful shutdown, which drains the disk writer's queue."""
        if self.rc is None:
            os.kill(self.pid, signal.SIGTERM)
            self.rc = self.launcher.wait(self.pid, timeout)
        self._close_client()
        return self.rc

    def _close_client(self) -> None:
        c = getattr(self, "client", None)
        if c is not None:
            c.close()

    # ---- API
    def post(self, path: str, body: dict) -> dict:
        r = self.client.post(path, json=body)
        if r.status_code != 200:
            raise AssertionError(f"{path} -> {r.status_code}: {r.text[:500]}\n{self.log()}")
        return r.json()

    def chat(self, messages: list[dict], max_tokens: int = 6, salt: str | None = None, **kw) -> dict:
        return self.post("/v1/chat/completions", chat_body(messages, max_tokens, salt, **kw))

    def cache(self) -> dict:
        r = self.client.get("/cache")
        assert r.status_code == 200, r.text
        return r.json()

    def tier(self, name: str) -> dict:
        return self.cache()["tiers"][name]

    def wait_ram_idle(self, timeout: float = 60.0) -> dict:
        """Until every finished request's blocks are in the RAM tier (the saver thread copies
        them after the reply). Call it with no request in flight; see `wait_disk_idle`."""
        deadline = time.monotonic() + timeout
        while True:
            c = self.cache()  # one engine snapshot: sequences first, then the tiers
            released, r = c["sequences"] == 0, c["tiers"]["ram"]
            if released and r["saves_pending"] == 0:
                return r
            if time.monotonic() > deadline:
                raise AssertionError(f"RAM tier saves still pending after {timeout} s: {r}")
            time.sleep(0.02)

    def wait_disk_idle(self, timeout: float = 60.0) -> dict:
        """Until every finished request's entry is written (committed, skipped or dropped).
        Call it with no request in flight. No timing window: the engine hands a sequence's
        save to the tiers after its reply and before it releases the sequence, so once `/cache`
        reports no sequences every save has been handed over; `queued` counts a save from then
        until the writer is done with it (saves not yet given to the writer included)."""
        deadline = time.monotonic() + timeout
        while True:
            c = self.cache()  # one engine snapshot: the tiers are read after the sequences,
            released, d = c["sequences"] == 0, c["tiers"]["disk"]  # so every save is covered
            if released and d["queued"] == 0:
                return d
            if time.monotonic() > deadline:
                raise AssertionError(f"disk writer still busy after {timeout} s: {d}")
            time.sleep(0.02)


# ---------------------------------------------------------------------------- requests

def chat_body(messages: list[dict], max_tokens: int = 6, salt: str | None = None, **kw) -> dict:
    body: dict[str, Any] = {"messages": messages, "max_tokens": max_tokens, "temperature": 0,
                            "logprobs": True, "top_logprobs": 3, **kw}
    if salt is not None:
        body["cache_salt"] = salt
    return body


def reply_text(resp: dict) -> str:
    return resp["choices"][0]["message"]["content"] or ""


def cache_n(resp: dict) -> int:
    return int(resp["timings"]["cache_n"])


def cached_fraction(resp: dict) -> float:
    return cache_n(resp) / resp["usage"]["prompt_tokens"]


def tokens_of(resp: dict) -> list[tuple[bytes, float, tuple]]:
    out = []
    for e in resp["choices"][0]["logprobs"]["content"]:
        top = tuple((bytes(t["bytes"]), t["logprob"]) for t in e["top_logprobs"])
        out.append((bytes(e["bytes"]), float(e["logprob"]), top))
    return out


def assert_same_output(got: dict, cold: dict, what: str = "", tol: float = 1e-4) -> None:
    """Greedy tokens identical, logprobs (and the top alternatives) equal within `tol`."""
    a, b = tokens_of(got), tokens_of(cold)
    ctx = f"{what}: cache_n={cache_n(got)} prompt={got['usage']['prompt_tokens']}"
    assert [x[0] for x in a] == [x[0] for x in b], f"{ctx}: tokens differ from the cold run"
    assert got["choices"][0]["finish_reason"] == cold["choices"][0]["finish_reason"], ctx
    assert reply_text(got) == reply_text(cold), ctx
    for i, (x, y) in enumerate(zip(a, b)):
        assert abs(x[1] - y[1]) <= tol, f"{ctx}: token {i} logprob {x[1]} vs cold {y[1]}"
        assert [t for t, _ in x[2]] == [t for t, _ in y[2]], f"{ctx}: token {i} top tokens differ"
        for (_, lx), (_, ly) in zip(x[2], y[2]):
            assert abs(lx - ly) <= tol, f"{ctx}: token {i} top logprob {lx} vs cold {ly}"


class ColdRuns:
    """Reference outputs from a server with every cache off (no sharing, no tiers), memoized."""

    def __init__(self, server: Server):
        self.server = server
        self._memo: dict[str, dict] = {}

    def __call__(self, messages: list[dict], max_tokens: int = 6) -> dict:
        key = json.dumps([messages, max_tokens], sort_keys=True)
        if key not in self._memo:
            r = self.server.chat(messages, max_tokens)
            assert cache_n(r) == 0
            self._memo[key] = r
        return self._memo[key]


COLD_ARGS = ("--no-slot-attach", "--cache-ram", "0")


# ---------------------------------------------------------------------------- content

def text(seed: int, n_chars: int) -> str:
    """Deterministic filler text. The tiny model's vocabulary is mostly single characters, so
    n_chars characters are about n_chars tokens."""
    import numpy as np

    rng = np.random.default_rng(seed)
    words = []
    n = 0
    while n < n_chars:
        w = "".join(chr(ord("a") + int(c)) for c in rng.integers(0, 26, int(rng.integers(2, 9))))
        words.append(w)
        n += len(w) + 1
    return " ".join(words)[:n_chars]


def conversation(system: str, user: str) -> list[dict]:
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


def next_turn(messages: list[dict], reply: str, user: str) -> list[dict]:
    return [*messages, {"role": "assistant", "content": reply}, {"role": "user", "content": user}]


def dir_files(path: Path) -> dict[str, int]:
    """Name -> size of every regular file in a cache dir (the `.lock` included)."""
    out = {}
    for p in Path(path).iterdir():
        try:
            if p.is_file():
                out[p.name] = p.stat().st_size
        except FileNotFoundError:  # removed while we looked
            pass
    return out


def entry_files(path: Path) -> dict[str, int]:
    return {k: v for k, v in dir_files(path).items() if k != ".lock"}


if __name__ == "__main__" and sys.argv[1:] == ["--zygote"]:
    _zygote_main()
