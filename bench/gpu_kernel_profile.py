"""Where a GPU step's device time goes: per kernel, for a decode step at batch 1 and 32 (1K
context) and a 1,024-token prefill chunk, measured on eager steps (CUDA graphs off) with a
pair of CUDA events around each launch (`gpu_runtime.kernel_profile`), beside the step's
whole device time eager and as a CUDA graph.

A long-running kernel is queued before each measured step, so the host's launches wait in
the stream's queue and the device runs them back to back, as a graph replay does: an event
pair then times its kernel, not the host's launch gap. The step's total minus its kernels is
CuPy's own launches (elementwise ops, copies) plus any idle time left; the graph's total
against the eager one says what the graph saves on the device.

    python bench/gpu_kernel_profile.py --model q15.gguf [--ctx 1024] [--batches 1,32]
                                       [--prefill 1024] [--reps 3] [--out FILE.json]

With KVSHARE_GPU_WEIGHTS=blocks for issue 40's setting (bench/gpu_check.sh runs it). On the
CPU emulator (tests/gpu_emu) it runs end to end with every time 0: a check of its plumbing.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "python"))
sys.path.insert(0, str(ROOT / "bench"))

from gpu_bench import decode_cache  # noqa: E402

from kvshare.model.batch import SeqChunk  # noqa: E402
from kvshare.model.loader import load_model  # noqa: E402
from kvshare.ops import gpu_runtime as rt  # noqa: E402
from kvshare.ops import gpu_sampling  # noqa: E402

SPIN_SRC = r"""
extern "C" __global__ void kvs_spin(unsigned long long ns) {
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    } while (t - t0 < ns);
}
"""


class Spinner:
    """A one-thread kernel that keeps the device busy for `ms` milliseconds (by the
    device's global timer; `fn` None where it does not run: the emulator)."""

    def __init__(self, cp):
        self.cp = cp
        try:
            self.fn = cp.RawKernel(SPIN_SRC, "kvs_spin")
            self.fn((1,), (1,), (np.uint64(1000),))
        except Exception as e:  # noqa: BLE001 - the emulator has no %globaltimer
            print(f"no spin kernel ({type(e).__name__}): times include the host's launch gaps",
                  flush=True)
            self.fn = None

    def __call__(self, ms: float) -> None:
        if self.fn is not None:
            self.fn((1,), (1,), (np.uint64(int(ms * 1e6)),))


def _step_fn(model, kind: str, batch: int, ctx: int, rng):
    """A function running one step of `kind` ("decode" at `batch`, or "prefill" of `ctx`
    tokens) on its own cache, the same positions at every call (the step rewrites its KV)."""
    nbs = -(-(ctx + 2) // 16) + 1
    vocab = model.config.vocab_size
    if kind == "prefill":
        cache = model.new_cache(nbs, 16)
        table = np.arange(nbs)
        toks = rng.integers(0, vocab, ctx).astype(np.int32)
        return lambda: model.forward([SeqChunk(toks, 0, table, logits="last")], cache)
    cache, tables = decode_cache(model, batch, ctx, 2, rng)
    nxt = rng.integers(0, vocab, batch).astype(np.int32)

    def decode():
        # as served: the device sampler picks greedy tokens from the device logits (launched;
        # the ids are not read back here, so the step does not wait for the device)
        outs = model.forward([SeqChunk(nxt[i : i + 1], ctx, tables[i]) for i in range(batch)],
                             cache)
        return gpu_sampling.launch_rows([gpu_sampling.RowSpec(logits=o[0], greedy=True)
                                         for o in outs])

    return decode


def _device_ms(cp, spin: Spinner, step, reps: int, spin_ms: float) -> float:
    """Device milliseconds per call of `step`, its launches queued behind a spin."""
    total = 0.0
    for _ in range(reps):
        spin(spin_ms)
        a, b = cp.cuda.Event(), cp.cuda.Event()
        a.record()
        step()
        b.record()
        b.synchronize()
        total += float(cp.cuda.get_elapsed_time(a, b))
    return total / reps


def profile(model, cp, spin: Spinner, kind: str, batch: int, ctx: int, reps: int, rng,
            spin_ms: float) -> dict:
    model.logits_on_device = True
    try:
        model.cuda_graphs = False
        step = _step_fn(model, kind, batch, ctx, rng)
        for _ in range(2):  # compiles, cuBLAS heuristics, launch attributes
            step()
        eager_ms = _device_ms(cp, spin, step, reps, spin_ms)
        with rt.kernel_profile() as prof:  # the spin is not timed: not through rt.kernel
            for _ in range(reps):
                spin(spin_ms)
                step()
                prof.collect()  # waits: the next rep's launches queue behind its own spin
            kernels = prof.collect()
        model.cuda_graphs = True
        gstep = _step_fn(model, kind, batch, ctx, rng)
        for _ in range(3):  # a prefill shape is captured at its second step
            gstep()
        graph_ms = _device_ms(cp, spin, gstep, reps, spin_ms)
    finally:
        model.cuda_graphs = None
        model.logits_on_device = False
    rows = sorted(((name, c / reps, ms / reps) for name, (c, ms) in kernels.items()),
                  key=lambda r: -r[2])
    summed = sum(r[2] for r in rows)
    return {"kind": kind, "batch": batch, "ctx": ctx, "eager_ms": round(eager_ms, 4),
            "graph_ms": round(graph_ms, 4), "kernels_ms": round(summed, 4),
            "kernels": [{"name": n, "calls": c, "ms": round(ms, 4)} for n, c, ms in rows]}


def print_profile(p: dict) -> None:
    what = (f"decode batch {p['batch']} at context {p['ctx']}" if p["kind"] == "decode" else
            f"prefill {p['ctx']} tokens")
    print(f"\n{what}: device {p['eager_ms']:.3f} ms eager, {p['graph_ms']:.3f} ms as a graph; "
          f"timed kernels {p['kernels_ms']:.3f} ms", flush=True)
    print(f"  {'kernel':<34} {'calls':>6} {'us/step':>9} {'share':>6}")
    base = p["eager_ms"] or 1.0
    for k in p["kernels"]:
        print(f"  {k['name']:<34} {k['calls']:6.0f} {k['ms'] * 1e3:9.1f} "
              f"{100 * k['ms'] / base:5.1f}%")
    rest = p["eager_ms"] - p["kernels_ms"]
    print(f"  {'(CuPy ops, copies, idle)':<34} {'':6} {rest * 1e3:9.1f} {100 * rest / base:5.1f}%",
          flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="GGUF path")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--ctx", type=int, default=1024, help="decode context length")
    ap.add_argument("--batches", default="1,32", help="decode batch sizes")
    ap.add_argument("--prefill", type=int, default=1024, help="prefill chunk tokens (0: none)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--spin-ms", type=float, default=80.0,
                    help="device milliseconds queued before each measured step")
    ap.add_argument("--out", default=None, help="JSON output file")
    args = ap.parse_args()
    model = load_model(args.model, device=args.device)
    if not model.backend.is_gpu:
        raise SystemExit("gpu_kernel_profile: needs --device cuda")
    cp = rt.cupy_module()
    spin = Spinner(cp)
    rng = np.random.default_rng(0)
    out = {"model": str(args.model),
           "gpu_weights": os.environ.get("KVSHARE_GPU_WEIGHTS", "f16").strip().lower(),
           "spin": spin.fn is not None, "profiles": []}
    work = [("decode", int(b), args.ctx) for b in args.batches.split(",") if b]
    if args.prefill:
        work.append(("prefill", 1, args.prefill))
    for kind, b, n in work:
        p = profile(model, cp, spin, kind, b, n, args.reps, rng, args.spin_ms)
        out["profiles"].append(p)
        print_profile(p)
        if args.out:  # after each profile: a timed-out run keeps what it measured
            Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
