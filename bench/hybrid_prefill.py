"""Prefill throughput of the hybrid models (tiny-qwen35, tiny-lfm2) at long prompts, with the
time spent in the recurrent layers (gated delta net / short conv, incl. their FFNs) shown
separately from the rest (embedding, attention layers, output head), plus decode tokens/s.

    python bench/hybrid_prefill.py [--tokens 8192] [--chunk 512 0] [--repeat 2] [--device cpu]

`--chunk 0` is one-shot prefill; other values feed the prompt in chunks of that many tokens
(the engine's prefill budget) asking for the last logits only. Prints a table and writes
bench/out/hybrid_prefill.json. `rows(...)` is the entry point for other benchmarks
(bench/hybrid_sessions.py). Prompts are random token ids; each number is the best of
`--repeat` runs (other processes share this machine's cores; on a loaded machine set
OPENBLAS_NUM_THREADS=1, as OpenBLAS threads that must wait for a core make small GEMMs 10-20x
slower). The JSON records the CPU count, load average and OPENBLAS_NUM_THREADS.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "python"))

from kvshare.backend import get_backend  # noqa: E402
from kvshare.model.batch import SeqChunk  # noqa: E402
from kvshare.model.hybrid import HybridRecurrentLayer  # noqa: E402
from kvshare.model.loader import load_model  # noqa: E402

MODELS = {"tiny-qwen35": ROOT / "tests/data/models/tiny-qwen35.gguf",
          "tiny-lfm2": ROOT / "tests/data/models/tiny-lfm2.gguf"}
BS = 16


class _LayerTimer:
    """Wraps the recurrent layers' forward to add up their wall time."""

    def __init__(self, model):
        self.total = 0.0
        self._orig = []
        for layer in model.layers:
            if isinstance(layer, HybridRecurrentLayer):
                fwd = layer.forward
                self._orig.append((layer, fwd))
                layer.forward = self._wrap(fwd, model.backend)

    def _wrap(self, fwd, be):
        def timed(*a, **kw):
            be.synchronize()
            t0 = time.perf_counter()
            out = fwd(*a, **kw)
            be.synchronize()
            self.total += time.perf_counter() - t0
            return out
        return timed

    def restore(self):
        for layer, fwd in self._orig:
            layer.forward = fwd


def _prefill(model, tokens, chunk):
    n = len(tokens)
    nb = -(-(n + 64) // BS)  # room for decode steps after the prompt
    cache = model.new_cache(nb, BS, n_state_slots=1)
    table = np.arange(nb, dtype=np.int32)
    step = chunk or n
    timer = _LayerTimer(model)
    try:
        model.backend.synchronize()
        t0 = time.perf_counter()
        for s in range(0, n, step):
            e = min(n, s + step)
            model.forward([SeqChunk(tokens[s:e], s, table, logits="last" if e == n else "none",
                                    state_slot=0)], cache)
        model.backend.synchronize()
        dt = time.perf_counter() - t0
    finally:
        timer.restore()
    return dt, timer.total, cache, table


def _decode(model, cache, table, start, n_steps):
    """Decode tokens/s of one sequence after the prefill (the cache has room for the steps)."""
    tok = np.int32(5)
    model.backend.synchronize()
    t0 = time.perf_counter()
    for i in range(n_steps):
        model.forward([SeqChunk([tok], start + i, table, state_slot=0)], cache)
    model.backend.synchronize()
    return n_steps / (time.perf_counter() - t0)


def rows(models=("tiny-qwen35", "tiny-lfm2"), n_tokens=8192, chunks=(512, 0), repeat=2,
         device="cpu", decode_steps=32) -> list[dict]:
    be = get_backend(device)
    out = []
    for name in models:
        m = load_model(MODELS.get(name, name), be)
        rng = np.random.default_rng(n_tokens)
        tokens = rng.integers(0, m.config.vocab_size, n_tokens).astype(np.int32)
        _prefill(m, tokens[:300], 0)  # warm-up (Numba kernels, BLAS)
        for chunk in chunks:
            best = None
            for _ in range(repeat):
                dt, rec, cache, table = _prefill(m, tokens, chunk)
                if best is None or dt < best[0]:
                    best = (dt, rec)
            dt, rec = best
            row = dict(model=name, device=be.name, n_tokens=n_tokens,
                       chunk=chunk or n_tokens, seconds=round(dt, 3),
                       tokens_per_s=round(n_tokens / dt, 1),
                       recurrent_s=round(rec, 3), recurrent_share=round(rec / dt, 3),
                       state_bytes_per_seq=m.state_nbytes(),
                       kv_bytes_per_token=m.kv_bytes_per_token(cache.kv_dtype))
            if chunk == chunks[0]:
                row["decode_tok_s_b1"] = round(_decode(m, cache, table, n_tokens,
                                                       decode_steps), 1)
            out.append(row)
    return out


def table(rs: list[dict]) -> str:
    head = ("model", "device", "tokens", "chunk", "s", "tok/s", "recurrent s", "rec share",
            "state B/seq", "decode b1 tok/s")
    lines = [" | ".join(head), " | ".join("---" for _ in head)]
    for r in rs:
        lines.append(" | ".join(str(x) for x in (
            r["model"], r["device"], r["n_tokens"], r["chunk"], r["seconds"], r["tokens_per_s"],
            r["recurrent_s"], f"{100 * r['recurrent_share']:.0f}%", r["state_bytes_per_seq"],
            r.get("decode_tok_s_b1", ""))))
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", default=["tiny-qwen35", "tiny-lfm2"])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--chunk", type=int, nargs="+", default=[512, 0])
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default=str(ROOT / "bench/out/hybrid_prefill.json"))
    a = ap.parse_args()
    rs = rows(a.models, a.tokens, a.chunk, a.repeat, a.device)
    print(table(rs))
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    meta = dict(machine=platform.machine(), python=platform.python_version(),
                cpus=len(os.sched_getaffinity(0)), load_avg=os.getloadavg(),
                openblas_threads=os.environ.get("OPENBLAS_NUM_THREADS"))
    Path(a.out).write_text(json.dumps(dict(meta, rows=rs), indent=1))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
