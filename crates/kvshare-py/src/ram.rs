//! Binding of the RAM tier (`RamTier`). Payload copies run with the GIL released.

use crate::ckpt::{account_of, PyCheckpoint, PyCheckpointAccount};
use crate::convert::{
    detach_unless, key_of, key_to_py, keys_of, read_bytes, tokens_of, write_bytes,
};
use crate::errors::IntoPyResult;
use kvshare_core::ram_tier::{EntryKind, RamTier};
use parking_lot::Mutex;
use pyo3::exceptions::PyAssertionError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};

/// Content-addressed block payloads and checkpoints in host memory under a byte budget (LRU),
/// with pinned prefix entries under a sub-budget (see `kvshare_core::ram_tier`).
#[pyclass(frozen, name = "RamTier", module = "kvshare._core")]
pub struct PyRamTier {
    inner: Mutex<RamTier>,
}

#[pymethods]
impl PyRamTier {
    #[new]
    #[pyo3(signature = (budget_bytes, account = None, pin_budget_bytes = None))]
    fn new(
        budget_bytes: u64,
        account: Option<&Bound<'_, PyCheckpointAccount>>,
        pin_budget_bytes: Option<u64>,
    ) -> Self {
        let mut tier = RamTier::new(budget_bytes, account_of(account));
        if let Some(p) = pin_budget_bytes {
            tier.set_pin_budget(p);
        }
        PyRamTier {
            inner: Mutex::new(tier),
        }
    }

    /// Store a block payload (bytes or a C-contiguous array; copied once, GIL released).
    /// Returns False if the key was already held.
    fn put_block(&self, py: Python<'_>, key: &[u8], data: &Bound<'_, PyAny>) -> PyResult<bool> {
        let key = key_of(key)?;
        let data = read_bytes(data)?;
        let slice = data.as_slice();
        py.detach(|| self.inner.lock().put_block(key, slice))
            .py_err()
    }

