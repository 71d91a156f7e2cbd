//! Binding of kvshare-kernels' block-format kernels: products with and dequantization of
//! weights kept in their GGUF block formats (`raw` uint8 `[rows, row_bytes]`, typically a
//! read-only view into the mmapped file). Arrays are borrowed in place, the GIL is released
//! while they run, and every misuse raises ValueError.

use crate::convert::{typed_array, TypedArray};
use crate::errors::InvalidArgument;
use kvshare_kernels::blocks::{
    block_matmul_t as core_block_matmul_t, dequantize_rows, set_force_portable, BlockMatrix,
    BlockType, QActs, ACT_BLOCK,
};
use kvshare_kernels::KernelError;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

pub(crate) fn value_error(msg: impl Into<String>) -> PyErr {
    PyValueError::new_err(msg.into())
}

/// The shared array checks raise InvalidArgument; these functions promise ValueError.
pub(crate) fn as_value_error(py: Python<'_>, e: PyErr) -> PyErr {
    if e.is_instance_of::<InvalidArgument>(py) {
        value_error(e.value(py).to_string())
    } else {
        e
    }
}

fn block_type(qtype: u32) -> PyResult<BlockType> {
    BlockType::from_ggml(qtype)
        .ok_or_else(|| value_error(format!("GGML type {qtype} has no block kernels")))
}

/// The `[rows, row_bytes]` raw blocks of `rows` rows of `k` elements of `ty`.
fn check_raw(shape: &[usize], ty: BlockType, k: usize) -> PyResult<usize> {
    let &[rows, rb] = shape else {
        return Err(value_error("raw must be 2-D uint8 [rows, row_bytes]"));
    };
    let bs = ty.block_size();
    if k == 0 || !k.is_multiple_of(bs) {
        return Err(value_error(format!(
            "k = {k} is not a positive multiple of the {ty:?} block size {bs}"
        )));
    }
    if rb != ty.row_bytes(k) {
        return Err(value_error(format!(
            "raw rows have {rb} bytes, {ty:?} rows of {k} values have {}",
            ty.row_bytes(k)
        )));
    }
    Ok(rows)
}

pub(crate) fn overlaps(a: (usize, usize), b: (usize, usize)) -> bool {
    a.1 > a.0 && b.1 > b.0 && a.0 < b.1 && b.0 < a.1
}

