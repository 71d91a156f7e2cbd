"""Bounded resources at the edge (issue 15, part 3): what large or silent clients cost a server.

A real `kvshare serve` (default model: Gemma 3 270M; `--model` for another) on a loopback port,
with a sampler of the server's RSS (psutil, every 10 ms, plus the kernel's peak-RSS counter
VmHWM reset before each scenario where /proc allows it) and a /health poller (a request every
20 ms on its own connection) running through each scenario:

  big-chat       20 concurrent chat requests, each a user message of ~16 MiB of words
                 (just under the 16 MiB body limit): each must get a 4xx (400
                 context_length_exceeded), none a 5xx.
  big-letters    the same as legacy completions with a 16 MiB prompt without spaces (the worst
                 case for SentencePiece tokenization: one 16M-character fragment).
  near-limit     20 concurrent completions whose prompt is just under the no-tokenization bound
                 ((ctx - 1) x the longest token's characters), so each is tokenized in full
                 before the 400: the largest tokenization work a request can cause.
  tokenize-big   20 concurrent /tokenize with_pieces on ~16 MiB (413) and on 1 MiB (400
                 response_too_large or a bounded answer).
  slowloris      N connections (default 500) that send half a body and go silent: they must be
                 closed (408) once --body-timeout has passed; small chat requests sent all the
                 while must keep answering. Plus one request that declares a 17 MiB body and
                 never sends it (413 after the timeout).
  stop-strings   a victim stream's decode speed alone, beside 3 plain streams, and beside 3
                 streams that use the most stop-string text the API allows (16 strings, 1,024
                 characters); twelve 1 MiB stop strings (the issue's attack) now get 400.

First `idle`: /health alone, the machine's own latency noise to read the others against.

Targets (issue 15): no 5xx; server peak RSS <= 1 GiB above idle; /health p99 <= 200 ms.

    python bench/edge_load.py                       # everything, default model
    python bench/edge_load.py --only big-chat,slowloris
    python bench/edge_load.py --model tests/data/models/tiny-qwen3-chat.gguf --quick

Prints a table and writes bench/out/edge_load.json. Not run in CI.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import psutil
from serve_process import ServeProcess

OUT = Path(__file__).parent / "out"
MiB = 1024 * 1024
WORDS = ["cache", "prefix", "session", "agent", "token", "block", "server", "request", "model",
         "layer", "restore", "disk", "memory", "budget", "eviction", "checkpoint", "attention",
         "state", "conversation", "returning", "history", "tool", "schema", "system", "prompt",
         "user", "reply", "turn", "write", "read", "verify", "checksum", "index", "entry",
         "commit"]


# ---------------------------------------------------------------------------- server process

class Server(ServeProcess):
    def __init__(self, *args: str, startup_timeout: float = 300.0):
        fd, log_path = tempfile.mkstemp(prefix="kvshare-edge-", suffix=".log")
        os.close(fd)
        super().__init__(list(args), log_path, startup_timeout=startup_timeout)
        self.host, self.port = self.url.split("//")[1].split(":")[0], int(self.url.rsplit(":", 1)[1])
        self.ps = psutil.Process(self.proc.pid)

    def log(self) -> str:
        return super().log()[-4000:]


# ---------------------------------------------------------------------------- probes

POLLER = Path(__file__).with_name("health_poller.py")  # its own process (see there)


class Probes:
    """RSS sampler and /health poller (a separate process) around one scenario."""

    def __init__(self, server: Server, health_every: float = 0.02):
        self.server = server
        self.health_every = health_every
        self.rss: list[int] = []
        self.health_ms: list[float] = []
        self.health_bad = 0
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def _hwm_path(self) -> Path:
        return Path(f"/proc/{self.server.proc.pid}")

    def reset_hwm(self) -> bool:
        try:
            (self._hwm_path() / "clear_refs").write_text("5")
            return True
        except OSError:
            return False

    def hwm(self) -> int | None:
        try:
            for line in (self._hwm_path() / "status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
        except OSError:
            pass
        return None

    def __enter__(self) -> "Probes":
        self.idle_rss = self.server.ps.memory_info().rss
        self.hwm_reset = self.reset_hwm()
        self.cpu0 = sum(self.server.ps.cpu_times()[:2])
        self.t0 = time.monotonic()

        def sample() -> None:
            while not self._stop.is_set():
                try:
                    self.rss.append(self.server.ps.memory_info().rss)
                except psutil.Error:
                    return
                time.sleep(0.01)

        self._poller = subprocess.Popen(
            [sys.executable, str(POLLER), self.server.url, str(self.health_every)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self._threads = [threading.Thread(target=sample, daemon=True)]
        for t in self._threads:
            t.start()
        time.sleep(0.3)  # the poller's first requests
        return self

    def __exit__(self, *exc) -> None:
        self.wall_s = time.monotonic() - self.t0
        self._stop.set()
        for t in self._threads:
            t.join(60)
        out, _ = self._poller.communicate("", timeout=120)
        for sec, ok in json.loads(out or "[]"):
            self.health_ms.append(sec * 1e3)
            self.health_bad += not ok
        self.cpu_s = sum(self.server.ps.cpu_times()[:2]) - self.cpu0

    def summary(self) -> dict:
        h = sorted(self.health_ms) or [0.0]
        peak = max(self.rss) if self.rss else self.idle_rss
        hwm = self.hwm() if self.hwm_reset else None
        return {
            "wall_s": round(self.wall_s, 2), "server_cpu_s": round(self.cpu_s, 2),
            "idle_rss_mib": round(self.idle_rss / MiB, 1),
            "peak_rss_above_idle_mib": round((max(peak, hwm or 0) - self.idle_rss) / MiB, 1),
            "peak_rss_source": "VmHWM" if hwm and hwm > peak else "sampled",
            "health_n": len(self.health_ms), "health_failed": self.health_bad,
            "health_p50_ms": round(statistics.median(h), 1),
            "health_p99_ms": round(h[min(len(h) - 1, int(len(h) * 0.99))], 1),
            "health_max_ms": round(h[-1], 1),
        }


# ---------------------------------------------------------------------------- bodies

def words_text(n_chars: int, seed: int = 0) -> str:
    import random

    rng = random.Random(seed)
    parts, size = [], 0
    while size < n_chars:
        w = rng.choice(WORDS)
        parts.append(w)
        size += len(w) + 1
    return " ".join(parts)[:n_chars]


def letters_text(n_chars: int, seed: int = 0) -> str:
    import random

    rng = random.Random(seed)
    alphabet = "abcdefghijklmnopqrstuvwxyz"
    chunk = "".join(rng.choice(alphabet) for _ in range(65536))
    return (chunk * (n_chars // len(chunk) + 1))[:n_chars]


def chat_body(text: str) -> bytes:
    return json.dumps({"messages": [{"role": "user", "content": text}], "max_tokens": 4}
                      ).encode()


def completion_body(text: str) -> bytes:
    return json.dumps({"prompt": text, "max_tokens": 4}).encode()


def fit_body(make, limit: int, text_fn) -> bytes:
    """The largest body `make(text_fn(n))` that is at most `limit` bytes (ASCII text)."""
    overhead = len(make(""))
    return make(text_fn(limit - overhead - 16))


def post_many(server: Server, path: str, bodies: list[bytes], timeout: float = 600.0
              ) -> list[tuple[int, str]]:
    def one(body: bytes) -> tuple[int, str]:
        try:
            with httpx.Client(timeout=timeout) as c:
                r = c.post(server.url + path, content=body,
                           headers={"content-type": "application/json"})
                try:
                    code = (r.json().get("error") or {}).get("code") or ""
                except ValueError:
                    code = "non-json"
                return r.status_code, code
        except httpx.HTTPError as e:
            return -1, type(e).__name__

    with ThreadPoolExecutor(len(bodies)) as ex:
        return list(ex.map(one, bodies))


def statuses(results: list[tuple[int, str]]) -> dict:
    return dict(Counter(f"{s} {c}".strip() for s, c in results))


# ---------------------------------------------------------------------------- scenarios

def scenario_idle(server: Server, seconds: float = 5.0) -> dict:
    """/health alone: the machine's own latency noise, to read the others against."""
    with Probes(server) as p:
        time.sleep(seconds)
    out = {"scenario": "idle"}
    out.update(p.summary())
    return out


