"""CuPy twins of the hybrid-model ops (`kvshare.ops.gated_delta`, `kvshare.ops.short_conv`),
re-exported by `kvshare.ops.gpu` so that `gpu_op(name)` finds them.

They run the very same array code as the NumPy ops (`chunked_impl`, `step_impl` of
`gated_delta_xp`, `conv_impl`, `conv_step_impl` of `short_conv_xp`, written against an array
module) with CuPy as the module: cuBLAS batched GEMMs for the chunkwise delta rule (the
triangular systems of every chunk and head in one batch of forward-substitution steps; one
small loop over chunks for the state), CuPy element-wise kernels elsewhere. Same signatures as the NumPy ops less `backend`, same
contracts (states updated in place). Nothing GPU-related is imported before first use.

`gated_delta_step_slots` is the decode step as one kernel (kernels/gated_delta.cu) on the
cache's state array itself: each row's state is read and updated in place at its slot, so the
decode rows need no gather / scatter of their states (and a padding row, slot < 0, touches
nothing: the step can be a CUDA graph's). `step_impl`'s arithmetic in float32, the sums in a
fixed order. `causal_conv1d_step_slots` is the conv's decode step likewise
(kernels/short_conv.cu), `conv_step_impl`'s arithmetic in its order: the same bits.

`gated_delta_seq_slots` and `causal_conv1d_seq_slots` take a step with prompt chunks the same
way: every chunk of the step (`SeqRows`: each sequence's rows and slot, a decode row a
sequence of one) in one launch, on the cache's states in place. The models' GPU steps run
these, not the array-code twins above, whose chunkwise form costs a few hundred CuPy
operations a layer and chunk.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import numpy as np

from kvshare.backend import cupy_module
from kvshare.ops import gpu_runtime as rt
from kvshare.ops.gated_delta_xp import CHUNK, chunked_impl, step_impl
from kvshare.ops.short_conv_xp import conv_impl, conv_step_impl

__all__ = ["SeqRows", "causal_conv1d", "causal_conv1d_seq_slots", "causal_conv1d_step",
           "causal_conv1d_step_slots", "gated_delta_chunked", "gated_delta_seq_slots",
           "gated_delta_step", "gated_delta_step_slots", "seq_rows"]


def _f32(cp: Any, a: Any) -> Any:
    return a if (isinstance(a, cp.ndarray) and a.dtype == cp.float32) else cp.asarray(
        a, dtype=cp.float32)


def causal_conv1d(x: Any, weight: Any, state: Any, *, out: Any | None = None) -> Any:
    cp = cupy_module()
    return conv_impl(cp, _f32(cp, x), _f32(cp, weight), state, out=out)


def causal_conv1d_step(x: Any, weight: Any, states: Any) -> Any:
    cp = cupy_module()
    return conv_step_impl(cp, _f32(cp, x), _f32(cp, weight), states)


def gated_delta_chunked(q: Any, k: Any, v: Any, g: Any, beta: Any, state: Any, *, scale: float,
                        chunk_size: int = CHUNK) -> Any:
    cp = cupy_module()
    return chunked_impl(cp, *(_f32(cp, a) for a in (q, k, v, g, beta)), state, scale=scale,
                        chunk_size=chunk_size)


def gated_delta_step(q: Any, k: Any, v: Any, g: Any, beta: Any, states: Any, *,
                     scale: float) -> Any:
    cp = cupy_module()
    return step_impl(cp, *(_f32(cp, a) for a in (q, k, v, g, beta)), states, scale=scale)


# --- the decode step as one kernel, on the cache's states by slot (kernels/gated_delta.cu) ----

GD_ENTRY_POINTS: tuple[str, ...] = ("gated_delta_step_f32", "gated_delta_seq_f32")
rt.declare_entry_points("gated_delta", GD_ENTRY_POINTS)
GD_WARPS = 4  # warps of a CTA, splitting Dk (gated_delta.cu GD_WARPS)
GD_COLS = 32  # Dv columns of a CTA, a lane each (GD_COLS)
GD_TILE = 16  # the most tokens of a sequence kernel's shared-memory tile (GD_TILE)
GD_QK_TILE = 2048  # the tile's q (and k) values: tile * Dk at most (GD_QK_TILE)


class SeqRows(NamedTuple):
    """A step's rows as sequences, for the sequence kernels (`gated_delta_seq_slots`,
    `causal_conv1d_seq_slots`): sequence s is rows `row0[s] .. row0[s] + count[s] - 1`, its
    recurrent states at `slots[s]` (< 0: a padding sequence: zeros out, no state touched);
    `row_seq[r]` is row r's sequence. int32 device arrays (views of one upload)."""

    row0: Any
    count: Any
    slots: Any
    row_seq: Any
    n_rows: int
    n_seq: int


