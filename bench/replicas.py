"""What the shared Redis tier and the router buy two replicas (issue 16), on a real model.

A real `redis-server` (Debian's package, loopback, no persistence), two `kvshare serve`
replicas of Gemma 3 270M with `--cache-redis` (each warmed up by one unrelated request), an agent prefix (tools + a long system prompt,
~6K tokens by default), each turn streamed; TTFT = time to the first content delta.

Rows, in one run:
- A, turn 1: A computes the prefix (the cold reference);
- B, turn 1 of another session of the same agent: B has never seen the prefix; it attaches
  from Redis (cached tokens, TTFT / cold);
- B restarted (empty RAM, no disk): attaches from Redis again;
- B, a different agent (control: nothing to attach to, so a cold computation on B);
- through `kvshare route` in front of A and B: a third session's turn 1 and the router's
  overhead on an attached turn (TTFT via the router / direct).
Also printed: Redis's memory after the run (INFO memory) and the bytes written per token.

    python bench/replicas.py [--prefix-words 2400] [--out bench/out/replicas.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from agent_apis import TOOLS, system_prompt
from serve_process import ServeProcess


def start_redis(tmp: str) -> tuple[subprocess.Popen, int]:
    exe = shutil.which("redis-server")
    if exe is None:
        sys.exit("redis-server is not installed (apt-get install redis-server)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--maxmemory", "4gb",
                             "--maxmemory-policy", "allkeys-lru", "--dir", tmp],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    import redis

    deadline = time.monotonic() + 10
    while True:
        try:
            if redis.Redis(port=port).ping():
                return proc, port
        except redis.RedisError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


class Router:
    def __init__(self, backends: list[str], log_path: Path):
        cmd = [sys.executable, "-m", "kvshare.server.cli", "route", "--port", "0",
               "--log-level", "warning"]
        for b in backends:
            cmd += ["--backend", b]
        self.log_path = log_path
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        self.url = ""
        while not self.url:
            m = re.search(r"kvshare: routing at (http://\S+) ", log_path.read_text())
            if m:
                self.url = m.group(1)
            elif self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(log_path.read_text())
            else:
                time.sleep(0.05)
        with httpx.Client(base_url=self.url) as c:
            while c.get("/health").status_code != 200:
                time.sleep(0.05)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(20)


def turn(url: str, system: str, question: str, max_tokens: int) -> dict:
    tools = [{"type": "function", "function": {"name": n, "description": d, "parameters": p}}
             for n, d, p in TOOLS]
    body = {"model": "agent", "messages": [{"role": "system", "content": system},
                                           {"role": "user", "content": question}],
            "tools": tools, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft = None
    usage = timings = None
    with httpx.Client(timeout=600) as c, c.stream("POST", url + "/v1/chat/completions",
                                                  json=body) as r:
        if r.status_code != 200:
            r.read()
            raise RuntimeError(f"{r.status_code}: {r.text[:300]}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if ttft is None and ev.get("choices") and ev["choices"][0]["delta"].get("content"):
                ttft = time.perf_counter() - t0
            usage = ev.get("usage") or usage
            timings = ev.get("timings") or timings
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"prompt": usage["prompt_tokens"], "cached": cached,
            "ttft_s": ttft if ttft is not None else time.perf_counter() - t0}


def warm(srv: ServeProcess, max_tokens: int) -> ServeProcess:
    """One unrelated long-ish request first: a process's first forward pass at a long context
    pays one-time costs (~0.7 s here) that are not the tier's."""
    turn(srv.url, "Warm-up. " + " ".join(f"w{i}" for i in range(600)), "hi", max_tokens)
    return srv


