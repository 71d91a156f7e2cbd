//! Binding of checkpoints: `CheckpointAccount`, `Checkpoint`, `CheckpointStore` and
//! `checkpoint_account_stats()`. A Python `Checkpoint` wraps the one `Arc<Checkpoint>`; passing
//! it to a store or the RAM tier clones the `Arc`, never the bytes.

use crate::convert::{
    detach_unless, invalid, key_of, key_to_py, keys_of, keys_to_py, read_bytes, tokens_of,
    write_bytes,
};
use crate::errors::IntoPyResult;
use kvshare_core::checkpoint::{Checkpoint, CheckpointAccount, CheckpointStore};
use parking_lot::Mutex;
use pyo3::exceptions::PyAssertionError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};
use std::sync::Arc;

/// Counters of distinct live checkpoints and their bytes. `CheckpointAccount()` makes a new one;
/// objects created without an explicit account use the process-wide default one.
#[pyclass(frozen, name = "CheckpointAccount", module = "kvshare._core")]
pub struct PyCheckpointAccount {
    pub(crate) inner: CheckpointAccount,
}

#[pymethods]
impl PyCheckpointAccount {
    #[new]
    fn new() -> Self {
        PyCheckpointAccount {
            inner: CheckpointAccount::new(),
        }
    }

    /// The process-wide default account.
    #[staticmethod]
    fn default() -> Self {
        PyCheckpointAccount {
            inner: CheckpointAccount::global().clone(),
        }
    }

    #[getter]
    fn live_count(&self) -> u64 {
        self.inner.live_count()
    }

    #[getter]
    fn live_bytes(&self) -> u64 {
        self.inner.live_bytes()
    }

    fn __repr__(&self) -> String {
        format!(
            "CheckpointAccount(live_count={}, live_bytes={})",
            self.inner.live_count(),
            self.inner.live_bytes()
        )
    }
}

pub(crate) fn account_of(account: Option<&Bound<'_, PyCheckpointAccount>>) -> CheckpointAccount {
    match account {
        Some(a) => a.get().inner.clone(),
        None => CheckpointAccount::global().clone(),
    }
}

/// `{"count": ..., "bytes": ...}` of the process-wide default account.
#[pyfunction]
fn checkpoint_account_stats(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let a = CheckpointAccount::global();
    let d = PyDict::new(py);
    d.set_item("count", a.live_count())?;
    d.set_item("bytes", a.live_bytes())?;
    Ok(d)
}

/// An immutable recurrent-state snapshot at a token position.
///
/// `np.asarray(ckpt)` is a zero-copy read-only uint8 view of the data (via
/// `__array_interface__`; the view keeps the checkpoint alive); `data` returns a `bytes` copy.
#[pyclass(frozen, name = "Checkpoint", module = "kvshare._core")]
pub struct PyCheckpoint {
    pub(crate) inner: Arc<Checkpoint>,
}

impl PyCheckpoint {
    pub(crate) fn wrap(inner: Arc<Checkpoint>) -> PyCheckpoint {
        PyCheckpoint { inner }
    }
}

#[pymethods]
impl PyCheckpoint {
    /// Wrap precomputed fields (key/anchor/tail are trusted). Prefer `Checkpoint.at`.
    #[new]
    #[pyo3(signature = (position, key, anchor, tail, data, layout = String::new(), account = None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        position: u64,
        key: &[u8],
        anchor: &[u8],
        tail: &Bound<'_, PyAny>,
        data: &Bound<'_, PyAny>,
        layout: String,
        account: Option<&Bound<'_, PyCheckpointAccount>>,
    ) -> PyResult<Self> {
        let (key, anchor) = (key_of(key)?, key_of(anchor)?);
        let tail = tokens_of(tail)?;
        let data = read_bytes(data)?;
        let slice = data.as_slice();
        let owned = py.detach(|| slice.to_vec());
        let c = Checkpoint::new(
            &account_of(account),
            position,
            key,
            anchor,
            tail,
            owned,
            layout,
        )
        .py_err()?;
        Ok(PyCheckpoint::wrap(c))
    }

    /// The checkpoint of the state after `tokens`: key, anchor and tail are derived from the
    /// tokens with the same chain hashing as the block keys.
    #[staticmethod]
    #[pyo3(signature = (root, tokens, block_size, data, layout = String::new(), extra = None, account = None))]
    #[allow(clippy::too_many_arguments)]
    fn at(
        py: Python<'_>,
        root: &[u8],
        tokens: &Bound<'_, PyAny>,
        block_size: usize,
        data: &Bound<'_, PyAny>,
        layout: String,
        extra: Option<&[u8]>,
        account: Option<&Bound<'_, PyCheckpointAccount>>,
    ) -> PyResult<Self> {
        let root = key_of(root)?;
        let tokens = tokens_of(tokens)?;
        let data = read_bytes(data)?;
        let slice = data.as_slice();
        let extra = extra.unwrap_or(b"");
        let account = account_of(account);
        let c = py
            .detach(|| {
                Checkpoint::at(
                    &account,
                    &root,
                    &tokens,
                    block_size,
                    extra,
                    slice.to_vec(),
                    layout,
                )
            })
            .py_err()?;
        Ok(PyCheckpoint::wrap(c))
    }

    #[getter]
    fn position(&self) -> u64 {
        self.inner.position
    }

    #[getter]
    fn key<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        key_to_py(py, &self.inner.key)
    }

    #[getter]
    fn anchor<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        key_to_py(py, &self.inner.anchor)
    }

    #[getter]
    fn anchor_position(&self) -> u64 {
        self.inner.anchor_position()
    }

    #[getter]
    fn tail(&self) -> Vec<u32> {
        self.inner.tail.clone()
    }

    /// A `bytes` copy of the data (use `np.asarray(ckpt)` or `read_into` to avoid it).
    #[getter]
    fn data<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &self.inner.data)
    }

    #[getter]
    fn layout(&self) -> &str {
        &self.inner.layout
    }

    #[getter]
    fn nbytes(&self) -> usize {
        self.inner.data.len()
    }

    /// Copy the data into a writable C-contiguous array or bytearray of exactly `nbytes` bytes.
    fn read_into(&self, py: Python<'_>, out: &Bound<'_, PyAny>) -> PyResult<()> {
        let mut w = write_bytes(out)?;
        let keep_gil = w.needs_gil;
        let dst = w.as_mut_slice();
        if dst.len() != self.inner.data.len() {
            return Err(invalid(format!(
                "checkpoint holds {} bytes, destination has {}",
                self.inner.data.len(),
                dst.len()
            )));
        }
        let src = &self.inner.data[..];
        detach_unless(py, keep_gil, || dst.copy_from_slice(src));
        Ok(())
    }

    /// True if both objects wrap the same shared checkpoint (not merely equal content).
    fn same(&self, other: &Bound<'_, PyCheckpoint>) -> bool {
        Arc::ptr_eq(&self.inner, &other.get().inner)
    }

    /// NumPy array interface: a read-only uint8 view of the data, no copy.
    #[getter]
    fn __array_interface__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        let n = self.inner.data.len();
        let ptr = if n == 0 {
            0usize
        } else {
            self.inner.data.as_ptr() as usize
        };
        d.set_item("shape", (n,))?;
        d.set_item("typestr", "|u1")?;
        d.set_item("data", (ptr, true))?;
        d.set_item("version", 3)?;
        Ok(d)
    }

    fn __repr__(&self) -> String {
        format!(
            "Checkpoint(position={}, nbytes={}, key={}…)",
            self.inner.position,
            self.inner.data.len(),
            &self.inner.key.to_hex()[..12]
        )
    }
}

