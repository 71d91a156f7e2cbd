"""Grouped mixture-of-experts products on the GPU with the experts in their GGUF block formats
(kernels/moe_blocks.cu): the GPU twin of `kvshare.ops.moe.moe_ffn_grouped`.

`GpuStackedExperts` is one matrix of every expert of a layer as the file holds it: each part
(`ffn_gate_exps` and `ffn_up_exps`, or one `ffn_gate_up_exps`; or `ffn_down_exps`) is the
whole stacked tensor's raw blocks on the device, `[n_expert * rows_p, row_bytes]`, copied
unchanged (as `gpu_blocks.GpuBlockWeight` keeps a dense weight), so a layer costs its file size
and nothing is dequantized.

`moe_ffn(h, router, gate_up, down, routing, ...)` runs a layer's experts for a batch:

1. routing on the device (`route_device`, kernel `moe_route_f32`: `ops.moe_routing.route`'s
   arithmetic, one warp a token), nothing copied back, so a step with MoE layers can be a
   CUDA graph; a host router (or `KVSHARE_GPU_MOE_ROUTING=host`) routes on the host: the
   router's logits `[N, n_expert]` are copied back and `route` picks the experts and weights,
   exactly as on the CPU;
2. the (token, slot) pairs sorted by expert and cut into tiles of at most M pairs: on the
   device (`plan_device`, kernel `moe_sort_pairs`; M = 1, 4 or 16, the smallest that holds N
   tokens' pairs of one expert, and `max_tiles` CTAs, the tiles past the last empty), or on
   the host after a host routing (`plan`: M the smallest that holds the busiest expert's
   pairs, uploaded with the routing weights);
3. gate|up and the gated activation in one launch, `gmvglu_<type>_m<M>`, when gate and up
   have one type; otherwise one `gmv_<type>_m<M>` per part into `[pairs, 2 n_ff]` and
   `moe_glu_f32`;
4. the down products, plus the expert's bias, times the pair's routing weight, in one launch
   (`gmv_<type>_m<M>`) into `[pairs, n_embd]`;
5. `moe_combine_f32`: each token's k slots added in slot order -> `[N, n_embd]`.

So a layer is 3 launches (4 with mixed gate/up types) plus the two routing kernels for any
number of active experts,
where the per-expert path (`ops.moe.moe_ffn` on dense device experts) makes ~3 per active
expert plus gathers. Numerics: float32 accumulation in the kernels' order, the activations of
activation.cu (`silu`, `gelu_tanh`) and gpt-oss's `swiglu_oai` in float32.

Types (`EXPERT_TYPES`): those of `gpu_blocks.BLOCK_TYPES` (blocks.cu's decoders) and MXFP4
(gpt-oss's experts: E8M0 scale, E2M1 values; its decoder is in moe_blocks.cu, so MXFP4 has no
per-expert `GpuBlockWeight`). Nothing GPU-related is imported before first use.
"""

from __future__ import annotations

import os
from typing import Any, Sequence

import numpy as np

from kvshare.backend import cupy_module
from kvshare.ops import gpu_runtime as rt
from kvshare.ops.gpu_blocks import BLOCK_TYPES
from kvshare.ops.gpu_runtime import ELEMWISE_THREADS

# GGML type id -> (kernel name suffix, elements per block, bytes per block): blocks.cu's
# decoders, and MXFP4, decoded in moe_blocks.cu only (gpt-oss's experts)
MXFP4 = 39
EXPERT_TYPES: dict[int, tuple[str, int, int]] = {**BLOCK_TYPES, MXFP4: ("mxfp4", 32, 17)}
GM_M = (1, 4, 16)  # pairs per tile of the kernels (gmv_<type>_m<M>, gmvglu_<type>_m<M>)
GM_WARPS = 4  # 128-thread CTAs, the warps splitting each row (moe_blocks.cu GM_WARPS)
# output rows per CTA of (M, NW): moe_blocks.cu's GmRows<M, NW>::R
GM_ROWS_PER_CTA = {(1, 1): 2, (4, 1): 4, (16, 1): 4, (1, 2): 2, (4, 2): 2, (16, 2): 2}
ACTIVATIONS = {"silu": 0, "gelu_tanh": 1, "swiglu_oai": 2}

