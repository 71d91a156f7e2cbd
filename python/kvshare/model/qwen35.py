"""Qwen3.5 (`qwen35`, llama.cpp's `llama_model_qwen35` graph over `llm_build_delta_net_base`):
gated delta net layers with one gated full-attention layer every `full_attention_interval`.

Every layer: `h = RMSNorm(x, attn_norm)` -> mixer -> `x += mixer` -> `h = RMSNorm(x,
post_attention_norm)` -> SwiGLU FFN -> `x += ffn`. Norm weights are used as stored (the
converter already added Qwen's +1 to the ones that need it). Final RMSNorm `output_norm`; the
output head is tied to the embeddings when the file has no `output.weight`.

Gated delta net mixer (Dk = Dv = `ssm.state_size`, H_k = `ssm.group_count` key heads,
H_v = `ssm.time_step_rank` value heads, conv kernel K = `ssm.conv_kernel`):
- `qkv = attn_qkv @ h` (channels: q [H_k*Dk], k [H_k*Dk], v [H_v*Dv]), `z = attn_gate @ h`,
  `beta = sigmoid(ssm_beta @ h)`, `g = ssm_a * softplus(ssm_alpha @ h + ssm_dt.bias)` (ssm_a
  is stored as -exp(A_log): g <= 0 is the log-decay), all four in one fused GEMM here;
- `qkv = silu(causal_conv1d(qkv))` with the K-1 previous inputs as conv state;
- q, k L2-normalised per head (eps = rms eps), q scaled by 1/sqrt(Dk);
- gated delta rule (`kvshare.ops.gated_delta`), value head h reading key head h % H_k;
- `o = RMSNorm(o per head, ssm_norm) * silu(z)`; `ssm_out @ o`.

Full-attention mixer: `attn_q` yields, per head, the query (head_dim) followed by an output
gate (head_dim); per-head RMSNorm of q and k; rope on the first `rope.dimension_count` dims
(llama.cpp uses interleaved multi-section rope, which with text positions gives every
section the same position: plain NEOX rope); attention scaled by 1/sqrt(head_dim); output
times sigmoid(gate); `attn_output`.

State per slot (`state_shapes()`): `conv [n_rec, K-1, conv_dim]` (the last K-1 qkv
projections, oldest first) and `ssm [n_rec, H_v, Dk, Dv]` (the delta-rule matrices).

On a GPU every step runs `GatedDeltaNetLayer.gpu_step` and `gpu_attention_step` (the states
updated in place by slot: the decode kernels, or with a prompt chunk the sequence kernels;
every array from the step's workspace), which a CUDA graph of the step captures as they are
(`model.gpu_graphs`; qwen35moe's too: its shared expert's gate is formed in the
workspace).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from kvshare.backend import CPU, Backend
from kvshare.model.base import BatchPlan
from kvshare.model.kv_arrays import KVArrays
from kvshare.model.config import ATTENTION, ModelConfig
from kvshare.model.hybrid import (HybridModel, HybridRecurrentLayer, ffn_graph_ready,
                                  gather_states, l2_norm_heads, plan_seq_rows, scatter_states,
                                  sigmoid, silu, softplus, split_batch)
from kvshare.ops.attention import paged_attention, write_kv
from kvshare.ops.embedding import embedding  # noqa: F401 - re-exported for symmetry
from kvshare.ops.gated_delta import gated_delta_chunked, gated_delta_step
from kvshare.ops.linear import linear
from kvshare.ops.norm import rms_norm
from kvshare.ops.rope import apply_rope
from kvshare.ops.short_conv import causal_conv1d, causal_conv1d_step

CONV, SSM = 0, 1  # indices of the state kinds in KVArrays.states


@dataclass
class GatedAttentionLayer:
    """Qwen3.5's full-attention layer (weights `[out, in]`)."""

    index: int
    attn_index: int
    attn_norm: Any
    wqkv: Any  # [(2 n_head + 2 n_kv) * head_dim, n_embd]: q|gate interleaved per head, k, v
    wo: Any
    q_norm: Any
    k_norm: Any
    ffn_norm: Any  # post_attention_norm
    w_gate_up: Any
    w_down: Any
    rope_base: float = 10000.0  # the model's (the loader sets them): what a step graph keys
    rope_scale: float = 1.0  # its rope tables by
    window: int = 0
    sinks: Any = None
    kind: str = ATTENTION


