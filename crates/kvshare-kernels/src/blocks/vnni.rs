//! 8-bit activations times block weights in integers (AVX512-VNNI `vpdpbusd`), with one
//! result per (weight row, activation row) pair whatever the batch.
//!
//! llama.cpp's `vec_dot` quantizes the activations to 8 bits and multiplies them with the
//! weights' codes in integers: 4 products per lane and instruction instead of one f32
//! multiply-add per weight, so its decode reaches the memory's rate where the f32 products of
//! `exact512` stayed compute-bound (batch 8, the 1.9B model's Q4_K/Q6_K rows). But its
//! results move with how a prompt is chunked. Here:
//!
//! - activations are quantized once per call (`ActFormat`: per 32 values of a row, or per
//!   256 for the K-quants as ggml's Q8_K; ties to even);
//! - 1 activation row, or up to 4 with Q6_K and 8 with Q4_K (`OneRow` each,
//!   `few_rows_parts`): 64 codes of a weight row per
//!   vector, the integer sums of 16 blocks at a time by a transposing reduction
//!   (`half_sums`); 16 weight rows at a time those sums are turned by a 16 x 16 transpose so
//!   that each lane runs one weight row's float chain (Q6_K: one activation row, each
//!   weight row read in order for a window of its blocks, `one_q6_k_16`; 2-4: the 16 rows
//!   read side by side, `many_q6_k_16`), the rest of a tile one or two rows at a time with
//!   the chain in scalars (`one_*`); Q4_K at 1-8 rows instead turns the 16 rows' codes
//!   (`lanes_q4_k_16`: no reduction of sums);
//! - 1-8 rows of legacy weights (one row: `OneRow`, `lanes_legacy_one`; 2-8: `Packed`
//!   tiles of 8, `lanes_legacy`): 16 weight rows' codes turned per block so that lane `i`
//!   holds row `i`'s (Q4_0/Q5_0 turned before they are unpacked, `nibble_lanes`, where the
//!   CPU has AVX512-VBMI2 and BITALG), each activation row's 4 codes broadcast into
//!   `vpdpbusd`: the products land in the weight rows' lanes;
//! - more, up to 8 rows (`Packed` tiles of 8, `dot_*`; the legacy types' last 1-15 weight
//!   rows of a part): lanes hold rows (4 bytes of each row side by
//!   side), a block's unsigned codes broadcast 4 at a time (`vpshufd`), the zero point (8,
//!   16, 32, or 128 for Q8_0's signed bytes shifted to unsigned) taken off with the row's
//!   exact sum, two blocks' float steps in one vector;
//! - more rows (`Packed` tiles of 16, `prepare` / `multiply`): activations + 128 as u8, each
//!   block's signed codes broadcast from memory into the s8 operand, 4 weight rows unpacked
//!   once per call and multiplied with every tile, `128 * sum(codes)` taken off;
//! - every kernel gives a block the same integer sum (exact, whatever its order) and the same
//!   f32 operations: `y[b & 1] = fma(f32(isum) * d_act, d_weight, y[b & 1])` over the blocks
//!   in order, the two chains added at the end (K-quants: a `d * sc` chain and a minima chain).
//!
//! A lane's arithmetic never looks at another lane, so a token's result is the same bits in a
//! decode step of 1 or 8 rows and in a prefill chunk of any size or position: with the
//! batch-invariant attention (`attention::paged_attention_invariant`), prefix sharing, which
//! moves chunk boundaries, still changes nothing but speed.

use super::{k4_scale_min_words, row_tile_regions, BlockMatrix, BlockType, OutPtr};
use crate::x86::prefetch_lines;
use std::arch::x86_64::*;

/// Activation rows per tile of a product with at most 8 rows: the lanes of a 256-bit vector
/// of i32.
pub(super) const LANES: usize = 8;
/// Activation rows per tile of a larger product: the lanes of a 512-bit vector.
const WIDE_LANES: usize = 16;
/// How far ahead of the row being multiplied a decode call prefetches (see `exact512`).
const PREFETCH_AHEAD: usize = 8192;

/// Whether the CPU has the instructions (VNNI, and AVX-512BW/VL for the byte masks and
/// 256-bit forms, next to the AVX2 + FMA + F16C of the rest).
pub(super) fn available() -> bool {
    std::is_x86_feature_detected!("avx512f")
        && std::is_x86_feature_detected!("avx512bw")
        && std::is_x86_feature_detected!("avx512vl")
        && std::is_x86_feature_detected!("avx512vnni")
        && std::is_x86_feature_detected!("avx2")
        && std::is_x86_feature_detected!("fma")
        && std::is_x86_feature_detected!("f16c")
}

/// Whether `ty` has a kernel here.
pub(super) fn supports(ty: BlockType) -> bool {
    use BlockType::*;
    matches!(ty, Q8_0 | Q4_0 | Q5_0 | Q4_K | Q6_K)
}

#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Line([u8; 64]);

/// `m` activation rows of `k` values quantized to 8 bits and packed in tiles of `LANES` rows
/// (rows past `m` are zeros). Tile `t` holds, in order:
/// - `qs`: i8, the 4 values of each group `g` (values `4g..4g + 4` of a block of 32) of the
///   8 rows side by side, two such groups to a 512-bit vector: for the K-quants
///   (`ActFormat::Q8K`) `[k / 32][4][2][LANES][4]`, per block group `g` then group `g + 4`;
///   for the legacy types (`Per32`) `[k / 64][8][2][LANES][4]`, per pair of blocks group `g`
///   of the first block then of the second (`dot_legacy`), an odd last block as the
///   K-quants';
/// - `d`: f32 `[k / 32][LANES]`, each block's scale;
/// - `sum`: f32 `[k / 32][LANES]`, `d * (sum of the block's q)` (the K-quants' minima);
/// - `isum32`: i32 `[k / 32][LANES]`, the block's sum of q (zero points);
/// - `isum16`: i32 `[k / 16][LANES]`, the same per 16 values (Q6_K's sub-blocks).
pub(super) struct Packed {
    buf: Vec<Line>,
    /// Rows per tile: 8 (values as i8, groups paired) or 16 (values + 128 as u8, one group
    /// of the 16 rows per 64 bytes: the `wide_*` kernels).
    lanes: usize,
    k: usize,
    m: usize,
    tiles: usize,
    /// Bytes per tile (a multiple of 32: every load of 8 lanes is one aligned half-line).
    stride: usize,
}

/// Where one tile's parts start.
#[derive(Clone, Copy)]
struct Tile {
    qs: *const i8,
    d: *const f32,
    sum: *const f32,
    isum32: *const i32,
    isum16: *const i32,
}

/// A pointer the quantizing parts share; each writes its own tiles.
#[derive(Clone, Copy)]
struct BufPtr(*mut u8);
// SAFETY: parts write disjoint tiles of one live buffer.
unsafe impl Send for BufPtr {}
unsafe impl Sync for BufPtr {}

impl BufPtr {
    fn at(self, i: usize) -> *mut u8 {
        self.0.wrapping_add(i)
    }
}

impl Packed {
    /// Quantize and pack `x` (`[m, k]`, `k` a multiple of 32), on up to `threads` threads.
    /// SAFETY: `available()`.
    pub(super) unsafe fn quantize(
        x: &[f32],
        m: usize,
        k: usize,
        f: ActFormat,
        lanes: usize,
        threads: usize,
    ) -> Packed {
        debug_assert!(k.is_multiple_of(32) && x.len() == m * k);
        let nb = k / 32;
        let stride = lanes * (k + 20 * nb);
        let tiles = m.div_ceil(lanes);
        let wide = lanes == WIDE_LANES;
        // wide tiles hold q + 128 (u8): rows past m must be 128s too (so that they add 0)
        let fill = if wide { 0x80 } else { 0 };
        let buf = vec![Line([fill; 64]); (tiles * stride).div_ceil(64)];
        let mut p = Packed {
            buf,
            lanes,
            k,
            m,
            tiles,
            stride,
        };
        let base = BufPtr(p.buf.as_mut_ptr() as *mut u8);
        // ~1 ns per value: parts of at least 64K values
        let parts = threads
            .min(crate::pool::max_parts())
            .min(tiles)
            .min(m * k / (1 << 16))
            .max(1);
        let per = tiles.div_ceil(parts);
        crate::pool::run(parts, &|part| {
            for t in part * per..((part + 1) * per).min(tiles) {
                let tile = base.at(t * stride);
                if wide {
                    // the metadata of padding rows: zeros (d = 0)
                    // SAFETY: the tile's metadata follows its lanes * k value bytes
                    unsafe {
                        std::ptr::write_bytes(tile.wrapping_add(lanes * k), 0, lanes * 20 * nb)
                    };
                }
                for lane in 0..lanes.min(m - t * lanes) {
                    let r = t * lanes + lane;
                    let d = tile.wrapping_add(lanes * k) as *mut f32;
                    let sum = d.wrapping_add(lanes * nb);
                    let isum32 = sum.wrapping_add(lanes * nb) as *mut i32;
                    let o = RowOut {
                        qs: tile.wrapping_add(4 * lane),
                        group: 4 * lanes,
                        paired: !wide,
                        pair_blocks: !wide && f == ActFormat::Per32,
                        offset: wide,
                        d: d.wrapping_add(lane),
                        sum: sum.wrapping_add(lane),
                        isum32: isum32.wrapping_add(lane),
                        isum16: isum32.wrapping_add(lanes * nb + lane),
                        meta: lanes,
                    };
                    // SAFETY: row r < m exists; tile t (< tiles) belongs to this part alone
                    unsafe { quantize_row(&x[r * k..(r + 1) * k], o, k, f) };
                }
            }
        });
        p
    }

    fn tile(&self, t: usize) -> Tile {
        let nb = self.k / 32;
        let base = (self.buf.as_ptr() as *const u8).wrapping_add(t * self.stride);
        let d = base.wrapping_add(self.lanes * self.k) as *const f32;
        let sum = d.wrapping_add(self.lanes * nb);
        let isum32 = sum.wrapping_add(self.lanes * nb) as *const i32;
        Tile {
            qs: base as *const i8,
            d,
            sum,
            isum32,
            isum16: isum32.wrapping_add(self.lanes * nb),
        }
    }
}

/// Where one quantized row goes: its 4-value groups `group` bytes apart from `qs` (or, with
/// `paired`, in a tile's order: see `Packed`), its
/// per-block values `meta` apart in `d`, `sum`, `isum32` and `isum16` (the tile layout of
/// `Packed`, or a plain row: groups 4 bytes apart, values 1 apart).
#[derive(Clone, Copy)]
struct RowOut {
    qs: *mut u8,
    group: usize,
    paired: bool,
    /// With `paired`: the legacy layout, groups of a pair of blocks side by side.
    pair_blocks: bool,
    /// Store `q + 128` as u8 (the wide tiles) instead of `q` as i8.
    offset: bool,
    d: *mut f32,
    sum: *mut f32,
    isum32: *mut i32,
    isum16: *mut i32,
    meta: usize,
}

/// How activations are quantized for a weight type. Measured against llama.cpp's outputs on
/// Gemma 3 270M Q4_K_M (tests/test_model_gemma3.py, 2,184 positions): per-256 scales for the
/// K-quants as ggml's `quantize_row_q8_K` and f32 per-32 scales for the others agree best
/// (top-1 0.9886; per-32 for all types 0.9849; ggml's f16-rounded per-32 `quantize_row_q8_0`
/// for Q8_0/Q5_0 weights as well 0.9808; f32 activations 0.9853).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(super) enum ActFormat {
    /// Per 32 values `d = amax / 127`, `q = rint(x / d)` (Q8_0 / Q4_0 / Q5_0 weights).
    Per32,
    /// ggml's `quantize_row_q8_K` (K-quants): per 256 values, with `max` the first value of
    /// largest magnitude, `q = rint(x * (-127 / max))` and `d = 1 / (-127 / max)` (each
    /// 32-value block of the 256 carries that `d`).
    Q8K,
}

/// The activation format `ty`'s kernel multiplies.
pub(super) fn format_of(ty: BlockType) -> ActFormat {
    if matches!(ty, BlockType::Q4_K | BlockType::Q6_K) {
        ActFormat::Q8K
    } else {
        ActFormat::Per32
    }
}

/// Quantize one row of `k` values in format `f` (`k` a multiple of 256 for `Q8K`): the one
/// quantization every kernel here multiplies. Rounding is to nearest, ties to even (the MXCSR
/// default, as ggml's AVX code and its `nearest_int`).
/// SAFETY: `available()`; `o` has room for `k` values.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,f16c")]
unsafe fn quantize_row(x: &[f32], o: RowOut, k: usize, f: ActFormat) {
    let nb = k / 32;
    let abs = _mm512_set1_epi32(0x7FFF_FFFF);
    let load = |b: usize| unsafe {
        (
            _mm512_loadu_ps(x.as_ptr().add(32 * b)),
            _mm512_loadu_ps(x.as_ptr().add(32 * b + 16)),
        )
    };
    let absv = |v: __m512| _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(v), abs));
    let (mut d, mut scale) = (0f32, 0f32);
    for b in 0..nb {
        let (v0, v1) = load(b);
        match f {
            ActFormat::Q8K if b % 8 == 0 => {
                let mut amax = 0f32;
                for i in 0..8 {
                    let (u0, u1) = load(b + i);
                    amax = amax.max(_mm512_reduce_max_ps(_mm512_max_ps(absv(u0), absv(u1))));
                }
                // the first value of that magnitude, with its sign
                let max = x[32 * b..32 * b + 256]
                    .iter()
                    .copied()
                    .find(|v| v.abs() == amax)
                    .unwrap_or(0.0);
                if amax == 0.0 || max == 0.0 {
                    (d, scale) = (0.0, 0.0);
                } else {
                    scale = -127.0 / max;
                    d = 1.0 / scale;
                }
            }
            ActFormat::Q8K => {}
            ActFormat::Per32 => {
                let amax = _mm512_reduce_max_ps(_mm512_max_ps(absv(v0), absv(v1)));
                d = amax / 127.0;
                scale = if d > 0.0 { 1.0 / d } else { 0.0 };
            }
        }
        unsafe {
            let lim = _mm512_set1_epi32(127);
            let q = |v| {
                let q = _mm512_cvtps_epi32(_mm512_mul_ps(v, _mm512_set1_ps(scale)));
                _mm512_max_epi32(
                    _mm512_min_epi32(q, lim),
                    _mm512_sub_epi32(_mm512_setzero_si512(), lim),
                )
            };
            let (q0, q1) = (q(v0), q(v1));
            let (s0, s1) = (_mm512_reduce_add_epi32(q0), _mm512_reduce_add_epi32(q1));
            let mut bytes = [0u32; 8];
            _mm_storeu_si128(bytes.as_mut_ptr() as *mut __m128i, _mm512_cvtepi32_epi8(q0));
            _mm_storeu_si128(
                bytes.as_mut_ptr().add(4) as *mut __m128i,
                _mm512_cvtepi32_epi8(q1),
            );
            for (g, v) in bytes.iter().enumerate() {
                // (an odd last block of the pair layout takes the K-quants' paired one)
                let odd_last = b + 1 == nb && nb % 2 == 1;
                let at = if o.pair_blocks && !odd_last {
                    // group g of blocks b & !1 and (b & !1) + 1 side by side (lanes 0..7,
                    // 8..15)
                    (b & !1) * 8 * o.group + g * 2 * o.group + (b % 2) * o.group
                } else if o.paired {
                    // groups g and g + 4 of a block side by side (lanes 0..7, 8..15)
                    b * 8 * o.group + (g % 4) * 2 * o.group + (g / 4) * o.group
                } else {
                    (8 * b + g) * o.group
                };
                let v = if o.offset { *v ^ 0x8080_8080 } else { *v };
                (o.qs.add(at) as *mut u32).write_unaligned(v);
            }
            *o.d.add(b * o.meta) = d;
            *o.sum.add(b * o.meta) = d * (s0 + s1) as f32;
            *o.isum32.add(b * o.meta) = s0 + s1;
            *o.isum16.add(2 * b * o.meta) = s0;
            *o.isum16.add((2 * b + 1) * o.meta) = s1;
        }
    }
}