def seq_rows(spans: Sequence[tuple[int, int, int]], n_rows: int, n_slots: int) -> SeqRows:
    """`SeqRows` of a step of `n_rows` rows from its host spans `(row0, row1, slot)` (a decode
    row is `(r, r + 1, slot)`), checked: every row in exactly one span, slots below `n_slots`
    and distinct where >= 0. One upload (`rt.upload`: cached by content, so every layer of a
    forward call reuses it)."""
    n_seq = len(spans)
    h = np.full(3 * n_seq + int(n_rows), -1, np.int64)
    owner = h[3 * n_seq :]
    for s, (r0, r1, slot) in enumerate(spans):
        r0, r1, slot = int(r0), int(r1), max(-1, int(slot))  # (any negative slot: padding)
        if not 0 <= r0 <= r1 <= n_rows:
            raise ValueError(f"sequence {s}'s rows [{r0}, {r1}) are outside [0, {n_rows})")
        if (owner[r0:r1] >= 0).any():
            raise ValueError(f"sequence {s}'s rows [{r0}, {r1}) overlap another's")
        if slot >= n_slots:
            raise IndexError(f"state slot {slot} out of range [0, {n_slots})")
        owner[r0:r1] = s
        h[s], h[n_seq + s], h[2 * n_seq + s] = r0, r1 - r0, slot
    if (owner < 0).any():
        raise ValueError(f"row {int(np.argmax(owner < 0))} is in no sequence")
    live = h[2 * n_seq : 3 * n_seq]
    live = live[live >= 0]
    if np.unique(live).size != live.size:
        raise ValueError(f"state slots of one step must be distinct, got "
                         f"{h[2 * n_seq : 3 * n_seq].tolist()}")
    d = rt.upload(h, np.int32)
    return SeqRows(d[:n_seq], d[n_seq : 2 * n_seq], d[2 * n_seq : 3 * n_seq],
                   d[3 * n_seq :], int(n_rows), n_seq)


def _rows_f32(cp: Any, a: Any, ndim: int, what: str, unit_last: bool = True) -> Any:
    """`a` as a float32 device array of `ndim` dims, with unit last stride when `unit_last`
    (a copy only when needed)."""
    if not (isinstance(a, cp.ndarray) and a.dtype == cp.float32 and a.ndim == ndim
            and (not unit_last or a.shape[-1] <= 1 or a.strides[-1] == 4)):
        a = cp.ascontiguousarray(cp.asarray(a), dtype=cp.float32)
    if a.ndim != ndim:
        raise ValueError(f"{what} must have {ndim} dimensions, got shape {tuple(a.shape)}")
    return a


def _device_slots(cp: Any, slots: Any, n_slots: int) -> Any:
    """int32 device slots from a device array (used as is: not checked) or a host sequence
    (checked: below n_slots, the non-negative ones distinct; uploaded through `rt.upload`'s
    cache)."""
    if isinstance(slots, cp.ndarray):
        return cp.ascontiguousarray(slots.reshape(-1), dtype=cp.int32)
    h = np.asarray(slots, np.int64).reshape(-1)
    live = h[h >= 0]
    if live.size and int(live.max()) >= n_slots:
        raise IndexError(f"state slot {int(live.max())} out of range [0, {n_slots})")
    if np.unique(live).size != live.size:
        raise ValueError(f"state slots of one step must be distinct, got {h.tolist()}")
    return rt.upload(h, np.int32)


