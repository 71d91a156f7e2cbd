//! CPU compute kernels for kvshare's model runtime.
//!
//! NumPy and OpenBLAS run the large products (prefill), but a decode step multiplies a few
//! activation rows by every weight once, and there the cost is reading the weights: kept as
//! int8 with per-group scales they are ~4x smaller than f32. This crate holds the one kernel
//! that makes that pay: `qmatmul_t`, with explicit AVX2 + FMA (runtime-detected) and a
//! portable fallback. Activations stay f32, so results equal the f32 product of the
//! dequantized weights up to summation order.

pub mod attention;
pub mod pool;
pub mod qmatmul;

pub use attention::{paged_attention, PagedKv, Queries};
pub use qmatmul::{qmatmul_t, KernelError, QMatrix};
