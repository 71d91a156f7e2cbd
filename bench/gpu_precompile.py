"""Compile every kernel module for this machine's GPU at once, a process per module, into
CuPy's on-disk kernel cache (`~/.cupy/kernel_cache`, or `$CUPY_CACHE_DIR`).

kvshare compiles a kernel module with NVRTC the first time a process launches one of its
kernels, and CuPy keeps the result on disk for every later process. On a fresh machine (a
device check's) the first test or bench that touches the block kernels would otherwise pay
for them one after another, inside its own step's time limit: the largest modules take tens
of seconds each. Run first by `bench/gpu_check.sh`:

    python bench/gpu_precompile.py [--jobs N]

Prints each module's compile time, slowest first, and exits 1 if any module failed.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import time
import traceback


def compile_module(name: str) -> tuple[str, float, str | None]:
    """(module, seconds, error or None): load one kernel of the module, which compiles it."""
    t0 = time.perf_counter()
    try:
        from kvshare import kernels  # noqa: PLC0415

        kernels.get_function(name, kernels.entry_points(name)[0])
    except Exception:  # noqa: BLE001 - reported per module
        return name, time.perf_counter() - t0, traceback.format_exc(limit=3)
    return name, time.perf_counter() - t0, None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args()
    from kvshare import kernels  # noqa: PLC0415

    names = kernels.module_names()
    t0 = time.perf_counter()
    # spawn: each worker initialises CUDA itself (the parent never touches the device)
    with mp.get_context("spawn").Pool(max(1, min(args.jobs, len(names)))) as pool:
        results = pool.map(compile_module, names)
    failed = 0
    for name, seconds, error in sorted(results, key=lambda r: -r[1]):
        print(f"{name:<22} {seconds:6.1f} s{'  FAILED' if error else ''}")
        if error:
            failed += 1
            print(error, file=sys.stderr)
    print(f"{len(names)} modules in {time.perf_counter() - t0:.1f} s ({args.jobs} jobs), "
          f"{failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
