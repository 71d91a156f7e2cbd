"""The engine's own host time per decode step: what a GPU step's host side costs beyond the
model's launches and the sampling, measured on the CPU.

On a GPU each decode step's host work is the model's launches (`bench/gpu_host_cost.py`:
one graph launch and the input upload, ~0.2-0.4 ms), the sampling's pack and read-back, and
the engine's own work: the schedule, building the step's chunks, the cache's commit, each
row's DECIDE (the token, stop ids, max_tokens, the grammar matcher) and EMIT (detokenizing,
stop strings, the event). Scheduled in turn, all of it is time the device idles; with async
scheduling (engine/step_ahead.py) all but the launch overlaps the device's step, and the
step takes max(device, host) instead of their sum.

This runs the engine on the CPU over a small model and takes out the time spent inside
`model.forward` and `Sampler.sample`; what is left is the engine's part, the same code a GPU
engine runs (there EMIT runs beside the device). Per step and per row, at 1 / 8 / 32
concurrent greedy requests. The machine is shared and noisy: the figures are an order of
magnitude (run it twice), the split between the parts is what it shows.

    python bench/engine_host_cost.py [--model FILE.gguf] [--out FILE.json]

Default model: a random qwen3 of the tiny test size (`scripts/make_random_gguf.py --size
tiny`) with the vocabulary of `--tokenizer-from` (e.g. `.whl/ggml-vocab-qwen2.gguf` from
`bench/gpu_check.sh --prepare`: Qwen's 151,936 tokens), else the tiny test model's.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TINY_VOCAB = ROOT / "tests" / "data" / "models" / "tiny-qwen3-chat.gguf"


def _timed(counter: Counter, key: str, fn):
    def wrapper(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            counter[key] += time.perf_counter() - t
    return wrapper


def measure(path: str, batch: int, steps: int, warm: int = 2) -> dict:
    from kvshare.engine.api import GenerationRequest, SamplingParams  # noqa: PLC0415
    from kvshare.engine.engine import Engine, EngineConfig  # noqa: PLC0415
    from kvshare.engine.sampling import Sampler  # noqa: PLC0415

    eng = Engine.from_model_path(path, EngineConfig(parallel=batch, ctx_size=512,
                                                    cache_ram_mib=0))
    spent: Counter = Counter()
    eng.model.forward = _timed(spent, "forward", eng.model.forward)
    eng.scheduler.schedule = _timed(spent, "schedule", eng.scheduler.schedule)
    sample = Sampler.sample
    Sampler.sample = _timed(spent, "sample", sample)  # type: ignore[method-assign]
    try:
        for i in range(batch):
            eng.submit(GenerationRequest(list(range(100 + i, 164 + i)), warm + steps + 8,
                                         SamplingParams(temperature=0.0), ignore_eos=True))
        eng._drain_inbox()  # noqa: SLF001 - the bench drives the engine's steps itself
        seqs = list(eng.scheduler.waiting)
        while min(s.n_generated for s in seqs) < warm:
            eng.step()
        spent.clear()
        t = time.perf_counter()
        for _ in range(steps):
            eng.step()
        total = time.perf_counter() - t
        taken = dict(spent)
        eng.run_until_idle()
    finally:
        Sampler.sample = sample  # type: ignore[method-assign]
    us = {k: v / steps * 1e6 for k, v in taken.items()}
    engine_us = total / steps * 1e6 - us.get("forward", 0.0) - us.get("sample", 0.0)
    return {"batch": batch, "steps": steps, "step_us": round(total / steps * 1e6, 1),
            "forward_us": round(us.get("forward", 0.0), 1),
            "sample_us": round(us.get("sample", 0.0), 1),
            "schedule_us": round(us.get("schedule", 0.0), 1),
            "engine_us": round(engine_us, 1), "engine_us_per_row": round(engine_us / batch, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="GGUF (default: a random tiny qwen3)")
    ap.add_argument("--tokenizer-from", default=None,
                    help="GGUF whose vocabulary the default model takes")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--out", default=None, help="write the JSON here")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = args.model
        if path is None:
            path = str(Path(tmp) / "tiny.gguf")
            subprocess.run([sys.executable, str(ROOT / "scripts" / "make_random_gguf.py"),
                            "--arch", "qwen3", "--size", "tiny", "--out", path,
                            "--tokenizer-from", args.tokenizer_from or str(TINY_VOCAB)],
                           check=True, stdout=subprocess.DEVNULL)
        rows = [measure(path, int(b), args.steps) for b in args.batches.split(",")]
    print("the engine's host time per decode step on the CPU (us), the model's forward and "
          "the host sampling taken out")
    print(f"{'batch':>5} {'step':>8} {'forward':>8} {'sample':>8} {'schedule':>8} "
          f"{'engine':>8} {'per row':>8}")
    for r in rows:
        print(f"{r['batch']:5d} {r['step_us']:8.0f} {r['forward_us']:8.0f} {r['sample_us']:8.0f} "
              f"{r['schedule_us']:8.0f} {r['engine_us']:8.0f} {r['engine_us_per_row']:8.1f}")
    if args.out:
        Path(args.out).write_text(json.dumps({"model": Path(args.model).name if args.model
                                              else "random qwen3 tiny", "rows": rows},
                                             indent=1))


if __name__ == "__main__":
    main()
