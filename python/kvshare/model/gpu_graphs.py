"""Decode steps of a dense `DecoderModel` on the GPU as CUDA graphs.

A GPU decode step is a few hundred kernel launches (per layer: norms, the fused Q/K/V
product, q/k norms and rope, the KV write, attention, the output product, the gated MLP,
residual adds), each with its own Python argument marshalling: on a fast GPU the host, not
the device, sets the step time, and a batch of 4 costs what a batch of 1 does. A CUDA graph
replays all of a step's launches with one call.

How (`DecodeGraphs`):
- Batch buckets 1, 2, 4, 8, ... (up to `MAX_BUCKET`): a step of n decode rows runs in the
  graph of the smallest bucket >= n, its rows padded with copies of row 0 that write no KV
  (slot -1) and whose logits are dropped.
- Every input that changes between steps lives in one device buffer (`StepInputs`): token
  ids, positions, KV slots, block tables (`width` entries per row, -1 padded; the window
  group's too in a split cache), the attention tiles and the split count of each attention
  launch. The host fills a staging copy and sends it with one copy before each replay; the
  graph's kernels read the buffer, so block tables and positions are never constants of a
  graph.
- Every array the step's ops create comes from a `gpu_runtime.Workspace` (one buffer shared
  by all buckets: steps run one at a time), the same offsets at every run; a layer's
  intermediates are released once it has added into the residual stream. Nothing is
  allocated, copied to or from the host, or synchronized while a graph is captured, and no
  host code branches on device values (the attention split count, which follows the context
  length, is a device input: `gpu.StaticAttention`).
- A bucket's first step runs the step's code eagerly (it measures the workspace and warms
  NVRTC, cuBLAS and the launch attributes; its logits are that step's), then captures it on
  the runner's stream; later steps of that bucket replay it. Another KV cache object or a
  larger workspace drops the graphs; they are captured again when next used.
- The step calls the model's own `_project_qkv` and `_output_and_mlp` and the same GPU ops
  as `DecoderModel.forward`, in the same order: the logits equal the eager step's, bit for
  bit where the eager step has the same batch (tests/test_model_gpu.py and
  tests/test_engine_gpu.py check it, tests/test_ops_gpu_graph.py the parts).

Where graphs do not apply the step stays eager: prefill and mixed steps (any chunk of more
than one token), steps with a row that wants no logits, more rows than `MAX_BUCKET`, a block
table longer than `width`, models whose layers are not all plain attention layers (MoE
layers route on the host; hybrid recurrent layers; attention sinks), and architectures that
override the layer methods. `KVSHARE_CUDA_GRAPHS=0` (`kvshare serve --no-cuda-graphs`), or
`model.cuda_graphs = False`, turns graphs off.
"""

from __future__ import annotations

import os
import warnings
import weakref
from typing import Any, Sequence

import numpy as np

from kvshare.model.batch import SeqChunk
from kvshare.ops import gpu_runtime as rt

ENV = "KVSHARE_CUDA_GRAPHS"
MAX_BUCKET = 256


