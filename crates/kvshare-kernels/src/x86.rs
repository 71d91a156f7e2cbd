//! x86 SIMD pieces shared by the kernels.

use std::arch::x86_64::*;

/// Prefetches (hint `H`) the lines of `from..from + len` that lie before `end` (a weight's
/// last byte + 1, say). One comparison a line: ~8% of a hot Q4_K product's time went to this
/// loop with two.
#[inline]
pub(crate) fn prefetch_lines<const H: i32>(from: *const u8, len: usize, end: *const u8) {
    let mut pf = from;
    let stop = pf.wrapping_add(len).min(end);
    while pf < stop {
        // SAFETY: a prefetch reads nothing and never faults, whatever the address
        unsafe { _mm_prefetch::<H>(pf as *const i8) };
        pf = pf.wrapping_add(64);
    }
}

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

/// The 16 x 16 transpose of `r` (`out[c]` lane `l` = `r[l]` lane `c`): pairs, then
/// quads within 128-bit lanes, then the 128-bit lanes.
#[target_feature(enable = "avx512f")]
#[inline]
pub(crate) fn transpose16(r: [__m512; 16]) -> [__m512; 16] {
    let mut t = [_mm512_setzero_ps(); 16];
    for i in 0..8 {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    // u[4g + c], 128-bit lane L: rows 4g..4g + 3 at column 4L + c
    let mut u = [_mm512_setzero_ps(); 16];
    for g in 0..4 {
        let pd = |v: __m512| _mm512_castps_pd(v);
        let (a, b) = (pd(t[4 * g]), pd(t[4 * g + 2]));
        let (c, d) = (pd(t[4 * g + 1]), pd(t[4 * g + 3]));
        u[4 * g] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, b));
        u[4 * g + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, b));
        u[4 * g + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(c, d));
        u[4 * g + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(c, d));
    }
    let mut out = [_mm512_setzero_ps(); 16];
    for c in 0..4 {
        let s0 = _mm512_shuffle_f32x4::<0b01_00_01_00>(u[c], u[4 + c]);
        let s1 = _mm512_shuffle_f32x4::<0b11_10_11_10>(u[c], u[4 + c]);
        let s2 = _mm512_shuffle_f32x4::<0b01_00_01_00>(u[8 + c], u[12 + c]);
        let s3 = _mm512_shuffle_f32x4::<0b11_10_11_10>(u[8 + c], u[12 + c]);
        out[c] = _mm512_shuffle_f32x4::<0b10_00_10_00>(s0, s2);
        out[4 + c] = _mm512_shuffle_f32x4::<0b11_01_11_01>(s0, s2);
        out[8 + c] = _mm512_shuffle_f32x4::<0b10_00_10_00>(s1, s3);
        out[12 + c] = _mm512_shuffle_f32x4::<0b11_01_11_01>(s1, s3);
    }
    out
}

/// The 4 words of 16 rows' 16-byte headers (`h[r]`, stored contiguously) as 4 vectors:
/// `out[w]` lane `r` = word `w` of `h[r]`. Two rounds of two-source permutes (8 in all).
/// SAFETY: `h` points at 16 x 16 readable bytes.
#[target_feature(enable = "avx512f")]
#[inline]
pub(crate) unsafe fn header_words16(h: *const u8) -> [__m512i; 4] {
    // z[k] lane 4j + w: word w of row 4k + j
    // (plain loads: a closure passed to `array::from_fn` may compile to a call without the
    // target features)
    let mut z = [_mm512_setzero_si512(); 4];
    for (k, zk) in z.iter_mut().enumerate() {
        *zk = unsafe { _mm512_loadu_si512(h.add(64 * k) as *const _) };
    }
    // lanes 0..8: word w of rows 0..8 (from z[0], z[1]); lanes 8..16: word w + 1
    let pick = |w: i32| {
        _mm512_setr_epi32(
            w,
            4 + w,
            8 + w,
            12 + w,
            16 + w,
            20 + w,
            24 + w,
            28 + w,
            w + 1,
            5 + w,
            9 + w,
            13 + w,
            17 + w,
            21 + w,
            25 + w,
            29 + w,
        )
    };
    let (p0, p2) = (pick(0), pick(2));
    let lo01 = _mm512_permutex2var_epi32(z[0], p0, z[1]);
    let hi01 = _mm512_permutex2var_epi32(z[2], p0, z[3]);
    let lo23 = _mm512_permutex2var_epi32(z[0], p2, z[1]);
    let hi23 = _mm512_permutex2var_epi32(z[2], p2, z[3]);
    let first = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23);
    let second = _mm512_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    [
        _mm512_permutex2var_epi32(lo01, first, hi01),
        _mm512_permutex2var_epi32(lo01, second, hi01),
        _mm512_permutex2var_epi32(lo23, first, hi23),
        _mm512_permutex2var_epi32(lo23, second, hi23),
    ]
}
