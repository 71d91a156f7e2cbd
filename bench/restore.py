"""Time to first token for a returning conversation: recomputed vs restored from RAM vs disk.

Issue 6's benchmark, on the default model (Gemma 3 270M, CPU unless --device cuda). For each
conversation size (~2K / 8K / 20K tokens) turn 1 is computed, then turn 2 (turn 1 + the reply +
a new user message) is sent three ways:

  (a) recomputed: the same turn-2 tokens with a fresh `cache_salt` (nothing can be reused),
      on a server whose pool only holds about one conversation, so this also pushes turn 1's
      blocks out of the pool;
  (b) RAM: the unsalted turn 2 on the same server: turn 1's blocks come back from the RAM tier;
  (c) disk: a new server process (`--cache-ram 0`) on the same `--cache-dir`: the blocks come
      from disk. By default the cache files are first dropped from the OS page cache
      (posix_fadvise DONTNEED), so this reads the device, not memory (--warm-page-cache: don't).
      Measured twice: "1st disk" is the first long request of the new process (the salted copy
      from (a), restored from disk), which also pays one-time costs (first touch of the KV pool's
      pages and of the forward pass's long-context buffers); "disk" is then turn 2 itself, also
      from disk (the pool holds one conversation), in a process past those costs.

TTFT is measured by the client (a streamed /v1/completions with token-id prompts, up to the
first token's chunk) and, as a cross-check, by the server (the time-to-first-token histogram:
admission to first token). Every measured request is preceded by waiting for the disk writer
to go idle, and every server gets a short warm-up request first.

    python bench/restore.py               # 2K, 8K, 20K (slow on a CPU: the 20K recompute)
    python bench/restore.py --quick       # 2K only (smoke run)
    python bench/restore.py --sizes 2048,4096

Writes bench/out/restore.json and bench/out/restore.png (needs matplotlib; without it the plot
is skipped). Target: disk restore >= 50x faster than recomputing at 8K tokens. Not run in CI.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import tempfile
import time
import uuid
from pathlib import Path

from serve_process import ServeProcess

OUT = Path(__file__).parent / "out"
CTX = 24576
WORDS = ["cache", "prefix", "session", "agent", "token", "block", "server", "request", "model",
         "layer", "restore", "disk", "memory", "budget", "eviction", "checkpoint", "attention",
         "state", "conversation", "returning", "history", "tool", "schema", "system", "prompt",
         "user", "reply", "turn", "write", "read", "verify", "checksum", "index", "entry",
         "commit", "rename", "fsync", "crash", "kill", "restart", "sweep", "pool", "shared",
         "reference", "hash", "chain", "salt", "tenant"]


# ---------------------------------------------------------------------------- server process

class Server(ServeProcess):
    def __init__(self, args: list[str], log_dir: Path, name: str, timeout: float = 900.0):
        super().__init__(args, log_dir / f"{name}.log", log_level="info",
                         startup_timeout=timeout, client_timeout=3600.0)
        self._n_logged = 0

    def tokenize(self, text: str, add_special: bool) -> list[int]:
        r = self.client.post("/tokenize", json={"content": text, "add_special": add_special})
        r.raise_for_status()
        return r.json()["tokens"]

    def complete(self, ids: list[int], max_tokens: int, salt: str | None = None) -> dict:
        body = {"prompt": ids, "max_tokens": max_tokens, "temperature": 0}
        if salt:
            body["cache_salt"] = salt
        r = self.client.post("/v1/completions", json=body)
        r.raise_for_status()
        self.request_log()
        return r.json()

    def ttft(self, ids: list[int], salt: str | None = None) -> dict:
        """Stream a 2-token completion; the client's TTFT is the first token chunk's arrival."""
        body = {"prompt": ids, "max_tokens": 2, "temperature": 0, "stream": True, "logprobs": 1,
                "stream_options": {"include_usage": True}}
        if salt:
            body["cache_salt"] = salt
        server_before = self.server_ttft()
        first = None
        timings = None
        text = ""
        t0 = time.perf_counter()
        with self.client.stream("POST", "/v1/completions", json=body) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                for ch in chunk.get("choices") or []:
                    if (ch.get("logprobs") or ch.get("text")) and first is None:
                        first = time.perf_counter() - t0
                        text = ch.get("logprobs", {}).get("tokens", [ch.get("text")])[0]
                if chunk.get("timings"):
                    timings = chunk["timings"]
        server = self.server_ttft()
        log = self.request_log()
        return {"ttft_s": first, "server_ttft_s": server[0] - server_before[0],
                # prompt_ms: admission (or first scheduling) to first token, including the
                # tier restore; restore_ms: the restore's own share
                "prefill_s": (log["prompt_ms"] - log.get("restore_ms", 0.0)) / 1e3,
                "restore_s": log.get("restore_ms", 0.0) / 1e3,
                "first_token": text, "cache_n": timings["cache_n"],
                "prompt_tokens": timings["cache_n"] + timings["prompt_n"]}

    def request_log(self, timeout: float = 10.0) -> dict:
        """The server's log line of the request that just finished (requests are sequential)."""
        deadline = time.monotonic() + timeout
        while True:
            lines = [ln for ln in self.log_path.read_text(errors="replace").splitlines()
                     if "kvshare.server.requests" in ln]
            if len(lines) > self._n_logged:
                self._n_logged = len(lines)
                return json.loads(lines[-1].split("kvshare.server.requests: ", 1)[1])
            if time.monotonic() > deadline:
                raise RuntimeError("no request log line")
            time.sleep(0.05)

    def server_ttft(self) -> tuple[float, float]:
        body = self.client.get("/metrics").text
        s = re.search(r"^kvshare_time_to_first_token_seconds_sum (\S+)$", body, re.M)
        c = re.search(r"^kvshare_time_to_first_token_seconds_count (\S+)$", body, re.M)
        return (float(s.group(1)) if s else 0.0, float(c.group(1)) if c else 0.0)

    def tiers(self) -> dict:
        return self.client.get("/cache").json()["tiers"]

    def wait_writer(self, timeout: float = 1800.0) -> None:
        """Until the engine has finished the previous request's tier save (a tiny request
        queues behind it on the engine thread) and the disk writer has nothing queued and
        nothing new lands for a moment."""
        r = self.client.post("/v1/completions", json={"prompt": [2, 3, 4], "max_tokens": 1,
                                                       "temperature": 0})
        r.raise_for_status()
        self.request_log()
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            d = self.tiers().get("disk")
            if d is None:
                return
            state = (d["queued"], d["writes"], d["bytes_written"], d["skipped_existing"],
                     d["dropped_writes"], d["failed_writes"])
            if d["queued"] == 0 and state == last:
                return
            last = state
            time.sleep(0.5)
        raise RuntimeError("disk writer still busy")

    def stop(self) -> None:
        super().stop(timeout=1800)  # SIGTERM drains the disk writer


