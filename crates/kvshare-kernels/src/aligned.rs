//! 64-byte-aligned f32 buffers (one cache line per 16 values).
//!
//! The SIMD kernels load 16 f32 at offsets that are multiples of 16 values; from a buffer
//! with the allocator's 16-byte alignment three such loads in four split two cache lines,
//! which halved the AVX-512 block products with several activation rows (17-19 against 29-30
//! G weight-rows/s). Scratch buffers and copies of the callers' rows are made with this type.

use std::ops::{Deref, DerefMut};

#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Line([f32; 16]);

/// `len` f32 values starting on a 64-byte boundary.
pub(crate) struct AlignedF32 {
    lines: Vec<Line>,
    len: usize,
}

impl AlignedF32 {
    /// `len` zeros.
    pub(crate) fn zeros(len: usize) -> AlignedF32 {
        AlignedF32 {
            lines: vec![Line([0.0; 16]); len.div_ceil(16)],
            len,
        }
    }

    /// `len` copies of `v`.
    pub(crate) fn filled(len: usize, v: f32) -> AlignedF32 {
        let mut a = AlignedF32::zeros(len);
        a.fill(v);
        a
    }

    /// A copy of `x`.
    pub(crate) fn copy_of(x: &[f32]) -> AlignedF32 {
        let mut a = AlignedF32::zeros(x.len());
        a.copy_from_slice(x);
        a
    }
}

impl Deref for AlignedF32 {
    type Target = [f32];
    fn deref(&self) -> &[f32] {
        // SAFETY: the lines hold len.div_ceil(16) * 16 >= len initialized f32s, contiguous
        // (repr(C) arrays of f32)
        unsafe { std::slice::from_raw_parts(self.lines.as_ptr() as *const f32, self.len) }
    }
}

impl DerefMut for AlignedF32 {
    fn deref_mut(&mut self) -> &mut [f32] {
        // SAFETY: as in deref, borrowed mutably through self
        unsafe { std::slice::from_raw_parts_mut(self.lines.as_mut_ptr() as *mut f32, self.len) }
    }
}

#[cfg(test)]
mod tests {
    use super::AlignedF32;

    #[test]
    fn starts_on_a_cache_line_and_holds_its_values() {
        for len in [0, 1, 15, 16, 17, 1000] {
            let x: Vec<f32> = (0..len).map(|i| i as f32).collect();
            let a = AlignedF32::copy_of(&x);
            assert_eq!(&a[..], &x[..]);
            assert_eq!(a.as_ptr() as usize % 64, 0);
            let f = AlignedF32::filled(len, -1.5);
            assert!(f.iter().all(|&v| v == -1.5) && f.len() == len);
        }
    }
}
