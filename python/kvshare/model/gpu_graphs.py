"""Steps of a `DecoderModel` on the GPU as CUDA graphs: decode steps, prefill chunks and
mixed steps of up to `MAX_TOKENS` tokens (a hybrid's too: see below).

A GPU step is a few hundred kernel launches (per layer: norms, the fused Q/K/V product, q/k
norms and rope, the KV write, attention, the output product, the gated MLP, residual adds),
each with its own Python argument marshalling: on a fast GPU the host, not the device, sets
the step time, and a batch of 4 costs what a batch of 1 does. A prefill chunk of an agent's
next turn (a tool result, a user message: tens to hundreds of tokens after a cached prefix)
costs the host as much as a decode step, and every decode row beside it waits for it. A
CUDA graph replays all of a step's launches with one call.

How (`StepGraphs`):
- A step is captured per `StepShape`: its token rows, sequences and logit rows each padded
  to a bucket (powers of two up to 64, then multiples of 64: `bucket_of`; a step with a
  prefill chunk pads its sequences, and its kept logit rows where more than one, to at
  least `PREFILL_MIN_SEQS`, so that a turn's prompt chunk is one of two shapes, alone or
  beside 1 to 3 decode rows), whether the
  last layer keeps only the rows whose logits are wanted (`gather`), and whether attention
  runs on the tensor-core kernels (`mma`, decided as the eager step decides it). Padding
  token rows are copies of row 0 that write no KV (slot -1); padding sequences and logit
  rows repeat the first; their logits are dropped.
- Every input that changes between steps lives in one device buffer (`StepInputs`): token
  ids, positions, KV slots, block tables (`width` entries per sequence, -1 padded; the
  window group's too in a split cache), the attention tiles (`pa_tiles` of the step's
  chunks, one single-row tile per padding row, then tiles of no rows, which the kernels
  skip) and the split count of each attention launch, and for a shape that gathers the kept
  rows with their own one-token tiles and block tables (`DecoderModel._attention_rows`).
  The host fills a staging copy and sends it with one copy before each replay; the graph's
  kernels read the buffer, so block tables, positions and chunk boundaries are never
  constants of a graph.
- Every array the step's ops create comes from a `gpu_runtime.Workspace` (one buffer shared
  by all shapes: steps run one at a time), the same offsets at every run; a layer's
  intermediates are released once it has added into the residual stream. Nothing is
  allocated, copied to or from the host, or synchronized while a graph is captured, and no
  host code branches on device values (the attention split count, which follows the context
  length, is a device input: `gpu.StaticAttention`).
- A shape with a prefill chunk runs eager the first time it comes (chunk lengths vary: a
  shape that never comes again is not worth a capture), and is captured the second time; a
  decode shape is captured at its first step. A shape's eager run is the step's code on its
  inputs, measuring its workspace (`peaks`; it also warms NVRTC, cuBLAS and the launch
  attributes). A shape whose workspace is known and fits is captured at once on the runner's
  stream and replayed for the step; otherwise the step first runs eager (its logits are that
  step's) and is captured after. Later steps of that shape replay it. Another KV cache
  object or a larger workspace drops the graphs; they are captured again when next used
  (after a larger workspace, at once: the shapes' needs are known).
- A server captures the shapes it meets first before its first request (`warm_up`, the
  steps of `warm_up_steps`: decode batches up to its `--parallel`, a turn's last prompt
  chunk of 32 tokens and every multiple of 64 up to its prefill chunk, alone and beside
  decode rows, a long prompt's middle chunk), so an agent's next turn replays a graph from
  the start.
  Each shape's measuring run writes no KV (slots -1) and reads only block 0.
- The step calls the model's own `_project_qkv` and `_output_and_mlp` and the same GPU ops
  as `DecoderModel.forward`, in the same order, and its attention tiles are the eager
  step's: the logits and the KV equal the eager step's, bit for bit where the eager step has
  the same rows (tests/test_model_gpu.py and tests/test_engine_gpu.py check it,
  tests/test_ops_gpu_graph.py the parts; on a GPU, cuBLAS may pick another algorithm for a
  padded row count).

A hybrid model (recurrent layers beside attention ones: `HybridModel.step_graphs_apply`)
has its steps captured too. A recurrent layer's part of the step is its `gpu_step` (the same
code its eager GPU step runs), on the recurrent states in the cache: a decode step's rows at
their slots (one more input, `state_slots`, -1 for a padding row, which reads and writes no
state), a step with a prompt chunk's sequences (`seq`: each chunk's rows and slot, then one
sequence of slot -1 holding the padding rows, read by the sequence kernels). A hybrid's own
attention layer takes the model's `gpu_attention_step` (qwen35's gated attention), given
the step's static attention (the last layer of a shape that gathers: the kept rows'); where
the last layer is recurrent, the kept rows are gathered after it, as the eager step keeps
them. lfm2, lfm2moe, qwen35 and qwen35moe have such steps.

Where graphs do not apply the step stays eager: more than `MAX_TOKENS` tokens or
`MAX_LOGIT_ROWS` logit rows, a block table longer than `width`, a step whose attention needs
more splits than its shape's grid has, models with a layer that is not graph-ready
(`DecoderModel._layer_graph_ready`: MoE layers that route on the host or have a shared
expert, `MoeFFN.graph_ready`; recurrent layers without a graph-ready `gpu_step`), and
architectures that override the layer methods (a model's own rope tables, `_rope_tables`,
are computed on the device: gpt-oss's YaRN tables).
`KVSHARE_CUDA_GRAPHS=0` (`kvshare serve --no-cuda-graphs`), or `model.cuda_graphs = False`,
turns graphs off; `KVSHARE_CUDA_GRAPHS_PREFILL=0` keeps them to decode steps (every chunk
one token).
"""

