"""Issue 16 acceptance: replicas share prefixes through a real `redis-server` (the shared tier).

Real parts throughout: `redis-server` on a loopback port (tests/redis_helpers.py), `kvshare
serve` replicas as separate processes (tests/tier_helpers.py) with `--cache-redis`, greedy chat
completions with logprobs compared with a server that has every cache off ("equal to the cold
run": same tokens, logprobs within 1e-4). The tiny attention-only model and the tiny hybrid
(tiny-qwen35: blocks plus recurrent-state checkpoints) load in well under a second.

- A computes a session; B (its own empty RAM tier) attaches to it from Redis (>= 95% of the
  prefix cached), and so does B restarted with empty local tiers.
- Redis killed in the middle of a run of concurrent sessions: every request succeeds with the
  cold run's output, and the metrics show the failures and the open breaker; Redis back (empty)
  -> the tier fills and serves again.
- A damaged value in Redis is detected (checksum), deleted and recomputed.
- Isolation: two cache_salts, and two API keys (`--cache-scope key`), never attach to each
  other's entries through Redis.
"""

from __future__ import annotations

import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tier_helpers import (COLD_ARGS, TINY_MODEL, Server, assert_same_output, cache_n,
                          conversation, next_turn, reply_text, text)

pytestmark = pytest.mark.skipif(not TINY_MODEL.exists(), reason="run tests/data/make_tiny_qwen3_chat.py")

TINY_HYBRID = TINY_MODEL.parent / "tiny-qwen35.gguf"
REPLICA = ("--parallel", "2", "--cache-min-tokens", "64")


@pytest.fixture(autouse=True)
def redis_up(redis_server):
    """Every test starts with Redis running (one that killed it may have failed midway)."""
    if redis_server.proc is None or redis_server.proc.poll() is not None:
        assert redis_server.start(), redis_server.log()
    yield


@pytest.fixture(scope="module")
def servers(launcher):
    started: list[Server] = []

    def start(*args: str, model=TINY_MODEL) -> Server:
        s = Server(launcher, *REPLICA, *args, model=model)
        started.append(s)
        return s

    yield start
    for s in started:
        if s.rc is None:
            s.kill9()


def wait_remote_idle(server: Server, timeout: float = 60.0) -> dict:
    """Until every finished request's blocks were handed to Redis (or dropped)."""
    deadline = time.monotonic() + timeout
    while True:
        c = server.cache()
        r = c["tiers"]["remote"]
        if c["sequences"] == 0 and r["queued"] == 0:
            return r
        if time.monotonic() > deadline:
            raise AssertionError(f"shared-tier writes still queued after {timeout} s: {r}")
        time.sleep(0.02)


def metric(server: Server, name: str) -> float:
    body = server.client.get("/metrics").text
    m = re.search(rf'^{name}(?:_total)?{{tier="remote"}} (\S+)$', body, re.M)
    assert m, f"{name} missing from /metrics"
    return float(m.group(1))


def test_session_computed_on_a_attaches_on_b_and_on_b_restarted(servers, cold, redis_server):
    a = servers("--cache-redis", redis_server.url)
    b = servers("--cache-redis", redis_server.url)
    msgs = conversation(text(1601, 700), "question one")
    first = a.chat(msgs)
    assert cache_n(first) == 0
    assert_same_output(first, cold(msgs), "A, cold")
    written = wait_remote_idle(a)
    assert written["blocks_written"] > 0, written

    got = b.chat(msgs)
    prompt = got["usage"]["prompt_tokens"]
    assert cache_n(got) >= 0.95 * prompt, (cache_n(got), prompt)
    assert_same_output(got, cold(msgs), "B from Redis")
    remote = b.tier("remote")
    assert remote["tokens_served"] >= 0.9 * prompt and remote["restores"] == 1, remote
    assert b.tier("ram")["restores"] == 0  # B's own tiers had nothing: it came from Redis

    # the conversation goes on at B; A's next turn attaches to what B added
    turn2 = next_turn(msgs, reply_text(got), "question two")
    got2 = b.chat(turn2)
    assert_same_output(got2, cold(turn2), "B turn 2")
    wait_remote_idle(b)
    got2a = a.chat(turn2)
    assert cache_n(got2a) >= 0.95 * got2a["usage"]["prompt_tokens"]
    assert_same_output(got2a, cold(turn2), "A turn 2 from B's blocks")

    # B restarted: no RAM, no disk, a fresh pool; Redis still has the session
    b.kill9()
    b2 = servers("--cache-redis", redis_server.url)
    got3 = b2.chat(turn2)
    assert cache_n(got3) >= 0.95 * got3["usage"]["prompt_tokens"]
    assert b2.tier("remote")["tokens_served"] > 0
    assert_same_output(got3, cold(turn2), "B restarted, from Redis")


