"""Gemma 3 (llama.cpp's `llm_build_gemma3<iswa=true>`).

Per layer: RMSNorm -> Q/K/V -> per-head RMSNorm of q and k -> rope (NEOX; sliding-window
layers base 10000, every 6th layer (il % 6 == 5) global with the file's base, 1e6 for the
270M model) -> q scaled by 1/sqrt(head_dim) -> attention (sliding-window layers: window 512,
the query's own token included) -> output projection -> post-attention RMSNorm -> residual ->
RMSNorm -> GeGLU (tanh GELU of the gate times up) -> down -> post-FFN RMSNorm -> residual.
Embeddings are scaled by sqrt(n_embd); norm weights are used as stored (the converter already
added Gemma's +1); the output head is tied to the embeddings; no logit soft-capping.
"""

from __future__ import annotations

from kvshare.backend import CPU, Backend
from kvshare.model.base import DecoderModel, load_decoder
from kvshare.model.config import ModelConfig


class Gemma3Model(DecoderModel):
    architectures = ("gemma3",)

    def __init__(self, config: ModelConfig, loader, backend: Backend = CPU):
        super().__init__(config, backend)
        load_decoder(self, loader)
        for layer in self.layers:
            if layer.q_norm is None or layer.post_attn_norm is None:
                raise ValueError(f"gemma3 layer {layer.index} lacks q/k or post norms")
