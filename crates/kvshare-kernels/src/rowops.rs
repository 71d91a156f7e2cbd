//! Row-wise elementwise work of a forward step: RMSNorm and the gated activations (GeGLU with
//! tanh-approximated GELU, SwiGLU, gpt-oss's clamped SwiGLU).
//!
//! NumPy computed these as chains of 5-7 whole-array passes (~2-6 ns per value: a 160-token
//! Gemma turn spent ~60 ms of ~500 in them on the main thread), and its RMSNorm took a
//! different formula for small and large batches, so a row's norm depended on its chunk. Here
//! one pass per row, the same formula for every batch size:
//! - RMSNorm as ggml computes it: the sum of squares in f64, `scale = 1 / sqrt(mean + eps)` in
//!   f32, then `(x * scale) * weight`;
//! - GeGLU as `ops/activation.py` wrote it: `t = ((g * g) * A - B) * g` with
//!   `A = -2 sqrt(2/pi) 0.044715`, `B = 2 sqrt(2/pi)` (f32), then `g / (1 + exp(t)) * up`
//!   (`x * sigmoid(2z)`, the tanh form exactly in real arithmetic); SwiGLU as
//!   `g / (1 + exp(-g)) * up`; ggml's `swiglu_oai` as it computes it: `g` clamped to
//!   `<= 7`, `up` to `[-7, 7]`, then `g / (1 + exp(1.702 * -g)) * (up + 1)`. exp is Cephes'
//!   polynomial (~2 ulp) on AVX2, `f32::exp` elsewhere and in the tails.

use crate::qmatmul::KernelError;

/// The gated activation of a fused `[gate | up]` row.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Glu {
    /// `gelu_tanh(gate) * up` (Gemma).
    GeluTanh,
    /// `silu(gate) * up` (llama family).
    Silu,
    /// gpt-oss's clamped SwiGLU (ggml's `swiglu_oai`, alpha `SWIGLU_OAI_ALPHA`, limit
    /// `SWIGLU_OAI_LIMIT`).
    SwigluOai,
}

/// `swiglu_oai`'s constants (llama.cpp's LLM_FFN_SWIGLU_OAI_MOE for gpt-oss).
pub const SWIGLU_OAI_ALPHA: f32 = 1.702;
pub const SWIGLU_OAI_LIMIT: f32 = 7.0;

/// `swiglu_oai`'s clamps: the gate to `<= limit`, the up value to `[-limit, limit]`; a NaN
/// stays NaN, as with `std::min` / `std::clamp` in ggml (the comparisons are false).
#[inline]
fn oai_clamp(g: f32, u: f32) -> (f32, f32) {
    let lim = SWIGLU_OAI_LIMIT;
    let g = if lim < g { lim } else { g };
    let u = if lim < u {
        lim
    } else if u < -lim {
        -lim
    } else {
        u
    };
    (g, u)
}

const GELU_C: f64 = 0.797_884_560_802_865_4; // sqrt(2 / pi)

fn gelu_consts() -> (f32, f32) {
    ((-2.0 * GELU_C * 0.044715) as f32, (2.0 * GELU_C) as f32)
}

fn check_norm(len: usize, d: usize, weight: &[f32]) -> Result<(), KernelError> {
    if d == 0 || !len.is_multiple_of(d) {
        return Err(KernelError::Shape(format!(
            "{len} values are not rows of {d}"
        )));
    }
    if !weight.is_empty() && weight.len() != d {
        return Err(KernelError::Shape(format!(
            "weight has {} values, rows have {d}",
            weight.len()
        )));
    }
    Ok(())
}

/// `out = x / sqrt(mean(x^2) + eps) * weight` per row of `d` values (`weight` empty: no
/// scale). `x` and `out` hold the same number of values.
pub fn rms_norm(
    x: &[f32],
    d: usize,
    weight: &[f32],
    eps: f32,
    out: &mut [f32],
) -> Result<(), KernelError> {
    check_norm(x.len(), d, weight)?;
    if out.len() != x.len() {
        return Err(KernelError::Shape(format!(
            "out has {} values, x {}",
            out.len(),
            x.len()
        )));
    }
    // SAFETY: both hold x.len() values; distinct borrows cannot overlap
    unsafe { norm_rows(x.as_ptr(), out.as_mut_ptr(), x.len(), d, weight, eps) };
    Ok(())
}