def test_hybrid_checkpoints_travel_through_redis(launcher, redis_server):
    if not TINY_HYBRID.exists():
        pytest.skip("tests/data/models/tiny-qwen35.gguf missing")
    started = []
    try:
        cold_h = Server(launcher, *COLD_ARGS, model=TINY_HYBRID)
        started.append(cold_h)
        a = Server(launcher, *REPLICA, "--cache-redis", redis_server.url, model=TINY_HYBRID)
        b = Server(launcher, *REPLICA, "--cache-redis", redis_server.url, model=TINY_HYBRID)
        started += [a, b]
        msgs = conversation(text(1702, 600), "hybrid question")
        ref = cold_h.chat(msgs)
        assert_same_output(a.chat(msgs), ref, "hybrid A")
        assert wait_remote_idle(a)["checkpoints_written"] > 0
        got = b.chat(msgs)
        # resumes at the deepest block-aligned checkpoint (the first user message at least)
        assert cache_n(got) >= 0.8 * got["usage"]["prompt_tokens"], cache_n(got)
        remote = b.tier("remote")
        assert remote["checkpoints_served"] == 1 and remote["tokens_served"] > 0, remote
        assert_same_output(got, ref, "hybrid B from Redis")
    finally:
        for s in started:
            s.kill9()


def test_redis_killed_mid_run_every_request_still_succeeds(servers, cold, redis_server):
    a = servers("--cache-redis", redis_server.url, "--cache-redis-timeout", "0.3")
    b = servers("--cache-redis", redis_server.url, "--cache-redis-timeout", "0.3")
    convs = [conversation(text(1800 + i, 400), f"q{i}") for i in range(8)]
    refs = [cold(m, 8) for m in convs]
    results: dict[int, dict] = {}
    killed = threading.Event()

    def run(i: int) -> None:
        server = a if i % 2 else b
        results[i] = server.chat(convs[i], 8)
        if i == 2:
            redis_server.stop()  # while the other requests run or wait
            killed.set()

    with ThreadPoolExecutor(4) as ex:
        list(ex.map(run, range(8)))
    assert killed.is_set()
    for i in range(8):
        assert_same_output(results[i], refs[i], f"conversation {i} with Redis killed")
    # after the kill: still answering, from the local tiers
    again = [a.chat(convs[1], 8), b.chat(convs[0], 8)]
    assert_same_output(again[0], refs[1], "A after the kill")
    assert_same_output(again[1], refs[0], "B after the kill")
    # new conversations on A: each looks Redis up (its local tiers miss) and fails; after 3
    # failures in a row the breaker keeps Redis off, and they still get cold-run output
    for i in range(3):
        fresh = conversation(text(1850 + i, 300), f"fresh {i}")
        assert_same_output(a.chat(fresh, 4), cold(fresh, 4), f"fresh {i} with Redis down")
    # the fallback is visible: failed commands, and the breaker that keeps Redis off
    for s in (a, b):
        wait_remote_idle(s)
    fails = metric(a, "kvshare_cache_tier_failures") + metric(b, "kvshare_cache_tier_failures")
    assert fails >= 3
    assert metric(a, "kvshare_cache_tier_breaker_trips") >= 1

    # Redis comes back empty; once the breaker lets a probe through the tier works again
    assert redis_server.start()
    fresh = conversation(text(1899, 400), "after the outage")
    deadline = time.monotonic() + 30
    while True:
        a.chat(fresh, 4)
        written = wait_remote_idle(a)
        if redis_server.client().dbsize() > 0:
            break
        assert time.monotonic() < deadline, f"the shared tier did not recover: {written}"
        time.sleep(1.0)
        fresh = conversation(text(int(time.monotonic() * 1000) % 100000, 400), "again")
    while b.tier("remote")["breaker"] == "open":  # B's own breaker: its cooldown runs out
        assert time.monotonic() < deadline, "B's breaker stays open"
        time.sleep(0.2)
    got = b.chat(fresh, 4)  # the probe B's breaker lets through is this restore
    assert cache_n(got) >= 0.95 * got["usage"]["prompt_tokens"]
    assert_same_output(got, cold(fresh, 4), "B after Redis came back")


