//! AVX2 + FMA + F16C row kernels.
//!
//! A 32-weight chunk is unpacked once into 32 bytes and multiplied with the i8 activations
//! of up to 4 rows: `maddubs` (u8 x i8 -> i16 pairs) and `madd` with ones give 8 i32 sums
//! (lanes 0..3 the first 16 weights, 4..7 the last 16), scaled in f32 by weight scale x
//! activation scale. Unsigned weight codes (Q4_0's 0..15 instead of -8..7) keep `maddubs`
//! free of the sign trick; their zero point goes into the offset term with the activation
//! sums. No i16 pair can saturate: |code| <= 63 (unsigned) or 128 (signed) times 127, twice.

// loops index several arrays per row or element (accumulators, codes j and j + 16)
#![allow(clippy::needless_range_loop)]

use super::portable::{e8m0_half, unpack, Unpacked, IQ4NL_VALUES, MXFP4_VALUES};
use super::{Acts, BlockType, QActs, ACT_BLOCK};
use crate::x86::hsum;
use std::arch::x86_64::*;

macro_rules! by_rows {
    ($f:ident, $rows:expr, $($arg:expr),*) => {
        match $rows {
            8 => $f::<8>($($arg),*),
            7 => $f::<7>($($arg),*),
            6 => $f::<6>($($arg),*),
            5 => $f::<5>($($arg),*),
            4 => $f::<4>($($arg),*),
            3 => $f::<3>($($arg),*),
            2 => $f::<2>($($arg),*),
            _ => $f::<1>($($arg),*),
        }
    };
}

macro_rules! by_rows_mx {
    ($f:ident, $mx:expr, $rows:expr, $($arg:expr),*) => {
        match $rows {
            8 => $f::<8, $mx>($($arg),*),
            7 => $f::<7, $mx>($($arg),*),
            6 => $f::<6, $mx>($($arg),*),
            5 => $f::<5, $mx>($($arg),*),
            4 => $f::<4, $mx>($($arg),*),
            3 => $f::<3, $mx>($($arg),*),
            2 => $f::<2, $mx>($($arg),*),
            _ => $f::<1, $mx>($($arg),*),
        }
    };
}

/// Dot products of weight row `row` with activation rows `[r0, r0 + rows)` (`rows` <= 8)
/// into `out`; false when this type has no AVX2 kernel (the caller then takes the portable
/// one).
///
/// SAFETY: the CPU has AVX2, FMA and F16C; `row` is a whole row of `ty` for the activations'
/// `k`, and rows `r0..r0 + rows` exist.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn row_dot(
    ty: BlockType,
    row: &[u8],
    acts: &Acts<'_>,
    r0: usize,
    rows: usize,
    out: &mut [f32],
) -> bool {
    use BlockType::*;
    unsafe {
        match acts {
            Acts::Float { x, k } => match ty {
                F32 | F16 | BF16 => by_rows!(dot_float, rows, ty, row, x, *k, r0, out),
                _ => return false,
            },
            Acts::Quant(a) => match ty {
                Q8_0 => by_rows!(dot_q8_0, rows, row, a, r0, out),
                Q4_0 | Q4_1 | Q5_0 | Q5_1 => by_rows!(dot_q4q5, rows, ty, row, a, r0, out),
                IQ4_NL => by_rows_mx!(dot_table4, false, rows, row, a, r0, out),
                MXFP4 => by_rows_mx!(dot_table4, true, rows, row, a, r0, out),
                Q4_K | Q5_K => by_rows!(dot_q4k_q5k, rows, ty == Q5_K, row, a, r0, out),
                Q6_K => by_rows!(dot_q6_k, rows, row, a, r0, out),
                Q2_K | Q3_K | IQ4_XS => by_rows!(dot_unpacked, rows, ty, row, a, r0, out),
                F32 | F16 | BF16 => return false,
            },
        }
    }
    true
}

/// The f16 at `p` (unaligned, little-endian) as f32.
#[target_feature(enable = "avx2,f16c")]
#[inline]
unsafe fn f16(p: *const u8) -> f32 {
    let h = unsafe { (p as *const u16).read_unaligned() };
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(h as i32)))
}

/// 16 bytes at `p` as 32 nibbles: bytes 0..15 the low nibbles, 16..31 the high ones (the
/// element order of Q4_0/Q4_1/Q5_x/IQ4_NL blocks).
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn nibbles(p: *const u8) -> __m256i {
    let t = unsafe { _mm_loadu_si128(p as *const __m128i) };
    let b = _mm256_set_m128i(_mm_srli_epi16(t, 4), t);
    _mm256_and_si256(b, _mm256_set1_epi8(0x0F))
}

