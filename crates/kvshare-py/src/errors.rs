//! Python exception classes, one per `CoreError` variant, all under `KvshareError`.

use kvshare_core::CoreError;
use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::prelude::*;

create_exception!(
    _core,
    KvshareError,
    PyException,
    "Base class of every kvshare core error."
);
create_exception!(
    _core,
    OutOfBlocks,
    KvshareError,
    "No free or evictable KV block is left."
);
create_exception!(
    _core,
    InvalidArgument,
    KvshareError,
    "An argument breaks an API contract."
);
create_exception!(
    _core,
    CorruptEntry,
    KvshareError,
    "A cache entry failed its checksum; it was removed."
);
create_exception!(
    _core,
    FingerprintMismatch,
    KvshareError,
    "A cache entry belongs to another model."
);
create_exception!(
    _core,
    PathEscape,
    KvshareError,
    "A path would leave the cache directory."
);
create_exception!(
    _core,
    OverBudget,
    KvshareError,
    "Larger than the whole byte budget."
);
create_exception!(
    _core,
    CacheIoError,
    KvshareError,
    "An I/O error in the cache store."
);

pub fn to_py(err: CoreError) -> PyErr {
    let msg = err.to_string();
    match err {
        CoreError::OutOfBlocks(_) => OutOfBlocks::new_err(msg),
        CoreError::InvalidArgument(_) => InvalidArgument::new_err(msg),
        CoreError::CorruptEntry(_) => CorruptEntry::new_err(msg),
        CoreError::FingerprintMismatch(_) => FingerprintMismatch::new_err(msg),
        CoreError::PathEscape(_) => PathEscape::new_err(msg),
        CoreError::OverBudget(_) => OverBudget::new_err(msg),
        CoreError::Io(_) => CacheIoError::new_err(msg),
    }
}

/// `result.map_err(to_py)` shorthand.
pub trait IntoPyResult<T> {
    fn py_err(self) -> PyResult<T>;
}
impl<T> IntoPyResult<T> for kvshare_core::Result<T> {
    fn py_err(self) -> PyResult<T> {
        self.map_err(to_py)
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("KvshareError", py.get_type::<KvshareError>())?;
    m.add("OutOfBlocks", py.get_type::<OutOfBlocks>())?;
    m.add("InvalidArgument", py.get_type::<InvalidArgument>())?;
    m.add("CorruptEntry", py.get_type::<CorruptEntry>())?;
    m.add("FingerprintMismatch", py.get_type::<FingerprintMismatch>())?;
    m.add("PathEscape", py.get_type::<PathEscape>())?;
    m.add("OverBudget", py.get_type::<OverBudget>())?;
    m.add("CacheIoError", py.get_type::<CacheIoError>())?;
    Ok(())
}
