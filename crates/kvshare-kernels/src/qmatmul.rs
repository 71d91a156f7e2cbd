//! `out[m, n] = sum_k x[m, k] * w[n, k]` where `w` is block-quantized:
//! `w[n, k] = qs[n, k] * scale[n, k / G] - mins[n, k / G]` (mins optional), G = 16 or 32.
//!
//! Work is split over output rows `n` (tiles of `TILE` rows) into up to `threads` parts run by
//! `crate::pool` (workers that spin between the calls of a decode step).
//! Within one weight row, activation rows are processed in blocks of up to 4, so each weight
//! is loaded and converted once per 4 activation rows (decode of a batch reads the weights
//! once, not once per sequence).

use thiserror::Error;

/// Output rows are split between threads in multiples of this.
const TILE: usize = 32;
/// Least work (weights x row blocks) worth handing to another thread: a spinning worker
/// takes a part in about a microsecond, a 256K-weight part runs ~25 us.
const WEIGHTS_PER_THREAD: usize = 1 << 18;
/// Activation rows processed together against one converted weight vector.
const ROW_BLOCK: usize = 4;

#[derive(Debug, Error, PartialEq, Eq)]
pub enum KernelError {
    #[error("shape mismatch: {0}")]
    Shape(String),
    /// A block table lacks a block that a query's keys live in.
    #[error("{0}")]
    Uncovered(String),
}

/// A borrowed `[n, k]` block-quantized matrix.
#[derive(Clone, Copy)]
pub struct QMatrix<'a> {
    pub qs: &'a [i8],
    pub scale: &'a [f32],
    pub mins: Option<&'a [f32]>,
    pub n: usize,
    pub k: usize,
    pub group: usize,
}

impl QMatrix<'_> {
    fn check(&self) -> Result<(), KernelError> {
        let bad = |m: String| Err(KernelError::Shape(m));
        if self.group != 16 && self.group != 32 {
            return bad(format!("group must be 16 or 32, got {}", self.group));
        }
        if self.k == 0 || !self.k.is_multiple_of(self.group) {
            return bad(format!(
                "k = {} is not a multiple of the group {}",
                self.k, self.group
            ));
        }
        if self.qs.len() != self.n * self.k {
            return bad(format!(
                "qs has {} values, expected {} x {}",
                self.qs.len(),
                self.n,
                self.k
            ));
        }
        let ng = self.n * (self.k / self.group);
        if self.scale.len() != ng {
            return bad(format!(
                "scale has {} values, expected {ng}",
                self.scale.len()
            ));
        }
        if let Some(m) = self.mins {
            if m.len() != ng {
                return bad(format!("mins has {} values, expected {ng}", m.len()));
            }
        }
        Ok(())
    }
}

/// The matrix itself and the sizes of `x` (`[m, w.k]`) and `out` (`[m, w.n]`).
fn check_sizes(x: &[f32], m: usize, w: &QMatrix<'_>, out: &[f32]) -> Result<(), KernelError> {
    w.check()?;
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

/// Raw output pointer shared by the tasks; each writes a disjoint set of columns.
#[derive(Clone, Copy)]
struct OutPtr(*mut f32);
// SAFETY: tasks write disjoint elements (distinct columns n) of one live buffer.
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

/// `out = x @ w.T` for `x` f32 `[m, w.k]` (row-major) into `out` f32 `[m, w.n]`, on up to
/// `threads` threads (1: on the calling thread only).
pub fn qmatmul_t(
    x: &[f32],
    m: usize,
    w: &QMatrix<'_>,
    out: &mut [f32],
    threads: usize,
) -> Result<(), KernelError> {
    check_sizes(x, m, w, out)?;
    if m == 0 || w.n == 0 {
        return Ok(());
    }
    let ptr = OutPtr(out.as_mut_ptr());
    let n_tiles = w.n.div_ceil(TILE);
    // waking a pool thread costs about what converting ~2M weights does
    let work = w.n * w.k * m.div_ceil(ROW_BLOCK);
    let parts = threads
        .min(crate::pool::max_parts())
        .min(n_tiles)
        .min(work / WEIGHTS_PER_THREAD)
        .max(1);
    let per = n_tiles.div_ceil(parts) * TILE;
    crate::pool::run(parts, &|t| {
        let (lo, hi) = (t * per, ((t + 1) * per).min(w.n));
        if lo < hi {
            // SAFETY: x/w were checked above; rows [lo, hi) of w and columns [lo, hi) of
            // out belong to this part alone.
            unsafe { rows_range(x, m, w, ptr, lo, hi) }
        }
    });
    Ok(())
}

/// Columns `[lo, hi)` of the output.
unsafe fn rows_range(x: &[f32], m: usize, w: &QMatrix<'_>, out: OutPtr, lo: usize, hi: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
            return unsafe { avx2::rows_range(x, m, w, out, lo, hi) };
        }
    }
    unsafe { portable_rows_range(x, m, w, out, lo, hi) }
}

