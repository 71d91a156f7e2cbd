//! Binding of chain hashing (`root_key`, `chain_key`, `hash_blocks`, `prefix_key`) and the block
//! pool (`BlockPool`). Checkpoints and the RAM tier are in `ckpt.rs` and `ram.rs`, registered
//! from here. Conversions only: all logic is in kvshare-core.

use crate::convert::{id_of, ids_of, invalid, key_of, key_to_py, keys_of, keys_to_py, tokens_of};
use crate::errors::IntoPyResult;
use kvshare_core::hash;
use kvshare_core::pool::{BlockId, BlockPool};
use parking_lot::Mutex;
use pyo3::exceptions::PyAssertionError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};

fn block_size_of(block_size: usize) -> PyResult<usize> {
    if block_size == 0 {
        return Err(invalid("block_size must be > 0"));
    }
    Ok(block_size)
}

/// Root key of every chain: model fingerprint, KV dtype, block size, optional cache salt.
#[pyfunction]
#[pyo3(signature = (fingerprint, kv_dtype, block_size, cache_salt = None))]
fn root_key<'py>(
    py: Python<'py>,
    fingerprint: &[u8],
    kv_dtype: &str,
    block_size: u32,
    cache_salt: Option<&[u8]>,
) -> Bound<'py, PyBytes> {
    key_to_py(
        py,
        &hash::root_key(fingerprint, kv_dtype, block_size, cache_salt),
    )
}

/// Key of one full block: H(parent, tokens, extra).
#[pyfunction]
#[pyo3(signature = (parent, tokens, extra = None))]
fn chain_key<'py>(
    py: Python<'py>,
    parent: &[u8],
    tokens: &Bound<'py, PyAny>,
    extra: Option<&[u8]>,
) -> PyResult<Bound<'py, PyBytes>> {
    let parent = key_of(parent)?;
    let tokens = tokens_of(tokens)?;
    Ok(key_to_py(
        py,
        &hash::chain_key(&parent, &tokens, extra.unwrap_or(b"")),
    ))
}

/// Keys of all full blocks of `tokens` (GIL released while hashing).
#[pyfunction]
#[pyo3(signature = (root, tokens, block_size, extra = None))]
fn hash_blocks<'py>(
    py: Python<'py>,
    root: &[u8],
    tokens: &Bound<'py, PyAny>,
    block_size: usize,
    extra: Option<&[u8]>,
) -> PyResult<Bound<'py, PyList>> {
    let root = key_of(root)?;
    let bs = block_size_of(block_size)?;
    let tokens = tokens_of(tokens)?;
    let extra = extra.unwrap_or(b"");
    let keys = py.detach(|| hash::hash_blocks(&root, &tokens, bs, extra));
    keys_to_py(py, &keys)
}

/// Key of the prefix `tokens` at any position (GIL released while hashing).
#[pyfunction]
#[pyo3(signature = (root, tokens, block_size, extra = None))]
fn prefix_key<'py>(
    py: Python<'py>,
    root: &[u8],
    tokens: &Bound<'py, PyAny>,
    block_size: usize,
    extra: Option<&[u8]>,
) -> PyResult<Bound<'py, PyBytes>> {
    let root = key_of(root)?;
    let bs = block_size_of(block_size)?;
    let tokens = tokens_of(tokens)?;
    let extra = extra.unwrap_or(b"");
    let k = py.detach(|| hash::prefix_key(&root, &tokens, bs, extra));
    Ok(key_to_py(py, &k))
}

/// The fixed-size KV block pool (bookkeeping only; Python owns the KV arrays).
#[pyclass(frozen, name = "BlockPool", module = "kvshare._core")]
pub struct PyBlockPool {
    inner: Mutex<BlockPool>,
}

#[pymethods]
impl PyBlockPool {
    #[new]
    fn new(n_blocks: usize, block_size: usize) -> PyResult<Self> {
        Ok(PyBlockPool {
            inner: Mutex::new(BlockPool::new(n_blocks, block_size).py_err()?),
        })
    }

    #[getter]
    fn n_blocks(&self) -> usize {
        self.inner.lock().n_blocks()
    }

    #[getter]
    fn block_size(&self) -> usize {
        self.inner.lock().block_size()
    }

    /// Free + cached blocks: how many `allocate` calls can succeed now.
    fn available(&self) -> usize {
        self.inner.lock().available()
    }

    fn allocate(&self, parent: &[u8]) -> PyResult<BlockId> {
        let parent = key_of(parent)?;
        self.inner.lock().allocate(parent).py_err()
    }

    fn acquire(&self, ids: Vec<i64>) -> PyResult<()> {
        let ids = ids_of(ids)?;
        self.inner.lock().acquire(&ids).py_err()
    }

