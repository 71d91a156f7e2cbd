"""What the agent APIs' cache hints buy (issue 12), measured through the official SDKs.

One `kvshare serve` (Gemma 3 270M, `--cache-dir`), an agent prefix of tools + a long system
prompt (`--prefix-words`), and for each API a conversation of three turns:
- chat completions: the client re-sends the whole conversation each turn;
- Anthropic Messages: the same, with `cache_control` on the system prompt and on the last
  message (as Claude Code marks them);
- OpenAI Responses: turn 1 stores, turns 2 and 3 send only their new input with
  `previous_response_id`.
Each turn is streamed; the table shows the prompt, the tokens reused from the cache and the time
to the first streamed token. A fresh agent's first turn on another API shows the cross-API
attach; then the server restarts on the same `--cache-dir` and the Anthropic first turn runs
again (disk tier). Ratios in one run: turn 1 computes the prefix, later turns attach to it.

    python bench/agent_apis.py [--prefix-words 900] [--out bench/out/agent_apis.json]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from serve_process import ServeProcess

TOOLS = [
    ("open_file", "Open a file of the repository and return its text.",
     {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}),
    ("run_tests", "Run the test suite, or one test file, and return the failures.",
     {"type": "object", "properties": {"target": {"type": "string"}}}),
    ("search", "Search the repository for a regular expression.",
     {"type": "object", "properties": {"pattern": {"type": "string"}, "glob": {"type": "string"}},
      "required": ["pattern"]}),
]
QUESTIONS = ["Where is the build configured?", "Which tests cover the parser?",
             "Summarize what the scheduler does."]


def system_prompt(words: int) -> str:
    out, i = [], 0
    while len(out) < words:
        out += (f"Rule {i}: for module m{i} read src/m{i}.py and tests/test_m{i}.py first and "
                f"cite the line you used.").split()
        i += 1
    return " ".join(out[:words])


def timed_stream(events, first_of) -> tuple[float, object]:
    t0 = time.perf_counter()
    ttft = None
    last = None
    for ev in events:
        if ttft is None and first_of(ev):
            ttft = time.perf_counter() - t0
        last = ev
    return (ttft if ttft is not None else time.perf_counter() - t0), last


def chat_turns(oa, system: str, n_turns: int, max_tokens: int) -> list[dict]:
    tools = [{"type": "function", "function": {"name": n, "description": d, "parameters": p}}
             for n, d, p in TOOLS]
    msgs = [{"role": "system", "content": system}]
    rows = []
    for q in QUESTIONS[:n_turns]:
        msgs.append({"role": "user", "content": q})
        stream = oa.chat.completions.create(model="agent", messages=msgs, tools=tools,
                                            max_tokens=max_tokens, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
        text: list[str] = []

        def first(ch, text=text) -> bool:
            if ch.choices and ch.choices[0].delta.content:
                text.append(ch.choices[0].delta.content)
                return True
            return False

        ttft, last = timed_stream(stream, first)
        u = last.usage
        rows.append({"prompt": u.prompt_tokens, "cached": u.prompt_tokens_details.cached_tokens,
                     "ttft_s": ttft})
        msgs.append({"role": "assistant", "content": "".join(text) or "ok"})
    return rows


def messages_turns(an, system: str, n_turns: int, max_tokens: int) -> list[dict]:
    tools = [{"name": n, "description": d, "input_schema": p} for n, d, p in TOOLS]
    sys_blocks = [{"type": "text", "text": system, "cache_control": {"type": "ephemeral"}}]
    msgs: list[dict] = []
    rows = []
    for q in QUESTIONS[:n_turns]:
        # Claude Code's pattern: a breakpoint on the newest user message
        for m in msgs:
            for b in m["content"]:
                b.pop("cache_control", None)
        msgs.append({"role": "user", "content": [{"type": "text", "text": q,
                                                  "cache_control": {"type": "ephemeral"}}]})
        text: list[str] = []

        def first(ev, text=text) -> bool:
            if ev.type == "content_block_delta" and getattr(ev.delta, "text", None):
                text.append(ev.delta.text)
                return True
            return False

        with an.messages.stream(model="agent", system=sys_blocks, messages=msgs, tools=tools,
                                max_tokens=max_tokens, extra_body={"temperature": 0}) as s:
            ttft, _ = timed_stream(s, first)
            final = s.get_final_message()
        u = final.usage
        rows.append({"prompt": u.input_tokens + u.cache_read_input_tokens
                     + u.cache_creation_input_tokens, "cached": u.cache_read_input_tokens,
                     "created": u.cache_creation_input_tokens, "ttft_s": ttft})
        msgs.append({"role": "assistant", "content": [{"type": "text",
                                                       "text": "".join(text).strip() or "ok"}]})
    return rows


def responses_turns(oa, system: str, n_turns: int, max_tokens: int) -> list[dict]:
    tools = [{"type": "function", "name": n, "description": d, "parameters": p, "strict": False}
             for n, d, p in TOOLS]
    prev = None
    rows = []
    for q in QUESTIONS[:n_turns]:
        kw = {"previous_response_id": prev} if prev else {}
        stream = oa.responses.create(model="agent", instructions=system, input=q, tools=tools,
                                     max_output_tokens=max_tokens, temperature=0, stream=True,
                                     **kw)
        ttft, last = timed_stream(stream, lambda ev: ev.type == "response.output_text.delta")
        r = last.response
        rows.append({"prompt": r.usage.input_tokens,
                     "cached": r.usage.input_tokens_details.cached_tokens, "ttft_s": ttft,
                     "sent_items": 1})
        prev = r.id
    return rows


def clients(url: str):
    import anthropic
    import openai

    oa = openai.OpenAI(base_url=url + "/v1", api_key="k", timeout=600, max_retries=0)
    an = anthropic.Anthropic(base_url=url, api_key="k", timeout=600, max_retries=0)
    return oa, an


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prefix-words", type=int, default=900)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--out", default=str(Path(__file__).parent / "out" / "agent_apis.json"))
    args = ap.parse_args()
    system = system_prompt(args.prefix_words)
    cache_dir = tempfile.mkdtemp(prefix="kvshare-bench-apis-")
    log = Path(tempfile.mkstemp(prefix="kvshare-bench-apis-", suffix=".log")[1])
    serve_args = ["--kv-unified-per-slot", "8192", "--cache-dir", cache_dir, "--parallel", "2"]
    results: dict = {"prefix_words": args.prefix_words}

    srv = ServeProcess(serve_args, log)
    try:
        oa, an = clients(srv.url)
        # each API's own conversation; the first one run computes the agent prefix
        results["chat"] = chat_turns(oa, system, args.turns, args.max_tokens)
        results["messages"] = messages_turns(an, system, args.turns, args.max_tokens)
        results["responses"] = responses_turns(oa, system, args.turns, args.max_tokens)
        # a cold control: another agent (different system prompt), first turn
        results["cold_messages"] = messages_turns(an, "Be terse. " + system[::-1], 1,
                                                  args.max_tokens)
    finally:
        srv.stop()
    srv = ServeProcess(serve_args, log)
    try:
        oa, an = clients(srv.url)
        results["messages_after_restart"] = messages_turns(an, system, 1, args.max_tokens)
    finally:
        srv.stop()

    print(f"agent prefix: {args.prefix_words} words of system prompt + {len(TOOLS)} tools; "
          f"Gemma 3 270M; streamed; TTFT = time to the first text delta")
    print(f"{'run':<24} {'turn':>4} {'prompt':>7} {'cached':>7} {'cached %':>9} {'TTFT s':>8}")
    for name in ("chat", "messages", "responses", "cold_messages", "messages_after_restart"):
        for i, r in enumerate(results[name]):
            pct = 100.0 * r["cached"] / r["prompt"] if r["prompt"] else 0.0
            print(f"{name:<24} {i + 1:>4} {r['prompt']:>7} {r['cached']:>7} {pct:>8.1f}% "
                  f"{r['ttft_s']:>8.3f}")
    cold = results["cold_messages"][0]["ttft_s"]
    ratios = {
        "messages_turn1_ttft_over_cold": results["messages"][0]["ttft_s"] / cold,
        "responses_turn1_ttft_over_cold": results["responses"][0]["ttft_s"] / cold,
        "messages_after_restart_ttft_over_cold": results["messages_after_restart"][0]["ttft_s"]
        / cold,
    }
    results["ratios"] = ratios
    for k, v in ratios.items():
        print(f"{k}: {v:.3f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
