//! The grouped expert products (`moe_gate_up`, `moe_down`) against a plain reference: every
//! (token, slot) pair multiplied by its expert's dequantized rows in f64, the SwiGLU and the
//! weighted sum in f64; and bit for bit against one per-matrix kernel call per expert; with
//! per-expert biases and gpt-oss's `swiglu_oai`, against the same f64 reference and bit for
//! bit against the bias-free products with the biases and the activation applied after.

use kvshare_kernels::blocks::{
    block_gemm_f32, block_matmul_t_f32, dequantize_rows, gemm_available, vnni_available,
    BlockMatrix, BlockType, MAX_ROWS,
};
use kvshare_kernels::moe::{experts_supported, moe_down, moe_gate_up, ExpertActs, Experts};
use kvshare_kernels::rowops::{glu_in_place, Glu};
use proptest::prelude::*;

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
    fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    }
    /// A finite half of magnitude about 2^-9..2^-1, random sign.
    fn small_f16(&mut self) -> u16 {
        let r = self.next();
        let sign = (r & 1) as u16;
        let exp = 6 + (r >> 1) as u16 % 8;
        let man = (r >> 8) as u16 & 0x3ff;
        (sign << 15) | (exp << 10) | man
    }
}

/// `n` rows of `k` values of `ty`: random bytes with finite, small scales.
fn random_rows(ty: BlockType, n: usize, k: usize, rng: &mut Rng) -> Vec<u8> {
    let bb = ty.block_bytes();
    let nb = n * k / ty.block_size();
    let mut raw: Vec<u8> = (0..nb * bb).map(|_| rng.next() as u8).collect();
    let halves: &[usize] = match ty {
        BlockType::Q8_0 | BlockType::Q4_0 => &[0],
        BlockType::Q4_K => &[0, 2],
        BlockType::Q6_K => &[208],
        _ => &[],
    };
    for b in raw.chunks_exact_mut(bb) {
        if ty == BlockType::MXFP4 {
            b[0] = 120 + (rng.next() % 8) as u8; // E8M0 scales 2^-8..2^-1
        }
        if ty == BlockType::F16 {
            b.copy_from_slice(&rng.small_f16().to_le_bytes());
        }
        for &o in halves {
            b[o..o + 2].copy_from_slice(&rng.small_f16().to_le_bytes());
        }
    }
    raw
}

fn dequantize(w: &BlockMatrix<'_>) -> Vec<f32> {
    let mut out = vec![0f32; w.n * w.k];
    dequantize_rows(w, 0, w.n, &mut out, 1).unwrap();
    out
}

/// One MoE block's data: gate and up stacked tensors of `ff` rows per expert, down of `d`.
struct Block {
    n_expert: usize,
    ff: usize,
    d: usize,
    gate: Vec<u8>,
    up: Vec<u8>,
    down: Vec<u8>,
    tys: [BlockType; 3],
}

impl Block {
    fn new(tys: [BlockType; 3], n_expert: usize, ff: usize, d: usize, rng: &mut Rng) -> Self {
        Block {
            n_expert,
            ff,
            d,
            gate: random_rows(tys[0], n_expert * ff, d, rng),
            up: random_rows(tys[1], n_expert * ff, d, rng),
            down: random_rows(tys[2], n_expert * d, ff, rng),
            tys,
        }
    }
    fn gate_up(&self) -> [BlockMatrix<'_>; 2] {
        let m = |raw, ty| BlockMatrix {
            raw,
            ty,
            n: self.n_expert * self.ff,
            k: self.d,
        };
        [m(&self.gate[..], self.tys[0]), m(&self.up[..], self.tys[1])]
    }
    fn down(&self) -> [BlockMatrix<'_>; 1] {
        [BlockMatrix {
            raw: &self.down,
            ty: self.tys[2],
            n: self.n_expert * self.d,
            k: self.ff,
        }]
    }
}

/// (ids, weights) of `n_tok` tokens with `slots` distinct experts each.
fn routing(n_tok: usize, slots: usize, n_expert: usize, rng: &mut Rng) -> (Vec<i64>, Vec<f32>) {
    let mut ids = Vec::new();
    let mut ws = Vec::new();
    for _ in 0..n_tok {
        let mut picked: Vec<i64> = Vec::new();
        while picked.len() < slots {
            let e = (rng.next() % n_expert as u64) as i64;
            if !picked.contains(&e) {
                picked.push(e);
            }
        }
        ids.extend(picked);
        ws.extend((0..slots).map(|_| rng.unit().abs() + 0.1));
    }
    (ids, ws)
}

