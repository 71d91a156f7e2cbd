//! Paged attention for decode rows and prefill chunks, reading keys and values in place from
//! the block pool.
//!
//! Decode rows (a sequence with at most `DECODE_ROWS` query rows in the call): NumPy computes
//! a decode token's attention as a `[heads, hd] x [hd, T]` product, a softmax and a
//! `[heads, T] x [T, hd]` product: at 6K context each of those walks 6 MB of f32 keys or
//! values on one thread through OpenBLAS's small-M path, ~4 ms per global layer. Here one
//! pass over the keys scores all query heads of a KV head at once, and long contexts are
//! split over threads (each part keeps its own max and sum, combined at the end like
//! flash-decoding), so the cost is close to reading K and V once.
//!
//! Prefill chunks (more rows): flash-attention style tiles of query rows x the query heads of
//! one KV head (`TILE_VECS` query vectors) walk their keys in blocks of `KEY_BLOCK`, keeping
//! a running max, sum and weighted sum of values per query vector (online softmax), so the
//! keys and values are read in place from the pool (f16 converted in registers) once per
//! tile, and only the keys a tile can see are scored. Tiles are dealt out to threads
//! largest first.
//!
//! KV element types (`KvElem`): f32, f16 (`F16`) and q8_0 (`Q8Block`: ggml's Q8_0 blocks of 32
//! values, an f16 scale and 32 int8, as llama.cpp's `-ctk q8_0 -ctv q8_0` caches hold them).
//! f32 rows are read in place, decode rows read f16 in place too (converted eight values at a
//! time in registers); q8_0 decode rows are converted to f32 32 rows at a time into a small
//! buffer, and prefill tiles convert each key block's f16 or q8_0 rows to f32 once (every
//! query vector of the tile, and the AVX-512 products, then read those), except narrow tiles
//! (a decode row's few query heads), which read f16 rows in place too.
//! `quantize_q8_0` is ggml's `quantize_row_q8_0_ref` (what `ops/attention.py` writes).
//!
//! Layout (as `ops/attention.py`): `k`, `v`: `[n_blocks, block_size, n_kv, hd]` values (f32, f16,
//! or `hd / 32` Q8_0 blocks); query
//! rows `[n_tok, n_head, hd]`; sequence `s` owns rows `q_starts[s]..q_starts[s + 1]` at
//! positions `start_positions[s] + i`; query head `h` reads KV head `h / (n_head / n_kv)`. A
//! query at position `qp` sees keys `kp <= qp` with `qp - kp < window` when `window > 0`.
//!
//! Attention sinks (gpt-oss; `paged_attention_with`): one learned logit per query head that
//! joins the softmax's denominator and weighs no value. Every path keeps a row's max, sum and
//! weighted values until its keys are merged, and the sink enters there, once per row.

use crate::aligned::AlignedF32;
use crate::qmatmul::KernelError;

/// Least number of keys worth a task of its own on another thread.
const KEYS_PER_TASK: usize = 256;
/// Least total work (keys x query heads x head dim) worth another thread (~40 us).
const WORK_PER_THREAD: usize = 1 << 18;
/// The same for the tile path, whose parts the pool deals out to whichever thread is running
/// (`pool::run_on`): a decode row of the 1.9B model at context 64 (8 tiles, 2^17) took 87 us
/// on one thread.
const TILE_WORK_PER_THREAD: usize = 1 << 15;
/// Sequences with at most this many query rows take the decode path (one task per row, long
/// contexts split over threads); longer ones take the tiled prefill path.
pub const DECODE_ROWS: usize = 4;
/// Query vectors (query rows x query heads of one KV head) per prefill tile.
const TILE_VECS: usize = 64;
/// Keys per step of a prefill tile (their scores: `KEY_BLOCK x TILE_VECS` f32).
const KEY_BLOCK: usize = 32;
/// The invariant attention's stretches of keys (a multiple of `KEY_BLOCK`): each is
/// computed alone and the results merged in order, so that a decode row's keys can be split
/// between threads. At 6K context a decode row of Gemma 3 270M's global layers took 2.2 ms
/// on one thread.
const SEGMENT: usize = 256;
/// With fewer tiles than this per thread, the invariant attention deals out their segments
/// instead of whole tiles.
const SPLIT_BELOW: usize = 4;
/// Most query vectors a tile scores with keys in lanes (`avx512::scores_narrow`).
const NARROW_VECTORS: usize = 8;
/// q8_0 rows a decode task converts to f32 at a time (`as_f32_rows`).
const DQ_ROWS: usize = 32;

/// An element type of the KV pool: f32, IEEE half precision (`F16`, the pool's f16 mode) or
/// a ggml Q8_0 block of 32 values (`Q8Block`, the pool's q8_0 mode). A row of `head_dim`
/// values is `head_dim / VALS` elements.
pub trait KvElem: Copy + Sync + 'static {
    /// Whether the type is f32 itself (read without conversion).
    const IS_F32: bool = false;
    /// Values one element holds: 1, or 32 for a Q8_0 block.
    const VALS: usize = 1;
    /// Value `i` of a row of elements.
    fn value(row: &[Self], i: usize) -> f32;
    /// A row of elements as f32 values (`out.len()` of them).
    fn row_to_f32(row: &[Self], out: &mut [f32]) {
        for (i, o) in out.iter_mut().enumerate() {
            *o = Self::value(row, i);
        }
    }
}

impl KvElem for f32 {
    const IS_F32: bool = true;
    fn value(row: &[Self], i: usize) -> f32 {
        row[i]
    }
    fn row_to_f32(row: &[Self], out: &mut [f32]) {
        out.copy_from_slice(&row[..out.len()]);
    }
}

/// An IEEE 754 half-precision value, as NumPy's float16 stores it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(transparent)]
pub struct F16(pub u16);

impl F16 {
    /// The value as f32 (exact).
    pub fn to_f32(self) -> f32 {
        let h = self.0 as u32;
        let sign = (h & 0x8000) << 16;
        let exp = (h >> 10) & 0x1f;
        let man = h & 0x3ff;
        let bits = match (exp, man) {
            (0, 0) => sign,
            (0, _) => {
                // subnormal: normalise
                let shift = man.leading_zeros() - 21;
                sign | ((113 - shift) << 23) | (((man << shift) & 0x3ff) << 13)
            }
            (31, _) => sign | 0x7f80_0000 | (man << 13),
            _ => sign | ((exp + 112) << 23) | (man << 13),
        };
        f32::from_bits(bits)
    }

    /// The half nearest to `x` (ties to even; overflow to infinity), as ggml's
    /// `GGML_FP32_TO_FP16` and F16C's `vcvtps2ph` round.
    pub fn from_f32(x: f32) -> F16 {
        let b = x.to_bits();
        let sign = ((b >> 16) & 0x8000) as u16;
        let exp = ((b >> 23) & 0xff) as i32;
        let man = b & 0x7f_ffff;
        if exp == 0xff {
            // infinity, or NaN (kept quiet and non-zero)
            let nan = if man != 0 {
                0x200 | (man >> 13) as u16
            } else {
                0
            };
            return F16(sign | 0x7c00 | nan);
        }
        let e = exp - 127 + 15; // the half's biased exponent
        if e >= 31 {
            return F16(sign | 0x7c00);
        }
        // the value as an integer count of the half's last place (2^-24 for subnormals),
        // with `shift` bits below it rounded off
        let (m, shift) = if e <= 0 {
            if e < -10 {
                return F16(sign); // below half the smallest subnormal: zero
            }
            (man | 0x80_0000, (14 - e) as u32)
        } else {
            (man, 13)
        };
        let half = 1u32 << (shift - 1);
        let rest = m & ((1u32 << shift) - 1);
        let mut q = m >> shift;
        if rest > half || (rest == half && q & 1 == 1) {
            q += 1; // may carry into the exponent: still the right bits
        }
        let bits = if e <= 0 { q } else { ((e as u32) << 10) + q };
        F16(sign | bits as u16)
    }
}

impl KvElem for F16 {
    fn value(row: &[Self], i: usize) -> f32 {
        row[i].to_f32()
    }
}

/// Values per Q8_0 block.
pub const Q8_VALS: usize = 32;
/// Bytes of a Q8_0 block: an f16 scale, then 32 int8 values.
pub const Q8_BYTES: usize = 34;

/// One ggml Q8_0 block (`block_q8_0`): value `j` is `d * qs[j]`, `d` an f16 stored
/// little-endian. 34 bytes, alignment 1: a pool row of `head_dim` values is `head_dim / 32`
/// of them, `head_dim / 32 * 34` bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(C)]
pub struct Q8Block {
    pub d: [u8; 2],
    pub qs: [i8; 32],
}

const _: () = assert!(std::mem::size_of::<Q8Block>() == Q8_BYTES);
const _: () = assert!(std::mem::align_of::<Q8Block>() == 1);

impl Q8Block {
    /// The scale as f32.
    pub fn scale(&self) -> f32 {
        F16(u16::from_le_bytes(self.d)).to_f32()
    }

    /// Bytes (a multiple of 34 of them) viewed as blocks; None otherwise.
    pub fn from_bytes(b: &[u8]) -> Option<&[Q8Block]> {
        if !b.len().is_multiple_of(Q8_BYTES) {
            return None;
        }
        // SAFETY: Q8Block is repr(C) of byte arrays (size 34, alignment 1, every bit
        // pattern valid), and the slice covers exactly b's bytes.
        Some(unsafe {
            std::slice::from_raw_parts(b.as_ptr() as *const Q8Block, b.len() / Q8_BYTES)
        })
    }