def scenario_bodies(server: Server, name: str, path: str, body: bytes | list[bytes],
                    n: int) -> dict:
    bodies = body if isinstance(body, list) else [body] * n
    with Probes(server) as p:
        res = post_many(server, path, bodies)
    body = bodies[0]
    out = {"scenario": name, "requests": n, "body_mib": round(len(body) / MiB, 2),
           "statuses": statuses(res), "n_5xx": sum(1 for s, _ in res if s >= 500 or s < 0)}
    out.update(p.summary())
    return out


def scenario_near_limit(server: Server, n: int, ctx: int, per_token: int) -> dict:
    n_chars = (ctx - 1) * per_token - 64  # just under the no-tokenization bound
    # distinct texts: the tokenizer remembers fragments it has seen (up to 1M characters)
    bodies = [completion_body(letters_text(n_chars, seed=100 + i)) for i in range(n + 1)]
    t = time.perf_counter()
    one = post_many(server, "/v1/completions", bodies[:1])
    single_s = time.perf_counter() - t
    out = scenario_bodies(server, "near-limit", "/v1/completions", bodies[1:], n)
    out["prompt_chars"] = n_chars
    out["single_request_s"] = round(single_s, 2)
    out["single_status"] = statuses(one)
    return out


def half_body_connection(server: Server) -> socket.socket:
    s = socket.create_connection((server.host, server.port))
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
              b"Content-Type: application/json\r\nContent-Length: 2000\r\n\r\n"
              b'{"messages": [{"role": "user", "content": "' + b"a" * 900)
    return s


