//! AVX-512 form of [`super::exact`]'s products (f32 activations, weights formed with ggml's
//! own f32 operations), for the types that carry most of a model's bytes: Q8_0, Q4_0, Q4_1,
//! Q5_0, Q5_1, Q4_K, Q5_K, Q6_K.
//!
//! Why a second form: with Gemma 3 270M's 640-wide rows a weight row is 20 blocks, and the
//! AVX2 form's per-row work (a dispatch, a horizontal sum, scattered stores) cost about as
//! much as the row's products; a decode step ran at ~6 GB/s of weights on one core, half of
//! what the memory delivers. Here `W` weight rows are walked together against `R` activation
//! rows (`W * R <= 8`), 16 lanes at a time, so the per-row costs are shared by W rows and the
//! unpacking of a weight block by R activation rows.
//!
//! Every (weight row, activation row) pair accumulates in the same order whatever `W` and
//! `R` are (two 16-lane accumulators, for the first and last 16 of each 32 weights, summed at
//! the end), so a row's result does not depend on the batch it is computed in, on how the
//! rows are split between threads, or on whether it falls in a group of W or in the tail.

// loops index several arrays per row (accumulators, activation pointers)
#![allow(clippy::needless_range_loop)]

use super::{split_row_tiles, BlockMatrix, BlockType, OutPtr};
use crate::aligned::AlignedF32;
use std::arch::x86_64::*;

/// How far ahead of the rows being multiplied their bytes are prefetched.
const PREFETCH_AHEAD: usize = 8192;

/// Whether the CPU runs these kernels (AVX-512F next to the AVX2 + FMA + F16C that the
/// unpacking uses).
pub(super) fn available() -> bool {
    std::is_x86_feature_detected!("avx512f")
        && std::is_x86_feature_detected!("avx2")
        && std::is_x86_feature_detected!("fma")
        && std::is_x86_feature_detected!("f16c")
}

/// Whether `ty` has a kernel here.
pub(super) fn supports(ty: BlockType) -> bool {
    use BlockType::*;
    matches!(ty, Q8_0 | Q4_0 | Q4_1 | Q5_0 | Q5_1 | Q4_K | Q5_K | Q6_K)
}

/// The f16 at `p` (unaligned) as f32, by F16C. Broadcast (`vpbroadcastw`) rather than
/// inserted: LLVM inserts a lone half with `vpinsrw` into whatever register is free, often
/// the previous row's scale, which chained every block's conversion to the row before it
/// (~15 cycles a link, W links per block: it bounded the kernel at ~6 G weights/s).
#[target_feature(enable = "avx2,f16c")]
#[inline]
unsafe fn f16(p: *const u8) -> f32 {
    let h = unsafe { (p as *const i16).read_unaligned() };
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_set1_epi16(h)))
}

/// The f16 at `p` in all 16 lanes (see `f16`).
#[target_feature(enable = "avx512f,avx2,f16c")]
#[inline]
unsafe fn f16x16(p: *const u8) -> __m512 {
    let h = unsafe { (p as *const i16).read_unaligned() };
    _mm512_cvtph_ps(_mm256_set1_epi16(h))
}

