"""Prefill attention time of one chunk with Gemma 3 270M's attention shapes (4 query heads on
1 KV head, head_dim 256; local layers: sliding window 512, global layers: full causal),
f32 and f16 KV pools: the NumPy tile path (before: `KERNEL_MAX_ROWS = 0`, f16 tiles converted
to f32) against the compiled kernel (`_core.paged_attention`'s tiled path), plus decode rows
for scale.

    python bench/attention_kernels.py [--chunks 1024 4096] [--start 0] [--repeat 3]

Two measurements per case: wall time with the threads of an engine step of that many tokens
(`CPU_THREADS.for_tokens`, row-parallel model: all cores), and the CPU time of the calling
thread on one thread (`set_cpu_threads(1)`: one BLAS thread, one kernel thread), which a
machine shared with other work cannot inflate. Each number is the best of `--repeat` calls.
Prints a table and writes bench/out/attention_kernels.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "python"))

import kvshare.ops.attention as A  # noqa: E402
from kvshare.backend import CPU_THREADS, cpu_count, set_cpu_threads  # noqa: E402
from kvshare.ops.attention import pad_block_tables, paged_attention  # noqa: E402

N_HEAD, N_KV, HD, BS = 4, 1, 256, 16
SCALE = HD ** -0.5


def _case(rng, start: int, n: int, dtype):
    total = start + n
    nb = -(-total // BS)
    table = rng.permutation(nb + 4)[:nb].astype(np.int32)  # shuffled blocks
    kc = (rng.standard_normal((nb + 4, BS, N_KV, HD)) * 0.5).astype(dtype)
    vc = rng.standard_normal((nb + 4, BS, N_KV, HD)).astype(dtype)
    q = rng.standard_normal((n, N_HEAD, HD)).astype(np.float32)
    return q, kc, vc, pad_block_tables([table])


def _time(fn, repeat: int, clock=time.perf_counter) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = clock()
        fn()
        best = min(best, clock() - t0)
    return best


def _both(fn, n: int, repeat: int) -> tuple[float, float]:
    """(wall seconds on an engine step's threads, CPU seconds on one thread)."""
    CPU_THREADS.for_tokens(n, row_parallel=True)
    wall = _time(fn, repeat)
    set_cpu_threads(1)
    try:
        CPU_THREADS.for_tokens(n, row_parallel=True)
        cpu = _time(fn, repeat, time.thread_time)
    finally:
        set_cpu_threads(None)
    return wall, cpu


def run(chunks: list[int], start: int, repeat: int) -> list[dict]:
    rng = np.random.default_rng(0)
    rows = []
    for n in chunks:
        for dtype in (np.float32, np.float16):
            q, kc, vc, bt = _case(rng, start, n, dtype)
            qs, sp = np.array([0, n]), np.array([start])
            for window, kind in ((512, "local"), (0, "global")):
                def call(q=q, kc=kc, vc=vc, bt=bt, qs=qs, sp=sp, window=window, n=n):
                    return paged_attention(q, kc, vc, bt, qs, sp, scale=SCALE, window=window,
                                           parts=CPU_THREADS.for_tokens(n, row_parallel=True))

                saved = A.KERNEL_MAX_ROWS
                A.KERNEL_MAX_ROWS = 0
                try:
                    ref = call()
                    np_wall, np_cpu = _both(call, n, repeat)
                finally:
                    A.KERNEL_MAX_ROWS = saved
                got = call()
                k_wall, k_cpu = _both(call, n, repeat)
                err = float(np.abs(got - ref).max())
                rows.append({"chunk": n, "start": start, "kv": np.dtype(dtype).name,
                             "layer": kind, "window": window,
                             "numpy_wall_ms": np_wall * 1e3, "kernel_wall_ms": k_wall * 1e3,
                             "numpy_cpu1_ms": np_cpu * 1e3, "kernel_cpu1_ms": k_cpu * 1e3,
                             "speedup_wall": np_wall / k_wall, "speedup_cpu1": np_cpu / k_cpu,
                             "max_abs_diff": err})
                print(f"{n:6d} {np.dtype(dtype).name:8s} {kind:7s} {np_wall * 1e3:9.1f} "
                      f"{k_wall * 1e3:9.1f} {np_wall / k_wall:6.2f}x {np_cpu * 1e3:9.1f} "
                      f"{k_cpu * 1e3:9.1f} {np_cpu / k_cpu:6.2f}x {err:9.2e}", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--chunks", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--start", type=int, default=0, help="cached positions before the chunk")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    print(f"{'':24s} {'wall ms, all cores':^27s} {'CPU ms, one thread':^27s}")
    print(f"{'chunk':>6s} {'kv':8s} {'layer':7s} {'numpy':>9s} {'kernel':>9s} {'ratio':>7s} "
          f"{'numpy':>9s} {'kernel':>9s} {'ratio':>7s} {'max|diff|':>9s}")
    rows = run(args.chunks, args.start, args.repeat)
    out = ROOT / "bench/out/attention_kernels.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "shapes": {"n_head": N_HEAD, "n_kv": N_KV, "head_dim": HD, "block_size": BS},
        "cpus": cpu_count(), "loadavg": os.getloadavg(), "machine": platform.processor(),
        "openblas_threads": os.environ.get("OPENBLAS_NUM_THREADS"), "rows": rows}, indent=1))
    print(f"wrote {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
