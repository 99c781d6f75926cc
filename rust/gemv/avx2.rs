//! AVX2 with FMA, for x86 CPUs without AVX512_BF16: bf16 widened to f32 and multiplied-added in
//! 8 f32 lanes. A bf16 is the top half of an f32, so 16 loaded values split without a shuffle:
//! each 32-bit lane's even value shifted up, its odd value masked. A dot product does not mind
//! which lane a value lands in as long as `x` and the weight land alike, and they do. One weight
//! row against up to 4 `x` rows a pass (the 16 vector registers: 8 accumulators, the weight's two
//! halves and an `x` row's two), prefetching the weight as `avx512.rs` does.

use std::arch::x86_64::*;

use half::bf16;

/// `x` rows per pass over a weight row.
const ROWS: usize = 4;

/// Values a step takes: one 256-bit load of each row.
const STEP: usize = 16;

/// How far ahead of its products a pass prefetches the weight, in values (`avx512.rs`'s).
const PREFETCH: usize = 4096;

/// The sums `sums[r * rows + m] = x[m] · w[r]` for the `w.len() / k` rows of `w`.
///
/// # Safety
/// The CPU must have AVX2 and FMA.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn dots(x: &[bf16], rows: usize, k: usize, w: &[bf16], sums: &mut [f32]) {
    passes!(row, ROWS, [1, 2, 3], x, rows, k, w, sums);
}

/// `out[m] = x[m] · w` for the `M` rows of `x`, `k` values each; values past the last whole
/// step summed in f32 one by one.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn row<const M: usize>(x: &[bf16], w: &[bf16], k: usize, out: &mut [f32]) {
    let mut even = [_mm256_setzero_ps(); M];
    let mut odd = [_mm256_setzero_ps(); M];
    let whole = k - k % STEP;
    let (xp, wp) = (x.as_ptr(), w.as_ptr());
    let mut c = 0;
    while c < whole {
        // SAFETY: values `c .. c + STEP` of each row lie before `whole` <= `k`; a prefetch past
        // the weight's end does not fault.
        unsafe {
            if c % 32 == 0 {
                _mm_prefetch::<_MM_HINT_T0>(wp.wrapping_add(c + PREFETCH).cast());
            }
            let (we, wo) = split(_mm256_loadu_si256(wp.add(c).cast()));
            for m in 0..M {
                let (xe, xo) = split(_mm256_loadu_si256(xp.add(m * k + c).cast()));
                even[m] = _mm256_fmadd_ps(xe, we, even[m]);
                odd[m] = _mm256_fmadd_ps(xo, wo, odd[m]);
            }
        }
        c += STEP;
    }
    for (m, o) in out.iter_mut().enumerate() {
        let tail = super::scalar::dot(&x[m * k + whole..(m + 1) * k], &w[whole..]);
        *o = sum(_mm256_add_ps(even[m], odd[m])) + tail;
    }
}

/// 16 bf16 as 8 f32 of the even values and 8 of the odd ones.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn split(v: __m256i) -> (__m256, __m256) {
    let high = _mm256_set1_epi32(0xFFFF_0000_u32 as i32);
    (_mm256_castsi256_ps(_mm256_slli_epi32::<16>(v)), _mm256_castsi256_ps(_mm256_and_si256(v, high)))
}

/// The sum of the 8 lanes.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn sum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)))
}
