//! Conversions between Python objects and core types: keys (32-byte `bytes`), token lists
//! (sequences of ints or NumPy integer arrays), block ids, and byte payloads.
//!
//! The extension is built for the stable ABI of Python 3.10 (abi3-py310), where the buffer
//! protocol is not part of the limited API (pyo3 offers `PyBuffer` only from 3.11 on). Payloads
//! are therefore read without a copy from `bytes` (borrowed), from NumPy arrays (through
//! CPython's buffer call, declared here: it is exported by every CPython 3) and from any other
//! object exposing NumPy's `__array_interface__` (a C-contiguous host array: its data pointer is
//! borrowed); other buffer objects (`bytearray`, `memoryview`, ...) are copied once through
//! `memoryview(obj).tobytes()`.

use crate::errors::InvalidArgument;
use kvshare_core::hash::BlockKey;
use kvshare_core::pool::BlockId;
use pyo3::exceptions::PyTypeError;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyByteArray, PyBytes, PyDict, PyList, PyTuple};

pub(crate) fn invalid(msg: impl Into<String>) -> PyErr {
    InvalidArgument::new_err(msg.into())
}

/// A 32-byte key from `bytes`.
pub(crate) fn key_of(b: &[u8]) -> PyResult<BlockKey> {
    BlockKey::from_slice(b).ok_or_else(|| invalid(format!("a key is 32 bytes, got {}", b.len())))
}

pub(crate) fn key_to_py<'py>(py: Python<'py>, k: &BlockKey) -> Bound<'py, PyBytes> {
    PyBytes::new(py, &k.0)
}

/// A list (or any iterable) of 32-byte `bytes` keys.
pub(crate) fn keys_of(obj: &Bound<'_, PyAny>) -> PyResult<Vec<BlockKey>> {
    let mut out = Vec::with_capacity(obj.len().unwrap_or(0));
    if let Ok(list) = obj.cast::<PyList>() {
        for item in list.iter() {
            out.push(key_of(
                item.cast::<PyBytes>()
                    .map_err(|_| invalid("keys must be bytes"))?
                    .as_bytes(),
            )?);
        }
    } else {
        for item in obj.try_iter()? {
            let item = item?;
            out.push(key_of(
                item.cast::<PyBytes>()
                    .map_err(|_| invalid("keys must be bytes"))?
                    .as_bytes(),
            )?);
        }
    }
    Ok(out)
}

pub(crate) fn keys_to_py<'py>(py: Python<'py>, keys: &[BlockKey]) -> PyResult<Bound<'py, PyList>> {
    PyList::new(py, keys.iter().map(|k| key_to_py(py, k)))
}

pub(crate) fn id_of(v: i64) -> PyResult<BlockId> {
    u32::try_from(v)
        .ok()
        .filter(|&x| x != u32::MAX)
        .ok_or_else(|| invalid(format!("invalid block id {v}")))
}

pub(crate) fn ids_of(v: Vec<i64>) -> PyResult<Vec<BlockId>> {
    v.into_iter().map(id_of).collect()
}

/// What `__array_interface__` says about a host array.
struct ArrayInfo {
    ptr: usize,
    readonly: bool,
    /// 'i', 'u', 'f', 'b', ...
    kind: u8,
    itemsize: usize,
    n_items: usize,
    shape: Vec<usize>,
    c_contiguous: bool,
}

/// What a host array is: for a NumPy array, its buffer (`ndarray_info`, ~0.2 us); else
/// `__array_interface__` (anything imitating NumPy, ~2.5 us: NumPy builds a dict per access,
/// and a decode step passes ~450 arrays to the kernels). `None` when the object has neither,
/// or a form we do not borrow from (big-endian data, `data` given as a buffer).
fn array_info(obj: &Bound<'_, PyAny>) -> PyResult<Option<ArrayInfo>> {
    if let Some(info) = ndarray_info(obj)? {
        return Ok(Some(info));
    }
    interface_info(obj)
}