/// The product kernels' signature (`block_matmul_t`, `block_matmul_t_f32`).
type BlockProduct =
    fn(&[f32], usize, &BlockMatrix<'_>, &mut [f32], usize) -> Result<(), KernelError>;

/// Check and borrow `x`, `raw` and `out` for one of the product kernels, run it with the GIL
/// released.
fn run_product(
    py: Python<'_>,
    kernel: BlockProduct,
    x: &Bound<'_, PyAny>,
    raw: &Bound<'_, PyAny>,
    qtype: u32,
    out: &Bound<'_, PyAny>,
    threads: usize,
) -> PyResult<()> {
    let err = |e| as_value_error(py, e);
    let ty = block_type(qtype)?;
    let xa = typed_array(x, b'f', 4, false, "x").map_err(err)?;
    let ra = typed_array(raw, b'u', 1, false, "raw").map_err(err)?;
    let oa = typed_array(out, b'f', 4, true, "out").map_err(err)?;
    let &[m, k] = xa.shape.as_slice() else {
        return Err(value_error("x must be 2-D float32 [m, k]"));
    };
    let n = check_raw(&ra.shape, ty, k)?;
    if oa.shape != [m, n] {
        return Err(value_error(format!("out must have shape ({m}, {n})")));
    }
    if overlaps(oa.span(4), xa.span(4)) || overlaps(oa.span(4), ra.span(1)) {
        return Err(value_error("out must not overlap an input"));
    }
    // SAFETY: dtypes checked by typed_array; `out` overlaps no input; all arrays stay
    // referenced (so cannot be resized or freed) for this call.
    let (xs, rs, os) = unsafe {
        (
            xa.as_slice::<f32>(),
            ra.as_slice::<u8>(),
            oa.as_mut_slice::<f32>(),
        )
    };
    let w = BlockMatrix { raw: rs, ty, n, k };
    py.detach(|| kernel(xs, m, &w, os, threads.max(1)))
        .map_err(|e| value_error(e.to_string()))
}

/// `out[m, n] = sum_k x[m, k] * w[n, k]` for `w` the rows of `raw` in GGML type `qtype`
/// (at most 16 rows of `x`; activations are quantized to 8 bits for quantized types).
#[pyfunction]
#[pyo3(signature = (x, raw, qtype, out, threads = 1))]
fn block_matmul_t(
    py: Python<'_>,
    x: &Bound<'_, PyAny>,
    raw: &Bound<'_, PyAny>,
    qtype: u32,
    out: &Bound<'_, PyAny>,
    threads: usize,
) -> PyResult<()> {
    run_product(py, core_block_matmul_t, x, raw, qtype, out, threads)
}

/// `out[rows, k]` = the rows of `raw` (GGML type `qtype`) as f32, as ggml dequantizes them.
#[pyfunction]
#[pyo3(signature = (raw, qtype, k, out, threads = 1))]
fn block_dequantize(
    py: Python<'_>,
    raw: &Bound<'_, PyAny>,
    qtype: u32,
    k: usize,
    out: &Bound<'_, PyAny>,
    threads: usize,
) -> PyResult<()> {
    let err = |e| as_value_error(py, e);
    let ty = block_type(qtype)?;
    let ra = typed_array(raw, b'u', 1, false, "raw").map_err(err)?;
    let oa = typed_array(out, b'f', 4, true, "out").map_err(err)?;
    let rows = check_raw(&ra.shape, ty, k)?;
    if oa.shape != [rows, k] {
        return Err(value_error(format!("out must have shape ({rows}, {k})")));
    }
    if overlaps(oa.span(4), ra.span(1)) {
        return Err(value_error("out must not overlap raw"));
    }
    // SAFETY: as in block_matmul_t
    let (rs, os) = unsafe { (ra.as_slice::<u8>(), oa.as_mut_slice::<f32>()) };
    let w = BlockMatrix {
        raw: rs,
        ty,
        n: rows,
        k,
    };
    py.detach(|| dequantize_rows(&w, 0, rows, os, threads.max(1)))
        .map_err(|e| value_error(e.to_string()))
}

/// Replace `x` (writable C-contiguous f32 `[m, k]`, k a multiple of 32) in place by the values
/// its 8-bit activation quantization stands for (what `block_matmul_t` multiplies with), so a
/// BLAS product on them equals the kernel's up to float summation order.
#[pyfunction]
fn block_act_round_trip(py: Python<'_>, x: &Bound<'_, PyAny>) -> PyResult<()> {
    let xa = typed_array(x, b'f', 4, true, "x").map_err(|e| as_value_error(py, e))?;
    let &[_, k] = xa.shape.as_slice() else {
        return Err(value_error("x must be 2-D f32 [m, k]"));
    };
    if !k.is_multiple_of(ACT_BLOCK) {
        return Err(value_error(format!(
            "k = {k} is not a multiple of {ACT_BLOCK}"
        )));
    }
    // SAFETY: dtype, contiguity and writability checked; `x` stays referenced for this call.
    let xs = unsafe { xa.as_mut_slice::<f32>() };
    py.detach(|| QActs::round_trip(xs, k));
    Ok(())
}

/// Make the block kernels use their portable code (tests compare it with the SIMD path).
#[pyfunction]
fn block_force_portable(on: bool) {
    set_force_portable(on);
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(block_matmul_t, m)?)?;
    m.add_function(wrap_pyfunction!(block_dequantize, m)?)?;
    m.add_function(wrap_pyfunction!(block_act_round_trip, m)?)?;
    m.add_function(wrap_pyfunction!(block_force_portable, m)?)?;
    m.add_function(wrap_pyfunction!(block_matmul_t_f32, m)?)?;
    m.add_function(wrap_pyfunction!(block_matmul_t_f32_parts, m)?)?;
    m.add_function(wrap_pyfunction!(block_gemm_f32, m)?)?;
    m.add_function(wrap_pyfunction!(block_gemm_available, m)?)?;
    m.add_function(wrap_pyfunction!(block_vnni_available, m)?)?;
    m.add_function(wrap_pyfunction!(block_vnni_supports, m)?)?;
    m.add_function(wrap_pyfunction!(block_matmul_t_vnni, m)?)
}

/// Whether `block_gemm_f32` runs on this CPU (AVX-512) with the SIMD code switched on.
#[pyfunction]
fn block_gemm_available() -> bool {
    kvshare_kernels::blocks::gemm_available()
}

