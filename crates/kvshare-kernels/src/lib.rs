//! CPU compute kernels for kvshare's model runtime.
//!
//! NumPy and OpenBLAS run the large products (prefill), but a decode step multiplies a few
//! activation rows by every weight once and reads every cached key and value once, and there
//! the cost is reading memory. `qmatmul_t` multiplies by weights kept as int8 with per-group
//! scales (~4x smaller than f32); `paged_attention` scores a decode row against its keys in
//! one pass over the block pool. Both use explicit AVX2 + FMA (runtime-detected) with a
//! portable fallback, and split their work over `pool`'s threads. Activations stay f32, so
//! results equal the f32 computation up to summation order.

mod aligned;
pub mod attention;
pub mod blocks;
pub mod decode;
pub mod moe;
pub mod pool;
pub mod qmatmul;
pub mod rowops;
#[cfg(target_arch = "x86_64")]
mod x86;

pub use attention::{
    paged_attention, paged_attention_invariant, quantize_q8_0, KvElem, PagedKv, Q8Block, Queries,
    F16,
};
pub use qmatmul::{qmatmul_t, KernelError, QMatrix};
