//! `kvshare._core.DiskStore`: the binding of `kvshare_core::disk::DiskStore`. Conversion only:
//! keys are 32-byte `bytes`, payloads any C-contiguous buffer (bytes, bytearray, memoryview,
//! NumPy array), and every disk operation runs with the GIL released.

use std::ffi::{c_char, c_int, c_void};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use kvshare_core::disk::{
    CheckpointInfo, DiskConfig, DiskStore, Key, NewCheckpoint, NewEntry, WriteOutcome,
};
use kvshare_core::CoreError;
use pyo3::exceptions::PyBufferError;
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};

use crate::errors::{to_py, IntoPyResult};

// --- buffer protocol -------------------------------------------------------------------------
// pyo3 exposes `PyBuffer` only for Python >= 3.11 under the limited API, and this extension is
// built abi3 for 3.10. `PyObject_GetBuffer` / `PyBuffer_Release` and the `Py_buffer` layout have
// been exported and unchanged by every CPython 3.x, so they are declared here.
#[repr(C)]
struct RawBuffer {
    buf: *mut c_void,
    obj: *mut ffi::PyObject,
    len: ffi::Py_ssize_t,
    itemsize: ffi::Py_ssize_t,
    readonly: c_int,
    ndim: c_int,
    format: *mut c_char,
    shape: *mut ffi::Py_ssize_t,
    strides: *mut ffi::Py_ssize_t,
    suboffsets: *mut ffi::Py_ssize_t,
    internal: *mut c_void,
}

extern "C" {
    fn PyObject_GetBuffer(obj: *mut ffi::PyObject, view: *mut RawBuffer, flags: c_int) -> c_int;
    fn PyBuffer_Release(view: *mut RawBuffer);
}

const PYBUF_SIMPLE: c_int = 0; // contiguous bytes, no shape/strides
const PYBUF_WRITABLE: c_int = 1;

/// A held buffer export; released (with the GIL held) on drop.
pub(crate) struct Buffer {
    view: Box<RawBuffer>,
}

impl Buffer {
    pub(crate) fn get(obj: &Bound<'_, PyAny>, writable: bool) -> PyResult<Buffer> {
        let mut view = Box::new(RawBuffer {
            buf: std::ptr::null_mut(),
            obj: std::ptr::null_mut(),
            len: 0,
            itemsize: 0,
            readonly: 0,
            ndim: 0,
            format: std::ptr::null_mut(),
            shape: std::ptr::null_mut(),
            strides: std::ptr::null_mut(),
            suboffsets: std::ptr::null_mut(),
            internal: std::ptr::null_mut(),
        });
        let flags = if writable {
            PYBUF_SIMPLE | PYBUF_WRITABLE
        } else {
            PYBUF_SIMPLE
        };
        // SAFETY: obj is a live object (GIL held); view is a valid, zeroed Py_buffer.
        if unsafe { PyObject_GetBuffer(obj.as_ptr(), &mut *view, flags) } != 0 {
            return Err(PyErr::take(obj.py()).unwrap_or_else(|| {
                PyBufferError::new_err("object does not export a contiguous buffer")
            }));
        }
        Ok(Buffer { view })
    }

    pub(crate) fn raw(&self) -> RawSlice {
        RawSlice(self.view.buf as *mut u8, self.view.len.max(0) as usize)
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        // SAFETY: obtained by a successful PyObject_GetBuffer; dropped with the GIL held (never
        // moved into a `detach` closure: only `RawSlice` crosses).
        unsafe { PyBuffer_Release(&mut *self.view) }
    }
}

/// Pointer + length of a held buffer, usable without the GIL while the `Buffer` lives.
#[derive(Clone, Copy)]
pub(crate) struct RawSlice(*mut u8, usize);
// SAFETY: the memory stays exported (and so alive) while its `Buffer` is held by the caller.
unsafe impl Send for RawSlice {}

impl RawSlice {
    /// SAFETY: the owning `Buffer` must outlive the slice.
    pub(crate) unsafe fn bytes<'a>(self) -> &'a [u8] {
        if self.1 == 0 {
            &[]
        } else {
            std::slice::from_raw_parts(self.0, self.1)
        }
    }
    /// SAFETY: as `bytes`, and the buffer was obtained writable.
    pub(crate) unsafe fn bytes_mut<'a>(self) -> &'a mut [u8] {
        if self.1 == 0 {
            &mut []
        } else {
            std::slice::from_raw_parts_mut(self.0, self.1)
        }
    }
}

