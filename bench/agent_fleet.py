"""A multi-turn agent fleet on a shared tool prefix: issue 13's agent-turn acceptance.

N sessions (default 4) share a ~6K-token agent prefix (tool schemas + system prompt, sent as
the system message of /v1/chat/completions so the server applies the model's chat template).
Each session runs T turns (default 3); every turn re-sends the whole conversation so far (the
earlier user messages and the assistant replies the server returned) plus ~150 new tokens of
user text (the first turn: a session id and a task, later turns: a tool result and a
question), and generates a short greedy reply. The sessions run concurrently (one thread and
one HTTP connection each, streaming), all released at once.

Measured per target: TTFT (request sent -> first non-empty content or reasoning_content chunk) of the first turn
and of the later turns (median, max), the fleet's wall time (release -> last reply done), and
the cached prompt tokens the server reports (kvshare: usage.prompt_tokens_details.cached_tokens
and timings.cache_n; llama-server: timings.cache_n). Targets (kvshare / peer): later-turn TTFT
median <= 0.75x and fleet wall <= 1/4.

kvshare is started by the bench (`kvshare serve`, default settings, free loopback port, ready
once /health answers); the peer is an already-running llama-server given by --peer-url (start
it on the same GGUF with as many slots as sessions, e.g. `llama-server -m MODEL -np 4 -c 32768`).
The prompts are deterministic for a --seed and are sized with kvshare's own tokenizer
(POST /tokenize; the peer's /tokenize with --no-kvshare; a character estimate otherwise). A
server that kept this seed's prefix from an earlier run starts warm: restart it or change --seed.

    python bench/agent_fleet.py --quick                   # smoke test: ~1.5K prefix, 2x2 turns
    python bench/agent_fleet.py                           # 6K prefix, 4 sessions x 3 turns
    python bench/agent_fleet.py --peer-url http://127.0.0.1:8081   # side by side with llama-server

On a GPU (issue 40's figures; KVSHARE_* variables reach the server only through --server-env):

    python bench/agent_fleet.py --model q15.gguf --server-args "--device cuda" \
        --server-env KVSHARE_GPU_WEIGHTS=blocks --out agent_fleet.json

The host's side of that fleet without a GPU: the same server on the CPU emulator of CuPy with
no kernel run (token 0 sampled every step), on a random 1.5b-shaped GGUF cut to a few layers
(its steps are CUDA graphs: one launch each, whatever the layer count):

    python bench/agent_fleet.py --model q15_4layers.gguf --server-args "--device cuda" \
        --server-launcher tests/gpu_emu/kvshare_emu.py --server-env KVSHARE_EMU_NOOP=1 \
        --server-env KVSHARE_GPU_WEIGHTS=blocks --out bench/out/agent_fleet_gpu_host.json

Writes bench/out/agent_fleet.json (or --out).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shlex
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_process import ServeProcess  # noqa: E402

OUT = Path(__file__).parent / "out"
DEFAULT_CTX = 8192  # kvshare's default context per sequence
TTFT_TARGET = 0.75  # later-turn TTFT median, kvshare / peer
WALL_TARGET = 0.25  # fleet wall, kvshare / peer

VERBS = ["search", "read", "list", "edit", "run", "inspect", "diff", "grep", "build", "test",
         "format", "lint", "rename", "move", "annotate", "profile", "trace", "bisect"]
NOUNS = ["repository", "file", "directory", "symbol", "function", "commit", "branch", "issue",
         "module", "package", "test_suite", "config", "log", "dependency", "snippet", "patch"]
WORDS = ["the", "a", "matching", "recursive", "optional", "given", "current", "cached", "relative",
         "absolute", "path", "pattern", "line", "range", "result", "context", "limit", "output",
         "encoding", "timeout", "workspace", "index", "query", "filter", "sorted", "unique",
         "glob", "regex", "offset", "window", "summary", "error", "warning", "status", "target"]
IDENTS = ["parse_config", "load_model", "KvPool", "Scheduler.step", "attach_prefix", "run_batch",
          "tokenize", "BlockTable", "evict_lru", "decode_one", "prefill_chunk", "SlotManager",
          "read_header", "write_snapshot", "restore_tier", "merge_finishes", "route_path"]


# --------------------------------------------------------------------------- prompts

def _sentence(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n)).capitalize() + "."


def _tool(seed: int, i: int) -> dict:
    rng = random.Random(f"{seed}-tool-{i}")
    props = {}
    for _ in range(rng.randint(2, 4)):
        name = f"{rng.choice(WORDS)}_{rng.choice(WORDS)}"
        typ = rng.choice(["string", "integer", "boolean", "string"])
        props[name] = {"type": typ, "description": _sentence(rng, rng.randint(4, 9))}
    return {"type": "function", "function": {
        "name": f"{rng.choice(VERBS)}_{rng.choice(NOUNS)}_{i}",
        "description": _sentence(rng, rng.randint(10, 20)),
        "parameters": {"type": "object", "properties": props,
                       "required": sorted(props)[:1]},
    }}


def agent_prefix(seed: int, n_tools: int) -> str:
    """The shared system prompt: instructions + `n_tools` tool schemas (deterministic)."""
    tools = json.dumps([_tool(seed, i) for i in range(n_tools)], indent=1)
    return ("You are a coding agent working in a large repository. You can call these tools; "
            "to call one, answer with a JSON object {\"name\": ..., \"arguments\": {...}}.\n"
            + tools + "\nThink step by step, call tools when needed, keep answers short.\n")


def user_text(seed: int, session: int, turn: int, units: int) -> str:
    """Turn 0: the session id and a task; later turns: a tool result and a question."""
    rng = random.Random(f"{seed}-user-{session}-{turn}")
    if turn == 0:
        head = (f"Session id: {session:04d}-{rng.randrange(16 ** 6):06x}. Task: fix the failing "
                f"test in module {rng.choice(NOUNS)} and explain the cause. Notes:\n")
        body = "\n".join(f"- {_sentence(rng, 10)}" for _ in range(units))
        return head + body
    tool = f"{rng.choice(VERBS)}_{rng.choice(NOUNS)}"
    lines = [f"src/{rng.choice(NOUNS)}/{rng.choice(IDENTS).split('.')[0].lower()}.py:"
             f"{rng.randint(1, 2000)}: {rng.choice(IDENTS)}({rng.choice(WORDS)}, "
             f"{rng.choice(WORDS)}={rng.randint(0, 99)})" for _ in range(units)]
    return (f"Tool result ({tool}, {units} matches):\n" + "\n".join(lines)
            + f"\nWhich of these should I look at next, and why? ({rng.choice(WORDS)} first)")


def fit(make: Callable[[int], str], target: int, count: Callable[[str], int],
        start: int) -> tuple[str, int]:
    """The text make(n) whose token count is closest to `target` (a few proportional steps)."""
    n, best = max(1, start), None
    seen: dict[int, int] = {}
    for _ in range(6):
        if n not in seen:
            seen[n] = count(make(n))
        if best is None or abs(seen[n] - target) < abs(seen[best] - target):
            best = n
        if abs(seen[n] - target) <= max(2, target // 50):
            break
        n = max(1, round(n * target / max(1, seen[n])))
        if n in seen:
            break
    assert best is not None
    return make(best), seen[best]


def tokenizer(url: str | None) -> tuple[Callable[[str], int], str]:
    """The server's own token count (POST /tokenize), or ~3.2 characters per token."""
    if url:
        try:
            with httpx.Client(timeout=60) as c:
                r = c.post(url + "/tokenize", json={"content": "Hello world."})
                if r.status_code == 200 and isinstance(r.json().get("tokens"), list):
                    def count(text: str) -> int:
                        # in pieces cut at newlines: /tokenize caps its input (kvshare: 4 x ctx)
                        pieces, cur = [], ""
                        for line in text.splitlines(keepends=True):
                            if cur and len(cur) + len(line) > 16000:
                                pieces.append(cur)
                                cur = ""
                            cur += line
                        pieces.append(cur)
                        n = 0
                        with httpx.Client(timeout=120) as cl:
                            for piece in pieces:
                                resp = cl.post(url + "/tokenize", json={"content": piece})
                                resp.raise_for_status()
                                n += len(resp.json()["tokens"])
                        return n
                    return count, f"{url}/tokenize"
        except (httpx.HTTPError, ValueError):
            pass
    return (lambda text: max(1, round(len(text) / 3.2))), "estimate (3.2 chars/token)"


