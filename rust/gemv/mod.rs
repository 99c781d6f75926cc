//! bf16 linears of a few rows on the CPU: `out = x · Wᵀ (+ bias)`, reading `W` as the model holds
//! it (row-major, `[n, k]`). At one to a few rows a linear does one multiply-add per weight it
//! reads, so its time is the weight's bytes over the memory bandwidth; oneDNN's packed GEMM adds
//! about 20 us of set-up to every call, which for SmolLM2's 576-wide layers is a third of the call
//! (`benches/gemv.py` times both). Each output is the dot product of an `x` row with a weight
//! row, summed in f32 and rounded to bf16 once, as oneDNN does.
//!
//! Work is split by weight rows over the calling thread's OpenMP team (`crate::team`), the threads
//! torch's GEMMs just used; without a team the calling thread does it all.

/// The passes of a SIMD path's `dots` (`sums[r * rows + m] = x[m] · w[r]` for the `w.len() / k`
/// rows of `w`): for each weight row, the `x` rows at most `$max` at a time, each pass
/// `$row::<count>(x_rows, w_row, k, sums)`, `count` a constant of `$counts` or `$max`. A macro,
/// so that the row kernels inline under the calling function's target features.
macro_rules! passes {
    ($row:ident, $max:ident, [$($n:literal),*], $x:expr, $rows:expr, $k:expr, $w:expr, $sums:expr) => {{
        let (x, rows, k, w, sums): (&[bf16], usize, usize, &[bf16], &mut [f32]) = ($x, $rows, $k, $w, $sums);
        let n = w.len() / k;
        for r in 0..n {
            let mut m = 0;
            while m < rows {
                let c = rows.min(m + $max) - m;
                let (xs, ws, out) = (&x[m * k..(m + c) * k], &w[r * k..(r + 1) * k], &mut sums[r * rows + m..][..c]);
                // SAFETY: `c` rows of `x` and one of `w`, `k` values each (sliced above); the
                // target features are the caller's.
                unsafe {
                    match c {
                        $($n => $row::<$n>(xs, ws, k, out),)*
                        _ => $row::<$max>(xs, ws, k, out),
                    }
                }
                m += c;
            }
        }
    }};
}

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
#[cfg(target_arch = "aarch64")]
mod neon;
mod scalar;

use half::bf16;

use crate::error::{ensure, Result};
use crate::team::Team;

/// Weight rows per work item: 16 rows of a 576-wide layer are 18 KiB, and SmolLM2's linears make
/// 36 to 3,072 items a call, enough for an even split and few enough for the shared counter.
const BLOCK: usize = 16;

/// The dot-product kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Path {
    /// Plain f32 multiply-adds: the reference every SIMD path is tested against.
    Scalar,
    /// AVX2 with FMA: bf16 widened to f32, fused multiply-adds of 8 lanes.
    Avx2,
    /// AVX512_BF16 `vdpbf16ps`: 32 products per instruction, summed pairwise into f32 lanes.
    Avx512Bf16,
    /// NEON (aarch64): bf16 widened to f32, fused multiply-adds of 4 lanes.
    Neon,
    /// NEON with BF16 (Armv8.6) `bfdot`: 8 products per instruction, summed pairwise into 4 lanes.
    NeonBf16,
}

impl Path {
    /// In the order `best` prefers them last to first.
    pub const ALL: [Path; 5] = [Path::Scalar, Path::Avx2, Path::Avx512Bf16, Path::Neon, Path::NeonBf16];

    pub fn name(self) -> &'static str {
        match self {
            Path::Scalar => "scalar",
            Path::Avx2 => "avx2",
            Path::Avx512Bf16 => "avx512_bf16",
            Path::Neon => "neon",
            Path::NeonBf16 => "neon_bf16",
        }
    }

    pub fn parse(s: &str) -> Result<Path> {
        let name = s.trim().to_ascii_lowercase();
        Path::ALL.into_iter().find(|p| p.name() == name).ok_or_else(|| {
            let names: Vec<_> = Path::ALL.iter().map(|p| p.name()).collect();
            crate::error::NeoError::Value(format!("unknown linear kernel {s:?}; expected one of {}", names.join(", ")))
        })
    }

    pub fn is_supported(self) -> bool {
        match self {
            Path::Scalar => true,
            #[cfg(target_arch = "x86_64")]
            Path::Avx2 => {
                use std::arch::is_x86_feature_detected as has;
                // F16C for the quantized kernel's f16 models (every AVX2 CPU has it).
                has!("avx2") && has!("fma") && has!("f16c")
            }
            #[cfg(target_arch = "x86_64")]
            Path::Avx512Bf16 => {
                use std::arch::is_x86_feature_detected as has;
                has!("avx512f") && has!("avx512bw") && has!("avx512bf16")
            }
            #[cfg(target_arch = "aarch64")]
            Path::Neon => true,
            #[cfg(target_arch = "aarch64")]
            Path::NeonBf16 => std::arch::is_aarch64_feature_detected!("bf16"),
            #[allow(unreachable_patterns)]
            _ => false,
        }
    }

    /// The fastest path this CPU runs.
    pub fn best() -> Path {
        Path::ALL.into_iter().rev().find(|p| p.is_supported()).unwrap_or(Path::Scalar)
    }

    /// The sums `sums[r * rows + m] = x[m] · w[r]` for the `w.len() / k` weight rows of `w`.
    fn dots(self, x: &[bf16], rows: usize, k: usize, w: &[bf16], sums: &mut [f32]) {
        match self {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `Path::is_supported` was checked when the path was chosen (`Gemv::new`).
            Path::Avx512Bf16 => unsafe { avx512::dots(x, rows, k, w, sums) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as above.
            Path::Avx2 => unsafe { avx2::dots(x, rows, k, w, sums) },
            #[cfg(target_arch = "aarch64")]
            Path::Neon => neon::dots_widen(x, rows, k, w, sums),
            #[cfg(target_arch = "aarch64")]
            // SAFETY: as above.
            Path::NeonBf16 => unsafe { neon::dots_bfdot(x, rows, k, w, sums) },
            _ => scalar::dots(x, rows, k, w, sums),
        }
    }
}

