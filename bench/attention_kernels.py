"""Prefill attention time of one chunk with Gemma 3 270M's attention shapes (4 query heads on
1 KV head, head_dim 256; local layers: sliding window 512, global layers: full causal),
f32 and f16 KV pools: the NumPy tile path (before: `KERNEL_MAX_ROWS = 0`, f16 tiles converted
to f32) against the compiled kernel (`_core.paged_attention`'s tiled path), plus decode rows
for scale.

    python bench/attention_kernels.py [--chunks 1024 4096] [--start 0] [--repeat 3]

Threads as in an engine step of that many tokens (`CPU_THREADS.for_tokens`, row-parallel
model). Each number is the best of `--repeat` calls. Prints a table and writes
bench/out/attention_kernels.json.
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
from kvshare.backend import CPU_THREADS, cpu_count  # noqa: E402
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


def _time(fn, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def run(chunks: list[int], start: int, repeat: int) -> list[dict]:
    rng = np.random.default_rng(0)
    rows = []
    for n in chunks:
        parts = CPU_THREADS.for_tokens(n, row_parallel=True)
        for dtype in (np.float32, np.float16):
            q, kc, vc, bt = _case(rng, start, n, dtype)
            qs, sp = np.array([0, n]), np.array([start])
            for window, kind in ((512, "local"), (0, "global")):
                def call(q=q, kc=kc, vc=vc, bt=bt, qs=qs, sp=sp, window=window):
                    return paged_attention(q, kc, vc, bt, qs, sp, scale=SCALE, window=window,
                                           parts=parts)

                saved = A.KERNEL_MAX_ROWS
                A.KERNEL_MAX_ROWS = 0
                try:
                    ref = call()
                    t_np = _time(call, repeat)
                finally:
                    A.KERNEL_MAX_ROWS = saved
                got = call()
                t_k = _time(call, repeat)
                err = float(np.abs(got - ref).max())
                rows.append({"chunk": n, "start": start, "kv": np.dtype(dtype).name,
                             "layer": kind, "window": window, "numpy_ms": t_np * 1e3,
                             "kernel_ms": t_k * 1e3, "speedup": t_np / t_k,
                             "max_abs_diff": err})
                print(f"{n:6d} {np.dtype(dtype).name:8s} {kind:7s} {t_np * 1e3:10.1f} "
                      f"{t_k * 1e3:10.1f} {t_np / t_k:8.2f}x {err:10.2e}", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--chunks", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--start", type=int, default=0, help="cached positions before the chunk")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    print(f"{'chunk':>6s} {'kv':8s} {'layer':7s} {'numpy ms':>10s} {'kernel ms':>10s} "
          f"{'speedup':>9s} {'max|diff|':>10s}")
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