/// The block's output per token in f64, and per token the sum over its pairs of |w| |x| terms
/// (the scale of the 8-bit activations' error).
fn reference(
    b: &Block,
    x: &[f32],
    n_tok: usize,
    ids: &[i64],
    ws: &[f32],
    slots: usize,
) -> Vec<f64> {
    let [g, u] = b.gate_up();
    let (gf, uf, df) = (dequantize(&g), dequantize(&u), dequantize(&b.down()[0]));
    let (d, ff) = (b.d, b.ff);
    let mut out = vec![0f64; n_tok * d];
    for t in 0..n_tok {
        let xt = &x[t * d..(t + 1) * d];
        for j in 0..slots {
            let e = ids[t * slots + j] as usize;
            let mut a = vec![0f64; ff];
            for (c, av) in a.iter_mut().enumerate() {
                let row = (e * ff + c) * d;
                let dot = |w: &[f32]| -> f64 {
                    (0..d)
                        .map(|i| w[row + i] as f64 * xt[i] as f64)
                        .sum::<f64>()
                };
                let (gv, uv) = (dot(&gf), dot(&uf));
                *av = gv / (1.0 + (-gv).exp()) * uv;
            }
            for r in 0..d {
                let row = (e * d + r) * ff;
                let s: f64 = (0..ff).map(|c| df[row + c] as f64 * a[c]).sum();
                out[t * d + r] += ws[t * slots + j] as f64 * s;
            }
        }
    }
    out
}

#[allow(clippy::too_many_arguments)]
fn run_block(
    b: &Block,
    x: &[f32],
    n_tok: usize,
    ids: &[i64],
    ws: &[f32],
    slots: usize,
    acts: ExpertActs,
    threads: usize,
) -> Vec<f32> {
    let gu = b.gate_up();
    let dn = b.down();
    let gw = Experts {
        parts: &gu,
        n_expert: b.n_expert,
        bias: None,
    };
    let dw = Experts {
        parts: &dn,
        n_expert: b.n_expert,
        bias: None,
    };
    let mut a = vec![0f32; n_tok * slots * b.ff];
    moe_gate_up(
        x,
        n_tok,
        ids,
        slots,
        &gw,
        acts,
        Some(Glu::Silu),
        &mut a,
        threads,
    )
    .unwrap();
    let mut out = vec![0f32; n_tok * b.d];
    moe_down(&a, n_tok, ids, ws, slots, &dw, acts, &mut out, threads).unwrap();
    out
}

fn max_rel_err(got: &[f32], want: &[f64]) -> f64 {
    let scale = want.iter().fold(0f64, |m, v| m.max(v.abs())).max(1e-30);
    got.iter()
        .zip(want)
        .map(|(&g, &w)| (g as f64 - w).abs())
        .fold(0f64, f64::max)
        / scale
}

const TYPES: [[BlockType; 3]; 4] = [
    [BlockType::Q8_0, BlockType::Q4_0, BlockType::Q8_0],
    [BlockType::Q4_K, BlockType::Q4_K, BlockType::Q6_K],
    [BlockType::F16, BlockType::F16, BlockType::F16],
    [BlockType::Q4_K, BlockType::Q8_0, BlockType::Q4_0],
];

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    #[test]
    fn grouped_matches_the_reference(
        ty in 0usize..TYPES.len(),
        n_expert in 1usize..7,
        slots_max in 1usize..4,
        n_tok in 0usize..40,
        ff_blocks in 1usize..3,
        threads in 1usize..4,
        seed in any::<u64>(),
    ) {
        let mut rng = Rng(seed);
        let tys = TYPES[ty];
        let bs = tys.iter().map(|t| t.block_size()).max().unwrap();
        let (ff, d) = (ff_blocks * bs, bs);
        let slots = slots_max.min(n_expert);
        let b = Block::new(tys, n_expert, ff, d, &mut rng);
        let x: Vec<f32> = (0..n_tok * d).map(|_| rng.unit()).collect();
        let (ids, ws) = routing(n_tok, slots, n_expert, &mut rng);
        let want = reference(&b, &x, n_tok, &ids, &ws, slots);
        let got = run_block(&b, &x, n_tok, &ids, &ws, slots, ExpertActs::F32, threads);
        prop_assert!(max_rel_err(&got, &want) < 2e-5, "f32 {}", max_rel_err(&got, &want));
        // 8-bit activations: ~0.5% of sum |w x| per product, llama.cpp's approximation
        let got = run_block(&b, &x, n_tok, &ids, &ws, slots, ExpertActs::Q8, threads);
        prop_assert!(max_rel_err(&got, &want) < 0.05, "q8 {}", max_rel_err(&got, &want));
        let gu = b.gate_up();
        let dn = b.down();
        let vnni_ok = vnni_available()
            && experts_supported(&Experts { parts: &gu, n_expert, bias: None }, ExpertActs::Vnni)
            && experts_supported(&Experts { parts: &dn, n_expert, bias: None }, ExpertActs::Vnni);
        if vnni_ok {
            let got = run_block(&b, &x, n_tok, &ids, &ws, slots, ExpertActs::Vnni, threads);
            prop_assert!(max_rel_err(&got, &want) < 0.05, "vnni {}", max_rel_err(&got, &want));
        }
    }
}

