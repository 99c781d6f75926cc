//! int8 K/V rows are stored rotated by a normalized Hadamard transform. A row's int8 step is
//! `max|row| / 127`, so one large channel (RoPE'd keys have a few) coarsens every other channel of
//! the row; the rotation spreads each channel over all of them first, which cuts the round-trip
//! error several times over for such rows (QuaRot's and SpinQuant's observation). The transform
//! `H` is orthonormal and its own inverse, so nothing else changes: the kernel scores a rotated q
//! against the stored rows (`(Hq)·(Hk) = q·k`) and rotates its output back (`Σ p (Hv) = H Σ p v`),
//! and a row is read back by dequantizing, then rotating again.
//!
//! Head dims that are not a power of two are rotated in blocks of the largest power of two that
//! divides them (a block-diagonal `H`, still orthonormal).
//!
//! Rows stay row-major: the first four butterfly stages are one 16x16 matrix per 16 values
//! (sixteen broadcast multiply-adds; written as butterflies, compilers leave them scalar or slow),
//! the later ones add and subtract whole 16-value runs, so every step is plain vector arithmetic
//! on any SIMD tier the compiler targets.

use crate::attn::types::{quantize_row, Element};

/// `H16[j][l] = (-1)^popcount(j & l)`: the unnormalized Hadamard matrix of 16 (Sylvester's).
const H16: [[f32; 16]; 16] = {
    let mut h = [[1.0; 16]; 16];
    let mut j = 0usize;
    while j < 16 {
        let mut l = 0usize;
        while l < 16 {
            if (j & l).count_ones() % 2 == 1 {
                h[j][l] = -1.0;
            }
            l += 1;
        }
        j += 1;
    }
    h
};

/// The Hadamard block of a row of `len` values: the largest power of two dividing `len`.
fn block_len(len: usize) -> usize {
    if len == 0 {
        return 1;
    }
    1 << len.trailing_zeros()
}

/// `x = H x` in place: per block, H16 on each 16 values (plain butterflies for blocks under 16),
/// butterflies over 16-value runs for the later stages, then `1/sqrt(block)`.
#[inline(always)]
pub fn rotate(x: &mut [f32]) {
    let n = block_len(x.len());
    let norm = 1.0 / (n as f32).sqrt();
    for block in x.chunks_exact_mut(n) {
        let mut h = 1;
        if n >= 16 {
            for chunk in block.chunks_exact_mut(16) {
                let mut y = [0f32; 16];
                for (xj, row) in chunk.iter().zip(&H16) {
                    for (yl, hl) in y.iter_mut().zip(row) {
                        *yl += xj * hl;
                    }
                }
                chunk.copy_from_slice(&y);
            }
            h = 16;
        }
        while h < n {
            for pair in block.chunks_exact_mut(2 * h) {
                let (lo, hi) = pair.split_at_mut(h);
                for (a, b) in lo.iter_mut().zip(hi) {
                    (*a, *b) = (*a + *b, *a - *b);
                }
            }
            h *= 2;
        }
        for v in block {
            *v *= norm;
        }
    }
}

/// Quantizes one K/V row as the int8 pool stores it: rotated, then symmetric int8 (see
/// `quantize_row`); returns its scale. `buf` holds at least `src.len()` values of workspace.
#[inline(always)]
pub fn quantize_kv_row<E: Element>(src: &[E], dst: &mut [i8], buf: &mut [f32]) -> f32 {
    let row = &mut buf[..src.len()];
    for (r, s) in row.iter_mut().zip(src) {
        *r = s.to_f32();
    }
    rotate(row);
    quantize_row(row, dst)
}

/// A stored int8 K/V row read back: `H (scale * src)` into `dst`. `buf` as for
/// `quantize_kv_row`.
#[inline(always)]
pub fn dequantize_kv_row<E: Element>(src: &[i8], scale: f32, dst: &mut [E], buf: &mut [f32]) {
    let row = &mut buf[..src.len()];
    for (r, &x) in row.iter_mut().zip(src) {
        *r = f32::from(x) * scale;
    }
    rotate(row);
    for (d, &x) in dst.iter_mut().zip(row.iter()) {
        *d = E::from_f32(x);
    }
}

/// Quantizes rows of `width` values (`src.len() / width` of them) as `quantize_kv_row` does, one
/// scale per row into `scales` (swap-outs and host-bound prefills: many rows at once, so the row
/// loop runs compiled for this CPU's widest vector tier; the result is the same on every tier).
pub fn quantize_kv_rows<E: Element>(src: &[E], dst: &mut [i8], scales: &mut [f32], width: usize) {
    struct Rows<'a, E> {
        src: &'a [E],
        dst: &'a mut [i8],
        scales: &'a mut [f32],
        width: usize,
    }
    impl<E: Element> RowLoop for Rows<'_, E> {
        #[inline(always)]
        fn run(self) {
            let mut buf = vec![0.0; self.width];
            let rows = self.src.chunks(self.width).zip(self.dst.chunks_mut(self.width));
            for ((s, o), scale) in rows.zip(self.scales) {
                *scale = quantize_kv_row(s, o, &mut buf);
            }
        }
    }
    on_widest_tier(Rows { src, dst, scales, width });
}