def closed_at(socks: list[socket.socket], t0: float, deadline_s: float) -> list[float | None]:
    """Seconds (from t0) at which each connection got its response and was closed."""
    import selectors

    sel = selectors.DefaultSelector()
    for i, s in enumerate(socks):
        s.setblocking(False)
        sel.register(s, selectors.EVENT_READ, i)
    out: list[float | None] = [None] * len(socks)
    open_n = len(socks)
    while open_n and time.monotonic() - t0 < deadline_s:
        for key, _ in sel.select(timeout=0.2):
            s = key.fileobj
            try:
                data = s.recv(65536)
            except (BlockingIOError, InterruptedError):
                continue
            except OSError:
                data = b""
            if not data:
                out[key.data] = time.monotonic() - t0
                sel.unregister(s)
                open_n -= 1
    sel.close()
    return out


def scenario_slowloris(server: Server, n: int, body_timeout: float) -> dict:
    chat = json.dumps({"messages": [{"role": "user", "content": "hello"}], "max_tokens": 2})
    chat_lat: list[float] = []
    chat_status: Counter = Counter()
    stop = threading.Event()

    def chatter() -> None:
        with httpx.Client(timeout=120) as c:
            while not stop.is_set():
                t = time.perf_counter()
                try:
                    r = c.post(server.url + "/v1/chat/completions", content=chat,
                               headers={"content-type": "application/json"})
                    chat_status[r.status_code] += 1
                except httpx.HTTPError as e:
                    chat_status[type(e).__name__] += 1
                chat_lat.append(time.perf_counter() - t)
                time.sleep(0.2)

    with Probes(server) as p:
        t0 = time.monotonic()
        socks = [half_body_connection(server) for _ in range(n)]
        opened_s = time.monotonic() - t0
        declared = socket.create_connection((server.host, server.port))
        declared.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: "
                         + str(17 * MiB).encode() + b"\r\n\r\n")
        th = threading.Thread(target=chatter, daemon=True)
        th.start()
        closed = closed_at(socks + [declared], t0, body_timeout * 3 + 30)
        stop.set()
        th.join(120)
        # and after
        r = httpx.post(server.url + "/v1/chat/completions", content=chat, timeout=120,
                       headers={"content-type": "application/json"})
        after = r.status_code
    for s in socks + [declared]:
        s.close()
    got = [c for c in closed[:-1] if c is not None]
    lat = sorted(chat_lat) or [0.0]
    out = {"scenario": "slowloris", "connections": n, "body_timeout_s": body_timeout,
           "opened_in_s": round(opened_s, 2), "closed": len(got),
           "closed_first_s": round(min(got), 2) if got else None,
           "closed_last_s": round(max(got), 2) if got else None,
           "declared_17mib_closed_s": round(closed[-1], 2) if closed[-1] else None,
           "chat_during": dict(chat_status), "chat_p50_s": round(statistics.median(lat), 3),
           "chat_max_s": round(lat[-1], 3), "chat_after": after}
    out.update(p.summary())
    return out


def stream_speed(server: Server, body: dict) -> float:
    """Decode tokens/s of one streamed completion (first token excluded)."""
    n, t_first = 0, None
    with (httpx.Client(timeout=600) as c,
          c.stream("POST", server.url + "/v1/completions", json=body) as r):
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            ev = json.loads(line[6:])
            if ev.get("choices") and ev["choices"][0].get("text"):
                n += 1
                if t_first is None:
                    t_first = time.perf_counter()
                    n = 0
    dt = time.perf_counter() - (t_first or time.perf_counter())
    return n / dt if dt > 0 else 0.0


