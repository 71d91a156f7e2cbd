//! `kvshare._core.remote_value*`: the binding of `kvshare_core::remote` (the shared tier's
//! value format). Conversion only; hashing and copying run with the GIL released.

use kvshare_core::remote::{decode_value, encode_value, ValueKind, ValueMeta};
use kvshare_core::CoreError;
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::disk::{key_of, Buffer};
use crate::errors::{to_py, IntoPyResult};

fn kind_of(kind: &str) -> PyResult<ValueKind> {
    ValueKind::parse(kind).map_err(to_py)
}

/// Encodes `payload` (any C-contiguous buffer) as a value of `kind` ("block" or "checkpoint")
/// stored under `key` for the model `fingerprint`.
#[pyfunction]
#[pyo3(signature = (kind, fingerprint, key, payload, position = 0, layout = String::new()))]
fn remote_value<'py>(
    py: Python<'py>,
    kind: &str,
    fingerprint: &Bound<'py, PyAny>,
    key: &Bound<'py, PyAny>,
    payload: &Bound<'py, PyAny>,
    position: u64,
    layout: String,
) -> PyResult<Bound<'py, PyBytes>> {
    let kind = kind_of(kind)?;
    let (fp, key) = (key_of(fingerprint)?, key_of(key)?);
    let buf = Buffer::get(payload, false)?;
    let raw = buf.raw();
    let meta = ValueMeta { position, layout };
    // SAFETY: `buf` is held until the encoding is done.
    let out = py.detach(move || encode_value(kind, &fp, &key, &meta, unsafe { raw.bytes() }));
    drop(buf);
    Ok(PyBytes::new(py, &out.py_err()?))
}

/// Checks `value` (read from under `key`) and copies its payload into writable `out`, whose
/// length must equal the payload's. Returns `(position, layout)`. Raises `CorruptEntry` for any
/// damage or a payload of another length, `FingerprintMismatch` for another model's value.
#[pyfunction]
fn remote_value_into(
    py: Python<'_>,
    value: &Bound<'_, PyAny>,
    kind: &str,
    fingerprint: &Bound<'_, PyAny>,
    key: &Bound<'_, PyAny>,
    out: &Bound<'_, PyAny>,
) -> PyResult<(u64, String)> {
    let kind = kind_of(kind)?;
    let (fp, key) = (key_of(fingerprint)?, key_of(key)?);
    let src = Buffer::get(value, false)?;
    let dst = Buffer::get(out, true)?;
    let (rs, rd) = (src.raw(), dst.raw());
    // SAFETY: both buffers are held until the copy is done; `dst` was obtained writable.
    let got = py.detach(move || -> Result<ValueMeta, CoreError> {
        let (meta, payload) = decode_value(unsafe { rs.bytes() }, kind, &fp, &key)?;
        let dst = unsafe { rd.bytes_mut() };
        if payload.len() != dst.len() {
            return Err(CoreError::CorruptEntry(format!(
                "remote value: payload of {} bytes, expected {}",
                payload.len(),
                dst.len()
            )));
        }
        dst.copy_from_slice(payload);
        Ok(meta)
    });
    drop((src, dst));
    let meta = got.py_err()?;
    Ok((meta.position, meta.layout))
}

/// Checks `value` and returns `(position, layout, payload)`; errors as `remote_value_into`.
#[pyfunction]
fn remote_value_open<'py>(
    py: Python<'py>,
    value: &Bound<'py, PyAny>,
    kind: &str,
    fingerprint: &Bound<'py, PyAny>,
    key: &Bound<'py, PyAny>,
) -> PyResult<(u64, String, Bound<'py, PyBytes>)> {
    let kind = kind_of(kind)?;
    let (fp, key) = (key_of(fingerprint)?, key_of(key)?);
    let src = Buffer::get(value, false)?;
    let rs = src.raw();
    // SAFETY: `src` is held until the copy is done.
    let got = py.detach(move || {
        decode_value(unsafe { rs.bytes() }, kind, &fp, &key).map(|(m, p)| (m, p.to_vec()))
    });
    drop(src);
    let (meta, payload) = got.py_err()?;
    Ok((meta.position, meta.layout, PyBytes::new(py, &payload)))
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(remote_value, m)?)?;
    m.add_function(wrap_pyfunction!(remote_value_into, m)?)?;
    m.add_function(wrap_pyfunction!(remote_value_open, m)?)?;
    Ok(())
}
