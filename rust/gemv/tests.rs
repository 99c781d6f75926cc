use half::bf16;
use proptest::prelude::*;

use super::{Gemv, Path, Weight};

/// Values a bf16 holds exactly, from a seeded generator.
fn values(len: usize, seed: u64) -> Vec<bf16> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            bf16::from_f32(((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 4.0)
        })
        .collect()
}

/// Each dot product in f64, and the bound on an f32 sum's error: `k` roundings of at most
/// 2^-24 of the running sum, which never exceeds the sum of the products' magnitudes.
fn reference(x: &[bf16], w: &[bf16], k: usize) -> Vec<(f64, f64)> {
    let mut out = Vec::new();
    for wr in w.chunks_exact(k) {
        for xm in x.chunks_exact(k) {
            let products = xm.iter().zip(wr).map(|(a, b)| f64::from(a.to_f32()) * f64::from(b.to_f32()));
            let (sum, mag) = products.fold((0.0, 0.0), |(s, m), p| (s + p, m + p.abs()));
            out.push((sum, mag * k as f64 * 2f64.powi(-24)));
        }
    }
    out
}

fn check_dots(path: Path, rows: usize, n: usize, k: usize, seed: u64) {
    let (x, w) = (values(rows * k, seed), values(n * k, seed + 1));
    let mut sums = vec![f32::NAN; n * rows];
    path.dots(&x, rows, k, &w, &mut sums);
    for (i, ((want, bound), got)) in reference(&x, &w, k).into_iter().zip(&sums).enumerate() {
        let (r, m) = (i / rows, i % rows);
        assert!(
            (f64::from(*got) - want).abs() <= bound,
            "{} rows={rows} n={n} k={k}: weight row {r}, x row {m}: {got} vs {want} (bound {bound})",
            path.name()
        );
    }
}

#[test]
fn every_path_matches_the_f64_sums() {
    for path in Path::ALL.into_iter().filter(|p| p.is_supported()) {
        // Every count of rows a pass takes (up to 8) and past it; widths of a partial chunk, whole
        // pairs of chunks, a pair and one more chunk (96), and a pair and a partial one.
        for (rows, n, k) in [
            (1, 1, 1),
            (1, 5, 31),
            (2, 4, 32),
            (3, 7, 33),
            (4, 9, 576),
            (5, 16, 64),
            (6, 2, 96),
            (7, 3, 127),
            (8, 5, 160),
            (9, 3, 1000),
            (17, 2, 200),
        ] {
            check_dots(path, rows, n, k, (rows * 1000 + n * 10 + k) as u64);
        }
    }
}

#[test]
fn run_adds_the_bias_and_rounds_once() {
    let (rows, n, k) = (3, 37, 100);
    let (x, w, bias) = (values(rows * k, 1), values(n * k, 2), values(n, 3));
    for path in Path::ALL.into_iter().filter(|p| p.is_supported()) {
        let gemv = Gemv::new(Some(path), 1).unwrap();
        let mut out = vec![bf16::NAN; rows * n];
        gemv.run(&x, Weight { w: &w, n, k, bias: Some(&bias) }, &mut out).unwrap();
        let mut sums = vec![0.0; n * rows];
        path.dots(&x, rows, k, &w, &mut sums);
        for m in 0..rows {
            for r in 0..n {
                assert_eq!(out[m * n + r], bf16::from_f32(sums[r * rows + m] + bias[r].to_f32()), "{}", path.name());
            }
        }
    }
}

#[test]
fn run_refuses_shapes_that_do_not_fit() {
    let gemv = Gemv::new(Some(Path::Scalar), 1).unwrap();
    let (x, w) = (values(8, 1), values(12, 2));
    let mut out = vec![bf16::ZERO; 6];
    let weight = Weight { w: &w, n: 3, k: 4, bias: None };
    assert!(gemv.run(&x, weight, &mut out).is_ok());
    assert!(gemv.run(&x[..7], weight, &mut out).is_err(), "x not whole rows");
    assert!(gemv.run(&x, weight, &mut out[..5]).is_err(), "out too short");
    assert!(gemv.run(&x, Weight { n: 4, ..weight }, &mut out).is_err(), "weight too short");
    assert!(gemv.run(&x, Weight { bias: Some(&w[..2]), ..weight }, &mut out).is_err(), "bias too short");
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]
    #[test]
    fn the_best_path_matches_the_f64_sums(rows in 1usize..20, n in 1usize..40, k in 1usize..300, seed in 0u64..1000) {
        check_dots(Path::best(), rows, n, k, seed);
    }
}
