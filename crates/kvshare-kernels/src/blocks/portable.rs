//! The portable kernels: ggml's `dequantize_row_*` arithmetic, and the dot products of a
//! weight row with quantized activations through one unpacked form of every block type.
//!
//! Every block unpacks to integers `q` and, per 16 elements, a scale `s` and an offset `o`
//! with value = s * q + o, where each product and sum is the one ggml's dequantization does
//! (so dequantizing through this form is exact, not merely close).

// loops index several arrays per row or element (accumulators, codes j and j + 16)
#![allow(clippy::needless_range_loop)]

use super::{Acts, BlockType, ACT_BLOCK};
use crate::qmatmul::KernelError;

/// The 16 values of IQ4_NL/IQ4_XS's 4-bit codes (ggml's kvalues_iq4nl).
pub(crate) const IQ4NL_VALUES: [i8; 16] = [
    -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
];

/// MXFP4's 16 E2M1 codes doubled (ggml's kvalues_mxfp4): with the block's E8M0 exponent
/// taken as half its power of two (`e8m0_half`), every value is an integer times the scale,
/// as ggml computes them.
pub(crate) const MXFP4_VALUES: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

/// ggml's `GGML_E8M0_TO_FP32_HALF`: 2^(e - 128) as f32, subnormal for e < 2.
#[inline]
pub(crate) fn e8m0_half(e: u8) -> f32 {
    let bits = if e < 2 {
        0x0020_0000u32 << e
    } else {
        (e as u32 - 1) << 23
    };
    f32::from_bits(bits)
}

/// An IEEE half (as GGUF stores it, little-endian) as f32, exactly.
pub fn f16_to_f32(h: u16) -> f32 {
    let h = h as u32;
    let sign = (h & 0x8000) << 16;
    let exp = (h >> 10) & 0x1f;
    let man = h & 0x3ff;
    let bits = match (exp, man) {
        (0, 0) => sign,
        (0, _) => {
            // subnormal: normalise
            let shift = man.leading_zeros() - 21;
            sign | ((113 - shift) << 23) | (((man << shift) & 0x3ff) << 13)
        }
        (31, _) => sign | 0x7f80_0000 | (man << 13),
        _ => sign | ((exp + 112) << 23) | (man << 13),
    };
    f32::from_bits(bits)
}

#[inline]
pub(crate) fn f16_at(b: &[u8], off: usize) -> f32 {
    f16_to_f32(u16::from_le_bytes([b[off], b[off + 1]]))
}

/// ggml's get_scale_min_k4: the 6-bit scale and min of sub-block `j` (0..8) of Q4_K/Q5_K.
#[inline]
pub(crate) fn scale_min_k4(j: usize, s: &[u8]) -> (u8, u8) {
    if j < 4 {
        (s[j] & 63, s[j + 4] & 63)
    } else {
        (
            (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4),
            (s[j + 4] >> 4) | ((s[j] >> 6) << 4),
        )
    }
}

/// Q3_K's 16 6-bit scales (still biased by 32) from its 12 bytes, as ggml unpacks them.
pub(crate) fn q3k_scales(s: &[u8]) -> [i8; 16] {
    let w = |i: usize| u32::from_le_bytes([s[4 * i], s[4 * i + 1], s[4 * i + 2], s[4 * i + 3]]);
    let (a0, a1, tmp) = (w(0), w(1), w(2));
    let (km1, km2) = (0x0303_0303u32, 0x0f0f_0f0fu32);
    let aux = [
        (a0 & km2) | ((tmp & km1) << 4),
        (a1 & km2) | (((tmp >> 2) & km1) << 4),
        ((a0 >> 4) & km2) | (((tmp >> 4) & km1) << 4),
        ((a1 >> 4) & km2) | (((tmp >> 6) & km1) << 4),
    ];
    let mut out = [0i8; 16];
    for (i, v) in aux.iter().enumerate() {
        for (j, byte) in v.to_le_bytes().iter().enumerate() {
            out[4 * i + j] = *byte as i8;
        }
    }
    out
}

