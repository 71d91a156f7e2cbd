//! AVX2 + FMA + F16C row kernels.

use super::{Acts, BlockType};

/// Dot products of weight row `row` with activation rows `[r0, r0 + rows)`; false when
/// this type has no AVX2 kernel (the caller then takes the portable one).
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn row_dot(
    _ty: BlockType,
    _row: &[u8],
    _acts: &Acts<'_>,
    _r0: usize,
    _rows: usize,
    _out: &mut [f32],
) -> bool {
    false
}
