//! Mixture-of-experts products: every product of a MoE block for a batch in one call over the
//! stacked expert weights (a whole `ffn_*_exps` tensor in its GGUF block format), with the
//! routing (each token's experts and weights) as input: ggml's `mul_mat_id`.
//!
//! One call per expert and matrix from Python cost a hand-off each (8 active experts x 3
//! matrices x every layer of a decode step), and one expert's product (768 rows of
//! Qwen3-30B-A3B) is too small to split well over the threads. Here the (token, slot) pairs
//! are grouped by expert (a counting sort, token order kept within an expert), each expert's
//! activation rows are gathered once, and the work is cut into units of (expert, part, run of
//! weight rows) of about equal cost that the pool's threads claim, so the cores share the
//! active experts out between them.
//!
//! A unit runs the crate's per-matrix kernels on its expert's rows, on its own thread:
//! - `ExpertActs::F32`: `block_matmul_t_f32` for up to `MAX_ROWS` tokens; above it the
//!   AVX-512 panel GEMM (`block_gemm_f32`) for quantized weights, and the exact kernel
//!   `MAX_ROWS` tokens at a time for float weights or without AVX-512;
//! - `ExpertActs::Q8`: `block_matmul_t` (8-bit activations) for up to `MAX_ROWS` tokens; above
//!   it the values those 8-bit activations stand for (`QActs::round_trip`) through the f32
//!   paths, as the dense `BlockWeight` does;
//! - `ExpertActs::Vnni`: `block_matmul_t_vnni` for any number of tokens.
//!
//! Every output is computed as that kernel computes it for the expert's tokens alone: each
//! output column depends on its weight row only, and a token's row on its own activations, so
//! the result is the one of a product per expert, bit for bit, whatever the thread split. A
//! token's row does not depend on the other tokens of its batch with "vnni", nor with f32
//! activations while its experts have at most `MAX_ROWS` tokens (the GEMM above sums in
//! another order).
//!
//! `moe_gate_up` multiplies the tokens' rows by each routed expert's gate|up rows, adds the
//! expert's biases where it has them (gpt-oss), and applies the gated activation
//! (`rowops::glu_in_place`: SwiGLU, GeGLU or gpt-oss's clamped `swiglu_oai`); `moe_down`
//! multiplies those rows by the experts' down rows (plus their biases), scales each pair's
//! row by its routing weight (an f32 product) and adds a token's slots in slot order, as
//! llama.cpp adds its `ffn_moe_weighted` views. Each bias is added to its product as its own
//! f32 sum, as a product then a bias add computes it.

use crate::blocks::{
    block_gemm_f32, block_matmul_t, block_matmul_t_f32, block_matmul_t_vnni, gemm_available,
    vnni_available, vnni_supports, BlockMatrix, QActs, MAX_ROWS,
};
use crate::rowops::{glu_in_place, Glu};
use crate::KernelError;
use std::sync::Mutex;

/// How the experts' products treat the activations (as `BlockWeight`'s `activations`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExpertActs {
    F32,
    Q8,
    Vnni,
}

/// One matrix of every expert: `parts[p]` is a stacked tensor of `n_expert * n_p` rows (expert
/// `e`'s rows `e * n_p..(e + 1) * n_p`), all with the same `k`; expert `e`'s matrix is its rows
/// of each part stacked in part order (gate then up, or one fused gate|up tensor). `bias`:
/// optionally `[n_expert, rows]` f32, expert `e`'s bias of each row of its matrix.
#[derive(Clone, Copy)]
pub struct Experts<'a> {
    pub parts: &'a [BlockMatrix<'a>],
    pub n_expert: usize,
    pub bias: Option<&'a [f32]>,
}

impl Experts<'_> {
    /// `(k, rows per expert)` after checking the parts.
    fn check(&self) -> Result<(usize, usize), KernelError> {
        let Some(first) = self.parts.first() else {
            return Err(KernelError::Shape("experts need at least one part".into()));
        };
        if self.n_expert == 0 {
            return Err(KernelError::Shape("n_expert must be positive".into()));
        }
        let mut rows = 0;
        for w in self.parts {
            w.check()?;
            if w.k != first.k {
                return Err(KernelError::Shape(
                    "the experts' parts must have the same k".into(),
                ));
            }
            if !w.n.is_multiple_of(self.n_expert) {
                return Err(KernelError::Shape(format!(
                    "a part of {} rows is not {} experts' rows",
                    w.n, self.n_expert
                )));
            }
            rows += w.n / self.n_expert;
        }
        if let Some(b) = self.bias {
            if b.len() != self.n_expert * rows {
                return Err(KernelError::Shape(format!(
                    "bias has {} values, expected {} experts x {rows} rows",
                    b.len(),
                    self.n_expert
                )));
            }
        }
        Ok((first.k, rows))
    }

    /// Rows `lo..hi` of expert `e`'s rows of part `p`.
    fn rows_of(&self, p: usize, e: usize, lo: usize, hi: usize) -> BlockMatrix<'_> {
        let w = &self.parts[p];
        let (n_p, rb) = (w.n / self.n_expert, w.row_bytes());
        let at = (e * n_p + lo) * rb;
        BlockMatrix {
            raw: &w.raw[at..at + (hi - lo) * rb],
            ty: w.ty,
            n: hi - lo,
            k: w.k,
        }
    }
}

