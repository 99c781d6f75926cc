//! The reference: each product in f32, summed in order.

use half::bf16;

pub(super) fn dots(x: &[bf16], rows: usize, k: usize, w: &[bf16], sums: &mut [f32]) {
    for (r, wr) in w.chunks_exact(k).enumerate() {
        for (m, xm) in x.chunks_exact(k).take(rows).enumerate() {
            sums[r * rows + m] = dot(xm, wr);
        }
    }
}

/// `x · w` over their common length (the SIMD paths' values past their last whole step).
pub(super) fn dot(x: &[bf16], w: &[bf16]) -> f32 {
    x.iter().zip(w).map(|(a, b)| a.to_f32() * b.to_f32()).sum()
}