/// The 32 bits at `p` as bytes 0xFF (bit set) / 0 (ggml's bytes_from_bits_32).
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn bits_to_bytes(p: *const u8) -> __m256i {
    let x = unsafe { (p as *const u32).read_unaligned() };
    let shuf = _mm256_set_epi64x(
        0x0303_0303_0303_0303,
        0x0202_0202_0202_0202,
        0x0101_0101_0101_0101,
        0,
    );
    let bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(x as i32), shuf);
    let bytes = _mm256_or_si256(bytes, _mm256_set1_epi64x(0x7fbf_dfef_f7fb_fdfe));
    _mm256_cmpeq_epi8(bytes, _mm256_set1_epi64x(-1))
}

/// The i32 sums of 4 products each of unsigned weight bytes `w` and the activations at `a`.
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn dot_u8(w: __m256i, a: *const i8) -> __m256 {
    let av = unsafe { _mm256_loadu_si256(a as *const __m256i) };
    let p = _mm256_madd_epi16(_mm256_maddubs_epi16(w, av), _mm256_set1_epi16(1));
    _mm256_cvtepi32_ps(p)
}

/// As `dot_u8` for signed weight bytes (sign moved onto the activations).
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn dot_i8(w: __m256i, a: *const i8) -> __m256 {
    let av = unsafe { _mm256_loadu_si256(a as *const __m256i) };
    let p = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(av, w));
    _mm256_cvtepi32_ps(_mm256_madd_epi16(p, _mm256_set1_epi16(1)))
}

/// Where activation rows `r0..r0 + R` live in `a`.
struct ActRows<'a> {
    a: &'a QActs,
    /// Blocks of 32 per row.
    nb: usize,
    /// Block index of row r0's first block.
    base: usize,
}

impl ActRows<'_> {
    fn new(a: &QActs, r0: usize) -> ActRows<'_> {
        let nb = a.blocks_per_row();
        ActRows {
            a,
            nb,
            base: r0 * nb,
        }
    }
    /// The block index of chunk `c` (of the row) in activation row r0 + i.
    #[inline(always)]
    fn block(&self, i: usize, c: usize) -> usize {
        self.base + i * self.nb + c
    }
    #[inline(always)]
    fn qs(&self, ab: usize) -> *const i8 {
        self.a.qs.as_ptr().wrapping_add(ab * ACT_BLOCK)
    }
    /// Activation scale of block `ab`.
    #[inline(always)]
    fn d(&self, ab: usize) -> f32 {
        // SAFETY: ab < rows * nb: the callers index rows r0..r0 + R of chunks < nb
        unsafe { *self.a.d.get_unchecked(ab) }
    }
    #[inline(always)]
    fn sum32(&self, ab: usize) -> f32 {
        // SAFETY: as `d`
        unsafe { *self.a.sum32.get_unchecked(ab) }
    }
    #[inline(always)]
    fn sum16(&self, ab: usize, half: usize) -> f32 {
        // SAFETY: as `d` (two per block)
        unsafe { *self.a.sum16.get_unchecked(2 * ab + half) }
    }
}

/// The even and odd accumulators of each row added.
#[target_feature(enable = "avx")]
#[inline]
fn sum2<const R: usize>(acc: &[[__m256; R]; 2]) -> [__m256; R] {
    std::array::from_fn(|i| _mm256_add_ps(acc[0][i], acc[1][i]))
}

