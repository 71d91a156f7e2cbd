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
"""

from __future__ import annotations

from kvshare import _core
from kvshare.engine.sequence import Sequence


class CacheManager:
    def __init__(self, pool: "_core.BlockPool", kv_cache, block_size: int, fingerprint: bytes,
                 kv_dtype: str, attach: bool, tiers=None):
        self.pool = pool
        self.kv = kv_cache
        self.block_size = block_size
        self.fingerprint = fingerprint
        self.kv_dtype = kv_dtype
        self.attach_enabled = attach
        self.tiers = tiers  # engine.tiers.TierManager or None: RAM and disk behind the pool
        self._roots: dict[bytes | None, bytes] = {}

    def root_key(self, salt: bytes | None) -> bytes:
        root = self._roots.get(salt)
        if root is None:
            root = _core.root_key(self.fingerprint, self.kv_dtype, self.block_size, salt)
            self._roots[salt] = root
        return root

    # ---- admission -------------------------------------------------------------------
    def attach(self, seq: Sequence) -> int:
        """Point a new sequence's block table at the longest cached prefix of its tokens
        (at most len - 1 of them). Returns the number of tokens reused."""
        bs = self.block_size
        root = self.root_key(seq.request.cache_salt)
        seq.block_table = []
        seq.block_keys = []
        seq.n_computed = 0
        if not self.attach_enabled or len(seq.tokens) < 2:
            return 0
        reusable = len(seq.tokens) - 1
        keys = _core.hash_blocks(root, seq.tokens[: reusable - reusable % bs], bs)
        ids, matched = self.pool.match_prefix(keys)
        ids = list(ids)
        if ids:
            self.pool.acquire(ids)
        if self.tiers is not None and self.tiers.enabled and len(ids) < len(keys):
            ids += self.tiers.restore(seq.tokens, keys, len(ids), root)
        seq.block_table = ids
        seq.block_keys = list(keys[: len(ids)])
        matched = len(ids) * bs
        rest = min(reusable - matched, bs)
        if rest > 0:
            parent = seq.block_keys[-1] if seq.block_keys else root
            hit = self.pool.extend_match(parent, seq.tokens[matched : matched + rest])
            if hit is not None:
                src, n = hit
                n = min(n, rest)
                dst = self.pool.cow(src, n)
                self.kv.copy_block(src, dst, n)
                seq.block_table.append(dst)
                matched += n
        seq.n_computed = matched
        return matched

    def reattach(self, seq: Sequence) -> int:
        """Mid-prefill: if blocks for the next positions appeared since admission (a donor
        finished computing them), take them instead of recomputing. Returns tokens gained."""
        bs = self.block_size
        if not self.attach_enabled or seq.n_computed % bs or len(seq.block_table) * bs != seq.n_computed:
            return 0
        reusable = len(seq.tokens) - 1
        self.ensure_keys(seq, reusable)
        start = len(seq.block_table)
        want = seq.block_keys[start : reusable // bs]
        if not want:
            return 0
        ids, _ = self.pool.match_prefix(want)
        ids = list(ids)
        if not ids:
            return 0
        self.pool.acquire(ids)
        seq.block_table.extend(ids)
        seq.n_computed += len(ids) * bs
        return len(ids) * bs

    def next_key(self, seq: Sequence) -> bytes | None:
        """Key of the block the sequence would compute next, if it starts a block."""
        bs = self.block_size
        if not self.attach_enabled or seq.n_computed % bs:
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
        if need <= have:
            return
        parent = seq.block_keys[-1] if have else self.root_key(seq.request.cache_salt)
        seq.block_keys.extend(_core.hash_blocks(parent, seq.tokens[have * bs : need * bs], bs))

    def blocks_needed(self, seq: Sequence, end: int) -> int:
        return max(0, -(-end // self.block_size) - len(seq.block_table))

    def allocate_for(self, seq: Sequence, end: int) -> None:
        """Give the sequence blocks covering positions [0, end). Raises OutOfBlocks (having
        allocated nothing) if the pool cannot supply them all."""
        bs = self.block_size
        n_new = self.blocks_needed(seq, end)
        if n_new == 0:
            return
        self.ensure_keys(seq, end)
        root = self.root_key(seq.request.cache_salt)
        got: list[int] = []
        try:
            for j in range(len(seq.block_table), len(seq.block_table) + n_new):
                parent = seq.block_keys[j - 1] if j > 0 else root
                got.append(self.pool.allocate(parent))
        except _core.OutOfBlocks:
            if got:
                self.pool.release(got)
            raise
        seq.block_table.extend(got)
        del bs

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
        seq.n_computed = end

    def save_to_tiers(self, seq: Sequence) -> None:
        """Copy a finishing sequence's computed full blocks out to the RAM and disk tiers."""
        if self.tiers is None or not self.tiers.enabled or not self.attach_enabled:
            return
        self.ensure_keys(seq, seq.n_computed)
        self.tiers.save(seq.tokens, seq.block_keys, seq.block_table, seq.n_computed)

    def release(self, seq: Sequence) -> None:
        """Hand the sequence's blocks back (last block first); cached ones stay findable."""
        if seq.block_table:
            self.pool.release(seq.block_table)
        seq.block_table = []

    def shared_blocks(self, seq: Sequence) -> int:
        return sum(1 for b in seq.block_table if self.pool.ref_count(b) > 1)
