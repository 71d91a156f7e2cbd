"""How many concurrent agent sessions one fixed KV budget serves without preemption: sliding-
window layers keeping only their windows (the default) vs keeping every position
(`--swa-full`, what kvshare did before), on Gemma 3 270M (15 of its 18 layers see 512 tokens).

For each configuration: one `kvshare serve --kv-mem M --parallel 32`, a ~6K-token agent prefix
computed once (a warm-up session), then K concurrent sessions of that agent (same system
prompt, their own question, 32 generated tokens each) for K = 1, 2, 3, 4, 6, 8, 12, 16, 24, 32; the
largest K that ran without a preemption (`/cache` counters) is the capacity. `--kv-mem`
defaults to a budget that holds the prefix in the --swa-full layout with little room to spare
(what makes today's code preempt). Also printed: the disk tier's bytes per cached token once the
warm-up session is written (`--cache-dir`: the full layers' blocks, the windows at its prefix
entry and its end), each layout.

    python bench/kv_capacity.py [--kv-mem 116] [--prefix-tokens 6150]

Writes bench/out/kv_capacity.json.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import threading
import time
from pathlib import Path

from agent_sessions import agent_prefix
from serve_process import ServeProcess

OUT = Path(__file__).parent / "out"
SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)


def session(srv: ServeProcess, prefix: str, question: str, out: dict) -> None:
    r = srv.client.post("/v1/chat/completions", json={
        "messages": [{"role": "system", "content": prefix}, {"role": "user", "content": question}],
        "max_tokens": 32, "temperature": 0, "ignore_eos": True})
    out["status"] = r.status_code
    if r.status_code == 200:
        out["cache_n"] = r.json()["timings"]["cache_n"]
        out["prompt_tokens"] = r.json()["usage"]["prompt_tokens"]


def warm_disk_bytes(srv: ServeProcess) -> int:
    """The disk tier's bytes once the warm-up session's entry is written."""
    deadline = time.monotonic() + 120
    while True:
        c = srv.client.get("/cache").json()
        disk = c["tiers"]["disk"]
        if c["sequences"] == 0 and disk["queued"] == 0:
            return int(disk["bytes_on_disk"])
        if time.monotonic() > deadline:
            raise RuntimeError(f"disk writer still busy: {disk}")
        time.sleep(0.05)


def capacity(extra: list[str], prefix: str, kv_mem: int, log: Path) -> dict:
    cache_dir = tempfile.mkdtemp(prefix="kvshare-bench-cap-")
    srv = ServeProcess(["--kv-mem", str(kv_mem), "--parallel", "32", "--kv-unified-per-slot", "8192",
                        "--cache-dir", cache_dir, "--cache-min-tokens", "64", *extra], log)
    try:
        warm: dict = {}
        session(srv, prefix, "Warm up.", warm)
        disk_bytes = warm_disk_bytes(srv)
        best, rows = 0, []
        for k in SIZES:
            before = srv.client.get("/cache").json()["counters"]["preemptions"]
            outs = [dict() for _ in range(k)]
            threads = [threading.Thread(target=session, args=(srv, prefix, f"Question {i}: what "
                                                              f"does module m{i} do?", outs[i]))
                       for i in range(k)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            snap = srv.client.get("/cache").json()
            pre = snap["counters"]["preemptions"] - before
            ok = all(o.get("status") == 200 for o in outs)
            rows.append({"sessions": k, "preemptions": pre, "all_ok": ok,
                         "peak_kv_bytes_held": snap["pool"].get("peak_kv_bytes_held")})
            if pre == 0 and ok:
                best = k
            else:
                break
        return {"capacity": best, "rows": rows, "disk_bytes": disk_bytes,
                "warm_tokens": warm.get("prompt_tokens")}
    finally:
        srv.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kv-mem", type=int, default=116, help="MiB of KV (both layouts)")
    ap.add_argument("--prefix-tokens", type=int, default=6150)
    ap.add_argument("--out", default=str(OUT / "kv_capacity.json"))
    args = ap.parse_args()
    prefix = agent_prefix(args.prefix_tokens)
    logdir = Path(tempfile.mkdtemp(prefix="kvshare-bench-cap-logs-"))
    res = {}
    for name, extra in (("windows (default)", []), ("--swa-full", ["--swa-full"])):
        res[name] = capacity(extra, prefix, args.kv_mem, logdir / f"{extra[0] if extra else 'w'}.log")
    print(f"--kv-mem {args.kv_mem} MiB, ~{args.prefix_tokens}-token agent prefix, Gemma 3 270M, "
          "32 tokens per session")
    print(f"{'layout':20} {'sessions without preemption':>28} {'disk bytes, 1 session':>22} "
          f"{'per token':>10}")
    for name, r in res.items():
        per = r["disk_bytes"] / max(1, r["warm_tokens"] or 1)
        print(f"{name:20} {r['capacity']:>28} {r['disk_bytes']:>22} {per:>10.0f}")
    w, f = res["windows (default)"], res["--swa-full"]
    ratio = w["capacity"] / f["capacity"] if f["capacity"] else float("inf")
    print(f"capacity: {ratio:.1f}x with windows")
    if w["disk_bytes"] and f["disk_bytes"]:
        print(f"disk tier bytes per cached token, the same session: "
              f"{w['disk_bytes'] / f['disk_bytes']:.2f}x")
    OUT.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"kv_mem_mib": args.kv_mem, "results": res,
                                          "capacity_ratio": ratio}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
