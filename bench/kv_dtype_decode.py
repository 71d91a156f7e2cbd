"""Decode speed by KV dtype at one context length, interleaved: each step runs once on every
pool in turn, so the shared machine's drift hits them alike (bench/model_bench.py runs them one
after another, minutes apart).

    python bench/kv_dtype_decode.py [--ctx 6144] [--steps 96] [--threads N] [f16 q8_0 ...]

Prints, per dtype, KV bytes per token, and median / best decode step (batch 1) and its CPU time.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "python"))

from kvshare.backend import set_cpu_threads  # noqa: E402
from kvshare.model.batch import SeqChunk  # noqa: E402
from kvshare.model.loader import default_model_path, load_model  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dtypes", nargs="*", default=["f16", "q8_0"])
    ap.add_argument("--model", default=None)
    ap.add_argument("--ctx", type=int, default=6144)
    ap.add_argument("--steps", type=int, default=96)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    set_cpu_threads(args.threads)
    model = load_model(args.model or default_model_path())
    rng = np.random.default_rng(0)
    hi = min(200000, model.config.vocab_size - 1)
    toks = rng.integers(1000, hi, args.ctx + args.steps).astype(np.int32)
    nb = -(-(args.ctx + args.steps + 1) // 16)
    table = np.arange(nb, dtype=np.int32)
    pools = {}
    for dt in args.dtypes:
        cache = model.new_cache(nb, 16, kv_dtype=dt)
        for s in range(0, args.ctx, 512):
            e = min(args.ctx, s + 512)
            model.forward([SeqChunk(toks[s:e], s, table, "last" if e == args.ctx else "none")],
                          cache)
        pools[dt] = cache
    wall: dict[str, list[float]] = {dt: [] for dt in pools}
    cpu: dict[str, list[float]] = {dt: [] for dt in pools}
    for i in range(args.steps):
        for dt, cache in pools.items():
            w0, c0 = time.perf_counter(), time.process_time()
            model.forward([SeqChunk([int(toks[args.ctx + i])], args.ctx + i, table)], cache)
            wall[dt].append(time.perf_counter() - w0)
            cpu[dt].append(time.process_time() - c0)
    for dt in pools:
        w, c = np.array(wall[dt]), np.array(cpu[dt])
        print(f"{dt:>5}: {model.kv_bytes_per_token(dt):>7} KV bytes/token; decode @ctx {args.ctx} "
              f"(threads {args.threads or 'all'}): {1 / np.median(w):5.1f} tok/s median "
              f"({np.median(w) * 1e3:.1f} ms/step, best {w.min() * 1e3:.1f}, CPU "
              f"{np.median(c) * 1e3:.1f} ms/step)")


if __name__ == "__main__":
    main()