/// One block unpacked: `q[e]` for its elements, `s[g]`/`o[g]` per 16 elements; `offset`
/// says whether `o` applies (dequantization adds it only then, as ggml does).
pub(crate) struct Unpacked {
    pub q: [i8; 256],
    pub s: [f32; 16],
    pub o: [f32; 16],
    pub offset: bool,
}

impl Unpacked {
    pub(crate) fn new() -> Self {
        Unpacked {
            q: [0; 256],
            s: [0.0; 16],
            o: [0.0; 16],
            offset: false,
        }
    }
}

/// Unpack one block `b` of a quantized type (`ty.block_bytes()` bytes) into `u`.
pub(crate) fn unpack(ty: BlockType, b: &[u8], u: &mut Unpacked) {
    use BlockType::*;
    u.offset = false;
    match ty {
        Q8_0 => {
            let d = f16_at(b, 0);
            for j in 0..32 {
                u.q[j] = b[2 + j] as i8;
            }
            u.s[..2].fill(d);
        }
        Q4_0 | Q4_1 | IQ4_NL => {
            let d = f16_at(b, 0);
            let qs = if ty == Q4_1 { &b[4..20] } else { &b[2..18] };
            for j in 0..16 {
                let (lo, hi) = (qs[j] & 0x0F, qs[j] >> 4);
                (u.q[j], u.q[j + 16]) = match ty {
                    Q4_0 => (lo as i8 - 8, hi as i8 - 8),
                    Q4_1 => (lo as i8, hi as i8),
                    _ => (IQ4NL_VALUES[lo as usize], IQ4NL_VALUES[hi as usize]),
                };
            }
            u.s[..2].fill(d);
            if ty == Q4_1 {
                u.o[..2].fill(f16_at(b, 2));
                u.offset = true;
            }
        }
        MXFP4 => {
            // e (E8M0), qs[16]: low nibbles are elements 0..15, high ones 16..31
            let d = e8m0_half(b[0]);
            for j in 0..16 {
                let v = b[1 + j];
                u.q[j] = MXFP4_VALUES[(v & 0x0F) as usize];
                u.q[j + 16] = MXFP4_VALUES[(v >> 4) as usize];
            }
            u.s[..2].fill(d);
        }
        Q5_0 | Q5_1 => {
            let d = f16_at(b, 0);
            let (hoff, qoff) = if ty == Q5_1 { (4, 8) } else { (2, 6) };
            let qh = u32::from_le_bytes([b[hoff], b[hoff + 1], b[hoff + 2], b[hoff + 3]]);
            let bias = if ty == Q5_0 { 16 } else { 0 };
            for j in 0..16 {
                let xh0 = ((qh >> j) << 4) & 0x10;
                let xh1 = (qh >> (j + 12)) & 0x10;
                let q = b[qoff + j] as u32;
                u.q[j] = (((q & 0x0F) | xh0) as i32 - bias) as i8;
                u.q[j + 16] = (((q >> 4) | xh1) as i32 - bias) as i8;
            }
            u.s[..2].fill(d);
            if ty == Q5_1 {
                u.o[..2].fill(f16_at(b, 2));
                u.offset = true;
            }
        }
        Q2_K => {
            // scales[16], qs[64], d, dmin
            let (sc, qs) = (&b[0..16], &b[16..80]);
            let (d, dmin) = (f16_at(b, 80), f16_at(b, 82));
            let mut e = 0;
            for half in 0..2 {
                let q = &qs[32 * half..32 * half + 32];
                for j in 0..4 {
                    let shift = 2 * j;
                    for part in 0..2 {
                        let g = e / 16;
                        let s = sc[g];
                        u.s[g] = d * (s & 0x0F) as f32;
                        u.o[g] = -(dmin * (s >> 4) as f32);
                        for l in 0..16 {
                            u.q[e] = ((q[l + 16 * part] >> shift) & 3) as i8;
                            e += 1;
                        }
                    }
                }
            }
            u.offset = true;
        }
        Q3_K => {
            // hmask[32], qs[64], scales[12], d
            let (hm, qs) = (&b[0..32], &b[32..96]);
            let scales = q3k_scales(&b[96..108]);
            let d = f16_at(b, 108);
            let mut m = 1u8;
            let mut e = 0;
            for half in 0..2 {
                let q = &qs[32 * half..32 * half + 32];
                for j in 0..4 {
                    let shift = 2 * j;
                    for part in 0..2 {
                        let g = e / 16;
                        u.s[g] = d * (scales[g] as i32 - 32) as f32;
                        for l in 0..16 {
                            let i = l + 16 * part;
                            let lo = ((q[i] >> shift) & 3) as i8;
                            u.q[e] = lo - if hm[i] & m != 0 { 0 } else { 4 };
                            e += 1;
                        }
                    }
                    m = m.wrapping_shl(1);
                }
            }
        }
        Q4_K | Q5_K => {
            // d, dmin, scales[12], (Q5_K: qh[32]), qs[128]
            let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
            let sc = &b[4..16];
            let (qh, qs) = if ty == Q5_K {
                (Some(&b[16..48]), &b[48..176])
            } else {
                (None, &b[16..144])
            };
            for j in 0..4 {
                for part in 0..2 {
                    let sub = 2 * j + part;
                    let (s, m) = scale_min_k4(sub, sc);
                    let (d1, m1) = (d * s as f32, dmin * m as f32);
                    u.s[2 * sub..2 * sub + 2].fill(d1);
                    u.o[2 * sub..2 * sub + 2].fill(-m1);
                    for l in 0..32 {
                        let v = qs[32 * j + l];
                        let mut q = if part == 0 { v & 0x0F } else { v >> 4 };
                        if let Some(qh) = qh {
                            if qh[l] & (1 << sub) != 0 {
                                q += 16;
                            }
                        }
                        u.q[32 * sub + l] = q as i8;
                    }
                }
            }
            u.offset = true;
        }
        Q6_K => {
            // ql[128], qh[64], scales[16] (i8), d
            let d = f16_at(b, 208);
            for g in 0..16 {
                u.s[g] = d * (b[192 + g] as i8) as f32;
            }
            for half in 0..2 {
                let ql = &b[64 * half..64 * half + 64];
                let qh = &b[128 + 32 * half..128 + 32 * half + 32];
                let y = &mut u.q[128 * half..128 * half + 128];
                for l in 0..32 {
                    let q = |v: u8, h: u8| ((v | (h & 3) << 4) as i8) - 32;
                    y[l] = q(ql[l] & 0x0F, qh[l]);
                    y[l + 32] = q(ql[l + 32] & 0x0F, qh[l] >> 2);
                    y[l + 64] = q(ql[l] >> 4, qh[l] >> 4);
                    y[l + 96] = q(ql[l + 32] >> 4, qh[l] >> 6);
                }
            }
        }
        IQ4_XS => {
            // d, scales_h u16, scales_l[4], qs[128]
            let d = f16_at(b, 0);
            let sh = u16::from_le_bytes([b[2], b[3]]) as u32;
            for ib in 0..8 {
                let sl = (b[4 + ib / 2] >> (4 * (ib % 2))) & 0x0F;
                let ls = sl as i32 | ((((sh >> (2 * ib)) & 3) as i32) << 4);
                let dl = d * (ls - 32) as f32;
                u.s[2 * ib..2 * ib + 2].fill(dl);
                let qs = &b[8 + 16 * ib..8 + 16 * ib + 16];
                for j in 0..16 {
                    u.q[32 * ib + j] = IQ4NL_VALUES[(qs[j] & 0x0F) as usize];
                    u.q[32 * ib + j + 16] = IQ4NL_VALUES[(qs[j] >> 4) as usize];
                }
            }
        }
        F32 | F16 | BF16 => unreachable!("float types are not unpacked"),
    }
}

