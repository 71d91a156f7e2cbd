"""kvshare._core.DiskStore end to end through the binding: round trip into NumPy buffers,
dedup, corruption, typed errors, eviction, queue drops, locking, concurrent threads."""

import hashlib
import threading
import time

import numpy as np
import pytest

from kvshare import _core
from kvshare._core import CacheIoError, CorruptEntry, DiskStore, InvalidArgument, KvshareError

FP = b"model-fingerprint-for-tests"
BLOCK = 4096  # bytes per block in these tests


def chain(name: str, n: int) -> list[bytes]:
    """Chain keys: each depends on the previous one, like real block keys."""
    keys, prev = [], b""
    for i in range(n):
        prev = hashlib.blake2b(prev + f"{name}/{i}".encode(), digest_size=32).digest()
        keys.append(prev)
    return keys


def payload(keys: list[bytes]) -> np.ndarray:
    """[n, BLOCK] uint8, a pure function of each key."""
    rows = [np.frombuffer(hashlib.shake_256(k).digest(BLOCK), dtype=np.uint8) for k in keys]
    return np.stack(rows) if rows else np.zeros((0, BLOCK), np.uint8)


def ckpt(keys: list[bytes], i: int) -> tuple[int, bytes, str, np.ndarray]:
    data = np.frombuffer(hashlib.shake_256(b"ck" + keys[i]).digest(1000), dtype=np.uint8)
    return ((i + 1) * 16, keys[i], "conv f32[250]", data)


def open_store(path, **kw) -> DiskStore:
    args = dict(budget_bytes=1 << 30, ttl_seconds=None, min_tokens=0, queue_depth=16)
    args.update(kw)
    return DiskStore(path, FP, **args)


@pytest.fixture
def store(tmp_path):
    s = open_store(tmp_path / "cache")
    yield s
    s.close()


