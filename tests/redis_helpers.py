"""A real `redis-server` on a loopback port for the shared-tier tests (tests/test_replicas.py,
tests/test_remote_tier.py): started from Debian's package (scripts/test.sh installs it where
missing), no persistence, its own temp dir; stop/start keep the port so clients reconnect."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time

import pytest

REDIS_SERVER = shutil.which("redis-server")


def require_redis() -> None:
    """Skip without redis-server, except under scripts/test.sh (KVSHARE_REQUIRE_REDIS=1, after
    it installed redis-server) or CI (`CI` set), where its absence is a failure."""
    if REDIS_SERVER is None:
        if os.environ.get("CI") or os.environ.get("KVSHARE_REQUIRE_REDIS"):
            pytest.fail("redis-server is not installed (scripts/test.sh installs it)")
        pytest.skip("redis-server is not installed (apt-get install redis-server)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    def __init__(self, maxmemory: str = "512mb"):
        require_redis()
        self.dir = tempfile.mkdtemp(prefix="kvshare-redis-")
        self.maxmemory = maxmemory
        self.proc: subprocess.Popen | None = None
        self.port = 0
        for _ in range(5):  # another process may take the port between probe and bind
            self.port = _free_port()
            if self.start():
                break
        else:
            raise RuntimeError(f"redis-server did not start: {self.log()}")

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def log(self) -> str:
        try:
            with open(os.path.join(self.dir, "redis.log")) as f:
                return f.read()[-4000:]
        except OSError:
            return ""

    def start(self, timeout: float = 10.0) -> bool:
        """Start (again, on the same port, empty). False if it exited at once."""
        self.proc = subprocess.Popen(
            [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--maxmemory", self.maxmemory,
             "--maxmemory-policy", "allkeys-lru", "--dir", self.dir,
             "--logfile", os.path.join(self.dir, "redis.log")],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False
            try:
                if self.client().ping():
                    return True
            except Exception:  # noqa: BLE001 - not up yet
                time.sleep(0.02)
        return False

    def stop(self) -> None:
        """SIGKILL: Redis vanishes mid-conversation (connections reset, no goodbye)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def client(self):
        import redis

        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=2)

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)
