"""Recurrent layers (gated delta net, short conv) of hybrid models: one state per sequence, in
a state slot, resumable only where a checkpoint of it was saved (checkpoints.py).

This group leads admission: a sequence resumes at the deepest checkpoint at or before the
longest cached match (device pool, or a RAM/disk/Redis tier), taking the full-attention blocks
up to it (the partial block copied) and copying the checkpoint's state into its own slot. It
also plans where the sequence's prefill pauses to save checkpoints, saves them as the forward
pass reaches those positions, and decides what goes to the tiers: blocks with the checkpoints
that make them resumable.
"""

from __future__ import annotations

import logging
import time

from kvshare import _core
from kvshare.engine.cache.base import CacheContext, LayerGroupManager, prefix_entry_tokens
from kvshare.engine.cache.checkpoints import CheckpointManager
from kvshare.engine.cache.full_attention import FullAttentionManager
from kvshare.engine.sequence import Sequence, recomputes

log = logging.getLogger("kvshare.cache")


class RecurrentStateManager(LayerGroupManager):
    kind = "recurrent"
    stateful = True

    def __init__(self, checkpoints: CheckpointManager, full: FullAttentionManager,
                 ctx: CacheContext):
        self.checkpoints = checkpoints
        self.full = full
        self.ctx = ctx
        self.keys = ctx.keys
        self.block_size = ctx.block_size

    @staticmethod
    def _slot(seq: Sequence) -> int:
        """The sequence's state slot: taken at admission, held until release, so every step
        between them has one."""
        slot = seq.state_slot
        assert slot is not None, f"{seq.key} has no state slot (not admitted)"
        return slot

    # ---- admission -------------------------------------------------------------------
    def admit(self, seq: Sequence) -> int:
        seq.block_keys = []
        seq.state_slot = self.checkpoints.take_slot()
        got = self._resume(seq)
        if (seq.request.n > 1 and seq.choice == 0 and self.ctx.attach
                and seq.n_prompt not in seq.checkpoint_at):
            # the other choices fork from the prompt's end: they resume from this one
            seq.checkpoint_at.append(seq.n_prompt)
        return got

    def _resume(self, seq: Sequence) -> int:
        bs = self.block_size
        ck_mgr = self.checkpoints
        root = self.keys.root_key(seq.request.cache_salt)
        reusable = len(seq.tokens) - 1
        boundary = seq.request.first_user_boundary
        aligned = self.ctx.tiers_on()
        if not self.ctx.attach or reusable < 1 or recomputes(seq):
            seq.checkpoint_at = (ck_mgr.plan(seq.n_prompt, 0, 0, boundary, aligned)
                                 if self.ctx.attach else [])
            return 0
        keys = list(_core.hash_blocks(root, seq.tokens[: reusable - reusable % bs], bs))
        ids, ext, match_len, ck = self._pool_match(root, keys, seq.tokens, reusable)
        resume = ck.position if ck is not None else 0
        if aligned:
            try:
                got = self._resume_from_tiers(seq, root, keys, reusable, resume)
            except Exception:  # noqa: BLE001 - a failed tier lookup or read is a miss
                self.ctx.counters["restore_failed"] += 1
                log.exception("tier checkpoint restore for %s failed; recomputing",
                              seq.request.request_id)
                got = None
            if got:
                seq.checkpoint_at = ck_mgr.plan(seq.n_prompt, got, max(match_len, got), boundary,
                                                True)
                return got
            if got is not None:  # a failed tier restore allocated blocks: match the pool again
                ids, ext, match_len, ck = self._pool_match(root, keys, seq.tokens, reusable)
                resume = ck.position if ck is not None else 0
        seq.checkpoint_at = ck_mgr.plan(seq.n_prompt, resume, match_len, boundary, aligned)
        if resume == 0:
            return 0
        n_full = resume // bs
        self.full.take(seq, ids[:n_full])
        seq.block_keys = list(keys[:n_full])
        if resume % bs and not self.full.copy_partial(
                seq, ids[n_full] if n_full < len(ids) else ext[0], resume % bs):
            self.full.release(seq)  # the state is at `resume`: start over
            seq.block_keys = []
            return 0
        ck_mgr.restore(ck, self._slot(seq))
        seq.held_checkpoints.append(ck)
        seq.n_computed = resume
        return resume

    def _pool_match(self, root, keys, tokens, reusable):
        """(block ids, partial extension, match length, deepest device checkpoint) of the
        longest match in the device pool (a peek: nothing acquired)."""
        bs = self.block_size
        ids = self.full.peek(keys)
        match_len = len(ids) * bs
        ext = None
        rest = min(reusable - match_len, bs)
        if rest > 0:
            ext = self.full.pool.extend_match(keys[len(ids) - 1] if ids else root,
                                              tokens[match_len: match_len + rest])
            if ext is not None:
                match_len += min(ext[1], rest)
        ck = self.checkpoints.deepest(root, list(keys[: len(ids)]), tokens[:match_len], match_len)
        return ids, ext, match_len, ck

    def _resume_from_tiers(self, seq: Sequence, root: bytes, keys, reusable: int, resume: int):
        """Resume at a RAM, disk or Redis checkpoint deeper than `resume`: blocks up to it from
        the pool and the tiers, its state loaded into the sequence's slot. Returns the
        position; None if no tier has a deeper checkpoint (nothing touched); 0 if one was found
        but could not be used (blocks missing, pool full, corrupt or foreign state): whatever
        was acquired is released and the caller falls back to the pool."""
        ck_mgr = self.checkpoints
        found = self.ctx.tiers.find_checkpoint(root, keys, seq.tokens, reusable, resume,
                                               ck_mgr.account)
        if found is None:
            return None
        pos, tier, load = found
        n = pos // self.block_size
        t0 = time.perf_counter()
        ck = load()  # first: a corrupt or foreign checkpoint costs no block reads
        if ck is not None:
            try:
                ck_mgr.restore(ck, self._slot(seq))
            except ValueError as exc:
                log.warning("tier checkpoint unusable, recomputing: %s", exc)
                ck = None
        ids: list[int] = []
        if ck is not None:
            ids = list(self.full.pool.acquire_prefix(keys[:n])[0])
            if len(ids) < n:
                ids += self.full.restore(seq, keys[:n], len(ids))
        seq.restore_s += time.perf_counter() - t0
        if ck is None or len(ids) < n:
            self.full.cancel(ids)
            return 0  # the slot may hold the loaded state: prefill from 0 zeroes it
        self.ctx.tiers.checkpoint_served(tier)
        seq.held_checkpoints.append(ck_mgr.adopt(ck))
        seq.block_table = ids
        seq.block_keys = list(keys[:n])
        seq.n_computed = pos
        return pos

    # ---- compute -----------------------------------------------------------------------
    def allocate(self, seq: Sequence, end: int) -> list[int] | None:
        return []  # the state slot was taken at admission

    def install(self, seq: Sequence, ids: list[int]) -> None:
        """Nothing: this group holds no blocks (`allocate` gives none)."""

    def cancel(self, ids: list[int]) -> None:
        """Nothing: this group holds no blocks (`allocate` gives none)."""

    def commit(self, seq: Sequence, start: int, end: int) -> None:
        """At a planned position: checkpoint the state. Past the prompt, with tiers: keep
        the state at the reply's latest block boundary (`_checkpoint_reply`). A failed
        snapshot costs a future cache hit, never this request."""
        if end in seq.checkpoint_at and end <= seq.n_prompt:
            try:
                self._save_checkpoint(seq)
            except Exception:  # noqa: BLE001
                self.ctx.counters["checkpoint_save_failed"] += 1
                log.exception("checkpoint of %s failed", seq.request.request_id)
        try:
            self._checkpoint_reply(seq)
        except Exception:  # noqa: BLE001
            self.ctx.counters["tier_pin_failed"] += 1
            log.exception("reply checkpoint of %s failed", seq.request.request_id)

    def _save_checkpoint(self, seq: Sequence) -> None:
        """Prefill reached one of the sequence's checkpoint positions: snapshot its state.
        At the prefix entry's position (block aligned, before the first user message) the
        blocks and the checkpoint also go to the RAM tier, pinned."""
        ck = self.checkpoints.save(self.keys.root_key(seq.request.cache_salt), seq.tokens,
                                   seq.n_computed, self._slot(seq))
        seq.held_checkpoints.append(ck)
        n = prefix_entry_tokens(seq, self.block_size)
        tiers = self.ctx.tiers
        if (n and ck.position == n and self.ctx.tiers_on() and tiers.ram is not None
                and seq.request.cache_store):
            self.keys.ensure(seq, n)
            tiers.pin_prefix(seq.block_keys, seq.block_table, n // self.block_size, ck)

    def _checkpoint_reply(self, seq: Sequence) -> None:
        """With tiers: keep the state at the reply's latest block boundary, so the finished
        conversation goes to the tiers resumable at most a block before its end (the tiers
        hold full blocks only), and a returning conversation still in the pool resumes there
        too (its checkpoint joins the store when the sequence ends)."""
        n = seq.n_computed
        if n <= seq.n_prompt or n % self.block_size or not self.ctx.tiers_on():
            return
        # a snapshot on the state's device, overwritten at each boundary; the checkpoint (a
        # host copy: on a GPU a transfer the engine thread waits for) is made once, when the
        # sequence ends (`_tail_checkpoint`), not every block of the reply
        seq.tail_snapshot = self.ctx.kv.snapshot_state(self._slot(seq), seq.tail_snapshot)
        seq.tail_position = n

    def _tail_checkpoint(self, seq: Sequence) -> _core.Checkpoint | None:
        """The checkpoint of the reply's latest block boundary, in the store: made from the
        sequence's snapshot the first time it is asked for."""
        snapshot, seq.tail_snapshot = seq.tail_snapshot, None
        if snapshot is not None:
            seq.tail_checkpoint = self.checkpoints.save_snapshot(
                self.keys.root_key(seq.request.cache_salt), seq.tokens, seq.tail_position,
                snapshot)
        return seq.tail_checkpoint

    def release(self, seq: Sequence) -> None:
        try:  # a returning conversation still in the pool resumes at its tail too
            self._tail_checkpoint(seq)
        except Exception:  # noqa: BLE001
            self.ctx.counters["tier_pin_failed"] += 1
            log.exception("reply checkpoint of %s failed", seq.request.request_id)
        self.checkpoints.give_slot(seq.state_slot)
        seq.state_slot = None
        seq.held_checkpoints.clear()
        seq.tail_snapshot = seq.tail_checkpoint = None

    # ---- tiers -------------------------------------------------------------------------
    def pin(self, seq: Sequence) -> int:
        seq.prefix_pinned = True  # the prefix entry is pinned with its checkpoint (commit)
        return 0

    def save(self, seq: Sequence) -> None:
        """Blocks with the checkpoints that make them resumable (a hybrid resumes only at a
        checkpoint)."""
        cks = [*seq.held_checkpoints, self._tail_checkpoint(seq)]
        self.ctx.tiers.save_hybrid(seq.block_keys, seq.block_table, cks,
                                   prefix_entry_tokens(seq, self.block_size))

    def stats(self) -> dict:
        return self.checkpoints.snapshot()