/// For each weight `ws[p]` (`[n_p, k]`, all `supports`ed), `out[:, c_p..c_p + n_p] =
/// x[m, k] @ dequantize(ws[p]).T` with `c_p` the rows of the weights before it and `out`
/// `[m, sum n_p]` (sizes checked by the caller, `m <= 16`, `available()`). One pass over
/// the pool for all of them: fused Q/K/V or gate/up of different types cost one hand-off to
/// the workers, and their rows are split between threads by bytes, whatever part they are in.
pub(super) fn matmul_parts(
    x: &[f32],
    m: usize,
    ws: &[BlockMatrix<'_>],
    out: &mut [f32],
    threads: usize,
) {
    let ptr = OutPtr(out.as_mut_ptr());
    let ld: usize = ws.iter().map(|w| w.n).sum();
    let k = ws[0].k;
    // The kernels load activations 16 at a time from offsets that are multiples of 16
    // values (and rows are k values, a multiple of 32), so a 64-byte-aligned copy makes
    // every load one cache line. NumPy's buffers are 16-byte aligned: there three loads in
    // four split two lines, and a batch of 8 ran at 17-19 against 29-30 G weight-rows/s.
    let aligned = AlignedF32::copy_of(&x[..m * k]);
    let x = &aligned[..];
    // the K-quants' offset terms take each row's sums per 32 activations (once per call)
    let sums: Vec<f32> = if ws
        .iter()
        .any(|w| matches!(w.ty, BlockType::Q4_K | BlockType::Q5_K))
    {
        x[..m * k]
            .chunks_exact(32)
            .map(|c| c.iter().sum())
            .collect()
    } else {
        Vec::new()
    };
    let (tiles, bounds, threads) = split_row_tiles(ws, m.div_ceil(8), threads);
    crate::pool::run_on(threads, bounds.len() - 1, &|i| {
        for &(p, lo, hi, col) in &tiles[bounds[i]..bounds[i + 1]] {
            // SAFETY: the tile's rows and columns are inside the checked sizes; each tile,
            // so each output column, belongs to one part
            unsafe { tile(x, &sums, m, &ws[p], lo, hi, ptr, col, ld) };
        }
    });
}

/// Rows `lo..hi` of `w` times all `m` activation rows, into columns `col + (lo..hi)` of
/// `out` (`[m, ld]`). SAFETY: as `dispatch`.
#[allow(clippy::too_many_arguments)]
unsafe fn tile(
    x: &[f32],
    sums: &[f32],
    m: usize,
    w: &BlockMatrix<'_>,
    lo: usize,
    hi: usize,
    out: OutPtr,
    col: usize,
    ld: usize,
) {
    let (rb, nb) = (w.row_bytes(), w.k / w.ty.block_size());
    let mut r = 0;
    while r < m {
        let (rows, wr) = pass_shape(w.ty, m - r);
        let xs = x.as_ptr().wrapping_add(r * w.k);
        let mut n = lo;
        while n < hi {
            let g = if hi - n >= wr { wr } else { 1 };
            let rows_at = w.raw.as_ptr().wrapping_add(n * rb);
            // ask for the bytes PREFETCH_AHEAD past this group now: one core's hardware
            // prefetchers kept too few lines in flight for these short streams (1-2 MB per
            // matrix), and the kernel waited on memory at ~4 GB/s
            let ahead = rows_at.wrapping_add(PREFETCH_AHEAD);
            let end = w.raw.as_ptr().wrapping_add(w.raw.len());
            let mut pf = ahead;
            while pf < end && pf < ahead.wrapping_add(g * rb) {
                // SAFETY: a prefetch never faults; pf is inside the weight's bytes
                unsafe { _mm_prefetch::<_MM_HINT_T0>(pf as *const i8) };
                pf = pf.wrapping_add(64);
            }
            // SAFETY: available() checked by the caller; weight rows n..n + g < w.n and
            // activation rows r..r + rows < m exist (sizes checked by the caller); the
            // outputs written are columns col + n..col + n + g of rows r..r + rows.
            let a = Args {
                rows: rows_at,
                rb,
                nb,
                bs: w.ty.block_size(),
                bb: w.ty.block_bytes(),
                xs,
                sums: sums.as_ptr().wrapping_add(r * (w.k / 32)),
                k: w.k,
                out,
                r0: r,
                n0: col + n,
                ld,
            };
            unsafe { dispatch(w.ty, g, rows, a) };
            n += g;
        }
        r += rows;
    }
}

/// Activation rows per pass and weight rows walked together for them, with `left` rows to go.
/// Q4_K/Q5_K (`dot_k4`, which keeps a second set of accumulators for the offsets) run several
/// activation rows one weight row at a time: with 2-4 weight rows their loop outgrew the
/// registers (a batch of 4 took 1.7x longer per row than one weight row at a time).
fn pass_shape(ty: BlockType, left: usize) -> (usize, usize) {
    let k_quant = matches!(ty, BlockType::Q4_K | BlockType::Q5_K);
    match left {
        _ if ty == BlockType::Q6_K => (left.min(8), 1),
        1 => (1, if k_quant { 4 } else { 8 }),
        _ if k_quant => (left.min(8), 1),
        2 => (2, 4),
        3 | 4 => (left, 2),
        n => (n.min(8), 1),
    }
}

/// Run `dot::<T, W, R>` (`dot_k4` for Q4_K/Q5_K) for the runtime `(ty, w, r)` (`w * r <= 8`).
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
unsafe fn dispatch(ty: BlockType, w: usize, r: usize, a: Args) {
    macro_rules! by_type {
        ($w:literal, $r:literal) => {{
            use BlockType::*;
            unsafe {
                match ty {
                    Q8_0 => dot::<{ Q8_0 as u32 }, $w, $r>(a),
                    Q4_0 => dot::<{ Q4_0 as u32 }, $w, $r>(a),
                    Q4_1 => dot::<{ Q4_1 as u32 }, $w, $r>(a),
                    Q5_0 => dot::<{ Q5_0 as u32 }, $w, $r>(a),
                    Q5_1 => dot::<{ Q5_1 as u32 }, $w, $r>(a),
                    Q4_K => dot_k4::<false, $w, $r>(a),
                    Q5_K => dot_k4::<true, $w, $r>(a),
                    _ => dot::<{ Q6_K as u32 }, $w, $r>(a),
                }
            }
        }};
    }
    match (w, r) {
        (8, 1) => by_type!(8, 1),
        (4, 1) => by_type!(4, 1),
        (4, 2) => by_type!(4, 2),
        (2, 3) => by_type!(2, 3),
        (2, 4) => by_type!(2, 4),
        (_, 1) => by_type!(1, 1),
        (_, 2) => by_type!(1, 2),
        (_, 3) => by_type!(1, 3),
        (_, 4) => by_type!(1, 4),
        (_, 5) => by_type!(1, 5),
        (_, 6) => by_type!(1, 6),
        (_, 7) => by_type!(1, 7),
        _ => by_type!(1, 8),
    }
}

/// Where `dot` reads and writes: weight rows at `rows` (`rb` bytes, `nb` blocks each),
/// activation rows at `xs` (`k` values each) with their sums per 32 values at `sums` (K-quant
/// offsets; `k / 32` per row), the output `[_, ld]` from row `r0` and column `n0`.
#[derive(Clone, Copy)]
struct Args {
    rows: *const u8,
    rb: usize,
    nb: usize,
    /// Values and bytes per block (passed in: two divisions per call cost ~10% of a batch
    /// of 8 rows' 20-block weight row)
    bs: usize,
    bb: usize,
    xs: *const f32,
    sums: *const f32,
    k: usize,
    out: OutPtr,
    r0: usize,
    n0: usize,
    ld: usize,
}

/// The values of 16 codes `q` (as f32, zero point already subtracted): `q * s`, then
/// `+ o` where the format has an offset; a multiply, then an add, as ggml dequantizes.
#[target_feature(enable = "avx512f")]
#[inline]
fn weights16(q: __m512, s: __m512, o: Option<__m512>) -> __m512 {
    let w = _mm512_mul_ps(q, s);
    match o {
        Some(o) => _mm512_add_ps(w, o),
        None => w,
    }
}

/// 16 weights `w` FMA'd with activations `e..e + 16` of each row into `acc`.
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn fma16<const R: usize>(w: __m512, xs: &[*const f32; R], e: usize, acc: &mut [__m512; R]) {
    for i in 0..R {
        // SAFETY: e + 16 <= k values of activation row i (the caller)
        let xv = unsafe { _mm512_loadu_ps(xs[i].add(e)) };
        acc[i] = _mm512_fmadd_ps(w, xv, acc[i]);
    }
}

/// The 16 bytes at `p` as i32 lanes (zero-extended).
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn bytes16(p: *const u8) -> __m512i {
    _mm512_cvtepu8_epi32(unsafe { _mm_loadu_si128(p as *const __m128i) })
}

/// `a | (b & 0x10)` (Q5 formats' fifth bit), one instruction.
#[target_feature(enable = "avx512f")]
#[inline]
fn or_bit4(a: __m512i, b: __m512i) -> __m512i {
    _mm512_ternarylogic_epi32::<0xF8>(a, b, _mm512_set1_epi32(0x10))
}

/// The 8 sub-block scales `d * sc` and offsets `-(dmin * m)` of the Q4_K/Q5_K block at `p`,
/// as ggml computes them (`get_scale_min_k4`, unpacked for all 8 at once as ggml-cpu's
/// AVX2 code does; f32 products, so the same values as the scalar form). Kept in memory so
/// that each is broadcast by a load, not by a shuffle.
#[target_feature(enable = "avx2,f16c")]
#[inline]
unsafe fn k4_scales(p: *const u8) -> ([f32; 8], [f32; 8]) {
    let (scales, mins) = unsafe { super::k4_scale_min_words(p) };
    let to_f32 = |v: u64| _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(v as i64)));
    let (d, dmin) = unsafe { (f16(p), f16(p.add(2))) };
    let sc = _mm256_mul_ps(_mm256_set1_ps(d), to_f32(scales));
    // -(dmin * m): the product, then the sign flipped (exact)
    let mn = _mm256_xor_ps(
        _mm256_mul_ps(_mm256_set1_ps(dmin), to_f32(mins)),
        _mm256_set1_ps(-0.0),
    );
    let (mut a, mut b) = ([0f32; 8], [0f32; 8]);
    unsafe {
        _mm256_storeu_ps(a.as_mut_ptr(), sc);
        _mm256_storeu_ps(b.as_mut_ptr(), mn);
    }
    (a, b)
}

