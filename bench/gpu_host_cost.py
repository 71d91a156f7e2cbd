"""The host side of the GPU path, measured without a GPU: per decode step (CUDA graphs on and
off, batch 1 / 8 / 32) and per prefill forward (128 and 1,024 tokens, graphs on and off; a
new 128-token shape's first step, eager, and its second, captured; an engine's start, which
captures the shapes an agent server meets first, and a 128-token turn's first step after it),
the launches the host issues (kernels, cuBLAS GEMMs, graph launches), its host-to-device
copies and device-to-host reads, and the host's wall time per step with the device's work
taken out.

It runs the real GPU code path on the CPU emulator of CuPy (`tests/gpu_emu`) with
`KVSHARE_EMU_NOOP=1`: kernels and GEMMs are checked and recorded but not run. The counts are
kvshare's own (what it asks of CuPy per step, the same on a GPU); the time is kvshare's
Python plus the emulator's launch plumbing (ctypes, a few microseconds a launch, about
CuPy's own cost of a launch), so it estimates how much of a device step the host needs when
the device is fast, not a GPU figure. A decode step is sampled as served: logits stay on
the device and the device sampler picks greedy tokens (`ops.gpu_sampling`).

    python bench/gpu_host_cost.py [--model FILE.gguf] [--layers 4] [--out FILE.json]

Default model: a random qwen3 GGUF of Qwen3-1.7B's layer shapes (`scripts/make_random_gguf.py
--size 1.5b --layers N`, the vocabulary of `--tokenizer-from` when given), block weights
(`KVSHARE_GPU_WEIGHTS=blocks`, issue 40's setting). Per-layer figures scale to the full
model's layers (`--full-layers`, 28 by default): the table shows both the measured step and
that estimate.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FULL_LAYERS = 28  # Qwen3-1.7B


def _emulator():
    os.environ["KVSHARE_EMU_NOOP"] = "1"
    os.environ.setdefault("KVSHARE_GPU_WEIGHTS", "blocks")
    sys.path.insert(0, str(ROOT / "tests" / "gpu_emu"))
    sys.path.insert(0, str(ROOT / "python"))
    import fakecupy  # noqa: PLC0415

    fakecupy.install()
    return fakecupy


def _measure(emu, fn, warm: int, reps: int) -> dict:
    """`fn` run `warm` times, then `reps` times measured: per run, the counts, the host time,
    and kvshare's part of it (the time less what the emulator's plumbing took, `emu_s`)."""
    for _ in range(warm):
        fn()
    c0 = dict(emu.COUNTS)
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    dt = (time.perf_counter() - t) / reps
    d = {k: (emu.COUNTS[k] - c0[k]) / reps for k in c0}
    emu_s = d.pop("emu_s")
    return {"host_us": dt * 1e6, "kvshare_us": (dt - emu_s) * 1e6, **d}


def decode_cost(emu, model, batch: int, graphs: bool, steps: int = 40) -> dict:
    import numpy as np  # noqa: PLC0415

    from kvshare.model.batch import SeqChunk  # noqa: PLC0415
    from kvshare.ops import gpu_sampling  # noqa: PLC0415

    model.cuda_graphs = graphs
    nbs = 16
    cache = _new_cache(model, nbs * batch, batch)
    tables = [np.arange(i * nbs, (i + 1) * nbs) for i in range(batch)]
    model.logits_on_device = True
    nxt = np.zeros(batch, np.int32)
    pos = [64]
    slot = _slot_of(model)

    def step():
        outs = model.forward([SeqChunk(nxt[i : i + 1], pos[0], tables[i], state_slot=slot(i))
                              for i in range(batch)], cache)
        gpu_sampling.sample_rows([gpu_sampling.RowSpec(logits=o[0], greedy=True) for o in outs])
        pos[0] += 1

    try:
        return _measure(emu, step, warm=3, reps=steps)  # the warm steps capture the graph
    finally:
        model.logits_on_device = False
        model.cuda_graphs = None


def prefill_cost(emu, model, n: int, graphs: bool, reps: int = 5) -> dict:
    import numpy as np  # noqa: PLC0415

    from kvshare.model.batch import SeqChunk  # noqa: PLC0415

    toks = np.arange(n, dtype=np.int32) % min(1000, model.config.vocab_size)
    nb = -(-n // 16) + 1
    cache = _new_cache(model, nb, 1)
    table = np.arange(nb)
    model.cuda_graphs = graphs

    def fwd():
        model.forward([SeqChunk(toks, 0, table, logits="last", state_slot=_slot_of(model)(0))],
                      cache)

    try:
        return _measure(emu, fwd, warm=2, reps=reps)  # the warm runs capture the graph
    finally:
        model.cuda_graphs = None


def _new_cache(model, n_blocks: int, n_seqs: int):
    """A cache of `n_blocks` 16-token blocks, with a recurrent-state slot per sequence for a
    hybrid model."""
    slots = n_seqs if model.config.n_recurrent_layers else 0
    return model.new_cache(n_blocks, 16, n_state_slots=slots)


def _slot_of(model):
    """Sequence i's state slot: i for a hybrid model, None otherwise."""
    return (lambda i: i) if model.config.n_recurrent_layers else (lambda i: None)


