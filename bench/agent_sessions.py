"""Three agent sessions sharing a long prefix, with and without cross-session sharing.

Reproduces the llama-server experiment of issue 4 on the default model: a ~6K-token agent
prefix (tool schemas + system prompt) in Gemma chat format; the sessions differ only in a
session id at the end of the system prompt and in the question. Session 2 arrives while 1
decodes, session 3 while 1 and 2 decode; each generates 48 tokens. For each configuration
(kvshare with sharing, kvshare with --no-slot-attach, and optionally --peer-url) it records
TTFT per session, each session's decode speed, cache_n, and kvshare's peak KV tokens; then it
sweeps the prefix length and plots 3rd-session TTFT vs prefix length.

    python bench/agent_sessions.py                 # full run (prefix 6K, sweep 2K/4K/8K)
    python bench/agent_sessions.py --quick         # small prefix, no sweep (smoke test)
    python bench/agent_sessions.py --peer-url http://127.0.0.1:8081   # add a side-by-side row

Writes bench/out/agent_sessions.json and bench/out/agent_sessions.png.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

OUT = Path(__file__).parent / "out"
GEN_TOKENS = 48


def agent_prefix(target_tokens: int) -> str:
    """A tool-schema + system prompt of roughly `target_tokens` Gemma tokens."""
    tools = []
    i = 0
    text = ""
    while len(text) < target_tokens * 3.2:  # ~3.2 characters per token for JSON-ish text
        tools.append({
            "type": "function",
            "function": {
                "name": f"tool_{i}_search_repository",
                "description": f"Tool {i}: search the repository for files matching a pattern and "
                               f"return matching lines with context; supports regex and globbing.",
                "parameters": {"type": "object", "properties": {
                    "pattern": {"type": "string", "description": "regular expression to search for"},
                    "path": {"type": "string", "description": "directory to search in"},
                    "max_results": {"type": "integer", "description": f"limit, default {10 + i}"},
                }, "required": ["pattern"]},
            },
        })
        i += 1
        text = json.dumps(tools, indent=1)
    return ("You are a coding agent working in a large repository. You can call these tools:\n"
            + text + "\nAlways think step by step and call tools when needed.\n")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, extra: list[str], ctx: int):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        model = [] if "--model" in extra else ["--model", "gemma3-270m"]  # its prompts are Gemma's
        cmd = [sys.executable, "-m", "kvshare.server.cli", "serve", "--port", str(self.port),
               "--parallel", "4", "--kv-unified-per-slot", str(ctx), *model, *extra]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        deadline = time.time() + 300
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {self.proc.stderr.read()[-2000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError("server did not become healthy")

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def run_session(url: str, prefix: str, session: int, question: str, record: dict,
                first_token: threading.Event) -> None:
    body = {
        "stream": True, "stream_options": {"include_usage": True},
        "max_tokens": GEN_TOKENS, "temperature": 0, "ignore_eos": True,
        "messages": [{"role": "system", "content": prefix + f"Session id: {session:08d}."},
                     {"role": "user", "content": question}],
    }
    t0 = time.perf_counter()
    token_times: list[float] = []
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                record["usage"] = chunk["usage"]
                record["timings"] = chunk.get("timings") or {}
            for choice in chunk.get("choices", []):
                if choice.get("delta", {}).get("content"):
                    token_times.append(time.perf_counter())
                    if len(token_times) == 1:
                        first_token.set()
    record["ttft_s"] = token_times[0] - t0 if token_times else None
    record["token_times"] = token_times
    n = len(token_times)
    record["decode_tps"] = (n - 1) / (token_times[-1] - token_times[0]) if n > 1 else None
    record["cache_n"] = (record.get("timings") or {}).get("cache_n",
                        ((record.get("usage") or {}).get("prompt_tokens_details") or {}).get("cached_tokens"))
    record["prompt_tokens"] = (record.get("usage") or {}).get("prompt_tokens")


def three_sessions(url: str, prefix: str, salt: int) -> dict:
    """Solo run for session 1's reference decode speed, then the staggered 3-session run."""
    solo: dict = {}
    run_session(url, prefix + f"(warm-up {salt})", 900 + salt, "Say hello.", solo, threading.Event())
    records = [dict() for _ in range(3)]
    events = [threading.Event() for _ in range(3)]
    questions = ["List the files in src/.", "Find the definition of main.", "Summarise the README."]
    threads = []
    for i in range(3):
        if i > 0:
            events[i - 1].wait(600)
            time.sleep(0.3)  # arrive while the earlier sessions decode
        th = threading.Thread(target=run_session,
                              args=(url, prefix, 1000 * salt + i + 1, questions[i], records[i], events[i]))
        th.start()
        threads.append(th)
    for th in threads:
        th.join()
    # Session 1's decode speed while sessions 2 and 3 arrive and prefill.
    s1 = records[0]["token_times"]
    start = s1[0]
    end = records[2]["token_times"][0] if records[2]["token_times"] else s1[-1]
    window = [t for t in s1 if start <= t <= end]
    during = (len(window) - 1) / (window[-1] - window[0]) if len(window) > 2 else records[0]["decode_tps"]
    for r in records:
        r.pop("token_times", None)
    solo.pop("token_times", None)
    return {"sessions": records, "solo_decode_tps": solo["decode_tps"],
            "s1_decode_tps_during_arrivals": during}


