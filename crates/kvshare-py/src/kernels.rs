//! Binding of kvshare-kernels: `qmatmul_t`, the quantized matrix product of the CPU decode
//! path, `paged_attention` for decode rows and prefill chunks (f32, f16 or q8_0 pools; sinks) and
//! `quantize_q8_0` (what a q8_0 pool stores). Arrays are borrowed in place and the GIL is
//! released while they run.

use crate::convert::{invalid, typed_array, TypedArray};
use kvshare_kernels::attention::{paged_attention_with, Paths, Q8_BYTES, Q8_VALS};
use kvshare_kernels::{
    qmatmul_t as core_qmatmul_t, quantize_q8_0 as core_quantize_q8_0, KernelError, KvElem, PagedKv,
    Q8Block, QMatrix, Queries, F16,
};
use pyo3::exceptions::PyIndexError;
use pyo3::prelude::*;

/// `out[m, n] = sum_k x[m, k] * (qs[n, k] * scale[n, k // group] - mins[n, k // group])`.
#[pyfunction]
#[pyo3(signature = (x, qs, scale, mins, out, group, threads = 1))]
#[allow(clippy::too_many_arguments)]
fn qmatmul_t(
    py: Python<'_>,
    x: &Bound<'_, PyAny>,
    qs: &Bound<'_, PyAny>,
    scale: &Bound<'_, PyAny>,
    mins: Option<&Bound<'_, PyAny>>,
    out: &Bound<'_, PyAny>,
    group: usize,
    threads: usize,
) -> PyResult<()> {
    let xa = typed_array(x, b'f', 4, false, "x")?;
    let qa = typed_array(qs, b'i', 1, false, "qs")?;
    let sa = typed_array(scale, b'f', 4, false, "scale")?;
    let ma = mins
        .map(|m| typed_array(m, b'f', 4, false, "mins"))
        .transpose()?;
    let oa = typed_array(out, b'f', 4, true, "out")?;
    let (&[m, k], &[n, kq]) = (xa.shape.as_slice(), qa.shape.as_slice()) else {
        return Err(invalid("x and qs must be 2-D"));
    };
    if k != kq {
        return Err(invalid(format!("x has {k} columns, qs has {kq}")));
    }
    if oa.shape != [m, n] {
        return Err(invalid(format!("out must have shape ({m}, {n})")));
    }
    let inputs = [
        Some(xa.span(4)),
        Some(qa.span(1)),
        Some(sa.span(4)),
        ma.as_ref().map(|a| a.span(4)),
    ];
    refuse_overlap(oa.span(4), inputs.into_iter().flatten())?;
    // SAFETY: dtypes checked by typed_array; `out` overlaps no input (checked above); all
    // arrays stay referenced (and so cannot be resized) for this call.
    let (xs, qv, sv, mv, ov) = unsafe {
        (
            xa.as_slice::<f32>(),
            qa.as_slice::<i8>(),
            sa.as_slice::<f32>(),
            ma.as_ref().map(|a| a.as_slice::<f32>()),
            oa.as_mut_slice::<f32>(),
        )
    };
    let w = QMatrix {
        qs: qv,
        scale: sv,
        mins: mv,
        n,
        k,
        group,
    };
    py.detach(|| core_qmatmul_t(xs, m, &w, ov, threads.max(1)))
        .map_err(|e| invalid(e.to_string()))
}

/// `paged_attention` or `paged_attention_invariant` of one pool type, with optional sinks.
#[allow(clippy::too_many_arguments)]
fn attend<T: KvElem>(
    invariant: bool,
    cache: &PagedKv<'_, T>,
    queries: &Queries<'_>,
    scale: f32,
    window: usize,
    sinks: Option<&[f32]>,
    max_rows: usize,
    out: &mut [f32],
    threads: usize,
) -> Result<(), KernelError> {
    let paths = if invariant {
        Paths::Invariant
    } else {
        Paths::Fast
    };
    paged_attention_with(
        cache, queries, scale, window, sinks, max_rows, out, threads, paths,
    )
}

