use half::{bf16, f16};
use proptest::prelude::*;

use super::{Format, Gemv, Path, QuantWeight, COLS};
use crate::attn::{DType, Element};

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

fn xs<E: Element>(len: usize, seed: u64) -> Vec<E> {
    noise(len, seed).map(|v| E::from_f32((v as f32 / (1u64 << 24) as f32 - 0.5) * 4.0)).collect()
}

fn qs(len: usize, seed: u64) -> Vec<i8> {
    noise(len, seed).map(|v| (v % 255) as i8).map(|v| v.max(-127)).collect()
}

/// `q` (`[n, k]`, row-major) in the kernel's int8 layout.
fn pack8(q: &[i8], n: usize, k: usize) -> Vec<u8> {
    let (blocks, pairs) = (n.div_ceil(COLS), k.div_ceil(2));
    let mut packed = vec![0; blocks * pairs * 2 * COLS];
    for (r, row) in q.chunks_exact(k).enumerate() {
        for (i, &v) in row.iter().enumerate() {
            packed[((r / COLS) * pairs + i / 2) * 2 * COLS + (r % COLS) * 2 + i % 2] = v as u8;
        }
    }
    packed
}

/// `q` (`[n, k]`, 0..15) in the kernel's int4 layout: lane `L` of pair `p` (column `L / 2`, input
/// `2p + L % 2`) in byte `L % 16`, low nibble for lanes below 16.
fn pack4(q: &[i8], n: usize, k: usize) -> Vec<u8> {
    let (blocks, pairs) = (n.div_ceil(COLS), k / 2);
    let mut packed = vec![0u8; blocks * pairs * COLS];
    for (r, row) in q.chunks_exact(k).enumerate() {
        for (i, &v) in row.iter().enumerate() {
            let lane = (r % COLS) * 2 + i % 2;
            let shift = if lane < COLS { 0 } else { 4 };
            packed[((r / COLS) * pairs + i / 2) * COLS + lane % COLS] |= (v as u8) << shift;
        }
    }
    packed
}

/// A linear of a model in `E` and its input.
struct Case<E = bf16> {
    format: Format,
    x: Vec<E>,
    /// int8 values, or int4's 0..15.
    q: Vec<i8>,
    packed: Vec<u8>,
    /// int4: per block and group, 16 scales then 16 zeros.
    groups: Vec<E>,
    scales: Vec<f32>,
    bias: Vec<f32>,
    rows: usize,
    n: usize,
    k: usize,
}

impl Case {
    fn new(rows: usize, n: usize, k: usize, seed: u64) -> Case {
        Case::with(Format::Int8, rows, n, k, seed)
    }
}

impl<E: Element> Case<E> {
    fn with(format: Format, rows: usize, n: usize, k: usize, seed: u64) -> Case<E> {
        let padded = n.div_ceil(COLS) * COLS;
        let bias = xs::<E>(padded, seed + 3).iter().map(|b| b.to_f32()).collect();
        let (packed, q, groups, scales) = match format {
            Format::Int8 => {
                let q = qs(n * k, seed + 1);
                let scales = noise(padded, seed + 2).map(|v| v as f32 / (1u64 << 30) as f32).collect();
                (pack8(&q, n, k), q, Vec::new(), scales)
            }
            Format::Int4 { group } => {
                let q: Vec<i8> = noise(n * k, seed + 1).map(|v| (v % 16) as i8).collect();
                let groups = xs(padded / COLS * (k / group) * 2 * COLS, seed + 2);
                (pack4(&q, n, k), q, groups, vec![1.0; padded])
            }
            Format::GroupedInt8 { group } => {
                // Every int8, -128 included.
                let q: Vec<i8> = noise(n * k, seed + 1).map(|v| v as u8 as i8).collect();
                let groups = xs(padded / COLS * (k / group) * 2 * COLS, seed + 2);
                (pack8(&q, n, k), q, groups, vec![1.0; padded])
            }
        };
        Case { format, x: xs(rows * k, seed), q, packed, groups, scales, bias, rows, n, k }
    }