    /// Mutable bytes (a multiple of 34 of them) viewed as blocks; None otherwise.
    pub fn from_bytes_mut(b: &mut [u8]) -> Option<&mut [Q8Block]> {
        if !b.len().is_multiple_of(Q8_BYTES) {
            return None;
        }
        // SAFETY: as in `from_bytes`; the borrow is exclusive.
        Some(unsafe {
            std::slice::from_raw_parts_mut(b.as_mut_ptr() as *mut Q8Block, b.len() / Q8_BYTES)
        })
    }
}

impl KvElem for Q8Block {
    const VALS: usize = Q8_VALS;
    fn value(row: &[Self], i: usize) -> f32 {
        let b = &row[i / Q8_VALS];
        b.scale() * b.qs[i % Q8_VALS] as f32
    }
    fn row_to_f32(row: &[Self], out: &mut [f32]) {
        for (b, o) in row.iter().zip(out.chunks_exact_mut(Q8_VALS)) {
            let d = b.scale();
            for (x, &q) in o.iter_mut().zip(&b.qs) {
                *x = d * q as f32;
            }
        }
    }
}

/// ggml's `quantize_row_q8_0_ref`: `x` (a multiple of 32 values) into Q8_0 blocks. Per
/// block: `d = amax / 127`, `q = round(x * (1 / d))` (halves away from zero; 0 when d is 0),
/// `d` stored as the nearest f16.
pub fn quantize_q8_0(x: &[f32], out: &mut [Q8Block]) -> Result<(), KernelError> {
    if !x.len().is_multiple_of(Q8_VALS) || out.len() != x.len() / Q8_VALS {
        return shape_err(format!(
            "{} values need a multiple of 32 values and {} blocks, got {}",
            x.len(),
            x.len() / Q8_VALS,
            out.len()
        ));
    }
    for (xs, b) in x.chunks_exact(Q8_VALS).zip(out.iter_mut()) {
        let amax = xs.iter().fold(0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        b.d = F16::from_f32(d).0.to_le_bytes();
        for (q, &v) in b.qs.iter_mut().zip(xs) {
            *q = (v * id).round() as i8;
        }
    }
    Ok(())
}

/// A borrowed layer of the block pool.
#[derive(Clone, Copy)]
pub struct PagedKv<'a, T: KvElem = f32> {
    pub k: &'a [T],
    pub v: &'a [T],
    pub n_blocks: usize,
    pub block_size: usize,
    pub n_kv: usize,
    pub head_dim: usize,
}

/// The query rows and where they sit.
#[derive(Clone, Copy)]
pub struct Queries<'a> {
    /// `[n_tok, n_head, hd]`
    pub q: &'a [f32],
    pub n_head: usize,
    /// `[n_seq, width]`, -1 where a sequence has no block
    pub tables: &'a [i32],
    pub width: usize,
    /// `[n_seq + 1]`
    pub q_starts: &'a [i64],
    /// `[n_seq]`
    pub start_positions: &'a [i64],
}

/// One (query row, KV head) over keys `[lo, hi)`.
#[derive(Clone, Copy)]
struct Task {
    seq: usize,
    row: usize,
    kvh: usize,
    lo: usize,
    hi: usize,
}

/// A task's unnormalised result: per query head of the group, the score max, the sum of
/// `exp(score - max)` and `sum exp(score - max) * v` (`[g, hd]`).
struct Partial {
    max: Vec<f32>,
    sum: Vec<f32>,
    acc: Vec<f32>,
}

fn shape_err<T>(m: String) -> Result<T, KernelError> {
    Err(KernelError::Shape(m))
}

fn check<T: KvElem>(
    kv: &PagedKv<'_, T>,
    qs: &Queries<'_>,
    out: &[f32],
) -> Result<usize, KernelError> {
    let (nb, bs, n_kv, hd) = (kv.n_blocks, kv.block_size, kv.n_kv, kv.head_dim);
    if !hd.is_multiple_of(T::VALS) {
        return shape_err(format!(
            "head_dim {hd} must be a multiple of {} for this KV type",
            T::VALS
        ));
    }
    let size = nb * bs * n_kv * (hd / T::VALS);
    if kv.k.len() != size || kv.v.len() != size {
        return shape_err(format!("k/v must have {nb} x {bs} x {n_kv} x {hd} values"));
    }
    if bs == 0 || n_kv == 0 || hd == 0 || qs.n_head == 0 || !qs.n_head.is_multiple_of(n_kv) {
        return shape_err(format!(
            "n_head {} must be a multiple of n_kv {n_kv} (all > 0)",
            qs.n_head
        ));
    }
    let n_seq = qs.start_positions.len();
    if qs.q_starts.len() != n_seq + 1 || qs.tables.len() != n_seq * qs.width {
        return shape_err(format!(
            "{n_seq} sequences need q_starts of {} and tables of {n_seq} x width",
            n_seq + 1
        ));
    }
    let n_tok = qs.q.len() / (qs.n_head * hd);
    if qs.q.len() != n_tok * qs.n_head * hd || out.len() != qs.q.len() {
        return shape_err("q and out must be [n_tok, n_head, head_dim]".into());
    }
    let mut prev = 0i64;
    if qs.q_starts.first() != Some(&0) {
        return shape_err("q_starts must start at 0".into());
    }
    for &e in &qs.q_starts[1..] {
        if e < prev || e as usize > n_tok {
            return shape_err(format!("q_starts must ascend within 0..={n_tok}"));
        }
        prev = e;
    }
    Ok(n_tok)
}

/// Whether the block table of sequence `s` covers key positions `[lo, hi)`.
fn cover<T: KvElem>(
    kv: &PagedKv<'_, T>,
    qs: &Queries<'_>,
    s: usize,
    lo: usize,
    hi: usize,
) -> Result<(), KernelError> {
    let bs = kv.block_size;
    let table = &qs.tables[s * qs.width..(s + 1) * qs.width];
    for b in lo / bs..hi.div_ceil(bs) {
        match table.get(b) {
            Some(&id) if id >= 0 && (id as usize) < kv.n_blocks => {}
            _ => {
                return Err(KernelError::Uncovered(format!(
                    "sequence {s}: block table does not cover positions < {hi}"
                )))
            }
        }
    }
    Ok(())
}

/// First key position a query at `qp` sees.
fn first_key(qp: usize, window: usize) -> usize {
    if window > 0 {
        (qp + 1).saturating_sub(window)
    } else {
        0
    }
}

/// Rows `(r0, r1)` and first position of the sequences whose row count is in
/// `(min_rows, max_rows]`.
fn seqs_with_rows<'a>(
    qs: &'a Queries<'_>,
    min_rows: usize,
    max_rows: usize,
) -> impl Iterator<Item = Result<(usize, usize, usize, usize), KernelError>> + 'a {
    (0..qs.start_positions.len()).filter_map(move |s| {
        let (r0, r1) = (qs.q_starts[s] as usize, qs.q_starts[s + 1] as usize);
        let n = r1 - r0;
        if n == 0 || n <= min_rows || n > max_rows {
            return None;
        }
        let p0 = qs.start_positions[s];
        if p0 < 0 {
            return Some(shape_err(format!("sequence {s}: negative start position")));
        }
        Some(Ok((s, r0, r1, p0 as usize)))
    })
}

/// The decode tasks of every sequence with `(min_rows, max_rows]` query rows, checking that
/// each one's block table covers its keys.
fn tasks<T: KvElem>(
    kv: &PagedKv<'_, T>,
    qs: &Queries<'_>,
    window: usize,
    min_rows: usize,
    max_rows: usize,
) -> Result<Vec<Task>, KernelError> {
    let mut out = Vec::new();
    for r in seqs_with_rows(qs, min_rows, max_rows) {
        let (s, r0, r1, p0) = r?;
        cover(kv, qs, s, first_key(p0, window), p0 + (r1 - r0))?;
        for row in r0..r1 {
            let qp = p0 + (row - r0);
            for kvh in 0..kv.n_kv {
                out.push(Task {
                    seq: s,
                    row,
                    kvh,
                    lo: first_key(qp, window),
                    hi: qp + 1,
                });
            }
        }
    }
    Ok(out)
}

/// One prefill tile: query rows `[r0, r1)` of sequence `seq` (positions from `qa`) with the
/// query heads of KV head `kvh`, over keys `[lo, hi)`.
#[derive(Clone, Copy, Debug)]
struct Tile {
    seq: usize,
    r0: usize,
    r1: usize,
    kvh: usize,
    qa: usize,
    lo: usize,
    hi: usize,
}

/// The prefill tiles of every sequence with more than `min_rows` and at most `max_rows` rows.
fn tiles<T: KvElem>(
    kv: &PagedKv<'_, T>,
    qs: &Queries<'_>,
    window: usize,
    min_rows: usize,
    max_rows: usize,
) -> Result<Vec<Tile>, KernelError> {
    let g = qs.n_head / kv.n_kv;
    let tq = (TILE_VECS / g).max(1);
    let mut out = Vec::new();
    for r in seqs_with_rows(qs, min_rows, max_rows) {
        let (s, r0, r1, p0) = r?;
        cover(kv, qs, s, first_key(p0, window), p0 + (r1 - r0))?;
        let mut a = r0;
        while a < r1 {
            let b = (a + tq).min(r1);
            let qa = p0 + (a - r0);
            for kvh in 0..kv.n_kv {
                out.push(Tile {
                    seq: s,
                    r0: a,
                    r1: b,
                    kvh,
                    qa,
                    lo: first_key(qa, window),
                    hi: qa + (b - a),
                });
            }
            a = b;
        }
    }
    Ok(out)
}

