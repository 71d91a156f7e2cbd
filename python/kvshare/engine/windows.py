"""The sliding-window layer group: its own block pool, holding each sequence's window only.

Gemma 3 attends over the last W = 512 positions in 15 of its 18 layers. Their K/V live in a
second block pool (`ModelCache.split`, same block size and chain keys as the main pool), and a
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
computing the same prefix (`Scheduler`, `CacheManager.reattach`) takes the donor's window
blocks the same way, zero-copy.
"""

from __future__ import annotations

from kvshare import _core


class WindowGroup:
    def __init__(self, pool: "_core.BlockPool", window: int, block_size: int):
        self.pool = pool
        self.window = int(window)
        self.block_size = int(block_size)
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

    # ---- attach ------------------------------------------------------------------------
    def match_at(self, keys: list[bytes], p: int) -> list[int] | None:
        """The pool's blocks of the window ending at block-aligned `p` (a peek), or None when
        one is missing."""
        r = self.window_blocks(p)
        if not len(r):
            return []
        if self.pool.lookup(keys[r[-1]]) is None:  # cheap first: most p are not kept
            return None
        ids = list(self.pool.match_prefix(keys[r.start:r.stop])[0])
        return ids if len(ids) == len(r) else None

    def attach(self, seq, ids: list[int], p: int) -> None:
        """Take references to `ids` (the window ending at `p`) as the sequence's table (what
        it held before is released after, so a block in both stays held)."""
        self.pool.acquire(ids)
        old = [b for b in seq.win_table if b != self.null]
        seq.win_table = [self.null] * self.first_needed(p) + list(ids)
        if old:
            self.pool.release(old)

    def copy_partial(self, seq, src: int, n: int, kv) -> int | None:
        """Copy-on-write of the first n tokens of window block `src` into a fresh block that
        ends the sequence's table; None (nothing changed) without room."""
        try:
            dst = self.pool.cow(src, n)
        except _core.OutOfBlocks:
            return None
        try:
            kv.copy_block(src, dst, n, group=1)
        except BaseException:
            self.pool.release([dst])
            raise
        seq.win_table.append(dst)
        return dst

    # ---- compute -----------------------------------------------------------------------
    def allocate(self, seq, end: int, parent_key) -> list[int] | None:
        """Blocks for positions up to `end` (the entries before the window of the sequence's
        next position are the null block). None (nothing allocated) without room."""
        bs = self.block_size
        need = -(-end // bs)
        start = len(seq.win_table)
        if start >= need:
            return []
        skip = self.first_needed(seq.n_computed)
        got: list[int] = []
        try:
            for j in range(start, need):
                got.append(self.null if j < skip else self.pool.allocate(parent_key(j)))
        except _core.OutOfBlocks:
            self.release_ids([b for b in got if b != self.null])
            return None
        return got

    def record(self, seq, start: int, end: int, keys: list[bytes]) -> None:
        """After the forward pass wrote tokens[start:end]: record them in the window blocks,
        register the full ones, release the blocks that left the window."""
        bs = self.block_size
        pos = start
        table = seq.win_table
        while pos < end:
            j = pos // bs
            stop = min(end, (j + 1) * bs)
            block = table[j]
            if block != self.null:
                self.pool.append_tokens(block, seq.tokens[pos:stop])
                if stop == (j + 1) * bs:
                    self.pool.register(block, keys[j])
            pos = stop
        self.drop_before(seq, self.first_needed(end))

    def drop_before(self, seq, j_end: int) -> None:
        table = seq.win_table
        gone = [j for j in range(min(j_end, len(table))) if table[j] != self.null]
        if gone:
            self.pool.release([table[j] for j in gone])
            for j in gone:
                table[j] = self.null

    def release(self, seq) -> None:
        ids = [b for b in seq.win_table if b != self.null]
        if ids:
            self.pool.release(ids)
        seq.win_table = []

    def release_ids(self, ids: list[int]) -> None:
        if ids:
            self.pool.release(ids)

    def used_blocks(self) -> int:
        """Blocks held by sequences (the null block excluded)."""
        return int(self.pool.stats()["used"]) - 1
