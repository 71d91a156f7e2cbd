//! Products and dequantization with weights kept in their GGUF block formats (the file's
//! bytes, e.g. an mmap), computed on the blocks directly as ggml-cpu's `vec_dot` does.
//!
//! A weight matrix `[n, k]` is `n` rows of `k / block` blocks each. For a decode product the
//! activation rows are quantized once to 8-bit blocks (`QActs`: per 32 values an f32 scale,
//! i8 values and the scaled sums of each 16 values), and each weight block is multiplied
//! with them in integers (32 products per instruction pair on AVX2), scaled in f32 per
//! sub-block; the offset terms of Q4_1/Q5_1/K-quants (and of the unsigned forms of
//! Q4_0/Q5_0/Q6_K/Q3_K) use the activation sums, so no weight is ever widened to f32. One
//! activation format serves every weight type: per-32 scales are never coarser than a weight
//! sub-block (16 or 32), so the integer sums of a sub-block need no rescaling.
//! F32/F16/BF16 weights take an f32 dot with the f32 activations instead.
//!
//! Work is split over output rows (`crate::pool`), up to 4 activation rows per pass over a
//! weight row, so a decode batch reads each weight block once per step.

#[cfg(target_arch = "x86_64")]
mod avx2;
mod exact;
#[cfg(target_arch = "x86_64")]
mod exact512;
#[cfg(target_arch = "x86_64")]
mod gemm512;
mod portable;
#[cfg(target_arch = "x86_64")]
mod vnni;

use crate::qmatmul::KernelError;
use std::sync::atomic::{AtomicBool, Ordering};

pub use portable::{dequantize_row, f16_to_f32};

/// Most activation rows `block_matmul_t` takes (larger batches dequantize tiles + BLAS).
pub const MAX_ROWS: usize = 16;
/// Output rows are split between threads in multiples of this.
const TILE: usize = 32;
/// Least bytes of weights read per part worth handing to another thread (~25 us).
const BYTES_PER_THREAD: usize = 1 << 17;
/// Parts per thread of a product split by `split_row_tiles`, and the least bytes of work in
/// one (each part costs a claim: an atomic add shared between the cores, and a cold start:
/// the kernels prefetch ahead of what they read, so a part's first rows wait for memory).
/// 2 rather than 4 (Zen 4, in-process A/B from the mmap, two threads): the 1.9B model's
/// one-row products 0.98x the time, Gemma 3 270M's 0.96x; 1 gained another ~1% but leaves
/// no part to take over from a thread that falls behind.
const PARTS_PER_THREAD: usize = 2;
const BYTES_PER_PART: usize = 1 << 16;
/// Activation rows processed together against one weight row: each weight block is unpacked
/// once per 8 rows. With 4, a batch of 8 unpacked every block twice; 8 made one pass of
/// Gemma 3 270M's block weights at 8 rows 15-20% faster (125 / 117 ms vs 157 / 140 ms,
/// alternating runs on 2 cores) and left 1 and 4 rows unchanged.
const ROW_BLOCK: usize = 8;
/// Activation values per scale of the quantized activations.
pub const ACT_BLOCK: usize = 32;

/// A GGUF tensor type with its ggml type id.
#[allow(non_camel_case_types)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum BlockType {
    F32 = 0,
    F16 = 1,
    Q4_0 = 2,
    Q4_1 = 3,
    Q5_0 = 6,
    Q5_1 = 7,
    Q8_0 = 8,
    Q2_K = 10,
    Q3_K = 11,
    Q4_K = 12,
    Q5_K = 13,
    Q6_K = 14,
    IQ4_NL = 20,
    IQ4_XS = 23,
    BF16 = 30,
    MXFP4 = 39,
}

impl BlockType {
    pub const ALL: [BlockType; 16] = [
        BlockType::F32,
        BlockType::F16,
        BlockType::Q4_0,
        BlockType::Q4_1,
        BlockType::Q5_0,
        BlockType::Q5_1,
        BlockType::Q8_0,
        BlockType::Q2_K,
        BlockType::Q3_K,
        BlockType::Q4_K,
        BlockType::Q5_K,
        BlockType::Q6_K,
        BlockType::IQ4_NL,
        BlockType::IQ4_XS,
        BlockType::BF16,
        BlockType::MXFP4,
    ];