/// One product per expert with the per-matrix kernels (the exact kernel up to MAX_ROWS
/// tokens, the panel GEMM above), as the per-expert path computes it.
fn per_expert_gate_up(b: &Block, x: &[f32], n_tok: usize, ids: &[i64], slots: usize) -> Vec<f32> {
    let [g, u] = b.gate_up();
    let (d, ff) = (b.d, b.ff);
    let mut out = vec![0f32; n_tok * slots * ff];
    for e in 0..b.n_expert {
        let pairs: Vec<usize> = (0..n_tok * slots)
            .filter(|&p| ids[p] as usize == e)
            .collect();
        let m = pairs.len();
        if m == 0 {
            continue;
        }
        let xs: Vec<f32> = pairs
            .iter()
            .flat_map(|&p| x[p / slots * d..(p / slots + 1) * d].iter().copied())
            .collect();
        let mut gu = vec![0f32; m * 2 * ff];
        for (part, w) in [g, u].iter().enumerate() {
            let rb = w.row_bytes();
            let sub = BlockMatrix {
                raw: &w.raw[e * ff * rb..(e + 1) * ff * rb],
                ty: w.ty,
                n: ff,
                k: d,
            };
            let mut o = vec![0f32; m * ff];
            if m > MAX_ROWS && gemm_available() && !w.ty.is_float() {
                block_gemm_f32(&xs, m, &sub, &mut o, ff, 0, 2).unwrap();
            } else {
                for r in (0..m).step_by(MAX_ROWS) {
                    let rows = (m - r).min(MAX_ROWS);
                    block_matmul_t_f32(
                        &xs[r * d..(r + rows) * d],
                        rows,
                        &sub,
                        &mut o[r * ff..(r + rows) * ff],
                        2,
                    )
                    .unwrap();
                }
            }
            for i in 0..m {
                gu[i * 2 * ff + part * ff..][..ff].copy_from_slice(&o[i * ff..(i + 1) * ff]);
            }
        }
        glu_in_place(&mut gu, ff, Glu::Silu).unwrap();
        for (i, &p) in pairs.iter().enumerate() {
            out[p * ff..(p + 1) * ff].copy_from_slice(&gu[i * 2 * ff..i * 2 * ff + ff]);
        }
    }
    out
}

#[test]
fn grouped_equals_one_product_per_expert_bit_for_bit() {
    let mut rng = Rng(11);
    for (n_tok, tys) in [(1, TYPES[1]), (7, TYPES[0]), (60, TYPES[1]), (60, TYPES[3])] {
        let b = Block::new(tys, 5, 512, 512, &mut rng);
        let x: Vec<f32> = (0..n_tok * b.d).map(|_| rng.unit()).collect();
        let (ids, _) = routing(n_tok, 2, 5, &mut rng);
        let want = per_expert_gate_up(&b, &x, n_tok, &ids, 2);
        for threads in [1, 2, 3] {
            let gu = b.gate_up();
            let w = Experts {
                parts: &gu,
                n_expert: 5,
                bias: None,
            };
            let mut got = vec![0f32; want.len()];
            moe_gate_up(
                &x,
                n_tok,
                &ids,
                2,
                &w,
                ExpertActs::F32,
                Some(Glu::Silu),
                &mut got,
                threads,
            )
            .unwrap();
            assert!(
                got.iter()
                    .zip(&want)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "{n_tok} tokens, {threads} threads"
            );
        }
    }
}

