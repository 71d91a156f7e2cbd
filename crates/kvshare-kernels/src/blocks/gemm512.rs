//! AVX-512 products of many activation rows (prefill chunks) with block weights: each thread
//! dequantizes a panel of `NR` weight rows into an L1/L2-sized f32 buffer (the packing copy
//! any GEMM makes, here also the dequantization) and multiplies it with every activation row
//! in a register-tiled micro-kernel. OpenBLAS reached 28-35 G multiply-adds/s per core on
//! these shapes (80-160 token rows per call, k = 640-2048), and its thread-split callers
//! dequantized every weight tile once per thread.
//!
//! Layout. The activations are packed once per call, transposed in blocks of `MR` = 32 rows
//! (`[k][32]`: two vectors per `k`); a weight panel is `NR` dequantized rows interleaved in
//! chunks of 16 values (`[k / 16][NR][16]`, written in place by the dequantization), so the
//! micro-kernel reads every weight at a constant offset from one pointer. Per `k` it loads
//! two activation vectors and broadcasts each of the `NR` weights into two FMAs: 24
//! accumulators, 24 FMAs per 14 loads.
//!
//! Blocking. A thread takes its panels in groups of `GROUP` and `k` in chunks of `KCH`: for
//! each chunk it dequantizes the group's slices (L2), then passes every block of activations
//! (its chunk slice in L1) over all of them, keeping one tile per (panel, block) until the
//! last chunk. Without it each panel streamed all the packed activations from L3.
//!
//! Summation order. Every output sums `fma(x[m, k], w[n, k], acc)` over each span of
//! `SPAN` values of k in order from zero, and adds the spans in order, so a row's result
//! does not depend on the batch, on where it falls in a block of 32 (pad rows are zeros and
//! are not stored), on the thread split or on the panel.

#![allow(clippy::needless_range_loop)]

use super::{BlockMatrix, OutPtr};
use crate::aligned::AlignedF32;
use std::arch::x86_64::*;

/// Activation rows per micro-kernel call (two 16-lane vectors).
const MR: usize = 32;
/// Weight rows per panel (24 accumulators of the 32 registers).
const NR: usize = 12;
/// Values of one weight row per interleaved chunk.
const KC: usize = 16;
/// Values of k summed in registers before being added to the tile (a multiple of KC).
const SPAN: usize = 64;
/// Panels multiplied together per chunk of k: every block of activations is read once per
/// group of panels instead of once per panel.
const GROUP: usize = 16;
/// Values of k per chunk (a multiple of SPAN and of every block size, and at most a
/// dequantization's stack buffer): a block's activations for one chunk, 256 x 32 f32 = 32
/// KiB, stay in L1 while the group's panels pass them (the panels' slices, 16 x 12 KiB, in
/// L2). Chunks of 1024 / 512 / 256 ran a 256 x 2048 x 6144 Q4_K product at 43-44 / 43 /
/// 49-57 G multiply-adds/s on one core (alternating runs; 45-52 before the chunks).
pub(super) const KCH: usize = 256;

/// Whether the CPU runs this GEMM (AVX-512F; the dequantization brings its own checks).
pub(super) fn available() -> bool {
    std::is_x86_feature_detected!("avx512f")
}

/// `f(bytes, n, dst, stride)` writes the `n` values of the whole blocks `bytes` as f32, with
/// ggml's arithmetic, values `16 * c..16 * c + 16` at `dst[c * stride..]` (a panel's layout);
/// it panics if `dst` is too short for them.
pub(super) type Dequantize<'a> = &'a (dyn Fn(&[u8], usize, &mut [f32], usize) + Sync);

