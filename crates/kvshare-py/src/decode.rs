//! Binding of `kvshare_kernels::decode::decode_layer`: one attention + MLP layer of a CPU
//! decode step in one call (arrays borrowed in place, the GIL released).

use crate::blocks::{as_value_error, overlaps, raw_parts, value_error};
use crate::convert::{typed_array, TypedArray};
use kvshare_kernels::blocks::{BlockMatrix, BlockType};
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

/// A weight part borrowed from its array: data address, bytes, type, rows.
#[derive(Clone, Copy)]
struct Part {
    ptr: usize,
    len: usize,
    ty: BlockType,
    n: usize,
}

/// A layer's weights checked and borrowed (from a `FusedLayer`, or from the 11-tuple for
/// one call): parts of `wqkv`, `wo`, `w_gate_up`, `w_down`, and the seven vectors
/// `(attn_norm, bqkv, q_norm, k_norm, post_attn_norm, ffn_norm, post_ffn_norm)` as (address,
/// values), `None` where absent.
#[derive(Clone)]
struct Borrowed {
    d: usize,
    qd: usize,
    weights: [Vec<Part>; 4],
    vectors: [Option<(usize, usize)>; 7],
}

impl Borrowed {
    /// Checks the 11-tuple `layer` of a model with `d`-wide rows and `qd` query values per
    /// row; `keep` holds the arrays' references for as long as the result is used.
    fn new<'py>(
        layer: &Bound<'py, PyTuple>,
        d: usize,
        qd: usize,
        keep: &mut Vec<Bound<'py, PyAny>>,
    ) -> PyResult<Self> {
        if layer.len() != 11 {
            return Err(value_error("layer must be an 11-tuple of weights"));
        }
        let item = |i: usize| layer.get_item(i);
        let borrow = |ps: Vec<(TypedArray<'py>, BlockType, usize)>, keep: &mut Vec<_>| {
            ps.into_iter()
                .map(|(a, ty, n)| {
                    let (ptr, end) = a.span(1);
                    keep.push(a.owner().clone());
                    Part {
                        ptr,
                        len: end - ptr,
                        ty,
                        n,
                    }
                })
                .collect::<Vec<_>>()
        };
        let gu = parts(&item(8)?, d)?;
        let ff = gu.iter().map(|p| p.2).sum::<usize>() / 2;
        let wqkv = borrow(parts(&item(1)?, d)?, keep);
        let wo = borrow(parts(&item(5)?, qd)?, keep);
        let gu = borrow(gu, keep);
        let down = borrow(parts(&item(9)?, ff)?, keep);
        let mut vectors = [None; 7];
        for (slot, i) in vectors.iter_mut().zip([0, 2, 3, 4, 6, 7, 10]) {
            if let Some(a) = vector(&item(i)?, "a norm or bias")? {
                let (ptr, end) = a.span(4);
                keep.push(a.owner().clone());
                *slot = Some((ptr, (end - ptr) / 4));
            }
        }
        let [attn_norm, _, _, _, post_attn_norm, ffn_norm, post_ffn_norm] = vectors;
        if attn_norm.is_none() || ffn_norm.is_none() {
            return Err(value_error("attn_norm and ffn_norm are required"));
        }
        for v in [attn_norm, ffn_norm, post_attn_norm, post_ffn_norm]
            .into_iter()
            .flatten()
        {
            if v.1 != d {
                return Err(value_error(format!("a norm must have {d} values")));
            }
        }
        Ok(Borrowed {
            d,
            qd,
            weights: [wqkv, wo, gu, down],
            vectors,
        })
    }

    /// The arrays' `[start, end)` addresses.
    fn spans(&self) -> impl Iterator<Item = (usize, usize)> + '_ {
        let parts = self
            .weights
            .iter()
            .flatten()
            .map(|p| (p.ptr, p.ptr + p.len));
        let vecs = self.vectors.iter().flatten().map(|&(p, n)| (p, p + 4 * n));
        parts.chain(vecs)
    }

    /// The kernels' matrices of weight `w`, rows of `k` values.
    /// SAFETY: the arrays are alive (referenced) and unchanged while they are used.
    unsafe fn matrices(&self, w: usize, k: usize) -> Vec<BlockMatrix<'_>> {
        self.weights[w]
            .iter()
            .map(|p| BlockMatrix {
                // SAFETY: see above; ptr/len describe a u8 array's data
                raw: unsafe { std::slice::from_raw_parts(p.ptr as *const u8, p.len) },
                ty: p.ty,
                n: p.n,
                k,
            })
            .collect()
    }

    /// Vector `i` (see the struct), empty when absent.
    /// SAFETY: as `matrices`.
    unsafe fn vector(&self, i: usize) -> &[f32] {
        self.vectors[i].map_or(&[], |(p, n)| unsafe {
            std::slice::from_raw_parts(p as *const f32, n)
        })
    }
}

