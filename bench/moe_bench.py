"""Mixture-of-experts step time: the per-expert path (one block-format product per active
expert and matrix from Python) against the grouped kernels (`_core.moe_gate_up` /
`_core.moe_down`: one Rust call per matrix product for the batch), on one model in one run.

    python bench/moe_bench.py [--model PATH] [--layers 2] [--prefill 256] [--chunk 256]
                              [--steps 16] [--rounds 5]

Without `--model` it writes a random `qwen3moe` with Qwen3-30B-A3B's layer shapes (hidden
2048, 32 query / 4 KV heads of 128, 128 experts of FFN 768, 8 per token; llama.cpp's Q4_K_M
mix) but only `--layers` layers and tiny-qwen3moe's small vocabulary, so the step is the
layers' time (`scripts/make_random_gguf.py --size 30b-a3b --layers N`; kept under
bench/out/ for the next run). Decode: one sequence at context 64, `--steps` steps per round;
prefill: a `--prefill`-token prompt in chunks of `--chunk`. Both paths alternate round by
round (the machine is shared and its speed drifts), the best round of each is kept, and the
table gives ms per step / tokens per second and the ratio. JSON to bench/out/moe_bench.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "python"))

from kvshare.backend import CPU_THREADS  # noqa: E402
from kvshare.model.batch import SeqChunk  # noqa: E402
from kvshare.model.loader import load_model  # noqa: E402

OUT = ROOT / "bench" / "out"


def random_model(layers: int) -> Path:
    path = OUT / f"qwen3moe-30b-a3b-{layers}l.gguf"
    if not path.exists():
        OUT.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, str(ROOT / "scripts" / "make_random_gguf.py"),
                        "--arch", "qwen3moe", "--size", "30b-a3b", "--layers", str(layers),
                        "--tokenizer-from", str(ROOT / "tests/data/models/tiny-qwen3moe.gguf"),
                        "--out", str(path)], check=True)
    return path


def set_path(model, grouped: bool, saved: dict) -> None:
    """Switch every MoE layer to the grouped kernels or the per-expert path."""
    for L in model.layers:
        moe = getattr(L, "moe", None)
        if moe is None:
            continue
        if id(moe) not in saved:
            saved[id(moe)] = (moe.stacked_gate_up, moe.stacked_down)
        moe.stacked_gate_up, moe.stacked_down = saved[id(moe)] if grouped else (None, None)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--prefill", type=int, default=256)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)
    path = Path(args.model) if args.model else random_model(args.layers)
    model = load_model(str(path))
    if not any(getattr(L, "moe", None) is not None and L.moe.stacked_gate_up is not None
               for L in model.layers):
        print("this model's MoE layers have no grouped form (see ops/moe.grouped_supported)")
        return 2
    cfg = model.config
    rng = np.random.default_rng(0)
    hi = cfg.vocab_size - 1
    bs = 16
    ctx = 64
    nb_d = -(-(ctx + args.steps + 1) // bs)
    nb_p = -(-args.prefill // bs) + 1
    dcache, ptab = model.new_cache(nb_d, bs), np.arange(nb_p, dtype=np.int32)
    dtab = np.arange(nb_d, dtype=np.int32)
    pcache = model.new_cache(nb_p, bs)
    model.forward([SeqChunk(rng.integers(1, hi, ctx).astype(np.int32), 0, dtab,
                            logits="none")], dcache)
    prompt = rng.integers(1, hi, args.prefill).astype(np.int32)
    saved: dict = {}
    times = {p: {"decode": [], "prefill": []} for p in ("per_expert", "grouped")}

    def decode() -> float:
        t0 = time.perf_counter()
        for pos in range(ctx, ctx + args.steps):
            model.forward([SeqChunk([int(rng.integers(1, hi))], pos, dtab, logits="last")],
                          dcache)
        return (time.perf_counter() - t0) / args.steps

    def prefill() -> float:
        t0 = time.perf_counter()
        n = len(prompt)
        for s in range(0, n, args.chunk):
            e = min(n, s + args.chunk)
            model.forward([SeqChunk(prompt[s:e], s, ptab,
                                    logits="last" if e == n else "none")], pcache)
        return time.perf_counter() - t0

    for p in ("per_expert", "grouped"):  # warm-up: every weight read once
        set_path(model, p == "grouped", saved)
        decode()
        prefill()
    for _ in range(args.rounds):
        for p in ("per_expert", "grouped"):
            set_path(model, p == "grouped", saved)
            times[p]["decode"].append(decode())
            times[p]["prefill"].append(prefill())
    set_path(model, True, saved)

    best = {p: {c: min(v) for c, v in cases.items()} for p, cases in times.items()}
    n_moe = sum(getattr(L, "moe", None) is not None for L in model.layers)
    print(f"model {path.name}: {n_moe} MoE layers, {cfg.extra.get('expert_count')} experts, "
          f"{cfg.extra.get('expert_used_count')} per token, "
          f"{CPU_THREADS.kernel_threads} kernel threads, best of {args.rounds} rounds")
    print(f"{'case':<34}{'per-expert':>12}{'grouped':>12}{'speed-up':>10}")
    rows = []
    for case, unit in (("decode", "ms/step"), ("prefill", "tok/s")):
        a, b = best["per_expert"][case], best["grouped"][case]
        if case == "decode":
            va, vb = a * 1e3, b * 1e3
            label = f"decode, batch 1, ctx {ctx} ({unit})"
        else:
            va, vb = args.prefill / a, args.prefill / b
            label = f"prefill {args.prefill} (chunk {args.chunk}) ({unit})"
        print(f"{label:<34}{va:>12.2f}{vb:>12.2f}{a / b:>9.2f}x")
        rows.append({"case": case, "unit": unit, "per_expert": va, "grouped": vb,
                     "speedup": a / b})
    OUT.mkdir(parents=True, exist_ok=True)
    result = {
        "model": str(path), "moe_layers": n_moe, "threads": CPU_THREADS.kernel_threads,
        "machine": platform.platform(), "rounds": args.rounds, "steps": args.steps,
        "prefill_tokens": args.prefill, "chunk": args.chunk, "table": rows,
        "round_seconds": times,
    }
    (OUT / "moe_bench.json").write_text(json.dumps(result, indent=1))
    print(f"wrote {OUT / 'moe_bench.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