/// `out[:, col0:col0 + n] = x @ dequantize(raw).T` for `raw` uint8 `[n, row_bytes]` of a
/// block-quantized GGML type and `x` f32 `[m, k]` (any m: a prefill chunk): weight panels are
/// dequantized into a cache-sized buffer and multiplied by an f32 micro-kernel; each output
/// sums its k products in order, whatever m. `out` is C-contiguous f32 `[m, ld]`.
#[pyfunction]
#[pyo3(signature = (x, raw, qtype, out, col0 = 0, threads = 1))]
fn block_gemm_f32(
    py: Python<'_>,
    x: &Bound<'_, PyAny>,
    raw: &Bound<'_, PyAny>,
    qtype: u32,
    out: &Bound<'_, PyAny>,
    col0: usize,
    threads: usize,
) -> PyResult<()> {
    let err = |e| as_value_error(py, e);
    let ty = block_type(qtype)?;
    let xa = typed_array(x, b'f', 4, false, "x").map_err(err)?;
    let ra = typed_array(raw, b'u', 1, false, "raw").map_err(err)?;
    let oa = typed_array(out, b'f', 4, true, "out").map_err(err)?;
    let &[m, k] = xa.shape.as_slice() else {
        return Err(value_error("x must be 2-D float32 [m, k]"));
    };
    let n = check_raw(&ra.shape, ty, k)?;
    let &[om, ld] = oa.shape.as_slice() else {
        return Err(value_error("out must be 2-D float32 [m, ld]"));
    };
    if om != m || col0.checked_add(n).is_none_or(|e| e > ld) {
        return Err(value_error(format!(
            "out must have {m} rows and at least {col0} + {n} columns, got ({om}, {ld})"
        )));
    }
    if overlaps(oa.span(4), xa.span(4)) || overlaps(oa.span(4), ra.span(1)) {
        return Err(value_error("out must not overlap an input"));
    }
    // SAFETY: as in run_product
    let (xs, rs, os) = unsafe {
        (
            xa.as_slice::<f32>(),
            ra.as_slice::<u8>(),
            oa.as_mut_slice::<f32>(),
        )
    };
    let w = BlockMatrix { raw: rs, ty, n, k };
    py.detach(|| kvshare_kernels::blocks::block_gemm_f32(xs, m, &w, os, ld, col0, threads.max(1)))
        .map_err(|e| value_error(e.to_string()))
}

/// `out[m, n] = sum_k x[m, k] * w[n, k]` as `block_matmul_t`, with the f32 activations
/// themselves (no 8-bit rounding): equals `x @ dequantize(w).T` up to f32 summation order.
#[pyfunction]
#[pyo3(signature = (x, raw, qtype, out, threads = 1))]
fn block_matmul_t_f32(
    py: Python<'_>,
    x: &Bound<'_, PyAny>,
    raw: &Bound<'_, PyAny>,
    qtype: u32,
    out: &Bound<'_, PyAny>,
    threads: usize,
) -> PyResult<()> {
    let kernel: BlockProduct = kvshare_kernels::blocks::block_matmul_t_f32;
    run_product(py, kernel, x, raw, qtype, out, threads)
}

/// Whether `block_matmul_t_vnni` runs on this CPU (AVX512-VNNI) with the SIMD code on.
#[pyfunction]
fn block_vnni_available() -> bool {
    kvshare_kernels::blocks::vnni_available()
}

/// Whether `block_matmul_t_vnni` takes weights of GGML type `qtype`.
#[pyfunction]
fn block_vnni_supports(qtype: u32) -> bool {
    kvshare_kernels::blocks::BlockType::from_ggml(qtype)
        .is_some_and(kvshare_kernels::blocks::vnni_supports)
}

/// `x` (f32 `[m, k]`, any m) quantized to 8 bits per 32 values times the rows of each of
/// `raws[p]` (uint8 `[n_p, row_bytes]`, GGML type `qtypes[p]`), in integers; part `p` fills
/// columns `sum(n_q, q < p) ..` of `out` (`[m, sum n_p]`). A row's result does not depend on
/// `m` or on the row's place in `x`.
#[pyfunction]
#[pyo3(signature = (x, raws, qtypes, out, threads = 1))]
fn block_matmul_t_vnni(
    py: Python<'_>,
    x: &Bound<'_, PyAny>,
    raws: Vec<Bound<'_, PyAny>>,
    qtypes: Vec<u32>,
    out: &Bound<'_, PyAny>,
    threads: usize,
) -> PyResult<()> {
    parts_product(py, x, raws, qtypes, out, |xs, m, ws, os| {
        kvshare_kernels::blocks::block_matmul_t_vnni(xs, m, ws, os, threads.max(1))
    })
}