def scenario_stop_strings(server: Server, tokens: int) -> dict:
    """The victim's decode speed alone, beside 3 plain streams, and beside 3 streams that use
    the most stop-string text allowed: the last two should be about the same."""
    victim = {"prompt": "Once upon a time", "max_tokens": tokens, "temperature": 0,
              "ignore_eos": True, "stream": True}
    stops = [f"{i:02d}" + "\u00a7" * 62 for i in range(16)]  # 16 x 64 = 1,024 characters
    plain = {"prompt": "It was a dark and stormy night", "max_tokens": tokens * 3,
             "temperature": 0, "ignore_eos": True}
    huge = dict(plain, stop=["x" * MiB] * 12)
    r = httpx.post(server.url + "/v1/completions", json=huge, timeout=60)
    huge_status = f"{r.status_code} {(r.json().get('error') or {}).get('message', '')[:60]}"

    def beside(other: dict | None) -> tuple[float, list[int]]:
        if other is None:
            return stream_speed(server, victim), []
        with ThreadPoolExecutor(3) as ex:
            futs = [ex.submit(httpx.post, server.url + "/v1/completions", json=other,
                              timeout=600) for _ in range(3)]
            time.sleep(0.5)
            speed = stream_speed(server, victim)
            return speed, [f.result().status_code for f in futs]

    solo, _ = beside(None)
    with_plain, _ = beside(plain)
    with_stops, codes = beside(dict(plain, stop=stops))
    return {"scenario": "stop-strings", "victim_tokens": tokens,
            "victim_solo_tok_s": round(solo, 1), "beside_3_plain_tok_s": round(with_plain, 1),
            "beside_3_max_stops_tok_s": round(with_stops, 1),
            "stops_vs_plain": round(with_stops / with_plain, 2) if with_plain else None,
            "attackers": codes, "twelve_1mib_stops": huge_status}


# ---------------------------------------------------------------------------- main

def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--ctx-size", type=int, default=8192)
    ap.add_argument("--n", type=int, default=20, help="concurrent large requests")
    ap.add_argument("--slowloris", type=int, default=500, help="half-body connections")
    ap.add_argument("--body-timeout", type=float, default=5.0)
    ap.add_argument("--only", default="", help="comma-separated scenario names")
    ap.add_argument("--quick", action="store_true", help="5 large requests, 100 connections")
    args = ap.parse_args()
    if args.quick:
        args.n, args.slowloris = 5, 100
    only = set(filter(None, args.only.split(",")))

    def want(name: str) -> bool:
        return not only or name in only

    sargs = ["--ctx-size", str(args.ctx_size), "--body-timeout", str(args.body_timeout)]
    if args.model:
        sargs += ["--model", args.model]
    server = Server(*sargs)
    results: list[dict] = []
    try:
        # warm up (first request pays one-time costs), then the token length bound
        httpx.post(server.url + "/v1/chat/completions", timeout=300,
                   json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        from kvshare.model.loader import default_model_path
        from kvshare.model.tokenizer import Tokenizer

        from kvshare.server.limits import max_token_chars

        per_token = max_token_chars(Tokenizer.from_gguf(args.model or default_model_path()))
        limit = 16 * MiB
        if want("idle"):
            results.append(scenario_idle(server))
        if want("big-chat"):
            results.append(scenario_bodies(server, "big-chat", "/v1/chat/completions",
                                           fit_body(chat_body, limit, words_text), args.n))
        if want("big-letters"):
            results.append(scenario_bodies(server, "big-letters", "/v1/completions",
                                           fit_body(completion_body, limit, letters_text),
                                           args.n))
        if want("near-limit"):
            results.append(scenario_near_limit(server, args.n, args.ctx_size, per_token))
        if want("tokenize-big"):
            big = json.dumps({"content": words_text(limit - 4096), "with_pieces": True}).encode()
            results.append(scenario_bodies(server, "tokenize-16mib", "/tokenize", big, args.n))
            mids = [json.dumps({"content": letters_text(MiB, seed=200 + i), "with_pieces": True}
                               ).encode() for i in range(args.n)]
            results.append(scenario_bodies(server, "tokenize-1mib", "/tokenize", mids, args.n))
        if want("slowloris"):
            results.append(scenario_slowloris(server, args.slowloris, args.body_timeout))
        if want("stop-strings"):
            results.append(scenario_stop_strings(server, 48))
    finally:
        server.stop()

    OUT.mkdir(parents=True, exist_ok=True)
    meta = {"model": args.model or "default (Gemma 3 270M Q4_K_M)", "ctx_size": args.ctx_size,
            "max_token_chars": per_token, "cpus": os.cpu_count()}
    (OUT / "edge_load.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    cols = ("scenario", "requests", "body_mib", "statuses", "n_5xx", "wall_s",
            "peak_rss_above_idle_mib", "health_p50_ms", "health_p99_ms", "health_max_ms")
    print(f"model {meta['model']}, ctx {args.ctx_size}, longest token {per_token} chars")
    print(" | ".join(cols))
    for r in results:
        print(" | ".join(str(r.get(c, "")) for c in cols))
    for r in results:
        extra = {k: v for k, v in r.items() if k not in cols}
        print(f"{r['scenario']}: {json.dumps(extra)}")
    print(f"wrote {OUT / 'edge_load.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
