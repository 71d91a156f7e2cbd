"""Mixture-of-experts feed-forward block: the router's choice of experts per token and the
experts' gated FFNs over the tokens routed to them (llama.cpp's `build_moe_ffn`).

Routing (`route`): router logits `[N, n_expert]` -> gating probabilities (softmax, or sigmoid)
-> the top k experts by probability (highest first) -> their probabilities as weights,
divided by their sum when `norm` (the sum clamped to >= 2^-14, as ggml clamps it) and
multiplied by `scale` when it is neither 0 nor 1. "softmax_weight" picks by the raw logits and
takes the softmax of the k picked logits as weights. The router's product itself is
`router_logits`: on the CPU an f32 router takes a row kernel whose result for a token does
not depend on the rows beside it, so routing is batch-invariant (as `blocks-vnni` needs).

Products (`moe_ffn`): the (token, slot) pairs are grouped by expert (`group_by_expert`), and
each expert with at least one pair runs one product per matrix over its tokens' rows: its
gate|up rows (plus the expert's gate|up bias, where the model has one), the gated activation
(`activation`: "silu", "gelu_tanh", or gpt-oss's clamped "swiglu_oai"), its down rows (plus
its down bias). A pair's output is weighted and the k
slots of a token are added in slot order (highest weight first), as llama.cpp adds its
`ffn_moe_weighted` views. Each expert's matrices are whatever `ops.linear.linear` takes (a
`BlockWeight` on the CPU: one block-format product per active expert on its rows), so a
token's result does not depend on which other tokens share its step.

Grouped (`moe_ffn_grouped`, the CPU path for experts in block formats): the same block in two
Rust calls over the whole stacked tensors (`StackedExperts`), `_core.moe_gate_up` (gate|up
products, plus the experts' biases, with the gated activation) and `_core.moe_down` (down
products plus biases, weighted, slots added in order); the grouping by expert and the split of the work over the cores by expert happen in
`kvshare-kernels`' `moe` module, with the kernels `BlockWeight` takes for the same
activations, so its results equal `moe_ffn`'s on `BlockWeight` experts bit for bit.

On a GPU, `moe_ffn_grouped` given `gpu_moe.GpuStackedExperts` (the stacked tensors' blocks on
the device) runs `gpu_moe.moe_ffn`: routing on the host, then one launch per matrix product
for the whole batch (kernels/moe_blocks.cu). Experts given as per-expert device matrices take
`moe_ffn`'s loop, one product per active expert (`KVSHARE_MOE_GROUPED=0`; models on a GPU
hold every MoE layer's experts as `GpuStackedExperts`: `model.moe`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from kvshare import _core
from kvshare.backend import CPU, CPU_THREADS, Backend
from kvshare.ops.activation import glu
from kvshare.ops.linear import linear
from kvshare.ops.moe_routing import Routing, route
from kvshare.ops.parallel import ROWS

# gpt-oss's gated activation (llama.cpp's LLM_FFN_SWIGLU_OAI_MOE constants)
SWIGLU_OAI_ALPHA = np.float32(1.702)
SWIGLU_OAI_LIMIT = np.float32(7.0)


def group_by_expert(ids: np.ndarray, n_expert: int) -> tuple[np.ndarray, np.ndarray]:
    """`(pairs, offsets)`: the flat (token, slot) pair indices `t * k + j` of `ids` ([N, k],
    host) sorted by expert, token order kept within an expert, and `offsets [n_expert + 1]`:
    expert e's pairs are `pairs[offsets[e]:offsets[e + 1]]` (empty for an idle expert)."""
    flat = np.asarray(ids, np.int64).reshape(-1)
    if flat.size and (flat.min() < 0 or flat.max() >= n_expert):
        raise IndexError(f"expert id out of range [0, {n_expert})")
    pairs = np.argsort(flat, kind="stable")
    offsets = np.zeros(n_expert + 1, np.int64)
    np.cumsum(np.bincount(flat, minlength=n_expert), out=offsets[1:])
    return pairs, offsets