/// Tiles a thread takes at a time from its own region of a product, and from the back of
/// another's once its own is done (`pool::run_ranges`).
const OWN_TILES: usize = 2;
const STEAL_TILES: usize = 1;

/// For each weight `ws[p]` (`[n_p, k]`, all `supports`ed), `out[:, c_p..c_p + n_p]` = the
/// products of `x` (`[m, k]`, any `m`) quantized to 8 bits with the rows of `ws[p]`, `c_p`
/// the rows of the weights before it and `out` `[m, sum n_p]` (sizes checked by the caller,
/// `available()`). Weight rows are split between threads by bytes, whatever part they are in.
pub(super) fn matmul_parts(
    x: &[f32],
    m: usize,
    ws: &[BlockMatrix<'_>],
    out: &mut [f32],
    threads: usize,
) {
    if m <= few_rows_limit(ws) {
        few_rows_parts(x, m, ws, out, threads);
        return;
    }
    let ptr = OutPtr(out.as_mut_ptr());
    let ld: usize = ws.iter().map(|w| w.n).sum();
    let k = ws[0].k;
    // up to 8 rows (past few_rows_limit): one tile of 8 lanes; more: tiles of 16 (Gemma 3 270M's matrices, one
    // core each of two: 8 rows 43 ms with 8 lanes, 69 with 16; 64 rows 297 and 220 ms)
    let lanes = if m <= LANES { LANES } else { WIDE_LANES };
    // one quantization per format the parts take
    let pack = |f: ActFormat| {
        ws.iter()
            .any(|w| format_of(w.ty) == f)
            // SAFETY: available() checked by the caller
            .then(|| unsafe { Packed::quantize(x, m, k, f, lanes, threads) })
    };
    let (p32, q8k) = (pack(ActFormat::Per32), pack(ActFormat::Q8K));
    let packed_for = |ty| match format_of(ty) {
        ActFormat::Per32 => p32.as_ref().expect("quantized for the parts that take it"),
        ActFormat::Q8K => q8k.as_ref().expect("quantized for the parts that take it"),
    };
    let n_tiles = m.div_ceil(lanes);
    let (tiles, regions) = row_tile_regions(ws, n_tiles, threads);
    crate::pool::run_ranges(&regions, OWN_TILES, STEAL_TILES, &|a, b| {
        for &(p, lo, hi, col) in &tiles[a..b] {
            // SAFETY: available(); rows lo..hi of ws[p] exist and their output columns
            // belong to this range alone
            unsafe { weight_rows(packed_for(ws[p].ty), &ws[p], lo, hi, ptr, col, ld) };
        }
    });
}

/// Rows `lo..hi` of `w` times every packed row, into columns `col + (lo..hi)` of `out`
/// (`[m, ld]`). SAFETY: as `matmul_parts`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn weight_rows(
    p: &Packed,
    w: &BlockMatrix<'_>,
    lo: usize,
    hi: usize,
    out: OutPtr,
    col: usize,
    ld: usize,
) {
    let rb = w.row_bytes();
    let end = w.raw.as_ptr().wrapping_add(w.raw.len());
    let row_at = |n: usize| w.raw.as_ptr().wrapping_add(n * rb);
    if p.lanes == WIDE_LANES {
        // WIDE_ROWS weight rows at a time, unpacked once, times every tile
        let (mut pr4, mut pr1) = (Prepared::<WIDE_ROWS>::new(), Prepared::<1>::new());
        let mut n = lo;
        while n < hi {
            let step = if hi - n >= WIDE_ROWS { WIDE_ROWS } else { 1 };
            // SAFETY: rows n..n + step < w.n hold k / block whole blocks
            unsafe {
                if step == WIDE_ROWS {
                    prepare(w.ty, std::array::from_fn(|i| row_at(n + i)), w.k, &mut pr4);
                } else {
                    prepare(w.ty, [row_at(n)], w.k, &mut pr1);
                }
            }
            for t in 0..p.tiles {
                let tile = p.tile(t);
                let valid = p.lanes.min(p.m - t * p.lanes);
                let mut lanes = [[0f32; 16]; WIDE_ROWS];
                // SAFETY: the tile holds k values per row
                unsafe {
                    if step == WIDE_ROWS {
                        for (l, y) in lanes.iter_mut().zip(multiply(w.ty, &pr4, &tile)) {
                            _mm512_storeu_ps(l.as_mut_ptr(), y);
                        }
                    } else {
                        let [y] = multiply(w.ty, &pr1, &tile);
                        _mm512_storeu_ps(lanes[0].as_mut_ptr(), y);
                    }
                }
                for (i, l) in lanes[..step].iter().enumerate() {
                    for (r, v) in l[..valid].iter().enumerate() {
                        // SAFETY: row t * lanes + r < m, column col + n + i < ld: inside
                        // out, and the column belongs to this thread
                        unsafe { *out.at((t * p.lanes + r) * ld + col + n + i) = *v };
                    }
                }
            }
            n += step;
        }
        return;
    }
    // at most 8 rows: one tile, one pass over the weights (decode)
    debug_assert_eq!(p.tiles, 1);
    let tile = p.tile(0);
    let mut first = lo;
    if matches!(w.ty, BlockType::Q8_0 | BlockType::Q4_0 | BlockType::Q5_0) {
        // 16 weight rows at a time in lanes (`lanes_legacy`), the rest row by row
        let nb = w.k / 32;
        while hi - first >= LEGACY_LANE_ROWS {
            let row0 = row_at(first);
            let mut ys = [_mm512_setzero_ps(); LANES];
            // SAFETY: rows first..first + 16 < w.n hold nb whole blocks; the tile holds them
            unsafe {
                use BlockType::*;
                let ys = &mut ys[..p.m];
                match w.ty {
                    Q8_0 => lanes_legacy_rows::<{ Q8_0 as u32 }>(row0, rb, nb, &tile, end, ys),
                    Q4_0 => lanes_legacy_rows::<{ Q4_0 as u32 }>(row0, rb, nb, &tile, end, ys),
                    _ => lanes_legacy_rows::<{ Q5_0 as u32 }>(row0, rb, nb, &tile, end, ys),
                }
            }
            for (r, y) in ys[..p.m].iter().enumerate() {
                // SAFETY: row r < m, columns col + first..+16 < ld: inside out, and they
                // belong to this thread
                unsafe { _mm512_storeu_ps(out.at(r * ld + col + first), *y) };
            }
            first += LEGACY_LANE_ROWS;
        }
    }
    for n in first..hi {
        // ask for the bytes ahead now (see `exact512`)
        prefetch_lines::<_MM_HINT_T0>(row_at(n).wrapping_add(PREFETCH_AHEAD), rb, end);
        let mut lanes = [0f32; LANES];
        // SAFETY: row n < w.n holds k / block whole blocks; the tile holds k values per row
        unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), row_dot(w.ty, row_at(n), w.k, &tile)) };
        for (r, v) in lanes[..p.m].iter().enumerate() {
            // SAFETY: row r < m, column col + n < ld: inside out, and the column belongs to
            // this thread
            unsafe { *out.at(r * ld + col + n) = *v };
        }
    }
}

/// The products of weight row `row` (`k` values of `ty`) with the tile's 8 rows, one per lane.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn row_dot(ty: BlockType, row: *const u8, k: usize, t: &Tile) -> __m256 {
    use BlockType::*;
    unsafe {
        match ty {
            Q8_0 => dot_legacy::<{ Q8_0 as u32 }>(row, k / 32, t),
            Q4_0 => dot_legacy::<{ Q4_0 as u32 }>(row, k / 32, t),
            Q5_0 => dot_legacy::<{ Q5_0 as u32 }>(row, k / 32, t),
            Q4_K => dot_q4_k(row, k / 256, t),
            _ => dot_q6_k(row, k / 256, t),
        }
    }
}

/// The f16 at `p` (unaligned) in all 8 lanes.
#[target_feature(enable = "avx2,f16c")]
#[inline]
unsafe fn f16x8(p: *const u8) -> __m256 {
    let h = unsafe { (p as *const i16).read_unaligned() };
    _mm256_cvtph_ps(_mm_set1_epi16(h))
}

/// The f16 at `p` (unaligned) as f32.
#[target_feature(enable = "avx2,f16c")]
#[inline]
unsafe fn f16(p: *const u8) -> f32 {
    _mm256_cvtss_f32(unsafe { f16x8(p) })
}

/// The 16 bytes at `p` in both halves of a vector.
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn bcast128(p: *const u8) -> __m256i {
    _mm256_broadcastsi128_si256(unsafe { _mm_loadu_si128(p as *const __m128i) })
}

#[target_feature(enable = "avx2")]
#[inline]
fn low4(v: __m256i) -> __m256i {
    _mm256_and_si256(v, _mm256_set1_epi8(0x0F))
}

#[target_feature(enable = "avx2")]
#[inline]
fn high4(v: __m256i) -> __m256i {
    _mm256_and_si256(_mm256_srli_epi16::<4>(v), _mm256_set1_epi8(0x0F))
}

/// Per lane, the sums of a block's codes times their activations: `c` holds codes 0..15 in
/// its two low 128-bit quarters and codes 16..31 in its two high ones, `a` the tile's block
/// (4 vectors: groups g and g + 4 of the 8 rows). Lanes 0..7 sum codes 0..15 of each row,
/// lanes 8..15 codes 16..31.
#[target_feature(enable = "avx512f,avx512vnni")]
#[inline]
unsafe fn dot32(c: __m512i, a: *const i8) -> __m512i {
    let ld = |i: usize| unsafe { _mm512_load_si512(a.add(64 * i) as *const _) };
    let z = _mm512_setzero_si512();
    let s0 = _mm512_dpbusd_epi32(z, _mm512_shuffle_epi32::<0x00>(c), ld(0));
    let s1 = _mm512_dpbusd_epi32(z, _mm512_shuffle_epi32::<0x55>(c), ld(1));
    let s0 = _mm512_dpbusd_epi32(s0, _mm512_shuffle_epi32::<0xAA>(c), ld(2));
    let s1 = _mm512_dpbusd_epi32(s1, _mm512_shuffle_epi32::<0xFF>(c), ld(3));
    _mm512_add_epi32(s0, s1)
}

/// Lanes 0..7 plus lanes 8..15.
#[target_feature(enable = "avx512f")]
#[inline]
fn fold(v: __m512i) -> __m256i {
    _mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64::<1>(v))
}

/// `fold` of two vectors in one: `[fold(a), fold(b)]`.
#[target_feature(enable = "avx512f")]
#[inline]
fn fold_pair(a: __m512i, b: __m512i) -> __m512i {
    _mm512_add_epi32(
        _mm512_shuffle_i64x2::<0b01_00_01_00>(a, b),
        _mm512_shuffle_i64x2::<0b11_10_11_10>(a, b),
    )
}

/// 32 bytes at `p` as [0..16, 0..16, 16..32, 16..32] (the quarters `dot32` reads).
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn spread32(p: *const u8) -> __m512i {
    let v = _mm512_castsi256_si512(unsafe { _mm256_loadu_si256(p as *const __m256i) });
    _mm512_permutexvar_epi64(_mm512_setr_epi64(0, 1, 0, 1, 2, 3, 2, 3), v)
}

#[target_feature(enable = "avx512f,avx512bw")]
#[inline]
fn low4x(v: __m512i) -> __m512i {
    _mm512_and_si512(v, _mm512_set1_epi8(0x0F))
}

#[target_feature(enable = "avx512f,avx512bw")]
#[inline]
fn high4x(v: __m512i) -> __m512i {
    _mm512_and_si512(_mm512_srli_epi16::<4>(v), _mm512_set1_epi8(0x0F))
}

/// Lanes of 8 i32 at `p` (aligned).
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn ld_i32(p: *const i32) -> __m256i {
    unsafe { _mm256_load_si256(p as *const __m256i) }
}

#[target_feature(enable = "avx2")]
#[inline]
unsafe fn ld_f32(p: *const f32) -> __m256 {
    unsafe { _mm256_load_ps(p) }
}

/// Blocks of 32 with one f16 scale and codes whose integer sum with the activations is
/// `isum`: the shared chain `y[b & 1] = fma(f32(isum) * d_act, d_w, y[b & 1])`.
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn scale_block(y: &mut [__m256; 2], b: usize, isum: __m256i, t: &Tile, dw: __m256) {
    let f = _mm256_mul_ps(_mm256_cvtepi32_ps(isum), unsafe {
        ld_f32(t.d.add(b * LANES))
    });
    y[b & 1] = _mm256_fmadd_ps(f, dw, y[b & 1]);
}

