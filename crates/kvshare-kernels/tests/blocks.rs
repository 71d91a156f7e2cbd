//! Block-format kernels against references written straight from ggml's C
//! (`dequantize_row_*` in ggml-quants.c), on random valid blocks.

use kvshare_kernels::blocks::{
    block_matmul_t, block_matmul_t_portable, dequantize_row, dequantize_rows, f16_to_f32,
    BlockMatrix, BlockType, QActs, ACT_BLOCK,
};
use kvshare_kernels::KernelError;
use proptest::prelude::*;

const KVALUES: [i8; 16] = [
    -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
];

/// ggml's kvalues_mxfp4: the E2M1 values doubled.
const KVALUES_MXFP4: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

/// ggml's GGML_E8M0_TO_FP32_HALF, transcribed.
fn e8m0_to_fp32_half(x: u8) -> f32 {
    let bits: u32 = if x < 2 {
        0x0020_0000 << x
    } else {
        (x as u32 - 1) << 23
    };
    f32::from_bits(bits)
}

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        // splitmix64
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn byte(&mut self) -> u8 {
        self.next() as u8
    }
    fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    }
    /// A finite half of magnitude about 2^-9..1, random sign.
    fn small_f16(&mut self) -> u16 {
        let r = self.next();
        let sign = (r & 1) as u16;
        let exp = 6 + (r >> 1) as u16 % 9;
        let man = (r >> 8) as u16 & 0x3ff;
        (sign << 15) | (exp << 10) | man
    }
}

fn f16_fields(ty: BlockType) -> &'static [usize] {
    use BlockType::*;
    match ty {
        Q4_0 | Q5_0 | Q8_0 | IQ4_NL | IQ4_XS | Q4_1 | Q5_1 | Q4_K | Q5_K => match ty {
            Q4_1 | Q5_1 | Q4_K | Q5_K => &[0, 2],
            _ => &[0],
        },
        Q2_K => &[80, 82],
        Q3_K => &[108],
        Q6_K => &[208],
        F32 | F16 | BF16 | MXFP4 => &[],
    }
}

/// `n` rows of `k` elements of type `ty`: random bytes with finite, small scales.
fn random_rows(ty: BlockType, n: usize, k: usize, rng: &mut Rng) -> Vec<u8> {
    let nb = n * k / ty.block_size();
    let bb = ty.block_bytes();
    let mut raw: Vec<u8> = (0..nb * bb).map(|_| rng.byte()).collect();
    for b in raw.chunks_exact_mut(bb) {
        match ty {
            BlockType::F32 => b.copy_from_slice(&rng.unit().to_le_bytes()),
            BlockType::F16 => b.copy_from_slice(&rng.small_f16().to_le_bytes()),
            BlockType::BF16 => {
                let v = (rng.unit().to_bits() >> 16) as u16;
                b.copy_from_slice(&v.to_le_bytes())
            }
            // exponents 2^-10..2^2: products stay far from overflow and underflow
            BlockType::MXFP4 => b[0] = 118 + rng.byte() % 13,
            _ => {
                for &off in f16_fields(ty) {
                    b[off..off + 2].copy_from_slice(&rng.small_f16().to_le_bytes());
                }
            }
        }
    }
    raw
}

fn h(b: &[u8], o: usize) -> f32 {
    f16_to_f32(u16::from_le_bytes([b[o], b[o + 1]]))
}

fn get_scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

