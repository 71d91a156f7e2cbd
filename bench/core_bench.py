"""Micro-benchmarks of the Rust cache core through its Python binding (kvshare._core).

Measures, on the CPU only:
- hashing throughput: `hash_blocks` over a 32K-token prompt (NumPy int64 and list input);
- hash + longest-prefix lookup of a 32K-token prompt against a pool pre-populated with that
  prompt's blocks (`hash_blocks` + `BlockPool.match_prefix`; target <= 2 ms);
- block pool allocate/release ops per second (single calls, and batched tables of 64 blocks);
- RAM tier put/get bandwidth for 1 MiB block payloads.

If `bench/core_bench_disk.py` exists and defines `run(results: dict)`, it is called to add the
disk-store rows (disk write/read MB/s of a 256 MiB entry, restore into NumPy).

    python bench/core_bench.py            # full run
    python bench/core_bench.py --quick    # fewer repetitions

Prints a table and writes bench/out/core_bench.json.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from kvshare import _core

OUT = Path(__file__).parent / "out"
BLOCK_SIZE = 16
PROMPT_TOKENS = 32 * 1024
LOOKUP_TARGET_MS = 2.0


def timed(fn, repeat: int) -> list[float]:
    """Wall-clock seconds of `repeat` calls of fn (after one warm-up call)."""
    fn()
    out = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def summary_ms(samples: list[float]) -> dict:
    s = sorted(samples)
    return {
        "median_ms": statistics.median(s) * 1e3,
        "min_ms": s[0] * 1e3,
        "p90_ms": s[min(len(s) - 1, int(0.9 * len(s)))] * 1e3,
        "n": len(s),
    }


def prompt_tokens(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256_000, size=n, dtype=np.int64)


def bench_hashing(results: dict, repeat: int) -> None:
    root = _core.root_key(b"bench-model", "f16", BLOCK_SIZE)
    toks = prompt_tokens(PROMPT_TOKENS)
    as_list = toks.tolist()
    for label, arg in (("numpy", toks), ("list", as_list)):
        s = summary_ms(timed(lambda arg=arg: _core.hash_blocks(root, arg, BLOCK_SIZE), repeat))
        s["tokens_per_s"] = PROMPT_TOKENS / (s["median_ms"] / 1e3)
        results[f"hash_blocks_32k_{label}"] = s
    # the core alone: prefix_key returns one key (no list of 2048 bytes objects to build)
    s = summary_ms(timed(lambda: _core.prefix_key(root, toks, BLOCK_SIZE), repeat))
    s["tokens_per_s"] = PROMPT_TOKENS / (s["median_ms"] / 1e3)
    results["prefix_key_32k_numpy"] = s


def populated_pool(root: bytes, toks: np.ndarray):
    n_blocks = len(toks) // BLOCK_SIZE
    pool = _core.BlockPool(n_blocks + 64, BLOCK_SIZE)
    keys = _core.hash_blocks(root, toks, BLOCK_SIZE)
    parent = root
    for i, key in enumerate(keys):
        b = pool.allocate(parent)
        pool.append_tokens(b, toks[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE])
        pool.register(b, key)
        parent = key
    # an idle prefix: every block cached (ref 0) in the LRU, as after its sessions ended
    pool.release(list(range(len(keys))))
    return pool, keys


def bench_lookup(results: dict, repeat: int) -> None:
    root = _core.root_key(b"bench-model", "f16", BLOCK_SIZE)
    toks = prompt_tokens(PROMPT_TOKENS)
    pool, keys = populated_pool(root, toks)
    as_list = toks.tolist()
    for label, arg in (("numpy", toks), ("list", as_list)):
        def lookup(arg=arg):
            ids, n = pool.match_prefix(_core.hash_blocks(root, arg, BLOCK_SIZE))
            assert n == PROMPT_TOKENS

        s = summary_ms(timed(lookup, repeat))
        s["target_ms"] = LOOKUP_TARGET_MS
        s["meets_target"] = s["median_ms"] <= LOOKUP_TARGET_MS
        results[f"hash_and_lookup_32k_{label}"] = s
    s = summary_ms(timed(lambda: pool.match_prefix(keys), repeat))
    results["lookup_only_32k"] = s


def bench_alloc_free(results: dict, repeat: int) -> None:
    root = _core.root_key(b"bench-model", "f16", BLOCK_SIZE)
    pool = _core.BlockPool(4096, BLOCK_SIZE)
    n = 20_000

    def single():
        for _ in range(n):
            b = pool.allocate(root)
            pool.release([b])

    samples = timed(single, max(3, repeat // 10))
    med = statistics.median(samples)
    results["alloc_release_single"] = {"ops_per_s": 2 * n / med, "pairs": n, "median_s": med}

    table_len, tables = 64, 300

    def batched():
        for _ in range(tables):
            t = [pool.allocate(root) for _ in range(table_len)]
            pool.release(t)

    samples = timed(batched, max(3, repeat // 10))
    med = statistics.median(samples)
    ops = tables * (table_len + 1)  # 64 allocate calls + one release call per table
    results["alloc_64_release_table"] = {
        "blocks_per_s": tables * table_len / med,
        "calls_per_s": ops / med,
        "median_s": med,
    }
    pool.check_invariants()


def bench_ram_tier(results: dict, repeat: int) -> None:
    mib = 1 << 20
    n_entries = 64
    ram = _core.RamTier(n_entries * mib)
    payload = np.random.default_rng(0).integers(0, 255, size=mib, dtype=np.uint8)
    keys = [i.to_bytes(32, "little") for i in range(n_entries)]
    fresh = iter(range(n_entries, 1 << 62))

    def put_all():
        # steady state: the tier is full, so every put of a new key also evicts the LRU entry
        for _ in range(n_entries):
            ram.put_block(next(fresh).to_bytes(32, "little"), payload)

    out = np.empty(mib, dtype=np.uint8)

    def get_all():
        for k in keys:
            ram.get_block_into(k, out)

    reps = max(3, repeat // 10)
    put = statistics.median(timed(put_all, reps))
    for k in keys:
        ram.put_block(k, payload)
    get = statistics.median(timed(get_all, reps))
    results["ram_put_1mib"] = {"mb_per_s": n_entries * mib / put / 1e6, "entries": n_entries}
    results["ram_get_into_1mib"] = {"mb_per_s": n_entries * mib / get / 1e6, "entries": n_entries}
    ram.check_invariants()


def run_disk_hook(results: dict) -> None:
    """Disk rows come from bench/core_bench_disk.py (the disk store's own file) if present."""
    path = Path(__file__).with_name("core_bench_disk.py")
    if not path.exists():
        results["disk"] = {"skipped": "bench/core_bench_disk.py not present"}
        return
    spec = importlib.util.spec_from_file_location("core_bench_disk", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.run(results)


def print_table(results: dict) -> None:
    rows = []
    for name, r in results.items():
        if not isinstance(r, dict) or name == "meta":
            continue
        cells = []
        for key in ("median_ms", "p90_ms", "tokens_per_s", "ops_per_s", "blocks_per_s",
                    "calls_per_s", "mb_per_s", "meets_target", "skipped"):
            if key in r:
                v = r[key]
                if isinstance(v, bool):
                    cells.append(f"{key}={'yes' if v else 'NO'}")
                elif isinstance(v, float):
                    cells.append(f"{key}={v:,.3f}" if v < 100 else f"{key}={v:,.0f}")
                else:
                    cells.append(f"{key}={v}")
        extra = [f"{k}={v}" for k, v in r.items() if k.endswith("_mb_s") or k.endswith("_MBps")]
        rows.append((name, "  ".join(cells + extra)))
    width = max(len(n) for n, _ in rows)
    print(f"{'benchmark'.ljust(width)}  result")
    print("-" * (width + 60))
    for name, text in rows:
        print(f"{name.ljust(width)}  {text}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer repetitions")
    ap.add_argument("--out", type=Path, default=OUT / "core_bench.json")
    args = ap.parse_args(argv)
    repeat = 10 if args.quick else 50

    results: dict = {
        "meta": {
            "python": sys.version.split()[0],
            "machine": platform.machine(),
            "processor": platform.processor() or platform.machine(),
            "kvshare_core": _core.__version__,
            "block_size": BLOCK_SIZE,
            "prompt_tokens": PROMPT_TOKENS,
            "repeat": repeat,
            "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        }
    }
    bench_hashing(results, repeat)
    bench_lookup(results, repeat)
    bench_alloc_free(results, repeat)
    bench_ram_tier(results, repeat)
    run_disk_hook(results)

    print_table(results)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2, default=str))
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