/// The parts of a weight stacked along its output axis: `raws[p]` (uint8 `[n_p, row_bytes]`
/// of GGML type `qtypes[p]`, rows of `k` values) checked and borrowed, with their type and
/// rows.
pub(crate) fn raw_parts<'py>(
    py: Python<'_>,
    raws: &[Bound<'py, PyAny>],
    qtypes: &[u32],
    k: usize,
) -> PyResult<Vec<(TypedArray<'py>, BlockType, usize)>> {
    if raws.is_empty() || raws.len() != qtypes.len() {
        return Err(value_error(
            "raws and qtypes must be non-empty and of one length",
        ));
    }
    raws.iter()
        .zip(qtypes)
        .map(|(raw, &qtype)| {
            let ty = block_type(qtype)?;
            let ra = typed_array(raw, b'u', 1, false, "raw").map_err(|e| as_value_error(py, e))?;
            let n = check_raw(&ra.shape, ty, k)?;
            Ok((ra, ty, n))
        })
        .collect()
}

/// `raw_parts`' arrays as the kernels' matrices.
pub(crate) fn raw_matrices<'a>(
    parts: &'a [(TypedArray<'_>, BlockType, usize)],
    k: usize,
) -> Vec<BlockMatrix<'a>> {
    parts
        .iter()
        .map(|(ra, ty, n)| BlockMatrix {
            // SAFETY: dtype u8 checked by typed_array; the array stays referenced (so cannot
            // be resized or freed) while the matrix is borrowed
            raw: unsafe { ra.as_slice::<u8>() },
            ty: *ty,
            n: *n,
            k,
        })
        .collect()
}

/// The checked arguments of a product of several weights side by side (`raws[p]`, uint8
/// `[n_p, row_bytes]` of type `qtypes[p]`, filling columns `sum(n_q, q < p) ..` of `out`,
/// `[m, sum n_p]`), passed to `product(x, m, weights, out)` with the GIL released.
fn parts_product(
    py: Python<'_>,
    x: &Bound<'_, PyAny>,
    raws: Vec<Bound<'_, PyAny>>,
    qtypes: Vec<u32>,
    out: &Bound<'_, PyAny>,
    product: impl FnOnce(&[f32], usize, &[BlockMatrix<'_>], &mut [f32]) -> Result<(), KernelError>
        + Send,
) -> PyResult<()> {
    let err = |e| as_value_error(py, e);
    if raws.is_empty() || raws.len() != qtypes.len() {
        return Err(value_error(
            "raws and qtypes must be non-empty and of one length",
        ));
    }
    let xa = typed_array(x, b'f', 4, false, "x").map_err(err)?;
    let oa = typed_array(out, b'f', 4, true, "out").map_err(err)?;
    let &[m, k] = xa.shape.as_slice() else {
        return Err(value_error("x must be 2-D float32 [m, k]"));
    };
    let arrays = raw_parts(py, &raws, &qtypes, k)?;
    if arrays
        .iter()
        .any(|(ra, _, _)| overlaps(oa.span(4), ra.span(1)))
    {
        return Err(value_error("out must not overlap an input"));
    }
    let ld: usize = arrays.iter().map(|(_, _, n)| n).sum();
    if oa.shape != [m, ld] {
        return Err(value_error(format!("out must have shape ({m}, {ld})")));
    }
    if overlaps(oa.span(4), xa.span(4)) {
        return Err(value_error("out must not overlap an input"));
    }
    // SAFETY: dtypes checked by typed_array; `out` overlaps no input; all arrays stay
    // referenced (so cannot be resized or freed) for this call.
    let (xs, os) = unsafe { (xa.as_slice::<f32>(), oa.as_mut_slice::<f32>()) };
    let ws = raw_matrices(&arrays, k);
    py.detach(|| product(xs, m, &ws, os))
        .map_err(|e| value_error(e.to_string()))
}

/// `block_matmul_t_f32` of several weights with the same `k` at once: `raws[p]` (uint8
/// `[n_p, row_bytes]`, GGML type `qtypes[p]`) fills columns `sum(n_q, q < p) ..` of `out`
/// (`[m, sum n_p]`). One pass over the kernel threads for all parts (fused Q/K/V, gate/up).
#[pyfunction]
#[pyo3(signature = (x, raws, qtypes, out, threads = 1))]
fn block_matmul_t_f32_parts(
    py: Python<'_>,
    x: &Bound<'_, PyAny>,
    raws: Vec<Bound<'_, PyAny>>,
    qtypes: Vec<u32>,
    out: &Bound<'_, PyAny>,
    threads: usize,
) -> PyResult<()> {
    parts_product(py, x, raws, qtypes, out, |xs, m, ws, os| {
        kvshare_kernels::blocks::block_matmul_t_f32_parts(xs, m, ws, os, threads.max(1))
    })
}