def kv_peak(url: str) -> dict:
    """kvshare's peak KV tokens, peak bytes of KV blocks held by sequences (both layer groups),
    and its block bytes per token (main pool, window pool) for llama.cpp's estimate."""
    try:
        pool = httpx.get(url + "/cache", timeout=5).json()["pool"]
    except Exception:
        return {}
    bs = pool["block_size"]
    win = pool.get("window") or {}
    return {"peak_kv_tokens": pool["peak_tokens_used"],
            "peak_kv_bytes_held": pool.get("peak_kv_bytes_held"),
            "main_bytes_per_token": pool.get("block_bytes", 0) / bs,
            "window_bytes_per_token": win.get("block_bytes", 0) / bs,
            "window": win.get("size", 0)}


def llama_cpp_bytes(run: dict, peak: dict, n_seq: int = 3, n_ubatch: int = 512) -> int | None:
    """What llama.cpp holds for the same sessions, from its cache layout at its defaults
    (llama_kv_cache_iswa, no --swa-full): every session's own cells of the full-attention
    layers (no sharing across sequences), and for the sliding-window layers a cache of
    min(n_ctx, n_swa * n_seq + n_ubatch) cells. Both f16, as kvshare's default."""
    if not peak.get("window"):
        return None
    cells = sum((s.get("prompt_tokens") or 0) + GEN_TOKENS for s in run["sessions"])
    swa_cells = peak["window"] * n_seq + n_ubatch
    return int(cells * peak["main_bytes_per_token"] + swa_cells * peak["window_bytes_per_token"])


