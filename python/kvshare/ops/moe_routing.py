"""A mixture-of-experts router's choice: `Routing` (how a layer picks and weighs experts, from
its GGUF metadata) and `route` (router logits to each token's experts and weights, as
llama.cpp's build_moe_ffn does: softmax / sigmoid / softmax-of-the-selected gating, top k,
normalized and scaled). Shared by the CPU (`ops.moe`) and GPU (`ops.gpu_moe`) expert paths."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from kvshare.backend import CPU, Backend

__all__ = ["GATINGS", "Routing", "route"]

GATINGS = ("softmax", "sigmoid", "softmax_weight")
# ggml clamps the sum of the selected weights to the smallest normal f16 before dividing
_MIN_WEIGHT_SUM = np.float32(6.103515625e-5)


@dataclass(frozen=True)
class Routing:
    """How a layer's router picks and weighs experts."""

    n_expert: int
    k: int  # experts per token (`expert_used_count`)
    gating: str = "softmax"
    norm: bool = True  # divide the k weights by their sum
    scale: float = 0.0  # multiply the weights by this (0 and 1: unchanged)

    def __post_init__(self) -> None:
        if self.gating not in GATINGS:
            raise ValueError(f"gating {self.gating!r}: expected one of {', '.join(GATINGS)}")
        if not 0 < self.k <= self.n_expert:
            raise ValueError(f"{self.k} experts per token out of {self.n_expert}")


def _softmax_rows(x: Any, xp: Any) -> Any:
    """ggml_soft_max of f32 rows: exp(x - max), divided by the row's sum."""
    e = xp.exp(x - x.max(axis=1, keepdims=True))
    s = e.sum(axis=1, keepdims=True, dtype=xp.float64)
    e *= (1.0 / s).astype(xp.float32)
    return e


def _top_k(scores: Any, k: int, xp: Any) -> Any:
    """Per row, the indices of the k largest scores, largest first (ties: lower index)."""
    if k == 1:
        return scores.argmax(axis=1)[:, None]
    return xp.argsort(-scores, axis=1, kind="stable")[:, :k]


def route(logits: Any, routing: Routing, *, backend: Backend = CPU,
          selection_bias: Any = None) -> tuple[Any, Any]:
    """The experts of each token and their weights: `(ids int64 [N, k], weights f32 [N, k])`,
    slot 0 the most probable expert. `logits`: f32 `[N, n_expert]`, the router's output.
    `selection_bias` (`[n_expert]`, LFM2 MoE's `exp_probs_b`): added to the probabilities to
    pick the experts only; the weights are the unbiased probabilities."""
    xp = backend.xp
    logits = logits.astype(xp.float32, copy=False)
    if logits.ndim != 2 or logits.shape[1] != routing.n_expert:
        raise ValueError(f"router logits must be [N, {routing.n_expert}], got {logits.shape}")
    if routing.gating == "softmax":
        probs = _softmax_rows(logits, xp)
    elif routing.gating == "sigmoid":
        probs = 1.0 / (1.0 + xp.exp(-logits))
    else:
        probs = logits
    scores = probs if selection_bias is None else probs + selection_bias
    ids = _top_k(scores, routing.k, xp)
    w = xp.take_along_axis(probs, ids, axis=1)
    if routing.gating == "softmax_weight":
        w = _softmax_rows(w, xp)
    if routing.norm:
        s = xp.maximum(w.sum(axis=1, keepdims=True, dtype=xp.float64).astype(xp.float32),
                       _MIN_WEIGHT_SUM)
        w = w / s
    if routing.scale not in (0.0, 1.0):
        w = w * xp.float32(routing.scale)
    return ids.astype(xp.int64, copy=False), w.astype(xp.float32, copy=False)
