//! Products of f32 activations with weights in their GGUF block formats, exact up to float
//! summation order: `block_matmul_t_f32(x, w)` equals `x @ dequantize(w).T` computed in f32.
//!
//! Unlike `block_matmul_t` nothing is rounded to 8 bits, so a row's result does not depend on
//! whether it was computed here (decode, <= 16 rows) or by dequantized weights and f32 BLAS
//! (prefill chunks): the two differ only by the order of f32 additions (~1e-7 relative).
//!
//! Form of the arithmetic: every weight is formed in registers with the very f32 operations
//! of ggml's `dequantize_row_*` (and of [`super::dequantize_row`]): `s * q` (`+ o`), where the
//! sub-block scale `s` is e.g. `d * sc` and the offset `o` is `-(dmin * m)`, computed in f32 as
//! ggml does. The weights used are therefore bit-identical to the dequantized ones, and the
//! only error against the f64 product of `x` and `dequantize(w)` is that of the f32 FMA
//! accumulation (2-4 accumulators of 8 lanes per activation row). The factored form
//! (`d_sc * sum(q x) - dmin_m * sum(x)`, exact only up to the rounding of each weight) was
//! tried: ~3% faster for Q4_K and Q6_K, slower for Q8_0 (the conversions and unpacking, not
//! the scaling, bound these loops), so it is not used.
//!
//! Each weight row is read once per pass of up to 4 activation rows: a 32-weight chunk is
//! unpacked to 32 signed bytes (AVX2), widened to four vectors of 8 f32, scaled, and
//! FMA'd with the f32 activations of each row. Types without a kernel of their own (Q2_K,
//! Q3_K, IQ4_NL, IQ4_XS, MXFP4) are dequantized block by block into a stack buffer by the portable
//! code and then take the same FMA loop; F32/F16/BF16 take `block_matmul_t`'s f32 dot.
//!
//! Where AVX-512 runs, the types that carry most of a model's bytes (Q8_0, Q4_0/Q4_1, Q5_0/Q5_1,
//! Q4_K/Q5_K, Q6_K) take `exact512` instead: the same weight arithmetic, 16 lanes, several
//! weight rows at once, and one summation order whatever the batch.

// loops index several arrays per row (accumulators, activation pointers)
#![allow(clippy::needless_range_loop)]

use super::portable::dequantize_row_unchecked;
use super::{
    check_sizes, for_each_row_block, use_avx2, Acts, BlockMatrix, BlockType, MAX_ROWS, ROW_BLOCK,
};
use crate::qmatmul::KernelError;

/// Largest block (elements) of a quantized type: the stack buffer of the generic path.
const MAX_BLOCK: usize = 256;

pub(super) fn matmul(
    x: &[f32],
    m: usize,
    w: &BlockMatrix<'_>,
    out: &mut [f32],
    threads: usize,
    portable: bool,
) -> Result<(), KernelError> {
    check_sizes(x, m, w, out)?;
    if m == 0 || w.n == 0 {
        return Ok(());
    }
    let simd = use_avx2(portable);
    #[cfg(target_arch = "x86_64")]
    if simd && super::exact512::supports(w.ty) && super::exact512::available() {
        super::exact512::matmul_parts(x, m, std::slice::from_ref(w), out, threads);
        return Ok(());
    }
    for_each_row_block(m, w, out, threads, &|row, r, res| {
        row_dot(simd, w.ty, row, x, w.k, r, res.len(), res)
    });
    Ok(())
}

