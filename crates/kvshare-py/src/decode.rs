//! Binding of `kvshare_kernels::decode::decode_layer`: attention + MLP layers of a CPU
//! decode step, one (`decode_layer`) or a run of them (`decode_layers`) in one call, arrays
//! borrowed in place and the GIL released; `FusedLayer` holds a layer's weights checked once.

use crate::blocks::{as_value_error, overlaps, raw_parts, value_error};
use crate::convert::{typed_array, TypedArray};
use kvshare_kernels::blocks::{BlockMatrix, BlockType};
use kvshare_kernels::decode::{
    decode_layer as core_decode_layer, LayerShape, LayerWeights, StepRows,
};
use kvshare_kernels::rowops::Glu;
use kvshare_kernels::{KernelError, Queries, F16};
use pyo3::exceptions::PyIndexError;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyList, PyTuple};

/// A layer's shape tuple: `(n_head, n_kv, head_dim, eps, neox, activation, window, scale)`.
type ShapeArgs = (usize, usize, usize, f32, bool, String, usize, f32);

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
    fn new(layer: &Bound<'_, PyTuple>, shape: ShapeArgs) -> PyResult<Self> {
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

/// The step's arrays shared by its layers: `x` (written) and the sequences' `q_starts` and
/// `start_positions`.
struct StepArrays<'py> {
    x: TypedArray<'py>,
    n: usize,
    d: usize,
    q_starts: TypedArray<'py>,
    start_positions: TypedArray<'py>,
    n_seq: usize,
}

impl<'py> StepArrays<'py> {
    fn new(
        x: &Bound<'py, PyAny>,
        q_starts: &Bound<'py, PyAny>,
        start_positions: &Bound<'py, PyAny>,
    ) -> PyResult<Self> {
        let xa = array(x, b'f', 4, true, "x")?;
        let &[n, d] = xa.shape.as_slice() else {
            return Err(value_error("x must be 2-D float32 [n, n_embd]"));
        };
        let qa = array(q_starts, b'i', 8, false, "q_starts")?;
        let spa = array(start_positions, b'i', 8, false, "start_positions")?;
        let &[n_seq] = spa.shape.as_slice() else {
            return Err(value_error("start_positions must be [n_seq]"));
        };
        if qa.shape != [n_seq + 1] {
            return Err(value_error(
                "start_positions must be [n_seq] and q_starts [n_seq + 1]",
            ));
        }
        Ok(StepArrays {
            x: xa,
            n,
            d,
            q_starts: qa,
            start_positions: spa,
            n_seq,
        })
    }
}

/// One layer's arguments, checked (with the GIL).
struct CheckedLayer<'py> {
    w: Borrowed,
    s: LayerShape,
    ff: usize,
    cos: TypedArray<'py>,
    sin: TypedArray<'py>,
    slots: TypedArray<'py>,
    tables: TypedArray<'py>,
    width: usize,
    k: TypedArray<'py>,
    v: TypedArray<'py>,
    itemsize: usize,
    block_size: usize,
}

