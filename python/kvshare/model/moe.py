"""Experts as a layer's feed-forward block: `MoeFFN` (router, routed experts, optional shared
expert) loaded from a GGUF layer's tensors, its routing read as llama.cpp reads it per
architecture. The computation is `kvshare.ops.moe`.

GGUF layout (ggml's dimension order reversed, as NumPy shapes): `ffn_gate_inp [n_expert,
n_embd]` (the router), `ffn_gate_exps` / `ffn_up_exps [n_expert, n_ff_exp, n_embd]` (or one
`ffn_gate_up_exps [n_expert, 2 n_ff_exp, n_embd]`), `ffn_down_exps [n_expert, n_embd,
n_ff_exp]`; a shared expert as `ffn_{gate,up,down}_shexp` with its gate `ffn_gate_inp_shexp
[n_embd]`; gpt-oss's biases as `ffn_gate_inp.bias [n_expert]` (the router's) and
`ffn_{gate,up,down}_exps.bias [n_expert, rows]` (each expert's products').

Each expert's rows of a stacked tensor are a contiguous run of its bytes, so on the CPU every
expert's matrices are `BlockWeight`s over views of the mapped file, in the file's block format
(its gate and up rows one fused weight, as the dense layers' are; MXFP4 included): nothing is
dequantized or copied at load, a model costs its file size, and a product reads only the
experts its tokens use. With `KVSHARE_CPU_WEIGHTS=int8` / `f32` or a block format without
kernels, each expert is dequantized to the backend's dense form instead. With
`blocks-q8`, MXFP4 experts multiply activations rounded to 8 bits as ggml's Q8_0 rounds them
(`Q8_0Acts`: llama.cpp's `vec_dot_mxfp4_q8_0` scales each block's integer sum by the Q8_0
block's f16 scale, which the kernels' own 8-bit activations keep in f32), times the blocks
with f32 arithmetic; a dense expert of another quantized format takes the same rounding.

On the CPU the layer also keeps each matrix's whole stacked tensors (`StackedExperts`, the
same bytes) for the grouped kernels (`ops.moe.moe_ffn_grouped`: one Rust call per matrix
product for the batch, the experts' biases and gpt-oss's `swiglu_oai` included); the
per-expert `BlockWeight`s remain the path for formats and activations those kernels lack and
for `KVSHARE_MOE_GROUPED=0`.

On a GPU each matrix of the experts is one `gpu_moe.GpuStackedExperts` on the device, and
every forward runs the grouped GPU kernels (`ops.moe.moe_ffn_grouped` -> `gpu_moe.moe_ffn`:
routing on the host, one launch per matrix product for the batch). Which bytes it holds
follows the dense layers' `KVSHARE_GPU_WEIGHTS`: `blocks` keeps the file's blocks (the types
of `gpu_moe.supports`; a layer costs its file size), the default dequantizes each expert to
f16 (one F16 part `[n_expert * rows, k]`, each expert's gate and up rows contiguous), as does
`blocks` for a type without a GPU decoder. The router is f32 on the device (exact logits, so
the same experts as the CPU's wherever the choice is not a tie). The per-expert weights
(`GpuBlockWeight`s or f16 views over the same device bytes) remain for
`KVSHARE_MOE_GROUPED=0`, which takes `ops.moe.moe_ffn`'s loop.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvshare.model.config import ModelConfig
from kvshare.model.weights import cpu_weight_mode, dequantize
from kvshare.ops.moe import (GROUPED_ACTIVATIONS, Routing, StackedExperts, grouped_supported,
                             moe_ffn, moe_ffn_grouped, q8_0_round)

# GGML type ids of F16 and MXFP4
F16 = 1
MXFP4 = 39

# How llama.cpp's graph routes each architecture (`build_moe_ffn`'s gating, `norm_w` and
# `w_scale` arguments). For qwen3moe and qwen35moe it passes softmax gating and norm_w = true
# whatever the file says, and reads no `expert_weights_scale` (so 0: no scaling).
# For lfm2moe it passes the file's `expert_gating_func` (a required key; LFM2-8B-A1B: sigmoid),
# norm_w = true, its `exp_probs_b` as the selection bias, and reads no scale either.
ARCH_ROUTING: dict[str, dict[str, Any]] = {
    "qwen3moe": dict(gating="softmax", norm=True),
    "qwen35moe": dict(gating="softmax", norm=True),
    "lfm2moe": dict(norm=True),
    # gpt-oss: LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX_WEIGHT (top k of the biased router logits,
    # the softmax of those k as weights), norm_w = false, no scale read
    "gpt-oss": dict(gating="softmax_weight", norm=False),
}
# llama.cpp's `llama_expert_gating_func_type` values
GATING_FUNCS = {1: "softmax", 2: "sigmoid"}


def routing_for(cfg: ModelConfig) -> Routing:
    ex = cfg.extra
    try:
        n_expert, k = int(ex["expert_count"]), int(ex["expert_used_count"])
    except KeyError as exc:
        raise ValueError(f"{cfg.arch} metadata lacks {exc}") from exc
    if not 0 < k <= n_expert:
        # named by the file's keys: startup prints this line alone
        raise ValueError(f"{cfg.arch}.expert_used_count {k} is not in 1..{cfg.arch}"
                         f".expert_count ({n_expert})")
    kw = dict(ARCH_ROUTING[cfg.arch])
    if "gating" not in kw:
        func = ex.get("expert_gating_func")
        if func not in GATING_FUNCS:
            raise ValueError(f"{cfg.arch}: expert_gating_func {func!r} is not one of "
                             f"{GATING_FUNCS}")
        kw["gating"] = GATING_FUNCS[func]
    return Routing(n_expert=n_expert, k=k, **kw)


@dataclass
class MoeFFN:
    """One layer's experts: `__call__(h)` is the block's output for the normed rows h."""

    routing: Routing
    router: Any  # [n_expert, n_embd]
    # per expert [2 n_ff_exp, n_embd] / [n_embd, n_ff_exp]; empty where only the stacked
    # tensors exist (MXFP4 on a GPU: the grouped kernels' format alone)
    gate_up: list[Any]
    down: list[Any]
    backend: Any
    shared_gate_up: Any = None  # [2 n_ff_shexp, n_embd]
    shared_down: Any = None
    shared_gate: Any = None  # [1, n_embd]: sigmoid(shared_gate . h) scales the shared expert
    selection_bias: Any = None  # [n_expert] f32: added to the probabilities to pick experts
    # the stacked tensors for the grouped kernels (None: the per-expert path)
    stacked_gate_up: StackedExperts | None = None
    stacked_down: StackedExperts | None = None
    activation: str = "silu"  # the experts' gated activation (`ops.moe.moe_ffn`)
    router_bias: Any = None  # [n_expert] f32, added to the router's logits
    gate_up_bias: Any = None  # [n_expert, 2 n_ff_exp] f32: gate then up, per expert
    down_bias: Any = None  # [n_expert, n_embd] f32

    def __call__(self, h: Any) -> Any:
        from kvshare.ops.activation import glu  # noqa: PLC0415
        from kvshare.ops.linear import linear  # noqa: PLC0415

        be = self.backend
        if self._grouped():
            y = moe_ffn_grouped(h, self.router, self.stacked_gate_up, self.stacked_down,
                                self.routing, self.activation, router_bias=self.router_bias,
                                selection_bias=self.selection_bias,
                                gate_up_bias=self.gate_up_bias, down_bias=self.down_bias)
        else:
            y = moe_ffn(h, self.router, self.gate_up, self.down, self.routing,
                        self.activation, router_bias=self.router_bias,
                        selection_bias=self.selection_bias, gate_up_bias=self.gate_up_bias,
                        down_bias=self.down_bias, backend=be)
        if self.shared_gate_up is not None:
            s = linear(glu(linear(h, self.shared_gate_up, backend=be), "silu", backend=be),
                       self.shared_down, backend=be)
            if self.shared_gate is not None:
                # s *= 1 / (1 + exp(-g)), formed in g's own array (on a GPU, one from the
                # step's workspace: a CUDA graph's step allocates nothing else)
                g = linear(h, self.shared_gate, backend=be)
                xp = be.xp
                xp.negative(g, out=g)
                xp.exp(g, out=g)
                g += 1.0
                xp.reciprocal(g, out=g)
                s *= g
            y += s
        return y

    def _grouped(self) -> bool:
        """Whether `__call__` takes the grouped kernels (`moe_ffn_grouped`)."""
        return (self.stacked_gate_up is not None and self.stacked_down is not None
                and self.activation in GROUPED_ACTIVATIONS)

    def graph_ready(self) -> bool:
        """Whether a step of this layer can be a CUDA graph (`model.gpu_graphs`): the grouped
        GPU kernels with the router on the device and routed there (`gpu_moe.device_routing`);
        a shared expert's products and gate take their arrays from the step's workspace."""
        if not getattr(self.backend, "is_gpu", False):
            return False
        if not (self._grouped() and getattr(self.stacked_gate_up, "on_gpu", False)
                and getattr(self.stacked_down, "on_gpu", False)):
            return False
        from kvshare.ops import gpu_moe  # noqa: PLC0415

        return gpu_moe.device_router(self.router) and gpu_moe.device_routing(self.routing)

    @property
    def n_ff_exp(self) -> int:
        return int(self.down[0].shape[1]) if self.down else int(self.stacked_down.k)


def _expert_views(ld: Any, name: str, n_expert: int) -> tuple[list[np.ndarray], int, tuple]:
    """The bytes of each expert's matrix in stacked tensor `name`: (views, qtype, [rows, k])."""
    info = ld.gf.tensors.get(name)
    if info is None:
        raise KeyError(name)
    shape = info.numpy_shape
    if len(shape) != 3 or shape[0] != n_expert:
        raise ValueError(f"{name} has shape {shape}, expected [{n_expert}, rows, cols]")
    raw = ld.gf.raw(name)
    per = raw.size // n_expert
    return [raw[e * per : (e + 1) * per] for e in range(n_expert)], int(info.qtype), shape[1:]


