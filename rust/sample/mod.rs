//! Random tokens drawn on the CPU: one token per row from `softmax(logits / temperature)`, by the
//! inverse of its CDF at a uniform the caller drew (Python keeps the generators, so a seeded
//! request draws the same tokens whatever its batch). torch's way on the CPU (divide, softmax,
//! cumsum, searchsorted) passes over a 49k-wide row about eight times and allocates at each; 64
//! such rows took 9 ms (`benches/sampling.py`). Here a row is read twice (its maximum; the
//! exponentials summed by blocks) and, past the blocks before the drawn token, once more in one
//! block.
//!
//! Top-k, top-p and min-p narrow a row to the logits at or above a threshold (`filter.rs`) before
//! the draw, as torch's sort-based filters did at 0.5x the engine's speed (64 streams of SmolLM2).
//!
//! Each row is drawn by one thread in a fixed order, so its token depends on nothing but its row,
//! parameters and uniform. Masked entries (`-inf`) are never drawn.

mod argmax;
mod filter;

use half::bf16;

use crate::attn::simd::{Portable, Simd};
use crate::attn::Tier;
use crate::error::{ensure, Result};
use crate::team::{self, Team};

/// Vectors per block whose exponentials are summed together (256 values in AVX-512's lanes): the
/// search for the drawn token reads the block sums, then one block.
const BLOCK_VECTORS: usize = 16;

/// How one row is drawn: `softmax(logits / temperature)`, narrowed to the `top_k` largest logits
/// (0: all), then to the smallest set of them holding `top_p` of their mass (1: all), then to
/// those whose probability is at least `min_p` times the largest (0: all). vLLM's order and
/// meanings; ties at a cut are kept.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RowParams {
    pub temperature: f32,
    pub top_k: usize,
    pub top_p: f32,
    pub min_p: f32,
}

impl RowParams {
    pub fn plain(temperature: f32) -> RowParams {
        RowParams { temperature, top_k: 0, top_p: 1.0, min_p: 0.0 }
    }

    fn check(&self) -> Result<()> {
        let RowParams { temperature: t, top_p, min_p, .. } = *self;
        ensure!(t.is_finite() && t > 0.0, Value, "temperature must be positive and finite, got {t}");
        ensure!(top_p > 0.0 && top_p <= 1.0, Value, "top_p must lie in (0, 1], got {top_p}");
        ensure!((0.0..=1.0).contains(&min_p), Value, "min_p must lie in [0, 1], got {min_p}");
        Ok(())
    }
}

/// A step's logits, `[rows, vocab]` flattened: float32, or the model's bf16 (greedy rows only).
#[derive(Clone, Copy)]
pub enum Logits<'a> {
    F32(&'a [f32]),
    Bf16(&'a [bf16]),
}

impl Logits<'_> {
    fn len(&self) -> usize {
        match self {
            Logits::F32(x) => x.len(),
            Logits::Bf16(x) => x.len(),
        }
    }
}

/// The vector halves of a draw, per tier: a row's first maximum (`argmax.rs`, a greedy row's
/// token too), and its exponentials summed by blocks.
#[derive(Clone, Copy)]
struct Kernels {
    lanes: usize,
    block_sums: unsafe fn(&[f32], f32, f32, &mut Vec<f32>),
    argmax_f32: unsafe fn(&[f32]) -> usize,
    argmax_bf16: unsafe fn(&[bf16]) -> usize,
}

/// A thread's buffers: block sums, a filter's candidates, a narrowed row.
#[derive(Default)]
struct Scratch {
    sums: Vec<f32>,
    candidates: Vec<(f32, u32)>,
    narrowed: Vec<f32>,
}

/// The inverse-CDF sampler of a SIMD tier, on the calling thread's OpenMP team.
#[derive(Clone, Copy)]
pub struct Categorical {
    tier: Tier,
    kernels: Kernels,
    team: Option<Team>,
}

impl Categorical {
    /// `tier` (default: `NEO_RS_SIMD`, else the best this CPU has) on a team of `threads`.
    pub fn new(tier: Option<Tier>, threads: usize) -> Result<Categorical> {
        let tier = match tier {
            Some(t) => t.require()?,
            None => Tier::from_env()?,
        };
        Ok(Categorical { tier, kernels: kernels(tier), team: Team::find(threads) })
    }

    pub fn tier(&self) -> Tier {
        self.tier
    }