fn finish<const R: usize>(acc: &[__m256; R], off: &[f32; R], out: &mut [f32]) {
    for i in 0..R {
        // SAFETY: the features were checked by the caller of row_dot
        out[i] = unsafe { hsum(acc[i]) } + off[i];
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_q8_0<const R: usize>(row: &[u8], a: &QActs, r0: usize, out: &mut [f32]) {
    let rows = ActRows::new(a, r0);
    // two accumulators per row (even and odd blocks) so that consecutive FMAs do not wait
    // on each other
    let mut acc = [[_mm256_setzero_ps(); R]; 2];
    for (c, b) in row.chunks_exact(34).enumerate() {
        let p = b.as_ptr();
        let d = unsafe { f16(p) };
        let w = unsafe { _mm256_loadu_si256(p.add(2) as *const __m256i) };
        let acc = &mut acc[c & 1];
        for i in 0..R {
            let ab = rows.block(i, c);
            let s = _mm256_set1_ps(d * rows.d(ab));
            acc[i] = _mm256_fmadd_ps(unsafe { dot_i8(w, rows.qs(ab)) }, s, acc[i]);
        }
    }
    finish(&sum2(&acc), &[0.0; R], out);
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_q4q5<const R: usize>(
    ty: BlockType,
    row: &[u8],
    a: &QActs,
    r0: usize,
    out: &mut [f32],
) {
    use BlockType::*;
    let rows = ActRows::new(a, r0);
    let bb = ty.block_bytes();
    let mut acc = [[_mm256_setzero_ps(); R]; 2];
    let mut off = [[0f32; R]; 2];
    for (c, b) in row.chunks_exact(bb).enumerate() {
        let p = b.as_ptr();
        let d = unsafe { f16(p) };
        // value = d * code + o, o = m (Q4_1/Q5_1) or -8 d / -16 d (the zero point)
        let (w, o) = unsafe {
            match ty {
                Q4_0 => (nibbles(p.add(2)), -8.0 * d),
                Q4_1 => (nibbles(p.add(4)), f16(p.add(2))),
                Q5_0 => {
                    let h = _mm256_and_si256(bits_to_bytes(p.add(2)), _mm256_set1_epi8(0x10));
                    (_mm256_or_si256(nibbles(p.add(6)), h), -16.0 * d)
                }
                _ => {
                    let h = _mm256_and_si256(bits_to_bytes(p.add(4)), _mm256_set1_epi8(0x10));
                    (_mm256_or_si256(nibbles(p.add(8)), h), f16(p.add(2)))
                }
            }
        };
        let (acc, off) = (&mut acc[c & 1], &mut off[c & 1]);
        for i in 0..R {
            let ab = rows.block(i, c);
            let s = _mm256_set1_ps(d * rows.d(ab));
            acc[i] = _mm256_fmadd_ps(unsafe { dot_u8(w, rows.qs(ab)) }, s, acc[i]);
            off[i] += o * rows.sum32(ab);
        }
    }
    let off: [f32; R] = std::array::from_fn(|i| off[0][i] + off[1][i]);
    finish(&sum2(&acc), &off, out);
}

/// The formats of 32 4-bit codes looked up in a 16-value table: IQ4_NL (f16 scale) and, with
/// `MX`, MXFP4 (E8M0 scale byte, ggml's kvalues_mxfp4).
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_table4<const R: usize, const MX: bool>(
    row: &[u8],
    a: &QActs,
    r0: usize,
    out: &mut [f32],
) {
    let rows = ActRows::new(a, r0);
    let values = if MX { &MXFP4_VALUES } else { &IQ4NL_VALUES };
    let table = unsafe { _mm_loadu_si128(values.as_ptr() as *const __m128i) };
    let table = _mm256_set_m128i(table, table);
    let (bb, codes) = if MX { (17, 1) } else { (18, 2) };
    let mut acc = [[_mm256_setzero_ps(); R]; 2];
    for (c, b) in row.chunks_exact(bb).enumerate() {
        let p = b.as_ptr();
        let d = if MX {
            e8m0_half(b[0])
        } else {
            unsafe { f16(p) }
        };
        let w = _mm256_shuffle_epi8(table, unsafe { nibbles(p.add(codes)) });
        let acc = &mut acc[c & 1];
        for i in 0..R {
            let ab = rows.block(i, c);
            let s = _mm256_set1_ps(d * rows.d(ab));
            acc[i] = _mm256_fmadd_ps(unsafe { dot_i8(w, rows.qs(ab)) }, s, acc[i]);
        }
    }
    finish(&sum2(&acc), &[0.0; R], out);
}

/// Q4_K (and with `five`, Q5_K): 8 sub-blocks of 32 with 6-bit scales and mins.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_q4k_q5k<const R: usize>(
    five: bool,
    row: &[u8],
    a: &QActs,
    r0: usize,
    out: &mut [f32],
) {
    let rows = ActRows::new(a, r0);
    let bb = if five { 176 } else { 144 };
    let m4 = _mm256_set1_epi8(0x0F);
    let mut acc = [[_mm256_setzero_ps(); R]; 2];
    // the min terms of a super-block: its 8 mins times the 8 activation sums, one FMA
    let mut offv = [_mm256_setzero_ps(); R];
    for (bi, b) in row.chunks_exact(bb).enumerate() {
        let p = b.as_ptr();
        let (d, dmin) = unsafe { (f16(p), f16(p.add(2))) };
        let mut sc = [0f32; 8];
        let mut mn = [0f32; 8];
        for j in 0..8 {
            let (s, m) = super::portable::scale_min_k4(j, &b[4..16]);
            sc[j] = d * s as f32;
            mn[j] = -(dmin * m as f32);
        }
        let minsv = unsafe { _mm256_loadu_ps(mn.as_ptr()) };
        for i in 0..R {
            let sums = rows.a.sum32.as_ptr().wrapping_add(rows.block(i, bi * 8));
            offv[i] = _mm256_fmadd_ps(minsv, unsafe { _mm256_loadu_ps(sums) }, offv[i]);
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
                let c = bi * 8 + sub;
                let acc = &mut acc[part];
                for i in 0..R {
                    let ab = rows.block(i, c);
                    let s = _mm256_set1_ps(sc[sub] * rows.d(ab));
                    acc[i] = _mm256_fmadd_ps(unsafe { dot_u8(w, rows.qs(ab)) }, s, acc[i]);
                }
            }
        }
    }
    let off: [f32; R] = std::array::from_fn(|i| unsafe { hsum(offv[i]) });
    finish(&sum2(&acc), &off, out);
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_q6_k<const R: usize>(row: &[u8], a: &QActs, r0: usize, out: &mut [f32]) {
    let rows = ActRows::new(a, r0);
    let m4 = _mm256_set1_epi8(0x0F);
    let m2 = _mm256_set1_epi8(3);
    let mut acc = [[_mm256_setzero_ps(); R]; 2];
    // the zero-point terms: -32 x the 16 scales times the 16 activation sums, two FMAs
    let mut offv = [_mm256_setzero_ps(); R];
    for (bi, b) in row.chunks_exact(210).enumerate() {
        let p = b.as_ptr();
        let d = unsafe { f16(p.add(208)) };
        let mut sc = [0f32; 16];
        for (g, s) in sc.iter_mut().enumerate() {
            *s = d * (b[192 + g] as i8) as f32;
        }
        let (sc0, sc1) = unsafe {
            (
                _mm256_loadu_ps(sc.as_ptr()),
                _mm256_loadu_ps(sc.as_ptr().add(8)),
            )
        };
        for i in 0..R {
            let sums = rows
                .a
                .sum16
                .as_ptr()
                .wrapping_add(2 * rows.block(i, bi * 8));
            unsafe {
                offv[i] = _mm256_fmadd_ps(sc0, _mm256_loadu_ps(sums), offv[i]);
                offv[i] = _mm256_fmadd_ps(sc1, _mm256_loadu_ps(sums.add(8)), offv[i]);
            }
        }
        for half in 0..2 {
            let (ql0, ql1, qh) = unsafe {
                (
                    _mm256_loadu_si256(p.add(64 * half) as *const __m256i),
                    _mm256_loadu_si256(p.add(64 * half + 32) as *const __m256i),
                    _mm256_loadu_si256(p.add(128 + 32 * half) as *const __m256i),
                )
            };
            // codes 0..63 (value = scale * (code - 32)); the 2 high bits of chunk c are
            // bits 2c..2c+1 of qh
            let hi = |sh: i32| -> __m256i {
                let h = match sh {
                    0 => qh,
                    2 => _mm256_srli_epi16(qh, 2),
                    4 => _mm256_srli_epi16(qh, 4),
                    _ => _mm256_srli_epi16(qh, 6),
                };
                _mm256_slli_epi16(_mm256_and_si256(h, m2), 4)
            };
            let chunks = [
                _mm256_or_si256(_mm256_and_si256(ql0, m4), hi(0)),
                _mm256_or_si256(_mm256_and_si256(ql1, m4), hi(2)),
                _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), m4), hi(4)),
                _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), m4), hi(6)),
            ];
            for (cc, w) in chunks.into_iter().enumerate() {
                let g = 8 * half + 2 * cc;
                let (s0, s1) = (sc[g], sc[g + 1]);
                let sv = _mm256_set_m128(_mm_set1_ps(s1), _mm_set1_ps(s0));
                let c = bi * 8 + 4 * half + cc;
                let acc = &mut acc[cc & 1];
                for i in 0..R {
                    let ab = rows.block(i, c);
                    let s = _mm256_mul_ps(sv, _mm256_set1_ps(rows.d(ab)));
                    acc[i] = _mm256_fmadd_ps(unsafe { dot_u8(w, rows.qs(ab)) }, s, acc[i]);
                }
            }
        }
    }
    let off: [f32; R] = std::array::from_fn(|i| -32.0 * unsafe { hsum(offv[i]) });
    finish(&sum2(&acc), &off, out);
}