/// Whether `acts` can multiply every part of `w` here.
pub fn experts_supported(w: &Experts<'_>, acts: ExpertActs) -> bool {
    match acts {
        ExpertActs::Vnni => vnni_available() && w.parts.iter().all(|p| vnni_supports(p.ty)),
        _ => true,
    }
}

/// The (token, slot) pairs `t * slots + j` sorted by expert (token order kept within one):
/// expert `e`'s pairs are `order[offsets[e]..offsets[e + 1]]`.
struct Groups {
    order: Vec<usize>,
    offsets: Vec<usize>,
}

fn group(ids: &[i64], n_expert: usize) -> Result<Groups, KernelError> {
    let mut offsets = vec![0usize; n_expert + 1];
    for &e in ids {
        if e < 0 || e as usize >= n_expert {
            return Err(KernelError::Shape(format!(
                "expert id {e} outside 0..{n_expert}"
            )));
        }
        offsets[e as usize + 1] += 1;
    }
    for e in 0..n_expert {
        offsets[e + 1] += offsets[e];
    }
    let mut next = offsets.clone();
    let mut order = vec![0usize; ids.len()];
    for (pair, &e) in ids.iter().enumerate() {
        order[next[e as usize]] = pair;
        next[e as usize] += 1;
    }
    Ok(Groups { order, offsets })
}

/// A raw pointer the units share; each writes disjoint elements of one live buffer.
#[derive(Clone, Copy)]
struct SharedPtr(*mut f32);
// SAFETY: writers touch disjoint elements (checked by construction at each use).
unsafe impl Send for SharedPtr {}
unsafe impl Sync for SharedPtr {}

impl SharedPtr {
    fn at(self, i: usize) -> *mut f32 {
        self.0.wrapping_add(i)
    }
}

/// Weight rows per unit are a multiple of this (the kernels' row tiles).
const UNIT_ROWS: usize = 32;
/// Units per thread: enough that a thread the OS has descheduled holds up little of a call.
const UNITS_PER_THREAD: usize = 4;
/// A unit below this cost (weight bytes read plus activation values per weight row) costs
/// more to hand over than it saves.
const MIN_UNIT_COST: usize = 1 << 16;

/// `out` (`[m, w.n]`) = `x` (`[m, w.k]`) times the rows of `w`, on this thread (see the module
/// docs for which kernel runs).
fn product(
    x: &[f32],
    m: usize,
    w: &BlockMatrix<'_>,
    acts: ExpertActs,
    out: &mut [f32],
) -> Result<(), KernelError> {
    if acts == ExpertActs::Vnni {
        return block_matmul_t_vnni(x, m, std::slice::from_ref(w), out, 1);
    }
    if m <= MAX_ROWS {
        return match acts {
            ExpertActs::Q8 => block_matmul_t(x, m, w, out, 1),
            _ => block_matmul_t_f32(x, m, w, out, 1),
        };
    }
    let rounded;
    let x = if acts == ExpertActs::Q8 && !w.ty.is_float() {
        let mut r = x.to_vec();
        QActs::round_trip(&mut r, w.k);
        rounded = r;
        &rounded[..]
    } else {
        x
    };
    if !w.ty.is_float() && gemm_available() {
        return block_gemm_f32(x, m, w, out, w.n, 0, 1);
    }
    for r in (0..m).step_by(MAX_ROWS) {
        let rows = (m - r).min(MAX_ROWS);
        block_matmul_t_f32(
            &x[r * w.k..(r + rows) * w.k],
            rows,
            w,
            &mut out[r * w.n..(r + rows) * w.n],
            1,
        )?;
    }
    Ok(())
}