/// The 16 scales `d * sc` (sc i8) of the Q6_K block at `p`, as ggml computes them.
#[target_feature(enable = "avx512f,avx2,f16c")]
#[inline]
unsafe fn q6k_scales(p: *const u8) -> [f32; 16] {
    let d = unsafe { f16x16(p.add(208)) };
    let raw = unsafe { _mm_loadu_si128(p.add(192) as *const __m128i) };
    let mut out = [0f32; 16];
    let v = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(raw)));
    unsafe { _mm512_storeu_ps(out.as_mut_ptr(), v) };
    out
}

/// The codes of 16 elements of Q4_K/Q5_K sub-block `sub` from their bytes `v` (i32 lanes):
/// the low nibbles for an even `sub`, the high ones for an odd one, and with `five` (Q5_K)
/// bit `sub` of `qh` (the bytes of the block's high bits) moved to bit 4.
#[target_feature(enable = "avx512f")]
#[inline]
fn k4_codes(v: __m512i, qh: __m512i, sub: usize, five: bool) -> __m512i {
    let q = if sub.is_multiple_of(2) {
        _mm512_and_si512(v, _mm512_set1_epi32(0x0F))
    } else {
        _mm512_srli_epi32::<4>(v)
    };
    if !five {
        return q;
    }
    let r = _mm512_set1_epi32((4 - sub as i32).rem_euclid(32));
    or_bit4(q, _mm512_rolv_epi32(qh, r))
}

