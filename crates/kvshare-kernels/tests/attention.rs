//! `paged_attention` (SIMD where available, split over threads) against a float64 dense
//! reference over random block tables, windows, head groupings and sequence mixes, and
//! against the portable path; bad tables and shapes are typed errors. q8_0 pools: ggml's
//! quantization bit for bit, attention equal to f32 attention over the dequantized K/V.

use kvshare_kernels::attention::{
    paged_attention_avx2, paged_attention_portable, paged_attention_with, Paths,
};
use kvshare_kernels::{
    paged_attention, quantize_q8_0, KernelError, KvElem, PagedKv, Q8Block, Queries, F16,
};
use proptest::prelude::*;

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn unit(&mut self) -> f32 {
        (self.next() % 2001) as f32 / 1000.0 - 1.0
    }
}

struct Case {
    k: Vec<f32>,
    v: Vec<f32>,
    q: Vec<f32>,
    n_blocks: usize,
    bs: usize,
    n_kv: usize,
    hd: usize,
    n_head: usize,
    tables: Vec<i32>,
    width: usize,
    q_starts: Vec<i64>,
    starts: Vec<i64>,
}

impl Case {
    fn kv(&self) -> PagedKv<'_> {
        PagedKv {
            k: &self.k,
            v: &self.v,
            n_blocks: self.n_blocks,
            block_size: self.bs,
            n_kv: self.n_kv,
            head_dim: self.hd,
        }
    }
    fn queries(&self) -> Queries<'_> {
        Queries {
            q: &self.q,
            n_head: self.n_head,
            tables: &self.tables,
            width: self.width,
            q_starts: &self.q_starts,
            start_positions: &self.starts,
        }
    }

    /// Dense f64 attention of every query row.
    fn reference(&self, scale: f64, window: usize) -> Vec<f64> {
        self.reference_sinks(scale, window, None)
    }

    /// `reference` with each query head's sink logit in the softmax's denominator.
    fn reference_sinks(&self, scale: f64, window: usize, sinks: Option<&[f32]>) -> Vec<f64> {
        let (hd, g) = (self.hd, self.n_head / self.n_kv);
        let mut out = vec![0f64; self.q.len()];
        for s in 0..self.starts.len() {
            let table = &self.tables[s * self.width..(s + 1) * self.width];
            for row in self.q_starts[s] as usize..self.q_starts[s + 1] as usize {
                let qp = self.starts[s] as usize + row - self.q_starts[s] as usize;
                let lo = if window > 0 {
                    (qp + 1).saturating_sub(window)
                } else {
                    0
                };
                for h in 0..self.n_head {
                    let kvh = h / g;
                    let at = |p: usize| {
                        ((table[p / self.bs] as usize * self.bs + p % self.bs) * self.n_kv + kvh)
                            * hd
                    };
                    let qv = &self.q[(row * self.n_head + h) * hd..][..hd];
                    let sc: Vec<f64> = (lo..=qp)
                        .map(|p| {
                            qv.iter()
                                .zip(&self.k[at(p)..at(p) + hd])
                                .map(|(a, b)| *a as f64 * *b as f64)
                                .sum::<f64>()
                                * scale
                        })
                        .collect();
                    let sink = sinks.map(|s| s[h] as f64);
                    let mx = sc
                        .iter()
                        .cloned()
                        .chain(sink)
                        .fold(f64::NEG_INFINITY, f64::max);
                    let e: Vec<f64> = sc.iter().map(|x| (x - mx).exp()).collect();
                    let den: f64 = e.iter().sum::<f64>() + sink.map_or(0.0, |s| (s - mx).exp());
                    for (i, p) in (lo..=qp).enumerate() {
                        for d in 0..hd {
                            out[(row * self.n_head + h) * hd + d] +=
                                e[i] / den * self.v[at(p) + d] as f64;
                        }
                    }
                }
            }
        }
        out
    }
}

/// `lens[s]` = (context before the step, query rows); blocks handed out in shuffled order.
fn case(seed: u64, lens: &[(usize, usize)], bs: usize, n_kv: usize, g: usize, hd: usize) -> Case {
    let mut rng = Rng(seed.wrapping_mul(0x9E3779B97F4A7C15) | 1);
    let need: Vec<usize> = lens.iter().map(|(c, n)| (c + n).div_ceil(bs)).collect();
    let n_blocks = need.iter().sum::<usize>() + 2;
    let mut ids: Vec<i32> = (0..n_blocks as i32).collect();
    for i in (1..ids.len()).rev() {
        ids.swap(i, (rng.next() % (i as u64 + 1)) as usize);
    }
    let width = need.iter().copied().max().unwrap_or(0) + 1;
    let mut tables = vec![-1i32; lens.len() * width];
    let mut next = 0;
    for (s, &nb) in need.iter().enumerate() {
        for b in 0..nb {
            tables[s * width + b] = ids[next];
            next += 1;
        }
    }
    let n_head = n_kv * g;
    let size = n_blocks * bs * n_kv * hd;
    let n_tok: usize = lens.iter().map(|l| l.1).sum();
    let mut q_starts = vec![0i64];
    for l in lens {
        q_starts.push(q_starts.last().unwrap() + l.1 as i64);
    }
    Case {
        k: (0..size).map(|_| rng.unit()).collect(),
        v: (0..size).map(|_| rng.unit()).collect(),
        q: (0..n_tok * n_head * hd).map(|_| rng.unit() * 2.0).collect(),
        n_blocks,
        bs,
        n_kv,
        hd,
        n_head,
        tables,
        width,
        q_starts,
        starts: lens.iter().map(|l| l.0 as i64).collect(),
    }
}