    fn weight(&self) -> QuantWeight<'_, E> {
        QuantWeight {
            format: self.format,
            packed: &self.packed,
            groups: &self.groups,
            n: self.n,
            k: self.k,
            scales: &self.scales,
            bias: &self.bias,
        }
    }

    /// Column `c`'s weight at input `i` in f64, and a bound on how far what the kernels sum is
    /// from it (the grouped formats: the f32 roundings of its terms, and of int4's group sums
    /// offset by `128 · Σx` that the SIMD path cancels, within a step of `E` of each product).
    fn weight_at(&self, c: usize, i: usize) -> (f64, f64) {
        let q = f64::from(self.q[c * self.k + i]);
        let Some(group) = self.format.group() else { return (q, 0.0) };
        let g = &self.groups[((c / COLS) * (self.k / group) + i / group) * 2 * COLS..];
        let (scale, zero) = (f64::from(g[c % COLS].to_f32()), f64::from(g[COLS + c % COLS].to_f32()));
        let (w, offset) = match self.format {
            Format::Int4 { .. } => ((q - 8.0) * scale + zero, 23.0),
            _ => (q * scale + zero, 0.0),
        };
        (w, w.abs() * unit::<E>() + (zero.abs() + offset * scale.abs()) * 2f64.powi(-22))
    }

    /// Each output in f64 before its one rounding to `E`, and the bound on the f32 result's
    /// error before that rounding: the widened weights', then `k` roundings of at most 2^-24 of
    /// the running sum (never more than the sum of the products' magnitudes), then the
    /// scaling's and the bias's.
    fn reference(&self, m: usize, c: usize) -> (f64, f64) {
        let xm = &self.x[m * self.k..][..self.k];
        let (mut sum, mut mag, mut widened) = (0.0, 0.0, 0.0);
        for (i, a) in xm.iter().enumerate() {
            let (a, (w, off)) = (f64::from(a.to_f32()), self.weight_at(c, i));
            sum += a * w;
            mag += (a * w).abs() + a.abs() * off;
            widened += a.abs() * off;
        }
        let scale = f64::from(self.scales[c]);
        let value = sum * scale + f64::from(self.bias[c]);
        let eps = 2f64.powi(-24);
        let bound = widened * scale + mag * scale * (self.k as f64 + 1.0) * eps + (value.abs() + mag * scale) * eps;
        (value, bound)
    }

    /// The kernel's output against the reference: at most the f32 error plus one rounding to `E`.
    fn check(&self, path: Path, threads: usize) {
        let gemm = Gemv::new(Some(path), threads).unwrap();
        let mut out = vec![E::from_f32(f32::NAN); self.rows * self.n];
        gemm.run_quantized(&self.x, self.weight(), &mut out).unwrap();
        self.check_out(&out, path);
    }

    /// `check`'s comparison of `path`'s output `out` (its first `self.rows` rows).
    fn check_out(&self, out: &[E], path: Path) {
        for m in 0..self.rows {
            for c in 0..self.n {
                let (want, bound) = self.reference(m, c);
                let got = f64::from(out[m * self.n + c].to_f32());
                let bound = bound + (want.abs() + bound) * unit::<E>();
                assert!(
                    (got - want).abs() <= bound,
                    "{} {:?} {:?} rows={} n={} k={}: row {m}, column {c}: {got} vs {want} (bound {bound})",
                    path.name(),
                    E::DTYPE,
                    self.format,
                    self.rows,
                    self.n,
                    self.k
                );
            }
        }
    }

    /// `check` on every path (one thread).
    fn check_paths(&self) {
        for path in paths() {
            self.check(path, 1);
        }
    }
}

/// `E`'s unit of rounding: a bound on one rounding's relative error.
fn unit<E: Element>() -> f64 {
    match E::DTYPE {
        DType::BF16 => 2f64.powi(-8),
        DType::F16 => 2f64.powi(-11),
        DType::F32 => 2f64.powi(-24),
    }
}

/// `Case::with`'s linear in each dtype, on every path.
fn check_each_dtype(format: Format, rows: usize, n: usize, k: usize, seed: u64) {
    Case::<bf16>::with(format, rows, n, k, seed).check_paths();
    Case::<f16>::with(format, rows, n, k, seed).check_paths();
    Case::<f32>::with(format, rows, n, k, seed).check_paths();
}

#[test]
fn every_path_matches_the_f64_outputs() {
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
        check_each_dtype(Format::Int8, rows, n, k, (rows * 1000 + n * 10 + k) as u64);
    }
    // The grouped formats: groups of 2 to 128 inputs, one group to many, both kernels and
    // several tiles.
    for (rows, n, k, group) in [
        (1, 16, 2, 2),
        (2, 17, 64, 32),
        (4, 40, 576, 64),
        (5, 16, 8, 4),
        (3, 20, 96, 16),
        (13, 33, 256, 128),
        (30, 20, 1024, 128),
        (7, 18, 512, 16),
    ] {
        let seed = (rows * 1000 + n * 10 + k) as u64;
        for format in [Format::Int4 { group }, Format::GroupedInt8 { group }] {
            check_each_dtype(format, rows, n, k, seed);
        }
    }
}

