"""How many concurrent agent sessions one fixed KV budget serves without preemption: sliding-
window layers keeping only their windows (the default) vs keeping every position
(`--swa-full`, what kvshare did before), on Gemma 3 270M (15 of its 18 layers see 512 tokens).

For each configuration: one `kvshare serve --kv-mem M --parallel 16`, a ~6K-token agent prefix
computed once (a warm-up session), then K concurrent sessions of that agent (same system
prompt, their own question, 32 generated tokens each) for K = 1, 2, 3, 4, 6, 8, 12, 16; the
largest K that ran without a preemption (`/cache` counters) is the capacity. `--kv-mem`
defaults to a budget that holds the prefix in the --swa-full layout with little room to spare
(what makes today's code preempt). Also printed: the disk tier's bytes per cached token of the
warm-up session (`--cache-dir`), each layout.

    python bench/kv_capacity.py [--kv-mem 120] [--prefix-tokens 6150]

Writes bench/out/kv_capacity.json.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import threading
from pathlib import Path

from agent_sessions import agent_prefix
from serve_process import ServeProcess

OUT = Path(__file__).parent / "out"
SIZES = (1, 2, 3, 4, 6, 8, 12, 16)


def session(srv: ServeProcess, prefix: str, question: str, out: dict) -> None:
    r = srv.client.post("/v1/chat/completions", json={
        "messages": [{"role": "system", "content": prefix}, {"role": "user", "content": question}],
        "max_tokens": 32, "temperature": 0, "ignore_eos": True})
    out["status"] = r.status_code
    if r.status_code == 200:
        out["cache_n"] = r.json()["timings"]["cache_n"]


def capacity(extra: list[str], prefix: str, kv_mem: int, log: Path) -> dict:
    cache_dir = tempfile.mkdtemp(prefix="kvshare-bench-cap-")
    srv = ServeProcess(["--kv-mem", str(kv_mem), "--parallel", "16", "--ctx-size", "8192",
                        "--cache-dir", cache_dir, "--cache-min-tokens", "64", *extra], log)
    try:
        warm: dict = {}
        session(srv, prefix, "Warm up.", warm)
        srv.client.post("/v1/chat/completions", json={"messages": [
            {"role": "user", "content": "flush"}], "max_tokens": 1})  # a turn passes the save
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
        disk = srv.client.get("/cache").json()["tiers"].get("disk", {})
        return {"capacity": best, "rows": rows, "disk_bytes": disk.get("bytes_on_disk",
                                                                       disk.get("bytes")),
                "warm_prompt_tokens": None}
    finally:
        srv.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kv-mem", type=int, default=120, help="MiB of KV (both layouts)")
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
    print(f"{'layout':20} {'sessions without preemption':>28} {'disk bytes (warm-up)':>22}")
    for name, r in res.items():
        print(f"{name:20} {r['capacity']:>28} {r['disk_bytes'] or 0:>22}")
    w, f = res["windows (default)"], res["--swa-full"]
    ratio = w["capacity"] / f["capacity"] if f["capacity"] else float("inf")
    print(f"capacity: {ratio:.1f}x with windows")
    if w["disk_bytes"] and f["disk_bytes"]:
        print(f"disk tier bytes for the same session: {w['disk_bytes'] / f['disk_bytes']:.2f}x")
    OUT.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"kv_mem_mib": args.kv_mem, "results": res,
                                          "capacity_ratio": ratio}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
