"""Full-attention layers: ref-counted, shared, copy-on-write KV blocks in the main block pool.

Rules that keep sharing safe:
- A block is found by its chain key (keys.py), so a match is always state computed from
  exactly this prompt's tokens (and salt).
- A shared block is never written: a match that ends inside a block copies the matching
  tokens into a fresh block first (copy-on-write).
- At least one prompt token is always computed, so the last position's logits exist.
- Tokens are recorded in the pool only after the forward pass wrote their KV, and a full block
  is registered (made findable) only then.

Faults stay with their sequence: no room is a return value (the scheduler waits or preempts),
a tier restore that fails is a miss (recompute), a failed copy-on-write recomputes the few
tokens it would have copied.

This group leads admission for models whose layers are all full attention; for the others
its blocks are taken up to the position the lead resumes at (`take`, `restore`,
`copy_partial`).
"""

from __future__ import annotations

import logging
import time

from kvshare import _core
from kvshare.engine.cache.base import (CacheContext, LayerGroupManager, allocate_blocks,
                                       copy_on_write, full_blocks_before, prefix_entry_tokens,
                                       record_tokens)
from kvshare.engine.faults import injected, maybe_inject
from kvshare.engine.sequence import Sequence, recomputes

log = logging.getLogger("kvshare.cache")