/// The codes of legacy blocks `p0` and `p1` (type `T`) as unsigned bytes (Q8_0's + 128),
/// each block's codes 0..15 in both 128-bit lanes of its half of the first vector and
/// codes 16..31 likewise in the second: each block's bytes are broadcast from memory to
/// its two lanes (no cross-lane permute), nibbles and fifth bits unpacked for both at once.
/// SAFETY: both blocks exist.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2")]
#[inline]
unsafe fn legacy_pair_halves<const T: u32>(p0: *const u8, p1: *const u8) -> (__m512i, __m512i) {
    // the 16 bytes at `at` of each block, in both lanes of its half
    let halves = |at: usize| unsafe {
        let b = |p: *const u8| _mm256_broadcastsi128_si256(_mm_loadu_si128(p.add(at) as *const _));
        _mm512_inserti64x4::<1>(_mm512_castsi256_si512(b(p0)), b(p1))
    };
    if T == 8 {
        let flip = _mm512_set1_epi8(-128);
        return (
            _mm512_xor_si512(halves(2), flip),
            _mm512_xor_si512(halves(18), flip),
        );
    }
    // Q4_0: 16 nibble bytes after the scale, byte j holding codes j and j + 16; Q5_0: after
    // the scale and 4 bytes of fifth bits (bit j: code j's)
    let nib = halves(if T == 2 { 2 } else { 6 });
    let low4 = _mm512_set1_epi8(0x0F);
    let lo = _mm512_and_si512(nib, low4);
    let hi = _mm512_and_si512(_mm512_srli_epi16::<4>(nib), low4);
    if T == 2 {
        return (lo, hi);
    }
    let (q0, q1) = unsafe {
        (
            (p0.add(2) as *const u32).read_unaligned() as u64,
            (p1.add(2) as *const u32).read_unaligned() as u64,
        )
    };
    // each block's 16 bits twice, as its half's two lanes
    let twice = |a: u64, b: u64| a | a << 16 | b << 32 | b << 48;
    let fifth = _mm512_set1_epi8(0x10);
    (
        _mm512_or_si512(
            lo,
            _mm512_maskz_mov_epi8(twice(q0 & 0xFFFF, q1 & 0xFFFF), fifth),
        ),
        _mm512_or_si512(hi, _mm512_maskz_mov_epi8(twice(q0 >> 16, q1 >> 16), fifth)),
    )
}

/// Q8_0 / Q4_0 / Q5_0: the integer sum less zero point x the row's sum, then the chain.
/// Blocks go two at a time: both blocks' codes unpacked together (`legacy_pair_halves`), each
/// 4-code group of block `b` (even) broadcast to the low 8 lanes and of block `b + 1` to the
/// high 8, against the tile's pair layout (see `Packed`), so that the products land with
/// block `b`'s 8 rows in the low lanes and block `b + 1`'s in the high ones; their float
/// steps in one 16-lane vector, the low lanes holding the even chain and the high the odd;
/// each lane's operations are `scale_block`'s (the same bits). One block at a time with the
/// groups paired (g, g + 4) took per block a code spread, a fold of 16 lanes to 8, and for
/// Q5_0 an unpacking of its own; in-process A/B at 8 rows, two threads, hot: Q8_0 0.94x the
/// time, Q5_0 0.89x, Q4_0 0.80x.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn dot_legacy<const T: u32>(row: *const u8, nb: usize, t: &Tile) -> __m256 {
    let (bb, ty) = legacy_layout(T);
    let shift = |z: __m512i| legacy_zero_point::<T>(z);
    // the f16 scales of two blocks, each in 8 lanes
    let scales = |p0: *const u8, p1: *const u8| unsafe {
        let h = |p: *const u8| _mm256_set1_epi16((p as *const i16).read_unaligned());
        _mm512_cvtph_ps(_mm256_permute2x128_si256::<0x20>(h(p0), h(p1)))
    };
    let mut y = _mm512_setzero_ps();
    let mut b = 0;
    while b + 1 < nb {
        unsafe {
            let (p0, p1) = (row.add(bb * b), row.add(bb * (b + 1)));
            let (lo, hi) = legacy_pair_halves::<T>(p0, p1);
            // groups 0..3 of the pair's two blocks, then groups 4..7 (`dot32`'s broadcasts)
            let a = t.qs.add(b * 8 * LANES * 4);
            let s = _mm512_add_epi32(dot32(lo, a), dot32(hi, a.add(4 * 64)));
            let z = shift(_mm512_loadu_si512(t.isum32.add(b * LANES) as *const _));
            let f = _mm512_mul_ps(
                _mm512_cvtepi32_ps(_mm512_sub_epi32(s, z)),
                _mm512_loadu_ps(t.d.add(b * LANES)),
            );
            y = _mm512_fmadd_ps(f, scales(p0, p1), y);
        }
        b += 2;
    }
    let odd = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(y)));
    let mut even = _mm512_castps512_ps256(y);
    if b < nb {
        // an odd last block (laid out as a K-quant tile's block: groups g and g + 4 side by
        // side): the even chain
        unsafe {
            let p = row.add(bb * b);
            let c = _mm512_castsi256_si512(legacy_codes(ty, p));
            let spread = _mm512_setr_epi64(0, 1, 0, 1, 2, 3, 2, 3);
            let s = fold(dot32(
                _mm512_permutexvar_epi64(spread, c),
                t.qs.add(b * 8 * LANES * 4),
            ));
            let z = _mm512_castsi512_si256(shift(_mm512_castsi256_si512(ld_i32(
                t.isum32.add(b * LANES),
            ))));
            let mut yy = [even, odd];
            scale_block(&mut yy, b, _mm256_sub_epi32(s, z), t, f16x8(p));
            even = yy[0];
        }
    }
    _mm256_add_ps(even, odd)
}

/// The 4 32-bit groups of the 16 bytes at `p` of each of 16 rows `rb` bytes apart: vector
/// `g` lane `i` holds group `g` of row `i` (4 rows' bytes to a vector, one 128-bit lane
/// each, then a 4 x 4 transpose in every lane).
/// SAFETY: 16 bytes at `p + i rb` exist for `i < 16`.
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn lane_words16(p: *const u8, rb: usize) -> [__m512i; 4] {
    let at = |r: usize| unsafe { _mm_loadu_si128(p.add(r * rb) as *const __m128i) };
    // v(j) lane q: row 4q + j
    let v = |j: usize| {
        let x = _mm512_castsi128_si512(at(j));
        let x = _mm512_inserti32x4::<1>(x, at(4 + j));
        let x = _mm512_inserti32x4::<2>(x, at(8 + j));
        _mm512_inserti32x4::<3>(x, at(12 + j))
    };
    let (v0, v1, v2, v3) = (v(0), v(1), v(2), v(3));
    let (a, b) = (_mm512_unpacklo_epi32(v0, v1), _mm512_unpackhi_epi32(v0, v1));
    let (c, d) = (_mm512_unpacklo_epi32(v2, v3), _mm512_unpackhi_epi32(v2, v3));
    [
        _mm512_unpacklo_epi64(a, c),
        _mm512_unpackhi_epi64(a, c),
        _mm512_unpacklo_epi64(b, d),
        _mm512_unpackhi_epi64(b, d),
    ]
}

/// The 8 32-bit groups of the 32 bytes `c[i]` of each of 16 rows: vector `g` lane `i` holds
/// group `g` of row `i` (two rows to a vector, then an 8 x 8 transpose in each half).
#[target_feature(enable = "avx512f")]
#[inline]
fn transpose_words32(c: [__m256i; 16]) -> [__m512i; 8] {
    // z[i]: rows i and i + 4 (i < 4), rows i + 4 and i + 8 (i >= 4), so that the transpose
    // leaves the rows in order
    let mut z = [_mm512_setzero_si512(); 8];
    for (i, zi) in z.iter_mut().enumerate() {
        let (lo, hi) = if i < 4 { (i, i + 4) } else { (i + 4, i + 8) };
        *zi = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(c[lo]), c[hi]);
    }
    let t1 = |a: __m512i, c: __m512i| (_mm512_unpacklo_epi32(a, c), _mm512_unpackhi_epi32(a, c));
    let (t0, t1_) = t1(z[0], z[1]);
    let (t2, t3) = t1(z[2], z[3]);
    let (t4, t5) = t1(z[4], z[5]);
    let (t6, t7) = t1(z[6], z[7]);
    // u[g] per 128-bit lane: group g (lanes 0, 2) or g + 4 (lanes 1, 3) of 4 rows
    let u = [
        _mm512_unpacklo_epi64(t0, t2),
        _mm512_unpackhi_epi64(t0, t2),
        _mm512_unpacklo_epi64(t1_, t3),
        _mm512_unpackhi_epi64(t1_, t3),
        _mm512_unpacklo_epi64(t4, t6),
        _mm512_unpackhi_epi64(t4, t6),
        _mm512_unpacklo_epi64(t5, t7),
        _mm512_unpackhi_epi64(t5, t7),
    ];
    let mut w = [_mm512_setzero_si512(); 8];
    for g in 0..4 {
        w[g] = _mm512_shuffle_i32x4::<0b10_00_10_00>(u[g], u[g + 4]);
        w[g + 4] = _mm512_shuffle_i32x4::<0b11_01_11_01>(u[g], u[g + 4]);
    }
    w
}

/// `transpose_words32` of the 32 bytes at `p + i rb` for `i < 16`.
/// SAFETY: the bytes exist.
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn lane_words32(p: *const u8, rb: usize) -> [__m512i; 8] {
    let mut c = [_mm256_setzero_si256(); 16];
    for (i, ci) in c.iter_mut().enumerate() {
        *ci = unsafe { _mm256_loadu_si256(p.add(i * rb) as *const __m256i) };
    }
    transpose_words32(c)
}

/// Weight rows a legacy kernel for 2-8 activation rows takes together in lanes
/// (`lanes_legacy`).
const LEGACY_LANE_ROWS: usize = 16;

/// Quantized activations as `lanes_legacy` reads them: an 8-row `Tile` (2-8 rows) or
/// `OneRow`s (a decode step of one sequence). Arguments: the row's block count `nb`, block
/// `b`, 4-code group `g` (0..8), activation row `r`.
trait LegacyActs {
    /// Codes `4g..4g + 4` of block `b` of row `r`, as one little-endian word.
    /// SAFETY: the activations hold block `b` of row `r`.
    unsafe fn codes4(&self, nb: usize, b: usize, g: usize, r: usize) -> i32;
    /// Block `b`'s code sum.
    /// SAFETY: as `codes4`.
    unsafe fn code_sum(&self, nb: usize, b: usize, r: usize) -> i32;
    /// Block `b`'s scale.
    /// SAFETY: as `codes4`.
    unsafe fn scale(&self, nb: usize, b: usize, r: usize) -> f32;
}

impl LegacyActs for Tile {
    #[inline(always)]
    unsafe fn codes4(&self, nb: usize, b: usize, g: usize, r: usize) -> i32 {
        // where group g of block b starts (see `Packed`: pairs of blocks, an odd last block
        // as a K-quant tile's)
        let at = if b + 1 == nb && nb % 2 == 1 {
            b * 8 * LANES * 4 + ((g % 4) * 2 + g / 4) * LANES * 4
        } else {
            (b / 2) * 16 * LANES * 4 + (g * 2 + (b & 1)) * LANES * 4
        };
        // SAFETY: the tile holds block b of its 8 rows
        unsafe { (self.qs.add(at + 4 * r) as *const i32).read_unaligned() }
    }
    #[inline(always)]
    unsafe fn code_sum(&self, _nb: usize, b: usize, r: usize) -> i32 {
        // SAFETY: the tile holds block b of its 8 rows
        unsafe { *self.isum32.add(b * LANES + r) }
    }
    #[inline(always)]
    unsafe fn scale(&self, _nb: usize, b: usize, r: usize) -> f32 {
        // SAFETY: the tile holds block b of its 8 rows
        unsafe { *self.d.add(b * LANES + r) }
    }
}

impl LegacyActs for OneRow {
    #[inline(always)]
    unsafe fn codes4(&self, _nb: usize, b: usize, g: usize, _r: usize) -> i32 {
        // SAFETY: the row holds block b (plain order: 32 codes a block)
        unsafe { (self.q().add(32 * b + 4 * g) as *const i32).read_unaligned() }
    }
    #[inline(always)]
    unsafe fn code_sum(&self, _nb: usize, b: usize, _r: usize) -> i32 {
        // SAFETY: the row holds block b
        unsafe { *self.isum32.get_unchecked(b) }
    }
    #[inline(always)]
    unsafe fn scale(&self, _nb: usize, b: usize, _r: usize) -> f32 {
        // SAFETY: the row holds block b
        unsafe { *self.d.get_unchecked(b) }
    }
}

/// Legacy weights (`T`) times the first `M` (2, 4 or 8) rows of an 8-row tile, 16 weight rows
/// (`rb` bytes apart from `row0`) at a time with the weight rows in lanes: per block, the
/// 16 rows' codes turned by an 8 x 8 transpose of 32-bit groups (one vector per 4-code
/// group, lane `i` holding weight row `i`'s), then each activation row's 4 codes of a group
/// broadcast from the tile into `vpdpbusd`, so that the products land in the weight rows'
/// lanes with no reduction; then each activation row's chains `y[b & 1] = fma(f32(isum -
/// zero point x sum) * d_act, d_w, y[b & 1])`, `dot_legacy`'s operations in its order (the
/// same bits). `dot_legacy` takes one weight row against the tile's rows in lanes and
/// spends per pair of blocks 8 shuffles and a fold on 8 multiply-adds; here the transpose
/// is shared by the `M` activation rows.
/// SAFETY: rows `0..16` of `row0` hold `nb` blocks; the tile holds them; `end` is the
/// weight's last byte + 1.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn lanes_legacy<const T: u32, const M: usize, A: LegacyActs>(
    row0: *const u8,
    rb: usize,
    nb: usize,
    t: &A,
    end: *const u8,
) -> [__m512; M] {
    if T != BlockType::Q8_0 as u32 && nibble_lanes_available() {
        // SAFETY: as this function's; the CPU has nibble_lanes' instructions
        unsafe { lanes_legacy_nibbles::<T, M, A>(row0, rb, nb, t, end) }
    } else {
        // SAFETY: as this function's
        unsafe { lanes_legacy_body::<T, M, A, false>(row0, rb, nb, t, end) }
    }
}

/// `lanes_legacy` where Q4_0 / Q5_0 blocks take `nibble_lanes`.
/// SAFETY: as `lanes_legacy`; `nibble_lanes_available()`.
#[target_feature(
    enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c,avx512vbmi2,avx512bitalg"
)]
unsafe fn lanes_legacy_nibbles<const T: u32, const M: usize, A: LegacyActs>(
    row0: *const u8,
    rb: usize,
    nb: usize,
    t: &A,
    end: *const u8,
) -> [__m512; M] {
    // SAFETY: as this function's
    unsafe { lanes_legacy_body::<T, M, A, true>(row0, rb, nb, t, end) }
}