fn assert_close(got: &[f32], want: &[f64], what: &str) {
    for (i, (a, b)) in got.iter().zip(want).enumerate() {
        assert!(
            (*a as f64 - b).abs() <= 2e-5 + 2e-5 * b.abs(),
            "{what}: element {i}: {a} vs {b}"
        );
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn matches_dense_reference(
        seed in any::<u64>(),
        lens in prop::collection::vec((0usize..300, 1usize..4), 1..4),
        bs in prop::sample::select(vec![1usize, 4, 16]),
        n_kv in 1usize..3,
        g in 1usize..6,
        hd in prop::sample::select(vec![8usize, 16, 32, 48]),
        window in prop::sample::select(vec![0usize, 1, 7, 64]),
        threads in 1usize..4,
    ) {
        let c = case(seed, &lens, bs, n_kv, g, hd);
        let scale = 1.0 / (hd as f32).sqrt();
        let want = c.reference(scale as f64, window);
        let mut out = vec![0f32; c.q.len()];
        paged_attention(&c.kv(), &c.queries(), scale, window, usize::MAX, &mut out, threads).unwrap();
        assert_close(&out, &want, "simd");
        let mut port = vec![0f32; c.q.len()];
        paged_attention_portable(&c.kv(), &c.queries(), scale, window, usize::MAX, &mut port).unwrap();
        assert_close(&port, &want, "portable");
    }
}

#[test]
fn long_context_split_over_threads_matches() {
    // 5,000 keys: split into pieces on several threads, each with its own max and sum
    let c = case(7, &[(5000, 1), (3000, 1), (20, 1)], 16, 1, 4, 64);
    let want = c.reference(0.125, 0);
    for threads in [1, 2, 3] {
        let mut out = vec![0f32; c.q.len()];
        paged_attention(&c.kv(), &c.queries(), 0.125, 0, 1, &mut out, threads).unwrap();
        assert_close(&out, &want, "long");
    }
}

#[test]
fn rows_of_longer_sequences_are_left_alone() {
    let c = case(3, &[(40, 1), (10, 5)], 4, 1, 2, 16);
    let want = c.reference(0.25, 0);
    let mut out = vec![7f32; c.q.len()];
    paged_attention(&c.kv(), &c.queries(), 0.25, 0, 1, &mut out, 1).unwrap();
    let first = c.n_head * c.hd; // sequence 0's single row
    assert_close(&out[..first], &want[..first], "decode row");
    assert!(
        out[first..].iter().all(|&x| x == 7.0),
        "prefill rows must not be written"
    );
}

#[test]
fn bad_input_is_a_typed_error() {
    let mut c = case(5, &[(40, 1)], 4, 1, 2, 16);
    let mut out = vec![0f32; c.q.len()];
    // a block the table lacks
    c.tables[3] = -1;
    let e = paged_attention(&c.kv(), &c.queries(), 1.0, 0, 1, &mut out, 1).unwrap_err();
    assert!(
        matches!(e, KernelError::Uncovered(ref m) if m.contains("block table")),
        "{e}"
    );
    // a block id past the pool
    c.tables[3] = c.n_blocks as i32;
    assert!(paged_attention(&c.kv(), &c.queries(), 1.0, 0, 1, &mut out, 1).is_err());
    // heads not a multiple of KV heads
    let mut c = case(5, &[(40, 1)], 4, 2, 2, 16);
    c.n_head = 3;
    assert!(paged_attention(&c.kv(), &c.queries(), 1.0, 0, 1, &mut out, 1).is_err());
    // out of the wrong size
    let c = case(5, &[(40, 1)], 4, 1, 2, 16);
    let mut short = vec![0f32; 3];
    assert!(paged_attention(&c.kv(), &c.queries(), 1.0, 0, 1, &mut short, 1).is_err());
}

/// Bits of an f32 that half precision holds exactly (normal or zero).
fn f16_bits(x: f32) -> u16 {
    if x == 0.0 {
        return 0;
    }
    let b = x.to_bits();
    let exp = ((b >> 23) & 0xff) as i32 - 127 + 15;
    assert!(
        (1..31).contains(&exp) && b & 0x1fff == 0,
        "{x} is not an exact f16"
    );
    (((b >> 16) & 0x8000) | ((exp as u32) << 10) | ((b >> 13) & 0x3ff)) as u16
}

#[test]
fn f16_conversion_is_exact() {
    for bits in 0..=u16::MAX {
        let x = F16(bits).to_f32();
        if x.is_nan() {
            continue;
        }
        let sign = if bits & 0x8000 != 0 { -1.0 } else { 1.0 };
        if bits & 0x7c00 == 0 {
            // zero and subnormals: mantissa x 2^-24
            assert_eq!(
                x,
                sign * (bits & 0x3ff) as f32 * 2f32.powi(-24),
                "{bits:#06x} -> {x}"
            );
        } else if !x.is_infinite() {
            // normal halves round-trip through f32
            assert_eq!(f16_bits(x), bits, "{bits:#06x} -> {x}");
        }
    }
    assert_eq!(F16(0x3c00).to_f32(), 1.0);
    assert_eq!(F16(0xc000).to_f32(), -2.0);
    assert_eq!(F16(0x0001).to_f32(), 2f32.powi(-24)); // smallest subnormal (5.96e-8)
    assert_eq!(F16(0x7bff).to_f32(), 65504.0);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    #[test]
    fn f16_pool_matches_dense_reference(
        seed in any::<u64>(),
        lens in prop::collection::vec((0usize..600, 1usize..3), 1..4),
        g in 1usize..5,
        hd in prop::sample::select(vec![8usize, 16, 64]),
        window in prop::sample::select(vec![0usize, 33]),
        threads in 1usize..3,
    ) {
        let mut c = case(seed, &lens, 16, 1, g, hd);
        // values a half holds exactly, so the reference sees what the pool holds
        for x in c.k.iter_mut().chain(c.v.iter_mut()) {
            *x = (*x * 1024.0).round() / 1024.0;
        }
        let want = c.reference(0.125, window);
        let k16: Vec<F16> = c.k.iter().map(|&x| F16(f16_bits(x))).collect();
        let v16: Vec<F16> = c.v.iter().map(|&x| F16(f16_bits(x))).collect();
        let kv = PagedKv { k: &k16, v: &v16, n_blocks: c.n_blocks, block_size: c.bs, n_kv: c.n_kv, head_dim: c.hd };
        let mut out = vec![0f32; c.q.len()];
        paged_attention(&kv, &c.queries(), 0.125, window, usize::MAX, &mut out, threads).unwrap();
        assert_close(&out, &want, "f16 simd");
        let mut port = vec![0f32; c.q.len()];
        paged_attention_portable(&kv, &c.queries(), 0.125, window, usize::MAX, &mut port).unwrap();
        assert_close(&port, &want, "f16 portable");
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(32))]

    /// Prefill chunks (more than `DECODE_ROWS` rows: the tiled online-softmax path) mixed
    /// with decode rows, f32 and f16 pools, SIMD and portable, several thread counts.
    #[test]
    fn prefill_chunks_match_dense_reference(
        seed in any::<u64>(),
        lens in prop::collection::vec((0usize..200, 1usize..90), 1..4),
        bs in prop::sample::select(vec![1usize, 4, 16]),
        n_kv in 1usize..3,
        g in 1usize..6,
        hd in prop::sample::select(vec![8usize, 16, 48, 64]),
        window in prop::sample::select(vec![0usize, 1, 5, 40, 100]),
        threads in 1usize..4,
        half in any::<bool>(),
    ) {
        let mut c = case(seed, &lens, bs, n_kv, g, hd);
        if half {
            for x in c.k.iter_mut().chain(c.v.iter_mut()) {
                *x = (*x * 1024.0).round() / 1024.0;
            }
        }
        let scale = 1.0 / (hd as f32).sqrt();
        let want = c.reference(scale as f64, window);
        let mut out = vec![0f32; c.q.len()];
        let mut port = vec![0f32; c.q.len()];
        let mut narrow = vec![0f32; c.q.len()];
        if half {
            let k16: Vec<F16> = c.k.iter().map(|&x| F16(f16_bits(x))).collect();
            let v16: Vec<F16> = c.v.iter().map(|&x| F16(f16_bits(x))).collect();
            let kv = PagedKv { k: &k16, v: &v16, n_blocks: c.n_blocks, block_size: c.bs, n_kv: c.n_kv, head_dim: c.hd };
            paged_attention(&kv, &c.queries(), scale, window, usize::MAX, &mut out, threads).unwrap();
            paged_attention_portable(&kv, &c.queries(), scale, window, usize::MAX, &mut port).unwrap();
            paged_attention_avx2(&kv, &c.queries(), scale, window, usize::MAX, &mut narrow, threads).unwrap();
        } else {
            paged_attention(&c.kv(), &c.queries(), scale, window, usize::MAX, &mut out, threads).unwrap();
            paged_attention_portable(&c.kv(), &c.queries(), scale, window, usize::MAX, &mut port).unwrap();
            paged_attention_avx2(&c.kv(), &c.queries(), scale, window, usize::MAX, &mut narrow, threads).unwrap();
        }
        assert_close(&out, &want, "prefill simd");
        assert_close(&narrow, &want, "prefill avx2");
        assert_close(&port, &want, "prefill portable");
    }
}

