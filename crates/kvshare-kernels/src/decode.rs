//! One attention + MLP decoder layer of a decode step in one call (the CPU's few-row steps).
//!
//! A decode step of a small model spends a sixth of its time between kernels: Gemma 3 270M's
//! 18 layers made ~14 Python calls each (norms, the fused products, rope, the KV write,
//! attention, the GLU, residual adds), ~15 us apiece. `decode_layer` runs the same
//! operations in order over the same kernels (`blocks::block_matmul_t_vnni`,
//! `attention::paged_attention_invariant`, `rowops::glu_in_place`) and the same float
//! formulas as the Python ops it replaces (`rms_norm_rows` is `ops.norm`'s Numba loop, `rope`
//! `ops.rope`'s), so a row's result is the same bits either way, and prefix sharing (which
//! moves rows between decode steps and prefill chunks) still changes nothing.

use crate::attention::{paged_attention, paged_attention_invariant, KvElem, PagedKv, Queries, F16};
use crate::blocks::{block_matmul_t_vnni, BlockMatrix};
use crate::rowops::{glu_in_place, Glu};
use crate::KernelError;

/// A layer's weights (an empty slice: the model has no such tensor).
pub struct LayerWeights<'a> {
    pub attn_norm: &'a [f32],
    /// Q, K and V stacked, `[(n_head + 2 n_kv) head_dim, n_embd]`, in parts
    pub wqkv: &'a [BlockMatrix<'a>],
    pub bqkv: &'a [f32],
    /// `[head_dim]` per-head norms of q and k (qwen3, gemma3)
    pub q_norm: &'a [f32],
    pub k_norm: &'a [f32],
    pub wo: &'a [BlockMatrix<'a>],
    /// Gemma's norm of the attention output before the residual add
    pub post_attn_norm: &'a [f32],
    pub ffn_norm: &'a [f32],
    /// gate then up, `[2 n_ff, n_embd]`
    pub w_gate_up: &'a [BlockMatrix<'a>],
    pub w_down: &'a [BlockMatrix<'a>],
    pub post_ffn_norm: &'a [f32],
}

/// The layer's sizes and formulas.
#[derive(Clone, Copy)]
pub struct LayerShape {
    pub n_head: usize,
    pub n_kv: usize,
    pub head_dim: usize,
    pub eps: f32,
    /// rope pairs `(i, i + n_rot / 2)` (NEOX), else `(2i, 2i + 1)`
    pub neox: bool,
    pub glu: Glu,
    /// sliding window (0: full causal attention)
    pub window: usize,
    /// multiplier of q.k
    pub scale: f32,
}

/// What the step's rows are: `n` rows of the residual stream, their rope angles (`cos`,
/// `sin`: `[n, n_rot / 2]`), the KV rows they store into (`slots`), and the attention's view
/// of them (`queries.q` is unused: the layer computes q).
pub struct StepRows<'a> {
    pub n: usize,
    pub cos: &'a [f32],
    pub sin: &'a [f32],
    pub slots: &'a [i64],
    pub queries: Queries<'a>,
}

/// A KV pool element the layer can store (f32, or f16 rounded to nearest even as NumPy's
/// `astype(float16)` does).
pub trait KvStore: KvElem {
    fn store(x: f32) -> Self;
    /// `store` of each value of `src` into `dst` (of one length).
    fn store_row(src: &[f32], dst: &mut [Self]) {
        store_each(src, dst);
    }
}

/// `T::store` of each value of `src` into `dst`, one at a time.
fn store_each<T: KvStore>(src: &[f32], dst: &mut [T]) {
    dst.iter_mut().zip(src).for_each(|(c, &a)| *c = T::store(a));
}

impl KvStore for f32 {
    fn store(x: f32) -> Self {
        x
    }
}

impl KvStore for F16 {
    fn store(x: f32) -> Self {
        F16::from_f32(x)
    }

