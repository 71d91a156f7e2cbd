"""What pinning an agent prefix in the RAM tier, and restoring it from there, costs the
engine thread.

When a prompt's prefix entry (tool schemas + system prompt, up to the first user message) is
computed, the cache copies its KV blocks to the RAM tier and pins them there
(`TierManager.pin_prefix`). The engine thread runs every session's steps, so whatever it
spends there delays every session's next token. This bench times `pin_prefix` on the calling
thread (what the engine thread spends: the copy out of the pool) and until the tier holds the
pinned blocks (`flush`: the puts on the saver thread too, what the engine thread would spend
making them itself),
on a CPU pool of Qwen3-1.7B's KV shapes (28 layers, 8 KV heads of 128, f16; 1.75 MiB a
16-token block), for a 6K-token prefix (375 blocks, ~690 MB) and a 1K one, into an empty RAM
tier; then the same blocks, gone from the pool, restored from RAM (`TierManager.restore`:
on the calling thread, and until the device holds them).

On a GPU (`--device cuda`) the engine thread only gathers the blocks into a device copy, and
the saver thread copies that to the host (`KVArrays.read_blocks_later`), and a restore's
chunks go through page-locked staging with asynchronous copies (`KVArrays.staging_buffer`);
each size is also run the way both went before, the rows `sync`: the whole read on the
calling thread (`read_blocks`: a gather and one device-to-host copy per 64 MiB chunk, as when
the device copy would pass `LATER_READ_MAX_BYTES`) and pageable staging
(`STAGING_PINNED = False`: CuPy copies each chunk into a page-locked buffer of its own before
the transfer).

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


def run(kv: KVArrays, n_blocks: int) -> tuple[float, float, float, float]:
    """Seconds of one pin of blocks 0..n_blocks-1 into a fresh RAM tier (on the calling
    thread, until the pins are in place) and of their restore from it (on the calling thread,
    until the device holds them)."""
    pool = _core.BlockPool(kv.n_blocks, BS)
    tokens = list(range(n_blocks * BS))
    root = _core.root_key(b"bench", "f16", BS, None)
    keys = _core.hash_blocks(root, tokens, BS)
    table = []
    for j in range(n_blocks):
        b = pool.allocate(keys[j - 1] if j else root)
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
    pool.release(table)
    pool.evict_all_cached()
    t3 = time.perf_counter()
    ids = tiers.restore(tokens, keys, 0, root)
    t4 = time.perf_counter()
    kv.backend.synchronize()
    t5 = time.perf_counter()
    assert len(ids) == n_blocks, "the prefix was not restored"
    pool.release(ids)
    return t1 - t0, t2 - t0, t4 - t3, t5 - t3


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
    # on a GPU: the copies off the engine thread (async), then as they were (sync)
    modes = ["async", "sync"] if backend.is_gpu else ["sync"]
    later_max = kv_arrays.LATER_READ_MAX_BYTES
    rows = []
    print(f"{'prefix tokens':>14} {'blocks':>7} {'MB':>7} {'copies':>7} {'pin: engine ms':>15} "
          f"{'until pinned ms':>16} {'restore: engine ms':>19} {'until restored ms':>18}")
    for tokens in sizes:
        n = tokens // BS
        for mode in modes:
            kv_arrays.LATER_READ_MAX_BYTES = later_max if mode == "async" else 0
            kv_arrays.STAGING_PINNED = mode == "async"
            kv.release_staging()  # (the other mode's)
            runs = [run(kv, n) for _ in range(args.repeats)]
            med = [statistics.median(r[i] for r in runs) * 1e3 for i in range(4)]
            mb = n * kv.block_nbytes / 1e6
            rows.append({"prefix_tokens": tokens, "blocks": n, "mb": round(mb, 1),
                         "copies": mode, "pin_engine_thread_ms": round(med[0], 2),
                         "until_pinned_ms": round(med[1], 2),
                         "restore_engine_thread_ms": round(med[2], 2),
                         "until_restored_ms": round(med[3], 2),
                         "runs": [[round(x * 1e3, 2) for x in r] for r in runs]})
            print(f"{tokens:>14} {n:>7} {mb:>7.0f} {mode:>7} {med[0]:>15.1f} {med[1]:>16.1f} "
                  f"{med[2]:>19.1f} {med[3]:>18.1f}")
    kv_arrays.LATER_READ_MAX_BYTES = later_max
    kv_arrays.STAGING_PINNED = True
    name = "prefix_pin_cost.json" if not backend.is_gpu else "prefix_pin_cost_gpu.json"
    out = Path(args.out) if args.out else Path(__file__).parent / "out" / name
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"device": args.device, "block_bytes": kv.block_nbytes,
                               "rows": rows}, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