#[test]
fn ragged_loads_and_a_token_alone() {
    let mut rng = Rng(5);
    let b = Block::new(TYPES[0], 4, 64, 64, &mut rng);
    let n_tok = 30;
    let x: Vec<f32> = (0..n_tok * 64).map(|_| rng.unit()).collect();
    // every token on expert 2, the others idle
    let ids = vec![2i64; n_tok];
    let ws = vec![1f32; n_tok];
    let want = reference(&b, &x, n_tok, &ids, &ws, 1);
    let got = run_block(&b, &x, n_tok, &ids, &ws, 1, ExpertActs::F32, 2);
    assert!(max_rel_err(&got, &want) < 2e-5);
    // a token's row alone equals its row in the batch (the same bits where its experts have
    // at most MAX_ROWS tokens: the exact kernel either way; the GEMM above sums in its order)
    let (ids, ws) = routing(n_tok, 3, 4, &mut rng);
    let full = run_block(&b, &x, n_tok, &ids, &ws, 3, ExpertActs::F32, 2);
    let few = run_block(
        &b,
        &x[..5 * 64],
        5,
        &ids[..15],
        &ws[..15],
        3,
        ExpertActs::F32,
        2,
    );
    let one = run_block(
        &b,
        &x[64..128],
        1,
        &ids[3..6],
        &ws[3..6],
        3,
        ExpertActs::F32,
        1,
    );
    assert_eq!(one, few[64..128]);
    for t in [0, 13, 29] {
        let one = run_block(
            &b,
            &x[t * 64..(t + 1) * 64],
            1,
            &ids[t * 3..(t + 1) * 3],
            &ws[t * 3..(t + 1) * 3],
            3,
            ExpertActs::F32,
            2,
        );
        let want: Vec<f64> = full[t * 64..(t + 1) * 64]
            .iter()
            .map(|&v| v as f64)
            .collect();
        assert!(max_rel_err(&one, &want) < 1e-6);
    }
}

#[test]
fn bad_input_is_an_error() {
    let mut rng = Rng(3);
    let b = Block::new(TYPES[0], 4, 32, 32, &mut rng);
    let gu = b.gate_up();
    let w = Experts {
        parts: &gu,
        n_expert: 4,
        bias: None,
    };
    let x = vec![0f32; 2 * 32];
    let mut out = vec![0f32; 2 * 32];
    let run = |ids: &[i64], out: &mut [f32]| {
        moe_gate_up(&x, 2, ids, 1, &w, ExpertActs::F32, Some(Glu::Silu), out, 1)
    };
    assert!(run(&[0, 4], &mut out).is_err());
    assert!(run(&[0, -1], &mut out).is_err());
    assert!(run(&[0], &mut out).is_err());
    assert!(run(&[0, 1], &mut out[..10]).is_err());
    let bad = Experts {
        parts: &gu,
        n_expert: 3,
        bias: None,
    };
    assert!(moe_gate_up(&x, 2, &[0, 1], 1, &bad, ExpertActs::F32, None, &mut out, 1).is_err());
}

/// gpt-oss's block in f64: gate|up products plus biases, `swiglu_oai`, down products plus
/// biases, weighted and summed.
#[allow(clippy::too_many_arguments)]
fn reference_oai(
    b: &Block,
    gu_bias: &[f32],
    d_bias: &[f32],
    x: &[f32],
    n_tok: usize,
    ids: &[i64],
    ws: &[f32],
    slots: usize,
) -> Vec<f64> {
    let [g, u] = b.gate_up();
    let (gf, uf, df) = (dequantize(&g), dequantize(&u), dequantize(&b.down()[0]));
    let (d, ff) = (b.d, b.ff);
    let mut out = vec![0f64; n_tok * d];
    for t in 0..n_tok {
        let xt = &x[t * d..(t + 1) * d];
        for j in 0..slots {
            let e = ids[t * slots + j] as usize;
            let a: Vec<f64> = (0..ff)
                .map(|c| {
                    let row = (e * ff + c) * d;
                    let dot = |w: &[f32]| -> f64 {
                        (0..d).map(|i| w[row + i] as f64 * xt[i] as f64).sum()
                    };
                    let gv = (dot(&gf) + gu_bias[e * 2 * ff + c] as f64).min(7.0);
                    let uv = (dot(&uf) + gu_bias[e * 2 * ff + ff + c] as f64).clamp(-7.0, 7.0);
                    gv / (1.0 + (-1.702 * gv).exp()) * (uv + 1.0)
                })
                .collect();
            for r in 0..d {
                let row = (e * d + r) * ff;
                let s: f64 = (0..ff).map(|c| df[row + c] as f64 * a[c]).sum();
                out[t * d + r] += ws[t * slots + j] as f64 * (s + d_bias[e * d + r] as f64);
            }
        }
    }
    out
}

