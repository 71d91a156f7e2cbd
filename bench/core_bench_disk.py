"""Disk-store benchmark through the binding (kvshare._core.DiskStore).

Rows (one 256 MiB entry = 2048 blocks of 128 KiB, i.e. a 32K-token prompt at 128 KiB/block):
- disk_write_256mib: `write` (copy from NumPy, blake3 per block, write, fsync, rename, commit);
- disk_submit_flush_256mib: the same through the background writer (`submit` + `flush`);
- disk_read_warm_256mib: `read_blocks` into a preallocated NumPy array, files in page cache;
- disk_read_cold_256mib: the same after dropping the files from the page cache (fadvise);
- disk_restore_numpy_256mib: lookup + allocate + read + verify into a fresh NumPy array.

    python bench/core_bench_disk.py          # prints a table, writes bench/out/core_bench_disk.json

`bench/core_bench.py` calls `run(results)` to add these rows to its own report.
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from kvshare import _core

OUT = Path(__file__).parent / "out"
BLOCK_BYTES = 128 << 10
N_BLOCKS = 2048  # 256 MiB
TOKENS_PER_BLOCK = 16
MIB = 1 << 20


def _keys(name: str, n: int) -> list[bytes]:
    keys, prev = [], b""
    for i in range(n):
        prev = hashlib.blake2b(prev + f"{name}/{i}".encode(), digest_size=32).digest()
        keys.append(prev)
    return keys


def _drop_page_cache(path: Path) -> None:
    for p in path.iterdir():
        if p.suffix in (".kv", ".ckpt", ".idx"):
            fd = os.open(p, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def run(results: dict, repeat: int = 3) -> None:
    """Adds the disk rows to `results` (name -> dict with mb_per_s and median_ms)."""
    nbytes = N_BLOCKS * BLOCK_BYTES
    rng = np.random.default_rng(0)
    payload = rng.integers(0, 256, size=(N_BLOCKS, BLOCK_BYTES), dtype=np.uint8)
    with tempfile.TemporaryDirectory(prefix="kvshare-disk-bench-") as tmp:
        store = _core.DiskStore(Path(tmp) / "cache", b"bench", 1 << 40, None, 0, queue_depth=4)
        try:
            def row(name: str, secs: list[float], **extra) -> None:
                med = statistics.median(secs)
                results[name] = {
                    "mb_per_s": nbytes / med / 1e6,
                    "median_ms": med * 1e3,
                    "min_ms": min(secs) * 1e3,
                    "n": len(secs),
                    "bytes": nbytes,
                    **extra,
                }

            writes, submits, chains = [], [], []
            for r in range(repeat):
                keys = _keys(f"w{r}", N_BLOCKS)
                t0 = time.perf_counter()
                assert store.write(keys, payload, BLOCK_BYTES, N_BLOCKS * TOKENS_PER_BLOCK) is not None
                writes.append(time.perf_counter() - t0)
                chains.append(keys)
                keys = _keys(f"s{r}", N_BLOCKS)
                t0 = time.perf_counter()
                assert store.submit(keys, payload, BLOCK_BYTES, N_BLOCKS * TOKENS_PER_BLOCK)
                store.flush()
                submits.append(time.perf_counter() - t0)
            row("disk_write_256mib", writes)
            row("disk_submit_flush_256mib", submits)

            out = np.empty((N_BLOCKS, BLOCK_BYTES), dtype=np.uint8)
            warm = []
            for r in range(repeat):
                t0 = time.perf_counter()
                assert store.read_blocks(chains[r], out) == N_BLOCKS
                warm.append(time.perf_counter() - t0)
            assert np.array_equal(out, payload)
            row("disk_read_warm_256mib", warm)

            cold = []
            for r in range(repeat):
                _drop_page_cache(store.path)
                t0 = time.perf_counter()
                assert store.read_blocks(chains[r], out) == N_BLOCKS
                cold.append(time.perf_counter() - t0)
            row("disk_read_cold_256mib", cold, note="page cache dropped with posix_fadvise")

            restore = []
            for r in range(repeat):
                _drop_page_cache(store.path)
                t0 = time.perf_counter()
                n, total, _ = store.lookup(chains[r])
                arr = np.empty((n, BLOCK_BYTES), dtype=np.uint8)
                assert store.read_blocks(chains[r][:n], arr) == n == N_BLOCKS and total == nbytes
                restore.append(time.perf_counter() - t0)
            row("disk_restore_numpy_256mib", restore, note="cold: lookup + np.empty + read + verify")
            results["disk_store_stats"] = store.stats()
        finally:
            store.close()


def main() -> int:
    results: dict = {"meta": {"python": sys.version.split()[0], "kvshare_core": _core.__version__,
                              "entry_mib": N_BLOCKS * BLOCK_BYTES // MIB, "block_bytes": BLOCK_BYTES,
                              "time": time.strftime("%Y-%m-%dT%H:%M:%S")}}
    run(results)
    print(f"{'benchmark':28}  {'MB/s':>8}  {'median ms':>10}")
    print("-" * 52)
    for name, r in results.items():
        if isinstance(r, dict) and "mb_per_s" in r:
            print(f"{name:28}  {r['mb_per_s']:8,.0f}  {r['median_ms']:10,.1f}")
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / "core_bench_disk.json"
    path.write_text(json.dumps(results, indent=2, default=str))
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
