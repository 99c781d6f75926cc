//! The reference: each product in f32, summed in input order.

use half::bf16;

use super::{Block, Out, COLS};

/// # Safety
/// As `Out::put`: this call alone writes `w`'s columns, for `rows` rows of `k` values of `x`.
pub(super) unsafe fn block(x: &[bf16], rows: usize, k: usize, w: &Block<'_>, out: Out) {
    for (m, xm) in x.chunks_exact(k).take(rows).enumerate() {
        let mut sums = [0.0f32; COLS];
        for (c, sum) in sums.iter_mut().enumerate() {
            for (i, v) in xm.iter().enumerate() {
                *sum += v.to_f32() * f32::from(w.q[(i / 2) * 2 * COLS + c * 2 + i % 2]);
            }
        }
        // SAFETY: the caller's.
        unsafe { out.put(m, w, &sums) };
    }
}
