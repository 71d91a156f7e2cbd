"""What the web UI's polling costs the server (issue 44's acceptance): the JSON endpoint per
poll, and decode throughput with and without a page polling it every 500 ms.

  poll-cost   `GET /webui/state` with 64 sessions and 10,000 cached blocks:
              - in process: `WebUIState.encoded` (the snapshot, the tree, the JSON bytes: all
                that the endpoint does off the event loop) over the fake engine, the board
                holding 64 sessions whose prompts make 10,000 distinct blocks (a 20-block
                prefix they all share, 157 blocks each of their own); `cold` rebuilds the tree
                (a session came or went since the last poll), `warm` reuses it;
              - over HTTP: a real `kvshare serve` on the tiny model after 64 such prompts
                (its pool then caches ~10,000 blocks), the round trip a client measures.
              Target: < 5 ms per poll.
  decode      a real `kvshare serve` (default: the default model, SmolLM2-135M) with a few
              sessions generating all the time, its decode throughput (the server's
              generated_tokens_total over each window) with a poller process asking for
              `/webui/state` every 500 ms and without it, the two conditions alternating
              (ABBA) for several rounds in one run: each round's ratio polled / not polled,
              their mean, spread and 95% interval. The difference is measurable when the
              interval leaves out 1.0.

    python bench/webui_bench.py                     # both parts
    python bench/webui_bench.py --only decode --rounds 8 --window 5
    python bench/webui_bench.py --model tests/data/models/tiny-qwen3-chat.gguf

Prints a table and writes bench/out/webui_bench.json. Not run in CI.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
from serve_process import ServeProcess

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the fake engine

OUT = Path(__file__).parent / "out"
TINY = ROOT / "tests" / "data" / "models" / "tiny-qwen3-chat.gguf"
SESSIONS = 64
SHARED_BLOCKS, OWN_BLOCKS = 20, 157  # 20 + 64 x 157 = 10,068 distinct blocks
POLL_TARGET_MS = 5.0
POLL_EVERY_S = 0.5


def quantiles(xs: list[float]) -> dict:
    xs = sorted(xs)
    return {"median": statistics.median(xs), "p90": xs[int(0.9 * (len(xs) - 1))],
            "max": xs[-1], "n": len(xs)}


# ---------------------------------------------------------------------------- poll cost

def poll_cost_in_process(repeats: int) -> dict:
    from fake_engine import FakeEngine

    from kvshare.engine.api import GenerationRequest
    from kvshare.server.webui import WebUI

    ui = WebUI(FakeEngine(ctx_size=8192), None, show_prompts=False)
    bs = ui.board.block_size
    prefix = list(range(1000, 1000 + bs * SHARED_BLOCKS))
    rng = random.Random(0)
    for i in range(SESSIONS):
        own = [rng.randrange(2000, 30000) for _ in range(bs * OWN_BLOCKS)]
        ui.board.acquire(f"s{i}", GenerationRequest(prompt_tokens=prefix + own, max_tokens=4))
    blocks = len({b for s in ui.board.sessions.values() for b in s.chain})
    cold, warm, size = [], [], 0
    for _ in range(repeats):
        ui.board.version += 1  # as when a session comes or goes: the tree is rebuilt
        t = time.perf_counter()
        size = len(ui.state.encoded(None))
        cold.append((time.perf_counter() - t) * 1e3)
        t = time.perf_counter()
        ui.state.encoded(None)
        warm.append((time.perf_counter() - t) * 1e3)
    return {"sessions": SESSIONS, "distinct_blocks": blocks, "bytes": size,
            "cold_ms": quantiles(cold), "warm_ms": quantiles(warm)}


def words(rng: random.Random, n: int) -> str:
    vocab = ["cache", "prefix", "session", "agent", "token", "block", "server", "request",
             "model", "layer", "restore", "disk", "memory", "budget", "eviction", "tool",
             "schema", "system", "prompt", "reply", "turn", "write", "read", "verify"]
    return " ".join(f"{rng.choice(vocab)}{rng.randrange(1000)}" for _ in range(n))


def poll_cost_http(repeats: int, log_dir: str) -> dict:
    s = ServeProcess(["--model", str(TINY), "--parallel", "8", "--kv-unified-per-slot", "4096",
                      "--kv-blocks", "12000", "--cache-ram", "0"],
                     Path(log_dir) / "webui-bench-cost.log")
    try:
        bs = s.client.get("/webui/state").json()["server"]["block_size"]
        rng = random.Random(1)
        shared = words(rng, SHARED_BLOCKS * bs // 3)
        n_tok = len(s.client.post("/tokenize", json={"content": shared}).json()["tokens"])
        shared = " ".join(shared.split()[: len(shared.split()) * SHARED_BLOCKS * bs // n_tok])
        own_words = OWN_BLOCKS * bs * len(shared.split()) // (SHARED_BLOCKS * bs)

        def one(i: int) -> None:
            r = s.client.post("/v1/completions", json={
                "prompt": shared + " " + words(random.Random(100 + i), own_words),
                "max_tokens": 1})
            assert r.status_code == 200, r.text

        threads = [threading.Thread(target=one, args=(i,)) for i in range(SESSIONS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        pool = s.client.get("/cache").json()["pool"]
        lat, size = [], 0
        for _ in range(repeats):
            t = time.perf_counter()
            r = s.client.get("/webui/state")
            lat.append((time.perf_counter() - t) * 1e3)
            size = len(r.content)
        sessions = len(r.json()["sessions"])
        return {"sessions": sessions, "cached_blocks": pool["cached"],
                "used_blocks": pool["used"], "bytes": size, "round_trip_ms": quantiles(lat)}
    finally:
        s.stop()


# ---------------------------------------------------------------------------- decode

POLLER = r"""
import sys, threading, time, httpx
url, every = sys.argv[1], float(sys.argv[2])
on, done, lat = threading.Event(), threading.Event(), []
def commands():
    for line in sys.stdin:
        on.set() if line.strip() == "on" else on.clear()
    done.set(), on.set()