/// CPython's `Py_buffer` and buffer calls. pyo3 declares them only for the 3.11 limited API
/// (this extension is built for abi3-py310), but CPython has exported them with this layout
/// since 3.3.
mod buffer {
    use std::ffi::{c_char, c_int, c_void};

    #[repr(C)]
    pub(super) struct View {
        pub buf: *mut c_void,
        pub obj: *mut pyo3::ffi::PyObject,
        pub len: isize,
        pub itemsize: isize,
        pub readonly: c_int,
        pub ndim: c_int,
        pub format: *mut c_char,
        pub shape: *mut isize,
        pub strides: *mut isize,
        pub suboffsets: *mut isize,
        pub internal: *mut c_void,
    }

    /// PyBUF_RECORDS_RO: strides and format, read-only allowed.
    pub(super) const RECORDS_RO: c_int = 0x0010 | 0x0008 | 0x0004;

    extern "C" {
        pub(super) fn PyObject_GetBuffer(
            obj: *mut pyo3::ffi::PyObject,
            view: *mut View,
            flags: c_int,
        ) -> c_int;
        pub(super) fn PyBuffer_Release(view: *mut View);
    }
}

/// A NumPy array's facts from its buffer (released at once: the caller keeps a reference to
/// the array, which NumPy does not resize while others hold it). `None` for anything that is
/// not an `ndarray` (a memoryview's exporter could be resized once we let go of the view) or
/// whose buffer format we do not read; the caller then asks `__array_interface__`.
fn ndarray_info(obj: &Bound<'_, PyAny>) -> PyResult<Option<ArrayInfo>> {
    static NDARRAY: pyo3::sync::PyOnceLock<Py<pyo3::types::PyType>> = pyo3::sync::PyOnceLock::new();
    let py = obj.py();
    let ndarray = NDARRAY.get_or_try_init(py, || -> PyResult<_> {
        Ok(py
            .import(intern!(py, "numpy"))?
            .getattr(intern!(py, "ndarray"))?
            .cast_into::<pyo3::types::PyType>()?
            .unbind())
    })?;
    if !obj.is_instance(ndarray.bind(py))? {
        return Ok(None);
    }
    let mut view = std::mem::MaybeUninit::<buffer::View>::zeroed();
    // SAFETY: obj is a live object and view a Py_buffer-sized out parameter; on success the
    // view is released below before it goes out of scope.
    if unsafe { buffer::PyObject_GetBuffer(obj.as_ptr(), view.as_mut_ptr(), buffer::RECORDS_RO) }
        != 0
    {
        let _ = PyErr::take(py);
        return Ok(None);
    }
    // SAFETY: filled by a successful PyObject_GetBuffer
    let mut view = unsafe { view.assume_init() };
    // SAFETY: format, shape and strides are valid (RECORDS_RO asked for them) until release
    let info = unsafe {
        let format = std::ffi::CStr::from_ptr(view.format).to_bytes();
        let ndim = view.ndim.max(0) as usize;
        let shape: Vec<usize> = (0..ndim).map(|i| *view.shape.add(i) as usize).collect();
        let strides: Vec<isize> = (0..ndim).map(|i| *view.strides.add(i)).collect();
        let code = match format {
            [b'<' | b'=' | b'@' | b'|', c] | [c] => Some(*c),
            _ => None,
        };
        let kind = match code {
            Some(b'e' | b'f' | b'd') => Some(b'f'),
            Some(b'b' | b'h' | b'i' | b'l' | b'q') => Some(b'i'),
            Some(b'B' | b'H' | b'I' | b'L' | b'Q') => Some(b'u'),
            Some(b'?') => Some(b'b'),
            _ => None,
        };
        kind.map(|kind| {
            let itemsize = view.itemsize as usize;
            let n_items: usize = shape.iter().product();
            ArrayInfo {
                ptr: view.buf as usize,
                readonly: view.readonly != 0,
                kind,
                itemsize,
                n_items,
                c_contiguous: c_contiguous(&shape, &strides, itemsize) || n_items == 0,
                shape,
            }
        })
    };
    // SAFETY: a view filled by PyObject_GetBuffer, released once
    unsafe { buffer::PyBuffer_Release(&mut view) };
    Ok(info)
}