#[test]
fn long_prefill_chunk_over_threads_matches() {
    // Gemma 3 270M's grouping (4 query heads on one KV head, head_dim 256) at a 300-row chunk
    // after 700 cached positions, full and windowed, alongside a decode row
    let c = case(11, &[(700, 300), (50, 1)], 16, 1, 4, 256);
    for window in [0, 512, 64] {
        let want = c.reference(0.0625, window);
        for threads in [1, 2, 3] {
            let mut out = vec![0f32; c.q.len()];
            paged_attention(
                &c.kv(),
                &c.queries(),
                0.0625,
                window,
                usize::MAX,
                &mut out,
                threads,
            )
            .unwrap();
            assert_close(&out, &want, "long prefill");
            let mut narrow = vec![0f32; c.q.len()];
            paged_attention_avx2(
                &c.kv(),
                &c.queries(),
                0.0625,
                window,
                usize::MAX,
                &mut narrow,
                threads,
            )
            .unwrap();
            assert_close(&narrow, &want, "long prefill avx2");
        }
    }
}

#[test]
fn prefill_rows_past_max_rows_are_left_alone_and_uncovered_tables_fail() {
    let mut c = case(4, &[(10, 20), (30, 6)], 4, 1, 2, 16);
    let want = c.reference(0.25, 0);
    let mut out = vec![7f32; c.q.len()];
    paged_attention(&c.kv(), &c.queries(), 0.25, 0, 10, &mut out, 2).unwrap();
    let first = 20 * c.n_head * c.hd; // sequence 0's rows: more than max_rows
    assert!(out[..first].iter().all(|&x| x == 7.0));
    assert_close(&out[first..], &want[first..], "6-row chunk");
    // the chunk's last position (35) lives in block 8 of sequence 1
    c.tables[c.width + 8] = -1;
    let e = paged_attention(&c.kv(), &c.queries(), 0.25, 0, 10, &mut out, 2).unwrap_err();
    assert!(matches!(e, KernelError::Uncovered(_)), "{e}");
}