/// `rms_norm` with `out` = `x`.
pub fn rms_norm_in_place(
    x: &mut [f32],
    d: usize,
    weight: &[f32],
    eps: f32,
) -> Result<(), KernelError> {
    check_norm(x.len(), d, weight)?;
    let p = x.as_mut_ptr();
    // SAFETY: each row is read whole (its sum) before any of it is written, and then every
    // value is read before it is written at the same index
    unsafe { norm_rows(p, p, x.len(), d, weight, eps) };
    Ok(())
}

/// SAFETY: `src` and `dst` hold `len` values (the same buffer, or not overlapping).
unsafe fn norm_rows(src: *const f32, dst: *mut f32, len: usize, d: usize, w: &[f32], eps: f32) {
    for r in 0..len / d {
        // SAFETY: row r lies inside both buffers (the caller)
        let (x, o) = unsafe { (src.add(r * d), dst.add(r * d)) };
        let ss = unsafe { sum_squares(x, d) };
        let scale = 1.0f32 / (((ss / d as f64) as f32) + eps).sqrt();
        // SAFETY: as above
        unsafe { scale_row(x, o, d, scale, w) };
    }
}

/// The sum of `x[i]^2` over `d` values, in f64 (each square is exact in f64).
unsafe fn sum_squares(x: *const f32, d: usize) -> f64 {
    #[cfg(target_arch = "x86_64")]
    {
        if crate::x86::avx2_fma() {
            // SAFETY: features checked; d values at x (the caller)
            return unsafe { avx2::sum_squares(x, d) };
        }
    }
    let mut acc = 0f64;
    for i in 0..d {
        // SAFETY: i < d (the caller)
        let v = unsafe { *x.add(i) } as f64;
        acc += v * v;
    }
    acc
}

unsafe fn scale_row(x: *const f32, o: *mut f32, d: usize, s: f32, w: &[f32]) {
    #[cfg(target_arch = "x86_64")]
    {
        if crate::x86::avx2_fma() {
            // SAFETY: features checked; d values at x and o, w empty or d long
            return unsafe { avx2::scale_row(x, o, d, s, w) };
        }
    }
    for i in 0..d {
        // SAFETY: i < d; x[i] is read before o[i] is written (they may be the same value)
        unsafe {
            let v = *x.add(i) * s;
            *o.add(i) = if w.is_empty() { v } else { v * w[i] };
        }
    }
}

/// In place on rows `[gate | up]` of `2 * ff` values: `gate = act(gate) * up`.
pub fn glu_in_place(gu: &mut [f32], ff: usize, kind: Glu) -> Result<(), KernelError> {
    if ff == 0 || !gu.len().is_multiple_of(2 * ff) {
        return Err(KernelError::Shape(format!(
            "{} values are not rows of 2 x {ff}",
            gu.len()
        )));
    }
    for row in gu.chunks_exact_mut(2 * ff) {
        let (g, u) = row.split_at_mut(ff);
        #[cfg(target_arch = "x86_64")]
        {
            if crate::x86::avx2_fma() {
                // SAFETY: features checked; g and u hold ff values each
                unsafe { avx2::glu(g, u, kind) };
                continue;
            }
        }
        glu_portable(g, u, kind);
    }
    Ok(())
}

fn glu_one(g: f32, u: f32, kind: Glu) -> f32 {
    match kind {
        Glu::GeluTanh => {
            let (a, b) = gelu_consts();
            let t = ((g * g) * a - b) * g;
            g / (t.exp() + 1.0) * u
        }
        Glu::Silu => g / ((-g).exp() + 1.0) * u,
        Glu::SwigluOai => {
            let (g, u) = oai_clamp(g, u);
            g / ((SWIGLU_OAI_ALPHA * -g).exp() + 1.0) * (u + 1.0)
        }
    }
}