/// The body of `lanes_legacy`, inlined into a function with its target features (and with
/// `NIBBLES`, `nibble_lanes`' too).
#[inline(always)]
unsafe fn lanes_legacy_body<const T: u32, const M: usize, A: LegacyActs, const NIBBLES: bool>(
    row0: *const u8,
    rb: usize,
    nb: usize,
    t: &A,
    end: *const u8,
) -> [__m512; M] {
    let (bb, ty) = legacy_layout(T);
    // the 16 rows' f16 scales of block b, one per lane (low halves), from each row's first
    // 16 bytes (a 16-lane gather took a fifth of a hot Q8_0 product's time)
    // SAFETY: block b of each row has >= 16 bytes (a block has >= 18)
    let scales = |b: usize| unsafe { lane_words16(row0.add(bb * b), rb)[0] };
    // the next 16 rows follow these: their bytes in order, a block's share at a time
    let next = row0.wrapping_add(LEGACY_LANE_ROWS * rb);
    let share = LEGACY_LANE_ROWS * bb;
    let mut y = [[_mm512_setzero_ps(); 2]; M];
    // Q4_0 / Q5_0: blocks whose 32 bytes from their start lie inside the weight (all but a
    // weight's last block) take `nibble_lanes` where the CPU has its instructions; their
    // scales come with their codes
    let whole = if T != BlockType::Q8_0 as u32 && NIBBLES {
        let last = row0.wrapping_add((LEGACY_LANE_ROWS - 1) * rb);
        (0..nb)
            .take_while(|&b| last.wrapping_add(bb * b + 32) <= end)
            .count()
    } else {
        0
    };
    // the scales of the next block not in `whole`, read one block ahead
    let mut h = if whole < nb {
        scales(whole)
    } else {
        _mm512_setzero_si512()
    };
    for b in 0..nb {
        prefetch_lines::<_MM_HINT_T1>(next.wrapping_add(share * b), share, end);
        // w[g] lane i: group g of weight row i; hw lane i: its scale in the low half
        let (hw, w) = if b < whole {
            // SAFETY: 32 bytes from block b of each of the 16 rows exist (b < whole)
            unsafe { nibble_lanes::<T>(row0.add(bb * b), rb) }
        } else {
            let hw = h;
            if b + 1 < nb {
                h = scales(b + 1);
            }
            let w = if T == BlockType::Q8_0 as u32 {
                // SAFETY: block b of rows 0..16 exists
                let mut w = unsafe { lane_words32(row0.add(bb * b + 2), rb) };
                for wg in w.iter_mut() {
                    *wg = _mm512_xor_si512(*wg, _mm512_set1_epi8(-128));
                }
                w
            } else {
                let mut c = [_mm256_setzero_si256(); 16];
                for (i, ci) in c.iter_mut().enumerate() {
                    // SAFETY: block b of rows 0..16 exists
                    *ci = unsafe { legacy_codes(ty, row0.add(i * rb + bb * b)) };
                }
                transpose_words32(c)
            };
            (hw, w)
        };
        let dw = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(hw));
        // the activation rows side by side: each row's 8 multiply-adds are a chain, from
        // minus the zero point times the row's sum (integers: the same sum in any order)
        let mut s = [_mm512_setzero_si512(); M];
        for (r, sr) in s.iter_mut().enumerate() {
            // SAFETY: the activations hold block b of row r
            let zp = unsafe { t.code_sum(nb, b, r) } << legacy_zero_shift(T);
            *sr = _mm512_set1_epi32(-zp);
        }
        for (g, wg) in w.iter().enumerate() {
            for (r, sr) in s.iter_mut().enumerate() {
                // SAFETY: the activations hold block b of row r
                let a = unsafe { t.codes4(nb, b, g, r) };
                *sr = _mm512_dpbusd_epi32(*sr, *wg, _mm512_set1_epi32(a));
            }
        }
        for (r, (yr, s)) in y.iter_mut().zip(s).enumerate() {
            // SAFETY: the activations hold block b of row r
            unsafe {
                let f = _mm512_mul_ps(_mm512_cvtepi32_ps(s), _mm512_set1_ps(t.scale(nb, b, r)));
                yr[b & 1] = _mm512_fmadd_ps(f, dw, yr[b & 1]);
            }
        }
    }
    let mut out = [_mm512_setzero_ps(); M];
    for (o, yr) in out.iter_mut().zip(&y) {
        *o = _mm512_add_ps(yr[0], yr[1]);
    }
    out
}

/// Whether this CPU runs `nibble_lanes` (AVX512-VBMI2 and BITALG: Ice Lake, Zen 4 and later;
/// Cascade Lake has VNNI without them). `KVSHARE_KERNEL_NO_VBMI2=1` (read once) takes the
/// per-row unpack instead, so that the tests run both paths on one machine.
fn nibble_lanes_available() -> bool {
    static AVAILABLE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *AVAILABLE.get_or_init(|| {
        std::env::var_os("KVSHARE_KERNEL_NO_VBMI2").is_none_or(|v| v.is_empty() || v == "0")
            && std::is_x86_feature_detected!("avx512vbmi2")
            && std::is_x86_feature_detected!("avx512bitalg")
    })
}

/// The scales and codes of a Q4_0 / Q5_0 (`T`) block of 16 rows (`p + i rb`) as
/// `lanes_legacy` takes them (lane `i` of the first: row `i`'s f16 scale in its low half;
/// vector `g` lane `i` of the second: codes `4g..4g + 4` of row `i`, unsigned), turned before they
/// are unpacked: one `lane_words32` of the 32 bytes from each block's start, the 4-byte
/// groups of `qs` (and Q5_0's `qh`) cut out by a funnel shift, the nibbles split by masks
/// and Q5_0's fifth bits set by a bit shuffle of `qh` (a byte mask per group). Per row the
/// plain unpack (`legacy_codes`) took 6-8 operations on 256 bits; here each is on 16 rows.
/// The same codes, so the same bits.
/// SAFETY: 32 bytes at `p + i rb` exist for `i < 16`; `nibble_lanes_available()`.
#[target_feature(enable = "avx512f,avx512bw,avx512vbmi2,avx512bitalg")]
#[inline]
unsafe fn nibble_lanes<const T: u32>(p: *const u8, rb: usize) -> (__m512i, [__m512i; 8]) {
    // v[j] lane i: bytes 4j..4j + 4 of row i's block (d: 0..2, Q5_0's qh 2..6, qs after)
    let v = unsafe { lane_words32(p, rb) };
    let q5 = T == BlockType::Q5_0 as u32;
    // qs starts 2 bytes into v[0] (Q4_0) or v[1] (Q5_0)
    let first = usize::from(q5);
    let low = _mm512_set1_epi8(0x0F);
    let mut w = [_mm512_setzero_si512(); 8];
    for h in 0..4 {
        let q = _mm512_shrdi_epi32::<16>(v[first + h], v[first + h + 1]);
        w[h] = _mm512_and_si512(q, low);
        w[h + 4] = _mm512_and_si512(_mm512_srli_epi32::<4>(q), low);
    }
    if q5 {
        // code j's fifth bit is bit j of qh; byte b of group g in lane i (of 64-bit lane
        // i / 2) takes bit 4g + b of row i's qh, which sits in that 64-bit lane at
        // 32 (i % 2) + 4g + b
        let qh = _mm512_shrdi_epi32::<16>(v[0], v[1]);
        let pick = _mm512_set1_epi64(0x2322_2120_0302_0100);
        let sixteen = _mm512_set1_epi8(0x10);
        for (g, wg) in w.iter_mut().enumerate() {
            let at = _mm512_add_epi8(pick, _mm512_set1_epi8(4 * g as i8));
            let m = _mm512_bitshuffle_epi64_mask(qh, at);
            *wg = _mm512_mask_add_epi8(*wg, m, *wg, sixteen);
        }
    }
    (v[0], w)
}

/// `lanes_legacy` of one activation row (`one`): 16 weight rows' results.
/// SAFETY: as `lanes_legacy`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn lanes_legacy_one<const T: u32>(
    row0: *const u8,
    rb: usize,
    nb: usize,
    one: &OneRow,
    end: *const u8,
) -> [f32; LANE_ROWS] {
    let [y] = unsafe { lanes_legacy::<T, 1, OneRow>(row0, rb, nb, one, end) };
    let mut out = [0f32; LANE_ROWS];
    unsafe { _mm512_storeu_ps(out.as_mut_ptr(), y) };
    out
}

/// `lanes_legacy` of the tile's first `ys.len()` (2-8) rows into `ys`, as 2, 4 or 8 of its
/// rows (the rows past them are zeros).
/// SAFETY: as `lanes_legacy`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn lanes_legacy_rows<const T: u32>(
    row0: *const u8,
    rb: usize,
    nb: usize,
    t: &Tile,
    end: *const u8,
    ys: &mut [__m512],
) {
    let m = ys.len();
    unsafe {
        match m {
            2 => ys.copy_from_slice(&lanes_legacy::<T, 2, Tile>(row0, rb, nb, t, end)),
            3 | 4 => ys.copy_from_slice(&lanes_legacy::<T, 4, Tile>(row0, rb, nb, t, end)[..m]),
            _ => ys.copy_from_slice(&lanes_legacy::<T, 8, Tile>(row0, rb, nb, t, end)[..m]),
        }
    }
}

/// The 8 sub-block scales and minima (6 bits each) of the Q4_K/Q5_K block at `p`
/// (ggml's `get_scale_min_k4`).
#[inline]
unsafe fn k4_scale_min(p: *const u8) -> ([u8; 8], [u8; 8]) {
    let (sc, mn) = unsafe { k4_scale_min_words(p) };
    (sc.to_le_bytes(), mn.to_le_bytes())
}

/// Q4_K: per sub-block `j` of 32, `ys = fma(f32(isum) * d_act, d * sc_j, ys)` and
/// `ym = fma(d_act * sum(a), dmin * m_j, ym)` (both products of an f16 and a 6-bit integer:
/// exact in f32); the result `ys - ym`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn dot_q4_k(row: *const u8, nsb: usize, t: &Tile) -> __m256 {
    let mut ys = _mm256_setzero_ps();
    let mut ym = _mm256_setzero_ps();
    for s in 0..nsb {
        unsafe {
            let p = row.add(144 * s);
            let (d, dmin) = (f16(p), f16(p.add(2)));
            let (sc, mn) = k4_scale_min(p);
            for i in 0..4 {
                let q = spread32(p.add(16 + 32 * i));
                for (half, c) in [low4x(q), high4x(q)].into_iter().enumerate() {
                    let j = 2 * i + half;
                    let b = 8 * s + j;
                    let isum = fold(dot32(c, t.qs.add(b * 8 * LANES * 4)));
                    let f = _mm256_mul_ps(_mm256_cvtepi32_ps(isum), ld_f32(t.d.add(b * LANES)));
                    ys = _mm256_fmadd_ps(f, _mm256_set1_ps(d * sc[j] as f32), ys);
                    ym = _mm256_fmadd_ps(
                        ld_f32(t.sum.add(b * LANES)),
                        _mm256_set1_ps(dmin * mn[j] as f32),
                        ym,
                    );
                }
            }
        }
    }
    _mm256_sub_ps(ys, ym)
}

/// Q6_K: per 32 values (two sub-blocks of 16 with i8 scales: `dot32`'s two halves), the
/// integer `sc_0 * (isum_0 - 32 sum_0) + sc_1 * (isum_1 - 32 sum_1)`, then the chain with `d`;
/// the float steps of two such blocks in one 16-lane vector, as `dot_legacy`'s.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn dot_q6_k(row: *const u8, nsb: usize, t: &Tile) -> __m256 {
    let three = _mm512_set1_epi8(3);
    let mut y = _mm512_setzero_ps();
    for s in 0..nsb {
        unsafe {
            let p = row.add(210 * s);
            let dw = _mm512_cvtph_ps(_mm256_set1_epi16(
                (p.add(208) as *const i16).read_unaligned(),
            ));
            let scales = p.add(192) as *const i8;
            for n in 0..2 {
                let ql = p.add(64 * n);
                let (la, lb) = (spread32(ql), spread32(ql.add(32)));
                let h = spread32(p.add(128 + 32 * n));
                // block 8 s + 4 n + q's integer sums (see `dot_q6_k`'s doc)
                let block = |q: usize| {
                    // q1..q4 of ggml's dequantize_row_q6_K: low nibbles of ql[0..32],
                    // ql[32..64], then their high nibbles; qh bits 2q..2q + 1 on top
                    let nib = match q {
                        0 => low4x(la),
                        1 => low4x(lb),
                        2 => high4x(la),
                        _ => high4x(lb),
                    };
                    let cnt = _mm_cvtsi32_si128(2 * q as i32);
                    let top =
                        _mm512_slli_epi16::<4>(_mm512_and_si512(_mm512_srl_epi16(h, cnt), three));
                    let b = 8 * s + 4 * n + q;
                    let raw = dot32(_mm512_or_si512(nib, top), t.qs.add(b * 8 * LANES * 4));
                    let z = _mm512_slli_epi32::<5>(_mm512_load_si512(
                        t.isum16.add(2 * b * LANES) as *const _
                    ));
                    let sc = _mm512_mask_set1_epi32(
                        _mm512_set1_epi32(*scales.add(8 * n + 2 * q) as i32),
                        0xFF00,
                        *scales.add(8 * n + 2 * q + 1) as i32,
                    );
                    _mm512_mullo_epi32(_mm512_sub_epi32(raw, z), sc)
                };
                for q in [0, 2] {
                    let (v0, v1) = (block(q), block(q + 1));
                    // block b (even) in the low lanes, b + 1 in the high
                    let iv = fold_pair(v0, v1);
                    let b = 8 * s + 4 * n + q;
                    let f =
                        _mm512_mul_ps(_mm512_cvtepi32_ps(iv), _mm512_loadu_ps(t.d.add(b * LANES)));
                    y = _mm512_fmadd_ps(f, dw, y);
                }
            }
        }
    }
    let odd = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(y)));
    _mm256_add_ps(_mm512_castps512_ps256(y), odd)
}

/// One activation row quantized as `quantize_row` does, in plain order (a decode step of one
/// sequence): `q[k]`, and per block `d`, `sum`, `isum32`, per 16 values `isum16`. Each is
/// followed by zeros (a 64-value chunk or 16 blocks), so a kernel may read a whole vector past
/// the row's last block.
pub(super) struct OneRow {
    q: Vec<Line>,
    d: Vec<f32>,
    sum: Vec<f32>,
    isum32: Vec<i32>,
    isum16: Vec<i32>,
}

impl OneRow {
    /// SAFETY: `available()`; `x.len() == k`, a multiple of 32.
    unsafe fn quantize(x: &[f32], k: usize, f: ActFormat) -> OneRow {
        let nb = k / 32;
        let mut r = OneRow {
            q: vec![Line([0; 64]); k.div_ceil(64) + 1],
            d: vec![0.0; nb + 16],
            sum: vec![0.0; nb + 16],
            isum32: vec![0; nb + 16],
            isum16: vec![0; 2 * nb + 16],
        };
        let o = RowOut {
            qs: r.q.as_mut_ptr() as *mut u8,
            group: 4,
            paired: false,
            pair_blocks: false,
            offset: false,
            d: r.d.as_mut_ptr(),
            sum: r.sum.as_mut_ptr(),
            isum32: r.isum32.as_mut_ptr(),
            isum16: r.isum16.as_mut_ptr(),
            meta: 1,
        };
        // SAFETY: the buffers hold k values and nb blocks
        unsafe { quantize_row(x, o, k, f) };
        r
    }

