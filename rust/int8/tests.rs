use half::bf16;
use proptest::prelude::*;

use super::{Int8Gemm, Int8Weight, Path, COLS};

/// Values a bf16 holds exactly, and int8 weights, from a seeded generator.
fn noise(len: usize, seed: u64) -> impl Iterator<Item = u64> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len).map(move |_| {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        s >> 40
    })
}

fn xs(len: usize, seed: u64) -> Vec<bf16> {
    noise(len, seed).map(|v| bf16::from_f32((v as f32 / (1u64 << 24) as f32 - 0.5) * 4.0)).collect()
}

fn qs(len: usize, seed: u64) -> Vec<i8> {
    noise(len, seed).map(|v| (v % 255) as i8).map(|v| v.max(-127)).collect()
}

/// `q` (`[n, k]`, row-major) in the kernel's layout.
fn pack(q: &[i8], n: usize, k: usize) -> Vec<i8> {
    let (blocks, pairs) = (n.div_ceil(COLS), k.div_ceil(2));
    let mut packed = vec![0; blocks * pairs * 2 * COLS];
    for (r, row) in q.chunks_exact(k).enumerate() {
        for (i, &v) in row.iter().enumerate() {
            packed[((r / COLS) * pairs + i / 2) * 2 * COLS + (r % COLS) * 2 + i % 2] = v;
        }
    }
    packed
}

struct Case {
    x: Vec<bf16>,
    q: Vec<i8>,
    packed: Vec<i8>,
    scales: Vec<f32>,
    bias: Vec<f32>,
    rows: usize,
    n: usize,
    k: usize,
}

impl Case {
    fn new(rows: usize, n: usize, k: usize, seed: u64) -> Case {
        let q = qs(n * k, seed + 1);
        let padded = n.div_ceil(COLS) * COLS;
        let scales = noise(padded, seed + 2).map(|v| v as f32 / (1u64 << 30) as f32).collect();
        let bias = xs(padded, seed + 3).iter().map(|b| b.to_f32()).collect();
        Case { x: xs(rows * k, seed), packed: pack(&q, n, k), q, scales, bias, rows, n, k }
    }

    fn weight(&self) -> Int8Weight<'_> {
        Int8Weight { packed: &self.packed, n: self.n, k: self.k, scales: &self.scales, bias: &self.bias }
    }

    /// Each output in f64 before its one rounding to bf16, and the bound on the f32 result's
    /// error before that rounding: `k` roundings of at most 2^-24 of the running sum (never more
    /// than the sum of the products' magnitudes), then the scaling's and the bias's.
    fn reference(&self, m: usize, c: usize) -> (f64, f64) {
        let (xm, qc) = (&self.x[m * self.k..][..self.k], &self.q[c * self.k..][..self.k]);
        let products = xm.iter().zip(qc).map(|(a, &b)| f64::from(a.to_f32()) * f64::from(b));
        let (sum, mag) = products.fold((0.0, 0.0), |(s, g), p| (s + p, g + p.abs()));
        let scale = f64::from(self.scales[c]);
        let value = sum * scale + f64::from(self.bias[c]);
        let eps = 2f64.powi(-24);
        let bound = mag * scale * (self.k as f64 + 1.0) * eps + (value.abs() + mag * scale) * eps;
        (value, bound)
    }

    /// The kernel's output against the reference: at most the f32 error plus one bf16 rounding.
    fn check(&self, path: Path, threads: usize) {
        let gemm = Int8Gemm::new(Some(path), threads).unwrap();
        let mut out = vec![bf16::NAN; self.rows * self.n];
        gemm.run(&self.x, self.weight(), &mut out).unwrap();
        for m in 0..self.rows {
            for c in 0..self.n {
                let (want, bound) = self.reference(m, c);
                let got = f64::from(out[m * self.n + c].to_f32());
                let bound = bound + (want.abs() + bound) * 2f64.powi(-8);
                assert!(
                    (got - want).abs() <= bound,
                    "{} rows={} n={} k={}: row {m}, column {c}: {got} vs {want} (bound {bound})",
                    path.name(),
                    self.rows,
                    self.n,
                    self.k
                );
            }
        }
    }
}

#[test]
fn every_path_matches_the_f64_outputs() {
    for path in Path::ALL.into_iter().filter(|p| p.is_supported()) {
        // Rows on both sides of the fused kernel's limit and of a tile; widths with a partial
        // block; odd and even inputs, below and above the fused kernel's unrolling.
        for (rows, n, k) in [
            (1, 1, 1),
            (1, 5, 31),
            (2, 16, 32),
            (3, 17, 33),
            (4, 40, 576),
            (5, 16, 7),
            (12, 3, 100),
            (13, 33, 64),
            (30, 20, 9),
            (13, 20, 601),
        ] {
            Case::new(rows, n, k, (rows * 1000 + n * 10 + k) as u64).check(path, 1);
        }
    }
}

#[test]
fn an_odd_input_width_never_reads_past_a_row() {
    // Row 1 starts with an infinity right after row 0's last value: row 0 must not meet it
    // (through the pad weight, 0, it would make a NaN). Fused and tiled rows.
    for path in Path::ALL.into_iter().filter(|p| p.is_supported()) {
        for rows in [2, 8] {
            let mut case = Case::new(rows, 16, 5, 7);
            case.x[5] = bf16::INFINITY;
            let gemm = Int8Gemm::new(Some(path), 1).unwrap();
            let mut out = vec![bf16::NAN; rows * 16];
            gemm.run(&case.x, case.weight(), &mut out).unwrap();
            case.rows = 1;
            case.x.truncate(5);
            let mut row0 = vec![bf16::NAN; 16];
            gemm.run(&case.x, case.weight(), &mut row0).unwrap();
            assert_eq!(out[..16], row0[..], "{} rows={rows}", path.name());
            case.check(path, 1);
        }
    }
}

#[test]
fn run_refuses_shapes_that_do_not_fit() {
    let case = Case::new(2, 3, 4, 1);
    let gemm = Int8Gemm::new(Some(Path::Scalar), 1).unwrap();
    let mut out = vec![bf16::ZERO; 6];
    assert!(gemm.run(&case.x, case.weight(), &mut out).is_ok());
    assert!(gemm.run(&case.x[..7], case.weight(), &mut out).is_err(), "x not whole rows");
    assert!(gemm.run(&case.x, case.weight(), &mut out[..5]).is_err(), "out too short");
    assert!(gemm.run(&case.x, Int8Weight { n: 17, ..case.weight() }, &mut out).is_err(), "weight too short");
    assert!(gemm.run(&case.x, Int8Weight { scales: &case.scales[..3], ..case.weight() }, &mut out).is_err());
    assert!(gemm.run(&case.x, Int8Weight { bias: &case.bias[..3], ..case.weight() }, &mut out).is_err());
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]
    #[test]
    fn the_best_path_matches_the_f64_outputs(rows in 1usize..40, n in 1usize..50, k in 1usize..300, seed in 0u64..1000) {
        Case::new(rows, n, k, seed).check(Path::best(), 1);
    }
}