def test_round_trip_into_numpy(store):
    keys = chain("a", 8)
    data = payload(keys)
    assert store.submit(keys, data, BLOCK, tokens=128, checkpoints=[ckpt(keys, 3), ckpt(keys, 7)])
    store.flush()
    n, nbytes, ck = store.lookup(chain("a", 12))
    assert (n, nbytes) == (8, 8 * BLOCK)
    assert ck == (128, keys[7], "conv f32[250]", 1000)
    out = np.empty((8, BLOCK), dtype=np.uint8)
    assert store.read_blocks(keys, out) == 8
    np.testing.assert_array_equal(out, data)
    # Any writable contiguous buffer works; as many whole blocks as fit are read.
    ba = bytearray(3 * BLOCK + 5)
    assert store.read_blocks(keys, ba) == 3
    assert bytes(ba[: 3 * BLOCK]) == data[:3].tobytes()
    f16 = np.empty((2, BLOCK // 2), dtype=np.float16)  # any dtype: bytes are bytes
    assert store.read_blocks(keys, f16) == 2
    assert f16.tobytes() == data[:2].tobytes()
    pos, layout, blob = store.read_checkpoint(keys[3])
    assert (pos, layout, blob) == (64, "conv f32[250]", ckpt(keys, 3)[3].tobytes())
    assert store.read_checkpoint(keys[4]) is None
    cands = [((i + 1) * 16, k) for i, k in enumerate(keys)]
    assert store.lookup_checkpoint(cands, 100)[0] == 64
    assert store.lookup_checkpoint(cands, 10) is None
    assert store.lookup(chain("b", 4))[:2] == (0, 0)
    s = store.stats()
    assert (s["entries"], s["blocks"], s["checkpoints"], s["writes"]) == (1, 8, 2, 1)
    assert (s["hits"], s["misses"]) == (1, 1)
    assert s["bytes_read"] == (8 + 3 + 2) * BLOCK + 1000
    on_disk = sum(p.stat().st_size for p in store.path.iterdir() if p.name != ".lock")
    assert s["bytes_on_disk"] == on_disk == s["bytes_written"]
    assert set(s) >= {
        "dropped_writes", "evictions_ttl", "evictions_budget", "evictions_corrupt", "bytes_written", "queued",
    }


def test_write_dedup_parents_and_reopen(tmp_path):
    keys = chain("a", 12)
    data = payload(keys)
    with open_store(tmp_path) as s:
        parent = s.write(keys[:8], data[:8], BLOCK, 128)
        assert isinstance(parent, bytes) and len(parent) == 32
        assert s.write(keys[:8], data[:8], BLOCK, 128) is None  # already stored
        n = s.stored_prefix(keys)
        assert n == 8
        # payload_from: only the tail is passed; per-block lengths work too.
        child = s.write(keys, data[n:], [BLOCK] * 4, 192, payload_from=n)
        (kv_child,) = [p for p in s.path.iterdir() if p.name == child.hex() + ".kv"]
        assert kv_child.stat().st_size == 4 * BLOCK
        info = {e["key"]: e for e in s.entries()}
        assert info[child]["deps"] == [parent] and info[child]["n_blocks"] == 12
    with open_store(tmp_path) as s:  # reopen
        out = np.zeros((12, BLOCK), np.uint8)
        assert s.read_blocks(keys, out) == 12
        np.testing.assert_array_equal(out, data)


def test_flipped_byte_raises_corrupt_entry(store):
    keys = chain("a", 4)
    key = store.write(keys, payload(keys), BLOCK, 64)
    kv = store.path / f"{key.hex()}.kv"
    raw = bytearray(kv.read_bytes())
    raw[5000] ^= 0x01
    kv.write_bytes(bytes(raw))
    out = np.full((4, BLOCK), 7, dtype=np.uint8)
    with pytest.raises(CorruptEntry):
        store.read_blocks(keys, out)
    assert not out.any(), "no bytes of a corrupt entry reach the caller"
    assert issubclass(CorruptEntry, KvshareError)
    assert store.lookup(keys)[0] == 0
    assert not kv.exists() and not (store.path / f"{key.hex()}.idx").exists()
    s = store.stats()
    assert (s["evictions_corrupt"], s["entries"], s["bytes_on_disk"]) == (1, 0, 0)


def test_flipped_checkpoint_and_truncated_file(tmp_path):
    keys = chain("a", 4)
    with open_store(tmp_path) as s:
        key = s.write(keys, payload(keys), BLOCK, 64, checkpoints=[ckpt(keys, 3)])
    ck = tmp_path / f"{key.hex()}.ckpt"
    raw = bytearray(ck.read_bytes())
    raw[-1] ^= 0x80
    ck.write_bytes(bytes(raw))
    with open_store(tmp_path) as s:
        with pytest.raises(CorruptEntry):
            s.read_checkpoint(keys[3])
        assert s.stats()["entries"] == 0
        key = s.write(keys, payload(keys), BLOCK, 64)
    kv = tmp_path / f"{key.hex()}.kv"
    kv.write_bytes(kv.read_bytes()[:-1])  # truncated: found by the sweep at open
    with open_store(tmp_path) as s:
        assert s.lookup(keys)[0] == 0
        assert s.stats()["swept_files"] == 2
        assert not kv.exists()


def test_argument_errors(store):
    keys = chain("a", 2)
    with pytest.raises(InvalidArgument):
        store.submit([b"short"], payload(keys[:1]), BLOCK, 16)
    with pytest.raises(InvalidArgument):
        store.submit(keys, payload(keys), BLOCK + 1, 32)  # lengths do not add up
    with pytest.raises(InvalidArgument):
        store.write(keys, payload(keys[1:]), BLOCK, 32, payload_from=1)  # block 0 not stored
    store.write(keys, payload(keys), BLOCK, 32)
    with pytest.raises(BufferError):
        store.read_blocks(keys, bytes(2 * BLOCK))  # read-only
    with pytest.raises((BufferError, ValueError)):  # numpy says ValueError
        store.read_blocks(keys, np.zeros((2 * BLOCK, 2), np.uint8)[:, 0])  # not contiguous
    with pytest.raises(TypeError):
        store.lookup([1, 2, 3])


def test_fingerprint_isolation(tmp_path):
    keys = chain("a", 3)
    with open_store(tmp_path) as s:
        s.write(keys, payload(keys), BLOCK, 48)
    with DiskStore(tmp_path, b"another model", 1 << 30, None, 0) as other:
        assert other.lookup(keys)[0] == 0
        assert other.stats()["entries"] == 0
    with open_store(tmp_path) as s:
        assert s.lookup(keys)[0] == 3


def test_ttl_budget_and_min_tokens(tmp_path):
    keys_a, keys_b, keys_c = chain("a", 4), chain("b", 4), chain("c", 4)
    with open_store(tmp_path / "ttl", ttl_seconds=0.5) as s:
        s.write(keys_a, payload(keys_a), BLOCK, 64)
        time.sleep(1.1)
        assert s.lookup(keys_a)[0] == 0
        assert s.stats()["evictions_ttl"] == 1
    with open_store(tmp_path / "budget", budget_bytes=9 * BLOCK, min_tokens=32) as s:
        assert s.write(keys_a[:1], payload(keys_a[:1]), BLOCK, 16) is None  # under min_tokens
        assert s.stats()["skipped_small"] == 1
        s.write(keys_a, payload(keys_a), BLOCK, 64)
        time.sleep(0.01)
        s.write(keys_b, payload(keys_b), BLOCK, 64)
        time.sleep(0.01)
        s.lookup(keys_a)  # a is now more recent than b
        time.sleep(0.01)
        s.write(keys_c, payload(keys_c), BLOCK, 64)
        st = s.stats()
        assert st["bytes_on_disk"] <= 9 * BLOCK and st["evictions_budget"] == 1
        assert [s.stored_prefix(k) for k in (keys_a, keys_b, keys_c)] == [4, 0, 4]
        with pytest.raises(_core.OverBudget):
            big = chain("big", 12)
            s.write(big, payload(big), BLOCK, 192)


def test_full_queue_drops_and_counts(tmp_path):
    with open_store(tmp_path, queue_depth=1) as s:
        big = np.zeros((1, 8 << 20), np.uint8)
        results = [s.submit(chain(f"q{i}", 1), big, 8 << 20, 16) for i in range(30)]
        s.flush()
        st = s.stats()
        assert results.count(False) > 0
        assert st["dropped_writes"] == results.count(False)
        assert st["writes"] == results.count(True) == st["entries"]


def test_one_store_per_directory_and_close(tmp_path):
    s = open_store(tmp_path)
    with pytest.raises(CacheIoError):
        open_store(tmp_path)
    keys = chain("a", 2)
    assert s.submit(keys, payload(keys), BLOCK, 32)
    s.close()  # drains the queue
    with pytest.raises(InvalidArgument):
        s.lookup(keys)
    assert s.submit(keys, payload(keys), BLOCK, 32) is False
    with open_store(tmp_path) as again:
        assert again.lookup(keys)[0] == 2
    assert "DiskStore(" in repr(again)


def test_concurrent_threads(tmp_path):
    store = open_store(tmp_path, budget_bytes=200 * BLOCK, queue_depth=64)
    shared = chain("shared", 16)
    store.write(shared[:8], payload(shared[:8]), BLOCK, 128)
    errors: list[BaseException] = []

    def worker(t: int) -> None:
        try:
            rng = np.random.default_rng(t)
            for i in range(40):
                name = f"t{t}-{i % 5}"
                n = int(rng.integers(1, 12))
                keys = chain(name, n)
                store.submit(keys, payload(keys), BLOCK, n * 16)
                # Extend the shared prefix from several threads at once.
                m = int(rng.integers(8, 17))
                have = store.stored_prefix(shared[:m])
                store.submit(shared[:m], payload(shared[have:m]), BLOCK, m * 16, payload_from=have)
                if i % 7 == 0:
                    store.flush()
                for probe in (keys, shared):
                    got, nbytes, _ = store.lookup(probe)
                    if got == 0:
                        continue
                    # The writer thread may commit or evict between lookup and read, so the
                    # read is bounded by the buffer (got blocks), not by the earlier lookup.
                    out = np.empty((got, BLOCK), np.uint8)
                    k = store.read_blocks(probe, out)
                    assert k <= got
                    np.testing.assert_array_equal(out[:k], payload(probe[:k]))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    store.flush()
    assert not errors, errors
    s = store.stats()
    assert s["writes"] > 0 and s["evictions_corrupt"] == 0 and s["bytes_on_disk"] <= 200 * BLOCK
    assert s["failed_writes"] + s["writes"] + s["skipped_existing"] + s["dropped_writes"] >= 1
    store.close()