/// ggml's dequantize_row_* for one block, transcribed loop for loop.
fn reference_block(ty: BlockType, x: &[u8], y: &mut Vec<f32>) {
    use BlockType::*;
    match ty {
        Q8_0 => {
            let d = h(x, 0);
            for j in 0..32 {
                y.push((x[2 + j] as i8) as f32 * d);
            }
        }
        Q4_0 | Q4_1 | IQ4_NL => {
            let d = h(x, 0);
            let qs = if ty == Q4_1 { &x[4..20] } else { &x[2..18] };
            let mut out = [0f32; 32];
            for j in 0..16 {
                let (a, b) = ((qs[j] & 0x0F) as i32, (qs[j] >> 4) as i32);
                (out[j], out[j + 16]) = match ty {
                    Q4_0 => ((a - 8) as f32 * d, (b - 8) as f32 * d),
                    Q4_1 => {
                        let m = h(x, 2);
                        (a as f32 * d + m, b as f32 * d + m)
                    }
                    _ => (
                        d * KVALUES[a as usize] as f32,
                        d * KVALUES[b as usize] as f32,
                    ),
                };
            }
            y.extend_from_slice(&out);
        }
        Q5_0 | Q5_1 => {
            let d = h(x, 0);
            let o = if ty == Q5_1 { 2 } else { 0 };
            let qh = u32::from_le_bytes([x[2 + o], x[3 + o], x[4 + o], x[5 + o]]);
            let qs = &x[6 + o..22 + o];
            let mut out = [0f32; 32];
            for j in 0..16 {
                let xh_0 = ((qh >> j) << 4) & 0x10;
                let xh_1 = (qh >> (j + 12)) & 0x10;
                let x0 = ((qs[j] as u32 & 0x0F) | xh_0) as i32;
                let x1 = ((qs[j] as u32 >> 4) | xh_1) as i32;
                if ty == Q5_0 {
                    out[j] = (x0 - 16) as f32 * d;
                    out[j + 16] = (x1 - 16) as f32 * d;
                } else {
                    let m = h(x, 2);
                    out[j] = x0 as f32 * d + m;
                    out[j + 16] = x1 as f32 * d + m;
                }
            }
            y.extend_from_slice(&out);
        }
        Q2_K => {
            let (d, min) = (h(x, 80), h(x, 82));
            let mut q = &x[16..80];
            let mut is = 0;
            for _n in 0..2 {
                let mut shift = 0;
                for _j in 0..4 {
                    for half in 0..2 {
                        let sc = x[is];
                        is += 1;
                        let (dl, ml) = (d * (sc & 0xF) as f32, min * (sc >> 4) as f32);
                        for l in 0..16 {
                            y.push(dl * ((q[l + 16 * half] >> shift) & 3) as i8 as f32 - ml);
                        }
                    }
                    shift += 2;
                }
                q = &q[32..];
            }
        }
        Q3_K => {
            let d_all = h(x, 108);
            let mut aux = [0u32; 4];
            for i in 0..3 {
                aux[i] = u32::from_le_bytes([
                    x[96 + 4 * i],
                    x[97 + 4 * i],
                    x[98 + 4 * i],
                    x[99 + 4 * i],
                ]);
            }
            let (kmask1, kmask2) = (0x03030303u32, 0x0f0f0f0fu32);
            let tmp = aux[2];
            aux[2] = ((aux[0] >> 4) & kmask2) | (((tmp >> 4) & kmask1) << 4);
            aux[3] = ((aux[1] >> 4) & kmask2) | (((tmp >> 6) & kmask1) << 4);
            aux[0] = (aux[0] & kmask2) | ((tmp & kmask1) << 4);
            aux[1] = (aux[1] & kmask2) | (((tmp >> 2) & kmask1) << 4);
            let scales: Vec<i8> = aux
                .iter()
                .flat_map(|v| v.to_le_bytes())
                .map(|b| b as i8)
                .collect();
            let hm = &x[0..32];
            let mut q = &x[32..96];
            let (mut m, mut is) = (1u8, 0);
            for _n in 0..2 {
                let mut shift = 0;
                for _j in 0..4 {
                    for half in 0..2 {
                        let dl = d_all * (scales[is] as i32 - 32) as f32;
                        is += 1;
                        for l in 0..16 {
                            let i = l + 16 * half;
                            let v =
                                ((q[i] >> shift) & 3) as i8 - if hm[i] & m != 0 { 0 } else { 4 };
                            y.push(dl * v as f32);
                        }
                    }
                    shift += 2;
                    m = m.wrapping_shl(1);
                }
                q = &q[32..];
            }
        }
        Q4_K | Q5_K => {
            let (d, min) = (h(x, 0), h(x, 2));
            let sc = &x[4..16];
            let (qh, mut ql) = if ty == Q5_K {
                (&x[16..48], &x[48..176])
            } else {
                (&x[0..0], &x[16..144])
            };
            let (mut is, mut u1, mut u2) = (0, 1u8, 2u8);
            for _j in 0..4 {
                let (s, m) = get_scale_min_k4(is, sc);
                let (d1, m1) = (d * s as f32, min * m as f32);
                let (s, m) = get_scale_min_k4(is + 1, sc);
                let (d2, m2) = (d * s as f32, min * m as f32);
                for l in 0..32 {
                    let hb = if ty == Q5_K && qh[l] & u1 != 0 { 16 } else { 0 };
                    y.push(d1 * ((ql[l] & 0xF) + hb) as f32 - m1);
                }
                for l in 0..32 {
                    let hb = if ty == Q5_K && qh[l] & u2 != 0 { 16 } else { 0 };
                    y.push(d2 * ((ql[l] >> 4) + hb) as f32 - m2);
                }
                ql = &ql[32..];
                is += 2;
                u1 <<= 2;
                u2 <<= 2;
            }
        }
        Q6_K => {
            let d = h(x, 208);
            for n in 0..2 {
                let ql = &x[64 * n..];
                let qh = &x[128 + 32 * n..];
                let sc = &x[192 + 8 * n..];
                let mut out = [0f32; 128];
                for l in 0..32 {
                    let is = l / 16;
                    let q1 = ((ql[l] & 0xF) | ((qh[l] & 3) << 4)) as i8 - 32;
                    let q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) as i8 - 32;
                    let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i8 - 32;
                    let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i8 - 32;
                    out[l] = d * (sc[is] as i8) as f32 * q1 as f32;
                    out[l + 32] = d * (sc[is + 2] as i8) as f32 * q2 as f32;
                    out[l + 64] = d * (sc[is + 4] as i8) as f32 * q3 as f32;
                    out[l + 96] = d * (sc[is + 6] as i8) as f32 * q4 as f32;
                }
                y.extend_from_slice(&out);
            }
        }
        IQ4_XS => {
            let d = h(x, 0);
            let scales_h = u16::from_le_bytes([x[2], x[3]]) as i32;
            for ib in 0..8 {
                let ls = ((x[4 + ib / 2] >> (4 * (ib % 2))) & 0xf) as i32
                    | (((scales_h >> (2 * ib)) & 3) << 4);
                let dl = d * (ls - 32) as f32;
                let qs = &x[8 + 16 * ib..];
                let mut out = [0f32; 32];
                for j in 0..16 {
                    out[j] = dl * KVALUES[(qs[j] & 0xf) as usize] as f32;
                    out[j + 16] = dl * KVALUES[(qs[j] >> 4) as usize] as f32;
                }
                y.extend_from_slice(&out);
            }
        }
        MXFP4 => {
            // dequantize_row_mxfp4
            let d = e8m0_to_fp32_half(x[0]);
            let mut out = [0f32; 32];
            for j in 0..16 {
                let x0 = KVALUES_MXFP4[(x[1 + j] & 0x0F) as usize];
                let x1 = KVALUES_MXFP4[(x[1 + j] >> 4) as usize];
                out[j] = x0 as f32 * d;
                out[j + 16] = x1 as f32 * d;
            }
            y.extend_from_slice(&out);
        }
        F32 => y.push(f32::from_le_bytes([x[0], x[1], x[2], x[3]])),
        F16 => y.push(h(x, 0)),
        BF16 => y.push(f32::from_bits(
            (u16::from_le_bytes([x[0], x[1]]) as u32) << 16,
        )),
    }
}

fn reference_rows(ty: BlockType, raw: &[u8]) -> Vec<f32> {
    let mut y = Vec::new();
    for b in raw.chunks_exact(ty.block_bytes()) {
        reference_block(ty, b, &mut y);
    }
    y
}