def drop_page_cache(path: Path) -> int:
    """Ask the kernel to forget the cached pages of every file in `path` (clean after fsync)."""
    n = 0
    for p in path.iterdir():
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                n += p.stat().st_size
            finally:
                os.close(fd)
    return n


# ---------------------------------------------------------------------------- one size

def filler(seed: int, n_words: int) -> str:
    import random

    rng = random.Random(seed)
    out = []
    for i in range(n_words):
        out.append(rng.choice(WORDS))
        if i % 17 == 16:
            out[-1] += "."
    return " ".join(out)


def conversation_ids(srv: Server, target: int, seed: int) -> list[int]:
    """[BOS] <start_of_turn>user\\n <~target tokens> <end_of_turn>\\n<start_of_turn>model\\n"""
    head = srv.tokenize("<start_of_turn>user\nHere is our history so far:\n", True)
    tail = srv.tokenize("<end_of_turn>\n<start_of_turn>model\n", False)
    body: list[int] = []
    chunk = 0
    while len(body) < target:
        body += srv.tokenize(" " + filler(seed * 1000 + chunk, 1500), False)
        chunk += 1
    return head + body[: target - len(head) - len(tail)] + tail


def run_size(target: int, args, work: Path, seed: int) -> dict:
    cache_dir = work / f"cache-{target}"
    if cache_dir.exists():
        shutil.rmtree(cache_dir)
    common = ["--ctx-size", str(CTX), "--parallel", "1", "--device", args.device,
              "--block-size", "16",
              "--cache-dir", str(cache_dir), "--cache-min-tokens", "256"]
    if args.model:
        common += ["--model", args.model]
    # A pool that holds one turn 2 (turn 1 is exactly `target` tokens; the reply and the new
    # message add < 64) and little more, so the salted recompute pushes turn 1 out of it.
    kv_blocks = -(-(target + 64) // 16) + 2
    print(f"\n== {target} tokens (pool {kv_blocks} blocks) ==", flush=True)

    a = Server([*common, "--kv-blocks", str(kv_blocks)], work, f"ram-{target}")
    a.complete(a.tokenize("<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n", True), 2)
    ids1 = conversation_ids(a, target, seed)
    t = time.perf_counter()
    r1 = a.complete(ids1, 8)
    turn1_s = time.perf_counter() - t
    reply = r1["choices"][0]["text"]
    ids2 = ids1 + a.tokenize(reply, False) + a.tokenize(
        "<end_of_turn>\n<start_of_turn>user\nGood. What should we do next?<end_of_turn>\n"
        "<start_of_turn>model\n", False)
    print(f"turn 1: {len(ids1)} tokens computed in {turn1_s:.1f} s; turn 2: {len(ids2)} tokens",
          flush=True)
    a.wait_writer()
    salt = f"bench-recompute-{uuid.uuid4().hex}"
    recompute = a.ttft(ids2, salt=salt)
    print(f"  recomputed: TTFT {recompute['ttft_s']:.3f} s (cache_n {recompute['cache_n']})",
          flush=True)
    a.wait_writer()
    before = a.tiers()["ram"]
    ram = a.ttft(ids2)
    after = a.tiers()["ram"]
    ram["tier_tokens"] = after["tokens_served"] - before["tokens_served"]
    print(f"  from RAM:   TTFT {ram['ttft_s']:.3f} s, restore {ram['restore_s']:.3f} s "
          f"(cache_n {ram['cache_n']}, {ram['tier_tokens']} from the RAM tier)", flush=True)
    a.wait_writer()
    a.stop()

    dropped = 0 if args.warm_page_cache else drop_page_cache(cache_dir)
    disk_bytes = sum(p.stat().st_size for p in cache_dir.iterdir() if p.is_file())
    b = Server([*common, "--kv-blocks", str(kv_blocks), "--cache-ram", "0"], work, f"disk-{target}")
    b.complete(b.tokenize("<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n", True), 2)
    # First long request of the new process: the salted copy (written by (a)), from disk. It
    # also pays the process's one-time costs (first touch of the KV pool's pages, first
    # long-context forward), which the next measurement then does not.
    first = b.ttft(ids2, salt=salt)
    d0 = b.tiers()["disk"]
    first.update(tier_tokens=d0["tokens_served"], bytes_read=d0["bytes_read"])
    print(f"  from disk, first request after the restart: TTFT {first['ttft_s']:.3f} s, restore "
          f"{first['restore_s']:.3f} s (cache_n {first['cache_n']}, "
          f"{d0['bytes_read'] / 2**20:.0f} MiB read)", flush=True)
    b.wait_writer()
    disk = b.ttft(ids2)  # the pool holds one conversation: this one comes from disk too
    d = b.tiers()["disk"]
    disk.update(tier_tokens=d["tokens_served"] - d0["tokens_served"],
                bytes_read=d["bytes_read"] - d0["bytes_read"])
    print(f"  from disk:  TTFT {disk['ttft_s']:.3f} s, restore {disk['restore_s']:.3f} s "
          f"(cache_n {disk['cache_n']}, {disk['tier_tokens']} from disk, "
          f"{disk['bytes_read'] / 2**20:.0f} MiB read)", flush=True)
    b.stop()
    same = recompute["first_token"] == ram["first_token"] == disk["first_token"] == first["first_token"]
    if not same:
        print("  WARNING: first tokens differ:", recompute["first_token"], ram["first_token"],
              disk["first_token"], first["first_token"])
    if not args.keep_cache:
        shutil.rmtree(cache_dir, ignore_errors=True)
    return {
        "target_tokens": target, "turn1_tokens": len(ids1), "turn2_tokens": len(ids2),
        "turn1_s": turn1_s, "kv_blocks": kv_blocks, "disk_bytes": disk_bytes,
        "page_cache_dropped_bytes": dropped, "same_first_token": same,
        "recompute": recompute, "ram": ram, "disk": disk, "disk_after_restart": first,
        "speedup_ram": recompute["ttft_s"] / ram["ttft_s"],
        "speedup_disk": recompute["ttft_s"] / disk["ttft_s"],
        "speedup_disk_after_restart": recompute["ttft_s"] / first["ttft_s"],
    }


# ---------------------------------------------------------------------------- report

def table(rows: list[dict]) -> str:
    def cell(m: dict) -> str:
        return f"{m['ttft_s']:.3f} ({m['restore_s']:.3f})"

    head = (f"{'tokens':>7} {'recompute':>10} {'RAM (restore)':>16} {'disk (restore)':>16} "
            f"{'1st disk (restore)':>19} {'RAM x':>6} {'disk x':>7} {'1st x':>6} {'MiB':>5} "
            f"{'cached':>7}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['turn2_tokens']:>7} {r['recompute']['ttft_s']:>10.3f} {cell(r['ram']):>16} "
            f"{cell(r['disk']):>16} {cell(r['disk_after_restart']):>19} {r['speedup_ram']:>6.1f} "
            f"{r['speedup_disk']:>7.1f} {r['speedup_disk_after_restart']:>6.1f} "
            f"{r['disk']['bytes_read'] / 2**20:>5.0f} "
            f"{100 * r['disk']['cache_n'] / r['disk']['prompt_tokens']:>6.1f}%")
    lines.append("Time to first token in seconds (client side); in parentheses the server's admission-"
                 "to-prefill time,\ni.e. the restore itself (the rest is the prefill of the "
                 "uncached tail, one forward pass over the\nwhole context). x = recompute / "
                 "restore TTFT. 'disk': a restore in a running process; '1st disk':\nthe first "
                 "long request after the restart (also pays first-touch costs of the KV pool).")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)")
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    xs = range(len(rows))
    keys = (("recompute", "recomputed"), ("ram", "RAM tier"), ("disk", "disk tier"),
            ("disk_after_restart", "disk, 1st request after restart"))
    w = 0.2
    for k, (key, label) in enumerate(keys):
        vals = [r[key]["ttft_s"] for r in rows]
        bars = ax.bar([x + (k - 1.5) * w for x in xs], vals, w, label=label)
        for b, v in zip(bars, vals):
            ax.annotate(f"{v:.2f}s", (b.get_x() + b.get_width() / 2, v), ha="center",
                        va="bottom", fontsize=7)
    ax.set_yscale("log")
    top = max(r["recompute"]["ttft_s"] for r in rows)
    ax.set_ylim(top=top * 30)  # room for the legend above the bars
    ax.set_xticks(list(xs))
    ax.set_xticklabels([f"{r['turn2_tokens']} tokens\n(disk {r['speedup_disk']:.0f}x)" for r in rows])
    ax.set_ylabel("time to first token (s, log)")
    ax.set_title("Returning conversation: recompute vs restore (Gemma 3 270M)")
    ax.legend(loc="upper center", ncol=2, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="2K tokens only (smoke run)")
    ap.add_argument("--sizes", default="2048,8192,20480", help="conversation sizes in tokens")
    ap.add_argument("--model", default=None, help="GGUF (default: the packaged Gemma 3 270M)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--work-dir", default=None, help="cache dirs and logs (default: a temp dir)")
    ap.add_argument("--warm-page-cache", action="store_true",
                    help="don't drop the cache files from the OS page cache before (c)")
    ap.add_argument("--keep-cache", action="store_true", help="keep the cache dirs")
    ap.add_argument("--out", default=str(OUT / "restore.json"))
    args = ap.parse_args(argv)
    sizes = [2048] if args.quick else [int(s) for s in args.sizes.split(",")]
    work = Path(args.work_dir) if args.work_dir else Path(tempfile.mkdtemp(prefix="kvshare-restore-"))
    work.mkdir(parents=True, exist_ok=True)
    rows = [run_size(n, args, work, seed=i + 1) for i, n in enumerate(sizes)]
    print()
    print(table(rows))
    result = {"model": args.model or "gemma-3-270m-q4_k_m (default)", "device": args.device,
              "ctx_size": CTX, "page_cache": "warm" if args.warm_page_cache else "dropped",
              "rows": rows}
    at8k = [r for r in rows if r["target_tokens"] == 8192]
    if at8k:
        x = at8k[0]["speedup_disk"]
        y = at8k[0]["speedup_disk_after_restart"]
        result["target"] = {"disk_speedup_at_8k": x, "disk_speedup_at_8k_first_after_restart": y,
                            "wanted": 50.0, "met": x >= 50.0}
        print(f"\ndisk restore vs recompute at 8K: {x:.0f}x (first request after the restart: "
              f"{y:.0f}x); target >= 50x: {'met' if x >= 50 else 'NOT met'}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")
    plot(rows, out.with_suffix(".png"))
    if not args.work_dir:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