// --- conversions ---------------------------------------------------------------------------

pub(crate) fn key_of(obj: &Bound<'_, PyAny>) -> PyResult<Key> {
    let b: &[u8] = obj.extract()?;
    b.try_into().map_err(|_| {
        to_py(CoreError::InvalidArgument(format!(
            "a key must be 32 bytes, got {}",
            b.len()
        )))
    })
}

fn keys_of(seq: &Bound<'_, PyAny>) -> PyResult<Vec<Key>> {
    seq.try_iter()?.map(|k| key_of(&k?)).collect()
}

fn ckpt_info(py: Python<'_>, c: Option<CheckpointInfo>) -> PyResult<Py<PyAny>> {
    Ok(match c {
        Some(c) => (c.position, PyBytes::new(py, &c.key), c.layout, c.len)
            .into_pyobject(py)?
            .into_any()
            .unbind(),
        None => py.None(),
    })
}

/// The block lengths of `n` payload blocks: one int for all, or one per block.
fn block_lens(obj: &Bound<'_, PyAny>, n: usize) -> PyResult<Vec<u64>> {
    if let Ok(one) = obj.extract::<u64>() {
        return Ok(vec![one; n]);
    }
    obj.extract::<Vec<u64>>()
}

// --- the class -------------------------------------------------------------------------------

/// Crash-safe on-disk store of KV blocks and checkpoints with a background writer.
#[pyclass(frozen, name = "DiskStore", module = "kvshare._core")]
pub struct PyDiskStore {
    inner: DiskStore,
}

impl PyDiskStore {
    #[allow(clippy::too_many_arguments)]
    fn entry(
        py: Python<'_>,
        block_keys: &Bound<'_, PyAny>,
        payload: &Bound<'_, PyAny>,
        block_bytes: &Bound<'_, PyAny>,
        tokens: u64,
        checkpoints: Option<&Bound<'_, PyAny>>,
        payload_from: usize,
    ) -> PyResult<NewEntry> {
        let block_keys = keys_of(block_keys)?;
        let n_payload = block_keys.len().saturating_sub(payload_from);
        let block_lens = block_lens(block_bytes, n_payload)?;
        let buf = Buffer::get(payload, false)?;
        let raw = buf.raw();
        // SAFETY: `buf` is held until after the copy.
        let payload: Vec<u8> = py.detach(move || unsafe { raw.bytes() }.to_vec());
        drop(buf);
        let mut cks = Vec::new();
        if let Some(seq) = checkpoints {
            for item in seq.try_iter()? {
                let item = item?;
                let (position, key, layout, data): (
                    u64,
                    Bound<'_, PyAny>,
                    String,
                    Bound<'_, PyAny>,
                ) = item.extract()?;
                let b = Buffer::get(&data, false)?;
                let raw = b.raw();
                // SAFETY: `b` is held until after the copy.
                let data: Arc<[u8]> = py.detach(move || Arc::from(unsafe { raw.bytes() }));
                cks.push(NewCheckpoint {
                    position,
                    key: key_of(&key)?,
                    layout,
                    data,
                });
            }
        }
        Ok(NewEntry {
            block_keys,
            payload_from,
            payload,
            block_lens,
            tokens,
            checkpoints: cks,
        })
    }
}

#[pymethods]
impl PyDiskStore {
    /// Opens (creating) `path`, sweeps it and starts the writer thread. `ttl_seconds` None or
    /// <= 0: no TTL. Raises `CacheIoError` if another store holds the directory.
    #[new]
    #[pyo3(signature = (path, model_fingerprint, budget_bytes, ttl_seconds, min_tokens, queue_depth = 16))]
    fn new(
        py: Python<'_>,
        path: PathBuf,
        model_fingerprint: &[u8],
        budget_bytes: u64,
        ttl_seconds: Option<f64>,
        min_tokens: u64,
        queue_depth: usize,
    ) -> PyResult<Self> {
        let mut cfg = DiskConfig::new(path, model_fingerprint);
        cfg.budget_bytes = budget_bytes;
        cfg.ttl = ttl_seconds
            .filter(|t| *t > 0.0)
            .map(Duration::from_secs_f64);
        cfg.min_tokens = min_tokens;
        cfg.queue_depth = queue_depth;
        let inner = py.detach(move || DiskStore::open(cfg)).py_err()?;
        Ok(PyDiskStore { inner })
    }

