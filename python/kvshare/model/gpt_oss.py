"""gpt-oss (GGUF arch `gpt-oss`, llama.cpp's `llama_model_openai_moe` graph).

Per layer: RMSNorm (`attn_norm`) -> Q/K/V with biases -> NEOX rope (YaRN scaled where the
file says `rope.scaling.type = yarn`, as gpt-oss GGUFs do: `kvshare.ops.rope_yarn`) ->
grouped-query attention scaled by 1/sqrt(n_rot) with the layer's learned sinks
(`attn_sinks [n_head]`, one extra logit per head in the softmax's denominator), over a
sliding window of `attention.sliding_window` tokens in the layers llama.cpp's pattern 2 marks
(il % 2 == 0) and over every earlier token in the others -> output projection with bias ->
residual -> RMSNorm (`post_attention_norm`) -> experts -> residual. The experts
(`kvshare.model.moe`): router with bias, the top `expert_used_count` by router logit weighted
by the softmax of those logits, gate/up/down products with per-expert biases, and the
clamped SwiGLU `swiglu_oai` (alpha 1.702, limit 7), on the CPU in their MXFP4 blocks through
the grouped kernels (`ops.moe.moe_ffn_grouped`). Final RMSNorm, output head.

Attention with sinks runs the compiled kernel of `ops.attention` (`_core.paged_attention`,
decode rows and prefill tiles, f32, f16 and q8_0 pools) on the CPU, and the GPU paged
attention (kernels/paged_attention.cu: the sink joins the merged denominator in
`paged_attn_combine`) on a GPU, where the experts take the grouped kernels
(`ops.gpu_moe`, MXFP4 blocks or f16 by `KVSHARE_GPU_WEIGHTS`, routed on the device). Its
steps are CUDA graphs there (`model.gpu_graphs`): the YaRN tables come from the step's device
positions (`_rope_tables`, `ops.gpu.rope_cos_sin_yarn`).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import numpy as np

from kvshare.backend import CPU, Backend
from kvshare.model.base import AttentionLayer, DecoderModel, load_decoder
from kvshare.model.config import ModelConfig
from kvshare.model.moe import load_moe
from kvshare.model.qwen3moe import _WithoutDenseFFN
from kvshare.ops.rope_yarn import Yarn, yarn_cos_sin


@dataclass
class GptOssLayer(AttentionLayer):
    """An attention layer with sinks, an output bias and experts for its FFN (w_gate_up /
    w_down are None, so the fused decode path, whose layers have a dense FFN, leaves it
    alone: `fused.layer_args`); `sinks`, `bo` and `moe` are AttentionLayer's fields."""


class _GptOssNames(_WithoutDenseFFN):
    """A `WeightLoader` as `load_attention_layer` sees it for a gpt-oss layer: its pre-FFN
    norm is `post_attention_norm` (read as the FFN norm, not as a norm of the attention
    output), and the dense FFN it asks for is absent (the experts are loaded apart)."""

    def _name(self, name: str) -> str:
        if name.endswith(".ffn_norm.weight"):
            return name[: -len("ffn_norm.weight")] + "post_attention_norm.weight"
        return name

    def has(self, name: str) -> bool:
        if name.endswith(".post_attention_norm.weight"):
            return False
        return self._ld.has(self._name(name))

    def get(self, name: str, *args: Any, **kw: Any) -> Any:
        return self._ld.get(self._name(name), *args, **kw)


class GptOssModel(DecoderModel):
    architectures = ("gpt-oss",)

    def __init__(self, config: ModelConfig, loader: Any, backend: Backend = CPU):
        super().__init__(config, backend)
        yarn = config.extra.get("yarn")
        self.yarn = Yarn(**{k: yarn[k] for k in ("freq_scale", "n_ctx_orig", "ext_factor",
                                                 "attn_factor", "beta_fast", "beta_slow")}
                         ) if yarn else None
        load_decoder(self, _GptOssNames(loader))
        layers = []
        for L in self.layers:
            p = f"blk.{L.index}."
            sinks = np.asarray(loader.host(p + "attn_sinks.weight"), np.float32).reshape(-1)
            if sinks.shape != (config.n_head,):
                raise ValueError(f"layer {L.index}: attn_sinks has {sinks.size} values, "
                                 f"expected {config.n_head}")
            bo = (np.asarray(loader.host(p + "attn_output.bias"), np.float32).reshape(-1)
                  if loader.has(p + "attn_output.bias") else None)
            if backend.is_gpu:  # the GPU ops read both from device memory
                sinks = backend.asarray(sinks)
                bo = None if bo is None else backend.asarray(bo)
            layers.append(GptOssLayer(**{
                **{f.name: getattr(L, f.name) for f in fields(AttentionLayer)},
                "sinks": sinks, "bo": bo, "moe": load_moe(loader, config, L.index, "swiglu_oai")}))
        self.layers = layers

    def _rope_tables(self, positions: Any, base: float, scale: float) -> tuple[Any, Any]:
        if self.yarn is None:
            return super()._rope_tables(positions, base, scale)
        return yarn_cos_sin(positions, self.config.n_rot, base, self.yarn, backend=self.backend)