/// 0.0, 1.0, ... 15.0: the lookup table of 4-bit codes (`vpermps` reads the low 4 bits of
/// each index lane, so a lane needs no mask).
const TABLE16: __m512 = unsafe {
    std::mem::transmute::<[f32; 16], __m512>([
        0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0, 12.0, 13.0, 14.0, 15.0,
    ])
};

/// `k4_codes` as f32, by table lookup (`vpermps` reads the low 4 bits of each lane, 5 for
/// the two-table `vpermt2ps` of Q5_K) instead of a mask and a conversion: the conversions
/// competed with the multiply-adds for one port. The table holds the integers as f32, so
/// the values are the same as the conversion's.
#[target_feature(enable = "avx512f")]
#[inline]
fn codes_f32<const FIVE: bool>(v: __m512i, qh: __m512i, sub: usize) -> __m512 {
    let lo = TABLE16;
    if FIVE {
        let hi = _mm512_add_ps(lo, _mm512_set1_ps(16.0));
        return _mm512_permutex2var_ps(lo, k4_codes(v, qh, sub, true), hi);
    }
    let idx = if sub.is_multiple_of(2) {
        v
    } else {
        _mm512_srli_epi32::<4>(v)
    };
    _mm512_permutexvar_ps(idx, lo)
}