/// Attention of the query rows of sequences with at most `max_rows` rows (decode rows and
/// prefill chunks) over the paged cache (see `kvshare_kernels::attention`); other rows of
/// `out` are left as they are. With `invariant`, every row takes the tiled path with key
/// blocks at absolute positions: a row's result is the same bits in any call. `sinks`:
/// float32 `[n_head]` attention-sink logits (gpt-oss), or None.
#[pyfunction]
#[pyo3(signature = (q, k_cache, v_cache, block_tables, q_starts, start_positions, scale, window, out, max_rows, threads = 1, invariant = false, sinks = None))]
#[allow(clippy::too_many_arguments)]
fn paged_attention(
    py: Python<'_>,
    q: &Bound<'_, PyAny>,
    k_cache: &Bound<'_, PyAny>,
    v_cache: &Bound<'_, PyAny>,
    block_tables: &Bound<'_, PyAny>,
    q_starts: &Bound<'_, PyAny>,
    start_positions: &Bound<'_, PyAny>,
    scale: f32,
    window: usize,
    out: &Bound<'_, PyAny>,
    max_rows: usize,
    threads: usize,
    invariant: bool,
    sinks: Option<&Bound<'_, PyAny>>,
) -> PyResult<()> {
    let qa = typed_array(q, b'f', 4, false, "q")?;
    let ska = sinks
        .map(|s| typed_array(s, b'f', 4, false, "sinks"))
        .transpose()?;
    // the pool is f32, f16 (NumPy float16: IEEE half) or q8_0 (uint8: rows of 34-byte blocks)
    let itemsize = match k_cache.getattr("dtype").and_then(|d| d.getattr("itemsize")) {
        Ok(n) => match n.extract::<usize>().ok() {
            Some(2) => 2,
            Some(1) => 1,
            _ => 4,
        },
        _ => 4,
    };
    let kind = if itemsize == 1 { b'u' } else { b'f' };
    let ka = typed_array(k_cache, kind, itemsize, false, "k_cache")?;
    let va = typed_array(v_cache, kind, itemsize, false, "v_cache")?;
    let ta = typed_array(block_tables, b'i', 4, false, "block_tables")?;
    let sa = typed_array(q_starts, b'i', 8, false, "q_starts")?;
    let pa = typed_array(start_positions, b'i', 8, false, "start_positions")?;
    let oa = typed_array(out, b'f', 4, true, "out")?;
    let &[n_blocks, block_size, n_kv, row] = ka.shape.as_slice() else {
        return Err(invalid(
            "k_cache must be [n_blocks, block_size, n_kv_heads, head_dim]",
        ));
    };
    // a q8_0 row holds head_dim / 32 blocks of 34 bytes
    let head_dim = if itemsize == 1 {
        if row % Q8_BYTES != 0 {
            return Err(invalid(format!(
                "a q8_0 k_cache row is a multiple of {Q8_BYTES} bytes, got {row}"
            )));
        }
        row / Q8_BYTES * Q8_VALS
    } else {
        row
    };
    if va.shape != ka.shape {
        return Err(invalid("v_cache must have k_cache's shape"));
    }
    let &[_, n_head, qd] = qa.shape.as_slice() else {
        return Err(invalid("q must be [n_tok, n_head, head_dim]"));
    };
    if qd != head_dim || oa.shape != qa.shape {
        return Err(invalid(
            "q and out must be [n_tok, n_head, head_dim] of the cache's head_dim",
        ));
    }
    let &[n_seq, width] = ta.shape.as_slice() else {
        return Err(invalid("block_tables must be 2-D"));
    };
    if pa.shape != [n_seq] || sa.shape != [n_seq + 1] {
        return Err(invalid(
            "start_positions must be [n_seq] and q_starts [n_seq + 1]",
        ));
    }
    if let Some(a) = &ska {
        if a.shape != [n_head] {
            return Err(invalid(format!("sinks must be [{n_head}] (n_head)")));
        }
    }
    let inputs = [
        Some(qa.span(4)),
        Some(ka.span(itemsize)),
        Some(va.span(itemsize)),
        Some(ta.span(4)),
        Some(sa.span(8)),
        Some(pa.span(8)),
        ska.as_ref().map(|a| a.span(4)),
    ];
    refuse_overlap(oa.span(4), inputs.into_iter().flatten())?;
    // SAFETY: dtypes checked by typed_array (F16 is a transparent u16, the layout of NumPy's
    // float16); `out` overlaps no input; all arrays stay referenced for this call.
    let (qv, tv, sv, pv, ov, skv) = unsafe {
        (
            qa.as_slice::<f32>(),
            ta.as_slice::<i32>(),
            sa.as_slice::<i64>(),
            pa.as_slice::<i64>(),
            oa.as_mut_slice::<f32>(),
            ska.as_ref().map(|a| a.as_slice::<f32>()),
        )
    };
    let queries = Queries {
        q: qv,
        n_head,
        tables: tv,
        width,
        q_starts: sv,
        start_positions: pv,
    };
    let threads = threads.max(1);
    let res = if itemsize == 1 {
        // SAFETY: as above (bytes; Q8Block has alignment 1)
        let (kb, vb) = unsafe { (ka.as_slice::<u8>(), va.as_slice::<u8>()) };
        let (Some(k), Some(v)) = (Q8Block::from_bytes(kb), Q8Block::from_bytes(vb)) else {
            return Err(invalid("q8_0 k_cache/v_cache must be whole 34-byte blocks"));
        };
        let cache = PagedKv {
            k,
            v,
            n_blocks,
            block_size,
            n_kv,
            head_dim,
        };
        py.detach(|| {
            attend(
                invariant, &cache, &queries, scale, window, skv, max_rows, ov, threads,
            )
        })
    } else if itemsize == 2 {
        // SAFETY: as above
        let cache = unsafe { paged_kv::<F16>(&ka, &va, n_blocks, block_size, n_kv, head_dim) };
        py.detach(|| {
            attend(
                invariant, &cache, &queries, scale, window, skv, max_rows, ov, threads,
            )
        })
    } else {
        // SAFETY: as above
        let cache = unsafe { paged_kv::<f32>(&ka, &va, n_blocks, block_size, n_kv, head_dim) };
        py.detach(|| {
            attend(
                invariant, &cache, &queries, scale, window, skv, max_rows, ov, threads,
            )
        })
    };
    res.map_err(|e| match e {
        KernelError::Uncovered(m) => PyIndexError::new_err(m),
        e => invalid(e.to_string()),
    })
}