class GatedDeltaNetLayer(HybridRecurrentLayer):
    def __init__(self, model: "Qwen35Model", index: int, rec_index: int, w: dict[str, Any]):
        super().__init__(index, rec_index, "gated delta net")
        self.model = model
        self.__dict__.update(w)

    def forward(self, x: Any, plan: BatchPlan, cache: KVArrays) -> Any:
        m = self.model
        cfg, be = m.config, m.backend
        if be.is_gpu:
            # one kernel a recurrence over the chunks' states in place: a decode step's (what
            # a CUDA graph of it replays) or, with a prompt chunk, the sequence kernels
            dec_rows, dec_slots, prefill = split_batch(plan)
            return self.gpu_step(x, plan_seq_rows(plan, cache) if prefill else dec_slots,
                                 cache)
        xp = be.xp
        eps = cfg.norm_eps
        Hk, Hv, Dk, Dv = m.n_k_heads, m.n_v_heads, m.d_k, m.d_v
        n = x.shape[0]
        kd, vd = Hk * Dk, Hv * Dv
        conv_dim = 2 * kd + vd
        dec_rows, dec_slots, prefill = split_batch(plan)
        h = rms_norm(x, self.attn_norm, eps, backend=be)
        proj = linear(h, self.w_in, backend=be)  # [n, conv_dim + vd + 2 Hv]: qkv | z | b | a
        z = proj[:, conv_dim : conv_dim + vd]
        beta = sigmoid(proj[:, conv_dim + vd : conv_dim + vd + Hv], xp)
        g = softplus(proj[:, conv_dim + vd + Hv :] + self.dt_bias, xp)
        g *= self.ssm_a
        qkv_in = proj[:, :conv_dim]
        conv_states, ssm_states = cache.states[CONV], cache.states[SSM]
        qkv = xp.empty((n, conv_dim), np.float32)
        for r0, r1, slot in prefill:
            causal_conv1d(qkv_in[r0:r1], self.conv_w, conv_states[slot, self.rec_index],
                          backend=be, out=qkv[r0:r1])
        if len(dec_slots):
            st, view = gather_states(conv_states, dec_slots, self.rec_index, xp)
            qkv[dec_rows] = causal_conv1d_step(qkv_in[dec_rows], self.conv_w, st, backend=be)
            scatter_states(conv_states, dec_slots, self.rec_index, st, view, xp)
        qkv = silu(qkv, xp)
        q = l2_norm_heads(qkv[:, :kd].reshape(n, Hk, Dk), eps, xp)
        k = l2_norm_heads(qkv[:, kd : 2 * kd].reshape(n, Hk, Dk), eps, xp)
        v = qkv[:, 2 * kd :].reshape(n, Hv, Dv)
        scale = 1.0 / float(np.sqrt(Dk))
        o = xp.empty((n, Hv, Dv), np.float32)
        for r0, r1, slot in prefill:
            o[r0:r1] = gated_delta_chunked(q[r0:r1], k[r0:r1], v[r0:r1], g[r0:r1],
                                           beta[r0:r1], ssm_states[slot, self.rec_index],
                                           scale=scale, backend=be)
        if len(dec_slots):
            st, view = gather_states(ssm_states, dec_slots, self.rec_index, xp)
            o[dec_rows] = gated_delta_step(q[dec_rows], k[dec_rows], v[dec_rows], g[dec_rows],
                                           beta[dec_rows], st, scale=scale, backend=be)
            scatter_states(ssm_states, dec_slots, self.rec_index, st, view, xp)
        rms_norm(o, self.ssm_norm, eps, backend=be, out=o)
        o *= silu(z, xp).reshape(n, Hv, Dv)
        x += linear(o.reshape(n, vd), self.ssm_out, backend=be)
        return m.ffn(x, self.ffn_norm, self.w_gate_up, self.w_down)

    def step_graph_ready(self) -> bool:
        """Whether `gpu_step` can be captured: on a GPU, with a dense FFN or experts that
        are graph-ready (`MoeFFN.graph_ready`)."""
        return self.model.backend.is_gpu and ffn_graph_ready(self.w_gate_up)

    def gpu_step(self, x: Any, slots: Any, cache: KVArrays) -> Any:
        """The layer on a GPU step's rows x, x updated in place and returned. `slots`: for a
        decode step (every row one token), row i's state slot (a host list, or a CUDA
        graph's device int32 buffer, where a padding row has -1); for a step with a prompt
        chunk, its rows as sequences (`gpu_hybrid.SeqRows`: `hybrid.plan_seq_rows`). The
        conv and delta-rule steps are one kernel each on the cache's states at the slots
        (kernels/short_conv.cu, gated_delta.cu: the decode kernels, or the sequence
        kernels, which run each sequence's rows in order), the gates, silu + q/k l2 norms
        and the output gate one kernel each (kernels/gdn_decode.cu); its arrays come from
        the step's workspace (`rt.empty`) and its ops take no host values, so a graph
        captures it as it is."""
        from kvshare.ops import gpu_hybrid  # noqa: PLC0415 - GPU path only
        from kvshare.ops import gpu_runtime as rt  # noqa: PLC0415

        m = self.model
        cfg, be = m.config, m.backend
        eps = cfg.norm_eps
        Hk, Hv, Dk, Dv = m.n_k_heads, m.n_v_heads, m.d_k, m.d_v
        n = x.shape[0]
        kd, vd = Hk * Dk, Hv * Dv
        conv_dim = 2 * kd + vd
        h = rms_norm(x, self.attn_norm, eps, backend=be)
        proj = linear(h, self.w_in, backend=be)  # [n, conv_dim + vd + 2 Hv]: qkv | z | b | a
        beta, g = gpu_hybrid.gdn_gates(proj[:, conv_dim + vd : conv_dim + vd + Hv],
                                       proj[:, conv_dim + vd + Hv :], self.dt_bias, self.ssm_a)
        qkv = rt.empty((n, conv_dim), np.float32)
        seq = isinstance(slots, gpu_hybrid.SeqRows)
        conv = gpu_hybrid.causal_conv1d_seq_slots if seq else gpu_hybrid.causal_conv1d_step_slots
        delta = gpu_hybrid.gated_delta_seq_slots if seq else gpu_hybrid.gated_delta_step_slots
        conv(proj[:, :conv_dim], self.conv_w, cache.states[CONV], slots, self.rec_index,
             out=qkv)
        gpu_hybrid.silu_l2norm_qk(qkv, Hk, Dk, eps)
        q = qkv[:, :kd].reshape(n, Hk, Dk)
        k = qkv[:, kd : 2 * kd].reshape(n, Hk, Dk)
        v = qkv[:, 2 * kd :].reshape(n, Hv, Dv)
        o = rt.empty((n, Hv, Dv), np.float32)
        delta(q, k, v, g, beta, cache.states[SSM], slots, self.rec_index,
              scale=1.0 / float(np.sqrt(Dk)), out=o)
        rms_norm(o, self.ssm_norm, eps, backend=be, out=o)
        o2 = o.reshape(n, vd)
        gpu_hybrid.mul_silu(o2, proj[:, conv_dim : conv_dim + vd])
        x += linear(o2, self.ssm_out, backend=be)
        return m.ffn(x, self.ffn_norm, self.w_gate_up, self.w_down)