ENTRY_POINTS: tuple[str, ...] = (
    *(f"{kind}_{tag}_m{m}" for tag, _, _ in EXPERT_TYPES.values()
      for kind in ("gmv", "gmvglu") for m in GM_M),
    "moe_glu_f32", "moe_combine_f32", "moe_route_f32", "moe_sort_pairs")
rt.declare_entry_points("moe_blocks", ENTRY_POINTS)
# the device routing's limits (moe_blocks.cu MOE_MAX_EXPERTS; a lane keeps one slot of k)
MAX_EXPERTS = 512
MAX_K = 32
ROUTE_WARPS = 4  # tokens per CTA of moe_route_f32 (MOE_ROUTE_WARPS)
SORT_THREADS = 256  # moe_sort_pairs' one CTA (MOE_SORT_THREADS)
GATING_CODES = {"softmax": 0, "sigmoid": 1, "softmax_weight": 2}
ROUTING_ENV = "KVSHARE_GPU_MOE_ROUTING"


def _within_limits(routing: Any) -> bool:
    return routing.n_expert <= MAX_EXPERTS and routing.k <= MAX_K


def device_routing(routing: Any) -> bool:
    """Whether a layer with this `Routing` routes on the device: within the kernels' limits
    and not turned off ($KVSHARE_GPU_MOE_ROUTING=host)."""
    if os.environ.get(ROUTING_ENV, "device").strip().lower() == "host":
        return False
    return _within_limits(routing)


def device_router(router: Any) -> bool:
    """Whether `router` is a device weight (`gpu.linear` takes it), not a host f32 array whose
    logits are computed on the host."""
    return rt.is_device(router) or not isinstance(router, np.ndarray)


def supports(qtypes: Sequence[int], k: int) -> bool:
    """Whether stacked experts of these GGML types with rows of `k` values run grouped here."""
    return all(int(q) in EXPERT_TYPES and k > 0 and k % EXPERT_TYPES[int(q)][1] == 0
               for q in qtypes)


def row_bytes(qtype: int, k: int) -> int:
    """Bytes of one row of `k` elements of GGML type `qtype` (ValueError if the kernels lack
    the type or k is not a whole number of blocks)."""
    try:
        _, qk, size = EXPERT_TYPES[int(qtype)]
    except KeyError:
        raise ValueError(f"GGML type {qtype} is not supported by the grouped MoE kernels "
                         f"(have {sorted(EXPERT_TYPES)})") from None
    if k <= 0 or k % qk:
        raise ValueError(f"row length {k} is not a positive multiple of the block size {qk} "
                         f"of GGML type {qtype}")
    return k // qk * size