// ---- q8_0 ------------------------------------------------------------------------------------

/// The f16 nearest to a finite `x` (ties to the even bits), found by search over the halves'
/// exact values: independent of `F16::from_f32`'s bit arithmetic.
fn f16_nearest(x: f32) -> u16 {
    let sign = if x.is_sign_negative() { 0x8000 } else { 0 };
    let a = x.abs() as f64;
    // largest non-negative half h with value(h) <= a (values ascend with the bits up to inf)
    let (mut lo, mut hi) = (0u16, 0x7c00u16);
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if F16(mid).to_f32() as f64 <= a {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    let (vl, vh) = (F16(lo).to_f32() as f64, F16(hi).to_f32() as f64);
    // past the largest half, IEEE rounds as if the next value were 2^16 (so 65520 and up
    // become infinity)
    let vh = if hi == 0x7c00 { 65536.0 } else { vh };
    let pick = if a - vl < vh - a || (a - vl == vh - a && lo & 1 == 0) {
        lo
    } else {
        hi
    };
    sign | pick
}

#[test]
fn f16_from_f32_rounds_to_nearest_even() {
    let mut rng = Rng(99);
    let mut xs: Vec<f32> = Vec::new();
    // every half, and every midpoint between neighbours (the ties), and just off them
    for h in 0..0x7c00u16 {
        let a = F16(h).to_f32();
        let b = F16(h + 1).to_f32();
        let mid = ((a as f64 + b as f64) / 2.0) as f32;
        xs.extend([
            a,
            mid,
            f32::from_bits(mid.to_bits() + 1),
            f32::from_bits(mid.to_bits() - 1),
        ]);
    }
    for _ in 0..100_000 {
        xs.push(f32::from_bits(rng.next() as u32 & 0x7fff_ffff) % 70000.0);
    }
    xs.extend([65504.0, 65519.99, 65520.0, 1e-8, 2.9e-8, 3.0e-8, 0.0]);
    for &x in &xs {
        for v in [x, -x] {
            if !v.is_finite() {
                continue;
            }
            assert_eq!(F16::from_f32(v).0, f16_nearest(v), "{v:e}");
        }
    }
    assert_eq!(F16::from_f32(f32::INFINITY).0, 0x7c00);
    assert_eq!(F16::from_f32(1e6).0, 0x7c00);
    assert!(F16::from_f32(f32::NAN).to_f32().is_nan());
}

/// ggml's `quantize_row_q8_0_ref`, transcribed: amax, d = amax / 127, id = 1/d, roundf.
fn ggml_q8_0_ref(x: &[f32]) -> Vec<Q8Block> {
    x.chunks_exact(32)
        .map(|xs| {
            let mut amax = 0.0f32;
            for &v in xs {
                amax = if amax > v.abs() { amax } else { v.abs() };
            }
            let d = amax / ((1 << 7) - 1) as f32;
            let id = if d != 0.0 { 1.0f32 / d } else { 0.0 };
            let mut qs = [0i8; 32];
            for (q, &v) in qs.iter_mut().zip(xs) {
                let x0 = v * id;
                // C's roundf: halves away from zero
                let r = x0.trunc()
                    + if (x0 - x0.trunc()).abs() >= 0.5 {
                        x0.signum()
                    } else {
                        0.0
                    };
                *q = r as i8;
            }
            Q8Block {
                d: f16_nearest(d).to_le_bytes(),
                qs,
            }
        })
        .collect()
}

#[test]
fn quantize_q8_0_is_ggml_bit_for_bit() {
    let mut rng = Rng(5);
    let mut x: Vec<f32> = (0..32 * 4000)
        .map(|i| {
            let scale = [1e-6f32, 1e-3, 0.1, 1.0, 30.0, 1e4][(i / 32) % 6];
            rng.unit() * scale
        })
        .collect();
    x[..32].fill(0.0); // d = 0: every q 0
                       // exact halves after scaling: amax 127 gives d = 1, id = 1
    for (j, v) in x[32..64].iter_mut().enumerate() {
        *v = j as f32 - 16.5;
    }
    x[63] = 127.0;
    let mut got = vec![
        Q8Block {
            d: [0; 2],
            qs: [0; 32]
        };
        x.len() / 32
    ];
    quantize_q8_0(&x, &mut got).unwrap();
    let want = ggml_q8_0_ref(&x);
    for (i, (a, b)) in got.iter().zip(&want).enumerate() {
        assert_eq!(a, b, "block {i}");
    }
    assert_eq!(got[1].qs[0], -17); // -16.5 rounds away from zero
    assert_eq!(got[1].qs[1], -16); // -15.5
    assert!(got[0].qs.iter().all(|&q| q == 0) && got[0].d == [0, 0]);
    // shapes: not a multiple of 32, or the wrong number of blocks
    assert!(quantize_q8_0(&x[..31], &mut got[..0]).is_err());
    assert!(quantize_q8_0(&x[..64], &mut got[..1]).is_err());
    // values: d * q, as ggml's dequantize_row_q8_0
    let row = &got[2..4];
    let mut out = vec![0f32; 64];
    Q8Block::row_to_f32(row, &mut out);
    for (i, o) in out.iter().enumerate() {
        let b = &row[i / 32];
        assert_eq!(
            *o,
            F16(u16::from_le_bytes(b.d)).to_f32() * b.qs[i % 32] as f32
        );
        assert_eq!(*o, Q8Block::value(row, i));
    }
}

/// A case's K/V as q8_0 blocks; the case's own f32 K/V replaced by their dequantized values,
/// so its dense reference sees what the pool holds.
fn to_q8(c: &mut Case) -> (Vec<Q8Block>, Vec<Q8Block>) {
    let blank = Q8Block {
        d: [0; 2],
        qs: [0; 32],
    };
    let mut kq = vec![blank; c.k.len() / 32];
    let mut vq = vec![blank; c.v.len() / 32];
    quantize_q8_0(&c.k, &mut kq).unwrap();
    quantize_q8_0(&c.v, &mut vq).unwrap();
    Q8Block::row_to_f32(&kq, &mut c.k);
    Q8Block::row_to_f32(&vq, &mut c.v);
    (kq, vq)
}

/// Every path (SIMD with AVX-512 tiles where present, AVX2 tiles, portable) on a q8_0 pool
/// against the dense f64 reference over the dequantized K/V.
fn check_q8(c: &Case, kq: &[Q8Block], vq: &[Q8Block], scale: f32, window: usize, threads: usize) {
    let want = c.reference(scale as f64, window);
    let kv = PagedKv {
        k: kq,
        v: vq,
        n_blocks: c.n_blocks,
        block_size: c.bs,
        n_kv: c.n_kv,
        head_dim: c.hd,
    };
    let n = c.q.len();
    let (mut out, mut narrow, mut port) = (vec![0f32; n], vec![0f32; n], vec![0f32; n]);
    paged_attention(
        &kv,
        &c.queries(),
        scale,
        window,
        usize::MAX,
        &mut out,
        threads,
    )
    .unwrap();
    paged_attention_avx2(
        &kv,
        &c.queries(),
        scale,
        window,
        usize::MAX,
        &mut narrow,
        threads,
    )
    .unwrap();
    paged_attention_portable(&kv, &c.queries(), scale, window, usize::MAX, &mut port).unwrap();
    assert_close(&out, &want, "q8_0 simd");
    assert_close(&narrow, &want, "q8_0 avx2");
    assert_close(&port, &want, "q8_0 portable");
    // and equal to the f32 kernel over the dequantized pool
    let mut f = vec![0f32; n];
    paged_attention(
        &c.kv(),
        &c.queries(),
        scale,
        window,
        usize::MAX,
        &mut f,
        threads,
    )
    .unwrap();
    for (i, (a, b)) in out.iter().zip(&f).enumerate() {
        assert!(
            (a - b).abs() <= 1e-5 + 1e-5 * b.abs(),
            "vs f32 kernel: {i}: {a} vs {b}"
        );
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(32))]

    /// Decode rows (<= DECODE_ROWS) and prefill chunks mixed, ragged lengths, GQA ratios,
    /// windows, block sizes, threads.
    #[test]
    fn q8_0_pool_matches_dense_reference(
        seed in any::<u64>(),
        lens in prop::collection::vec((0usize..300, prop_oneof![1usize..5, 5usize..70]), 1..4),
        bs in prop::sample::select(vec![1usize, 4, 16]),
        n_kv in 1usize..3,
        g in 1usize..6,
        hd in prop::sample::select(vec![32usize, 64, 96]),
        window in prop::sample::select(vec![0usize, 1, 7, 40, 100]),
        threads in 1usize..4,
    ) {
        let mut c = case(seed, &lens, bs, n_kv, g, hd);
        // K/V of varied size per block of 32 (each block gets its own scale)
        let mut rng = Rng(seed | 1);
        for blk in c.k.chunks_exact_mut(32).chain(c.v.chunks_exact_mut(32)) {
            let f = [0.25f32, 0.5, 1.0, 2.0][(rng.next() % 4) as usize];
            blk.iter_mut().for_each(|x| *x *= f);
        }
        let (kq, vq) = to_q8(&mut c);
        check_q8(&c, &kq, &vq, 1.0 / (hd as f32).sqrt(), window, threads);
    }
}