#[allow(clippy::too_many_arguments)]
fn check_layer<'py>(
    step: &StepArrays<'py>,
    layer: &Bound<'py, PyAny>,
    shape: &ShapeArgs,
    cos: &Bound<'py, PyAny>,
    sin: &Bound<'py, PyAny>,
    slots: &Bound<'py, PyAny>,
    k_cache: &Bound<'py, PyAny>,
    v_cache: &Bound<'py, PyAny>,
    block_tables: &Bound<'py, PyAny>,
    keep: &mut Vec<Bound<'py, PyAny>>,
) -> PyResult<CheckedLayer<'py>> {
    let &(n_head, n_kv, head_dim, eps, neox, ref act, window, scale) = shape;
    let glu = match act.as_str() {
        "gelu_tanh" => Glu::GeluTanh,
        "silu" => Glu::Silu,
        other => return Err(value_error(format!("unknown activation {other:?}"))),
    };
    let (d, qd) = (step.d, n_head * head_dim);
    let w = match layer.cast::<FusedLayer>() {
        Ok(f) => {
            let w = f.get().weights.clone();
            if w.d != d || w.qd != qd {
                return Err(value_error(format!(
                    "the layer was prepared for rows of {} and {} query values, not {d} and {qd}",
                    w.d, w.qd
                )));
            }
            w
        }
        Err(_) => {
            let tuple = layer
                .cast::<PyTuple>()
                .map_err(|_| value_error("layer must be an 11-tuple of weights or a FusedLayer"))?;
            Borrowed::new(tuple, d, qd, keep)?
        }
    };
    let ff = w.weights[2].iter().map(|p| p.n).sum::<usize>() / 2;
    let cos = array(cos, b'f', 4, false, "cos")?;
    let sin = array(sin, b'f', 4, false, "sin")?;
    let slots = array(slots, b'i', 8, false, "slots")?;
    let tables = array(block_tables, b'i', 4, false, "block_tables")?;
    let &[n_seq, width] = tables.shape.as_slice() else {
        return Err(value_error("block_tables must be 2-D"));
    };
    if n_seq != step.n_seq {
        return Err(value_error(
            "start_positions must be [n_seq] and q_starts [n_seq + 1]",
        ));
    }
    let itemsize = k_cache
        .getattr(intern!(k_cache.py(), "dtype"))
        .and_then(|d| d.getattr(intern!(k_cache.py(), "itemsize")))
        .and_then(|n| n.extract::<usize>())
        .map_err(|_| value_error("k_cache must be a NumPy array"))?;
    if itemsize != 2 && itemsize != 4 {
        return Err(value_error("the fused layer takes an f32 or f16 pool"));
    }
    let k = array(k_cache, b'f', itemsize, true, "k_cache")?;
    let v = array(v_cache, b'f', itemsize, true, "v_cache")?;
    let &[_, block_size, pool_kv, pool_hd] = k.shape.as_slice() else {
        return Err(value_error(
            "k_cache must be [n_blocks, block_size, n_kv_heads, head_dim]",
        ));
    };
    if v.shape != k.shape || pool_kv != n_kv || pool_hd != head_dim {
        return Err(value_error(
            "k_cache and v_cache must be [n_blocks, block_size, n_kv, head_dim]",
        ));
    }
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
    Ok(CheckedLayer {
        w,
        s,
        ff,
        cos,
        sin,
        slots,
        tables,
        width,
        k,
        v,
        itemsize,
        block_size,
    })
}

/// Refuses arrays written by a call (`x`, every layer's K and V) that overlap any other
/// array of the call.
fn check_overlaps(step: &StepArrays<'_>, layers: &[CheckedLayer<'_>]) -> PyResult<()> {
    let mut written = vec![step.x.span(4)];
    let mut read = vec![step.q_starts.span(8), step.start_positions.span(8)];
    for c in layers {
        written.push(c.k.span(c.itemsize));
        written.push(c.v.span(c.itemsize));
        read.extend([
            c.cos.span(4),
            c.sin.span(4),
            c.slots.span(8),
            c.tables.span(4),
        ]);
        read.extend(c.w.spans());
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
    Ok(())
}

/// A layer's pool: f16 or f32 rows.
enum Pool<'a> {
    F16(&'a mut [F16], &'a mut [F16]),
    F32(&'a mut [f32], &'a mut [f32]),
}