def swiglu_oai(gu: Any, *, backend: Backend = CPU) -> Any:
    """ggml_swiglu_oai of `gu` `[n, 2 ff]` (gate columns then up columns) -> `[n, ff]`:
    `x / (1 + exp(-alpha x)) * (y + 1)` with the gate x clamped to <= limit and the up
    value y to [-limit, limit], in f32 in ggml's order of operations."""
    xp = backend.xp
    ff = gu.shape[1] // 2
    x = xp.minimum(gu[:, :ff], SWIGLU_OAI_LIMIT)
    y = xp.clip(gu[:, ff:], -SWIGLU_OAI_LIMIT, SWIGLU_OAI_LIMIT)
    out = x / (np.float32(1.0) + xp.exp(SWIGLU_OAI_ALPHA * -x))
    out *= y + np.float32(1.0)
    return out


def _activate(gu: Any, activation: str, backend: Backend) -> Any:
    if activation == "swiglu_oai":
        if (not backend.is_gpu and gu.dtype == np.float32 and gu.ndim == 2
                and gu.flags.c_contiguous and gu.shape[1] % 2 == 0):
            # kvshare-kernels' `Glu::SwigluOai`, the grouped kernels' activation: the same
            # formula with their exp, so both paths give the same bits
            if gu.size:
                _core.glu_in_place(gu, "swiglu_oai")
            return gu[:, : gu.shape[1] // 2]
        return swiglu_oai(gu, backend=backend)
    return glu(gu, activation, backend=backend)


# rows per call of the router's row kernel (`_core.block_matmul_t_f32` takes at most this many)
_ROUTER_ROWS = 16
HAVE_ROUTER_KERNEL = hasattr(_core, "block_matmul_t_f32")


def router_logits(h: Any, router: Any, bias: Any = None, *, backend: Backend = CPU) -> Any:
    """The router's logits `h @ router.T (+ bias)` `[N, n_expert]`.

    On the CPU an f32 router (llama.cpp's quantizer leaves `ffn_gate_inp` in F32) goes through
    `_core.block_matmul_t_f32` 16 rows at a time: that kernel sums each row's products in one
    order whatever the number of rows beside it, so a token's logits are the same bits alone
    (decode), in a batch or anywhere in a prefill chunk. BLAS (`linear`'s path for f32
    weights) sums a lone row (gemv) and a block of rows (gemm) in different orders, and the
    ~1e-7 difference, passed through the routing weights into the next layer's 8-bit
    activations ("vnni"), would move the logits of a cached prefix against a cold run. Other
    router forms (block weights, a GPU) take `linear`."""
    if (backend.is_gpu or not HAVE_ROUTER_KERNEL or not isinstance(router, np.ndarray)
            or router.dtype != np.float32 or router.ndim != 2):
        return linear(h, router, bias, backend=backend)
    h = np.ascontiguousarray(h, dtype=np.float32)
    n = h.shape[0]
    raw = np.ascontiguousarray(router).view(np.uint8)  # the F32 rows as GGML type 0's bytes
    out = np.empty((n, router.shape[0]), np.float32)
    # inside a row-parallel part (prefill) the other parts hold the other cores
    threads = 1 if ROWS.inside() else CPU_THREADS.kernel_threads
    for s in range(0, n, _ROUTER_ROWS):
        e = min(n, s + _ROUTER_ROWS)
        _core.block_matmul_t_f32(h[s:e], raw, 0, out[s:e], threads)
    if bias is not None:
        out += bias
    return out


def moe_ffn(h: Any, router: Any, gate_up: Sequence[Any], down: Sequence[Any],
            routing: Routing, activation: str = "silu", *, router_bias: Any = None,
            selection_bias: Any = None, gate_up_bias: Any = None, down_bias: Any = None,
            backend: Backend = CPU) -> Any:
    """The experts' output `[N, n_embd]` for the normed hidden rows `h` (`[N, n_embd]` f32).

    `router`: `[n_expert, n_embd]`; `gate_up[e]`: expert e's gate rows then up rows
    (`[2 n_ff_exp, n_embd]`); `down[e]`: `[n_embd, n_ff_exp]`; any weight form `linear`
    takes. `router_bias`: optional `[n_expert]` added to the router logits; `selection_bias`:
    `route`'s; `gate_up_bias` `[n_expert, 2 n_ff_exp]` and `down_bias` `[n_expert, n_embd]`:
    optional per-expert biases added to its products (gpt-oss)."""
    xp = backend.xp
    n = h.shape[0]
    logits = router_logits(h, router, router_bias, backend=backend)
    ids, w = route(logits, routing, backend=backend, selection_bias=selection_bias)
    k = routing.k
    ids_host = backend.to_host(ids) if backend.is_gpu else ids
    pairs, offsets = group_by_expert(ids_host, routing.n_expert)
    y = xp.empty((n * k, h.shape[1]), xp.float32)
    wflat = w.reshape(-1)
    active = np.nonzero(offsets[1:] > offsets[:-1])[0]
    for e in active.tolist():
        p = pairs[offsets[e] : offsets[e + 1]]
        rows = p // k
        if backend.is_gpu:
            p, rows = backend.asarray(p), backend.asarray(rows)
        gu = linear(h[rows], gate_up[e], None if gate_up_bias is None else gate_up_bias[e],
                    backend=backend)
        a = _activate(gu, activation, backend)
        out = linear(a, down[e], None if down_bias is None else down_bias[e], backend=backend)
        out *= wflat[p][:, None]
        y[p] = out
    y = y.reshape(n, k, h.shape[1])
    acc = y[:, 0].copy()
    for j in range(1, k):
        acc += y[:, j]
    return acc


def q8_0_round(x: Any) -> np.ndarray:
    """`x` (f32 `[M, k]`, k a multiple of 32) as the values of ggml's Q8_0 blocks of it
    (`quantize_row_q8_0_ref`: per 32 values d = amax / 127, q = round(x / d), d stored as
    f16): `q * f16(d)`, what llama.cpp's CPU multiplies a Q8_0-activation weight with."""
    from kvshare.ops import kv_q8_0  # noqa: PLC0415

    x = np.ascontiguousarray(x, dtype=np.float32)
    return kv_q8_0.dequantize(kv_q8_0.quantize(x.reshape(x.shape[0], 1, -1))).reshape(x.shape)


HAVE_GROUPED = hasattr(_core, "moe_gate_up")


@dataclass(frozen=True)
class StackedExperts:
    """One matrix of every expert as the file holds it: `raws[p]` uint8 `[n_expert * n_p,
    row_bytes]` (a whole `ffn_*_exps` tensor, a view of the map) of GGML type `qtypes[p]`, rows
    of `k` values; expert e's matrix is its `n_p` rows of each part, stacked in part order.
    `activations` as `BlockWeight`'s ("f32", "q8", "vnni")."""

    raws: tuple[np.ndarray, ...]
    qtypes: tuple[int, ...]
    n_expert: int
    k: int
    activations: str = "f32"
    # the products' inputs rounded through ggml's Q8_0 blocks first (`q8_0_round`)
    q8_0_acts: bool = False

    @property
    def rows(self) -> int:
        """Rows of one expert's matrix."""
        return sum(r.shape[0] for r in self.raws) // self.n_expert


def grouped_supported(qtypes: Sequence[int], activations: str) -> bool:
    """Whether `moe_ffn_grouped` takes experts of these GGML types with these activations
    (block formats; with "vnni" only types that have a VNNI kernel)."""
    from kvshare.ops.blockweight import BLOCK_TYPES  # noqa: PLC0415

    if not HAVE_GROUPED or any(int(q) not in BLOCK_TYPES for q in qtypes):
        return False
    if activations == "vnni":
        return bool(_core.block_vnni_available()) and all(
            _core.block_vnni_supports(int(q)) for q in qtypes)
    return activations in ("f32", "q8")


# the gated activations the grouped kernels apply (`rowops::Glu`)
GROUPED_ACTIVATIONS = ("silu", "gelu_tanh", "swiglu_oai")


def _bias(b: Any) -> np.ndarray | None:
    return None if b is None else np.ascontiguousarray(b, dtype=np.float32)


def moe_ffn_grouped(h: np.ndarray, router: Any, gate_up: StackedExperts, down: StackedExperts,
                    routing: Routing, activation: str = "silu", *,
                    router_bias: Any = None, selection_bias: Any = None,
                    gate_up_bias: Any = None, down_bias: Any = None) -> np.ndarray:
    """`moe_ffn` with the grouped kernels: `gate_up` (gate rows then up rows per expert) and
    `down` as stacked tensors, `activation` one of `GROUPED_ACTIVATIONS`, the biases as
    `moe_ffn`'s. `StackedExperts`: the CPU's Rust kernels; `gpu_moe.GpuStackedExperts`: the
    GPU's (a device array comes back)."""
    if activation not in GROUPED_ACTIVATIONS:
        raise ValueError(f"the grouped kernels have no activation {activation!r}")
    if getattr(gate_up, "on_gpu", False) and getattr(down, "on_gpu", False):
        # `gpu_moe.GpuStackedExperts`: the same products with the grouped GPU kernels
        from kvshare.ops import gpu_moe  # noqa: PLC0415

        return gpu_moe.moe_ffn(h, router, gate_up, down, routing, activation,
                               router_bias=router_bias, selection_bias=selection_bias,
                               gate_up_bias=gate_up_bias, down_bias=down_bias)
    n = h.shape[0]
    h = np.ascontiguousarray(h, dtype=np.float32)
    ids, w = route(router_logits(h, router, router_bias), routing,
                   selection_bias=selection_bias)
    if gate_up.q8_0_acts:
        h = q8_0_round(h)
    ids = np.ascontiguousarray(ids, dtype=np.int64)
    w = np.ascontiguousarray(w, dtype=np.float32)
    # inside a row-parallel part (prefill) the other parts hold the other cores
    threads = 1 if ROWS.inside() else CPU_THREADS.kernel_threads
    ff = gate_up.rows // 2
    a = np.empty((n * routing.k, ff), np.float32)
    _core.moe_gate_up(h, ids, list(gate_up.raws), list(gate_up.qtypes), gate_up.n_expert, a,
                      gate_up.activations, activation, threads, _bias(gate_up_bias))
    if down.q8_0_acts:
        a = q8_0_round(a)
    out = np.empty((n, down.rows), np.float32)
    _core.moe_down(a, ids, w, list(down.raws), list(down.qtypes), down.n_expert, out,
                   down.activations, threads, _bias(down_bias))
    return out


def moe_ffn_reference(h: np.ndarray, router: np.ndarray, gate_up: Sequence[np.ndarray],
                      down: Sequence[np.ndarray], routing: Routing,
                      selection_bias: Any = None, activation: str = "silu", *,
                      router_bias: Any = None, gate_up_bias: Any = None,
                      down_bias: Any = None) -> np.ndarray:
    """`moe_ffn` token by token in float64 on dense f32 weights: the test oracle (SwiGLU or
    "swiglu_oai", biases optional)."""
    logits = np.asarray(h @ router.T, np.float32)
    if router_bias is not None:
        logits = logits + router_bias
    ids, w = route(logits, routing, selection_bias=selection_bias)
    out = np.zeros(h.shape, np.float64)
    ff = gate_up[0].shape[0] // 2
    for t in range(h.shape[0]):
        x = h[t].astype(np.float64)
        for j in range(routing.k):
            e = int(ids[t, j])
            gu = gate_up[e].astype(np.float64) @ x
            if gate_up_bias is not None:
                gu += gate_up_bias[e]
            g, u = gu[:ff], gu[ff:]
            if activation == "swiglu_oai":
                lim = float(SWIGLU_OAI_LIMIT)
                g, u = np.minimum(g, lim), np.clip(u, -lim, lim)
                a = g / (1.0 + np.exp(-float(SWIGLU_OAI_ALPHA) * g)) * (u + 1.0)
            else:
                a = g / (1.0 + np.exp(-g)) * u
            d = down[e].astype(np.float64) @ a
            if down_bias is not None:
                d += down_bias[e]
            out[t] += float(w[t, j]) * d
    return out