class Qwen35Model(HybridModel):
    architectures = ("qwen35",)

    def __init__(self, config: ModelConfig, loader, backend: Backend = CPU):
        super().__init__(config, backend)
        ex = config.extra
        try:
            self.d_conv = int(ex["ssm.conv_kernel"])
            self.d_k = self.d_v = int(ex["ssm.state_size"])
            self.n_k_heads = int(ex["ssm.group_count"])
            self.n_v_heads = int(ex["ssm.time_step_rank"])
            d_inner = int(ex["ssm.inner_size"])
        except KeyError as exc:
            raise ValueError(f"qwen35 metadata lacks {exc}") from exc
        if d_inner != self.n_v_heads * self.d_v:
            raise ValueError(f"ssm.inner_size {d_inner} != time_step_rank * state_size")
        if self.n_v_heads % self.n_k_heads:
            raise ValueError("value heads must be a multiple of key heads")
        if config.head_dim != config.head_dim_v:
            raise ValueError("qwen35: key and value head sizes differ")
        self.conv_dim = 2 * self.n_k_heads * self.d_k + self.n_v_heads * self.d_v
        _load(self, loader)

    def load_ffn(self, ld: Any, il: int) -> tuple[Any, Any]:
        """Layer `il`'s feed-forward weights as `ffn` takes them (the MoE subclass: experts)."""
        return load_ffn(ld, f"blk.{il}.")

    def state_shapes(self) -> list[tuple[int, ...]]:
        """`[conv (n_rec, K-1, conv_dim), ssm (n_rec, H_v, Dk, Dv)]` per slot."""
        r = self.config.n_recurrent_layers
        return [(r, self.d_conv - 1, self.conv_dim), (r, self.n_v_heads, self.d_k, self.d_v)]

    def step_graphs_apply(self) -> bool:
        """Steps as CUDA graphs (`HybridModel.step_graphs_apply`), this class's gated
        attention layers taking `gpu_attention_step` there as its eager GPU steps do."""
        return self._graph_methods_kept(HybridModel.forward, Qwen35Model._attention_layer) and all(
            ffn_graph_ready(L.w_gate_up) if isinstance(L, GatedAttentionLayer)
            else self._layer_graph_ready(L) for L in self.layers)

    def _gated_qkv(self, L: GatedAttentionLayer, x: Any, cos: Any, sin: Any, slots: Any,
                   kc: Any, vc: Any) -> tuple[Any, Any]:
        """Norm, the q|gate / k / v projection, q/k norms and rope of rows x; stores their K
        and V at `slots`; returns (q `[n, H, D]`, the gate's view `[n, H, D]`)."""
        cfg, be = self.config, self.backend
        eps = cfg.norm_eps
        H, K, D = cfg.n_head, cfg.n_head_kv, cfg.head_dim
        n = x.shape[0]
        h = rms_norm(x, L.attn_norm, eps, backend=be)
        qkv = linear(h, L.wqkv, backend=be)
        qg = qkv[:, : 2 * H * D].reshape(n, H, 2 * D)
        q = rms_norm(qg[:, :, :D], L.q_norm, eps, backend=be)
        k = rms_norm(qkv[:, 2 * H * D : (2 * H + K) * D].reshape(n, K, D), L.k_norm, eps,
                     backend=be)
        v = qkv[:, (2 * H + K) * D :].reshape(n, K, D)
        apply_rope(q, cos, sin, cfg.rope_style, backend=be)
        apply_rope(k, cos, sin, cfg.rope_style, backend=be)
        write_kv(kc, vc, slots, k, v, backend=be)
        return q, qg[:, :, D:]

    def gpu_attention_step(self, L: Any, x: Any, cos: Any, sin: Any, slots: Any, kc: Any,
                           vc: Any, attend: Any, rows: Any = None) -> Any:
        """A GPU step's gated attention layer on rows x: the step a CUDA graph captures
        (`model.gpu_graphs`), which the eager step runs too. `slots`: the rows' KV slots
        (host, or a graph's device buffer); `attend(q)`: the step's paged attention of q
        (eager: the plan's tables; a graph: its static inputs). `rows`: None, or the device
        int32 rows to keep (the last layer of a step that wants some rows' logits): their
        q, gate and x are gathered before the attention, which `attend` then computes for
        those rows alone. Returns x (updated in place; the kept rows, a new array, where
        `rows` is given). Its arrays come from the step's workspace: the gate's sigmoid is
        formed in one (`hybrid.sigmoid`'s operations, with `out=`)."""
        from kvshare.ops import gpu  # noqa: PLC0415 - GPU path only
        from kvshare.ops import gpu_runtime as rt  # noqa: PLC0415

        cfg, be = self.config, self.backend
        xp = be.xp
        H, D = cfg.n_head, cfg.head_dim
        n = x.shape[0]
        q, gate_in = self._gated_qkv(L, x, cos, sin, slots, kc, vc)
        gate = rt.empty((n, H, D), np.float32)
        xp.negative(gate_in, out=gate)
        xp.exp(gate, out=gate)
        gate += 1.0
        xp.reciprocal(gate, out=gate)
        if rows is not None:
            q, gate, x = (gpu.gather_rows(a, rows) for a in (q, gate, x))
            n = x.shape[0]
        attn = attend(q)
        attn *= gate
        x += linear(attn.reshape(n, H * D), L.wo, backend=be)
        return self.ffn(x, L.ffn_norm, L.w_gate_up, L.w_down)

    def _attention_layer(self, L: Any, x: Any, plan: BatchPlan, cache: KVArrays,
                         last: bool) -> Any:
        if not isinstance(L, GatedAttentionLayer):
            return super()._attention_layer(L, x, plan, cache, last)
        cfg, be = self.config, self.backend
        kc, vc = cache.layer_kv(L.attn_index)
        if be.is_gpu:
            # the work a CUDA graph of the step replays (decode steps and steps with a prompt
            # chunk alike)
            cos, sin = self._rope(plan, L.rope_base, L.rope_scale)
            if last and plan.logit_rows.size == 0:
                self._gated_qkv(L, x, cos, sin, plan.slots, kc, vc)  # K/V stored
                return None
            if last and plan.logit_rows.size < x.shape[0]:
                kept = plan.logit_rows
                return self.gpu_attention_step(
                    L, x, cos, sin, plan.slots, kc, vc,
                    lambda q: self._attention_rows(q, kc, vc, plan, 0, kept, selected=True),
                    rows=be.asarray(kept.astype(np.int32)))
            return self.gpu_attention_step(
                L, x, cos, sin, plan.slots, kc, vc,
                lambda q: paged_attention(q, kc, vc, plan.block_tables, plan.q_starts,
                                          plan.start_positions, scale=cfg.q_scale, backend=be,
                                          mask_cache=plan.masks))
        xp = be.xp
        H, D = cfg.n_head, cfg.head_dim
        n = x.shape[0]
        cos, sin = self._rope(plan, cfg.rope_base, cfg.rope_scale)
        q, gate = self._gated_qkv(L, x, cos, sin, plan.slots, kc, vc)
        if last:
            if plan.logit_rows.size == 0:
                return None
            if plan.logit_rows.size < n:
                rows = plan.logit_rows
                attn = self._attention_rows(q, kc, vc, plan, 0, rows)
                x = x[rows]
                gate = gate[rows]
                n = len(rows)
            else:
                last = False
        if not last:
            attn = paged_attention(q, kc, vc, plan.block_tables, plan.q_starts,
                                   plan.start_positions, scale=cfg.q_scale, backend=be,
                                   mask_cache=plan.masks)
        attn *= sigmoid(gate, xp)
        x += linear(attn.reshape(n, H * D), L.wo, backend=be)
        return self.ffn(x, L.ffn_norm, L.w_gate_up, L.w_down)