def _median(ms: list[dict]) -> dict:
    """Per key, the median of the runs' figures."""
    return {k: sorted(m[k] for m in ms)[len(ms) // 2] for k in ms[0]}


def new_shape_cost(emu, model, n: int, reps: int = 5) -> tuple[dict, dict]:
    """A prefill shape's first two steps, graphs on: the first runs eager on the shape's
    inputs (measuring its workspace), the second is captured and replayed. Each run is on a
    new cache with the runner's sightings forgotten, so that both steps are a new shape's;
    the medians over `reps` runs (after one unmeasured)."""
    import numpy as np  # noqa: PLC0415

    from kvshare.model import gpu_graphs  # noqa: PLC0415
    from kvshare.model.batch import SeqChunk  # noqa: PLC0415

    toks = np.arange(n, dtype=np.int32) % min(1000, model.config.vocab_size)
    nb = -(-n // 16) + 1
    table = np.arange(nb)
    model.cuda_graphs = True
    steps: list[list[dict]] = [[], []]
    try:
        runner = gpu_graphs.runner(model)
        for rep in range(reps + 1):
            cache = _new_cache(model, nb, 1)
            runner.sightings.clear()
            for i in range(2):
                m = _measure(emu, lambda c=cache: model.forward(
                    [SeqChunk(toks, 0, table, logits="last", state_slot=_slot_of(model)(0))],
                    c), warm=0, reps=1)
                if rep:
                    steps[i].append(m)
    finally:
        model.cuda_graphs = None

    return _median(steps[0]), _median(steps[1])


def warm_up_cost(emu, model, n: int, reps: int = 3) -> tuple[dict, dict]:
    """An engine's start with the server's defaults (`Model.warm_up`: 4 sequences, 512-token
    prefill chunks) on a new cache, then a new `n`-token turn's first step on it (a shape the
    start captured: a replay); the medians over `reps` runs (after one unmeasured)."""
    import numpy as np  # noqa: PLC0415

    from kvshare.model.batch import SeqChunk  # noqa: PLC0415

    toks = np.arange(n, dtype=np.int32) % min(1000, model.config.vocab_size)
    nb = 64  # the warm-up's longest step is 576 tokens
    table = np.arange(-(-n // 16) + 1)
    model.cuda_graphs = True
    steps: list[list[dict]] = [[], []]
    try:
        for rep in range(reps + 1):
            cache = _new_cache(model, nb, 4)
            m0 = _measure(emu, lambda c=cache: model.warm_up(c, 4, 512), warm=0, reps=1)
            m1 = _measure(emu, lambda c=cache: model.forward(
                [SeqChunk(toks, 0, table, logits="last", state_slot=_slot_of(model)(0))], c),
                warm=0, reps=1)
            if rep:
                steps[0].append(m0)
                steps[1].append(m1)
    finally:
        model.cuda_graphs = None

    return _median(steps[0]), _median(steps[1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="GGUF (default: a random 1.5b-shaped qwen3)")
    ap.add_argument("--layers", type=int, default=4, help="layers of the default model")
    ap.add_argument("--tokenizer-from", default=None,
                    help="GGUF whose vocabulary the default model takes (e.g. "
                         ".whl/ggml-vocab-qwen2.gguf from gpu_check.sh --prepare)")
    ap.add_argument("--full-layers", type=int, default=FULL_LAYERS,
                    help="the full model's layers, which the per-layer figures scale to "
                         f"(default {FULL_LAYERS}: Qwen3-1.7B; 48 for Qwen3-30B-A3B, 24 for "
                         "gpt-oss-20b)")
    ap.add_argument("--out", default=None, help="write the JSON here")
    args = ap.parse_args()
    full = args.full_layers
    emu = _emulator()
    from kvshare.model.loader import load_model  # noqa: PLC0415

    with tempfile.TemporaryDirectory() as tmp:
        path = args.model
        if path is None:
            path = str(Path(tmp) / "q15.gguf")
            cmd = [sys.executable, str(ROOT / "scripts" / "make_random_gguf.py"), "--arch",
                   "qwen3", "--size", "1.5b", "--layers", str(args.layers), "--out", path]
            if args.tokenizer_from:
                cmd += ["--tokenizer-from", args.tokenizer_from]
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        model = load_model(path, device="cuda")
    n_layers = model.config.n_layers
    rows = {}
    for graphs in (True, False):
        for b in (1, 8, 32):
            rows[f"decode b{b} graphs {'on' if graphs else 'off'}"] = decode_cost(
                emu, model, b, graphs)
    for graphs in (True, False):
        for n in (128, 1024):
            rows[f"prefill {n} graphs {'on' if graphs else 'off'}"] = prefill_cost(
                emu, model, n, graphs)
    # (a model whose steps stay eager has no such rows)
    if model.step_graphs_apply():
        # a later turn's prompt is a new prefill shape more often than not: its first steps
        rows["prefill 128 new shape 1"], rows["prefill 128 new shape 2"] = new_shape_cost(
            emu, model, 128)
        # the engine's start captures the shapes a later turn meets first: its first step
        # replays
        rows["start: warm-up"], rows["warmed 128 graphs on"] = warm_up_cost(emu, model, 128)
    result = {"model": Path(path).name if args.model else f"random qwen3 1.5b, {n_layers} layers",
              "n_layers": n_layers, "gpu_weights": os.environ["KVSHARE_GPU_WEIGHTS"],
              "rows": rows}
    result["full_layers"] = full
    if n_layers < full:
        # the eager rows grow with the layers (the graph and sampling part does not: the
        # graphs-on row of the same batch); a prefill is all layers, near enough
        for name, r in rows.items():
            if "graphs on" in name:
                continue
            fixed = rows.get(name.replace("off", "on")) if "graphs off" in name else None
            for k in ("kvshare_us", "kernel"):
                f = fixed[k] if fixed is not None else 0.0
                r[f"{k}_x{full}"] = f + (r[k] - f) * full / n_layers
    print(f"host side of the GPU path on the no-op emulator ({result['model']}, "
          f"{result['gpu_weights']} weights), per step. kvshare us: the host's time less the "
          f"emulator's launch plumbing; x{full}: scaled to {full} layers")
    xf = f"x{full}"
    print(f"{'path':<24} {'kvshare us':>10} {xf:>7} {'kernels':>8} {xf:>6} {'gemms':>6} "
          f"{'elemwise':>8} {'graphs':>6} {'h2d':>5} {'d2h':>5}")
    for name, r in rows.items():
        x_us = r.get(f"kvshare_us_x{full}", r["kvshare_us"])
        x_k = r.get(f"kernel_x{full}", r["kernel"])
        print(f"{name:<24} {r['kvshare_us']:10.0f} {x_us:7.0f} {r['kernel']:8.1f} {x_k:6.0f} "
              f"{r['gemm']:6.1f} {r['elementwise']:8.1f} {r['graph']:6.1f} {r['h2d']:5.1f} "
              f"{r['d2h']:5.1f}")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