    /// F16C's `vcvtps2ph` (round to nearest even, as `from_f32`) 8 values at a time where
    /// the CPU has it. `from_f32`'s branches per value took 16 us of a 1.9B decode layer's
    /// 2,048 K/V values (timers in the layer, 22 -> 6 us for norms, rope and the store).
    fn store_row(src: &[f32], dst: &mut [Self]) {
        #[cfg(target_arch = "x86_64")]
        if crate::x86::avx2_fma() {
            // SAFETY: F16C checked; F16 is a transparent u16
            unsafe { f16c_row(src, dst) };
            return;
        }
        store_each(src, dst);
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx,f16c")]
unsafe fn f16c_row(src: &[f32], dst: &mut [F16]) {
    use std::arch::x86_64::*;
    let n = src.len().min(dst.len());
    let mut i = 0;
    while i + 8 <= n {
        // SAFETY: i + 8 <= n values on both sides
        unsafe {
            let h =
                _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(_mm256_loadu_ps(src.as_ptr().add(i)));
            _mm_storeu_si128(dst.as_mut_ptr().add(i) as *mut __m128i, h);
        }
        i += 8;
    }
    for j in i..n {
        dst[j] = F16::from_f32(src[j]);
    }
}

/// The layer over `rows.n` rows of `x` (`[n, n_embd]`, updated in place), storing their K
/// and V into the pool (`k_cache`, `v_cache`: `[n_blocks, block_size, n_kv, head_dim]`)
/// and attending with `max_rows` and `invariant` as `paged_attention` does.
#[allow(clippy::too_many_arguments)]
pub fn decode_layer<T: KvStore>(
    w: &LayerWeights<'_>,
    s: &LayerShape,
    x: &mut [f32],
    rows: &StepRows<'_>,
    k_cache: &mut [T],
    v_cache: &mut [T],
    block_size: usize,
    max_rows: usize,
    invariant: bool,
    threads: usize,
) -> Result<(), KernelError> {
    let (n, hd) = (rows.n, s.head_dim);
    let shape = |m: String| Err(KernelError::Shape(m));
    if n == 0 || !x.len().is_multiple_of(n) {
        return shape(format!("{} values are not {n} rows", x.len()));
    }
    let d = x.len() / n;
    let (qd, kd) = (s.n_head * hd, s.n_kv * hd);
    let half = rows.cos.len() / n;
    if rows.cos.len() != n * half || rows.sin.len() != n * half || 2 * half > hd {
        return shape("cos and sin must be [n, n_rot / 2] with n_rot <= head_dim".into());
    }
    if rows.slots.len() != n || rows.queries.q_starts.last().copied() != Some(n as i64) {
        return shape("slots and q_starts must cover the n rows".into());
    }
    let row_kv = s.n_kv * hd / T::VALS;
    if block_size == 0
        || row_kv == 0
        || k_cache.len() != v_cache.len()
        || !k_cache.len().is_multiple_of(block_size * row_kv)
    {
        return shape("k_cache and v_cache must be [n_blocks, block_size, n_kv, head_dim]".into());
    }
    let pool_rows = k_cache.len() / row_kv;
    if rows.slots.iter().any(|&p| p < 0 || p as usize >= pool_rows) {
        return shape("a slot is outside the pool".into());
    }
    let width = |ws: &[BlockMatrix<'_>]| ws.iter().map(|m| m.n).sum::<usize>();
    if width(w.wqkv) != qd + 2 * kd || (!w.bqkv.is_empty() && w.bqkv.len() != qd + 2 * kd) {
        return shape("wqkv (and bqkv) must have (n_head + 2 n_kv) head_dim rows".into());
    }
    for norm in [w.q_norm, w.k_norm] {
        if !norm.is_empty() && norm.len() != hd {
            return shape("q_norm and k_norm must have head_dim values".into());
        }
    }

    // attention block: norm, Q/K/V, per-head norms and rope, the KV store, attention
    let mut h = vec![0f32; n * d];
    rms_norm_rows(x, &mut h, d, w.attn_norm, s.eps)?;
    let mut qkv = vec![0f32; n * (qd + 2 * kd)];
    block_matmul_t_vnni(&h, n, w.wqkv, &mut qkv, threads)?;
    if !w.bqkv.is_empty() {
        for r in qkv.chunks_exact_mut(qd + 2 * kd) {
            r.iter_mut().zip(w.bqkv).for_each(|(a, b)| *a += b);
        }
    }
    let mut q = vec![0f32; n * qd];
    for (i, r) in qkv.chunks_exact_mut(qd + 2 * kd).enumerate() {
        let (cos, sin) = (&rows.cos[i * half..][..half], &rows.sin[i * half..][..half]);
        let (qr, kv) = r.split_at_mut(qd);
        for (heads, norm) in [(&mut *qr, w.q_norm), (&mut kv[..kd], w.k_norm)] {
            if !norm.is_empty() {
                norm_rows_in_place(heads, hd, norm, s.eps);
            }
            for head in heads.chunks_exact_mut(hd) {
                rope(head, cos, sin, s.neox);
            }
        }
        q[i * qd..][..qd].copy_from_slice(qr);
        let slot = rows.slots[i] as usize;
        let (k, v) = kv.split_at(kd);
        let (kc, vc) = (
            &mut k_cache[slot * row_kv..][..row_kv],
            &mut v_cache[slot * row_kv..][..row_kv],
        );
        T::store_row(k, kc);
        T::store_row(v, vc);
    }
    let kv = PagedKv {
        k: &*k_cache,
        v: &*v_cache,
        n_blocks: pool_rows / block_size,
        block_size,
        n_kv: s.n_kv,
        head_dim: hd,
    };
    let queries = Queries {
        q: &q,
        ..rows.queries
    };
    let mut attn = vec![0f32; n * qd];
    if invariant {
        paged_attention_invariant(
            &kv, &queries, s.scale, s.window, max_rows, &mut attn, threads,
        )?;
    } else {
        paged_attention(
            &kv, &queries, s.scale, s.window, max_rows, &mut attn, threads,
        )?;
    }
    let mut o = vec![0f32; n * d];
    block_matmul_t_vnni(&attn, n, w.wo, &mut o, threads)?;
    if !w.post_attn_norm.is_empty() {
        norm_rows_in_place(&mut o, d, w.post_attn_norm, s.eps);
    }
    x.iter_mut().zip(&o).for_each(|(a, b)| *a += b);

    // MLP block: norm, gate/up, the GLU, down
    rms_norm_rows(x, &mut h, d, w.ffn_norm, s.eps)?;
    let ff2 = width(w.w_gate_up);
    let mut gu = vec![0f32; n * ff2];
    block_matmul_t_vnni(&h, n, w.w_gate_up, &mut gu, threads)?;
    glu_in_place(&mut gu, ff2 / 2, s.glu)?;
    // the GLU's rows side by side (one row: already so)
    let ff = ff2 / 2;
    let a = if n == 1 {
        gu.truncate(ff);
        gu
    } else {
        let mut a = vec![0f32; n * ff];
        for (dst, src) in a.chunks_exact_mut(ff).zip(gu.chunks_exact(ff2)) {
            dst.copy_from_slice(&src[..ff]);
        }
        a
    };
    block_matmul_t_vnni(&a, n, w.w_down, &mut o, threads)?;
    if !w.post_ffn_norm.is_empty() {
        norm_rows_in_place(&mut o, d, w.post_ffn_norm, s.eps);
    }
    x.iter_mut().zip(&o).for_each(|(a, b)| *a += b);
    Ok(())
}

/// `out = rms_norm(x) * w` row by row (rows of `d`; `w` empty: no weight), `ops.norm`'s Numba
/// loop exactly: the squares summed in f64 in order, the scale `f32(1 / f64(sqrt(f32(mean) +
/// eps)))`, then `(x * scale) * w` in f32.
fn rms_norm_rows(
    x: &[f32],
    out: &mut [f32],
    d: usize,
    w: &[f32],
    eps: f32,
) -> Result<(), KernelError> {
    if d == 0
        || x.len() != out.len()
        || !x.len().is_multiple_of(d)
        || (!w.is_empty() && w.len() != d)
    {
        return Err(KernelError::Shape(format!(
            "norm of {} values in rows of {d}",
            x.len()
        )));
    }
    out.copy_from_slice(x);
    norm_rows_in_place(out, d, w, eps);
    Ok(())
}

/// Rows that `norm_rows_in_place` sums side by side.
const NORM_ROWS: usize = 8;

/// `rms_norm_rows` in place on the rows of `x` (rows of `d`). Each row's squares are summed
/// in f64 in order, one dependent add after another (the Numba loop's order, so the same
/// bits); up to `NORM_ROWS` rows' chains run side by side, since one chain waits on the add
/// latency (a batch of 8 rows' norms, the layer's per-head norms).
fn norm_rows_in_place(x: &mut [f32], d: usize, w: &[f32], eps: f32) {
    for group in x.chunks_mut(NORM_ROWS * d) {
        let sums = match group.len() / d {
            1 => sums_of_squares::<1>(group, d),
            2 => sums_of_squares::<2>(group, d),
            3 => sums_of_squares::<3>(group, d),
            4 => sums_of_squares::<4>(group, d),
            5 => sums_of_squares::<5>(group, d),
            6 => sums_of_squares::<6>(group, d),
            7 => sums_of_squares::<7>(group, d),
            _ => sums_of_squares::<8>(group, d),
        };
        for (row, acc) in group.chunks_exact_mut(d).zip(sums) {
            let r = (1.0f64 / ((((acc / d as f64) as f32) + eps).sqrt()) as f64) as f32;
            if w.is_empty() {
                row.iter_mut().for_each(|v| *v *= r);
            } else {
                row.iter_mut().zip(w).for_each(|(v, &g)| *v = (*v * r) * g);
            }
        }
    }
}

/// The f64 sums of squares of the first `M` rows of `x` (rows of `d`), each in order; the
/// rest of `NORM_ROWS` zeros.
fn sums_of_squares<const M: usize>(x: &[f32], d: usize) -> [f64; NORM_ROWS] {
    let rows: [&[f32]; M] = std::array::from_fn(|i| &x[i * d..(i + 1) * d]);
    let mut acc = [0f64; M];
    for j in 0..d {
        for (a, row) in acc.iter_mut().zip(&rows) {
            let v = row[j] as f64;
            *a += v * v;
        }
    }
    let mut out = [0f64; NORM_ROWS];
    out[..M].copy_from_slice(&acc);
    out
}

/// `ops.rope`'s rotation of one head in place: for each pair `(a, b)` (NEOX: `(t, t + half)`,
/// else `(2t, 2t + 1)`), `a c - b s` and `b c + a s`, each product rounded.
fn rope(x: &mut [f32], cos: &[f32], sin: &[f32], neox: bool) {
    let half = cos.len();
    if neox {
        // the same products and sums as below, over slices the compiler vectorizes
        let (lo, hi) = x.split_at_mut(half);
        for ((a, b), (&c, &s)) in lo.iter_mut().zip(&mut hi[..half]).zip(cos.iter().zip(sin)) {
            let (av, bv) = (*a, *b);
            *a = av * c - bv * s;
            *b = bv * c + av * s;
        }
        return;
    }
    for t in 0..half {
        let (ia, ib) = (2 * t, 2 * t + 1);
        let (a, b, c, s) = (x[ia], x[ib], cos[t], sin[t]);
        x[ia] = a * c - b * s;
        x[ib] = b * c + a * s;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The vector store (F16C where the CPU has it) gives every value `from_f32`'s half:
    /// a sweep of the f32 bit patterns (normals, subnormals, halfway cases, infinities and
    /// NaNs among them), in rows whose lengths leave scalar tails.
    #[test]
    fn f16_row_store_is_from_f32() {
        let mut vals: Vec<f32> = (0..=u32::MAX).step_by(4093).map(f32::from_bits).collect();
        // ties to even at the half's last place, both signs, and the overflow edge
        for m in 0..64u32 {
            let t = f32::from_bits(0x3f80_0000 | (m << 13) | 0x1000);
            vals.extend([
                t,
                -t,
                65504.0 + m as f32 * 8.0,
                f32::from_bits(0x3380_0000 + m),
            ]);
        }
        for len in [vals.len(), 7, 13] {
            let src = &vals[..len];
            let mut got = vec![F16(0); len];
            F16::store_row(src, &mut got);
            for (i, (&x, h)) in src.iter().zip(&got).enumerate() {
                assert_eq!(
                    h.0,
                    F16::from_f32(x).0,
                    "value {i}: {x:e} ({:#x})",
                    x.to_bits()
                );
            }
        }
    }
}