def load_ffn(ld: Any, p: str) -> tuple[Any, Any]:
    names = [p + "ffn_gate.weight", p + "ffn_up.weight"]
    return ld.matrix(names), ld.matrix([p + "ffn_down.weight"])


def load_embeddings(model: HybridModel, ld: Any, output_norm: str) -> None:
    cfg = model.config
    model.tok_embd = ld.matrix(["token_embd.weight"])
    if model.tok_embd.shape != (cfg.vocab_size, cfg.n_embd):
        raise ValueError(f"token_embd has shape {model.tok_embd.shape}, expected "
                         f"{(cfg.vocab_size, cfg.n_embd)}")
    model.output_norm = ld.get(output_norm)
    if ld.has("output.weight"):
        model.output = ld.matrix(["output.weight"])
    else:
        model.output = model.tok_embd


def _load(model: Qwen35Model, ld: Any) -> None:
    cfg = model.config
    load_embeddings(model, ld, "output_norm.weight")
    H, K, D = cfg.n_head, cfg.n_head_kv, cfg.head_dim
    layers: list[Any] = []
    rec = 0
    attn_idx = cfg.attn_layer_index
    for il in range(cfg.n_layers):
        p = f"blk.{il}."
        gate_up, down = model.load_ffn(ld, il)
        if cfg.layer_kinds[il] == ATTENTION:
            names = [p + "attn_q.weight", p + "attn_k.weight", p + "attn_v.weight"]
            w = ld.matrix(names)
            if tuple(w.shape) != ((2 * H + 2 * K) * D, cfg.n_embd):
                raise ValueError(f"layer {il}: q+gate/k/v weights have {w.shape[0]} rows, "
                                 f"expected {(2 * H + 2 * K) * D}")
            layers.append(GatedAttentionLayer(
                index=il, attn_index=attn_idx[il], attn_norm=ld.get(p + "attn_norm.weight"),
                wqkv=w,
                wo=ld.matrix([p + "attn_output.weight"]),
                q_norm=ld.get(p + "attn_q_norm.weight"), k_norm=ld.get(p + "attn_k_norm.weight"),
                ffn_norm=ld.get(p + "post_attention_norm.weight"), w_gate_up=gate_up,
                w_down=down, rope_base=cfg.rope_base, rope_scale=cfg.rope_scale))
            continue
        names = [p + "attn_qkv.weight", p + "attn_gate.weight", p + "ssm_beta.weight",
                 p + "ssm_alpha.weight"]
        w_in = ld.matrix(names)
        want = model.conv_dim + model.n_v_heads * model.d_v + 2 * model.n_v_heads
        if tuple(w_in.shape) != (want, cfg.n_embd):
            raise ValueError(f"layer {il}: delta-net input projections have shape "
                             f"{tuple(w_in.shape)}, expected {(want, cfg.n_embd)}")
        conv_w = ld.host(p + "ssm_conv1d.weight")
        if conv_w.shape != (model.conv_dim, model.d_conv):
            raise ValueError(f"layer {il}: ssm_conv1d has shape {conv_w.shape}")
        layers.append(GatedDeltaNetLayer(model, il, rec, dict(
            attn_norm=ld.get(p + "attn_norm.weight"),
            w_in=w_in,
            conv_w=ld.put(conv_w, keep_f32=True),
            dt_bias=ld.get(p + "ssm_dt.bias"),
            ssm_a=ld.get(p + "ssm_a"),
            ssm_norm=ld.get(p + "ssm_norm.weight"),
            ssm_out=ld.matrix([p + "ssm_out.weight"]),
            ffn_norm=ld.get(p + "post_attention_norm.weight"),
            w_gate_up=gate_up, w_down=down)))
        rec += 1
    model.layers = layers


def build(cfg: ModelConfig, ld: Any, be: Backend) -> Qwen35Model:
    return Qwen35Model(cfg, ld, be)