/// Split long key ranges into pieces for `parts` threads, then deal the pieces out in
/// contiguous groups of about equal key counts. Each piece carries its item's index.
fn plan(items: &[Task], parts: usize) -> Vec<Vec<(Task, usize)>> {
    let mut pieces = Vec::new();
    for (item, &t) in items.iter().enumerate() {
        let len = t.hi - t.lo;
        let n = parts.min(len / KEYS_PER_TASK).max(1);
        let per = len.div_ceil(n);
        let mut a = t.lo;
        while a < t.hi {
            let b = (a + per).min(t.hi);
            pieces.push((Task { lo: a, hi: b, ..t }, item));
            a = b;
        }
    }
    let total: usize = pieces.iter().map(|(t, _)| t.hi - t.lo).sum();
    let target = total.div_ceil(parts).max(1);
    let mut groups = vec![Vec::new()];
    let mut acc = 0;
    for p in pieces {
        if acc >= target && groups.len() < parts {
            groups.push(Vec::new());
            acc = 0;
        }
        acc += p.0.hi - p.0.lo;
        groups.last_mut().unwrap().push(p);
    }
    groups
}

/// Which code paths `paged_attention_with` takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Paths {
    /// `paged_attention`'s: decode rows alone, prefill tiles, the best SIMD the CPU has.
    Fast,
    /// `paged_attention_invariant`'s: every row through the tiles, the same bits in any call.
    Invariant,
    /// The portable (non-SIMD) code, one thread: tests compare the others with it.
    Portable,
    /// `Fast` without the AVX-512 tiles (the AVX2 ones): tests on AVX-512 machines.
    Avx2,
}

/// Attention of every query row of the sequences with at most `max_rows` rows, written into
/// `out` (`[n_tok, n_head, hd]`; other sequences' rows are not touched). `scale` multiplies
/// q.k before the softmax. Runs on up to `threads` threads (`crate::pool`).
pub fn paged_attention<T: KvElem>(
    kv: &PagedKv<'_, T>,
    qs: &Queries<'_>,
    scale: f32,
    window: usize,
    max_rows: usize,
    out: &mut [f32],
    threads: usize,
) -> Result<(), KernelError> {
    paged_attention_with(
        kv,
        qs,
        scale,
        window,
        None,
        max_rows,
        out,
        threads,
        Paths::Fast,
    )
}

/// `paged_attention` on the portable (non-SIMD) code paths, for tests comparing them.
pub fn paged_attention_portable<T: KvElem>(
    kv: &PagedKv<'_, T>,
    qs: &Queries<'_>,
    scale: f32,
    window: usize,
    max_rows: usize,
    out: &mut [f32],
) -> Result<(), KernelError> {
    paged_attention_with(
        kv,
        qs,
        scale,
        window,
        None,
        max_rows,
        out,
        1,
        Paths::Portable,
    )
}

/// `paged_attention` without the AVX-512 prefill tiles (the AVX2 ones), for tests on machines
/// that have AVX-512.
#[doc(hidden)]
pub fn paged_attention_avx2<T: KvElem>(
    kv: &PagedKv<'_, T>,
    qs: &Queries<'_>,
    scale: f32,
    window: usize,
    max_rows: usize,
    out: &mut [f32],
    threads: usize,
) -> Result<(), KernelError> {
    paged_attention_with(
        kv,
        qs,
        scale,
        window,
        None,
        max_rows,
        out,
        threads,
        Paths::Avx2,
    )
}

/// `paged_attention` with every row's result the same bits whatever call computes it: decode
/// rows take the prefill tiles too (one row's query heads per tile), a tile's key blocks end
/// at multiples of `KEY_BLOCK` and its keys are cut at multiples of `SEGMENT`, so a query
/// vector meets the same blocks, online-softmax steps, products and merges in a tile of any
/// shape (a decode row's stretches on whichever threads are free). With 8-bit activations
/// (`blocks::block_matmul_t_vnni`) the float-order differences between the decode and
/// prefill paths (~1e-6) moved rounding boundaries and changed logits by ~1%.
pub fn paged_attention_invariant<T: KvElem>(
    kv: &PagedKv<'_, T>,
    qs: &Queries<'_>,
    scale: f32,
    window: usize,
    max_rows: usize,
    out: &mut [f32],
    threads: usize,
) -> Result<(), KernelError> {
    paged_attention_with(
        kv,
        qs,
        scale,
        window,
        None,
        max_rows,
        out,
        threads,
        Paths::Invariant,
    )
}

/// `paged_attention` on the given `paths`, with optional attention sinks: `sinks[h]`
/// (`n_head` values) is query head `h`'s learned logit, which joins the softmax's
/// denominator and weighs no value (gpt-oss; llama.cpp's `ggml_soft_max_add_sinks` and its
/// flash attention's sinks): `out = sum_j e^(s_j - m) v_j / (sum_j e^(s_j - m) + e^(sink - m))`.
/// The sink enters once a row's keys are all merged, so it changes no path's bits before it.
#[allow(clippy::too_many_arguments)]
pub fn paged_attention_with<T: KvElem>(
    kv: &PagedKv<'_, T>,
    qs: &Queries<'_>,
    scale: f32,
    window: usize,
    sinks: Option<&[f32]>,
    max_rows: usize,
    out: &mut [f32],
    threads: usize,
    paths: Paths,
) -> Result<(), KernelError> {
    let (threads, simd, wide, decode_max) = match paths {
        Paths::Fast => (threads, true, true, DECODE_ROWS),
        Paths::Invariant => (threads, true, true, 0),
        Paths::Portable => (1, false, false, DECODE_ROWS),
        Paths::Avx2 => (threads, true, false, DECODE_ROWS),
    };
    attention(
        kv, qs, scale, window, sinks, max_rows, out, threads, simd, wide, decode_max,
    )
}

#[allow(clippy::too_many_arguments)]
fn attention<T: KvElem>(
    kv: &PagedKv<'_, T>,
    qs: &Queries<'_>,
    scale: f32,
    window: usize,
    sinks: Option<&[f32]>,
    max_rows: usize,
    out: &mut [f32],
    threads: usize,
    simd: bool,
    wide: bool,
    // sequences with at most this many rows take the decode path (0: every row a tile)
    decode_max: usize,
) -> Result<(), KernelError> {
    check(kv, qs, out)?;
    if let Some(s) = sinks {
        if s.len() != qs.n_head {
            return shape_err(format!(
                "sinks must have n_head ({}) values, got {}",
                qs.n_head,
                s.len()
            ));
        }
    }
    let decode = tasks(kv, qs, window, 0, max_rows.min(decode_max))?;
    let prefill = tiles(kv, qs, window, decode_max, max_rows)?;
    let threads = threads.min(crate::pool::max_parts()).max(1);
    if !decode.is_empty() {
        decode_rows(kv, qs, scale, sinks, &decode, out, threads, simd);
    }
    if !prefill.is_empty() {
        // the invariant attention (no decode path) cuts keys at fixed positions, so that a
        // decode row's keys can be shared between threads
        let segment = if decode_max == 0 { SEGMENT } else { 0 };
        prefill_tiles(
            kv, qs, scale, window, sinks, prefill, out, threads, simd, wide, segment,
        );
    }
    Ok(())
}

/// The decode path: every task's keys split over threads, partial results merged.
#[allow(clippy::too_many_arguments)]
fn decode_rows<T: KvElem>(
    kv: &PagedKv<'_, T>,
    qs: &Queries<'_>,
    scale: f32,
    sinks: Option<&[f32]>,
    items: &[Task],
    out: &mut [f32],
    threads: usize,
    simd: bool,
) {
    let g = qs.n_head / kv.n_kv;
    let work: usize = items.iter().map(|t| (t.hi - t.lo) * kv.head_dim * g).sum();
    let parts = threads.min(work / WORK_PER_THREAD).max(1);
    let groups = plan(items, parts);
    let results: Vec<std::sync::Mutex<Vec<(usize, Partial)>>> = groups
        .iter()
        .map(|_| std::sync::Mutex::new(Vec::new()))
        .collect();
    crate::pool::run(groups.len(), &|i| {
        let r: Vec<(usize, Partial)> = groups[i]
            .iter()
            .map(|&(t, item)| (item, partial(kv, qs, scale, t, simd)))
            .collect();
        *results[i].lock().unwrap_or_else(|e| e.into_inner()) = r;
    });
    let results = results
        .into_iter()
        .map(|m| m.into_inner().unwrap_or_else(|e| e.into_inner()));
    // combine the pieces of each item (in key order: groups and pieces are in order)
    let hd = kv.head_dim;
    let mut merged: Vec<Option<Partial>> = (0..items.len()).map(|_| None).collect();
    for (item, p) in results.flatten() {
        match &mut merged[item] {
            slot @ None => *slot = Some(p),
            Some(m) => {
                for h in 0..g {
                    let acc = &mut m.acc[h * hd..(h + 1) * hd];
                    let later = (p.max[h], p.sum[h], &p.acc[h * hd..(h + 1) * hd]);
                    fold(&mut m.max[h], &mut m.sum[h], acc, later);
                }
            }
        }
    }
    for (t, m) in items.iter().zip(merged) {
        let mut m = m.expect("every item has a piece");
        for h in 0..g {
            if let Some(s) = sinks {
                let acc = &mut m.acc[h * hd..(h + 1) * hd];
                add_sink(m.max[h], &mut m.sum[h], acc, s[t.kvh * g + h]);
            }
            let inv = 1.0 / m.sum[h];
            let o = (t.row * qs.n_head + t.kvh * g + h) * hd;
            for (d, x) in out[o..o + hd].iter_mut().zip(&m.acc[h * hd..(h + 1) * hd]) {
                *d = x * inv;
            }
        }
    }
}

