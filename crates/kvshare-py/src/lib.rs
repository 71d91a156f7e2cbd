//! `kvshare._core`: a thin PyO3 binding of kvshare-core. No logic lives here: every class is a
//! `#[pyclass(frozen)]` wrapper around a core type behind a Mutex, every core error maps to a
//! typed Python exception, and the GIL is released around hashing of long prompts, disk I/O,
//! the compute kernels and constrained decoding's masks.

use pyo3::prelude::*;

mod blocks;
mod ckpt;
mod constrain;
mod convert;
mod decode;
mod disk;
mod errors;
mod kernels;
mod moe;
mod pool;
mod ram;
mod remote;

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    errors::register(m)?;
    pool::register(m)?;
    disk::register(m)?;
    remote::register(m)?;
    kernels::register(m)?;
    blocks::register(m)?;
    constrain::register(m)?;
    decode::register(m)?;
    moe::register(m)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
