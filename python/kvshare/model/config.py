"""`ModelConfig`: the hyper-parameters of a model, read from GGUF metadata the way llama.cpp's
`llama_model::load_hparams` reads them for the architectures kvshare supports."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvshare.model.gguf_file import GGUFError

ATTENTION = "attention"
RECURRENT = "recurrent"

# llama.cpp's llama_model_rope_type(): NEOX rotates pairs (i, i + n_rot/2), NORM rotates
# adjacent pairs (2i, 2i + 1) (the converter permutes llama's Q/K weights to match).
ROPE_NEOX = "neox"
ROPE_NORM = "norm"
_ROPE_STYLE = {"gemma3": ROPE_NEOX, "qwen2": ROPE_NEOX, "qwen3": ROPE_NEOX, "qwen3moe": ROPE_NEOX,
               "llama": ROPE_NORM}


@dataclass(frozen=True)
class ModelConfig:
    arch: str
    n_layers: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int  # key length per head
    head_dim_v: int  # value length per head
    n_ff: int
    vocab_size: int
    norm_eps: float
    context_length: int
    rope_base: float  # global (full-attention) layers
    rope_base_swa: float  # sliding-window layers
    rope_scale: float = 1.0  # ggml freq_scale: position multiplier (1 / linear scaling factor)
    rope_scale_swa: float = 1.0  # the same for sliding-window layers
    rope_dim: int = 0  # rotated dimensions per head (n_rot); 0 -> head_dim
    rope_style: str = ROPE_NEOX
    sliding_window: int = 0  # tokens a sliding-window query sees, itself included (0: none)
    layer_kinds: tuple[str, ...] = ()  # ATTENTION or RECURRENT, per layer
    layer_windows: tuple[int, ...] = ()  # per layer: 0 = full causal, else the window size
    attn_scale: float = 0.0  # multiplier of q.k; 0 -> 1/sqrt(head_dim)
    embed_scale: float = 1.0  # multiplier of token embeddings (Gemma: sqrt(n_embd))
    activation: str = "silu"  # "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
    tied_embeddings: bool = False
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def n_attn_layers(self) -> int:
        return sum(k == ATTENTION for k in self.layer_kinds)

    @property
    def n_recurrent_layers(self) -> int:
        return sum(k == RECURRENT for k in self.layer_kinds)

    @property
    def attn_layer_index(self) -> tuple[int, ...]:
        """Per layer: its index among attention layers (its slot in the KV array), or -1."""
        out, i = [], 0
        for k in self.layer_kinds:
            out.append(i if k == ATTENTION else -1)
            i += k == ATTENTION
        return tuple(out)

    @property
    def n_rot(self) -> int:
        return self.rope_dim or self.head_dim

    @property
    def q_scale(self) -> float:
        return self.attn_scale or 1.0 / math.sqrt(self.head_dim)

    def layer_rope_base(self, il: int) -> float:
        return self.rope_base_swa if self.layer_windows[il] else self.rope_base

    def layer_rope_scale(self, il: int) -> float:
        return self.rope_scale_swa if self.layer_windows[il] else self.rope_scale


def _get(md: dict[str, Any], key: str, default: Any = ...) -> Any:
    if key in md:
        return md[key]
    if default is ...:
        raise GGUFError(f"model metadata lacks {key!r}")
    return default


def _per_layer(value: Any, n_layers: int) -> list[int]:
    if isinstance(value, list):
        if len(value) != n_layers:
            raise GGUFError(f"per-layer metadata has {len(value)} entries for {n_layers} layers")
        return [int(v) for v in value]
    return [int(value)] * n_layers


def _swa_windows(md: dict[str, Any], p: str, default_pattern: int, n_layers: int,
                 sliding: int) -> list[int]:
    """Each layer's window (0: full attention) from `attention.sliding_window_pattern`: a
    per-layer list, or n (llama.cpp's set_swa_pattern: layer il is sliding-window unless
    il % n == n - 1; 0: every layer)."""
    pattern = md.get(p + "attention.sliding_window_pattern", default_pattern)
    if isinstance(pattern, list):
        is_swa = [bool(v) for v in pattern]
    else:
        n = int(pattern)
        is_swa = [n == 0 or il % n < n - 1 for il in range(n_layers)]
    return [sliding if s else 0 for s in is_swa]


def _rope_scale(md: dict[str, Any], p: str) -> float:
    """The position scale of linear rope scaling (1.0: none); other kinds are refused."""
    scaling_type = md.get(p + "rope.scaling.type", "none")
    factor = float(md.get(p + "rope.scaling.factor", 0.0) or 0.0)
    if scaling_type == "linear" and factor > 0:
        return 1.0 / factor
    if scaling_type not in ("none", "linear") and factor not in (0.0, 1.0):
        raise GGUFError(f"rope scaling type {scaling_type!r} is not supported")
    return 1.0


def config_from_metadata(md: dict[str, Any]) -> ModelConfig:
    arch = str(_get(md, "general.architecture"))
    p = arch + "."
    n_layers = int(_get(md, p + "block_count"))
    n_embd = int(_get(md, p + "embedding_length"))
    heads = _per_layer(_get(md, p + "attention.head_count"), n_layers)
    heads_kv = _per_layer(_get(md, p + "attention.head_count_kv", heads), n_layers)
    n_head = max(heads)
    attn_kv = [h for h in heads_kv if h > 0]
    n_head_kv = max(attn_kv) if attn_kv else 0
    head_dim = int(_get(md, p + "attention.key_length", n_embd // max(n_head, 1)))
    head_dim_v = int(_get(md, p + "attention.value_length", head_dim))
    n_ff = _get(md, p + "feed_forward_length", 0)
    n_ff = max(n_ff) if isinstance(n_ff, list) else int(n_ff)
    tokens = md.get("tokenizer.ggml.tokens")
    vocab = int(md.get(p + "vocab_size", len(tokens) if tokens else 0))
    eps = float(_get(md, p + "attention.layer_norm_rms_epsilon", 1e-6))
    ctx = int(_get(md, p + "context_length", 4096))
    rope_base = float(_get(md, p + "rope.freq_base", 10000.0))
    rope_dim = int(_get(md, p + "rope.dimension_count", head_dim))
    rope_scale = 1.0 if arch == "gpt-oss" else _rope_scale(md, p)
    kinds = [ATTENTION if h > 0 else RECURRENT for h in heads_kv]
    windows = [0] * n_layers
    sliding = int(md.get(p + "attention.sliding_window", 0) or 0)
    kw: dict[str, Any] = {}
    if arch == "gemma3":
        # llama.cpp: swa_type STANDARD, set_swa_pattern(6): layer il is sliding-window unless
        # il % 6 == 5; sliding-window layers use rope base 10000 and scale 1.
        windows = _swa_windows(md, p, 6, n_layers, sliding)
        kw.update(
            rope_base_swa=float(md.get(p + "rope.freq_base_swa", 10000.0)),
            attn_scale=1.0 / math.sqrt(head_dim),  # query_pre_attn_scalar (27B differs)
            embed_scale=math.sqrt(n_embd),
            activation="gelu_tanh",
        )
        if n_layers == 62:  # Gemma 3 27B: 1/sqrt(n_embd / n_head)
            kw["attn_scale"] = 1.0 / math.sqrt(n_embd / n_head)
    elif arch in ("llama", "qwen2", "qwen3", "qwen3moe"):
        kw.update(rope_base_swa=rope_base, rope_scale_swa=rope_scale, activation="silu")
        if arch == "qwen3moe":
            kw["extra"] = _moe_extra(md, p)
        if sliding and arch == "qwen2" and md.get(p + "attention.use_sliding_window"):
            raise GGUFError("qwen2 sliding-window attention is not supported")
    elif arch in ("qwen35", "qwen35moe", "lfm2", "lfm2moe"):
        # hybrid models (kvshare.model.qwen35 / lfm2): recurrent-layer hyper-parameters go to
        # `extra`. qwen35's recurrent layers are the ones llama.cpp marks: an explicit
        # `attention.recurrent_layers` array, else every layer but each
        # `full_attention_interval`-th one (default 4). Its multi-section rope ("imrope")
        # gives every section the same position for text, which is plain NEOX rope.
        kw.update(rope_base_swa=rope_base, rope_scale_swa=rope_scale, activation="silu",
                  extra=_hybrid_extra(md, p))
        if arch in ("qwen35moe", "lfm2moe"):
            kw["extra"].update(_moe_extra(md, p))
        if arch in ("qwen35", "qwen35moe"):
            rec = md.get(p + "attention.recurrent_layers")
            if isinstance(rec, list) and len(rec) == n_layers:
                is_rec = [bool(v) for v in rec]
            else:
                interval = int(md.get(p + "full_attention_interval", 4) or 4)
                is_rec = [(il + 1) % interval != 0 for il in range(n_layers)]
            kinds = [RECURRENT if r else ATTENTION for r in is_rec]
    elif arch == "gpt-oss":
        windows, rope_scale, gkw = _gpt_oss(md, p, n_layers, sliding, rope_base, rope_dim, ctx)
        kw.update(gkw)
    else:
        kw.update(rope_base_swa=rope_base, rope_scale_swa=rope_scale)
    return ModelConfig(
        arch=arch, n_layers=n_layers, n_embd=n_embd, n_head=n_head, n_head_kv=n_head_kv,
        head_dim=head_dim, head_dim_v=head_dim_v, n_ff=n_ff, vocab_size=vocab, norm_eps=eps,
        context_length=ctx, rope_base=rope_base, rope_scale=rope_scale, rope_dim=rope_dim,
        rope_style=_ROPE_STYLE.get(arch, ROPE_NEOX), sliding_window=sliding,
        layer_kinds=tuple(kinds), layer_windows=tuple(windows), **kw,
    )


def _gpt_oss(md: dict[str, Any], p: str, n_layers: int, sliding: int, rope_base: float,
             rope_dim: int, ctx: int) -> tuple[list[int], float, dict[str, Any]]:
    """gpt-oss's layer windows, rope scale and the rest of its config, as llama.cpp's
    llama_model_openai_moe reads them: swa_type STANDARD, set_swa_pattern(2) (layer il is
    sliding-window when il % 2 == 0) unless the file has a pattern; the window layers' rope
    base from rope.freq_base_swa (default the global one), the same scale; q.k scaled by
    1/sqrt(n_rot); experts only, no dense FFN."""
    windows = _swa_windows(md, p, 2, n_layers, sliding)
    yarn = _yarn(md, p, ctx)
    rope_scale = yarn["freq_scale"] if yarn else _rope_scale(md, p)
    extra = _moe_extra(md, p)
    if yarn:
        extra["yarn"] = yarn
    return windows, rope_scale, dict(
        rope_base_swa=float(md.get(p + "rope.freq_base_swa", rope_base)),
        rope_scale_swa=rope_scale, attn_scale=1.0 / math.sqrt(rope_dim),
        activation="swiglu_oai", extra=extra)


def _yarn(md: dict[str, Any], p: str, ctx: int) -> dict[str, Any] | None:
    """YaRN rope scaling's parameters as llama.cpp sets them for an architecture that reads
    none of the `rope.scaling.yarn_*` keys (gpt-oss), or None when the file asks for no
    YaRN: `freq_scale` (1 / factor), `n_ctx_orig` (`rope.scaling.original_context_length`,
    else the context length), `ext_factor` 1, `beta_fast` 32, `beta_slow` 1, and
    `attn_factor`, llama_context's `yarn_attn_factor`: (0.1 ln(factor) + 1), divided by
    itself again (ggml's rope multiplies that factor back in), times
    `rope.scaling.attn_factor`; formed in f32 as llama.cpp forms it."""
    if md.get(p + "rope.scaling.type", "linear") != "yarn":
        return None
    factor = float(md.get(p + "rope.scaling.factor", 0.0) or 0.0)
    freq_scale = np.float32(1.0) if factor == 0.0 else np.float32(1.0) / np.float32(factor)
    f = np.float32(1.0) / freq_scale
    attn = np.float32(1.0)
    if f > 1.0:
        attn = np.float32(0.1) * np.log(f) + np.float32(1.0)
    attn = attn * (np.float32(1.0) / (np.float32(1.0) + np.float32(0.1) * np.log(f)))
    attn = attn * np.float32(md.get(p + "rope.scaling.attn_factor", 1.0))
    return dict(freq_scale=float(freq_scale), ext_factor=1.0, attn_factor=float(attn),
                beta_fast=32.0, beta_slow=1.0,
                n_ctx_orig=int(md.get(p + "rope.scaling.original_context_length", ctx)))


def _moe_extra(md: dict[str, Any], p: str) -> dict[str, Any]:
    """The experts' metadata of a mixture-of-experts architecture (`kvshare.model.moe`), keyed
    without the architecture prefix."""
    keys = ("expert_count", "expert_used_count", "expert_feed_forward_length",
            "expert_shared_feed_forward_length", "leading_dense_block_count",
            "expert_gating_func")
    out = {k: int(md[p + k]) for k in keys if p + k in md}
    for k in ("expert_count", "expert_used_count"):
        if not out.get(k):
            raise GGUFError(f"{p[:-1]} metadata lacks {p + k!r}")
    return out


def _hybrid_extra(md: dict[str, Any], p: str) -> dict[str, Any]:
    """Recurrent-layer metadata of the hybrid architectures (qwen35 `ssm.*`, lfm2
    `shortconv.l_cache`), keyed without the architecture prefix."""
    keys = ("ssm.conv_kernel", "ssm.state_size", "ssm.group_count", "ssm.time_step_rank",
            "ssm.inner_size", "shortconv.l_cache", "full_attention_interval")
    return {k: int(md[p + k]) for k in keys if p + k in md}