/// The prefill path: tiles dealt out to threads largest first (an atomic counter), each
/// result copied into `out`. With `segment` > 0 and too few tiles to keep the threads busy
/// (decode rows), each tile's `segment`-aligned stretches of keys are dealt out instead and
/// merged in key order here: the same operations as `tile` does on one thread, so the same
/// bits.
#[allow(clippy::too_many_arguments)]
fn prefill_tiles<T: KvElem>(
    kv: &PagedKv<'_, T>,
    qs: &Queries<'_>,
    scale: f32,
    window: usize,
    sinks: Option<&[f32]>,
    mut items: Vec<Tile>,
    out: &mut [f32],
    threads: usize,
    simd: bool,
    wide: bool,
    segment: usize,
) {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Mutex;
    let (g, hd) = (qs.n_head / kv.n_kv, kv.head_dim);
    let cost = |t: &Tile| (t.r1 - t.r0) * (t.hi - t.lo);
    items.sort_by_key(|t| std::cmp::Reverse(cost(t)));
    let work: usize = items.iter().map(|t| cost(t) * g * hd).sum();
    // the sinks of a tile's query heads (those of its KV head)
    let group = |t: &Tile| sinks.map(|s| &s[t.kvh * g..(t.kvh + 1) * g]);
    let threads = threads.min(work / TILE_WORK_PER_THREAD).max(1);
    let write = |out: &mut [f32], t: &Tile, r: &[f32]| {
        for row in t.r0..t.r1 {
            let o = (row * qs.n_head + t.kvh * g) * hd;
            let i = (row - t.r0) * g * hd;
            out[o..o + g * hd].copy_from_slice(&r[i..i + g * hd]);
        }
    };
    if segment > 0 && threads > 1 && items.len() < SPLIT_BELOW * threads {
        let tqs: Vec<TileQueries> = items
            .iter()
            .map(|t| TileQueries::new(kv, qs, scale, t, simd, wide))
            .collect();
        let pieces: Vec<(usize, usize, usize)> = items
            .iter()
            .enumerate()
            .flat_map(|(i, t)| segments(t.lo, t.hi, segment).map(move |(a, b)| (i, a, b)))
            .collect();
        let states: Vec<Mutex<Option<TileState>>> =
            pieces.iter().map(|_| Mutex::new(None)).collect();
        crate::pool::run_on(threads, pieces.len(), &|p| {
            let (i, a, b) = pieces[p];
            let st = tile_keys(kv, qs, window, &items[i], &tqs[i], a, b, simd);
            *states[p].lock().unwrap_or_else(|e| e.into_inner()) = Some(st);
        });
        let mut merged: Vec<Option<TileState>> = items.iter().map(|_| None).collect();
        for (&(i, _, _), st) in pieces.iter().zip(states) {
            let st = st.into_inner().unwrap_or_else(|e| e.into_inner());
            merge(&mut merged[i], st.expect("every piece ran"));
        }
        for (t, st) in items.iter().zip(merged) {
            write(out, t, &st.expect("every tile has keys").finish(group(t)));
        }
        return;
    }
    let parts = threads.min(items.len());
    let next = AtomicUsize::new(0);
    let results: Vec<Mutex<Vec<f32>>> = items.iter().map(|_| Mutex::new(Vec::new())).collect();
    crate::pool::run(parts, &|_| loop {
        let i = next.fetch_add(1, Ordering::Relaxed);
        let Some(t) = items.get(i) else { break };
        let r = tile(kv, qs, scale, window, group(t), t, simd, wide, segment);
        *results[i].lock().unwrap_or_else(|e| e.into_inner()) = r;
    });
    for (t, r) in items.iter().zip(results) {
        write(out, t, &r.into_inner().unwrap_or_else(|e| e.into_inner()));
    }
}

/// One prefill tile's output, `[rows, g, hd]`: online softmax over key blocks; with
/// `segment` > 0, over the keys of each `segment`-aligned stretch in turn, the stretches'
/// results merged in key order (`merge`), as `attention`'s split tiles do on several threads.
/// `sinks`: the tile's query heads' sink logits (`TileState::finish`).
#[allow(clippy::too_many_arguments)]
fn tile<T: KvElem>(
    kv: &PagedKv<'_, T>,
    qs: &Queries<'_>,
    scale: f32,
    window: usize,
    sinks: Option<&[f32]>,
    t: &Tile,
    simd: bool,
    wide: bool,
    segment: usize,
) -> Vec<f32> {
    let tq = TileQueries::new(kv, qs, scale, t, simd, wide);
    let mut merged = None;
    for (lo, hi) in segments(t.lo, t.hi, segment) {
        merge(&mut merged, tile_keys(kv, qs, window, t, &tq, lo, hi, simd));
    }
    merged.map_or_else(
        || vec![0.0; (t.r1 - t.r0) * tq.g * kv.head_dim],
        |s| s.finish(sinks),
    )
}

/// `[lo, hi)` cut at the multiples of `segment` (0: not cut).
fn segments(lo: usize, hi: usize, segment: usize) -> impl Iterator<Item = (usize, usize)> {
    let mut a = lo;
    std::iter::from_fn(move || {
        if a >= hi {
            return None;
        }
        let b = match a.checked_div(segment) {
            Some(n) => ((n + 1) * segment).min(hi),
            None => hi,
        };
        let piece = (a, b);
        a = b;
        Some(piece)
    })
}

/// A tile's query vectors, scaled (and transposed for the AVX-512 products).
struct TileQueries {
    g: usize,
    /// query vectors (row r, head h at r * g + h), and with padding
    m: usize,
    mp: usize,
    wide: bool,
    /// at most `NARROW_VECTORS` (a decode row's heads): `avx512::scores_narrow`, no `qt`
    narrow: bool,
    q: AlignedF32,
    qt: AlignedF32,
}

impl TileQueries {
    fn new<T: KvElem>(
        kv: &PagedKv<'_, T>,
        qs: &Queries<'_>,
        scale: f32,
        t: &Tile,
        simd: bool,
        wide: bool,
    ) -> Self {
        let hd = kv.head_dim;
        let g = qs.n_head / kv.n_kv;
        let m = (t.r1 - t.r0) * g;
        let wide = wide && simd && wide_ok(hd);
        // AVX-512 works on 16 query vectors at a time: zero vectors pad the tile (never output)
        let mp = if wide { m.next_multiple_of(16) } else { m };
        let narrow = wide && m <= NARROW_VECTORS;
        let mut q = AlignedF32::zeros(mp * hd);
        for row in t.r0..t.r1 {
            let q0 = (row * qs.n_head + t.kvh * g) * hd;
            let d = (row - t.r0) * g * hd;
            for (a, b) in q[d..d + g * hd].iter_mut().zip(&qs.q[q0..q0 + g * hd]) {
                *a = b * scale;
            }
        }
        // the wide path scores with the queries transposed, `qt[d * mp + i]`
        let qt = if wide && !narrow {
            let mut qt = AlignedF32::zeros(hd * mp);
            for (i, qr) in q.chunks_exact(hd).enumerate() {
                for (d, &x) in qr.iter().enumerate() {
                    qt[d * mp + i] = x;
                }
            }
            qt
        } else {
            AlignedF32::zeros(0)
        };
        TileQueries {
            g,
            m,
            mp,
            wide,
            narrow,
            q,
            qt,
        }
    }
}

/// A tile's online-softmax state over some of its keys, per query vector: the score max
/// (-inf: no key seen), the sum of `exp(score - max)` and `sum exp(score - max) * v`.
struct TileState {
    m: usize,
    hd: usize,
    mx: AlignedF32,
    sum: AlignedF32,
    acc: AlignedF32,
}

impl TileState {
    /// `[m, hd]`: each vector's weighted values over its sum; with `sinks` (one per query
    /// head of the tile's group: vector `r * g + h` takes `sinks[h]`), the sink's term added
    /// to the sum first (`add_sink`).
    fn finish(self, sinks: Option<&[f32]>) -> Vec<f32> {
        let mut out = self.acc[..self.m * self.hd].to_vec();
        for (i, (a, s)) in out
            .chunks_exact_mut(self.hd)
            .zip(self.sum.iter())
            .enumerate()
        {
            let mut s = *s;
            if let Some(sk) = sinks {
                add_sink(self.mx[i], &mut s, a, sk[i % sk.len()]);
            }
            let inv = 1.0 / s;
            a.iter_mut().for_each(|x| *x *= inv);
        }
        out
    }
}

/// A query vector's softmax state over all its keys (`mx`, `sum`, `acc`) with a sink logit
/// joining the denominator, as ggml-cpu's flash attention adds it: the side below the larger
/// of the max and the sink is scaled down (never an `exp` of a positive number, which could
/// overflow), so `acc / sum` is then the row's result.
fn add_sink(mx: f32, sum: &mut f32, acc: &mut [f32], sink: f32) {
    if sink > mx {
        let ms = (mx - sink).exp();
        acc.iter_mut().for_each(|x| *x *= ms);
        *sum = *sum * ms + 1.0;
    } else {
        *sum += (sink - mx).exp();
    }
}

/// Fold `p` (the state over later keys) into `into` (the state over the keys before them).
/// A vector that saw no key on one side takes the other side's state unchanged, so its
/// result is the same bits whichever stretches of keys it did not see were computed.
fn merge(into: &mut Option<TileState>, p: TileState) {
    let Some(a) = into else {
        *into = Some(p);
        return;
    };
    let hd = a.hd;
    for i in 0..a.m {
        let acc = &mut a.acc[i * hd..(i + 1) * hd];
        let later = (p.mx[i], p.sum[i], &p.acc[i * hd..(i + 1) * hd]);
        fold(&mut a.mx[i], &mut a.sum[i], acc, later);
    }
}