/// Whether `strides` (bytes) lay `shape` out in C order.
fn c_contiguous(shape: &[usize], strides: &[isize], itemsize: usize) -> bool {
    let mut expect = itemsize as isize;
    let mut ok = true;
    for (dim, stride) in shape.iter().zip(strides.iter()).rev() {
        if *dim > 1 && *stride != expect {
            ok = false;
        }
        expect *= *dim as isize;
    }
    ok
}

/// `obj.__array_interface__`'s facts.
fn interface_info(obj: &Bound<'_, PyAny>) -> PyResult<Option<ArrayInfo>> {
    let py = obj.py();
    let Ok(ai) = obj.getattr(intern!(py, "__array_interface__")) else {
        return Ok(None);
    };
    let Ok(ai) = ai.cast::<PyDict>() else {
        return Ok(None);
    };
    let Some(data) = ai.get_item("data")? else {
        return Ok(None);
    };
    let Ok(data) = data.cast::<PyTuple>() else {
        return Ok(None);
    };
    let ptr: usize = data.get_item(0)?.extract()?;
    let readonly: bool = data.get_item(1)?.extract()?;
    let Some(typestr) = ai.get_item("typestr")? else {
        return Ok(None);
    };
    let typestr: String = typestr.extract()?;
    let t = typestr.as_bytes();
    if t.len() < 3
        || !(t[0] == b'<' || t[0] == b'|' || t[0] == b'=')
        || !cfg!(target_endian = "little")
    {
        return Ok(None);
    }
    let Ok(itemsize) = typestr[2..].parse::<usize>() else {
        return Ok(None);
    };
    let shape: Vec<usize> = match ai.get_item("shape")? {
        Some(s) => s.extract()?,
        None => return Ok(None),
    };
    let n_items: usize = shape.iter().product();
    let c_contiguous = match ai.get_item("strides")? {
        None => true,
        Some(s) if s.is_none() => true,
        Some(s) => {
            let strides: Vec<isize> = s.extract()?;
            c_contiguous(&shape, &strides, itemsize) || n_items == 0
        }
    };
    Ok(Some(ArrayInfo {
        ptr,
        readonly,
        kind: t[1],
        itemsize,
        n_items,
        shape,
        c_contiguous,
    }))
}

/// Bytes read from a Python payload: borrowed where possible (see the module docs).
pub(crate) enum ReadBytes<'py> {
    Bytes(Bound<'py, PyBytes>),
    /// Borrowed from a live array (`_owner` keeps it alive; a NumPy array that is referenced
    /// cannot be resized).
    Array {
        ptr: usize,
        len: usize,
        _owner: Bound<'py, PyAny>,
    },
    Owned(Vec<u8>),
}

impl ReadBytes<'_> {
    pub(crate) fn as_slice(&self) -> &[u8] {
        match self {
            ReadBytes::Bytes(b) => b.as_bytes(),
            ReadBytes::Array { len: 0, .. } => &[],
            // SAFETY: ptr/len describe the live, C-contiguous data of `_owner` (held here).
            ReadBytes::Array { ptr, len, .. } => unsafe {
                std::slice::from_raw_parts(*ptr as *const u8, *len)
            },
            ReadBytes::Owned(v) => v,
        }
    }
}

/// Read a payload (bytes, NumPy array, or any buffer object).
pub(crate) fn read_bytes<'py>(obj: &Bound<'py, PyAny>) -> PyResult<ReadBytes<'py>> {
    if let Ok(b) = obj.cast::<PyBytes>() {
        return Ok(ReadBytes::Bytes(b.clone()));
    }
    if let Ok(ba) = obj.cast::<PyByteArray>() {
        return Ok(ReadBytes::Owned(ba.to_vec()));
    }
    if let Some(info) = array_info(obj)? {
        if !info.c_contiguous {
            return Err(invalid("payload array must be C-contiguous"));
        }
        return Ok(ReadBytes::Array {
            ptr: info.ptr,
            len: info.n_items * info.itemsize,
            _owner: obj.clone(),
        });
    }
    let py = obj.py();
    let mv = py
        .import(intern!(py, "builtins"))?
        .getattr(intern!(py, "memoryview"))?
        .call1((obj,))
        .map_err(|_| {
            PyTypeError::new_err("payload must be bytes, a NumPy array or a buffer object")
        })?;
    let b = mv.call_method0(intern!(py, "tobytes"))?;
    Ok(ReadBytes::Bytes(b.cast_into::<PyBytes>()?))
}

