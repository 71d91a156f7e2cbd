"""Bulk block moves of the KV pool (`KVArrays.read_blocks` / `write_blocks`) against the
per-block ones (`read_block` / `write_block`), bit for bit, in both groups of a split cache;
a read left to another thread (`read_blocks_later`) returns the pool as it was when asked;
and the tiers' use of them: a RAM save reads its missing blocks with one bulk read (on a GPU
its device-to-host copy on the saver thread), a restore installs each chunk with one bulk
write.

The `gpu` tests run on a CUDA device, and in CI on the CPU emulator (tests/gpu_emu): there a
bulk read is also held to one device-to-host copy per chunk (`BULK_CHUNK_BYTES`), not one per
block."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from kvshare import _core
from kvshare.backend import CPU, Backend
from kvshare.engine.cache.tiers import TierManager
from kvshare.model import kv_arrays
from kvshare.model.config import ATTENTION, ModelConfig
from kvshare.model.kv_arrays import KVArrays

BS = 4
N_BLOCKS, N_WIN_BLOCKS = 12, 7
# repeated and out-of-order ids, per group (group 1: the window layers' own, smaller pool)
IDS = {0: [5, 1, 5, 0, 11, 3, 1], 1: [6, 2, 2, 0, 4, 6]}


def config() -> ModelConfig:
    """Four attention layers, the middle two sliding-window ones (a split cache's group 1)."""
    return ModelConfig(arch="test", n_layers=4, n_embd=64, n_head=4, n_head_kv=2, head_dim=32,
                       head_dim_v=32, n_ff=128, vocab_size=100, norm_eps=1e-6,
                       context_length=1024, rope_base=1e4, rope_base_swa=1e4, sliding_window=8,
                       layer_kinds=(ATTENTION,) * 4, layer_windows=(0, 8, 8, 0))


def random_pool(backend: Backend = CPU, kv_dtype="f32", seed: int = 0,
                n_blocks: int = N_BLOCKS) -> KVArrays:
    """A split pool whose every byte is random (NaN payloads included: moves must copy bits)."""
    kv = KVArrays(config(), n_blocks, BS, kv_dtype=kv_dtype, backend=backend,
                  n_win_blocks=N_WIN_BLOCKS)
    assert kv.split and kv.kv.shape[0] == 2 and kv.kv_win.shape[0] == 2
    rng = np.random.default_rng(seed)
    for g in (0, 1):
        arr = kv.win_group(g)
        arr[...] = backend.asarray(random_bytes(rng, arr.shape, arr.dtype))
    return kv


def random_bytes(rng, shape, dtype) -> np.ndarray:
    dtype = np.dtype(dtype)
    n = int(np.prod(shape)) * dtype.itemsize
    return rng.integers(0, 256, n, dtype=np.uint8).view(dtype).reshape(shape)


def contents(kv: KVArrays) -> list[np.ndarray]:
    """Both groups' bytes, copied to the host."""
    return [np.array(kv.backend.to_host(kv.win_group(g))).view(np.uint8) for g in (0, 1)]


def bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.uint8)


def check_bulk_moves(backend: Backend, kv_dtype) -> None:
    """read_blocks equals read_block of each, write_blocks equals write_block of each in
    order (repeated ids: the last data stays), per group, the other group untouched."""
    kv = random_pool(backend, kv_dtype)
    for g in (0, 1):
        got = kv.read_blocks(IDS[g], group=g)
        assert got.shape == (len(IDS[g]), *kv.group_block_shape(g))
        assert got.dtype == kv.kv_dtype and got.flags.c_contiguous
        want = np.stack([kv.read_block(b, group=g) for b in IDS[g]])
        np.testing.assert_array_equal(bits(got), bits(want))
        assert kv.read_blocks([], group=g).shape == (0, *kv.group_block_shape(g))

        data = random_bytes(np.random.default_rng(10 + g), got.shape, kv.kv_dtype)
        bulk, one_by_one = random_pool(backend, kv_dtype), random_pool(backend, kv_dtype)
        bulk.write_blocks(IDS[g], data, group=g)
        for b, d in zip(IDS[g], data):
            one_by_one.write_block(b, d, group=g)
        for a, b in zip(contents(bulk), contents(one_by_one)):
            np.testing.assert_array_equal(a, b)
        assert not np.array_equal(contents(bulk)[g], contents(kv)[g]), "nothing written"
        np.testing.assert_array_equal(contents(bulk)[1 - g], contents(kv)[1 - g])
        bulk.write_blocks([], data[:0], group=g)


