//! AVX512_BF16: 32 int8 weights (a pair of inputs for each of a block's 16 columns) widened to
//! bf16, against the pair of `x` values broadcast, in one `vdpbf16ps` per row (module docs of
//! `super`).

use std::arch::x86_64::*;

use half::bf16;

use super::{Block, Out, Rows, Scratch, COLS, FUSED_ROWS, TILE};

/// Values of a pair: a block's weights for two inputs.
const PAIR: usize = 2 * COLS;
/// Pairs per chunk: 8 KiB of widened weight.
const CHUNK: usize = 128;
/// Accumulator sets the fused kernel alternates between, so that a row's chain of `vdpbf16ps`
/// does not wait on its own latency.
const SETS: usize = 4;

/// # Safety
/// The CPU must have AVX512F, AVX512BW and AVX512_BF16; `x` holds `rows` rows of `k`, `w` is a
/// block of a weight `k` wide, and this call alone writes `w`'s columns of `out`.
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
pub(super) unsafe fn block(x: Rows<'_>, rows: usize, k: usize, w: &Block<'_>, scratch: &mut Scratch, out: Out) {
    let pairs = k.div_ceil(2);
    let Rows { x, stride } = x;
    assert!(stride >= k && x.len() >= (rows - 1) * stride + k, "block: rows shorter than their shapes");
    assert!(w.q.len() >= pairs * PAIR, "block: a block shorter than its shape");
    let x = x.as_ptr();
    if rows <= FUSED_ROWS {
        let fused = [fused::<1>, fused::<2>, fused::<3>, fused::<4>][rows - 1];
        // SAFETY: rows of `k` values `stride` apart and `pairs` pairs of `w` (asserted); the
        // features and the columns are the caller's.
        unsafe { fused(x, stride, k, w, out, 0) };
        return;
    }
    scratch.wide.resize(pairs * PAIR, bf16::ZERO);
    scratch.sums.resize(rows * COLS, 0.0);
    for (p, wide) in scratch.wide.chunks_exact_mut(PAIR).enumerate() {
        // SAFETY: pair `p` of the block (asserted) into its 32 values of the scratch.
        unsafe { _mm512_storeu_si512(wide.as_mut_ptr().cast(), bits(widen(w.q.as_ptr().add(p * PAIR)))) };
    }
    let tiles = [
        tile::<1>, tile::<2>, tile::<3>, tile::<4>, tile::<5>, tile::<6>, tile::<7>, tile::<8>, tile::<9>, tile::<10>,
        tile::<11>, tile::<12>,
    ];
    // Tiles of even sizes: 16 rows as 8 + 8 rather than 12 + 4, whose 4 chains of `vdpbf16ps`
    // would wait on their own latency.
    let tile_rows = rows.div_ceil(rows.div_ceil(TILE));
    // The pairs in chunks that stay in L1 while every tile of rows passes over them (a whole
    // widened block of a 2,048-wide input, 64 KiB, would be read from L2 by each tile).
    let mut p0 = 0;
    while p0 < pairs {
        let chunk = Chunk { p0, p1: (p0 + CHUNK).min(pairs), k, stride };
        let mut m = 0;
        while m < rows {
            let c = tile_rows.min(rows - m);
            let sums = scratch.sums[m * COLS..].as_mut_ptr();
            // SAFETY: rows `m .. m + c` (asserted), the widened pairs and `c * COLS` sums (sized
            // above); the features and the columns are the caller's.
            unsafe { tiles[c - 1](x.add(m * stride), chunk, scratch.wide.as_ptr(), sums, w, out, m) };
            m += c;
        }
        p0 = chunk.p1;
    }
}

/// Pairs `p0 .. p1` of a block whose input is `k` wide, for rows `stride` apart.
#[derive(Clone, Copy)]
struct Chunk {
    p0: usize,
    p1: usize,
    k: usize,
    stride: usize,
}

/// Rows `m0 .. m0 + M` against the block, widening each pair in registers.
///
/// # Safety
/// As `block`'s: `M` rows from `m0` of `x`, `stride` apart.
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
unsafe fn fused<const M: usize>(x: *const bf16, stride: usize, k: usize, w: &Block<'_>, out: Out, m0: usize) {
    let mut acc = [[_mm512_setzero_ps(); M]; SETS];
    let q = w.q.as_ptr();
    let full = k / 2;
    let row = |m: usize| x.wrapping_add((m0 + m) * stride);
    // SAFETY: pairs below `k.div_ceil(2)` of the block, values below `k` of the rows: the
    // caller's.
    unsafe {
        let mut p = 0;
        while p + SETS <= full {
            for (s, set) in acc.iter_mut().enumerate() {
                let wv = widen(q.add((p + s) * PAIR));
                for (m, a) in set.iter_mut().enumerate() {
                    *a = _mm512_dpbf16_ps(*a, wv, both(row(m).add(2 * (p + s))));
                }
            }
            p += SETS;
        }
        for p in p..full {
            let wv = widen(q.add(p * PAIR));
            for (m, a) in acc[0].iter_mut().enumerate() {
                *a = _mm512_dpbf16_ps(*a, wv, both(row(m).add(2 * p)));
            }
        }
        if k % 2 == 1 {
            let wv = widen(q.add(full * PAIR));
            for (m, a) in acc[0].iter_mut().enumerate() {
                *a = _mm512_dpbf16_ps(*a, wv, last(row(m).add(k - 1)));
            }
        }
        let [s0, s1, s2, s3] = acc;
        for (m, ((a, b), (c, d))) in s0.into_iter().zip(s1).zip(s2.into_iter().zip(s3)).enumerate() {
            store(out, m0 + m, w, _mm512_add_ps(_mm512_add_ps(a, b), _mm512_add_ps(c, d)));
        }
    }
}

