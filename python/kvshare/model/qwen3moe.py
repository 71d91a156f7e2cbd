"""Qwen3 MoE (`qwen3moe`, llama.cpp's `llama_model_qwen3moe` graph): the qwen3 layer with a
mixture of experts for its feed-forward block.

Per layer: RMSNorm -> Q/K/V -> per-head RMSNorm of q and k -> NEOX rope -> grouped-query
attention scaled by 1/sqrt(head_dim) -> output projection -> residual -> RMSNorm -> experts
(softmax router, top `expert_used_count` of `expert_count`, weights renormalised to sum 1,
SwiGLU experts of `expert_feed_forward_length`; `kvshare.model.moe`) -> residual. Final
RMSNorm and an output head (tied to the embeddings when the file has no `output.weight`).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from kvshare.backend import CPU, Backend
from kvshare.model.base import AttentionLayer, DecoderModel, load_decoder
from kvshare.model.config import ModelConfig
from kvshare.model.moe import MoeFFN, load_moe


@dataclass
class MoeAttentionLayer(AttentionLayer):
    """An attention layer whose feed-forward block is `moe` (w_gate_up / w_down are None, so
    the fused decode path, whose layers are dense, leaves it alone)."""

    moe: MoeFFN | None = None


def with_experts(L: AttentionLayer, moe: MoeFFN) -> MoeAttentionLayer:
    """Dense layer `L` as loaded, with `moe` for its feed-forward block."""
    return MoeAttentionLayer(**{**{f.name: getattr(L, f.name) for f in fields(AttentionLayer)},
                                "moe": moe})


class _WithoutDenseFFN:
    """A `WeightLoader` as `load_attention_layer` sees it for a MoE layer: the dense
    ffn_gate / ffn_up / ffn_down it asks for are the layer's experts, loaded apart."""

    _DENSE = ("ffn_gate.weight", "ffn_down.weight")

    def __init__(self, ld: Any):
        self._ld = ld

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ld, name)

    def matrix(self, names: list[str]) -> Any:
        if names[0].endswith(self._DENSE) and not self._ld.has(names[0]):
            return None
        return self._ld.matrix(names)


class Qwen3MoeModel(DecoderModel):
    architectures = ("qwen3moe",)

    def __init__(self, config: ModelConfig, loader: Any, backend: Backend = CPU):
        super().__init__(config, backend)
        load_decoder(self, _WithoutDenseFFN(loader))
        layers = []
        for L in self.layers:
            layers.append(with_experts(L, load_moe(loader, config, L.index)))
        self.layers = layers