/// One query vector's softmax state over earlier keys (`mx`, `sum`, `acc`) and over later
/// ones (`later`) made one: both rescaled to the larger max. A side that saw no key (max
/// -inf) leaves the other unchanged (the formula gives the same bits there when one side is
/// finite, and NaN when neither is).
fn fold(mx: &mut f32, sum: &mut f32, acc: &mut [f32], later: (f32, f32, &[f32])) {
    let (mb, sb, pacc) = later;
    if mb == f32::NEG_INFINITY {
        return;
    }
    if *mx == f32::NEG_INFINITY {
        (*mx, *sum) = (mb, sb);
        acc.copy_from_slice(pacc);
        return;
    }
    let m = mx.max(mb);
    let (fa, fb) = ((*mx - m).exp(), (mb - m).exp());
    *mx = m;
    *sum = *sum * fa + sb * fb;
    for (x, y) in acc.iter_mut().zip(pacc) {
        *x = *x * fa + *y * fb;
    }
}

/// The tile's state over its keys in `[lo, hi)`: online softmax over key blocks.
#[allow(clippy::too_many_arguments)]
fn tile_keys<T: KvElem>(
    kv: &PagedKv<'_, T>,
    qs: &Queries<'_>,
    window: usize,
    t: &Tile,
    tq: &TileQueries,
    lo: usize,
    hi: usize,
    simd: bool,
) -> TileState {
    let (bs, n_kv, hd) = (kv.block_size, kv.n_kv, kv.head_dim);
    let rl = hd / T::VALS; // elements per row
    let (g, m, mp, wide, narrow) = (tq.g, tq.m, tq.mp, tq.wide, tq.narrow);
    let rows = t.r1 - t.r0;
    let (q, qt) = (&tq.q, &tq.qt);
    let table = &qs.tables[t.seq * qs.width..(t.seq + 1) * qs.width];
    // 64-byte aligned (`crate::aligned`): the AVX-512 products load 16 values at a time
    let mut mx = AlignedF32::filled(mp, f32::NEG_INFINITY);
    let mut sum = AlignedF32::zeros(mp);
    let mut acc = AlignedF32::zeros(mp * hd);
    let mut sc = AlignedF32::zeros(KEY_BLOCK * mp); // [key, query vector]
    let mut offs = Vec::with_capacity(KEY_BLOCK);
    // an f32 pool is read in place; f16 and q8_0 rows are converted once per block (not once
    // per four query vectors); the portable path reads f16 in place too; a narrow tile (a
    // decode row) reads f32 and f16 rows in place, converting in registers (`avx512::row16`)
    let in_place = T::IS_F32 || (!simd && T::VALS == 1);
    let narrow_in_place = narrow && T::VALS == 1;
    let mut kbuf = AlignedF32::zeros(if narrow_in_place { 0 } else { KEY_BLOCK * hd });
    let dense_offs: Vec<usize> = (0..KEY_BLOCK).map(|j| j * hd).collect();
    let as_f32 = |x: &[T]| -> &[f32] {
        debug_assert!(T::IS_F32);
        // SAFETY: T is f32 (IS_F32 is only true for f32).
        unsafe { std::slice::from_raw_parts(x.as_ptr() as *const f32, x.len()) }
    };
    let q_last = t.qa + rows - 1;
    if narrow_in_place {
        // A decode row's keys were stored steps ago and are in memory by now; the scores
        // read 16 keys' rows side by side, a line of each at a time, and waited on each
        // round of misses. Asking for all of them first keeps more misses in flight: Gemma 3
        // 270M's attention in a decode step at context 64-80 took 20-22 us a layer, not
        // 26-28; the 1.9B's 42, not 47-48. (The values are read in order, key after key.)
        let row_bytes = rl * std::mem::size_of::<T>();
        for p in lo..hi {
            let off = ((table[p / bs] as usize * bs + p % bs) * n_kv + t.kvh) * rl;
            prefetch_row(kv.k[off..].as_ptr() as *const u8, row_bytes);
        }
    }
    let mut j0 = lo;
    while j0 < hi {
        // blocks end at multiples of KEY_BLOCK (the first may start later, at keys no row
        // of the tile sees before it), so a row meets the same blocks in any tile
        let j1 = ((j0 / KEY_BLOCK + 1) * KEY_BLOCK).min(hi);
        let nk = j1 - j0;
        offs.clear();
        offs.extend((j0..j1).map(|p| ((table[p / bs] as usize * bs + p % bs) * n_kv + t.kvh) * rl));
        let sc = &mut sc[..nk * mp];
        // a few query vectors (a decode row's heads) in a 16-wide tile: keys in lanes
        if (!in_place || narrow) && !narrow_in_place {
            to_f32_rows(kv.k, &offs, hd, &mut kbuf, simd);
        }
        let (kd, ko): (&[f32], &[usize]) = if in_place && wide && !narrow {
            (as_f32(kv.k), &offs)
        } else {
            (&kbuf, &dense_offs[..nk])
        };
        if narrow_in_place {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: wide_ok detected AVX-512F and hd is a multiple of 16; offs index whole
            // rows of kv.k (f32 or f16), q holds m rows of hd, sc nk x mp.
            unsafe {
                avx512::scores_narrow(kv.k, &offs, q, m, mp, hd, sc)
            };
        } else if narrow {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as above; kbuf holds nk dense f32 rows of hd.
            unsafe {
                avx512::scores_narrow(&kbuf[..], &dense_offs[..nk], q, m, mp, hd, sc)
            };
        } else if wide {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: wide_ok detected AVX-512F; ko index whole rows of kd, qt is hd x mp
            // with mp a multiple of 16, sc nk x mp.
            unsafe {
                avx512::scores_t(kd, ko, qt, mp, hd, sc)
            };
        } else if in_place {
            scores(kv.k, &offs, q, mp, hd, sc, simd);
        } else {
            scores(kd, ko, q, mp, hd, sc, simd);
        }
        // every row sees every key of the block: no mask
        let open = j1 - 1 <= t.qa && (window == 0 || q_last - j0 < window);
        if !open {
            for (j, s) in sc.chunks_exact_mut(mp).enumerate() {
                let p = j0 + j;
                for r in 0..rows {
                    let qp = t.qa + r;
                    if p > qp || (window > 0 && qp - p >= window) {
                        s[r * g..(r + 1) * g].fill(f32::NEG_INFINITY);
                    }
                }
            }
        }
        // the query vectors past m pad the tile (never output): their softmax is skipped,
        // in whole groups of 8 so that every vector's exp takes the same (SIMD) path
        let live = m.next_multiple_of(8).min(mp);
        softmax_step(sc, mp, live, hd, &mut mx, &mut sum, &mut acc, simd);
        if narrow_in_place {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as for the scores; acc is mp x hd.
            unsafe {
                avx512::weighted_values_narrow(kv.v, &offs, sc, m, mp, hd, &mut acc)
            };
            j0 = j1;
            continue;
        }
        if !in_place {
            to_f32_rows(kv.v, &offs, hd, &mut kbuf, simd);
        }
        let (vd, vo): (&[f32], &[usize]) = if in_place && wide {
            (as_f32(kv.v), &offs)
        } else {
            (&kbuf, &dense_offs[..nk])
        };
        if narrow {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as above, over kbuf's dense f32 rows.
            unsafe {
                avx512::weighted_values_narrow(vd, vo, sc, m, mp, hd, &mut acc)
            };
        } else if wide {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as above; acc is mp x hd.
            unsafe {
                avx512::weighted_values(vd, vo, sc, m, mp, hd, &mut acc)
            };
        } else if in_place {
            weighted_values(kv.v, &offs, sc, mp, hd, &mut acc, simd);
        } else {
            weighted_values(vd, vo, sc, mp, hd, &mut acc, simd);
        }
        j0 = j1;
    }
    TileState {
        m,
        hd,
        mx,
        sum,
        acc,
    }
}

/// Asks for the `len` bytes at `p` to be brought into the cache (a hint: never faults).
fn prefetch_row(p: *const u8, len: usize) {
    #[cfg(target_arch = "x86_64")]
    crate::x86::prefetch_lines::<{ std::arch::x86_64::_MM_HINT_T0 }>(p, len, p.wrapping_add(len));
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (p, len);
}

/// Whether the prefill tiles can use AVX-512 (`avx512`).
fn wide_ok(hd: usize) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        simd_ok(hd) && std::is_x86_feature_detected!("avx512f")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = hd;
        false
    }
}

/// `dst[j * hd..][..hd]` = the row at element offset `offs[j]` of `src`, as f32.
fn to_f32_rows<T: KvElem>(src: &[T], offs: &[usize], hd: usize, dst: &mut [f32], simd: bool) {
    #[cfg(target_arch = "x86_64")]
    {
        if simd && simd_ok(hd) {
            // SAFETY: features detected; offs index whole rows of src, dst holds offs.len()
            // rows of hd.
            return unsafe { avx2::to_f32_rows(src, offs, hd, dst) };
        }
    }
    let rl = hd / T::VALS;
    for (d, &o) in dst.chunks_exact_mut(hd).zip(offs) {
        T::row_to_f32(&src[o..o + rl], d);
    }
}

/// The online softmax of one key block for the first `m` of the `stride` query vectors:
/// `sc` (`[keys, stride]` scores, -inf where masked) becomes `exp(score - new max)`; each
/// query vector's running max, sum and weighted values are rescaled to the new max.
#[allow(clippy::too_many_arguments)]
fn softmax_step(
    sc: &mut [f32],
    stride: usize,
    m: usize,
    hd: usize,
    mx: &mut [f32],
    sum: &mut [f32],
    acc: &mut [f32],
    simd: bool,
) {
    let mut nm = mx[..m].to_vec();
    for s in sc.chunks_exact(stride) {
        for (a, &b) in nm.iter_mut().zip(&s[..m]) {
            *a = a.max(b);
        }
    }
    for i in 0..m {
        if nm[i] == f32::NEG_INFINITY {
            nm[i] = 0.0; // nothing seen yet: every exp below is 0
        } else if nm[i] != mx[i] {
            let alpha = if mx[i] == f32::NEG_INFINITY {
                0.0
            } else {
                (mx[i] - nm[i]).exp()
            };
            sum[i] *= alpha;
            acc[i * hd..(i + 1) * hd]
                .iter_mut()
                .for_each(|x| *x *= alpha);
            mx[i] = nm[i];
        }
    }
    for s in sc.chunks_exact_mut(stride) {
        let s = &mut s[..m];
        exp_sub(s, &nm, simd);
        for (a, &b) in sum.iter_mut().zip(s.iter()) {
            *a += b;
        }
    }
}