/// Stored rows of `width` values read back as `dequantize_kv_row` does (swap-ins; compiled as
/// `quantize_kv_rows` is).
pub fn dequantize_kv_rows<E: Element>(src: &[i8], scales: &[f32], dst: &mut [E], width: usize) {
    struct Rows<'a, E> {
        src: &'a [i8],
        scales: &'a [f32],
        dst: &'a mut [E],
        width: usize,
    }
    impl<E: Element> RowLoop for Rows<'_, E> {
        #[inline(always)]
        fn run(self) {
            let mut buf = vec![0.0; self.width];
            let rows = self.src.chunks(self.width).zip(self.scales);
            for ((s, &scale), o) in rows.zip(self.dst.chunks_mut(self.width)) {
                dequantize_kv_row(s, scale, o, &mut buf);
            }
        }
    }
    on_widest_tier(Rows { src, scales, dst, width });
}

/// A loop over many rows, `run` inlined into whichever wrapper calls it.
trait RowLoop {
    fn run(self);
}

/// Runs `rows` from a wrapper compiled for the widest vector tier this CPU has
/// (`Tier::from_env`, so `NEO_RS_SIMD` applies). rustc never contracts or reorders float
/// arithmetic, so every tier computes the same bits.
fn on_widest_tier(rows: impl RowLoop) {
    #[cfg(target_arch = "x86_64")]
    {
        use crate::attn::Tier;
        #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
        fn avx512(rows: impl RowLoop) {
            rows.run()
        }
        #[target_feature(enable = "avx2,fma,f16c")]
        fn avx2(rows: impl RowLoop) {
            rows.run()
        }
        match Tier::from_env() {
            // SAFETY: the tier is supported by this CPU (`from_env` checks it).
            Ok(Tier::Avx512) => return unsafe { avx512(rows) },
            // SAFETY: as above.
            Ok(Tier::Avx2) => return unsafe { avx2(rows) },
            _ => {}
        }
    }
    rows.run()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lcg(seed: &mut u64) -> f32 {
        *seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        ((*seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }

    #[test]
    fn quantized_rows_read_back_within_half_a_step() {
        let (width, mut seed) = (64, 3);
        let mut buf = [0f32; 64];
        for zero in [false, true] {
            let x: Vec<f32> = (0..width).map(|_| if zero { 0.0 } else { lcg(&mut seed) * 4.0 }).collect();
            let mut q = [0i8; 64];
            let s = quantize_kv_row(&x, &mut q, &mut buf);
            let mut back = [f32::NAN; 64];
            dequantize_kv_row(&q, s, &mut back, &mut buf);
            // Each rotated value is within s/2; rotated back, the row's error norm is too.
            let err = x.iter().zip(&back).map(|(p, q)| (p - q) * (p - q)).sum::<f32>().sqrt();
            assert!(err <= s / 2.0 * (width as f32).sqrt() + 1e-6, "error {err}, step {s}");
            assert_eq!(zero, s == 0.0);
            assert!(q.iter().all(|&v| v != -128));
        }
    }

    #[test]
    fn an_outlier_channel_costs_the_other_channels_little() {
        // One channel at 100, the rest uniform in [-1, 1]. Plain int8 steps by 100/127 = 0.79 for
        // every channel (rms error 0.79/sqrt(12) = 0.23); rotated, the row's max is about
        // 100/8 + a few, a step near 0.12 (rms error about 0.035).
        let mut seed = 11;
        let mut x: Vec<f32> = (0..64).map(|_| lcg(&mut seed)).collect();
        x[5] = 100.0;
        let rms = |y: &[f32]| (x.iter().zip(y).map(|(a, b)| (a - b) * (a - b)).sum::<f32>() / 64.0).sqrt();
        let (mut q, mut back, mut buf) = ([0i8; 64], [0f32; 64], [0f32; 64]);
        let s = quantize_row(&x, &mut q);
        let plain: Vec<f32> = q.iter().map(|&v| f32::from(v) * s).collect();
        let s = quantize_kv_row(&x, &mut q, &mut buf);
        dequantize_kv_row(&q, s, &mut back, &mut buf);
        assert!(rms(&plain) > 0.15, "plain int8 rms error {}", rms(&plain));
        assert!(rms(&back) < 0.1, "rotated int8 rms error {}", rms(&back));
    }
}