/// `y[i]` (`[pairs, cols]`, sorted order) = `xin[src(order[i])]` (rows of `k`) times the
/// matrix of the expert of `order[i]`, on up to `threads` threads.
fn grouped(
    xin: &[f32],
    k: usize,
    src: &(dyn Fn(usize) -> usize + Sync),
    g: &Groups,
    w: &Experts<'_>,
    acts: ExpertActs,
    threads: usize,
) -> Result<Vec<f32>, KernelError> {
    let pairs = g.order.len();
    let cols: usize = w.parts.iter().map(|p| p.n / w.n_expert).sum();
    let mut xs = vec![0f32; pairs * k];
    for (i, &pair) in g.order.iter().enumerate() {
        let r = src(pair);
        xs[i * k..(i + 1) * k].copy_from_slice(&xin[r * k..(r + 1) * k]);
    }
    // the units: (expert, part, first row, end row, first column)
    let cost = |e: usize, p: usize, rows: usize| {
        let m = g.offsets[e + 1] - g.offsets[e];
        rows * (w.parts[p].row_bytes() + m * k)
    };
    let n_expert = w.n_expert;
    let mut total = 0;
    for e in 0..n_expert {
        for p in 0..w.parts.len() {
            if g.offsets[e + 1] > g.offsets[e] {
                total += cost(e, p, w.parts[p].n / n_expert);
            }
        }
    }
    // work below one unit's worth per thread stays on fewer threads: a hand-off to a worker
    // costs more than it saves (tiny-gpt-oss's layer, one token: ~130 us alone, ~280 us on
    // two threads of a busy 2-core machine)
    let threads = threads
        .min(total.div_ceil(MIN_UNIT_COST))
        .clamp(1, crate::pool::max_parts());
    let target = (total / (threads * UNITS_PER_THREAD)).max(MIN_UNIT_COST);
    let mut units = Vec::new();
    for e in 0..n_expert {
        if g.offsets[e + 1] == g.offsets[e] {
            continue;
        }
        let mut col = 0;
        for p in 0..w.parts.len() {
            let n_p = w.parts[p].n / n_expert;
            let pieces = cost(e, p, n_p).div_ceil(target).max(1);
            let step = n_p.div_ceil(pieces).next_multiple_of(UNIT_ROWS);
            for lo in (0..n_p).step_by(step.max(1)) {
                units.push((e, p, lo, (lo + step).min(n_p), col + lo));
            }
            col += n_p;
        }
    }
    let mut y = vec![0f32; pairs * cols];
    let yp = SharedPtr(y.as_mut_ptr());
    let failed: Mutex<Option<KernelError>> = Mutex::new(None);
    crate::pool::run_on(threads, units.len(), &|u| {
        let (e, p, lo, hi, col) = units[u];
        let (a, b) = (g.offsets[e], g.offsets[e + 1]);
        let m = b - a;
        let n = hi - lo;
        let mut tmp = vec![0f32; m * n];
        let sub = w.rows_of(p, e, lo, hi);
        if let Err(err) = product(&xs[a * k..b * k], m, &sub, acts, &mut tmp) {
            *failed.lock().unwrap_or_else(|x| x.into_inner()) = Some(err);
            return;
        }
        let bias = w.bias.map(|b| &b[e * cols + col..e * cols + col + n]);
        for i in 0..m {
            // SAFETY: rows a..b are expert e's, columns col..col + n this unit's alone; all
            // inside y's [pairs, cols]
            let dst = unsafe { std::slice::from_raw_parts_mut(yp.at((a + i) * cols + col), n) };
            let src = &tmp[i * n..(i + 1) * n];
            match bias {
                Some(b) => {
                    for ((d, &v), &bv) in dst.iter_mut().zip(src).zip(b) {
                        *d = v + bv;
                    }
                }
                None => dst.copy_from_slice(src),
            }
        }
    });
    if let Some(err) = failed.into_inner().unwrap_or_else(|x| x.into_inner()) {
        return Err(err);
    }
    Ok(y)
}

/// Rows per part of the elementwise passes after the products.
const PASS_ROWS: usize = 64;

fn check_routing(ids: &[i64], n_tok: usize, slots: usize) -> Result<(), KernelError> {
    if slots == 0 || ids.len() != n_tok * slots {
        return Err(KernelError::Shape(format!(
            "ids has {} values, expected {n_tok} tokens x {slots} slots (slots > 0)",
            ids.len()
        )));
    }
    Ok(())
}

