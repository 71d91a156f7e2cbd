"""What pinning an agent prefix in the RAM tier costs the engine thread.

When a prompt's prefix entry (tool schemas + system prompt, up to the first user message) is
computed, the cache copies its KV blocks to the RAM tier and pins them there
(`TierManager.pin_prefix`). The engine thread runs every session's steps, so whatever it
spends there delays every session's next token. This bench times `pin_prefix` on the calling
thread (what the engine thread spends: the copy out of the pool) and until the tier holds the
pinned blocks (`flush`: the puts on the saver thread too, what the engine thread would spend
making them itself),
on a CPU pool of Qwen3-1.7B's KV shapes (28 layers, 8 KV heads of 128, f16; 1.75 MiB a
16-token block), for a 6K-token prefix (375 blocks, ~690 MB) and a 1K one, into an empty RAM
tier.

On a GPU (`--device cuda`) the engine thread only gathers the blocks into a device copy, and
the saver thread copies that to the host (`KVArrays.read_blocks_later`); each size is also
run with the whole read on the calling thread (`read_blocks`: a gather and one
device-to-host copy per 64 MiB chunk, as when the device copy would pass
`LATER_READ_MAX_BYTES`), the rows `read now`.

    python bench/prefix_pin_cost.py --out bench/out/prefix_pin_cost.json
    python bench/prefix_pin_cost.py --device cuda --out bench/out/prefix_pin_cost_gpu.json

Prints a table and writes the JSON (each figure the median of --repeats runs).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path


from kvshare import _core
from kvshare.backend import get_backend
from kvshare.engine.cache.tiers import TierManager
from kvshare.model import kv_arrays
from kvshare.model.config import ATTENTION, ModelConfig
from kvshare.model.kv_arrays import KVArrays

BS = 16


def qwen3_1_7b_kv() -> ModelConfig:
    return ModelConfig(arch="qwen3", n_layers=28, n_embd=2048, n_head=16, n_head_kv=8,
                       head_dim=128, head_dim_v=128, n_ff=6144, vocab_size=151936,
                       norm_eps=1e-6, context_length=40960, rope_base=1e6, rope_base_swa=1e6,
                       sliding_window=0, layer_kinds=(ATTENTION,) * 28, layer_windows=(0,) * 28)


def run(kv: KVArrays, n_blocks: int) -> tuple[float, float]:
    """(seconds on the calling thread, seconds until the pins are in place) for one pin of
    blocks 0..n_blocks-1 into a fresh RAM tier."""
    pool = _core.BlockPool(kv.n_blocks, BS)
    tokens = list(range(n_blocks * BS))
    keys = _core.hash_blocks(_core.root_key(b"bench", "f16", BS, None), tokens, BS)
    table = []
    for j in range(n_blocks):
        b = pool.allocate(keys[j - 1] if j else _core.root_key(b"bench", "f16", BS, None))
        pool.append_tokens(b, tokens[j * BS:(j + 1) * BS])
        pool.register(b, keys[j])
        table.append(b)
    ram = _core.RamTier(2 * n_blocks * kv.block_nbytes + (1 << 20))
    tiers = TierManager(pool, kv, BS, ram, None)
    kv.backend.synchronize()
    t0 = time.perf_counter()
    tiers.pin_prefix(keys, table, n_blocks)
    t1 = time.perf_counter()
    tiers.flush()
    t2 = time.perf_counter()
    assert all(ram.is_pinned(k) for k in keys), "the prefix was not pinned"
    assert kv.later_bytes == 0
    return t1 - t0, t2 - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prefix-tokens", default="6000,1024")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    args = ap.parse_args()
    sizes = [int(x) for x in args.prefix_tokens.split(",")]
    n_max = max(sizes) // BS
    backend = get_backend(args.device)
    kv = KVArrays(qwen3_1_7b_kv(), n_max + 1, BS, kv_dtype="f16", backend=backend)
    kv.kv[...] = 1.0  # touched: the pool's pages exist, as a serving pool's do
    # on a GPU: the device-to-host copy on the saver thread, then all on the calling thread
    modes = ["later", "now"] if backend.is_gpu else ["now"]
    later_max = kv_arrays.LATER_READ_MAX_BYTES
    rows = []
    print(f"{'prefix tokens':>14} {'blocks':>7} {'MB':>7} {'read':>6} {'engine thread ms':>17} "
          f"{'until pinned ms':>16}")
    for tokens in sizes:
        n = tokens // BS
        for mode in modes:
            kv_arrays.LATER_READ_MAX_BYTES = later_max if mode == "later" else 0
            runs = [run(kv, n) for _ in range(args.repeats)]
            call = statistics.median(r[0] for r in runs)
            done = statistics.median(r[1] for r in runs)
            mb = n * kv.block_nbytes / 1e6
            rows.append({"prefix_tokens": tokens, "blocks": n, "mb": round(mb, 1), "read": mode,
                         "engine_thread_ms": round(call * 1e3, 2),
                         "until_pinned_ms": round(done * 1e3, 2),
                         "runs": [[round(a * 1e3, 2), round(b * 1e3, 2)] for a, b in runs]})
            print(f"{tokens:>14} {n:>7} {mb:>7.0f} {mode:>6} {call * 1e3:>17.1f} "
                  f"{done * 1e3:>16.1f}")
    kv_arrays.LATER_READ_MAX_BYTES = later_max
    name = "prefix_pin_cost.json" if not backend.is_gpu else "prefix_pin_cost_gpu.json"
    out = Path(args.out) if args.out else Path(__file__).parent / "out" / name
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"device": args.device, "block_bytes": kv.block_nbytes,
                               "rows": rows}, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