threading.Thread(target=commands, daemon=True).start()
with httpx.Client(timeout=60) as c:
    while on.wait() and not done.is_set():
        t = time.perf_counter()
        c.get(url + "/webui/state").raise_for_status()
        lat.append((time.perf_counter() - t) * 1e3)
        time.sleep(max(0.0, every - (time.perf_counter() - t)))
print(" ".join(f"{x:.3f}" for x in lat))
"""


def decode_bench(model: str, streams: int, rounds: int, window: float, log_dir: str) -> dict:
    s = ServeProcess(["--model", model, "--parallel", str(streams), "--kv-unified-per-slot", "4096"],
                     Path(log_dir) / "webui-bench-decode.log")
    stop = threading.Event()
    errors: list[str] = []

    def generate(i: int) -> None:
        with httpx.Client(base_url=s.url, timeout=600) as c:
            while not stop.is_set():
                r = c.post("/v1/chat/completions", json={
                    "messages": [{"role": "user", "content": f"Write a long story, part {i}."}],
                    "max_tokens": 256, "ignore_eos": True, "temperature": 0.8})
                if r.status_code != 200:
                    errors.append(r.text[:200])
                    return

    def generated() -> int:
        return int(s.client.get("/cache").json()["counters"]["generated_tokens_total"])

    poller = subprocess.Popen([sys.executable, "-c", POLLER, s.url, str(POLL_EVERY_S)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    gens = [threading.Thread(target=generate, args=(i,), daemon=True) for i in range(streams)]
    rates: dict[str, list[float]] = {"off": [], "on": []}
    try:
        for t in gens:
            t.start()
        time.sleep(max(3.0, window))  # warm-up: every stream decoding
        for r in range(rounds):
            order = ("off", "on") if r % 2 == 0 else ("on", "off")
            for cond in order:
                assert poller.stdin is not None
                poller.stdin.write(cond + "\n")
                poller.stdin.flush()
                n0, t0 = generated(), time.perf_counter()
                time.sleep(window)
                rates[cond].append((generated() - n0) / (time.perf_counter() - t0))
            if errors:
                raise RuntimeError(f"a generating session failed: {errors[0]}")
    finally:
        stop.set()
        out, _ = poller.communicate(timeout=60)
        for t in gens:
            t.join(timeout=120)
        s.stop()
    polls = [float(x) for x in out.split()]
    ratios = [on / off for on, off in zip(rates["on"], rates["off"])]
    mean = statistics.mean(ratios)
    sd = statistics.stdev(ratios) if len(ratios) > 1 else 0.0
    half = _t95(len(ratios) - 1) * sd / len(ratios) ** 0.5
    return {"model": model, "streams": streams, "rounds": rounds, "window_s": window,
            "tok_s_off": rates["off"], "tok_s_on": rates["on"], "ratios": ratios,
            "ratio_mean": mean, "ratio_sd": sd, "ratio_min": min(ratios),
            "ratio_max": max(ratios), "ratio_ci95": [mean - half, mean + half],
            "measurable": not (mean - half <= 1.0 <= mean + half),
            "poll_ms": quantiles(polls) if polls else None}


def _t95(df: int) -> float:
    """Student's t two-sided 95% quantile (df >= 1; 1.96 beyond the table)."""
    table = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26,
             10: 2.23, 12: 2.18, 15: 2.13, 20: 2.09, 30: 2.04}
    return next((v for k, v in table.items() if df <= k), 1.96) if df >= 1 else float("inf")


