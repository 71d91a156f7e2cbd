"""gpt-oss attention with sinks: the NumPy tiles (`ops.attention.KERNEL_MAX_ROWS = 0`, the
path sinks took before the kernel had a sink term) against the compiled kernel
(`_core.paged_attention(sinks=)`), in one run.

    python bench/gpt_oss_attention_bench.py [--model tests/data/models/tiny-gpt-oss.gguf]
                                            [--contexts 64,1024,4096] [--steps 16] [--rounds 5]
                                            [--attn-contexts 1024,4096,16384]

Two parts. The model: a decode step (one sequence, batch 1) at each context of `--contexts`,
`--steps` steps per round, the whole forward call (tiny-gpt-oss: 4 layers, 4 query / 2 KV
heads of 32, sliding window 128 on layers 0 and 2, so only its full layers grow with the
context). The attention alone at gpt-oss-20b's shape (64 query heads on 8 KV heads of 64,
an f16 pool of 16-token blocks): one decode row per call at each of `--attn-contexts`, full
and in the 128-token window, with random sinks. Both paths alternate round by round (the
machine is shared and its speed drifts), the best round of each is kept. Table: ms per
step/call and the ratio; JSON to bench/out/gpt_oss_attention_bench.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from functools import partial
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "python"))

import kvshare.ops.attention as attention_mod  # noqa: E402
from kvshare.backend import CPU_THREADS  # noqa: E402
from kvshare.model.batch import SeqChunk  # noqa: E402
from kvshare.model.loader import load_model  # noqa: E402
from kvshare.ops.attention import paged_attention, write_kv  # noqa: E402

OUT = ROOT / "bench" / "out"
PATHS = ("numpy", "kernel")
KERNEL_ROWS = attention_mod.KERNEL_MAX_ROWS


def use(path: str) -> None:
    attention_mod.KERNEL_MAX_ROWS = KERNEL_ROWS if path == "kernel" else 0


def alternate(rounds: int, run) -> dict[str, list[float]]:
    """`run()` seconds per path, `rounds` times each, paths alternating; one warm-up each."""
    times: dict[str, list[float]] = {p: [] for p in PATHS}
    for p in PATHS:
        use(p)
        run()
    for _ in range(rounds):
        for p in PATHS:
            use(p)
            times[p].append(run())
    use("kernel")
    return times


def decode_steps(model, cache, table, token: int, ctx: int, steps: int) -> float:
    """Seconds per decode step at position `ctx`: the same position each time, so every step
    reads `ctx` keys and writes one row."""
    t0 = time.perf_counter()
    for _ in range(steps):
        model.forward([SeqChunk([token], ctx, table, logits="last")], cache)
    return (time.perf_counter() - t0) / steps


def attention_calls(q, kc, vc, table, ctx: int, window: int, sinks, calls: int) -> float:
    """Seconds per `paged_attention` call of one decode row at position `ctx`."""
    t0 = time.perf_counter()
    for _ in range(calls):
        paged_attention(q, kc, vc, table, np.array([0, 1]), np.array([ctx]),
                        scale=q.shape[2] ** -0.5, window=window, sinks=sinks)
    return (time.perf_counter() - t0) / calls


def model_cases(args, rng) -> list[dict]:
    model = load_model(args.model)
    hi = model.config.vocab_size - 1
    bs, rows = 16, []
    for ctx in args.contexts:
        nb = -(-(ctx + 2) // bs)
        cache, table = model.new_cache(nb, bs), np.arange(nb, dtype=np.int32)
        model.forward([SeqChunk(rng.integers(1, hi, ctx).astype(np.int32), 0, table,
                                logits="none")], cache)
        token = int(rng.integers(1, hi))
        step = partial(decode_steps, model, cache, table, token, ctx, args.steps)
        use("numpy")
        a = model.forward([SeqChunk([token], ctx, table, logits="last")], cache)[0]
        use("kernel")
        b = model.forward([SeqChunk([token], ctx, table, logits="last")], cache)[0]
        times = alternate(args.rounds, step)
        rows.append({"case": f"{Path(args.model).stem} decode step, ctx {ctx}",
                     "unit": "ms/step", "times": times,
                     "max_logit_delta": float(np.abs(a - b).max())})
    return rows


def attention_cases(args, rng) -> list[dict]:
    n_head, n_kv, hd, bs = 64, 8, 64, 16
    rows = []
    for ctx in args.attn_contexts:
        nb = -(-(ctx + 1) // bs)
        kc = np.zeros((nb, bs, n_kv, hd), np.float16)
        vc = np.zeros_like(kc)
        write_kv(kc, vc, np.arange(ctx + 1),
                 rng.standard_normal((ctx + 1, n_kv, hd)).astype(np.float32),
                 rng.standard_normal((ctx + 1, n_kv, hd)).astype(np.float32))
        q = rng.standard_normal((1, n_head, hd)).astype(np.float32)
        sinks = rng.standard_normal(n_head).astype(np.float32)
        table = np.arange(nb, dtype=np.int32)[None]
        for window in (0, 128):
            calls = max(2, args.steps * 1024 // max(ctx, 1024))
            call = partial(attention_calls, q, kc, vc, table, ctx, window, sinks, calls)
            times = alternate(args.rounds, call)
            rows.append({"case": f"20b attention row, ctx {ctx}"
                                 + (f", window {window}" if window else ""),
                         "unit": "ms/call", "times": times})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(ROOT / "tests/data/models/tiny-gpt-oss.gguf"))
    ap.add_argument("--contexts", default="64,1024,4096")
    ap.add_argument("--attn-contexts", default="1024,4096,16384")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)
    args.contexts = [int(x) for x in args.contexts.split(",") if x]
    args.attn_contexts = [int(x) for x in args.attn_contexts.split(",") if x]
    rng = np.random.default_rng(0)
    rows = model_cases(args, rng) + attention_cases(args, rng)
    print(f"{CPU_THREADS.kernel_threads} kernel threads, best of {args.rounds} rounds")
    print(f"{'case':<54}{'numpy':>10}{'kernel':>10}{'speed-up':>10}")
    for r in rows:
        a, b = (min(r["times"][p]) * 1e3 for p in PATHS)
        r.update(numpy=a, kernel=b, speedup=a / b)
        print(f"{r['case'] + ' (' + r['unit'] + ')':<54}{a:>10.3f}{b:>10.3f}{a / b:>9.2f}x")
    for r in rows:
        if "max_logit_delta" in r:
            print(f"{r['case']}: max |logit numpy - kernel| {r['max_logit_delta']:.2e}")
    OUT.mkdir(parents=True, exist_ok=True)
    result = {"model": args.model, "threads": CPU_THREADS.kernel_threads,
              "machine": platform.platform(), "rounds": args.rounds, "steps": args.steps,
              "table": [{k: v for k, v in r.items() if k != "times"} for r in rows],
              "round_seconds": {r["case"]: r["times"] for r in rows}}
    path = OUT / "gpt_oss_attention_bench.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
