//! Random tokens drawn on the CPU: one token per row from `softmax(logits / temperature)`, by the
//! inverse of its CDF at a uniform the caller drew (Python keeps the generators, so a seeded
//! request draws the same tokens whatever its batch). torch's way on the CPU (divide, softmax,
//! cumsum, searchsorted) passes over a 49k-wide row about eight times and allocates at each; 64
//! such rows took 7 ms of a 47 ms step. Here a row is read twice (its maximum; the exponentials
//! summed by blocks) and, past the blocks before the drawn token, once more in one block.
//!
//! Each row is drawn by one thread in a fixed order, so its token depends on nothing but its row,
//! temperature and uniform. Masked entries (`-inf`) are never drawn.

use crate::attn::simd::{Portable, Simd};
use crate::attn::Tier;
use crate::error::{ensure, Result};
use crate::team::{self, Team};

/// Vectors per block whose exponentials are summed together (256 values in AVX-512's lanes): the
/// search for the drawn token reads the block sums, then one block.
const BLOCK_VECTORS: usize = 16;

/// `draw_row` of one tier: `(row, 1 / temperature, uniform, scratch) -> index`.
type DrawRow = unsafe fn(&[f32], f32, f32, &mut Vec<f32>) -> usize;

/// The inverse-CDF sampler of a SIMD tier, on the calling thread's OpenMP team.
#[derive(Clone, Copy)]
pub struct Categorical {
    tier: Tier,
    draw_row: DrawRow,
    team: Option<Team>,
}

impl Categorical {
    /// `tier` (default: `NEO_RS_SIMD`, else the best this CPU has) on a team of `threads`.
    pub fn new(tier: Option<Tier>, threads: usize) -> Result<Categorical> {
        let tier = match tier {
            Some(t) => t.require()?,
            None => Tier::from_env()?,
        };
        Ok(Categorical { tier, draw_row: row_fn(tier), team: Team::find(threads) })
    }

    pub fn tier(&self) -> Tier {
        self.tier
    }

    /// `out[i]`: the token drawn for row `rows[i]` of `logits` (rows of `vocab`) at temperature
    /// `temperatures[i]` and uniform `uniforms[i]` in `[0, 1)`.
    pub fn draw(
        &self,
        logits: &[f32],
        vocab: usize,
        rows: &[usize],
        temperatures: &[f32],
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
            temperatures.len() == n && uniforms.len() == n && out.len() == n,
            Shape,
            "{n} rows, {} temperatures, {} uniforms, {} outputs",
            temperatures.len(),
            uniforms.len(),
            out.len()
        );
        let num_rows = logits.len() / vocab;
        ensure!(rows.iter().all(|&r| r < num_rows), Shape, "rows {rows:?} of logits with {num_rows} rows");
        let positive = temperatures.iter().all(|t| t.is_finite() && *t > 0.0);
        ensure!(positive, Value, "temperatures must be positive and finite, got {temperatures:?}");
        let unit = uniforms.iter().all(|u| (0.0..1.0).contains(u));
        ensure!(unit, Value, "uniforms must lie in [0, 1), got {uniforms:?}");
        let out_addr = out.as_mut_ptr() as usize;
        let draw = |sums: &mut Vec<f32>, i: usize| {
            let row = &logits[rows[i] * vocab..(rows[i] + 1) * vocab];
            // SAFETY: `row_fn` gave the function of a tier `Tier::require` accepted on this CPU.
            let token = unsafe { (self.draw_row)(row, 1.0 / temperatures[i], uniforms[i], sums) };
            // SAFETY: `out` is `n` long and borrowed mutably for this call; item `i` alone writes
            // `out[i]`.
            unsafe { *(out_addr as *mut u32).add(i) = token as u32 };
        };
        team::for_each_init(self.team, n, Vec::new, draw);
        Ok(())
    }
}

fn row_fn(tier: Tier) -> DrawRow {
    match tier {
        #[cfg(target_arch = "x86_64")]
        Tier::Avx512 => draw_row_avx512,
        #[cfg(target_arch = "x86_64")]
        Tier::Avx2 => draw_row_avx2,
        #[cfg(target_arch = "aarch64")]
        Tier::Neon => draw_row_neon,
        _ => draw_row_portable,
    }
}

/// The scalar reference tier's `draw_row`.
unsafe fn draw_row_portable(x: &[f32], inv_t: f32, u: f32, sums: &mut Vec<f32>) -> usize {
    // SAFETY: the portable tier runs on any CPU.
    unsafe { draw_row::<Portable>(x, inv_t, u, sums) }
}

