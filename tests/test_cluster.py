"""Issue 16 acceptance, the cluster: `kvshare route` in front of two `kvshare serve` replicas
that share a real `redis-server`, every part its own process on a loopback port.

8 tenants (each its own system prompt and tools) x 4 concurrent sessions, all first turns sent
at once through the router, then every session's second turn:
- each tenant's prefix is computed once across the cluster: the sum of `prompt_n` (tokens
  computed) over the first turns is at most 1.1 x the distinct prefixes' tokens (each tenant's
  longest common prompt prefix, tokenized by the replica);
- the replicas' loads (requests routed, prompt tokens computed) are within 1.5x of each other;
- every second turn is >= 95% cached (the router keeps a session where its prefix lives), and
  every reply equals a cold run's.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from redis_helpers import RedisServer, require_redis
from tier_helpers import (COLD_ARGS, ROOT, TINY_MODEL, ColdRuns, Server, assert_same_output,
                          chat_body, next_turn, reply_text, text)

pytestmark = pytest.mark.skipif(not TINY_MODEL.exists(), reason="run tests/data/make_tiny_qwen3_chat.py")

TENANTS, SESSIONS = 8, 4
_ROUTING = re.compile(r"kvshare: routing at (http://\S+) ")


class Router:
    """`python -m kvshare.server.cli route ...` as a user runs it."""

    def __init__(self, *backends: str):
        fd, self.log_path = tempfile.mkstemp(prefix="kvshare-route-", suffix=".log")
        args = [sys.executable, "-m", "kvshare.server.cli", "route", "--port", "0",
                "--health-interval", "0.5", "--log-level", "warning"]
        for b in backends:
            args += ["--backend", b]
        self.proc = subprocess.Popen(args, stdout=fd, stderr=subprocess.STDOUT, cwd=ROOT,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})
        os.close(fd)
        deadline = time.monotonic() + 60
        self.url = ""
        while not self.url:
            m = _ROUTING.search(self.log())
            if m:
                self.url = m.group(1)
            elif self.proc.poll() is not None or time.monotonic() > deadline:
                self.proc.kill()
                raise RuntimeError(f"the router did not start:\n{self.log()}")
            else:
                time.sleep(0.05)
        self.client = httpx.Client(base_url=self.url, timeout=300)
        while self.client.get("/health").status_code != 200:  # both backends checked
            assert time.monotonic() < deadline, self.log()
            time.sleep(0.05)

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()[-6000:]

    def close(self) -> None:
        self.client.close()
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def tools_of(t: int) -> list[dict]:
    return [{"type": "function", "function": {
        "name": f"tool_{t}_{i}", "description": text(700 + 10 * t + i, 60),
        "parameters": {"type": "object", "properties": {"arg": {"type": "string"}}}}}
        for i in range(2)]


def first_turn(t: int, s: int) -> list[dict]:
    return [{"role": "system", "content": f"Tenant {t}. " + text(500 + t, 1500)},
            {"role": "user", "content": f"s{s}: hi"}]


def prompt_ids(server: Server, messages: list[dict], tools: list[dict]) -> list[int]:
    r = server.client.post("/apply-template", json={"messages": messages, "tools": tools})
    assert r.status_code == 200, r.text
    r = server.client.post("/tokenize", json={"content": r.json()["prompt"],
                                              "parse_special": True})
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def common_prefix(seqs: list[list[int]]) -> int:
    n = min(len(s) for s in seqs)
    for i in range(n):
        if any(s[i] != seqs[0][i] for s in seqs):
            return i
    return n


def routed(router: Router) -> dict[str, float]:
    out: dict[str, float] = {}
    for m in re.finditer(r'^kvshare_router_requests_total\{backend="([^"]+)",reason="[^"]+"\} (\S+)$',
                         router.client.get("/metrics").text, re.M):
        out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
    return out


def computed(server: Server) -> float:
    m = re.search(r"^llamacpp:prompt_tokens_total (\S+)$", server.client.get("/metrics").text,
                  re.M)
    assert m
    return float(m.group(1))


def test_eight_tenants_four_sessions_two_replicas(launcher):
    require_redis()
    redis = RedisServer()
    started: list = []
    try:
        replicas = [Server(launcher, "--parallel", "8", "--cache-min-tokens", "64",
                           "--cache-redis", redis.url) for _ in range(2)]
        started += replicas
        cold = Server(launcher, *COLD_ARGS)
        started.append(cold)
        router = Router(*(r.url for r in replicas))
        started.append(router)
        refs = ColdRuns(cold)

        jobs = [(t, s) for s in range(SESSIONS) for t in range(TENANTS)]  # interleaved

        def send(job, messages) -> dict:
            t, _ = job
            r = router.client.post("/v1/chat/completions",
                                   json=chat_body(messages, 6, tools=tools_of(t)))
            assert r.status_code == 200, f"{r.status_code}: {r.text[:300]}\n{router.log()}"
            return r.json()

        with ThreadPoolExecutor(len(jobs)) as ex:
            firsts = list(ex.map(lambda j: send(j, first_turn(*j)), jobs))

        # each tenant's shared prefix, in tokens, as the replica tokenizes it
        distinct = 0
        for t in range(TENANTS):
            ids = [prompt_ids(replicas[0], first_turn(t, s), tools_of(t)) for s in range(SESSIONS)]
            distinct += common_prefix(ids)
        computed_first = sum(int(r["timings"]["prompt_n"]) for r in firsts)
        reasons = re.findall(r'^kvshare_router_requests_total\{(.*)\} (\S+)$',
                             router.client.get("/metrics").text, re.M)
        assert computed_first <= 1.1 * distinct, (
            f"first turns computed {computed_first} tokens for {distinct} distinct prefix "
            f"tokens; routed {reasons}; per request {[r['timings']['prompt_n'] for r in firsts]}; "
            f"replicas {[r.cache()['counters'] for r in replicas]}")

        loads = routed(router)
        work = [computed(r) for r in replicas]
        print(f"first turns computed {computed_first} tokens for {distinct} distinct prefix "
              f"tokens ({computed_first / distinct:.3f}x); routed {loads}; computed {work}")
        assert len(loads) == 2 and max(loads.values()) <= 1.5 * min(loads.values()), loads
        assert max(work) <= 1.5 * min(work), work

        # second turns stay where their prefix (and conversation) lives
        seconds_msgs = [next_turn(first_turn(*j), reply_text(r), "and then?")
                        for j, r in zip(jobs, firsts)]
        with ThreadPoolExecutor(len(jobs)) as ex:
            seconds = list(ex.map(lambda a: send(*a), zip(jobs, seconds_msgs)))
        for j, r in zip(jobs, seconds):
            cached = int(r["timings"]["cache_n"])
            assert cached >= 0.95 * r["usage"]["prompt_tokens"], (j, cached)

        # and every reply is the cold run's (tools rendered the same way)
        for j, m, r in zip(jobs, [first_turn(*j) for j in jobs], firsts):
            ref = refs.server.chat(m, 6, tools=tools_of(j[0]))
            assert_same_output(r, ref, f"tenant {j[0]} session {j[1]} turn 1")
        for j, m, r in list(zip(jobs, seconds_msgs, seconds))[::5]:
            ref = refs.server.chat(m, 6, tools=tools_of(j[0]))
            assert_same_output(r, ref, f"tenant {j[0]} session {j[1]} turn 2")
    finally:
        for s in started:
            if isinstance(s, Router):
                s.close()
            elif s.rc is None:
                s.kill9()
        redis.close()
