//! The reference: each weight in f32 (int8's `q`, int4's `(q - 8) · scale + zero`, grouped
//! int8's `q · scale + zero`), each product in f32, summed in input order.

use super::{Block, Format, Out, Values, COLS};

/// # Safety
/// As `Out::put`: this call alone writes `w`'s columns, for `rows` rows of `k` values of `x`.
pub(super) unsafe fn block(x: Values<'_>, rows: usize, k: usize, w: &Block<'_>, out: Out) {
    for m in 0..rows {
        let mut sums = [0.0f32; COLS];
        for (c, sum) in sums.iter_mut().enumerate() {
            for i in 0..k {
                *sum += x.get(m * k + i) * weight(w, c, i);
            }
        }
        // SAFETY: the caller's.
        unsafe { out.put(m, w, &sums) };
    }
}

/// Column `c`'s weight at input `i`: int8's `q` (its scale comes after the sum), int4's `(q - 8)
/// · scale + zero` and grouped int8's `q · scale + zero` in f32.
fn weight(w: &Block<'_>, c: usize, i: usize) -> f32 {
    let (p, lane) = (i / 2, 2 * c + i % 2);
    let params = |group: usize| {
        let g = i / group * 2 * COLS;
        (w.groups.get(g + c), w.groups.get(g + COLS + c))
    };
    match w.format {
        Format::Int8 => f32::from(w.q[p * 2 * COLS + lane] as i8),
        Format::Int4 { group } => {
            let byte = w.q[p * COLS + lane % COLS];
            let q = if lane < COLS { byte & 15 } else { byte >> 4 };
            let (scale, zero) = params(group);
            f32::from(q).mul_add(scale, (-8.0f32).mul_add(scale, zero))
        }
        Format::GroupedInt8 { group } => {
            let (scale, zero) = params(group);
            f32::from(w.q[p * 2 * COLS + lane] as i8).mul_add(scale, zero)
        }
    }
}
