//! `paged_attention` (SIMD where available, split over threads) against a float64 dense
//! reference over random block tables, windows, head groupings and sequence mixes, and
//! against the portable path; bad tables and shapes are typed errors.

use kvshare_kernels::attention::{paged_attention_avx2, paged_attention_portable};
use kvshare_kernels::{paged_attention, KernelError, KvElem, PagedKv, Queries, F16};
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
                    let mx = sc.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    let e: Vec<f64> = sc.iter().map(|x| (x - mx).exp()).collect();
                    let den: f64 = e.iter().sum();
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
