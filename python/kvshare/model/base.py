"""The `Model` interface the engine runs, and `DecoderModel`, the batched forward pass shared
by the decoder-only architectures (Gemma 3, llama / qwen2 / qwen3).

One `forward` call runs a batch that mixes prefill chunks and decode tokens of several
sequences (`SeqChunk`s). Token-wise work (embedding, norms, projections, MLP) runs once over
the concatenation of all chunks' tokens: one GEMM per weight per call. Attention runs per
sequence over its paged KV: the chunk's new K/V are written into its blocks first, then each
query attends over the blocks of its own sequence. Only rows whose logits are requested go
through the last layer's MLP and the output head.

A layer is either an `AttentionLayer` (KV in the paged cache, slot `attn_index` of
`KVArrays.kv`) or a `RecurrentLayer` (state in the sequence's `state_slot` of
`KVArrays.states`). The recurrent kind is the hook for hybrid architectures: subclasses
implement `RecurrentLayer.forward`; this module only defines its contract.
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from kvshare.backend import CPU, CPU_THREADS, Backend
from kvshare.model.batch import SeqChunk, split_logits
from kvshare.model.kv_arrays import KVArrays
from kvshare.model import fused, gpu_graphs
from kvshare.model.config import ATTENTION, RECURRENT, ModelConfig
from kvshare.ops.attention import pad_block_tables, paged_attention, slots_of, token_positions
from kvshare.ops.embedding import embedding
from kvshare.ops.linear import linear, linear_add, linear_glu
from kvshare.ops.norm import rms_norm
from kvshare.ops.parallel import ROWS, split_rows
from kvshare.ops.rope import qkv_rope_write, rope_cos_sin

log = logging.getLogger("kvshare.model")


@dataclass(frozen=True)
class LayerKinds:
    """A model's layers by kind: full attention (K/V of every position), sliding window (K/V of
    the last `window` positions), recurrent (one state per sequence)."""

    full_attention: int
    sliding_window: int = 0
    window: int = 0
    recurrent: int = 0


class Model(ABC):
    """A loaded model on one backend.

    `forward(chunks, cache)` runs one step and returns, per chunk, host float32 logits:
    `[1, vocab]` for `logits="last"`, `[n, vocab]` for `"all"`, None for `"none"`.
    """

    config: ModelConfig
    backend: Backend
    path: Path | None = None
    # the share of the file's map in 2 MiB pages (`model/huge_pages.py`; 0.0: not mapped so)
    huge_page_fraction: float = 0.0
    # GPU decode steps as CUDA graphs (`model.gpu_graphs`, decoder models): None follows
    # $KVSHARE_CUDA_GRAPHS (on unless "0"), False keeps every step eager
    cuda_graphs: bool | None = None
    _fingerprint: str | None = None

    @property
    def arch(self) -> str:
        return self.config.arch

    @property
    def fingerprint(self) -> str:
        """SHA-256 of the weights file (cached on disk by path, size and mtime)."""
        if self._fingerprint is None:
            if self.path is None:
                raise ValueError("model has no file to fingerprint")
            from kvshare.model.fingerprint import file_fingerprint  # noqa: PLC0415

            self._fingerprint = file_fingerprint(self.path)
        return self._fingerprint

    def state_shapes(self) -> list[tuple[int, ...]]:
        """Per-slot shapes of the recurrent-state arrays (none for attention-only models)."""
        return []

    def kv_bytes_per_token(self, kv_dtype: Any = None, group: int | None = None) -> int:
        """Bytes of paged KV one token takes (K and V): of all attention layers (`group`
        None), of the full-attention ones (0) or of the sliding-window ones (1). q8_0: 34 bytes
        per 32 values."""
        from kvshare.model.kv_arrays import kv_row_bytes  # noqa: PLC0415

        dt = kv_dtype if kv_dtype is not None else self._default_kv_dtype()
        c = self.config
        n = c.n_attn_layers
        if group is not None:
            n_win = self.n_window_layers()
            n = n_win if group == 1 else n - n_win
        return n * max(c.n_head_kv, 1) * (kv_row_bytes(c.head_dim, dt)
                                           + kv_row_bytes(c.head_dim_v, dt))

    def n_window_layers(self) -> int:
        """Attention layers with a sliding window (their K/V can live in a window group)."""
        c = self.config
        return sum(1 for w, k in zip(c.layer_windows or (), c.attn_layer_index) if w and k >= 0)

    def layer_kinds(self) -> "LayerKinds":
        """How many layers of each kind the model has, as the engine's cache groups them
        (engine/cache: one manager per kind)."""
        c = self.config
        n_win = self.n_window_layers()
        return LayerKinds(full_attention=c.n_attn_layers - n_win, sliding_window=n_win,
                          window=int(c.sliding_window) if n_win else 0,
                          recurrent=c.n_layers - c.n_attn_layers if self.state_shapes() else 0)

    def _default_kv_dtype(self) -> Any:
        # f16 on every backend: half the pool's bytes and reads (llama.cpp's default too); the
        # CPU attention kernel reads it in place for decode rows and prefill chunks alike
        return np.float16

    def new_cache(self, n_blocks: int, block_size: int = 16, n_state_slots: int = 0,
                  kv_dtype: Any = None, n_win_blocks: int | None = None) -> KVArrays:
        """A KV pool of `n_blocks` blocks of `block_size` tokens (`kv_dtype`: a dtype or "f32" /
        "f16" / "q8_0" (CPU only); default f16) plus `n_state_slots` recurrent-state slots
        (hybrid models only).
        `n_win_blocks`: the sliding-window layers get their own pool of that many blocks
        (`KVArrays.split`)."""
        if kv_dtype is None:
            kv_dtype = self._default_kv_dtype()
        return KVArrays(self.config, n_blocks, block_size, n_state_slots=n_state_slots,
                          kv_dtype=kv_dtype, backend=self.backend,
                          state_shapes=self.state_shapes(), n_win_blocks=n_win_blocks)

    @abstractmethod
    def forward(self, chunks: Sequence[SeqChunk], cache: KVArrays) -> list[np.ndarray | None]:
        ...

    def fed_steps_apply(self) -> bool:
        """Whether `forward_fed` may launch steps (a GPU model with decode graphs)."""
        return False

    def warm_up(self, cache: KVArrays, parallel: int, prefill_chunk: int) -> int:
        """Prepare the steps a server meets first on `cache` before its first request (a GPU
        model: capture their CUDA graphs, `DecoderModel.warm_up`). Returns how many step
        shapes were prepared; 0: nothing to do."""
        return 0

    def forward_fed(self, chunks: Sequence[SeqChunk], cache: KVArrays, token_feed: Any
                    ) -> list[Any] | None:
        """A decode step fed its input tokens on the device (`DecoderModel.forward_fed`), or
        None: this model launches no such step."""
        return None


# positions per table of `DecoderModel._rope_row` (256 x n_rot / 2 x 2 f32: 256 KB for Gemma 3)
ROPE_BLOCK = 256


@dataclass
class BatchPlan:
    """Everything about one forward call that does not depend on the layer."""

    chunks: Sequence[SeqChunk]
    tokens: np.ndarray  # int32 [N]
    positions: np.ndarray  # int64 [N]
    q_starts: np.ndarray  # int64 [n_seq + 1]
    start_positions: np.ndarray  # int64 [n_seq]
    block_tables: np.ndarray  # int32 [n_seq, max_blocks], -1 padded
    slots: np.ndarray  # int64 [N]: flat KV row of each token
    logit_rows: np.ndarray  # int64 [R]: rows of the batch whose logits are returned
    state_slots: list[int | None]
    rope: dict[tuple[float, float], tuple[Any, Any]] = field(default_factory=dict)
    masks: dict = field(default_factory=dict)
    row_parts: int = 1  # CPU: >1 runs the token-wise work as row-parallel parts (ops.parallel)
    win_block_tables: np.ndarray | None = None  # the window group's (split caches)
    win_slots: np.ndarray | None = None
    fused: bool = False  # the attention layers take `model.fused` (CPU decode steps)
    max_seq_rows: int = 0  # most rows of one sequence in the step
    # a hybrid's GPU step with a prompt chunk: its rows as sequences for the recurrent
    # layers' sequence kernels (`hybrid.plan_seq_rows`, made by the first layer)
    seq_rows: Any = None

    def group(self, g: int) -> tuple[np.ndarray, np.ndarray]:
        """(block tables, KV slots) of layer group `g` (KVArrays.group_of)."""
        if g == 1:
            return self.win_block_tables, self.win_slots
        return self.block_tables, self.slots


def _check_tables(chunks: Sequence[SeqChunk], block_size: int) -> None:
    for c in chunks:
        need = -(-c.end_pos // block_size)
        if len(c.block_table) < need:
            raise IndexError(f"block table of {len(c.block_table)} blocks cannot hold "
                             f"{c.end_pos} positions at block size {block_size}")


def _win_tables(chunks: Sequence[SeqChunk]) -> list[np.ndarray] | None:
    """The chunks' window tables (a split cache), or None when no chunk has one."""
    if all(c.win_block_table is None for c in chunks):
        return None
    if any(c.win_block_table is None for c in chunks):
        raise ValueError("a split cache needs every chunk's win_block_table")
    return [c.win_block_table for c in chunks]


