//! x86 SIMD pieces shared by the kernels.

use std::arch::x86_64::*;

/// The sum of the 8 lanes of `v`.
#[target_feature(enable = "avx")]
#[inline]
pub(crate) unsafe fn hsum(v: __m256) -> f32 {
    let s4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)))
}

/// `exp(x)` of 8 lanes, Cephes' expf polynomial (~2 ulp); inputs above 88 give exp(88), below
/// -87 exactly 0 (so -inf gives 0).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(crate) unsafe fn exp8(x: __m256) -> __m256 {
    let keep = _mm256_cmp_ps(x, _mm256_set1_ps(-87.0), _CMP_GE_OQ);
    let x = _mm256_min_ps(x, _mm256_set1_ps(88.0));
    let x = _mm256_max_ps(x, _mm256_set1_ps(-87.0));
    let fx = _mm256_floor_ps(_mm256_fmadd_ps(
        x,
        _mm256_set1_ps(std::f32::consts::LOG2_E),
        _mm256_set1_ps(0.5),
    ));
    let x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693_359_4), x);
    let x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.121_944_4e-4), x);
    let mut y = _mm256_set1_ps(1.987_569_1e-4);
    for c in [
        1.398_199_9e-3,
        8.333_452e-3,
        4.166_579_6e-2,
        0.166_666_65,
        0.5,
    ] {
        y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(c));
    }
    let y = _mm256_fmadd_ps(
        y,
        _mm256_mul_ps(x, x),
        _mm256_add_ps(x, _mm256_set1_ps(1.0)),
    );
    let e = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)),
        23,
    );
    _mm256_and_ps(_mm256_mul_ps(y, _mm256_castsi256_ps(e)), keep)
}

/// Whether AVX2, FMA and F16C run here (`is_x86_feature_detected!` caches its answer).
pub(crate) fn avx2_fma() -> bool {
    std::is_x86_feature_detected!("avx2")
        && std::is_x86_feature_detected!("fma")
        && std::is_x86_feature_detected!("f16c")
}