    fn q(&self) -> *const i8 {
        self.q.as_ptr() as *const i8
    }
}

/// `out[a, c_p + n]` for `m` <= `few_rows_limit` activation rows (see `matmul_parts`): each row
/// quantized alone (`OneRow`), 16 weight rows at a time in lanes (`lanes_q4_k_16`,
/// `one_q6_k_16` / `many_q6_k_16`, `lanes_legacy_one`), the rest of a
/// tile row by row (`one_*`); the same bits for a row whatever `m` is.
fn few_rows_parts(x: &[f32], m: usize, ws: &[BlockMatrix<'_>], out: &mut [f32], threads: usize) {
    let ptr = OutPtr(out.as_mut_ptr());
    let k = ws[0].k;
    let ld: usize = ws.iter().map(|w| w.n).sum();
    let quantize = |f: ActFormat| -> Vec<OneRow> {
        if !ws.iter().any(|w| format_of(w.ty) == f) {
            return Vec::new();
        }
        // SAFETY: available() checked by the caller; x holds m rows of k values
        (0..m)
            .map(|a| unsafe { OneRow::quantize(&x[a * k..(a + 1) * k], k, f) })
            .collect()
    };
    let (p32, q8k) = (quantize(ActFormat::Per32), quantize(ActFormat::Q8K));
    let rows_for = |ty| match format_of(ty) {
        ActFormat::Per32 => &p32,
        ActFormat::Q8K => &q8k,
    };
    let (tiles, regions) = row_tile_regions(ws, 1, threads);
    crate::pool::run_ranges(&regions, OWN_TILES, STEAL_TILES, &|a, b| {
        for &(p, lo, hi, col) in &tiles[a..b] {
            let ones = rows_for(ws[p].ty);
            let tile = RowsOut { out: ptr, col, ld };
            // SAFETY: available(); rows lo..hi of ws[p] exist and their output columns
            // belong to this part alone
            unsafe {
                match m {
                    1 => few_row_rows::<1>(ones, &ws[p], lo, hi, tile),
                    2 => few_row_rows::<2>(ones, &ws[p], lo, hi, tile),
                    3 => few_row_rows::<3>(ones, &ws[p], lo, hi, tile),
                    4 => few_row_rows::<4>(ones, &ws[p], lo, hi, tile),
                    5 => few_row_rows::<5>(ones, &ws[p], lo, hi, tile),
                    6 => few_row_rows::<6>(ones, &ws[p], lo, hi, tile),
                    7 => few_row_rows::<7>(ones, &ws[p], lo, hi, tile),
                    _ => few_row_rows::<8>(ones, &ws[p], lo, hi, tile),
                }
            }
        }
    });
}

/// Most activation rows `few_rows_parts` takes for a product with weights `ws` (more:
/// `Packed` tiles). Per weight row `many_q6_k_16`'s cost grows with each activation row (its
/// sums are reduced and transposed row by row) while the packed kernels' stays flat up to 8:
/// measured on Gemma 3 270M's decode steps and the random 1.9B qwen3's, alternating builds,
/// it is faster up to 4 rows (the 1.9B's batch of 4: 1.4x). `lanes_q4_k_16` turns a block's
/// codes once for all its activation rows: against the packed `dot_q4_k`, the 1.9B's Q4_K
/// products at 5 rows 0.56x the time, 8 rows 0.71x (Gemma's 0.62x, 0.83x). The legacy
/// types take the packed tiles from 2 rows (`lanes_legacy`).
fn few_rows_limit(ws: &[BlockMatrix<'_>]) -> usize {
    let limit = |ty| match ty {
        BlockType::Q4_K => 8,
        BlockType::Q6_K => 4,
        _ => 1,
    };
    ws.iter().map(|w| limit(w.ty)).min().unwrap_or(1)
}

/// Where a part's results go: `out[a * ld + col + n]` for activation row `a`, weight row `n`.
#[derive(Clone, Copy)]
struct RowsOut {
    out: OutPtr,
    col: usize,
    ld: usize,
}

/// Rows `lo..hi` of `w` times the `M` activation rows `ones`.
/// SAFETY: as `few_rows_parts`'s parts: rows lo..hi of `w` exist, `ones` holds `M` rows of
/// `w.k` values, and the output columns belong to this call alone.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn few_row_rows<const M: usize>(
    ones: &[OneRow],
    w: &BlockMatrix<'_>,
    lo: usize,
    hi: usize,
    o: RowsOut,
) {
    use BlockType::*;
    let ones: [&OneRow; M] = std::array::from_fn(|a| &ones[a]);
    let rb = w.row_bytes();
    let end = w.raw.as_ptr().wrapping_add(w.raw.len());
    let row_at = |n: usize| w.raw.as_ptr().wrapping_add(n * rb);
    let (nb, nsb) = (w.k / 32, w.k / 256);
    let put = |a: usize, n: usize, v: f32| {
        // SAFETY: activation row a < M, column col + n inside this part's columns
        unsafe { *o.out.at(a * o.ld + o.col + n) = v };
    };
    let mut n = lo;
    // 16 weight rows at a time in lanes
    while hi - n >= LANE_ROWS {
        // SAFETY: rows n..n + LANE_ROWS < w.n hold k / block whole blocks
        let y = unsafe {
            let row0 = row_at(n);
            match w.ty {
                Q8_0 | Q4_0 | Q5_0 if M > 1 => {
                    unreachable!("legacy blocks take one activation row here (few_rows_limit)")
                }
                Q8_0 => [lanes_legacy_one::<{ Q8_0 as u32 }>(row0, rb, nb, ones[0], end); M],
                Q4_0 => [lanes_legacy_one::<{ Q4_0 as u32 }>(row0, rb, nb, ones[0], end); M],
                Q5_0 => [lanes_legacy_one::<{ Q5_0 as u32 }>(row0, rb, nb, ones[0], end); M],
                Q4_K => lanes_q4_k_16::<M>(row0, rb, nsb, ones, end),
                _ if M == 1 => [one_q6_k_16(row0, rb, nsb, ones[0], end); M],
                _ => many_q6_k_16::<M>(row0, rb, nsb, ones, end),
            }
        };
        for (a, ya) in y.iter().enumerate() {
            for (i, v) in ya.iter().enumerate() {
                put(a, n + i, *v);
            }
        }
        n += LANE_ROWS;
    }
    // the rest (a weight's last rows), two at a time where the kernel takes two
    while n < hi {
        let pair = hi - n >= 2 && matches!(w.ty, Q8_0 | Q4_0 | Q5_0 | Q4_K);
        let count = if pair { 2 } else { 1 };
        let rows = [row_at(n), row_at(n + 1)];
        for (a, one) in ones.iter().enumerate() {
            // SAFETY: rows n..n + count < w.n hold k / block whole blocks; `one` holds k
            // values
            let y = unsafe {
                match w.ty {
                    Q8_0 => legacy_rows::<{ Q8_0 as u32 }>(rows, pair, nb, one),
                    Q4_0 => legacy_rows::<{ Q4_0 as u32 }>(rows, pair, nb, one),
                    Q5_0 => legacy_rows::<{ Q5_0 as u32 }>(rows, pair, nb, one),
                    Q4_K if pair => one_q4_k::<2>(rows, nsb, one),
                    Q4_K => [one_q4_k::<1>([rows[0]], nsb, one)[0], 0.0],
                    _ => [one_q6_k(rows[0], nsb, one), 0.0],
                }
            };
            for (i, v) in y[..count].iter().enumerate() {
                put(a, n + i, *v);
            }
        }
        n += count;
    }
}

/// The 16 sums of the 8-lane halves of `v`, in block order (half `h` of `v[i]` is block
/// `2i + h`). The sums are of integers: any order gives the same value.
#[target_feature(enable = "avx512f")]
#[inline]
fn half_sums(v: [__m512i; 8]) -> __m512i {
    // per 128-bit lane: [a0 + a2, b0 + b2, a1 + a3, b1 + b3]
    let l1 = |a, b| _mm512_add_epi32(_mm512_unpacklo_epi32(a, b), _mm512_unpackhi_epi32(a, b));
    // per 128-bit lane: the lane sums of a, b, c, d
    let l2 = |a, b| _mm512_add_epi32(_mm512_unpacklo_epi64(a, b), _mm512_unpackhi_epi64(a, b));
    let t0 = l2(l1(v[0], v[1]), l1(v[2], v[3]));
    let t4 = l2(l1(v[4], v[5]), l1(v[6], v[7]));
    let x = _mm512_shuffle_i32x4::<0b10_00_10_00>(t0, t4);
    let y = _mm512_shuffle_i32x4::<0b11_01_11_01>(t0, t4);
    // [v0..v3 half 0, v0..v3 half 1, v4..v7 half 0, v4..v7 half 1]
    let u = _mm512_add_epi32(x, y);
    let idx = _mm512_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15);
    _mm512_permutexvar_epi32(idx, u)
}

/// The 16 sums of the 128-bit quarters of `v` (4 lanes each), in order (quarter `c` of
/// `v[i]` is sum `4i + c`).
#[target_feature(enable = "avx512f")]
#[inline]
fn quarter_sums(v: [__m512i; 4]) -> __m512i {
    let l1 = |a, b| _mm512_add_epi32(_mm512_unpacklo_epi32(a, b), _mm512_unpackhi_epi32(a, b));
    let l2 = |a, b| _mm512_add_epi32(_mm512_unpacklo_epi64(a, b), _mm512_unpackhi_epi64(a, b));
    // lane 4c + i: quarter c of v[i]
    let t = l2(l1(v[0], v[1]), l1(v[2], v[3]));
    let idx = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    _mm512_permutexvar_epi32(idx, t)
}

/// The 32 codes of a Q8_0/Q4_0/Q5_0 block at `p` as unsigned bytes in order (Q8_0's signed
/// bytes + 128).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2")]
#[inline]
unsafe fn legacy_codes(ty: BlockType, p: *const u8) -> __m256i {
    unsafe {
        match ty {
            BlockType::Q8_0 => _mm256_xor_si256(
                _mm256_loadu_si256(p.add(2) as *const __m256i),
                _mm256_set1_epi8(-128),
            ),
            BlockType::Q4_0 => {
                let c = bcast128(p.add(2));
                _mm256_blend_epi32::<0xF0>(low4(c), high4(c))
            }
            _ => {
                let c = bcast128(p.add(6));
                let qh = (p.add(2) as *const u32).read_unaligned();
                _mm256_or_si256(
                    _mm256_blend_epi32::<0xF0>(low4(c), high4(c)),
                    _mm256_maskz_mov_epi8(qh, _mm256_set1_epi8(0x10)),
                )
            }
        }
    }
}

/// `one_legacy` of `rows[0]`, and of `rows[1]` too when `pair` (else 0 in its place).
/// SAFETY: as `one_legacy`'s, for the rows it reads.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn legacy_rows<const T: u32>(
    rows: [*const u8; 2],
    pair: bool,
    nb: usize,
    one: &OneRow,
) -> [f32; 2] {
    unsafe {
        if pair {
            one_legacy::<T, 2>(rows, nb, one)
        } else {
            [one_legacy::<T, 1>([rows[0]], nb, one)[0], 0.0]
        }
    }
}

/// `legacy_codes` of the blocks at `p` and `p + block bytes` in the two halves of a vector,
/// unpacked together: one load of both blocks' nibbles spread to four 128-bit lanes (low,
/// high, low, high), one masked shift, and for Q5_0 both blocks' fifth bits as one 64-bit
/// mask (21 -> 14 operations a pair with the product).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2")]
#[inline]
unsafe fn legacy_pair(ty: BlockType, p: *const u8) -> __m512i {
    unsafe {
        if ty == BlockType::Q8_0 {
            return _mm512_xor_si512(
                _mm512_inserti64x4::<1>(
                    _mm512_castsi256_si512(_mm256_loadu_si256(p.add(2) as *const __m256i)),
                    _mm256_loadu_si256(p.add(36) as *const __m256i),
                ),
                _mm512_set1_epi8(-128),
            );
        }
        // Q4_0: 16 nibble bytes after the f16 scale; Q5_0: after the scale and 4 bytes of
        // fifth bits
        let (bb, at) = if ty == BlockType::Q4_0 {
            (18, 2)
        } else {
            (22, 6)
        };
        let x = _mm256_loadu2_m128i(
            p.add(bb + at) as *const __m128i,
            p.add(at) as *const __m128i,
        );
        let q = _mm512_shuffle_i64x2::<0b01_01_00_00>(
            _mm512_castsi256_si512(x),
            _mm512_castsi256_si512(x),
        );
        let nib = _mm512_and_si512(
            _mm512_mask_srli_epi16(q, 0xFF00_FF00, q, 4),
            _mm512_set1_epi8(0x0F),
        );
        if ty == BlockType::Q4_0 {
            return nib;
        }
        let qh0 = (p.add(2) as *const u32).read_unaligned() as u64;
        let qh1 = (p.add(bb + 2) as *const u32).read_unaligned() as u64;
        _mm512_or_si512(
            nib,
            _mm512_maskz_mov_epi8(qh0 | qh1 << 32, _mm512_set1_epi8(0x10)),
        )
    }
}

/// Q8_0 / Q4_0 / Q5_0 (`T`, ggml's type id) with one activation row, `R` weight rows at a
/// time: blocks two to a vector, 16 blocks' integer sums at a time, their 16 weight scales by
/// one gather, then `dot_q8_0`'s chain in scalars (the same operations, so the same bits). A
/// row's chain is a sequence of dependent multiply-adds; the `R` rows' chains are
/// independent, so the core runs them side by side. The type is a constant and a whole
/// chunk of 16 blocks a fixed loop, so that the chunk's sums stay in registers with no
/// branch per block.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn one_legacy<const T: u32, const R: usize>(
    rows: [*const u8; R],
    nb: usize,
    one: &OneRow,
) -> [f32; R] {
    let (bb, ty) = legacy_layout(T);
    let at = lane_offsets(bb);
    let mut y = [[0f32; 2]; R];
    let mut c0 = 0;
    while c0 < nb {
        let cnt = (nb - c0).min(16);
        let valid = (((1u32 << cnt) - 1) & 0xFFFF) as u16;
        let (z, d_act) = unsafe { legacy_chunk_acts::<T>(one, c0) };
        let mut fs = [[0f32; 16]; R];
        let mut dw = [[0f32; 16]; R];
        for r in 0..R {
            // SAFETY: blocks c0..c0 + cnt of the row exist; `one` holds their activations
            unsafe {
                let v = legacy_chunk_sums(ty, bb, rows[r], c0, cnt, one);
                let f = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(half_sums(v), z)), d_act);
                _mm512_storeu_ps(fs[r].as_mut_ptr(), f);
                let w = legacy_chunk_scales(rows[r], bb, c0, valid, at);
                _mm512_storeu_ps(dw[r].as_mut_ptr(), w);
            }
        }
        // c0 is even: block c0 + j goes to chain j & 1 (kept in registers: the index is a
        // constant in this loop)
        for r in 0..R {
            let [mut even, mut odd] = y[r];
            for j in (0..cnt).step_by(2) {
                even = fs[r][j].mul_add(dw[r][j], even);
                if j + 1 < cnt {
                    odd = fs[r][j + 1].mul_add(dw[r][j + 1], odd);
                }
            }
            y[r] = [even, odd];
        }
        c0 += cnt;
    }
    y.map(|y| y[0] + y[1])
}

