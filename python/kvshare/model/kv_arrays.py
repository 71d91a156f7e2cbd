"""`KVArrays`: the paged KV pool of a model (and, for hybrid models, its recurrent-state
slots) on one backend.

KV layout: one array `kv[n_attn_layers, 2, n_blocks, block_size, n_kv_heads, head_dim]`
(index 0 of the second axis is K, 1 is V; V uses `head_dim_v`, which must equal `head_dim` for
the single-array layout). Python owns the memory; the Rust block pool owns which block ids are
free, shared or cached. A block holds `block_size` consecutive positions of one sequence in
every attention layer, so `read_block` / `write_block` move one block's bytes between tiers.

Layer groups (`n_win_blocks` given): a model with sliding-window layers keeps their K/V in a
second array `kv_win[n_window_layers, 2, n_win_blocks, ...]` with its own block ids (the
engine's second block pool): those layers only ever read the last W positions, so a sequence
holds only its window there (docs/architecture.md, "KV by layer kind"). `kv` then holds the
full-attention layers only. `layer_kv` hides which array a layer lives in; `group_of` says.

q8_0 pools (`kv_dtype="q8_0"`, CPU only): each K/V row of `head_dim` values is ggml Q8_0
blocks (`kvshare.ops.kv_q8_0`), so the arrays are uint8 with a last axis of
`head_dim / 32 * 34` bytes instead of `head_dim` values; `kv_dtype` is then uint8 (what the
tiers view their bytes as) and `kv_dtype_name` says "q8_0". Blocks move as bytes like any other.

Recurrent state (filled in by the hybrid-model work): `states` is a list with one array per
recurrent-state tensor kind, each shaped `[n_state_slots, ...]`; attention-only models have
`n_state_slots == 0` and no state arrays.
"""

from __future__ import annotations

import logging
import math
import mmap
import threading
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np

from kvshare.backend import CPU, Backend
from kvshare.model.config import ModelConfig
from kvshare.ops import kv_q8_0 as q8

log = logging.getLogger(__name__)


_DTYPE_NAMES = {"f32": np.float32, "float32": np.float32, "f16": np.float16,
                "float16": np.float16, "half": np.float16, "q8_0": np.uint8}
_NAME_OF = {np.dtype(np.float32): "f32", np.dtype(np.float16): "f16", np.dtype(np.uint8): "q8_0"}


def kv_dtype_of(kv_dtype: Any) -> np.dtype:
    """The pool's array dtype from a NumPy dtype or a name ("f32", "f16", "float32",
    "float16", "q8_0"). q8_0 rows are bytes: its array dtype is uint8 (and uint8 means q8_0)."""
    if isinstance(kv_dtype, str) and kv_dtype.lower() in _DTYPE_NAMES:
        return np.dtype(_DTYPE_NAMES[kv_dtype.lower()])
    dt = np.dtype(kv_dtype)
    if dt not in _NAME_OF:
        raise ValueError(f"KV dtype {kv_dtype!r} not supported (f32, f16 or q8_0)")
    return dt


def kv_dtype_name(kv_dtype: Any) -> str:
    """The name of a KV dtype ("f32", "f16" or "q8_0"), as cache keys and flags spell it."""
    return _NAME_OF[kv_dtype_of(kv_dtype)]


def kv_row_bytes(head_dim: int, kv_dtype: Any) -> int:
    """Bytes of one K or V row of `head_dim` values in a pool of `kv_dtype` (q8_0: 34 per 32
    values; ValueError when head_dim is not a multiple of 32)."""
    dt = kv_dtype_of(kv_dtype)
    if dt == np.uint8:
        try:
            return q8.row_bytes(head_dim)
        except ValueError:
            raise ValueError(f"q8_0 KV needs a head_dim that is a multiple of {q8.VALS}; this "
                             f"model's head_dim is {head_dim} (use f16)") from None
    return head_dim * dt.itemsize


