"""One `kvshare serve` process for the benchmarks: started exactly as a user runs it (a
subprocess on 127.0.0.1, port chosen by the OS and read from its log, no KVSHARE_* variables
inherited unless passed as `env`), ready once /health answers, stopped by SIGTERM (graceful) or SIGKILL after a wait.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

SERVING = re.compile(r"kvshare: serving \S+ at (http://[^\s]+) ")


class ServeProcess:
    def __init__(self, args: list[str], log_path: Path | str, *, log_level: str = "warning",
                 startup_timeout: float = 600.0, client_timeout: float = 600.0,
                 env: dict[str, str] | None = None, launcher: str | None = None):
        self.log_path = Path(log_path)
        # the benches measure Gemma 3 270M (llama.cpp's side-by-side numbers and the issues'
        # targets are on it) unless told otherwise; `kvshare serve`'s own default is the
        # chat-tuned SmolLM2
        model = [] if "--model" in args else ["--model", "gemma3-270m"]
        # `launcher`: a script run in place of kvshare's command line module, e.g.
        # tests/gpu_emu/kvshare_emu.py (the same command line on the CPU emulator of CuPy)
        entry = [launcher] if launcher else ["-m", "kvshare.server.cli"]
        cmd = [sys.executable, *entry, "serve", "--host", "127.0.0.1",
               "--port", "0", "--log-level", log_level, *model, *args]
        # `env`: variables the caller sets on purpose (e.g. KVSHARE_GPU_WEIGHTS, which has no
        # flag), on top of the environment less the inherited KVSHARE_* ones
        child_env = {k: v for k, v in os.environ.items() if not k.startswith("KVSHARE_")}
        child_env.update(env or {})
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                         env=child_env)
        deadline = time.monotonic() + startup_timeout
        self.url = ""
        while not self.url:
            m = SERVING.search(self.log())
            if m:
                self.url = m.group(1)
            elif self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"server did not start:\n{self.log()[-3000:]}")
            else:
                time.sleep(0.05)
        self.client = httpx.Client(base_url=self.url,
                                   timeout=httpx.Timeout(client_timeout, connect=10.0))
        while True:
            try:
                if self.client.get("/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"server not healthy:\n{self.log()[-3000:]}")
            time.sleep(0.05)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, timeout: float = 60.0) -> None:
        client = getattr(self, "client", None)
        if client is not None:
            client.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