/// Rows `x[0 .. M]` (output rows `m0 ..`) against `chunk` of the block widened into `wide`,
/// adding to the rows' partial `sums` (`[M][COLS]`; none before the first chunk) and, after the
/// last chunk, storing them.
///
/// # Safety
/// As `block`'s: `M` rows of `x`, `chunk.stride` apart; the widened pairs; `M * COLS` sums.
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
unsafe fn tile<const M: usize>(
    x: *const bf16,
    chunk: Chunk,
    wide: *const bf16,
    sums: *mut f32,
    w: &Block<'_>,
    out: Out,
    m0: usize,
) {
    let Chunk { p0, p1, k, stride } = chunk;
    let mut acc = [_mm512_setzero_ps(); M];
    let full = p1.min(k / 2);
    // SAFETY: the caller's rows, pairs and sums.
    unsafe {
        if p0 > 0 {
            for (m, a) in acc.iter_mut().enumerate() {
                *a = _mm512_loadu_ps(sums.add(m * COLS));
            }
        }
        for p in p0..full {
            let wv = bh(_mm512_loadu_si512(wide.add(p * PAIR).cast()));
            for (m, a) in acc.iter_mut().enumerate() {
                *a = _mm512_dpbf16_ps(*a, wv, both(x.add(m * stride + 2 * p)));
            }
        }
        if full < p1 {
            // An odd `k`'s last input, in the last chunk.
            let wv = bh(_mm512_loadu_si512(wide.add(full * PAIR).cast()));
            for (m, a) in acc.iter_mut().enumerate() {
                *a = _mm512_dpbf16_ps(*a, wv, last(x.add(m * stride + k - 1)));
            }
        }
        for (m, a) in acc.into_iter().enumerate() {
            if p1 == k.div_ceil(2) {
                store(out, m0 + m, w, a);
            } else {
                _mm512_storeu_ps(sums.add(m * COLS), a);
            }
        }
    }
}

/// 32 int8 as 32 bf16, in order (exact: an int8 needs 7 bits of significand).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
unsafe fn widen(q: *const i8) -> __m512bh {
    // SAFETY: the caller's 32 values.
    let (lo, hi) = unsafe { (_mm_loadu_si128(q.cast()), _mm_loadu_si128(q.add(16).cast())) };
    let (lo, hi) = (_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(lo)), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(hi)));
    // The second operand fills the low half.
    _mm512_cvtne2ps_pbh(hi, lo)
}

/// `x[0], x[1]` in every 32-bit lane.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
unsafe fn both(x: *const bf16) -> __m512bh {
    // SAFETY: the caller's two values.
    bh(_mm512_set1_epi32(unsafe { x.cast::<i32>().read_unaligned() }))
}

/// `x[0], 0` in every 32-bit lane: an odd `k`'s last input (the packing's pad weight is 0, but
/// the value past a row of `x` may be anything, an infinity included).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
unsafe fn last(x: *const bf16) -> __m512bh {
    // SAFETY: the caller's value.
    bh(_mm512_set1_epi32(i32::from(unsafe { x.read() }.to_bits())))
}

/// Row `m`'s block of columns from its sums: scaled, biased, rounded to bf16 (to nearest even,
/// as `bf16::from_f32`), and only the block's real columns stored.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
unsafe fn store(out: Out, m: usize, w: &Block<'_>, sums: __m512) {
    // SAFETY: `scales` and `bias` hold `COLS` values; the row and columns are the caller's.
    unsafe {
        let scaled = _mm512_mul_ps(sums, _mm512_loadu_ps(w.scales.as_ptr()));
        let value = _mm512_add_ps(scaled, _mm512_loadu_ps(w.bias.as_ptr()));
        let half = std::mem::transmute::<__m256bh, __m256i>(_mm512_cvtneps_pbh(value));
        let dst = (out.addr as *mut bf16).add(m * out.n + w.first);
        _mm512_mask_storeu_epi16(dst.cast(), (1u32 << w.cols) - 1, _mm512_castsi256_si512(half));
    }
}

/// The same 512 bits as integers.
#[inline(always)]
fn bits(x: __m512bh) -> __m512i {
    // SAFETY: both are plain 64-byte vectors; every bit pattern is valid for either.
    unsafe { std::mem::transmute::<__m512bh, __m512i>(x) }
}

/// The same 512 bits as 32 bf16 lanes.
#[inline(always)]
fn bh(x: __m512i) -> __m512bh {
    // SAFETY: both are plain 64-byte vectors; every bit pattern is valid for either.
    unsafe { std::mem::transmute::<__m512i, __m512bh>(x) }
}