/// `out[..., :]` = the rows of `x` (float32 `[..., head_dim]`, head_dim a multiple of 32) as
/// ggml Q8_0 blocks (uint8 `[..., head_dim / 32 * 34]`), exactly as ggml's
/// `quantize_row_q8_0_ref`.
#[pyfunction]
fn quantize_q8_0(py: Python<'_>, x: &Bound<'_, PyAny>, out: &Bound<'_, PyAny>) -> PyResult<()> {
    let xa = typed_array(x, b'f', 4, false, "x")?;
    let oa = typed_array(out, b'u', 1, true, "out")?;
    let (Some((&hd, xlead)), Some((&ob, olead))) = (xa.shape.split_last(), oa.shape.split_last())
    else {
        return Err(invalid("x and out must have at least one dimension"));
    };
    if hd % Q8_VALS != 0 || xlead != olead || ob != hd / Q8_VALS * Q8_BYTES {
        return Err(invalid(format!(
            "x [..., {hd}] needs a multiple of {Q8_VALS} values per row and out [..., {}]",
            hd / Q8_VALS * Q8_BYTES
        )));
    }
    refuse_overlap(oa.span(1), [xa.span(4)])?;
    // SAFETY: dtypes checked by typed_array; out overlaps no input; both stay referenced.
    let (xs, os) = unsafe { (xa.as_slice::<f32>(), oa.as_mut_slice::<u8>()) };
    let blocks = Q8Block::from_bytes_mut(os).ok_or_else(|| invalid("out: whole blocks"))?;
    py.detach(|| core_quantize_q8_0(xs, blocks))
        .map_err(|e| invalid(e.to_string()))
}

/// The pool layer's K and V arrays as the kernel's view.
/// SAFETY of use: `T` is the element type `typed_array` checked for both.
unsafe fn paged_kv<'a, T: KvElem>(
    ka: &'a TypedArray<'_>,
    va: &'a TypedArray<'_>,
    n_blocks: usize,
    block_size: usize,
    n_kv: usize,
    head_dim: usize,
) -> PagedKv<'a, T> {
    // SAFETY: see above.
    let (k, v) = unsafe { (ka.as_slice::<T>(), va.as_slice::<T>()) };
    PagedKv {
        k,
        v,
        n_blocks,
        block_size,
        n_kv,
        head_dim,
    }
}

/// InvalidArgument when the output's bytes `[start, end)` overlap any input's.
fn refuse_overlap(
    out: (usize, usize),
    inputs: impl IntoIterator<Item = (usize, usize)>,
) -> PyResult<()> {
    let (o0, o1) = out;
    if o1 > o0 && inputs.into_iter().any(|(a, b)| a < o1 && o0 < b) {
        return Err(invalid("out must not overlap an input"));
    }
    Ok(())
}

fn value_err(msg: impl Into<String>) -> PyErr {
    pyo3::exceptions::PyValueError::new_err(msg.into())
}

/// The row ops raise ValueError for every bad argument (as the block kernels do).
fn as_value(e: PyErr) -> PyErr {
    Python::attach(|py| value_err(e.value(py).to_string()))
}

