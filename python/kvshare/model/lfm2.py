"""LFM2 (`lfm2`, llama.cpp's `llm_build_lfm2`): short-convolution layers (where
`attention.head_count_kv` is 0) and attention layers.

Every layer: `h = RMSNorm(x, attn_norm)` -> mixer -> `x += mixer` -> `h = RMSNorm(x,
ffn_norm)` -> SwiGLU FFN -> `x += ffn`. The final norm is stored as `token_embd_norm`; the
output head is tied to the embeddings.

Short-conv mixer (L = `shortconv.l_cache`): `B, C, X = split(in_proj @ h, 3)`;
`y = causal_conv1d(B * X)` (depthwise, kernel L, no activation, the L-1 previous inputs as
state); `out_proj @ (C * y)`.

Attention mixer: the llama/qwen3 layer (q/k per-head RMSNorm, NEOX rope on the whole head,
grouped-query attention scaled by 1/sqrt(head_dim), `attn_output`), run by
`DecoderModel._attention_layer` unchanged.

State per slot (`state_shapes()`): `conv [n_rec, L-1, n_embd]` (the last L-1 values of B*X,
oldest first).

On a GPU every step's short-conv layers run `ShortConvLayer.gpu_step` (the conv one kernel
on the cache's states by slot, two over a step with a prompt chunk; its arrays from the
step's workspace), which a CUDA graph of the step captures as it is (`model.gpu_graphs`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvshare.backend import CPU, Backend
from kvshare.model.base import BatchPlan, load_attention_layer
from kvshare.model.kv_arrays import KVArrays
from kvshare.model.config import ATTENTION, ModelConfig
from kvshare.model.hybrid import HybridModel, HybridRecurrentLayer, ffn_graph_ready, \
    gather_states, plan_seq_rows, scatter_states, split_batch
from kvshare.model.qwen35 import load_embeddings, load_ffn
from kvshare.ops.linear import linear
from kvshare.ops.norm import rms_norm
from kvshare.ops.short_conv import causal_conv1d, causal_conv1d_step

CONV = 0


class ShortConvLayer(HybridRecurrentLayer):
    def __init__(self, model: "Lfm2Model", index: int, rec_index: int, w: dict[str, Any]):
        super().__init__(index, rec_index, "short conv")
        self.model = model
        self.__dict__.update(w)

    def forward(self, x: Any, plan: BatchPlan, cache: KVArrays) -> Any:
        m = self.model
        be = m.backend
        xp = be.xp
        E = m.config.n_embd
        n = x.shape[0]
        dec_rows, dec_slots, prefill = split_batch(plan)
        if be.is_gpu:
            # one conv kernel over the chunks' states in place: a decode step's (what a CUDA
            # graph of it replays) or, with a prompt chunk, the sequence kernels'
            return self.gpu_step(x, plan_seq_rows(plan, cache) if prefill else dec_slots,
                                 cache)
        h = rms_norm(x, self.attn_norm, m.config.norm_eps, backend=be)
        bcx = linear(h, self.in_proj, backend=be)  # [n, 3E]: B | C | X
        bx = bcx[:, :E] * bcx[:, 2 * E :]
        states = cache.states[CONV]
        y = xp.empty((n, E), np.float32)
        for r0, r1, slot in prefill:
            causal_conv1d(bx[r0:r1], self.conv_w, states[slot, self.rec_index], backend=be,
                          out=y[r0:r1])
        if len(dec_slots):
            st, view = gather_states(states, dec_slots, self.rec_index, xp)
            y[dec_rows] = causal_conv1d_step(bx[dec_rows], self.conv_w, st, backend=be)
            scatter_states(states, dec_slots, self.rec_index, st, view, xp)
        y *= bcx[:, E : 2 * E]
        x += linear(y, self.out_proj, backend=be)
        return m.ffn(x, self.ffn_norm, self.w_gate_up, self.w_down)

    def gpu_step(self, x: Any, slots: Any, cache: KVArrays) -> Any:
        """The layer on a GPU step's rows x, x updated in place and returned. `slots`: for a
        decode step (every row one token), row i's state slot (a host list, or a CUDA
        graph's device int32 buffer, where a padding row has -1); for a step with a prompt
        chunk, its rows as sequences (`gpu_hybrid.SeqRows`: `hybrid.plan_seq_rows`, the
        conv's sequence kernels). Its arrays come from the step's workspace (`rt.empty`) and
        its ops take no host values, so a graph captures it as it is."""
        from kvshare.ops import gpu_hybrid  # noqa: PLC0415 - GPU path only
        from kvshare.ops import gpu_runtime as rt  # noqa: PLC0415

        m = self.model
        be = m.backend
        cp = be.xp
        E = m.config.n_embd
        n = x.shape[0]
        h = rms_norm(x, self.attn_norm, m.config.norm_eps, backend=be)
        bcx = linear(h, self.in_proj, backend=be)  # [n, 3E]: B | C | X
        bx = rt.empty((n, E), np.float32)
        cp.multiply(bcx[:, :E], bcx[:, 2 * E :], out=bx)
        y = rt.empty((n, E), np.float32)
        conv = (gpu_hybrid.causal_conv1d_seq_slots if isinstance(slots, gpu_hybrid.SeqRows)
                else gpu_hybrid.causal_conv1d_step_slots)
        conv(bx, self.conv_w, cache.states[CONV], slots, self.rec_index, out=y)
        cp.multiply(y, bcx[:, E : 2 * E], out=y)
        x += linear(y, self.out_proj, backend=be)
        return m.ffn(x, self.ffn_norm, self.w_gate_up, self.w_down)

    def step_graph_ready(self) -> bool:
        """Whether `gpu_step` can be captured: on a GPU, with a dense FFN or experts
        that are graph-ready (`MoeFFN.graph_ready`)."""
        return self.model.backend.is_gpu and ffn_graph_ready(self.w_gate_up)


class Lfm2Model(HybridModel):
    architectures = ("lfm2",)

    def __init__(self, config: ModelConfig, loader, backend: Backend = CPU):
        super().__init__(config, backend)
        try:
            self.l_cache = int(config.extra["shortconv.l_cache"])
        except KeyError as exc:
            raise ValueError("lfm2 metadata lacks shortconv.l_cache") from exc
        if self.l_cache < 2:
            raise ValueError(f"shortconv.l_cache {self.l_cache} < 2")
        _load(self, loader)

    def state_shapes(self) -> list[tuple[int, ...]]:
        """`[conv (n_rec, L-1, n_embd)]` per slot."""
        return [(self.config.n_recurrent_layers, self.l_cache - 1, self.config.n_embd)]


def _load(model: Lfm2Model, ld: Any) -> None:
    cfg = model.config
    E = cfg.n_embd
    load_embeddings(model, ld, "token_embd_norm.weight")
    layers: list[Any] = []
    rec = 0
    attn_idx = cfg.attn_layer_index
    for il in range(cfg.n_layers):
        p = f"blk.{il}."
        if cfg.layer_kinds[il] == ATTENTION:
            layers.append(load_attention_layer(ld, cfg, il, attn_idx[il]))
            continue
        gate_up, down = load_ffn(ld, p)
        in_proj = ld.matrix([p + "shortconv.in_proj.weight"])
        conv_w = ld.host(p + "shortconv.conv.weight")
        if tuple(in_proj.shape) != (3 * E, E) or conv_w.shape != (E, model.l_cache):
            raise ValueError(f"layer {il}: short-conv weights have shapes "
                             f"{tuple(in_proj.shape)}, "
                             f"{conv_w.shape}")
        layers.append(ShortConvLayer(model, il, rec, dict(
            attn_norm=ld.get(p + "attn_norm.weight"),
            in_proj=in_proj,
            conv_w=ld.put(conv_w, keep_f32=True),
            out_proj=ld.matrix([p + "shortconv.out_proj.weight"]),
            ffn_norm=ld.get(p + "ffn_norm.weight"), w_gate_up=gate_up, w_down=down)))
        rec += 1
    model.layers = layers


def build(cfg: ModelConfig, ld: Any, be: Backend) -> Lfm2Model:
    return Lfm2Model(cfg, ld, be)