def build_prompts(args: argparse.Namespace, count: Callable[[str], int]) -> dict:
    prefix, prefix_tokens = fit(lambda n: agent_prefix(args.seed, n), args.prefix_tokens, count,
                                start=max(1, args.prefix_tokens // 75))
    users, user_tokens = [], []
    for s in range(args.sessions):
        row, row_tokens = [], []
        for t in range(args.turns):
            text, n = fit(lambda k, s=s, t=t: user_text(args.seed, s, t, k), args.new_tokens,
                          count, start=max(1, args.new_tokens // 16))
            row.append(text)
            row_tokens.append(n)
        users.append(row)
        user_tokens.append(row_tokens)
    return {"prefix": prefix, "prefix_tokens": prefix_tokens, "users": users,
            "user_tokens": user_tokens}


# --------------------------------------------------------------------------- the fleet

def cached_of(usage: dict, timings: dict) -> int | None:
    if "cache_n" in timings:
        return timings["cache_n"]
    return (usage.get("prompt_tokens_details") or {}).get("cached_tokens")


def one_turn(client: httpx.Client, messages: list[dict], max_tokens: int,
             ignore_eos: bool) -> dict:
    body: dict = {"messages": messages, "max_tokens": max_tokens, "temperature": 0,
                  "stream": True, "stream_options": {"include_usage": True}}
    if ignore_eos:
        body["ignore_eos"] = True
    rec: dict = {"ttft_s": None}
    parts: list[str] = []
    usage: dict = {}
    timings: dict = {}
    finish = None
    reasoning_chars = 0
    t0 = time.perf_counter()
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            r.read()
            raise RuntimeError(f"HTTP {r.status_code}: {r.text[:500]}")
        for line in r.iter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if "id" not in rec and chunk.get("id"):
                rec["id"] = chunk["id"]
            if chunk.get("usage"):
                usage = chunk["usage"]
            if chunk.get("timings"):
                timings = chunk["timings"]
            for choice in chunk.get("choices") or []:
                delta = choice.get("delta") or {}
                piece = delta.get("content")
                # a reasoning model's first tokens stream as reasoning_content: the first
                # token either way (a random-weight model with a thinking template may
                # never leave it)
                thought = delta.get("reasoning_content")
                if (piece or thought) and rec["ttft_s"] is None:
                    rec["ttft_s"] = time.perf_counter() - t0
                if thought:
                    reasoning_chars += len(thought)
                if piece:
                    parts.append(piece)
                if choice.get("finish_reason"):
                    finish = choice["finish_reason"]
                    if rec["ttft_s"] is None:  # an empty reply: the finish is the first answer
                        rec["ttft_s"] = time.perf_counter() - t0
                        rec["empty_reply"] = True
    rec["latency_s"] = time.perf_counter() - t0
    rec["reply"] = "".join(parts)
    rec["reasoning_chars"] = reasoning_chars
    rec["finish_reason"] = finish
    rec["prompt_tokens"] = usage.get("prompt_tokens")
    if rec["prompt_tokens"] is None and "prompt_n" in timings:
        rec["prompt_tokens"] = timings["prompt_n"] + timings.get("cache_n", 0)
    rec["completion_tokens"] = usage.get("completion_tokens", timings.get("predicted_n"))
    rec["cached_tokens"] = cached_of(usage, timings)
    rec["server_prompt_ms"] = timings.get("prompt_ms")
    return rec


def run_session(url: str, prompts: dict, s: int, args: argparse.Namespace,
                barrier: threading.Barrier, t_start: list[float], out: list) -> None:
    messages: list[dict] = [{"role": "system", "content": prompts["prefix"]}]
    with httpx.Client(base_url=url, timeout=httpx.Timeout(1800, connect=10)) as client:
        barrier.wait()
        for t in range(args.turns):
            messages.append({"role": "user", "content": prompts["users"][s][t]})
            sent = time.perf_counter() - t_start[0]
            try:
                rec = one_turn(client, messages, args.max_tokens, args.ignore_eos)
            except Exception as e:  # recorded, the session stops: the others go on
                out.append({"session": s, "turn": t, "error": f"{type(e).__name__}: {e}"})
                return
            rec.update(session=s, turn=t, sent_at_s=sent)
            out.append(rec)
            messages.append({"role": "assistant", "content": rec["reply"]})


def warm_up(url: str) -> None:
    """One tiny unrelated request first, as a server in use has served before: first-call
    costs stay out of the fleet's times (it shares only the chat template's first tokens)."""
    with httpx.Client(base_url=url, timeout=600) as c:
        c.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "Say OK."}], "max_tokens": 2,
            "temperature": 0}).raise_for_status()