class GpuStackedExperts:
    """One matrix of every expert on the device in its GGUF blocks: `parts[i]` = `(data
    uint8 [n_expert * rows_i, row_bytes_i], qtype_i, rows_i)`; expert e's matrix is rows
    `[e rows_i, (e + 1) rows_i)` of each part, stacked in part order. `on_gpu` marks it for
    `ops.moe.moe_ffn_grouped`'s dispatch."""

    on_gpu = True

    def __init__(self, parts: Sequence[tuple[Any, int, int]], n_expert: int, k: int):
        if not parts:
            raise ValueError("stacked experts need at least one part")
        self.parts = tuple((d, int(q), int(r)) for d, q, r in parts)
        self.n_expert, self.k = int(n_expert), int(k)
        for d, q, r in self.parts:
            rb = row_bytes(q, self.k)
            if tuple(d.shape) != (self.n_expert * r, rb):
                raise ValueError(f"part of shape {tuple(d.shape)}, expected "
                                 f"{(self.n_expert * r, rb)}")

    @classmethod
    def from_host(cls, raws: Sequence[Any], qtypes: Sequence[int], n_expert: int, k: int,
                  backend: Any = None) -> "GpuStackedExperts":
        """From the stacked tensors' bytes (`raws[i]`: any array whose bytes are the file's
        rows, e.g. `GGUFFile.raw(name)` or a `StackedExperts`' raws), copied to the device."""
        cp = cupy_module()
        parts = []
        for raw, q in zip(raws, qtypes):
            rb = row_bytes(int(q), int(k))
            b = np.ascontiguousarray(raw).view(np.uint8).reshape(-1)
            if b.size == 0 or b.size % (rb * n_expert):
                raise ValueError(f"{b.size} bytes are not {n_expert} experts' rows of {rb} "
                                 f"bytes (GGML type {q}, k={k})")
            b = b.reshape(-1, rb)
            d = backend.asarray(b) if getattr(backend, "is_gpu", False) else cp.asarray(b)
            parts.append((d, int(q), b.shape[0] // n_expert))
        return cls(parts, n_expert, k)

    @classmethod
    def from_stacked(cls, se: Any, backend: Any = None) -> "GpuStackedExperts":
        """From an `ops.moe.StackedExperts` (the CPU's stacked views of the file)."""
        return cls.from_host(se.raws, se.qtypes, se.n_expert, se.k, backend)

    @classmethod
    def from_gguf(cls, gf: Any, names: Sequence[str], n_expert: int, backend: Any = None
                  ) -> "GpuStackedExperts | None":
        """Tensors `names` of a `GGUFFile` (3-D `[n_expert, rows, k]`), or None when the
        kernels do not take them (missing, another shape, row lengths differ, a type without a
        decoder)."""
        raws, qtypes, ks = [], [], set()
        for name in names:
            info = gf.tensors.get(name)
            if info is None or len(info.numpy_shape) != 3 or info.numpy_shape[0] != n_expert:
                return None
            raws.append(gf.raw(name))
            qtypes.append(int(info.qtype))
            ks.add(int(info.numpy_shape[2]))
        if len(ks) != 1:
            return None
        k = ks.pop()
        if not supports(qtypes, k):
            return None
        return cls.from_host(raws, qtypes, n_expert, k, backend)

    @property
    def rows(self) -> int:
        """Rows of one expert's matrix."""
        return sum(r for _, _, r in self.parts)

    @property
    def qtypes(self) -> tuple[int, ...]:
        return tuple(q for _, q, _ in self.parts)

    @property
    def nbytes(self) -> int:
        return sum(int(d.nbytes) for d, _, _ in self.parts)

    def kernel_parts(self) -> set[tuple[str, str]]:
        """The kernel units (`kvshare.kernels.parts`) its layer launches: moe_blocks.cu's part
        of each expert type, and its part of no type (routing, pair sort, GLU, combine)."""
        return {("moe_blocks", EXPERT_TYPES[q][0]) for q in self.qtypes} | {("moe_blocks", "")}

    def __repr__(self) -> str:
        tags = [EXPERT_TYPES[q][0] for q in self.qtypes]
        return (f"GpuStackedExperts(n_expert={self.n_expert}, rows={self.rows}, k={self.k}, "
                f"types={tags})")


def plan(ids: np.ndarray, n_expert: int) -> tuple[np.ndarray, np.ndarray, int]:
    """`(pairs int32 [N k], tiles int32 [n_tiles, 3], M)` for host expert ids `[N, k]`: the
    pair indices sorted by expert (token order kept), and tiles (expert, first position in
    `pairs`, count <= M) covering each active expert's run; M the smallest of `GM_M` that
    holds the busiest expert's pairs (at most the largest)."""
    flat = np.asarray(ids, np.int64).reshape(-1)
    if flat.size and (flat.min() < 0 or flat.max() >= n_expert):
        raise IndexError(f"expert id out of range [0, {n_expert})")
    pairs = np.argsort(flat, kind="stable").astype(np.int32)
    counts = np.bincount(flat, minlength=n_expert)
    starts = np.zeros(n_expert, np.int64)
    np.cumsum(counts[:-1], out=starts[1:])
    busiest = int(counts.max()) if flat.size else 1
    mt = next((v for v in GM_M if v >= busiest), GM_M[-1])
    active = np.nonzero(counts)[0]
    n_t = -(-counts[active] // mt)
    e = np.repeat(active, n_t)
    first = np.repeat(starts[active], n_t)
    j = np.arange(int(n_t.sum())) - np.repeat(np.cumsum(n_t) - n_t, n_t)
    p0 = first + j * mt
    cnt = np.minimum(mt, starts[e] + counts[e] - p0)
    tiles = np.stack([e, p0, cnt], axis=1).astype(np.int32)
    return pairs, tiles, mt


def tile_rows(n: int) -> int:
    """M of a device plan for N tokens: the smallest of `GM_M` that holds one expert's pairs
    of N tokens (a token picks an expert once), at most the largest."""
    return next((v for v in GM_M if v >= n), GM_M[-1])


def max_tiles(n_pairs: int, n_expert: int, mt: int) -> int:
    """The most tiles of at most `mt` pairs the pairs of `n_expert` experts can need: each
    active expert's run is cut alone, so at most ceil(pairs / mt) plus one per active expert
    (and never more than the pairs)."""
    return max(1, min(n_pairs, -(-n_pairs // mt) + min(n_expert, n_pairs)))


def route_device(logits: Any, routing: Any, selection_bias: Any = None) -> tuple[Any, Any]:
    """`ops.moe_routing.route` on the device: `(ids int32 [N, k], weights f32 [N, k])` device
    arrays for device f32 router logits `[N, n_expert]` (`selection_bias`: `[n_expert]`, host
    or device)."""
    if not _within_limits(routing):
        raise ValueError(f"device routing takes at most {MAX_EXPERTS} experts and {MAX_K} per "
                         f"token, not {routing.n_expert} and {routing.k}")
    logits = rt.as_rows(logits)
    n = int(logits.shape[0])
    if tuple(logits.shape) != (n, routing.n_expert):
        raise ValueError(f"router logits must be [N, {routing.n_expert}], got "
                         f"{tuple(logits.shape)}")
    if logits.dtype != np.float32 or not logits.flags.c_contiguous:
        c = rt.empty(logits.shape, np.float32)
        c[...] = logits
        logits = c
    ids = rt.empty((n, routing.k), np.int32)
    w = rt.empty((n, routing.k), np.float32)
    if n == 0:
        return ids, w
    sel = None
    if selection_bias is not None:
        sel = (selection_bias if rt.is_device(selection_bias)
               else rt.upload(selection_bias, np.float32)).reshape(-1)
        if sel.dtype != np.float32 or sel.size != routing.n_expert:
            raise ValueError(f"selection bias must be {routing.n_expert} float32 values")
    rt.kernel("moe_blocks", "moe_route_f32")(
        (-(-n // ROUTE_WARPS), 1, 1), (32 * ROUTE_WARPS, 1, 1),
        (logits, np.int64(n), np.int32(routing.n_expert), np.int32(routing.k),
         np.int32(GATING_CODES[routing.gating]), np.int32(bool(routing.norm)),
         np.float32(routing.scale), sel if sel is not None else logits,
         np.int32(sel is not None), ids, w))
    return ids, w


def plan_device(ids: Any, n_expert: int, mt: int) -> tuple[Any, Any, int]:
    """`plan` on the device for device int32 expert ids `[N, k]`: `(pairs, tiles, n_tiles)`
    with `n_tiles = max_tiles(...)` rows of tiles, the ones past the last of count 0."""
    if n_expert > MAX_EXPERTS:
        raise ValueError(f"the device plan takes at most {MAX_EXPERTS} experts")
    n_pairs = int(ids.size)
    nt = max_tiles(n_pairs, n_expert, mt)
    pairs = rt.empty((max(n_pairs, 1),), np.int32)
    tiles = rt.empty((nt, 3), np.int32)
    rt.kernel("moe_blocks", "moe_sort_pairs")(
        (1, 1, 1), (SORT_THREADS, 1, 1),
        (ids, np.int32(n_pairs), np.int32(n_expert), np.int32(mt), np.int32(nt), pairs, tiles))
    return pairs, tiles, nt


def _aligned_rows(x: Any) -> Any:
    """x (float32 rows, unit column stride) itself when its rows can be read as float4, else
    an aligned contiguous copy."""
    if (x.data.ptr % 16 == 0 and (x.shape[0] <= 1 or x.strides[0] % 16 == 0)
            and (x.shape[1] <= 1 or x.strides[1] == 4)):
        return x
    c = rt.empty(x.shape, np.float32)
    c[...] = x
    return c


def _bias_view(b: Any, expect: tuple[int, int]) -> Any:
    if b is None:
        return None
    d = rt.upload(b, np.float32) if not rt.is_device(b) else cupy_module().ascontiguousarray(
        b, dtype=np.float32)
    if tuple(d.shape) != expect:
        raise ValueError(f"expert biases of shape {tuple(d.shape)}, expected {expect}")
    return d


def _launch(kind: str, tag: str, mt: int, n_rows: int, n_tiles: int, args: tuple) -> None:
    r = GM_ROWS_PER_CTA[(mt, 2 if kind == "gmvglu" else 1)]
    gy = max(1, min(65535, -(-n_rows // r)))
    rt.kernel("moe_blocks", f"{kind}_{tag}_m{mt}")((n_tiles, gy, 1), (32 * GM_WARPS, 1, 1), args)


def experts(h: Any, ids: np.ndarray, weights: np.ndarray, gate_up: GpuStackedExperts,
            down: GpuStackedExperts, activation: str = "silu", *, gate_up_bias: Any = None,
            down_bias: Any = None) -> Any:
    """The experts' weighted output `[N, n_embd]` (float32, on the device) for device rows
    `h [N, n_embd]` routed to `ids [N, k]` with `weights [N, k]`: host arrays (a host plan,
    uploaded), or device int32 / float32 arrays (`route_device`: a device plan)."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"the grouped GPU kernels have no activation {activation!r}")
    act = np.int32(ACTIVATIONS[activation])
    h = _aligned_rows(rt.as_rows(h))
    n, d_in = (int(s) for s in h.shape)
    on_device = rt.is_device(ids)
    ids = ids.reshape(n, -1) if on_device else np.asarray(ids).reshape(n, -1)
    kk = int(ids.shape[1])
    n_expert = gate_up.n_expert
    ff = gate_up.rows // 2
    if gate_up.k != d_in or down.k != ff or down.n_expert != n_expert or gate_up.rows % 2:
        raise ValueError(f"experts gate|up {gate_up} and down {down} do not fit rows of "
                         f"{d_in} values")
    d_out = down.rows
    out = rt.empty((n, d_out), np.float32)
    if n == 0 or d_out == 0:
        return out
    n_pairs = n * kk
    if on_device:
        mt = tile_rows(n)
        pairs, tiles, n_tiles = plan_device(ids, n_expert, mt)
        pw = weights.reshape(-1)
    else:
        pairs_h, tiles_h, mt = plan(ids, n_expert)
        n_tiles = int(tiles_h.shape[0])
        pairs, tiles = rt.upload(pairs_h, np.int32), rt.upload(tiles_h, np.int32)
        pw = rt.upload(np.ascontiguousarray(weights, np.float32).reshape(-1), np.float32)
    gub = _bias_view(gate_up_bias, (n_expert, 2 * ff))
    db = _bias_view(down_bias, (n_expert, d_out))
    i32, i64 = np.int32, np.int64
    a = rt.empty((n_pairs, ff), np.float32)
    gp = gate_up.parts
    if len(gp) == 1 or (len(gp) == 2 and gp[0][1] == gp[1][1] and gp[0][2] == gp[1][2] == ff):
        # one type: gate rows and up rows from one part (fused tensor: rows [0, ff) and
        # [ff, 2 ff) of each expert's 2 ff) or from the two parts at the same rows
        w0, q, r0 = gp[0]
        w1, off1 = (w0, ff) if len(gp) == 1 else (gp[1][0], 0)
        b0 = gub[:, :ff] if gub is not None else a
        b1 = gub[:, ff:] if gub is not None else a
        _launch("gmvglu", EXPERT_TYPES[q][0], mt, ff, n_tiles, (
            w0, w1, i64(row_bytes(q, d_in)), i64(r0), i64(0), i64(off1), i32(ff), i32(d_in),
            h, i64(rt.estrides(h)[0]), i32(kk), pairs, tiles, a, i64(ff), i64(0),
            b0, b1, i64(2 * ff), i32(gub is not None), a, i32(0), act))
    else:
        gu = rt.empty((n_pairs, 2 * ff), np.float32)
        col = 0
        for w, q, r in gp:
            b = gub[:, col:] if gub is not None else gu
            # each part is its own matrix of r rows per expert, written at columns col..
            _launch("gmv", EXPERT_TYPES[q][0], mt, r, n_tiles, (
                w, w, i64(row_bytes(q, d_in)), i64(r), i64(0), i64(0), i32(r), i32(d_in),
                h, i64(rt.estrides(h)[0]), i32(kk), pairs, tiles, gu, i64(2 * ff), i64(col),
                b, b, i64(2 * ff), i32(gub is not None), gu, i32(0), act))
            col += r
        rt.kernel("moe_blocks", "moe_glu_f32")(
            rt.grid(n_pairs * ff), (ELEMWISE_THREADS, 1, 1),
            (gu, a, i64(n_pairs), i64(ff), act))
    y = rt.empty((n_pairs, d_out), np.float32)
    col = 0
    for w, q, r in down.parts:
        b = db[:, col:] if db is not None else y
        _launch("gmv", EXPERT_TYPES[q][0], mt, r, n_tiles, (
            w, w, i64(row_bytes(q, ff)), i64(r), i64(0), i64(0), i32(r), i32(ff),
            a, i64(ff), i32(1), pairs, tiles, y, i64(d_out), i64(col),
            b, b, i64(d_out), i32(db is not None), pw, i32(1), act))
        col += r
    rt.kernel("moe_blocks", "moe_combine_f32")(
        rt.grid(n * d_out), (ELEMWISE_THREADS, 1, 1), (y, out, i64(n), i32(kk), i64(d_out)))
    return out


def moe_ffn(h: Any, router: Any, gate_up: GpuStackedExperts, down: GpuStackedExperts,
            routing: Any, activation: str = "silu", *, router_bias: Any = None,
            selection_bias: Any = None, gate_up_bias: Any = None, down_bias: Any = None) -> Any:
    """`ops.moe.moe_ffn_grouped` on the GPU (see the module doc): `h` `[N, n_embd]` rows (on
    the device or the host), `router` a device weight `gpu.linear` takes, or a host f32
    `[n_expert, n_embd]` array (then the logits are computed on the host); the biases as
    `moe_ffn`'s (host or device). Returns a float32 device array `[N, n_embd]`."""
    from kvshare.ops import gpu  # noqa: PLC0415
    from kvshare.ops.moe_routing import route  # noqa: PLC0415

    h = rt.as_rows(h)
    on_device = device_router(router)
    if on_device and device_routing(routing):
        ids, w = route_device(gpu.linear(h, router, router_bias), routing, selection_bias)
        return experts(h, ids, w, gate_up, down, activation, gate_up_bias=gate_up_bias,
                       down_bias=down_bias)
    if on_device:
        logits = rt.host(gpu.linear(h, router, router_bias), np.float32)
    else:
        logits = np.asarray(rt.host(h, np.float32) @ router.T, np.float32)
        if router_bias is not None:
            logits = logits + rt.host(router_bias, np.float32)
    sb = None if selection_bias is None else rt.host(selection_bias, np.float32)
    ids, w = route(logits, routing, selection_bias=sb)
    return experts(h, ids, w, gate_up, down, activation, gate_up_bias=gate_up_bias,
                   down_bias=down_bias)
