"""Prefixes that outlive sessions: the RAM tier, the disk tier and the shared (Redis) tier behind
the device block pool.

Lookups fall through device pool -> RAM -> disk -> Redis, always by chain key, so a restored
block is exactly the KV of this prompt's tokens (and salt, and model). Redis is never read on
the engine thread: a request's blocks there were fetched before it was queued (`prefetch.py`),
and its admission reads that holding area (`reading`) where it would read Redis. When a sequence finishes, its
full blocks (prompt + reply, as the client's next turn will present them) are copied to the
RAM tier (same content stored once; not with `--no-cache-idle-slots`, `finished_to_ram`) and queued for the disk writer and the Redis writer; the
writers skip blocks already stored, so a returning conversation only adds its new turn.

Prefix entries: the full blocks of a chat prompt up to its first user message (tools + system
prompt, what every session of an agent starts with) are pinned in the RAM tier as soon as they
are computed: pins are evicted only when nothing unpinned is left, within a pin sub-budget (see
`kvshare_core::ram_tier`), so a flood of one-off conversations cannot push them out.

Recency: a chain is refreshed deepest block first (`touch_blocks`), so eviction takes a
conversation's deep blocks before its head and what stays is always a usable prefix.

Restored blocks are registered in the pool like computed ones, so concurrent sessions attach
to them zero-copy; a conversation whose blocks are still in the pool costs no tier reads.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, cast

import numpy as np

from kvshare import _core
from kvshare.engine.cache.remote_tier import RemoteTier

if TYPE_CHECKING:
    from typing_extensions import Buffer


class FetchedBlocks(Protocol):
    """What a request's fetch ahead holds (`prefetch.RemoteFetch`), as the lookups read it."""

    def present(self, keys: list[bytes]) -> int: ...

    def read_blocks(self, keys: list[bytes], staging: np.ndarray) -> int: ...

    def find_checkpoint(self, candidates: list[tuple[int, bytes]]
                        ) -> tuple[int, bytes] | None: ...


class Fetcher(Protocol):
    """The fetch threads (`prefetch.RemoteFetcher`), as the tier manager reports and stops them."""

    def stats(self) -> dict: ...

    def close(self) -> None: ...

log = logging.getLogger("kvshare.tiers")

# Blocks per tier read: reused staging buffers of this many blocks (bounded memory, and each
# chunk goes straight from it into the pool: one bulk write after the read).
CHUNK_BLOCKS = 64
# Disk restores are pipelined: up to this many chunk reads are in flight (on DISK_READERS
# threads; the store releases the GIL and its lock while reading and verifying) while the
# engine thread installs the chunk before them, so the device's queue stays busy and the
# pool writes hide behind the reads. Staging memory (the pool's, `KVArrays.staging_buffer`):
# DISK_DEPTH + 1 chunks, one more on a GPU, whose writes return before the device has read
# them (RAM restores use the first one, two on a GPU).
DISK_READERS = 2
DISK_DEPTH = 2
# Saves run on a background thread: the engine thread only copies the blocks out of the pool
# (they may be reused once it moves on; on a GPU into device memory, the copy to the host the
# saver's: `KVArrays.read_blocks_later`), the RAM puts, pins and the disk writer's submit (which
# copies and checksums the payload) happen off it. Measured on Gemma 270M: a new 2K-token
# conversation's save held the engine (and every other session's next step) 0.17-0.35 s,
# ~4x that at 8K. At most this many saves wait; beyond, the engine waits for the oldest.
MAX_PENDING_SAVES = 2


def _flat_bytes(a: np.ndarray) -> "Buffer":
    """`a`'s bytes as one flat uint8 array (a view): what the Rust stores read and write."""
    return cast("Buffer", a.reshape(-1).view(np.uint8))


@dataclass
class TierCounters:
    restores: int = 0  # admissions that took at least one block from this tier
    blocks_served: int = 0
    tokens_served: int = 0
    errors: int = 0  # corrupt entries met (the entry is removed; we recompute)
    checkpoints_served: int = 0  # hybrids: recurrent-state checkpoints restored from this tier
    restore_seconds: float = 0.0  # time spent restoring from this tier (reads + pool writes)