/// The reference implementation (and the path on CPUs without AVX2/FMA).
unsafe fn portable_rows_range(
    x: &[f32],
    m: usize,
    w: &QMatrix<'_>,
    out: OutPtr,
    lo: usize,
    hi: usize,
) {
    let (k, g) = (w.k, w.group);
    let ng = k / g;
    let mut row = vec![0f32; k];
    for n in lo..hi {
        for gi in 0..ng {
            let s = w.scale[n * ng + gi];
            let mn = w.mins.map_or(0.0, |mm| mm[n * ng + gi]);
            for j in 0..g {
                row[gi * g + j] = w.qs[n * k + gi * g + j] as f32 * s - mn;
            }
        }
        for r in 0..m {
            let xr = &x[r * k..(r + 1) * k];
            let mut lanes = [0f32; 8];
            for (c, (a, b)) in row.iter().zip(xr).enumerate() {
                lanes[c % 8] += a * b;
            }
            // SAFETY: r < m, n < w.n: inside the [m, w.n] buffer the caller owns.
            unsafe { *out.0.add(r * w.n + n) = lanes.iter().sum() };
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::{OutPtr, QMatrix, ROW_BLOCK};
    use crate::x86::hsum;
    use std::arch::x86_64::*;

    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn rows_range(
        x: &[f32],
        m: usize,
        w: &QMatrix<'_>,
        out: OutPtr,
        lo: usize,
        hi: usize,
    ) {
        for n in lo..hi {
            let mut r = 0;
            while r < m {
                let rows = (m - r).min(ROW_BLOCK);
                unsafe {
                    match rows {
                        4 => one_row::<4>(x, r, w, n, out),
                        3 => one_row::<3>(x, r, w, n, out),
                        2 => one_row::<2>(x, r, w, n, out),
                        _ => one_row::<1>(x, r, w, n, out),
                    }
                }
                r += rows;
            }
        }
    }

    /// Activation rows `[r0, r0 + R)` times weight row `n`. Two accumulators per activation
    /// row hide the FMA latency when R is small.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    unsafe fn one_row<const R: usize>(
        x: &[f32],
        r0: usize,
        w: &QMatrix<'_>,
        n: usize,
        out: OutPtr,
    ) {
        let (k, g) = (w.k, w.group);
        let ng = k / g;
        let q = unsafe { w.qs.as_ptr().add(n * k) };
        let xp = unsafe { x.as_ptr().add(r0 * k) };
        let mut acc0 = [_mm256_setzero_ps(); R];
        let mut acc1 = [_mm256_setzero_ps(); R];
        for gi in 0..ng {
            let s = _mm256_set1_ps(w.scale[n * ng + gi]);
            let base = gi * g;
            // g is 16 or 32: pairs of 8-wide chunks
            let mut c = 0;
            while c < g {
                unsafe {
                    let w0 = dequant8(q.add(base + c), s, w.mins, n * ng + gi);
                    let w1 = dequant8(q.add(base + c + 8), s, w.mins, n * ng + gi);
                    for i in 0..R {
                        let xi = xp.add(i * k + base + c);
                        acc0[i] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xi), acc0[i]);
                        acc1[i] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xi.add(8)), acc1[i]);
                    }
                }
                c += 16;
            }
        }
        for i in 0..R {
            unsafe { *out.0.add((r0 + i) * w.n + n) = hsum(_mm256_add_ps(acc0[i], acc1[i])) };
        }
    }

    /// 8 weights as f32: `q * s - min`.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    unsafe fn dequant8(q: *const i8, s: __m256, mins: Option<&[f32]>, gidx: usize) -> __m256 {
        let qi = unsafe { _mm_loadl_epi64(q as *const __m128i) };
        let wf = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(qi));
        match mins {
            Some(mm) => _mm256_fmsub_ps(wf, s, _mm256_set1_ps(mm[gidx])),
            None => _mm256_mul_ps(wf, s),
        }
    }
}

/// The portable path, for tests comparing it with the SIMD one.
pub fn qmatmul_t_portable(
    x: &[f32],
    m: usize,
    w: &QMatrix<'_>,
    out: &mut [f32],
) -> Result<(), KernelError> {
    check_sizes(x, m, w, out)?;
    let ptr = OutPtr(out.as_mut_ptr());
    // SAFETY: sizes checked above; one task owns the whole output.
    unsafe { portable_rows_range(x, m, w, ptr, 0, w.n) };
    Ok(())
}