/// Checkpoints by key (one per key), with lookup of the deepest one along a prompt.
#[pyclass(frozen, name = "CheckpointStore", module = "kvshare._core")]
pub struct PyCheckpointStore {
    inner: Mutex<CheckpointStore>,
}

#[pymethods]
impl PyCheckpointStore {
    #[new]
    #[pyo3(signature = (account = None))]
    fn new(account: Option<&Bound<'_, PyCheckpointAccount>>) -> Self {
        PyCheckpointStore {
            inner: Mutex::new(CheckpointStore::new(account_of(account))),
        }
    }

    /// Store `ckpt`; returns the stored checkpoint (the existing one if its key is present).
    fn insert(&self, ckpt: &Bound<'_, PyCheckpoint>) -> PyCheckpoint {
        PyCheckpoint::wrap(self.inner.lock().insert(ckpt.get().inner.clone()))
    }

    fn get(&self, key: &[u8]) -> PyResult<Option<PyCheckpoint>> {
        let key = key_of(key)?;
        Ok(self.inner.lock().get(&key).map(PyCheckpoint::wrap))
    }

    fn remove(&self, key: &[u8]) -> PyResult<Option<PyCheckpoint>> {
        let key = key_of(key)?;
        Ok(self.inner.lock().remove(&key).map(PyCheckpoint::wrap))
    }

    fn __contains__(&self, key: &[u8]) -> PyResult<bool> {
        let key = key_of(key)?;
        Ok(self.inner.lock().contains(&key))
    }

    /// The deepest checkpoint at or before `max_position` along the prompt `tokens` whose
    /// full-block keys are `block_keys` (from `hash_blocks`).
    #[pyo3(signature = (root, block_keys, tokens, max_position = None))]
    fn deepest(
        &self,
        py: Python<'_>,
        root: &[u8],
        block_keys: &Bound<'_, PyAny>,
        tokens: &Bound<'_, PyAny>,
        max_position: Option<u64>,
    ) -> PyResult<Option<PyCheckpoint>> {
        let root = key_of(root)?;
        let keys = keys_of(block_keys)?;
        let tokens = tokens_of(tokens)?;
        let max = max_position.unwrap_or(u64::MAX);
        let found = py.detach(|| self.inner.lock().deepest(&root, &keys, &tokens, max));
        Ok(found.map(PyCheckpoint::wrap))
    }

    fn __len__(&self) -> usize {
        self.inner.lock().len()
    }

    /// The keys of the stored checkpoints (any order).
    fn keys<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let keys: Vec<_> = self.inner.lock().iter().map(|c| c.key).collect();
        keys_to_py(py, &keys)
    }

    /// Payload bytes of the checkpoints in this store (each once).
    #[getter]
    fn unique_bytes(&self) -> u64 {
        self.inner.lock().unique_bytes()
    }

    #[getter]
    fn account(&self) -> PyCheckpointAccount {
        PyCheckpointAccount {
            inner: self.inner.lock().account().clone(),
        }
    }

    fn check_invariants(&self) -> PyResult<()> {
        self.inner
            .lock()
            .check_invariants()
            .map_err(PyAssertionError::new_err)
    }

    fn __repr__(&self) -> String {
        let s = self.inner.lock();
        format!(
            "CheckpointStore(len={}, unique_bytes={})",
            s.len(),
            s.unique_bytes()
        )
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyCheckpointAccount>()?;
    m.add_class::<PyCheckpoint>()?;
    m.add_class::<PyCheckpointStore>()?;
    m.add_function(wrap_pyfunction!(checkpoint_account_stats, m)?)?;
    Ok(())
}