def check_bad_input_moves_nothing(backend: Backend) -> None:
    """A bad id anywhere in the list (or data of the wrong shape) raises before any block is
    written or read."""
    kv = random_pool(backend)
    before = contents(kv)
    for g, n in ((0, N_BLOCKS), (1, N_WIN_BLOCKS)):
        data = np.zeros((3, *kv.group_block_shape(g)), dtype=kv.kv_dtype)
        for ids in ([1, 2, n], [1, -1, 2]):
            with pytest.raises(IndexError, match="out of range"):
                kv.write_blocks(ids, data, group=g)
            with pytest.raises(IndexError, match="out of range"):
                kv.read_blocks(ids, group=g)
        with pytest.raises(ValueError, match="shape"):
            kv.write_blocks([1, 2], data, group=g)
    with pytest.raises(IndexError):  # a valid id of group 0 is not one of group 1
        kv.write_blocks([0, N_WIN_BLOCKS], np.zeros((2, *kv.win_block_shape), kv.kv_dtype),
                        group=1)
    for a, b in zip(contents(kv), before):
        np.testing.assert_array_equal(a, b)


# ---- CPU ------------------------------------------------------------------------------------

@pytest.mark.parametrize("kv_dtype", ["f32", "f16", "q8_0"])
def test_bulk_moves_equal_per_block_moves(kv_dtype):
    check_bulk_moves(CPU, kv_dtype)


def test_bulk_moves_check_every_id_before_moving_anything():
    check_bad_input_moves_nothing(CPU)


def test_read_blocks_copies_out_of_the_pool():
    kv = random_pool()
    got = kv.read_blocks([3, 3])
    before = contents(kv)
    got[...] = 0
    np.testing.assert_array_equal(contents(kv)[0], before[0])


def check_later_read(backend: Backend) -> None:
    """A later read returns the blocks as they were when it was asked, whatever is written
    to the pool before its result is taken, in both groups; its device copies are released."""
    kv = random_pool(backend, "f16")
    for g in (0, 1):
        want = kv.read_blocks(IDS[g], group=g)
        read = kv.read_blocks_later(IDS[g], group=g)
        kv.win_group(g)[...] = 0
        got = read()
        assert got.shape == want.shape and got.dtype == want.dtype and got.flags.c_contiguous
        np.testing.assert_array_equal(bits(got), bits(want))
        assert kv.later_bytes == 0
        assert kv.read_blocks_later([], group=g)().shape == (0, *kv.group_block_shape(g))
    with pytest.raises(IndexError, match="out of range"):
        kv.read_blocks_later([1, N_BLOCKS])
    assert kv.later_bytes == 0


def test_a_later_read_returns_the_pool_as_it_was():
    check_later_read(CPU)


# ---- tiers ----------------------------------------------------------------------------------

ROOT = b"\x01" * 32


class Counting:
    """Wraps a KVArrays' per-block and bulk moves, recording their calls."""

    def __init__(self, kv: KVArrays, monkeypatch):
        self.calls: list[tuple[str, list[int]]] = []
        for name in ("read_block", "read_blocks", "read_blocks_later", "write_block",
                     "write_blocks"):
            monkeypatch.setattr(kv, name, self._wrap(name, getattr(kv, name)))

    def _wrap(self, name, f):
        def counted(blocks, *a, **k):
            self.calls.append((name, [blocks] if np.ndim(blocks) == 0 else list(blocks)))
            return f(blocks, *a, **k)
        return counted

    def names(self) -> list[str]:
        return [name for name, _ in self.calls]


def computed_chain(pool, kv: KVArrays, n: int) -> tuple[list[int], list[bytes], list[int]]:
    """n full blocks of one sequence in the pool, registered: (tokens, keys, block table)."""
    tokens = list(range(100, 100 + n * BS))
    keys = _core.hash_blocks(ROOT, tokens, BS)
    table = []
    for j in range(n):
        block = pool.allocate(keys[j - 1] if j else ROOT)
        pool.append_tokens(block, tokens[j * BS:(j + 1) * BS])
        pool.register(block, keys[j])
        table.append(block)
    return tokens, keys, table