fn glu_portable(g: &mut [f32], u: &[f32], kind: Glu) {
    for (a, &b) in g.iter_mut().zip(u) {
        *a = glu_one(*a, b, kind);
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::{gelu_consts, glu_one, Glu, SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT};
    use crate::x86::exp8;
    use std::arch::x86_64::*;

    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn sum_squares(x: *const f32, d: usize) -> f64 {
        let mut acc = [_mm256_setzero_pd(); 2];
        let mut i = 0;
        while i + 8 <= d {
            // SAFETY: i + 8 <= d values at x (the caller)
            let v = unsafe { _mm256_loadu_ps(x.add(i)) };
            let lo = _mm256_cvtps_pd(_mm256_castps256_ps128(v));
            let hi = _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1));
            acc[0] = _mm256_fmadd_pd(lo, lo, acc[0]);
            acc[1] = _mm256_fmadd_pd(hi, hi, acc[1]);
            i += 8;
        }
        let mut lanes = [0f64; 4];
        // SAFETY: 4 f64 to a 4-value array
        unsafe { _mm256_storeu_pd(lanes.as_mut_ptr(), _mm256_add_pd(acc[0], acc[1])) };
        let mut s = (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
        for j in i..d {
            // SAFETY: j < d
            let v = unsafe { *x.add(j) } as f64;
            s += v * v;
        }
        s
    }

    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn scale_row(x: *const f32, o: *mut f32, d: usize, s: f32, w: &[f32]) {
        let sv = _mm256_set1_ps(s);
        let mut i = 0;
        while i + 8 <= d {
            // SAFETY: i + 8 <= d values at x, o and (when not empty) w
            unsafe {
                let v = _mm256_mul_ps(_mm256_loadu_ps(x.add(i)), sv);
                let v = if w.is_empty() {
                    v
                } else {
                    _mm256_mul_ps(v, _mm256_loadu_ps(w.as_ptr().add(i)))
                };
                _mm256_storeu_ps(o.add(i), v);
            }
            i += 8;
        }
        for j in i..d {
            // SAFETY: j < d
            unsafe {
                let v = *x.add(j) * s;
                *o.add(j) = if w.is_empty() { v } else { v * w[j] };
            }
        }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn glu(g: &mut [f32], u: &[f32], kind: Glu) {
        let n = g.len();
        let (a, b) = gelu_consts();
        let (av, bv, one) = (_mm256_set1_ps(a), _mm256_set1_ps(b), _mm256_set1_ps(1.0));
        let (alpha, lim) = (
            _mm256_set1_ps(SWIGLU_OAI_ALPHA),
            _mm256_set1_ps(SWIGLU_OAI_LIMIT),
        );
        let neg_lim = _mm256_set1_ps(-SWIGLU_OAI_LIMIT);
        let mut i = 0;
        while i + 8 <= n {
            // SAFETY: i + 8 <= n values in g and u
            unsafe {
                let mut gv = _mm256_loadu_ps(g.as_ptr().add(i));
                let mut uv = _mm256_loadu_ps(u.as_ptr().add(i));
                if kind == Glu::SwigluOai {
                    // min/max return their second operand when one is NaN: a NaN stays NaN
                    gv = _mm256_min_ps(lim, gv);
                    uv = _mm256_max_ps(neg_lim, _mm256_min_ps(lim, uv));
                    uv = _mm256_add_ps(uv, one);
                }
                // separate roundings (no FMA), as the NumPy form computed them
                let t = match kind {
                    Glu::GeluTanh => _mm256_mul_ps(
                        _mm256_sub_ps(_mm256_mul_ps(_mm256_mul_ps(gv, gv), av), bv),
                        gv,
                    ),
                    Glu::Silu => _mm256_sub_ps(_mm256_setzero_ps(), gv),
                    Glu::SwigluOai => _mm256_mul_ps(alpha, _mm256_sub_ps(_mm256_setzero_ps(), gv)),
                };
                let y = _mm256_div_ps(gv, _mm256_add_ps(exp8(t), one));
                let y = _mm256_mul_ps(y, uv);
                _mm256_storeu_ps(g.as_mut_ptr().add(i), y);
            }
            i += 8;
        }
        for j in i..n {
            g[j] = glu_one(g[j], u[j], kind);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn values(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed;
        (0..n)
            .map(|_| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 12.0
            })
            .collect()
    }

    #[test]
    fn rms_norm_matches_the_f64_formula_and_in_place() {
        for d in [1, 7, 8, 64, 100, 640] {
            let x = values(3 * d, d as u64);
            let w = values(d, 99);
            let mut out = vec![0f32; x.len()];
            rms_norm(&x, d, &w, 1e-6, &mut out).unwrap();
            for (r, row) in x.chunks(d).enumerate() {
                let ss: f64 = row.iter().map(|&v| v as f64 * v as f64).sum();
                let s = 1.0f32 / (((ss / d as f64) as f32) + 1e-6).sqrt();
                for i in 0..d {
                    assert_eq!(out[r * d + i], (row[i] * s) * w[i], "d {d} row {r} {i}");
                }
            }
            let mut y = x.clone();
            rms_norm_in_place(&mut y, d, &w, 1e-6).unwrap();
            assert_eq!(y, out);
            let mut nw = vec![0f32; x.len()];
            rms_norm(&x, d, &[], 1e-6, &mut nw).unwrap();
            assert!(nw
                .iter()
                .zip(&out)
                .zip(w.iter().cycle())
                .all(|((a, b), c)| a * c == *b));
        }
        assert!(rms_norm(&[1.0; 10], 4, &[], 1e-6, &mut [0.0; 10]).is_err());
        assert!(rms_norm(&[1.0; 8], 4, &[1.0; 3], 1e-6, &mut [0.0; 8]).is_err());
        assert!(rms_norm(&[1.0; 8], 4, &[], 1e-6, &mut [0.0; 4]).is_err());
    }

    #[test]
    fn glu_matches_the_f64_functions() {
        for kind in [Glu::GeluTanh, Glu::Silu, Glu::SwigluOai] {
            for ff in [1, 9, 16, 100] {
                let gu = values(4 * 2 * ff, ff as u64 + 5);
                let mut y = gu.clone();
                glu_in_place(&mut y, ff, kind).unwrap();
                for (r, row) in gu.chunks(2 * ff).enumerate() {
                    for i in 0..ff {
                        let (g, u) = (row[i] as f64, row[ff + i] as f64);
                        let act = match kind {
                            Glu::GeluTanh => {
                                0.5 * g * (1.0 + (GELU_C * (g + 0.044715 * g * g * g)).tanh())
                            }
                            Glu::Silu => g / (1.0 + (-g).exp()),
                            Glu::SwigluOai => {
                                let g = g.min(7.0);
                                g / (1.0 + (-1.702 * g).exp())
                            }
                        };
                        let want = match kind {
                            Glu::SwigluOai => act * (u.clamp(-7.0, 7.0) + 1.0),
                            _ => act * u,
                        };
                        let got = y[r * 2 * ff + i] as f64;
                        assert!(
                            (got - want).abs() <= 4e-6 * want.abs() + 1e-12,
                            "{kind:?} ff {ff} {i}: {got} vs {want}"
                        );
                        // the up half is left as it was
                        assert_eq!(y[r * 2 * ff + ff + i], row[ff + i]);
                    }
                }
            }
        }
        assert!(glu_in_place(&mut [0.0; 6], 2, Glu::Silu).is_err());
    }

    #[test]
    fn swiglu_oai_clamps_as_ggml() {
        let ff = 37;
        let mut gu: Vec<f32> = values(2 * ff, 3).iter().map(|v| v * 3.0).collect();
        gu[0] = f32::NAN;
        gu[ff + 1] = f32::NAN;
        let mut y = gu.clone();
        glu_in_place(&mut y, ff, Glu::SwigluOai).unwrap();
        assert!(y[0].is_nan() && y[1].is_nan());
        // a gate over the limit is the limit, an up value outside [-7, 7] its bound: the
        // same bits as the clamped inputs give
        let clamped: Vec<f32> = (0..2 * ff)
            .map(|i| match i {
                0 | 1 => gu[i],
                i if i < ff => gu[i].min(7.0),
                i if i == ff + 1 => gu[i],
                i => gu[i].clamp(-7.0, 7.0),
            })
            .collect();
        assert!(gu[2..ff].iter().any(|v| *v > 7.0));
        assert!(gu[ff + 2..].iter().any(|v| v.abs() > 7.0));
        let mut z = clamped.clone();
        glu_in_place(&mut z, ff, Glu::SwigluOai).unwrap();
        for i in 2..ff {
            assert_eq!(y[i].to_bits(), z[i].to_bits(), "{i}");
            let (g, u) = (clamped[i] as f64, clamped[ff + i] as f64);
            let want = g / (1.0 + (-1.702 * g).exp()) * (u + 1.0);
            assert!(
                (y[i] as f64 - want).abs() <= 4e-6 * want.abs() + 1e-12,
                "{i}"
            );
        }
    }
}