/// A layer's weights for `decode_layer`, checked and borrowed once: `FusedLayer(layer,
/// shape)` with `decode_layer`'s 11-tuple and shape tuple. Passed in the tuple's place, it
/// saves re-reading ~13 arrays' buffers every decode step (~1 us apiece). It holds the
/// arrays (they must not be changed while it lives; a model's weights are not).
#[pyclass(frozen, module = "kvshare._core")]
pub struct FusedLayer {
    weights: Borrowed,
    _owners: Vec<Py<PyAny>>,
}

#[pymethods]
impl FusedLayer {
    #[new]
    fn new(
        layer: &Bound<'_, PyTuple>,
        shape: (usize, usize, usize, f32, bool, String, usize, f32),
    ) -> PyResult<Self> {
        let (n_head, _, head_dim, ..) = shape;
        if layer.len() != 11 {
            return Err(value_error("layer must be an 11-tuple of weights"));
        }
        let attn_norm = vector(&layer.get_item(0)?, "attn_norm")?
            .ok_or_else(|| value_error("attn_norm and ffn_norm are required"))?;
        let d = attn_norm.shape.iter().product::<usize>();
        let mut keep = Vec::new();
        let weights = Borrowed::new(layer, d, n_head * head_dim, &mut keep)?;
        Ok(FusedLayer {
            weights,
            _owners: keep.into_iter().map(Bound::unbind).collect(),
        })
    }
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
    layer: &Bound<'_, PyAny>,
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
    let xa = array(x, b'f', 4, true, "x")?;
    let &[n, d] = xa.shape.as_slice() else {
        return Err(value_error("x must be 2-D float32 [n, n_embd]"));
    };
    let qd = n_head * head_dim;
    let mut keep = Vec::new();
    let prepared;
    let w: &Borrowed = match layer.cast::<FusedLayer>() {
        Ok(f) => {
            prepared = f.get().weights.clone();
            if prepared.d != d || prepared.qd != qd {
                return Err(value_error(format!(
                    "the layer was prepared for rows of {} and {} query values, not {d} and {qd}",
                    prepared.d, prepared.qd
                )));
            }
            &prepared
        }
        Err(_) => {
            let tuple = layer
                .cast::<PyTuple>()
                .map_err(|_| value_error("layer must be an 11-tuple of weights or a FusedLayer"))?;
            prepared = Borrowed::new(tuple, d, qd, &mut keep)?;
            &prepared
        }
    };
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
    read.extend(w.spans());
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
    let ff = w.weights[2].iter().map(|p| p.n).sum::<usize>() / 2;
    // SAFETY: the arrays are referenced (by `keep` or the FusedLayer) for this call, and a
    // model's weights do not change
    let (mqkv, mo, mgu, mdown) = unsafe {
        (
            w.matrices(0, d),
            w.matrices(1, qd),
            w.matrices(2, d),
            w.matrices(3, ff),
        )
    };
    // SAFETY: as above
    let v = |i| unsafe { w.vector(i) };
    let weights = LayerWeights {
        attn_norm: v(0),
        wqkv: &mqkv,
        bqkv: v(1),
        q_norm: v(2),
        k_norm: v(3),
        wo: &mo,
        post_attn_norm: v(4),
        ffn_norm: v(5),
        w_gate_up: &mgu,
        w_down: &mdown,
        post_ffn_norm: v(6),
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
    m.add_class::<FusedLayer>()?;
    m.add_function(wrap_pyfunction!(decode_layer, m)?)
}