#[test]
fn q8_0_gemma_shape_long_context() {
    // Gemma 3 270M: 4 query heads on one KV head, head_dim 256; decode rows at 3,000 keys (split
    // over threads) beside a 300-row prefill chunk, full and windowed
    let mut c = case(13, &[(3000, 1), (700, 300), (40, 2)], 16, 1, 4, 256);
    let (kq, vq) = to_q8(&mut c);
    for window in [0, 512] {
        for threads in [1, 3] {
            check_q8(&c, &kq, &vq, 0.0625, window, threads);
        }
    }
}

#[test]
fn q8_0_head_dim_not_a_multiple_of_32_is_an_error() {
    let c = case(5, &[(40, 1)], 4, 1, 2, 48);
    let blank = Q8Block {
        d: [0; 2],
        qs: [0; 32],
    };
    let k = vec![blank; c.k.len() / 32];
    let kv = PagedKv {
        k: &k,
        v: &k,
        n_blocks: c.n_blocks,
        block_size: c.bs,
        n_kv: c.n_kv,
        head_dim: c.hd,
    };
    let mut out = vec![0f32; c.q.len()];
    let e = paged_attention(&kv, &c.queries(), 1.0, 0, usize::MAX, &mut out, 1).unwrap_err();
    assert!(
        matches!(e, KernelError::Shape(ref m) if m.contains("multiple of 32")),
        "{e}"
    );
}