/// `out[m, sum n_p]`: the products with each of `ws` side by side (see
/// `block_matmul_t_f32_parts`).
pub(super) fn matmul_parts(
    x: &[f32],
    m: usize,
    ws: &[BlockMatrix<'_>],
    out: &mut [f32],
    threads: usize,
    portable: bool,
) -> Result<(), KernelError> {
    let ld: usize = ws.iter().map(|w| w.n).sum();
    if ws.is_empty() || ws.iter().any(|w| w.k != ws[0].k) {
        return Err(KernelError::Shape(
            "parts must be one or more weights with the same k".into(),
        ));
    }
    for w in ws {
        w.check()?;
    }
    let k = ws[0].k;
    if m > MAX_ROWS || x.len() != m * k {
        return Err(KernelError::Shape(format!(
            "x has {} values, expected m x {k} with m <= {MAX_ROWS}",
            x.len()
        )));
    }
    if out.len() != m * ld {
        return Err(KernelError::Shape(format!(
            "out has {} values, expected {m} x {ld}",
            out.len()
        )));
    }
    if m == 0 || ld == 0 {
        return Ok(());
    }
    #[cfg(target_arch = "x86_64")]
    if use_avx2(portable)
        && ws.iter().all(|w| super::exact512::supports(w.ty))
        && super::exact512::available()
    {
        super::exact512::matmul_parts(x, m, ws, out, threads);
        return Ok(());
    }
    // one product per part, its columns copied into place
    let mut col = 0;
    for w in ws {
        let mut tmp = vec![0f32; m * w.n];
        matmul(x, m, w, &mut tmp, threads, portable)?;
        for r in 0..m {
            out[r * ld + col..r * ld + col + w.n].copy_from_slice(&tmp[r * w.n..(r + 1) * w.n]);
        }
        col += w.n;
    }
    Ok(())
}

/// Dot products of weight row `row` with activation rows `[r0, r0 + rows)` of `x` (`[m, k]`).
#[allow(clippy::too_many_arguments)]
fn row_dot(
    simd: bool,
    ty: BlockType,
    row: &[u8],
    x: &[f32],
    k: usize,
    r0: usize,
    rows: usize,
    out: &mut [f32],
) {
    if ty.is_float() {
        // block_matmul_t's float path is already f32 throughout
        super::row_dot(simd, ty, row, &Acts::Float { x, k }, r0, rows, out);
        return;
    }
    #[cfg(target_arch = "x86_64")]
    {
        if simd {
            debug_assert!((r0 + rows) * k <= x.len());
            // SAFETY: the CPU has AVX2, FMA and F16C (use_avx2); `row` is a whole row of
            // `ty` for `k` and rows r0..r0 + rows of x exist (checked by check_sizes).
            unsafe { avx2::row_dot(ty, row, x, k, r0, rows, out) };
            return;
        }
    }
    let _ = simd;
    portable_row_dot(ty, row, x, k, r0, rows, out);
}

/// The portable path: each block dequantized (ggml's arithmetic) into a stack buffer, then
/// 8-lane f32 dots with the activation rows.
fn portable_row_dot(
    ty: BlockType,
    row: &[u8],
    x: &[f32],
    k: usize,
    r0: usize,
    rows: usize,
    out: &mut [f32],
) {
    let (bs, bb) = (ty.block_size(), ty.block_bytes());
    let mut buf = [0f32; MAX_BLOCK];
    let mut lanes = [[0f32; 8]; ROW_BLOCK];
    for (bi, b) in row.chunks_exact(bb).enumerate() {
        let wv = &mut buf[..bs];
        dequantize_row_unchecked(ty, b, wv);
        for i in 0..rows {
            let xr = &x[(r0 + i) * k + bi * bs..][..bs];
            for (e, (a, v)) in wv.iter().zip(xr).enumerate() {
                lanes[i][e % 8] += a * v;
            }
        }
    }
    for i in 0..rows {
        out[i] = lanes[i].iter().sum();
    }
}

#[cfg(target_arch = "x86_64")]
pub(super) mod avx2 {
    use super::super::portable::{dequantize_row_unchecked, f16_to_f32, scale_min_k4};
    use super::super::BlockType;
    use super::MAX_BLOCK;
    use crate::x86::hsum;
    use std::arch::x86_64::*;

    /// Dispatch on the row count, with A accumulators per row (R x A independent FMA
    /// chains: at least 4 to hide the FMA latency, few enough to stay in registers).
    macro_rules! by_rows {
        ($f:ident, $rows:expr, $($arg:expr),*) => {
            match $rows {
                8 => $f::<8, 1>($($arg),*),
                7 => $f::<7, 1>($($arg),*),
                6 => $f::<6, 1>($($arg),*),
                5 => $f::<5, 1>($($arg),*),
                4 => $f::<4, 2>($($arg),*),
                3 => $f::<3, 2>($($arg),*),
                2 => $f::<2, 4>($($arg),*),
                _ => $f::<1, 4>($($arg),*),
            }
        };
    }

    /// `by_rows` for kernels with the block type as a const generic (`T`, its ggml id).
    macro_rules! by_rows_t {
        ($f:ident, $t:ident, $rows:expr, $($arg:expr),*) => {
            match $rows {
                8 => $f::<8, 1, { $t as u32 }>($($arg),*),
                7 => $f::<7, 1, { $t as u32 }>($($arg),*),
                6 => $f::<6, 1, { $t as u32 }>($($arg),*),
                5 => $f::<5, 1, { $t as u32 }>($($arg),*),
                4 => $f::<4, 2, { $t as u32 }>($($arg),*),
                3 => $f::<3, 2, { $t as u32 }>($($arg),*),
                2 => $f::<2, 4, { $t as u32 }>($($arg),*),
                _ => $f::<1, 4, { $t as u32 }>($($arg),*),
            }
        };
    }

    /// See `super::row_dot`. SAFETY: AVX2, FMA and F16C; `row` a whole row of quantized
    /// `ty` for `k`; rows `r0..r0 + rows` (`rows` <= 8) of `x` (`[_, k]`) exist.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn row_dot(
        ty: BlockType,
        row: &[u8],
        x: &[f32],
        k: usize,
        r0: usize,
        rows: usize,
        out: &mut [f32],
    ) {
        use BlockType::*;
        let base = x.as_ptr().wrapping_add(r0 * k);
        unsafe {
            match ty {
                Q8_0 => by_rows_t!(dot_legacy, Q8_0, rows, row, base, k, out),
                Q4_0 => by_rows_t!(dot_legacy, Q4_0, rows, row, base, k, out),
                Q4_1 => by_rows_t!(dot_legacy, Q4_1, rows, row, base, k, out),
                Q5_0 => by_rows_t!(dot_legacy, Q5_0, rows, row, base, k, out),
                Q5_1 => by_rows_t!(dot_legacy, Q5_1, rows, row, base, k, out),
                Q4_K | Q5_K => by_rows!(dot_q4k_q5k, rows, ty == Q5_K, row, base, k, out),
                Q6_K => by_rows!(dot_q6_k, rows, row, base, k, out),
                _ => by_rows!(dot_generic, rows, ty, row, base, k, out),
            }
        }
    }

    /// The activation row pointers of rows `base + i * k`.
    #[inline(always)]
    fn row_ptrs<const R: usize>(base: *const f32, k: usize) -> [*const f32; R] {
        std::array::from_fn(|i| base.wrapping_add(i * k))
    }

    /// Sum the A accumulators of each row and write the R results.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    unsafe fn finish<const R: usize, const A: usize>(acc: &[[__m256; R]; A], out: &mut [f32]) {
        for i in 0..R {
            let mut v = acc[0][i];
            for a in 1..A {
                v = _mm256_add_ps(v, acc[a][i]);
            }
            out[i] = unsafe { hsum(v) };
        }
    }

    /// The f16 at `p` (unaligned, little-endian) as f32. In integers, not by F16C: LLVM
    /// inserts the half into whatever register is free (`vpinsrw`), often an accumulator,
    /// which chains each block's conversion to the previous block's last FMA.
    #[inline(always)]
    pub(in crate::blocks) unsafe fn f16(p: *const u8) -> f32 {
        let h = unsafe { (p as *const u16).read_unaligned() } as u32;
        let exp = (h >> 10) & 0x1f;
        if exp != 0 && exp != 31 {
            // a normal half: rebias the exponent (exact)
            f32::from_bits(((h & 0x8000) << 16) | (((h & 0x7fff) + (112 << 10)) << 13))
        } else {
            f16_to_f32(h as u16)
        }
    }

    /// 16 bytes at `p` as 32 nibbles: bytes 0..15 the low nibbles, 16..31 the high ones.
    #[target_feature(enable = "avx2")]
    #[inline]
    pub(in crate::blocks) unsafe fn nibbles(p: *const u8) -> __m256i {
        let t = unsafe { _mm_loadu_si128(p as *const __m128i) };
        let b = _mm256_set_m128i(_mm_srli_epi16(t, 4), t);
        _mm256_and_si256(b, _mm256_set1_epi8(0x0F))
    }

    /// The 32 bits at `p` as bytes 0x10 (bit set) / 0: Q5_0/Q5_1's fifth bits.
    #[target_feature(enable = "avx2")]
    #[inline]
    pub(in crate::blocks) unsafe fn fifth_bits(p: *const u8) -> __m256i {
        let x = unsafe { (p as *const u32).read_unaligned() };
        let shuf = _mm256_set_epi64x(
            0x0303_0303_0303_0303,
            0x0202_0202_0202_0202,
            0x0101_0101_0101_0101,
            0,
        );
        let bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(x as i32), shuf);
        let bytes = _mm256_or_si256(bytes, _mm256_set1_epi64x(0x7fbf_dfef_f7fb_fdfe));
        let set = _mm256_cmpeq_epi8(bytes, _mm256_set1_epi64x(-1));
        _mm256_and_si256(set, _mm256_set1_epi8(0x10))
    }

    /// 32 weights: signed codes `q` (bytes), value = s * q (+ o) with `s0`/`o0` for the first
    /// 16 and `s1`/`o1` for the last 16, exactly as ggml dequantizes (a multiply, then an
    /// add: no FMA, so the weight is bit-identical to the dequantized one). Each weight is
    /// FMA'd with activations `xs[i] + e ..` into the accumulators of row i.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    #[allow(clippy::too_many_arguments)]
    unsafe fn fma32<const R: usize, const A: usize, const OFF: bool>(
        q: __m256i,
        s0: f32,
        s1: f32,
        o0: f32,
        o1: f32,
        xs: &[*const f32; R],
        e: usize,
        acc: &mut [[__m256; R]; A],
    ) {
        // widened 8 bytes at a time from memory (a store forwarded to the loads costs less
        // than the lane extracts and shifts of the register)
        let mut tmp = [0i8; 32];
        unsafe { _mm256_storeu_si256(tmp.as_mut_ptr() as *mut __m256i, q) };
        unsafe { fma32_mem::<R, A, OFF>(tmp.as_ptr(), s0, s1, o0, o1, xs, e, acc) }
    }

    /// `fma32` on the 32 codes at `q`.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    #[allow(clippy::too_many_arguments)]
    unsafe fn fma32_mem<const R: usize, const A: usize, const OFF: bool>(
        q: *const i8,
        s0: f32,
        s1: f32,
        o0: f32,
        o1: f32,
        xs: &[*const f32; R],
        e: usize,
        acc: &mut [[__m256; R]; A],
    ) {
        let (sv0, sv1) = (_mm256_set1_ps(s0), _mm256_set1_ps(s1));
        let (ov0, ov1) = (_mm256_set1_ps(o0), _mm256_set1_ps(o1));
        for g in 0..4 {
            // SAFETY: 32 codes at q
            let b = unsafe { _mm_loadl_epi64(q.add(8 * g) as *const __m128i) };
            let f = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
            let (s, o) = if g < 2 { (sv0, ov0) } else { (sv1, ov1) };
            let mut w = _mm256_mul_ps(f, s);
            if OFF {
                w = _mm256_add_ps(w, o);
            }
            let a = &mut acc[g % A];
            for i in 0..R {
                // SAFETY: e + 8 g + 8 <= k elements of activation row i (caller)
                let xv = unsafe { _mm256_loadu_ps(xs[i].add(e + 8 * g)) };
                a[i] = _mm256_fmadd_ps(w, xv, a[i]);
            }
        }
    }

    /// Q8_0, Q4_0, Q4_1, Q5_0, Q5_1: blocks of 32 with one f16 scale (and min).
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn dot_legacy<const R: usize, const A: usize, const T: u32>(
        row: &[u8],
        base: *const f32,
        k: usize,
        out: &mut [f32],
    ) {
        const fn is(t: u32, ty: BlockType) -> bool {
            t == ty as u32
        }
        use BlockType::*;
        let xs = row_ptrs::<R>(base, k);
        let mut acc = [[_mm256_setzero_ps(); R]; A];
        let bb = match T {
            _ if is(T, Q8_0) => 34,
            _ if is(T, Q4_0) => 18,
            _ if is(T, Q4_1) => 20,
            _ if is(T, Q5_0) => 22,
            _ => 24,
        };
        for (bi, b) in row.chunks_exact(bb).enumerate() {
            let p = b.as_ptr();
            let e = 32 * bi;
            unsafe {
                let d = f16(p);
                match T {
                    _ if is(T, Q8_0) => {
                        let q = p.add(2) as *const i8;
                        fma32_mem::<R, A, false>(q, d, d, 0.0, 0.0, &xs, e, &mut acc);
                    }
                    _ if is(T, Q4_0) => {
                        let q = _mm256_sub_epi8(nibbles(p.add(2)), _mm256_set1_epi8(8));
                        fma32::<R, A, false>(q, d, d, 0.0, 0.0, &xs, e, &mut acc);
                    }
                    _ if is(T, Q4_1) => {
                        let (q, m) = (nibbles(p.add(4)), f16(p.add(2)));
                        fma32::<R, A, true>(q, d, d, m, m, &xs, e, &mut acc);
                    }
                    _ if is(T, Q5_0) => {
                        let q = _mm256_or_si256(nibbles(p.add(6)), fifth_bits(p.add(2)));
                        let q = _mm256_sub_epi8(q, _mm256_set1_epi8(16));
                        fma32::<R, A, false>(q, d, d, 0.0, 0.0, &xs, e, &mut acc);
                    }
                    _ => {
                        let q = _mm256_or_si256(nibbles(p.add(8)), fifth_bits(p.add(4)));
                        let m = f16(p.add(2));
                        fma32::<R, A, true>(q, d, d, m, m, &xs, e, &mut acc);
                    }
                }
            }
        }
        unsafe { finish(&acc, out) };
    }

    /// Q4_K (and with `five`, Q5_K): 8 sub-blocks of 32 with 6-bit scales and mins:
    /// value = (d * sc) * q - dmin * m.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn dot_q4k_q5k<const R: usize, const A: usize>(
        five: bool,
        row: &[u8],
        base: *const f32,
        k: usize,
        out: &mut [f32],
    ) {
        let xs = row_ptrs::<R>(base, k);
        let bb = if five { 176 } else { 144 };
        let m4 = _mm256_set1_epi8(0x0F);
        let mut acc = [[_mm256_setzero_ps(); R]; A];
        for (bi, b) in row.chunks_exact(bb).enumerate() {
            let p = b.as_ptr();
            let (d, dmin) = unsafe { (f16(p), f16(p.add(2))) };
            let mut sc = [0f32; 8];
            let mut mn = [0f32; 8];
            for j in 0..8 {
                let (s, m) = scale_min_k4(j, &b[4..16]);
                sc[j] = d * s as f32;
                mn[j] = -(dmin * m as f32);
            }
            let qs = unsafe { p.add(if five { 48 } else { 16 }) };
            let hbits = if five {
                unsafe { _mm256_loadu_si256(p.add(16) as *const __m256i) }
            } else {
                _mm256_setzero_si256()
            };
            for j in 0..4 {
                let q = unsafe { _mm256_loadu_si256(qs.add(32 * j) as *const __m256i) };
                let halves = [
                    _mm256_and_si256(q, m4),
                    _mm256_and_si256(_mm256_srli_epi16(q, 4), m4),
                ];
                for (part, mut w) in halves.into_iter().enumerate() {
                    let sub = 2 * j + part;
                    if five {
                        let bit = _mm256_set1_epi8((1u8 << sub) as i8);
                        let set = _mm256_cmpeq_epi8(_mm256_and_si256(hbits, bit), bit);
                        w = _mm256_or_si256(w, _mm256_and_si256(set, _mm256_set1_epi8(0x10)));
                    }
                    let e = 256 * bi + 32 * sub;
                    let (s, o) = (sc[sub], mn[sub]);
                    unsafe { fma32::<R, A, true>(w, s, s, o, o, &xs, e, &mut acc) };
                }
            }
        }
        unsafe { finish(&acc, out) };
    }

    /// Q6_K: 16 sub-blocks of 16 with i8 scales: value = (d * sc) * (code - 32).
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn dot_q6_k<const R: usize, const A: usize>(
        row: &[u8],
        base: *const f32,
        k: usize,
        out: &mut [f32],
    ) {
        let xs = row_ptrs::<R>(base, k);
        let m4 = _mm256_set1_epi8(0x0F);
        let m2 = _mm256_set1_epi8(3);
        let c32 = _mm256_set1_epi8(32);
        let mut acc = [[_mm256_setzero_ps(); R]; A];
        for (bi, b) in row.chunks_exact(210).enumerate() {
            let p = b.as_ptr();
            let d = unsafe { f16(p.add(208)) };
            // the 16 scales d * sc (i8), as ggml computes them, in two vectors
            let mut sc = [0f32; 16];
            unsafe {
                let raw = _mm_loadu_si128(p.add(192) as *const __m128i);
                let dv = _mm256_set1_ps(d);
                let s0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(raw));
                let s1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128::<8>(raw)));
                _mm256_storeu_ps(sc.as_mut_ptr(), _mm256_mul_ps(dv, s0));
                _mm256_storeu_ps(sc.as_mut_ptr().add(8), _mm256_mul_ps(dv, s1));
            }
            for half in 0..2 {
                let (ql0, ql1, qh) = unsafe {
                    (
                        _mm256_loadu_si256(p.add(64 * half) as *const __m256i),
                        _mm256_loadu_si256(p.add(64 * half + 32) as *const __m256i),
                        _mm256_loadu_si256(p.add(128 + 32 * half) as *const __m256i),
                    )
                };
                // the 2 high bits of chunk c are bits 2c..2c+1 of qh
                let hi = [
                    qh,
                    _mm256_srli_epi16(qh, 2),
                    _mm256_srli_epi16(qh, 4),
                    _mm256_srli_epi16(qh, 6),
                ]
                .map(|h| _mm256_slli_epi16(_mm256_and_si256(h, m2), 4));
                let lo = [
                    _mm256_and_si256(ql0, m4),
                    _mm256_and_si256(ql1, m4),
                    _mm256_and_si256(_mm256_srli_epi16(ql0, 4), m4),
                    _mm256_and_si256(_mm256_srli_epi16(ql1, 4), m4),
                ];
                for cc in 0..4 {
                    let q = _mm256_sub_epi8(_mm256_or_si256(lo[cc], hi[cc]), c32);
                    let g = 8 * half + 2 * cc;
                    let e = 256 * bi + 128 * half + 32 * cc;
                    unsafe {
                        fma32::<R, A, false>(q, sc[g], sc[g + 1], 0.0, 0.0, &xs, e, &mut acc)
                    };
                }
            }
        }
        unsafe { finish(&acc, out) };
    }

    /// Types without a kernel of their own: each block dequantized by the portable code
    /// into a stack buffer, then FMA'd with the activations.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn dot_generic<const R: usize, const A: usize>(
        ty: BlockType,
        row: &[u8],
        base: *const f32,
        k: usize,
        out: &mut [f32],
    ) {
        let xs = row_ptrs::<R>(base, k);
        let (bs, bb) = (ty.block_size(), ty.block_bytes());
        let mut buf = [0f32; MAX_BLOCK];
        let mut acc = [[_mm256_setzero_ps(); R]; A];
        for (bi, b) in row.chunks_exact(bb).enumerate() {
            dequantize_row_unchecked(ty, b, &mut buf[..bs]);
            for g in 0..bs / 8 {
                let w = unsafe { _mm256_loadu_ps(buf.as_ptr().add(8 * g)) };
                let a = &mut acc[g % A];
                for i in 0..R {
                    // SAFETY: bi * bs + 8 g + 8 <= k elements of row i
                    let xv = unsafe { _mm256_loadu_ps(xs[i].add(bi * bs + 8 * g)) };
                    a[i] = _mm256_fmadd_ps(w, xv, a[i]);
                }
            }
        }
        unsafe { finish(&acc, out) };
    }
}