/// The weights of the block at `p` of type `T` (a ggml id that `supports` takes), 16 at a
/// time: `f(q, s, o, e)` with codes `q` (i32 lanes, zero point already subtracted) whose
/// values are `q * s`, plus `o` for the formats with an offset (a multiply, then an add:
/// ggml's arithmetic), for elements `e..e + 16` of the block. The one unpacking that `dot`
/// (which multiplies) and `dequantize_row` (which stores) share.
///
/// Codes are unpacked in 32-bit lanes straight from memory (`vpmovzxbd`, then shifts, masks
/// and `vpternlogd`), not in bytes and widened afterwards: the byte shuffles and lane
/// extracts of the widening all compete for one port, which bounded the byte form.
///
/// SAFETY: `p` points at a whole block of `T`.
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
#[inline]
unsafe fn block_groups<const T: u32>(
    p: *const u8,
    mut f: impl FnMut(__m512, __m512, Option<__m512>, usize),
) {
    const fn is(t: u32, ty: BlockType) -> bool {
        t == ty as u32
    }
    use BlockType::*;
    let m4 = _mm512_set1_epi32(0x0F);
    // SAFETY (whole body): every read lies inside the block (the caller)
    unsafe {
        match T {
            _ if is(T, Q8_0) => {
                let d = f16x16(p);
                for h in 0..2 {
                    let q = _mm_loadu_si128(p.add(2 + 16 * h) as *const __m128i);
                    f(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)), d, None, 16 * h);
                }
            }
            _ if is(T, Q4_0) || is(T, Q4_1) => {
                let one = is(T, Q4_1);
                let d = f16x16(p);
                let v = bytes16(p.add(if one { 4 } else { 2 }));
                // the low nibble of each lane indexes the table: codes minus the zero point
                let table = if one {
                    TABLE16
                } else {
                    _mm512_sub_ps(TABLE16, _mm512_set1_ps(8.0))
                };
                let lo = _mm512_permutexvar_ps(v, table);
                let hi = _mm512_permutexvar_ps(_mm512_srli_epi32::<4>(v), table);
                let m = if one { Some(f16x16(p.add(2))) } else { None };
                f(lo, d, m, 0);
                f(hi, d, m, 16);
            }
            _ if is(T, Q5_0) || is(T, Q5_1) => {
                let one = is(T, Q5_1);
                let d = f16x16(p);
                let o = if one { 4 } else { 2 };
                // lane j of the low (high) 16 elements takes bit j (j + 16) of qh to bit 4:
                // rotate left by 4 - j (mod 32)
                let rot_lo =
                    _mm512_setr_epi32(4, 3, 2, 1, 0, 31, 30, 29, 28, 27, 26, 25, 24, 23, 22, 21);
                let rot_hi =
                    _mm512_setr_epi32(20, 19, 18, 17, 16, 15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5);
                let qh = _mm512_set1_epi32((p.add(o) as *const i32).read_unaligned());
                let v = bytes16(p.add(o + 4));
                // bits 0-3 from the nibble, bit 4 (and bits the lookup ignores) from qh
                let nib = _mm512_set1_epi32(0x0F);
                let lo = _mm512_ternarylogic_epi32::<0xE4>(v, _mm512_rolv_epi32(qh, rot_lo), nib);
                let hi = _mm512_ternarylogic_epi32::<0xE4>(
                    _mm512_srli_epi32::<4>(v),
                    _mm512_rolv_epi32(qh, rot_hi),
                    nib,
                );
                // the 5-bit codes index two tables: codes minus the zero point
                let zero = if one { 0.0 } else { 16.0 };
                let (ta, tb) = (
                    _mm512_sub_ps(TABLE16, _mm512_set1_ps(zero)),
                    _mm512_sub_ps(TABLE16, _mm512_set1_ps(zero - 16.0)),
                );
                let m = if one { Some(f16x16(p.add(2))) } else { None };
                f(_mm512_permutex2var_ps(ta, lo, tb), d, m, 0);
                f(_mm512_permutex2var_ps(ta, hi, tb), d, m, 16);
            }
            _ if is(T, Q4_K) || is(T, Q5_K) => {
                let five = is(T, Q5_K);
                let (sc, mn) = k4_scales(p);
                let qs = p.add(if five { 48 } else { 16 });
                let qh = [bytes16(p.add(16)), bytes16(p.add(32))];
                for jj in 0..4 {
                    let v = [bytes16(qs.add(32 * jj)), bytes16(qs.add(32 * jj + 16))];
                    for sub in [2 * jj, 2 * jj + 1] {
                        let (s, m) = (_mm512_set1_ps(sc[sub]), _mm512_set1_ps(mn[sub]));
                        for g in 0..2 {
                            let q = if five {
                                codes_f32::<true>(v[g], qh[g], sub)
                            } else {
                                codes_f32::<false>(v[g], qh[g], sub)
                            };
                            f(q, s, Some(m), 32 * sub + 16 * g);
                        }
                    }
                }
            }
            _ => {
                // Q6_K: value = (d * sc) * (code - 32), sc per 16 weights
                let sc = q6k_scales(p);
                let (c30, c32) = (_mm512_set1_epi32(0x30), _mm512_set1_epi32(32));
                for half in 0..2 {
                    for g in 0..2 {
                        let a = bytes16(p.add(64 * half + 16 * g));
                        let b = bytes16(p.add(64 * half + 32 + 16 * g));
                        let h = bytes16(p.add(128 + 32 * half + 16 * g));
                        // the 4 quarters of 32: low bits, and qh's bits 0-1, 2-3, 4-5, 6-7
                        // moved to bits 4-5
                        let q = [
                            _mm512_ternarylogic_epi32::<0xF8>(
                                _mm512_and_si512(a, m4),
                                _mm512_slli_epi32::<4>(h),
                                c30,
                            ),
                            _mm512_ternarylogic_epi32::<0xF8>(
                                _mm512_and_si512(b, m4),
                                _mm512_slli_epi32::<2>(h),
                                c30,
                            ),
                            _mm512_ternarylogic_epi32::<0xF8>(_mm512_srli_epi32::<4>(a), h, c30),
                            _mm512_ternarylogic_epi32::<0xF8>(
                                _mm512_srli_epi32::<4>(b),
                                _mm512_srli_epi32::<2>(h),
                                c30,
                            ),
                        ];
                        for (c, q) in q.into_iter().enumerate() {
                            let s = _mm512_set1_ps(sc[8 * half + 2 * c + g]);
                            let e = 128 * half + 32 * c + 16 * g;
                            f(_mm512_cvtepi32_ps(_mm512_sub_epi32(q, c32)), s, None, e);
                        }
                    }
                }
            }
        }
    }
}