    /// The canonical cache directory.
    #[getter]
    fn path(&self) -> PathBuf {
        self.inner.dir().to_path_buf()
    }

    /// Queues an entry for the background writer; False if the queue was full (dropped).
    #[pyo3(signature = (block_keys, payload, block_bytes, tokens, checkpoints = None, payload_from = 0))]
    #[allow(clippy::too_many_arguments)]
    fn submit(
        &self,
        py: Python<'_>,
        block_keys: &Bound<'_, PyAny>,
        payload: &Bound<'_, PyAny>,
        block_bytes: &Bound<'_, PyAny>,
        tokens: u64,
        checkpoints: Option<&Bound<'_, PyAny>>,
        payload_from: usize,
    ) -> PyResult<bool> {
        let e = Self::entry(
            py,
            block_keys,
            payload,
            block_bytes,
            tokens,
            checkpoints,
            payload_from,
        )?;
        py.detach(|| self.inner.submit(e)).py_err()
    }

    /// Writes an entry now; returns its key, or None if nothing was written (already stored,
    /// too few tokens).
    #[pyo3(signature = (block_keys, payload, block_bytes, tokens, checkpoints = None, payload_from = 0))]
    #[allow(clippy::too_many_arguments)]
    fn write(
        &self,
        py: Python<'_>,
        block_keys: &Bound<'_, PyAny>,
        payload: &Bound<'_, PyAny>,
        block_bytes: &Bound<'_, PyAny>,
        tokens: u64,
        checkpoints: Option<&Bound<'_, PyAny>>,
        payload_from: usize,
    ) -> PyResult<Option<Py<PyBytes>>> {
        let e = Self::entry(
            py,
            block_keys,
            payload,
            block_bytes,
            tokens,
            checkpoints,
            payload_from,
        )?;
        Ok(match py.detach(|| self.inner.write_now(&e)).py_err()? {
            WriteOutcome::Written { key, .. } => Some(PyBytes::new(py, &key).unbind()),
            _ => None,
        })
    }

    /// Waits until every queued write is done.
    fn flush(&self, py: Python<'_>) {
        py.detach(|| self.inner.flush())
    }