from __future__ import annotations

import os
import warnings
import weakref
from collections import Counter
from typing import Any, NamedTuple, Sequence

import numpy as np

from kvshare.model.batch import SeqChunk, split_logits
from kvshare.model.config import ATTENTION
from kvshare.ops import gpu_runtime as rt

ENV = "KVSHARE_CUDA_GRAPHS"
MAX_TOKENS = 1024  # the most query rows (tokens) of a captured step
# the most logit rows: a graph's logits live in the workspace for as long as the graphs do
# (256 rows of a 152K vocabulary: 155 MB); a prompt's logits row by row stay eager
MAX_LOGIT_ROWS = 256
FINE_FROM = 64  # buckets are powers of two up to here, then multiples of it
# a shape with a prefill chunk is captured at its second step (the first runs eager); a
# decode shape at its first
PREFILL_SIGHTINGS = 2
# a step with a prefill chunk pads its sequences, and its kept logit rows where more than
# one, to at least this many: an agent's next turn is one prefill chunk beside the other
# sessions' decode rows, and without the floor each count of those rows would be a shape of
# its own, captured again. Padding sequences and logit rows cost the device next to nothing
# (no tiles of their own; a few one-token attention rows and logit rows, read with the same
# weights). A single kept row stays one (`step_shape`).
PREFILL_MIN_SEQS = 4


PREFILL_ENV = "KVSHARE_CUDA_GRAPHS_PREFILL"
_OFF = ("0", "false", "no", "off")


def enabled_by_env(environ: Any = None) -> bool:
    """Whether $KVSHARE_CUDA_GRAPHS leaves graphs on (the default)."""
    env = os.environ if environ is None else environ
    return env.get(ENV, "1").strip().lower() not in _OFF


def prefill_by_env(environ: Any = None) -> bool:
    """Whether $KVSHARE_CUDA_GRAPHS_PREFILL leaves steps with a prefill chunk to graphs too
    (the default; "0": decode steps only)."""
    env = os.environ if environ is None else environ
    return env.get(PREFILL_ENV, "1").strip().lower() not in _OFF