/// W weight rows of type `T` (ggml id) times R activation rows.
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
unsafe fn dot<const T: u32, const W: usize, const R: usize>(a: Args) {
    let Args {
        rows,
        rb,
        nb,
        bs,
        bb,
        xs: x0,
        k,
        out,
        r0,
        n0,
        ld: n,
        ..
    } = a;
    let xs: [*const f32; R] = std::array::from_fn(|i| x0.wrapping_add(i * k));
    let mut acc = [[[_mm512_setzero_ps(); R]; 2]; W];
    for bi in 0..nb {
        for j in 0..W {
            let acc = &mut acc[j];
            let base = bs * bi;
            // SAFETY: block bi of weight row j lies inside the row and activation offsets
            // stay below k (the caller's sizes)
            unsafe {
                block_groups::<T>(rows.add(j * rb + bb * bi), |q, s, o, e| {
                    // the first and last 16 of every 32 weights sum apart (two chains)
                    fma16::<R>(weights16(q, s, o), &xs, base + e, &mut acc[(e / 16) % 2]);
                })
            };
        }
    }
    let sums = lane_sums::<W, R>(|j, i| _mm512_add_ps(acc[j][0][i], acc[j][1][i]));
    for j in 0..W {
        for i in 0..R {
            // SAFETY: row r0 + i < m, column n0 + j < n: this part's own output (caller)
            unsafe { *out.at((r0 + i) * n + n0 + j) = sums[j * R + i] };
        }
    }
}

/// The sum of the 16 lanes of `v`, in a fixed tree: lanes `i + 8`, then `i + 4`, then
/// `i + 2`, then `i + 1` added to lane `i` (what `sums8` computes for each of its vectors,
/// so a (weight row, activation row) pair gets the same bits whatever the pass shape).
#[target_feature(enable = "avx512f")]
#[inline]
fn sum16(v: __m512) -> f32 {
    let u = _mm256_add_ps(
        _mm512_castps512_ps256(v),
        _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v))),
    );
    let w = _mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps::<1>(u));
    let y = _mm_add_ps(w, _mm_movehl_ps(w, w));
    _mm_cvtss_f32(_mm_add_ss(y, _mm_movehdup_ps(y)))
}

