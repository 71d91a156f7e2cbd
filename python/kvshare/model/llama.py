"""The llama family: `llama`, `qwen2` and `qwen3` (llama.cpp's `llm_build_llama`,
`llm_build_qwen2`, `llm_build_qwen3`).

Per layer: RMSNorm -> Q/K/V (qwen2: with biases) -> qwen3: per-head RMSNorm of q and k ->
rope (llama: NORM style, adjacent pairs; qwen2/qwen3: NEOX style; llama 3 files may carry
`rope_freqs.weight` frequency factors) -> grouped-query attention scaled by 1/sqrt(head_dim)
-> output projection -> residual -> RMSNorm -> SwiGLU -> down -> residual. Final RMSNorm and an
output head (tied to the embeddings when the file has no `output.weight`).
"""

from __future__ import annotations

from kvshare.backend import CPU, Backend
from kvshare.model.base import DecoderModel, load_decoder
from kvshare.model.config import ModelConfig


class LlamaModel(DecoderModel):
    architectures = ("llama", "qwen2", "qwen3")

    def __init__(self, config: ModelConfig, loader, backend: Backend = CPU):
        super().__init__(config, backend)
        load_decoder(self, loader)
