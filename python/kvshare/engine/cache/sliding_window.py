"""The sliding-window layer group: its own block pool, holding each sequence's window only.

Gemma 3 attends over the last W = 512 positions in 15 of its 18 layers. Their K/V live in a
second block pool (`KVArrays.split`, same block size and chain keys as the main pool), and a
sequence holds there only the blocks some future query of its can still see:
- before each step it holds blocks from `first_needed(start)` (the block of position
  start - W + 1) to the chunk's end; entries before that are the reserved zero block `null`
  (never read: attention starts at the window);
- after each step it releases the blocks that left the window of its next position.

Sharing: every full window block is registered under its chain key, as in the main pool, and
a released one stays findable in the pool's LRU until its room is needed. A sequence whose
prompt matches up to a block-aligned position p attaches to the main pool's blocks before p
and to the window blocks of [p - W + 1, p) when the window pool still has all of them, and
resumes at p: the deepest such p within the match, as a hybrid resumes at its deepest
checkpoint. Sessions of one agent re-acquire the window at their shared prefix's end and
release it again, which keeps it recent; a window is W / block_size blocks (Gemma 270M, f16:
7.5 MiB) shared by every session that resumes there. A session that waits for a donor
computing the same prefix (`Scheduler`, `reattach`) takes the donor's window blocks the same
way, zero-copy.

This group leads admission (a match resumes only where a kept window ends) and so decides what
goes to the tiers: the full-attention blocks of the whole prefix plus the windows ending where
the prefix entry and the conversation end, so the next session resumes there.
"""

from __future__ import annotations

import logging
import time

import numpy as np

from kvshare import _core
from kvshare.engine.cache.base import (CacheContext, LayerGroupManager, allocate_blocks,
                                       copy_on_write, record_tokens)
from kvshare.engine.cache.full_attention import FullAttentionManager
from kvshare.engine.sequence import Sequence, recomputes

log = logging.getLogger("kvshare.cache")

WINDOW_GROUP = 1  # the window pool's arrays in KVArrays (group 0: full attention)


