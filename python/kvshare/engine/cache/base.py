"""The interface every layer kind's cache manager implements (`LayerGroupManager`).

A model's layers fall into groups by kind: full attention (every position's K/V), sliding
window (the last W positions' K/V) and recurrent state (one state per sequence). Each group has
one manager; `KVCacheManager` (manager.py) runs them side by side with the scheduler's verbs:

- `admit`: a new or preempted sequence attaches to the longest cached prefix it can resume;
- `allocate`: room for the positions a step will compute: a list of new blocks, or None for
  "no room" (having taken nothing), never an exception; `install` hands them to the sequence,
  `cancel` gives them back when another group had no room;
- `commit`: the forward pass wrote tokens[start:end]: record them, make full blocks findable,
  drop what no later query reads, snapshot state;
- `release`: give back what the sequence holds (finish or preemption);
- `pin` / `save`: copy what later sessions resume from out to the RAM / disk / Redis tiers.

Where a sequence may resume is decided by its most restrictive group, the lead: full attention
can resume at any matched position; a sliding-window group only where a kept window ends, a
recurrent group only at a checkpoint. The lead admits the sequence (taking the full-attention
blocks up to its resume point) and chooses what goes to the tiers.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvshare import _core
from kvshare.engine.cache.keys import BlockKeys
from kvshare.engine.sequence import Sequence

if TYPE_CHECKING:
    from kvshare.engine.cache.tiers import TierManager
    from kvshare.model.kv_arrays import KVArrays


@dataclass
class CacheContext:
    """What every group's manager shares: the model's paged KV arrays (the payload of every
    group's blocks), the chain keys, the tiers behind the pools (always there: `enabled` is
    False when no tier is configured), whether prefixes are shared at all, and the counters
    of faults recovered from (a failed restore is a miss, a copy-on-write without room
    recomputes, ...)."""

    kv: KVArrays
    keys: BlockKeys
    tiers: TierManager
    attach: bool = True
    counters: Counter = field(default_factory=Counter)

    @property
    def block_size(self) -> int:
        return self.keys.block_size

    def tiers_on(self) -> bool:
        return self.tiers.enabled and self.attach


def full_blocks_before(seq: Sequence, b: int | None, block_size: int) -> int:
    """Tokens of the full blocks before position b of the prompt (0 when b is not in it)."""
    if not isinstance(b, int) or b <= 0 or b > seq.n_prompt:
        return 0
    return b - b % block_size


def prefix_entry_tokens(seq: Sequence, block_size: int) -> int:
    """Tokens of the prompt's prefix entry: the full blocks before its first user message (0
    when the request has no boundary or it is inside the first block)."""
    return full_blocks_before(seq, seq.request.first_user_boundary, block_size)


class LayerGroupManager(ABC):
    kind: str = ""
    # a forward pass advances per-sequence state in place (recurrent layers): a sequence
    # resumes only from a snapshot, never from blocks a concurrent one is computing
    stateful: bool = False

    @abstractmethod
    def admit(self, seq: Sequence) -> int:
        """Attach a fresh sequence (empty tables) to the longest prefix this group and the
        groups it leads can resume at. Returns the tokens reused (seq.n_computed)."""

    def reattach(self, seq: Sequence) -> int:
        """Mid-prefill, block aligned: take blocks for the next positions that appeared since
        admission (a donor finished computing them). Returns the tokens gained."""
        return 0

    @abstractmethod
    def allocate(self, seq: Sequence, end: int) -> list[int] | None:
        """New blocks so that positions [0, end) have room (not yet in the sequence's table);
        None, having taken nothing, when the pool cannot supply them."""

    @abstractmethod
    def install(self, seq: Sequence, ids: list[int]) -> None:
        """Append blocks from `allocate` to the sequence's table."""

    @abstractmethod
    def cancel(self, ids: list[int]) -> None:
        """Give back blocks from `allocate` that will not be installed."""

    @abstractmethod
    def commit(self, seq: Sequence, start: int, end: int) -> None:
        """The forward pass wrote tokens[start:end] of the sequence."""

    @abstractmethod
    def release(self, seq: Sequence) -> None:
        """Give back everything the sequence holds in this group."""

    @abstractmethod
    def pin(self, seq: Sequence) -> int:
        """(lead) Once the prompt's prefix entry is computed, pin it in the RAM tier. Returns
        the tokens pinned now (0: nothing, not yet, or pinned another way)."""

    @abstractmethod
    def save(self, seq: Sequence) -> None:
        """(lead) A finishing sequence: copy what later sessions resume from to the tiers."""

    def stats(self) -> dict | None:
        """This group's share of /cache (None: nothing beyond the main pool's)."""
        return None


def copy_on_write(pool, kv, src: int, n: int, group: int = 0) -> int | None:
    """A fresh block of `pool` holding the first n tokens of block `src` (their chain state and
    their K/V in `group`'s arrays); `src` is never written. None (nothing taken) when the pool
    has no free block."""
    try:
        dst = pool.cow(src, n)
    except _core.OutOfBlocks:
        return None
    try:
        kv.copy_block(src, dst, n, group=group)
    except BaseException:
        pool.release([dst])
        raise
    return dst


def record_tokens(pool, table: list[int], seq: Sequence, start: int, end: int, keys: BlockKeys,
                  skip: int | None = None) -> None:
    """Record tokens[start:end] in the blocks of `table` (entries equal to `skip` are not
    held: passed over), registering under its chain key every block that became full."""
    bs = keys.block_size
    pos = start
    while pos < end:
        j = pos // bs
        stop = min(end, (j + 1) * bs)
        block = table[j]
        if block != skip:
            pool.append_tokens(block, seq.tokens[pos:stop])
            if stop == (j + 1) * bs:
                keys.ensure(seq, stop)
                pool.register(block, seq.block_keys[j])
        pos = stop


def allocate_blocks(pool, keys: BlockKeys, seq: Sequence, js: range, null: int | None = None,
                    null_before: int = 0) -> list[int] | None:
    """Fresh blocks of `pool` for the sequence's blocks `js`, each chained from its parent key
    (entries before `null_before` are the `null` block instead: not held). None, having taken
    nothing, when the pool runs out."""
    got: list[int] = []
    try:
        for j in js:
            if null is not None and j < null_before:
                got.append(null)
            else:
                got.append(pool.allocate(keys.parent(seq, j)))
    except _core.OutOfBlocks:
        taken = [b for b in got if b != null]
        if taken:
            pool.release(taken)
        return None
    return got
