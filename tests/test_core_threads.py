"""Concurrent use of the binding from several Python threads: shared pool, store, RAM tier and
checkpoint account stay consistent, and hashing releases the GIL."""

import gc
import threading
import time

import numpy as np

from kvshare import _core

BS = 16
N_THREADS = 8


def test_threads_share_pool_store_and_ram_tier():
    pool = _core.BlockPool(96, BS)
    acct = _core.CheckpointAccount()
    store = _core.CheckpointStore(acct)
    ram = _core.RamTier(64 * 1024, acct)
    root = _core.root_key(b"fp", "f16", BS)
    system = np.arange(5 * BS, dtype=np.int64)  # a shared "system prompt" of 5 blocks
    barrier = threading.Barrier(N_THREADS)
    errors = []
    counts = {"matched": 0, "out_of_blocks": 0}
    lock = threading.Lock()

    def worker(tid):
        rng = np.random.default_rng(tid)
        try:
            barrier.wait()
            for it in range(60):
                user = rng.integers(0, 100, size=int(rng.integers(1, 3 * BS)))
                prompt = np.concatenate([system, user])
                keys = _core.hash_blocks(root, prompt, BS)
                table = []
                try:
                    # match + acquire in one step: nobody can evict the blocks in between
                    ids, n = pool.acquire_prefix(keys)
                    table = list(ids)
                    assert n == len(ids) * BS
                    if ids:
                        assert [pool.lookup(k) for k in keys[: len(ids)]] == ids
                        with lock:
                            counts["matched"] += 1
                    pos = len(table) * BS
                    parent = keys[len(table) - 1] if table else root
                    while pos < len(prompt):
                        b = pool.allocate(parent)
                        table.append(b)
                        chunk = prompt[pos : pos + BS]
                        pool.append_tokens(b, chunk)
                        if len(chunk) == BS:
                            got = pool.register(b, keys[pos // BS])
                            if got != b:
                                # swap to the registered twin if it is still there
                                swapped = pool.acquire_prefix([keys[pos // BS]])[0]
                                if swapped:
                                    pool.release([b])
                                    table[-1] = swapped[0]
                            parent = keys[pos // BS]
                        pos += len(chunk)
                    assert all(pool.ref_count(b) >= 1 for b in table)
                    # checkpoint at the end of the prompt, held by the store and the RAM tier
                    c = _core.Checkpoint.at(root, prompt, BS, rng.bytes(256), account=acct)
                    c = store.insert(c)
                    ram.put_checkpoint(c)
                    ram.put_block(keys[0], system[:BS].tobytes())
                    assert ram.get_block(keys[0]) in (None, system[:BS].tobytes())
                    if it % 7 == 0:
                        store.remove(c.key)
                except _core.OutOfBlocks:
                    with lock:
                        counts["out_of_blocks"] += 1
                finally:
                    pool.release(table)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(N_THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert counts["matched"] > 0
    pool.check_invariants()
    store.check_invariants()
    ram.check_invariants()
    st = pool.stats()
    assert st["used"] == 0 and st["shared"] == 0 and st["tokens_held"] == 0
    assert st["cached"] + st["free"] == st["total"]
    pool.evict_all_cached()
    assert pool.stats()["free"] == pool.n_blocks
    # accounting: the distinct checkpoints held by the store or the RAM tier, each once
    gc.collect()
    held = []
    for key in set(store.keys()) | {key for kind, key in ram.lru_order() if kind == "checkpoint"}:
        for ck in (store.get(key), ram.get_checkpoint(key)):
            if ck is not None and not any(ck.same(h) for h in held):
                held.append(ck)
    assert acct.live_count == len(held) > 0
    assert acct.live_bytes == sum(h.nbytes for h in held)
    assert ram.held_bytes <= ram.budget
    del held, ck
    store_keys = store.keys()
    for key in store_keys:
        store.remove(key)
    ram.clear()
    gc.collect()
    assert (acct.live_count, acct.live_bytes) == (0, 0)


def test_concurrent_hashing_gives_identical_keys():
    root = _core.root_key(b"fp", "f16", BS)
    toks = np.random.default_rng(1).integers(0, 50000, size=8192)
    expect = _core.hash_blocks(root, toks, BS)
    results = [None] * N_THREADS

    def worker(i):
        for _ in range(20):
            got = _core.hash_blocks(root, toks, BS)
            if got != expect:
                results[i] = False
                return
        results[i] = True

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(N_THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(results)


def test_hashing_releases_the_gil():
    """While one thread hashes a long prompt, another Python thread keeps running."""
    root = _core.root_key(b"fp", "f16", BS)
    toks = np.random.default_rng(2).integers(0, 50000, size=4_000_000, dtype=np.int32)
    for _attempt in range(3):
        stamps = []
        done = threading.Event()

        def ticker(done=done, stamps=stamps):
            while not done.is_set():
                stamps.append(time.perf_counter())

        t = threading.Thread(target=ticker)
        t.start()
        time.sleep(0.01)
        t0 = time.perf_counter()
        _core.prefix_key(root, toks, BS)
        t1 = time.perf_counter()
        done.set()
        t.join()
        inside = [s for s in stamps if t0 <= s <= t1]
        gaps = np.diff([t0, *inside, t1])
        # With the GIL held for the whole hash, the ticker could not run at all inside the call
        # (one gap ~ the whole call). Released: it ticks throughout.
        if len(inside) > 100 and gaps.max() < 0.5 * (t1 - t0):
            return
    raise AssertionError(f"no progress while hashing: {len(inside)} ticks, max gap {gaps.max():.4f}s of {t1 - t0:.4f}s")