    /// `out[i]`: the token drawn for row `rows[i]` of `logits` (rows of `vocab`) as `params[i]`
    /// says, at the uniform `uniforms[i]` in `[0, 1)`.
    pub fn draw(
        &self,
        logits: &[f32],
        vocab: usize,
        rows: &[usize],
        params: &[RowParams],
        uniforms: &[f32],
        out: &mut [u32],
    ) -> Result<()> {
        ensure!(
            vocab > 0 && logits.len().is_multiple_of(vocab),
            Shape,
            "logits hold {} values, not rows of {vocab}",
            logits.len()
        );
        let n = rows.len();
        ensure!(
            params.len() == n && uniforms.len() == n && out.len() == n,
            Shape,
            "{n} rows, {} parameters, {} uniforms, {} outputs",
            params.len(),
            uniforms.len(),
            out.len()
        );
        let num_rows = logits.len() / vocab;
        ensure!(rows.iter().all(|&r| r < num_rows), Shape, "rows {rows:?} of logits with {num_rows} rows");
        params.iter().try_for_each(RowParams::check)?;
        let unit = uniforms.iter().all(|u| (0.0..1.0).contains(u));
        ensure!(unit, Value, "uniforms must lie in [0, 1), got {uniforms:?}");
        let out_addr = out.as_mut_ptr() as usize;
        let draw = |scratch: &mut Scratch, i: usize| {
            let row = &logits[rows[i] * vocab..(rows[i] + 1) * vocab];
            // SAFETY: `kernels` gave the functions of a tier `Tier::require` accepted on this CPU.
            let token = unsafe { self.draw_row(row, params[i], uniforms[i], scratch) };
            // SAFETY: `out` is `n` long and borrowed mutably for this call; item `i` alone writes
            // `out[i]`.
            unsafe { *(out_addr as *mut u32).add(i) = token as u32 };
        };
        team::for_each_init(self.team, n, Scratch::default, draw);
        Ok(())
    }

    /// `out[i]`: the first largest entry of row `i` of `logits` (rows of `vocab`), as torch's
    /// `max(dim=-1).indices`.
    pub fn argmax(&self, logits: Logits<'_>, vocab: usize, out: &mut [u32]) -> Result<()> {
        let n = out.len();
        ensure!(
            vocab > 0 && logits.len() == n * vocab,
            Shape,
            "logits hold {} values, not {n} rows of {vocab}",
            logits.len()
        );
        let out_addr = out.as_mut_ptr() as usize;
        let Kernels { argmax_f32, argmax_bf16, .. } = self.kernels;
        let row = |_: &mut (), i: usize| {
            let at = i * vocab..(i + 1) * vocab;
            // SAFETY: `kernels` gave the functions of a tier `Tier::require` accepted on this CPU.
            let token = unsafe {
                match logits {
                    Logits::F32(x) => argmax_f32(&x[at]),
                    Logits::Bf16(x) => argmax_bf16(&x[at]),
                }
            };
            // SAFETY: `out` is `n` long and borrowed mutably for this call; item `i` alone writes
            // `out[i]`.
            unsafe { *(out_addr as *mut u32).add(i) = token as u32 };
        };
        team::for_each_init(self.team, n, || (), row);
        Ok(())
    }

    /// One row's token (its parameters checked).
    ///
    /// # Safety
    /// The CPU must support the tier of `self.kernels`.
    unsafe fn draw_row(&self, x: &[f32], p: RowParams, u: f32, scratch: &mut Scratch) -> usize {
        let inv_t = 1.0 / p.temperature;
        // SAFETY: forwarded caller contract.
        let m = x[unsafe { (self.kernels.argmax_f32)(x) }];
        if m == f32::NEG_INFINITY {
            return 0; // every entry masked: nothing to draw (the caller's masks leave one at least)
        }
        let Scratch { sums, candidates, narrowed } = scratch;
        let x = match filter::threshold(x, m, inv_t, p, candidates, |x| {
            // SAFETY: forwarded caller contract.
            unsafe { (self.kernels.block_sums)(x, m, inv_t, sums) };
            sums.iter().map(|&s| f64::from(s)).sum()
        }) {
            Some(cut) => {
                narrowed.clear();
                narrowed.extend(x.iter().map(|&v| if v >= cut { v } else { f32::NEG_INFINITY }));
                narrowed.as_slice()
            }
            None => x,
        };
        // SAFETY: forwarded caller contract.
        unsafe { (self.kernels.block_sums)(x, m, inv_t, sums) };
        search(x, m, inv_t, u, sums, self.kernels.lanes)
    }
}

fn kernels(tier: Tier) -> Kernels {
    match tier {
        #[cfg(target_arch = "x86_64")]
        Tier::Avx512 => Kernels {
            lanes: 16,
            block_sums: avx512::block_sums,
            argmax_f32: avx512::argmax_f32,
            argmax_bf16: avx512::argmax_bf16,
        },
        #[cfg(target_arch = "x86_64")]
        Tier::Avx2 => Kernels {
            lanes: 8,
            block_sums: avx2::block_sums,
            argmax_f32: avx2::argmax_f32,
            argmax_bf16: avx2::argmax_bf16,
        },
        #[cfg(target_arch = "aarch64")]
        Tier::Neon => Kernels {
            lanes: 4,
            block_sums: neon::block_sums,
            argmax_f32: neon::argmax_f32,
            argmax_bf16: neon::argmax_bf16,
        },
        _ => Kernels {
            lanes: Portable::LANES,
            block_sums: portable::block_sums,
            argmax_f32: portable::argmax_f32,
            argmax_bf16: portable::argmax_bf16,
        },
    }
}