class SlidingWindowManager(LayerGroupManager):
    kind = "sliding_window"

    def __init__(self, pool: "_core.BlockPool", window: int, full: FullAttentionManager,
                 ctx: CacheContext):
        self.pool = pool
        self.window = int(window)
        self.full = full
        self.ctx = ctx
        self.keys = ctx.keys
        self.block_size = ctx.block_size
        # the zero block that stands for released entries: held forever, never written
        self.null = pool.allocate(b"\0" * 32)

    # ---- positions ---------------------------------------------------------------------
    def first_needed(self, pos: int) -> int:
        """Index of the first block a query at `pos` (or later) reads."""
        return max(0, pos - self.window + 1) // self.block_size

    def window_blocks(self, p: int) -> range:
        """Blocks a sequence resuming at block-aligned `p` needs: those of positions
        [p - W + 1, p - 1]."""
        return range(self.first_needed(p), p // self.block_size)

    # ---- admission -------------------------------------------------------------------
    def admit(self, seq: Sequence) -> int:
        """Resume at the deepest block-aligned p within the main pool's match (or, past it,
        within what the tiers hold) whose window is in the window pool (or a tier); then the
        longest partial match of the next block, copied in both pools."""
        bs = self.block_size
        reusable = len(seq.tokens) - 1
        if not self.ctx.attach or reusable < 1 or recomputes(seq):
            return 0
        self.keys.ensure(seq, reusable)
        keys = seq.block_keys[: reusable // bs]
        ids = self.full.peek(keys)
        if self.ctx.tiers_on() and len(ids) < len(keys):
            try:
                got = self._resume_from_tiers(seq, keys, ids)
            except Exception:  # noqa: BLE001 - a failed tier lookup or read is a miss
                self.ctx.counters["restore_failed"] += 1
                log.exception("tier window restore for %s failed; recomputing",
                              seq.request.request_id)
                self.release(seq)
                self.full.release(seq)
                seq.n_computed = 0
                got = 0
            if got:
                return got
        got = self._resume(seq, keys, ids, 0)
        if got == len(ids) * bs and got < reusable:
            got += self._extend(seq, min(reusable - got, bs))
        return got

    def reattach(self, seq: Sequence) -> int:
        want = self.full.blocks_ahead(seq)
        if not want:
            return 0
        return self._resume(seq, seq.block_keys, self.full.peek(want), seq.n_computed)

    def _resume(self, seq: Sequence, keys: list[bytes], ids: list[int], start: int) -> int:
        """Move the sequence (holding blocks [0, start) of the main pool) to the deepest
        block-aligned p in (start, start + len(ids) blocks] whose window is in the window
        pool: `ids` are the main pool's blocks from `start` on (a peek). Returns the tokens
        gained."""
        bs = self.block_size
        j0 = start // bs
        for p in range((j0 + len(ids)) * bs, start, -bs):
            wids = self._match_at(keys, p)
            if wids is None:
                continue
            self.full.take(seq, ids[: p // bs - j0])
            self._attach(seq, wids, p)
            seq.n_computed = p
            return p - start
        return 0

    def _match_at(self, keys: list[bytes], p: int) -> list[int] | None:
        """The pool's blocks of the window ending at block-aligned `p` (a peek), or None when
        one is missing."""
        r = self.window_blocks(p)
        if not len(r):
            return []
        if self.pool.lookup(keys[r[-1]]) is None:  # cheap first: most p are not kept
            return None
        ids = list(self.pool.match_prefix(keys[r.start:r.stop])[0])
        return ids if len(ids) == len(r) else None

    def _attach(self, seq: Sequence, ids: list[int], p: int) -> None:
        """Take references to `ids` (the window ending at `p`) as the sequence's table (what
        it held before is released after, so a block in both stays held)."""
        self.pool.acquire(ids)
        old = [b for b in seq.win_table if b != self.null]
        seq.win_table = [self.null] * self.first_needed(p) + list(ids)
        self.cancel(old)

    def _extend(self, seq: Sequence, rest: int) -> int:
        """Past a block-aligned resume point: the longest partial match of the next block in
        both pools (the main pool's and the window pool's copies of it), copied-on-write into
        fresh blocks of each. Returns the tokens gained (0: none, nothing changed)."""
        p = seq.n_computed
        j = p // self.block_size
        nxt = seq.tokens[p: p + rest]
        hit = self.full.extend_match(seq, j, nxt)
        whit = self.pool.extend_match(self.keys.parent(seq, j), nxt)
        if hit is None or whit is None:
            return 0
        n = min(hit[1], whit[1], rest)
        if n <= 0 or not self.full.copy_partial(seq, hit[0], n):
            return 0
        dst = copy_on_write(self.pool, self.ctx.kv, whit[0], n, WINDOW_GROUP)
        if dst is None:  # no room in the window pool: take the main pool's copy back
            self.full.drop_last(seq)
            return 0
        seq.win_table.append(dst)
        seq.n_computed = p + n
        return n

    def _resume_from_tiers(self, seq: Sequence, keys: list[bytes], ids: list[int]) -> int:
        """Resume deeper than the pool alone allows: at the deepest block-aligned p past the
        pool's match where the main blocks before p and the window blocks ending at p are each
        in the pool or a tier. Returns p (0: none, nothing held)."""
        bs, tiers = self.block_size, self.ctx.tiers
        m = len(ids) + tiers.available_prefix(keys[len(ids):])
        t0 = time.perf_counter()
        try:
            for p in range(m * bs, len(ids) * bs, -bs):
                r = self.window_blocks(p)
                have = [self.pool.lookup(keys[j]) for j in r]
                if any(h is None and not tiers.has_window_block(keys[j])
                       for j, h in zip(reversed(r), reversed(have))):
                    continue
                n_main = p // bs
                self.full.take(seq, ids)
                if n_main > len(ids):
                    seq.block_table += self.full.restore(seq, keys[:n_main], len(ids))
                wids = (self._restore_window(seq, keys, r, have)
                        if len(seq.block_table) == n_main else None)
                if wids is None:
                    self.full.release(seq)
                    return 0
                seq.win_table = [self.null] * r.start + wids
                seq.n_computed = p
                return p
            return 0
        finally:
            seq.restore_s += time.perf_counter() - t0

    def _restore_window(self, seq: Sequence, keys: list[bytes], r: range,
                        have: list) -> list[int] | None:
        """Window blocks `r`: the pool's (acquired) or read from a tier into fresh blocks
        (one bulk write) registered under their chain keys. None (nothing held) if one cannot
        be had."""
        bs, kv = self.block_size, self.ctx.kv
        read = [i for i, h in enumerate(have) if h is None]
        data = np.empty((len(read), *kv.win_block_shape), dtype=kv.kv_dtype)
        for row, i in enumerate(read):
            if not self.ctx.tiers.read_window_block(keys[r[i]], data[row]):
                return None
        # the pool's blocks are held before any allocation, which could evict a cached one
        got = [h for h in have if h is not None]
        self.pool.acquire(got)
        ids = list(have)
        try:
            for i in read:
                ids[i] = self.pool.allocate(self.keys.parent(seq, r[i]))
                got.append(ids[i])
            kv.write_blocks([ids[i] for i in read], data, group=WINDOW_GROUP)
        except _core.OutOfBlocks:
            self.cancel(got)
            return None
        except BaseException:
            self.cancel(got)
            raise
        for i in read:
            j = r[i]
            self.pool.append_tokens(ids[i], seq.tokens[j * bs:(j + 1) * bs])
            other = self.pool.register(ids[i], keys[j])
            if other != ids[i]:  # registered meanwhile: share that one
                self.pool.acquire([other])
                self.pool.release([ids[i]])
                ids[i] = other
        return ids

    # ---- compute -----------------------------------------------------------------------
    def allocate(self, seq: Sequence, end: int) -> list[int] | None:
        """Blocks for positions up to `end` (the entries before the window of the sequence's
        next position are the null block)."""
        bs = self.block_size
        need = -(-end // bs)
        start = len(seq.win_table)
        if start >= need:
            return []
        self.keys.ensure(seq, end)
        return allocate_blocks(self.pool, self.keys, seq, range(start, need), self.null,
                               self.first_needed(seq.n_computed))

    def install(self, seq: Sequence, ids: list[int]) -> None:
        seq.win_table.extend(ids)

    def cancel(self, ids: list[int]) -> None:
        ids = [b for b in ids if b != self.null]
        if ids:
            self.pool.release(ids)

    def commit(self, seq: Sequence, start: int, end: int) -> None:
        """Record tokens[start:end] in the window blocks, register the full ones, release the
        blocks that left the window."""
        record_tokens(self.pool, seq.win_table, seq, start, end, self.keys, skip=self.null)
        self._drop_before(seq, self.first_needed(end))

    def _drop_before(self, seq: Sequence, j_end: int) -> None:
        table = seq.win_table
        gone = [j for j in range(min(j_end, len(table))) if table[j] != self.null]
        if gone:
            self.pool.release([table[j] for j in gone])
            for j in gone:
                table[j] = self.null

    def release(self, seq: Sequence) -> None:
        self.cancel(seq.win_table)
        seq.win_table = []

    # ---- tiers -------------------------------------------------------------------------
    def pin(self, seq: Sequence) -> int:
        """The full-attention prefix entry and the window ending at it, pinned in RAM."""
        n = self.full.pin(seq)
        if n:
            self._save_window(seq, n, pin=True)
        return n

    def save(self, seq: Sequence) -> None:
        """The full-attention blocks, and the windows the next session resumes at: where the
        prefix entry ends (pinned with it in RAM, see pin) and where the conversation ends
        (its next turn)."""
        self.full.save(seq)
        n = self.full.pinned_tokens(seq)
        if n:
            self._save_window(seq, n, pin=self.ctx.tiers.ram is not None)
        self._save_window(seq, seq.n_computed)

    def _save_window(self, seq: Sequence, p: int, pin: bool = False) -> None:
        """The window blocks ending at block-aligned p (of `p`) to the tiers, when the window
        pool still has them all (held by the sequence, or cached)."""
        bs = self.block_size
        p -= p % bs
        if p < bs:
            return
        r = self.window_blocks(p)
        table = seq.win_table
        ids = []
        for j in r:
            b = table[j] if j < len(table) and table[j] != self.null else None
            if b is None:
                b = self.pool.lookup(seq.block_keys[j])
            if b is None:
                return
            ids.append(b)
        host = self.ctx.kv.read_blocks(ids, group=WINDOW_GROUP)
        self.ctx.tiers.save_window([seq.block_keys[j] for j in r], host, pin)

    def used_blocks(self) -> int:
        """Blocks held by sequences (the null block excluded)."""
        return int(self.pool.stats()["used"]) - 1

    def stats(self) -> dict:
        return {"size": self.window, "blocks": int(self.pool.stats()["total"]),
                "used": self.used_blocks(), "block_bytes": self.ctx.kv.win_block_nbytes}
