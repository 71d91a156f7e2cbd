"""Fetch-ahead from the shared (Redis) tier: a request's remote reads run before it is queued,
on a fetch thread, never on the engine thread.

Why: the engine thread runs every sequence's steps. A Redis read there (even one bounded by
its deadline) stalls every other sequence's decode for as long as it takes, up to
`--cache-redis-timeout` per call. So when a request is submitted, `RemoteFetcher.start` looks
up its prompt's chain: a prompt whose blocks the device pool already holds is queued at once;
otherwise a fetch thread finds what the local tiers (RAM, disk) hold, asks Redis for the
blocks past them (and, by the lead group's rules, the window blocks or the recurrent-state
checkpoint the sequence would resume at), reads and verifies them into a `RemoteFetch` held for
the request, and only then queues it. At admission the engine thread takes that holding area
as the tiers' remote reads (`TierManager.reading`): the same lookup code, over memory. A fetch
that fails or misses its deadline holds what it got so far (a leading part, still usable) or
nothing; the request then computes the rest, as on any miss.

Bounds: at most `max_fetches` fetches at once (a request that finds them all busy is queued
without one: a miss, never a wait behind a slow Redis), each within `deadline_s` of its start
plus one call's timeout, and at most `max_bytes` of fetched blocks held at once over all
requests (a fetch takes the leading blocks that fit). A holding area is dropped at admission
(its blocks are then in the pool) or when its request ends first.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from kvshare import _core
from kvshare.engine.sequence import Sequence, recomputes

if TYPE_CHECKING:
    from kvshare.engine.cache.base import CacheContext, LayerGroupManager
    from kvshare.engine.cache.tiers import TierManager


class FetchingCache(Protocol):
    """What a fetch reads of the cache manager (`manager.KVCacheManager`, which imports this
    module)."""

    block_size: int
    ctx: CacheContext
    tiers: TierManager
    pool: Any
    kv: Any
    keys: Any
    lead: LayerGroupManager


log = logging.getLogger("kvshare.remote")

FETCH_THREADS = 8  # fetches in flight at once
FETCH_MAX_BYTES = 256 * 2**20  # fetched blocks held at once, over every waiting request
CHUNK_BLOCKS = 64  # blocks per pipelined read


class RemoteFetch:
    """One request's blocks (chain key -> verified payload bytes) and at most one recurrent
    checkpoint, read from Redis ahead of its admission. Answers the tiers' remote reads
    (`present`, `read_blocks`, `find_checkpoint`, `read_checkpoint`, as `RemoteTier` does)
    from memory."""

    def __init__(self) -> None:
        self.blocks: dict[bytes, np.ndarray] = {}
        self.checkpoint: tuple[bytes, int, str, bytes] | None = None  # key, position, layout, data
        self.nbytes = 0  # held against the fetcher's budget

    def present(self, keys: list[bytes]) -> int:
        n = 0
        while n < len(keys) and keys[n] in self.blocks:
            n += 1
        return n

    def read_blocks(self, keys: list[bytes], staging: np.ndarray) -> int:
        for i, key in enumerate(keys):
            data = self.blocks.get(key)
            out = staging[i].reshape(-1).view(np.uint8)
            if data is None or data.size != out.size:
                return i
            out[:] = data
        return len(keys)

    def find_checkpoint(self, candidates: list[tuple[int, bytes]]) -> tuple[int, bytes] | None:
        ck = self.checkpoint
        if ck is not None and (ck[1], ck[0]) in candidates:
            return ck[1], ck[0]
        return None

    def read_checkpoint(self, block_key: bytes, position: int) -> tuple[str, bytes] | None:
        ck = self.checkpoint
        if ck is None or ck[0] != block_key or ck[1] != position:
            return None
        return ck[2], ck[3]


@dataclass
class FetchCounters:
    started: int = 0  # fetches run on a fetch thread
    local: int = 0  # queued at once: under one block, or the device pool holds the prompt
    busy: int = 0  # requests queued without a fetch: every fetch thread was busy
    over_budget: int = 0  # fetches cut short: the bytes held ahead were at their bound
    late: int = 0  # fetches that ran past their deadline (what came in by then is used)
    blocks: int = 0  # blocks (and window blocks) fetched
    checkpoints: int = 0
    bytes: int = 0
    seconds: float = 0.0  # time spent fetching, over all fetches
    held_bytes: int = 0  # held now, waiting for admission


class RemoteFetcher:
    """Runs fetches for the cache manager's lead group (see the module docstring)."""

    def __init__(self, cache: FetchingCache, max_fetches: int = FETCH_THREADS,
                 max_bytes: int = FETCH_MAX_BYTES, deadline_s: float | None = None):
        self.cache = cache
        self.tiers = cache.tiers
        remote = self.tiers.remote
        assert remote is not None
        self.remote = remote
        self.max_fetches = max_fetches
        self.max_bytes = max_bytes
        # two round trips (which blocks, then the blocks) at the call timeout each, and more
        # for long prompts; a fetch stops starting calls after this
        self.deadline_s = deadline_s if deadline_s is not None else 4 * remote.timeout_s
        self.counters = FetchCounters()
        self._lock = threading.Lock()
        self._running = 0
        self._held: dict[str, RemoteFetch] = {}  # sequence key -> its fetch, until admission
        self._pool: ThreadPoolExecutor | None = None

    # ---- the submitting thread -------------------------------------------------------------
    def start(self, seq: Sequence, done: Callable[[], None]) -> bool:
        """Fetch ahead for `seq` on a fetch thread, then call `done()` (there, always once).
        False (and `done` is not called) when there is nothing to fetch or no thread free: the
        caller queues the request itself."""
        ctx = self.cache.ctx
        if not ctx.attach or len(seq.tokens) < 2 or recomputes(seq):
            return False
        if not self.remote.breaker.allow():
            return False  # every read would be a miss
        keys = self._chain(seq)
        if not keys or len(self.cache.pool.match_prefix(keys)[0]) == len(keys):
            self.counters.local += 1
            return False
        with self._lock:
            if self._running >= self.max_fetches:
                self.counters.busy += 1
                return False
            self._running += 1
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.max_fetches,
                                                thread_name_prefix="kvshare-fetch")
        try:
            self._pool.submit(self._run, seq, keys, done)
        except RuntimeError:  # shutting down: no fetch
            with self._lock:
                self._running -= 1
            return False
        return True

    def _chain(self, seq: Sequence) -> list[bytes]:
        """The chain keys the lead group's admission looks up (full blocks of all but the last
        prompt token)."""
        bs = self.cache.block_size
        reusable = len(seq.tokens) - 1
        if self.cache.lead.kind == "recurrent":  # one root: no public-prefix split
            root = self.cache.keys.root_key(seq.request.cache_salt)
            return list(_core.hash_blocks(root, seq.tokens[: reusable - reusable % bs], bs))
        self.cache.keys.ensure(seq, reusable)
        return list(seq.block_keys[: reusable // bs])

    # ---- a fetch thread ------------------------------------------------------------------
    def _run(self, seq: Sequence, keys: list[bytes], done: Callable[[], None]) -> None:
        t0 = time.monotonic()
        fetch = RemoteFetch()
        try:
            self._fetch(seq, keys, fetch, t0 + self.deadline_s)
        except Exception:  # noqa: BLE001 - a failed fetch is a miss, never the request's error
            log.exception("fetching ahead from Redis for %s failed", seq.request.request_id)
        finally:
            with self._lock:
                self._running -= 1
                self.counters.started += 1
                self.counters.seconds += time.monotonic() - t0
                if fetch.blocks or fetch.checkpoint is not None:
                    self._held[seq.key] = fetch
                else:
                    self._give_back(fetch)
            done()

    def _fetch(self, seq: Sequence, keys: list[bytes], fetch: RemoteFetch,
               deadline: float) -> None:
        kind = self.cache.lead.kind
        n_local = self._local_prefix(keys)
        if kind == "recurrent":
            self._fetch_checkpointed(seq, keys, n_local, fetch, deadline)
            return
        run = self.remote.present(keys[n_local:]) if n_local < len(keys) else 0
        if kind == "sliding_window":
            self._fetch_windowed(keys, n_local, n_local + run, fetch, deadline)
            return
        self._fetch_blocks(keys[n_local:n_local + run], self.cache.kv.block_nbytes, fetch,
                           deadline)

    def _local_prefix(self, keys: list[bytes]) -> int:
        """How many leading keys the device pool, RAM and disk hold, in the order a restore
        takes them."""
        tiers = self.tiers
        n = len(self.cache.pool.match_prefix(keys)[0])
        if tiers.ram is not None and n < len(keys):
            n += int(tiers.ram.match_prefix(keys[n:]))
        if tiers.disk is not None and n < len(keys):
            n += int(tiers.disk.lookup(keys[n:])[0])
        return n

    def _fetch_blocks(self, keys: list[bytes], nbytes: int, fetch: RemoteFetch,
                      deadline: float) -> bool:
        """Read `keys` (each one payload of `nbytes`) into the holding area, leading ones
        first, as far as the budget and the deadline allow. True if all came."""
        for c0 in range(0, len(keys), CHUNK_BLOCKS):
            chunk = keys[c0:c0 + CHUNK_BLOCKS]
            if time.monotonic() > deadline:
                self.counters.late += 1
                return False
            room = self._reserve(fetch, len(chunk), nbytes)
            if room < len(chunk):
                with self._lock:
                    self.counters.over_budget += 1
                if not room:
                    return False
            cut, chunk = room < len(chunk), chunk[:room]
            buf = np.empty((len(chunk), nbytes), dtype=np.uint8)
            n = self.remote.read_blocks(chunk, buf)
            with self._lock:  # what did not come back is not held
                self._unreserve(fetch, (len(chunk) - n) * nbytes)
            for i in range(n):
                fetch.blocks[chunk[i]] = buf[i]
            with self._lock:
                self.counters.blocks += n
                self.counters.bytes += n * nbytes
            if n < len(chunk) or cut:
                return False
        return True

    def _reserve(self, fetch: RemoteFetch, n: int, nbytes: int) -> int:
        """Take room for up to `n` payloads of `nbytes` in the budget; how many fit."""
        with self._lock:
            room = self.max_bytes - self.counters.held_bytes
            k = max(0, min(n, room // max(1, nbytes)))
            self.counters.held_bytes += k * nbytes
            fetch.nbytes += k * nbytes
            return k

    def _unreserve(self, fetch: RemoteFetch, nbytes: int) -> None:
        self.counters.held_bytes -= nbytes
        fetch.nbytes -= nbytes

    def _fetch_windowed(self, keys: list[bytes], n_local: int, n_main: int,
                        fetch: RemoteFetch, deadline: float) -> None:
        """Sliding-window lead: it resumes at the deepest block-aligned p whose main blocks
        and window blocks (those of positions [p - W + 1, p)) are all to be had. Fetch the main
        blocks up to the deepest such p that Redis completes, and its window blocks that only
        Redis holds."""
        win = self.cache.lead
        tiers, bs = self.tiers, self.cache.block_size
        n_pool = len(self.cache.pool.match_prefix(keys)[0])
        if n_main <= n_pool:
            return
        lo = win.first_needed((n_pool + 1) * bs)  # type: ignore[attr-defined]
        wkeys = {j: tiers.window_key(keys[j]) for j in range(lo, n_main)}

        def local(j: int) -> bool:
            wk = wkeys[j]
            return (win.pool.lookup(keys[j]) is not None  # type: ignore[attr-defined]
                    or (tiers.ram is not None and tiers.ram.contains_block(wk))
                    or (tiers.disk is not None and bool(tiers.disk.lookup([wk])[0])))

        held = {j for j in range(lo, n_main) if local(j)}
        ask = [j for j in range(lo, n_main) if j not in held]
        if ask:
            there = self.remote.present_each([wkeys[j] for j in ask])
            remote = {j for j, t in zip(ask, there) if t}
        else:
            remote = set()
        for p in range(n_main * bs, n_pool * bs, -bs):
            r = win.window_blocks(p)  # type: ignore[attr-defined]
            if all(j in held or j in remote for j in r):
                if self._fetch_blocks(keys[n_local:p // bs], self.cache.kv.block_nbytes, fetch,
                                      deadline):
                    self._fetch_blocks([wkeys[j] for j in r if j not in held],
                                       self.cache.kv.win_block_nbytes, fetch, deadline)
                return

    def _fetch_checkpointed(self, seq: Sequence, keys: list[bytes], n_local: int,
                            fetch: RemoteFetch, deadline: float) -> None:
        """Recurrent lead: it resumes only at a checkpoint. Fetch the deepest checkpoint Redis
        has past what RAM and disk offer, and the blocks up to it the local tiers lack."""
        tiers, bs = self.tiers, self.cache.block_size
        reusable = len(seq.tokens) - 1
        root = self.cache.keys.root_key(seq.request.cache_salt)
        floor = tiers.local_checkpoint_position(root, keys, seq.tokens, reusable)
        top = min(len(keys), reusable // bs)
        cands = [(j * bs, keys[j - 1]) for j in range(floor // bs + 1, top + 1)]
        found = self.remote.find_checkpoint(cands) if cands else None
        if found is None:
            return
        pos, bkey = found
        n = pos // bs
        if n > n_local and self.remote.present(keys[n_local:n]) < n - n_local:
            return
        if time.monotonic() > deadline:
            self.counters.late += 1
            return
        got = self.remote.read_checkpoint(bkey, pos)
        if got is None:
            return
        layout, data = got
        if not self._reserve(fetch, 1, len(data)):
            with self._lock:
                self.counters.over_budget += 1
            return
        fetch.checkpoint = (bkey, pos, layout, data)
        with self._lock:
            self.counters.checkpoints += 1
            self.counters.bytes += len(data)
        if n > n_local and not self._fetch_blocks(keys[n_local:n], self.cache.kv.block_nbytes,
                                                  fetch, deadline):
            with self._lock:  # blocks missing: the checkpoint cannot be used
                self._give_back(fetch)
            fetch.blocks.clear()
            fetch.checkpoint = None

    # ---- the engine thread -----------------------------------------------------------------
    def take(self, seq: Sequence) -> RemoteFetch | None:
        """The sequence's fetch, handed over for its admission (None: none held). Its bytes
        stop counting when `release` is called after the admission."""
        with self._lock:
            return self._held.pop(seq.key, None)

    def release(self, fetch: RemoteFetch | None) -> None:
        if fetch is not None:
            with self._lock:
                self._give_back(fetch)

    def drop(self, seq: Sequence) -> None:
        """The request ended before its admission: its fetch (if any) goes."""
        self.release(self.take(seq))

    def _give_back(self, fetch: RemoteFetch) -> None:
        self.counters.held_bytes -= fetch.nbytes
        fetch.nbytes = 0

    def in_flight(self) -> int:
        with self._lock:
            return self._running

    def stats(self) -> dict:
        with self._lock:
            return {**vars(self.counters), "running": self._running,
                    "waiting_admission": len(self._held)}

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