/// `out[r, col0 + j] = sum_k x[r, k] * dequantize(w)[j, k]` for every row `r < m` and weight
/// row `j < w.n`; `out` has `ld` columns. Sizes checked by the caller (`x` holds `m * w.k`,
/// `out` `m * ld`, `col0 + w.n <= ld`); `available()`.
#[allow(clippy::too_many_arguments)]
pub(super) fn gemm(
    x: &[f32],
    m: usize,
    w: &BlockMatrix<'_>,
    out: &mut [f32],
    ld: usize,
    col0: usize,
    threads: usize,
    dequantize: Dequantize<'_>,
) {
    let k = w.k;
    let blocks = m.div_ceil(MR);
    // the activations, transposed in blocks of MR rows; rows past m stay zero
    let mut xp = AlignedF32::zeros(blocks * MR * k);
    {
        let xs = &mut xp[..];
        for r in 0..m {
            let (b, i) = (r / MR, r % MR);
            let dst = &mut xs[b * MR * k..(b + 1) * MR * k];
            for (kk, &v) in x[r * k..(r + 1) * k].iter().enumerate() {
                dst[kk * MR + i] = v;
            }
        }
    }
    // the packed activations are only read while the parts run
    let xp_ptr = OutPtr(xp.as_mut_ptr());
    let out_ptr = OutPtr(out.as_mut_ptr());
    let panels = w.n.div_ceil(NR);
    let parts = threads
        .min(crate::pool::max_parts())
        .min(panels)
        // a part below ~2M multiply-adds costs more to hand off than it saves
        .min((m * w.n * k / (1 << 21)).max(1))
        .max(1);
    let per = panels.div_ceil(parts);
    let rb = w.row_bytes();
    let (bs, bb) = (w.ty.block_size(), w.ty.block_bytes());
    let (n_all, raw) = (w.n, w.raw);
    let tile_len = MR * NR;
    crate::pool::run(parts, &|t| {
        let (first, end) = (t * per, ((t + 1) * per).min(panels));
        let mut panel = AlignedF32::zeros(GROUP * NR * KCH);
        let mut tiles = vec![0f32; GROUP * blocks * tile_len];
        let mut g0 = first;
        while g0 < end {
            let g1 = (g0 + GROUP).min(end);
            tiles.fill(0.0);
            // k in chunks: the chunk's slices of the group's panels stay in L2 while every
            // block of activations passes them, and each block's slice is read from L3 once
            // per group, not once per panel
            let mut k0 = 0;
            while k0 < k {
                let k1 = (k0 + KCH).min(k);
                let kl = k1 - k0;
                for (g, p) in (g0..g1).enumerate() {
                    let n0 = p * NR;
                    let rows = NR.min(n_all - n0);
                    for j in 0..NR {
                        // row j of panel g, chunk c at (c * NR + j) * KC
                        let dst = &mut panel[g * NR * KCH + j * KC..];
                        if j < rows {
                            let at = (n0 + j) * rb;
                            let bytes = &raw[at + k0 / bs * bb..at + k1 / bs * bb];
                            dequantize(bytes, kl, dst, NR * KC);
                        } else {
                            for c in 0..kl / KC {
                                dst[c * NR * KC..][..KC].fill(0.0);
                            }
                        }
                    }
                }
                let pp = panel.as_ptr();
                for b in 0..blocks {
                    let live = MR.min(m - b * MR);
                    let xb = xp_ptr.at(b * MR * k + k0 * MR);
                    for g in 0..g1 - g0 {
                        let tile = &mut tiles[(g * blocks + b) * tile_len..][..tile_len];
                        // SAFETY: the packed block holds k values per row from k0, the
                        // panel kl; features checked by the caller (available())
                        unsafe {
                            let wp = pp.add(g * NR * KCH);
                            if live > 16 {
                                micro::<2>(xb, wp, kl, tile)
                            } else {
                                micro::<1>(xb, wp, kl, tile)
                            }
                        };
                    }
                }
                k0 = k1;
            }
            for (g, p) in (g0..g1).enumerate() {
                let n0 = p * NR;
                let rows = NR.min(n_all - n0);
                for b in 0..blocks {
                    let tile = &tiles[(g * blocks + b) * tile_len..][..tile_len];
                    for i in 0..MR.min(m - b * MR) {
                        // SAFETY: row b * MR + i < m, columns col0 + n0 .. + rows <= col0 +
                        // w.n <= ld; each panel's columns belong to one part
                        let o = out_ptr.at((b * MR + i) * ld + col0 + n0);
                        for j in 0..rows {
                            unsafe { *o.add(j) = tile[j * MR + i] };
                        }
                    }
                }
            }
            g0 = g1;
        }
    });
}

/// One block of MR packed activation rows (`xp`, `[k][MR]`; the first `16 * H` used) times
/// one panel (`wp`, `[k / KC][NR][KC]`) into `tile` (`[NR][MR]`).
#[target_feature(enable = "avx512f")]
unsafe fn micro<const H: usize>(xp: *const f32, wp: *const f32, k: usize, tile: &mut [f32]) {
    debug_assert!(tile.len() >= MR * NR);
    // registers sum SPAN values of k, then the tile adds the span's sum: one chain over all of
    // k erred 2e-8 of sum |x w| on average, against OpenBLAS's 1.0-1.5e-8; spans of 64 err
    // 4.9-7.6e-9 (k = 2048 / 640)
    let mut c0 = 0;
    while c0 < k / KC {
        let c1 = (c0 + SPAN / KC).min(k / KC);
        let mut acc = [[_mm512_setzero_ps(); H]; NR];
        for c in c0..c1 {
            let w = unsafe { wp.add(c * NR * KC) };
            let x = unsafe { xp.add(c * KC * MR) };
            for i in 0..KC {
                // SAFETY: k index c * KC + i < k of the packed block and panel
                let xv: [__m512; H] =
                    std::array::from_fn(|h| unsafe { _mm512_load_ps(x.add(i * MR + 16 * h)) });
                for j in 0..NR {
                    let b = _mm512_set1_ps(unsafe { *w.add(j * KC + i) });
                    for h in 0..H {
                        acc[j][h] = _mm512_fmadd_ps(xv[h], b, acc[j][h]);
                    }
                }
            }
        }
        for j in 0..NR {
            for h in 0..H {
                // SAFETY: tile holds NR * MR values
                unsafe {
                    let t = tile.as_mut_ptr().add(j * MR + 16 * h);
                    _mm512_storeu_ps(t, _mm512_add_ps(_mm512_loadu_ps(t), acc[j][h]));
                }
            }
        }
        c0 = c1;
    }
}