def test_damaged_value_in_redis_is_detected_and_recomputed(servers, cold, redis_server):
    a = servers("--cache-redis", redis_server.url)
    b = servers("--cache-redis", redis_server.url)
    rc = redis_server.client()
    msgs = conversation(text(1901, 500), "damage")
    before = set(rc.keys(b"kvshare:*:b:*"))
    a.chat(msgs)
    wait_remote_idle(a)
    ours = sorted(set(rc.keys(b"kvshare:*:b:*")) - before)  # this conversation's blocks
    assert len(ours) >= 20, len(ours)
    # B reads every one of them in chain order: whichever is damaged, the restore meets it
    victim = ours[len(ours) // 2]
    value = bytearray(rc.get(victim))
    value[len(value) // 2] ^= 0x40
    rc.set(victim, bytes(value))
    got = b.chat(msgs)
    assert_same_output(got, cold(msgs), "B with a damaged block in Redis")
    remote = b.tier("remote")
    assert remote["corrupt"] >= 1, remote
    # the damaged value is gone or rewritten whole (B wrote it back after recomputing)
    wait_remote_idle(b)
    after = rc.get(victim)
    assert after is None or after != bytes(value)


def test_tenants_never_attach_to_each_other_through_redis(servers, cold, redis_server):
    a = servers("--cache-redis", redis_server.url)
    b = servers("--cache-redis", redis_server.url)
    secret = conversation("The launch code is 4417. " + text(2001, 500), "what is the code?")
    first = a.chat(secret, salt="tenant-one")
    assert cache_n(first) == 0
    wait_remote_idle(a)
    other = b.chat(secret, salt="tenant-two")
    assert cache_n(other) == 0, "another salt attached to tenant-one's blocks through Redis"
    assert b.tier("remote")["tokens_served"] == 0
    assert_same_output(other, cold(secret), "tenant-two")
    same = b.chat(secret, salt="tenant-one")
    assert cache_n(same) >= 0.95 * same["usage"]["prompt_tokens"]  # the control

    # API keys (cache scope `key`): the key decides the salt, on every replica alike
    keys = ("--api-key", "key-alpha", "--api-key", "key-beta", "--cache-scope", "key")
    ka = servers("--cache-redis", redis_server.url, *keys)
    kb = servers("--cache-redis", redis_server.url, *keys)
    for s in (ka, kb):  # for /cache (the requests below send their own key)
        s.client.headers["Authorization"] = "Bearer key-alpha"
    msgs = conversation("Private notes of alpha. " + text(2002, 500), "summarize")
    body = {"messages": msgs, "max_tokens": 6, "temperature": 0, "logprobs": True,
            "top_logprobs": 3}

    def post(server: Server, key: str) -> dict:
        r = server.client.post("/v1/chat/completions", json=body,
                               headers={"Authorization": f"Bearer {key}"})
        assert r.status_code == 200, r.text
        return r.json()

    assert cache_n(post(ka, "key-alpha")) == 0
    wait_remote_idle(ka)
    beta = post(kb, "key-beta")
    assert cache_n(beta) == 0, "key-beta attached to key-alpha's blocks through Redis"
    assert_same_output(beta, cold(msgs), "key-beta")
    alpha_on_b = post(kb, "key-alpha")
    assert cache_n(alpha_on_b) >= 0.95 * alpha_on_b["usage"]["prompt_tokens"]  # the control