/// `x[i] = exp(x[i] - sub[i])` (0 where `x[i]` is -inf).
fn exp_sub(x: &mut [f32], sub: &[f32], simd: bool) {
    #[cfg(target_arch = "x86_64")]
    {
        if simd && simd_ok(16) {
            // SAFETY: features detected; x and sub have equal lengths.
            return unsafe { avx2::exp_sub(x, sub) };
        }
    }
    for (a, &b) in x.iter_mut().zip(sub) {
        *a = (*a - b).exp();
    }
}

/// One task: scores of its keys for the group's query heads, their softmax numerators and
/// the weighted sum of values.
fn partial<T: KvElem>(
    kv: &PagedKv<'_, T>,
    qs: &Queries<'_>,
    scale: f32,
    t: Task,
    simd: bool,
) -> Partial {
    let (bs, n_kv, hd) = (kv.block_size, kv.n_kv, kv.head_dim);
    let rl = hd / T::VALS; // elements per row
    let g = qs.n_head / n_kv;
    let table = &qs.tables[t.seq * qs.width..(t.seq + 1) * qs.width];
    // offset of each key's row (this KV head) in k / v, in elements
    let rows: Vec<usize> = (t.lo..t.hi)
        .map(|p| ((table[p / bs] as usize * bs + p % bs) * n_kv + t.kvh) * rl)
        .collect();
    let q0 = (t.row * qs.n_head + t.kvh * g) * hd;
    let q: Vec<f32> = qs.q[q0..q0 + g * hd].iter().map(|x| x * scale).collect();
    let n = rows.len();
    let mut sc = vec![0f32; n * g]; // [key, head]
    if T::VALS == 1 {
        scores(kv.k, &rows, &q, g, hd, &mut sc, simd);
    } else {
        as_f32_rows(kv.k, &rows, hd, simd, g, &mut sc, |k, r, sc| {
            scores(k, r, &q, g, hd, sc, simd)
        });
    }
    let mut max = vec![f32::NEG_INFINITY; g];
    for j in 0..n {
        for h in 0..g {
            max[h] = max[h].max(sc[j * g + h]);
        }
    }
    let mut sum = vec![0f32; g];
    for j in 0..n {
        for h in 0..g {
            let e = (sc[j * g + h] - max[h]).exp();
            sc[j * g + h] = e;
            sum[h] += e;
        }
    }
    let mut acc = vec![0f32; g * hd];
    if T::VALS == 1 {
        weighted_values(kv.v, &rows, &sc, g, hd, &mut acc, simd);
    } else {
        as_f32_rows(kv.v, &rows, hd, simd, g, &mut sc, |v, r, p| {
            weighted_values(v, r, p, g, hd, &mut acc, simd)
        });
    }
    Partial { max, sum, acc }
}

/// The decode path's q8_0 rows: `f(f32 rows, their offsets, their part of sc)` over the rows
/// `DQ_ROWS` at a time, converted to f32 first (a few KiB, read back from L1). At 6K context
/// this made a decode row ~30% faster than converting eight values in registers inside every
/// product (`avx2::load8`), and faster than reading f16 in place.
fn as_f32_rows<T: KvElem>(
    src: &[T],
    rows: &[usize],
    hd: usize,
    simd: bool,
    g: usize,
    sc: &mut [f32],
    mut f: impl FnMut(&[f32], &[usize], &mut [f32]),
) {
    let mut buf = vec![0f32; DQ_ROWS * hd];
    let dense: Vec<usize> = (0..DQ_ROWS).map(|j| j * hd).collect();
    for (r, s) in rows.chunks(DQ_ROWS).zip(sc.chunks_mut(DQ_ROWS * g)) {
        to_f32_rows(src, r, hd, &mut buf[..r.len() * hd], simd);
        f(&buf[..r.len() * hd], &dense[..r.len()], s);
    }
}

/// Whether the AVX2 path can run (every AVX2 CPU also has F16C, which f16 pools use).
#[cfg(target_arch = "x86_64")]
fn simd_ok(hd: usize) -> bool {
    hd.is_multiple_of(16)
        && std::is_x86_feature_detected!("avx2")
        && std::is_x86_feature_detected!("fma")
        && std::is_x86_feature_detected!("f16c")
}

/// `sc[j * g + h] = q[h] . k[rows[j]]` (`rows`: element offsets of whole rows).
fn scores<T: KvElem>(
    k: &[T],
    rows: &[usize],
    q: &[f32],
    g: usize,
    hd: usize,
    sc: &mut [f32],
    simd: bool,
) {
    #[cfg(target_arch = "x86_64")]
    {
        if simd && simd_ok(hd) {
            // SAFETY: features detected; rows index whole rows of k (built from a checked
            // table), q holds g rows of hd, sc rows.len() x g.
            return unsafe { avx2::scores(k, rows, q, g, hd, sc) };
        }
    }
    portable_scores(k, rows, q, g, hd, sc)
}

/// `acc[h] += sum_j p[j * g + h] * v[rows[j]]`.
fn weighted_values<T: KvElem>(
    v: &[T],
    rows: &[usize],
    p: &[f32],
    g: usize,
    hd: usize,
    acc: &mut [f32],
    simd: bool,
) {
    #[cfg(target_arch = "x86_64")]
    {
        if simd && simd_ok(hd) {
            // SAFETY: as in `scores`.
            return unsafe { avx2::weighted_values(v, rows, p, g, hd, acc) };
        }
    }
    portable_weighted_values(v, rows, p, g, hd, acc)
}

fn portable_scores<T: KvElem>(
    k: &[T],
    rows: &[usize],
    q: &[f32],
    g: usize,
    hd: usize,
    sc: &mut [f32],
) {
    let rl = hd / T::VALS;
    let mut kr = vec![0f32; hd];
    for (j, &r) in rows.iter().enumerate() {
        T::row_to_f32(&k[r..r + rl], &mut kr);
        for h in 0..g {
            sc[j * g + h] = q[h * hd..(h + 1) * hd]
                .iter()
                .zip(&kr)
                .map(|(a, b)| a * b)
                .sum();
        }
    }
}