/// `paged_attention_invariant`: every row the same bits whether computed in a 40-row chunk, a
/// chunk cut elsewhere, or alone (a decode step, whose keys are split between threads at
/// fixed positions when the context is long, and whose few query heads read f32 and f16
/// rows in place), with and without a window, on 1 to 3 threads, over f32 and f16 pools;
/// and within the tolerance of the dense reference.
#[test]
fn invariant_rows_do_not_depend_on_the_call() {
    invariant_rows::<f32>(|x| x);
    invariant_rows::<F16>(|x| F16(f16_bits(x)));
}

fn invariant_rows<T: KvElem>(to: fn(f32) -> T) {
    use kvshare_kernels::paged_attention_invariant;
    for (ctx, window, hd, g, threads) in [
        (150, 0, 32, 4, 1),
        (150, 64, 32, 2, 3),
        (150, 0, 256, 4, 2),
        (150, 37, 16, 1, 1),
        (700, 0, 64, 4, 2),
        (700, 300, 32, 2, 3),
        (530, 0, 256, 4, 1),
    ] {
        let n = 40;
        let mut c = case(
            window as u64 + hd as u64 + ctx as u64,
            &[(ctx, n)],
            16,
            1,
            g,
            hd,
        );
        // values a half holds exactly, so the reference sees what either pool holds
        for x in c.k.iter_mut().chain(c.v.iter_mut()) {
            *x = (*x * 1024.0).round() / 1024.0;
        }
        let (k, v): (Vec<T>, Vec<T>) = (
            c.k.iter().map(|&x| to(x)).collect(),
            c.v.iter().map(|&x| to(x)).collect(),
        );
        let kv = PagedKv {
            k: &k,
            v: &v,
            n_blocks: c.n_blocks,
            block_size: c.bs,
            n_kv: c.n_kv,
            head_dim: c.hd,
        };
        let scale = 1.0 / (hd as f32).sqrt();
        let row_len = c.n_head * hd;
        let run = |r0: usize, r1: usize| {
            let q_starts = [0i64, (r1 - r0) as i64];
            let starts = [(ctx + r0) as i64];
            let qs = Queries {
                q: &c.q[r0 * row_len..r1 * row_len],
                n_head: c.n_head,
                tables: &c.tables,
                width: c.width,
                q_starts: &q_starts,
                start_positions: &starts,
            };
            let mut out = vec![f32::NAN; (r1 - r0) * row_len];
            paged_attention_invariant(&kv, &qs, scale, window, usize::MAX, &mut out, threads)
                .unwrap();
            out
        };
        let all = run(0, n);
        assert_close(&all, &c.reference(scale as f64, window), "invariant");
        for (r0, r1) in [(0, 1), (5, 6), (39, 40), (7, 30), (1, 4), (20, 40)] {
            let part = run(r0, r1);
            let same = all[r0 * row_len..r1 * row_len]
                .iter()
                .zip(&part)
                .all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "window {window} hd {hd}: rows {r0}..{r1} differ");
        }
    }
}

