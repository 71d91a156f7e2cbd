"""YaRN rope scaling: the cos and sin tables of ggml's `rope_yarn` (ggml-cpu's
`ggml_rope_cache_init` with `ext_factor` != 0), which `ops.rope.apply_rope` applies as it
applies plain ones.

Per rotated pair i (dimension i0 = 2i of n_dims): the extrapolated angle
`theta_e = pos * base^(-i0 / n_dims)`, the interpolated one `theta_i = freq_scale * theta_e`,
mixed by a ramp over the pairs `theta = theta_i (1 - r) + theta_e r`,
`r = ext_factor * (1 - clamp((i0 / 2 - low) / max(0.001, high - low), 0, 1))`, where
`[low, high]` are `ggml_rope_yarn_corr_dims` (the pairs that turn `beta_fast` resp.
`beta_slow` times over the original context); both tables are multiplied by
`mscale = attn_factor * (1 + 0.1 ln(1 / freq_scale))`, so q.k carries `mscale^2`.
Angles are formed in float64 and rounded, as `ops.rope.rope_cos_sin` forms plain ones; the
correction dims and mscale in f32, as ggml forms them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvshare.backend import CPU, Backend
from kvshare.ops._dispatch import gpu_op


@dataclass(frozen=True)
class Yarn:
    freq_scale: float  # 1 / the scaling factor
    n_ctx_orig: int  # the context the model was trained at before scaling
    ext_factor: float = 1.0
    attn_factor: float = 1.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0


def _corr_dim(n_dims: int, n_ctx_orig: int, n_rot: float, base: float) -> np.float32:
    """ggml_rope_yarn_corr_dim, in f32."""
    f32 = np.float32
    return f32(n_dims) * np.log(f32(n_ctx_orig) / (f32(n_rot) * f32(2) * f32(math.pi))) / (
        f32(2) * np.log(f32(base)))


def corr_dims(n_dims: int, n_ctx_orig: int, base: float, beta_fast: float,
              beta_slow: float) -> tuple[float, float]:
    """ggml_rope_yarn_corr_dims: the first and last pair index of the ramp."""
    start = math.floor(_corr_dim(n_dims, n_ctx_orig, beta_fast, base))
    end = math.ceil(_corr_dim(n_dims, n_ctx_orig, beta_slow, base))
    return float(max(0, start)), float(min(n_dims - 1, end))


def mscale(y: Yarn) -> np.float32:
    """The factor both tables carry (ggml's `rope_yarn` mscale)."""
    m = np.float32(y.attn_factor)
    if y.ext_factor != 0.0:
        m = m * (np.float32(1.0) + np.float32(0.1) * np.log(np.float32(1.0) /
                                                              np.float32(y.freq_scale)))
    return np.float32(m)


def pair_factors(n_rot: int, base: float, y: Yarn) -> tuple[np.ndarray, np.ndarray,
                                                             np.ndarray, float, float]:
    """The per-pair constants of the tables, float64 `[n_rot // 2]` each: (inv_freq, keep,
    mix, freq_scale, mscale), where `theta = theta_e * freq_scale * keep + theta_e * mix`
    (keep = 1 - mix; ext_factor 0: keep 1, mix 0)."""
    i0 = np.arange(0, n_rot, 2, dtype=np.float64)
    inv = base ** (-i0 / n_rot)
    mix = np.zeros_like(inv)
    if y.ext_factor != 0.0:
        low, high = corr_dims(n_rot, y.n_ctx_orig, base, y.beta_fast, y.beta_slow)
        ramp = 1.0 - np.clip((i0 / 2 - low) / max(0.001, high - low), 0.0, 1.0)
        mix = ramp * y.ext_factor
    return inv, 1.0 - mix, mix, float(np.float32(y.freq_scale)), float(mscale(y))


def yarn_cos_sin(positions: Any, n_rot: int, base: float, y: Yarn, *,
                 backend: Backend = CPU) -> tuple[Any, Any]:
    """cos and sin tables, each float32 `[N, n_rot // 2]`, for integer `positions` `[N]`
    (module docstring). On the GPU they are computed there, from device positions too (a
    captured step's: `kvshare.ops.gpu.rope_cos_sin_yarn`, the same float64 roundings)."""
    inv, keep, mix, fs, m = pair_factors(n_rot, base, y)
    if backend.is_gpu:
        return gpu_op("rope_cos_sin_yarn")(positions, inv, keep, mix, fs, m)
    pos = np.asarray(backend.to_host(positions), dtype=np.float64)
    theta_e = pos[:, None] * inv[None, :]
    theta_i = theta_e * fs
    theta = theta_i
    if y.ext_factor != 0.0:
        theta = theta_i * keep[None, :] + theta_e * mix[None, :]
    cos = (np.cos(theta) * m).astype(np.float32)
    sin = (np.sin(theta) * m).astype(np.float32)
    return cos, sin
