"""A CPU decode step's attention + MLP layers in one Rust call (`_core.decode_layers`).

`DecoderModel._attention_layer` makes ~14 calls per layer (norms, the fused products, rope,
the KV write, attention, the GLU, residual adds), each ~10-15 us of Python around a few us
of work: a sixth of a Gemma 3 270M decode step. `kvshare_kernels::decode` runs the same
operations with the same kernels and float formulas, so a row's result is the same bits on
either path (tests/test_fused_decode.py compares them). It applies where those kernels are
the ones the Python path would call: 8-bit activations on every weight ("vnni"), an f32 or
f16 pool, at most `MAX_ROWS` rows with at most 4 per sequence (the attention's decode rows),
every row wanted past the last layer. `DecoderModel.forward` hands each run of consecutive
such layers to `run_layers` (one call, the GIL released once; each layer's weights checked
once, in a `_core.FusedLayer`). Set KVSHARE_FUSED_DECODE=0 to turn it off.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from kvshare import _core
from kvshare.backend import CPU_THREADS
from kvshare.ops.attention import DECODE_ROWS, KERNEL_MAX_ROWS
from kvshare.ops.blockweight import BLOCK_KERNEL_MAX, BlockWeight
from kvshare.ops.rope import NEOX

ENABLED = (hasattr(_core, "decode_layers") and hasattr(_core, "FusedLayer")
           and os.environ.get("KVSHARE_FUSED_DECODE", "1") != "0")
MAX_ROWS = BLOCK_KERNEL_MAX
_POOL_DTYPES = (np.dtype(np.float32), np.dtype(np.float16))


def _parts(w: Any) -> tuple[list[np.ndarray], list[int]] | None:
    """A weight's `(raws, qtypes)`, or None when it is not all 8-bit-activation blocks."""
    if not isinstance(w, BlockWeight) or w.activations != "vnni" or not w.vnni_all:
        return None
    return [p.raw for p in w.parts], [p.qtype for p in w.parts]


def layer_args(L: Any) -> tuple | None:
    """The layer's weights as `_core.decode_layer` takes them (built once), or None when the
    layer cannot take the fused path."""
    if L.fused is None:
        ws = [_parts(w) for w in (L.wqkv, L.wo, L.w_gate_up, L.w_down)]
        vecs = (L.attn_norm, L.bqkv, L.q_norm, L.k_norm, L.post_attn_norm, L.ffn_norm,
                L.post_ffn_norm)
        ok = all(w is not None for w in ws) and all(
            v is None or (isinstance(v, np.ndarray) and v.dtype == np.float32
                          and v.flags.c_contiguous) for v in vecs)
        if not ok:
            L.fused = ()
        else:
            an, b, qn, kn, pan, fn, pfn = vecs
            L.fused = (an, ws[0], b, qn, kn, ws[1], pan, fn, ws[2], ws[3], pfn)
    return L.fused or None


def step_applies(plan: Any, x: Any) -> bool:
    """Whether this step's rows can take the fused path (once per forward call)."""
    n = x.shape[0]
    return (ENABLED and 0 < n <= MAX_ROWS and plan.row_parts <= 1
            and isinstance(x, np.ndarray) and x.flags.c_contiguous
            # more rows per sequence make `paged_attention` take all cores, not the kernels'
            # share, which the fused layer uses
            and plan.max_seq_rows <= DECODE_ROWS)


def applies(L: Any, x: Any, plan: Any, kc: Any, last: bool) -> bool:
    """Whether this layer of a step that `step_applies` takes the fused path (`x`: the rows
    as this layer gets them; a recurrent layer before it returns its own array)."""
    if kc.dtype not in _POOL_DTYPES or not x.flags.c_contiguous:
        return False
    if last and plan.logit_rows.size != len(plan.tokens):
        return False
    return layer_args(L) is not None


def layer_call(model: Any, L: Any, cos: np.ndarray, sin: np.ndarray, slots: np.ndarray,
               kc: Any, vc: Any, tables: np.ndarray) -> tuple:
    """The layer's arguments for `run_layers` (see `applies`)."""
    shape = L.fused_shape
    if shape is None:  # built once per layer
        cfg = model.config
        shape = L.fused_shape = (cfg.n_head, cfg.n_head_kv, cfg.head_dim, float(cfg.norm_eps),
                                 cfg.rope_style == NEOX, model.glu_activation, int(L.window),
                                 float(cfg.q_scale))
        # the weights' buffers read and checked once, not at every step (~13 arrays a layer)
        L.fused_layer = _core.FusedLayer(L.fused, shape)
    return (L.fused_layer, shape, cos, sin, slots, kc, vc, tables)


def run_layers(model: Any, x: np.ndarray, plan: Any, calls: list[tuple]) -> None:
    """Consecutive layers (`layer_call`s) over the rows x, in place, in one call: ~30 us a
    layer of Python and argument checks went to each `decode_layer` call of a Gemma 3 270M
    decode step."""
    _core.decode_layers(calls, x, plan.q_starts, plan.start_positions, KERNEL_MAX_ROWS,
                        bool(model.batch_invariant), CPU_THREADS.kernel_threads)