class TierManager:
    def __init__(self, pool, kv, block_size: int, ram: "_core.RamTier | None",
                 disk: "_core.DiskStore | None", remote: "RemoteTier | None" = None,
                 remote_min_tokens: int = 0):
        self.pool = pool
        self.kv = kv
        self.block_size = block_size
        self.ram = ram
        self.disk = disk
        self.remote = remote
        self.remote_min_tokens = remote_min_tokens  # shorter sequences are not sent to Redis
        self.ram_counters = TierCounters()
        self.disk_counters = TierCounters()
        self.remote_counters = TierCounters()
        self._readers: ThreadPoolExecutor | None = None
        self._saver: ThreadPoolExecutor | None = None
        self._saves: deque[tuple[Future, bool]] = deque()  # (job, writes to disk)
        # keys read out of the pool whose RAM put a queued saver job makes (`_submit_save`:
        # the engine thread adds, the job removes; set operations are atomic under the GIL)
        self._ram_pending: set[bytes] = set()
        # the admitting sequence's blocks fetched ahead from Redis (`reading`): the engine
        # thread's remote reads go here, never to the network
        self._reads: FetchedBlocks | None = None
        self.fetcher: Fetcher | None = None  # set by the cache manager with a remote tier
        # False (`--no-cache-idle-slots`): a finished sequence's saves skip the RAM tier (its
        # blocks stay in the pool until evicted); prefix entries are still pinned there
        self.finished_to_ram = True

    @contextlib.contextmanager
    def reading(self, fetched: FetchedBlocks | None) -> Iterator[None]:
        """While admitting one sequence: its fetch-ahead is what the remote tier holds (None:
        nothing; a lookup past the local tiers is a miss)."""
        self._reads = fetched
        try:
            yield
        finally:
            self._reads = None

    @property
    def enabled(self) -> bool:
        return self.ram is not None or self.disk is not None or self.remote is not None

    # ---- restore -----------------------------------------------------------------------
    def restore(self, tokens: list[int], keys: list[bytes], start: int, root: bytes,
                split: tuple[int, bytes] | None = None) -> list[int]:
        """Bring blocks `keys[start:]` (as many leading ones as a tier holds) into the pool.
        Returns the new pool block ids (each holding one reference for the caller). Block 0
        chains from `root`; `split` = (p, parent) gives block p another parent (the first
        block after a public prefix, see keys.BlockKeys.chain)."""
        got: list[int] = []
        if self.ram is not None and start < len(keys):
            n = self.ram.match_prefix(keys[start:])
            if n:
                t0 = time.perf_counter()
                ids = self._restore_chunks(self._read_ram, tokens, keys, start, n, root,
                                           self.ram_counters, split=split)
                self.ram.touch_blocks(keys[start:start + len(ids)])
                self._count(self.ram_counters, len(ids), time.perf_counter() - t0)
                got += ids
                if len(ids) < n:
                    return got  # the pool is full: no point reading the disk
        pos = start + len(got)
        if self.disk is not None and pos < len(keys):
            n, _, _ = self.disk.lookup(keys[pos:])
            if n:
                t0 = time.perf_counter()
                ids = self._restore_chunks(self._read_disk, tokens, keys, pos, n, root,
                                           self.disk_counters, depth=DISK_DEPTH, split=split)
                self._count(self.disk_counters, len(ids), time.perf_counter() - t0)
                got += ids
                if len(ids) < n:
                    return got
        pos = start + len(got)
        reads = self._reads
        if reads is not None and pos < len(keys):
            t0 = time.perf_counter()
            n = reads.present(keys[pos:])
            ids = self._restore_chunks(reads.read_blocks, tokens, keys, pos, n, root,
                                       self.remote_counters, split=split) if n else []
            got += ids
            self._count(self.remote_counters, len(ids), time.perf_counter() - t0)
        return got

    def _count(self, c: TierCounters, n_blocks: int, seconds: float) -> None:
        c.restore_seconds += seconds
        if n_blocks:
            c.restores += 1
            c.blocks_served += n_blocks
            c.tokens_served += n_blocks * self.block_size

    def _staging_blocks(self, slot: int, n: int) -> np.ndarray:
        """`n` blocks of reused staging buffer `slot` (the pool's: page-locked on a GPU, and
        handed out once the device has read the last chunk written from it), shaped
        `[n, *block_shape]`."""
        nbytes = self.kv.block_nbytes
        buf = self.kv.staging_buffer(slot, self._chunk_blocks() * nbytes)[: n * nbytes]
        return buf.view(self.kv.kv_dtype).reshape(n, *self.kv.block_shape)

    def _chunk_blocks(self) -> int:
        """Blocks per restore chunk: `CHUNK_BLOCKS`, fewer where the pool's staging is
        page-locked (`KVArrays.staging_chunk_blocks`)."""
        return self.kv.staging_chunk_blocks(CHUNK_BLOCKS)

    def _restore_chunks(self, read, tokens, keys, start, n, root, counters,
                        depth: int = 0, split=None) -> list[int]:
        """Restore keys[start:start+n] chunk by chunk: `read(chunk_keys, staging)` fills a
        staging buffer and returns how many leading blocks it holds; each is then written into
        a fresh pool block and registered. `depth` > 0 (the disk): that many chunk reads run
        ahead on reader threads while the engine installs the current chunk. Stops at the
        first short or corrupt read or a full pool; reads still in flight then are waited for
        and dropped. A read that fails in any way (corrupt, unreadable: the store has removed
        the entry) ends the restore there: the rest is recomputed."""
        size = self._chunk_blocks()
        starts = list(range(start, start + n, size))
        chunks = [keys[c0:min(c0 + size, start + n)] for c0 in starts]
        ahead: dict[int, tuple[np.ndarray, Future]] = {}
        # where a chunk's install returns before the device has read its staging (a GPU), one
        # more slot: the next chunk is read while this one is copied
        ring = depth + (2 if self.kv.staging_writes_async else 1)

        def fetch(i: int) -> None:
            # ring slot i % ring: that of chunk i - ring, already installed (its copy to the
            # device waited for by `_staging_blocks`)
            staging = self._staging_blocks(i % ring, len(chunks[i]))
            if depth:
                if self._readers is None:
                    self._readers = ThreadPoolExecutor(DISK_READERS,
                                                       thread_name_prefix="kvshare-disk")
                fut = self._readers.submit(read, chunks[i], staging)
            else:
                fut = Future()
                try:
                    fut.set_result(read(chunks[i], staging))
                except Exception as exc:  # noqa: BLE001 - raised again by result() below
                    fut.set_exception(exc)
            ahead[i] = (staging, fut)

        ids: list[int] = []
        fetched = 0
        try:
            for i, c0 in enumerate(starts):
                while fetched < min(i + depth + 1, len(chunks)):
                    fetch(fetched)
                    fetched += 1
                staging, fut = ahead.pop(i)
                try:
                    n_read = fut.result()
                except Exception as exc:  # noqa: BLE001 - the store removed the entry
                    log.warning("tier entry unreadable (%s), recomputing: %s",
                                type(exc).__name__, exc)
                    counters.errors += 1
                    break
                added = self._install(tokens, keys, c0, staging[:n_read], root, split)
                ids += added
                if len(added) < len(chunks[i]):
                    break
        finally:
            for _, fut in ahead.values():  # no read may still write a reused buffer
                with contextlib.suppress(Exception):  # dropped reads; a corrupt one was logged
                    fut.result()
        return ids

    def _install(self, tokens, keys, j0: int, blocks: np.ndarray, root: bytes,
                 split=None) -> list[int]:
        """Blocks `blocks[i]` (chain position j0 + i) into fresh pool blocks, registered: as
        many leading ones as the pool has room for, written with one bulk write. A failed
        write releases them all (the restore ends here; the rest is recomputed)."""
        bs = self.block_size
        ids: list[int] = []
        for j in range(j0, j0 + len(blocks)):
            parent = split[1] if split and j == split[0] else (keys[j - 1] if j > 0 else root)
            try:
                ids.append(self.pool.allocate(parent))
            except _core.OutOfBlocks:
                break
        if not ids:
            return ids
        try:
            self.kv.write_blocks(ids, blocks[:len(ids)])
        except Exception:  # noqa: BLE001 - the restore ends here; the rest is recomputed
            log.exception("writing restored blocks into the pool failed")
            self.pool.release(ids)
            return []
        for j, block in enumerate(ids, j0):
            self.pool.append_tokens(block, tokens[j * bs:(j + 1) * bs])
            self.pool.register(block, keys[j])
        return ids

    def _read_ram(self, keys: list[bytes], staging: np.ndarray) -> int:
        ram = self.ram
        assert ram is not None
        for i, key in enumerate(keys):
            if not ram.get_block_into(key, staging[i]):
                return i
        return len(keys)

    def _read_disk(self, keys: list[bytes], staging: np.ndarray) -> int:
        """One verified bulk read (adjacent regions coalesced) straight into the staging."""
        assert self.disk is not None
        return int(self.disk.read_blocks(keys, _flat_bytes(staging)))

    # ---- save --------------------------------------------------------------------------
    def save(self, tokens: list[int], keys: list[bytes], block_table: list[int], n_tokens: int,
             prefix_tokens: int = 0) -> None:
        """Copy the full blocks of tokens[:n_tokens] out to the tiers (RAM, and queued for
        disk); the full blocks of tokens[:prefix_tokens] (a prefix entry) are pinned in RAM.
        Here only what the tiers lack is copied out of the pool; the rest runs on the saver
        thread (`flush` waits for it)."""
        n_full = min(n_tokens // self.block_size, len(keys), len(block_table))
        if n_full == 0:
            return
        keys = list(keys[:n_full])
        to_ram = self.ram is not None and self.finished_to_ram
        ram_missing = self._ram_missing(keys) if to_ram else []
        stored = self.disk.stored_prefix(keys) if self.disk is not None else n_full
        remote_from = self._remote_from(keys, n_full)
        first = min(ram_missing[0] if ram_missing else n_full, stored, remote_from)
        read = (self.kv.read_blocks_later(block_table[first:n_full]) if first < n_full
                else None)
        n_prefix = min(prefix_tokens // self.block_size, n_full)
        to_disk = self.disk is not None and stored < n_full
        self._submit_save(lambda: self._save_job(keys, first, read, ram_missing, stored,
                                                 n_prefix, remote_from, to_ram), to_disk,
                          [keys[j] for j in ram_missing] if read is not None else [])

    def _remote_from(self, keys: list[bytes], n_full: int) -> int:
        """The first block the shared tier may lack (n_full: nothing to send)."""
        if self.remote is None or n_full * self.block_size < self.remote_min_tokens:
            return n_full
        return self.remote.first_unknown(keys)

    def _save_job(self, keys: list[bytes], first: int,
                  read: Callable[[], np.ndarray] | None, ram_missing: list[int], stored: int,
                  n_prefix: int, remote_from: int | None = None, to_ram: bool = True) -> None:
        n_full = len(keys)
        if read is None:  # every tier holds all of it already
            if self.ram is not None and to_ram and n_prefix:
                self.ram.pin_blocks(keys[:n_prefix])
            return
        host = read()
        if self.remote is not None and remote_from is not None and remote_from < n_full:
            self.remote.submit(keys[remote_from:], host[remote_from - first:])
        if self.ram is not None and to_ram:
            self._put_ram(keys, ram_missing, lambda j: host[j - first])
            if n_prefix:
                self.ram.pin_blocks(keys[:n_prefix])
        if self.disk is not None and stored < n_full:
            payload = _flat_bytes(host[stored - first:])
            self.disk.submit(keys, payload, self.kv.block_nbytes, n_full * self.block_size,
                             None, stored)

    def _submit_save(self, job: Callable[[], None], to_disk: bool,
                     ram_puts: Sequence[bytes] = ()) -> None:
        """Run `job` on the saver thread. `ram_puts`: the keys of the blocks it puts in RAM,
        read out of the pool already: until it has run, later saves and pins do not read
        them again (`_ram_missing`; the sessions of one agent prefix pin it one after
        another)."""
        if self._saver is None:
            self._saver = ThreadPoolExecutor(1, thread_name_prefix="kvshare-save")
        while len(self._saves) >= MAX_PENDING_SAVES:
            self._wait(self._saves.popleft()[0])
        run = job
        if ram_puts:
            self._ram_pending.update(ram_puts)

            def run() -> None:
                try:
                    job()
                finally:
                    self._ram_pending.difference_update(ram_puts)

        self._saves.append((self._saver.submit(run), to_disk))

    @staticmethod
    def _wait(fut: Future) -> None:
        try:
            fut.result()
        except Exception:  # a failed save costs a future cache hit, never a request
            log.exception("saving to the cache tiers failed")

    def flush(self) -> None:
        """Wait until every queued save has reached the tiers (disk: the writer's queue)."""
        while self._saves:
            self._wait(self._saves.popleft()[0])

    def _pending_disk_saves(self) -> int:
        # read-only (called from other threads): list() of a deque is atomic under the GIL
        return sum(1 for fut, to_disk in list(self._saves) if to_disk and not fut.done())

    def pin_prefix(self, keys: list[bytes], block_table: list[int], n_blocks: int,
                   checkpoint=None) -> None:
        """Copy the first `n_blocks` blocks to RAM (what is missing) and pin them as a prefix
        entry, with a hybrid's `checkpoint` at their end (`pin_checkpoint`); the puts and
        pins run on the saver thread (`_save_ram_later`)."""
        n = min(n_blocks, len(keys), len(block_table))
        ram = self.ram
        if ram is None or n == 0:
            return
        keys = list(keys[:n])

        def pin() -> None:
            ram.pin_blocks(keys)
            if checkpoint is not None:
                self.pin_checkpoint(keys, checkpoint)

        self._save_ram_later(keys, block_table, pin)

    def _save_ram_later(self, keys: list[bytes], block_table: list[int],
                        then: Callable[[], None] | None = None) -> None:
        """Take the blocks of `keys` (a chain's first ones) that RAM lacks out of the pool now,
        in one bulk read (`read_blocks_later`: on a GPU the device-to-host copy is the saver
        thread's); put them in RAM, then run `then`, on the saver thread, as a finished
        sequence's save does (`flush` waits for it): the copies and puts of a long agent
        prefix (~690 MB for 6K tokens of a Qwen3-1.7B-shaped model) held up every session's
        next step on the engine thread."""
        missing = self._ram_missing(keys)
        read = self.kv.read_blocks_later([block_table[j] for j in missing]) if missing else None

        def job() -> None:
            if read is not None:
                host = read()
                row = {j: i for i, j in enumerate(missing)}
                self._put_ram(keys, missing, lambda j: host[row[j]])
            if then is not None:
                then()

        self._submit_save(job, False, [keys[j] for j in missing])

    def _ram_missing(self, keys: list[bytes]) -> list[int]:
        """Indexes of the `keys` RAM neither holds nor has a put of queued (`_submit_save`)."""
        ram, pending = self.ram, self._ram_pending
        assert ram is not None
        return [j for j, key in enumerate(keys)
                if not ram.contains_block(key) and key not in pending]

    def _put_ram(self, keys: list[bytes], missing: list[int], block_of) -> None:
        """Put blocks `missing` (indexes into `keys`; `block_of(j)` is block j's data) into
        RAM. Refresh what is held first, so the puts evict other conversations before this
        chain's head; put deepest first; then leave the chain head-most-recent."""
        ram = self.ram
        assert ram is not None
        ram.touch_blocks(keys)
        for j in reversed(missing):
            try:
                ram.put_block(keys[j], block_of(j))
            except _core.OverBudget:
                return
        ram.touch_blocks(keys)

    # ---- hybrid models: blocks plus recurrent-state checkpoints ---------------------------
    # A hybrid sequence can resume only where a checkpoint of its recurrent state exists, and
    # the tiers hold full blocks only, so only block-aligned checkpoints go to the tiers (the
    # engine plans aligned ones at the first user message, the end of the prompt, and every
    # block boundary of the reply). Blocks past the deepest such checkpoint would be useless.
    def save_hybrid(self, keys: list[bytes], block_table: list[int], checkpoints,
                    prefix_tokens: int = 0) -> None:
        """Save the blocks up to the deepest block-aligned checkpoint among `checkpoints`, and
        those checkpoints (RAM: the shared object; disk and the shared tier: inside the entry).
        The prefix entry (blocks and checkpoint at `prefix_tokens`, block aligned) is pinned in
        RAM. As `save`: here only the blocks some tier lacks are taken out of the pool, in one
        read (`read_blocks_later`); the puts, pins and submits run on the saver thread."""
        bs = self.block_size
        limit = min(len(keys), len(block_table))
        by_key = {c.key: c for c in checkpoints
                  if c is not None and c.position % bs == 0 and 0 < c.position // bs <= limit}
        cks = sorted(by_key.values(), key=lambda c: c.position)
        if not cks:
            return
        n = cks[-1].position // bs
        keys = list(keys[:n])
        ram, disk, remote = self.ram, self.disk, self.remote
        to_ram = ram is not None and self.finished_to_ram
        ram_missing = self._ram_missing(keys) if to_ram else []
        stored = disk.stored_prefix(keys) if disk is not None else n
        # the shared tier takes the checkpoints even where it holds every block
        to_remote = remote is not None and n * bs >= self.remote_min_tokens
        remote_from = remote.first_unknown(keys) if remote is not None and to_remote else n
        first = min(ram_missing[0] if ram_missing else n, stored, remote_from)
        read = self.kv.read_blocks_later(block_table[first:n]) if first < n else None
        prefix = next((c for c in cks if prefix_tokens and c.position == prefix_tokens), None)

        def job() -> None:
            # the blocks keys[first:] (none: every tier holds them all)
            host = read() if read is not None else np.empty(0, np.uint8)
            if remote is not None and to_remote:
                remote.submit(keys[remote_from:],
                              host[remote_from - first:] if remote_from < n else None,
                              [(keys[c.position // bs - 1], c.position, c.layout,
                                np.asarray(c)) for c in cks])
            if ram is not None and to_ram:
                self._put_ram(keys, ram_missing, lambda j: host[j - first])
                for c in cks:
                    with contextlib.suppress(_core.OverBudget):
                        ram.put_checkpoint(c)
                if prefix is not None:
                    self.pin_checkpoint(keys, prefix)
            if disk is not None:
                # checkpoints already stored are referenced, not rewritten (the writer skips
                # an entry with nothing new)
                disk.submit(keys, _flat_bytes(host[stored - first:]), self.kv.block_nbytes,
                            n * bs, [(c.position, c.key, c.layout, _flat_bytes(np.asarray(c)))
                                     for c in cks], stored)

        self._submit_save(job, disk is not None, [keys[j] for j in ram_missing])

    def pin_checkpoint(self, keys: list[bytes], ckpt) -> None:
        """Pin a hybrid prefix entry: the blocks up to `ckpt` (held in RAM) and `ckpt` itself."""
        if self.ram is None:
            return
        n = ckpt.position // self.block_size
        if self.ram.pin_blocks(keys[:n]) == n:
            try:
                self.ram.put_checkpoint(ckpt)
            except _core.OverBudget:
                return
            self.ram.pin_checkpoint(ckpt.key)

    def find_checkpoint(self, root: bytes, keys: list[bytes], tokens: list[int], max_position: int,
                        deeper_than: int, account):
        """The deepest block-aligned checkpoint in RAM or on disk at a position in
        (deeper_than, max_position], as `(position, tier, load)`; `load()` returns the
        checkpoint (the shared RAM object, or one built from verified disk bytes) or None if
        it turned out unreadable. None if no tier has one."""
        bs = self.block_size
        best = None
        if self.ram is not None:
            ck = self.ram.deepest_checkpoint(root, keys, tokens[:max_position], max_position)
            if ck is not None and ck.position > deeper_than and ck.position % bs == 0:
                best = (ck.position, "ram", lambda: ck)
        if self.disk is not None:
            floor = best[0] if best else deeper_than
            top = min(len(keys), max_position // bs)
            cands = [(j * bs, keys[j - 1]) for j in range(floor // bs + 1, top + 1)]
            info = self.disk.lookup_checkpoint(cands, max_position) if cands else None
            if info is not None and info[0] > floor:
                pos, key = int(info[0]), bytes(info[1])
                best = (pos, "disk", lambda: self._load_disk_checkpoint(root, tokens[:pos], key, account))
        reads = self._reads
        if reads is not None:
            floor = best[0] if best else deeper_than
            top = min(len(keys), max_position // bs)
            cands = [(j * bs, keys[j - 1]) for j in range(floor // bs + 1, top + 1)]
            found = reads.find_checkpoint(cands)
            if found is not None:
                rpos, bkey = found
                best = (rpos, "remote", lambda: self._load_remote_checkpoint(
                    reads, root, tokens[:rpos], bkey, account))
        return best

    def local_checkpoint_position(self, root: bytes, keys: list[bytes], tokens: list[int],
                                  max_position: int) -> int:
        """The deepest block-aligned checkpoint position RAM or disk offer (0: none); any
        thread (the fetch-ahead compares Redis's with it)."""
        bs, best = self.block_size, 0
        if self.ram is not None:
            ck = self.ram.deepest_checkpoint(root, keys, tokens[:max_position], max_position)
            if ck is not None and ck.position % bs == 0:
                best = int(ck.position)
        if self.disk is not None:
            top = min(len(keys), max_position // bs)
            cands = [(j * bs, keys[j - 1]) for j in range(best // bs + 1, top + 1)]
            info = self.disk.lookup_checkpoint(cands, max_position) if cands else None
            if info is not None and info[0] > best:
                best = int(info[0])
        return best

    def checkpoint_served(self, tier: str) -> None:
        counters = {"ram": self.ram_counters, "disk": self.disk_counters,
                    "remote": self.remote_counters}[tier]
        counters.checkpoints_served += 1

    def _load_remote_checkpoint(self, reads, root, tokens, block_key, account):
        got = reads.read_checkpoint(block_key, len(tokens))
        if got is None:
            return None
        layout, data = got
        return _core.Checkpoint.at(root, tokens, self.block_size, data, layout, None, account)

    def _load_disk_checkpoint(self, root, tokens, key, account):
        try:
            got = self.disk.read_checkpoint(key)
        except (_core.CorruptEntry, _core.CacheIoError) as exc:  # the store removed it
            log.warning("disk checkpoint unreadable, recomputing: %s", exc)
            self.disk_counters.errors += 1
            return None
        if got is None or int(got[0]) != len(tokens):
            return None
        _, layout, data = got
        ck = _core.Checkpoint.at(root, tokens, self.block_size, data, layout, None, account)
        return ck if ck.key == key else None

    # ---- sliding-window layer groups (sliding_window.py) ------------------------------------
    # The main pool's blocks go to the tiers as always; the window pool's blocks only for the
    # windows a sequence resumes at (its prefix entry, its end), under keys of their own
    # (`window_key`): a window block is a different payload for the same chain key.
    @staticmethod
    def window_key(key: bytes) -> bytes:
        return _core.chain_key(key, [], b"kvshare/window-block")

    def available_prefix(self, keys: list[bytes]) -> int:
        """How many leading `keys` (main-pool blocks) a tier holds (nothing read)."""
        n = self.ram.match_prefix(keys) if self.ram is not None and keys else 0
        if self.disk is not None and n < len(keys):
            n += int(self.disk.lookup(keys[n:])[0])
        if self._reads is not None and n < len(keys):
            n += self._reads.present(keys[n:])
        return n

    def has_window_block(self, key: bytes) -> bool:
        wk = self.window_key(key)
        if self.ram is not None and self.ram.contains_block(wk):
            return True
        if self.disk is not None and self.disk.lookup([wk])[0]:
            return True
        return self._reads is not None and self._reads.present([wk]) == 1

    def read_window_block(self, key: bytes, out: np.ndarray) -> bool:
        """Window block `key` into `out` (its shape), verified; False if no tier has it whole."""
        wk = self.window_key(key)
        if self.ram is not None and self.ram.get_block_into(wk, out):
            return True
        if self.disk is not None and self.disk.lookup([wk])[0]:
            try:
                if self.disk.read_blocks([wk], _flat_bytes(out)) == 1:
                    return True
            except (_core.CorruptEntry, _core.CacheIoError) as exc:
                log.warning("disk window block unreadable, recomputing: %s", exc)
                self.disk_counters.errors += 1
        if self._reads is not None:
            return self._reads.read_blocks([wk], out.reshape(1, *out.shape)) == 1
        return False

    def save_window(self, keys: list[bytes], host: np.ndarray, pin: bool = False) -> None:
        """Window blocks (chain `keys`, payload `host[i]`, already copied out of the pool) to
        the tiers, on the saver thread; pinned in RAM with a prefix entry."""
        tkeys = [self.window_key(k) for k in keys]
        n = len(tkeys)
        # a prefix entry's window (pinned) goes to RAM either way, a finished one's only
        # when finished sequences do
        to_ram = self.ram is not None and (pin or self.finished_to_ram)
        ram_missing = self._ram_missing(tkeys) if to_ram else []
        stored = self.disk.stored_prefix(tkeys) if self.disk is not None else n
        rf = self.remote.first_unknown(tkeys) if self.remote is not None else n
        nbytes = int(host[0].nbytes) if n else 0

        def job() -> None:
            if self.ram is not None and to_ram:
                self._put_ram(tkeys, ram_missing, lambda j: host[j])
                if pin:
                    self.ram.pin_blocks(tkeys)
            if self.disk is not None and stored < n:
                self.disk.submit(tkeys, _flat_bytes(host[stored:]), nbytes,
                                 n * self.block_size, None, stored)
            if self.remote is not None and rf < n:
                self.remote.submit(tkeys[rf:], host[rf:])

        if n:
            self._submit_save(job, self.disk is not None and stored < n)

    # ---- introspection -----------------------------------------------------------------
    def snapshot(self) -> dict:
        out: dict = {}
        if self.ram is not None:
            out["ram"] = {**self.ram.stats(), **vars(self.ram_counters)}
            # saves handed over whose RAM copies are not all in yet
            out["ram"]["saves_pending"] = sum(1 for fut, _ in list(self._saves) if not fut.done())
        if self.disk is not None:
            out["disk"] = {**self.disk.stats(), **vars(self.disk_counters)}
            # saves not yet handed to the writer count as queued writes
            out["disk"]["queued"] += self._pending_disk_saves()
        if self.remote is not None:
            out["remote"] = {**self.remote.stats(), **vars(self.remote_counters)}
            out["remote"]["queued"] += self._pending_saves()
            if self.fetcher is not None:
                out["remote"]["fetch_ahead"] = self.fetcher.stats()
        return out

    def _pending_saves(self) -> int:
        return sum(1 for fut, _ in list(self._saves) if not fut.done())

    def close(self) -> None:
        self.flush()
        if self._saver is not None:
            self._saver.shutdown(wait=True)
        if self._readers is not None:
            self._readers.shutdown(wait=True)
        if self.disk is not None:
            self.disk.close()
        if self.fetcher is not None:
            self.fetcher.close()
        if self.remote is not None:
            self.remote.close()
