"""Decode-size products with a 2048 x 2048 quantized weight, three kernels: `block_matmul_t`
(GGUF blocks, activations rounded to 8 bits), `block_matmul_t_f32` (GGUF blocks, f32
activations: exact up to summation order) and the older `qmatmul_t` (weights expanded to int8 +
f32 group scales, f32 activations). Best-of-`reps` wall time for m = 1, 4, 16 rows on one
thread and on all kernel threads, and the max error against the f64 product (relative to
sum |x w|). Prints a table and writes bench/out/block_exact.json. Short by design: run it once.

    python bench/block_exact.py [--reps 15] [--types Q4_K,Q6_K,Q8_0,Q5_0]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import time
from functools import partial
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q, quants

from kvshare import _core
from kvshare.backend import CPU_THREADS
from kvshare.model.weights import split_quantized

N = K = 2048
F16_FIELDS = {Q.Q4_K: [0, 2], Q.Q5_K: [0, 2], Q.Q6_K: [208], Q.Q8_0: [0], Q.Q4_0: [0],
              Q.Q5_0: [0], Q.Q4_1: [0, 2], Q.Q5_1: [0, 2]}


def random_blocks(t: Q, rng: np.random.Generator) -> np.ndarray:
    bs, ts = GGML_QUANT_SIZES[t]
    nb = N * K // bs
    blocks = rng.integers(0, 256, (nb, ts), dtype=np.uint8)
    for off in F16_FIELDS[t]:
        d = rng.uniform(1e-3, 1e-2, nb).astype(np.float16)
        blocks[:, off : off + 2] = d.view(np.uint8).reshape(nb, 2)
    return blocks.reshape(N, -1)


def best_time(fn, reps: int) -> float:
    """Least wall seconds of `fn()` over `reps` calls (after 2 warm-up calls)."""
    for _ in range(2):
        fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--types", default="Q4_K,Q6_K,Q8_0,Q5_0")
    ap.add_argument("--out", default=str(Path(__file__).parent / "out" / "block_exact.json"))
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    all_threads = max(1, CPU_THREADS.kernel_threads)
    kernels = ("q8 act", "f32 act", "int8 split")
    print(f"{N} x {K} weight, best of {args.reps}, threads 1 and {all_threads}, load average "
          f"{os.getloadavg()[0]:.1f}; us per call (max error / sum|xw|)")
    header = f"{'type':6} {'rows':>4} {'thr':>3} " + " ".join(f"{k:>20}" for k in kernels)
    print(header)
    print("-" * len(header))
    results = []
    for name in args.types.split(","):
        t = Q[name]
        raw = random_blocks(t, rng)
        raw.setflags(write=False)  # as a view into the mapped file is
        qs, scale, mins, group = split_quantized(raw, t, (N, K))
        dense = np.asarray(quants.dequantize(raw, t), np.float32).astype(np.float64)
        for m in (1, 4, 16):
            x = rng.standard_normal((m, K)).astype(np.float32)
            ref = x.astype(np.float64) @ dense.T
            mag = np.abs(x).astype(np.float64) @ np.abs(dense).T
            out = np.empty((m, N), np.float32)
            for threads in sorted({1, all_threads}):
                calls = {
                    "q8 act": partial(_core.block_matmul_t, x, raw, int(t), out, threads),
                    "f32 act": partial(_core.block_matmul_t_f32, x, raw, int(t), out, threads),
                    "int8 split": partial(_core.qmatmul_t, x, qs, scale, mins, out, group,
                                          threads),
                }
                row = {"type": name, "rows": m, "threads": threads}
                cells = []
                for kname, fn in calls.items():
                    s = best_time(fn, args.reps)
                    err = float((np.abs(out - ref) / mag).max())
                    row[kname] = {"best_us": s * 1e6, "max_rel_err": err}
                    cells.append(f"{s * 1e6:9.1f} ({err:7.1e})")
                results.append(row)
                print(f"{name:6} {m:4d} {threads:3d} " + " ".join(f"{c:>20}" for c in cells))
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps({"n": N, "k": K, "reps": args.reps,
                                    "load_average": os.getloadavg()[0],
                                    "machine": platform.processor() or platform.machine(),
                                    "results": results}, indent=1))
    print(f"wrote {out_path}")


if __name__ == "__main__":
    main()
