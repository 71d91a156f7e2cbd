"""`KVCacheManager`: the cache as the scheduler sees it, one manager per layer group behind it.

The scheduler's verbs (admit, allocate, commit, release, finish) go to every group's manager
(base.py): full attention always, plus a sliding-window group (Gemma 3's local layers) or a
recurrent group (hybrids). The lead (the most restrictive group) admits and decides what goes
to the tiers; allocation takes room in every group or in none.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Literal, overload

from kvshare.engine.cache.base import CacheContext, LayerGroupManager
from kvshare.engine.cache.full_attention import FullAttentionManager
from kvshare.engine.cache.prefetch import RemoteFetcher
from kvshare.engine.faults import maybe_inject
from kvshare.engine.sequence import Sequence, recomputes

if TYPE_CHECKING:
    from kvshare._core import _PoolStats
    from kvshare.engine.cache.recurrent import RecurrentStateManager
    from kvshare.engine.cache.sliding_window import SlidingWindowManager

log = logging.getLogger("kvshare.cache")


class KVCacheManager:
    def __init__(self, full: FullAttentionManager, ctx: CacheContext,
                 other: LayerGroupManager | None = None):
        self.ctx = ctx
        self.full = full
        self.pool = full.pool  # the main (full-attention) block pool
        self.kv = ctx.kv
        self.tiers = ctx.tiers
        self.keys = ctx.keys
        self.block_size = ctx.block_size
        self.groups: list[LayerGroupManager] = [full] + ([other] if other is not None else [])
        self.lead = other if other is not None else full
        self.counters = ctx.counters  # recovered faults: restore_failed, cow_no_room, ...
        # Redis reads run ahead of admission, off the engine thread (prefetch.py)
        self.fetcher = RemoteFetcher(self) if self.tiers.remote is not None else None
        self.tiers.fetcher = self.fetcher

    @property
    def attach_enabled(self) -> bool:
        return self.ctx.attach

    @property
    def stateful(self) -> bool:
        """A forward pass advances per-sequence state in place (recurrent layers): a failed
        one cannot just be computed again, the sequence must resume from a checkpoint."""
        return any(g.stateful for g in self.groups)

    @property
    def waits_for_donors(self) -> bool:
        """A sequence may wait for (and attach to) blocks a concurrent one is computing: not
        when it has state, which resumes only at checkpoints."""
        return self.ctx.attach and not self.stateful

    def root_key(self, salt: bytes | None) -> bytes:
        return self.keys.root_key(salt)

    @overload
    def group(self, kind: Literal["sliding_window"]) -> SlidingWindowManager | None: ...
    @overload
    def group(self, kind: Literal["recurrent"]) -> RecurrentStateManager | None: ...
    @overload
    def group(self, kind: str) -> LayerGroupManager | None: ...

    def group(self, kind: str) -> LayerGroupManager | None:
        """The group of that kind (each manager class has its own `kind`), or None."""
        return next((g for g in self.groups if g.kind == kind), None)

    # ---- admission -------------------------------------------------------------------
    def admit(self, seq: Sequence) -> int:
        """Attach a new (or preempted) sequence to the longest cached prefix it can resume.
        Returns the number of prompt tokens reused."""
        seq.block_table = []
        seq.win_table = []
        seq.n_computed = 0
        if seq.prefill_started is None:  # prompt time includes any tier restore
            seq.prefill_started = time.perf_counter()
        fetched = self.fetcher.take(seq) if self.fetcher is not None else None
        try:
            with self.tiers.reading(fetched):
                return self.lead.admit(seq)
        finally:  # its blocks are in the pool now (or were not usable)
            if fetched is not None:
                self.fetcher.release(fetched)  # type: ignore[union-attr]

    def fetch_ahead(self, seq: Sequence, done) -> bool:
        """Before a new request is queued: fetch what its admission would read from Redis on a
        fetch thread, then call `done()` there (prefetch.py). False (`done` not called): nothing
        to fetch, or no fetch thread free; queue it now."""
        if self.fetcher is None:
            return False
        try:
            return self.fetcher.start(seq, done)
        except Exception:  # noqa: BLE001 - no fetch is a miss, never the request's error
            log.exception("fetching ahead for %s could not start", seq.request.request_id)
            return False

    def drop_fetch(self, seq: Sequence) -> None:
        """A request that ends before its admission lets go of what was fetched for it."""
        if self.fetcher is not None:
            self.fetcher.drop(seq)

    def reattach(self, seq: Sequence) -> int:
        """Mid-prefill: if blocks for the next positions appeared since admission (a donor
        finished computing them), take them instead of recomputing. Returns tokens gained."""
        return self.lead.reattach(seq)

    def next_key(self, seq: Sequence) -> bytes | None:
        """Key of the block the sequence would compute next, if it starts a block."""
        bs = self.block_size
        if not self.waits_for_donors or seq.n_computed % bs or recomputes(seq):
            return None
        j = seq.n_computed // bs
        self.keys.ensure(seq, len(seq.tokens) - 1)
        return seq.block_keys[j] if j < len(seq.block_keys) else None

    def uncomputed_keys(self, seq: Sequence) -> list[bytes]:
        """Keys of full prompt blocks this sequence has yet to compute."""
        if not self.ctx.attach:
            return []
        self.keys.ensure(seq, len(seq.tokens) - 1)
        return seq.block_keys[seq.n_computed // self.block_size:]

    def has_block(self, key: bytes) -> bool:
        """The main pool holds a computed block under `key`."""
        return self.pool.lookup(key) is not None

    # ---- compute -----------------------------------------------------------------------
    def allocate(self, seq: Sequence, end: int) -> bool:
        """Room for positions [0, end) in every group. False, having taken nothing, when one
        group's pool cannot supply it: the scheduler waits or preempts."""
        grants: list[tuple[LayerGroupManager, list[int]]] = []
        for g in self.groups:
            ids = g.allocate(seq, end)
            if ids is None:
                for done, got in grants:
                    done.cancel(got)
                return False
            grants.append((g, ids))
        for g, ids in grants:
            g.install(seq, ids)
        return True

    def commit(self, seq: Sequence, start: int, end: int) -> None:
        """The forward pass wrote tokens[start:end]: every group records them, then the tier
        bookkeeping (pin the prompt's prefix entry in RAM once computed). A failed pin costs
        a future cache hit, never this request."""
        self.full.commit(seq, start, end)
        seq.n_computed = end
        for g in self.groups[1:]:
            g.commit(seq, start, end)
        try:
            self.lead.pin(seq)
        except Exception:  # noqa: BLE001
            seq.prefix_pinned = True
            self.counters["tier_pin_failed"] += 1
            log.exception("tier bookkeeping for %s failed", seq.request.request_id)

    def release(self, seq: Sequence) -> None:
        """Hand back everything the sequence holds (preemption, failure, finish); cached
        blocks stay findable."""
        for g in reversed(self.groups):
            g.release(seq)

    def finish(self, seq: Sequence, save: bool = True) -> None:
        """A finished sequence: with `save`, copy what later sessions resume from out to the
        tiers (a failed save costs a future cache hit, never this request); then release."""
        self.drop_fetch(seq)  # it may end while queued, before its admission took the fetch
        if save and self.ctx.tiers_on() and seq.request.cache_store:
            try:
                maybe_inject(seq.request, "save")
                self.keys.ensure(seq, seq.n_computed)
                self.lead.save(seq)
            except Exception:  # noqa: BLE001
                self.counters["tier_save_failed"] += 1
                log.exception("saving %s to the cache tiers failed", seq.request.request_id)
        self.release(seq)

    # ---- introspection ----------------------------------------------------------------
    def kv_bytes_held(self, pool_stats: _PoolStats | None = None) -> int:
        """Bytes of the KV blocks that sequences hold now (referenced, not merely cached) in
        every group; `pool_stats`: the main pool's `stats()` when the caller has them."""
        n = int((pool_stats or self.pool.stats())["used"]) * self.kv.block_nbytes
        win = self.group("sliding_window")
        if win is not None:
            n += win.used_blocks() * self.kv.win_block_nbytes
        return n

    def shared_blocks(self, seq: Sequence) -> int:
        return self.full.shared_blocks(seq)
