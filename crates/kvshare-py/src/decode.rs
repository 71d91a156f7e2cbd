//! Binding of `kvshare_kernels::decode::decode_layer`: one attention + MLP layer of a CPU
//! decode step in one call (arrays borrowed in place, the GIL released).

use crate::blocks::{as_value_error, overlaps, raw_matrices, raw_parts, value_error};
use crate::convert::{typed_array, TypedArray};
use kvshare_kernels::blocks::BlockType;
use kvshare_kernels::decode::{
    decode_layer as core_decode_layer, LayerShape, LayerWeights, StepRows,
};
use kvshare_kernels::rowops::Glu;
use kvshare_kernels::{KernelError, Queries, F16};
use pyo3::exceptions::PyIndexError;
use pyo3::prelude::*;
use pyo3::types::PyTuple;

/// `typed_array`, its InvalidArgument as ValueError (what the layer promises for every bad
/// argument, as the block kernels do).
fn array<'py>(
    obj: &Bound<'py, PyAny>,
    kind: u8,
    itemsize: usize,
    writable: bool,
    what: &str,
) -> PyResult<TypedArray<'py>> {
    typed_array(obj, kind, itemsize, writable, what)
        .map_err(|e| Python::attach(|py| as_value_error(py, e)))
}

/// A weight's parts: a `(raws, qtypes)` pair (see `raw_parts`) of rows of `k` values.
fn parts<'py>(
    obj: &Bound<'py, PyAny>,
    k: usize,
) -> PyResult<Vec<(TypedArray<'py>, BlockType, usize)>> {
    let (raws, qtypes): (Vec<Bound<'py, PyAny>>, Vec<u32>) = obj
        .extract()
        .map_err(|_| value_error("a weight is a (raws, qtypes) pair of lists"))?;
    raw_parts(obj.py(), &raws, &qtypes, k)
}

/// An f32 vector, or None (the model has no such tensor): empty.
fn vector<'py>(obj: &Bound<'py, PyAny>, what: &str) -> PyResult<Option<TypedArray<'py>>> {
    if obj.is_none() {
        return Ok(None);
    }
    array(obj, b'f', 4, false, what).map(Some)
}

fn slice_of<'a>(a: &'a Option<TypedArray<'_>>) -> &'a [f32] {
    // SAFETY: dtype f32 checked by typed_array; the array stays referenced for the call
    a.as_ref().map_or(&[], |a| unsafe { a.as_slice::<f32>() })
}