/// A writable destination: a C-contiguous NumPy array (borrowed) or a `bytearray`.
pub(crate) struct WriteBytes<'py> {
    ptr: usize,
    len: usize,
    /// A `bytearray` can be resized by another Python thread at any time (we hold no buffer
    /// export on it), so it may only be written while this thread holds the GIL. A referenced
    /// NumPy array cannot be resized, so writing it with the GIL released is safe.
    pub(crate) needs_gil: bool,
    _owner: Bound<'py, PyAny>,
}

impl WriteBytes<'_> {
    /// SAFETY of use: the caller must not let two `&mut` slices of the same object coexist.
    pub(crate) fn as_mut_slice(&mut self) -> &mut [u8] {
        if self.len == 0 {
            return &mut [];
        }
        // SAFETY: ptr/len describe the live, writable, C-contiguous data of `_owner`.
        unsafe { std::slice::from_raw_parts_mut(self.ptr as *mut u8, self.len) }
    }
}

pub(crate) fn write_bytes<'py>(obj: &Bound<'py, PyAny>) -> PyResult<WriteBytes<'py>> {
    if let Ok(ba) = obj.cast::<PyByteArray>() {
        return Ok(WriteBytes {
            ptr: ba.data() as usize,
            len: ba.len(),
            needs_gil: true,
            _owner: obj.clone(),
        });
    }
    match array_info(obj)? {
        Some(info) if info.readonly => Err(invalid("destination array is read-only")),
        Some(info) if !info.c_contiguous => Err(invalid("destination array must be C-contiguous")),
        Some(info) => Ok(WriteBytes {
            ptr: info.ptr,
            len: info.n_items * info.itemsize,
            needs_gil: false,
            _owner: obj.clone(),
        }),
        None => Err(PyTypeError::new_err(
            "destination must be a writable NumPy array or a bytearray",
        )),
    }
}

/// Convert `n` integers of type `T` at `p` (any alignment) to token ids.
///
/// SAFETY: `p` must point at `n` readable values of `T`.
unsafe fn read_ints<T: Copy + TryInto<u32>>(p: *const u8, n: usize) -> PyResult<Vec<u32>> {
    let p = p.cast::<T>();
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        let v = unsafe { p.add(i).read_unaligned() };
        match v.try_into() {
            Ok(t) => out.push(t),
            Err(_) => return Err(invalid(format!("token id at index {i} out of range"))),
        }
    }
    Ok(out)
}

/// Run `f` with the GIL released unless `keep_gil` (see [`WriteBytes::needs_gil`]).
pub(crate) fn detach_unless<T: Send, F: Send + FnOnce() -> T>(
    py: Python<'_>,
    keep_gil: bool,
    f: F,
) -> T {
    if keep_gil {
        f()
    } else {
        py.detach(f)
    }
}

fn token_of(v: i64) -> PyResult<u32> {
    u32::try_from(v).map_err(|_| invalid(format!("token id {v} out of range")))
}