/// `sum16` of each of 8 vectors at once (lane `t` of the result: vector `t`), by
/// transposing shuffles: ~24 instructions where 8 `sum16`s take ~72, which at 8 activation
/// rows was a sixth of a 20-block weight row's work.
#[target_feature(enable = "avx512f")]
#[inline]
fn sums8(v: [__m512; 8]) -> __m256 {
    // lanes i + 8: vectors 2p and 2p + 1 side by side
    let pair = |a: __m512, b: __m512| {
        _mm512_add_ps(
            _mm512_shuffle_f32x4::<0x44>(a, b),
            _mm512_shuffle_f32x4::<0xEE>(a, b),
        )
    };
    let (s01, s23, s45, s67) = (
        pair(v[0], v[1]),
        pair(v[2], v[3]),
        pair(v[4], v[5]),
        pair(v[6], v[7]),
    );
    // lanes i + 4: four vectors' 4 lanes per 128-bit quarter
    let quad = |a: __m512, b: __m512| {
        _mm512_add_ps(
            _mm512_shuffle_f32x4::<0x88>(a, b),
            _mm512_shuffle_f32x4::<0xDD>(a, b),
        )
    };
    let (t0, t1) = (quad(s01, s23), quad(s45, s67));
    // lanes i + 2: quarter q holds vector q's two lanes, then vector q + 4's
    let z = _mm512_add_ps(
        _mm512_shuffle_ps::<0x44>(t0, t1),
        _mm512_shuffle_ps::<0xEE>(t0, t1),
    );
    // lanes i + 1: quarter q's lane 0 is vector q's sum, lane 1 vector q + 4's
    let r = _mm512_add_ps(
        _mm512_shuffle_ps::<0x88>(z, z),
        _mm512_shuffle_ps::<0xDD>(z, z),
    );
    let idx = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 0, 0, 0, 0, 0, 0, 0, 0);
    _mm512_castps512_ps256(_mm512_permutexvar_ps(idx, r))
}

/// `sum16(f(j, i))` for every weight row `j < W` and activation row `i < R`, as `[j * R + i]`
/// (8 at a time through `sums8` when there are several).
#[target_feature(enable = "avx512f")]
#[inline]
fn lane_sums<const W: usize, const R: usize>(f: impl Fn(usize, usize) -> __m512) -> [f32; 8] {
    const { assert!(W * R <= 8) };
    let mut out = [0f32; 8];
    if W * R == 1 {
        out[0] = sum16(f(0, 0));
        return out;
    }
    let v: [__m512; 8] = std::array::from_fn(|t| {
        if t < W * R {
            f(t / R, t % R)
        } else {
            _mm512_setzero_ps()
        }
    });
    // SAFETY: out holds 8 values
    unsafe { _mm256_storeu_ps(out.as_mut_ptr(), sums8(v)) };
    out
}

/// W Q4_K (`FIVE`: Q5_K) weight rows times R activation rows, in the factored form
/// `sum_sub s_sub * (sum q x) + sum_sub o_sub * (sum x)` (`s = d * sc`, `o = -(dmin * m)`):
/// per 16 weights a conversion and a multiply-add, against a conversion, a multiply, an add
/// and a multiply-add for forming each weight. Exact up to float rounding order like the
/// rest (one-hot activations still give each weight bit for bit: `s * q + o`), and batch
/// invariant: the activation sums are each row's own, in one order.
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
unsafe fn dot_k4<const FIVE: bool, const W: usize, const R: usize>(a: Args) {
    let Args {
        rows,
        rb,
        nb,
        bs: _,
        bb: _,
        xs: x0,
        sums,
        k,
        out,
        r0,
        n0,
        ld,
    } = a;
    let xs: [*const f32; R] = std::array::from_fn(|i| x0.wrapping_add(i * k));
    let ss: [*const f32; R] = std::array::from_fn(|i| sums.wrapping_add(i * (k / 32)));
    let mut acc = [[_mm512_setzero_ps(); R]; W];
    let mut off = [[_mm256_setzero_ps(); R]; W];
    for bi in 0..nb {
        for j in 0..W {
            // SAFETY (whole body): block bi of weight row j lies inside the row (the caller's
            // sizes); activation offsets stay below k, sum offsets below k / 32.
            unsafe {
                let p = rows.add(j * rb + if FIVE { 176 } else { 144 } * bi);
                let (sc, mn) = k4_scales(p);
                let qs = p.add(if FIVE { 48 } else { 16 });
                let qh = [bytes16(p.add(16)), bytes16(p.add(32))];
                for jj in 0..4 {
                    let v = [bytes16(qs.add(32 * jj)), bytes16(qs.add(32 * jj + 16))];
                    for sub in [2 * jj, 2 * jj + 1] {
                        let f: [__m512; 2] =
                            std::array::from_fn(|g| codes_f32::<FIVE>(v[g], qh[g], sub));
                        let s = _mm512_set1_ps(sc[sub]);
                        let e = 256 * bi + 32 * sub;
                        for i in 0..R {
                            let t = _mm512_mul_ps(f[0], _mm512_loadu_ps(xs[i].add(e)));
                            let t = _mm512_fmadd_ps(f[1], _mm512_loadu_ps(xs[i].add(e + 16)), t);
                            acc[j][i] = _mm512_fmadd_ps(t, s, acc[j][i]);
                        }
                    }
                }
                let o = _mm256_loadu_ps(mn.as_ptr());
                for i in 0..R {
                    let xsum = _mm256_loadu_ps(ss[i].add(8 * bi));
                    off[j][i] = _mm256_fmadd_ps(o, xsum, off[j][i]);
                }
            }
        }
    }
    let sums = lane_sums::<W, R>(|j, i| acc[j][i]);
    for j in 0..W {
        for i in 0..R {
            // SAFETY: the features are enabled on this function
            let v = sums[j * R + i] + unsafe { crate::x86::hsum(off[j][i]) };
            // SAFETY: row r0 + i < m, column n0 + j < ld: this part's own output (caller)
            unsafe { *out.at((r0 + i) * ld + n0 + j) = v };
        }
    }
}