_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux >= 5.14

# Bulk block moves on the GPU (`read_blocks`, `write_blocks`) go through device scratch: a read
# gathers its blocks and copies them block-major, a write copies them over before scattering
# them. Moving at most this many bytes of blocks per chunk bounds that scratch (about twice
# this) whatever the prefix, while each transfer stays tens of MiB: a 6K-token prefix of a
# Qwen3-1.7B-shaped f16 model (~690 MB, 375 blocks of 1.8 MB) moves in 11 chunks of 36 blocks.
BULK_CHUNK_BYTES = 64 << 20

# A read left to the saver thread (`read_blocks_later`) holds a device copy of its blocks until
# that thread has them on the host. At most this many bytes of such copies are held at once
# (a 6K-token prefix of a Qwen3-1.7B-shaped f16 model is ~690 MB); a read past it goes
# through the chunked `read_blocks` at once, as a read whose copy the device cannot allocate
# does.
LATER_READ_MAX_BYTES = 1 << 30

# Staging buffers (`staging_buffer`) on a GPU are page-locked, and the device copies straight
# from them. False: pageable buffers, written as any host array is (CuPy copies each chunk
# into a page-locked buffer of its own first; bench/prefix_pin_cost.py's baseline rows).
STAGING_PINNED = True


def _wait_for_staged_copies(done: list[Any], _buffers: list[np.ndarray]) -> None:
    """(A pool's finalizer; `_buffers` is held until the copies are done.)"""
    for event in done:
        if event is not None:
            event.synchronize()


