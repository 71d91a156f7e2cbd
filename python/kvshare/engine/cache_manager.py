"""The engine's view of the KV cache: the Rust block pool (bookkeeping) plus the model's paged
KV arrays (payload). Attach, block allocation, recording computed tokens, and release.

Rules that keep sharing safe:
- A block is found by its chain key, which covers every token before it and the request's
  cache salt, so a match is always state computed from exactly this prompt's tokens.
- A shared block is never written: a match that ends inside a block copies the matching
  tokens into a fresh block first (copy-on-write).
- At least one prompt token is always computed, so the last position's logits exist.
- Tokens are recorded in the pool only after the forward pass wrote their KV, and a full block
  is registered (made findable) only then.
- A request's public prefix (`public_prefix_tokens`, operator-marked) is keyed without its
  salt, so every tenant shares it; the first block after it chains from a key that mixes in
  the salt, so nothing private is ever found across tenants (see `chain`).

Faults stay with their sequence: running out of blocks is reported by return value (the
scheduler waits or preempts), a tier restore that fails is a miss (recompute), a failed
copy-on-write recomputes the few tokens it would have copied.
"""

from __future__ import annotations

import logging
import time
from collections import Counter

import numpy as np

from kvshare import _core
from kvshare.engine.faults import injected, maybe_inject
from kvshare.engine.sequence import Sequence

log = logging.getLogger("kvshare.cache")