def run_fleet(url: str, prompts: dict, args: argparse.Namespace) -> dict:
    if not args.no_warm_up:
        warm_up(url)
    t_start = [0.0]
    barrier = threading.Barrier(args.sessions + 1,
                                action=lambda: t_start.__setitem__(0, time.perf_counter()))
    records: list[dict] = []
    threads = [threading.Thread(target=run_session,
                                args=(url, prompts, s, args, barrier, t_start, records))
               for s in range(args.sessions)]
    for th in threads:
        th.start()
    barrier.wait()
    for th in threads:
        th.join()
    wall = time.perf_counter() - t_start[0]
    records.sort(key=lambda r: (r["session"], r["turn"]))
    return summarize(records, wall, prompts["prefix_tokens"])


def request_log_times(log: str) -> dict[str, dict]:
    """kvshare's request log lines (`kvshare.server.requests`, logged at --log-level info)
    by response id: prepare_ms, ttft_ms, prompt_ms."""
    out: dict[str, dict] = {}
    for line in log.splitlines():
        _, sep, js = line.partition("kvshare.server.requests: ")
        if sep:
            with contextlib.suppress(ValueError):
                d = json.loads(js)
                out[d["id"]] = d
    return out


def ttft_split(run: dict, times: dict[str, dict]) -> dict | None:
    """Where the later turns' TTFT went (ms, median and max over the turns), from the
    server's request log: before the engine (arrival to hand-over: body, parse, render,
    tokenize), in the engine (hand-over to first token: queued behind other steps, then the
    prompt), and the rest (the client's TTFT less both: HTTP in, SSE out, the client)."""
    rows = [(r, times[r["id"]]) for r in run["records"]
            if r["turn"] > 0 and "error" not in r and r.get("id") in times
            and "prepare_ms" in times[r["id"]] and "ttft_ms" in times[r["id"]]]
    if not rows:
        return None
    return {
        "n": len(rows),
        "before_engine_ms": _stats([t["prepare_ms"] for _, t in rows]),
        "engine_ms": _stats([t["ttft_ms"] for _, t in rows]),
        "engine_prompt_ms": _stats([t["prompt_ms"] for _, t in rows]),
        "rest_ms": _stats([1e3 * r["ttft_s"] - t["prepare_ms"] - t["ttft_ms"] for r, t in rows]),
    }


