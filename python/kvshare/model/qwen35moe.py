"""Qwen3.5 MoE (`qwen35moe`, llama.cpp's `llama_model_qwen35moe` graph): the qwen35 hybrid
(`kvshare.model.qwen35`: gated delta net layers, a gated attention layer every
`full_attention_interval`) whose every feed-forward block is a mixture of experts: softmax
router, top `expert_used_count` of `expert_count` renormalised to sum 1, SwiGLU experts, plus
a shared SwiGLU expert scaled by `sigmoid(ffn_gate_inp_shexp . h)` and added to their sum
(`kvshare.model.moe`)."""

from __future__ import annotations

from typing import Any

from kvshare.model.moe import MoeFFN, load_moe
from kvshare.model.qwen35 import Qwen35Model
from kvshare.ops.norm import rms_norm


class Qwen35MoeModel(Qwen35Model):
    architectures = ("qwen35moe",)

    def load_ffn(self, ld: Any, il: int) -> tuple[Any, Any]:
        return load_moe(ld, self.config, il), None

    def ffn(self, x: Any, norm: Any, w_gate_up: Any, w_down: Any) -> Any:
        """`x += experts(RMSNorm(x, norm))` in place (`w_gate_up` is the layer's `MoeFFN`)."""
        if not isinstance(w_gate_up, MoeFFN):
            return super().ffn(x, norm, w_gate_up, w_down)
        x += w_gate_up(rms_norm(x, norm, self.config.norm_eps, backend=self.backend))
        return x
