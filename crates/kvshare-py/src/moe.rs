//! Binding of kvshare-kernels' grouped expert products (`moe_gate_up`, `moe_down`): the
//! stacked expert tensors (`raws[p]`, uint8 `[n_expert * n_p, row_bytes]`, typically views of
//! the mapped file), the activations and the routing are borrowed in place, the GIL is
//! released while they run, and every misuse raises ValueError.

use crate::blocks::{as_value_error, overlaps, raw_matrices, raw_parts, value_error};
use crate::convert::{typed_array, TypedArray};
use kvshare_kernels::moe::{self, ExpertActs, Experts};
use kvshare_kernels::rowops::Glu;
use pyo3::prelude::*;

fn expert_acts(name: &str) -> PyResult<ExpertActs> {
    match name {
        "f32" => Ok(ExpertActs::F32),
        "q8" => Ok(ExpertActs::Q8),
        "vnni" => Ok(ExpertActs::Vnni),
        _ => Err(value_error(format!(
            "activations must be 'f32', 'q8' or 'vnni', got {name:?}"
        ))),
    }
}

fn array<'py>(
    py: Python<'_>,
    obj: &Bound<'py, PyAny>,
    kind: u8,
    size: usize,
    writable: bool,
    what: &str,
) -> PyResult<TypedArray<'py>> {
    typed_array(obj, kind, size, writable, what).map_err(|e| as_value_error(py, e))
}

/// `(rows, cols)` of a 2-D array.
fn dims(a: &TypedArray<'_>, what: &str) -> PyResult<(usize, usize)> {
    match a.shape.as_slice() {
        &[r, c] => Ok((r, c)),
        _ => Err(value_error(format!("{what} must be 2-D"))),
    }
}

/// The experts' biases `bias` (f32 `[n_expert, rows]`) borrowed, or None.
fn bias_array<'py>(
    py: Python<'_>,
    bias: Option<&Bound<'py, PyAny>>,
) -> PyResult<Option<TypedArray<'py>>> {
    bias.map(|b| array(py, b, b'f', 4, false, "bias"))
        .transpose()
}

/// Token rows `x` (f32 `[n_tok, k]`) routed to experts `ids` (int64 `[n_tok, slots]`): row
/// `t * slots + j` of `out` is `x[t]` times expert `ids[t, j]`'s rows of the stacked parts,
/// plus that expert's row of `bias` (f32 `[n_expert, rows]`) when given, with `glu` ("silu",
/// "gelu_tanh", "swiglu_oai") applied to its gate and up halves (`out`
/// `[n_tok * slots, rows / 2]`), or none (`[n_tok * slots, rows]`).
#[pyfunction]
#[pyo3(signature = (x, ids, raws, qtypes, n_expert, out, activations = "f32", glu = Some("silu"), threads = 1, bias = None))]
#[allow(clippy::too_many_arguments)]
fn moe_gate_up(
    py: Python<'_>,
    x: &Bound<'_, PyAny>,
    ids: &Bound<'_, PyAny>,
    raws: Vec<Bound<'_, PyAny>>,
    qtypes: Vec<u32>,
    n_expert: usize,
    out: &Bound<'_, PyAny>,
    activations: &str,
    glu: Option<&str>,
    threads: usize,
    bias: Option<&Bound<'_, PyAny>>,
) -> PyResult<()> {
    let acts = expert_acts(activations)?;
    let glu = match glu {
        None => None,
        Some("silu") => Some(Glu::Silu),
        Some("gelu_tanh") => Some(Glu::GeluTanh),
        Some("swiglu_oai") => Some(Glu::SwigluOai),
        Some(other) => return Err(value_error(format!("unknown activation {other:?}"))),
    };
    let xa = array(py, x, b'f', 4, false, "x")?;
    let ia = array(py, ids, b'i', 8, false, "ids")?;
    let oa = array(py, out, b'f', 4, true, "out")?;
    let ba = bias_array(py, bias)?;
    let (n_tok, k) = dims(&xa, "x")?;
    let (n_ids, slots) = dims(&ia, "ids")?;
    if n_ids != n_tok {
        return Err(value_error("x and ids must have one row per token"));
    }
    let arrays = raw_parts(py, &raws, &qtypes, k)?;
    let o = oa.span(4);
    if overlaps(o, xa.span(4))
        || overlaps(o, ia.span(8))
        || ba.as_ref().is_some_and(|b| overlaps(o, b.span(4)))
        || arrays.iter().any(|(ra, _, _)| overlaps(o, ra.span(1)))
    {
        return Err(value_error("out must not overlap an input"));
    }
    let parts = raw_matrices(&arrays, k);
    // SAFETY: dtypes checked by typed_array; `out` overlaps no input; all arrays stay
    // referenced (so cannot be resized or freed) for this call.
    let (xs, is, os, bs) = unsafe {
        (
            xa.as_slice::<f32>(),
            ia.as_slice::<i64>(),
            oa.as_mut_slice::<f32>(),
            ba.as_ref().map(|b| b.as_slice::<f32>()),
        )
    };
    let w = Experts {
        parts: &parts,
        n_expert,
        bias: bs,
    };
    py.detach(|| moe::moe_gate_up(xs, n_tok, is, slots, &w, acts, glu, os, threads.max(1)))
        .map_err(|e| value_error(e.to_string()))
}

