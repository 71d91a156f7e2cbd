"""Rope (NEOX and NORM styles) against a complex-number reference."""

import numpy as np
import pytest

from kvshare.ops.rope import NEOX, NORM, apply_rope, rope_cos_sin


def _reference(x, pos, n_rot, base, scale, style, factors=None):
    x = x.astype(np.float64).copy()
    half = n_rot // 2
    inv = base ** (-np.arange(half) * 2.0 / n_rot)
    if factors is not None:
        inv = inv / factors
    for t in range(x.shape[0]):
        ang = pos[t] * scale * inv
        if style == "neox":
            a, b = x[t, :, :half], x[t, :, half:n_rot]
        else:
            a, b = x[t, :, 0:n_rot:2], x[t, :, 1:n_rot:2]
        z = (a + 1j * b) * np.exp(1j * ang)
        a[...], b[...] = z.real, z.imag
    return x


@pytest.mark.parametrize("style", ["neox", "norm"])
@pytest.mark.parametrize("n_rot", [16, 8])
def test_rope_matches_reference(style, n_rot):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 3, 16)).astype(np.float32)
    pos = np.array([0, 1, 7, 300, 4096])
    factors = rng.uniform(1, 4, n_rot // 2) if n_rot == 8 else None
    cos, sin = rope_cos_sin(pos, n_rot, 10000.0, 0.5, factors)
    got = apply_rope(x.copy(), cos, sin, style)
    ref = _reference(x, pos, n_rot, 10000.0, 0.5, style, factors)
    np.testing.assert_allclose(got, ref, rtol=2e-5, atol=2e-5)
    np.testing.assert_array_equal(got[..., n_rot:], x[..., n_rot:])


def test_rope_on_strided_view_in_place():
    rng = np.random.default_rng(1)
    fused = rng.standard_normal((4, 3 * 8)).astype(np.float32)
    view = fused[:, 8:16].reshape(4, 1, 8)
    expect = _reference(view.copy(), np.arange(4), 8, 100.0, 1.0, "neox")
    cos, sin = rope_cos_sin(np.arange(4), 8, 100.0)
    apply_rope(view, cos, sin, "neox")
    np.testing.assert_allclose(fused[:, 8:16].reshape(4, 1, 8), expect, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("style", [NEOX, NORM])
@pytest.mark.parametrize("n", [1, 5, 32, 33])
def test_norm_and_rope_is_the_two_ops_bit_for_bit(style, n):
    """The fused decode loop (<= 32 rows) and the fallback (more) give exactly what
    `rms_norm` then `apply_rope` give, on heads inside a fused QKV row (strided views), with
    and without a norm weight, partial rotation included."""
    from kvshare.ops.norm import rms_norm
    from kvshare.ops.rope import norm_and_rope

    rng = np.random.default_rng(n)
    for H, D, n_rot, weighted in [(4, 256, 256, True), (16, 128, 64, True), (3, 64, 64, False)]:
        qkv = (rng.standard_normal((n, (H + 2) * D)) * 7).astype(np.float32)
        x = qkv[:, D : D + H * D].reshape(n, H, D)  # a strided view
        w = rng.standard_normal(D).astype(np.float32) if weighted else None
        cos, sin = rope_cos_sin(np.arange(50, 50 + n), n_rot, 10000.0)
        want = x.copy()
        if w is not None:
            rms_norm(want, w, 1e-6, out=want)
        apply_rope(want, cos, sin, style)
        before = qkv.copy()
        got = norm_and_rope(x, w, 1e-6, cos, sin, style)
        assert got is x
        assert np.array_equal(x.view(np.uint32), want.view(np.uint32)), (H, D, n_rot)
        # the rest of the fused row is untouched
        lo, hi = D, D + H * D
        assert np.array_equal(qkv[:, :lo], before[:, :lo])
        assert np.array_equal(qkv[:, hi:], before[:, hi:])
