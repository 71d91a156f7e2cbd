"""Shared machinery of the hybrid architectures (`qwen35`, `lfm2`): recurrent-state slots,
the per-call split of a batch into prefill chunks and decode tokens, and small helpers.

State slots. Every sequence owns one slot of `KVArrays.states` (`SeqChunk.state_slot`).
A model lists its state kinds in `state_shapes()`; each kind is one array of the cache,
`[n_state_slots, n_recurrent_layers, ...]`, and recurrent layer r (its `rec_index`) owns row
r of every kind. `KVArrays.read_state(slot)` / `write_state(slot, arrays)` therefore
snapshot / restore exactly everything a sequence needs to resume (the paged KV of the
attention layers is shared through the block tables as for any model).

Reset and resume. A chunk at `start_pos == 0` starts from a zero state: the forward call
zeroes its slot first. Any other chunk continues from what its slot holds, so resuming at
position p after `write_state(slot, snapshot_at_p)` (with the KV of positions < p in the
chunk's blocks) is exactly a cold run from p.

Batch split. On the CPU, within a recurrent layer, decode tokens (chunks of one token) of
all sequences are advanced together (states gathered from their slots, stepped, written
back); each prefill chunk runs the chunked (vectorised) form of its layer's recurrence on its
own slot's state in place. On a GPU a layer's step is one kernel per recurrence over the
cache's states at the chunks' slots: the decode kernels for a step of decode tokens (which a
CUDA graph captures), the sequence kernels for a step with a prompt chunk (`plan_seq_rows`:
every chunk's rows in order, as llama.cpp's scan), with no per-chunk loop on the host.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from kvshare.model.base import BatchPlan, DecoderModel, RecurrentLayer
from kvshare.model.batch import SeqChunk
from kvshare.model.kv_arrays import KVArrays
from kvshare.ops.activation import glu
from kvshare.ops.linear import linear
from kvshare.ops.norm import rms_norm


class HybridModel(DecoderModel):
    """A `DecoderModel` whose layers mix `AttentionLayer`s and `HybridRecurrentLayer`s."""

    def state_shapes(self) -> list[tuple[int, ...]]:
        raise NotImplementedError

    def new_cache(self, n_blocks: int, block_size: int = 16, n_state_slots: int = 1,
                  kv_dtype: Any = None, n_win_blocks: int | None = None) -> KVArrays:
        """As `Model.new_cache`; hybrid models need at least one state slot (default 1)."""
        return super().new_cache(n_blocks, block_size, n_state_slots=n_state_slots,
                                 kv_dtype=kv_dtype, n_win_blocks=n_win_blocks)

    def state_nbytes(self) -> int:
        """Bytes of one sequence's recurrent state (one slot: every kind, every layer)."""
        return sum(int(np.prod(s)) * 4 for s in self.state_shapes())

    def step_graphs_apply(self) -> bool:
        """Whether steps can be CUDA graphs (`model.gpu_graphs`: decode steps and steps with a
        prompt chunk): every recurrent layer's `gpu_step` graph-ready
        (`step_graph_ready`), the attention layers as `DecoderModel`'s, and the forward
        pass this class's (which checks the chunks' state slots and zeroes a new sequence's
        states, then runs `DecoderModel.forward`)."""
        return self._graph_methods_kept(HybridModel.forward) and all(
            self._layer_graph_ready(L) for L in self.layers)

    def forward_fed(self, chunks: Sequence[SeqChunk], cache: KVArrays, token_feed: Any
                    ) -> list[Any] | None:
        """As `DecoderModel.forward_fed`, for chunks that continue their sequences in
        distinct state slots (`forward`'s checks; a sequence's first token, whose states
        `forward` zeroes, is not a step launched ahead)."""
        if any(c.start_pos == 0 for c in chunks):
            return None
        try:
            self._check_slots(chunks, cache)
        except (ValueError, IndexError):
            return None
        return super().forward_fed(chunks, cache, token_feed)

    def forward(self, chunks: Sequence[SeqChunk], cache: KVArrays) -> list[np.ndarray | None]:
        self._check_slots(chunks, cache)
        for c in chunks:
            if c.start_pos == 0:  # a sequence's first chunk starts from a zero state
                for arr in cache.states:
                    arr[c.state_slot] = 0
        return super().forward(chunks, cache)

    def _check_slots(self, chunks: Sequence[SeqChunk], cache: KVArrays) -> None:
        """The cache has state slots and every chunk its own one, in range (ValueError,
        IndexError)."""
        if not cache.states or cache.n_state_slots < 1:
            raise ValueError(f"{self.arch} has recurrent layers: the cache needs state slots "
                             "(new_cache(..., n_state_slots=k))")
        seen: set[int] = set()
        for c in chunks:
            s = c.state_slot
            if s is None:
                raise ValueError("this model has recurrent layers: every chunk needs a state_slot")
            if not 0 <= s < cache.n_state_slots:
                raise IndexError(f"state slot {s} out of range [0, {cache.n_state_slots})")
            if s in seen:
                raise ValueError(f"state slot {s} used by two chunks of one forward call")
            seen.add(s)

    # shared by the layers of the subclasses ---------------------------------------------
    def ffn(self, x: Any, norm: Any, w_gate_up: Any, w_down: Any) -> Any:
        """`x += down(silu(gate(h)) * up(h))` with `h = rms_norm(x, norm)` (in place)."""
        be = self.backend
        h = rms_norm(x, norm, self.config.norm_eps, backend=be)
        gu = linear(h, w_gate_up, backend=be)
        a = glu(gu, "silu", backend=be)
        x += linear(a, w_down, backend=be)
        return x