/// One decoder layer of a decode step, in place on `x` (float32 `[n, n_embd]`): the same
/// operations and float formulas as `DecoderModel`'s Python ops (see
/// `kvshare_kernels::decode`). `layer`: `(attn_norm, wqkv, bqkv, q_norm, k_norm, wo,
/// post_attn_norm, ffn_norm, w_gate_up, w_down, post_ffn_norm)`, each weight a
/// `(raws, qtypes)` pair, each optional vector None when absent. `shape`: `(n_head, n_kv,
/// head_dim, eps, neox, activation, window, scale)`. The rest as `paged_attention`'s and
/// `write_kv`'s arguments (an f32 or f16 pool).
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn decode_layer(
    py: Python<'_>,
    layer: &Bound<'_, PyTuple>,
    shape: (usize, usize, usize, f32, bool, String, usize, f32),
    x: &Bound<'_, PyAny>,
    cos: &Bound<'_, PyAny>,
    sin: &Bound<'_, PyAny>,
    slots: &Bound<'_, PyAny>,
    k_cache: &Bound<'_, PyAny>,
    v_cache: &Bound<'_, PyAny>,
    block_tables: &Bound<'_, PyAny>,
    q_starts: &Bound<'_, PyAny>,
    start_positions: &Bound<'_, PyAny>,
    max_rows: usize,
    invariant: bool,
    threads: usize,
) -> PyResult<()> {
    let (n_head, n_kv, head_dim, eps, neox, act, window, scale) = shape;
    let glu = match act.as_str() {
        "gelu_tanh" => Glu::GeluTanh,
        "silu" => Glu::Silu,
        other => return Err(value_error(format!("unknown activation {other:?}"))),
    };
    if layer.len() != 11 {
        return Err(value_error("layer must be an 11-tuple of weights"));
    }
    let xa = array(x, b'f', 4, true, "x")?;
    let &[n, d] = xa.shape.as_slice() else {
        return Err(value_error("x must be 2-D float32 [n, n_embd]"));
    };
    let item = |i: usize| layer.get_item(i);
    let qd = n_head * head_dim;
    let gu = parts(&item(8)?, d)?;
    let ff = gu.iter().map(|p| p.2).sum::<usize>() / 2;
    let (wqkv, wo, down) = (
        parts(&item(1)?, d)?,
        parts(&item(5)?, qd)?,
        parts(&item(9)?, ff)?,
    );
    let vectors =
        [0, 2, 3, 4, 6, 7, 10].map(|i| item(i).and_then(|o| vector(&o, "a norm or bias")));
    let [attn_norm, bqkv, q_norm, k_norm, post_attn_norm, ffn_norm, post_ffn_norm] = vectors;
    let (attn_norm, bqkv, q_norm, k_norm) = (attn_norm?, bqkv?, q_norm?, k_norm?);
    let (post_attn_norm, ffn_norm, post_ffn_norm) = (post_attn_norm?, ffn_norm?, post_ffn_norm?);
    if attn_norm.is_none() || ffn_norm.is_none() {
        return Err(value_error("attn_norm and ffn_norm are required"));
    }
    for (v, len) in [
        (&attn_norm, d),
        (&ffn_norm, d),
        (&post_attn_norm, d),
        (&post_ffn_norm, d),
    ] {
        if v.as_ref().is_some_and(|a| a.shape != [len]) {
            return Err(value_error(format!("a norm must have {len} values")));
        }
    }
    let ca = array(cos, b'f', 4, false, "cos")?;
    let sa = array(sin, b'f', 4, false, "sin")?;
    let pa = array(slots, b'i', 8, false, "slots")?;
    let ta = array(block_tables, b'i', 4, false, "block_tables")?;
    let qa = array(q_starts, b'i', 8, false, "q_starts")?;
    let spa = array(start_positions, b'i', 8, false, "start_positions")?;
    let &[n_seq, width] = ta.shape.as_slice() else {
        return Err(value_error("block_tables must be 2-D"));
    };
    if qa.shape != [n_seq + 1] || spa.shape != [n_seq] {
        return Err(value_error(
            "start_positions must be [n_seq] and q_starts [n_seq + 1]",
        ));
    }
    let itemsize = k_cache
        .getattr("dtype")
        .and_then(|d| d.getattr("itemsize"))
        .and_then(|n| n.extract::<usize>())
        .map_err(|_| value_error("k_cache must be a NumPy array"))?;
    let kind = b'f';
    if itemsize != 2 && itemsize != 4 {
        return Err(value_error("the fused layer takes an f32 or f16 pool"));
    }
    let ka = array(k_cache, kind, itemsize, true, "k_cache")?;
    let va = array(v_cache, kind, itemsize, true, "v_cache")?;
    let &[_, block_size, pool_kv, pool_hd] = ka.shape.as_slice() else {
        return Err(value_error(
            "k_cache must be [n_blocks, block_size, n_kv_heads, head_dim]",
        ));
    };
    if va.shape != ka.shape || pool_kv != n_kv || pool_hd != head_dim {
        return Err(value_error(
            "k_cache and v_cache must be [n_blocks, block_size, n_kv, head_dim]",
        ));
    }
    // x, the pool's K and V are written: none may overlap another array
    let written = [xa.span(4), ka.span(itemsize), va.span(itemsize)];
    let mut read: Vec<(usize, usize)> = vec![
        ca.span(4),
        sa.span(4),
        pa.span(8),
        ta.span(4),
        qa.span(8),
        spa.span(8),
    ];
    for ps in [&wqkv, &wo, &gu, &down] {
        read.extend(ps.iter().map(|p| p.0.span(1)));
    }
    for v in [
        &attn_norm,
        &bqkv,
        &q_norm,
        &k_norm,
        &post_attn_norm,
        &ffn_norm,
        &post_ffn_norm,
    ]
    .into_iter()
    .flatten()
    {
        read.push(v.span(4));
    }
    for (i, w) in written.iter().enumerate() {
        if read
            .iter()
            .chain(&written[i + 1..])
            .any(|r| overlaps(*w, *r))
        {
            return Err(value_error(
                "x, k_cache and v_cache must not overlap another array",
            ));
        }
    }
    let (mqkv, mo, mgu, mdown) = (
        raw_matrices(&wqkv, d),
        raw_matrices(&wo, qd),
        raw_matrices(&gu, d),
        raw_matrices(&down, ff),
    );
    let weights = LayerWeights {
        attn_norm: slice_of(&attn_norm),
        wqkv: &mqkv,
        bqkv: slice_of(&bqkv),
        q_norm: slice_of(&q_norm),
        k_norm: slice_of(&k_norm),
        wo: &mo,
        post_attn_norm: slice_of(&post_attn_norm),
        ffn_norm: slice_of(&ffn_norm),
        w_gate_up: &mgu,
        w_down: &mdown,
        post_ffn_norm: slice_of(&post_ffn_norm),
    };
    let s = LayerShape {
        n_head,
        n_kv,
        head_dim,
        eps,
        neox,
        glu,
        window,
        scale,
    };
    // SAFETY: dtypes checked by typed_array; the written arrays overlap nothing (above); all
    // arrays stay referenced for this call
    let (xs, cs, ss, ps, ts, qs, sps) = unsafe {
        (
            xa.as_mut_slice::<f32>(),
            ca.as_slice::<f32>(),
            sa.as_slice::<f32>(),
            pa.as_slice::<i64>(),
            ta.as_slice::<i32>(),
            qa.as_slice::<i64>(),
            spa.as_slice::<i64>(),
        )
    };
    let rows = StepRows {
        n,
        cos: cs,
        sin: ss,
        slots: ps,
        queries: Queries {
            q: &[],
            n_head,
            tables: ts,
            width,
            q_starts: qs,
            start_positions: sps,
        },
    };
    let threads = threads.max(1);
    // SAFETY (both arms): the element type is the pool's (itemsize checked above); K and V
    // overlap no other array and nothing else borrows them
    let res = if itemsize == 2 {
        let (kc, vc) = unsafe { (ka.as_mut_slice::<F16>(), va.as_mut_slice::<F16>()) };
        py.detach(|| {
            core_decode_layer(
                &weights, &s, xs, &rows, kc, vc, block_size, max_rows, invariant, threads,
            )
        })
    } else {
        let (kc, vc) = unsafe { (ka.as_mut_slice::<f32>(), va.as_mut_slice::<f32>()) };
        py.detach(|| {
            core_decode_layer(
                &weights, &s, xs, &rows, kc, vc, block_size, max_rows, invariant, threads,
            )
        })
    };
    res.map_err(|e| match e {
        KernelError::Uncovered(m) => PyIndexError::new_err(m),
        e => value_error(e.to_string()),
    })
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(decode_layer, m)?)
}