/// One linear's weight, `n` rows of `k`, and its bias of `n`, if any.
#[derive(Debug, Clone, Copy)]
pub struct Weight<'a> {
    pub w: &'a [bf16],
    pub n: usize,
    pub k: usize,
    pub bias: Option<&'a [bf16]>,
}

impl Weight<'_> {
    pub fn check(&self) -> Result<()> {
        ensure!(self.n > 0 && self.k > 0, Shape, "a linear's weight must not be empty, got [{}, {}]", self.n, self.k);
        ensure!(
            self.w.len() == self.n * self.k,
            Shape,
            "weight holds {} values, not {} x {}",
            self.w.len(),
            self.n,
            self.k
        );
        if let Some(b) = self.bias {
            ensure!(b.len() == self.n, Shape, "bias holds {} values, the weight has {} rows", b.len(), self.n);
        }
        Ok(())
    }
}

/// The kernel path and the threads a CPU linear runs on: bf16 here (`run`), int8 and int4 in
/// `crate::qlinear` (`run_quantized`).
#[derive(Clone, Copy)]
pub struct Gemv {
    path: Path,
    team: Option<Team>,
}

impl Gemv {
    /// `path` (default: the best this CPU has) on a team of `threads` OpenMP threads.
    pub fn new(path: Option<Path>, threads: usize) -> Result<Gemv> {
        let path = path.unwrap_or_else(Path::best);
        ensure!(path.is_supported(), Runtime, "this CPU cannot run the {} linear kernel", path.name());
        Ok(Gemv { path, team: Team::find(threads) })
    }

    pub fn path(&self) -> Path {
        self.path
    }

    /// `out[m] = x[m] · Wᵀ + bias` for each of the `x.len() / k` rows of `x` (`out`: `[rows, n]`).
    pub fn run(&self, x: &[bf16], weight: Weight<'_>, out: &mut [bf16]) -> Result<()> {
        weight.check()?;
        let Weight { n, k, .. } = weight;
        ensure!(x.len().is_multiple_of(k) && !x.is_empty(), Shape, "x holds {} values, not rows of {k}", x.len());
        let rows = x.len() / k;
        ensure!(out.len() == rows * n, Shape, "out holds {} values, not {rows} x {n}", out.len());
        let out_addr = out.as_mut_ptr() as usize;
        let block = |sums: &mut Vec<f32>, item: usize| {
            let first = item * BLOCK;
            let count = BLOCK.min(n - first);
            sums.resize(count * rows, 0.0);
            self.path.dots(x, rows, k, &weight.w[first * k..(first + count) * k], sums);
            for r in 0..count {
                let bias = weight.bias.map_or(0.0, |b| b[first + r].to_f32());
                for m in 0..rows {
                    let value = bf16::from_f32(sums[r * rows + m] + bias);
                    // SAFETY: `out` is `rows * n` long and borrowed mutably for this call; item
                    // `item` alone writes columns `first .. first + count` of each row.
                    unsafe { *(out_addr as *mut bf16).add(m * n + first + r) = value };
                }
            }
        };
        self.for_each_init(n.div_ceil(BLOCK), Vec::new, block);
        Ok(())
    }

    /// `f(state, i)` for every `i` in `0..n`, on the team (`team::for_each_init`).
    pub(crate) fn for_each_init<S>(&self, n: usize, init: impl Fn() -> S + Sync, f: impl Fn(&mut S, usize) + Sync) {
        crate::team::for_each_init(self.team, n, init, f);
    }
}

#[cfg(test)]
mod tests;
