"""Agent-API acceptance at full size: random tool sets with forced calls (tool_choice "required"
or a named function) and random strict json_schema response formats, sent with the official
`openai` SDK to a `kvshare serve` it starts (default model unless --model), --concurrency at a
time, greedy. A reply is valid when (tools) it has tool calls, each of a declared tool (the named
one when named) with arguments that are JSON valid against that tool's schema (jsonschema), or
(json_schema) its content is JSON valid against the schema. The random cases come from
tests/schema_gen.py (the same generator tests/test_agent_api.py uses, seeds 0..N-1).

    python bench/tool_acceptance.py [--tools 200] [--schemas 200] [--concurrency 4]
                                    [--max-tokens 200] [--url http://...]  (an existing server)

Prints a table (requests, valid %, p50/p95 latency, tokens) and writes
bench/out/tool_acceptance.json (every invalid reply listed with its problems).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from serve_process import ServeProcess  # noqa: E402


def _schema_gen():
    spec = importlib.util.spec_from_file_location("schema_gen", ROOT / "tests" / "schema_gen.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


G = _schema_gen()


async def run_cases(url: str, kind: str, n: int, concurrency: int, max_tokens: int) -> dict:
    import openai

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="sk-dummy", timeout=900,
                                max_retries=0)
    cases = [G.tool_case(s) if kind == "tools" else G.schema_case(s) for s in range(n)]
    sem = asyncio.Semaphore(concurrency)
    rows: list[dict] = [{} for _ in cases]

    async def one(i: int) -> None:
        case = cases[i]
        async with sem:
            t0 = time.perf_counter()
            try:
                resp = await client.chat.completions.create(
                    model="kvshare", max_tokens=max_tokens, temperature=0, **case)
            except openai.APIError as e:
                rows[i] = {"seed": i, "valid": False, "latency_s": time.perf_counter() - t0,
                           "problems": [f"{type(e).__name__}: {e}"]}
                return
            dt = time.perf_counter() - t0
        ch = resp.choices[0]
        if kind == "tools":
            calls = [(c.function.name, c.function.arguments) for c in ch.message.tool_calls or []]
            problems = G.check_tool_calls(case, calls)
            if ch.finish_reason != "tool_calls":
                problems.append(f"finish_reason {ch.finish_reason!r}")
            extra = {"tool_choice": case["tool_choice"] if isinstance(case["tool_choice"], str)
                     else "named", "n_tools": len(case["tools"]), "n_calls": len(calls)}
            if problems:
                extra["calls"] = calls
        else:
            schema = case["response_format"]["json_schema"]["schema"]
            problems = G.check_json(schema, ch.message.content)
            if ch.finish_reason != "stop":
                problems.append(f"finish_reason {ch.finish_reason!r}")
            extra = {}
            if problems:
                extra["schema"] = schema
        if problems:
            extra["content"] = ch.message.content
        t = (resp.model_extra or {}).get("timings", {})
        rows[i] = {"seed": i, "valid": not problems, "problems": problems, "latency_s": dt,
                   "prompt_tokens": resp.usage.prompt_tokens,
                   "cached_tokens": resp.usage.prompt_tokens_details.cached_tokens
                   if resp.usage.prompt_tokens_details else None,
                   "completion_tokens": resp.usage.completion_tokens,
                   "finish_reason": ch.finish_reason,
                   "prompt_ms": t.get("prompt_ms"), "predicted_ms": t.get("predicted_ms"),
                   "predicted_per_second": t.get("predicted_per_second"), **extra}

    t0 = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(n)))
    wall = time.perf_counter() - t0
    await client.close()
    lat = [r["latency_s"] for r in rows]
    comp = [r.get("completion_tokens", 0) for r in rows]
    prompt = [r.get("prompt_tokens", 0) for r in rows]
    valid = sum(r["valid"] for r in rows)
    return {
        "kind": kind, "requests": n, "valid": valid, "valid_pct": 100.0 * valid / max(n, 1),
        "latency_p50_s": float(np.percentile(lat, 50)), "latency_p95_s": float(np.percentile(lat, 95)),
        "prompt_tokens_mean": statistics.mean(prompt), "completion_tokens_mean": statistics.mean(comp),
        "completion_tokens_max": max(comp), "completion_tokens_total": sum(comp),
        "wall_s": wall, "throughput_tok_s": sum(comp) / wall,
        "finish_reasons": {k: sum(1 for r in rows if r.get("finish_reason") == k)
                           for k in sorted({r.get("finish_reason") for r in rows}, key=str)},
        "invalid": [r for r in rows if not r["valid"]],
        "prompt_s_total": sum(r.get("prompt_ms") or 0 for r in rows) / 1e3,
        "predicted_s_total": sum(r.get("predicted_ms") or 0 for r in rows) / 1e3,
        "rows": [{k: r.get(k) for k in ("seed", "valid", "latency_s", "prompt_tokens",
                                        "cached_tokens", "completion_tokens", "finish_reason",
                                        "prompt_ms", "predicted_ms")}
                 for r in rows],
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tools", type=int, default=200, help="random tool-set requests")
    ap.add_argument("--schemas", type=int, default=200, help="random json_schema requests")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--model", default=None, help="GGUF path (default: the default model)")
    ap.add_argument("--url", default=None, help="use a running server instead of starting one")
    ap.add_argument("--server-args", default="", help="extra `kvshare serve` flags")
    ap.add_argument("--out", default=str(ROOT / "bench" / "out" / "tool_acceptance.json"))
    args = ap.parse_args(argv)

    proc = None
    url = args.url
    if url is None:
        serve_args = ["--parallel", str(args.concurrency), "--kv-unified-per-slot", "4096",
                      *(["--model", args.model] if args.model else []),
                      *args.server_args.split()]
        log = Path(tempfile.mkdtemp(prefix="kvshare-tool-acceptance-")) / "server.log"
        t0 = time.perf_counter()
        proc = ServeProcess(serve_args, log)
        url = proc.url
        print(f"server up in {time.perf_counter() - t0:.1f} s at {url} (log {log})")
    try:
        runs = []
        for kind, n in (("tools", args.tools), ("json_schema", args.schemas)):
            if n > 0:
                r = asyncio.run(run_cases(url, kind, n, args.concurrency, args.max_tokens))
                runs.append(r)
                print(f"  {kind}: {r['valid']}/{r['requests']} valid in {r['wall_s']:.0f} s",
                      flush=True)
    finally:
        if proc is not None:
            proc.stop()

    print(f"\n{'run':<12} {'requests':>8} {'valid %':>8} {'p50 s':>7} {'p95 s':>7} "
          f"{'prompt tok':>10} {'compl tok':>9} {'max':>5} {'tok/s':>7}")
    for r in runs:
        print(f"{r['kind']:<12} {r['requests']:>8} {r['valid_pct']:>8.1f} "
              f"{r['latency_p50_s']:>7.2f} {r['latency_p95_s']:>7.2f} "
              f"{r['prompt_tokens_mean']:>10.0f} {r['completion_tokens_mean']:>9.1f} "
              f"{r['completion_tokens_max']:>5} {r['throughput_tok_s']:>7.1f}")
    for r in runs:
        for bad in r["invalid"][:10]:
            print(f"  INVALID {r['kind']} seed {bad['seed']}: {bad['problems']}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"concurrency": args.concurrency, "max_tokens": args.max_tokens,
                               "runs": runs}, indent=1, default=str))
    print(f"wrote {out}")
    return 0 if all(r["valid"] == r["requests"] for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
