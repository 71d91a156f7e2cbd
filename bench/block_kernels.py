"""Decode-size products with a 2048 x 2048 quantized weight: `BlockWeight` (GGUF blocks read
in place) against `QWeight` (int8 + f32 group scales/mins), bytes per weight held and read,
time per `matmul_t` for 1, 4 and 16 activation rows (wall time on the kernel threads, and
CPU time on one thread), and the error against the f32 product (relative to sum |w x|). Prints a table and writes
bench/out/block_kernels.json. Short by design (a few seconds): run it once, not in a loop.

    python bench/block_kernels.py [--reps 50] [--types Q4_K,Q6_K,Q8_0]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q

from kvshare.backend import CPU_THREADS
from kvshare.model.weights import split_quantized
from kvshare.ops.blockweight import BlockWeight
from kvshare.ops.linear import QWeight

N = K = 2048
F16_FIELDS = {Q.Q4_K: [0, 2], Q.Q5_K: [0, 2], Q.Q6_K: [208], Q.Q8_0: [0], Q.Q4_0: [0]}


def random_blocks(t: Q, rng: np.random.Generator) -> np.ndarray:
    bs, ts = GGML_QUANT_SIZES[t]
    nb = N * K // bs
    blocks = rng.integers(0, 256, (nb, ts), dtype=np.uint8)
    for off in F16_FIELDS[t]:
        d = rng.uniform(1e-3, 1e-2, nb).astype(np.float16)
        blocks[:, off : off + 2] = d.view(np.uint8).reshape(nb, 2)
    return blocks.reshape(N, -1)


def qweight_bytes(w: QWeight) -> int:
    return w.qs.nbytes + w.scale.nbytes + (0 if w.mins is None else w.mins.nbytes)


def time_call(fn, reps: int, clock=time.perf_counter) -> tuple[float, float]:
    """(median, min) seconds of `fn()` over `reps` calls (after 3 warm-up calls)."""
    for _ in range(3):
        fn()
    ts = []
    for _ in range(reps):
        t0 = clock()
        fn()
        ts.append(clock() - t0)
    return float(np.median(ts)), float(np.min(ts))


def cpu_time_1thread(fn, reps: int) -> float:
    """Least thread CPU seconds of `fn()` on one kernel thread: robust on a shared, loaded
    machine where wall times of the multi-threaded call wait for descheduled workers."""
    saved = CPU_THREADS.kernel_threads
    CPU_THREADS.kernel_threads = 1
    try:
        return time_call(fn, reps, time.thread_time)[1]
    finally:
        CPU_THREADS.kernel_threads = saved


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--types", default="Q4_K,Q6_K,Q8_0")
    ap.add_argument("--out", default=str(Path(__file__).parent / "out" / "block_kernels.json"))
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    results = []
    header = (f"{'type':6} {'rows':>4} {'form':10} {'B/weight':>8} {'MB read':>8} "
              f"{'wall med us':>11} {'wall min us':>11} {'GB/s':>6} {'1-thr CPU us':>12} "
              f"{'max rel err':>11}")
    print(f"{N} x {K} weight, {CPU_THREADS.kernel_threads} kernel threads, load average "
          f"{os.getloadavg()[0]:.1f}")
    print(header)
    print("-" * len(header))
    for name in args.types.split(","):
        t = Q[name]
        raw = random_blocks(t, rng)
        raw.setflags(write=False)  # as a view into the mapped file is
        bw = BlockWeight(raw, int(t), K, activations="q8")
        qw = QWeight(*split_quantized(raw, t, (N, K)))
        dense = bw.dequantize()
        forms = [("block", bw, bw.nbytes), ("int8+f32", qw, qweight_bytes(qw))]
        for m in (1, 4, 16):
            x = rng.standard_normal((m, K)).astype(np.float32)
            ref = x @ dense.T
            scale = np.abs(x) @ np.abs(dense).T
            for form, w, nbytes in forms:
                out = np.empty((m, N), np.float32)
                def call(w=w, x=x, out=out):
                    w.matmul_t(x, out=out)

                med, best = time_call(call, args.reps)
                cpu1 = cpu_time_1thread(call, args.reps)
                err = float((np.abs(out - ref) / scale).max())
                row = {"type": name, "rows": m, "form": form, "bytes_per_weight": nbytes / (N * K),
                       "bytes_read": nbytes, "wall_median_us": med * 1e6,
                       "wall_min_us": best * 1e6, "gb_per_s_at_min": nbytes / best / 1e9,
                       "cpu_us_1_thread": cpu1 * 1e6, "max_rel_err": err}
                results.append(row)
                print(f"{name:6} {m:4d} {form:10} {row['bytes_per_weight']:8.3f} "
                      f"{nbytes / 1e6:8.2f} {med * 1e6:11.1f} {best * 1e6:11.1f} "
                      f"{row['gb_per_s_at_min']:6.2f} {cpu1 * 1e6:12.1f} {err:11.2e}")
    # the prefill path: a whole weight dequantized to f32 (tiles of it feed BLAS)
    deq = []
    print(f"\n{'type':6} {'form':10} {'dequantize 1-thr CPU ms':>24}")
    for name in args.types.split(","):
        t = Q[name]
        raw = random_blocks(t, rng)
        bw = BlockWeight(raw, int(t), K, activations="q8")
        qw = QWeight(*split_quantized(raw, t, (N, K)))
        for form, w in (("block", bw), ("int8+f32", qw)):
            ms = cpu_time_1thread(lambda w=w: w.dequantize(0, N), max(3, args.reps // 10)) * 1e3
            deq.append({"type": name, "form": form, "cpu_ms_1_thread": ms})
            print(f"{name:6} {form:10} {ms:24.2f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"n": N, "k": K, "threads": CPU_THREADS.kernel_threads,
                               "load_average": os.getloadavg()[0],
                               "machine": platform.processor() or platform.machine(),
                               "results": results, "dequantize": deq}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
