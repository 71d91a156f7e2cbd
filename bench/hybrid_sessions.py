"""Three agent sessions sharing a long prefix on a hybrid model (tiny-qwen35), with and without
attach, plus prefill throughput of both tiny hybrids at 8K tokens.

Session 2 arrives while session 1 decodes, session 3 while 1 and 2 decode (as in
bench/agent_sessions.py, but in-process: the engine thread serves request handles). Reports
per session TTFT and cache_n, the 3rd-session TTFT ratio (attach / no attach), checkpoint
count and unique bytes (each checkpoint counted once however many sessions hold it), and the
cost of restoring a checkpoint versus recomputing the prefix it stands for.

    python bench/hybrid_sessions.py [--prefix-tokens 6000] [--gen 48]

Writes bench/out/hybrid_sessions.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "python"))
sys.path.insert(0, str(ROOT / "bench"))

from kvshare.engine.api import GenerationRequest, SamplingParams  # noqa: E402
from kvshare.engine.engine import Engine, EngineConfig  # noqa: E402

MODEL = ROOT / "tests/data/models/tiny-qwen35.gguf"
OUT = ROOT / "bench/out"


def system_prompt(eng: Engine, n_tokens: int) -> str:
    parts, i = [], 0
    while len(eng.tokenize(" ".join(parts), add_special=False)) < n_tokens:
        parts.append(f"tool{i}(path, pattern) searches files for pattern {i};")
        i += 1
    return " ".join(parts)


def session(eng: Engine, system: str, sid: int, question: str, gen: int, rec: dict, started: threading.Event):
    text, boundary = eng.apply_chat_template([
        {"role": "system", "content": system + f" Session id {sid:08d}."},
        {"role": "user", "content": question}])
    ids = eng.tokenize(text)
    t0 = time.perf_counter()
    h = eng.submit(GenerationRequest(prompt_tokens=ids, max_tokens=gen, ignore_eos=True,
                                     sampling=SamplingParams(temperature=0.0), first_user_boundary=boundary))
    first = None
    for ev in h.events(timeout=600):
        if hasattr(ev, "token_id"):
            if first is None:
                first = time.perf_counter()
                started.set()
        else:
            rec.update(prompt_tokens=ev.prompt_tokens, cache_n=ev.timings.cache_n,
                       prompt_n=ev.timings.prompt_n, ttft_s=first - t0 if first else None,
                       decode_tps=1e3 * ev.timings.predicted_n / ev.timings.predicted_ms
                       if ev.timings.predicted_ms else None)
    started.set()


def three_sessions(attach: bool, prefix_tokens: int, gen: int) -> dict:
    eng = Engine.from_model_path(str(MODEL), EngineConfig(slot_attach=attach, kv_blocks=4096,
                                                          ctx_size=16384, prefill_chunk=512))
    eng.start()
    system = system_prompt(eng, prefix_tokens)
    recs = [dict() for _ in range(3)]
    evs = [threading.Event() for _ in range(3)]
    threads = []
    peak_ckpt = {"count": 0, "unique_bytes": 0, "holders": 0}
    for i, q in enumerate(["List the files.", "Find main.", "Summarise the README."]):
        if i:
            evs[i - 1].wait(600)
        th = threading.Thread(target=session, args=(eng, system, 1, q, gen, recs[i], evs[i]))
        th.start()
        threads.append(th)
    while any(t.is_alive() for t in threads):
        snap = eng.snapshot().get("checkpoints") or {}
        holders = sum(len(s.held_checkpoints) for s in list(eng.scheduler.running))
        if holders > peak_ckpt["holders"]:
            peak_ckpt = {"count": snap.get("count"), "unique_bytes": snap.get("live_bytes"), "holders": holders}
        time.sleep(0.002)
    for t in threads:
        t.join()
    ck = eng.checkpoints
    result = {"attach": attach, "sessions": recs, "checkpoints": eng.snapshot()["checkpoints"],
              "peak_checkpoint_holding": peak_ckpt}
    # Restore cost vs recompute: restore the deepest checkpoint into a free slot, and time a
    # cold prefill of the same prefix.
    if attach and len(ck.store):
        keys = ck.store.keys()
        deepest = max((ck.store.get(k) for k in keys), key=lambda c: c.position)
        slot = ck.take_slot()
        t0 = time.perf_counter()
        for _ in range(100):
            ck.restore(deepest, slot)
        restore_s = (time.perf_counter() - t0) / 100
        ck.give_slot(slot)
        ids = eng.tokenize(eng.apply_chat_template([{"role": "system", "content": system},
                                                   {"role": "user", "content": "x"}])[0])[: deepest.position]
        cold = Engine.from_model_path(str(MODEL), EngineConfig(slot_attach=False, kv_blocks=4096,
                                                               ctx_size=16384, prefill_chunk=16384))
        t0 = time.perf_counter()
        cold.submit(GenerationRequest(prompt_tokens=ids, max_tokens=1))
        cold.run_until_idle()
        recompute_s = time.perf_counter() - t0
        result["restore_vs_recompute"] = {"position": deepest.position, "checkpoint_bytes": deepest.nbytes,
                                          "restore_ms": 1e3 * restore_s, "recompute_ms": 1e3 * recompute_s,
                                          "speedup": recompute_s / restore_s}
    eng.shutdown(timeout=1)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prefix-tokens", type=int, default=6000)
    ap.add_argument("--gen", type=int, default=48)
    args = ap.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    runs = [three_sessions(True, args.prefix_tokens, args.gen), three_sessions(False, args.prefix_tokens, args.gen)]
    print(f"\ntiny-qwen35, prefix ~{args.prefix_tokens} tokens, {args.gen} tokens per session")
    print(f"{'attach':>7} {'sess':>4} {'prompt':>7} {'cache_n':>7} {'prompt_n':>8} {'TTFT ms':>9} {'decode t/s':>10}")
    for run in runs:
        for i, s in enumerate(run["sessions"]):
            print(f"{str(run['attach']):>7} {i + 1:>4} {s['prompt_tokens']:>7} {s['cache_n']:>7} {s['prompt_n']:>8} "
                  f"{1e3 * s['ttft_s']:>9.1f} {s['decode_tps'] or 0:>10.1f}")
    on, off = runs
    summary = {
        "ttft3_ratio_attach_over_no_attach": on["sessions"][2]["ttft_s"] / off["sessions"][2]["ttft_s"],
        "checkpoints": on["checkpoints"],
        "peak_checkpoint_holding": on["peak_checkpoint_holding"],
        "restore_vs_recompute": on.get("restore_vs_recompute"),
    }
    from hybrid_prefill import rows as prefill_rows  # noqa: PLC0415

    try:
        prefill = prefill_rows(n_tokens=8192)
    except TypeError:
        prefill = prefill_rows()
    summary["prefill_8k"] = [{k: r[k] for k in ("model", "chunk", "tokens_per_s") if k in r} for r in prefill]
    print(json.dumps(summary, indent=1))
    (OUT / "hybrid_sessions.json").write_text(json.dumps({"runs": runs, "summary": summary}, indent=1))
    print(f"wrote {OUT / 'hybrid_sessions.json'}")


if __name__ == "__main__":
    main()
