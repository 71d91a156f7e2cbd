"""The shared tier's client (`kvshare.engine.cache.remote_tier.RemoteTier`) against a real
`redis-server`, and against Redis servers that are down, slow (a socket that never answers) or
full (`maxmemory` with `noeviction`): reads are misses and writes are dropped within the
command timeout, the circuit breaker opens and recovers, and nothing raises to the caller.
The value format's damage detection is checked in Rust (crates/kvshare-core/src/remote.rs);
here, that a damaged value read back through Redis is deleted, never used."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import numpy as np
import pytest

from kvshare import _core
from kvshare.engine.cache.remote_tier import CircuitBreaker, RemoteTier
from redis_helpers import RedisServer, require_redis

FP = bytes(range(32))


def blocks(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, 2, 4, 8)).astype(np.float16)


def keys_of(n: int, seed: int) -> list[bytes]:
    return [bytes([seed % 256, i]) * 16 for i in range(n)]


def test_blocks_round_trip_with_ttl_and_skip_what_redis_holds(redis_server):
    tier = RemoteTier(redis_server.url, FP, ttl_s=3600)
    try:
        keys, data = keys_of(6, 1), blocks(6, 1)
        assert tier.submit(keys[:4], data[:4]) and tier.flush()
        assert tier.present(keys) == 4
        out = np.zeros_like(data)
        assert tier.read_blocks(keys[:4], out) == 4
        np.testing.assert_array_equal(out[:4], data[:4])
        rc = redis_server.client()
        assert 3500 < rc.ttl(tier._block_key(keys[0])) <= 3600
        # a second writer (another replica) skips what is there and sends only the rest; what
        # it skips it still uses, so its TTL is refreshed
        rc.expire(tier._block_key(keys[1]), 100)
        other = RemoteTier(redis_server.url, FP, ttl_s=3600)
        assert other.submit(keys, data) and other.flush()
        assert other.stats_.blocks_skipped == 4 and other.stats_.blocks_written == 2
        assert rc.ttl(tier._block_key(keys[1])) > 3500
        other.close()
        assert tier.present(keys) == 6
        # a missing block in the middle ends the prefix there
        rc.delete(tier._block_key(keys[2]))
        assert tier.present(keys) == 2
        assert tier.read_blocks(keys, np.zeros_like(data)) == 2
    finally:
        tier.close()


def test_another_model_sees_nothing(redis_server):
    a = RemoteTier(redis_server.url, FP, ttl_s=None)
    b = RemoteTier(redis_server.url, bytes(32), ttl_s=None)
    try:
        keys = keys_of(3, 2)
        assert a.submit(keys, blocks(3, 2)) and a.flush()
        assert b.present(keys) == 0
        assert redis_server.client().ttl(a._block_key(keys[0])) == -1  # no TTL asked
    finally:
        a.close()
        b.close()


def test_a_damaged_value_is_deleted_and_never_used(redis_server):
    tier = RemoteTier(redis_server.url, FP, ttl_s=60)
    try:
        keys, data = keys_of(3, 3), blocks(3, 3)
        assert tier.submit(keys, data) and tier.flush()
        rc = redis_server.client()
        k1 = tier._block_key(keys[1])
        v = bytearray(rc.get(k1))
        v[-3] ^= 1
        rc.set(k1, bytes(v))
        out = np.zeros_like(data)
        assert tier.read_blocks(keys, out) == 1
        assert not out[1].any()  # never the damaged bytes
        assert tier.stats_.corrupt == 1 and rc.exists(k1) == 0
        # a value stored under another key (swapped) is refused too
        rc.set(tier._block_key(keys[2]), rc.get(tier._block_key(keys[0])))
        assert tier.read_blocks(keys[2:], out[2:]) == 0 and tier.stats_.corrupt == 2
    finally:
        tier.close()


def test_checkpoints_round_trip_and_are_checked(redis_server):
    tier = RemoteTier(redis_server.url, FP, ttl_s=60)
    try:
        k = keys_of(1, 4)[0]
        state = np.arange(100, dtype=np.float32)
        assert tier.submit([], None, [(k, 64, "layout-1", state)]) and tier.flush()
        assert tier.find_checkpoint([(48, keys_of(1, 5)[0]), (64, k)]) == (64, k)
        layout, data = tier.read_checkpoint(k, 64)
        assert layout == "layout-1" and np.frombuffer(data, np.float32).tolist() == state.tolist()
        assert tier.read_checkpoint(k, 80) is None  # stored for another position: dropped
        assert tier.stats_.corrupt == 1
        assert tier.find_checkpoint([(64, k)]) is None
    finally:
        tier.close()


def test_breaker_opens_after_failures_and_hands_out_one_probe():
    now = [0.0]
    br = CircuitBreaker(failures=3, cooldown_s=5.0, clock=lambda: now[0])
    assert br.probe_due() is None  # closed: nothing to probe
    assert br.allow() and not br.failure() and not br.failure()
    assert br.failure() and br.state == "open"  # the third in a row opens it
    assert not br.allow() and br.probe_due() == 5.0
    now[0] = 5.0
    assert br.state == "half_open" and not br.allow()  # requests never probe
    assert br.probe_due() == 0.0  # the prober's turn
    assert br.probe_due() == 5.0  # one probe at a time
    assert not br.failure() and br.state == "open"  # the probe failed: open again (the same trip)
    now[0] = 10.0
    assert br.probe_due() == 0.0
    br.success()
    assert br.state == "closed" and br.allow() and br.allow()
    assert br.failure(trip=True) and br.state == "open"  # a missed deadline opens it at once


def test_redis_down_is_a_miss_and_a_dropped_write_never_an_error():
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    tier = RemoteTier(f"redis://127.0.0.1:{port}/0", FP, ttl_s=60, timeout_s=0.2)
    try:
        keys = keys_of(2, 6)
        t0 = time.monotonic()
        for _ in range(10):
            assert tier.present(keys) == 0
            assert tier.read_blocks(keys, blocks(2, 6)) == 0
        assert time.monotonic() - t0 < 2.0  # refused at once, then the breaker answers
        assert tier.breaker.state == "open" and tier.stats_.breaker_trips == 1
        assert not tier.submit(keys, blocks(2, 6))  # dropped while open
        assert tier.stats()["dropped_writes"] == 1 and not tier.ping()
    finally:
        tier.close()


def test_slow_redis_costs_at_most_the_timeout_then_nothing():
    """A server that accepts connections and never answers (a hung Redis)."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        srv.settimeout(0.1)
        while not stop.is_set():
            with contextlib.suppress(OSError):
                held.append(srv.accept()[0])

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    tier = RemoteTier(f"redis://127.0.0.1:{srv.getsockname()[1]}/0", FP, ttl_s=60,
                      timeout_s=0.2, breaker_failures=2)
    try:
        keys = keys_of(2, 7)
        t0 = time.monotonic()
        assert tier.present(keys) == 0
        assert 0.15 < time.monotonic() - t0 < 1.5  # one timeout
        t1 = time.monotonic()
        for _ in range(20):  # a missed deadline opened the breaker at once
            assert tier.present(keys) == 0
        assert time.monotonic() - t1 < 0.1  # no more waiting on the hung server
        assert tier.stats_.failures == 1 and tier.breaker.state == "open"
        assert tier.health()["state"] == "degraded"
    finally:
        stop.set()
        t.join()
        tier.close(timeout=1.0)
        for c in held:
            c.close()
        srv.close()


