"""How long a hostile output constraint takes to be refused at submit (issue 45: "< 1 s with a
message naming the limit").

Grammars and schemas that llguidance would reject only mid-generation (or after seconds of
GBNF conversion): chains of left-recursive alternatives that overflow an Earley row (450 rules
x 5, 120 x 26, 990 x 3), a chain of 8,000 rules, a schema that is only a `$ref` to itself.
Each is timed two ways:
- in process: `gbnf_to_lark` (the static limits of constraint_limits.py, then conversion) and
  llguidance's compile probe (`constrain.compile_grammar`, tiny qwen3 vocabulary);
- end to end: POST /completion to a real `kvshare serve` (tiny qwen3 model, 2 threads) until
  its 400, `--repeat` times, the worst reported.
For the row-overflow grammars the time the conversion would have taken (static check off)
is given too, as "unchecked".

    python bench/constraint_refusal.py [--repeat 5] [--json bench/out/constraint_refusal.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
TINY = ROOT / "tests" / "data" / "models" / "tiny-qwen3-chat.gguf"


def wide(n: int, alts: str) -> str:
    return ("root ::= r0\n" + "".join(
        f"r{i} ::= " + " | ".join(f'r{i + 1} "{c}"' for c in alts) + "\n" for i in range(n))
        + f'r{n} ::= "x"\n')


CHAIN_8000 = ("root ::= r0\n" + "".join(f'r{i} ::= r{i + 1} "a"\n' for i in range(8000))
              + 'r8000 ::= "x"\n')
CASES = [
    ("gbnf 450 rules x 5 alternatives", "grammar", wide(450, "abcde"), True),
    ("gbnf 120 rules x 26 alternatives", "grammar", wide(120, "abcdefghijklmnopqrstuvwxyz"), True),
    ("gbnf 990 rules x 3 alternatives", "grammar", wide(990, "abc"), True),
    ("gbnf chain of 8000 rules", "grammar", CHAIN_8000, False),
    ("json schema {$ref: #}", "json_schema", {"$ref": "#"}, False),
]


def in_process(vocab, field: str, value) -> tuple[float, str]:
    from kvshare.constrain import compile_grammar
    from kvshare.gbnf import gbnf_to_lark
    from kvshare.server.constraints import output_schema_text

    t0 = time.perf_counter()
    try:
        if field == "grammar":
            compile_grammar(vocab, "lark", gbnf_to_lark(value))
        else:
            compile_grammar(vocab, "json_schema", output_schema_text(value))
        return time.perf_counter() - t0, "accepted"
    except ValueError as e:
        return time.perf_counter() - t0, str(e)


def unchecked(value: str) -> float:
    """Seconds of the GBNF conversion with the parser-row estimate switched off."""
    import kvshare.gbnf.convert as convert

    saved = convert.MAX_PREDICTED_ITEMS
    convert.MAX_PREDICTED_ITEMS = 10**9
    try:
        t0 = time.perf_counter()
        convert.convert(value, None, fuse=True)
        return time.perf_counter() - t0
    finally:
        convert.MAX_PREDICTED_ITEMS = saved


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--json", default=str(ROOT / "bench" / "out" / "constraint_refusal.json"))
    ap.add_argument("--no-server", action="store_true")
    args = ap.parse_args()

    from kvshare.constrain import TokenVocab
    from kvshare.model.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(TINY)
    vocab = TokenVocab.from_tokenizer(tok, len(tok), [tok.token_to_id("<|im_end|>")])
    rows = []
    for name, field, value, row_overflow in CASES:
        worst, message = 0.0, ""
        for _ in range(args.repeat):
            dt, message = in_process(vocab, field, value)
            worst = max(worst, dt)
        rows.append({"case": name, "in_process_s": worst, "message": message[:160],
                     "unchecked_conversion_s": unchecked(value) if row_overflow else None})

    if not args.no_server:
        from serve_process import ServeProcess

        with tempfile.TemporaryDirectory() as tmp:
            srv = ServeProcess(["--model", str(TINY), "--ctx-size", "1024", "--parallel", "2",
                                "--threads", "2"], Path(tmp) / "serve.log")
            try:
                for row, (_, field, value, _) in zip(rows, CASES):
                    worst, status = 0.0, 0
                    for i in range(args.repeat):
                        # distinct texts: the server caches compiled grammars by source
                        v = value + f"# {i}\n" if field == "grammar" else value
                        t0 = time.perf_counter()
                        r = srv.client.post("/completion", json={
                            "prompt": "x", "n_predict": 4, field: v})
                        worst = max(worst, time.perf_counter() - t0)
                        status = r.status_code
                        row["server_message"] = r.json().get("error", {}).get("message", "")[:160]
                    row["server_s"], row["server_status"] = worst, status
            finally:
                srv.stop()

    print(f"{'case':36} {'in-process':>11} {'server':>8} {'status':>6} {'unchecked':>10}")
    for r in rows:
        unc = f"{r['unchecked_conversion_s']:.2f} s" if r["unchecked_conversion_s"] else "-"
        srv_s = f"{r['server_s']:.3f} s" if "server_s" in r else "-"
        print(f"{r['case']:36} {r['in_process_s']:9.3f} s {srv_s:>8} "
              f"{r.get('server_status', '-'):>6} {unc:>10}")
    for r in rows:
        print(f"  {r['case']}: {r.get('server_message') or r['message']}")
    out = {"cpu_count": os.cpu_count(), "repeat": args.repeat, "rows": rows}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