/// A legacy type's (ggml type id `t`) block bytes and type.
#[inline]
fn legacy_layout(t: u32) -> (usize, BlockType) {
    match t {
        8 => (34, BlockType::Q8_0),
        2 => (18, BlockType::Q4_0),
        _ => (22, BlockType::Q5_0),
    }
}

/// A legacy type's zero point as a power of two: Q8_0's 128 (its signed codes read as
/// unsigned), Q4_0's 8, Q5_0's 16.
#[inline]
const fn legacy_zero_shift(t: u32) -> u32 {
    match t {
        8 => 7,
        2 => 3,
        _ => 4,
    }
}

/// The zero point of type `T` times each lane's code sum `z` (what the unsigned codes'
/// products carry on top of the signed ones').
#[target_feature(enable = "avx512f")]
#[inline]
fn legacy_zero_point<const T: u32>(z: __m512i) -> __m512i {
    // a constant count: compiled to the immediate shift
    _mm512_sll_epi32(z, _mm_cvtsi32_si128(legacy_zero_shift(T) as i32))
}

/// The activations of blocks `c0..c0 + 16` for type `T`: the zero point times each block's
/// code sum (Q8_0's 128, Q4_0's 8, Q5_0's 16), and each block's scale.
/// SAFETY: `one` holds 16 blocks from `c0` (it is padded with zeros past the row's end).
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn legacy_chunk_acts<const T: u32>(one: &OneRow, c0: usize) -> (__m512i, __m512) {
    unsafe {
        let z = _mm512_loadu_si512(one.isum32.as_ptr().add(c0) as *const _);
        (
            legacy_zero_point::<T>(z),
            _mm512_loadu_ps(one.d.as_ptr().add(c0)),
        )
    }
}

/// The integer products of blocks `c0..c0 + cnt` of `row` (type `ty`, `bb` bytes a block)
/// with the activations, two blocks to a vector (`half_sums` gives the 16 block sums).
/// SAFETY: the blocks exist; `one` holds their activations.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2")]
#[inline]
unsafe fn legacy_chunk_sums(
    ty: BlockType,
    bb: usize,
    row: *const u8,
    c0: usize,
    cnt: usize,
    one: &OneRow,
) -> [__m512i; 8] {
    // blocks b and b + 1 (b + 1 < cnt unless `last`) against their activations
    let pair = |b: usize, last: bool| unsafe {
        let w = if last {
            _mm512_castsi256_si512(legacy_codes(ty, row.add(bb * b)))
        } else {
            legacy_pair(ty, row.add(bb * b))
        };
        // past the row's end the activations are zeros
        let a = _mm512_loadu_si512(one.q().add(32 * b) as *const _);
        _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, a)
    };
    let mut v = [_mm512_setzero_si512(); 8];
    if cnt == 16 {
        for (i, vi) in v.iter_mut().enumerate() {
            *vi = pair(c0 + 2 * i, false);
        }
    } else {
        for (i, vi) in v.iter_mut().enumerate().take(cnt.div_ceil(2)) {
            *vi = pair(c0 + 2 * i, 2 * i + 1 == cnt);
        }
    }
    v
}

/// The f16 scales of blocks `c0..c0 + 16` of `row` as f32 (`at`: the 16 blocks' offsets;
/// lanes outside `valid` 0): each the low half of 4 bytes read at its block's start.
/// SAFETY: the blocks in `valid` exist.
#[target_feature(enable = "avx512f,avx512bw,f16c")]
#[inline]
unsafe fn legacy_chunk_scales(
    row: *const u8,
    bb: usize,
    c0: usize,
    valid: u16,
    at: __m512i,
) -> __m512 {
    let h = unsafe {
        _mm512_mask_i32gather_epi32::<1>(
            _mm512_setzero_si512(),
            valid,
            at,
            row.add(bb * c0) as *const _,
        )
    };
    _mm512_cvtph_ps(_mm512_cvtepi32_epi16(h))
}

/// `d * b` for the 8 bytes `b` of `w` (products of an f16 and a 6-bit integer: exact), as
/// `dot_q4_k`'s `d * sc[j] as f32`.
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn scaled_bytes(w: u64, d: f32, out: *mut f32) {
    let b = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(w as i64));
    unsafe { _mm256_storeu_ps(out, _mm256_mul_ps(_mm256_cvtepi32_ps(b), _mm256_set1_ps(d))) };
}

/// Q4_K with one activation row, `R` weight rows at a time (see `one_legacy`): two
/// sub-blocks to a vector (low and high nibbles of 32 bytes), the scales and minima of a
/// block as vectors, then `dot_q4_k`'s chains in scalars.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn one_q4_k<const R: usize>(rows: [*const u8; R], nsb: usize, one: &OneRow) -> [f32; R] {
    let mut ys = [0f32; R];
    let mut ym = [0f32; R];
    let sum = one.sum.as_ptr();
    let mut s0 = 0;
    while s0 < nsb {
        let cnt = (nsb - s0).min(2);
        let d_act = unsafe { _mm512_loadu_ps(one.d.as_ptr().add(8 * s0)) };
        let mut fs = [[0f32; 16]; R];
        let mut dsc = [[0f32; 16]; R];
        let mut dmn = [[0f32; 16]; R];
        for r in 0..R {
            let mut v = [_mm512_setzero_si512(); 8];
            // block s0 + s: its 4 vectors of sums into v[4 s..], its scales and minima
            let mut block = |s: usize, v: &mut [__m512i; 4]| {
                let p = unsafe { rows[r].add(144 * (s0 + s)) };
                for (i, vi) in v.iter_mut().enumerate() {
                    unsafe {
                        let w = q4_k_codes(p, i);
                        let a =
                            _mm512_loadu_si512(one.q().add(256 * (s0 + s) + 64 * i) as *const _);
                        *vi = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, a);
                    }
                }
                unsafe {
                    let (sc, mn) = k4_scale_min_words(p);
                    scaled_bytes(sc, f16(p), dsc[r].as_mut_ptr().add(8 * s));
                    scaled_bytes(mn, f16(p.add(2)), dmn[r].as_mut_ptr().add(8 * s));
                }
            };
            let (first, second) = v.split_at_mut(4);
            block(0, first.try_into().expect("4 vectors"));
            if cnt == 2 {
                block(1, second.try_into().expect("4 vectors"));
            }
            let f = _mm512_mul_ps(_mm512_cvtepi32_ps(half_sums(v)), d_act);
            unsafe { _mm512_storeu_ps(fs[r].as_mut_ptr(), f) };
        }
        for r in 0..R {
            for j in 0..8 * cnt {
                // SAFETY: sub-block 8 * s0 + j of the row: `one` holds its sum
                let sum_b = unsafe { *sum.add(8 * s0 + j) };
                ys[r] = fs[r][j].mul_add(dsc[r][j], ys[r]);
                ym[r] = sum_b.mul_add(dmn[r][j], ym[r]);
            }
        }
        s0 += cnt;
    }
    std::array::from_fn(|r| ys[r] - ym[r])
}

/// Weight rows a one-row kernel takes together with the rows in lanes (`one_*_16`).
const LANE_ROWS: usize = 16;

/// Superblock pairs whose integer sums a lane kernel computes for one weight row before it
/// moves to the next row (a window: `WINDOW_PAIRS` x 16 rows x 64 bytes of sums per
/// activation row).
const WINDOW_PAIRS: usize = 12;

/// A slot of a window's buffers, written before it is read.
type Uninit<T> = std::mem::MaybeUninit<T>;

/// The 16 values of slots that were all written.
/// SAFETY: every slot of `v` was written.
#[inline(always)]
unsafe fn filled<T: Copy>(v: &[Uninit<T>; LANE_ROWS]) -> [T; LANE_ROWS] {
    // SAFETY: MaybeUninit<T> has T's layout; the caller wrote every slot
    unsafe { *(v as *const [Uninit<T>; LANE_ROWS] as *const [T; LANE_ROWS]) }
}

/// Prefetches bytes `from..from + len` of row `r` of the next group of `LANE_ROWS` rows (`rb`
/// bytes apart from `row0`), the bytes a lane kernel reads from row `r` of this group next:
/// its 16 streams a thread are more than the hardware prefetcher follows (without these
/// prefetches the 1.9B model's Q4_K products ran 1.5-1.8x slower from memory). Into L2 (T1):
/// on Zen 5 non-temporal prefetches beat T1 by 4-12%, but on Zen 4 T1 against
/// NTA, A/B from the mmap, two threads: the 1.9B model's `ffn_gate` at 3 rows 0.83x the
/// time, `ffn_down` at 4 rows 0.91x, `attn_q` at 2 rows 0.77x (see `prefetch_ahead`: an L1
/// miss waits for memory; an L2 prefetch does not hold the core's L1 miss buffers).
#[inline]
fn prefetch_next_group(
    row0: *const u8,
    rb: usize,
    r: usize,
    from: usize,
    len: usize,
    end: *const u8,
) {
    prefetch_lines::<_MM_HINT_T1>(row0.wrapping_add((LANE_ROWS + r) * rb + from), len, end);
}

/// How far ahead of the bytes being read a kernel that reads its weight rows in order
/// prefetches (`prefetch_ahead`).
const READ_AHEAD: usize = 8192;

/// Prefetches the `len` bytes `READ_AHEAD` past `at` into L2 (a kernel reading its rows in
/// order is about to read `at..at + len`). The hardware prefetcher follows one stream, but
/// from too close behind on Zen 4. Prefetching into L1 (T0, 2 KB ahead) held
/// the core's L1 miss buffers for a whole trip to memory: the prefetches themselves stalled
/// and a core drew 11-15 GB/s where a plain read draws 20+. Into L2 (T1) 8 KB ahead, A/B
/// against T0 2 KB (Zen 4, two threads, from the GGUF mmap): Gemma 3 270M's Q8_0 head 0.72x
/// the time, the 1.9B model's Q6_K head 0.73x and its Q4_K `ffn_gate` 0.78x (T2 the same;
/// 16-32 KB ahead no better; T0 1 KB on top, no better).
#[inline]
fn prefetch_ahead(at: *const u8, len: usize, end: *const u8) {
    prefetch_lines::<_MM_HINT_T1>(at.wrapping_add(READ_AHEAD), len, end);
}

/// The byte offsets of 16 rows `rb` bytes apart.
#[target_feature(enable = "avx512f")]
#[inline]
fn lane_offsets(rb: usize) -> __m512i {
    _mm512_mullo_epi32(
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
        _mm512_set1_epi32(rb as i32),
    )
}

/// Codes `64 i .. 64 i + 64` of the Q4_K block at `p`: its 32 code bytes `i` in both halves
/// of a vector, the low nibbles kept in the low half and the high nibbles in the high half.
/// SAFETY: `p` is a whole Q4_K block, `i < 4`.
#[target_feature(enable = "avx512f,avx512bw")]
#[inline]
unsafe fn q4_k_codes(p: *const u8, i: usize) -> __m512i {
    let q =
        _mm512_broadcast_i64x4(unsafe { _mm256_loadu_si256(p.add(16 + 32 * i) as *const __m256i) });
    _mm512_and_si512(
        _mm512_mask_srli_epi16(q, 0xFFFF_0000, q, 4),
        _mm512_set1_epi8(0x0F),
    )
}

/// The 256 codes of the Q6_K block at `p` (low 4 bits from `ql`, the top 2 from `qh`) as 4
/// vectors of 64, in the order the activations follow. Per half `n` of the block, `ql`'s 64
/// bytes hold values `0..64` in their low nibbles and `64..128` in their high ones, and `qh`
/// byte `l` holds the top bits of values `l`, `l + 32`, `l + 64` and `l + 96` (2 bits each,
/// from the bottom). So each vector takes one nibble of all 64 `ql` bytes, and the two
/// top-bit pairs its halves need from `qh` (broadcast to both halves and shifted by a
/// different count in each; the shifts are 16-bit, the mask per byte). That is 10 vector
/// operations per half where 256-bit halves took 22: the 1.9B model's batch-4 decode step
/// took 0.95x the time (quartiles 0.92-0.96, 10 rounds alternating builds in one process;
/// batch 1, which waits on memory, and Gemma 3 270M's batch 8 unchanged).
/// SAFETY: `p` is a whole Q6_K block.
#[target_feature(enable = "avx512f,avx512bw,avx2")]
#[inline]
unsafe fn q6_k_codes(p: *const u8) -> [__m512i; 4] {
    let (m4, m30) = (_mm512_set1_epi8(0x0F), _mm512_set1_epi8(0x30));
    // bits 4-5 of each code: for values 0..64 qh's bits 0-1 (lower half, << 4) and 2-3
    // (upper half, << 2); for values 64..128 bits 4-5 (>> 0) and 6-7 (>> 2)
    let left = _mm512_inserti64x4::<1>(_mm512_set1_epi16(4), _mm256_set1_epi16(2));
    let right = _mm512_inserti64x4::<1>(_mm512_setzero_si512(), _mm256_set1_epi16(2));
    let mut w = [_mm512_setzero_si512(); 4];
    for n in 0..2 {
        // SAFETY: ql (128 bytes) and qh (64 bytes) are in the block
        let (ql, qh) = unsafe {
            (
                _mm512_loadu_si512(p.add(64 * n) as *const _),
                _mm512_broadcast_i64x4(_mm256_loadu_si256(p.add(128 + 32 * n) as *const __m256i)),
            )
        };
        let lo = _mm512_and_si512(ql, m4);
        let hi = _mm512_and_si512(_mm512_srli_epi16::<4>(ql), m4);
        let top_lo = _mm512_and_si512(_mm512_sllv_epi16(qh, left), m30);
        let top_hi = _mm512_and_si512(_mm512_srlv_epi16(qh, right), m30);
        w[2 * n] = _mm512_or_si512(lo, top_lo);
        w[2 * n + 1] = _mm512_or_si512(hi, top_hi);
    }
    w
}

