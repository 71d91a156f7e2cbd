"""The OpenAI Agents SDK with default settings (no forced tool_choice) on a tool-using task,
against `kvshare serve` on a model (default: the default model), over several seeds.

A run succeeds when the agent called `get_weather` for Paris and its final answer carries the
tool's result ("sunny" or "21"). Prints a table and writes bench/out/agents_sdk_default_model.json.

    python bench/agents_sdk_default_model.py [--model NAME_OR_PATH] [--seeds 5] [--n-predict 512]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _run(url: str, seed: int) -> dict:
    import openai
    from agents import (Agent, ModelSettings, OpenAIChatCompletionsModel, Runner,
                        function_tool, set_tracing_disabled)

    set_tracing_disabled(True)
    calls: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """Get the current weather for a city."""
        calls.append(city)
        return f"It is sunny and 21 degrees Celsius in {city}."

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="sk-dummy", max_retries=0,
                                timeout=600)
    agent = Agent(name="weather", model=OpenAIChatCompletionsModel(model="m",
                                                                    openai_client=client),
                  instructions="You are a helpful assistant. Use the tools when they help.",
                  tools=[get_weather],
                  model_settings=ModelSettings(extra_args={"seed": seed}))
    t0 = time.perf_counter()
    try:
        result = await Runner.run(agent, "What is the weather like in Paris right now?",
                                  max_turns=4)
        final = str(result.final_output)
    except Exception as e:  # noqa: BLE001 - a failed run is a data point
        final = f"error: {type(e).__name__}: {e}"
    ok = any("paris" in c.lower() for c in calls) and ("sunny" in final.lower()
                                                        or "21" in final)
    return {"seed": seed, "ok": ok, "calls": calls, "final": final[:200],
            "seconds": round(time.perf_counter() - t0, 1)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--n-predict", type=int, default=512,
                    help="the server's cap on a reply's tokens (the SDK sends no max_tokens)")
    args = ap.parse_args()
    port = _port()
    cmd = [sys.executable, "-m", "kvshare.server.cli", "serve", "--port", str(port),
           "--parallel", "1", "--ctx-size", "4096", "--n-predict", str(args.n_predict)] + (["--model", args.model] if args.model
                                                       else [])
    with open(Path("/tmp") / f"kvshare-agents-{port}.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                env=os.environ.copy())
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        rows = [asyncio.run(_run(url, s)) for s in range(args.seeds)]
    finally:
        proc.terminate()
        proc.wait(30)
    print(f"model: {model}")
    print(f"{'seed':>4} {'ok':>3} {'calls':30} final")
    for r in rows:
        print(f"{r['seed']:>4} {'yes' if r['ok'] else 'no':>3} {json.dumps(r['calls'])[:30]:30} "
              f"{r['final'][:70]!r}")
    n_ok = sum(r["ok"] for r in rows)
    print(f"completed: {n_ok} of {len(rows)}")
    out = Path(__file__).parent / "out" / "agents_sdk_default_model.json"
    out.write_text(json.dumps({"model": model, "completed": n_ok, "n_predict": args.n_predict,
                               "runs": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
