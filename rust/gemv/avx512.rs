//! AVX512_BF16: `vdpbf16ps` multiplies 32 bf16 pairs of a weight row and an `x` row and adds each
//! adjacent pair's products into one of 16 f32 lanes; the lanes are summed once at the end of
//! the row. One weight row at a time against up to 8 `x` rows, so the weight is read front to
//! back: four rows read side by side (four streams 1 KiB apart) ran at 11 GB/s a thread here,
//! one at a time at 27 GB/s, as the hardware prefetcher follows a single stream.
//!
//! Past a row or two, the products of a line take long enough that the hardware prefetcher no
//! longer runs far enough ahead: each thread prefetches the weight `PREFETCH` bytes ahead itself
//! (Zen 5, Llama-3.2-1B's qkv projection read cold at 8 rows: 13 -> 17 GB/s on one thread, 23 ->
//! 31 on two). Taking `x` in slices that fit L1 was tried and dropped: it cut each weight row
//! into runs, and 8 rows fell to 10 GB/s.

use std::arch::x86_64::*;

use half::bf16;

/// `x` rows per pass over a weight row: two sets of 8 accumulators, the weight and an `x` chunk
/// fit the 32 vector registers.
const ROWS: usize = 8;

/// How far ahead of its products a pass prefetches the weight, in values: 8 KiB, about a
/// memory latency's worth of reading at a thread's bandwidth, with room to spare.
const PREFETCH: usize = 4096;

/// The sums `sums[r * rows + m] = x[m] · w[r]` for the `w.len() / k` rows of `w`.
///
/// # Safety
/// The CPU must have AVX512F, AVX512BW and AVX512_BF16.
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
pub(super) unsafe fn dots(x: &[bf16], rows: usize, k: usize, w: &[bf16], sums: &mut [f32]) {
    passes!(row, ROWS, [1, 2, 3, 4, 5, 6, 7], x, rows, k, w, sums);
}

/// `out[m] = x[m] · w` for `M` rows of `x`, `k` values each.
/// Alternate 32-value chunks go to two sets of accumulators, so that one row's chain of
/// `vdpbf16ps` does not wait on its own latency. The two sets are separate arrays indexed by
/// constants: one array indexed by the chunk's parity was kept on the stack, each product a load
/// and a store (4 rows ran at half of 1 row's speed).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
unsafe fn row<const M: usize>(x: &[bf16], w: &[bf16], k: usize, out: &mut [f32]) {
    let (x, w) = (x.as_ptr(), w.as_ptr());
    let mut even = [_mm512_setzero_ps(); M];
    let mut odd = [_mm512_setzero_ps(); M];
    let mut c = 0;
    while c + 64 <= k {
        // SAFETY: both chunks lie inside the caller's rows of `k` values; a prefetch past the
        // weight's end does not fault.
        unsafe {
            _mm_prefetch::<_MM_HINT_T0>(w.wrapping_add(c + PREFETCH).cast());
            _mm_prefetch::<_MM_HINT_T0>(w.wrapping_add(c + PREFETCH + 32).cast());
            chunk(&mut even, x, k, w, c, u32::MAX);
            chunk(&mut odd, x, k, w, c + 32, u32::MAX);
        }
        c += 64;
    }
    if c + 32 <= k {
        // SAFETY: a whole chunk inside the rows.
        unsafe { chunk(&mut even, x, k, w, c, u32::MAX) };
        c += 32;
    }
    if c < k {
        // SAFETY: the mask keeps the last, partial chunk inside the rows.
        unsafe { chunk(&mut odd, x, k, w, c, (1u32 << (k - c)) - 1) };
    }
    for (m, o) in out.iter_mut().enumerate() {
        *o = _mm512_reduce_add_ps(_mm512_add_ps(even[m], odd[m]));
    }
}

/// Adds the products of the (masked) 32 values at `c` of the weight row and of each `x` row.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
unsafe fn chunk<const M: usize>(
    acc: &mut [__m512; M],
    x: *const bf16,
    k: usize,
    w: *const bf16,
    c: usize,
    mask: __mmask32,
) {
    // SAFETY: the caller's rows of `k` values; the mask keeps loads inside them.
    unsafe {
        let wv = bh(_mm512_maskz_loadu_epi16(mask, w.add(c).cast()));
        for (m, a) in acc.iter_mut().enumerate() {
            *a = _mm512_dpbf16_ps(*a, wv, bh(_mm512_maskz_loadu_epi16(mask, x.add(m * k + c).cast())));
        }
    }
}

/// The same 512 bits as 32 bf16 lanes.
#[inline(always)]
fn bh(x: __m512i) -> __m512bh {
    // SAFETY: both are plain 64-byte vectors; every bit pattern is valid for either.
    unsafe { std::mem::transmute::<__m512i, __m512bh>(x) }
}
