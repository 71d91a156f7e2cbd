"""Recurrent-state checkpoints of hybrid models (gated delta net, short conv).

A recurrent layer's state cannot be cut back to an earlier token, so a hybrid sequence can only
resume a prompt where a snapshot of that state was saved. Snapshots are the core's immutable,
`Arc`-shared `Checkpoint`s keyed by the chain key of `tokens[:position]`: sequences, the store
and the RAM tier hold the same object, never a copy, and the account counts each once.

Where checkpoints are taken (all chosen at admission, prefill pauses exactly there):
- the first-user-message boundary of chat prompts (what sessions with the same system prompt
  and tools share);
- the divergence point: where the prompt splits from a cached one (the end of the longest
  cached match), before the first user message, when the recomputation it saves is worth its
  bytes: it saves at least `min_gain` tokens (`--checkpoint-min-gain`, default 64) over the
  deepest checkpoint the next prompt splitting there would otherwise resume at (the one this
  request resumes at, or one it plans below the split). The next prompt that diverges at the
  same place resumes exactly there. A checkpoint costs its state's bytes (tiny-qwen35: tens of
  KiB; a 0.8B Qwen3.5 a few MiB) once, however many sessions share it; recomputing 64 tokens
  costs more than reading that back, so the default is low;
- the end of the prompt (a returning conversation resumes there);
- every `min_step` tokens of long prompts, at most `max_per_seq` per sequence;
- with the RAM or disk tier on, also at the block boundary at or before the first user message
  and at or before the end of the prompt, and at the reply's latest block boundary (kept as a
  snapshot on the state's device while the reply runs, made a checkpoint when it ends: see
  recurrent.py): the tiers hold full blocks only, so they keep only block-aligned checkpoints
  (see tiers.py).
Restoring copies the snapshot into the sequence's own state slot; donors and checkpoints stay
untouched, and a checkpoint just restored is kept (a byte-identical save returns it).
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Callable

import numpy as np

from kvshare import _core

DIVERGENCE_MIN_GAIN = 64  # default --checkpoint-min-gain


class CheckpointManager:
    def __init__(self, kv, block_size: int, n_slots: int, min_step: int = 1024,
                 max_per_seq: int = 8, budget_bytes: int = 1 << 30,
                 min_gain: int = DIVERGENCE_MIN_GAIN):
        self.kv = kv
        self.block_size = block_size
        self.min_step = min_step
        self.min_gain = max(1, int(min_gain))
        self.max_per_seq = max_per_seq
        self.budget_bytes = budget_bytes
        self.account = _core.CheckpointAccount()
        self.store = _core.CheckpointStore(self.account)
        self._lru: OrderedDict[bytes, None] = OrderedDict()
        self._free_slots = list(range(n_slots))[::-1]
        self.saved = 0
        self.restored = 0
        self.evicted = 0

    # ---- state slots -------------------------------------------------------------------
    def take_slot(self) -> int:
        return self._free_slots.pop()

    def give_slot(self, slot: int | None) -> None:
        if slot is not None:
            self._free_slots.append(slot)

    # ---- lookup and restore ------------------------------------------------------------
    def deepest(self, root: bytes, keys: list[bytes], tokens: list[int],
                max_position: int) -> _core.Checkpoint | None:
        if max_position <= 0:
            return None
        ck = self.store.deepest(root, keys, tokens, max_position)
        if ck is not None and ck.key in self._lru:
            self._lru.move_to_end(ck.key)
        return ck

    def restore(self, ckpt: _core.Checkpoint, slot: int) -> None:
        """Copy a checkpoint's state into `slot` (the checkpoint's bytes are only read).
        ValueError (and the slot untouched) if its layout does not fit this model's state,
        e.g. a damaged or foreign tier entry."""
        self.kv.write_state(slot, self._arrays(ckpt))
        self.restored += 1

    def _arrays(self, ckpt: _core.Checkpoint) -> list[np.ndarray]:
        try:
            specs = [(tuple(int(d) for d in shape), np.dtype(dtype))
                     for shape, dtype in json.loads(ckpt.layout)["arrays"]]
        except (ValueError, TypeError, KeyError) as exc:
            raise ValueError(f"bad checkpoint layout: {exc}") from None
        want = [(tuple(s.shape[1:]), np.dtype(s.dtype)) for s in self.kv.states]
        if specs != want:
            raise ValueError(f"checkpoint layout {specs} does not match the model's state {want}")
        view = np.asarray(ckpt)  # zero-copy read-only view of the shared bytes
        if sum(int(np.prod(sh)) * dt.itemsize for sh, dt in specs) != view.size:
            raise ValueError("checkpoint size does not match its layout")
        arrays, off = [], 0
        for shape, dt in specs:
            n = int(np.prod(shape)) * dt.itemsize
            arrays.append(view[off:off + n].view(dt).reshape(shape))
            off += n
        return arrays

    def adopt(self, ckpt: _core.Checkpoint) -> _core.Checkpoint:
        """Hold a checkpoint restored from a tier in the store (later sessions share it);
        returns the stored one."""
        ck = self.store.insert(ckpt)
        self._lru[ck.key] = None
        self._lru.move_to_end(ck.key)
        self._enforce_budget()
        return ck

    # ---- save --------------------------------------------------------------------------
    def save(self, root: bytes, tokens: list[int], position: int,
             slot: int) -> _core.Checkpoint:
        """Snapshot `slot` (the state after tokens[:position]) as a checkpoint; returns the
        stored one (an existing identical-key checkpoint is kept, not replaced)."""
        return self._save(root, tokens, position, lambda: self.kv.read_state(slot))

    def save_snapshot(self, root: bytes, tokens: list[int], position: int,
                      snapshot: list) -> _core.Checkpoint:
        """`save` of a state snapshot (`KVArrays.snapshot_state`) taken at `position`."""
        return self._save(root, tokens, position, lambda: self.kv.read_snapshot(snapshot))

    def _save(self, root: bytes, tokens: list[int], position: int,
              read: Callable[[], list[np.ndarray]]) -> _core.Checkpoint:
        key = _core.prefix_key(root, tokens[:position], self.block_size)
        existing = self.store.get(key)
        if existing is not None:
            self._lru.move_to_end(key)
            return existing
        ck = self.store.insert(self._checkpoint(root, tokens, position, read()))
        self._lru[ck.key] = None
        self.saved += 1
        self._enforce_budget()
        return ck

    def _checkpoint(self, root: bytes, tokens: list[int], position: int,
                    arrays: list[np.ndarray]) -> _core.Checkpoint:
        layout = json.dumps({"arrays": [[list(a.shape), a.dtype.str] for a in arrays]})
        data = np.concatenate([np.ascontiguousarray(a).reshape(-1).view(np.uint8) for a in arrays])
        return _core.Checkpoint.at(root, tokens[:position], self.block_size, data, layout,
                                   None, self.account)

    def discard(self, key: bytes) -> None:
        """Drop the store's reference (holders keep theirs)."""
        self._lru.pop(key, None)
        self.store.remove(key)

    def _enforce_budget(self) -> None:
        while self.store.unique_bytes > self.budget_bytes and len(self._lru) > 1:
            key, _ = self._lru.popitem(last=False)
            if self.store.remove(key) is not None:
                self.evicted += 1

    # ---- where to checkpoint -----------------------------------------------------------
    def plan(self, n_prompt: int, resume: int, match_len: int, boundary: int | None,
             aligned: bool = False) -> list[int]:
        """Positions (> resume, <= n_prompt) at which prefill pauses to save a checkpoint.
        `aligned` (tiers on): also the block boundaries at or before the first user message
        and the end of the prompt."""
        points: set[int] = {n_prompt}
        if boundary is not None and resume < boundary <= n_prompt:
            points.add(boundary)
        if aligned:
            bs = self.block_size
            points.add(n_prompt - n_prompt % bs)
            if boundary is not None and boundary <= n_prompt:
                points.add(boundary - boundary % bs)
        periodic = [p for p in range(self.min_step, n_prompt, self.min_step) if p > resume]
        before_user = boundary is None or match_len < boundary
        if before_user and resume < match_len < n_prompt:
            # what a later prompt splitting here would resume at without this checkpoint
            below = max([resume] + [p for p in (*points, *periodic) if p < match_len])
            if match_len - below >= self.min_gain:
                points.add(match_len)
        room = max(0, self.max_per_seq - len(points))
        points.update(periodic[-room:] if room else [])
        return sorted(p for p in points if p > resume and p > 0)

    def snapshot(self) -> dict:
        return {"count": len(self.store), "unique_bytes": self.store.unique_bytes,
                "live_count": self.account.live_count, "live_bytes": self.account.live_bytes,
                "saved": self.saved, "restored": self.restored, "evicted": self.evicted,
                "budget_bytes": self.budget_bytes}