/// Whether `got` is `x @ w.T` within the error of 8-bit activations (per 32 values, the
/// rounding error is at most amax / 254 each) plus f32 summation slack.
fn check_product(ty: BlockType, x: &[f32], w: &[f32], m: usize, n: usize, k: usize, got: &[f32]) {
    for r in 0..m {
        let xr = &x[r * k..(r + 1) * k];
        for c in 0..n {
            let wr = &w[c * k..(c + 1) * k];
            let (mut exact, mut mag, mut bound) = (0f64, 0f64, 0f64);
            for (b, (xb, wb)) in xr.chunks(ACT_BLOCK).zip(wr.chunks(ACT_BLOCK)).enumerate() {
                let _ = b;
                let amax = xb.iter().fold(0f32, |a, v| a.max(v.abs())) as f64;
                for (a, v) in xb.iter().zip(wb) {
                    exact += *a as f64 * *v as f64;
                    mag += (*a as f64 * *v as f64).abs();
                    bound += (*v as f64).abs() * amax / 254.0;
                }
            }
            let tol = if ty.is_float() {
                1e-5 * mag + 1e-6
            } else {
                1.01 * bound + 1e-4 * mag + 1e-6
            };
            let g = got[r * n + c] as f64;
            assert!(
                (g - exact).abs() <= tol,
                "{ty:?} row {r} col {c}: got {g}, expected {exact} (tol {tol}, m {m} n {n} k {k})"
            );
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn dequantize_equals_ggml_reference(seed in any::<u64>(), n in 1usize..5, nb in 1usize..5) {
        let mut rng = Rng(seed);
        for ty in BlockType::ALL {
            let k = nb * ty.block_size().max(32);
            let raw = random_rows(ty, n, k, &mut rng);
            let want = reference_rows(ty, &raw);
            let mut got = vec![0f32; n * k];
            let w = BlockMatrix { raw: &raw, ty, n, k };
            dequantize_rows(&w, 0, n, &mut got, 2).unwrap();
            for (i, (a, b)) in got.iter().zip(&want).enumerate() {
                prop_assert_eq!(a.to_bits(), b.to_bits(), "{:?} element {}", ty, i);
            }
            let mut one = vec![0f32; k];
            dequantize_row(ty, &raw[..w.row_bytes()], &mut one).unwrap();
            prop_assert_eq!(&one[..], &want[..k]);
        }
    }

    #[test]
    fn products_match_dequantized_f32(
        seed in any::<u64>(),
        m in 1usize..=16,
        n in 1usize..70,
        nb in 1usize..=4,
    ) {
        let mut rng = Rng(seed);
        for ty in BlockType::ALL {
            let k = nb * ty.block_size().max(32);
            let raw = random_rows(ty, n, k, &mut rng);
            let wf = reference_rows(ty, &raw);
            let x: Vec<f32> = (0..m * k).map(|_| rng.unit()).collect();
            let w = BlockMatrix { raw: &raw, ty, n, k };
            let mut simd = vec![f32::NAN; m * n];
            block_matmul_t(&x, m, &w, &mut simd, 2).unwrap();
            check_product(ty, &x, &wf, m, n, k, &simd);
            let mut port = vec![f32::NAN; m * n];
            block_matmul_t_portable(&x, m, &w, &mut port, 1).unwrap();
            check_product(ty, &x, &wf, m, n, k, &port);
        }
    }
}

#[test]
fn threads_split_rows_without_changing_results() {
    let mut rng = Rng(7);
    for ty in [BlockType::Q4_K, BlockType::Q8_0, BlockType::F16] {
        let (m, n, k) = (5, 1003, 512);
        let raw = random_rows(ty, n, k, &mut rng);
        let x: Vec<f32> = (0..m * k).map(|_| rng.unit()).collect();
        let w = BlockMatrix {
            raw: &raw,
            ty,
            n,
            k,
        };
        let mut one = vec![0f32; m * n];
        let mut many = vec![0f32; m * n];
        block_matmul_t(&x, m, &w, &mut one, 1).unwrap();
        block_matmul_t(&x, m, &w, &mut many, 4).unwrap();
        assert_eq!(one, many, "{ty:?}");
        let mut d1 = vec![0f32; 400 * k];
        dequantize_rows(&w, 600, 1000, &mut d1, 4).unwrap();
        assert_eq!(
            d1,
            reference_rows(ty, &raw[600 * w.row_bytes()..1000 * w.row_bytes()])
        );
    }
}

#[test]
fn zero_activations_give_zero() {
    let mut rng = Rng(3);
    let (m, n, k) = (3, 9, 256);
    for ty in BlockType::ALL {
        let raw = random_rows(ty, n, k, &mut rng);
        let w = BlockMatrix {
            raw: &raw,
            ty,
            n,
            k,
        };
        let mut out = vec![f32::NAN; m * n];
        block_matmul_t(&vec![0.0; m * k], m, &w, &mut out, 1).unwrap();
        assert!(out.iter().all(|v| *v == 0.0), "{ty:?}: {out:?}");
    }
}

#[test]
fn ggml_ids_round_trip() {
    for ty in BlockType::ALL {
        assert_eq!(BlockType::from_ggml(ty as u32), Some(ty));
    }
    assert_eq!(BlockType::from_ggml(4), None); // Q4_2, removed from ggml
    assert_eq!(BlockType::from_ggml(16), None); // IQ2_XXS: no kernel here
    assert_eq!(BlockType::Q4_K.row_bytes(512), 288);
}

#[test]
fn bad_shapes_are_errors() {
    let raw = vec![0u8; 2 * 144];
    let shape_err = |r: Result<(), KernelError>| matches!(r, Err(KernelError::Shape(_)));
    let x = vec![0f32; 256];
    let mut out = vec![0f32; 2];
    let w = BlockMatrix {
        raw: &raw,
        ty: BlockType::Q4_K,
        n: 2,
        k: 256,
    };
    assert!(block_matmul_t(&x, 1, &w, &mut out, 1).is_ok());
    // k not a multiple of the block
    let w = BlockMatrix {
        raw: &raw,
        ty: BlockType::Q4_K,
        n: 2,
        k: 128,
    };
    assert!(shape_err(block_matmul_t(&x[..128], 1, &w, &mut out, 1)));
    // raw length
    let w = BlockMatrix {
        raw: &raw[..200],
        ty: BlockType::Q4_K,
        n: 2,
        k: 256,
    };
    assert!(shape_err(block_matmul_t(&x, 1, &w, &mut out, 1)));
    let w = BlockMatrix {
        raw: &raw,
        ty: BlockType::Q4_K,
        n: 2,
        k: 256,
    };
    // x and out sizes, too many rows
    assert!(shape_err(block_matmul_t(&x[..255], 1, &w, &mut out, 1)));
    assert!(shape_err(block_matmul_t(&x, 1, &w, &mut out[..1], 1)));
    let big = vec![0f32; 17 * 256];
    let mut big_out = vec![0f32; 17 * 2];
    assert!(shape_err(block_matmul_t(&big, 17, &w, &mut big_out, 1)));
    // dequantize ranges
    let mut d = vec![0f32; 256];
    assert!(shape_err(dequantize_rows(&w, 1, 3, &mut d, 1)));
    assert!(shape_err(dequantize_rows(&w, 0, 2, &mut d, 1)));
    assert!(shape_err(dequantize_row(
        BlockType::Q4_K,
        &raw[..100],
        &mut d
    )));
}

#[test]
fn float_weights_take_any_k() {
    let mut rng = Rng(11);
    for ty in [BlockType::F32, BlockType::F16, BlockType::BF16] {
        for k in [1, 5, 8, 15, 16, 23, 37] {
            let (m, n) = (6, 13);
            let raw = random_rows(ty, n, k, &mut rng);
            let wf = reference_rows(ty, &raw);
            let x: Vec<f32> = (0..m * k).map(|_| rng.unit()).collect();
            let w = BlockMatrix {
                raw: &raw,
                ty,
                n,
                k,
            };
            let mut simd = vec![f32::NAN; m * n];
            block_matmul_t(&x, m, &w, &mut simd, 1).unwrap();
            check_product(ty, &x, &wf, m, n, k, &simd);
            let mut port = vec![f32::NAN; m * n];
            block_matmul_t_portable(&x, m, &w, &mut port, 1).unwrap();
            check_product(ty, &x, &wf, m, n, k, &port);
        }
    }
}

/// The activations' round trip stands for exactly the kernel's 8-bit values: a product of the
/// round-tripped rows with dequantized weights in f32 equals the kernel's result up to float
/// summation order (this is how products with more rows than the kernel takes stay
/// consistent with it).
#[test]
fn act_round_trip_is_what_the_kernel_multiplies() {
    let mut rng = Rng(7);
    let (m, n, k) = (5, 23, 512);
    let x: Vec<f32> = (0..m * k).map(|_| rng.unit() * 2.0).collect();
    let mut xq = x.clone();
    QActs::round_trip(&mut xq, k);
    let acts = QActs::quantize(&x, k);
    for (i, (&v, &q)) in xq.iter().zip(&acts.qs).enumerate() {
        assert_eq!(v, q as f32 * acts.d[i / 32], "element {i}");
    }
    for ty in [
        BlockType::Q4_K,
        BlockType::Q8_0,
        BlockType::Q5_1,
        BlockType::Q6_K,
    ] {
        let raw = random_rows(ty, n, k, &mut rng);
        let w = reference_rows(ty, &raw);
        let mut got = vec![0f32; m * n];
        let bm = BlockMatrix {
            raw: &raw,
            ty,
            n,
            k,
        };
        block_matmul_t(&x, m, &bm, &mut got, 1).unwrap();
        for r in 0..m {
            for c in 0..n {
                let exact: f64 = (0..k)
                    .map(|i| xq[r * k + i] as f64 * w[c * k + i] as f64)
                    .sum();
                let scale: f64 = (0..k)
                    .map(|i| (xq[r * k + i] as f64 * w[c * k + i] as f64).abs())
                    .sum();
                let d = (got[r * n + c] as f64 - exact).abs();
                assert!(
                    d <= 1e-5 * scale + 1e-6,
                    "{ty:?} [{r}, {c}]: {} vs {exact}",
                    got[r * n + c]
                );
            }
        }
    }
}

// --- block_matmul_t_f32: f32 activations, exact up to summation order ---

use kvshare_kernels::blocks::{block_matmul_t_f32, block_matmul_t_f32_portable};

/// Whether `got` is `x @ w.T` (f64) within f32 summation error: 1e-5 * sum |x| |w|.
fn check_exact(ty: BlockType, x: &[f32], w: &[f32], m: usize, n: usize, k: usize, got: &[f32]) {
    for r in 0..m {
        let xr = &x[r * k..(r + 1) * k];
        for c in 0..n {
            let wr = &w[c * k..(c + 1) * k];
            let exact: f64 = xr.iter().zip(wr).map(|(a, b)| *a as f64 * *b as f64).sum();
            let mag: f64 = xr
                .iter()
                .zip(wr)
                .map(|(a, b)| (*a as f64 * *b as f64).abs())
                .sum();
            let tol = 1e-5 * mag + 1e-30;
            let g = got[r * n + c] as f64;
            assert!(
                (g - exact).abs() <= tol,
                "{ty:?} row {r} col {c}: got {g}, expected {exact} (tol {tol}, m {m} n {n} k {k})"
            );
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn f32_products_match_dequantized_f64(
        seed in any::<u64>(),
        m in 1usize..=16,
        n in 1usize..70,
        nb in 1usize..=4,
    ) {
        let mut rng = Rng(seed);
        for ty in BlockType::ALL {
            let k = nb * ty.block_size().max(32);
            let raw = random_rows(ty, n, k, &mut rng);
            let wf = reference_rows(ty, &raw);
            let x: Vec<f32> = (0..m * k).map(|_| rng.unit()).collect();
            let w = BlockMatrix { raw: &raw, ty, n, k };
            let mut simd = vec![f32::NAN; m * n];
            block_matmul_t_f32(&x, m, &w, &mut simd, 2).unwrap();
            check_exact(ty, &x, &wf, m, n, k, &simd);
            let mut port = vec![f32::NAN; m * n];
            block_matmul_t_f32_portable(&x, m, &w, &mut port, 1).unwrap();
            check_exact(ty, &x, &wf, m, n, k, &port);
        }
    }
}

/// One-hot activation rows pick single weights: 0 + w * 1 (and further zeros) is w exactly,
/// so each result is bit for bit the weight the kernel formed, which must be the dequantized
/// one (the kernel forms weights with ggml's own f32 operations).
#[test]
fn f32_weights_are_the_dequantized_ones() {
    let mut rng = Rng(21);
    let (n, k) = (37, 512);
    for ty in BlockType::ALL {
        let raw = random_rows(ty, n, k, &mut rng);
        let wf = reference_rows(ty, &raw);
        let w = BlockMatrix {
            raw: &raw,
            ty,
            n,
            k,
        };
        for j0 in (0..k).step_by(16) {
            let m = 16;
            let mut x = vec![0f32; m * k];
            for r in 0..m {
                x[r * k + j0 + r] = 1.0;
            }
            for portable in [false, true] {
                let mut out = vec![f32::NAN; m * n];
                if portable {
                    block_matmul_t_f32_portable(&x, m, &w, &mut out, 1).unwrap();
                } else {
                    block_matmul_t_f32(&x, m, &w, &mut out, 1).unwrap();
                }
                for r in 0..m {
                    for c in 0..n {
                        let want = wf[c * k + j0 + r];
                        assert!(
                            out[r * n + c] == want,
                            "{ty:?} portable {portable} w[{c}, {}]: {} vs {want}",
                            j0 + r,
                            out[r * n + c]
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn f32_threads_split_rows_without_changing_results() {
    let mut rng = Rng(9);
    for ty in [
        BlockType::Q4_K,
        BlockType::Q8_0,
        BlockType::Q6_K,
        BlockType::Q3_K,
        BlockType::F16,
    ] {
        let (m, n, k) = (7, 1003, 512);
        let raw = random_rows(ty, n, k, &mut rng);
        let x: Vec<f32> = (0..m * k).map(|_| rng.unit()).collect();
        let w = BlockMatrix {
            raw: &raw,
            ty,
            n,
            k,
        };
        let mut one = vec![0f32; m * n];
        let mut many = vec![0f32; m * n];
        block_matmul_t_f32(&x, m, &w, &mut one, 1).unwrap();
        block_matmul_t_f32(&x, m, &w, &mut many, 4).unwrap();
        assert_eq!(one, many, "{ty:?}");
        // a row's result does not depend on the other rows of its batch
        let mut single = vec![0f32; n];
        block_matmul_t_f32(&x[3 * k..4 * k], 1, &w, &mut single, 1).unwrap();
        let wf = reference_rows(ty, &raw);
        check_exact(ty, &x[3 * k..4 * k], &wf, 1, n, k, &single);
    }
}

#[test]
fn f32_results_do_not_depend_on_the_activations_alignment() {
    // the AVX-512 kernels copy the activations to a 64-byte-aligned buffer first (split
    // cache-line loads halved batch products); every offset of the caller's slice must give
    // the same bits
    let mut rng = Rng(17);
    for ty in [
        BlockType::Q8_0,
        BlockType::Q4_K,
        BlockType::Q6_K,
        BlockType::Q5_0,
    ] {
        let (m, n, k) = (8, 37, 512);
        let raw = random_rows(ty, n, k, &mut rng);
        let w = BlockMatrix {
            raw: &raw,
            ty,
            n,
            k,
        };
        let base: Vec<f32> = (0..m * k + 16).map(|_| rng.unit()).collect();
        let mut first: Option<Vec<f32>> = None;
        for off in 0..16 {
            let mut shifted = vec![0f32; m * k + 16];
            shifted[off..off + m * k].copy_from_slice(&base[..m * k]);
            let mut out = vec![0f32; m * n];
            block_matmul_t_f32(&shifted[off..off + m * k], m, &w, &mut out, 1).unwrap();
            match &first {
                None => {
                    let wf = reference_rows(ty, &raw);
                    check_exact(ty, &base[..m * k], &wf, m, n, k, &out);
                    first = Some(out);
                }
                Some(f) => assert_eq!(f, &out, "{ty:?} offset {off}"),
            }
        }
    }
}

#[test]
fn f32_float_weights_take_any_k_and_zero_acts_give_zero() {
    let mut rng = Rng(13);
    for ty in [BlockType::F32, BlockType::F16, BlockType::BF16] {
        for k in [1, 5, 8, 15, 16, 23, 37] {
            let (m, n) = (6, 13);
            let raw = random_rows(ty, n, k, &mut rng);
            let wf = reference_rows(ty, &raw);
            let x: Vec<f32> = (0..m * k).map(|_| rng.unit()).collect();
            let w = BlockMatrix {
                raw: &raw,
                ty,
                n,
                k,
            };
            let mut simd = vec![f32::NAN; m * n];
            block_matmul_t_f32(&x, m, &w, &mut simd, 1).unwrap();
            check_exact(ty, &x, &wf, m, n, k, &simd);
            let mut port = vec![f32::NAN; m * n];
            block_matmul_t_f32_portable(&x, m, &w, &mut port, 1).unwrap();
            check_exact(ty, &x, &wf, m, n, k, &port);
        }
    }
    let (m, n, k) = (3, 9, 256);
    for ty in BlockType::ALL {
        let raw = random_rows(ty, n, k, &mut rng);
        let w = BlockMatrix {
            raw: &raw,
            ty,
            n,
            k,
        };
        let mut out = vec![f32::NAN; m * n];
        block_matmul_t_f32(&vec![0.0; m * k], m, &w, &mut out, 1).unwrap();
        assert!(out.iter().all(|v| *v == 0.0), "{ty:?}: {out:?}");
    }
}

#[test]
fn f32_bad_shapes_are_errors() {
    let raw = vec![0u8; 2 * 144];
    let shape_err = |r: Result<(), KernelError>| matches!(r, Err(KernelError::Shape(_)));
    let x = vec![0f32; 17 * 256];
    let mut out = vec![0f32; 17 * 2];
    let w = BlockMatrix {
        raw: &raw,
        ty: BlockType::Q4_K,
        n: 2,
        k: 256,
    };
    assert!(block_matmul_t_f32(&x[..256], 1, &w, &mut out[..2], 1).is_ok());
    assert!(shape_err(block_matmul_t_f32(
        &x[..255],
        1,
        &w,
        &mut out[..2],
        1
    )));
    assert!(shape_err(block_matmul_t_f32(
        &x[..256],
        1,
        &w,
        &mut out[..1],
        1
    )));
    assert!(shape_err(block_matmul_t_f32(&x, 17, &w, &mut out, 1)));
    let bad = BlockMatrix {
        raw: &raw[..200],
        ..w
    };
    assert!(shape_err(block_matmul_t_f32(
        &x[..256],
        1,
        &bad,
        &mut out[..2],
        1
    )));
}

/// Zero, negative-zero, subnormal and extreme f16 scales take the kernels' slow conversion
/// path: the weights formed must still be the dequantized ones.
#[test]
fn f32_special_f16_scales() {
    let mut rng = Rng(17);
    let special: [u16; 8] = [
        0x0000, 0x8000, 0x0001, 0x83ff, 0x0200, 0x7bff, 0x0400, 0xbc00,
    ];
    let (n, k) = (11, 256);
    for ty in BlockType::ALL {
        if ty.is_float() {
            continue;
        }
        let mut raw = random_rows(ty, n, k, &mut rng);
        for b in raw.chunks_exact_mut(ty.block_bytes()) {
            for &off in f16_fields(ty) {
                let h = special[rng.next() as usize % special.len()];
                b[off..off + 2].copy_from_slice(&h.to_le_bytes());
            }
        }
        let wf = reference_rows(ty, &raw);
        let w = BlockMatrix {
            raw: &raw,
            ty,
            n,
            k,
        };
        for j0 in (0..k).step_by(4) {
            let m = 4;
            let mut x = vec![0f32; m * k];
            for r in 0..m {
                x[r * k + j0 + r] = 1.0;
            }
            let mut out = vec![f32::NAN; m * n];
            block_matmul_t_f32(&x, m, &w, &mut out, 1).unwrap();
            for r in 0..m {
                for c in 0..n {
                    let want = wf[c * k + j0 + r];
                    assert!(
                        out[r * n + c] == want,
                        "{ty:?} w[{c}, {}]: {} vs {want}",
                        j0 + r,
                        out[r * n + c]
                    );
                }
            }
        }
    }
}

/// MXFP4 at every E8M0 exponent: dequantized bit for bit as ggml (subnormal scales for
/// e < 2, infinities at e = 255 for the largest codes), and the f32 kernel forms the same
/// weights (one-hot rows; exponents up to 250, where no weight is infinite).
#[test]
fn mxfp4_every_exponent() {
    let ty = BlockType::MXFP4;
    let mut rng = Rng(41);
    let (n, k) = (8, 32 * 32);
    let mut raw = random_rows(ty, n, k, &mut rng);
    for (i, b) in raw.chunks_exact_mut(17).enumerate() {
        b[0] = i as u8; // 256 blocks: every exponent once
    }
    let want = reference_rows(ty, &raw);
    let w = BlockMatrix {
        raw: &raw,
        ty,
        n,
        k,
    };
    let mut got = vec![0f32; n * k];
    dequantize_rows(&w, 0, n, &mut got, 2).unwrap();
    for (i, (a, b)) in got.iter().zip(&want).enumerate() {
        assert_eq!(a.to_bits(), b.to_bits(), "element {i}");
    }
    assert!(want[32..64].iter().any(|v| *v != 0.0 && v.is_subnormal()));
    let finite = 251 / (k / 32); // the rows whose exponents are all <= 250
    let wr = BlockMatrix {
        raw: &raw[..finite * w.row_bytes()],
        ty,
        n: finite,
        k,
    };
    let m = 4;
    for j0 in (0..k).step_by(4) {
        let mut x = vec![0f32; m * k];
        for r in 0..m {
            x[r * k + j0 + r] = 1.0;
        }
        let mut out = vec![f32::NAN; m * finite];
        block_matmul_t_f32(&x, m, &wr, &mut out, 1).unwrap();
        for r in 0..m {
            for c in 0..finite {
                assert_eq!(
                    out[r * finite + c],
                    want[c * k + j0 + r],
                    "w[{c}, {}]",
                    j0 + r
                );
            }
        }
    }
}

use kvshare_kernels::blocks::block_matmul_t_f32_parts;

proptest! {
    #![proptest_config(ProptestConfig::with_cases(32))]

    /// Fused weights in one call: each part's columns equal that part's own product, bit for
    /// bit, and the f64 product within summation error.
    #[test]
    fn f32_parts_equal_each_part_alone(
        seed in any::<u64>(),
        m in 1usize..=16,
        picks in proptest::collection::vec((0usize..15, 1usize..45), 1..4),
    ) {
        let mut rng = Rng(seed);
        let k = 512;
        let specs: Vec<(BlockType, usize)> =
            picks.iter().map(|&(t, n)| (BlockType::ALL[t], n)).collect();
        let raws: Vec<Vec<u8>> = specs.iter().map(|&(ty, n)| random_rows(ty, n, k, &mut rng)).collect();
        let ws: Vec<BlockMatrix<'_>> = specs
            .iter()
            .zip(&raws)
            .map(|(&(ty, n), raw)| BlockMatrix { raw, ty, n, k })
            .collect();
        let x: Vec<f32> = (0..m * k).map(|_| rng.unit()).collect();
        let ld: usize = specs.iter().map(|s| s.1).sum();
        let mut out = vec![f32::NAN; m * ld];
        block_matmul_t_f32_parts(&x, m, &ws, &mut out, 2).unwrap();
        let mut col = 0;
        for (w, raw) in ws.iter().zip(&raws) {
            let mut alone = vec![0f32; m * w.n];
            block_matmul_t_f32(&x, m, w, &mut alone, 2).unwrap();
            let mut mine = vec![0f32; m * w.n];
            for r in 0..m {
                mine[r * w.n..(r + 1) * w.n].copy_from_slice(&out[r * ld + col..r * ld + col + w.n]);
            }
            prop_assert_eq!(&mine, &alone);
            check_exact(w.ty, &x, &reference_rows(w.ty, raw), m, w.n, k, &mine);
            col += w.n;
        }
    }
}

#[test]
fn f32_parts_bad_shapes_are_errors() {
    let raw = vec![0u8; 2 * 144];
    let w = BlockMatrix {
        raw: &raw,
        ty: BlockType::Q4_K,
        n: 2,
        k: 256,
    };
    let short = BlockMatrix {
        raw: &raw[..144],
        ty: BlockType::Q4_K,
        n: 1,
        k: 128,
    };
    let x = vec![0f32; 256];
    let mut out = vec![0f32; 4];
    assert!(block_matmul_t_f32_parts(&x, 1, &[w, w], &mut out, 1).is_ok());
    let shape_err = |r: Result<(), KernelError>| matches!(r, Err(KernelError::Shape(_)));
    assert!(shape_err(block_matmul_t_f32_parts(&x, 1, &[], &mut out, 1)));
    assert!(shape_err(block_matmul_t_f32_parts(
        &x,
        1,
        &[w, short],
        &mut out,
        1
    )));
    assert!(shape_err(block_matmul_t_f32_parts(
        &x,
        1,
        &[w],
        &mut out,
        1
    )));
    assert!(shape_err(block_matmul_t_f32_parts(
        &x[..255],
        1,
        &[w, w],
        &mut out,
        1
    )));
    let big = vec![0f32; 17 * 256];
    let mut big_out = vec![0f32; 17 * 4];
    assert!(shape_err(block_matmul_t_f32_parts(
        &big,
        17,
        &[w, w],
        &mut big_out,
        1
    )));
}

use kvshare_kernels::blocks::{block_gemm_f32, gemm_available};

/// `block_gemm_f32` of `x` (`[m, k]`) into columns `col0..col0 + n` of a NaN-filled `[m, ld]`,
/// returned as `[m, n]`; the other columns must stay NaN.
fn gemm_cols(
    x: &[f32],
    m: usize,
    w: &BlockMatrix<'_>,
    ld: usize,
    col0: usize,
    th: usize,
) -> Vec<f32> {
    let mut out = vec![f32::NAN; m * ld];
    block_gemm_f32(x, m, w, &mut out, ld, col0, th).unwrap();
    let mut got = Vec::with_capacity(m * w.n);
    for r in 0..m {
        for c in 0..ld {
            let v = out[r * ld + c];
            if (col0..col0 + w.n).contains(&c) {
                got.push(v);
            } else {
                assert!(
                    v.is_nan(),
                    "{:?}: column {c} outside {col0}..{} written",
                    w.ty,
                    col0 + w.n
                );
            }
        }
    }
    got
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(40))]

    // every quantized type, ragged m (not a multiple of the 32-row blocks; 16 or fewer rows
    // take the half-width kernel) and n (not a multiple of the 12-row panels)
    #[test]
    fn gemm_matches_dequantized_f64(
        seed in any::<u64>(),
        m in 1usize..75,
        n in 1usize..30,
        kb in 1usize..3,
        col0 in 0usize..5,
        th in 1usize..4,
    ) {
        if !gemm_available() {
            return Ok(());
        }
        let mut rng = Rng(seed);
        for ty in BlockType::ALL {
            if ty.is_float() {
                continue;
            }
            let k = 256 * kb;
            let raw = random_rows(ty, n, k, &mut rng);
            let x: Vec<f32> = (0..m * k).map(|_| rng.unit()).collect();
            let w = BlockMatrix { raw: &raw, ty, n, k };
            let got = gemm_cols(&x, m, &w, n + col0 + 3, col0, th);
            check_exact(ty, &x, &reference_rows(ty, &raw), m, n, k, &got);
        }
    }
}

#[test]
fn gemm_rows_do_not_depend_on_the_batch_or_threads() {
    if !gemm_available() {
        return;
    }
    let mut rng = Rng(23);
    for ty in [
        BlockType::Q4_K,
        BlockType::Q8_0,
        BlockType::Q6_K,
        BlockType::Q5_0,
    ] {
        let (m, n, k) = (70, 53, 512);
        let raw = random_rows(ty, n, k, &mut rng);
        let x: Vec<f32> = (0..m * k).map(|_| rng.unit()).collect();
        let w = BlockMatrix {
            raw: &raw,
            ty,
            n,
            k,
        };
        let all = gemm_cols(&x, m, &w, n, 0, 1);
        assert_eq!(all, gemm_cols(&x, m, &w, n, 0, 3), "{ty:?}: threads");
        // each row alone, and inside other batches (another place in the 32-row blocks)
        for (lo, hi) in [(5, 6), (5, 40), (33, 70), (0, 17)] {
            let part = gemm_cols(&x[lo * k..hi * k], hi - lo, &w, n, 0, 2);
            assert_eq!(&all[lo * n..hi * n], &part[..], "{ty:?}: rows {lo}..{hi}");
        }
    }
}

#[test]
fn gemm_refuses_float_weights_and_bad_shapes() {
    if !gemm_available() {
        return;
    }
    let mut rng = Rng(29);
    let (m, n, k) = (3, 4, 256);
    let x = vec![0.5f32; m * k];
    let raw = random_rows(BlockType::F16, n, k, &mut rng);
    let w = BlockMatrix {
        raw: &raw,
        ty: BlockType::F16,
        n,
        k,
    };
    let mut out = vec![0f32; m * n];
    assert!(matches!(
        block_gemm_f32(&x, m, &w, &mut out, n, 0, 1),
        Err(KernelError::Shape(_))
    ));
    let raw = random_rows(BlockType::Q4_K, n, k, &mut rng);
    let w = BlockMatrix {
        raw: &raw,
        ty: BlockType::Q4_K,
        n,
        k,
    };
    // columns past ld, a short out, a short x
    assert!(block_gemm_f32(&x, m, &w, &mut out, n, 1, 1).is_err());
    assert!(block_gemm_f32(&x, m, &w, &mut out[1..], n, 0, 1).is_err());
    assert!(block_gemm_f32(&x[1..], m, &w, &mut out, n, 0, 1).is_err());
    assert!(block_gemm_f32(&x, m, &w, &mut out, n, 0, 1).is_ok());
}

use kvshare_kernels::blocks::{block_matmul_t_vnni, vnni_available, vnni_supports};

/// Whether `got` is `x @ w.T` within the error of the VNNI kernels' 8-bit activations:
/// K-quants per 256 values (as ggml's Q8_K: each value off by at most amax / 254 of its 256),
/// the others per 32, plus f32 summation slack.
fn check_vnni(ty: BlockType, x: &[f32], w: &[f32], m: usize, n: usize, k: usize, got: &[f32]) {
    let block = if matches!(ty, BlockType::Q4_K | BlockType::Q6_K) {
        256
    } else {
        32
    };
    for r in 0..m {
        let xr = &x[r * k..(r + 1) * k];
        for c in 0..n {
            let wr = &w[c * k..(c + 1) * k];
            let (mut exact, mut mag, mut bound) = (0f64, 0f64, 0f64);
            for (xb, wb) in xr.chunks(block).zip(wr.chunks(block)) {
                let amax = xb.iter().fold(0f32, |a, v| a.max(v.abs())) as f64;
                for (a, v) in xb.iter().zip(wb) {
                    exact += *a as f64 * *v as f64;
                    mag += (*a as f64 * *v as f64).abs();
                    bound += (*v as f64).abs() * amax / 254.0;
                }
            }
            let tol = 1.01 * bound + 1e-4 * mag + 1e-6;
            let g = got[r * n + c] as f64;
            assert!(
                (g - exact).abs() <= tol,
                "{ty:?} row {r} col {c}: got {g}, expected {exact} (tol {tol}, m {m} n {n} k {k})"
            );
        }
    }
}

fn vnni_types() -> Vec<BlockType> {
    BlockType::ALL
        .into_iter()
        .filter(|t| vnni_supports(*t))
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(40))]

    // every type with a VNNI kernel, ragged m (tiles of 8 rows) and n (tiles of 32), 1..3
    // superblocks, 1..3 threads: within the error of 8-bit activations
    #[test]
    fn vnni_matches_dequantized_f64(
        seed in any::<u64>(),
        m in 1usize..40,
        n in 1usize..70,
        kb in 1usize..4,
        th in 1usize..4,
    ) {
        if !vnni_available() {
            return Ok(());
        }
        let mut rng = Rng(seed);
        for ty in vnni_types() {
            let k = 256 * kb;
            let raw = random_rows(ty, n, k, &mut rng);
            let x: Vec<f32> = (0..m * k).map(|_| rng.unit()).collect();
            let w = BlockMatrix { raw: &raw, ty, n, k };
            let mut got = vec![f32::NAN; m * n];
            block_matmul_t_vnni(&x, m, &[w], &mut got, th).unwrap();
            check_vnni(ty, &x, &reference_rows(ty, &raw), m, n, k, &got);
        }
    }
}

#[test]
fn vnni_rows_do_not_depend_on_the_batch_or_threads() {
    if !vnni_available() {
        return;
    }
    let mut rng = Rng(29);
    // an odd n leaves one row outside the one-row kernels' pairs; k = 768 leaves a chunk of
    // one K-quant block and 8 legacy blocks, k = 800 an odd 9 legacy blocks
    let shapes = |ty: BlockType| {
        let mut s = vec![(70, 512), (71, 768)];
        if ty.block_size() == 32 {
            s.push((67, 800));
        }
        s
    };
    for (ty, (n, k)) in vnni_types()
        .into_iter()
        .flat_map(|ty| shapes(ty).into_iter().map(move |s| (ty, s)))
    {
        let m = 45;
        let raw = random_rows(ty, n, k, &mut rng);
        let x: Vec<f32> = (0..m * k).map(|_| rng.unit()).collect();
        let w = BlockMatrix {
            raw: &raw,
            ty,
            n,
            k,
        };
        let run = |lo: usize, hi: usize, th: usize| {
            let mut out = vec![f32::NAN; (hi - lo) * n];
            block_matmul_t_vnni(&x[lo * k..hi * k], hi - lo, &[w], &mut out, th).unwrap();
            out
        };
        let all = run(0, m, 1);
        assert_eq!(all, run(0, m, 3), "{ty:?}: threads");
        // one row alone (a decode step), 2-4 rows (weight rows in lanes), and rows in other
        // places of the 8-row tiles
        for (lo, hi) in [
            (5, 6),
            (5, 7),
            (2, 5),
            (10, 14),
            (20, 25),
            (5, 13),
            (3, 40),
            (0, 17),
            (44, 45),
        ] {
            let part = run(lo, hi, 2);
            for (i, (a, b)) in all[lo * n..hi * n].iter().zip(&part).enumerate() {
                assert_eq!(
                    a.to_bits(),
                    b.to_bits(),
                    "{ty:?}: rows {lo}..{hi}, value {i}"
                );
            }
        }
    }
}

#[test]
fn vnni_parts_equal_each_part_alone_and_bad_input_is_an_error() {
    if !vnni_available() {
        return;
    }
    let mut rng = Rng(31);
    let (m, k) = (11, 256);
    let x: Vec<f32> = (0..m * k).map(|_| rng.unit()).collect();
    let raws: Vec<(BlockType, usize, Vec<u8>)> = [
        (BlockType::Q4_K, 40),
        (BlockType::Q8_0, 9),
        (BlockType::Q6_K, 33),
    ]
    .into_iter()
    .map(|(ty, n)| (ty, n, random_rows(ty, n, k, &mut rng)))
    .collect();
    let ws: Vec<BlockMatrix<'_>> = raws
        .iter()
        .map(|(ty, n, raw)| BlockMatrix {
            raw,
            ty: *ty,
            n: *n,
            k,
        })
        .collect();
    let ld: usize = ws.iter().map(|w| w.n).sum();
    let mut all = vec![f32::NAN; m * ld];
    block_matmul_t_vnni(&x, m, &ws, &mut all, 2).unwrap();
    let mut col = 0;
    for w in &ws {
        let mut one = vec![f32::NAN; m * w.n];
        block_matmul_t_vnni(&x, m, std::slice::from_ref(w), &mut one, 1).unwrap();
        for r in 0..m {
            assert_eq!(
                &all[r * ld + col..r * ld + col + w.n],
                &one[r * w.n..(r + 1) * w.n]
            );
        }
        col += w.n;
    }
    // a type without a kernel, a short x, a short out, parts of different k
    let q2 = random_rows(BlockType::Q2_K, 3, k, &mut rng);
    let bad = BlockMatrix {
        raw: &q2,
        ty: BlockType::Q2_K,
        n: 3,
        k,
    };
    assert!(matches!(
        block_matmul_t_vnni(&x, m, &[bad], &mut vec![0.0; m * 3], 1),
        Err(KernelError::Shape(_))
    ));
    assert!(block_matmul_t_vnni(&x[..k], m, &ws[..1], &mut vec![0.0; m * 40], 1).is_err());
    assert!(block_matmul_t_vnni(&x, m, &ws[..1], &mut vec![0.0; m * 39], 1).is_err());
    let wide = random_rows(BlockType::Q8_0, 2, 2 * k, &mut rng);
    let other = BlockMatrix {
        raw: &wide,
        ty: BlockType::Q8_0,
        n: 2,
        k: 2 * k,
    };
    assert!(block_matmul_t_vnni(&x, m, &[ws[0], other], &mut vec![0.0; m * 42], 1).is_err());
}