    /// The type of ggml type id `id`, None for a type without kernels here.
    pub fn from_ggml(id: u32) -> Option<Self> {
        Self::ALL.into_iter().find(|t| *t as u32 == id)
    }

    /// Elements per block.
    pub fn block_size(self) -> usize {
        use BlockType::*;
        match self {
            F32 | F16 | BF16 => 1,
            Q4_0 | Q4_1 | Q5_0 | Q5_1 | Q8_0 | IQ4_NL | MXFP4 => 32,
            Q2_K | Q3_K | Q4_K | Q5_K | Q6_K | IQ4_XS => 256,
        }
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        use BlockType::*;
        match self {
            F32 => 4,
            F16 | BF16 => 2,
            Q4_0 => 18,
            Q4_1 => 20,
            Q5_0 => 22,
            Q5_1 => 24,
            Q8_0 => 34,
            Q2_K => 84,
            Q3_K => 110,
            Q4_K => 144,
            Q5_K => 176,
            Q6_K => 210,
            IQ4_NL => 18,
            IQ4_XS => 136,
            MXFP4 => 17,
        }
    }

    /// Whether products use f32 activations (no activation quantization).
    pub fn is_float(self) -> bool {
        matches!(self, BlockType::F32 | BlockType::F16 | BlockType::BF16)
    }

    /// Bytes of one row of `k` elements (`k` a multiple of the block size).
    pub fn row_bytes(self, k: usize) -> usize {
        k / self.block_size() * self.block_bytes()
    }
}

/// A borrowed `[n, k]` weight matrix in a GGUF block format: row `i` is
/// `raw[i * row_bytes..(i + 1) * row_bytes]`.
#[derive(Clone, Copy)]
pub struct BlockMatrix<'a> {
    pub raw: &'a [u8],
    pub ty: BlockType,
    pub n: usize,
    pub k: usize,
}

impl BlockMatrix<'_> {
    pub fn row_bytes(&self) -> usize {
        self.ty.row_bytes(self.k)
    }

    /// The raw bytes of row `i` (`i < n`, sizes checked).
    fn row(&self, i: usize) -> &[u8] {
        let rb = self.row_bytes();
        &self.raw[i * rb..(i + 1) * rb]
    }

    pub fn check(&self) -> Result<(), KernelError> {
        let bs = self.ty.block_size();
        // quantized activations come in blocks of 32: every quantized type's block is a
        // multiple of that
        if self.k == 0 || !self.k.is_multiple_of(bs) {
            return Err(KernelError::Shape(format!(
                "k = {} is not a positive multiple of the {:?} block size {bs}",
                self.k, self.ty
            )));
        }
        let expect = self.n.checked_mul(self.row_bytes());
        if expect != Some(self.raw.len()) {
            return Err(KernelError::Shape(format!(
                "raw has {} bytes, expected {} rows x {} bytes ({:?}, k = {})",
                self.raw.len(),
                self.n,
                self.row_bytes(),
                self.ty,
                self.k
            )));
        }
        Ok(())
    }
}

static FORCE_PORTABLE: AtomicBool = AtomicBool::new(false);

/// Make `block_matmul_t` and `dequantize_rows` use the portable code even where AVX2 runs
/// (to test and compare both paths on one machine).
pub fn set_force_portable(on: bool) {
    FORCE_PORTABLE.store(on, Ordering::Relaxed);
}

