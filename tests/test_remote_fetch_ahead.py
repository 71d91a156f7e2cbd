"""Fetch-ahead from the shared tier (engine/cache/prefetch.py), in process against a real
`redis-server`, for each lead group: full attention (tiny qwen3), sliding window (tiny
gpt-oss, 128-token windows) and recurrent (tiny qwen3.5 hybrid).

Engine A serves a conversation and writes it to Redis; engine B (empty pool, no RAM or disk
tier) serves the next turn: its blocks (and window blocks, or checkpoint) come from Redis, all
of them read on fetch threads before the request is queued (never on the thread that runs the
steps), and B's tokens equal A's. Also: a prompt already in the pool is queued without a
fetch, and the bytes held ahead are bounded (a fetch over the budget takes a leading part)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest

from kvshare.engine.api import GenerationRequest, SamplingParams
from kvshare.engine.cache.remote_tier import RemoteTier
from kvshare.engine.engine import Engine, EngineConfig

MODELS = Path(__file__).parent / "data" / "models"
GREEDY = SamplingParams(temperature=0.0)
CASES = {"full_attention": "tiny-qwen3-chat.gguf", "sliding_window": "tiny-gpt-oss.gguf",
         "recurrent": "tiny-qwen35.gguf"}


def make(path: Path, url: str, **kw) -> Engine:
    cfg = EngineConfig(**{"parallel": 2, "ctx_size": 2048, "block_size": 16,
                          "cache_ram_mib": 0, "cache_min_tokens": 32, "cache_redis": url, **kw})
    return Engine.from_model_path(str(path), cfg)


def serve(eng: Engine, ids: list[int], n: int = 8):
    h = eng.submit(GenerationRequest(prompt_tokens=list(ids), max_tokens=n, sampling=GREEDY))
    eng.run_until_idle()
    tokens, fin = h.result(timeout=0)
    return [t.token_id for t in tokens if t.token_id >= 0], fin


def prompt_of(eng: Engine, seed: int, n: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(100, min(eng.vocab_size, 5000) - 100, n)]


@pytest.fixture
def read_threads(monkeypatch):
    """The names of the threads that read from Redis (blocks, presence, checkpoints)."""
    seen: list[str] = []
    for name in ("present", "present_each", "read_blocks", "find_checkpoint",
                 "read_checkpoint"):
        orig = getattr(RemoteTier, name)

        def spy(self, *a, _orig=orig, **kw):
            seen.append(threading.current_thread().name)
            return _orig(self, *a, **kw)

        monkeypatch.setattr(RemoteTier, name, spy)
    return seen


@pytest.mark.parametrize("lead", sorted(CASES))
def test_the_next_turn_comes_from_redis_read_ahead(lead, redis_server, read_threads):
    path = MODELS / CASES[lead]
    if not path.exists():
        pytest.skip(f"{path.name} missing")
    a = make(path, redis_server.url)
    b = make(path, redis_server.url)
    try:
        assert a.cache.lead.kind == lead
        first = prompt_of(a, 7 + len(lead), 420)
        reply, _ = serve(a, first)
        turn2 = first + reply + prompt_of(a, 99, 40)
        ref, _ = serve(a, turn2)  # A from its own pool
        assert a.tiers.remote.flush()
        read_threads.clear()
        got, fin = serve(b, turn2)
        assert got == ref
        remote = b.snapshot()["tiers"]["remote"]
        assert remote["tokens_served"] >= 400, remote
        assert fin.timings.cache_n >= 400, fin.timings
        if lead == "recurrent":
            assert remote["checkpoints_served"] == 1, remote
        if lead == "sliding_window":
            assert remote["fetch_ahead"]["blocks"] > remote["blocks_served"], remote
        assert read_threads and all(t.startswith("kvshare-fetch") for t in read_threads), \
            read_threads
        fa = remote["fetch_ahead"]
        assert fa["started"] == 1 and fa["held_bytes"] == 0 and fa["waiting_admission"] == 0, fa
        # the same prompt again: its blocks are in B's pool, nothing is fetched
        read_threads.clear()
        assert serve(b, turn2)[0] == ref
        assert not read_threads
        assert b.snapshot()["tiers"]["remote"]["fetch_ahead"]["local"] >= 1
    finally:
        a.shutdown(timeout=1.0)
        b.shutdown(timeout=1.0)


def test_fetched_bytes_are_bounded(redis_server):
    path = MODELS / CASES["full_attention"]
    a = make(path, redis_server.url)
    b = make(path, redis_server.url)
    try:
        ids = prompt_of(a, 3, 330)
        ref, _ = serve(a, ids)
        assert a.tiers.remote.flush()
        fetcher = b.cache.fetcher
        fetcher.max_bytes = 5 * b.kv.block_nbytes  # room for 5 blocks ahead
        got, fin = serve(b, ids)
        assert got == ref
        fa = b.snapshot()["tiers"]["remote"]["fetch_ahead"]
        assert fa["blocks"] == 5 and fa["over_budget"] == 1 and fa["held_bytes"] == 0, fa
        assert fin.timings.cache_n == 5 * 16  # the leading part it fetched; the rest computed
        from kvshare.server.metrics import _tier_metrics

        got_metrics = {f.name: f.samples[0].value for f in _tier_metrics(b.snapshot()["tiers"])
                       if f.name.startswith("kvshare_cache_remote_")}
        assert got_metrics["kvshare_cache_remote_fetches"] == 1
        assert got_metrics["kvshare_cache_remote_fetches_over_budget"] == 1
        assert got_metrics["kvshare_cache_remote_fetch_held_bytes"] == 0
    finally:
        a.shutdown(timeout=1.0)
        b.shutdown(timeout=1.0)


def test_a_request_cancelled_while_redis_hangs_ends_at_once():
    """The engine running on its thread, Redis accepting and never answering: a request that
    needs Redis is cancelled during its fetch and ends at once; a bystander submitted after it
    is served while the fetch still waits; the fetch ends within its bound, holding nothing."""
    from fake_redis import FakeRedis, wait_until

    fake = FakeRedis("silent")
    eng = make(MODELS / CASES["full_attention"], fake.url, cache_redis_timeout_s=4.0)
    eng.start()
    try:
        h = eng.submit(GenerationRequest(prompt_tokens=prompt_of(eng, 5, 300), max_tokens=4,
                                         sampling=GREEDY))
        wait_until(lambda: eng.cache.fetcher.in_flight() == 1, 5)
        t0 = time.monotonic()
        h.cancel()
        _, fin = h.result(timeout=1.0)
        assert fin.reason == "cancelled" and time.monotonic() - t0 < 1.0
        by = eng.submit(GenerationRequest(prompt_tokens=prompt_of(eng, 6, 8), max_tokens=4,
                                          sampling=GREEDY))
        tokens, fin = by.result(timeout=3.0)
        assert fin.reason == "length" and len(tokens) >= 4
        assert eng.cache.fetcher.in_flight() == 1  # still waiting on Redis meanwhile
        wait_until(lambda: eng.cache.fetcher.in_flight() == 0, 5 * 4.0 + 1)
        fa = eng.snapshot()["tiers"]["remote"]["fetch_ahead"]
        assert fa["held_bytes"] == 0 and fa["waiting_admission"] == 0, fa
        assert eng.tiers.remote.health()["state"] == "degraded"
    finally:
        eng.shutdown(timeout=1.0)
        fake.close()


def test_a_fetch_held_by_a_queued_request_goes_when_it_ends(redis_server):
    """A request whose fetch came back waits in the queue (the only slot is busy) holding its
    blocks; cancelled there, it lets go of them."""
    from fake_redis import wait_until

    path = MODELS / CASES["full_attention"]
    a = make(path, redis_server.url)
    b = make(path, redis_server.url, parallel=1)
    b.start()
    try:
        ids = prompt_of(a, 11, 330)
        serve(a, ids)
        assert a.tiers.remote.flush()
        busy = b.submit(GenerationRequest(prompt_tokens=prompt_of(b, 12, 20), max_tokens=1500,
                                          ignore_eos=True, sampling=GREEDY))
        wait_until(lambda: b.snapshot()["counters"]["generated_tokens_total"] > 0, 10)
        h = b.submit(GenerationRequest(prompt_tokens=ids, max_tokens=4, sampling=GREEDY))

        def fetch_ahead() -> dict:
            return b.snapshot()["tiers"]["remote"]["fetch_ahead"]

        wait_until(lambda: fetch_ahead()["waiting_admission"] == 1, 10)
        assert fetch_ahead()["held_bytes"] == 20 * b.kv.block_nbytes
        h.cancel()
        assert h.result(timeout=5)[1].reason == "cancelled"
        wait_until(lambda: fetch_ahead()["waiting_admission"] == 0, 5)
        assert fetch_ahead()["held_bytes"] == 0
        busy.cancel()
    finally:
        a.shutdown(timeout=1.0)
        b.shutdown(timeout=1.0)