#[test]
fn an_odd_input_width_never_reads_past_a_row() {
    odd_input_width_never_reads_past_a_row::<bf16>();
    odd_input_width_never_reads_past_a_row::<f16>();
    odd_input_width_never_reads_past_a_row::<f32>();
}

fn odd_input_width_never_reads_past_a_row<E: Element>() {
    // Row 1 starts with an infinity right after row 0's last value: row 0 must not meet it
    // (through the pad weight, 0, it would make a NaN). Fused and tiled rows.
    for path in paths() {
        for rows in [2, 8] {
            let mut case = Case::<E>::with(Format::Int8, rows, 16, 5, 7);
            case.x[5] = E::from_f32(f32::INFINITY);
            let gemm = Gemv::new(Some(path), 1).unwrap();
            let mut out = vec![E::from_f32(f32::NAN); rows * 16];
            gemm.run_quantized(&case.x, case.weight(), &mut out).unwrap();
            case.rows = 1;
            case.x.truncate(5);
            case.check_out(&out, path);
        }
    }
}

#[test]
fn run_refuses_shapes_that_do_not_fit() {
    let case = Case::new(2, 3, 4, 1);
    let gemm = Gemv::new(Some(Path::Scalar), 1).unwrap();
    let mut out = vec![bf16::ZERO; 6];
    assert!(gemm.run_quantized(&case.x, case.weight(), &mut out).is_ok());
    assert!(gemm.run_quantized(&case.x[..7], case.weight(), &mut out).is_err(), "x not whole rows");
    assert!(gemm.run_quantized(&case.x, case.weight(), &mut out[..5]).is_err(), "out too short");
    assert!(gemm.run_quantized(&case.x, QuantWeight { n: 17, ..case.weight() }, &mut out).is_err(), "weight too short");
    assert!(gemm.run_quantized(&case.x, QuantWeight { scales: &case.scales[..3], ..case.weight() }, &mut out).is_err());
    assert!(gemm.run_quantized(&case.x, QuantWeight { bias: &case.bias[..3], ..case.weight() }, &mut out).is_err());
    let case = Case::with(Format::Int4 { group: 4 }, 2, 3, 8, 1);
    assert!(gemm.run_quantized(&case.x, case.weight(), &mut out).is_ok());
    let groups = QuantWeight { groups: &case.groups[..30], ..case.weight() };
    assert!(gemm.run_quantized(&case.x, groups, &mut out).is_err(), "groups too short");
    let odd = QuantWeight { format: Format::Int4 { group: 3 }, ..case.weight() };
    assert!(gemm.run_quantized(&case.x, odd, &mut out).is_err(), "an odd group");
    let case = Case::with(Format::GroupedInt8 { group: 4 }, 2, 3, 8, 1);
    assert!(gemm.run_quantized(&case.x, case.weight(), &mut out).is_ok());
    let wider = QuantWeight { format: Format::GroupedInt8 { group: 16 }, ..case.weight() };
    assert!(gemm.run_quantized(&case.x, wider, &mut out).is_err(), "a group wider than the input");
    let int4 = QuantWeight { format: Format::Int4 { group: 4 }, ..case.weight() };
    assert!(gemm.run_quantized(&case.x, int4, &mut out).is_err(), "int8 bytes read as int4's");
}

/// Every path of the quantized kernels this CPU runs (AVX2's beside AVX-512's, which runs f16
/// and f32 models on a kernel of its own).
fn paths() -> impl Iterator<Item = Path> {
    Path::ALL.into_iter().filter(|p| p.is_supported())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]
    #[test]
    fn every_path_matches_random_f64_outputs(rows in 1usize..40, n in 1usize..50, k in 1usize..300, seed in 0u64..1000) {
        check_each_dtype(Format::Int8, rows, n, k, seed);
    }

    #[test]
    fn every_path_matches_random_f64_int4_outputs(
        rows in 1usize..40, n in 1usize..50, groups in 1usize..6, half_group in 1usize..40, seed in 0u64..1000,
    ) {
        let group = 2 * half_group;
        check_each_dtype(Format::Int4 { group }, rows, n, group * groups, seed);
    }

    #[test]
    fn every_path_matches_random_f64_grouped_int8_outputs(
        rows in 1usize..40, n in 1usize..50, groups in 1usize..6, half_group in 1usize..40, seed in 0u64..1000,
    ) {
        let group = 2 * half_group;
        check_each_dtype(Format::GroupedInt8 { group }, rows, n, group * groups, seed);
    }
}