def wait_remote_idle(srv: ServeProcess, timeout: float = 300) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        c = srv.client.get("/cache").json()
        r = c["tiers"]["remote"]
        if c["sequences"] == 0 and r["queued"] == 0:
            return r
        if time.monotonic() > deadline:
            raise RuntimeError(f"Redis writes still queued: {r}")
        time.sleep(0.05)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prefix-words", type=int, default=2400)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--out", default=str(Path(__file__).parent / "out" / "replicas.json"))
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="kvshare-bench-replicas-")
    redis_proc, port = start_redis(tmp)
    url = f"redis://127.0.0.1:{port}/0"
    serve_args = ["--kv-unified-per-slot", "8192", "--parallel", "2", "--cache-redis", url]
    system = system_prompt(args.prefix_words)
    other = "Be terse. " + system[::-1]
    rows: dict[str, dict] = {}
    procs: list = []
    try:
        a = warm(ServeProcess(serve_args, Path(tmp) / "a.log"), args.max_tokens)
        b = warm(ServeProcess(serve_args, Path(tmp) / "b.log"), args.max_tokens)
        procs += [a, b]
        rows["A turn 1 (computes)"] = turn(a.url, system, "Where is the build configured?",
                                           args.max_tokens)
        remote = wait_remote_idle(a)
        rows["B turn 1 (from Redis)"] = turn(b.url, system, "Which tests cover the parser?",
                                             args.max_tokens)
        b.stop()
        b = warm(ServeProcess(serve_args, Path(tmp) / "b2.log"), args.max_tokens)
        procs.append(b)
        rows["B restarted (from Redis)"] = turn(b.url, system, "List the modules.",
                                                args.max_tokens)
        rows["B other agent (cold)"] = turn(b.url, other, "Where is the build configured?",
                                            args.max_tokens)
        router = Router([a.url, b.url], Path(tmp) / "router.log")
        procs.append(router)
        rows["router, new session"] = turn(router.url, system, "What does main do?",
                                           args.max_tokens)
        q = "What does main do?"  # the same turn again: attached, so the router's cost shows
        direct = [turn(a.url, system, q, args.max_tokens)["ttft_s"] for _ in range(3)]
        routed = [turn(router.url, system, q, args.max_tokens)["ttft_s"] for _ in range(3)]
        import redis

        mem = redis.Redis(port=port).info("memory")["used_memory"]
    finally:
        for p in reversed(procs):
            with contextlib.suppress(Exception):  # already gone
                p.stop()
        redis_proc.kill()
        shutil.rmtree(tmp, ignore_errors=True)

    cold = rows["A turn 1 (computes)"]["ttft_s"]
    print(f"agent prefix: {args.prefix_words} words of system prompt + {len(TOOLS)} tools; "
          f"Gemma 3 270M; 2 replicas + redis-server on loopback; {os.cpu_count()} cores")
    print(f"{'run':<28} {'prompt':>7} {'cached':>7} {'cached %':>9} {'TTFT s':>8} {'/ cold':>7}")
    for name, r in rows.items():
        pct = 100.0 * r["cached"] / r["prompt"] if r["prompt"] else 0.0
        print(f"{name:<28} {r['prompt']:>7} {r['cached']:>7} {pct:>8.1f}% {r['ttft_s']:>8.3f} "
              f"{r['ttft_s'] / cold:>7.3f}")
    overhead = min(routed) / min(direct)
    tokens_written = remote["blocks_written"] * 16
    print(f"router overhead on an attached turn: TTFT {min(routed):.3f} s via the router vs "
          f"{min(direct):.3f} s direct ({overhead:.2f}x, best of 3)")
    print(f"Redis after the run: {mem / 2**20:.1f} MiB used; A wrote {remote['blocks_written']} "
          f"blocks ({remote['bytes_written'] / 2**20:.1f} MiB, "
          f"{remote['bytes_written'] / max(1, tokens_written):.0f} B per token: the pool's KV "
          f"bytes plus a 123-byte header per 16-token block)")
    out = {"rows": rows, "cold_ttft_s": cold,
           "ratios": {k: r["ttft_s"] / cold for k, r in rows.items()},
           "router_overhead": overhead, "direct_ttft_s": direct, "routed_ttft_s": routed,
           "redis_used_bytes": mem, "remote_after_turn1": remote}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