/// Whether the AVX2 + FMA + F16C kernels run here (and are not switched off).
fn use_avx2(portable: bool) -> bool {
    if portable || FORCE_PORTABLE.load(Ordering::Relaxed) {
        return false;
    }
    #[cfg(target_arch = "x86_64")]
    {
        std::is_x86_feature_detected!("avx2")
            && std::is_x86_feature_detected!("fma")
            && std::is_x86_feature_detected!("f16c")
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// Activation rows quantized to 8 bits: per `ACT_BLOCK` values of row `r` a scale `d`
/// (amax / 127) and i8 values `qs` (value ~ d * q), and per 16 values `sum16` = d * (sum of
/// their q), per 32 `sum32` (the offset terms of weight formats with mins).
pub struct QActs {
    pub k: usize,
    pub qs: Vec<i8>,
    pub d: Vec<f32>,
    pub sum16: Vec<f32>,
    pub sum32: Vec<f32>,
}

impl QActs {
    /// `x` f32 `[m, k]`, `k` a multiple of `ACT_BLOCK`.
    pub fn quantize(x: &[f32], k: usize) -> Self {
        let m = x.len() / k;
        let nb = k / ACT_BLOCK;
        let mut a = QActs {
            k,
            qs: vec![0; m * k],
            d: vec![0.0; m * nb],
            sum16: vec![0.0; m * nb * 2],
            sum32: vec![0.0; m * nb],
        };
        for (b, xb) in x.chunks_exact(ACT_BLOCK).enumerate() {
            let amax = xb.iter().fold(0f32, |a, v| a.max(v.abs()));
            let d = amax / 127.0;
            let id = if d > 0.0 { 1.0 / d } else { 0.0 };
            let q = &mut a.qs[b * ACT_BLOCK..(b + 1) * ACT_BLOCK];
            for (qi, &v) in q.iter_mut().zip(xb) {
                // amax maps to 127 exactly, so the rounded value stays in [-127, 127]
                *qi = (v * id).round().clamp(-127.0, 127.0) as i8;
            }
            let s0: i32 = q[..16].iter().map(|&v| v as i32).sum();
            let s1: i32 = q[16..].iter().map(|&v| v as i32).sum();
            a.d[b] = d;
            a.sum16[2 * b] = d * s0 as f32;
            a.sum16[2 * b + 1] = d * s1 as f32;
            a.sum32[b] = d * (s0 + s1) as f32;
        }
        a
    }

    /// Replace `x` (f32 `[m, k]`, `k` a multiple of `ACT_BLOCK`) by the values its 8-bit
    /// quantization stands for (`q * d`, the very `q` and `d` of [`QActs::quantize`]).
    ///
    /// The block kernels see activations only through that quantization. A product with
    /// more rows multiplies these values by dequantized weights in f32 (BLAS) instead, and
    /// gets the kernel's result up to float summation order: a prompt token's logits do not
    /// depend on whether it was computed in a prefill chunk or one row at a time (with
    /// shared prefixes, chunk boundaries move with what was cached).
    pub fn round_trip(x: &mut [f32], k: usize) {
        debug_assert!(k.is_multiple_of(ACT_BLOCK));
        for xb in x.chunks_exact_mut(ACT_BLOCK) {
            let amax = xb.iter().fold(0f32, |a, v| a.max(v.abs()));
            let d = amax / 127.0;
            let id = if d > 0.0 { 1.0 / d } else { 0.0 };
            for v in xb.iter_mut() {
                *v = (*v * id).round().clamp(-127.0, 127.0) * d;
            }
        }
    }

    /// Blocks of 32 per row.
    pub fn blocks_per_row(&self) -> usize {
        self.k / ACT_BLOCK
    }
}

/// The 8 sub-block scales and minima (6 bits each) of the Q4_K/Q5_K block at `p`, as the
/// bytes of two `u64`s: ggml's `get_scale_min_k4` for all 8 at once, with the `utmp` masks of
/// ggml-cpu's AVX2 `vec_dot_q4_K_q8_K`.
/// SAFETY: `p` points at a whole block (its 12 scale bytes at `p + 4`).
#[cfg(target_arch = "x86_64")]
#[inline]
unsafe fn k4_scale_min_words(p: *const u8) -> (u64, u64) {
    const LOW6: u32 = 0x3f3f_3f3f;
    const LOW4: u32 = 0x0f0f_0f0f;
    const LOW2: u32 = 0x0303_0303;
    let w = |i: usize| unsafe { (p.add(4 + 4 * i) as *const u32).read_unaligned() };
    let (u0, u1, u2) = (w(0), w(1), w(2));
    let scales = [u0 & LOW6, (u2 & LOW4) | (((u0 >> 6) & LOW2) << 4)];
    let minima = [u1 & LOW6, ((u2 >> 4) & LOW4) | (((u1 >> 6) & LOW2) << 4)];
    let word = |w: [u32; 2]| w[0] as u64 | (w[1] as u64) << 32;
    (word(scales), word(minima))
}

/// A tile of weight rows: (part, first row, end row, first output column).
type RowTile = (usize, usize, usize, usize);

/// The rows of weights `ws` (outputs side by side) in tiles of `TILE` rows, as (part, first
/// row, end row, first column), split into parts of about equal bytes, and the number of
/// threads to run them on: part `i` is `tiles[bounds[i]..bounds[i + 1]]`. `passes` is how
/// many times a call reads each weight byte (the threads are bounded by `BYTES_PER_THREAD`
/// of that work). There are up to `PARTS_PER_THREAD` parts per thread, claimed by whichever
/// thread is free (`pool::run_on`), so a thread the OS has descheduled holds up only the part
/// it is in. A tile is a multiple of every kernel's group of weight rows, so groups never
/// straddle two parts.
fn split_row_tiles(
    ws: &[BlockMatrix<'_>],
    passes: usize,
    threads: usize,
) -> (Vec<RowTile>, Vec<usize>, usize) {
    split_tiles(ws, passes, threads, PARTS_PER_THREAD)
}

/// `split_row_tiles` with one region per thread (`pool::run_ranges`): the tiles and the
/// regions' bounds (`threads + 1` of them, the last `tiles.len()`). The 8-bit-activation
/// products take these: a thread streams its region in order and the faster one takes the
/// other's last tiles, where with 2 parts per thread one of two threads waited 10-25 us at
/// the end of most of a decode step's products (1.9B model: 3-6 us with the regions).
fn row_tile_regions(
    ws: &[BlockMatrix<'_>],
    passes: usize,
    threads: usize,
) -> (Vec<RowTile>, Vec<usize>) {
    let (tiles, bounds, _) = split_tiles(ws, passes, threads, 1);
    (tiles, bounds)
}

fn split_tiles(
    ws: &[BlockMatrix<'_>],
    passes: usize,
    threads: usize,
    per_thread: usize,
) -> (Vec<RowTile>, Vec<usize>, usize) {
    let mut tiles = Vec::new();
    let mut col = 0;
    for (p, w) in ws.iter().enumerate() {
        for lo in (0..w.n).step_by(TILE) {
            tiles.push((p, lo, (lo + TILE).min(w.n), col));
        }
        col += w.n;
    }
    let bytes = |t: &RowTile| (t.2 - t.1) * ws[t.0].row_bytes();
    let total: usize = tiles.iter().map(bytes).sum();
    let threads = threads
        .min(crate::pool::max_parts())
        .min(tiles.len())
        .min(total * passes / BYTES_PER_THREAD)
        .max(1);
    let parts = if threads == 1 {
        1
    } else {
        (threads * per_thread)
            .min(tiles.len())
            .min(total * passes / BYTES_PER_PART)
            .max(threads)
    };
    let mut bounds = vec![0; parts + 1];
    let mut seen = 0;
    for (i, t) in tiles.iter().enumerate() {
        let share = (seen * parts / total.max(1)).min(parts - 1);
        for b in bounds.iter_mut().skip(share + 1) {
            *b = i + 1;
        }
        seen += bytes(t);
    }
    bounds[parts] = tiles.len();
    (tiles, bounds, threads)
}

/// Raw output pointer shared by the parts; each writes a disjoint set of columns.
#[derive(Clone, Copy)]
struct OutPtr(*mut f32);
// SAFETY: parts write disjoint elements (distinct columns n) of one live buffer.
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

impl OutPtr {
    /// The pointer to element `i` (a method, so closures capture the whole `Sync` wrapper).
    fn at(self, i: usize) -> *mut f32 {
        self.0.wrapping_add(i)
    }
}

/// What the row kernels multiply a weight row with.
pub(crate) enum Acts<'a> {
    Float { x: &'a [f32], k: usize },
    Quant(&'a QActs),
}

fn check_sizes(x: &[f32], m: usize, w: &BlockMatrix<'_>, out: &[f32]) -> Result<(), KernelError> {
    w.check()?;
    if m > MAX_ROWS {
        return Err(KernelError::Shape(format!(
            "x has {m} rows, block_matmul_t takes at most {MAX_ROWS}"
        )));
    }
    if x.len() != m * w.k {
        return Err(KernelError::Shape(format!(
            "x has {} values, expected {m} x {}",
            x.len(),
            w.k
        )));
    }
    if out.len() != m * w.n {
        return Err(KernelError::Shape(format!(
            "out has {} values, expected {m} x {}",
            out.len(),
            w.n
        )));
    }
    Ok(())
}

/// `out = x @ w.T` for `x` f32 `[m, w.k]` (`m <= MAX_ROWS`) into `out` f32 `[m, w.n]`, on up
/// to `threads` threads.
pub fn block_matmul_t(
    x: &[f32],
    m: usize,
    w: &BlockMatrix<'_>,
    out: &mut [f32],
    threads: usize,
) -> Result<(), KernelError> {
    matmul_impl(x, m, w, out, threads, false)
}

/// `out = x @ w.T` as `block_matmul_t`, but with the f32 activations themselves (no 8-bit
/// rounding): equal to `x @ dequantize(w).T` in f32 up to summation order (see `exact`).
pub fn block_matmul_t_f32(
    x: &[f32],
    m: usize,
    w: &BlockMatrix<'_>,
    out: &mut [f32],
    threads: usize,
) -> Result<(), KernelError> {
    exact::matmul(x, m, w, out, threads, false)
}

/// `block_matmul_t_f32` of several weights with the same `k` at once (fused Q/K/V, gate/up:
/// parts of different types): `out` is `[m, sum n_p]` and part `p` fills the columns after
/// those of the parts before it. One pass over the thread pool for all parts.
pub fn block_matmul_t_f32_parts(
    x: &[f32],
    m: usize,
    ws: &[BlockMatrix<'_>],
    out: &mut [f32],
    threads: usize,
) -> Result<(), KernelError> {
    exact::matmul_parts(x, m, ws, out, threads, false)
}

/// Whether `block_gemm_f32` runs here: AVX-512 present and the SIMD code not switched off
/// (`set_force_portable`). Elsewhere callers dequantize tiles and use BLAS.
pub fn gemm_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        use_avx2(false) && gemm512::available()
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// `out[r, col0 + j] = sum_k x[r, k] * dequantize(w)[j, k]` for all `m` rows of `x` (`[m, k]`)
/// and rows `j` of a quantized `w`, with `out` `[m, ld]`: the product of a prefill chunk.
/// Weight panels are dequantized (bit-exact with ggml) into a cache-sized buffer and
/// multiplied by a register-tiled f32 micro-kernel; every output sums its `k` products in
/// order from zero, so a row's result does not depend on `m`, the threads or the tiling.
/// Needs `gemm_available()`; float weights (F32/F16/BF16) are refused (BLAS takes them).
#[allow(clippy::too_many_arguments)]
pub fn block_gemm_f32(
    x: &[f32],
    m: usize,
    w: &BlockMatrix<'_>,
    out: &mut [f32],
    ld: usize,
    col0: usize,
    threads: usize,
) -> Result<(), KernelError> {
    w.check()?;
    if matches!(w.ty, BlockType::F32 | BlockType::F16 | BlockType::BF16) {
        return Err(KernelError::Shape(format!(
            "{:?} weights are not block-quantized",
            w.ty
        )));
    }
    if x.len() != m * w.k {
        return Err(KernelError::Shape(format!(
            "x has {} values, expected {m} x {}",
            x.len(),
            w.k
        )));
    }
    if col0.checked_add(w.n).is_none_or(|e| e > ld) || out.len() != m * ld {
        return Err(KernelError::Shape(format!(
            "out has {} values, expected {m} x {ld} with columns {col0}..{} inside",
            out.len(),
            col0.saturating_add(w.n)
        )));
    }
    if !gemm_available() {
        return Err(KernelError::Shape(
            "block_gemm_f32 needs AVX-512 (see gemm_available)".into(),
        ));
    }
    if m == 0 || w.n == 0 {
        return Ok(());
    }
    #[cfg(target_arch = "x86_64")]
    {
        let wide = exact512::supports(w.ty) && exact512::available();
        let ty = w.ty;
        let deq = move |bytes: &[u8], n: usize, dst: &mut [f32], stride: usize| {
            let chunks = n / 16;
            assert!(
                n.is_multiple_of(ty.block_size())
                    && bytes.len() >= n / ty.block_size() * ty.block_bytes()
                    && (chunks == 0 || (chunks - 1) * stride + 16 <= dst.len()),
                "a GEMM panel slice too short for its dequantized chunks"
            );
            if wide {
                // SAFETY: AVX-512 checked; the bytes hold n / block whole blocks and dst each
                // chunk's 16 values (asserted)
                unsafe { exact512::dequantize_row_chunks(ty, bytes, n, dst.as_mut_ptr(), stride) };
            } else {
                let mut tmp = [0f32; gemm512::KCH];
                portable::dequantize_row_unchecked(ty, bytes, &mut tmp[..n]);
                for (c, chunk) in tmp[..n].chunks_exact(16).enumerate() {
                    dst[c * stride..][..16].copy_from_slice(chunk);
                }
            }
        };
        gemm512::gemm(x, m, w, out, ld, col0, threads, &deq);
    }
    Ok(())
}

/// Whether `block_matmul_t_vnni` runs here (AVX512-VNNI, the SIMD code not switched off).
pub fn vnni_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        use_avx2(false) && vnni::available()
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Whether `block_matmul_t_vnni` takes weights of type `ty`.
pub fn vnni_supports(ty: BlockType) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        vnni::supports(ty)
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = ty;
        false
    }
}

/// `out[:, c_p..c_p + n_p]` = `x` (`[m, k]`, any `m`) quantized to 8 bits per 32 values
/// (scale `amax / 127`, ties to even) times the rows of each of `ws` (`c_p`: the rows of the
/// parts before it; `out` `[m, sum n_p]`), in integers (see `vnni`). A row's result is the
/// same bits whatever `m` is and wherever the row sits in `x`. Needs `vnni_available()` and
/// every part `vnni_supports`ed.
pub fn block_matmul_t_vnni(
    x: &[f32],
    m: usize,
    ws: &[BlockMatrix<'_>],
    out: &mut [f32],
    threads: usize,
) -> Result<(), KernelError> {
    let ld: usize = ws.iter().map(|w| w.n).sum();
    if ws.is_empty() || ws.iter().any(|w| w.k != ws[0].k) {
        return Err(KernelError::Shape(
            "parts must be one or more weights with the same k".into(),
        ));
    }
    for w in ws {
        w.check()?;
        if !vnni_supports(w.ty) {
            return Err(KernelError::Shape(format!(
                "{:?} weights have no VNNI kernel",
                w.ty
            )));
        }
    }
    let k = ws[0].k;
    if x.len() != m * k {
        return Err(KernelError::Shape(format!(
            "x has {} values, expected {m} x {k}",
            x.len()
        )));
    }
    if out.len() != m * ld {
        return Err(KernelError::Shape(format!(
            "out has {} values, expected {m} x {ld}",
            out.len()
        )));
    }
    if !vnni_available() {
        return Err(KernelError::Shape(
            "block_matmul_t_vnni needs AVX512-VNNI (see vnni_available)".into(),
        ));
    }
    if m == 0 || ld == 0 {
        return Ok(());
    }
    #[cfg(target_arch = "x86_64")]
    vnni::matmul_parts(x, m, ws, out, threads);
    Ok(())
}

/// `block_matmul_t_f32` on the portable code.
pub fn block_matmul_t_f32_portable(
    x: &[f32],
    m: usize,
    w: &BlockMatrix<'_>,
    out: &mut [f32],
    threads: usize,
) -> Result<(), KernelError> {
    exact::matmul(x, m, w, out, threads, true)
}

/// `block_matmul_t` on the portable code (the reference the SIMD path is tested against).
pub fn block_matmul_t_portable(
    x: &[f32],
    m: usize,
    w: &BlockMatrix<'_>,
    out: &mut [f32],
    threads: usize,
) -> Result<(), KernelError> {
    matmul_impl(x, m, w, out, threads, true)
}

fn matmul_impl(
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
    let qa;
    let acts = if w.ty.is_float() {
        Acts::Float { x, k: w.k }
    } else {
        qa = QActs::quantize(x, w.k);
        Acts::Quant(&qa)
    };
    for_each_row_block(m, w, out, threads, &|row, r, res| {
        row_dot(simd, w.ty, row, &acts, r, res.len(), res)
    });
    Ok(())
}

/// `dot(weight_row, first_activation_row, results)`: see [`for_each_row_block`].
pub(super) type RowBlockDot<'a> = dyn Fn(&[u8], usize, &mut [f32]) + Sync + 'a;

/// The loop both small-batch kernels share: output rows `n` are split in tiles over up to
/// `threads` pool parts (fewer when the work is small), and for each weight row, `dot(row,
/// r, res)` fills `res` (at most `ROW_BLOCK` long) with the products of that row and
/// activation rows `[r, r + res.len())`, which land in column `n` of `out` (`[m, w.n]`,
/// checked by the caller). Each weight row is read once per `ROW_BLOCK` activation rows.
pub(super) fn for_each_row_block(
    m: usize,
    w: &BlockMatrix<'_>,
    out: &mut [f32],
    threads: usize,
    dot: &RowBlockDot<'_>,
) {
    debug_assert_eq!(out.len(), m * w.n);
    let ptr = OutPtr(out.as_mut_ptr());
    let n_tiles = w.n.div_ceil(TILE);
    let work = w.raw.len() * m.div_ceil(ROW_BLOCK);
    let parts = threads
        .min(crate::pool::max_parts())
        .min(n_tiles)
        .min(work / BYTES_PER_THREAD)
        .max(1);
    let per = n_tiles.div_ceil(parts) * TILE;
    crate::pool::run(parts, &|t| {
        let (lo, hi) = (t * per, ((t + 1) * per).min(w.n));
        let mut res = [0f32; ROW_BLOCK];
        for n in lo..hi {
            let row = w.row(n);
            let mut r = 0;
            while r < m {
                let rows = (m - r).min(ROW_BLOCK);
                dot(row, r, &mut res[..rows]);
                for (i, v) in res[..rows].iter().enumerate() {
                    // SAFETY: r + i < m, n < w.n: inside the [m, n] buffer the caller
                    // checked; column n belongs to this part alone.
                    unsafe { *ptr.at((r + i) * w.n + n) = *v };
                }
                r += rows;
            }
        }
    });
}

/// Dot products of weight row `row` with activation rows `[r0, r0 + out.len())`.
fn row_dot(
    simd: bool,
    ty: BlockType,
    row: &[u8],
    acts: &Acts<'_>,
    r0: usize,
    rows: usize,
    out: &mut [f32],
) {
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: the CPU has AVX2, FMA and F16C (use_avx2); sizes were checked.
        if simd && unsafe { avx2::row_dot(ty, row, acts, r0, rows, out) } {
            return;
        }
    }
    let _ = simd;
    portable::row_dot(ty, row, acts, r0, rows, out);
}

/// Rows `[start, stop)` of `w` as f32 into `out` (`[stop - start, w.k]`), on up to `threads`
/// threads, exactly as ggml's `dequantize_row_*` computes them.
pub fn dequantize_rows(
    w: &BlockMatrix<'_>,
    start: usize,
    stop: usize,
    out: &mut [f32],
    threads: usize,
) -> Result<(), KernelError> {
    w.check()?;
    if start > stop || stop > w.n {
        return Err(KernelError::Shape(format!(
            "rows {start}..{stop} outside 0..{}",
            w.n
        )));
    }
    let rows = stop - start;
    if out.len() != rows * w.k {
        return Err(KernelError::Shape(format!(
            "out has {} values, expected {rows} x {}",
            out.len(),
            w.k
        )));
    }
    if rows == 0 {
        return Ok(());
    }
    let ptr = OutPtr(out.as_mut_ptr());
    // ~4 us per 64K values dequantized: parts of at least 1M values
    let parts = threads
        .min(crate::pool::max_parts())
        .min(rows * w.k / (1 << 20))
        .max(1);
    let per = rows.div_ceil(parts);
    #[cfg(target_arch = "x86_64")]
    let wide = use_avx2(false) && exact512::supports(w.ty) && exact512::available();
    crate::pool::run(parts, &|t| {
        let (lo, hi) = (t * per, ((t + 1) * per).min(rows));
        for i in lo..hi {
            // SAFETY: row i of out (i < rows) belongs to this part alone; checked above.
            let o = unsafe { std::slice::from_raw_parts_mut(ptr.at(i * w.k), w.k) };
            #[cfg(target_arch = "x86_64")]
            if wide {
                // SAFETY: AVX-512 checked; the row holds w.k / block whole blocks (checked)
                unsafe { exact512::dequantize_row(w.ty, w.row(start + i), o) };
                continue;
            }
            portable::dequantize_row_unchecked(w.ty, w.row(start + i), o);
        }
    });
    Ok(())
}