def grouped_enabled() -> bool:
    """`KVSHARE_MOE_GROUPED=0` keeps MoE layers on the per-expert path."""
    return os.environ.get("KVSHARE_MOE_GROUPED", "1") != "0"


def load_stacked(ld: Any, names: list[str], n_expert: int) -> StackedExperts | None:
    """The stacked tensors `names` for the grouped kernels, or None where they do not take
    them (a GPU, dense CPU weights, formats or activations without a grouped kernel)."""
    mode = cpu_weight_mode(ld.vnni_model)
    if ld.backend.is_gpu or not mode.startswith("blocks") or not grouped_enabled():
        return None
    from kvshare.ops.blockweight import row_bytes  # noqa: PLC0415

    raws, qtypes, ks = [], [], set()
    for name in names:
        info = ld.gf.tensors[name]
        q, (rows, k) = int(info.qtype), info.numpy_shape[1:]
        try:
            rb = row_bytes(q, k)
        except ValueError:
            return None
        raws.append(ld.gf.raw(name).reshape(n_expert * rows, rb))
        qtypes.append(q)
        ks.add(k)
    q8_0 = _q8_0_blocks(mode, qtypes)
    activations = "f32" if q8_0 else {"blocks-q8": "q8", "blocks-vnni": "vnni"}.get(mode, "f32")
    if len(ks) != 1 or not grouped_supported(qtypes, activations):
        return None
    return StackedExperts(tuple(raws), tuple(qtypes), n_expert, ks.pop(), activations,
                          q8_0_acts=q8_0)