def test_full_redis_drops_writes_and_reads_still_work():
    require_redis()
    r = RedisServer(maxmemory="2mb")
    try:
        r.client().config_set("maxmemory-policy", "noeviction")
        tier = RemoteTier(r.url, FP, ttl_s=60, breaker_failures=1000)
        keys, data = keys_of(2, 8), blocks(2, 8)
        assert tier.submit(keys, data) and tier.flush()
        big = np.zeros((16, 2, 64, 1024), np.float16)  # 4 MiB: more than Redis may hold
        assert tier.submit(keys_of(16, 9), big) and tier.flush()
        st = tier.stats()
        assert st["failures"] >= 1 and st["dropped_writes"] >= 1  # OOM refused, counted
        out = np.zeros_like(data)
        assert tier.read_blocks(keys, out) == 2  # what is there still serves
        np.testing.assert_array_equal(out, data)
        tier.close()
    finally:
        r.close()


def test_value_format_binding_refuses_a_wrong_length_buffer():
    v = _core.remote_value("block", FP, b"k" * 32, b"abcd")
    with pytest.raises(_core.CorruptEntry):
        _core.remote_value_into(v, "block", FP, b"k" * 32, bytearray(3))
    with pytest.raises(_core.FingerprintMismatch):
        _core.remote_value_open(v, "block", bytes(32), b"k" * 32)
    with pytest.raises(_core.InvalidArgument):
        _core.remote_value("blob", FP, b"k" * 32, b"")