/// For tokens `x` (`[n_tok, k]`) routed to experts `ids` (`[n_tok, slots]`, row-major), row
/// `t * slots + j` of `out` is `x[t]` times expert `ids[t, j]`'s rows of `w`; with `glu`, the
/// gated activation of those `2 * ff` values (gate first, then up), so `out` is
/// `[n_tok * slots, ff]`, else `[n_tok * slots, rows]`.
#[allow(clippy::too_many_arguments)]
pub fn moe_gate_up(
    x: &[f32],
    n_tok: usize,
    ids: &[i64],
    slots: usize,
    w: &Experts<'_>,
    acts: ExpertActs,
    glu: Option<Glu>,
    out: &mut [f32],
    threads: usize,
) -> Result<(), KernelError> {
    let (k, rows) = w.check()?;
    check_routing(ids, n_tok, slots)?;
    if x.len() != n_tok * k {
        return Err(KernelError::Shape(format!(
            "x has {} values, expected {n_tok} x {k}",
            x.len()
        )));
    }
    if glu.is_some() && !rows.is_multiple_of(2) {
        return Err(KernelError::Shape(format!(
            "{rows} rows per expert are not gate and up halves"
        )));
    }
    let ocols = if glu.is_some() { rows / 2 } else { rows };
    let pairs = n_tok * slots;
    if out.len() != pairs * ocols {
        return Err(KernelError::Shape(format!(
            "out has {} values, expected {pairs} x {ocols}",
            out.len()
        )));
    }
    if !experts_supported(w, acts) {
        return Err(KernelError::Shape(format!(
            "{acts:?} activations do not run on these experts' types here"
        )));
    }
    if pairs == 0 {
        return Ok(());
    }
    let g = group(ids, w.n_expert)?;
    let mut y = grouped(x, k, &|pair| pair / slots, &g, w, acts, threads)?;
    let op = SharedPtr(out.as_mut_ptr());
    let yp = SharedPtr(y.as_mut_ptr());
    let parts = pairs.div_ceil(PASS_ROWS);
    crate::pool::run_on(threads, parts, &|t| {
        for i in t * PASS_ROWS..((t + 1) * PASS_ROWS).min(pairs) {
            // SAFETY: sorted row i of y and output row order[i] (order is a permutation)
            // belong to this part alone
            let row = unsafe { std::slice::from_raw_parts_mut(yp.at(i * rows), rows) };
            if let Some(kind) = glu {
                glu_in_place(row, ocols, kind).expect("rows checked even");
            }
            let dst = unsafe { std::slice::from_raw_parts_mut(op.at(g.order[i] * ocols), ocols) };
            dst.copy_from_slice(&row[..ocols]);
        }
    });
    Ok(())
}

/// For pair rows `a` (`[n_tok * slots, k]`, row `t * slots + j` the input of token `t`'s slot
/// `j`) routed as `ids` with `weights` (both `[n_tok, slots]`), `out[t]` (`[n_tok, rows]`) =
/// the sum over slots in slot order of `weights[t, j] * (a[t * slots + j]` times expert
/// `ids[t, j]`'s rows of `w`).
#[allow(clippy::too_many_arguments)]
pub fn moe_down(
    a: &[f32],
    n_tok: usize,
    ids: &[i64],
    weights: &[f32],
    slots: usize,
    w: &Experts<'_>,
    acts: ExpertActs,
    out: &mut [f32],
    threads: usize,
) -> Result<(), KernelError> {
    let (k, rows) = w.check()?;
    check_routing(ids, n_tok, slots)?;
    let pairs = n_tok * slots;
    if weights.len() != pairs {
        return Err(KernelError::Shape(format!(
            "weights has {} values, expected {pairs}",
            weights.len()
        )));
    }
    if a.len() != pairs * k {
        return Err(KernelError::Shape(format!(
            "a has {} values, expected {pairs} x {k}",
            a.len()
        )));
    }
    if out.len() != n_tok * rows {
        return Err(KernelError::Shape(format!(
            "out has {} values, expected {n_tok} x {rows}",
            out.len()
        )));
    }
    if !experts_supported(w, acts) {
        return Err(KernelError::Shape(format!(
            "{acts:?} activations do not run on these experts' types here"
        )));
    }
    if pairs == 0 {
        return Ok(());
    }
    let g = group(ids, w.n_expert)?;
    let y = grouped(a, k, &|pair| pair, &g, w, acts, threads)?;
    let mut at = vec![0usize; pairs];
    for (i, &pair) in g.order.iter().enumerate() {
        at[pair] = i;
    }
    let op = SharedPtr(out.as_mut_ptr());
    let parts = n_tok.div_ceil(PASS_ROWS);
    crate::pool::run_on(threads, parts, &|t| {
        for tok in t * PASS_ROWS..((t + 1) * PASS_ROWS).min(n_tok) {
            // SAFETY: output row tok belongs to this part alone
            let o = unsafe { std::slice::from_raw_parts_mut(op.at(tok * rows), rows) };
            for j in 0..slots {
                let pair = tok * slots + j;
                let (src, wt) = (&y[at[pair] * rows..(at[pair] + 1) * rows], weights[pair]);
                // the weighted row is rounded to f32 before it is added (no fused
                // multiply-add), as the separate ggml ops compute it
                if j == 0 {
                    for (d, &v) in o.iter_mut().zip(src) {
                        *d = v * wt;
                    }
                } else {
                    for (d, &v) in o.iter_mut().zip(src) {
                        *d += v * wt;
                    }
                }
            }
        }
    });
    Ok(())
}