/// Types without a kernel of their own (Q2_K, Q3_K, IQ4_XS): blocks unpacked by the
/// portable code, products in SIMD.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_unpacked<const R: usize>(
    ty: BlockType,
    row: &[u8],
    a: &QActs,
    r0: usize,
    out: &mut [f32],
) {
    let rows = ActRows::new(a, r0);
    let (bb, chunks) = (ty.block_bytes(), ty.block_size() / ACT_BLOCK);
    let mut u = Unpacked::new();
    let mut acc = [[_mm256_setzero_ps(); R]; 2];
    let mut off = [[0f32; R]; 2];
    for (bi, b) in row.chunks_exact(bb).enumerate() {
        unpack(ty, b, &mut u);
        for cc in 0..chunks {
            let w = unsafe { _mm256_loadu_si256(u.q.as_ptr().add(32 * cc) as *const __m256i) };
            let (s0, s1) = (u.s[2 * cc], u.s[2 * cc + 1]);
            let (o0, o1) = (u.o[2 * cc], u.o[2 * cc + 1]);
            let sv = _mm256_set_m128(_mm_set1_ps(s1), _mm_set1_ps(s0));
            let c = bi * chunks + cc;
            let (acc, off) = (&mut acc[cc & 1], &mut off[cc & 1]);
            for i in 0..R {
                let ab = rows.block(i, c);
                let s = _mm256_mul_ps(sv, _mm256_set1_ps(rows.d(ab)));
                acc[i] = _mm256_fmadd_ps(unsafe { dot_i8(w, rows.qs(ab)) }, s, acc[i]);
                if u.offset {
                    off[i] += o0 * rows.sum16(ab, 0) + o1 * rows.sum16(ab, 1);
                }
            }
        }
    }
    let off: [f32; R] = std::array::from_fn(|i| off[0][i] + off[1][i]);
    finish(&sum2(&acc), &off, out);
}