def make_plan(chunks: Sequence[SeqChunk], block_size: int, config: ModelConfig) -> BatchPlan:
    if not chunks:
        raise ValueError("forward needs at least one chunk")
    if all(c.n == 1 for c in chunks):
        return _decode_plan(chunks, block_size, config)
    return _general_plan(chunks, block_size, config)


def _general_plan(chunks: Sequence[SeqChunk], block_size: int, config: ModelConfig
                  ) -> BatchPlan:
    lens = np.array([c.n for c in chunks], np.int64)
    q_starts = np.zeros(len(chunks) + 1, np.int64)
    np.cumsum(lens, out=q_starts[1:])
    tokens = np.concatenate([c.tokens for c in chunks])
    if tokens.min() < 0 or tokens.max() >= config.vocab_size:
        raise IndexError(f"token id out of range [0, {config.vocab_size})")
    start = np.array([c.start_pos for c in chunks], np.int64)
    seq, positions = token_positions(q_starts, start)
    _check_tables(chunks, block_size)
    tables = pad_block_tables([c.block_table for c in chunks])
    slots = slots_of(tables, seq, positions, block_size)
    rows = []
    for c, r0 in zip(chunks, q_starts[:-1]):
        if c.logits == "last":
            rows.append(np.array([r0 + c.n - 1]))
        elif c.logits == "all":
            rows.append(np.arange(r0, r0 + c.n))
    logit_rows = np.concatenate(rows).astype(np.int64) if rows else np.zeros(0, np.int64)
    plan = BatchPlan(chunks, tokens, positions, q_starts, start, tables, slots, logit_rows,
                     [c.state_slot for c in chunks])
    wins = _win_tables(chunks)
    if wins is not None:
        plan.win_block_tables = pad_block_tables(wins)
        plan.win_slots = slots_of(plan.win_block_tables, seq, positions, block_size)
    plan.max_seq_rows = int(lens.max())
    return plan