fn portable_weighted_values<T: KvElem>(
    v: &[T],
    rows: &[usize],
    p: &[f32],
    g: usize,
    hd: usize,
    acc: &mut [f32],
) {
    let rl = hd / T::VALS;
    let mut vr = vec![0f32; hd];
    for (j, &r) in rows.iter().enumerate() {
        if (0..g).all(|h| p[j * g + h] == 0.0) {
            continue;
        }
        T::row_to_f32(&v[r..r + rl], &mut vr);
        for h in 0..g {
            let w = p[j * g + h];
            if w == 0.0 {
                continue;
            }
            for (a, b) in acc[h * hd..(h + 1) * hd].iter_mut().zip(&vr) {
                *a += w * b;
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::{KvElem, Q8Block, F16, Q8_VALS};
    use crate::x86::{exp8, hsum};
    use std::any::TypeId;
    use std::arch::x86_64::*;

    /// Values `c..c + 8` of the row at `p` as f32 (f16 through F16C's `vcvtph2ps`). f32 and
    /// f16 rows only: q8_0 rows are converted by `to_f32_rows` before any product.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn load8<T: KvElem>(p: *const T, c: usize) -> __m256 {
        debug_assert!(T::VALS == 1);
        unsafe {
            if TypeId::of::<T>() == TypeId::of::<F16>() {
                _mm256_cvtph_ps(_mm_loadu_si128(p.add(c) as *const __m128i))
            } else {
                _mm256_loadu_ps((p as *const f32).add(c))
            }
        }
    }

    /// Up to four heads at a time against each key row, two accumulators per head (FMA
    /// latency), so each key row is read once per four heads.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn scores<T: KvElem>(
        k: &[T],
        rows: &[usize],
        q: &[f32],
        g: usize,
        hd: usize,
        sc: &mut [f32],
    ) {
        let mut h0 = 0;
        while h0 < g {
            let hn = (g - h0).min(4);
            unsafe {
                match hn {
                    4 => heads::<T, 4>(k, rows, q, g, h0, hd, sc),
                    3 => heads::<T, 3>(k, rows, q, g, h0, hd, sc),
                    2 => heads::<T, 2>(k, rows, q, g, h0, hd, sc),
                    _ => heads::<T, 1>(k, rows, q, g, h0, hd, sc),
                }
            }
            h0 += hn;
        }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn heads<T: KvElem, const H: usize>(
        k: &[T],
        rows: &[usize],
        q: &[f32],
        g: usize,
        h0: usize,
        hd: usize,
        sc: &mut [f32],
    ) {
        let kp = k.as_ptr();
        let qp = unsafe { q.as_ptr().add(h0 * hd) };
        // two keys at a time: 2H accumulators (8 FMA chains at H = 4), each q load used twice
        let mut j = 0;
        while j + 2 <= rows.len() {
            let (ka, kb) = unsafe { (kp.add(rows[j]), kp.add(rows[j + 1])) };
            let mut a = [_mm256_setzero_ps(); H];
            let mut b = [_mm256_setzero_ps(); H];
            let mut c = 0;
            while c < hd {
                unsafe {
                    let k0 = load8(ka, c);
                    let k1 = load8(kb, c);
                    for h in 0..H {
                        let qv = _mm256_loadu_ps(qp.add(h * hd + c));
                        a[h] = _mm256_fmadd_ps(qv, k0, a[h]);
                        b[h] = _mm256_fmadd_ps(qv, k1, b[h]);
                    }
                }
                c += 8;
            }
            unsafe {
                store_sums(&a, sc.as_mut_ptr().add(j * g + h0));
                store_sums(&b, sc.as_mut_ptr().add((j + 1) * g + h0));
            }
            j += 2;
        }
        if j < rows.len() {
            let kr = unsafe { kp.add(rows[j]) };
            let mut a0 = [_mm256_setzero_ps(); H];
            let mut a1 = [_mm256_setzero_ps(); H];
            let mut c = 0;
            while c < hd {
                unsafe {
                    let k0 = load8(kr, c);
                    let k1 = load8(kr, c + 8);
                    for h in 0..H {
                        a0[h] = _mm256_fmadd_ps(_mm256_loadu_ps(qp.add(h * hd + c)), k0, a0[h]);
                        a1[h] = _mm256_fmadd_ps(_mm256_loadu_ps(qp.add(h * hd + c + 8)), k1, a1[h]);
                    }
                }
                c += 16;
            }
            for h in 0..H {
                a0[h] = _mm256_add_ps(a0[h], a1[h]);
            }
            unsafe { store_sums(&a0, sc.as_mut_ptr().add(j * g + h0)) };
        }
    }

    /// `out[h] = sum of the lanes of a[h]` (four at once through `hadd` when H = 4).
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn store_sums<const H: usize>(a: &[__m256; H], out: *mut f32) {
        unsafe {
            if H == 4 {
                let t = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
                let s = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
                _mm_storeu_ps(out, s);
            } else {
                for (h, v) in a.iter().enumerate() {
                    *out.add(h) = hsum(*v);
                }
            }
        }
    }

    /// 16 output dims x up to four heads in registers while walking all keys, then the next
    /// 16 dims (each pass reads one cache line of every value row); adds to `acc`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn weighted_values<T: KvElem>(
        v: &[T],
        rows: &[usize],
        p: &[f32],
        g: usize,
        hd: usize,
        acc: &mut [f32],
    ) {
        let mut h0 = 0;
        while h0 < g {
            let hn = (g - h0).min(4);
            unsafe {
                match hn {
                    4 => values::<T, 4>(v, rows, p, g, h0, hd, acc),
                    3 => values::<T, 3>(v, rows, p, g, h0, hd, acc),
                    2 => values::<T, 2>(v, rows, p, g, h0, hd, acc),
                    _ => values::<T, 1>(v, rows, p, g, h0, hd, acc),
                }
            }
            h0 += hn;
        }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn values<T: KvElem, const H: usize>(
        v: &[T],
        rows: &[usize],
        p: &[f32],
        g: usize,
        h0: usize,
        hd: usize,
        acc: &mut [f32],
    ) {
        let vp = v.as_ptr();
        let mut c = 0;
        while c < hd {
            let mut a0 = [_mm256_setzero_ps(); H];
            let mut a1 = [_mm256_setzero_ps(); H];
            for h in 0..H {
                unsafe {
                    let o = acc.as_ptr().add((h0 + h) * hd + c);
                    a0[h] = _mm256_loadu_ps(o);
                    a1[h] = _mm256_loadu_ps(o.add(8));
                }
            }
            for (j, &r) in rows.iter().enumerate() {
                unsafe {
                    let v0 = load8(vp.add(r), c);
                    let v1 = load8(vp.add(r), c + 8);
                    for h in 0..H {
                        let w = _mm256_set1_ps(*p.get_unchecked(j * g + h0 + h));
                        a0[h] = _mm256_fmadd_ps(w, v0, a0[h]);
                        a1[h] = _mm256_fmadd_ps(w, v1, a1[h]);
                    }
                }
            }
            for h in 0..H {
                unsafe {
                    let o = acc.as_mut_ptr().add((h0 + h) * hd + c);
                    _mm256_storeu_ps(o, a0[h]);
                    _mm256_storeu_ps(o.add(8), a1[h]);
                }
            }
            c += 16;
        }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn to_f32_rows<T: KvElem>(
        src: &[T],
        offs: &[usize],
        hd: usize,
        dst: &mut [f32],
    ) {
        if TypeId::of::<T>() == TypeId::of::<Q8Block>() {
            // SAFETY: T is Q8Block.
            let src =
                unsafe { std::slice::from_raw_parts(src.as_ptr() as *const Q8Block, src.len()) };
            return unsafe { q8_rows(src, offs, hd, dst) };
        }
        for (j, &o) in offs.iter().enumerate() {
            let mut c = 0;
            while c < hd {
                unsafe {
                    let v = load8(src.as_ptr().add(o), c);
                    _mm256_storeu_ps(dst.as_mut_ptr().add(j * hd + c), v);
                }
                c += 8;
            }
        }
    }

    /// Q8_0 rows as f32, a block (one scale, 32 values) at a time.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn q8_rows(src: &[Q8Block], offs: &[usize], hd: usize, dst: &mut [f32]) {
        let nb = hd / Q8_VALS;
        for (j, &o) in offs.iter().enumerate() {
            let row = &src[o..o + nb];
            for (i, b) in row.iter().enumerate() {
                unsafe {
                    let d = _mm256_cvtph_ps(_mm_set1_epi16(i16::from_le_bytes(b.d)));
                    let q = _mm256_loadu_si256(b.qs.as_ptr() as *const __m256i);
                    let (lo, hi) = (_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1));
                    let out = dst.as_mut_ptr().add(j * hd + i * Q8_VALS);
                    for (k, part) in [lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)]
                        .into_iter()
                        .enumerate()
                    {
                        let x = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(part));
                        _mm256_storeu_ps(out.add(8 * k), _mm256_mul_ps(x, d));
                    }
                }
            }
        }
    }

    /// `x[i] = exp(x[i] - sub[i])`, Cephes' expf polynomial (~2 ulp) eight at a time; 0 where
    /// the difference is below -87 (so -inf gives exactly 0).
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn exp_sub(x: &mut [f32], sub: &[f32]) {
        let n = x.len();
        let mut i = 0;
        while i + 8 <= n {
            unsafe {
                let px = x.as_mut_ptr().add(i);
                let d = _mm256_sub_ps(_mm256_loadu_ps(px), _mm256_loadu_ps(sub.as_ptr().add(i)));
                _mm256_storeu_ps(px, exp8(d));
            }
            i += 8;
        }
        for j in i..n {
            x[j] = (x[j] - sub[j]).exp();
        }
    }
}