class Q8_0Acts:
    """A weight `[out, in]` of a quantized format whose products take the activations rounded
    through ggml's Q8_0 blocks (`ops.moe.q8_0_round`), as llama.cpp's CPU multiplies it
    (`vec_dot` with Q8_0 activations); `KVSHARE_CPU_WEIGHTS=blocks-q8`. `w`: dense f32, or a
    `BlockWeight` with f32 activations (its blocks times the rounded values)."""

    ndim = 2
    dtype = np.dtype(np.float32)

    def __init__(self, w: Any):
        self.w = w if hasattr(w, "matmul_t") else np.ascontiguousarray(w, dtype=np.float32)
        self.shape = tuple(self.w.shape)

    def matmul_t(self, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        xq = q8_0_round(x)
        if hasattr(self.w, "matmul_t"):
            return self.w.matmul_t(xq, out=out)
        return np.matmul(xq, self.w.T, out=out)


def _q8_0_blocks(mode: str, qtypes: list[int]) -> bool:
    """Whether experts of these types take `Q8_0Acts`' rounding on blocks in `mode`: MXFP4
    with `blocks-q8`, whose 8-bit activations would otherwise keep f32 scales."""
    return mode == "blocks-q8" and all(q == MXFP4 for q in qtypes)


def load_experts(ld: Any, names: list[str], n_expert: int) -> list[Any]:
    """Per expert, the row-wise stack of its matrices in the stacked tensors `names` (one name,
    or gate then up), in the form `ld`'s backend multiplies (see the module docstring)."""
    from kvshare.ops.blockweight import BLOCK_TYPES, BlockWeight  # noqa: PLC0415

    parts = [_expert_views(ld, n, n_expert) for n in names]
    ks = {shape[1] for _, _, shape in parts}
    if len(ks) != 1:
        raise ValueError(f"{', '.join(names)}: experts' input sizes differ ({sorted(ks)})")
    k = ks.pop()
    mode = cpu_weight_mode(ld.vnni_model)
    blocks_ok = (not ld.backend.is_gpu and mode.startswith("blocks")
                 and all(q in BLOCK_TYPES and k % BLOCK_TYPES[q][0] == 0 for _, q, _ in parts))
    out: list[Any] = []
    if blocks_ok:
        q8_0 = _q8_0_blocks(mode, [q for _, q, _ in parts])
        activations = "f32" if q8_0 else {"blocks-q8": "q8", "blocks-vnni": "vnni"}.get(
            mode, "f32")
        for e in range(n_expert):
            w = BlockWeight.concat([(views[e], q, k) for views, q, _ in parts],
                                   activations=activations)
            out.append(Q8_0Acts(w) if q8_0 else w)
        return out
    from kvshare.ops.blockweight import FLOAT_TYPES  # noqa: PLC0415

    q8_acts = (not ld.backend.is_gpu and mode == "blocks-q8" and k % 32 == 0
               and all(q not in FLOAT_TYPES for _, q, _ in parts))
    for e in range(n_expert):
        dense = [dequantize(views[e], q).reshape(shape) for views, q, shape in parts]
        w = ld.put(np.concatenate(dense, axis=0))
        out.append(Q8_0Acts(w) if q8_acts else w)
    return out


def gpu_expert_blocks() -> bool:
    """Whether a GPU keeps experts in their GGUF blocks: `KVSHARE_GPU_WEIGHTS=blocks`, the
    switch of the dense layers' block weights (`WeightLoader.gpu_block_weight`)."""
    return os.environ.get("KVSHARE_GPU_WEIGHTS", "f16").strip().lower() == "blocks"


def load_gpu_experts(ld: Any, names: list[str], n_expert: int) -> tuple[list[Any], Any]:
    """The stacked tensors `names` (one, or gate then up) on a GPU: `(per-expert weights,
    GpuStackedExperts)`, both over the same device bytes.

    With `KVSHARE_GPU_WEIGHTS=blocks` and types the grouped kernels decode
    (`gpu_moe.supports`), the file's blocks unchanged, and per expert a `GpuBlockWeight` over
    its rows (a copy only where an expert's rows do not start on a 16-byte boundary, as the
    kernels' loads need), or no per-expert weights for a type the dense kernels lack (MXFP4:
    the grouped kernels only; with `KVSHARE_MOE_GROUPED=0` it takes the f16 form). Otherwise
    (the default, or a type the grouped kernels lack) the experts dequantized to f16, one part
    `[n_expert * rows, k]` with each expert's rows contiguous (gate then up), and per expert
    an f16 view of its rows."""
    from kvshare.ops import gpu_blocks, gpu_moe  # noqa: PLC0415

    parts = [_expert_views(ld, n, n_expert) for n in names]
    ks = {shape[1] for _, _, shape in parts}
    if len(ks) != 1:
        raise ValueError(f"{', '.join(names)}: experts' input sizes differ ({sorted(ks)})")
    k = ks.pop()
    be = ld.backend
    qtypes = [q for _, q, _ in parts]
    per_expert_blocks = all(gpu_blocks.supports(q, k) for q in qtypes)
    if (gpu_expert_blocks() and gpu_moe.supports(qtypes, k)
            and (per_expert_blocks or grouped_enabled())):
        stacked = gpu_moe.GpuStackedExperts.from_gguf(ld.gf, names, n_expert, be)
        if stacked is not None:
            if not per_expert_blocks:
                return [], stacked
            return [gpu_blocks.GpuBlockWeight.from_parts(
                [(d[e * r : (e + 1) * r], q, k) for d, q, r in stacked.parts], be)
                for e in range(n_expert)], stacked
    rows = sum(shape[0] for _, _, shape in parts)
    xp = be.xp
    with xp.cuda.Device(be.device_id):
        dev = xp.empty((n_expert * rows, k), xp.float16)
    for e in range(n_expert):  # one expert at a time on the host
        w = np.concatenate([dequantize(views[e], q).reshape(shape) for views, q, shape in parts])
        dev[e * rows : (e + 1) * rows] = be.asarray(w, dtype="float16")
    per_expert = [dev[e * rows : (e + 1) * rows] for e in range(n_expert)]
    stacked = gpu_moe.GpuStackedExperts([(dev.view(xp.uint8), F16, rows)], n_expert, k)
    return per_expert, stacked


def _vector(ld: Any, name: str, shape: tuple[int, ...]) -> np.ndarray:
    """Tensor `name` as f32 of `shape` (-1: the rest), ValueError when it does not fit."""
    arr = np.asarray(ld.host(name), np.float32)
    try:
        return arr.reshape(shape)
    except ValueError:
        raise ValueError(f"{name} has shape {arr.shape}, expected {shape}") from None


def _expert_shape(per_expert: list[Any], stacked: Any) -> tuple[int, int]:
    """One expert's `[rows, k]`, from its weight or from the stacked tensors."""
    if per_expert:
        return (int(per_expert[0].shape[0]), int(per_expert[0].shape[1]))
    return (int(stacked.rows), int(stacked.k))


def _load_router(ld: Any, name: str) -> Any:
    if ld.backend.is_gpu:
        # f32 on the device (exact products, as the CPU's): an f16 router would move the
        # probabilities by ~1e-3 and pick other experts wherever two are that close
        return ld.put(np.asarray(ld.host(name), np.float32), keep_f32=True)
    return ld.matrix([name])


def _load_matrix(ld: Any, names: list[str], n_expert: int) -> tuple[list[Any], Any]:
    """One matrix of every expert: (per-expert weights, stacked tensors for the grouped
    kernels or None)."""
    if ld.backend.is_gpu:
        per_expert, stacked = load_gpu_experts(ld, names, n_expert)
        return per_expert, stacked if grouped_enabled() else None
    return load_experts(ld, names, n_expert), load_stacked(ld, names, n_expert)


def load_moe(ld: Any, cfg: ModelConfig, il: int, activation: str = "silu") -> MoeFFN:
    """Layer `il`'s experts (`blk.{il}.ffn_*`), shared expert and selection bias
    (`exp_probs_b.bias`) included where the file has them."""
    p = f"blk.{il}."
    routing = routing_for(cfg)
    E = routing.n_expert
    router = _load_router(ld, p + "ffn_gate_inp.weight")
    if tuple(router.shape) != (E, cfg.n_embd):
        raise ValueError(f"layer {il}: router has shape {tuple(router.shape)}, expected "
                         f"{(E, cfg.n_embd)}")
    if ld.has(p + "ffn_gate_up_exps.weight"):
        gu_names = [p + "ffn_gate_up_exps.weight"]
    else:
        gu_names = [p + "ffn_gate_exps.weight", p + "ffn_up_exps.weight"]
    (gate_up, stacked_gu), (down, stacked_down) = (
        _load_matrix(ld, names, E) for names in (gu_names, [p + "ffn_down_exps.weight"]))
    gu_shape, down_shape = _expert_shape(gate_up, stacked_gu), _expert_shape(down, stacked_down)
    ff = down_shape[1]
    if gu_shape != (2 * ff, cfg.n_embd) or down_shape[0] != cfg.n_embd:
        raise ValueError(f"layer {il}: experts' gate/up {gu_shape} and down {down_shape} do "
                         f"not fit n_embd {cfg.n_embd}")
    moe = MoeFFN(routing, router, gate_up, down, ld.backend, activation=activation)
    moe.stacked_gate_up, moe.stacked_down = stacked_gu, stacked_down
    if ld.has(p + "exp_probs_b.bias"):
        bias = np.asarray(ld.host(p + "exp_probs_b.bias"), np.float32).reshape(-1)
        if bias.shape != (E,):
            raise ValueError(f"layer {il}: exp_probs_b has {bias.size} values, expected {E}")
        moe.selection_bias = ld.put(bias, keep_f32=True)
    if ld.has(p + "ffn_gate_inp.bias"):
        moe.router_bias = ld.put(_vector(ld, p + "ffn_gate_inp.bias", (E,)), keep_f32=True)
    if ld.has(p + "ffn_down_exps.bias"):
        parts = [n.replace(".weight", ".bias") for n in gu_names]
        moe.gate_up_bias = ld.put(np.concatenate(
            [_vector(ld, n, (E, -1)) for n in parts], axis=1), keep_f32=True)
        moe.down_bias = ld.put(_vector(ld, p + "ffn_down_exps.bias", (E, cfg.n_embd)),
                               keep_f32=True)
        if moe.gate_up_bias.shape != (E, 2 * ff):
            raise ValueError(f"layer {il}: gate/up biases have shape "
                             f"{tuple(moe.gate_up_bias.shape)}, expected {(E, 2 * ff)}")
    if ld.has(p + "ffn_up_shexp.weight"):
        moe.shared_gate_up = ld.matrix([p + "ffn_gate_shexp.weight", p + "ffn_up_shexp.weight"])
        moe.shared_down = ld.matrix([p + "ffn_down_shexp.weight"])
        if ld.has(p + "ffn_gate_inp_shexp.weight"):
            moe.shared_gate = ld.put(ld.host(p + "ffn_gate_inp_shexp.weight").reshape(1, -1))
    return moe