/// A Q6_K block's integer sums with one activation row (its codes `w` from `q6_k_codes`,
/// block `s` of the row at `p`): per 16 values `sc * (isum - 32 sum)`, added in pairs, so
/// that the even lanes hold the 8 sums of 32 values.
/// SAFETY: `p` is block `s` of a row; `one` holds its activations.
#[target_feature(enable = "avx512f,avx512vnni")]
#[inline]
unsafe fn q6_k_pair_sums(w: &[__m512i; 4], p: *const u8, s: usize, one: &OneRow) -> __m512i {
    unsafe {
        let mut v = [_mm512_setzero_si512(); 4];
        for (i, vi) in v.iter_mut().enumerate() {
            let x = _mm512_loadu_si512(one.q().add(256 * s + 64 * i) as *const _);
            *vi = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[i], x);
        }
        let z = _mm512_slli_epi32::<5>(_mm512_loadu_si512(
            one.isum16.as_ptr().add(16 * s) as *const _
        ));
        let sc = _mm512_cvtepi8_epi32(_mm_loadu_si128(p.add(192) as *const __m128i));
        let iv = _mm512_mullo_epi32(_mm512_sub_epi32(quarter_sums(v), z), sc);
        _mm512_add_epi32(iv, _mm512_srli_epi64::<32>(iv))
    }
}

/// Q6_K with one activation row: 64 codes to a vector, the sums of each 16, scaled and
/// paired in integers, then `dot_q6_k`'s chain in scalars.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn one_q6_k(row: *const u8, nsb: usize, one: &OneRow) -> f32 {
    let mut y = [0f32; 2];
    for s in 0..nsb {
        unsafe {
            let p = row.add(210 * s);
            // the even lanes hold the 8 blocks' sums
            let pair = q6_k_pair_sums(&q6_k_codes(p), p, s, one);
            let idx = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 0, 0, 0, 0, 0, 0, 0, 0);
            let iv8 = _mm512_castsi512_si256(_mm512_permutexvar_epi32(idx, pair));
            let f = _mm256_mul_ps(
                _mm256_cvtepi32_ps(iv8),
                _mm256_loadu_ps(one.d.as_ptr().add(8 * s)),
            );
            let mut fs = [0f32; 8];
            _mm256_storeu_ps(fs.as_mut_ptr(), f);
            let d = f16(p.add(208));
            for (j, fj) in fs.iter().enumerate() {
                y[j & 1] = fj.mul_add(d, y[j & 1]);
            }
        }
    }
    y[0] + y[1]
}

/// The `d * sc` and `dmin * m` of the 8 sub-blocks of 16 Q4_K blocks, one block per lane
/// (`dd`: each block's f16 d and dmin; `u0..u2`: its 12 scale bytes as three words).
#[target_feature(enable = "avx512f,avx512bw,f16c")]
#[inline]
fn q4_k_lane_scales(
    dd: __m512i,
    u0: __m512i,
    u1: __m512i,
    u2: __m512i,
) -> ([__m512; 8], [__m512; 8]) {
    let mut dsc = [_mm512_setzero_ps(); 8];
    let mut dmn = [_mm512_setzero_ps(); 8];
    let d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(dd));
    let dmin = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32::<16>(dd)));
    // ggml's get_scale_min_k4 on all four bytes of a word at once (see `k4_scale_min_words`):
    // byte t of `sc_lo` / `mn_lo` is sub-block t's scale / min, of `sc_hi` / `mn_hi` sub-block
    // t + 4's (its 4 low bits from u2's nibbles, its 2 high bits from the top of u0's / u1's
    // byte t, shifted into place within the byte and masked)
    let (m6, m4, m30) = (
        _mm512_set1_epi8(0x3f),
        _mm512_set1_epi8(0x0f),
        _mm512_set1_epi8(0x30),
    );
    let (top0, top1) = (
        _mm512_and_si512(_mm512_srli_epi32::<2>(u0), m30),
        _mm512_and_si512(_mm512_srli_epi32::<2>(u1), m30),
    );
    let sc_lo = _mm512_and_si512(u0, m6);
    let mn_lo = _mm512_and_si512(u1, m6);
    let sc_hi = _mm512_or_si512(_mm512_and_si512(u2, m4), top0);
    let mn_hi = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32::<4>(u2), m4), top1);
    // lane q of a 128-bit lane: byte 4q + t, zero-extended (vpshufb works within 128-bit
    // lanes; an index with its top bit set gives 0)
    let lanes = _mm512_setr_epi32(0, 4, 8, 12, 0, 4, 8, 12, 0, 4, 8, 12, 0, 4, 8, 12);
    let zero_ext = _mm512_add_epi32(lanes, _mm512_set1_epi32(0x8080_8000u32 as i32));
    for t in 0..4 {
        let pick = _mm512_add_epi32(zero_ext, _mm512_set1_epi32(t as i32));
        let f = |w: __m512i| _mm512_cvtepi32_ps(_mm512_shuffle_epi8(w, pick));
        dsc[t] = _mm512_mul_ps(f(sc_lo), d);
        dmn[t] = _mm512_mul_ps(f(mn_lo), dmin);
        dsc[t + 4] = _mm512_mul_ps(f(sc_hi), d);
        dmn[t + 4] = _mm512_mul_ps(f(mn_hi), dmin);
    }
    (dsc, dmn)
}

/// The float steps of Q4_K block `s` of 16 weight rows in lanes with one activation row:
/// `cols[j]` lane `r` holds sub-block `j`'s integer sum in row `r`, `dsc` / `dmn` the
/// block's lane scales (`q4_k_lane_scales`); per sub-block in order, `ys += f32(isum) *
/// d_act * dsc` and `ym += sum * dmn`, the operations of `one_q4_k`'s scalars.
/// SAFETY: `one` holds block `s`'s scales and sums.
#[target_feature(enable = "avx512f,fma")]
#[inline]
unsafe fn q4_k_block_chains(
    cols: &[__m512i; 8],
    s: usize,
    one: &OneRow,
    dsc: &[__m512; 8],
    dmn: &[__m512; 8],
    ys: &mut __m512,
    ym: &mut __m512,
) {
    for (jj, cj) in cols.iter().enumerate() {
        let b = 8 * s + jj;
        // SAFETY: sub-block b of the row: `one` holds its scale and sum
        let (d_act, sum_b) = unsafe { (*one.d.as_ptr().add(b), *one.sum.as_ptr().add(b)) };
        let f = _mm512_mul_ps(_mm512_cvtepi32_ps(*cj), _mm512_set1_ps(d_act));
        *ys = _mm512_fmadd_ps(f, dsc[jj], *ys);
        *ym = _mm512_fmadd_ps(_mm512_set1_ps(sum_b), dmn[jj], *ym);
    }
}

/// The float chains of one activation row (`one`) with 16 Q6_K weight rows in lanes, for
/// blocks `s0..s0 + cnt`: `sums[r]` holds row `r`'s 16 sums of 32 values, `d` the blocks'
/// f16 `d` per lane; per 32 values in order `y[j & 1] += f32(isum) * d_act * d`, the
/// operations of `one_q6_k`'s scalars.
/// SAFETY: `one` holds the blocks' scales.
#[target_feature(enable = "avx512f,fma")]
#[inline]
unsafe fn q6_k_lane_chains(
    sums: [__m512; LANE_ROWS],
    s0: usize,
    cnt: usize,
    one: &OneRow,
    d: &[__m512; 2],
    y: &mut [__m512; 2],
) {
    let cols = crate::x86::transpose16(sums);
    for s in 0..cnt {
        for j in 0..8 {
            // SAFETY: block 8 (s0 + s) + j of the row: `one` holds its scale
            let d_act = unsafe { *one.d.as_ptr().add(8 * (s0 + s) + j) };
            let f = _mm512_mul_ps(
                _mm512_cvtepi32_ps(_mm512_castps_si512(cols[8 * s + j])),
                _mm512_set1_ps(d_act),
            );
            y[j & 1] = _mm512_fmadd_ps(f, d[s], y[j & 1]);
        }
    }
}

/// Q4_K with `M` (1-8) activation rows, 16 weight rows (`rb` bytes apart from `row0`) at a
/// time with the rows in lanes from the start: per superblock, each 32-byte code chunk of
/// the 16 rows turned by `lane_words32` (vector `g` lane `i`: codes `4g..4g + 4` of row
/// `i`'s two sub-blocks, one per nibble) and unpacked once for the `M` activation rows, each
/// activation row's 4 codes of a group broadcast into `vpdpbusd`, so that each sub-block's
/// integer sums land in the rows' lanes with no reduction or transpose of sums; then per
/// activation row `q4_k_block_chains` (`one_q4_k`'s operations in its order, so the same
/// bits). It replaced `one_q4_k_16` (one row: 0.80-0.87x the time hot) and `many_q4_k_16`
/// (a reduction and a transpose of sums per activation row; the 1.9B model's Q4_K products
/// at 2, 3, 4 rows 0.74x, 0.65x, 0.61x the time).
/// SAFETY: rows `0..16` of `row0` hold `nsb` blocks; `ones` hold their activations; `end`
/// is the weight's last byte + 1.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn lanes_q4_k_16<const M: usize>(
    row0: *const u8,
    rb: usize,
    nsb: usize,
    ones: [&OneRow; M],
    end: *const u8,
) -> [[f32; LANE_ROWS]; M] {
    let mut ys = [_mm512_setzero_ps(); M];
    let mut ym = [_mm512_setzero_ps(); M];
    let next = row0.wrapping_add(LANE_ROWS * rb);
    let share = LANE_ROWS * 144;
    let low4 = _mm512_set1_epi8(0x0F);
    for s in 0..nsb {
        prefetch_lines::<_MM_HINT_T1>(next.wrapping_add(share * s), share, end);
        // SAFETY: block s of rows 0..16 exists
        let p = unsafe { row0.add(144 * s) };
        // each row's f16 d and dmin and its 12 scale bytes as three words
        let [dd, u0, u1, u2] = unsafe { lane_words16(p, rb) };
        let (dsc, dmn) = q4_k_lane_scales(dd, u0, u1, u2);
        // cols[a][j] lane r: sub-block j's integer sum in row r with activation row a
        let mut cols = [[_mm512_setzero_si512(); 8]; M];
        for i in 0..4 {
            // SAFETY: code chunk i of block s of the 16 rows
            let w = unsafe { lane_words32(p.add(16 + 32 * i), rb) };
            let mut lo4 = [_mm512_setzero_si512(); 8];
            let mut hi4 = [_mm512_setzero_si512(); 8];
            for g in 0..8 {
                lo4[g] = _mm512_and_si512(w[g], low4);
                // 16 x the high nibbles: no shift per group, one per sum (exact: a
                // multiple of 16)
                hi4[g] = _mm512_andnot_si512(low4, w[g]);
            }
            for (a, one) in ones.iter().enumerate() {
                // sub-blocks 2i (low nibbles) and 2i + 1 (high) against their activations
                let x = unsafe { one.q().add(256 * s + 64 * i) };
                let (mut lo, mut hi) = (_mm512_setzero_si512(), _mm512_setzero_si512());
                for g in 0..8 {
                    // SAFETY: `one` holds the block's 256 activations
                    let (al, ah) = unsafe {
                        (
                            (x.add(4 * g) as *const i32).read_unaligned(),
                            (x.add(32 + 4 * g) as *const i32).read_unaligned(),
                        )
                    };
                    lo = _mm512_dpbusd_epi32(lo, lo4[g], _mm512_set1_epi32(al));
                    hi = _mm512_dpbusd_epi32(hi, hi4[g], _mm512_set1_epi32(ah));
                }
                cols[a][2 * i] = lo;
                cols[a][2 * i + 1] = _mm512_srai_epi32::<4>(hi);
            }
        }
        for (a, one) in ones.iter().enumerate() {
            // SAFETY: `one` holds block s's scales and sums
            unsafe { q4_k_block_chains(&cols[a], s, one, &dsc, &dmn, &mut ys[a], &mut ym[a]) };
        }
    }
    let mut out = [[0f32; LANE_ROWS]; M];
    for (o, (y, m)) in out.iter_mut().zip(ys.iter().zip(&ym)) {
        unsafe { _mm512_storeu_ps(o.as_mut_ptr(), _mm512_sub_ps(*y, *m)) };
    }
    out
}

/// Q6_K with `M` activation rows, 16 weight rows (`rb` bytes apart from `row0`) at a time
/// with the weight rows in lanes for the float steps: `one_q6_k`'s integer pairs of two SBs
/// per row (a weight row's codes unpacked once for the `M` activation rows), turned by a 16
/// x 16 transpose so that lane `r` holds weight row `r`'s sums, then lane `r` runs row `r`'s
/// two chains with its `d` (gathered), the same operations in the same order as
/// `one_q6_k`'s scalars (so the same bits) but 16 rows per instruction.
// weight row r indexes each activation row's sums (`sums[a][r]`)
#[allow(clippy::needless_range_loop)]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn many_q6_k_16<const M: usize>(
    row0: *const u8,
    rb: usize,
    nsb: usize,
    ones: [&OneRow; M],
    end: *const u8,
) -> [[f32; LANE_ROWS]; M] {
    let at = lane_offsets(rb);
    // the even lanes (one sum per 32 values) of two vectors, in order
    let evens = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    let mut y = [[_mm512_setzero_ps(); 2]; M];
    let mut s0 = 0;
    while s0 < nsb {
        let cnt = (nsb - s0).min(2);
        let mut sums = [[_mm512_setzero_ps(); LANE_ROWS]; M];
        for r in 0..LANE_ROWS {
            prefetch_next_group(row0, rb, r, 210 * s0, 210 * cnt, end);
            let mut pairs = [[_mm512_setzero_si512(); 2]; M];
            for s in 0..cnt {
                // SAFETY: block s0 + s of row r exists; each `one` holds its activations
                unsafe {
                    let p = row0.add(r * rb + 210 * (s0 + s));
                    let w = q6_k_codes(p);
                    for (a, one) in ones.iter().enumerate() {
                        pairs[a][s] = q6_k_pair_sums(&w, p, s0 + s, one);
                    }
                }
            }
            for a in 0..M {
                // lanes 8 s + j: the 8 sums of SB s0 + s
                sums[a][r] =
                    _mm512_castsi512_ps(_mm512_permutex2var_epi32(pairs[a][0], evens, pairs[a][1]));
            }
        }
        let mut d = [_mm512_setzero_ps(); 2];
        for (s, ds) in d.iter_mut().enumerate().take(cnt) {
            // each row's f16 d: the high half of the 4 bytes before the SB's end
            let dd = unsafe {
                _mm512_i32gather_epi32::<1>(at, row0.add(210 * (s0 + s) + 206) as *const _)
            };
            *ds = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32::<16>(dd)));
        }
        for (a, one) in ones.iter().enumerate() {
            // SAFETY: `one` holds the pair's scales
            unsafe { q6_k_lane_chains(sums[a], s0, cnt, one, &d, &mut y[a]) };
        }
        s0 += cnt;
    }
    std::array::from_fn(|a| {
        let mut out = [0f32; LANE_ROWS];
        unsafe { _mm512_storeu_ps(out.as_mut_ptr(), _mm512_add_ps(y[a][0], y[a][1])) };
        out
    })
}