/// One row of `ty` (`raw`: whole blocks) as f32 into `out`, exactly as ggml's
/// `dequantize_row_*`.
pub fn dequantize_row(ty: BlockType, raw: &[u8], out: &mut [f32]) -> Result<(), KernelError> {
    let (bs, bb) = (ty.block_size(), ty.block_bytes());
    if !raw.len().is_multiple_of(bb) || raw.len() / bb * bs != out.len() {
        return Err(KernelError::Shape(format!(
            "{} bytes of {ty:?} do not make {} values",
            raw.len(),
            out.len()
        )));
    }
    dequantize_row_unchecked(ty, raw, out);
    Ok(())
}

/// `dequantize_row` with sizes known to match.
pub(crate) fn dequantize_row_unchecked(ty: BlockType, raw: &[u8], out: &mut [f32]) {
    match ty {
        BlockType::F32 => {
            for (o, c) in out.iter_mut().zip(raw.chunks_exact(4)) {
                *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
        BlockType::F16 => {
            for (o, c) in out.iter_mut().zip(raw.chunks_exact(2)) {
                *o = f16_to_f32(u16::from_le_bytes([c[0], c[1]]));
            }
        }
        BlockType::BF16 => {
            for (o, c) in out.iter_mut().zip(raw.chunks_exact(2)) {
                *o = f32::from_bits((u16::from_le_bytes([c[0], c[1]]) as u32) << 16);
            }
        }
        _ => {
            let (bs, bb) = (ty.block_size(), ty.block_bytes());
            let mut u = Unpacked::new();
            for (b, y) in raw.chunks_exact(bb).zip(out.chunks_exact_mut(bs)) {
                unpack(ty, b, &mut u);
                for (e, v) in y.iter_mut().enumerate() {
                    let g = e / 16;
                    *v = u.s[g] * u.q[e] as f32;
                    if u.offset {
                        *v += u.o[g];
                    }
                }
            }
        }
    }
}

/// Dot products of weight row `row` with activation rows `[r0, r0 + rows)` into `out`.
pub(crate) fn row_dot(
    ty: BlockType,
    row: &[u8],
    acts: &Acts<'_>,
    r0: usize,
    rows: usize,
    out: &mut [f32],
) {
    match acts {
        Acts::Float { x, k } => {
            let mut w = vec![0f32; *k];
            dequantize_row_unchecked(ty, row, &mut w);
            for (i, o) in out[..rows].iter_mut().enumerate() {
                let xr = &x[(r0 + i) * k..(r0 + i + 1) * k];
                let mut lanes = [0f32; 8];
                for (c, (a, b)) in w.iter().zip(xr).enumerate() {
                    lanes[c % 8] += a * b;
                }
                *o = lanes.iter().sum();
            }
        }
        Acts::Quant(a) => {
            let (bs, bb) = (ty.block_size(), ty.block_bytes());
            let nb = a.blocks_per_row();
            let mut u = Unpacked::new();
            out[..rows].fill(0.0);
            for (bi, b) in row.chunks_exact(bb).enumerate() {
                unpack(ty, b, &mut u);
                for c in 0..bs / ACT_BLOCK {
                    let e0 = c * ACT_BLOCK;
                    for (i, o) in out[..rows].iter_mut().enumerate() {
                        // activation block of this chunk in row r0 + i
                        let ab = (r0 + i) * nb + bi * (bs / ACT_BLOCK) + c;
                        let aq = &a.qs[ab * ACT_BLOCK..(ab + 1) * ACT_BLOCK];
                        let isum = |h: usize| -> i32 {
                            (16 * h..16 * h + 16)
                                .map(|j| u.q[e0 + j] as i32 * aq[j] as i32)
                                .sum()
                        };
                        let (g0, g1) = (e0 / 16, e0 / 16 + 1);
                        let mut acc =
                            a.d[ab] * (u.s[g0] * isum(0) as f32 + u.s[g1] * isum(1) as f32);
                        if u.offset {
                            acc += u.o[g0] * a.sum16[2 * ab] + u.o[g1] * a.sum16[2 * ab + 1];
                        }
                        *o += acc;
                    }
                }
            }
        }
    }
}
