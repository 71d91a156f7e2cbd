"""What saving a hybrid model's conversation to the RAM and disk tiers costs the engine thread.

When a request of a hybrid model (attention + recurrent layers: Qwen3.5 / Qwen3-Next, LFM2)
finishes, its full blocks up to its deepest block-aligned recurrent-state checkpoint, and those
checkpoints, go to the tiers (`TierManager.save_hybrid`). The engine thread runs every
session's steps, so whatever it spends there delays every session's next token. This bench
times `save_hybrid` on the calling thread (what the engine thread spends) and until the saves
have reached the tiers (`flush`: RAM holds them and the disk writer has them queued), on a CPU
pool of Qwen3-Next-80B-A3B's shapes: the KV of its 12 attention layers (2 KV heads of 256, f16:
384 KiB a 16-token block) and checkpoints of its 36 delta-net layers' states (32 value heads
of 128 x 128, float32) and conv states (3 x 8,192), 79 MB each. Two saves:

- `new`: a new conversation of --tokens tokens (blocks + the checkpoints at its prefix entry and
  at its end), into empty tiers;
- `next turn`: the same conversation --turn-tokens longer (its earlier blocks and checkpoints
  already held in RAM and written to disk: the new blocks and the new tail checkpoint).

And what a reply's decode spends at each of its block boundaries, where the engine keeps the
state there (so the conversation goes to the tiers resumable a block before its end): a
snapshot of the slot's state on its device (`KVArrays.snapshot_state`, into the sequence's
buffer) against a checkpoint made there (`CheckpointManager.save`: the state read to the host,
joined, copied into the checkpoint), and what the snapshot costs once, when the sequence ends
(`save_snapshot`).

    python bench/hybrid_save_cost.py --out bench/out/hybrid_save_cost.json

Prints a table and writes the JSON (each figure the median of --repeats runs).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from kvshare import _core
from kvshare.backend import get_backend
from kvshare.engine.cache.checkpoints import CheckpointManager
from kvshare.engine.cache.tiers import TierManager
from kvshare.model.config import ATTENTION, ModelConfig
from kvshare.model.kv_arrays import KVArrays

BS = 16
N_ATTN = 12  # Qwen3-Next-80B-A3B: every 4th of 48 layers is full attention
N_DELTA = 36
STATE_BYTES = N_DELTA * (32 * 128 * 128 + 3 * 8192) * 4
PREFIX_TOKENS = 4096  # the prefix entry: tool schemas and system prompt


def attention_kv() -> ModelConfig:
    return ModelConfig(arch="qwen3", n_layers=N_ATTN, n_embd=2048, n_head=16, n_head_kv=2,
                       head_dim=256, head_dim_v=256, n_ff=5120, vocab_size=151936,
                       norm_eps=1e-6, context_length=65536, rope_base=1e7, rope_base_swa=1e7,
                       sliding_window=0, layer_kinds=(ATTENTION,) * N_ATTN,
                       layer_windows=(0,) * N_ATTN)


def checkpoint(root: bytes, tokens: list[int], position: int, rng) -> _core.Checkpoint:
    data = rng.integers(0, 255, STATE_BYTES, dtype=np.uint8)
    return _core.Checkpoint.at(root, tokens[:position], BS, data, "bench")


def run(kv: KVArrays, n_tokens: int, turn_tokens: int, fp: bytes) -> dict[str, tuple]:
    """(calling thread, until flushed) seconds of the `new` save and the `next turn` save."""
    rng = np.random.default_rng(n_tokens)
    n_total = n_tokens + turn_tokens
    pool = _core.BlockPool(kv.n_blocks, BS)
    tokens = [int(t) for t in rng.integers(0, 150000, n_total)]
    root = _core.root_key(fp, "f16", BS, None)
    keys = _core.hash_blocks(root, tokens, BS)
    table = []
    for j in range(n_total // BS):
        b = pool.allocate(keys[j - 1] if j else root)
        pool.append_tokens(b, tokens[j * BS:(j + 1) * BS])
        pool.register(b, keys[j])
        table.append(b)
    prefix = checkpoint(root, tokens, PREFIX_TOKENS, rng)
    out = {}
    with tempfile.TemporaryDirectory() as d:
        ram = _core.RamTier(4 * (n_total // BS * kv.block_nbytes + 3 * STATE_BYTES))
        disk = _core.DiskStore(d, fp, 1 << 34, None, 0)
        tiers = TierManager(pool, kv, BS, ram, disk)
        for name, end in (("new", n_tokens), ("next turn", n_total)):
            tail = checkpoint(root, tokens, end, rng)
            t0 = time.perf_counter()
            tiers.save_hybrid(keys, table, [prefix, tail], PREFIX_TOKENS)
            t1 = time.perf_counter()
            tiers.flush()
            t2 = time.perf_counter()
            assert ram.contains_block(keys[end // BS - 1]), "the blocks did not reach RAM"
            out[name] = (t1 - t0, t2 - t0)
            disk.flush()  # written before the next turn arrives (a client's seconds later)
        disk.close()
    pool.release(table)
    return out


def reply_boundary(kv: KVArrays, fp: bytes, repeats: int) -> dict[str, list[float]]:
    """Seconds of each way to keep the state at a reply's block boundary, `repeats` times."""
    rng = np.random.default_rng(0)
    for s in kv.states:
        s[0] = rng.standard_normal(s.shape[1:], dtype=np.float32)
    mgr = CheckpointManager(kv, BS, 1, budget_bytes=1 << 40)
    root = _core.root_key(fp, "f16", BS, None)
    tokens = [int(t) for t in rng.integers(0, 150000, BS * (repeats + 2))]
    snap = kv.snapshot_state(0)  # the sequence's buffer, from its first boundary on
    out: dict[str, list[float]] = {"snapshot": [], "checkpoint": [], "at the end": []}
    for i in range(repeats):
        t0 = time.perf_counter()
        kv.snapshot_state(0, snap)
        t1 = time.perf_counter()
        ck = mgr.save(root, tokens, BS * (i + 1), 0)
        t2 = time.perf_counter()
        mgr.discard(ck.key)
        del ck
        t3 = time.perf_counter()
        ck = mgr.save_snapshot(root, tokens, BS * (i + 2), snap)
        t4 = time.perf_counter()
        mgr.discard(ck.key)
        del ck
        out["snapshot"].append(t1 - t0)
        out["checkpoint"].append(t2 - t1)
        out["at the end"].append(t4 - t3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=6144)
    ap.add_argument("--turn-tokens", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    n_blocks = (args.tokens + args.turn_tokens) // BS
    kv = KVArrays(attention_kv(), n_blocks + 1, BS, kv_dtype="f16", backend=get_backend("cpu"))
    kv.kv[...] = 1.0  # touched: the pool's pages exist, as a serving pool's do
    fp = bytes(32)
    runs = [run(kv, args.tokens, args.turn_tokens, fp) for _ in range(args.repeats)]
    rows = []
    print(f"{'save':>10} {'blocks MB':>10} {'checkpoints MB':>15} {'engine thread ms':>17} "
          f"{'until flushed ms':>17}")
    for name, blocks, cks in (("new", args.tokens // BS, 2),
                              ("next turn", args.turn_tokens // BS, 1)):
        med = [statistics.median(r[name][i] for r in runs) * 1e3 for i in range(2)]
        mb, ck_mb = blocks * kv.block_nbytes / 1e6, cks * STATE_BYTES / 1e6
        rows.append({"save": name, "blocks_mb": round(mb, 1), "checkpoints_mb": round(ck_mb, 1),
                     "engine_thread_ms": round(med[0], 2), "until_flushed_ms": round(med[1], 2),
                     "runs": [[round(x * 1e3, 2) for x in r[name]] for r in runs]})
        print(f"{name:>10} {mb:>10.0f} {ck_mb:>15.0f} {med[0]:>17.1f} {med[1]:>17.1f}")
    block_bytes = kv.block_nbytes
    del kv
    states = KVArrays(attention_kv(), 1, BS, kv_dtype="f16", backend=get_backend("cpu"),
                      n_state_slots=1,
                      state_shapes=[(N_DELTA, 32, 128, 128), (N_DELTA, 3, 8192)])
    times = reply_boundary(states, fp, max(3, args.repeats))
    boundary = {k: round(statistics.median(v) * 1e3, 2) for k, v in times.items()}
    print(f"\nat each block boundary of a reply (state {STATE_BYTES / 1e6:.0f} MB), ms: "
          f"snapshot {boundary['snapshot']:.1f}, checkpoint {boundary['checkpoint']:.1f}; "
          f"the snapshot to a checkpoint at the end {boundary['at the end']:.1f}")
    out = Path(args.out) if args.out else Path(__file__).parent / "out" / "hybrid_save_cost.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"block_bytes": block_bytes,
                               "checkpoint_bytes": STATE_BYTES,
                               "tokens": args.tokens, "turn_tokens": args.turn_tokens,
                               "rows": rows, "reply_boundary_ms": boundary,
                               "reply_boundary_runs_ms": {k: [round(x * 1e3, 2) for x in v]
                                                          for k, v in times.items()}},
                              indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
