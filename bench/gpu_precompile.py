"""Compile every kernel module for this machine's GPU at once, a process per module (per
part, for the modules compiled one part per GGUF block type: `kvshare.kernels.parts`), into
CuPy's on-disk kernel cache (`~/.cupy/kernel_cache`, or `$CUPY_CACHE_DIR`).

kvshare compiles a kernel module (or part) with NVRTC the first time a process launches one
of its kernels, and CuPy keeps the result on disk for every later process. On a fresh machine
(a device check's) the tests and benches, which between them run every block type, would
otherwise pay for them one after another, inside their own steps' time limits. Run first by
`bench/gpu_check.sh`:

    python bench/gpu_precompile.py [--jobs N]

Prints the slowest compile times, and exits 1 if any module or part failed.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import time
import traceback


def compile_part(unit: tuple[str, str | None]) -> tuple[str, float, str | None]:
    """(what, seconds, error or None): load one kernel of a module's part, which compiles it."""
    name, part = unit
    what = name if part is None else f"{name}[{part or 'untyped'}]"
    t0 = time.perf_counter()
    try:
        from kvshare import kernels  # noqa: PLC0415

        kernels.load_module(name, part).get_function(kernels.entry_points(name, part)[0])
    except Exception:  # noqa: BLE001 - reported per part
        return what, time.perf_counter() - t0, traceback.format_exc(limit=3)
    return what, time.perf_counter() - t0, None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args()
    from kvshare import kernels  # noqa: PLC0415

    names = kernels.module_names()
    units = [(name, part) for name in names for part in kernels.parts(name)]
    t0 = time.perf_counter()
    # spawn: each worker initialises CUDA itself (the parent never touches the device)
    with mp.get_context("spawn").Pool(max(1, min(args.jobs, len(units)))) as pool:
        results = pool.map(compile_part, units, chunksize=1)
    failed = 0
    for i, (what, seconds, error) in enumerate(sorted(results, key=lambda r: -r[1])):
        if error or i < 12:
            print(f"{what:<26} {seconds:6.1f} s{'  FAILED' if error else ''}")
        if error:
            failed += 1
            print(error, file=sys.stderr)
    print(f"{len(names)} modules in {time.perf_counter() - t0:.1f} s ({len(units)} parts, "
          f"{args.jobs} jobs), {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