    /// Finishes queued writes, stops the writer and releases the directory.
    fn close(&self, py: Python<'_>) {
        py.detach(|| self.inner.close())
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    fn __exit__(&self, py: Python<'_>, _t: Py<PyAny>, _v: Py<PyAny>, _tb: Py<PyAny>) -> bool {
        self.close(py);
        false
    }

    /// Longest stored prefix of `keys`: (n_blocks, n_bytes, checkpoint) where checkpoint is
    /// the deepest one keyed by a matched key, as (position, key, layout, n_bytes), or None.
    fn lookup(&self, py: Python<'_>, keys: &Bound<'_, PyAny>) -> PyResult<(usize, u64, Py<PyAny>)> {
        let keys = keys_of(keys)?;
        let m = py.detach(|| self.inner.lookup(&keys)).py_err()?;
        Ok((m.n_blocks, m.n_bytes, ckpt_info(py, m.checkpoint)?))
    }

    /// Number of leading `keys` stored (no eviction, no stats).
    fn stored_prefix(&self, py: Python<'_>, keys: &Bound<'_, PyAny>) -> PyResult<usize> {
        let keys = keys_of(keys)?;
        py.detach(|| self.inner.stored_prefix(&keys)).py_err()
    }

    /// Reads the stored prefix of `keys` into the writable contiguous buffer `out` (as many
    /// whole blocks as fit), verified; returns the number of blocks read. Raises
    /// `CorruptEntry` (entry removed, `out` zeroed) on a checksum mismatch.
    fn read_blocks(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
        out: &Bound<'_, PyAny>,
    ) -> PyResult<usize> {
        let keys = keys_of(keys)?;
        let buf = Buffer::get(out, true)?;
        let raw = buf.raw();
        // SAFETY: `buf` (writable) is held until the read returns.
        let r = py.detach(move || self.inner.read_blocks(&keys, unsafe { raw.bytes_mut() }));
        drop(buf);
        r.py_err()
    }

    /// Deepest checkpoint among (position, key) candidates at or before `max_position`, as
    /// (position, key, layout, n_bytes), or None.
    fn lookup_checkpoint(
        &self,
        py: Python<'_>,
        candidates: Vec<(u64, Bound<'_, PyAny>)>,
        max_position: u64,
    ) -> PyResult<Py<PyAny>> {
        let cands: Vec<(u64, Key)> = candidates
            .iter()
            .map(|(p, k)| Ok((*p, key_of(k)?)))
            .collect::<PyResult<_>>()?;
        let c = py
            .detach(|| self.inner.lookup_checkpoint(&cands, max_position))
            .py_err()?;
        ckpt_info(py, c)
    }

    /// (position, layout, data) of a stored checkpoint, verified; None if not stored.
    fn read_checkpoint(
        &self,
        py: Python<'_>,
        key: &Bound<'_, PyAny>,
    ) -> PyResult<Option<(u64, String, Py<PyBytes>)>> {
        let key = key_of(key)?;
        let c = py.detach(|| self.inner.read_checkpoint(&key)).py_err()?;
        Ok(c.map(|c| (c.position, c.layout, PyBytes::new(py, &c.data).unbind())))
    }

    /// Runs eviction (TTL, then LRU to the budget); returns the number of entries removed.
    fn evict(&self, py: Python<'_>) -> PyResult<usize> {
        py.detach(|| self.inner.evict()).py_err()
    }

    /// Counters: entries, bytes_on_disk, blocks, checkpoints, hits, misses, checkpoint_hits,
    /// checkpoint_misses, bytes_read, bytes_written, writes, dropped_writes, skipped_small,
    /// skipped_existing, failed_writes, evictions_ttl, evictions_budget, evictions_corrupt,
    /// swept_files, io_errors, queued.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.inner.stats();
        let d = PyDict::new(py);
        for (k, v) in [
            ("entries", s.entries),
            ("bytes_on_disk", s.bytes_on_disk),
            ("blocks", s.blocks),
            ("checkpoints", s.checkpoints),
            ("hits", s.hits),
            ("misses", s.misses),
            ("checkpoint_hits", s.checkpoint_hits),
            ("checkpoint_misses", s.checkpoint_misses),
            ("bytes_read", s.bytes_read),
            ("bytes_written", s.bytes_written),
            ("writes", s.writes),
            ("dropped_writes", s.dropped_writes),
            ("skipped_small", s.skipped_small),
            ("skipped_existing", s.skipped_existing),
            ("failed_writes", s.failed_writes),
            ("evictions_ttl", s.evictions_ttl),
            ("evictions_budget", s.evictions_budget),
            ("evictions_corrupt", s.evictions_corrupt),
            ("swept_files", s.swept_files),
            ("io_errors", s.io_errors),
            ("queued", s.queued),
        ] {
            d.set_item(k, v)?;
        }
        Ok(d)
    }

    /// Committed entries, oldest first: dicts with key, n_blocks, n_checkpoints, tokens, bytes,
    /// created_ms, last_access_ms, deps.
    fn entries<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let list = PyList::empty(py);
        for e in self.inner.entries() {
            let d = PyDict::new(py);
            d.set_item("key", PyBytes::new(py, &e.key))?;
            d.set_item("n_blocks", e.n_blocks)?;
            d.set_item("n_checkpoints", e.n_checkpoints)?;
            d.set_item("tokens", e.tokens)?;
            d.set_item("bytes", e.bytes)?;
            d.set_item("created_ms", e.created_ms)?;
            d.set_item("last_access_ms", e.last_access_ms)?;
            let deps: Vec<Bound<'py, PyBytes>> =
                e.deps.iter().map(|k| PyBytes::new(py, k)).collect();
            d.set_item("deps", deps)?;
            list.append(d)?;
        }
        Ok(list)
    }

    fn __repr__(&self) -> String {
        let s = self.inner.stats();
        format!(
            "DiskStore({:?}, entries={}, bytes_on_disk={})",
            self.inner.dir(),
            s.entries,
            s.bytes_on_disk
        )
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyDiskStore>()
}
