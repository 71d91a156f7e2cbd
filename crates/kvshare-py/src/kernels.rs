//! Binding of kvshare-kernels: `qmatmul_t`, the quantized matrix product of the CPU decode
//! path. Arrays are borrowed in place and the GIL is released while it runs.

use crate::convert::{invalid, typed_array};
use kvshare_kernels::{qmatmul_t as core_qmatmul_t, QMatrix};
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
    let ma = mins.map(|m| typed_array(m, b'f', 4, false, "mins")).transpose()?;
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
    let (o0, o1) = oa.span(4);
    let inputs = [Some(xa.span(4)), Some(qa.span(1)), Some(sa.span(4)), ma.as_ref().map(|a| a.span(4))];
    if o1 > o0 && inputs.iter().flatten().any(|&(a, b)| a < o1 && o0 < b) {
        return Err(invalid("out must not overlap an input"));
    }
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
    let w = QMatrix { qs: qv, scale: sv, mins: mv, n, k, group };
    py.detach(|| core_qmatmul_t(xs, m, &w, ov, threads.max(1)))
        .map_err(|e| invalid(e.to_string()))
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(qmatmul_t, m)?)
}