class CacheManager:
    def __init__(self, pool: "_core.BlockPool", kv_cache, block_size: int, fingerprint: bytes,
                 kv_dtype: str, attach: bool, tiers=None, checkpoints=None, windows=None,
                 min_gain: int = 64):
        self.pool = pool
        self.kv = kv_cache
        self.block_size = block_size
        self.fingerprint = fingerprint
        self.kv_dtype = kv_dtype
        self.attach_enabled = attach
        self.tiers = tiers  # engine.tiers.TierManager or None: RAM and disk behind the pool
        # engine.checkpoints.CheckpointManager for hybrid models (None: attention only)
        self.checkpoints = checkpoints
        # engine.windows.WindowGroup when sliding-window layers keep only their windows: such
        # a sequence resumes only where a kept window ends (as a hybrid at a checkpoint)
        self.windows = windows
        self.min_gain = min_gain
        self._roots: dict[bytes | None, bytes] = {}
        self.counters: Counter[str] = Counter()  # recovered faults: restore_failed, cow_no_room

    def root_key(self, salt: bytes | None) -> bytes:
        root = self._roots.get(salt)
        if root is None:
            root = _core.root_key(self.fingerprint, self.kv_dtype, self.block_size, salt)
            self._roots[salt] = root
        return root

    def chain(self, seq: Sequence) -> tuple[bytes, int, bytes | None]:
        """How the sequence's chain of block keys starts: (the root block 0 chains from, the
        index p of its first private block, the parent key of block p). Without a public
        prefix (or a salt) p is 0 and everything chains from the salted root. With one, the
        p full public blocks chain from the unsalted root and block p from a key derived from
        block p-1's key and the salt. Hybrids keep one root: their checkpoints are keyed from
        it (public prefixes are not shared across tenants for them)."""
        if seq.chain is None:
            bs = self.block_size
            salt = seq.request.cache_salt
            p = 0
            if salt is not None and self.checkpoints is None:
                p = min(max(0, int(seq.request.public_prefix_tokens)), seq.n_prompt) // bs
            if p == 0:
                seq.chain = (self.root_key(salt), 0, None)
            else:
                public = self.root_key(None)
                last = _core.hash_blocks(public, seq.tokens[: p * bs], bs)[-1]
                seq.chain = (public, p, _core.root_key(last, self.kv_dtype, bs, salt))
        return seq.chain

    def parent_key(self, seq: Sequence, j: int) -> bytes:
        """The key block j of the sequence chains from (its keys up to j-1 computed)."""
        root, p, split = self.chain(seq)
        if j == 0:
            return root
        if j == p:
            return split
        return seq.block_keys[j - 1]

    # ---- admission -------------------------------------------------------------------
    def attach(self, seq: Sequence) -> int:
        """Point a new sequence's block table at the longest cached prefix of its tokens
        (at most len - 1 of them). Returns the number of tokens reused."""
        bs = self.block_size
        seq.block_table = []
        seq.n_computed = 0
        if seq.prefill_started is None:  # prompt time includes the restore below
            seq.prefill_started = time.perf_counter()
        if self.checkpoints is not None:
            seq.block_keys = []
            got = self._attach_hybrid(seq, self.root_key(seq.request.cache_salt))
            if (seq.request.n > 1 and seq.choice == 0 and self.attach_enabled
                    and seq.n_prompt not in seq.checkpoint_at):
                # the other choices fork from the prompt's end: they resume from this one
                seq.checkpoint_at.append(seq.n_prompt)
            return got
        if self.windows is not None:
            return self._attach_windowed(seq)
        if not self.attach_enabled or len(seq.tokens) < 2 or self._recompute(seq):
            return 0
        reusable = len(seq.tokens) - 1
        self.ensure_keys(seq, reusable)
        keys = seq.block_keys[: reusable // bs]
        ids = list(self.pool.acquire_prefix(keys)[0])
        if self.tiers is not None and self.tiers.enabled and len(ids) < len(keys):
            ids += self._restore(seq, keys, len(ids))
        seq.block_table = ids
        matched = len(ids) * bs
        rest = min(reusable - matched, bs)
        if rest > 0:
            hit = self.pool.extend_match(self.parent_key(seq, len(ids)),
                                         seq.tokens[matched : matched + rest])
            if hit is not None:
                n = min(hit[1], rest)
                if self._copy_partial(seq, hit[0], n):
                    matched += n
        seq.n_computed = matched
        return matched

    def _attach_windowed(self, seq: Sequence) -> int:
        """Sliding-window groups: resume at the deepest block-aligned position p within the
        main pool's match whose window the window pool still has (engine/windows.py)."""
        bs = self.block_size
        seq.win_table = []  # (attach has reset the rest)
        reusable = len(seq.tokens) - 1
        if not self.attach_enabled or reusable < 1 or self._recompute(seq):
            return 0
        self.ensure_keys(seq, reusable)
        keys = seq.block_keys[: reusable // bs]
        ids = list(self.pool.match_prefix(keys)[0])
        if self._tiers_on() and len(ids) < len(keys):
            try:
                got = self._resume_windowed_from_tiers(seq, keys, ids)
            except Exception:  # noqa: BLE001 - a failed tier lookup or read is a miss
                self.counters["restore_failed"] += 1
                log.exception("tier window restore for %s failed; recomputing",
                              seq.request.request_id)
                self.release(seq)
                seq.n_computed = 0
                got = 0
            if got:
                return got
        got = self._resume_windowed(seq, keys, ids, 0)
        if got == len(ids) * bs and got < reusable:
            got += self._extend_windowed(seq, min(reusable - got, bs))
        return got

    def _resume_windowed_from_tiers(self, seq: Sequence, keys: list[bytes],
                                    ids: list[int]) -> int:
        """Resume deeper than the pool alone allows: at the deepest block-aligned p past the
        pool's match where the main blocks before p and the window blocks ending at p are each
        in the pool or a tier. Returns p (0: none, nothing held)."""
        bs, win, tiers = self.block_size, self.windows, self.tiers
        m = len(ids) + tiers.available_prefix(keys[len(ids):])
        t0 = time.perf_counter()
        try:
            for p in range(m * bs, len(ids) * bs, -bs):
                r = win.window_blocks(p)
                have = [win.pool.lookup(keys[j]) for j in r]
                if any(h is None and not tiers.has_window_block(keys[j])
                       for j, h in zip(reversed(r), reversed(have))):
                    continue
                n_main = p // bs
                self.pool.acquire(ids)
                seq.block_table = list(ids)
                if n_main > len(ids):
                    seq.block_table += self._restore(seq, keys[:n_main], len(ids))
                wids = self._restore_window(seq, keys, r, have) if len(seq.block_table) == n_main else None
                if wids is None:
                    self.pool.release(seq.block_table)
                    seq.block_table = []
                    return 0
                seq.win_table = [win.null] * r.start + wids
                seq.n_computed = p
                return p
            return 0
        finally:
            seq.restore_s += time.perf_counter() - t0

    def _restore_window(self, seq: Sequence, keys: list[bytes], r: range,
                        have: list) -> list[int] | None:
        """Window blocks `r`: the pool's (acquired) or read from a tier into fresh blocks
        registered under their chain keys. None (nothing held) if one cannot be had."""
        win, bs = self.windows, self.block_size
        got: list[int] = []
        try:
            for j, h in zip(r, have):
                if h is not None:
                    win.pool.acquire([h])
                    got.append(h)
                    continue
                data = np.empty(self.kv.win_block_shape, dtype=self.kv.kv_dtype)
                if not self.tiers.read_window_block(keys[j], data):
                    raise LookupError("window block missing")
                block = win.pool.allocate(self.parent_key(seq, j))
                got.append(block)
                self.kv.write_block(block, data, group=1)
                win.pool.append_tokens(block, seq.tokens[j * bs:(j + 1) * bs])
                other = win.pool.register(block, keys[j])
                if other != block:  # registered meanwhile: share that one
                    win.pool.acquire([other])
                    win.pool.release([block])
                    got[-1] = other
        except (LookupError, _core.OutOfBlocks):
            win.release_ids(got)
            return None
        return got

    def _extend_windowed(self, seq: Sequence, rest: int) -> int:
        """Past a block-aligned resume point: the longest partial match of the next block in
        both pools (the main pool's and the window pool's copies of it), copied-on-write into
        fresh blocks of each. Returns the tokens gained (0: none, nothing changed)."""
        p = seq.n_computed
        j = p // self.block_size
        parent = self.parent_key(seq, j)
        nxt = seq.tokens[p: p + rest]
        hit = self.pool.extend_match(parent, nxt)
        whit = self.windows.pool.extend_match(parent, nxt)
        n = min(hit[1], whit[1], rest) if hit is not None and whit is not None else 0
        if n <= 0:
            return 0
        if not self._copy_partial(seq, hit[0], n):
            return 0
        wdst = self.windows.copy_partial(seq, whit[0], n, self.kv)
        if wdst is None:  # no room in the window pool: take the main pool's copy back
            self.pool.release([seq.block_table.pop()])
            return 0
        seq.n_computed = p + n
        return n

    def _resume_windowed(self, seq: Sequence, keys: list[bytes], ids: list[int],
                         start: int) -> int:
        """Move the sequence (holding blocks [0, start) of the main pool) to the deepest
        block-aligned p in (start, start + len(ids) blocks] whose window is in the window
        pool: `ids` are the main pool's blocks from `start` on (a peek). Returns the tokens
        gained."""
        bs, win = self.block_size, self.windows
        j0 = start // bs
        for p in range((j0 + len(ids)) * bs, start, -bs):
            wids = win.match_at(keys, p)
            if wids is None:
                continue
            take = ids[: p // bs - j0]
            self.pool.acquire(take)
            seq.block_table.extend(take)
            win.attach(seq, wids, p)
            seq.n_computed = p
            return p - start
        return 0

    def _restore(self, seq: Sequence, keys: list[bytes], start: int) -> list[int]:
        """Blocks keys[start:] from the tiers; a restore that fails is a miss (logged,
        counted, recomputed), never this request's error."""
        t0 = time.perf_counter()
        root, p, split = self.chain(seq)
        try:
            maybe_inject(seq.request, "restore")
            return self.tiers.restore(seq.tokens, keys, start, root, (p, split) if p else None)
        except Exception:  # noqa: BLE001 - the tiers hand back what they installed first
            self.counters["restore_failed"] += 1
            log.exception("tier restore for %s failed; recomputing", seq.request.request_id)
            return []
        finally:
            seq.restore_s += time.perf_counter() - t0

    def _attach_hybrid(self, seq: Sequence, root: bytes) -> int:
        """Hybrid models resume only where a checkpoint of the recurrent state exists: at the
        deepest checkpoint at or before the longest cached match (device pool, or a RAM/disk
        tier: see `_resume_from_tiers`). Attention blocks are shared up to it (the partial
        block copied), the state is copied into the sequence's slot. Also plans where this
        sequence's prefill will pause to save checkpoints."""
        bs = self.block_size
        ck_mgr = self.checkpoints
        seq.state_slot = ck_mgr.take_slot()
        reusable = len(seq.tokens) - 1
        boundary = seq.request.first_user_boundary
        aligned = self._tiers_on()
        if not self.attach_enabled or reusable < 1 or self._recompute(seq):
            seq.checkpoint_at = (ck_mgr.plan(seq.n_prompt, 0, 0, boundary, aligned)
                                 if self.attach_enabled else [])
            return 0
        keys = list(_core.hash_blocks(root, seq.tokens[: reusable - reusable % bs], bs))
        ids, ext, match_len, ck = self._pool_match(root, keys, seq.tokens, reusable)
        resume = ck.position if ck is not None else 0
        if aligned:
            try:
                got = self._resume_from_tiers(seq, root, keys, reusable, resume)
            except Exception:  # noqa: BLE001 - a failed tier lookup or read is a miss
                self.counters["restore_failed"] += 1
                log.exception("tier checkpoint restore for %s failed; recomputing",
                              seq.request.request_id)
                got = None
            if got:
                seq.checkpoint_at = ck_mgr.plan(seq.n_prompt, got, max(match_len, got), boundary, True)
                return got
            if got is not None:  # a failed tier restore allocated blocks: match the pool again
                ids, ext, match_len, ck = self._pool_match(root, keys, seq.tokens, reusable)
                resume = ck.position if ck is not None else 0
        seq.checkpoint_at = ck_mgr.plan(seq.n_prompt, resume, match_len, boundary, aligned)
        if resume == 0:
            return 0
        n_full = resume // bs
        shared = ids[:n_full]
        self.pool.acquire(shared)
        seq.block_table = list(shared)
        seq.block_keys = list(keys[:n_full])
        if resume % bs and not self._copy_partial(
                seq, ids[n_full] if n_full < len(ids) else ext[0], resume % bs):
            self.pool.release(seq.block_table)  # the state is at `resume`: start over
            seq.block_table, seq.block_keys = [], []
            return 0
        ck_mgr.restore(ck, seq.state_slot)
        seq.held_checkpoints.append(ck)
        seq.n_computed = resume
        return resume

    def _pool_match(self, root, keys, tokens, reusable):
        """(block ids, partial extension, match length, deepest device checkpoint) of the
        longest match in the device pool (a peek: nothing acquired)."""
        bs = self.block_size
        ids = list(self.pool.match_prefix(keys)[0])
        match_len = len(ids) * bs
        ext = None
        rest = min(reusable - match_len, bs)
        if rest > 0:
            ext = self.pool.extend_match(keys[len(ids) - 1] if ids else root,
                                         tokens[match_len: match_len + rest])
            if ext is not None:
                match_len += min(ext[1], rest)
        ck = self.checkpoints.deepest(root, list(keys[: len(ids)]), tokens[:match_len], match_len)
        return ids, ext, match_len, ck

    def _resume_from_tiers(self, seq: Sequence, root: bytes, keys, reusable: int, resume: int):
        """Resume a hybrid sequence at a RAM or disk checkpoint deeper than `resume`: blocks
        up to it from the pool and the tiers, its state loaded into the sequence's slot.
        Returns the position; None if no tier has a deeper checkpoint (nothing touched); 0 if
        one was found but could not be used (blocks missing, pool full, corrupt or foreign
        state): whatever was acquired is released and the caller falls back to the pool."""
        ck_mgr = self.checkpoints
        found = self.tiers.find_checkpoint(root, keys, seq.tokens, reusable, resume, ck_mgr.account)
        if found is None:
            return None
        pos, tier, load = found
        n = pos // self.block_size
        t0 = time.perf_counter()
        ck = load()  # first: a corrupt or foreign checkpoint costs no block reads
        if ck is not None:
            try:
                ck_mgr.restore(ck, seq.state_slot)
            except ValueError as exc:
                log.warning("tier checkpoint unusable, recomputing: %s", exc)
                ck = None
        ids: list[int] = []
        if ck is not None:
            ids = list(self.pool.acquire_prefix(keys[:n])[0])
            if len(ids) < n:
                ids += self._restore(seq, keys[:n], len(ids))
        seq.restore_s += time.perf_counter() - t0
        if ck is None or len(ids) < n:
            if ids:
                self.pool.release(ids)
            return 0  # the slot may hold the loaded state: prefill from 0 zeroes it
        self.tiers.checkpoint_served(tier)
        seq.held_checkpoints.append(ck_mgr.adopt(ck))
        seq.block_table = ids
        seq.block_keys = list(keys[:n])
        seq.n_computed = pos
        return pos

    def _tiers_on(self) -> bool:
        return self.tiers is not None and self.tiers.enabled and self.attach_enabled

    def _copy_partial(self, seq: Sequence, src: int, n: int) -> bool:
        """Copy-on-write: the first n tokens of a (possibly shared) block into a fresh block
        that ends the sequence's table; `src` is never written. False (nothing changed) when
        no block is free: the caller computes those tokens instead."""
        try:
            if injected(seq.request, "cow"):
                raise _core.OutOfBlocks("injected: no block for the copy-on-write")
            dst = self.pool.cow(src, n)
        except _core.OutOfBlocks:
            self.counters["cow_no_room"] += 1
            return False
        try:
            self.kv.copy_block(src, dst, n)
        except BaseException:
            self.pool.release([dst])
            raise
        seq.block_table.append(dst)
        return True

    def save_checkpoint(self, seq: Sequence) -> None:
        """Prefill reached one of the sequence's checkpoint positions: snapshot its state.
        At the prefix entry's position (block aligned, before the first user message) the
        blocks and the checkpoint also go to the RAM tier, pinned."""
        ck = self.checkpoints.save(self.root_key(seq.request.cache_salt), seq.tokens,
                                   seq.n_computed, seq.state_slot)
        seq.held_checkpoints.append(ck)
        n = self._prefix_tokens(seq)
        if (n and ck.position == n and self._tiers_on() and self.tiers.ram is not None
                and seq.request.cache_store):
            self.ensure_keys(seq, n)
            self.tiers.pin_prefix(seq.block_keys, seq.block_table, n // self.block_size)
            self.tiers.pin_checkpoint(seq.block_keys, ck)

    def checkpoint_reply(self, seq: Sequence) -> None:
        """Hybrids with tiers: keep a checkpoint at the reply's latest block boundary (the
        previous one is dropped from the store), so the finished conversation goes to the
        tiers resumable at most a block before its end (the tiers hold full blocks only), and
        a returning conversation still in the pool resumes there too."""
        n = seq.n_computed
        if (self.checkpoints is None or n <= seq.n_prompt or n % self.block_size
                or not self._tiers_on()):
            return
        old = seq.tail_checkpoint
        seq.tail_checkpoint = self.checkpoints.save(self.root_key(seq.request.cache_salt),
                                                    seq.tokens, n, seq.state_slot)
        if old is not None and old.key != seq.tail_checkpoint.key:
            self.checkpoints.discard(old.key)

    @staticmethod
    def _recompute(seq: Sequence) -> bool:
        """The request asked to compute its prompt afresh (llama-server `cache_prompt: false`);
        its other choices (n > 1) still fork from the first one's prompt."""
        return not seq.request.reuse_cache and seq.choice == 0

    def reattach(self, seq: Sequence) -> int:
        """Mid-prefill: if blocks for the next positions appeared since admission (a donor
        finished computing them), take them instead of recomputing. Returns tokens gained."""
        bs = self.block_size
        if (not self.attach_enabled or self.checkpoints is not None
                or seq.n_computed % bs or len(seq.block_table) * bs != seq.n_computed
                or self._recompute(seq)):
            return 0
        reusable = len(seq.tokens) - 1
        self.ensure_keys(seq, reusable)
        start = len(seq.block_table)
        want = seq.block_keys[start : reusable // bs]
        if not want:
            return 0
        if self.windows is not None:
            return self._resume_windowed(seq, seq.block_keys, list(self.pool.match_prefix(want)[0]),
                                         seq.n_computed)
        ids = list(self.pool.acquire_prefix(want)[0])
        if not ids:
            return 0
        seq.block_table.extend(ids)
        seq.n_computed += len(ids) * bs
        return len(ids) * bs

    def next_key(self, seq: Sequence) -> bytes | None:
        """Key of the block the sequence would compute next, if it starts a block."""
        bs = self.block_size
        if (not self.attach_enabled or self.checkpoints is not None
                or seq.n_computed % bs or self._recompute(seq)):
            return None
        j = seq.n_computed // bs
        self.ensure_keys(seq, len(seq.tokens) - 1)
        return seq.block_keys[j] if j < len(seq.block_keys) else None

    def uncomputed_keys(self, seq: Sequence) -> list[bytes]:
        """Keys of full prompt blocks this sequence has yet to compute."""
        if not self.attach_enabled:
            return []
        self.ensure_keys(seq, len(seq.tokens) - 1)
        return seq.block_keys[seq.n_computed // self.block_size:]

    # ---- compute -----------------------------------------------------------------------
    def ensure_keys(self, seq: Sequence, upto: int) -> None:
        """Compute chain keys of every full block within tokens[:upto]."""
        bs = self.block_size
        have = len(seq.block_keys)
        need = upto // bs
        _, p, _ = self.chain(seq)
        while have < need:  # in two runs when the public prefix ends inside [have, need)
            end = p if have < p < need else need
            parent = self.parent_key(seq, have)
            seq.block_keys.extend(_core.hash_blocks(parent, seq.tokens[have * bs : end * bs], bs))
            have = end

    def blocks_needed(self, seq: Sequence, end: int) -> int:
        return max(0, -(-end // self.block_size) - len(seq.block_table))

    def allocate_for(self, seq: Sequence, end: int) -> bool:
        """Give the sequence blocks covering positions [0, end). False (having allocated
        nothing) if the pool cannot supply them all: the scheduler waits or preempts."""
        n_new = self.blocks_needed(seq, end)
        win = self.windows
        if n_new == 0 and (win is None or len(seq.win_table) * self.block_size >= end):
            return True
        self.ensure_keys(seq, end)
        got: list[int] = []
        try:
            for j in range(len(seq.block_table), len(seq.block_table) + n_new):
                got.append(self.pool.allocate(self.parent_key(seq, j)))
        except _core.OutOfBlocks:
            if got:
                self.pool.release(got)
            return False
        if win is not None:
            wgot = win.allocate(seq, end, lambda j: self.parent_key(seq, j))
            if wgot is None:
                if got:
                    self.pool.release(got)
                return False
            seq.win_table.extend(wgot)
        seq.block_table.extend(got)
        return True

    def record(self, seq: Sequence, start: int, end: int) -> None:
        """After the forward pass wrote KV for tokens[start:end]: record them in their blocks
        and register every block that became full."""
        bs = self.block_size
        pos = start
        while pos < end:
            j = pos // bs
            stop = min(end, (j + 1) * bs)
            block = seq.block_table[j]
            self.pool.append_tokens(block, seq.tokens[pos:stop])
            if stop == (j + 1) * bs:
                self.ensure_keys(seq, stop)
                self.pool.register(block, seq.block_keys[j])
            pos = stop
        if self.windows is not None:
            self.windows.record(seq, start, end, seq.block_keys)
        seq.n_computed = end

    def _prefix_tokens(self, seq: Sequence) -> int:
        """Tokens of the prompt's prefix entry: the full blocks before its first user message
        (0 when the request has no boundary or it is inside the first block)."""
        return self._full_blocks_before(seq, seq.request.first_user_boundary)

    def _pinned_tokens(self, seq: Sequence) -> int:
        """Tokens pinned in the RAM tier for this prompt: the prefix entry, or the full blocks
        before the client's cache breakpoint when that reaches further (attention models; a
        hybrid resumes only at checkpoints, which sit at the first-user boundary)."""
        n = self._prefix_tokens(seq)
        if self.checkpoints is None:
            n = max(n, self._full_blocks_before(seq, seq.request.cache_point))
        return n

    def _full_blocks_before(self, seq: Sequence, b: int | None) -> int:
        if not isinstance(b, int) or b <= 0 or b > seq.n_prompt:
            return 0
        return b - b % self.block_size

    def pin_prefix(self, seq: Sequence) -> None:
        """Once a prompt's prefix entry is computed (or attached), copy it to the RAM tier and
        pin it there, without waiting for the request to finish: concurrent and later sessions
        with the same tools and system prompt find it even after a flood of other traffic."""
        if seq.prefix_pinned:
            return
        tiers = self.tiers
        if (tiers is None or tiers.ram is None or not self.attach_enabled
                or self.checkpoints is not None or not seq.request.cache_store):
            seq.prefix_pinned = True  # nothing to do for this sequence
            return
        n = self._pinned_tokens(seq)
        if seq.n_computed < n:
            return
        seq.prefix_pinned = True
        if n:
            self.ensure_keys(seq, n)
            tiers.pin_prefix(seq.block_keys, seq.block_table, n // self.block_size)
            if self.windows is not None:
                self._save_window(seq, n, pin=True)

    def save_to_tiers(self, seq: Sequence) -> None:
        """Copy a finishing sequence's computed full blocks out to the RAM and disk tiers (its
        prefix entry pinned in RAM)."""
        if not self._tiers_on() or not seq.request.cache_store:
            return
        maybe_inject(seq.request, "save")
        self.ensure_keys(seq, seq.n_computed)
        if self.checkpoints is not None:  # hybrids resume only at a checkpoint
            cks = [*seq.held_checkpoints, seq.tail_checkpoint]
            self.tiers.save_hybrid(seq.block_keys, seq.block_table, cks, self._prefix_tokens(seq))
            return
        self.tiers.save(seq.tokens, seq.block_keys, seq.block_table, seq.n_computed,
                        self._pinned_tokens(seq))
        if self.windows is not None:
            # the windows the next session resumes at: where the prefix entry ends (pinned
            # with it in RAM, see pin_prefix) and where the conversation ends (its next turn)
            n = self._pinned_tokens(seq)
            if n:
                self._save_window(seq, n, pin=self.tiers.ram is not None)
            self._save_window(seq, seq.n_computed)

    def _save_window(self, seq: Sequence, p: int, pin: bool = False) -> None:
        """The window blocks ending at block-aligned p (of `p`) to the tiers, when the window
        pool still has them all (held by the sequence, or cached)."""
        bs, win = self.block_size, self.windows
        p -= p % bs
        if p < bs:
            return
        r = win.window_blocks(p)
        table = seq.win_table
        ids = []
        for j in r:
            b = table[j] if j < len(table) and table[j] != win.null else None
            if b is None:
                b = win.pool.lookup(seq.block_keys[j])
            if b is None:
                return
            ids.append(b)
        host = self.kv.read_blocks(ids, group=1)
        self.tiers.save_window([seq.block_keys[j] for j in r], host, pin)

    def release(self, seq: Sequence) -> None:
        """Hand the sequence's blocks back (last block first); cached ones stay findable.
        A hybrid sequence also gives back its state slot and its checkpoint references."""
        if self.windows is not None and seq.win_table:
            self.windows.release(seq)
        if seq.block_table:
            self.pool.release(seq.block_table)
        seq.block_table = []
        if self.checkpoints is not None:
            self.checkpoints.give_slot(seq.state_slot)
            seq.state_slot = None
            seq.held_checkpoints.clear()
            seq.tail_checkpoint = None

    def shared_blocks(self, seq: Sequence) -> int:
        return sum(1 for b in seq.block_table if self.pool.ref_count(b) > 1)
