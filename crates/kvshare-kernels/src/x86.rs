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