/// A checked layer's data as plain slices (no Python objects: it runs without the GIL).
struct PlainLayer<'a> {
    mats: [Vec<BlockMatrix<'a>>; 4],
    vecs: [&'a [f32]; 7],
    s: LayerShape,
    cos: &'a [f32],
    sin: &'a [f32],
    slots: &'a [i64],
    tables: &'a [i32],
    width: usize,
    pool: Pool<'a>,
    block_size: usize,
}

impl<'a> PlainLayer<'a> {
    /// SAFETY: the arrays are referenced for as long as the result lives; the written ones
    /// (K and V) overlap no other array (`check_overlaps`) and are borrowed nowhere else.
    unsafe fn new(c: &'a CheckedLayer<'_>, d: usize) -> Self {
        let (qd, ff) = (c.s.n_head * c.s.head_dim, c.ff);
        // SAFETY: see above; the dtypes were checked by typed_array
        unsafe {
            PlainLayer {
                mats: [
                    c.w.matrices(0, d),
                    c.w.matrices(1, qd),
                    c.w.matrices(2, d),
                    c.w.matrices(3, ff),
                ],
                vecs: std::array::from_fn(|i| c.w.vector(i)),
                s: c.s,
                cos: c.cos.as_slice::<f32>(),
                sin: c.sin.as_slice::<f32>(),
                slots: c.slots.as_slice::<i64>(),
                tables: c.tables.as_slice::<i32>(),
                width: c.width,
                pool: if c.itemsize == 2 {
                    Pool::F16(c.k.as_mut_slice::<F16>(), c.v.as_mut_slice::<F16>())
                } else {
                    Pool::F32(c.k.as_mut_slice::<f32>(), c.v.as_mut_slice::<f32>())
                },
                block_size: c.block_size,
            }
        }
    }

    /// The layer over the rows `x` (`n` of them; the sequences' `q_starts` and
    /// `start_positions`).
    #[allow(clippy::too_many_arguments)]
    fn run(
        &mut self,
        x: &mut [f32],
        n: usize,
        q_starts: &[i64],
        start_positions: &[i64],
        max_rows: usize,
        invariant: bool,
        threads: usize,
    ) -> Result<(), KernelError> {
        let [wqkv, wo, w_gate_up, w_down] = &self.mats;
        let v = &self.vecs;
        let weights = LayerWeights {
            attn_norm: v[0],
            wqkv,
            bqkv: v[1],
            q_norm: v[2],
            k_norm: v[3],
            wo,
            post_attn_norm: v[4],
            ffn_norm: v[5],
            w_gate_up,
            w_down,
            post_ffn_norm: v[6],
        };
        let rows = StepRows {
            n,
            cos: self.cos,
            sin: self.sin,
            slots: self.slots,
            queries: Queries {
                q: &[],
                n_head: self.s.n_head,
                tables: self.tables,
                width: self.width,
                q_starts,
                start_positions,
            },
        };
        let (s, bs) = (&self.s, self.block_size);
        match &mut self.pool {
            Pool::F16(k, v) => core_decode_layer(
                &weights, s, x, &rows, k, v, bs, max_rows, invariant, threads,
            ),
            Pool::F32(k, v) => core_decode_layer(
                &weights, s, x, &rows, k, v, bs, max_rows, invariant, threads,
            ),
        }
    }
}

fn kernel_error(e: KernelError) -> PyErr {
    match e {
        KernelError::Uncovered(m) => PyIndexError::new_err(m),
        e => value_error(e.to_string()),
    }
}

/// A layer's arguments: the layer, its shape, and `[cos, sin, slots, k_cache, v_cache,
/// block_tables]`.
type LayerArgs<'py> = (Bound<'py, PyAny>, ShapeArgs, [Bound<'py, PyAny>; 6]);

/// Checks `layers` (each `(layer, shape, cos, sin, slots, k_cache, v_cache, block_tables)`)
/// and runs them in order over `x` with the GIL released once.
#[allow(clippy::too_many_arguments)]
fn run_layers<'py>(
    py: Python<'py>,
    layers: &[LayerArgs<'py>],
    x: &Bound<'py, PyAny>,
    q_starts: &Bound<'py, PyAny>,
    start_positions: &Bound<'py, PyAny>,
    max_rows: usize,
    invariant: bool,
    threads: usize,
) -> PyResult<()> {
    let step = StepArrays::new(x, q_starts, start_positions)?;
    let mut keep = Vec::new();
    let checked = layers
        .iter()
        .map(|(layer, shape, [cos, sin, slots, kc, vc, tables])| {
            check_layer(
                &step, layer, shape, cos, sin, slots, kc, vc, tables, &mut keep,
            )
        })
        .collect::<PyResult<Vec<_>>>()?;
    check_overlaps(&step, &checked)?;
    let d = step.d;
    // SAFETY: every array is referenced (by `step`, `checked` and `keep`) until this returns;
    // the written ones overlap nothing else (checked above), and each is borrowed once here
    let mut plain: Vec<PlainLayer<'_>> = checked
        .iter()
        .map(|c| unsafe { PlainLayer::new(c, d) })
        .collect();
    let (xs, qs, sps) = unsafe {
        (
            step.x.as_mut_slice::<f32>(),
            step.q_starts.as_slice::<i64>(),
            step.start_positions.as_slice::<i64>(),
        )
    };
    let (n, threads) = (step.n, threads.max(1));
    py.detach(|| {
        plain
            .iter_mut()
            .try_for_each(|l| l.run(xs, n, qs, sps, max_rows, invariant, threads))
    })
    .map_err(kernel_error)
}

/// One decoder layer of a decode step, in place on `x` (float32 `[n, n_embd]`): the same
/// operations and float formulas as `DecoderModel`'s Python ops (see
/// `kvshare_kernels::decode`). `layer`: a `FusedLayer`, or `(attn_norm, wqkv, bqkv, q_norm,
/// k_norm, wo, post_attn_norm, ffn_norm, w_gate_up, w_down, post_ffn_norm)`, each weight a
/// `(raws, qtypes)` pair, each optional vector None when absent. `shape`: `(n_head, n_kv,
/// head_dim, eps, neox, activation, window, scale)`. The rest as `paged_attention`'s and
/// `write_kv`'s arguments (an f32 or f16 pool).
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn decode_layer<'py>(
    py: Python<'py>,
    layer: &Bound<'py, PyAny>,
    shape: ShapeArgs,
    x: &Bound<'py, PyAny>,
    cos: &Bound<'py, PyAny>,
    sin: &Bound<'py, PyAny>,
    slots: &Bound<'py, PyAny>,
    k_cache: &Bound<'py, PyAny>,
    v_cache: &Bound<'py, PyAny>,
    block_tables: &Bound<'py, PyAny>,
    q_starts: &Bound<'py, PyAny>,
    start_positions: &Bound<'py, PyAny>,
    max_rows: usize,
    invariant: bool,
    threads: usize,
) -> PyResult<()> {
    let arrays = [cos, sin, slots, k_cache, v_cache, block_tables].map(|a| a.clone());
    run_layers(
        py,
        &[(layer.clone(), shape, arrays)],
        x,
        q_starts,
        start_positions,
        max_rows,
        invariant,
        threads,
    )
}

/// `decode_layer` for consecutive layers of one step in one call: `layers` is a list of
/// `(layer, shape, cos, sin, slots, k_cache, v_cache, block_tables)`, run in order over `x`
/// (each layer's arguments as `decode_layer`'s). Every layer is checked before any runs.
/// A decode step of Gemma 3 270M spent ~30 us a layer between Python and the kernels.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn decode_layers<'py>(
    py: Python<'py>,
    layers: &Bound<'py, PyList>,
    x: &Bound<'py, PyAny>,
    q_starts: &Bound<'py, PyAny>,
    start_positions: &Bound<'py, PyAny>,
    max_rows: usize,
    invariant: bool,
    threads: usize,
) -> PyResult<()> {
    let calls = layers
        .iter()
        .map(|t| {
            let t = t
                .cast_into::<PyTuple>()
                .ok()
                .filter(|t| t.len() == 8)
                .ok_or_else(|| {
                    value_error("each layer is an 8-tuple of decode_layer's arguments")
                })?;
            let shape = t.get_item(1)?.extract()?;
            let arrays = [2, 3, 4, 5, 6, 7].map(|i| t.get_item(i));
            let [a, b, c, d, e, f] = arrays;
            Ok((t.get_item(0)?, shape, [a?, b?, c?, d?, e?, f?]))
        })
        .collect::<PyResult<Vec<_>>>()?;
    run_layers(
        py,
        &calls,
        x,
        q_starts,
        start_positions,
        max_rows,
        invariant,
        threads,
    )
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<FusedLayer>()?;
    m.add_function(wrap_pyfunction!(decode_layer, m)?)?;
    m.add_function(wrap_pyfunction!(decode_layers, m)?)
}