def _gdn_out(cp: Any, out: Any, shape: tuple[int, ...], what: str) -> Any:
    """`out` checked (float32 device array of `shape`, unit last stride), or a new
    `rt.empty`."""
    if out is None:
        return rt.empty(shape, np.float32)
    if not (isinstance(out, cp.ndarray) and out.dtype == cp.float32
            and tuple(out.shape) == shape and (shape[-1] <= 1 or out.strides[-1] == 4)):
        raise ValueError(f"{what} must be a float32 device array {shape} with unit last stride")
    return out


def _slots_and_out(cp: Any, states_all: Any, rec_index: int, slots: Any, out: Any,
                   shape: tuple[int, ...]) -> tuple[Any, Any]:
    """A decode op's checked layer index, its device slots (one per row: `shape[0]`) and
    its output: `out` checked (float32, `shape`, unit last stride), or a new `rt.empty`."""
    _check_rec_index(states_all, rec_index)
    d_slots = _device_slots(cp, slots, int(states_all.shape[0]))
    if int(d_slots.size) != shape[0]:
        raise ValueError(f"{int(d_slots.size)} slots for {shape[0]} rows")
    return d_slots, _gdn_out(cp, out, shape, "out")


def _rows_and_out(cp: Any, states_all: Any, rec_index: int, rows: SeqRows, out: Any,
                  shape: tuple[int, ...]) -> Any:
    """A sequence op's checks (its layer index; `rows` of its `shape[0]` rows) and its
    output: `out` checked (float32, `shape`, unit last stride), or a new `rt.empty`."""
    _check_rec_index(states_all, rec_index)
    if rows.n_rows != shape[0]:
        raise ValueError(f"{rows.n_rows} rows of sequences for {shape[0]} rows")
    return _gdn_out(cp, out, shape, "out")


def _check_rec_index(states_all: Any, rec_index: int) -> None:
    n_rec = int(states_all.shape[1])
    if not 0 <= int(rec_index) < n_rec:
        raise IndexError(f"recurrent layer {rec_index} out of range [0, {n_rec})")


def _gd_inputs(cp: Any, q: Any, k: Any, v: Any, g: Any, beta: Any, st: Any
               ) -> tuple[Any, Any, Any, Any, Any]:
    """The delta-rule kernels' inputs checked (and made float32 device arrays with unit last
    stride where they are not): q, k `[B, H_k, Dk]`, v `[B, H_v, Dv]`, g, beta `[B, H_v]`, the
    state array `[n_slots, n_rec, H_v, Dk, Dv]`."""
    q = _rows_f32(cp, q, 3, "q")
    k = _rows_f32(cp, k, 3, "k")
    v = _rows_f32(cp, v, 3, "v")
    g = _rows_f32(cp, g, 2, "g", unit_last=False)
    beta = _rows_f32(cp, beta, 2, "beta", unit_last=False)
    B, Hk, Dk = (int(s) for s in q.shape)
    H, Dv = int(v.shape[1]), int(v.shape[2])
    if tuple(k.shape) != (B, Hk, Dk) or int(v.shape[0]) != B:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: "
                         "expected q, k [B, H_k, Dk] and v [B, H_v, Dv]")
    if tuple(g.shape) != (B, H) or tuple(beta.shape) != (B, H):
        raise ValueError(f"g {tuple(g.shape)} and beta {tuple(beta.shape)} must be {(B, H)}")
    if Hk == 0 or H % Hk:
        raise ValueError(f"{H} value heads are not a multiple of {Hk} key heads")
    if not (isinstance(st, cp.ndarray) and st.dtype == cp.float32 and st.ndim == 5
            and tuple(st.shape[2:]) == (H, Dk, Dv) and (Dv <= 1 or st.strides[-1] == 4)):
        raise ValueError(f"states must be a float32 device array [n_slots, n_rec, {H}, {Dk}, "
                         f"{Dv}] with unit last stride, got "
                         f"{getattr(st, 'dtype', type(st))} {tuple(getattr(st, 'shape', ()))}")
    return q, k, v, g, beta