def test_a_ram_save_reads_its_missing_blocks_at_once(monkeypatch):
    kv = random_pool()
    pool = _core.BlockPool(N_BLOCKS, BS)
    _, keys, table = computed_chain(pool, kv, 6)
    ram = _core.RamTier(1 << 20)
    ram.put_block(keys[2], kv.read_block(table[2]))  # held already: not read again
    tiers = TierManager(pool, kv, BS, ram, None)
    moves = Counting(kv, monkeypatch)
    tiers.pin_prefix(keys, table, 6)
    missing = [table[j] for j in (0, 1, 3, 4, 5)]
    assert moves.calls == [("read_blocks_later", missing), ("read_blocks", missing)]
    tiers.flush()  # the puts and pins run on the saver thread
    assert all(ram.is_pinned(k) for k in keys)
    for j in range(6):
        assert ram.get_block(keys[j]) == kv.read_block(table[j]).tobytes()


def test_a_prefix_pin_leaves_its_puts_and_pins_to_the_saver_thread(monkeypatch):
    """`pin_prefix` copies the blocks RAM lacks out of the pool on the calling thread (the
    engine's) and returns; the RAM puts and the pins run on the saver thread. A second pin
    of the chain while the first one's puts are still queued reads nothing again."""
    import threading  # noqa: PLC0415

    kv = random_pool()
    pool = _core.BlockPool(N_BLOCKS, BS)
    _, keys, table = computed_chain(pool, kv, 6)
    ram = _core.RamTier(1 << 20)
    tiers = TierManager(pool, kv, BS, ram, None)
    gate, threads, put = threading.Event(), [], tiers._put_ram

    def gated_put(*a):
        assert gate.wait(10)
        threads.append(threading.current_thread().name)
        return put(*a)

    monkeypatch.setattr(tiers, "_put_ram", gated_put)
    moves = Counting(kv, monkeypatch)
    tiers.pin_prefix(keys, table, 6)
    tiers.pin_prefix(keys, table, 6)  # another session of the same agent prefix
    assert ram.match_prefix(keys) == 0  # nothing put yet: the saver waits at the gate
    assert moves.calls == [("read_blocks_later", table[:6]), ("read_blocks", table[:6])]
    gate.set()
    tiers.flush()
    assert threads and all(t.startswith("kvshare-save") for t in threads), threads
    assert all(ram.is_pinned(k) for k in keys)
    for j in range(6):
        assert ram.get_block(keys[j]) == kv.read_block(table[j]).tobytes()


@pytest.mark.parametrize("budget_blocks", [0.5, 3])
def test_a_ram_save_keeps_the_blocks_per_block_reads_kept(budget_blocks):
    """Under a budget (3 blocks: the puts evict; half a block: the first put is over budget
    and ends the save) the same blocks end up in RAM as with a read per put."""
    kv = random_pool()
    pool = _core.BlockPool(N_BLOCKS, BS)
    _, keys, table = computed_chain(pool, kv, 6)
    budget = int(budget_blocks * kv.block_nbytes)
    ram, ref = _core.RamTier(budget), _core.RamTier(budget)
    tiers = TierManager(pool, kv, BS, ram, None)
    tiers._save_ram_later(keys, table)
    tiers.flush()
    ref_tiers = TierManager(pool, kv, BS, ref, None)
    ref_tiers._put_ram(keys, ref_tiers._ram_missing(keys), lambda j: kv.read_block(table[j]))
    held = [ram.get_block(k) for k in keys]
    assert held == [ref.get_block(k) for k in keys]
    assert sum(h is not None for h in held) == (3 if budget_blocks == 3 else 0)


def restore_setup(monkeypatch, n: int, free: int | None = None):
    """A chain of n blocks saved to RAM and gone from the pool; `free`: blocks left free (the
    rest held elsewhere). (tiers, kv, tokens, keys, the saved bytes, the moves' counter)."""
    kv = random_pool()
    pool = _core.BlockPool(N_BLOCKS, BS)
    tokens, keys, table = computed_chain(pool, kv, n)
    tiers = TierManager(pool, kv, BS, _core.RamTier(1 << 20), None)
    tiers.pin_prefix(keys, table, n)
    tiers.flush()
    assert tiers.ram.match_prefix(keys) == n
    saved = kv.read_blocks(table)
    pool.release(table)
    pool.evict_all_cached()
    for _ in range(N_BLOCKS - (N_BLOCKS if free is None else free)):
        pool.allocate(ROOT)
    kv.win_group(0)[...] = 0
    return tiers, kv, tokens, keys, saved, Counting(kv, monkeypatch)