def _stats(xs: list[float]) -> dict:
    return {"median": statistics.median(xs) if xs else None, "max": max(xs) if xs else None,
            "n": len(xs)}


def summarize(records: list[dict], wall: float, prefix_tokens: int) -> dict:
    ok = [r for r in records if "error" not in r]
    first = [r["ttft_s"] for r in ok if r["turn"] == 0]
    later = [r["ttft_s"] for r in ok if r["turn"] > 0]
    per_turn = {}
    for t in sorted({r["turn"] for r in ok}):
        rows = [r for r in ok if r["turn"] == t]
        prompt = sum(r["prompt_tokens"] or 0 for r in rows)
        cached = [r["cached_tokens"] for r in rows if r["cached_tokens"] is not None]
        per_turn[t] = {"ttft": _stats([r["ttft_s"] for r in rows]), "prompt_tokens": prompt,
                       "cached_tokens": sum(cached) if cached else None,
                       "completion_tokens": sum(r["completion_tokens"] or 0 for r in rows)}
    later_rows = [r for r in ok if r["turn"] > 0]
    later_prompt = sum(r["prompt_tokens"] or 0 for r in later_rows)
    later_cached = [r["cached_tokens"] for r in later_rows if r["cached_tokens"] is not None]
    return {
        "wall_s": wall, "turn1_ttft": _stats(first), "later_ttft": _stats(later),
        "per_turn": per_turn,
        "later_cached_fraction": (sum(later_cached) / later_prompt
                                  if later_cached and later_prompt else None),
        "turn1_max_cached": max((r["cached_tokens"] or 0 for r in ok if r["turn"] == 0),
                                default=None),
        "completion_tokens": sum(r["completion_tokens"] or 0 for r in ok),
        "empty_replies": sum(1 for r in ok if r.get("empty_reply")),
        "errors": [r for r in records if "error" in r],
        "records": records,
        "prefix_tokens": prefix_tokens,
    }


# --------------------------------------------------------------------------- report

def _f(x: float | None, fmt: str = ".2f") -> str:
    return "-" if x is None else format(x, fmt)