def _decode_plan(chunks: Sequence[SeqChunk], block_size: int, config: ModelConfig
                 ) -> BatchPlan:
    """`make_plan` of a step whose every chunk is one token (decode rows): the same plan,
    computed in Python integers (~20 NumPy calls on arrays of a few elements were a tenth of
    a Gemma 3 270M decode step)."""
    n = len(chunks)
    toks = [int(c.tokens[0]) for c in chunks]
    if min(toks) < 0 or max(toks) >= config.vocab_size:
        raise IndexError(f"token id out of range [0, {config.vocab_size})")
    _check_tables(chunks, block_size)
    pos = [c.start_pos for c in chunks]

    def slots(tables: list[np.ndarray]) -> np.ndarray:
        blocks = [int(t[p // block_size]) for t, p in zip(tables, pos)]
        if min(blocks) < 0:
            raise IndexError("block table does not cover every position of the batch")
        return np.array([b * block_size + p % block_size for b, p in zip(blocks, pos)],
                        np.int64)

    positions = np.array(pos, np.int64)
    tables = [c.block_table for c in chunks]
    logit_rows = np.array([i for i, c in enumerate(chunks) if c.logits != "none"], np.int64)
    plan = BatchPlan(chunks, np.array(toks, np.int32), positions, np.arange(n + 1, dtype=np.int64),
                     positions.copy(), pad_block_tables(tables), slots(tables), logit_rows,
                     [c.state_slot for c in chunks])
    wins = _win_tables(chunks)
    if wins is not None:
        plan.win_block_tables = pad_block_tables(wins)
        plan.win_slots = slots(wins)
    plan.max_seq_rows = 1
    return plan


@dataclass
class AttentionLayer:
    """Weights of one attention + MLP decoder layer (2-D weights `[out, in]`)."""

    index: int
    attn_index: int
    window: int
    rope_base: float
    rope_scale: float
    attn_norm: Any
    wqkv: Any  # [(n_head + 2 n_kv) * head_dim, n_embd]: Q, K, V stacked
    wo: Any  # [n_embd, n_head * head_dim]
    ffn_norm: Any
    w_gate_up: Any  # [2 n_ff, n_embd]: gate then up
    w_down: Any  # [n_embd, n_ff]
    bqkv: Any = None
    q_norm: Any = None  # [head_dim], per-head RMSNorm of q (qwen3, gemma3)
    k_norm: Any = None
    post_attn_norm: Any = None  # gemma: norm of the attention output before the residual
    post_ffn_norm: Any = None
    sinks: Any = None  # [n_head] f32: a learned logit in each head's softmax denominator (gpt-oss)
    bo: Any = None  # [n_embd] f32: the output projection's bias (gpt-oss)
    # the layer's FFN when it is a mixture of experts (`model.moe.MoeFFN`; w_gate_up and
    # w_down are None then, so the fused decode path, whose layers are dense, leaves it alone)
    moe: Any = None
    kind: str = ATTENTION
    # `model.fused`'s arguments for the layer, built on first use (() when it cannot take it)
    fused: Any = field(default=None, repr=False, compare=False)
    # and its shape tuple (`fused.layer_call`)
    fused_shape: Any = field(default=None, repr=False, compare=False)
    # and `_core.FusedLayer(fused, fused_shape)`: the weights checked and borrowed once
    fused_layer: Any = field(default=None, repr=False, compare=False)


class RecurrentLayer:
    """A layer whose state lives in the sequence's state slot (hybrid models).

    Contract for implementations (the hybrid-model work): `forward(x, plan, cache)` gets the
    batch's hidden states x float32 `[N, n_embd]` (rows of chunk s at
    `plan.q_starts[s]:plan.q_starts[s+1]`), reads and updates each chunk's state in
    `cache.states[...][plan.state_slots[s]]` in place, and returns the layer's output
    `[N, n_embd]` (the residual stream after the layer, including its MLP).
    """

    kind = RECURRENT

    def __init__(self, index: int, name: str = "recurrent"):
        self.index = index
        self.name = name

    def forward(self, x: Any, plan: BatchPlan, cache: KVArrays) -> Any:
        raise NotImplementedError(
            f"layer {self.index} is a {self.name} (recurrent) layer; recurrent layers are not "
            "implemented yet (hybrid-model support)")


class DecoderModel(Model):
    """A decoder-only transformer; subclasses load the weights into `self.layers` etc."""

    tok_embd: Any  # [vocab, n_embd]
    output: Any  # [vocab, n_embd] (the same array as tok_embd when tied)
    output_norm: Any
    layers: list[Any]
    rope_freq_factors: Any = None
    # True when the weights multiply 8-bit activations at every batch size (BlockWeight
    # "vnni"): attention then takes the kernel's batch-invariant form, so that a row's
    # activations, and with them their 8-bit rounding, do not depend on the step's batch
    batch_invariant: bool = False
    # True: on a GPU, `forward` returns each chunk's logits as device arrays (the engine then
    # samples on the device and only token ids come back); False: host NumPy arrays
    logits_on_device: bool = False

    def __init__(self, config: ModelConfig, backend: Backend = CPU):
        self.config = config
        self.backend = backend
        # the gated FFN's activation, as `ops.activation.glu` names it (the fused decode
        # layer passes it on too)
        self.glu_activation = "gelu_tanh" if config.activation == "gelu_tanh" else "silu"
        # rope key -> (block number, cos, sin) of ROPE_BLOCK positions (`_rope_row`)
        self._rope_blocks: dict[tuple[float, float], tuple[int, np.ndarray, np.ndarray]] = {}

    # the methods whose work a captured step repeats (`gpu_graphs.StepGraphs._run`): a class
    # that overrides one computes its steps its own way, and they stay eager
    _GRAPH_METHODS = ("forward", "_rope", "_project_qkv", "_output_and_mlp", "_attention_layer",
                      "_attention_rows", "_logits")

    def step_graphs_apply(self) -> bool:
        """Whether steps can be CUDA graphs (`model.gpu_graphs`): every layer graph-ready
        (`_layer_graph_ready`) and the forward pass this class's."""
        return self._graph_methods_kept(DecoderModel.forward) and all(
            self._layer_graph_ready(L) for L in self.layers)

    def _graph_methods_kept(self, forward: Any, attention_layer: Any = None) -> bool:
        """Whether the class keeps `_GRAPH_METHODS` as DecoderModel has them (`forward`, and
        `_attention_layer` where given: as given)."""
        cls = type(self)
        own = {"forward": forward,
               "_attention_layer": attention_layer or DecoderModel._attention_layer}
        return all(getattr(cls, name) is own.get(name, getattr(DecoderModel, name))
                   for name in self._GRAPH_METHODS)

    @staticmethod
    def _layer_graph_ready(L: Any) -> bool:
        """An attention layer whose experts (if any) are graph-ready, or a recurrent layer
        whose GPU step is (`step_graph_ready`).
        (AttentionLayer's subclasses only type its fields: gpt-oss's, qwen3moe's; a
        `_rope_tables` override computes its tables on the device, as the graph calls it.)"""
        if isinstance(L, AttentionLayer):
            return L.moe is None or L.moe.graph_ready()
        ready = getattr(L, "step_graph_ready", None)
        return bool(ready is not None and ready())

    def fed_steps_apply(self) -> bool:
        return self.backend.is_gpu and gpu_graphs.runner(self) is not None

    def warm_up(self, cache: KVArrays, parallel: int, prefill_chunk: int) -> int:
        """Capture the CUDA graphs of the step shapes an agent server meets first (decode
        batches up to `parallel`, a turn's last prompt chunk up to `prefill_chunk` tokens
        beside the other sessions' decode rows, a long prompt's middle chunk:
        `gpu_graphs.warm_up_steps`), so that those steps replay a graph from the first one."""
        if self.backend.is_gpu:
            self._compile_kernels()
        graphs = gpu_graphs.runner(self) if self.backend.is_gpu else None
        if graphs is None:
            return 0
        steps = gpu_graphs.warm_up_steps(cache, parallel, prefill_chunk)
        return graphs.warm_up(cache, [(s, make_plan(s, cache.block_size, self.config))
                                      for s in steps])

    def kernel_units(self) -> list[tuple[str, str | None]]:
        """The GPU kernel units (`(module, part)`) this model may launch: its weights' parts,
        then every module without parts (`gpu_runtime.kernel_units`)."""
        from kvshare.ops import gpu_runtime  # noqa: PLC0415

        return gpu_runtime.kernel_units([self.tok_embd, self.output, self.layers])

    def _compile_kernels(self) -> None:
        """Compile the kernels this GPU model may launch at once, in threads, before its first
        steps (`kernels.compile_parallel`): otherwise each compiles at its first launch, one
        after another (a fresh start, before CuPy's disk cache has them). A failure costs
        only that: each kernel then compiles at its first launch, as before."""
        from kvshare import kernels  # noqa: PLC0415

        t0 = time.perf_counter()
        try:
            n = kernels.compile_parallel(self.kernel_units())
        except Exception:  # noqa: BLE001 - the lazy path compiles (or reports) them again
            log.warning("compiling the kernels ahead failed; each compiles at its first launch",
                        exc_info=True)
            return
        log.info("%d kernel modules ready in %.2f s", n, time.perf_counter() - t0)

    def forward_fed(self, chunks: Sequence[SeqChunk], cache: KVArrays, token_feed: Any
                    ) -> list[Any] | None:
        """A decode step whose input tokens are on the device already (`token_feed`: device
        int32, one per chunk, in order; the chunks' own tokens are placeholders), launched
        as a CUDA graph: its logits as `forward` returns them, or None where no graph takes
        the step (nothing was launched). The engine launches a step this way before the
        previous step's sampled tokens have reached the host (engine/step_ahead.py)."""
        if not self.backend.is_gpu or any(c.n != 1 for c in chunks):
            return None
        graphs = gpu_graphs.runner(self)
        if graphs is None:
            return None
        plan = make_plan(chunks, cache.block_size, self.config)
        return graphs.forward(chunks, cache, plan, token_feed=token_feed)

    # ------------------------------------------------------------------------------------
    def forward(self, chunks: Sequence[SeqChunk], cache: KVArrays) -> list[np.ndarray | None]:
        cfg, be = self.config, self.backend
        plan = make_plan(chunks, cache.block_size, cfg)
        if be.is_gpu:  # a decode step replayed as a CUDA graph, where one applies
            graphs = gpu_graphs.runner(self)
            out = graphs.forward(chunks, cache, plan) if graphs is not None else None
            if out is not None:
                return out
        if not be.is_gpu:
            plan.row_parts = CPU_THREADS.for_tokens(len(plan.tokens),
                                                    row_parallel=not cfg.n_recurrent_layers)
        if any(c.state_slot is None for c in chunks) and cfg.n_recurrent_layers:
            raise ValueError("this model has recurrent layers: every chunk needs a state_slot")
        x = embedding(self.tok_embd, be.asarray(plan.tokens) if be.is_gpu else plan.tokens,
                      cfg.embed_scale, backend=be)
        plan.fused = not be.is_gpu and fused.step_applies(plan, x)
        n_layers = len(self.layers)
        # consecutive layers that take the fused path, run by one Rust call (`fused.run_layers`)
        batch: list[tuple] = []
        for il, layer in enumerate(self.layers):
            last = il == n_layers - 1
            if plan.fused and layer.kind == ATTENTION:
                call = self._fused_call(layer, x, plan, cache, last)
                if call is not None:
                    batch.append(call)
                    continue
            if batch:
                fused.run_layers(self, x, plan, batch)
                batch = []
            if layer.kind == ATTENTION:
                x = self._attention_layer(layer, x, plan, cache, last)
            else:
                x = layer.forward(x, plan, cache)
                if last:
                    x = x[plan.logit_rows]
            if x is None:  # nothing more to compute: no logits requested
                break
        if batch:
            fused.run_layers(self, x, plan, batch)
        return self._logits(x, plan)

    def _fused_call(self, L: Any, x: Any, plan: BatchPlan, cache: KVArrays,
                    last: bool) -> tuple | None:
        """The layer's arguments for `fused.run_layers` (a decode step's attention layer on
        the CPU), or None where `_attention_layer` computes it (another kind of attention
        layer, or the fused path does not apply)."""
        if type(L) is not AttentionLayer:
            return None
        kc, vc = cache.layer_kv(L.attn_index)
        tables, slots = plan.group(cache.group_of(L.attn_index))
        if tables is None or not fused.applies(L, x, plan, kc, last):
            return None
        cos, sin = self._rope(plan, L.rope_base, L.rope_scale)
        return fused.layer_call(self, L, cos, sin, slots, kc, vc, tables)

    def _rope(self, plan: BatchPlan, base: float, scale: float) -> tuple[Any, Any]:
        key = (base, scale)
        if key not in plan.rope:
            if len(plan.positions) == 1 and not self.backend.is_gpu:
                plan.rope[key] = self._rope_row(int(plan.positions[0]), key)
            else:
                plan.rope[key] = self._rope_tables(plan.positions, base, scale)
        return plan.rope[key]

    def _rope_tables(self, positions: Any, base: float, scale: float) -> tuple[Any, Any]:
        """cos and sin `[N, n_rot // 2]` of the rope key (base, scale) at `positions` (host
        positions, or on a GPU a device array: a captured step's positions buffer, so a
        model's override must compute them on the device too)."""
        return rope_cos_sin(positions, self.config.n_rot, base, scale, self.rope_freq_factors,
                            backend=self.backend)

    def _rope_row(self, pos: int, key: tuple[float, float]) -> tuple[Any, Any]:
        """`rope_cos_sin` of one position, cut from a table of `ROPE_BLOCK` positions kept
        per rope key: a batch-1 decode step's positions advance one at a time, so its ~10
        NumPy calls per key run once per block. The same values (each angle is formed and
        rounded alone)."""
        blk = pos // ROPE_BLOCK
        cached = self._rope_blocks.get(key)
        if cached is None or cached[0] != blk:
            first = blk * ROPE_BLOCK
            cached = (blk, *self._rope_tables(np.arange(first, first + ROPE_BLOCK), *key))
            self._rope_blocks[key] = cached
        i = pos % ROPE_BLOCK
        return cached[1][i : i + 1], cached[2][i : i + 1]

    def _attention_layer(self, L: AttentionLayer, x: Any, plan: BatchPlan, cache: KVArrays,
                         last: bool) -> Any:
        cfg, be = self.config, self.backend
        n = x.shape[0]
        cos, sin = self._rope(plan, L.rope_base, L.rope_scale)
        kc, vc = cache.layer_kv(L.attn_index)
        tables, slots = plan.group(cache.group_of(L.attn_index))
        if tables is None:
            raise ValueError("the cache keeps window layers apart: chunks need win_block_table")
        parts = split_rows(n, plan.row_parts) if plan.row_parts > 1 else None
        # every layer stores its K/V, even the last one of a step that wants no logits
        if parts is None:
            q = self._project_qkv(L, x, cos, sin, slots, kc, vc)
        else:
            q = np.concatenate(ROWS.run(
                lambda sl: self._project_qkv(L, x[sl], cos[sl], sin[sl], slots[sl], kc, vc),
                parts))
        rows = None
        if last:
            if plan.logit_rows.size == 0:
                return None
            if plan.logit_rows.size < n:
                rows = plan.logit_rows
                parts = None
        if rows is None:
            attn = paged_attention(q, kc, vc, tables, plan.q_starts,
                                   plan.start_positions, scale=cfg.q_scale, window=L.window,
                                   backend=be, mask_cache=plan.masks, parts=plan.row_parts,
                                   invariant=self.batch_invariant, sinks=L.sinks)
        else:
            # only the requested rows: attend per chunk with its selected queries
            attn = self._attention_rows(q, kc, vc, plan, L.window, rows, tables, L.sinks)
            x = x[rows]
        attn = attn.reshape(attn.shape[0], -1)
        if parts is None:
            self._output_and_mlp(L, x, attn)
        else:
            ROWS.run(lambda sl: self._output_and_mlp(L, x[sl], attn[sl]), parts)
        return x

    def _project_qkv(self, L: AttentionLayer, x: Any, cos: Any, sin: Any, slots: Any, kc: Any,
                     vc: Any) -> Any:
        """Norm, Q/K/V projection, q/k norms and rope of rows x; stores their K and V at
        `slots` of the layer's cache; returns q `[n, n_head, head_dim]`."""
        cfg, be = self.config, self.backend
        eps = cfg.norm_eps
        H, K, D = cfg.n_head, cfg.n_head_kv, cfg.head_dim
        h = rms_norm(x, L.attn_norm, eps, backend=be)
        qkv = linear(h, L.wqkv, L.bqkv, backend=be)
        # q/k norms, rope and the K/V store: one kernel on the GPU
        return qkv_rope_write(qkv, L.q_norm, L.k_norm, eps, cos, sin, cfg.rope_style, kc, vc,
                              slots, H, K, D, backend=be)

    def _output_and_mlp(self, L: AttentionLayer, x: Any, attn: Any) -> None:
        """Output projection and the MLP block, added into the rows x in place (x is this
        call's own array, the copy x[rows], or a row slice of either)."""
        be = self.backend
        eps = self.config.norm_eps
        # without a post-norm the projections add into x themselves (`linear_add`: on the GPU
        # a block weight's mat-vec accumulates into x, no separate add); the same values
        if L.post_attn_norm is None:
            linear_add(attn, L.wo, L.bo, x, backend=be)
        else:
            o = linear(attn, L.wo, L.bo, backend=be)
            rms_norm(o, L.post_attn_norm, eps, backend=be, out=o)
            x += o
        h = rms_norm(x, L.ffn_norm, eps, backend=be)
        if L.moe is not None:
            y = L.moe(h)
        else:
            a = linear_glu(h, L.w_gate_up, self.glu_activation, backend=be)
            if L.post_ffn_norm is None:
                linear_add(a, L.w_down, None, x, backend=be)
                return
            y = linear(a, L.w_down, backend=be)
        if L.post_ffn_norm is not None:
            rms_norm(y, L.post_ffn_norm, eps, backend=be, out=y)
        x += y

    def _attention_rows(self, q: Any, kc: Any, vc: Any, plan: BatchPlan, window: int,
                        rows: np.ndarray, tables: np.ndarray | None = None,
                        sinks: Any = None, selected: bool = False) -> Any:
        """Attention output of the query rows `rows` only (the last layer, when only some
        positions' logits are wanted): each row keeps its own position and sequence.
        `selected`: q holds those rows' queries alone (already gathered), in that order."""
        seq_of_row = np.searchsorted(plan.q_starts, rows, side="right") - 1
        pos = plan.positions[rows]
        # every selected row becomes a one-token "sequence" at its own position
        qs = np.arange(len(rows) + 1, dtype=np.int64)
        sel = q if selected else q[self.backend.asarray(rows) if self.backend.is_gpu else rows]
        tables = plan.block_tables if tables is None else tables
        return paged_attention(sel, kc, vc, tables[seq_of_row], qs, pos,
                               scale=self.config.q_scale, window=window, backend=self.backend,
                               invariant=self.batch_invariant, sinks=sinks)

    def _logits(self, x: Any, plan: BatchPlan) -> list[np.ndarray | None]:
        be = self.backend
        if x is None or plan.logit_rows.size == 0:
            return [None] * len(plan.chunks)
        h = rms_norm(x, self.output_norm, self.config.norm_eps, backend=be)
        logits = linear(h, self.output, backend=be)
        if not (be.is_gpu and self.logits_on_device):
            logits = be.to_host(logits)
        return split_logits(logits, plan.chunks)


def load_attention_layer(ld: Any, cfg: ModelConfig, il: int, attn_index: int) -> AttentionLayer:
    """Read layer `il` of a llama-style GGUF (`blk.{il}.*`) through a `WeightLoader`, fusing
    Q/K/V into one `[out, in]` matrix and gate/up into another (one GEMM each per step).
    Optional tensors: q/k/v biases, attn_q_norm/attn_k_norm, post_attention_norm and
    post_ffw_norm (Gemma)."""
    p = f"blk.{il}."
    H, K, D = cfg.n_head, cfg.n_head_kv, cfg.head_dim
    if ld.has(p + "attn_qkv.weight"):
        qkv_names = [p + "attn_qkv.weight"]
    else:
        qkv_names = [p + "attn_q.weight", p + "attn_k.weight", p + "attn_v.weight"]
    wqkv = ld.matrix(qkv_names)
    if tuple(wqkv.shape) != ((H + 2 * K) * D, cfg.n_embd):
        raise ValueError(f"layer {il}: fused QKV weight has shape {tuple(wqkv.shape)}, "
                         f"expected {((H + 2 * K) * D, cfg.n_embd)}")
    bqkv = None
    names = [p + "attn_q.bias", p + "attn_k.bias", p + "attn_v.bias"]
    if ld.has(p + "attn_qkv.bias"):
        bqkv = ld.host(p + "attn_qkv.bias")
    elif any(ld.has(n) for n in names):
        sizes = [H * D, K * D, K * D]
        bqkv = np.concatenate([ld.host(n) if ld.has(n) else np.zeros(s, np.float32)
                               for n, s in zip(names, sizes)])

    def opt(name: str) -> Any:
        return ld.get(p + name) if ld.has(p + name) else None

    gu_names = [p + "ffn_gate.weight", p + "ffn_up.weight"]
    window = cfg.layer_windows[il]
    return AttentionLayer(
        index=il, attn_index=attn_index, window=window,
        rope_base=cfg.layer_rope_base(il), rope_scale=cfg.layer_rope_scale(il),
        attn_norm=ld.get(p + "attn_norm.weight"),
        wqkv=wqkv, bqkv=None if bqkv is None else ld.put(bqkv, keep_f32=True),
        wo=ld.matrix([p + "attn_output.weight"]),
        q_norm=opt("attn_q_norm.weight"), k_norm=opt("attn_k_norm.weight"),
        post_attn_norm=opt("post_attention_norm.weight"),
        ffn_norm=ld.get(p + "ffn_norm.weight"),
        w_gate_up=ld.matrix(gu_names),
        w_down=ld.matrix([p + "ffn_down.weight"]),
        post_ffn_norm=opt("post_ffw_norm.weight"),
    )


def load_decoder(model: DecoderModel, ld: Any) -> None:
    """Fill a `DecoderModel` from a llama-style GGUF: embeddings, layers, final norm and the
    output head (tied to the embeddings when the file has no `output.weight`)."""
    cfg = model.config
    model.tok_embd = ld.matrix(["token_embd.weight"])
    if model.tok_embd.shape != (cfg.vocab_size, cfg.n_embd):
        raise ValueError(f"token_embd has shape {model.tok_embd.shape}, expected "
                         f"{(cfg.vocab_size, cfg.n_embd)}")
    if ld.has("rope_freqs.weight"):
        model.rope_freq_factors = ld.host("rope_freqs.weight")
    layers: list[Any] = []
    attn_idx = cfg.attn_layer_index
    for il in range(cfg.n_layers):
        if cfg.layer_kinds[il] != ATTENTION:
            layers.append(RecurrentLayer(il))
        else:
            layers.append(load_attention_layer(ld, cfg, il, attn_idx[il]))
    model.layers = layers
    model.output_norm = ld.get("output_norm.weight")
    if ld.has("output.weight"):
        model.output = ld.matrix(["output.weight"])
    else:
        model.output = model.tok_embd
    model.batch_invariant = any(getattr(w, "activations", None) == "vnni"
                                for w in (model.output, model.tok_embd))