def enabled_by_env(environ: Any = None) -> bool:
    """Whether $KVSHARE_CUDA_GRAPHS leaves graphs on (the default)."""
    env = os.environ if environ is None else environ
    return env.get(ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def bucket_of(n: int) -> int:
    """The graph batch size of a step of n decode rows: the smallest power of two >= n."""
    return 1 << max(0, int(n) - 1).bit_length()


def model_applies(model: Any) -> bool:
    """Whether the model's decode steps can be graphs: a GPU model whose layers are all plain
    attention layers and whose forward pass is `DecoderModel`'s (the model says:
    `decode_graphs_apply`)."""
    if not model.backend.is_gpu:
        return False
    applies = getattr(model, "decode_graphs_apply", None)
    return bool(applies is not None and applies())


class StepInputs:
    """The device buffer of a bucket's step inputs and its host staging copy: one uint8
    buffer, typed views at 256-byte aligned offsets (`fields`)."""

    def __init__(self, b: int, width: int, split: bool, n_groups: int, n_launch: int):
        cp = rt.cupy_module()
        spec = [("tokens", (b,), np.int32), ("positions", (b,), np.int64),
                ("slots0", (b,), np.int64), ("tiles", (b, 4), np.int32),
                ("splits", (n_launch,), np.int32), ("tables0", (b, width), np.int32)]
        if split:
            spec += [("slots1", (b,), np.int64), ("tables1", (b, width), np.int32)]
        off, lay = 0, []
        for name, shape, dt in spec:
            n = int(np.prod(shape)) * np.dtype(dt).itemsize
            lay.append((name, off, shape, dt, n))
            off += -(-n // 256) * 256
        self.nbytes = off
        self.host = np.zeros(off, np.uint8)
        self.dev = cp.zeros(off, np.uint8)
        self.h: dict[str, np.ndarray] = {}
        self.d: dict[str, Any] = {}
        for name, o, shape, dt, n in lay:
            self.h[name] = self.host[o : o + n].view(dt).reshape(shape)
            self.d[name] = self.dev[o : o + n].view(dt).reshape(shape)

    def send(self) -> None:
        """The staging copy to the device (on the current stream)."""
        self.dev.set(self.host)


class _Graph:
    __slots__ = ("graph", "logits", "inputs")


class DecodeGraphs:
    """A model's decode-step graphs (see the module doc). `failures`: buckets whose capture
    raised (they stay eager; the first failure also warns)."""

    def __init__(self, model: Any):
        self.model = model
        self.cp = rt.cupy_module()
        self.stream: Any = None
        self.ws = rt.Workspace()
        self.graphs: dict[int, _Graph] = {}
        self.inputs: dict[int, StepInputs] = {}
        self.failures: dict[int, str] = {}
        self.replays = 0
        self.captures = 0
        self._cache_key: Any = None
        self.rope_keys = list(dict.fromkeys((L.rope_base, L.rope_scale) for L in model.layers))
        self.windows = sorted({int(L.window) for L in model.layers})

    # -- which steps ---------------------------------------------------------------------
    def _width(self, cache: Any) -> int:
        per_seq = -(-int(self.model.config.context_length) // cache.block_size)
        return max(1, min(per_seq, max(cache.n_blocks, cache.n_win_blocks or 0)))

    def step_applies(self, chunks: Sequence[SeqChunk], cache: Any) -> bool:
        if len(chunks) > MAX_BUCKET or bucket_of(len(chunks)) in self.failures:
            return False
        if cache.kv_dtype not in (np.dtype(np.float16), np.dtype(np.float32)):
            return False
        width = self._width(cache)
        for c in chunks:
            if c.n != 1 or c.logits == "none":
                return False
            if -(-c.end_pos // cache.block_size) > width:
                return False
        return True

    # -- the step --------------------------------------------------------------------------
    def forward(self, chunks: Sequence[SeqChunk], cache: Any, plan: Any,
                token_feed: Any = None) -> list[np.ndarray] | None:
        """The step's logits as `DecoderModel.forward` returns them, or None when this step
        stays eager. `plan`: the step's `base.BatchPlan` (made first: its checks and errors
        are the eager step's). `token_feed`: a device int32 array whose first n values are
        the rows' input tokens, copied on the device into the step's inputs after the host's
        (the chunks' tokens are then placeholders): a step launched before the previous
        step's sampled tokens reached the host (`DecoderModel.forward_fed`)."""
        from kvshare.ops import gpu  # noqa: PLC0415

        if not self.step_applies(chunks, cache):
            return None
        cfg = self.model.config
        n = len(chunks)
        b = bucket_of(n)
        self._check_cache(cache)
        width = self._width(cache)
        launches = self._launches(cache)
        inp = self.inputs.get(b)
        if inp is None:
            inp = self.inputs[b] = StepInputs(b, width, cache.split, 2, len(launches))
        nb_of = {0: cache.n_blocks, 1: cache.n_win_blocks}
        q_starts = np.arange(n + 1, dtype=np.int64)
        H, K = cfg.n_head, cfg.n_head_kv
        gc, n_gchunks = gpu.group_chunk(H, K)
        n_sm = rt.device_attr("MultiProcessorCount")
        tiles = gpu.pa_tiles(q_starts, plan.start_positions, gc)
        h = inp.h
        h["tokens"][:n] = plan.tokens
        h["tokens"][n:] = plan.tokens[0]
        h["positions"][:n] = plan.positions
        h["positions"][n:] = plan.positions[0]
        h["tiles"][:n] = tiles
        h["tiles"][n:] = tiles[0]
        h["tiles"][:, 0] = h["tiles"][:, 1] = np.arange(b, dtype=np.int32)
        for g in (0, 1) if cache.split else (0,):
            tables, slots = plan.group(g)
            t = h[f"tables{g}"]
            t.fill(-1)
            t[:n, : tables.shape[1]] = tables[:, :width]
            t[n:] = t[0]
            h[f"slots{g}"][:n] = slots
            h[f"slots{g}"][n:] = -1  # padding rows write no KV
        for i, (g, window) in enumerate(launches):
            tables, _ = plan.group(g)
            # the eager op's check of the tables against the pool
            gpu._check_tables(tables, q_starts, plan.start_positions, cache.block_size,  # noqa: SLF001
                              nb_of[g], window)
            s = gpu.pa_splits(tiles, window, K, n_gchunks, n, H, cfg.head_dim, n_sm)
            if s > self._max_splits(b, K, n_gchunks, n_sm):
                return None
            h["splits"][i] = s
        entry = self.graphs.get(b)
        with self.stream:
            inp.send()
            if token_feed is not None:
                # ordered after the sampling that wrote them (a blocking stream waits for
                # the default stream's earlier work)
                inp.d["tokens"][:n] = token_feed[:n]
            if entry is None:
                logits = self._first_step(b, cache, inp, launches)
                return self._split_logits(logits[:n], chunks)
            entry.graph.launch(stream=self.stream)
            self.replays += 1
            return self._split_logits(entry.logits[:n], chunks)

    def _split_logits(self, logits: Any, chunks: Sequence[SeqChunk]) -> list[Any]:
        """Each chunk's `[1, vocab]` logits: host copies, or with `model.logits_on_device`
        views of the graph's own logits buffer, which the next replay overwrites: the engine
        samples from them before it runs the next step, so no copy is needed."""
        if not self.model.logits_on_device:
            logits = rt.host(logits)
        return [logits[i : i + 1] for i in range(len(chunks))]

    def _launches(self, cache: Any) -> list[tuple[int, int]]:
        """(layer group, window) of each distinct attention launch of a step."""
        return list(dict.fromkeys((cache.group_of(L.attn_index), int(L.window))
                                  for L in self.model.layers))

    @staticmethod
    def _max_splits(b: int, n_kv: int, n_gchunks: int, n_sm: int) -> int:
        """The most splits `pa_splits` gives a step of bucket b (its fewest real rows)."""
        r = 1 if b == 1 else b // 2 + 1
        ctas = r * n_kv * n_gchunks
        return 1 if ctas >= n_sm else min(64, -(-2 * n_sm // ctas))

    def _check_cache(self, cache: Any) -> None:
        # the graphs hold this cache's addresses: another cache object (even one that got the
        # same id and addresses after this one was freed) gets its own
        if self._cache_key is None or self._cache_key() is not cache:
            self.graphs.clear()
            self.inputs.clear()
            self._cache_key = weakref.ref(cache)
        if self.stream is None:
            # a blocking stream: ordered after the eager steps' work on the default stream
            self.stream = self.cp.cuda.Stream(non_blocking=False)

    def _statics(self, b: int, cache: Any, inp: StepInputs,
                 launches: list[tuple[int, int]]) -> dict[tuple[int, int], Any]:
        from kvshare.ops import gpu  # noqa: PLC0415

        cfg = self.model.config
        _, n_gchunks = gpu.group_chunk(cfg.n_head, cfg.n_head_kv)
        ms = self._max_splits(b, cfg.n_head_kv, n_gchunks, rt.device_attr("MultiProcessorCount"))
        return {gw: gpu.StaticAttention(inp.d[f"tables{gw[0]}"], inp.d["tiles"],
                                        inp.d["splits"][i : i + 1], ms)
                for i, gw in enumerate(launches)}

    def _run(self, b: int, cache: Any, inp: StepInputs, launches: list[tuple[int, int]]) -> Any:
        """The step's device work on bucket b's inputs (what the graph holds); returns the
        logits `[b, vocab]`. `DecoderModel.forward`'s operations, in its order."""
        from kvshare.ops import gpu  # noqa: PLC0415
        from kvshare.ops.embedding import embedding  # noqa: PLC0415
        from kvshare.ops.linear import linear  # noqa: PLC0415
        from kvshare.ops.norm import rms_norm  # noqa: PLC0415
        from kvshare.ops.rope import rope_cos_sin  # noqa: PLC0415

        model, cfg, be = self.model, self.model.config, self.model.backend
        statics = self._statics(b, cache, inp, launches)
        d = inp.d
        self.ws.reset()
        with rt.using(self.ws):
            x = embedding(model.tok_embd, d["tokens"], cfg.embed_scale, backend=be)
            ropes = {key: rope_cos_sin(d["positions"], cfg.n_rot, key[0], key[1],
                                       model.rope_freq_factors, backend=be)
                     for key in self.rope_keys}
            mark = self.ws.mark()
            for L in model.layers:
                cos, sin = ropes[(L.rope_base, L.rope_scale)]
                kc, vc = cache.layer_kv(L.attn_index)
                g = cache.group_of(L.attn_index)
                # the model's own layer code: the eager step's kernels, in its order
                q = model._project_qkv(L, x, cos, sin, d[f"slots{g}"], kc, vc)  # noqa: SLF001
                attn = gpu.paged_attention(q, kc, vc, None, None, None, scale=cfg.q_scale,
                                           window=L.window, static=statics[(g, int(L.window))])
                model._output_and_mlp(L, x, attn.reshape(attn.shape[0], -1))  # noqa: SLF001
                self.ws.release(mark)
            hn = rms_norm(x, model.output_norm, cfg.norm_eps, backend=be)
            return linear(hn, model.output, backend=be)

    def _first_step(self, b: int, cache: Any, inp: StepInputs,
                    launches: list[tuple[int, int]]) -> Any:
        """Run bucket b's step eagerly (this step's logits), then capture it."""
        ws = self.ws
        buf, ws.buf = ws.buf, None  # measure: ordinary allocations, offsets counted
        try:
            logits = self._run(b, cache, inp, launches)
        finally:
            ws.buf = buf
        if ws.peak > ws.nbytes:
            self.graphs.clear()  # they hold the old buffer's addresses
            ws.reserve(2 * ws.peak)
        st = self.stream
        entry = _Graph()
        entry.inputs = inp
        try:
            st.begin_capture()
            try:
                with rt.capturing():
                    entry.logits = self._run(b, cache, inp, launches)
            finally:
                entry.graph = st.end_capture()
        except Exception as exc:  # noqa: BLE001 - the bucket stays eager, the step is done
            if not self.failures:
                warnings.warn(f"CUDA graph capture of decode batch {b} failed; such steps "
                              f"stay eager ({type(exc).__name__}: {exc})", RuntimeWarning,
                              stacklevel=3)
            self.failures[b] = f"{type(exc).__name__}: {exc}"
            return logits
        self.graphs[b] = entry
        self.captures += 1
        return logits


def runner(model: Any) -> DecodeGraphs | None:
    """The model's `DecodeGraphs` (built on first use), or None where graphs are off or do
    not apply to the model."""
    on = getattr(model, "cuda_graphs", None)
    if on is None:
        on = enabled_by_env()
    if not on:
        return None
    r = model.__dict__.get("_decode_graphs")
    if r is None:
        if not model_applies(model):
            model.__dict__["_decode_graphs"] = False
            return None
        r = model.__dict__["_decode_graphs"] = DecodeGraphs(model)
    return r or None