/// Token ids from a NumPy integer array (any width, read in place) or a sequence of ints.
pub(crate) fn tokens_of(obj: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
    if let Some(info) = array_info(obj)? {
        if info.c_contiguous && (info.kind == b'i' || info.kind == b'u') {
            let (n, p) = (info.n_items, info.ptr as *const u8);
            // SAFETY: `obj` (and so its data) is alive for this call; n items of `itemsize`.
            return unsafe {
                match (info.itemsize, info.kind) {
                    (1, b'i') => read_ints::<i8>(p, n),
                    (1, _) => read_ints::<u8>(p, n),
                    (2, b'i') => read_ints::<i16>(p, n),
                    (2, _) => read_ints::<u16>(p, n),
                    (4, b'i') => read_ints::<i32>(p, n),
                    (4, _) => read_ints::<u32>(p, n),
                    (8, b'i') => read_ints::<i64>(p, n),
                    (8, _) => read_ints::<u64>(p, n),
                    _ => Err(invalid("unsupported integer width for token ids")),
                }
            };
        }
        if info.kind != b'i' && info.kind != b'u' {
            return Err(invalid("token ids must be integers"));
        }
        // non-contiguous integer array: go through tolist()
        let list = obj.call_method0(intern!(obj.py(), "tolist"))?;
        return tokens_of(&list);
    }
    if obj.is_instance_of::<PyBytes>() || obj.is_instance_of::<pyo3::types::PyString>() {
        return Err(invalid(
            "token ids must be a sequence of ints, not bytes/str",
        ));
    }
    let v: Vec<i64> = obj
        .extract()
        .map_err(|_| invalid("token ids must be a sequence of ints"))?;
    v.into_iter().map(token_of).collect()
}

/// A C-contiguous NumPy array of one element type, borrowed in place (see the module docs).
pub(crate) struct TypedArray<'py> {
    ptr: usize,
    pub(crate) shape: Vec<usize>,
    n_items: usize,
    _owner: Bound<'py, PyAny>,
}

impl<'py> TypedArray<'py> {
    /// The array the data belongs to.
    pub(crate) fn owner(&self) -> &Bound<'py, PyAny> {
        &self._owner
    }

    /// `[start, end)` addresses of the data, to refuse overlapping input and output.
    pub(crate) fn span(&self, itemsize: usize) -> (usize, usize) {
        (self.ptr, self.ptr + self.n_items * itemsize)
    }

    /// SAFETY of use: `T` must be the element type checked by `typed_array`.
    pub(crate) unsafe fn as_slice<T>(&self) -> &[T] {
        if self.n_items == 0 {
            return &[];
        }
        // SAFETY: ptr/n_items describe the live, aligned, C-contiguous data of `_owner`.
        unsafe { std::slice::from_raw_parts(self.ptr as *const T, self.n_items) }
    }

    /// SAFETY of use: as `as_slice`, the array was checked writable, and no other slice of
    /// the same array is alive.
    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn as_mut_slice<T>(&self) -> &mut [T] {
        if self.n_items == 0 {
            return &mut [];
        }
        // SAFETY: see above.
        unsafe { std::slice::from_raw_parts_mut(self.ptr as *mut T, self.n_items) }
    }
}

/// Borrow `obj` as a C-contiguous, aligned array of `kind`/`itemsize` (e.g. b'f', 4 for
/// float32); `writable` also requires a writable array. `what` names it in errors.
pub(crate) fn typed_array<'py>(
    obj: &Bound<'py, PyAny>,
    kind: u8,
    itemsize: usize,
    writable: bool,
    what: &str,
) -> PyResult<TypedArray<'py>> {
    let dtype = format!("{}{}", kind as char, itemsize);
    let info = array_info(obj)?
        .ok_or_else(|| PyTypeError::new_err(format!("{what} must be a NumPy array of {dtype}")))?;
    if info.kind != kind || info.itemsize != itemsize {
        return Err(invalid(format!("{what} must have dtype {dtype}")));
    }
    if !info.c_contiguous {
        return Err(invalid(format!("{what} must be C-contiguous")));
    }
    if writable && info.readonly {
        return Err(invalid(format!("{what} is read-only")));
    }
    if info.n_items > 0 && info.ptr % itemsize != 0 {
        return Err(invalid(format!(
            "{what} is not aligned to its element size"
        )));
    }
    Ok(TypedArray {
        ptr: info.ptr,
        shape: info.shape,
        n_items: info.n_items,
        _owner: obj.clone(),
    })
}
