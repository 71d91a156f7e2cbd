//! `qmatmul_t` (SIMD where available, any thread count) against a float64 reference of the
//! dequantized product, and against the portable path, over random shapes.

use kvshare_kernels::qmatmul::qmatmul_t_portable;
use kvshare_kernels::{qmatmul_t, KernelError, QMatrix};
use proptest::prelude::*;

struct Case {
    qs: Vec<i8>,
    scale: Vec<f32>,
    mins: Option<Vec<f32>>,
    x: Vec<f32>,
    m: usize,
    n: usize,
    k: usize,
    group: usize,
}

impl Case {
    fn w(&self) -> QMatrix<'_> {
        QMatrix {
            qs: &self.qs,
            scale: &self.scale,
            mins: self.mins.as_deref(),
            n: self.n,
            k: self.k,
            group: self.group,
        }
    }

    fn reference(&self) -> Vec<f64> {
        let ng = self.k / self.group;
        let mut out = vec![0f64; self.m * self.n];
        for r in 0..self.m {
            for n in 0..self.n {
                let mut acc = 0f64;
                for c in 0..self.k {
                    let gi = n * ng + c / self.group;
                    let mn = self.mins.as_ref().map_or(0.0, |v| v[gi] as f64);
                    let wv = self.qs[n * self.k + c] as f64 * self.scale[gi] as f64 - mn;
                    acc += wv * self.x[r * self.k + c] as f64;
                }
                out[r * self.n + n] = acc;
            }
        }
        out
    }
}

fn case(seed: u64, m: usize, n: usize, groups: usize, group: usize, with_mins: bool) -> Case {
    // a small xorshift: deterministic data without another dependency
    let mut s = seed.wrapping_mul(0x9E3779B97F4A7C15) | 1;
    let mut next = move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        s
    };
    let k = groups * group;
    let ng = n * groups;
    let unit = |v: u64| (v % 2001) as f32 / 1000.0 - 1.0;
    Case {
        qs: (0..n * k).map(|_| (next() % 255) as i64 as i8).collect(),
        scale: (0..ng).map(|_| unit(next()) * 0.01).collect(),
        mins: with_mins.then(|| (0..ng).map(|_| unit(next()) * 0.05).collect()),
        x: (0..m * k).map(|_| unit(next())).collect(),
        m,
        n,
        k,
        group,
    }
}

fn assert_close(got: &[f32], want: &[f64], what: &str) {
    let scale = want.iter().fold(0f64, |a, v| a.max(v.abs())).max(1e-3);
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            ((*g as f64) - w).abs() <= 1e-5 * scale + 1e-5 * w.abs(),
            "{what}: element {i}: {g} vs {w}"
        );
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(60))]
    #[test]
    fn matches_reference(seed in any::<u64>(), m in 1usize..11, n in 1usize..150,
                         groups in 1usize..9, g32 in any::<bool>(), with_mins in any::<bool>(),
                         threads in 1usize..5) {
        let c = case(seed, m, n, groups, if g32 { 32 } else { 16 }, with_mins);
        let want = c.reference();
        let mut out = vec![f32::NAN; m * n];
        qmatmul_t(&c.x, m, &c.w(), &mut out, threads).unwrap();
        assert_close(&out, &want, "simd");
        let mut port = vec![f32::NAN; m * n];
        qmatmul_t_portable(&c.x, m, &c.w(), &mut port).unwrap();
        assert_close(&port, &want, "portable");
    }
}

#[test]
fn large_layer_shapes_and_thread_counts_agree() {
    // Gemma 3 270M shapes: fused gate/up [4096, 640] (group 32, mins) and down [640, 2048]
    for (n, groups, group, mins) in [(4096, 20, 32, true), (640, 128, 16, false)] {
        let c = case(7, 5, n, groups, group, mins);
        let want = c.reference();
        for threads in [1, 2, 7] {
            let mut out = vec![f32::NAN; c.m * n];
            qmatmul_t(&c.x, c.m, &c.w(), &mut out, threads).unwrap();
            assert_close(&out, &want, &format!("threads {threads}"));
        }
    }
}

#[test]
fn bad_shapes_are_errors() {
    let c = case(1, 2, 8, 2, 32, false);
    let mut out = vec![0f32; 16];
    let err = qmatmul_t(&c.x[..10], 2, &c.w(), &mut out, 1).unwrap_err();
    assert!(matches!(err, KernelError::Shape(_)));
    let mut short = vec![0f32; 15];
    assert!(qmatmul_t(&c.x, 2, &c.w(), &mut short, 1).is_err());
    let mut w = c.w();
    w.group = 8;
    assert!(qmatmul_t(&c.x, 2, &w, &mut out, 1).is_err());
    let mut w = c.w();
    w.scale = &c.scale[..3];
    assert!(qmatmul_t(&c.x, 2, &w, &mut out, 1).is_err());
    // empty work is fine
    assert!(qmatmul_t(&[], 0, &c.w(), &mut [], 1).is_ok());
}
