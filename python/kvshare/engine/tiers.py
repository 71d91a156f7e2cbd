"""Prefixes that outlive sessions: the RAM tier and the disk tier behind the device block pool.

Lookups fall through device pool -> RAM -> disk, always by chain key, so a restored block is
exactly the KV of this prompt's tokens (and salt, and model). When a sequence finishes, its
full blocks (prompt + reply, as the client's next turn will present them) are copied to the
RAM tier (same content stored once) and queued for the disk writer; the writer skips blocks
already on disk, so a returning conversation only adds its new turn.

Restored blocks are registered in the pool like computed ones, so concurrent sessions attach
to them zero-copy; a conversation whose blocks are still in the pool costs no tier reads.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from kvshare import _core

log = logging.getLogger("kvshare.tiers")


@dataclass
class TierCounters:
    restores: int = 0  # admissions that took at least one block from this tier
    blocks_served: int = 0
    tokens_served: int = 0
    errors: int = 0  # corrupt entries met (the entry is removed; we recompute)


class TierManager:
    def __init__(self, pool, kv, block_size: int, ram: "_core.RamTier | None",
                 disk: "_core.DiskStore | None"):
        self.pool = pool
        self.kv = kv
        self.block_size = block_size
        self.ram = ram
        self.disk = disk
        self.ram_counters = TierCounters()
        self.disk_counters = TierCounters()
        self._staging: np.ndarray | None = None

    @property
    def enabled(self) -> bool:
        return self.ram is not None or self.disk is not None

    # ---- restore -----------------------------------------------------------------------
    def restore(self, tokens: list[int], keys: list[bytes], start: int, parent: bytes) -> list[int]:
        """Bring blocks `keys[start:]` (as many leading ones as a tier holds) into the pool.
        Returns the new pool block ids (each holding one reference for the caller)."""
        got: list[int] = []
        if self.ram is not None and start < len(keys):
            n = self.ram.match_prefix(keys[start:])
            ids = self._restore_from(self._read_ram, tokens, keys, start, n, parent)
            self._count(self.ram_counters, len(ids))
            got += ids
        pos = start + len(got)
        if self.disk is not None and pos < len(keys):
            n, _, _ = self.disk.lookup(keys[pos:])
            if n:
                prev = keys[pos - 1] if pos > 0 else parent
                try:
                    reader = self._read_disk(keys[pos:pos + n])
                except _core.CorruptEntry as exc:  # the store removed the entry: recompute
                    log.warning("disk entry corrupt, recomputing: %s", exc)
                    self.disk_counters.errors += 1
                    return got
                ids = self._restore_from(reader, tokens, keys, pos, n, prev)
                self._count(self.disk_counters, len(ids))
                got += ids
        return got

    def _count(self, c: TierCounters, n_blocks: int) -> None:
        if n_blocks:
            c.restores += 1
            c.blocks_served += n_blocks
            c.tokens_served += n_blocks * self.block_size

    def _restore_from(self, read, tokens, keys, start, n, parent) -> list[int]:
        bs = self.block_size
        ids: list[int] = []
        shape = self.kv.block_shape
        buf = np.empty(shape, dtype=self.kv.kv_dtype)
        for j in range(start, start + n):
            try:
                block = self.pool.allocate(keys[j - 1] if j > 0 else parent)
            except _core.OutOfBlocks:
                break
            if not read(j - start, keys[j], buf):
                self.pool.release([block])
                break
            self.kv.write_block(block, buf)
            self.pool.append_tokens(block, tokens[j * bs:(j + 1) * bs])
            self.pool.register(block, keys[j])
            ids.append(block)
        return ids

    def _read_ram(self, _i: int, key: bytes, out: np.ndarray) -> bool:
        return bool(self.ram.get_block_into(key, out))

    def _read_disk(self, keys: list[bytes]):
        """A reader over one verified bulk read of `keys`' blocks from disk."""
        nbytes = self.kv.block_nbytes
        staging = np.empty(len(keys) * nbytes, dtype=np.uint8)
        n_read = self.disk.read_blocks(keys, staging)

        def read(i: int, _key: bytes, out: np.ndarray) -> bool:
            if i >= n_read:
                return False
            out.reshape(-1).view(np.uint8)[:] = staging[i * nbytes:(i + 1) * nbytes]
            return True

        return read

    # ---- save --------------------------------------------------------------------------
    def save(self, tokens: list[int], keys: list[bytes], block_table: list[int], n_tokens: int) -> None:
        """Copy the full blocks of tokens[:n_tokens] out to the tiers (RAM now, disk queued)."""
        n_full = min(n_tokens // self.block_size, len(keys), len(block_table))
        if n_full == 0:
            return
        if self.ram is not None:
            for j in range(n_full):
                if not self.ram.contains_block(keys[j]):
                    try:
                        self.ram.put_block(keys[j], self.kv.read_block(block_table[j]))
                    except _core.OverBudget:
                        break
        if self.disk is not None:
            stored = self.disk.stored_prefix(keys[:n_full])
            if stored < n_full:
                payload = np.concatenate([self.kv.read_block(b).reshape(-1).view(np.uint8)
                                          for b in block_table[stored:n_full]])
                self.disk.submit(keys[:n_full], payload, self.kv.block_nbytes,
                                 n_full * self.block_size, None, stored)

    # ---- introspection -----------------------------------------------------------------
    def snapshot(self) -> dict:
        out: dict = {}
        if self.ram is not None:
            out["ram"] = {**self.ram.stats(), **vars(self.ram_counters)}
        if self.disk is not None:
            out["disk"] = {**self.disk.stats(), **vars(self.disk_counters)}
        return out

    def close(self) -> None:
        if self.disk is not None:
            self.disk.close()
