"""How often would the default model call a tool under `tool_choice: "auto"`?

The polyfilled generic format (model/tool_polyfill.py) makes the reply one JSON object whose
first key decides: `"tool_call"` or `"response"`. This reads the model's probability of each at
that point, P(tool) = p("tool") / (p("tool") + p("response")), for questions a tool answers and
questions it does not, with the tools declared as kvshare declares them (the system message)
and, for comparison, in other places. A useful prompt has P(tool) high on the first set and low
on the second.

    python bench/tool_choice_probe.py [--model PATH]     # table on stdout, JSON in bench/out/
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from kvshare.model import catalog, tool_polyfill
from kvshare.model.batch import SeqChunk
from kvshare.model.chat_template import ChatTemplate
from kvshare.model.loader import load_model
from kvshare.model.tokenizer.core import Tokenizer

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "The city name"}}, "required": ["city"]}}}
NEEDS_TOOL = ["What is the weather like in Paris right now?", "Is it raining in London today?",
              "How warm is it in Tokyo?", "Tell me the weather in Berlin.",
              "Should I take an umbrella in Rome today?"]
NO_TOOL = ["What is 2+2?", "Write a haiku about cats.", "Who wrote Hamlet?",
           "Translate 'good morning' to French.", "What is the capital of Italy?"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    args = ap.parse_args()
    path = args.model or str(catalog.ensure(catalog.DEFAULT_MODEL, progress=False))
    model, tok = load_model(path), Tokenizer.from_gguf(path)
    tpl = ChatTemplate.from_gguf(path, tok)
    t_tool = tok.encode("tool", add_special=False)[0]
    t_resp = tok.encode("response", add_special=False)[0]

    def p_tool(messages: list[dict], tools: list[dict] | None) -> float:
        text = tpl.render(messages, tools=tools, add_generation_prompt=True)
        ids = tok.encode(text + '{"', add_special=False)
        nb = -(-len(ids) // 16) + 1
        out = np.asarray(model.forward([SeqChunk(np.array(ids), 0, np.arange(nb))],
                                       model.new_cache(nb, 16))[0])
        logits = out[-1] if out.ndim == 2 else out
        p = np.exp(logits - logits.max())
        return float(p[t_tool] / (p[t_tool] + p[t_resp]))

    decl = tool_polyfill.tools_text([WEATHER])
    placements = {
        "kvshare (template polyfill)": lambda q: ([{"role": "user", "content": q}], [WEATHER]),
        "system message (same text)": lambda q: ([{"role": "system", "content": decl},
                                                 {"role": "user", "content": q}], None),
        "first user message": lambda q: ([{"role": "user", "content": decl + "\n\n" + q}], None),
    }
    rows = []
    for name, make in placements.items():
        pos = [p_tool(*make(q)) for q in NEEDS_TOOL]
        neg = [p_tool(*make(q)) for q in NO_TOOL]
        rows.append({"placement": name, "p_tool_needed": pos, "p_tool_not_needed": neg})
    print(f"model: {Path(path).name}")
    print(f"{'tools declared in':32} {'P(tool) | tool needed':>22} {'P(tool) | not needed':>22}")
    for r in rows:
        print(f"{r['placement']:32} {np.mean(r['p_tool_needed']):22.2f} "
              f"{np.mean(r['p_tool_not_needed']):22.2f}")
    out = Path(__file__).parent / "out" / "tool_choice_probe.json"
    out.write_text(json.dumps({"model": Path(path).name, "when": time.strftime("%Y-%m-%d"),
                               "rows": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