def bucket_of(n: int) -> int:
    """The padded size of n rows (tokens, sequences or logit rows) in a graph: the smallest
    power of two >= n up to `FINE_FROM`, then the next multiple of `FINE_FROM` (a 65-token
    chunk pads to 128, a 600-token one to 640)."""
    n = max(1, int(n))
    if n <= FINE_FROM:
        return 1 << (n - 1).bit_length()
    return -(-n // FINE_FROM) * FINE_FROM


def bucket_floor(b: int) -> int:
    """The fewest rows a step padded to bucket b has."""
    if b <= 1:
        return 1
    return b // 2 + 1 if b <= FINE_FROM else b - FINE_FROM + 1


class StepShape(NamedTuple):
    """What a captured step is specialised to: its padded token rows, sequences and logit
    rows, whether the last layer keeps only the logit rows (`gather`: some token wants no
    logits, as in a prefill chunk), whether attention runs on the tensor-core kernels
    (`mma`: some chunk brings `gpu.PM_MIN_TOKENS` tokens, as the eager step decides), and
    whether some chunk brings more than one token (`prefill`: its sequences and kept rows
    are padded to at least `PREFILL_MIN_SEQS`)."""

    tokens: int
    seqs: int
    rows: int  # 0: no logits wanted (the step only writes KV)
    gather: bool
    mma: bool
    prefill: bool = False

    @classmethod
    def decode(cls, b: int) -> StepShape:
        """The shape of a step of b decode rows that all want logits."""
        return cls(b, b, b, False, False, False)


class AttnBounds(NamedTuple):
    """A shape's attention launch parameters, which follow from the shape and the model
    alone (`StepGraphs.bounds`): the step's kernel (tensor-core or FMA) splits each KV
    head's query heads into `n_gchunks` chunks of `gc` (CTAs of `cta_rows` (token, head)
    rows), and its grid holds at most `max_splits` splits of the context (1 on the
    tensor-core kernels); the kept rows of a shape that gathers run on the FMA kernels
    (`fma_gc`, `fma_chunks`, at most `rmax_splits` splits)."""

    cta_rows: int
    gc: int
    n_gchunks: int
    max_splits: int
    fma_gc: int
    fma_chunks: int
    rmax_splits: int  # 0: the shape does not gather


def model_applies(model: Any) -> bool:
    """Whether the model's steps can be graphs: a GPU model whose layers are all plain
    attention layers and whose forward pass is `DecoderModel`'s (the model says:
    `step_graphs_apply`)."""
    if not model.backend.is_gpu:
        return False
    applies = getattr(model, "step_graphs_apply", None)
    return bool(applies is not None and applies())


class StepInputs:
    """The device buffer of a shape's step inputs and its host staging copy: one uint8
    buffer, typed views at 256-byte aligned offsets (`fields`).

    The staging copy is page-locked host memory, so `send` is an asynchronous copy on the
    step's stream: the host goes on (the next step's scheduling, or a step launched ahead)
    while the device finishes earlier work, where a copy from pageable memory may wait for
    the stream. The device reads the staging bytes only when the copy's turn comes, so the
    host must not write them before then: `wait_sent` (called before every staging) waits for
    the last copy, normally long done."""

    def __init__(self, shape: StepShape, width: int, split: bool, n_launch: int,
                 recurrent: bool = False):
        cp = rt.cupy_module()
        t, s, r = shape.tokens, shape.seqs, shape.rows
        groups = (0, 1) if split else (0,)
        spec = [("tokens", (t,), np.int32), ("positions", (t,), np.int64),
                ("tiles", (t, 4), np.int32), ("splits", (n_launch,), np.int32)]
        if recurrent:  # a hybrid's decode step: each row's recurrent-state slot (-1: padding)
            spec.append(("state_slots", (s,), np.int32))
        if recurrent and shape.prefill:
            # a hybrid's step with a prompt chunk: its rows as sequences for the recurrent
            # layers' sequence kernels (`gpu_hybrid.SeqRows`): row0, count and slot of each
            # of the s sequences and of one more, the padding rows' (slot -1), then each
            # row's sequence (`seq_views`)
            spec.append(("seq", (3 * (s + 1) + t,), np.int32))
        spec += [(f"slots{g}", (t,), np.int64) for g in groups]
        spec += [(f"tables{g}", (s, width), np.int32) for g in groups]
        if shape.gather:
            # the last layer's rows: one-token tiles at each kept row's position
            spec += [("rows", (r,), np.int32), ("rtiles", (r, 4), np.int32),
                     ("rsplits", (n_launch,), np.int32)]
            spec += [(f"rtables{g}", (r, width), np.int32) for g in groups]
        off, lay = 0, []
        for name, shp, dt in spec:
            n = int(np.prod(shp)) * np.dtype(dt).itemsize
            lay.append((name, off, shp, dt, n))
            off += -(-n // 256) * 256
        self.nbytes = off
        self.host = np.frombuffer(cp.cuda.alloc_pinned_memory(off), np.uint8, off)
        self.host.fill(0)
        self.dev = cp.zeros(off, np.uint8)
        self.sent: Any = None  # an event recorded after the last `send`'s copy
        self.h: dict[str, np.ndarray] = {}
        self.d: dict[str, Any] = {}
        for name, o, shp, dt, n in lay:
            self.h[name] = self.host[o : o + n].view(dt).reshape(shp)
            self.d[name] = self.dev[o : o + n].view(dt).reshape(shp)

    def seq_views(self, host: bool = False) -> Any:
        """The `seq` field as a `gpu_hybrid.SeqRows` of the device buffer, or (`host`) its
        four host views `(row0, count, slots, row_seq)` to fill."""
        a = (self.h if host else self.d)["seq"]
        t = self.h["tokens"].shape[0]
        n = (a.shape[0] - t) // 3
        parts = (a[:n], a[n : 2 * n], a[2 * n : 3 * n], a[3 * n :])
        if host:
            return parts
        from kvshare.ops import gpu_hybrid  # noqa: PLC0415

        return gpu_hybrid.SeqRows(*parts, t, n)

    def send(self, stream: Any) -> None:
        """The staging copy to the device, asynchronously on `stream`."""
        self.dev.set(self.host, stream=stream)
        if self.sent is None:
            self.sent = rt.cupy_module().cuda.Event(disable_timing=True)
        self.sent.record(stream)

    def wait_sent(self) -> None:
        """Wait until the last `send`'s copy has read the staging bytes (before writing
        them again)."""
        if self.sent is not None:
            self.sent.synchronize()

    def __del__(self) -> None:
        # the staging memory goes back to CuPy's page-locked pool with this object, and the
        # pool hands it out again: the last send's copy must have read it first (a model
        # dropped after a step launched ahead that nobody waited for). Not while a capture
        # runs (a wait there would break it).
        try:
            if not rt.is_capturing():
                self.wait_sent()
        except Exception:  # noqa: BLE001, S110 - interpreter shutdown, a device gone
            pass


class _Graph:
    __slots__ = ("graph", "logits", "inputs")
    graph: Any  # cupy.cuda.graph.Graph
    logits: Any  # its logits buffer ([rows, vocab]; None for a step that wants none)
    inputs: StepInputs


def _fill_tiles(dst: np.ndarray, real: np.ndarray, n_rows: int, pad_pos: int) -> None:
    """A static tile list: the step's own tiles, then one single-row tile for each padding
    row (n_rows .. len(dst) - 1, sequence 0 at `pad_pos`), then tiles of no rows, which the
    kernels skip (position 0: no key either)."""
    k = len(real)
    dst[:k] = real
    pad = np.arange(n_rows, len(dst), dtype=np.int32)
    dst[k : k + len(pad), 0] = 0
    dst[k : k + len(pad), 1] = pad
    dst[k : k + len(pad), 2] = 1
    dst[k : k + len(pad), 3] = pad_pos
    dst[k + len(pad) :] = 0


class StepGraphs:
    """A model's step graphs (see the module doc). `failures`: shapes whose capture raised
    (they stay eager; the first failure also warns)."""

    def __init__(self, model: Any):
        self.model = model
        self.cp = rt.cupy_module()
        self.stream: Any = None
        self.ws = rt.Workspace()
        self.graphs: dict[StepShape, _Graph] = {}
        self.inputs: dict[StepShape, StepInputs] = {}
        self.failures: dict[StepShape, str] = {}
        self._bounds: dict[StepShape, AttnBounds] = {}
        self.sightings: Counter[StepShape] = Counter()  # eager steps of prefill shapes
        # each shape's workspace bytes, measured by an eager run of it on this cache
        self.peaks: dict[StepShape, int] = {}
        self.replays = 0
        self.captures = 0
        self._cache_key: Any = None
        attn = [L for L in model.layers if L.kind == ATTENTION]
        self.rope_keys = list(dict.fromkeys((L.rope_base, L.rope_scale) for L in attn))
        # a hybrid model (recurrent layers): each row's state slot (decode) or each chunk's
        # rows and slot (a prompt chunk) an input of the step
        self.recurrent = bool(model.config.n_recurrent_layers)
        self.attn_layer = attn[0] if attn else None

    # -- which steps ---------------------------------------------------------------------
    def _width(self, cache: Any) -> int:
        per_seq = -(-int(self.model.config.context_length) // cache.block_size)
        return max(1, min(per_seq, max(cache.n_blocks, cache.n_win_blocks or 0)))

    def step_shape(self, chunks: Sequence[SeqChunk], cache: Any, plan: Any) -> StepShape | None:
        """The shape whose graph runs this step, or None where the step stays eager."""
        from kvshare.ops import gpu  # noqa: PLC0415

        n_tok = len(plan.tokens)
        if n_tok > MAX_TOKENS:
            return None
        if cache.kv_dtype not in (np.dtype(np.float16), np.dtype(np.float32)):
            return None
        prefill = plan.max_seq_rows > 1
        if prefill and not prefill_by_env():
            return None
        width = self._width(cache)
        if any(-(-c.end_pos // cache.block_size) > width for c in chunks):
            return None
        n_rows = len(plan.logit_rows)
        if n_rows > MAX_LOGIT_ROWS:
            return None
        gather = 0 < n_rows < n_tok
        mma = False
        if plan.max_seq_rows >= gpu.PM_MIN_TOKENS and self.attn_layer is not None:
            kc, vc = cache.layer_kv(self.attn_layer.attn_index)
            mma = gpu.mma_fits(kc, vc, self.model.config.head_dim)
        t = bucket_of(n_tok)
        least = PREFILL_MIN_SEQS if prefill else 1
        # one kept row stays one: the mat-vec kernels order a row's sums by how many rows
        # they take (1, 4 or 16), and the eager step takes one
        rows = (1 if n_rows == 1 else max(bucket_of(n_rows), least)) if gather else (
            t if n_rows else 0)
        shape = StepShape(t, max(bucket_of(len(chunks)), least), rows, gather, mma, prefill)
        return None if shape in self.failures else shape

    # -- the step --------------------------------------------------------------------------
    def forward(self, chunks: Sequence[SeqChunk], cache: Any, plan: Any,
                token_feed: Any = None) -> list[Any] | None:
        """The step's logits as `DecoderModel.forward` returns them, or None when this step
        stays eager. `plan`: the step's `base.BatchPlan` (made first: its checks and errors
        are the eager step's). `token_feed`: a device int32 array whose first n values are
        the rows' input tokens, copied on the device into the step's inputs after the host's
        (the chunks' tokens are then placeholders): a decode step launched before the
        previous step's sampled tokens reached the host (`DecoderModel.forward_fed`)."""
        shape = self.step_shape(chunks, cache, plan)
        if shape is None:
            return None
        # a shape with a prefill chunk is captured when it comes again (chunk lengths vary,
        # and a capture costs the host about one more eager step); its first step runs eager
        # on the shape's inputs, which measures its workspace, so that the second captures
        # at once
        sighting = shape.prefill and self.sightings[shape] < PREFILL_SIGHTINGS - 1
        if sighting:
            self.sightings[shape] += 1
        self._check_cache(cache)
        launches = self._launches(cache)
        inp = self._inputs(shape, cache, launches)
        if not self._stage(shape, chunks, cache, plan, inp, launches):
            return None
        n_tok = len(plan.tokens)
        entry = self.graphs.get(shape)
        with self.stream:
            inp.send(self.stream)
            if token_feed is not None:
                # ordered after the sampling that wrote them (a blocking stream waits for
                # the default stream's earlier work)
                inp.d["tokens"][:n_tok] = token_feed[:n_tok]
            if entry is None and sighting:
                logits = self._measured_run(shape, cache, inp, launches)
            elif entry is None:
                logits = self._first_step(shape, cache, inp, launches)
            else:
                entry.graph.launch(stream=self.stream)
                self.replays += 1
                logits = entry.logits
        return self._split_logits(logits, chunks, len(plan.logit_rows))

    def _inputs(self, shape: StepShape, cache: Any, launches: list[tuple[int, int]]
                ) -> StepInputs:
        """The shape's `StepInputs` (made at its first step)."""
        inp = self.inputs.get(shape)
        if inp is None:
            inp = self.inputs[shape] = StepInputs(shape, self._width(cache), cache.split,
                                                  len(launches), self.recurrent)
        return inp

    def _stage(self, shape: StepShape, chunks: Sequence[SeqChunk], cache: Any, plan: Any,
               inp: StepInputs, launches: list[tuple[int, int]]) -> bool:
        """Fill the staging copy of the step's inputs; False where the step's attention
        needs more splits than the shape's grid has (the step then stays eager)."""
        from kvshare.ops import gpu  # noqa: PLC0415

        cfg = self.model.config
        H, K = cfg.n_head, cfg.n_head_kv
        b = self.bounds(shape)
        n_tok, n_seq = len(plan.tokens), len(chunks)
        width = inp.h["tables0"].shape[1]
        n_sm = rt.device_attr("MultiProcessorCount")
        nb_of = {0: cache.n_blocks, 1: cache.n_win_blocks}
        inp.wait_sent()
        h = inp.h
        h["tokens"][:n_tok] = plan.tokens
        h["tokens"][n_tok:] = plan.tokens[0]
        h["positions"][:n_tok] = plan.positions
        h["positions"][n_tok:] = plan.positions[0]
        if self.recurrent:
            h["state_slots"][:n_seq] = [-1 if c.state_slot is None else c.state_slot
                                        for c in chunks]
            h["state_slots"][n_seq:] = -1
        if self.recurrent and shape.prefill:
            _stage_seqs(inp, chunks, plan, n_tok, h["state_slots"][:n_seq])
        real = gpu.pa_tiles(plan.q_starts, plan.start_positions, b.gc, b.cta_rows)
        _fill_tiles(h["tiles"], real, n_tok, int(plan.positions[0]))
        gather = shape.gather
        if gather:
            rows = plan.logit_rows
            n_r = len(rows)
            seq_of_row = np.searchsorted(plan.q_starts, rows, side="right") - 1
            h["rows"][:n_r] = rows
            h["rows"][n_r:] = rows[0]
            rpos = plan.positions[rows]
            rtiles = gpu.pa_tiles(np.arange(n_r + 1), rpos, b.fma_gc)
            # each kept row is a one-token sequence of its own (as `_attention_rows`)
            _fill_tiles(h["rtiles"], rtiles, n_r, int(rpos[0]))
        for g in (0, 1) if cache.split else (0,):
            tables, slots = plan.group(g)
            t = h[f"tables{g}"]
            t.fill(-1)
            t[:n_seq, : tables.shape[1]] = tables[:, :width]
            t[n_seq:] = t[0]
            h[f"slots{g}"][:n_tok] = slots
            h[f"slots{g}"][n_tok:] = -1  # padding rows write no KV
            if gather:
                rt_ = h[f"rtables{g}"]
                rt_[:n_r] = t[seq_of_row]
                rt_[n_r:] = rt_[0]
        for i, (g, window) in enumerate(launches):
            tables, _ = plan.group(g)
            # the eager op's check of the tables against the pool
            gpu._check_tables(tables, plan.q_starts, plan.start_positions,  # noqa: SLF001
                              cache.block_size, nb_of[g], window)
            s = 1
            if not shape.mma:
                s = gpu.pa_splits(real, window, K, b.n_gchunks, n_tok, H, cfg.head_dim, n_sm)
                if s > b.max_splits:
                    return False
            h["splits"][i] = s
            if gather:
                s = gpu.pa_splits(rtiles, window, K, b.fma_chunks, n_r, H, cfg.head_dim, n_sm)
                if s > b.rmax_splits:
                    return False
                h["rsplits"][i] = s
        return True

    def _split_logits(self, logits: Any, chunks: Sequence[SeqChunk], n_rows: int
                      ) -> list[Any]:
        """Each chunk's logits rows (None where it wants none): host copies, or with
        `model.logits_on_device` views of the graph's own logits buffer, which the next
        replay overwrites: the engine samples from them before it runs the next step, so no
        copy is needed."""
        if logits is None:
            return [None] * len(chunks)
        logits = logits[:n_rows]
        if not self.model.logits_on_device:
            logits = rt.host(logits)
        return split_logits(logits, chunks)

    def _launches(self, cache: Any) -> list[tuple[int, int]]:
        """(layer group, window) of each distinct attention launch of a step."""
        return list(dict.fromkeys((cache.group_of(L.attn_index), int(L.window))
                                  for L in self.model.layers if L.kind == ATTENTION))

    def bounds(self, shape: StepShape) -> AttnBounds:
        """The shape's `AttnBounds` (computed once per shape)."""
        b = self._bounds.get(shape)
        if b is None:
            from kvshare.ops import gpu  # noqa: PLC0415

            cfg = self.model.config
            H, K = cfg.n_head, cfg.n_head_kv
            cta_rows = gpu.PM_ROWS if shape.mma else gpu.PA_ROWS
            gc, n_gchunks = gpu.group_chunk(H, K, cta_rows)
            fma_gc, fma_chunks = gpu.group_chunk(H, K)
            # a prefill shape's sequences and kept rows may be fewer than their bucket's
            # floor, down to one (`PREFILL_MIN_SEQS`)
            least = PREFILL_MIN_SEQS if shape.prefill else 1
            ms = 1 if shape.mma else self._max_splits(shape.tokens, shape.seqs, gc,
                                                      n_gchunks, least)
            rms = (self._max_splits(shape.rows, shape.rows, fma_gc, fma_chunks, least)
                   if shape.gather else 0)
            b = self._bounds[shape] = AttnBounds(cta_rows, gc, n_gchunks, ms, fma_gc,
                                                 fma_chunks, rms)
        return b

    def _max_splits(self, tokens: int, seqs: int, gc: int, n_gchunks: int,
                    least: int = 1) -> int:
        """The most splits `pa_splits` gives a step padded to `tokens` rows and `seqs`
        sequences (the FMA kernels; its fewest tiles: the fewest real sequences, or the
        fewest real tokens in tiles of `PA_ROWS // gc`). `least`: the floor the shape pads
        its sequences and rows to (one real one may fill a bucket up to it)."""
        from kvshare.ops import gpu  # noqa: PLC0415

        def floor(b: int) -> int:
            return 1 if b <= least else bucket_floor(b)

        bm = max(1, gpu.PA_ROWS // gc)
        tiles = max(floor(seqs), -(-floor(tokens) // bm))
        ctas = tiles * self.model.config.n_head_kv * n_gchunks
        n_sm = rt.device_attr("MultiProcessorCount")
        return 1 if ctas >= n_sm else min(64, -(-2 * n_sm // ctas))

    def _check_cache(self, cache: Any) -> None:
        # the graphs hold this cache's addresses: another cache object (even one that got the
        # same id and addresses after this one was freed) gets its own
        if self._cache_key is None or self._cache_key() is not cache:
            for inp in self.inputs.values():
                inp.wait_sent()  # (its pinned memory goes back to CuPy's pool)
            self.graphs.clear()
            self.inputs.clear()
            self.peaks.clear()
            self._cache_key = weakref.ref(cache)
        if self.stream is None:
            # a blocking stream: ordered after the eager steps' work on the default stream
            self.stream = self.cp.cuda.Stream(non_blocking=False)

    def _statics(self, shape: StepShape, inp: StepInputs, launches: list[tuple[int, int]],
                 last: bool) -> dict[tuple[int, int], Any]:
        """Each attention launch's `StaticAttention`: the step's rows, or (`last`, a shape
        that gathers) the last layer's kept rows."""
        from kvshare.ops import gpu  # noqa: PLC0415

        b = self.bounds(shape)
        d = inp.d
        out = {}
        for i, gw in enumerate(launches):
            if last:
                out[gw] = gpu.StaticAttention(d[f"rtables{gw[0]}"], d["rtiles"],
                                              d["rsplits"][i : i + 1], b.rmax_splits)
            else:
                out[gw] = gpu.StaticAttention(d[f"tables{gw[0]}"], d["tiles"],
                                              d["splits"][i : i + 1], b.max_splits,
                                              mma=shape.mma)
        return out

    def _run(self, shape: StepShape, cache: Any, inp: StepInputs,
             launches: list[tuple[int, int]]) -> Any:
        """The step's device work on the shape's inputs (what the graph holds); returns the
        logits `[rows, vocab]` (None for a step that wants none).
        `DecoderModel.forward`'s operations, in its order."""
        from kvshare.ops import gpu  # noqa: PLC0415
        from kvshare.ops.embedding import embedding  # noqa: PLC0415
        from kvshare.ops.linear import linear  # noqa: PLC0415
        from kvshare.ops.norm import rms_norm  # noqa: PLC0415

        model, cfg, be = self.model, self.model.config, self.model.backend
        statics = self._statics(shape, inp, launches, last=False)
        rstatics = self._statics(shape, inp, launches, last=True) if shape.gather else {}
        d = inp.d
        self.ws.reset()
        with rt.using(self.ws):
            x = embedding(model.tok_embd, d["tokens"], cfg.embed_scale, backend=be)
            # (the model's tables: gpt-oss's are YaRN-scaled)
            ropes = {key: model._rope_tables(d["positions"], *key)  # noqa: SLF001
                     for key in self.rope_keys}
            mark = self.ws.mark()
            n_layers = len(model.layers)
            attention_step = getattr(model, "gpu_attention_step", None)
            for il, L in enumerate(model.layers):
                last = il == n_layers - 1
                if L.kind != ATTENTION:
                    # a hybrid's recurrent layer: the decode kernels on each row's slot, or
                    # with a prompt chunk the sequence kernels on the step's sequences
                    L.gpu_step(x, inp.seq_views() if shape.prefill else d["state_slots"],
                               cache)
                    if last and shape.gather:  # the kept rows, as the eager step keeps them
                        x = gpu.gather_rows(x, d["rows"])
                elif attention_step is not None:
                    # a hybrid's own attention layer (qwen35's gated one): its step with the
                    # graph's static attention (the last layer of a shape that gathers: on
                    # the kept rows, as the eager step)
                    g = cache.group_of(L.attn_index)
                    kc, vc = cache.layer_kv(L.attn_index)
                    if last and shape.rows == 0:
                        # K/V stored, nothing more read (as the eager step)
                        model._gated_qkv(L, x, *ropes[(L.rope_base, L.rope_scale)],  # noqa: SLF001
                                         d[f"slots{g}"], kc, vc)
                        return None
                    keep = last and shape.gather
                    static = (rstatics if keep else statics)[(g, int(L.window))]
                    x = attention_step(
                        L, x, *ropes[(L.rope_base, L.rope_scale)], d[f"slots{g}"], kc, vc,
                        lambda q, L=L, kc=kc, vc=vc, st=static: gpu.paged_attention(
                            q, kc, vc, None, None, None, scale=cfg.q_scale,
                            window=L.window, static=st, sinks=L.sinks),
                        rows=d["rows"] if keep else None)
                else:
                    cos, sin = ropes[(L.rope_base, L.rope_scale)]
                    kc, vc = cache.layer_kv(L.attn_index)
                    g = cache.group_of(L.attn_index)
                    # the model's own layer code: the eager step's kernels, in its order
                    q = model._project_qkv(L, x, cos, sin, d[f"slots{g}"], kc, vc)  # noqa: SLF001
                    if last and shape.rows == 0:
                        return None  # every layer has stored its K/V: nothing more is read
                    static = statics[(g, int(L.window))]
                    if last and shape.gather:
                        # only the rows whose logits are wanted (`DecoderModel._attention_rows`)
                        q = gpu.gather_rows(q, d["rows"])
                        x = gpu.gather_rows(x, d["rows"])
                        static = rstatics[(g, int(L.window))]
                    attn = gpu.paged_attention(q, kc, vc, None, None, None, scale=cfg.q_scale,
                                               window=L.window, static=static, sinks=L.sinks)
                    model._output_and_mlp(L, x, attn.reshape(attn.shape[0], -1))  # noqa: SLF001
                if last and shape.rows == 0:
                    return None  # (a hybrid's last layer has stored its state: nothing read)
                if not last:
                    self.ws.release(mark)
            hn = rms_norm(x, model.output_norm, cfg.norm_eps, backend=be)
            return linear(hn, model.output, backend=be)

    def _measured_run(self, shape: StepShape, cache: Any, inp: StepInputs,
                      launches: list[tuple[int, int]]) -> Any:
        """Run the shape's step eagerly (ordinary allocations, the workspace's offsets
        counted): its logits, and the shape's workspace need in `peaks` (a larger workspace
        reserved, and the graphs holding the old one's addresses dropped, where it did not
        fit)."""
        ws = self.ws
        buf, ws.buf = ws.buf, None
        try:
            logits = self._run(shape, cache, inp, launches)
        finally:
            ws.buf = buf
        self.peaks[shape] = ws.peak
        if ws.peak > ws.nbytes:
            self.graphs.clear()  # they hold the old buffer's addresses
            ws.reserve(2 * ws.peak)
        return logits

    def _first_step(self, shape: StepShape, cache: Any, inp: StepInputs,
                    launches: list[tuple[int, int]]) -> Any:
        """Capture the shape's step and replay it for this step, where an eager run of the
        shape has measured its workspace and it fits; otherwise run the step eagerly (this
        step's logits), then capture it."""
        need = self.peaks.get(shape)
        at_once = need is not None and need <= self.ws.nbytes
        logits = None if at_once else self._measured_run(shape, cache, inp, launches)
        entry = self._capture(shape, cache, inp, launches, stacklevel=4)
        if entry is None:
            # (captured work does not run: a step captured at once has not run yet)
            return self._measured_run(shape, cache, inp, launches) if at_once else logits
        if at_once:
            entry.graph.launch(stream=self.stream)
            self.replays += 1
            logits = entry.logits
        return logits

    def _capture(self, shape: StepShape, cache: Any, inp: StepInputs,
                 launches: list[tuple[int, int]], stacklevel: int = 3) -> _Graph | None:
        """Capture the shape's step on the runner's stream (nothing runs) and keep it; None
        where the capture raised (the shape then stays eager; the first failure warns)."""
        st = self.stream
        entry = _Graph()
        entry.inputs = inp
        try:
            st.begin_capture()
            try:
                with rt.capturing():
                    entry.logits = self._run(shape, cache, inp, launches)
            finally:
                entry.graph = st.end_capture()
        except Exception as exc:  # noqa: BLE001 - the shape stays eager
            if not self.failures:
                warnings.warn(f"CUDA graph capture of a step of shape {tuple(shape)} failed; "
                              f"such steps stay eager ({type(exc).__name__}: {exc})",
                              RuntimeWarning, stacklevel=stacklevel)
            self.failures[shape] = f"{type(exc).__name__}: {exc}"
            return None
        self.graphs[shape] = entry
        self.captures += 1
        return entry

    # -- before the first request ------------------------------------------------------------
    def warm_up(self, cache: Any, steps: Sequence[tuple[Sequence[SeqChunk], Any]]) -> int:
        """Capture the graphs of these steps' shapes now (a server's start: an agent's turn
        then replays a graph instead of paying the host an eager step and a capture). Each
        shape runs once eagerly to measure its workspace, then all are captured (the
        workspace sized for the largest first, so no capture is dropped by a later one's
        growth). `steps`: each step's chunks and `base.BatchPlan`. The steps write no KV
        (their slots are -1) and their logits are dropped; the blocks their tables name are
        only read. Returns the shapes captured."""
        self._check_cache(cache)
        launches = self._launches(cache)
        todo: list[StepShape] = []
        for chunks, plan in steps:
            shape = self.step_shape(chunks, cache, plan)
            if shape is None or shape in self.graphs or shape in todo:
                continue
            inp = self._inputs(shape, cache, launches)
            if not self._stage(shape, chunks, cache, plan, inp, launches):
                continue
            for g in (0, 1) if cache.split else (0,):
                inp.h[f"slots{g}"][:] = -1  # a warm-up step writes no KV
            if self.recurrent:
                inp.h["state_slots"][:] = -1  # nor recurrent states
            if self.recurrent and shape.prefill:
                inp.seq_views(host=True)[2][:] = -1
            with self.stream:
                inp.send(self.stream)
                self._measured_run(shape, cache, inp, launches)
            todo.append(shape)
        n = 0
        with self.stream:
            for shape in todo:
                if shape not in self.graphs and shape not in self.failures:
                    n += self._capture(shape, cache, self.inputs[shape], launches) is not None
        self.stream.synchronize()
        return n


def _stage_seqs(inp: StepInputs, chunks: Sequence[SeqChunk], plan: Any, n_tok: int,
                state_slots: np.ndarray) -> None:
    """A hybrid prefill shape's sequences (`StepInputs.seq_views`) in the staging copy: each
    chunk's rows and state slot (`state_slots`, as staged for the decode kernels); the
    shape's padding sequences empty (slot -1); the last one holding the padding rows (slot
    -1: zeros out, no state touched)."""
    row0, count, slots, row_seq = inp.seq_views(host=True)
    n_seq, n_pad = len(chunks), len(count) - 1
    lens = [c.n for c in chunks]
    row0[:n_seq] = plan.q_starts[:n_seq]
    count[:n_seq] = lens
    slots[:n_seq] = state_slots
    row0[n_seq:] = n_tok
    count[n_seq:] = 0
    count[n_pad] = len(row_seq) - n_tok
    slots[n_seq:] = -1
    row_seq[:n_tok] = np.repeat(np.arange(n_seq), lens)
    row_seq[n_tok:] = n_pad


def warm_up_steps(cache: Any, parallel: int, prefill_chunk: int) -> list[list[SeqChunk]]:
    """The steps an agent server meets first, one per shape: decode steps of every batch
    bucket up to `parallel`; a prompt's last chunk (its logits wanted), alone and beside
    another session's decode row, of 32 tokens and of every `FINE_FROM` multiple up to
    `prefill_chunk` plus `parallel - 1` decode rows; a long prompt's middle chunk
    (`prefill_chunk` tokens, no logits). Token 0 at positions from 0, every table naming
    block 0 (only read: `StepGraphs.warm_up` writes no KV)."""
    bs = cache.block_size
    win = cache.split

    def chunk(n: int, logits: str) -> SeqChunk:
        table = np.zeros(-(-n // bs), np.int32)
        return SeqChunk(np.zeros(n, np.int32), 0, table, logits,
                        win_block_table=table if win else None)

    steps: list[list[SeqChunk]] = []
    b = 1
    while b <= bucket_of(parallel):
        steps.append([chunk(1, "last") for _ in range(b)])
        b = bucket_of(b + 1)
    top = min(prefill_chunk + max(parallel - 1, 0), MAX_TOKENS)
    sizes = sorted({32, *range(FINE_FROM, top + 1, FINE_FROM), bucket_of(top)})
    for t in sizes:
        if 2 < t <= MAX_TOKENS:
            steps += [[chunk(t, "last")], [chunk(t - 1, "last"), chunk(1, "last")]]
    if 1 < prefill_chunk <= MAX_TOKENS:
        steps.append([chunk(prefill_chunk, "none")])
    return steps


def runner(model: Any) -> StepGraphs | None:
    """The model's `StepGraphs` (built on first use), or None where graphs are off or do
    not apply to the model."""
    on = getattr(model, "cuda_graphs", None)
    if on is None:
        on = enabled_by_env()
    if not on:
        return None
    r = model.__dict__.get("_step_graphs")
    if r is None:
        if not model_applies(model):
            model.__dict__["_step_graphs"] = False
            return None
        r = model.__dict__["_step_graphs"] = StepGraphs(model)
    return r or None