/// F32/F16/BF16 weights: f32 products with the f32 activations.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_float<const R: usize>(
    ty: BlockType,
    row: &[u8],
    x: &[f32],
    k: usize,
    r0: usize,
    out: &mut [f32],
) {
    let p = row.as_ptr();
    let load8 = |e: usize| -> __m256 {
        // SAFETY: e + 8 <= k elements of the row
        unsafe {
            match ty {
                BlockType::F32 => _mm256_loadu_ps(p.add(4 * e) as *const f32),
                BlockType::F16 => _mm256_cvtph_ps(_mm_loadu_si128(p.add(2 * e) as *const __m128i)),
                _ => {
                    let h = _mm256_cvtepu16_epi32(_mm_loadu_si128(p.add(2 * e) as *const __m128i));
                    _mm256_castsi256_ps(_mm256_slli_epi32(h, 16))
                }
            }
        }
    };
    let xp = x.as_ptr();
    let mut acc0 = [_mm256_setzero_ps(); R];
    let mut acc1 = [_mm256_setzero_ps(); R];
    let mut e = 0;
    while e + 16 <= k {
        let (w0, w1) = (load8(e), load8(e + 8));
        for i in 0..R {
            let xi = unsafe { xp.add((r0 + i) * k + e) };
            unsafe {
                acc0[i] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xi), acc0[i]);
                acc1[i] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xi.add(8)), acc1[i]);
            }
        }
        e += 16;
    }
    if e + 8 <= k {
        let w0 = load8(e);
        for i in 0..R {
            let xi = unsafe { xp.add((r0 + i) * k + e) };
            acc0[i] = _mm256_fmadd_ps(w0, unsafe { _mm256_loadu_ps(xi) }, acc0[i]);
        }
        e += 8;
    }
    let mut tail = [0f32; R];
    if e < k {
        let mut w = vec![0f32; k - e];
        let bytes = ty.block_bytes();
        super::portable::dequantize_row_unchecked(ty, &row[e * bytes..], &mut w);
        for (i, t) in tail.iter_mut().enumerate() {
            let xr = &x[(r0 + i) * k + e..(r0 + i + 1) * k];
            *t = w.iter().zip(xr).map(|(a, b)| a * b).sum();
        }
    }
    let acc: [__m256; R] = std::array::from_fn(|i| _mm256_add_ps(acc0[i], acc1[i]));
    finish(&acc, &tail, out);
}