    /// A `bytes` copy of the payload, or None. The entry stays.
    fn get_block<'py>(&self, py: Python<'py>, key: &[u8]) -> PyResult<Option<Bound<'py, PyBytes>>> {
        let key = key_of(key)?;
        let shared = self.inner.lock().get_block_shared(&key);
        Ok(shared.map(|d| PyBytes::new(py, &d)))
    }

    /// Copy the payload into `out` (writable C-contiguous array or bytearray of the same size).
    /// Returns False on a miss.
    fn get_block_into(&self, py: Python<'_>, key: &[u8], out: &Bound<'_, PyAny>) -> PyResult<bool> {
        let key = key_of(key)?;
        let mut w = write_bytes(out)?;
        let keep_gil = w.needs_gil;
        let dst = w.as_mut_slice();
        detach_unless(py, keep_gil, || self.inner.lock().get_block_into(&key, dst)).py_err()
    }

    fn contains_block(&self, key: &[u8]) -> PyResult<bool> {
        Ok(self.inner.lock().contains_block(&key_of(key)?))
    }

    fn remove_block(&self, key: &[u8]) -> PyResult<bool> {
        Ok(self.inner.lock().remove_block(&key_of(key)?))
    }

    /// Number of leading `keys` whose blocks are held (peek).
    fn match_prefix(&self, keys: &Bound<'_, PyAny>) -> PyResult<usize> {
        let keys = keys_of(keys)?;
        Ok(self.inner.lock().match_prefix(&keys))
    }

    /// Refresh the leading held blocks of a chain, deepest first (keys[0] ends most recent).
    /// Returns how many leading keys are held.
    fn touch_blocks(&self, keys: &Bound<'_, PyAny>) -> PyResult<usize> {
        let keys = keys_of(keys)?;
        Ok(self.inner.lock().touch_blocks(&keys))
    }

    /// Pin the leading held blocks of a chain (a prefix entry); returns how many leading keys
    /// are pinned afterwards (the pin budget may demote older pins, or this chain's tail).
    fn pin_blocks(&self, keys: &Bound<'_, PyAny>) -> PyResult<usize> {
        let keys = keys_of(keys)?;
        Ok(self.inner.lock().pin_blocks(&keys))
    }

    /// Pin a held checkpoint; returns whether it is pinned afterwards.
    fn pin_checkpoint(&self, key: &[u8]) -> PyResult<bool> {
        Ok(self.inner.lock().pin_checkpoint(&key_of(key)?))
    }

    /// Move a pinned block (or checkpoint) back to the normal LRU class; False if not pinned.
    #[pyo3(signature = (key, checkpoint = false))]
    fn unpin(&self, key: &[u8], checkpoint: bool) -> PyResult<bool> {
        Ok(self.inner.lock().unpin(kind_of(checkpoint), &key_of(key)?))
    }

    #[pyo3(signature = (key, checkpoint = false))]
    fn is_pinned(&self, key: &[u8], checkpoint: bool) -> PyResult<bool> {
        Ok(self
            .inner
            .lock()
            .is_pinned(kind_of(checkpoint), &key_of(key)?))
    }

    /// Hold a checkpoint (shares it; no byte copy). Returns False if its key was already held.
    fn put_checkpoint(&self, ckpt: &Bound<'_, PyCheckpoint>) -> PyResult<bool> {
        self.inner
            .lock()
            .put_checkpoint(ckpt.get().inner.clone())
            .py_err()
    }

    fn get_checkpoint(&self, key: &[u8]) -> PyResult<Option<PyCheckpoint>> {
        let key = key_of(key)?;
        Ok(self
            .inner
            .lock()
            .get_checkpoint(&key)
            .map(PyCheckpoint::wrap))
    }

    fn contains_checkpoint(&self, key: &[u8]) -> PyResult<bool> {
        Ok(self.inner.lock().contains_checkpoint(&key_of(key)?))
    }

    fn remove_checkpoint(&self, key: &[u8]) -> PyResult<Option<PyCheckpoint>> {
        let key = key_of(key)?;
        Ok(self
            .inner
            .lock()
            .remove_checkpoint(&key)
            .map(PyCheckpoint::wrap))
    }

    #[pyo3(signature = (root, block_keys, tokens, max_position = None))]
    fn deepest_checkpoint(
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
        let found = py.detach(|| {
            self.inner
                .lock()
                .deepest_checkpoint(&root, &keys, &tokens, max)
        });
        Ok(found.map(PyCheckpoint::wrap))
    }

    #[getter]
    fn held_bytes(&self) -> u64 {
        self.inner.lock().held_bytes()
    }

    #[getter]
    fn budget(&self) -> u64 {
        self.inner.lock().budget()
    }

    #[getter]
    fn pinned_bytes(&self) -> u64 {
        self.inner.lock().pinned_bytes()
    }

    #[getter]
    fn pin_budget(&self) -> u64 {
        self.inner.lock().pin_budget()
    }

    /// Change the pin budget (capped at the budget), demoting the least recent pins to fit.
    fn set_pin_budget(&self, pin_budget_bytes: u64) {
        self.inner.lock().set_pin_budget(pin_budget_bytes)
    }

    /// Change the budget, evicting LRU entries until the held bytes fit.
    fn set_budget(&self, budget_bytes: u64) {
        self.inner.lock().set_budget(budget_bytes)
    }

    fn clear(&self) {
        self.inner.lock().clear()
    }

    fn __len__(&self) -> usize {
        self.inner.lock().len()
    }

    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.inner.lock().stats();
        let d = PyDict::new(py);
        d.set_item("entries", s.entries)?;
        d.set_item("blocks", s.blocks)?;
        d.set_item("checkpoints", s.checkpoints)?;
        d.set_item("bytes", s.bytes)?;
        d.set_item("budget", s.budget)?;
        d.set_item("hits", s.hits)?;
        d.set_item("misses", s.misses)?;
        d.set_item("evictions", s.evictions)?;
        d.set_item("pinned", s.pinned)?;
        d.set_item("pinned_bytes", s.pinned_bytes)?;
        d.set_item("pin_budget", s.pin_budget)?;
        d.set_item("demotions", s.demotions)?;
        d.set_item("pinned_evictions", s.pinned_evictions)?;
        Ok(d)
    }

    /// `[(kind, key), ...]` in eviction order (normal entries least recently used first, then
    /// pinned ones); kind is "block" or "checkpoint".
    fn lru_order<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let order = self.inner.lock().lru_order();
        PyList::new(
            py,
            order
                .iter()
                .map(|(k, key)| (k.as_str(), key_to_py(py, key))),
        )
    }

    fn check_invariants(&self) -> PyResult<()> {
        self.inner
            .lock()
            .check_invariants()
            .map_err(PyAssertionError::new_err)
    }

    fn __repr__(&self) -> String {
        let s = self.inner.lock().stats();
        format!(
            "RamTier(entries={}, bytes={}, budget={}, pinned_bytes={})",
            s.entries, s.bytes, s.budget, s.pinned_bytes
        )
    }
}

fn kind_of(checkpoint: bool) -> EntryKind {
    if checkpoint {
        EntryKind::Checkpoint
    } else {
        EntryKind::Block
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyRamTier>()?;
    Ok(())
}