def _med_max(st: dict) -> str:
    return f"{_f(st['median'], '.1f')}/{_f(st['max'], '.1f')}"


def report(results: dict) -> None:
    runs = results["runs"]
    if results.get("kvshare_banner"):
        print(f"\n{results['kvshare_banner']}", end="")
    if results.get("peer_url"):
        print(f"\npeer: {results['peer_url']}", end="")
    print(f"\nprefix {results['prompts']['prefix_tokens']} tokens "
          f"({results['prompts']['counted_by']}), {results['config']['sessions']} sessions x "
          f"{results['config']['turns']} turns, ~{results['config']['new_tokens']} new tokens "
          f"per turn, max_tokens {results['config']['max_tokens']}")
    print(f"{'target':9} {'turn-1 TTFT med':>15} {'later TTFT med':>14} {'later max':>9} "
          f"{'fleet wall s':>12} {'later cached':>12} {'gen tok':>7}")
    for name, r in runs.items():
        frac = r.get("later_cached_fraction")
        print(f"{name:9} {_f(r['turn1_ttft']['median']):>15} {_f(r['later_ttft']['median']):>14} "
              f"{_f(r['later_ttft']['max']):>9} {_f(r['wall_s']):>12} "
              f"{'-' if frac is None else f'{100 * frac:.0f}%':>12} {r['completion_tokens']:>7}")
    for name, r in runs.items():
        turns = ", ".join(
            f"t{int(t) + 1}: TTFT med {_f(v['ttft']['median'])} s, cached "
            f"{'-' if v['cached_tokens'] is None else v['cached_tokens']}/{v['prompt_tokens']}"
            for t, v in r["per_turn"].items())
        print(f"  {name}: {turns}")
        sp = r.get("later_ttft_split")
        if sp:
            print(f"  {name}: later turns' TTFT, med/max ms: before the engine "
                  f"{_med_max(sp['before_engine_ms'])} (body, parse, render, tokenize); in the "
                  f"engine {_med_max(sp['engine_ms'])} (of which the prompt "
                  f"{_med_max(sp['engine_prompt_ms'])}); the rest {_med_max(sp['rest_ms'])} "
                  f"(HTTP, SSE, the client)")
        if r["errors"]:
            print(f"  {name}: {len(r['errors'])} failed turn(s): {r['errors'][0]['error']}")
        if r["empty_replies"]:
            print(f"  {name}: {r['empty_replies']} empty repl(ies): TTFT taken at the finish chunk")
    s = results.get("summary")
    if s:
        print(f"kvshare/peer: later-turn TTFT median {_f(s['later_ttft_ratio'], '.3f')} "
              f"(target <= {TTFT_TARGET}: {'met' if s['later_ttft_met'] else 'NOT met'}), "
              f"later-turn TTFT max {_f(s['later_ttft_max_ratio'], '.3f')}, "
              f"fleet wall {_f(s['wall_ratio'], '.3f')} "
              f"(target <= {WALL_TARGET}: {'met' if s['wall_met'] else 'NOT met'})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prefix-tokens", type=int, default=6000)
    ap.add_argument("--sessions", type=int, default=4)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=150, help="new user tokens per turn")
    ap.add_argument("--max-tokens", type=int, default=32, help="reply length cap per turn")
    ap.add_argument("--quick", action="store_true", help="~1500-token prefix, 2 sessions x 2 turns")
    ap.add_argument("--seed", type=int, default=0, help="prompt seed (same seed, same prompts)")
    ap.add_argument("--ignore-eos", action="store_true",
                    help="always generate --max-tokens (same decode work on both servers)")
    ap.add_argument("--no-warm-up", action="store_true",
                    help="skip the one tiny unrelated request sent to each server first")
    ap.add_argument("--model", default=None, help="GGUF for kvshare (default: the server's)")
    ap.add_argument("--server-args", default="", help="extra arguments for `kvshare serve`")
    ap.add_argument("--server-env", action="append", default=[], metavar="NAME=VALUE",
                    help="an environment variable for `kvshare serve` (repeatable; KVSHARE_* "
                         "variables are not inherited), e.g. KVSHARE_GPU_WEIGHTS=blocks")
    ap.add_argument("--server-launcher", default=None, metavar="SCRIPT",
                    help="a Python script run in place of kvshare's command line: "
                         "tests/gpu_emu/kvshare_emu.py serves `--device cuda` on the CPU "
                         "emulator (with --server-env KVSHARE_EMU_NOOP=1: the fleet's host "
                         "side, no kernel run)")
    ap.add_argument("--out", default=None, help="JSON file (default bench/out/agent_fleet.json)")
    ap.add_argument("--peer-url", default=None, help="an already-running llama-server")
    ap.add_argument("--no-kvshare", action="store_true", help="run the peer only")
    args = ap.parse_args()
    if args.quick:
        args.prefix_tokens, args.sessions, args.turns = 1500, 2, 2
    if args.no_kvshare and not args.peer_url:
        ap.error("--no-kvshare needs --peer-url")
    peer = args.peer_url.rstrip("/") if args.peer_url else None
    OUT.mkdir(parents=True, exist_ok=True)

    results: dict = {"config": {k: v for k, v in vars(args).items()}, "runs": {}}
    server = None
    if not args.no_kvshare:
        serve_args = (["--model", args.model] if args.model else []) + shlex.split(args.server_args)
        need = int(1.2 * (args.prefix_tokens + args.turns * (args.new_tokens + args.max_tokens
                                                             + 40)))
        if need > DEFAULT_CTX and "--kv-unified-per-slot" not in serve_args:
            serve_args += ["--kv-unified-per-slot", str(need)]
        log = Path(tempfile.mkdtemp(prefix="kvshare-agent-fleet-")) / "server.log"
        print(f"starting kvshare serve {' '.join(serve_args)} (log {log})", flush=True)
        env = dict(kv.split("=", 1) for kv in args.server_env)
        # at info, the server logs a line per request: the later turns' TTFT split
        server = ServeProcess(serve_args, log, env=env, launcher=args.server_launcher,
                              log_level="info")
        results["config"]["kvshare_serve_args"] = serve_args
        results["kvshare_banner"] = next((ln for ln in server.log().splitlines()
                                          if "kvshare: serving" in ln), None)
    try:
        count, counted_by = tokenizer(server.url if server else peer)
        prompts = build_prompts(args, count)
        results["prompts"] = {"counted_by": counted_by, "prefix_tokens": prompts["prefix_tokens"],
                              "prefix_chars": len(prompts["prefix"]),
                              "user_tokens": prompts["user_tokens"]}
        print(f"prefix: {prompts['prefix_tokens']} tokens by {counted_by} "
              f"({len(prompts['prefix'])} chars); new user tokens per turn: "
              f"{prompts['user_tokens']}", flush=True)
        if server:
            print("kvshare: running the fleet...", flush=True)
            results["runs"]["kvshare"] = run = run_fleet(server.url, prompts, args)
            run["later_ttft_split"] = ttft_split(run, request_log_times(server.log()))
            with contextlib.suppress(httpx.HTTPError, ValueError):
                results["runs"]["kvshare"]["server_cache"] = server.client.get("/cache").json()
    finally:
        if server:
            server.stop()
    if peer:
        print(f"peer {peer}: running the fleet...", flush=True)
        results["peer_url"] = peer
        results["runs"]["peer"] = run_fleet(peer, prompts, args)
        warm = results["runs"]["peer"]["turn1_max_cached"]
        if warm and warm > prompts["prefix_tokens"] // 2:
            print(f"warning: the peer had {warm} tokens cached on a first turn (a warm prefix "
                  f"from an earlier run?): restart it or use another --seed", file=sys.stderr)

    if "kvshare" in results["runs"] and "peer" in results["runs"]:
        k, p = results["runs"]["kvshare"], results["runs"]["peer"]

        def ratio(a: float | None, b: float | None) -> float | None:
            return a / b if a is not None and b else None

        tr = ratio(k["later_ttft"]["median"], p["later_ttft"]["median"])
        wr = ratio(k["wall_s"], p["wall_s"])
        results["summary"] = {
            "later_ttft_ratio": tr, "later_ttft_target": TTFT_TARGET,
            "later_ttft_met": tr is not None and tr <= TTFT_TARGET,
            "later_ttft_max_ratio": ratio(k["later_ttft"]["max"], p["later_ttft"]["max"]),
            "wall_ratio": wr, "wall_target": WALL_TARGET,
            "wall_met": wr is not None and wr <= WALL_TARGET,
        }
    report(results)
    path = Path(args.out) if args.out else OUT / "agent_fleet.json"
    path.write_text(json.dumps(results, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
