"""How long a decoding stream pauses while other requests wait on a misbehaving Redis (issue 45:
"a slow Redis can only make that request miss the tier; bystanders unaffected").

A real `kvshare serve` (tiny qwen3, `--parallel 4`, `--prefill-chunk 128`) with `--cache-redis`
pointing at tests/fake_redis.py: it answers as an empty Redis at start-up, then goes bad
(`trickle`: a byte every 0.3 s, `silent`: never answers, `reset`: resets connections; `empty`:
stays good, the control). A bystander streams /completion (no cache use); once it decodes,
3 chat requests that need the shared tier (prompts never seen) are sent together. Reported:
the bystander's longest pause between tokens while they run, and their wall time. Redis reads
run on fetch threads before a request is queued (engine/cache/prefetch.py); with reads on the
engine thread the pause was the whole Redis deadline.

Cases: the default deadline (0.5 s) with needy prompts of a few blocks (their prefill is a
few milliseconds), and a 5 s deadline with ~1K-token needy prompts (tests/
test_remote_deadlines.py asserts this one).

    python bench/redis_bystander.py [--json bench/out/redis_bystander.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests"))

from fake_redis import FakeRedis  # noqa: E402
from serve_process import ServeProcess  # noqa: E402
from tier_helpers import TINY_MODEL, chat_body, conversation, text  # noqa: E402

CASES = [("default deadline", 0.5, 60), ("5 s deadline, long prompts", 5.0, 700)]
MODES = ["empty", "trickle", "silent", "reset"]


def measure(mode: str, timeout_s: float, chars: int, log: Path, seed: int) -> dict:
    fake = FakeRedis("empty")
    srv = ServeProcess(["--model", str(TINY_MODEL), "--parallel", "4", "--cache-min-tokens",
                        "64", "--prefill-chunk", "128", "--cache-redis", fake.url,
                        "--cache-redis-timeout", str(timeout_s)], log)
    stop = threading.Event()
    stamps: list[float] = []

    def bystander() -> None:
        body = {"prompt": "count on", "n_predict": 100000, "ignore_eos": True, "stream": True,
                "cache_prompt": False}
        with srv.client.stream("POST", "/completion", json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and '"content"' in line:
                    stamps.append(time.monotonic())
                if stop.is_set():
                    return

    try:
        fake.mode = mode
        t = threading.Thread(target=bystander)
        t.start()
        while len(stamps) < 20:
            time.sleep(0.01)
        needy = [conversation(text(seed + i, chars), f"bystander bench {i}") for i in range(3)]
        walls: list[float] = [0.0] * 3

        def ask(i: int) -> None:
            t0 = time.monotonic()
            r = srv.client.post("/v1/chat/completions", json=chat_body(needy[i], 6))
            assert r.status_code == 200, r.text
            walls[i] = time.monotonic() - t0

        t0 = time.monotonic()
        askers = [threading.Thread(target=ask, args=(i,)) for i in range(3)]
        for a in askers:
            a.start()
        for a in askers:
            a.join()
        t1 = time.monotonic()
        stop.set()
        t.join(60)
        gaps = [b - a for a, b in zip(stamps, stamps[1:]) if b >= t0 and a <= t1]
        health = srv.client.get("/health").json()["tiers"]["remote"]["state"]
        return {"mode": mode, "redis_timeout_s": timeout_s, "needy_chars": chars,
                "bystander_max_pause_s": max(gaps), "bystander_tokens": len(gaps),
                "needy_max_wall_s": max(walls), "tier": health}
    finally:
        stop.set()
        srv.stop()
        fake.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=str(ROOT / "bench" / "out" / "redis_bystander.json"))
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for k, (case, timeout_s, chars) in enumerate(CASES):
            for j, mode in enumerate(MODES):
                row = measure(mode, timeout_s, chars, Path(tmp) / f"{k}-{mode}.log",
                              5000 + 100 * k + 10 * j)
                rows.append({"case": case, **row})
    print(f"{'case':28} {'redis':8} {'bystander max pause':>20} {'needy wall':>11} {'tier':>9}")
    for r in rows:
        print(f"{r['case']:28} {r['mode']:8} {r['bystander_max_pause_s'] * 1e3:17.0f} ms "
              f"{r['needy_max_wall_s']:9.2f} s {r['tier']:>9}")
    out = {"cpu_count": os.cpu_count(), "rows": rows}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