/// Pair rows `a` (f32 `[n_tok * slots, k]`) routed as `ids` (int64 `[n_tok, slots]`) with
/// `weights` (f32 `[n_tok, slots]`): `out[t]` (f32 `[n_tok, rows]`) = the sum over slots, in
/// slot order, of `weights[t, j]` times (`a[t * slots + j]` times expert `ids[t, j]`'s rows,
/// plus its row of `bias`, f32 `[n_expert, rows]`, when given).
#[pyfunction]
#[pyo3(signature = (a, ids, weights, raws, qtypes, n_expert, out, activations = "f32", threads = 1, bias = None))]
#[allow(clippy::too_many_arguments)]
fn moe_down(
    py: Python<'_>,
    a: &Bound<'_, PyAny>,
    ids: &Bound<'_, PyAny>,
    weights: &Bound<'_, PyAny>,
    raws: Vec<Bound<'_, PyAny>>,
    qtypes: Vec<u32>,
    n_expert: usize,
    out: &Bound<'_, PyAny>,
    activations: &str,
    threads: usize,
    bias: Option<&Bound<'_, PyAny>>,
) -> PyResult<()> {
    let acts = expert_acts(activations)?;
    let aa = array(py, a, b'f', 4, false, "a")?;
    let ba = bias_array(py, bias)?;
    let ia = array(py, ids, b'i', 8, false, "ids")?;
    let wa = array(py, weights, b'f', 4, false, "weights")?;
    let oa = array(py, out, b'f', 4, true, "out")?;
    let (_, k) = dims(&aa, "a")?;
    let (n_tok, slots) = dims(&ia, "ids")?;
    if wa.shape != ia.shape {
        return Err(value_error("weights must have the shape of ids"));
    }
    let arrays = raw_parts(py, &raws, &qtypes, k)?;
    let o = oa.span(4);
    if overlaps(o, aa.span(4))
        || overlaps(o, ia.span(8))
        || overlaps(o, wa.span(4))
        || ba.as_ref().is_some_and(|b| overlaps(o, b.span(4)))
        || arrays.iter().any(|(ra, _, _)| overlaps(o, ra.span(1)))
    {
        return Err(value_error("out must not overlap an input"));
    }
    let parts = raw_matrices(&arrays, k);
    // SAFETY: dtypes checked by typed_array; `out` overlaps no input; all arrays stay
    // referenced (so cannot be resized or freed) for this call.
    let (as_, is, ws, os, bs) = unsafe {
        (
            aa.as_slice::<f32>(),
            ia.as_slice::<i64>(),
            wa.as_slice::<f32>(),
            oa.as_mut_slice::<f32>(),
            ba.as_ref().map(|b| b.as_slice::<f32>()),
        )
    };
    let w = Experts {
        parts: &parts,
        n_expert,
        bias: bs,
    };
    py.detach(|| moe::moe_down(as_, n_tok, is, ws, slots, &w, acts, os, threads.max(1)))
        .map_err(|e| value_error(e.to_string()))
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(moe_gate_up, m)?)?;
    m.add_function(wrap_pyfunction!(moe_down, m)?)?;
    Ok(())
}