/// # Safety
/// The CPU must support AVX-512 F/BW/VL, AVX2, FMA and F16C.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn draw_row_avx512(x: &[f32], inv_t: f32, u: f32, sums: &mut Vec<f32>) -> usize {
    // SAFETY: forwarded caller contract.
    unsafe { draw_row::<crate::attn::x86::avx512::Avx512>(x, inv_t, u, sums) }
}

/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn draw_row_avx2(x: &[f32], inv_t: f32, u: f32, sums: &mut Vec<f32>) -> usize {
    // SAFETY: forwarded caller contract.
    unsafe { draw_row::<crate::attn::x86::avx2::Avx2>(x, inv_t, u, sums) }
}

/// # Safety
/// The CPU must support NEON.
#[cfg(target_arch = "aarch64")]
#[target_feature(enable = "neon")]
unsafe fn draw_row_neon(x: &[f32], inv_t: f32, u: f32, sums: &mut Vec<f32>) -> usize {
    // SAFETY: forwarded caller contract.
    unsafe { draw_row::<crate::attn::aarch64::neon::Neon>(x, inv_t, u, sums) }
}

/// The index drawn from `softmax(x * inv_t)` at uniform `u`: the first whose cumulative mass
/// exceeds `u` times the total (torch's `searchsorted(cdf, u * cdf[-1], right=True)`).
///
/// # Safety
/// The CPU must support `S`'s tier.
#[inline(always)]
unsafe fn draw_row<S: Simd>(x: &[f32], inv_t: f32, u: f32, sums: &mut Vec<f32>) -> usize {
    let lanes = S::LANES;
    let full = x.len() / lanes * lanes;
    let p = x.as_ptr();
    // SAFETY: the caller's CPU runs `S`; every load reads `lanes` values at `i + lanes <= full
    // <= x.len()`.
    let mut m = unsafe {
        let mut v = S::splat(f32::NEG_INFINITY);
        for i in (0..full).step_by(lanes) {
            v = S::max(v, S::load(p.add(i)));
        }
        S::reduce_max(v)
    };
    m = x[full..].iter().fold(m, |a, &b| a.max(b));
    if m == f32::NEG_INFINITY {
        return 0; // every entry masked: nothing to draw (the caller's masks leave one at least)
    }
    // The exponentials summed a block at a time (the vector `exp`: near zero, not zero, below
    // about -87, so a masked entry adds about 1e-38 to its block).
    let block = BLOCK_VECTORS * lanes;
    sums.clear();
    // SAFETY: as for the maximum.
    unsafe {
        let (shift, scale) = (S::splat(m), S::splat(inv_t));
        for start in (0..full).step_by(block) {
            let mut acc = S::zero();
            for i in (start..full.min(start + block)).step_by(lanes) {
                acc = S::add(acc, S::exp(S::mul(S::sub(S::load(p.add(i)), shift), scale)));
            }
            sums.push(S::reduce_add(acc));
        }
    }
    let weight = |v: f32| if v == f32::NEG_INFINITY { 0.0 } else { ((v - m) * inv_t).exp() };
    sums.push(x[full..].iter().map(|&v| weight(v)).sum());
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
        let w = weight(v);
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
mod tests {
    use super::*;

    /// The index an f64 inverse CDF draws, and how far the target is from the nearest boundary
    /// of the cumulative masses (relative to the total).
    fn reference(x: &[f32], t: f32, u: f32) -> (usize, f64) {
        let m = x.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b)) as f64;
        let w: Vec<f64> =
            x.iter().map(|&v| if v == f32::NEG_INFINITY { 0.0 } else { ((v as f64 - m) / t as f64).exp() }).collect();
        let total: f64 = w.iter().sum();
        let target = u as f64 * total;
        let mut c = 0.0;
        for (i, &wi) in w.iter().enumerate() {
            if wi > 0.0 && c + wi > target {
                let margin = (target - c).min(c + wi - target) / total;
                return (i, margin);
            }
            c += wi;
        }
        unreachable!("u < 1")
    }

    fn rng(seed: &mut u64) -> f32 {
        *seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        ((*seed >> 40) as f32) / (1u64 << 24) as f32
    }

    fn row(seed: &mut u64, vocab: usize, masked: f32) -> Vec<f32> {
        (0..vocab).map(|_| if rng(seed) < masked { f32::NEG_INFINITY } else { (rng(seed) - 0.5) * 16.0 }).collect()
    }

    #[test]
    fn every_tier_draws_the_f64_inverse_cdf_token() {
        let mut seed = 7u64;
        for tier in Tier::supported() {
            let c = Categorical::new(Some(tier), 1).unwrap();
            let mut checked = 0;
            for &(vocab, masked) in
                &[(1, 0.0), (7, 0.0), (16, 0.3), (255, 0.0), (256, 0.5), (257, 0.1), (4099, 0.0), (49152, 0.9)]
            {
                for &t in &[0.3f32, 1.0, 2.5] {
                    let mut x = row(&mut seed, vocab, masked);
                    x[vocab / 2] = 3.0; // one drawable entry at least
                    for _ in 0..20 {
                        let u = rng(&mut seed);
                        let mut out = [0u32];
                        c.draw(&x, vocab, &[0], &[t], &[u], &mut out).unwrap();
                        let (want, margin) = reference(&x, t, u);
                        assert!(x[out[0] as usize] > f32::NEG_INFINITY, "{tier:?} drew a masked entry");
                        if margin > 1e-5 {
                            assert_eq!(out[0] as usize, want, "{tier:?} vocab {vocab} t {t} u {u}");
                            checked += 1;
                        }
                    }
                }
            }
            assert!(checked > 400, "{tier:?}: only {checked} draws far from a boundary");
        }
    }

    #[test]
    fn the_ends_of_the_uniform_and_masked_rows() {
        for tier in Tier::supported() {
            let c = Categorical::new(Some(tier), 1).unwrap();
            let mut x = vec![f32::NEG_INFINITY; 1000];
            x[300] = 1.0;
            x[700] = 1.0;
            let mut out = [0u32; 3];
            let below_one = 1.0 - f32::EPSILON / 2.0;
            c.draw(&x, 1000, &[0, 0, 0], &[1.0; 3], &[0.0, 0.5, below_one], &mut out).unwrap();
            assert_eq!(out, [300, 700, 700], "{tier:?}");
            // Rows holding NaN (a broken model) draw an index of the row rather than panic.
            x[500] = f32::NAN;
            let nan = vec![f32::NAN; 1000];
            for row in [&x, &nan] {
                c.draw(row, 1000, &[0, 0, 0], &[1.0; 3], &[0.0, 0.5, below_one], &mut out).unwrap();
                assert!(out.iter().all(|&t| t < 1000), "{tier:?}");
            }
        }
    }

    #[test]
    fn rows_are_drawn_alone_and_on_a_team() {
        let mut seed = 3u64;
        let vocab = 3000;
        let logits: Vec<f32> = (0..8).flat_map(|_| row(&mut seed, vocab, 0.2)).collect();
        let rows = [5usize, 0, 7, 7, 2];
        let temps = [1.0f32, 0.5, 2.0, 1.0, 0.7];
        let us: Vec<f32> = (0..rows.len()).map(|_| rng(&mut seed)).collect();
        let one = Categorical::new(None, 1).unwrap();
        let two = Categorical::new(None, 2).unwrap();
        let (mut a, mut b) = (vec![0u32; 5], vec![0u32; 5]);
        one.draw(&logits, vocab, &rows, &temps, &us, &mut a).unwrap();
        two.draw(&logits, vocab, &rows, &temps, &us, &mut b).unwrap();
        assert_eq!(a, b);
        for (i, &r) in rows.iter().enumerate() {
            let mut alone = [0u32];
            one.draw(&logits[r * vocab..(r + 1) * vocab], vocab, &[0], &temps[i..=i], &us[i..=i], &mut alone).unwrap();
            assert_eq!(alone[0], a[i]);
        }
    }

    #[test]
    fn bad_arguments_are_refused() {
        let c = Categorical::new(None, 1).unwrap();
        let x = [0.0f32; 8];
        let mut out = [0u32];
        assert!(c.draw(&x, 3, &[0], &[1.0], &[0.5], &mut out).is_err());
        assert!(c.draw(&x, 4, &[2], &[1.0], &[0.5], &mut out).is_err());
        assert!(c.draw(&x, 4, &[0], &[0.0], &[0.5], &mut out).is_err());
        assert!(c.draw(&x, 4, &[0], &[1.0], &[1.0], &mut out).is_err());
        assert!(c.draw(&x, 4, &[0, 1], &[1.0], &[0.5], &mut out).is_err());
    }
}