/// Row `row` of `ty` (`supports(ty)`) as f32 into `out` (`out.len()` values, a whole number
/// of blocks), exactly as ggml's `dequantize_row_*` computes them: `block_groups`' unpacking
/// and weight arithmetic (a multiply, then an add), stored instead of multiplied. The
/// prefill GEMMs dequantize tiles of weights with this; the portable code reached 0.5-1.4 G
/// values/s, a third of a 160-token prefill chunk's product time.
///
/// SAFETY: `available()`; `row` holds `out.len() / block` whole blocks of `ty`.
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
pub(super) unsafe fn dequantize_row(ty: BlockType, row: &[u8], out: &mut [f32]) {
    // SAFETY: the caller's; out holds the n values written 16 after 16
    unsafe { dequantize_row_chunks(ty, row, out.len(), out.as_mut_ptr(), 16) }
}

/// `dequantize_row` of the first `n` values (whole blocks) of `row`, with values `16 * c ..
/// 16 * c + 16` written at `out + c * stride`: a GEMM panel interleaves its rows in chunks of
/// 16, and writing them in place saves a copy of every value.
///
/// SAFETY: `available()`; `row` holds `n / block` whole blocks of `ty`; `out + c * stride`
/// is valid for 16 writes for every `c < n / 16`.
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
pub(super) unsafe fn dequantize_row_chunks(
    ty: BlockType,
    row: &[u8],
    n: usize,
    out: *mut f32,
    stride: usize,
) {
    use BlockType::*;
    let (bs, bb) = (ty.block_size(), ty.block_bytes());
    debug_assert!(row.len() >= n / bs * bb);
    let f = match ty {
        Q8_0 => dequantize_blocks::<{ Q8_0 as u32 }>,
        Q4_0 => dequantize_blocks::<{ Q4_0 as u32 }>,
        Q4_1 => dequantize_blocks::<{ Q4_1 as u32 }>,
        Q5_0 => dequantize_blocks::<{ Q5_0 as u32 }>,
        Q5_1 => dequantize_blocks::<{ Q5_1 as u32 }>,
        Q4_K => dequantize_blocks::<{ Q4_K as u32 }>,
        Q5_K => dequantize_blocks::<{ Q5_K as u32 }>,
        _ => dequantize_blocks::<{ Q6_K as u32 }>,
    };
    // SAFETY: the caller's
    unsafe { f(row, bs, bb, n, out, stride) }
}

/// `dequantize_row_chunks` for type `T` (blocks of `bs` elements, `bb` bytes).
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
unsafe fn dequantize_blocks<const T: u32>(
    row: &[u8],
    bs: usize,
    bb: usize,
    n: usize,
    out: *mut f32,
    stride: usize,
) {
    for bi in 0..n / bs {
        // SAFETY: block bi lies inside `row`; its chunks (bi * bs + e) / 16 < n / 16 are
        // writable at out + chunk * stride (the caller)
        unsafe {
            block_groups::<T>(row.as_ptr().add(bi * bb), |q, s, off, e| {
                let chunk = (bi * bs + e) / 16;
                _mm512_storeu_ps(out.add(chunk * stride), weights16(q, s, off))
            })
        };
    }
}
