"""What a hybrid model's recurrent layer asks of the host on a GPU for a prompt chunk, measured
without a GPU: the gated delta rule and the causal conv of one layer over a T-token chunk, as
the GPU path ran them before (`gated_delta_chunked` and `causal_conv1d`: the chunkwise form's
array code on CuPy, per chunk) and as it runs them now (`gated_delta_seq_slots` and
`causal_conv1d_seq_slots`: one scan kernel, two conv kernels, every chunk of the step at
once). Per call: kernel launches, cuBLAS GEMMs, CuPy array operations (each a launch of its
own on a GPU, with its Python), and for the kernels kvshare's host time (the call's wall time
less the emulator's launch plumbing). The emulator computes CuPy's array operations with
NumPy, so the array code's time is not the host's and is left out.

It runs on the CPU emulator of CuPy (`tests/gpu_emu`) with `KVSHARE_EMU_NOOP=1` (kernels and
GEMMs checked and recorded, not run), as `bench/gpu_host_cost.py` does; the counts are what
kvshare asks of CuPy (the same on a GPU), the times an estimate of the host's share of a
device step. Qwen3-Next's delta-net heads by default (16 key heads, 32 value heads,
Dk = Dv = 128, conv kernel 4).

    python bench/hybrid_prefill_gpu_host_cost.py [--tokens 128,1024] [--out FILE.json]

With `--device cuda` (a GPU; `bench/gpu_check.sh`'s MOE_ONLY mode) the same calls run on the
device, and the table adds each call's wall time with the device synchronized after it (its
device time plus the host's issue time): what a recurrent layer's prompt chunk costs there.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import gpu_host_cost  # noqa: E402 - the sibling bench: its emulator set-up and measure


def _measure_device(cp, fn, reps: int) -> dict:
    """`fn`'s wall time per call on a GPU, synchronized (after one warm call)."""
    fn()
    cp.cuda.Device().synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    cp.cuda.Device().synchronize()
    return {"device_ms": (time.perf_counter() - t) / reps * 1e3}


def _measure(emu, fn, reps: int) -> dict:
    """`gpu_host_cost`'s measure of `fn` on the no-op emulator (one warm call)."""
    d = gpu_host_cost._measure(emu, fn, warm=1, reps=reps)  # noqa: SLF001 - the sibling bench's
    return {"kvshare_us": d["kvshare_us"], "kernels": d["kernel"], "gemms": d["gemm"],
            "array_ops": d["elementwise"], "h2d": d["h2d"], "d2h": d["d2h"]}


def _cases(cp, np, gpu_hybrid, T: int, Hk: int, H: int, Dk: int, Dv: int, K: int) -> dict:
    """The four calls on a T-token chunk of one sequence (zeros: the counts and the host's
    work do not depend on the values)."""
    C = 2 * Hk * Dk + H * Dv  # the conv's channels: q | k | v
    q = cp.zeros((T, Hk, Dk), np.float32)
    k = cp.zeros((T, Hk, Dk), np.float32)
    v = cp.zeros((T, H, Dv), np.float32)
    g = cp.zeros((T, H), np.float32)
    beta = cp.zeros((T, H), np.float32)
    x = cp.zeros((T, C), np.float32)
    w = cp.zeros((C, K), np.float32)
    ssm = cp.zeros((1, 1, H, Dk, Dv), np.float32)
    conv = cp.zeros((1, 1, K - 1, C), np.float32)
    seqs = gpu_hybrid.seq_rows([(0, T, 0)], T, 1)
    scale = 1.0 / float(np.sqrt(Dk))
    return {
        "delta rule, chunkwise (before)": lambda: gpu_hybrid.gated_delta_chunked(
            q, k, v, g, beta, ssm[0, 0], scale=scale),
        "delta rule, scan kernel (now)": lambda: gpu_hybrid.gated_delta_seq_slots(
            q, k, v, g, beta, ssm, seqs, 0, scale=scale),
        "conv, array code (before)": lambda: gpu_hybrid.causal_conv1d(x, w, conv[0, 0]),
        "conv, sequence kernels (now)": lambda: gpu_hybrid.causal_conv1d_seq_slots(
            x, w, conv, seqs, 0),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="128,1024", help="prompt chunk lengths")
    ap.add_argument("--heads", default="16,32,128,128", help="H_k,H_v,Dk,Dv")
    ap.add_argument("--conv-kernel", type=int, default=4)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--device", choices=("emulator", "cuda"), default="emulator",
                    help="cuda: time the calls on a GPU instead of counting them on the "
                    "emulator")
    ap.add_argument("--out", type=Path, help="write the JSON here")
    a = ap.parse_args()
    emu = gpu_host_cost._emulator() if a.device == "emulator" else None  # noqa: SLF001
    if emu is None:
        sys.path.insert(0, str(ROOT / "python"))
    import cupy as cp  # noqa: PLC0415 - the emulator's where installed above
    import numpy as np  # noqa: PLC0415

    from kvshare.ops import gpu_hybrid  # noqa: PLC0415

    Hk, H, Dk, Dv = (int(v) for v in a.heads.split(","))
    K = a.conv_kernel
    C = 2 * Hk * Dk + H * Dv  # the conv's channels: q | k | v (as in _cases)
    rows = []
    for T in (int(t) for t in a.tokens.split(",")):
        for name, fn in _cases(cp, np, gpu_hybrid, T, Hk, H, Dk, Dv, K).items():
            got = _measure(emu, fn, a.reps) if emu else _measure_device(cp, fn, a.reps)
            rows.append({"tokens": T, "op": name, **got})
    print(f"heads: H_k {Hk}, H_v {H}, Dk {Dk}, Dv {Dv}; conv {C} channels, kernel {K}; "
          "one layer, one sequence")
    if emu is None:
        print("| tokens | op | ms per call on the device (synchronized) |")
        print("| --- | --- | --- |")
        for r in rows:
            print(f"| {r['tokens']} | {r['op']} | {r['device_ms']:.3f} |")
    else:
        print("| tokens | op | kernels | gemms | array ops | kvshare host us |")
        print("| --- | --- | --- | --- | --- | --- |")
        for r in rows:
            if r["array_ops"]:  # NumPy's compute under the emulator: not a host time
                r["kvshare_us"] = None
            us = "-" if r["kvshare_us"] is None else f"{r['kvshare_us']:,.0f}"
            print(f"| {r['tokens']} | {r['op']} | {r['kernels']:.0f} | {r['gemms']:.0f} | "
                  f"{r['array_ops']:.0f} | {us} |")
    if a.out:
        a.out.write_text(json.dumps({"device": a.device, "heads": [Hk, H, Dk, Dv],
                                     "conv_kernel": K,
                                     "channels": C, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