/// Q6_K with one activation row, 16 weight rows at a time, each row read in order: the
/// integer pairs of a window of its blocks (the whole row up to `WINDOW_PAIRS` pairs) and
/// each block's last 16 bytes (its d at the end) kept per row, then `many_q6_k_16`'s float
/// steps with the rows in lanes (the same operations in the same order, so the same bits).
/// `many_*_16` read the 16 rows side by side, two blocks of each at a time: 16 streams,
/// which the hardware prefetcher does not follow, and their software prefetches cost more
/// than they saved on Zen 4; reading each row in order made the 1.9B model's Q4_K and Q6_K
/// products from memory 0.71-0.82x `many_*_16`'s time. With more activation
/// rows the windows' sums outgrow L1, so they keep `many_q6_k_16`. (Q4_K takes
/// `lanes_q4_k_16` at 1-8 rows, which reads the 16 rows' blocks side by side but prefetches
/// the next 16 rows as one stream.)
#[allow(clippy::needless_range_loop)]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn one_q6_k_16(
    row0: *const u8,
    rb: usize,
    nsb: usize,
    one: &OneRow,
    end: *const u8,
) -> [f32; LANE_ROWS] {
    // the even lanes (one sum per 32 values) of two vectors, in order
    let evens = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    let mut y = [_mm512_setzero_ps(); 2];
    let mut w0 = 0;
    while w0 < nsb {
        let wsb = (nsb - w0).min(2 * WINDOW_PAIRS);
        let npairs = wsb.div_ceil(2);
        // sums[pair][r]: row r's 16 sums of 32 values of the window's superblock pair;
        // tails[block][r]: the last 16 bytes of row r's block (its f16 d at the end)
        let mut sums = [[Uninit::<__m512>::uninit(); LANE_ROWS]; WINDOW_PAIRS];
        let mut tails = [[Uninit::<__m128i>::uninit(); LANE_ROWS]; 2 * WINDOW_PAIRS];
        for r in 0..LANE_ROWS {
            for pi in 0..npairs {
                let s0 = w0 + 2 * pi;
                let cnt = (nsb - s0).min(2);
                prefetch_ahead(row0.wrapping_add(r * rb + 210 * s0), 420, end);
                let mut pairs = [_mm512_setzero_si512(); 2];
                for (s, pair) in pairs.iter_mut().enumerate().take(cnt) {
                    // SAFETY: block s0 + s of row r exists; `one` holds its activations
                    unsafe {
                        let p = row0.add(r * rb + 210 * (s0 + s));
                        tails[2 * pi + s][r] =
                            Uninit::new(_mm_loadu_si128(p.add(194) as *const __m128i));
                        *pair = q6_k_pair_sums(&q6_k_codes(p), p, s0 + s, one);
                    }
                }
                // lanes 8 s + j: the 8 sums of SB s0 + s
                sums[pi][r] = Uninit::new(_mm512_castsi512_ps(_mm512_permutex2var_epi32(
                    pairs[0], evens, pairs[1],
                )));
            }
        }
        for pi in 0..npairs {
            let s0 = w0 + 2 * pi;
            let cnt = (nsb - s0).min(2);
            let mut d = [_mm512_setzero_ps(); 2];
            for (s, dv) in d.iter_mut().enumerate().take(cnt) {
                // SAFETY: tails[2 pi + s] holds 16 x 16 bytes
                let dd = unsafe {
                    crate::x86::header_words16(tails[2 * pi + s].as_ptr() as *const u8)[3]
                };
                *dv = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32::<16>(dd)));
            }
            // SAFETY: the window's rows filled sums[pi]; `one` holds the pair's scales
            unsafe { q6_k_lane_chains(filled(&sums[pi]), s0, cnt, one, &d, &mut y) };
        }
        w0 += wsb;
    }
    let mut out = [0f32; LANE_ROWS];
    unsafe { _mm512_storeu_ps(out.as_mut_ptr(), _mm512_add_ps(y[0], y[1])) };
    out
}

/// Weight rows a wide kernel walks together: each 64-byte load of the tile's activations
/// feeds `WIDE_ROWS` multiply-adds (one per weight row) instead of one; with one, the
/// kernels waited on the tile's bytes (16 rows x 2048 values: 32 KB, read from L2 once per
/// weight row).
const WIDE_ROWS: usize = 4;

/// The sums of codes 0..15 and 16..31 of `c` (signed bytes).
#[target_feature(enable = "avx2")]
#[inline]
fn code_sums(c: __m256i) -> (i32, i32) {
    let s = _mm256_sad_epu8(
        _mm256_xor_si256(c, _mm256_set1_epi8(-128)),
        _mm256_setzero_si256(),
    );
    let mut v = [0i64; 4];
    unsafe { _mm256_storeu_si256(v.as_mut_ptr() as *mut __m256i, s) };
    ((v[0] + v[1] - 2048) as i32, (v[2] + v[3] - 2048) as i32)
}

/// Per weight row `w`, the 16 rows' sums of its block's codes (`cb[w]`: 32 signed codes,
/// 4 per i32) times the tile's block at `a` (8 groups of 64 bytes): codes 0..15 and 16..31.
#[target_feature(enable = "avx512f,avx512vnni")]
#[inline]
unsafe fn wide32<const W: usize>(cb: &[[i32; 8]; W], a: *const u8) -> [[__m512i; 2]; W] {
    let mut acc = [[_mm512_setzero_si512(); 2]; W];
    for g in 0..8 {
        let av = unsafe { _mm512_load_si512(a.add(64 * g) as *const _) };
        for w in 0..W {
            acc[w][g / 4] = _mm512_dpbusd_epi32(acc[w][g / 4], av, _mm512_set1_epi32(cb[w][g]));
        }
    }
    acc
}

/// The 32 codes of a Q8_0 / Q4_0 / Q5_0 block at `p`, signed (zero point included).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2")]
#[inline]
unsafe fn signed_codes(ty: BlockType, p: *const u8) -> __m256i {
    unsafe {
        match ty {
            BlockType::Q8_0 => _mm256_loadu_si256(p.add(2) as *const __m256i),
            BlockType::Q4_0 => _mm256_sub_epi8(legacy_codes(ty, p), _mm256_set1_epi8(8)),
            _ => _mm256_sub_epi8(legacy_codes(ty, p), _mm256_set1_epi8(16)),
        }
    }
}

/// Store the 32 codes `c` into `cb` and return `128 * (their sums per 16)`.
#[target_feature(enable = "avx2")]
#[inline]
fn keep_codes(c: __m256i, cb: &mut [i32; 8]) -> (i32, i32) {
    unsafe { _mm256_storeu_si256(cb.as_mut_ptr() as *mut __m256i, c) };
    let (s0, s1) = code_sums(c);
    (128 * s0, 128 * s1)
}

/// `W` weight rows unpacked once for all the tiles of a call (`prepare`), then multiplied with
/// each tile (`multiply`): per block of 32 values its signed codes (4 per i32), `128 *` their
/// sums per 16, and the float factors of its chain (legacy: `d`; Q4_K: `d * sc`, `dmin * m`;
/// Q6_K: `d` and the two sub-block scales). Unpacking per tile cost the 1.9B model's Q6_K
/// rows as much as their products.
struct Prepared<const W: usize> {
    codes: Vec<[[i32; 8]; W]>,
    corr: Vec<[(i32, i32); W]>,
    fa: Vec<[f32; W]>,
    fb: Vec<[f32; W]>,
    sc: Vec<[(i32, i32); W]>,
}

impl<const W: usize> Prepared<W> {
    fn new() -> Self {
        Prepared {
            codes: Vec::new(),
            corr: Vec::new(),
            fa: Vec::new(),
            fb: Vec::new(),
            sc: Vec::new(),
        }
    }

    /// Room for `nb` blocks of 32.
    fn reset(&mut self, nb: usize) {
        self.codes.resize(nb, [[0; 8]; W]);
        self.corr.resize(nb, [(0, 0); W]);
        self.fa.resize(nb, [0.0; W]);
        self.fb.resize(nb, [0.0; W]);
        self.sc.resize(nb, [(0, 0); W]);
    }
}

/// Unpack weight rows `rows` (`k` values of `ty` each) into `pr`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,f16c")]
unsafe fn prepare<const W: usize>(
    ty: BlockType,
    rows: [*const u8; W],
    k: usize,
    pr: &mut Prepared<W>,
) {
    let nb = k / 32;
    pr.reset(nb);
    let three = _mm256_set1_epi8(3);
    for (w, &row) in rows.iter().enumerate() {
        unsafe {
            match ty {
                BlockType::Q4_K => {
                    for s in 0..k / 256 {
                        let p = row.add(144 * s);
                        let (d, dmin) = (f16(p), f16(p.add(2)));
                        let (sc, mn) = k4_scale_min(p);
                        for i in 0..4 {
                            let q = _mm256_loadu_si256(p.add(16 + 32 * i) as *const __m256i);
                            for (half, c) in [low4(q), high4(q)].into_iter().enumerate() {
                                let j = 2 * i + half;
                                let b = 8 * s + j;
                                pr.corr[b][w] = keep_codes(c, &mut pr.codes[b][w]);
                                pr.fa[b][w] = d * sc[j] as f32;
                                pr.fb[b][w] = dmin * mn[j] as f32;
                            }
                        }
                    }
                }
                BlockType::Q6_K => {
                    for s in 0..k / 256 {
                        let p = row.add(210 * s);
                        let d = f16(p.add(208));
                        let scales = p.add(192) as *const i8;
                        for n in 0..2 {
                            let ql = p.add(64 * n);
                            let qh = _mm256_loadu_si256(p.add(128 + 32 * n) as *const __m256i);
                            let la = _mm256_loadu_si256(ql as *const __m256i);
                            let lb = _mm256_loadu_si256(ql.add(32) as *const __m256i);
                            for q in 0..4 {
                                let nib = match q {
                                    0 => low4(la),
                                    1 => low4(lb),
                                    2 => high4(la),
                                    _ => high4(lb),
                                };
                                let cnt = _mm_cvtsi32_si128(2 * q as i32);
                                let top = _mm256_slli_epi16::<4>(_mm256_and_si256(
                                    _mm256_srl_epi16(qh, cnt),
                                    three,
                                ));
                                let c = _mm256_sub_epi8(
                                    _mm256_or_si256(nib, top),
                                    _mm256_set1_epi8(32),
                                );
                                let b = 8 * s + 4 * n + q;
                                pr.corr[b][w] = keep_codes(c, &mut pr.codes[b][w]);
                                pr.fa[b][w] = d;
                                pr.sc[b][w] = (
                                    *scales.add(8 * n + 2 * q) as i32,
                                    *scales.add(8 * n + 2 * q + 1) as i32,
                                );
                            }
                        }
                    }
                }
                _ => {
                    let bb = ty.block_bytes();
                    for b in 0..nb {
                        let p = row.add(bb * b);
                        pr.corr[b][w] = keep_codes(signed_codes(ty, p), &mut pr.codes[b][w]);
                        pr.fa[b][w] = f16(p);
                    }
                }
            }
        }
    }
}

/// The prepared rows times a wide tile's 16 rows (the operations of `wide_dot`).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn multiply<const W: usize>(ty: BlockType, pr: &Prepared<W>, t: &Tile) -> [__m512; W] {
    let mut y = [[_mm512_setzero_ps(); 2]; W];
    for b in 0..pr.codes.len() {
        unsafe {
            let acc = wide32(&pr.codes[b], t.qs.add(b * 8 * 64) as *const u8);
            let da = _mm512_load_ps(t.d.add(16 * b));
            match ty {
                BlockType::Q4_K => {
                    let sum = _mm512_load_ps(t.sum.add(16 * b));
                    for w in 0..W {
                        let (c0, c1) = pr.corr[b][w];
                        let isum = _mm512_sub_epi32(
                            _mm512_add_epi32(acc[w][0], acc[w][1]),
                            _mm512_set1_epi32(c0 + c1),
                        );
                        let f = _mm512_mul_ps(_mm512_cvtepi32_ps(isum), da);
                        // y[w][0] holds ys, y[w][1] ym
                        y[w][0] = _mm512_fmadd_ps(f, _mm512_set1_ps(pr.fa[b][w]), y[w][0]);
                        y[w][1] = _mm512_fmadd_ps(sum, _mm512_set1_ps(pr.fb[b][w]), y[w][1]);
                    }
                }
                BlockType::Q6_K => {
                    for w in 0..W {
                        let (c0, c1) = pr.corr[b][w];
                        let (s0, s1) = pr.sc[b][w];
                        let i0 = _mm512_sub_epi32(acc[w][0], _mm512_set1_epi32(c0));
                        let i1 = _mm512_sub_epi32(acc[w][1], _mm512_set1_epi32(c1));
                        let iv = _mm512_add_epi32(
                            _mm512_mullo_epi32(i0, _mm512_set1_epi32(s0)),
                            _mm512_mullo_epi32(i1, _mm512_set1_epi32(s1)),
                        );
                        let f = _mm512_mul_ps(_mm512_cvtepi32_ps(iv), da);
                        y[w][b & 1] = _mm512_fmadd_ps(f, _mm512_set1_ps(pr.fa[b][w]), y[w][b & 1]);
                    }
                }
                _ => {
                    for w in 0..W {
                        let (c0, c1) = pr.corr[b][w];
                        let isum = _mm512_sub_epi32(
                            _mm512_add_epi32(acc[w][0], acc[w][1]),
                            _mm512_set1_epi32(c0 + c1),
                        );
                        let f = _mm512_mul_ps(_mm512_cvtepi32_ps(isum), da);
                        y[w][b & 1] = _mm512_fmadd_ps(f, _mm512_set1_ps(pr.fa[b][w]), y[w][b & 1]);
                    }
                }
            }
        }
    }
    if ty == BlockType::Q4_K {
        std::array::from_fn(|w| _mm512_sub_ps(y[w][0], y[w][1]))
    } else {
        std::array::from_fn(|w| _mm512_add_ps(y[w][0], y[w][1]))
    }
}
