"""NVRTC compile time of the kernel modules, whole and in parts, and what one model compiles.

A GPU process compiles each kernel module (or part: `kvshare.kernels.parts`) at its first
launch; CuPy keeps the result on disk, so a machine pays once per source. This measures that
cost without a GPU: NVRTC called directly (as `tests/test_kernels_compile.py` calls it) to
machine code for one architecture, with the options CuPy's RawModule passes. Per module: the
whole module's time and each part's; with `--model`, what that model's GPU path compiles
(the modules of no block type, and of `blocks` / `moe_blocks` the parts of its weight
matrices' types), against the whole modules it compiled before parts, and the same units
compiled in `--threads` threads at once, as a GPU model's warm-up compiles them.

    python bench/kernel_compile_bench.py --model q15.gguf [--arch sm_90] \\
        [--out bench/out/kernel_compile.json]

The modules of no block type that a model compiles are all of them but `mmvq` (opt-in) and,
for a dense model, `moe_blocks` and the hybrids' recurrent kernels: an upper bound for a
model that never launches some of them (the CPU-only emulator's record of a warm-up and first
step of a dense Q4_K_M model: every one of them except `kv_write`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))

from kvshare import kernels  # noqa: E402

# what RawModule adds to kvshare's options, besides the device's architecture
CUPY_OPTIONS = ("--device-as-default-execution-space",)
# modules a model of the matching kind runs (the rest of the unsplit modules: every model)
HYBRID_ONLY = {"gated_delta", "gdn_decode", "short_conv"}
OPT_IN = {"mmvq"}


def compile_seconds(nvrtc, name: str, part: str | None, arch: str) -> float:
    t0 = time.perf_counter()
    prog = nvrtc.createProgram(kernels.source(name, part), f"{name}.cu", [], [])
    try:
        nvrtc.compileProgram(prog, [*kernels.NVRTC_OPTIONS, *CUPY_OPTIONS, f"-arch={arch}"])
        nvrtc.getCUBIN(prog)
    finally:
        nvrtc.destroyProgram(prog)
    return time.perf_counter() - t0


def model_types(path: str) -> tuple[set[str], set[str], bool]:
    """(block types of the 2-D weight matrices, of the 3-D expert stacks, hybrid?)."""
    from gguf import GGUFReader  # noqa: PLC0415

    reader = GGUFReader(path)
    dense, experts = set(), set()
    for t in reader.tensors:
        kind = t.tensor_type.name.lower()
        if len(t.shape) == 2:
            dense.add(kind)
        elif len(t.shape) == 3:
            experts.add(kind)
    arch = str(bytes(reader.fields["general.architecture"].parts[-1]), "utf-8")
    return dense, experts, arch.startswith(("lfm2", "qwen35"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="a GGUF: what its GPU path compiles, parts against whole")
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--out", default="bench/out/kernel_compile.json")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                    help="threads for the model's units compiled at once (default: the CPUs)")
    args = ap.parse_args()
    from cupy.cuda import nvrtc  # noqa: PLC0415

    rows = []
    for name in kernels.module_names():
        whole = compile_seconds(nvrtc, name, None, args.arch)
        parts = {part: compile_seconds(nvrtc, name, part, args.arch)
                 for part in kernels.parts(name) if part is not None}
        rows.append({"module": name, "whole_s": whole, "parts_s": parts})
        print(f"{name:<20} whole {whole:6.2f} s" + (
            f"   {len(parts)} parts: {min(parts.values()):.2f} to {max(parts.values()):.2f} s"
            if parts else ""), flush=True)
    out: dict = {"arch": args.arch, "nvrtc": ".".join(map(str, nvrtc.getVersion())),
                 "cpus": os.cpu_count(), "modules": rows}
    if args.model:
        dense, experts, hybrid = model_types(args.model)
        by = {r["module"]: r for r in rows}
        units, before = [], 0.0
        for name, r in by.items():
            if name in OPT_IN or (name in HYBRID_ONLY and not hybrid):
                continue
            if name == "moe_blocks" and not experts:
                continue
            if not r["parts_s"]:
                units.append((name, None, r["whole_s"]))
                before += r["whole_s"]
                continue
            want = sorted((dense if name == "blocks" else experts) & set(r["parts_s"]))
            if "" in r["parts_s"]:
                want = ["", *want]
            units += [(name, p, r["parts_s"][p]) for p in want]
            before += r["whole_s"]
        after = sum(s for _, _, s in units)
        # as the warm-up compiles them (kvshare.kernels.compile_parallel): NVRTC in threads
        t0 = time.perf_counter()
        with ThreadPoolExecutor(args.threads) as pool:
            list(pool.map(lambda u: compile_seconds(nvrtc, u[0], u[1], args.arch), units))
        threaded = time.perf_counter() - t0
        print(f"\n{Path(args.model).name}: weight types {sorted(dense)}"
              + (f", expert types {sorted(experts)}" if experts else ""))
        print("| compiled at a fresh start | NVRTC s |\n| --- | --- |")
        print(f"| whole modules (before parts) | {before:.1f} |")
        print(f"| modules and parts, one after another | {after:.1f} |")
        print(f"| modules and parts, {args.threads} threads (the warm-up's compile ahead) | "
              f"{threaded:.1f} |")
        for name, p, s in units:
            if p is not None:
                print(f"|   of which {name}[{p or 'untyped'}] | {s:.2f} |")
        out["model"] = {"path": args.model, "weight_types": sorted(dense),
                        "expert_types": sorted(experts), "whole_modules_s": before,
                        "parts_s": after, "threads": args.threads, "parts_threads_s": threaded,
                        "units": [{"module": n, "part": p, "s": s} for n, p, s in units]}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