def ffn_graph_ready(ffn: Any) -> bool:
    """A recurrent layer's FFN can be in a CUDA graph: dense, or experts that are graph-ready
    (`MoeFFN.graph_ready`)."""
    ready = getattr(ffn, "graph_ready", None)
    return ready is None or bool(ready())


class HybridRecurrentLayer(RecurrentLayer):
    """Base of the recurrent layers: `rec_index` is its row in every state kind."""

    def __init__(self, index: int, rec_index: int, name: str):
        super().__init__(index, name)
        self.rec_index = rec_index


def split_batch(plan: BatchPlan) -> tuple[np.ndarray, list[int], list[tuple[int, int, int]]]:
    """`(decode_rows, decode_slots, prefill)` of a batch: the rows and state slots of its
    one-token chunks, and `(row0, row1, slot)` of every longer chunk."""
    rows: list[int] = []
    slots: list[int] = []
    pre: list[tuple[int, int, int]] = []
    for s, c in enumerate(plan.chunks):
        r0 = int(plan.q_starts[s])
        if c.n == 1:
            rows.append(r0)
            slots.append(int(c.state_slot))
        else:
            pre.append((r0, r0 + c.n, int(c.state_slot)))
    return np.asarray(rows, np.int64), slots, pre


def plan_seq_rows(plan: BatchPlan, cache: KVArrays) -> Any:
    """A GPU step's rows as sequences (`gpu_hybrid.SeqRows`: each chunk's rows and state
    slot, a decode token a sequence of one row), for the recurrent layers' sequence kernels;
    made and uploaded once per forward call (kept in `plan.seq_rows`)."""
    if plan.seq_rows is None:
        from kvshare.ops import gpu_hybrid  # noqa: PLC0415 - GPU path only

        spans = [(int(plan.q_starts[s]), int(plan.q_starts[s]) + c.n,
                  -1 if c.state_slot is None else int(c.state_slot))  # (forward checked them)
                 for s, c in enumerate(plan.chunks)]
        plan.seq_rows = gpu_hybrid.seq_rows(spans, int(plan.q_starts[-1]),
                                            cache.n_state_slots)
    return plan.seq_rows


def gather_states(arr: Any, slots: list[int], rec_index: int, xp: Any = np
                  ) -> tuple[Any, bool]:
    """The states of `slots` in layer `rec_index` of one state kind: `[B, ...]`. A view (and
    True) for a single slot, else a gathered copy (False) to be written back with
    `scatter_states`."""
    if len(slots) == 1:
        s = slots[0]
        return arr[s : s + 1, rec_index], True
    return arr[xp.asarray(slots), rec_index], False


def scatter_states(arr: Any, slots: list[int], rec_index: int, states: Any, is_view: bool,
                   xp: Any = np) -> None:
    if not is_view:
        arr[xp.asarray(slots), rec_index] = states


def sigmoid(x: Any, xp: Any = np) -> Any:
    """`1 / (1 + exp(-x))`, float32, new array."""
    t = xp.negative(x)
    with np.errstate(over="ignore"):
        xp.exp(t, out=t)
    t += 1.0
    return xp.reciprocal(t, out=t)


def silu(x: Any, xp: Any = np) -> Any:
    """`x * sigmoid(x)`, new array."""
    return x * sigmoid(x, xp)


def softplus(x: Any, xp: Any = np) -> Any:
    """`log(1 + exp(x))` (ggml: x itself above 20), float32, new array."""
    return xp.where(x > 20.0, x, xp.logaddexp(xp.float32(0.0), x)).astype(xp.float32)


def l2_norm_heads(x: Any, eps: float, xp: Any = np) -> Any:
    """`x / max(||x||, eps)` over the last axis (ggml_l2_norm), float32, new array."""
    n = xp.sqrt(xp.einsum("...i,...i->...", x, x))
    xp.maximum(n, xp.float32(eps), out=n)
    return x / n[..., None]
