"""Step time of one MoE layer on the GPU: the grouped kernels (`kvshare.ops.gpu_moe`, 3-4
launches per layer) on the file's blocks (`KVSHARE_GPU_WEIGHTS=blocks`) and on experts
dequantized to f16 (the default: how a model loads them on a GPU, `model.moe`), against the
per-expert path (`kvshare.ops.moe.moe_ffn`, `KVSHARE_MOE_GROUPED=0`: one product per active
expert, with the experts as dense f16 device matrices and as per-expert `GpuBlockWeight`s).
The router is f32 on the device, as models load it.

Layers: layer 0 of a tiny MoE GGUF (tests/data/models/tiny-qwen3moe-q8.gguf: 16 experts, k = 4,
n_embd 64, n_ff 32, Q8_0 / Q4_0 / Q5_0), and a random layer of Qwen3-30B-A3B's shapes (128
experts, k = 8, n_embd 2048, n_ff 768; gate/up Q4_K, down Q6_K). Batches of 1 and 8 tokens
(decode) and 256 (a prefill chunk). Each time is the median of `--iters` synchronized calls
(routing included: the router's logits come back to the host in every path).

    python bench/moe_gpu_bench.py [--iters 30] [--out moe_gpu_bench.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))


def timed(fn, fargs: tuple, iters: int, sync, **kw) -> float:
    for _ in range(3):
        fn(*fargs, **kw)
    sync()
    ts = []
    for _ in range(iters):
        t = time.perf_counter()
        fn(*fargs, **kw)
        sync()
        ts.append(time.perf_counter() - t)
    return float(np.median(ts))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import cupy as cp
    from gguf import GGMLQuantizationType as Q
    from test_ops_gpu_moe import random_rows

    from kvshare.backend import get_backend
    from kvshare.model.gguf_file import GGUFFile
    from kvshare.ops import gpu_moe
    from kvshare.ops.gpu_blocks import GpuBlockWeight
    from kvshare.ops.moe import Routing, moe_ffn

    F16 = int(Q.F16)

    be = get_backend("cuda")
    sync = be.synchronize
    rng = np.random.default_rng(0)

    def tiny():
        gf = GGUFFile(str(ROOT / "tests/data/models/tiny-qwen3moe-q8.gguf"))
        p = "blk.0."
        E = gf.tensors[p + "ffn_gate_inp.weight"].numpy_shape[0]
        names = [p + "ffn_gate_exps.weight", p + "ffn_up_exps.weight"]
        raws = [(np.asarray(gf.raw(n)), int(gf.tensors[n].qtype)) for n in names]
        draw = (np.asarray(gf.raw(p + "ffn_down_exps.weight")),
                int(gf.tensors[p + "ffn_down_exps.weight"].qtype))
        router = np.asarray(gf.raw(p + "ffn_gate_inp.weight")).view(np.float32).reshape(E, -1)
        k = int(gf.metadata["qwen3moe.expert_used_count"])
        return "tiny-qwen3moe-q8 layer 0", E, k, router.shape[1], 32, raws, draw, router

    def a3b():
        E, k, d, ff = 128, 8, 2048, 768
        raws = [(random_rows(rng, Q.Q4_K, E * ff, d), int(Q.Q4_K)) for _ in range(2)]
        draw = (random_rows(rng, Q.Q6_K, E * d, ff), int(Q.Q6_K))
        router = rng.standard_normal((E, d)).astype(np.float32)
        return "Qwen3-30B-A3B-shaped layer (Q4_K/Q6_K)", E, k, d, ff, raws, draw, router

    results = []
    for make in (tiny, a3b):
        name, E, k, d, ff, raws, draw, router = make()
        routing = Routing(n_expert=E, k=k)
        gu = gpu_moe.GpuStackedExperts.from_host([r for r, _ in raws], [q for _, q in raws],
                                                 E, d, be)
        down = gpu_moe.GpuStackedExperts.from_host([draw[0]], [draw[1]], E, ff, be)
        # the per-expert paths: each expert's rows as a GpuBlockWeight, and dequantized to f16
        per_gu, per_down = [], []
        for e in range(E):
            per_gu.append(GpuBlockWeight.from_parts(
                [(r.reshape(E, -1)[e], q, d) for r, q in raws], be))
            per_down.append(GpuBlockWeight.from_parts([(draw[0].reshape(E, -1)[e], draw[1], ff)],
                                                      be))
        f16_gu = [w.dequantize_f16() for w in per_gu]
        f16_down = [w.dequantize_f16() for w in per_down]
        # the default GPU form: one F16 part per matrix, each expert's rows contiguous
        gu16, down16 = (gpu_moe.GpuStackedExperts(
            [(cp.ascontiguousarray(cp.concatenate(ws)).view(cp.uint8), F16, ws[0].shape[0])],
            E, ws[0].shape[1]) for ws in (f16_gu, f16_down))
        router32 = cp.asarray(router)
        print(f"model: {name}: {E} experts, k={k}, n_embd {d}, n_ff {ff}; grouped experts "
              f"{(gu.nbytes + down.nbytes) / 2**20:.1f} MiB on the device")
        for n in (1, 8, 256):
            h = cp.asarray(rng.standard_normal((n, d)).astype(np.float32))
            row = {"layer": name, "tokens": n}
            row["grouped_us"] = 1e6 * timed(
                gpu_moe.moe_ffn, (h, router32, gu, down, routing), args.iters, sync)
            row["grouped_f16_us"] = 1e6 * timed(
                gpu_moe.moe_ffn, (h, router32, gu16, down16, routing), args.iters, sync)
            try:  # the per-expert paths are the reference point; a failure there is reported
                y_g = gpu_moe.moe_ffn(h, router32, gu, down, routing)
                y_p = moe_ffn(h, router32, f16_gu, f16_down, routing, backend=be)
                row["rel_diff_vs_f16_per_expert"] = float(
                    cp.abs(y_g - y_p).max() / max(float(cp.abs(y_p).max()), 1e-30))
                row["per_expert_f16_us"] = 1e6 * timed(
                    moe_ffn, (h, router32, f16_gu, f16_down, routing), args.iters, sync,
                    backend=be)
                row["per_expert_blocks_us"] = 1e6 * timed(
                    moe_ffn, (h, router32, per_gu, per_down, routing), args.iters, sync,
                    backend=be)
            except Exception as exc:  # noqa: BLE001
                row["per_expert_error"] = f"{type(exc).__name__}: {exc}"
            results.append(row)
            if "per_expert_error" in row:
                print(f"moe step, {n:>3} tokens: grouped {row['grouped_us']:8.1f} us, "
                      f"grouped f16 {row['grouped_f16_us']:8.1f} us (per-expert path failed: {row['per_expert_error']})", flush=True)
            else:
                print(f"moe step, {n:>3} tokens: grouped {row['grouped_us']:8.1f} us, "
                      f"grouped f16 {row['grouped_f16_us']:8.1f} us, per-expert f16 {row['per_expert_f16_us']:8.1f} us, per-expert blocks "
                      f"{row['per_expert_blocks_us']:8.1f} us (grouped vs f16 per-expert: "
                      f"rel diff {row['rel_diff_vs_f16_per_expert']:.2e})", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