@pytest.mark.parametrize("chunk_blocks", [64, 2])
def test_a_restore_installs_each_chunk_with_one_bulk_write(monkeypatch, chunk_blocks):
    import kvshare.engine.cache.tiers as T

    monkeypatch.setattr(T, "CHUNK_BLOCKS", chunk_blocks)
    tiers, kv, tokens, keys, saved, moves = restore_setup(monkeypatch, 5)
    ids = tiers.restore(tokens, keys, 0, ROOT)
    assert len(ids) == 5
    assert moves.names() == ["write_blocks"] * -(-5 // chunk_blocks)
    assert [b for _, blocks in moves.calls for b in blocks] == ids
    np.testing.assert_array_equal(bits(kv.read_blocks(ids)), bits(saved))
    assert [tiers.pool.lookup(k) for k in keys] == ids
    assert [tiers.pool.tokens(b) for b in ids] == [tokens[j * BS:(j + 1) * BS] for j in range(5)]
    tiers.pool.check_invariants()


def test_a_restore_short_of_blocks_keeps_those_it_installed(monkeypatch):
    tiers, kv, tokens, keys, saved, moves = restore_setup(monkeypatch, 5, free=3)
    ids = tiers.restore(tokens, keys, 0, ROOT)
    assert len(ids) == 3 and moves.names() == ["write_blocks"]
    np.testing.assert_array_equal(bits(kv.read_blocks(ids)), bits(saved[:3]))
    assert [tiers.pool.lookup(k) for k in keys] == ids + [None, None]
    assert tiers.pool.available() == 0
    tiers.pool.check_invariants()


def test_a_failed_restore_write_releases_its_blocks(monkeypatch):
    tiers, kv, tokens, keys, _, moves = restore_setup(monkeypatch, 5)

    def fail(blocks, data, group=0):
        raise RuntimeError("device out of memory")

    monkeypatch.setattr(kv, "write_blocks", fail)
    assert tiers.restore(tokens, keys, 0, ROOT) == []
    assert tiers.pool.stats()["used"] == 0 and tiers.pool.available() == N_BLOCKS
    assert [tiers.pool.lookup(k) for k in keys] == [None] * 5
    tiers.pool.check_invariants()


# ---- GPU (a device, or the CPU emulator) ------------------------------------------------------

def gpu() -> Backend:
    from kvshare.backend import get_backend  # noqa: PLC0415

    return get_backend("cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", ["f32", "f16"])
def test_gpu_bulk_moves_equal_per_block_moves(kv_dtype):
    check_bulk_moves(gpu(), kv_dtype)


@pytest.mark.gpu
def test_gpu_bulk_moves_check_every_id_before_moving_anything():
    check_bad_input_moves_nothing(gpu())


@pytest.mark.gpu
@pytest.mark.parametrize("group", [0, 1])
def test_gpu_bulk_read_copies_to_the_host_once_per_chunk(monkeypatch, group):
    """A chunk budget of 3 blocks: 7 blocks come back in 3 device-to-host copies (a copy per
    block would be 7), equal to one unchunked read; chunked writes equal an unchunked one."""
    kv = random_pool(gpu(), "f16")
    ids = [4, 0, 6, 1, 1, 5, 2]
    unchunked = kv.read_blocks(ids, group=group)
    data = random_bytes(np.random.default_rng(3), unchunked.shape, kv.kv_dtype)
    whole = random_pool(gpu(), "f16")
    whole.write_blocks(ids[:-1], data[:-1], group=group)

    monkeypatch.setattr(kv_arrays, "BULK_CHUNK_BYTES",
                        3 * kv.block_nbytes if group == 0 else 3 * kv.win_block_nbytes)
    to_host = Backend.to_host
    copies: list[tuple[int, ...]] = []

    def counted(self, a, out=None):
        copies.append(tuple(a.shape))
        return to_host(self, a, out=out)

    monkeypatch.setattr(Backend, "to_host", counted)
    cupy = sys.modules["cupy"]
    d2h = cupy.COUNTS["d2h"] if hasattr(cupy, "COUNTS") else None  # the emulator's count
    got = kv.read_blocks(ids, group=group)
    assert [c[0] for c in copies] == [3, 3, 1]
    if d2h is not None:
        assert cupy.COUNTS["d2h"] - d2h == 3
    np.testing.assert_array_equal(bits(got), bits(unchunked))

    chunked = random_pool(gpu(), "f16")
    chunked.write_blocks(ids[:-1], data[:-1], group=group)  # 5 distinct ids: chunks of 3 and 2
    for a, b in zip(contents(chunked), contents(whole)):
        np.testing.assert_array_equal(a, b)


def pending_copies() -> int | None:
    """Asynchronous copies the emulator holds pending (None on a device)."""
    cupy = sys.modules["cupy"]
    return len(cupy._PENDING) if hasattr(cupy, "_PENDING") else None


@pytest.mark.gpu
@pytest.mark.parametrize("group", [0, 1])
def test_gpu_write_from_a_staging_buffer_equals_a_write_from_pageable_memory(group):
    """A write from a staging buffer (page-locked: asynchronous copies) leaves the pool as
    the same write from pageable memory does, also when the buffer is refilled and written
    again at once (its next `staging_buffer` waits for the first write's copies)."""
    ids = [4, 0, 6, 1, 5, 2]
    shape = (len(ids), *random_pool().group_block_shape(group))
    want, got = random_pool(gpu(), "f16"), random_pool(gpu(), "f16")
    for seed in (5, 6):
        data = random_bytes(np.random.default_rng(seed), shape, want.kv_dtype)
        want.write_blocks(ids, data, group=group)
        buf = got.staging_buffer(0, data.nbytes)
        staged = buf[:data.nbytes].view(got.kv_dtype).reshape(shape)
        staged[...] = data
        got.write_blocks(ids, staged, group=group)
        if pending_copies() is not None:
            assert pending_copies() > 0, "a staged write waited for its copies"
    for a, b in zip(contents(got), contents(want)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.gpu
def test_gpu_staged_write_that_fails_midway_still_guards_its_buffer(monkeypatch):
    """Chunks of one block: where the second chunk's upload raises, the first chunk's copy
    was queued from the staging buffer, so the buffer's next `staging_buffer` still waits
    for it (the event is recorded on the way out)."""
    kv = random_pool(gpu(), "f16")
    monkeypatch.setattr(kv_arrays, "BULK_CHUNK_BYTES", kv.block_nbytes)
    shape = (3, *kv.block_shape)
    buf = kv.staging_buffer(0, 3 * kv.block_nbytes)
    staged = buf.view(kv.kv_dtype).reshape(shape)
    staged[...] = random_bytes(np.random.default_rng(7), shape, kv.kv_dtype)
    asarray, calls = Backend.asarray, []

    def failing(self, a, dtype=None):
        calls.append(1)
        if len(calls) == 2:
            raise MemoryError("out of memory")
        return asarray(self, a, dtype)

    monkeypatch.setattr(Backend, "asarray", failing)
    with pytest.raises(MemoryError):
        kv.write_blocks([1, 2, 3], staged)
    monkeypatch.setattr(Backend, "asarray", asarray)
    assert kv._staging_done[0] is not None


def pinned_gpu_chain(monkeypatch, n: int = 5, chunk_blocks: int = 2, kv=None):
    """On the device, with restore chunks of `chunk_blocks`: a pool holding a chain of n
    blocks, pinned in a RAM tier. (kv, pool, tiers, tokens, keys, block table, their bytes)."""
    import kvshare.engine.cache.tiers as T  # noqa: PLC0415

    monkeypatch.setattr(T, "CHUNK_BLOCKS", chunk_blocks)
    kv = kv if kv is not None else random_pool(gpu(), "f16")
    pool = _core.BlockPool(N_BLOCKS, BS)
    tokens, keys, table = computed_chain(pool, kv, n)
    saved = kv.read_blocks(table)
    tiers = TierManager(pool, kv, BS, _core.RamTier(1 << 20), None)
    tiers.pin_prefix(keys, table, n)
    tiers.flush()
    return kv, pool, tiers, tokens, keys, table, saved


@pytest.mark.gpu
def test_gpu_staging_without_page_locked_memory_writes_synchronously(monkeypatch):
    """Where the host refuses page-locked memory the staging is pageable and a restore
    still lands, its writes synchronous (nothing pending)."""
    def refused(nbytes):
        raise RuntimeError("cudaErrorMemoryAllocation: out of memory")

    monkeypatch.setattr(sys.modules["cupy"].cuda, "alloc_pinned_memory", refused)
    kv, pool, tiers, tokens, keys, table, saved = pinned_gpu_chain(monkeypatch)
    pool.release(table)
    pool.evict_all_cached()
    kv.win_group(0)[...] = 0
    before = pending_copies()
    table = tiers.restore(tokens, keys, 0, ROOT)
    if before is not None:
        assert pending_copies() == before
    assert not any(kv._staging_pinned) and all(d is None for d in kv._staging_done)
    np.testing.assert_array_equal(bits(kv.read_blocks(table)), bits(saved))


@pytest.mark.gpu
def test_gpu_restore_chunks_stay_within_the_bulk_chunk(monkeypatch):
    """Page-locked staging holds at most `BULK_CHUNK_BYTES` of blocks a slot (here 3 of
    them): a 7-block restore goes in chunks of 3, 3 and 1, where pageable staging (the CPU)
    takes `CHUNK_BLOCKS` at once."""
    kv = random_pool(gpu(), "f16")
    monkeypatch.setattr(kv_arrays, "BULK_CHUNK_BYTES", 3 * kv.block_nbytes)
    assert kv.staging_chunk_blocks(64) == 3 and random_pool().staging_chunk_blocks(64) == 64
    kv, pool, tiers, tokens, keys, table, saved = pinned_gpu_chain(monkeypatch, 7, 64, kv)
    pool.release(table)
    pool.evict_all_cached()
    kv.win_group(0)[...] = 0
    moves = Counting(kv, monkeypatch)
    table = tiers.restore(tokens, keys, 0, ROOT)
    assert [len(blocks) for _, blocks in moves.calls] == [3, 3, 1]
    assert kv._staging and all(b.nbytes == 3 * kv.block_nbytes for b in kv._staging)
    np.testing.assert_array_equal(bits(kv.read_blocks(table)), bits(saved))


@pytest.mark.gpu
def test_gpu_restore_through_a_ring_of_staging_buffers(monkeypatch):
    """Chunks of 2 blocks: a 5-block restore fills the ring's 2 slots and reuses the first
    (after the device read it), twice over; the pool then holds the saved bytes."""
    kv, pool, tiers, tokens, keys, table, saved = pinned_gpu_chain(monkeypatch)
    for _ in range(2):
        pool.release(table)
        pool.evict_all_cached()
        kv.win_group(0)[...] = 0
        table = tiers.restore(tokens, keys, 0, ROOT)
        assert len(table) == 5
        if pending_copies() is not None:
            assert pending_copies() > 0, "the restore waited for its last copies"
        np.testing.assert_array_equal(bits(kv.read_blocks(table)), bits(saved))
    assert len(kv._staging) == 2
    pool.check_invariants()


@pytest.mark.gpu
def test_gpu_later_read_returns_the_pool_as_it_was():
    check_later_read(gpu())


class HostCopies:
    """Records each `cupy.asnumpy` call: (thread name, the stream it was given)."""

    def __init__(self, monkeypatch):
        import threading  # noqa: PLC0415

        cupy = sys.modules["cupy"]
        asnumpy = cupy.asnumpy
        self.calls: list[tuple[str, object]] = []

        def recorded(a, stream=None, *args, **kw):
            self.calls.append((threading.current_thread().name, stream))
            return asnumpy(a, stream, *args, **kw)

        monkeypatch.setattr(cupy, "asnumpy", recorded)


@pytest.mark.gpu
def test_gpu_later_read_leaves_the_copy_to_the_host_to_its_caller(monkeypatch):
    """Asking copies nothing to the host: the caller of the result does, on a non-blocking
    stream of the pool's own; until then the read holds its device copy's bytes."""
    import threading  # noqa: PLC0415

    kv = random_pool(gpu(), "f16")
    want = kv.read_blocks(IDS[0])
    copies = HostCopies(monkeypatch)
    read = kv.read_blocks_later(IDS[0])
    assert copies.calls == [] and kv.later_bytes == len(IDS[0]) * kv.block_nbytes
    kv.win_group(0)[...] = 0
    got: list[np.ndarray] = []
    t = threading.Thread(target=lambda: got.append(read()), name="saver")
    t.start()
    t.join()
    assert len(copies.calls) == 1 and copies.calls[0][0] == "saver"
    # (CuPy's Stream keeps no flag: the pool's copy stream, made non-blocking, not the legacy)
    assert copies.calls[0][1] is kv._copy_stream and kv._copy_stream.ptr != 0
    np.testing.assert_array_equal(bits(got[0]), bits(want))
    assert kv.later_bytes == 0
    with pytest.raises(RuntimeError, match="once"):
        read()


@pytest.mark.gpu
@pytest.mark.parametrize("why", ["over the budget", "out of device memory",
                                 "short of device headroom"])
def test_gpu_later_read_past_its_budget_reads_now(monkeypatch, why):
    """Past `LATER_READ_MAX_BYTES` of device copies held, where the gather's copy cannot be
    allocated, or where it would take over half of what the device can still allocate, the
    blocks are read at once, and the result returns them."""
    kv = random_pool(gpu(), "f16")
    want = kv.read_blocks(IDS[0])
    if why == "over the budget":
        monkeypatch.setattr(kv_arrays, "LATER_READ_MAX_BYTES", 2 * kv.block_nbytes)
        held = kv.read_blocks_later(IDS[0][:2])  # within it: held until taken
        assert kv.later_bytes == 2 * kv.block_nbytes
    elif why == "out of device memory":
        def no_memory(*a):
            raise MemoryError("out of memory allocating 14,336 bytes")

        monkeypatch.setattr(kv, "_gather_later", no_memory)
    else:
        assert kv._device_headroom() > 2 * len(IDS[0]) * kv.block_nbytes
        monkeypatch.setattr(kv, "_device_headroom", lambda: len(IDS[0]) * kv.block_nbytes)
    copies = HostCopies(monkeypatch)
    read = kv.read_blocks_later(IDS[0])
    assert copies.calls and all(stream is None for _, stream in copies.calls)
    kv.win_group(0)[...] = 0
    np.testing.assert_array_equal(bits(read()), bits(want))
    if why == "over the budget":
        np.testing.assert_array_equal(bits(held()), bits(want[:2]))
    assert kv.later_bytes == 0


@pytest.mark.gpu
def test_gpu_later_read_never_taken_gives_its_budget_back():
    """A read whose save was dropped (its result never taken) gives its bytes back when it
    is collected: later reads are not pushed onto the engine thread by a leaked count."""
    import gc  # noqa: PLC0415

    kv = random_pool(gpu(), "f16")
    read = kv.read_blocks_later(IDS[0])
    assert kv.later_bytes == len(IDS[0]) * kv.block_nbytes
    del read
    gc.collect()
    assert kv.later_bytes == 0


@pytest.mark.gpu
def test_gpu_prefix_pin_copies_nothing_to_the_host_on_the_engine_thread(monkeypatch):
    """A prefix pin on the device gathers its blocks and returns: the device-to-host copy
    runs in the saver's job, and RAM then holds the blocks as they were pinned."""
    kv = random_pool(gpu(), "f16")
    pool = _core.BlockPool(N_BLOCKS, BS)
    _, keys, table = computed_chain(pool, kv, 6)
    want = kv.read_blocks(table)
    ram = _core.RamTier(1 << 20)
    tiers = TierManager(pool, kv, BS, ram, None)
    jobs: list = []
    monkeypatch.setattr(tiers, "_submit_save", lambda job, *a: jobs.append(job))
    copies = HostCopies(monkeypatch)
    tiers.pin_prefix(keys, table, 6)
    assert copies.calls == [] and len(jobs) == 1
    kv.win_group(0)[...] = 0
    jobs[0]()
    assert len(copies.calls) == 1
    assert all(ram.is_pinned(k) for k in keys)
    for j in range(6):
        assert ram.get_block(keys[j]) == want[j].tobytes()


@pytest.mark.gpu
def test_gpu_engine_serves_an_evicted_conversation_from_the_ram_tier():
    """End to end on the device: a conversation saved to RAM (bulk reads), pushed out of the
    pool and restored (bulk writes) is back in the pool bit for bit, and continues with the
    greedy tokens of a cold run."""
    from pathlib import Path  # noqa: PLC0415

    from kvshare.engine.api import GenerationRequest, SamplingParams  # noqa: PLC0415
    from kvshare.engine.engine import Engine, EngineConfig  # noqa: PLC0415
    from kvshare.model.chat_template import ChatTemplate  # noqa: PLC0415
    from kvshare.model.loader import load_model  # noqa: PLC0415
    from kvshare.model.tokenizer import Tokenizer  # noqa: PLC0415

    path = Path(__file__).parent / "data" / "models" / "tiny-qwen3-chat.gguf"

    def engine(**kw) -> Engine:
        model = load_model(path, device="cuda")
        tok = Tokenizer.from_gguf(path)
        return Engine(model, tok, ChatTemplate.from_gguf(path, tok),
                      bytes.fromhex(model.fingerprint),
                      EngineConfig(kv_blocks=24, block_size=16, device="cuda",
                                   cache_min_tokens=32, **kw))

    def run(eng: Engine, ids: list[int], n: int = 6) -> list[int]:
        h = eng.submit(GenerationRequest(prompt_tokens=list(ids), max_tokens=n,
                                         ignore_eos=True,
                                         sampling=SamplingParams(temperature=0.0)))
        eng.run_until_idle()
        tokens, _ = h.result(timeout=0)
        return [t.token_id for t in tokens if t.token_id >= 0]

    def chat(eng: Engine, system: str, user: str) -> list[int]:
        return eng.tokenize(f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n"
                            f"{user}<|im_end|>\n<|im_start|>assistant\n")

    system = "You are the build assistant of a large project; answer briefly. " * 4
    cold = engine(cache_ram_mib=0, slot_attach=False)
    first = chat(cold, system, "Describe the build.")
    reply = run(cold, first)
    second = first + reply + cold.tokenize("<|im_end|>\n<|im_start|>user\nAnd then?<|im_end|>\n"
                                           "<|im_start|>assistant\n")
    want = run(cold, second)

    eng = engine(cache_ram_mib=64)
    assert run(eng, first) == reply
    keys = _core.hash_blocks(eng.cache.root_key(None), first, 16)
    computed = eng.kv.read_blocks(eng.pool.match_prefix(keys)[0])
    assert len(computed) == len(keys) >= 8
    for i in range(3):  # other conversations take the pool's blocks
        run(eng, chat(eng, f"Unrelated system prompt number {i}. " * 8, "Hi."), 2)
    assert eng.pool.match_prefix(keys)[0] == [], "the first conversation should be out of the pool"
    assert run(eng, second) == want
    restored = eng.kv.read_blocks(eng.pool.match_prefix(keys)[0])
    np.testing.assert_array_equal(bits(restored), bits(computed))
    ram = eng.snapshot()["tiers"]["ram"]
    assert ram["restores"] >= 1 and ram["blocks_served"] >= len(first) // 16
    eng.pool.check_invariants()


def check_state_snapshot(backend: Backend) -> KVArrays:
    """A snapshot of a slot's state keeps what the slot held when it was taken; a snapshot
    into an earlier one overwrites that one in place; other slots are untouched."""
    kv = KVArrays(config(), 2, BS, backend=backend, n_state_slots=3,
                  state_shapes=[(2, 3, 5), (4, 7)])
    rng = np.random.default_rng(7)
    for s in kv.states:
        s[...] = backend.asarray(rng.standard_normal(s.shape).astype(np.float32))
    def copy(slot):  # (read_state of a CPU pool is a view of the slot)
        return [np.array(a) for a in kv.read_state(slot)]

    before, others = copy(1), [copy(0), copy(2)]
    snap = kv.snapshot_state(1)
    for s in kv.states:
        s[1] = 0
    for got, want in zip(kv.read_snapshot(snap), before):
        np.testing.assert_array_equal(got, want)
    for s in kv.states:
        s[1] = backend.asarray(rng.standard_normal(s.shape[1:]).astype(np.float32))
    now = copy(1)
    assert kv.snapshot_state(1, snap) is snap
    for got, want in zip(kv.read_snapshot(snap), now):
        np.testing.assert_array_equal(got, want)
    for slot, want in zip((0, 2), others):
        for got, w in zip(kv.read_state(slot), want):
            np.testing.assert_array_equal(got, w)
    return kv


def test_a_state_snapshot_keeps_the_state_it_was_taken_of():
    check_state_snapshot(CPU)


@pytest.mark.gpu
def test_gpu_state_snapshot_stays_on_the_device(monkeypatch):
    """On a GPU a snapshot is a device-side copy: taking one copies nothing to the host."""
    check_state_snapshot(gpu())
    kv = KVArrays(config(), 2, BS, backend=gpu(), n_state_slots=2, state_shapes=[(2, 3, 5)])
    copies = HostCopies(monkeypatch)
    snap = kv.snapshot_state(1)
    kv.snapshot_state(0, snap)
    assert copies.calls == []
    assert all(type(a) is type(kv.states[0]) for a in snap)