# ---------------------------------------------------------------------------- report

def table(res: dict) -> str:
    lines = [f"{'measure':<44} {'median':>9} {'p90':>9} {'max':>9}  note"]
    if "poll_cost" in res:
        pc = res["poll_cost"]
        ip = pc["in_process"]
        for k, label in (("cold_ms", "state, tree rebuilt (in process) ms"),
                         ("warm_ms", "state, tree reused (in process) ms")):
            q = ip[k]
            lines.append(f"{label:<44} {q['median']:>9.2f} {q['p90']:>9.2f} {q['max']:>9.2f}  "
                         f"{ip['sessions']} sessions, {ip['distinct_blocks']} blocks, "
                         f"{ip['bytes']:,} B; target < {POLL_TARGET_MS} ms")
        h = pc["http"]
        q = h["round_trip_ms"]
        lines.append(f"{'GET /webui/state round trip (tiny model) ms':<44} {q['median']:>9.2f} "
                     f"{q['p90']:>9.2f} {q['max']:>9.2f}  {h['sessions']} sessions, "
                     f"{h['cached_blocks']} cached blocks, {h['bytes']:,} B")
    if "decode" in res:
        d = res["decode"]
        off, on = d["tok_s_off"], d["tok_s_on"]
        lines.append(f"{'decode tok/s, not polled':<44} {statistics.median(off):>9.1f} "
                     f"{'':>9} {max(off):>9.1f}  {d['streams']} streams, {d['rounds']} rounds "
                     f"of {d['window_s']} s, {Path(d['model']).name}")
        lines.append(f"{'decode tok/s, polled every 500 ms':<44} {statistics.median(on):>9.1f} "
                     f"{'':>9} {max(on):>9.1f}")
        lo, hi = d["ratio_ci95"]
        lines.append(f"{'ratio polled / not polled (per round)':<44} "
                     f"{statistics.median(d['ratios']):>9.3f} {'':>9} {d['ratio_max']:>9.3f}  "
                     f"mean {d['ratio_mean']:.3f} sd {d['ratio_sd']:.3f} min {d['ratio_min']:.3f}"
                     f", 95% [{lo:.3f}, {hi:.3f}]: "
                     + ("measurable" if d["measurable"] else "not measurable"))
        if d["poll_ms"]:
            q = d["poll_ms"]
            lines.append(f"{'the poller: GET /webui/state while decoding ms':<44} "
                         f"{q['median']:>9.2f} {q['p90']:>9.2f} {q['max']:>9.2f}  {q['n']} polls")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", default="poll-cost,decode")
    ap.add_argument("--model", default="smollm2-135m-instruct",
                    help="the decode part's model (catalog name or GGUF path)")
    ap.add_argument("--streams", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--window", type=float, default=4.0, help="seconds per condition and round")
    ap.add_argument("--repeats", type=int, default=50, help="polls timed per poll-cost figure")
    args = ap.parse_args()
    only = set(args.only.split(","))
    res: dict = {"when": time.strftime("%Y-%m-%d %H:%M:%S"), "cpus": os.cpu_count()}
    with tempfile.TemporaryDirectory(prefix="kvshare-webui-bench-") as log_dir:
        if "poll-cost" in only:
            res["poll_cost"] = {"in_process": poll_cost_in_process(args.repeats),
                                "http": poll_cost_http(args.repeats, log_dir)}
        if "decode" in only:
            res["decode"] = decode_bench(args.model, args.streams, args.rounds, args.window,
                                         log_dir)
    print(table(res))
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "webui_bench.json").write_text(json.dumps(res, indent=1))
    print(f"wrote {OUT / 'webui_bench.json'}")


if __name__ == "__main__":
    main()