// ---- attention sinks -------------------------------------------------------------------------

/// The KV pool types of the sink tests.
#[derive(Clone, Copy, Debug)]
enum Pool {
    F32,
    F16,
    Q8,
}

/// `paged_attention_with` on `paths` over the case's K/V stored as `pool` (the case's f32 K/V
/// must already be values that pool holds exactly: `exact_for`).
#[allow(clippy::too_many_arguments)]
fn run_sinks(
    c: &Case,
    pool: Pool,
    scale: f32,
    window: usize,
    sinks: Option<&[f32]>,
    threads: usize,
    paths: Paths,
    out: &mut [f32],
) -> Result<(), KernelError> {
    fn go<T: KvElem>(
        c: &Case,
        k: &[T],
        v: &[T],
        a: (f32, usize, Option<&[f32]>, usize, Paths),
        out: &mut [f32],
    ) -> Result<(), KernelError> {
        let kv = PagedKv {
            k,
            v,
            n_blocks: c.n_blocks,
            block_size: c.bs,
            n_kv: c.n_kv,
            head_dim: c.hd,
        };
        let (scale, window, sinks, threads, paths) = a;
        paged_attention_with(
            &kv,
            &c.queries(),
            scale,
            window,
            sinks,
            usize::MAX,
            out,
            threads,
            paths,
        )
    }
    let a = (scale, window, sinks, threads, paths);
    match pool {
        Pool::F32 => go(c, &c.k, &c.v, a, out),
        Pool::F16 => {
            let k: Vec<F16> = c.k.iter().map(|&x| F16(f16_bits(x))).collect();
            let v: Vec<F16> = c.v.iter().map(|&x| F16(f16_bits(x))).collect();
            go(c, &k, &v, a, out)
        }
        Pool::Q8 => {
            let blank = Q8Block {
                d: [0; 2],
                qs: [0; 32],
            };
            let mut k = vec![blank; c.k.len() / 32];
            let mut v = vec![blank; c.v.len() / 32];
            quantize_q8_0(&c.k, &mut k).unwrap();
            quantize_q8_0(&c.v, &mut v).unwrap();
            go(c, &k, &v, a, out)
        }
    }
}

/// The case's K/V replaced by values `pool` holds exactly, so the reference sees the pool.
fn exact_for(c: &mut Case, pool: Pool) {
    match pool {
        Pool::F32 => {}
        Pool::F16 => {
            for x in c.k.iter_mut().chain(c.v.iter_mut()) {
                *x = (*x * 1024.0).round() / 1024.0;
            }
        }
        Pool::Q8 => {
            to_q8(c);
        }
    }
}

const PATHS: [Paths; 4] = [Paths::Fast, Paths::Invariant, Paths::Portable, Paths::Avx2];

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    /// Sinks on every path the dispatcher may take (decode rows, prefill tiles, invariant
    /// tiles, narrow tiles; AVX-512, AVX2 and portable) over f32, f16 and q8_0 pools, with and
    /// without windows, against the dense f64 reference. Sinks range from far below the scores
    /// to far above them (the sink-dominated side of `add_sink`).
    #[test]
    fn sinks_match_dense_reference(
        seed in any::<u64>(),
        lens in prop::collection::vec((0usize..260, prop_oneof![1usize..5, 5usize..70]), 1..4),
        bs in prop::sample::select(vec![1usize, 16]),
        n_kv in 1usize..3,
        g in prop::sample::select(vec![1usize, 2, 3, 8]),
        hd in prop::sample::select(vec![32usize, 64]),
        window in prop::sample::select(vec![0usize, 1, 7, 128]),
        threads in 1usize..4,
        pool in prop::sample::select(vec![Pool::F32, Pool::F16, Pool::Q8]),
        sink_scale in prop::sample::select(vec![1.0f32, 4.0, 40.0]),
    ) {
        let mut c = case(seed, &lens, bs, n_kv, g, hd);
        exact_for(&mut c, pool);
        let mut rng = Rng(seed ^ 0x5151);
        let sinks: Vec<f32> = (0..c.n_head).map(|_| rng.unit() * sink_scale).collect();
        let scale = 1.0 / (hd as f32).sqrt();
        let want = c.reference_sinks(scale as f64, window, Some(&sinks));
        let plain = c.reference(scale as f64, window);
        for paths in PATHS {
            let mut out = vec![f32::NAN; c.q.len()];
            run_sinks(&c, pool, scale, window, Some(&sinks), threads, paths, &mut out).unwrap();
            assert_close(&out, &want, &format!("{pool:?} {paths:?} sinks"));
            // without sinks: the same paths' results as before
            run_sinks(&c, pool, scale, window, None, threads, paths, &mut out).unwrap();
            assert_close(&out, &plain, &format!("{pool:?} {paths:?} no sinks"));
        }
    }
}

