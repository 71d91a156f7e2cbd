"""Decode mat-vec on GGUF block weights, the two designs side by side on a GPU: `bmv`
(kernels/blocks.cu: weights decoded to float32 in registers, float32 activations; the
default) and `mmvq` (kernels/mmvq.cu, llama.cpp's design: activations quantized on the device
to 8-bit q8_1 blocks, integer dot products with __dp4a; `KVSHARE_GPU_MATVEC=q8`). The mmvq
time includes `quantize_q8_1`, which is also timed alone.

Shapes: the products of one decode step of a Qwen3-1.7B-shaped Q4_K_M model (n_embd 2048):
q|k|v (2048 + 1024 + 1024 rows; Q4_K, Q4_K, Q6_K), attn_output (2048 x 2048 Q4_K), gate|up
(2 x 6144 rows Q4_K), down (2048 x 6144 Q6_K), output (151936 x 2048 Q6_K); random blocks
made on the device (sane f16 scales). m = 1, 4, 8 activation rows. Each time is the mean of
`--iters` back-to-back calls between two CUDA events (after warm-up calls); GB/s counts the
weight bytes read once per call. `rel_diff` is max|y_mmvq - y_bmv| / max|y_bmv| (the 8-bit
rounding of the activations: a few 1e-3 on these random weights, not 1).

    python bench/gpu_matvec_bench.py [--iters 200] [--out bench/out/gpu_matvec_bench.json]

Needs a CUDA device and CuPy; without them it says so on one line and exits with status 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]

# name -> (k, [(GGML type name, rows), ...]) for one decode step's products
SHAPES: dict[str, tuple[int, list[tuple[str, int]]]] = {
    "qkv": (2048, [("Q4_K", 2048), ("Q4_K", 1024), ("Q6_K", 1024)]),
    "attn_output": (2048, [("Q4_K", 2048)]),
    "gate_up": (2048, [("Q4_K", 6144), ("Q4_K", 6144)]),
    "down": (6144, [("Q6_K", 2048)]),
    "output": (2048, [("Q6_K", 151936)]),
}
M_VALUES = (1, 4, 8)
# byte offsets of the f16 scale fields of the benched types (set to a sane value)
F16_FIELDS = {"Q4_K": (0, 2), "Q6_K": (208,)}


def random_weight(cp, gpu_blocks, k: int, parts: list[tuple[str, int]], rng_seed: int):
    """A GpuBlockWeight of random blocks made on the device (no host copy of the output
    matrix's 250 MB)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q  # noqa: PLC0415

    cp.random.seed(rng_seed)
    built = []
    for tname, n in parts:
        qt = Q[tname]
        qk, size = GGML_QUANT_SIZES[qt]
        nb = n * (k // qk)
        raw = cp.random.randint(0, 256, size=(nb, size), dtype=np.uint8)
        for off in F16_FIELDS[tname]:
            v = (cp.random.uniform(1e-3, 5e-2, nb)).astype(np.float16).view(np.uint8)
            raw[:, off : off + 2] = v.reshape(nb, 2)
        built.append((raw.reshape(n, -1), int(qt), k))
    return gpu_blocks.GpuBlockWeight.from_parts(built)


def event_ms(cp, iters: int, fn, *fargs, **kw) -> float:
    """Mean ms of fn(*fargs, **kw) over `iters` back-to-back calls, timed by CUDA events."""
    for _ in range(5):
        fn(*fargs, **kw)
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    start.record()
    for _ in range(iters):
        fn(*fargs, **kw)
    stop.record()
    stop.synchronize()
    return cp.cuda.get_elapsed_time(start, stop) / iters


def gbs(mb: float, ms: float) -> float:
    """GB/s of `mb` megabytes read in `ms` milliseconds."""
    return mb / ms if ms > 0 else float("nan")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--out", default=str(ROOT / "bench" / "out" / "gpu_matvec_bench.json"))
    args = ap.parse_args()

    try:
        from kvshare.backend import get_backend  # noqa: PLC0415

        be = get_backend("cuda")
        import cupy as cp  # noqa: PLC0415
    except Exception as exc:  # no CuPy, no driver, no device
        print(f"gpu_matvec_bench: needs a CUDA device and CuPy ({type(exc).__name__}: {exc})",
              file=sys.stderr)
        return 2
    from kvshare.ops import gpu_blocks, gpu_mmvq  # noqa: PLC0415

    dev = cp.cuda.runtime.getDeviceProperties(cp.cuda.runtime.getDevice())
    name = dev["name"].decode() if isinstance(dev["name"], bytes) else str(dev["name"])
    results: dict = {"device": name, "iters": args.iters, "rows": []}
    print(f"device: {name}; ms per product (mean of {args.iters}), GB/s of weight bytes")
    print(f"{'product':<12} {'m':>2} {'MB':>7} {'bmv ms':>8} {'GB/s':>6} {'mmvq ms':>8} "
          f"{'GB/s':>6} {'quant ms':>8} {'mmvq/bmv':>8} {'rel_diff':>8}")
    rng = np.random.default_rng(0)
    for si, (pname, (k, parts)) in enumerate(SHAPES.items()):
        w = random_weight(cp, gpu_blocks, k, parts, si)
        n = w.shape[0]
        mb = w.nbytes / 1e6
        for m in M_VALUES:
            x = cp.asarray(rng.standard_normal((m, k)).astype(np.float32))
            y_b = cp.empty((m, n), np.float32)
            y_q = cp.empty((m, n), np.float32)
            t_b = event_ms(cp, args.iters, gpu_blocks.linear, x, w, out=y_b)
            t_q = event_ms(cp, args.iters, gpu_mmvq.linear, x, w, out=y_q)
            t_z = event_ms(cp, args.iters, gpu_mmvq.quantize_q8_1, x)
            ref = float(cp.abs(y_b).max())
            rel = float(cp.abs(y_q - y_b).max()) / ref if ref > 0 else float("nan")
            row = {"product": pname, "m": m, "k": k, "n": n, "weight_mb": round(mb, 3),
                   "types": [t for t, _ in parts], "bmv_ms": t_b, "mmvq_ms": t_q,
                   "quantize_ms": t_z, "bmv_gbs": gbs(mb, t_b), "mmvq_gbs": gbs(mb, t_q),
                   "rel_diff": rel}
            results["rows"].append(row)
            print(f"{pname:<12} {m:>2} {mb:>7.1f} {t_b:>8.4f} {row['bmv_gbs']:>6.0f} "
                  f"{t_q:>8.4f} {row['mmvq_gbs']:>6.0f} {t_z:>8.4f} "
                  f"{t_q / t_b if t_b > 0 else float('nan'):>8.2f} "
                  f"{rel:>8.1e}", flush=True)
        w = None  # the output matrix's blocks go back before the next shape is made
        cp.get_default_memory_pool().free_all_blocks()
    be.synchronize()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