def run_config(name: str, extra: list[str] | None, prefix: str, ctx: int, peer: str | None = None) -> dict:
    if peer:
        res = three_sessions(peer, prefix, salt=7)
        res["config"] = name
        return res
    server = Server(extra or [], ctx)
    try:
        res = three_sessions(server.url, prefix, salt=1)
        res.update(kv_peak(server.url))
    finally:
        server.close()
    res["config"] = name
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prefix-tokens", type=int, default=6150)
    ap.add_argument("--sweep", default="2048,4096,8192")
    ap.add_argument("--quick", action="store_true", help="1K prefix, no sweep")
    ap.add_argument("--peer-url", default=None)
    args = ap.parse_args()
    if args.quick:
        args.prefix_tokens, args.sweep = 1024, ""
    OUT.mkdir(parents=True, exist_ok=True)
    ctx = 12288
    prefix = agent_prefix(args.prefix_tokens)
    results = {"prefix_tokens_target": args.prefix_tokens, "gen_tokens": GEN_TOKENS, "runs": []}
    configs = [("kvshare (sharing)", []), ("kvshare --no-slot-attach", ["--no-slot-attach"])]
    for name, extra in configs + [("kvshare --swa-full", ["--swa-full"])]:
        results["runs"].append(run_config(name, extra, prefix, ctx))
    if args.peer_url:
        results["runs"].append(run_config(f"peer {args.peer_url}", None, prefix, ctx, peer=args.peer_url))

    print(f"\nprefix ~{args.prefix_tokens} tokens, {GEN_TOKENS} tokens per session")
    print(f"{'config':28} {'sess':>4} {'prompt':>7} {'cache_n':>7} {'TTFT s':>8} {'decode t/s':>10}")
    for run in results["runs"]:
        for i, s in enumerate(run["sessions"]):
            print(f"{run['config']:28} {i + 1:>4} {s.get('prompt_tokens') or 0:>7} {s.get('cache_n') or 0:>7} "
                  f"{s['ttft_s'] or float('nan'):>8.2f} {s['decode_tps'] or float('nan'):>10.1f}")
        held = run.get("peak_kv_bytes_held")
        print(f"{'':28} peak KV tokens {run.get('peak_kv_tokens')}, peak KV held "
              f"{held / 2**20 if held else float('nan'):.1f} MiB, session-1 decode solo "
              f"{run['solo_decode_tps']:.1f} t/s, during arrivals {run['s1_decode_tps_during_arrivals']:.1f} t/s")
    share, noshare = results["runs"][0], results["runs"][1]
    t3s, t3n = share["sessions"][2]["ttft_s"], noshare["sessions"][2]["ttft_s"]
    prompt = share["sessions"][0]["prompt_tokens"] or 0
    private = sum((s["prompt_tokens"] or 0) - (s["cache_n"] or 0) for s in share["sessions"][1:])
    llama = llama_cpp_bytes(share, share)
    full = next(r for r in results["runs"] if r["config"] == "kvshare --swa-full")
    if llama:
        print(f"KV held at peak, three sessions: kvshare {share['peak_kv_bytes_held'] / 2**20:.1f} MiB, "
              f"kvshare --swa-full {full['peak_kv_bytes_held'] / 2**20:.1f} MiB, llama.cpp "
              f"{llama / 2**20:.1f} MiB (computed from its cache layout): "
              f"{share['peak_kv_bytes_held'] / llama:.2f}x llama.cpp")
    results["summary"] = {
        "peak_kv_bytes_held": share.get("peak_kv_bytes_held"),
        "peak_kv_bytes_held_swa_full": full.get("peak_kv_bytes_held"),
        "llama_cpp_kv_bytes_computed": llama,
        "kv_held_over_llama_cpp": share["peak_kv_bytes_held"] / llama if llama else None,
        "ttft3_ratio_share_over_noshare": t3s / t3n if t3s and t3n else None,
        "peak_kv_tokens_share": share.get("peak_kv_tokens"),
        "peak_kv_bound_1_1x": 1.1 * (prompt + private + 3 * GEN_TOKENS),
        "s1_decode_keep_ratio": share["s1_decode_tps_during_arrivals"] / share["solo_decode_tps"],
    }
    print("summary:", json.dumps(results["summary"], indent=1))

    sweep = [int(x) for x in args.sweep.split(",") if x]
    if sweep:
        results["sweep"] = []
        for n in sweep:
            p = agent_prefix(n)
            row = {"prefix_tokens_target": n}
            for name, extra in configs:
                r = run_config(name, extra, p, max(ctx, n + 2048))
                row[name] = r["sessions"][2]["ttft_s"]
            results["sweep"].append(row)
            print(f"sweep {n}: " + ", ".join(f"{k}={v}" for k, v in row.items()))
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt

            fig, ax = plt.subplots(figsize=(6, 4))
            for name, _ in configs:
                ax.plot(sweep, [r[name] for r in results["sweep"]], marker="o", label=name)
            ax.set_xlabel("shared prefix (tokens)")
            ax.set_ylabel("3rd-session TTFT (s)")
            ax.set_yscale("log")
            ax.legend()
            ax.grid(True, alpha=0.3)
            fig.tight_layout()
            fig.savefig(OUT / "agent_sessions.png", dpi=120)
        except ImportError:
            print("matplotlib not installed: no plot", file=sys.stderr)
    (OUT / "agent_sessions.json").write_text(json.dumps(results, indent=1))
    print(f"wrote {OUT / 'agent_sessions.json'}")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