#[test]
fn biases_and_swiglu_oai() {
    let mut rng = Rng(23);
    let mx = BlockType::MXFP4;
    for (n_tok, tys) in [(1, [mx; 3]), (9, [mx; 3]), (40, [mx; 3]), (6, TYPES[1])] {
        let (n_expert, slots) = (6, 3);
        let b = Block::new(tys, n_expert, 256, 256, &mut rng);
        let (d, ff) = (b.d, b.ff);
        // gate and up values reach past the clamps (|product| ~ 1, biases up to 8)
        let gu_bias: Vec<f32> = (0..n_expert * 2 * ff).map(|_| rng.unit() * 8.0).collect();
        let d_bias: Vec<f32> = (0..n_expert * d).map(|_| rng.unit()).collect();
        let x: Vec<f32> = (0..n_tok * d).map(|_| rng.unit() * 4.0).collect();
        let (ids, ws) = routing(n_tok, slots, n_expert, &mut rng);
        let (gu, dn) = (b.gate_up(), b.down());
        let gw = Experts {
            parts: &gu,
            n_expert,
            bias: Some(&gu_bias),
        };
        let dw = Experts {
            parts: &dn,
            n_expert,
            bias: Some(&d_bias),
        };
        let pairs = n_tok * slots;
        for acts in [ExpertActs::F32, ExpertActs::Q8] {
            let mut a = vec![0f32; pairs * ff];
            let oai = Some(Glu::SwigluOai);
            moe_gate_up(&x, n_tok, &ids, slots, &gw, acts, oai, &mut a, 2).unwrap();
            let mut out = vec![0f32; n_tok * d];
            moe_down(&a, n_tok, &ids, &ws, slots, &dw, acts, &mut out, 2).unwrap();
            let want = reference_oai(&b, &gu_bias, &d_bias, &x, n_tok, &ids, &ws, slots);
            let err = max_rel_err(&out, &want);
            // 8-bit activations: ~0.5% of sum |w x| per product, llama.cpp's approximation
            let tol = if acts == ExpertActs::F32 { 2e-5 } else { 0.05 };
            assert!(err < tol, "{tys:?} {n_tok} tokens {acts:?}: {err}");

            // the same bits as the bias-free products with the biases added after them
            let bare_gu = Experts { bias: None, ..gw };
            let mut gu_rows = vec![0f32; pairs * 2 * ff];
            moe_gate_up(
                &x,
                n_tok,
                &ids,
                slots,
                &bare_gu,
                acts,
                None,
                &mut gu_rows,
                2,
            )
            .unwrap();
            for (p, row) in gu_rows.chunks_exact_mut(2 * ff).enumerate() {
                let e = ids[p] as usize;
                for (v, bv) in row.iter_mut().zip(&gu_bias[e * 2 * ff..(e + 1) * 2 * ff]) {
                    *v += bv;
                }
            }
            glu_in_place(&mut gu_rows, ff, Glu::SwigluOai).unwrap();
            for p in 0..pairs {
                let (got, exp) = (&a[p * ff..(p + 1) * ff], &gu_rows[p * 2 * ff..][..ff]);
                assert!(got.iter().zip(exp).all(|(g, e)| g.to_bits() == e.to_bits()));
            }
            // each pair's row alone: a one-slot token routed to the pair's expert
            let bare_d = Experts { bias: None, ..dw };
            let mut down_rows = vec![0f32; pairs * d];
            moe_gate_up(&a, pairs, &ids, 1, &bare_d, acts, None, &mut down_rows, 2).unwrap();
            for t in 0..n_tok {
                for r in 0..d {
                    let mut acc = 0f32;
                    for j in 0..slots {
                        let p = t * slots + j;
                        let e = ids[p] as usize;
                        let v = (down_rows[p * d + r] + d_bias[e * d + r]) * ws[p];
                        acc = if j == 0 { v } else { acc + v };
                    }
                    assert_eq!(out[t * d + r].to_bits(), acc.to_bits(), "token {t} row {r}");
                }
            }
        }
    }
    // a bias of the wrong size is refused
    let b = Block::new(TYPES[0], 2, 32, 32, &mut rng);
    let gu = b.gate_up();
    let short = vec![0f32; 2 * 64 - 1];
    let w = Experts {
        parts: &gu,
        n_expert: 2,
        bias: Some(&short),
    };
    let mut out = [0f32; 32];
    let r = moe_gate_up(
        &[0.0; 32],
        1,
        &[0],
        1,
        &w,
        ExpertActs::F32,
        None,
        &mut out[..],
        1,
    );
    assert!(r.is_err());
}