class FullAttentionManager(LayerGroupManager):
    kind = "full_attention"

    def __init__(self, pool: "_core.BlockPool", ctx: CacheContext):
        self.pool = pool
        self.ctx = ctx
        self.keys = ctx.keys
        self.block_size = ctx.block_size

    # ---- admission -------------------------------------------------------------------
    def admit(self, seq: Sequence) -> int:
        """The longest cached prefix of the prompt (at most len - 1 tokens): full blocks from
        the pool, then the tiers, then a partial block copied."""
        bs = self.block_size
        if not self.ctx.attach or len(seq.tokens) < 2 or recomputes(seq):
            return 0
        reusable = len(seq.tokens) - 1
        self.keys.ensure(seq, reusable)
        keys = seq.block_keys[: reusable // bs]
        ids = list(self.pool.acquire_prefix(keys)[0])
        if self.ctx.tiers.enabled and len(ids) < len(keys):
            ids += self.restore(seq, keys, len(ids))
        seq.block_table = ids
        matched = len(ids) * bs
        rest = min(reusable - matched, bs)
        if rest > 0:
            hit = self.extend_match(seq, len(ids), seq.tokens[matched : matched + rest])
            if hit is not None:
                n = min(hit[1], rest)
                if self.copy_partial(seq, hit[0], n):
                    matched += n
        seq.n_computed = matched
        return matched

    def reattach(self, seq: Sequence) -> int:
        want = self.blocks_ahead(seq)
        if not want:
            return 0
        ids = list(self.pool.acquire_prefix(want)[0])
        if not ids:
            return 0
        seq.block_table.extend(ids)
        seq.n_computed += len(ids) * self.block_size
        return len(ids) * self.block_size

    def blocks_ahead(self, seq: Sequence) -> list[bytes]:
        """Keys of the full prompt blocks past a block-aligned sequence's table that it could
        take from the pool instead of computing ([] when it is mid-block)."""
        bs = self.block_size
        if (not self.ctx.attach or seq.n_computed % bs
                or len(seq.block_table) * bs != seq.n_computed or recomputes(seq)):
            return []
        reusable = len(seq.tokens) - 1
        self.keys.ensure(seq, reusable)
        return seq.block_keys[len(seq.block_table) : reusable // bs]

    # ---- the lead's tools ------------------------------------------------------------
    def peek(self, keys: list[bytes]) -> list[int]:
        """The pool's blocks of the longest prefix of `keys` (nothing acquired)."""
        return list(self.pool.match_prefix(keys)[0])

    def take(self, seq: Sequence, ids: list[int]) -> None:
        """Acquire `ids` (from `peek`) as the next entries of the sequence's table."""
        self.pool.acquire(ids)
        seq.block_table.extend(ids)

    def extend_match(self, seq: Sequence, j: int, tokens: list[int]) -> tuple[int, int] | None:
        """(block, n) of the cached block j whose first n tokens match `tokens` the longest
        (a peek), or None."""
        return self.pool.extend_match(self.keys.parent(seq, j), tokens)

    def restore(self, seq: Sequence, keys: list[bytes], start: int) -> list[int]:
        """Blocks keys[start:] from the tiers; a restore that fails is a miss (logged,
        counted, recomputed), never this request's error."""
        t0 = time.perf_counter()
        root, p, split = self.keys.chain(seq)
        try:
            maybe_inject(seq.request, "restore")
            # block p has its own parent (split) exactly when p > 0 (BlockKeys.chain)
            return self.ctx.tiers.restore(seq.tokens, keys, start, root,
                                          (p, split) if split is not None else None)
        except Exception:  # noqa: BLE001 - the tiers hand back what they installed first
            self.ctx.counters["restore_failed"] += 1
            log.exception("tier restore for %s failed; recomputing", seq.request.request_id)
            return []
        finally:
            seq.restore_s += time.perf_counter() - t0

    def copy_partial(self, seq: Sequence, src: int, n: int) -> bool:
        """Copy-on-write: the first n tokens of a (possibly shared) block into a fresh block
        that ends the sequence's table; `src` is never written. False (nothing changed) when
        no block is free: the caller computes those tokens instead."""
        # the fault hook stands for a pool with no free block
        no_room = injected(seq.request, "cow")
        dst = None if no_room else copy_on_write(self.pool, self.ctx.kv, src, n)
        if dst is None:
            self.ctx.counters["cow_no_room"] += 1
            return False
        seq.block_table.append(dst)
        return True

    def drop_last(self, seq: Sequence) -> None:
        """Give back the last block of the sequence's table (a copy the lead cannot use)."""
        self.pool.release([seq.block_table.pop()])

    # ---- compute -----------------------------------------------------------------------
    def allocate(self, seq: Sequence, end: int) -> list[int] | None:
        n_new = max(0, -(-end // self.block_size) - len(seq.block_table))
        if n_new == 0:
            return []
        self.keys.ensure(seq, end)
        start = len(seq.block_table)
        return allocate_blocks(self.pool, self.keys, seq, range(start, start + n_new))

    def install(self, seq: Sequence, ids: list[int]) -> None:
        seq.block_table.extend(ids)

    def cancel(self, ids: list[int]) -> None:
        if ids:
            self.pool.release(ids)

    def commit(self, seq: Sequence, start: int, end: int) -> None:
        """Record tokens[start:end] in their blocks and register every block that became
        full."""
        record_tokens(self.pool, seq.block_table, seq, start, end, self.keys)

    def release(self, seq: Sequence) -> None:
        """Hand the blocks back (last block first); cached ones stay findable."""
        if seq.block_table:
            self.pool.release(seq.block_table)
        seq.block_table = []

    # ---- tiers -------------------------------------------------------------------------
    def pinned_tokens(self, seq: Sequence) -> int:
        """Tokens pinned in the RAM tier for this prompt: the prefix entry, or the full blocks
        before the client's cache breakpoint when that reaches further."""
        bs = self.block_size
        return max(prefix_entry_tokens(seq, bs),
                   full_blocks_before(seq, seq.request.cache_point, bs))

    def pin(self, seq: Sequence) -> int:
        """Once a prompt's prefix entry is computed (or attached), copy it to the RAM tier and
        pin it there, without waiting for the request to finish: concurrent and later sessions
        with the same tools and system prompt find it even after a flood of other traffic.
        Returns the tokens pinned now (0: nothing, or not yet)."""
        if seq.prefix_pinned:
            return 0
        tiers = self.ctx.tiers
        if tiers.ram is None or not self.ctx.attach or not seq.request.cache_store:
            seq.prefix_pinned = True  # nothing to do for this sequence
            return 0
        n = self.pinned_tokens(seq)
        if seq.n_computed < n:
            return 0
        seq.prefix_pinned = True
        if n:
            self.keys.ensure(seq, n)
            tiers.pin_prefix(seq.block_keys, seq.block_table, n // self.block_size)
        return n

    def save(self, seq: Sequence) -> None:
        """The computed full blocks (prompt + reply, as the next turn presents them) to the RAM
        and disk tiers, the prefix entry pinned in RAM."""
        self.ctx.tiers.save(seq.tokens, seq.block_keys, seq.block_table, seq.n_computed,
                            self.pinned_tokens(seq))

    def stats(self) -> dict:
        return dict(self.pool.stats())

    def shared_blocks(self, seq: Sequence) -> int:
        return sum(1 for b in seq.block_table if self.pool.ref_count(b) > 1)