/// `block_sums` and the argmaxes of one tier, compiled for its instructions.
macro_rules! tier {
    ($name:ident, $simd:ty $(, $features:literal)?) => {
        mod $name {
            /// # Safety
            /// The CPU must support the tier.
            $(#[target_feature(enable = $features)])?
            pub(super) unsafe fn block_sums(x: &[f32], m: f32, inv_t: f32, sums: &mut Vec<f32>) {
                // SAFETY: forwarded caller contract.
                unsafe { super::block_sums::<$simd>(x, m, inv_t, sums) }
            }

            /// # Safety
            /// The CPU must support the tier.
            $(#[target_feature(enable = $features)])?
            pub(super) unsafe fn argmax_f32(x: &[f32]) -> usize {
                // SAFETY: forwarded caller contract.
                unsafe { super::argmax::row::<$simd, f32>(x) }
            }

            /// # Safety
            /// The CPU must support the tier.
            $(#[target_feature(enable = $features)])?
            pub(super) unsafe fn argmax_bf16(x: &[half::bf16]) -> usize {
                // SAFETY: forwarded caller contract.
                unsafe { super::argmax::row::<$simd, half::bf16>(x) }
            }
        }
    };
}

tier!(portable, crate::attn::simd::Portable);
#[cfg(target_arch = "x86_64")]
tier!(avx512, crate::attn::x86::avx512::Avx512, "avx512f,avx512bw,avx512vl,avx2,fma,f16c");
#[cfg(target_arch = "x86_64")]
tier!(avx2, crate::attn::x86::avx2::Avx2, "avx2,fma,f16c");
#[cfg(target_arch = "aarch64")]
tier!(neon, crate::attn::aarch64::neon::Neon, "neon");

/// `sums`: `exp((x - m) * inv_t)` summed a block of `BLOCK_VECTORS` vectors at a time, then the
/// tail past the last whole vector. The vector `exp` gives near zero, not zero, below about -87,
/// so a masked entry adds about 1e-38 to its block.
///
/// # Safety
/// The CPU must support `S`'s tier.
#[inline(always)]
unsafe fn block_sums<S: Simd>(x: &[f32], m: f32, inv_t: f32, sums: &mut Vec<f32>) {
    let lanes = S::LANES;
    let full = x.len() / lanes * lanes;
    let p = x.as_ptr();
    sums.clear();
    // SAFETY: the caller's CPU runs `S`; every load reads `lanes` values at `i + lanes <= full
    // <= x.len()`.
    unsafe {
        let (shift, scale) = (S::splat(m), S::splat(inv_t));
        for start in (0..full).step_by(BLOCK_VECTORS * lanes) {
            let mut acc = S::zero();
            for i in (start..full.min(start + BLOCK_VECTORS * lanes)).step_by(lanes) {
                acc = S::add(acc, S::exp(S::mul(S::sub(S::load(p.add(i)), shift), scale)));
            }
            sums.push(S::reduce_add(acc));
        }
    }
    sums.push(x[full..].iter().map(|&v| weight(v, m, inv_t)).sum());
}

/// An entry's unnormalised probability; exactly zero when masked.
fn weight(v: f32, m: f32, inv_t: f32) -> f32 {
    if v == f32::NEG_INFINITY {
        0.0
    } else {
        ((v - m) * inv_t).exp()
    }
}

/// The index drawn from `softmax(x * inv_t)` (maximum `m`, `sums` its `block_sums` on vectors of
/// `lanes`) at uniform `u`: the first whose cumulative mass exceeds `u` times the total (torch's
/// `searchsorted(cdf, u * cdf[-1], right=True)`).
fn search(x: &[f32], m: f32, inv_t: f32, u: f32, sums: &[f32], lanes: usize) -> usize {
    let (block, full) = (BLOCK_VECTORS * lanes, x.len() / lanes * lanes);
    let total: f64 = sums.iter().map(|&s| f64::from(s)).sum();
    let target = f64::from(u) * total;
    // The first block whose sum crosses the target, then a scan of its entries (and on past it
    // should its scalar exponentials fall a rounding short of its vector sum).
    let mut before = 0.0f64;
    let mut first = x.len();
    for (b, &s) in sums.iter().enumerate() {
        if before + f64::from(s) > target {
            first = b * block;
            break;
        }
        before += f64::from(s);
    }
    let mut last_drawable = None;
    for (i, &v) in x.iter().enumerate().skip(first.min(full)) {
        let w = weight(v, m, inv_t);
        if w > 0.0 {
            before += f64::from(w);
            if before > target {
                return i;
            }
            last_drawable = Some(i);
        }
    }
    // Rounding left the target past every entry: the last one with mass (before `first`, the
    // row's largest entry has mass; none is found only in a row holding NaN, whose draw is 0).
    last_drawable.or_else(|| x.iter().rposition(|&v| v == m)).unwrap_or(0)
}

#[cfg(test)]
mod tests;