def gated_delta_step_slots(q: Any, k: Any, v: Any, g: Any, beta: Any, states_all: Any,
                           slots: Any, rec_index: int, *, scale: float,
                           out: Any | None = None) -> Any:
    """`gated_delta_step` for B rows whose states stay in the cache: row b's state is
    `states_all[slots[b], rec_index]` (`states_all`: the cache's float32 array of this state
    kind, `[n_slots, n_rec, H_v, Dk, Dv]`, `KVArrays.states[SSM]`), read and updated in place
    by one launch (kernels/gated_delta.cu), no gather or scatter. q, k `[B, H_k, Dk]`, v
    `[B, H_v, Dv]`, g, beta `[B, H_v]` (views with any row and head strides are read as they
    are). `slots`: a host sequence (checked) or an int32 device array (not checked: what a
    CUDA graph passes); a slot < 0 is a padding row: its output is zeros, no state is
    touched. The slots must be distinct. Returns o `[B, H_v, Dv]` (`rt.empty`), or writes it
    into `out` (float32, that shape, unit last stride) and returns `out`."""
    cp = cupy_module()
    q, k, v, g, beta = _gd_inputs(cp, q, k, v, g, beta, states_all)
    B, Hk, Dk = (int(s) for s in q.shape)
    H, Dv = int(v.shape[1]), int(v.shape[2])
    st = states_all
    d_slots, out = _slots_and_out(cp, st, rec_index, slots, out, (B, H, Dv))
    if B == 0 or H == 0 or Dv == 0:
        return out
    ss = rt.estrides(st)
    layer = st[:, int(rec_index)]  # a view: the kernel's base pointer is layer rec_index's
    qs, ks, vs, gs, bs, os_ = (rt.estrides(a) for a in (q, k, v, g, beta, out))
    rt.kernel("gated_delta", "gated_delta_step_f32")(
        (B * H, -(-Dv // GD_COLS), 1), (32 * GD_WARPS, 1, 1),
        (q, np.int64(qs[0]), np.int64(qs[1]), k, np.int64(ks[0]), np.int64(ks[1]),
         v, np.int64(vs[0]), np.int64(vs[1]), g, np.int64(gs[0]), np.int64(gs[1]),
         beta, np.int64(bs[0]), np.int64(bs[1]),
         layer, np.int64(ss[0]), np.int64(ss[2]), np.int64(ss[3]),
         d_slots, np.int32(H), np.int32(Hk), np.int32(Dk), np.int32(Dv), np.float32(scale),
         out, np.int64(os_[0]), np.int64(os_[1])))
    return out


def gated_delta_seq_slots(q: Any, k: Any, v: Any, g: Any, beta: Any, states_all: Any,
                          rows: SeqRows, rec_index: int, *, scale: float,
                          out: Any | None = None) -> Any:
    """The gated delta rule over a step's sequences of rows (`rows`: `seq_rows`), one launch
    (kernels/gated_delta.cu `gated_delta_seq_f32`): sequence s's rows run in order on the
    state `states_all[rows.slots[s], rec_index]`, read once and updated in place; a
    sequential scan (llama.cpp's design), where `gated_delta_chunked` runs a few hundred
    array operations a chunk of 64 tokens. Each token's arithmetic is
    `gated_delta_step_slots`'s: a sequence's outputs and final state are those of its rows
    sent as decode steps one at a time. Inputs as `gated_delta_step_slots`' with B the step's
    rows; a row of a padding sequence (slot < 0) gets zeros. Returns o
    `[B, H_v, Dv]` (`rt.empty`), or writes it into `out`."""
    cp = cupy_module()
    q, k, v, g, beta = _gd_inputs(cp, q, k, v, g, beta, states_all)
    B, Hk, Dk = (int(s) for s in q.shape)
    H, Dv = int(v.shape[1]), int(v.shape[2])
    st = states_all
    if Dk > GD_QK_TILE:
        raise NotImplementedError(f"key heads of {Dk} > {GD_QK_TILE} values")
    out = _rows_and_out(cp, st, rec_index, rows, out, (B, H, Dv))
    if B == 0 or H == 0 or Dv == 0:
        return out
    tile = max(1, min(GD_TILE, GD_QK_TILE // max(1, Dk)))
    ss = rt.estrides(st)
    layer = st[:, int(rec_index)]  # a view: the kernel's base pointer is layer rec_index's
    qs, ks, vs, gs, bs, os_ = (rt.estrides(a) for a in (q, k, v, g, beta, out))
    rt.kernel("gated_delta", "gated_delta_seq_f32")(
        (rows.n_seq * H, -(-Dv // GD_COLS), 1), (32 * GD_WARPS, 1, 1),
        (q, np.int64(qs[0]), np.int64(qs[1]), k, np.int64(ks[0]), np.int64(ks[1]),
         v, np.int64(vs[0]), np.int64(vs[1]), g, np.int64(gs[0]), np.int64(gs[1]),
         beta, np.int64(bs[0]), np.int64(bs[1]),
         layer, np.int64(ss[0]), np.int64(ss[2]), np.int64(ss[3]),
         rows.row0, rows.count, rows.slots, np.int32(H), np.int32(Hk), np.int32(Dk),
         np.int32(Dv), np.float32(scale), np.int32(tile), out, np.int64(os_[0]),
         np.int64(os_[1])))
    return out


# --- the conv's decode step as one kernel, on the cache's states by slot (kernels/short_conv.cu)

SC_ENTRY_POINTS: tuple[str, ...] = ("causal_conv1d_step_f32", "causal_conv1d_seq_f32",
                                     "causal_conv1d_seq_state_f32")
rt.declare_entry_points("short_conv", SC_ENTRY_POINTS)


def _conv_inputs(cp: Any, x: Any, weight: Any, st: Any) -> tuple[Any, Any, Any]:
    """The conv kernels' inputs checked (x and weight made float32 device arrays where they
    are not): x `[B, C]` (any row stride), weight `[C, K]` (K >= 2), the state array
    `[n_slots, n_rec, K-1, C]` (float32 on the device, unit last stride)."""
    x = _rows_f32(cp, x, 2, "x")
    weight = _rows_f32(cp, weight, 2, "weight", unit_last=False)
    C = int(x.shape[1])
    K = int(weight.shape[1])
    if int(weight.shape[0]) != C or K < 2:
        raise ValueError(f"weight {tuple(weight.shape)}: expected [{C}, K] with K >= 2")
    if not (isinstance(st, cp.ndarray) and st.dtype == cp.float32 and st.ndim == 4
            and tuple(st.shape[2:]) == (K - 1, C) and (C <= 1 or st.strides[-1] == 4)):
        raise ValueError(f"states must be a float32 device array [n_slots, n_rec, {K - 1}, "
                         f"{C}] with unit last stride, got "
                         f"{getattr(st, 'dtype', type(st))} {tuple(getattr(st, 'shape', ()))}")
    return x, weight, st


def causal_conv1d_step_slots(x: Any, weight: Any, states_all: Any, slots: Any, rec_index: int,
                             *, out: Any | None = None) -> Any:
    """`causal_conv1d_step` for B rows whose conv states stay in the cache: row b's state is
    `states_all[slots[b], rec_index]` (`states_all`: the cache's float32 array of this state
    kind, `[n_slots, n_rec, K-1, C]`, `KVArrays.states[CONV]`), read, shifted and updated in
    place by one launch (kernels/short_conv.cu), no gather or scatter; `conv_step_impl`'s
    arithmetic in its order, so the same bits. x `[B, C]` (a view with any row stride is read
    as it is), weight `[C, K]` (K >= 2). `slots`: a host sequence (checked) or an int32 device
    array (not checked: what a CUDA graph passes); a slot < 0 is a padding row: its output is
    zeros, no state is touched. The slots must be distinct. Returns `[B, C]` (`rt.empty`), or
    writes it into `out` (float32, that shape, unit last stride) and returns `out`."""
    cp = cupy_module()
    x, weight, st = _conv_inputs(cp, x, weight, states_all)
    B, C = (int(s) for s in x.shape)
    K = int(weight.shape[1])
    d_slots, out = _slots_and_out(cp, st, rec_index, slots, out, (B, C))
    if B == 0 or C == 0:
        return out
    ss = rt.estrides(st)
    layer = st[:, int(rec_index)]  # a view: the kernel's base pointer is layer rec_index's
    xs, ws, os_ = (rt.estrides(a) for a in (x, weight, out))
    rt.kernel("short_conv", "causal_conv1d_step_f32")(
        rt.grid(B * C), (rt.ELEMWISE_THREADS, 1, 1),
        (x, np.int64(xs[0]), weight, np.int64(ws[0]), np.int64(ws[1]),
         layer, np.int64(ss[0]), np.int64(ss[2]), d_slots, np.int32(B), np.int32(C),
         np.int32(K), out, np.int64(os_[0])))
    return out


def causal_conv1d_seq_slots(x: Any, weight: Any, states_all: Any, rows: SeqRows,
                            rec_index: int, *, out: Any | None = None) -> Any:
    """`causal_conv1d` over a step's sequences of rows (`rows`: `seq_rows`): sequence s's
    rows follow the K-1 inputs its conv state `states_all[rows.slots[s], rec_index]` holds,
    which become its last K-1 inputs, in place. Two launches (kernels/short_conv.cu: the
    outputs, then the states), `conv_impl`'s arithmetic in its order: the outputs and states
    of NumPy's op on each sequence, bit for bit. x `[B, C]` (any row stride), weight `[C, K]`
    (K >= 2), `states_all` `[n_slots, n_rec, K-1, C]`; a row of a padding sequence (slot < 0)
    gets zeros. Returns `[B, C]` (`rt.empty`), or writes it into `out`, which must not
    overlap x (a row's output would overwrite a later row's input)."""
    cp = cupy_module()
    x, weight, st = _conv_inputs(cp, x, weight, states_all)
    B, C = (int(s) for s in x.shape)
    K = int(weight.shape[1])
    out = _rows_and_out(cp, st, rec_index, rows, out, (B, C))
    if out is x:
        raise ValueError("out must not be x: the sequence kernels read earlier rows' inputs")
    if B == 0 or C == 0:
        return out
    ss = rt.estrides(st)
    layer = st[:, int(rec_index)]  # a view: the kernels' base pointer is layer rec_index's
    xs, ws = rt.estrides(x), rt.estrides(weight)
    rt.kernel("short_conv", "causal_conv1d_seq_f32")(
        rt.grid(B * C), (rt.ELEMWISE_THREADS, 1, 1),
        (x, np.int64(xs[0]), weight, np.int64(ws[0]), np.int64(ws[1]),
         layer, np.int64(ss[0]), np.int64(ss[2]), rows.row0, rows.slots, rows.row_seq,
         np.int32(B), np.int32(C), np.int32(K), out, np.int64(rt.estrides(out)[0])))
    if rows.n_seq:
        rt.kernel("short_conv", "causal_conv1d_seq_state_f32")(
            rt.grid(rows.n_seq * C), (rt.ELEMWISE_THREADS, 1, 1),
            (x, np.int64(xs[0]), layer, np.int64(ss[0]), np.int64(ss[2]), rows.row0,
             rows.count, rows.slots, np.int32(rows.n_seq), np.int32(C), np.int32(K)))
    return out


# --- the element-wise parts of qwen35's delta-net decode step (kernels/gdn_decode.cu) ----------

GDN_ENTRY_POINTS: tuple[str, ...] = ("gdn_gates_f32", "silu_l2norm_qk_f32", "mul_silu_f32")
rt.declare_entry_points("gdn_decode", GDN_ENTRY_POINTS)
GDN_NORM_WARPS = 4  # warps of a norm CTA, one (row, head) each (gdn_decode.cu NORM_WARPS)


def _device_rows(cp: Any, a: Any, what: str) -> Any:
    """`a`: a float32 device array of 2 dims with unit last stride (used in place: not
    copied)."""
    if not (isinstance(a, cp.ndarray) and a.dtype == cp.float32 and a.ndim == 2
            and (a.shape[-1] <= 1 or a.size == 0 or a.strides[-1] == 4)):
        raise ValueError(f"{what} must be a float32 device array [n, d] with unit last "
                         f"stride, got {getattr(a, 'dtype', type(a))} "
                         f"{tuple(getattr(a, 'shape', ()))}")
    return a


def gdn_gates(proj_b: Any, proj_a: Any, dt_bias: Any, ssm_a: Any, *, beta_out: Any | None = None,
              g_out: Any | None = None) -> tuple[Any, Any]:
    """qwen35's delta-net gates of n rows and H value heads in one launch
    (kernels/gdn_decode.cu): `beta = sigmoid(b)`, `g = softplus(a + dt_bias) * ssm_a`
    (`kvshare.model.hybrid`'s formulas, float32, within a few ulp of NumPy's). proj_b,
    proj_a `[n, H]` (views of the fused projection with any row stride are read as they
    are), dt_bias, ssm_a `[H]`. Returns `(beta, g)`, each `[n, H]` (`rt.empty`), or written
    into `beta_out` / `g_out` (float32, that shape, unit last stride)."""
    cp = cupy_module()
    b = _rows_f32(cp, proj_b, 2, "proj_b")
    a = _rows_f32(cp, proj_a, 2, "proj_a")
    n, H = (int(s) for s in b.shape)
    if tuple(a.shape) != (n, H):
        raise ValueError(f"proj_b {tuple(b.shape)} and proj_a {tuple(a.shape)} differ")
    dt = _rows_f32(cp, dt_bias, 1, "dt_bias")
    sa = _rows_f32(cp, ssm_a, 1, "ssm_a")
    if int(dt.shape[0]) != H or int(sa.shape[0]) != H:
        raise ValueError(f"dt_bias {tuple(dt.shape)} and ssm_a {tuple(sa.shape)} must be ({H},)")
    beta = _gdn_out(cp, beta_out, (n, H), "beta_out")
    g = _gdn_out(cp, g_out, (n, H), "g_out")
    if n == 0 or H == 0:
        return beta, g
    rt.kernel("gdn_decode", "gdn_gates_f32")(
        rt.grid(n * H), (rt.ELEMWISE_THREADS, 1, 1),
        (b, np.int64(rt.estrides(b)[0]), a, np.int64(rt.estrides(a)[0]), dt, sa, np.int32(n),
         np.int32(H), beta, np.int64(rt.estrides(beta)[0]), g, np.int64(rt.estrides(g)[0])))
    return beta, g


def silu_l2norm_qk(qkv: Any, Hk: int, Dk: int, eps: float) -> Any:
    """In place on qwen35's conv output `qkv [n, C]` (a float32 device array with unit last
    stride, any row stride; channels q [Hk Dk] | k [Hk Dk] | v): `silu` on every value, then
    each q and k head divided by `max(||head||, eps)` of its silu'd values (ggml_l2_norm), one
    launch (kernels/gdn_decode.cu: a warp per (row, head), the squares summed in a fixed
    order). Returns qkv."""
    cp = cupy_module()
    qkv = _device_rows(cp, qkv, "qkv")
    n, C = (int(s) for s in qkv.shape)
    Hk, Dk = int(Hk), int(Dk)
    if Hk < 0 or Dk < 0 or 2 * Hk * Dk > C:
        raise ValueError(f"2 * {Hk} heads of {Dk} exceed the {C} channels of qkv")
    if n == 0 or C == 0:
        return qkv
    vd = C - 2 * Hk * Dk  # v's channels
    n_norm = -(-(n * 2 * Hk) // GDN_NORM_WARPS) if Dk else 0
    n_v = rt.grid(n * vd)[0] if vd else 0
    if n_norm + n_v == 0:
        return qkv
    rt.kernel("gdn_decode", "silu_l2norm_qk_f32")(
        (n_norm + n_v, 1, 1), (32 * GDN_NORM_WARPS, 1, 1),
        (qkv, np.int64(rt.estrides(qkv)[0]), np.int32(n), np.int32(C), np.int32(Hk),
         np.int32(Dk), np.float32(eps), np.int32(n_norm)))
    return qkv


def mul_silu(o: Any, z: Any) -> Any:
    """In place: `o *= silu(z)` (qwen35's output gate), one launch (kernels/gdn_decode.cu).
    o, z `[n, d]` float32 device arrays with unit last stride (any row stride: z a view of
    the fused projection). Returns o."""
    cp = cupy_module()
    o = _device_rows(cp, o, "o")
    z = _rows_f32(cp, z, 2, "z")
    if tuple(z.shape) != tuple(o.shape):
        raise ValueError(f"z {tuple(z.shape)} must have o's shape {tuple(o.shape)}")
    n, d = (int(s) for s in o.shape)
    if n == 0 or d == 0:
        return o
    rt.kernel("gdn_decode", "mul_silu_f32")(
        rt.grid(n * d), (rt.ELEMWISE_THREADS, 1, 1),
        (o, np.int64(rt.estrides(o)[0]), z, np.int64(rt.estrides(z)[0]), np.int32(n),
         np.int32(d)))
    return o