class KVArrays:
    def __init__(self, config: ModelConfig, n_blocks: int, block_size: int = 16, *,
                 n_state_slots: int = 0, kv_dtype: Any = np.float32,
                 backend: Backend = CPU, state_shapes: list[tuple[int, ...]] | None = None,
                 n_win_blocks: int | None = None):
        if n_blocks < 1 or block_size < 1:
            raise ValueError("n_blocks and block_size must be >= 1")
        if config.head_dim_v != config.head_dim:
            raise ValueError("K and V head sizes differ: not supported by the KV layout")
        self.config = config
        self.backend = backend
        self.n_blocks = int(n_blocks)
        self.block_size = int(block_size)
        self.kv_dtype = kv_dtype_of(kv_dtype)
        self.kv_dtype_name = kv_dtype_name(self.kv_dtype)
        # elements of one K/V row: head_dim values, or its q8_0 bytes
        row = kv_row_bytes(config.head_dim, self.kv_dtype) // self.kv_dtype.itemsize
        if self.kv_dtype_name == "q8_0" and backend.is_gpu:
            raise ValueError("q8_0 KV is CPU-only: the GPU attention kernels read f16 or f32 "
                             "(use f16)")
        self.n_attn_layers = config.n_attn_layers
        xp = backend.xp
        # which attention layers are sliding-window ones (their attn_index order)
        windows = [w for w, k in zip(config.layer_windows or [0] * config.n_layers,
                                     config.attn_layer_index) if k >= 0]
        self.split = n_win_blocks is not None and any(windows)
        # attn_index -> (group, index in the group's array): 0 = kv, 1 = kv_win
        self._where: list[tuple[int, int]] = []
        counts = [0, 0]
        for w in windows:
            g = 1 if (self.split and w) else 0
            self._where.append((g, counts[g]))
            counts[g] += 1
        self.n_win_blocks = int(n_win_blocks) if self.split else 0
        tail = (self.block_size, max(config.n_head_kv, 1), row)
        shape = (counts[0], 2, self.n_blocks, *tail)
        self._mapping: mmap.mmap | None = None
        self._win_mapping: mmap.mmap | None = None
        self.prefaulted: bool | None = None  # None: not tried; False: unsupported here
        self.kv, self._mapping = self._alloc(shape)
        self._layer_views: dict[int, tuple[Any, Any]] = {}
        self.kv_win, self._win_mapping = (self._alloc((counts[1], 2, self.n_win_blocks, *tail))
                                          if self.split else (None, None))
        self.n_state_slots = int(n_state_slots)
        # reads left to another thread (`read_blocks_later`): the bytes of device copies they
        # hold, and the stream their device-to-host copies run on
        self._later_lock = threading.Lock()
        self.later_bytes = 0
        self._copy_stream: Any = None
        # host staging buffers (`staging_buffer`), and on a GPU the event recorded after the
        # last write from each (None: nothing in flight)
        self._staging: list[np.ndarray] = []
        self._staging_done: list[Any] = []
        self._staging_pinned: list[bool] = []
        self._staging_failed = False
        # a pool dropped with copies from its staging in flight waits for them first: its
        # page-locked buffers would otherwise go back to CuPy's pool (and to a new owner)
        # while the device still reads them
        weakref.finalize(self, _wait_for_staged_copies, self._staging_done,
                         self._staging).atexit = False
        self.states: list[Any] = [
            xp.zeros((self.n_state_slots, *shape), dtype=np.float32)
            for shape in (state_shapes or [])
        ] if self.n_state_slots else []

    def _alloc(self, shape) -> tuple[Any, mmap.mmap | None]:
        if self.backend.is_gpu:
            return self.backend.xp.zeros(shape, dtype=self.kv_dtype), None
        # an anonymous mapping (zero-filled) rather than np.zeros: `prefault` can populate
        # its pages ahead of use without touching their contents
        count = int(np.prod(shape))
        mapping = mmap.mmap(-1, max(1, count * self.kv_dtype.itemsize))
        return np.frombuffer(mapping, dtype=self.kv_dtype, count=count).reshape(shape), mapping

    def group_of(self, attn_index: int) -> int:
        """0: the layer's K/V is in `kv` (full attention, or every layer when not split);
        1: in `kv_win` (a sliding-window layer of a split cache)."""
        return self._where[attn_index][0]

    def prefault(self, wait: bool = False) -> threading.Thread | None:
        """Populate the host KV pool's pages in the background (Linux MADV_POPULATE_WRITE:
        contents are left as they are, so the engine may write KV meanwhile). Without it the
        first long request after start-up pays the page faults of every block it touches
        (~0.25 s per 300 MB). Sets `prefaulted` (False where the kernel lacks the call)."""
        mappings = [m for m in (self._mapping, self._win_mapping) if m is not None]
        if not mappings:
            return None

        def run() -> None:
            step = 64 << 20  # a multiple of the page size; short holds of the mm lock
            try:
                for mapping in mappings:
                    for off in range(0, len(mapping), step):
                        mapping.madvise(_MADV_POPULATE_WRITE, off,
                                        min(step, len(mapping) - off))
            except (OSError, ValueError):
                self.prefaulted = False
                return
            self.prefaulted = True

        t = threading.Thread(target=run, name="kvshare-prefault", daemon=True)
        t.start()
        if wait:
            t.join()
        return t

    # --- sizes -------------------------------------------------------------------------
    @property
    def block_shape(self) -> tuple[int, ...]:
        """Shape of one block as `read_block` returns it."""
        s = self.kv.shape
        return (s[0], s[1], s[3], s[4], s[5])

    @property
    def block_nbytes(self) -> int:
        """Bytes of one block (all attention layers, K and V)."""
        # math.prod of the int tuple: the engine reads this every step (kv_bytes_held), and
        # np.prod of a tuple costs ~10 us
        return math.prod(self.block_shape) * self.kv_dtype.itemsize

    @property
    def nbytes(self) -> int:
        return (self.n_blocks * self.block_nbytes + self.n_win_blocks * self.win_block_nbytes
                + sum(int(s.nbytes) for s in self.states))

    @property
    def win_block_shape(self) -> tuple[int, ...]:
        s = self.kv_win.shape
        return (s[0], s[1], s[3], s[4], s[5])

    @property
    def win_block_nbytes(self) -> int:
        """Bytes of one block of the sliding-window group (0 when not split)."""
        if not self.split:
            return 0
        return math.prod(self.win_block_shape) * self.kv_dtype.itemsize

    def capacity_tokens(self) -> int:
        return self.n_blocks * self.block_size

    # --- per-layer views -----------------------------------------------------------------
    def layer_kv(self, attn_index: int) -> tuple[Any, Any]:
        """(K, V) of one attention layer, each `[n_blocks, block_size, n_kv_heads, head_dim]`
        (views, not copies; `n_win_blocks` of them for a window layer of a split cache)."""
        views = self._layer_views.get(attn_index)
        if views is None:  # built once: a decode step asks for every layer's
            g, i = self._where[attn_index]
            arr = self.win_group(g)
            views = self._layer_views[attn_index] = (arr[i, 0], arr[i, 1])
        return views

    def win_group(self, group: int) -> Any:
        return self.kv_win if group == 1 else self.kv

    # --- block moves ---------------------------------------------------------------------
    def _check(self, block: int, group: int = 0) -> int:
        block = int(block)
        n = self.n_win_blocks if group == 1 else self.n_blocks
        if not 0 <= block < n:
            raise IndexError(f"block {block} out of range [0, {n})")
        return block

    def copy_block(self, src: int, dst: int, n_tokens: int | None = None, group: int = 0) -> None:
        """Copy the first `n_tokens` positions (all, by default) of block `src` into `dst` in
        every attention layer of `group`: the copy of copy-on-write."""
        src, dst = self._check(src, group), self._check(dst, group)
        n = self.block_size if n_tokens is None else int(n_tokens)
        if not 0 <= n <= self.block_size:
            raise ValueError(f"n_tokens {n} not in [0, {self.block_size}]")
        arr = self.win_group(group)
        if n and src != dst:
            arr[:, :, dst, :n] = arr[:, :, src, :n]

    def group_block_shape(self, group: int = 0) -> tuple[int, ...]:
        return self.win_block_shape if group == 1 else self.block_shape

    def read_block(self, block: int, group: int = 0) -> np.ndarray:
        """A host copy of one block: `[n_attn_layers, 2, block_size, n_kv_heads, head_dim]`
        (the group's layers)."""
        block = self._check(block, group)
        return np.ascontiguousarray(self.backend.to_host(self.win_group(group)[:, :, block]))

    def read_blocks(self, blocks: list[int], group: int = 0) -> np.ndarray:
        """Host copies of several blocks as one contiguous array `[len(blocks), *block_shape]`
        (the tiers' save payload), equal to `read_block` of each; every id is checked before
        anything is copied. On the GPU each chunk of `BULK_CHUNK_BYTES` costs one gather, one
        block-major copy and one device-to-host copy: a copy per block would be a synchronous
        transfer per block on the engine thread."""
        ids = np.array([self._check(b, group) for b in blocks], dtype=np.intp)
        arr = self.win_group(group)
        if not self.backend.is_gpu:
            # one gather straight into block-major order: a copy per block took ~4% longer
            # (375 blocks of a 28-layer f16 pool: 190 ms, 184 ms gathered)
            return np.ascontiguousarray(np.moveaxis(arr, 2, 0)[ids])
        xp = self.backend.xp
        out = np.empty((len(ids), *self.group_block_shape(group)), dtype=self.kv_dtype)
        step = self._chunk_blocks(group)
        for i in range(0, len(ids), step):
            gathered = arr.take(self.backend.asarray(ids[i:i + step]), axis=2)
            self.backend.to_host(xp.ascontiguousarray(xp.moveaxis(gathered, 2, 0)),
                                 out=out[i:i + step])
        return out

    def read_blocks_later(self, blocks: list[int],
                          group: int = 0) -> Callable[[], np.ndarray]:
        """`read_blocks` in two halves: what the pool holds now, for another thread (the
        tiers' saver) to bring to the host. Returns a function that returns what `read_blocks`
        would have returned at this call, whatever steps write the pool meanwhile; call it
        once. On the GPU this call only gathers the blocks into one device array, block-major,
        on the current stream (after the steps that wrote them, before any that reuse them)
        and records an event; the function waits for the event, copies the array to the host
        on a non-blocking stream of its own (the device's copy engine, beside the steps the
        engine launches meanwhile) and frees it. The engine thread then spends a gather's
        launch on a prefix entry instead of its synchronous copies (~690 MB for a 6K-token
        prefix of a Qwen3-1.7B-shaped f16 model). On the CPU the blocks are read now
        (`read_blocks`) and the function returns them; so too on the GPU past
        `LATER_READ_MAX_BYTES` of device copies held, where the copy would take more than half
        of what the device can still allocate (the steps' own allocations come first), or
        where the device cannot allocate it."""
        ids = np.array([self._check(b, group) for b in blocks], dtype=np.intp)
        nbytes = len(ids) * (self.win_block_nbytes if group == 1 else self.block_nbytes)
        backend = self.backend
        if backend.is_gpu and len(ids):
            headroom = self._device_headroom()
            with self._later_lock:
                fits = (self.later_bytes + nbytes <= LATER_READ_MAX_BYTES
                        and (headroom is None or 2 * nbytes <= headroom))
                if fits:
                    self.later_bytes += nbytes
            if fits:
                try:
                    return self._gather_later(ids, group, nbytes)
                except BaseException as exc:
                    self._release_later(nbytes)
                    if not isinstance(exc, MemoryError):  # (CuPy's OutOfMemoryError is one)
                        raise
        host = self.read_blocks(list(ids), group)
        return lambda: host

    def _gather_later(self, ids: np.ndarray, group: int, nbytes: int) -> Callable[[], np.ndarray]:
        xp, dev = self.backend.xp, self.backend.device_id
        arr = self.win_group(group)
        with xp.cuda.Device(dev):
            if self._copy_stream is None:
                self._copy_stream = xp.cuda.Stream(non_blocking=True)
            gathered = xp.moveaxis(arr, 2, 0)[self.backend.asarray(ids)]
            done = xp.cuda.Event(disable_timing=True)
            done.record()
        copy_stream = self._copy_stream
        held = [gathered]

        def result() -> np.ndarray:
            if not held:
                raise RuntimeError("the result of a later read is taken once")
            dev_copy = held.pop()
            try:
                with xp.cuda.Device(dev):
                    done.synchronize()
                    host = np.empty(dev_copy.shape, dtype=self.kv_dtype)
                    xp.asnumpy(dev_copy, stream=copy_stream, out=host)
                    del dev_copy
                return host
            finally:
                release()

        # the budget comes back once: when the result is taken, or when a read never taken
        # (its save dropped) is collected with its device copy
        release = weakref.finalize(result, self._release_later, nbytes)
        return result

    def _device_headroom(self) -> int | None:
        """Bytes the device could still allocate: the driver's free memory and what CuPy's
        pool holds free (None where that cannot be read)."""
        xp = self.backend.xp
        try:
            with xp.cuda.Device(self.backend.device_id):
                free, _ = xp.cuda.runtime.memGetInfo()
                return int(free) + int(xp.get_default_memory_pool().free_bytes())
        except Exception:  # noqa: BLE001 - no figure: the byte budget alone decides
            return None

    def _release_later(self, nbytes: int) -> None:
        with self._later_lock:
            self.later_bytes -= nbytes

    def write_block(self, block: int, data: np.ndarray, group: int = 0) -> None:
        """Overwrite one block with `data` shaped like `read_block`'s result."""
        block = self._check(block, group)
        data = np.asarray(data)
        want = self.group_block_shape(group)
        if tuple(data.shape) != want:
            raise ValueError(f"block data shape {data.shape} != {want}")
        self.win_group(group)[:, :, block] = self.backend.asarray(data, dtype=self.kv_dtype)

    # --- host staging of bulk writes ------------------------------------------------------
    @property
    def staging_writes_async(self) -> bool:
        """True where `write_blocks` from a staging buffer returns before the buffer has been
        read (a GPU): a ring of them lets the next chunk be filled while this one is copied."""
        return self.backend.is_gpu and STAGING_PINNED

    def staging_chunk_blocks(self, most: int) -> int:
        """Blocks of group 0 to stage per chunk: `most`, and where staging is page-locked at
        most `BULK_CHUNK_BYTES` of them, so that the page-locked memory a pool holds is a few
        of those whatever its block size (a ring of 4 chunks of 64 blocks of a 64-layer model
        would be about 1 GB)."""
        if not self.staging_writes_async:
            return most
        return max(1, min(most, BULK_CHUNK_BYTES // self.block_nbytes))

    def staging_buffer(self, slot: int, nbytes: int) -> np.ndarray:
        """Host buffer `slot` (uint8, at least `nbytes`; reused by later calls) for filling
        with blocks to `write_blocks`: page-locked on a GPU, where a write from it is one
        asynchronous host-to-device copy straight from it (from pageable memory CuPy would
        first copy the bytes into a page-locked buffer of its own). Returned once the device
        has read what the last write from it sent, so the caller may overwrite it."""
        while len(self._staging) <= slot:
            self._staging.append(np.empty(0, np.uint8))
            self._staging_done.append(None)
            self._staging_pinned.append(False)
        self._wait_staging(slot)
        if self._staging[slot].nbytes < nbytes:
            self._staging[slot], self._staging_pinned[slot] = self._new_staging(nbytes)
        return self._staging[slot]

    def release_staging(self) -> None:
        """Wait for the writes from the staging buffers, then drop the buffers (the next
        `staging_buffer` makes new ones, as `STAGING_PINNED` then says)."""
        for slot in range(len(self._staging)):
            self._wait_staging(slot)
        for kept in (self._staging, self._staging_done, self._staging_pinned):
            kept.clear()

    def _new_staging(self, nbytes: int) -> tuple[np.ndarray, bool]:
        """A staging buffer of `nbytes`, and whether it is page-locked: on a GPU unless the
        host refuses to lock that much (writes from it are then as from any host array)."""
        if self.staging_writes_async:
            xp = self.backend.xp
            try:
                with xp.cuda.Device(self.backend.device_id):
                    mem = xp.cuda.alloc_pinned_memory(nbytes)
                return np.frombuffer(mem, np.uint8, nbytes), True
            except Exception as exc:  # noqa: BLE001 - CUDARuntimeError: out of page-locked memory
                if not self._staging_failed:
                    log.warning("no page-locked staging (%s: %s): restores copy from pageable "
                                "memory", type(exc).__name__, exc)
                self._staging_failed = True
        return np.empty(nbytes, np.uint8), False

    def _wait_staging(self, slot: int) -> None:
        done = self._staging_done[slot]
        if done is not None:
            done.synchronize()
            self._staging_done[slot] = None

    def _staging_slot_of(self, data: np.ndarray) -> int | None:
        """The page-locked staging buffer that C-contiguous `data` lies in wholly, or None."""
        if not data.flags.c_contiguous or not data.nbytes:
            return None
        lo = data.__array_interface__["data"][0]
        for slot, buf in enumerate(self._staging):
            start = buf.__array_interface__["data"][0]
            if start <= lo and lo + data.nbytes <= start + buf.nbytes:
                return slot if self._staging_pinned[slot] else None
        return None

    def write_blocks(self, blocks: list[int], data: np.ndarray, group: int = 0) -> None:
        """Overwrite blocks `blocks[i]` with `data[i]` (`data` shaped like `read_blocks`'
        result), as `write_block` of each in order would: of a repeated id the last data
        stays. Ids and shape are checked before anything is written. On the GPU each chunk of
        `BULK_CHUNK_BYTES` is one host-to-device copy and one scatter; from a staging buffer
        (`staging_buffer`) the copies are asynchronous on the current stream (the scatters
        after them, every later step after those) and the call returns without waiting: the
        buffer's next `staging_buffer` waits for them."""
        ids = [self._check(b, group) for b in blocks]
        data = np.asarray(data)
        want = (len(ids), *self.group_block_shape(group))
        if tuple(data.shape) != want:
            raise ValueError(f"blocks data shape {data.shape} != {want}")
        last = {b: i for i, b in enumerate(ids)}
        if len(last) < len(ids):  # a scatter leaves which of a repeated id's writes wins open
            ids, data = list(last), data[list(last.values())]
        idx = np.array(ids, dtype=np.intp)
        arr = self.win_group(group)
        if not self.backend.is_gpu:
            arr[:, :, idx] = np.moveaxis(data, 0, 2)
            return
        step = self._chunk_blocks(group)
        xp = self.backend.xp
        slot = (self._staging_slot_of(data)
                if self.staging_writes_async and data.dtype == self.kv_dtype else None)
        queued = False
        try:
            for i in range(0, len(idx), step):
                ids_dev = self.backend.asarray(idx[i:i + step])
                if slot is None:
                    # (CuPy copies pageable data into a page-locked buffer of its own first)
                    chunk = self.backend.asarray(data[i:i + step], dtype=self.kv_dtype)
                else:
                    with xp.cuda.Device(self.backend.device_id):
                        chunk = xp.empty(data[i:i + step].shape, dtype=self.kv_dtype)
                        chunk.set(data[i:i + step], stream=xp.cuda.get_current_stream())
                        queued = True
                arr[:, :, ids_dev] = xp.moveaxis(chunk, 0, 2)
        finally:
            if queued:  # (also where a later chunk raised: the copies queued still read it)
                with xp.cuda.Device(self.backend.device_id):
                    done = xp.cuda.Event(disable_timing=True)
                    done.record()
                self._staging_done[slot] = done

    def _chunk_blocks(self, group: int) -> int:
        """Blocks of `group` per chunk of a bulk move on the GPU (`BULK_CHUNK_BYTES`)."""
        block = self.win_block_nbytes if group == 1 else self.block_nbytes
        return max(1, BULK_CHUNK_BYTES // block)

    # --- recurrent state (hybrid models) ---------------------------------------------------
    def copy_state(self, src_slot: int, dst_slot: int) -> None:
        for s in self.states:
            s[dst_slot] = s[src_slot]

    def read_state(self, slot: int) -> list[np.ndarray]:
        return self.read_snapshot([s[slot] for s in self.states])

    def snapshot_state(self, slot: int, into: list[Any] | None = None) -> list[Any]:
        """A copy of `slot`'s state that the slot's later steps leave as it is, on the state's
        device: on a GPU a device-side copy on the current stream, after the steps that wrote
        the slot (no transfer, no wait). `into`, an earlier snapshot of this cache, is
        overwritten in place instead of allocating. `read_snapshot` brings it to the host."""
        if into is None:
            return [s[slot].copy() for s in self.states]
        for d, s in zip(into, self.states):
            d[...] = s[slot]
        return into

    def read_snapshot(self, arrays: list[Any]) -> list[np.ndarray]:
        """Host copies of state arrays (a slot's, or a `snapshot_state`)."""
        return [np.ascontiguousarray(self.backend.to_host(a)) for a in arrays]

    def write_state(self, slot: int, data: list[np.ndarray]) -> None:
        if len(data) != len(self.states):
            raise ValueError(f"{len(data)} state arrays given, cache has {len(self.states)}")
        for s, d in zip(self.states, data):
            s[slot] = self.backend.asarray(d, dtype=s.dtype)