/// The tiles' products on AVX-512 (16 lanes, 32 registers): f32 rows, and for narrow tiles (a
/// decode row's heads) f16 rows too, converted in registers.
#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::KvElem;
    use crate::x86::transpose16;
    use std::arch::x86_64::*;

    /// `sc[j * mp + i] = k[offs[j]] . q[i]` with the queries transposed (`qt[d * mp + i]`):
    /// six keys x 64 query vectors in 24 accumulators, broadcasting one key value per
    /// dimension (no horizontal sums).
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn scores_t(
        k: &[f32],
        offs: &[usize],
        qt: &[f32],
        mp: usize,
        hd: usize,
        sc: &mut [f32],
    ) {
        let mut i0 = 0;
        while i0 < mp {
            let w = ((mp - i0) / 16).min(4);
            let mut j = 0;
            while j < offs.len() {
                let kn = match offs.len() - j {
                    n if n >= 6 => 6,
                    n if n >= 4 => 4,
                    _ => 1,
                };
                unsafe {
                    match (kn, w) {
                        (6, 4) => st::<6, 4>(k, &offs[j..], qt, mp, hd, sc, j, i0),
                        (6, 3) => st::<6, 3>(k, &offs[j..], qt, mp, hd, sc, j, i0),
                        (6, 2) => st::<6, 2>(k, &offs[j..], qt, mp, hd, sc, j, i0),
                        (6, _) => st::<6, 1>(k, &offs[j..], qt, mp, hd, sc, j, i0),
                        (4, 4) => st::<4, 4>(k, &offs[j..], qt, mp, hd, sc, j, i0),
                        (4, 3) => st::<4, 3>(k, &offs[j..], qt, mp, hd, sc, j, i0),
                        (4, 2) => st::<4, 2>(k, &offs[j..], qt, mp, hd, sc, j, i0),
                        (4, _) => st::<4, 1>(k, &offs[j..], qt, mp, hd, sc, j, i0),
                        (_, 4) => st::<1, 4>(k, &offs[j..], qt, mp, hd, sc, j, i0),
                        (_, 3) => st::<1, 3>(k, &offs[j..], qt, mp, hd, sc, j, i0),
                        (_, 2) => st::<1, 2>(k, &offs[j..], qt, mp, hd, sc, j, i0),
                        _ => st::<1, 1>(k, &offs[j..], qt, mp, hd, sc, j, i0),
                    }
                }
                j += kn;
            }
            i0 += w * 16;
        }
    }

    #[target_feature(enable = "avx512f")]
    #[inline]
    #[allow(clippy::too_many_arguments)]
    unsafe fn st<const KN: usize, const W: usize>(
        k: &[f32],
        offs: &[usize],
        qt: &[f32],
        mp: usize,
        hd: usize,
        sc: &mut [f32],
        j: usize,
        i0: usize,
    ) {
        let mut acc = [[_mm512_setzero_ps(); W]; KN];
        let kp: [*const f32; KN] = std::array::from_fn(|x| unsafe { k.as_ptr().add(offs[x]) });
        let qp = unsafe { qt.as_ptr().add(i0) };
        for d in 0..hd {
            unsafe {
                let qv: [__m512; W] =
                    std::array::from_fn(|w| _mm512_loadu_ps(qp.add(d * mp + w * 16)));
                for x in 0..KN {
                    let kb = _mm512_set1_ps(*kp[x].add(d));
                    for w in 0..W {
                        acc[x][w] = _mm512_fmadd_ps(kb, qv[w], acc[x][w]);
                    }
                }
            }
        }
        for (x, ax) in acc.iter().enumerate() {
            for (w, aw) in ax.iter().enumerate() {
                unsafe {
                    _mm512_storeu_ps(sc.as_mut_ptr().add((j + x) * mp + i0 + w * 16), *aw);
                }
            }
        }
    }

    /// Values `at..at + 16` of a row at `p` (f32, or f16 converted: exact) as f32.
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn row16<T: KvElem>(p: *const T, at: usize) -> __m512 {
        debug_assert!(T::VALS == 1);
        unsafe {
            if T::IS_F32 {
                _mm512_loadu_ps((p as *const f32).add(at))
            } else {
                _mm512_cvtph_ps(_mm256_loadu_si256(
                    (p as *const u16).add(at) as *const __m256i
                ))
            }
        }
    }

    /// `sc[j * mp + i]` = `k[offs[j]] . q[i]` for the `m` (<= `NARROW_VECTORS`) query vectors
    /// (rows of `q`, `hd` apart) and the keys at element offsets `offs` of `k` (f32 or f16
    /// rows, converted in registers; `hd` a multiple of 16), keys in lanes: each 16 x 16
    /// piece of 16 keys' rows is transposed in registers, and a column (one dimension of the
    /// 16 keys) multiplies a broadcast query value. Per pair that is `scores_t`'s chain,
    /// `acc = fma(k[j][d], q[i][d], acc)` for d from 0, so the same bits, at a cost per
    /// query vector where `scores_t` pays for 16 (a decode row's 2-4 heads per KV head fill
    /// a 16-wide tile). The `mp - m` padding vectors score 0, as their zero queries do in
    /// `scores_t`.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn scores_narrow<T: KvElem>(
        k: &[T],
        offs: &[usize],
        q: &[f32],
        m: usize,
        mp: usize,
        hd: usize,
        sc: &mut [f32],
    ) {
        let nk = offs.len();
        debug_assert!(m <= super::NARROW_VECTORS && hd.is_multiple_of(16) && T::VALS == 1);
        debug_assert!(offs.iter().all(|&o| o + hd <= k.len()));
        debug_assert!(q.len() >= m * hd && sc.len() >= nk * mp);
        unsafe {
            match m {
                1 => narrow::<T, 1>(k, offs, q, mp, hd, sc),
                2 => narrow::<T, 2>(k, offs, q, mp, hd, sc),
                3 => narrow::<T, 3>(k, offs, q, mp, hd, sc),
                4 => narrow::<T, 4>(k, offs, q, mp, hd, sc),
                5 => narrow::<T, 5>(k, offs, q, mp, hd, sc),
                6 => narrow::<T, 6>(k, offs, q, mp, hd, sc),
                7 => narrow::<T, 7>(k, offs, q, mp, hd, sc),
                _ => narrow::<T, 8>(k, offs, q, mp, hd, sc),
            }
        }
        for row in sc[..nk * mp].chunks_exact_mut(mp) {
            row[m..].fill(0.0);
        }
    }

    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn narrow<T: KvElem, const M: usize>(
        k: &[T],
        offs: &[usize],
        q: &[f32],
        mp: usize,
        hd: usize,
        sc: &mut [f32],
    ) {
        let nk = offs.len();
        let mut j0 = 0;
        while j0 < nk {
            let n = (nk - j0).min(16);
            let mut acc = [_mm512_setzero_ps(); M];
            for d0 in (0..hd).step_by(16) {
                let mut rows = [_mm512_setzero_ps(); 16];
                for (l, r) in rows.iter_mut().enumerate().take(n) {
                    *r = unsafe { row16(k.as_ptr().add(offs[j0 + l]), d0) };
                }
                let cols = transpose16(rows);
                for (t, col) in cols.iter().enumerate() {
                    for (x, a) in acc.iter_mut().enumerate() {
                        let qv = unsafe { *q.get_unchecked(x * hd + d0 + t) };
                        *a = _mm512_fmadd_ps(*col, _mm512_set1_ps(qv), *a);
                    }
                }
            }
            for (x, a) in acc.iter().enumerate() {
                let mut lanes = [0f32; 16];
                unsafe { _mm512_storeu_ps(lanes.as_mut_ptr(), *a) };
                for (l, v) in lanes[..n].iter().enumerate() {
                    sc[(j0 + l) * mp + x] = *v;
                }
            }
            j0 += 16;
        }
    }

    /// `weighted_values` for a narrow tile's `m` (<= `NARROW_VECTORS`) query vectors, the
    /// value rows at element offsets `offs` of `v` (f32 or f16, converted in registers): up
    /// to four query vectors x 64 dims in 16 accumulators while walking the block's keys, so
    /// a decode row's four heads read and convert each value once. Per element the same
    /// chain as `weighted_values` (the same `pv`), `acc = fma(p[j][i], v[j][c], acc)` over the
    /// keys in order.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn weighted_values_narrow<T: KvElem>(
        v: &[T],
        offs: &[usize],
        p: &[f32],
        m: usize,
        mp: usize,
        hd: usize,
        acc: &mut [f32],
    ) {
        debug_assert!(m <= mp && m <= super::NARROW_VECTORS && hd.is_multiple_of(16));
        debug_assert!(offs.iter().all(|&o| o + hd <= v.len()));
        debug_assert!(acc.len() >= mp * hd && p.len() >= offs.len() * mp);
        let mut i = 0;
        while i < m {
            let x = (m - i).min(4);
            unsafe {
                match x {
                    4 => pv_dims::<T, 4>(v, offs, p, mp, hd, acc, i),
                    3 => pv_dims::<T, 3>(v, offs, p, mp, hd, acc, i),
                    2 => pv_dims::<T, 2>(v, offs, p, mp, hd, acc, i),
                    _ => pv_dims::<T, 1>(v, offs, p, mp, hd, acc, i),
                }
            }
            i += x;
        }
    }

    /// `acc[i] += sum_j p[j * mp + i] * v[offs[j]]` for the `m` query vectors of the tile
    /// (not the zero ones that pad it to `mp`; a decode row's 4 query heads were padded to
    /// 16): six query vectors x 64 dims in 24 accumulators while walking the block's keys.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn weighted_values(
        v: &[f32],
        offs: &[usize],
        p: &[f32],
        m: usize,
        mp: usize,
        hd: usize,
        acc: &mut [f32],
    ) {
        debug_assert!(m <= mp);
        let mut i = 0;
        while i < m {
            // six query vectors at a time (24 accumulators), then the rest in twos (the last
            // may be a padding vector: mp is a multiple of 16)
            let x = if m - i >= 6 { 6 } else { 2 };
            unsafe {
                if x == 6 {
                    pv_dims::<f32, 6>(v, offs, p, mp, hd, acc, i);
                } else {
                    pv_dims::<f32, 2>(v, offs, p, mp, hd, acc, i);
                }
            }
            i += x;
        }
    }

    /// `X` query vectors (from `i`) of `acc` over all `hd` dims, 64 at a time (`pv` with
    /// `W` = 4, the last 16-48 with a narrower `W`).
    #[target_feature(enable = "avx512f")]
    #[inline]
    #[allow(clippy::too_many_arguments)]
    unsafe fn pv_dims<T: KvElem, const X: usize>(
        v: &[T],
        offs: &[usize],
        p: &[f32],
        mp: usize,
        hd: usize,
        acc: &mut [f32],
        i: usize,
    ) {
        let mut c = 0;
        while c < hd {
            let w = ((hd - c) / 16).min(4);
            unsafe {
                match w {
                    4 => pv::<T, X, 4>(v, offs, p, mp, hd, acc, i, c),
                    3 => pv::<T, X, 3>(v, offs, p, mp, hd, acc, i, c),
                    2 => pv::<T, X, 2>(v, offs, p, mp, hd, acc, i, c),
                    _ => pv::<T, X, 1>(v, offs, p, mp, hd, acc, i, c),
                }
            }
            c += w * 16;
        }
    }

    /// `X` query vectors (from `i`) x `W` * 16 dims (from `c`) of `acc`, over the value rows
    /// at `offs` (f32 or f16: `row16`) in key order.
    #[target_feature(enable = "avx512f")]
    #[inline]
    #[allow(clippy::too_many_arguments)]
    unsafe fn pv<T: KvElem, const X: usize, const W: usize>(
        v: &[T],
        offs: &[usize],
        p: &[f32],
        mp: usize,
        hd: usize,
        acc: &mut [f32],
        i: usize,
        c: usize,
    ) {
        let ap = unsafe { acc.as_mut_ptr().add(i * hd + c) };
        let mut a = [[_mm512_setzero_ps(); W]; X];
        for (x, ax) in a.iter_mut().enumerate() {
            for (w, aw) in ax.iter_mut().enumerate() {
                *aw = unsafe { _mm512_loadu_ps(ap.add(x * hd + w * 16)) };
            }
        }
        for (j, &o) in offs.iter().enumerate() {
            unsafe {
                let vp = v.as_ptr().add(o);
                let vv: [__m512; W] = std::array::from_fn(|w| row16(vp, c + w * 16));
                for (x, ax) in a.iter_mut().enumerate() {
                    let pb = _mm512_set1_ps(*p.get_unchecked(j * mp + i + x));
                    for w in 0..W {
                        ax[w] = _mm512_fmadd_ps(pb, vv[w], ax[w]);
                    }
                }
            }
        }
        for (x, ax) in a.iter().enumerate() {
            for (w, aw) in ax.iter().enumerate() {
                unsafe { _mm512_storeu_ps(ap.add(x * hd + w * 16), *aw) };
            }
        }
    }
}