#[test]
fn sinks_gpt_oss_shape_long_context() {
    // gpt-oss-20b's attention: 64 query heads on 8 KV heads of 64; decode rows at 3,000 keys
    // (split over threads) beside a 200-row prefill chunk, full and in a 128-token window
    let mut c = case(17, &[(3000, 1), (500, 200), (40, 2)], 16, 8, 8, 64);
    let mut rng = Rng(3);
    let sinks: Vec<f32> = (0..c.n_head).map(|_| rng.unit() * 3.0).collect();
    for pool in [Pool::F32, Pool::F16, Pool::Q8] {
        exact_for(&mut c, pool);
        for window in [0, 128] {
            let want = c.reference_sinks(0.125, window, Some(&sinks));
            for (paths, threads) in [(Paths::Fast, 3), (Paths::Invariant, 2), (Paths::Avx2, 1)] {
                let mut out = vec![f32::NAN; c.q.len()];
                run_sinks(
                    &c,
                    pool,
                    0.125,
                    window,
                    Some(&sinks),
                    threads,
                    paths,
                    &mut out,
                )
                .unwrap();
                assert_close(&out, &want, &format!("{pool:?} {paths:?} w{window}"));
            }
        }
    }
}

/// With sinks, the invariant attention's rows are still the same bits in any call: a decode
/// row alone (its keys split between threads) and inside a chunk.
#[test]
fn sinks_keep_invariant_rows() {
    let mut c = case(23, &[(700, 40)], 16, 2, 8, 64);
    exact_for(&mut c, Pool::F16);
    let mut rng = Rng(9);
    let sinks: Vec<f32> = (0..c.n_head).map(|_| rng.unit() * 3.0).collect();
    let row_len = c.n_head * c.hd;
    let k: Vec<F16> = c.k.iter().map(|&x| F16(f16_bits(x))).collect();
    let v: Vec<F16> = c.v.iter().map(|&x| F16(f16_bits(x))).collect();
    let kv = PagedKv {
        k: &k,
        v: &v,
        n_blocks: c.n_blocks,
        block_size: c.bs,
        n_kv: c.n_kv,
        head_dim: c.hd,
    };
    let run = |r0: usize, r1: usize, threads: usize| {
        let q_starts = [0i64, (r1 - r0) as i64];
        let starts = [(700 + r0) as i64];
        let qs = Queries {
            q: &c.q[r0 * row_len..r1 * row_len],
            n_head: c.n_head,
            tables: &c.tables,
            width: c.width,
            q_starts: &q_starts,
            start_positions: &starts,
        };
        let mut out = vec![f32::NAN; (r1 - r0) * row_len];
        paged_attention_with(
            &kv,
            &qs,
            0.125,
            128,
            Some(&sinks),
            usize::MAX,
            &mut out,
            threads,
            Paths::Invariant,
        )
        .unwrap();
        out
    };
    let all = run(0, 40, 2);
    let want = c.reference_sinks(0.125, 128, Some(&sinks));
    assert_close(&all, &want, "invariant sinks");
    for (r0, r1, threads) in [(0, 1, 3), (39, 40, 2), (10, 30, 1)] {
        let part = run(r0, r1, threads);
        let same = all[r0 * row_len..r1 * row_len]
            .iter()
            .zip(&part)
            .all(|(a, b)| a.to_bits() == b.to_bits());
        assert!(same, "rows {r0}..{r1} differ");
    }
}

#[test]
fn sinks_of_the_wrong_length_are_an_error() {
    let c = case(5, &[(40, 1)], 4, 1, 2, 16);
    let mut out = vec![0f32; c.q.len()];
    let e = run_sinks(
        &c,
        Pool::F32,
        1.0,
        0,
        Some(&[0.0; 3]),
        1,
        Paths::Fast,
        &mut out,
    )
    .unwrap_err();
    assert!(
        matches!(e, KernelError::Shape(ref m) if m.contains("sinks")),
        "{e}"
    );
}