/// `out = x / sqrt(mean(x**2, -1) + eps) * weight` over the last axis of a C-contiguous f32
/// `x` (`weight`: f32 `[d]` or None); `out` is `x` itself (in place) or a C-contiguous f32
/// array of x's shape not overlapping it. ggml's formula: squares summed in f64, the scale in
/// f32, the same for every number of rows.
#[pyfunction]
#[pyo3(signature = (x, weight, eps, out))]
fn rms_norm(
    py: Python<'_>,
    x: &Bound<'_, PyAny>,
    weight: Option<&Bound<'_, PyAny>>,
    eps: f32,
    out: &Bound<'_, PyAny>,
) -> PyResult<()> {
    let oa = typed_array(out, b'f', 4, true, "out").map_err(as_value)?;
    let d = *oa
        .shape
        .last()
        .ok_or_else(|| value_err("x must have at least one axis"))?;
    let wa = weight
        .map(|w| typed_array(w, b'f', 4, false, "weight").map_err(as_value))
        .transpose()?;
    // SAFETY: dtype checked; the weight is only read and does not alias out (checked below)
    let w: &[f32] = match &wa {
        Some(w) => unsafe { w.as_slice() },
        None => &[],
    };
    if let Some(wa) = &wa {
        if wa.shape != [d] {
            return Err(value_err(format!("weight must have shape ({d},)")));
        }
        let (a, b) = (wa.span(4), oa.span(4));
        if a.0 < b.1 && b.0 < a.1 {
            return Err(value_err("out must not overlap weight"));
        }
    }
    let err = |e: KernelError| value_err(e.to_string());
    if x.is(out) {
        // SAFETY: dtype, contiguity and writability checked; no other slice of it is alive
        let os = unsafe { oa.as_mut_slice::<f32>() };
        return py
            .detach(|| kvshare_kernels::rowops::rms_norm_in_place(os, d, w, eps))
            .map_err(err);
    }
    let xa = typed_array(x, b'f', 4, false, "x").map_err(as_value)?;
    if xa.shape != oa.shape {
        return Err(value_err("out must have x's shape"));
    }
    let (a, b) = (xa.span(4), oa.span(4));
    if a.0 < b.1 && b.0 < a.1 {
        return Err(value_err("out must be x itself or not overlap it"));
    }
    // SAFETY: dtypes checked; out overlaps neither input; all stay referenced for the call
    let (xs, os) = unsafe { (xa.as_slice::<f32>(), oa.as_mut_slice::<f32>()) };
    py.detach(|| kvshare_kernels::rowops::rms_norm(xs, d, w, eps, os))
        .map_err(err)
}

/// In place on a C-contiguous f32 `gu` `[N, 2 * ff]` (a fused gate|up projection):
/// `gu[:, :ff] = act(gu[:, :ff]) * gu[:, ff:]` with `act` "gelu_tanh" or "silu", or
/// gpt-oss's "swiglu_oai" (`rowops::Glu::SwigluOai`: clamps, then `* (up + 1)`).
#[pyfunction]
fn glu_in_place(py: Python<'_>, gu: &Bound<'_, PyAny>, kind: &str) -> PyResult<()> {
    use kvshare_kernels::rowops::Glu;
    let kind = match kind {
        "gelu_tanh" => Glu::GeluTanh,
        "silu" => Glu::Silu,
        "swiglu_oai" => Glu::SwigluOai,
        other => return Err(value_err(format!("unknown activation {other:?}"))),
    };
    let ga = typed_array(gu, b'f', 4, true, "gu").map_err(as_value)?;
    let &[_, w] = ga.shape.as_slice() else {
        return Err(value_err("gu must be 2-D [N, 2 * ff]"));
    };
    if w % 2 != 0 {
        return Err(value_err("gu's width must be even (gate | up)"));
    }
    // SAFETY: dtype, contiguity and writability checked; no other slice of it is alive
    let gs = unsafe { ga.as_mut_slice::<f32>() };
    if gs.is_empty() {
        return Ok(());
    }
    py.detach(|| kvshare_kernels::rowops::glu_in_place(gs, w / 2, kind))
        .map_err(|e| value_err(e.to_string()))
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(rms_norm, m)?)?;
    m.add_function(wrap_pyfunction!(glu_in_place, m)?)?;
    m.add_function(wrap_pyfunction!(qmatmul_t, m)?)?;
    m.add_function(wrap_pyfunction!(quantize_q8_0, m)?)?;
    m.add_function(wrap_pyfunction!(paged_attention, m)?)
}
