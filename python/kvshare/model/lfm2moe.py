"""LFM2 MoE (`lfm2moe`, llama.cpp's `llama_model_lfm2moe` graph): the lfm2 hybrid
(`kvshare.model.lfm2`: short-conv and attention layers) whose feed-forward block, in every
layer from `leading_dense_block_count` on, is a mixture of experts: the router's
probabilities by the file's `expert_gating_func` (LFM2-8B-A1B: sigmoid), the top
`expert_used_count` of `expert_count` picked by probability plus the layer's selection bias
`exp_probs_b` and weighted by their unbiased probabilities over their sum, SwiGLU experts, no
shared expert (`kvshare.model.moe`). The leading layers keep lfm2's dense SwiGLU FFN."""

from __future__ import annotations

from typing import Any

from kvshare.backend import CPU, Backend
from kvshare.model.base import AttentionLayer
from kvshare.model.config import ModelConfig
from kvshare.model.lfm2 import Lfm2Model
from kvshare.model.moe import MoeFFN, load_moe
from kvshare.model.qwen3moe import _WithoutDenseFFN, with_experts
from kvshare.ops.norm import rms_norm


class Lfm2MoeModel(Lfm2Model):
    architectures = ("lfm2moe",)

    def __init__(self, config: ModelConfig, loader: Any, backend: Backend = CPU):
        # the MoE layers have no dense ffn_gate / ffn_up / ffn_down: lfm2's loading leaves
        # them None and the experts are loaded here
        super().__init__(config, _WithoutDenseFFN(loader), backend)
        lead = int(config.extra.get("leading_dense_block_count", 0))
        if not 0 <= lead <= config.n_layers:
            raise ValueError(f"lfm2moe: leading_dense_block_count {lead} outside "
                             f"0..{config.n_layers}")
        for il in range(lead, config.n_layers):
            L = self.layers[il]
            moe = load_moe(loader, config, il)
            if isinstance(L, AttentionLayer):
                self.layers[il] = with_experts(L, moe)
            else:
                L.w_gate_up, L.w_down = moe, None

    def ffn(self, x: Any, norm: Any, w_gate_up: Any, w_down: Any) -> Any:
        """A short-conv layer's FFN: `x += experts(RMSNorm(x, norm))` in place where
        `w_gate_up` is the layer's `MoeFFN`, lfm2's dense FFN otherwise."""
        if not isinstance(w_gate_up, MoeFFN):
            return super().ffn(x, norm, w_gate_up, w_down)
        x += w_gate_up(rms_norm(x, norm, self.config.norm_eps, backend=self.backend))
        return x