    fn release(&self, ids: Vec<i64>) -> PyResult<()> {
        let ids = ids_of(ids)?;
        self.inner.lock().release(&ids).py_err()
    }

    fn append_tokens(&self, id: i64, tokens: &Bound<'_, PyAny>) -> PyResult<()> {
        let id = id_of(id)?;
        let tokens = tokens_of(tokens)?;
        self.inner.lock().append_tokens(id, &tokens).py_err()
    }

    fn register(&self, id: i64, key: &[u8]) -> PyResult<BlockId> {
        let id = id_of(id)?;
        let key = key_of(key)?;
        self.inner.lock().register(id, key).py_err()
    }

    fn lookup(&self, key: &[u8]) -> PyResult<Option<BlockId>> {
        let key = key_of(key)?;
        Ok(self.inner.lock().lookup(&key))
    }

    /// `(block_ids, n_tokens)` of the longest present prefix of `keys` (peek).
    fn match_prefix(&self, keys: &Bound<'_, PyAny>) -> PyResult<(Vec<BlockId>, usize)> {
        let keys = keys_of(keys)?;
        Ok(self.inner.lock().match_prefix(&keys))
    }

    /// `match_prefix` + `acquire` of the matched blocks atomically: `(block_ids, n_tokens)`.
    fn acquire_prefix(&self, keys: &Bound<'_, PyAny>) -> PyResult<(Vec<BlockId>, usize)> {
        let keys = keys_of(keys)?;
        Ok(self.inner.lock().acquire_prefix(&keys))
    }

    fn extend_match(
        &self,
        parent: &[u8],
        next_tokens: &Bound<'_, PyAny>,
    ) -> PyResult<Option<(BlockId, usize)>> {
        let parent = key_of(parent)?;
        let tokens = tokens_of(next_tokens)?;
        Ok(self.inner.lock().extend_match(parent, &tokens))
    }

    fn cow(&self, src: i64, n_tokens: usize) -> PyResult<BlockId> {
        let src = id_of(src)?;
        self.inner.lock().cow(src, n_tokens).py_err()
    }

    fn evict_all_cached(&self) -> usize {
        self.inner.lock().evict_all_cached()
    }

    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.inner.lock().stats();
        let d = PyDict::new(py);
        d.set_item("total", s.total)?;
        d.set_item("used", s.used)?;
        d.set_item("free", s.free)?;
        d.set_item("cached", s.cached)?;
        d.set_item("shared", s.shared)?;
        d.set_item("tokens_held", s.tokens_held)?;
        Ok(d)
    }

    fn ref_count(&self, id: i64) -> PyResult<u32> {
        self.inner.lock().ref_count(id_of(id)?).py_err()
    }

    fn tokens(&self, id: i64) -> PyResult<Vec<u32>> {
        Ok(self.inner.lock().tokens(id_of(id)?).py_err()?.to_vec())
    }

    fn key<'py>(&self, py: Python<'py>, id: i64) -> PyResult<Option<Bound<'py, PyBytes>>> {
        let k = self.inner.lock().key(id_of(id)?).py_err()?;
        Ok(k.map(|k| key_to_py(py, &k)))
    }

    fn parent<'py>(&self, py: Python<'py>, id: i64) -> PyResult<Bound<'py, PyBytes>> {
        let k = self.inner.lock().parent(id_of(id)?).py_err()?;
        Ok(key_to_py(py, &k))
    }

    /// "free", "used" or "cached".
    fn state(&self, id: i64) -> PyResult<&'static str> {
        Ok(self.inner.lock().state(id_of(id)?).py_err()?.as_str())
    }

    fn lru_order(&self) -> Vec<BlockId> {
        self.inner.lock().lru_order()
    }

    /// Raise AssertionError if any internal invariant is broken.
    fn check_invariants(&self) -> PyResult<()> {
        self.inner
            .lock()
            .check_invariants()
            .map_err(PyAssertionError::new_err)
    }

    fn __repr__(&self) -> String {
        let p = self.inner.lock();
        let s = p.stats();
        format!(
            "BlockPool(n_blocks={}, block_size={}, used={}, cached={}, free={}, shared={})",
            s.total,
            p.block_size(),
            s.used,
            s.cached,
            s.free,
            s.shared
        )
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(root_key, m)?)?;
    m.add_function(wrap_pyfunction!(chain_key, m)?)?;
    m.add_function(wrap_pyfunction!(hash_blocks, m)?)?;
    m.add_function(wrap_pyfunction!(prefix_key, m)?)?;
    m.add_class::<PyBlockPool>()?;
    crate::ckpt::register(m)?;
    crate::ram::register(m)?;
    Ok(())
}
