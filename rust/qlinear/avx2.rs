//! AVX2 with FMA (and F16C), for x86 CPUs without AVX512_BF16 and for models in f16 or f32 on
//! any x86 CPU. Each pair of a block is widened to f32 as four vectors of 8 lanes: the 16
//! columns' weights at the pair's even input (columns 0-7, then 8-15), then at its odd one. Rows of `x` are widened to f32 once a call (`prepare`) and each
//! value broadcast against them, so no lane ever needs a horizontal sum. Int4 multiplies its
//! values `q` (0..15) and offsets each group by `(zero - 8 · scale) · Σx`; grouped int8 by
//! `zero · Σx`; the rows' group sums are taken in f64 and rounded once.
//!
//! A few rows (`FUSED_ROWS`) widen each pair in registers and use it at once; more widen the block
//! once into the thread's scratch (128 bytes a pair), then pass over it 4 rows at a time
//! (`f32_passes!`): 8 accumulators, the pair's 4 vectors and a row's 2 broadcasts in the 16
//! vector registers.

use std::arch::x86_64::*;

use super::{Block, F32Tile, Format, Out, Rows, Scratch, Values, COLS, FUSED_ROWS};

/// f32 values of a widened pair: even inputs' columns 0-7 and 8-15, then odd inputs'.
const PAIR: usize = 4 * 8;

/// For the grouped formats each row's sum over each group of `group` inputs (`[rows][k / group]`),
/// and the rows of `x` in f32, `2 * k.div_ceil(2)` values each (an odd `k`'s pad weight meets a
/// zero, never what follows the row).
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn prepare(x: Values<'_>, rows: usize, k: usize, group: Option<usize>) -> (Vec<f32>, Vec<f32>) {
    assert!(x.len() >= rows * k, "prepare: rows shorter than their shapes");
    let width = 2 * k.div_ceil(2);
    let mut wide = vec![0.0f32; rows * width];
    for (m, to) in wide.chunks_exact_mut(width).enumerate() {
        let (tail, row) = (k - k % 8, m * k);
        for (j, t) in to[..tail].chunks_exact_mut(8).enumerate() {
            // SAFETY: 8 values of row `m` (`x` holds `rows` rows of `k`).
            unsafe { _mm256_storeu_ps(t.as_mut_ptr(), widen_values(x, row + 8 * j)) };
        }
        for (i, t) in to[tail..k].iter_mut().enumerate() {
            *t = x.get(row + tail + i);
        }
    }
    let sums = group.map_or_else(Vec::new, |group| {
        wide.chunks_exact(width).flat_map(|row| row[..k].chunks_exact(group)).map(|g| f64_sum(g) as f32).collect()
    });
    (sums, wide)
}

/// `Σ v` in f64, in which sums of bf16 or f16 values lose nothing at any realistic width or
/// range (and of f32 values next to nothing).
#[target_feature(enable = "avx2,fma,f16c")]
fn f64_sum(v: &[f32]) -> f64 {
    let (mut lo, mut hi) = (_mm256_setzero_pd(), _mm256_setzero_pd());
    let chunks = v.chunks_exact(8);
    let tail: f64 = chunks.remainder().iter().map(|&x| f64::from(x)).sum();
    for c in chunks {
        // SAFETY: 8 values.
        unsafe {
            lo = _mm256_add_pd(lo, _mm256_cvtps_pd(_mm_loadu_ps(c.as_ptr())));
            hi = _mm256_add_pd(hi, _mm256_cvtps_pd(_mm_loadu_ps(c.as_ptr().add(4))));
        }
    }
    let mut lanes = [0.0f64; 4];
    // SAFETY: 4 values.
    unsafe { _mm256_storeu_pd(lanes.as_mut_ptr(), _mm256_add_pd(lo, hi)) };
    lanes.iter().sum::<f64>() + tail
}

/// # Safety
/// The CPU must have AVX2, FMA and F16C; `x` is `prepare`'s for `rows` rows of `k`, `ws` are
/// blocks of one weight `k` wide, and this call alone writes their columns of `out`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn blocks(x: Rows<'_>, rows: usize, k: usize, ws: &[Block<'_>], scratch: &mut Scratch, out: Out) {
    f32_passes!(x, rows, k, ws, scratch, out, pair: PAIR, widen4: widen4, widen8: widen8, store: store, load: load, against: rows_against)
}

/// A widened pair into the scratch at `to`.
///
/// # Safety
/// `to` has room for `PAIR` values.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn store(pair: [__m256; 4], to: *mut f32) {
    for (i, v) in pair.into_iter().enumerate() {
        // SAFETY: the caller's.
        unsafe { _mm256_storeu_ps(to.add(8 * i), v) };
    }
}

/// A widened pair back from the scratch at `from`.
///
/// # Safety
/// `from` holds `PAIR` values.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn load(from: *const f32) -> [__m256; 4] {
    // SAFETY: the caller's.
    std::array::from_fn(|i| unsafe { _mm256_loadu_ps(from.add(8 * i)) })
}

/// `M` rows against block `w`, pair `p`'s widened weights from `pair(p)`: each group's products
/// summed, then scaled and offset by its rows' `Σx` into the rows' sums (int8: one group of every
/// pair, its scales applied by `Out::put`). Up to 2 rows, a row's even and odd inputs feed chains
/// of their own, else the `vfmadd` chains would wait on their own latency.
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C; `rows` holds `M` rows of `prepare`'s and their group sums;
/// `pair` may be called for each of the block's pairs; this call alone writes `w`'s columns.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn rows_against<const M: usize>(
    rows: &F32Tile,
    k: usize,
    w: &Block<'_>,
    out: Out,
    pair: &impl Fn(usize) -> [__m256; 4],
) {
    let odd = if M <= 2 { 2 } else { 0 };
    let (groups, group_pairs) = w.format.group().map_or((1, k.div_ceil(2)), |group| (k / group, group / 2));
    let int4 = matches!(w.format, Format::Int4 { .. });
    let mut acc = [[_mm256_setzero_ps(); 2]; M];
    // SAFETY: the caller's rows, group sums and pairs.
    unsafe {
        for g in 0..groups {
            let mut dots = [[_mm256_setzero_ps(); 4]; M];
            for p in g * group_pairs..(g + 1) * group_pairs {
                let [e0, e1, o0, o1] = pair(p);
                for (m, d) in dots.iter_mut().enumerate() {
                    let xe = _mm256_broadcast_ss(&*rows.x.add(m * rows.width + 2 * p));
                    let xo = _mm256_broadcast_ss(&*rows.x.add(m * rows.width + 2 * p + 1));
                    d[0] = _mm256_fmadd_ps(e0, xe, d[0]);
                    d[1] = _mm256_fmadd_ps(e1, xe, d[1]);
                    d[odd] = _mm256_fmadd_ps(o0, xo, d[odd]);
                    d[odd + 1] = _mm256_fmadd_ps(o1, xo, d[odd + 1]);
                }
            }
            let sums =
                dots.map(
                    |d| if M <= 2 { [_mm256_add_ps(d[0], d[2]), _mm256_add_ps(d[1], d[3])] } else { [d[0], d[1]] },
                );
            if w.format.group().is_none() {
                acc = sums;
                continue;
            }
            let params = |at: usize| [widen_values(w.groups, at), widen_values(w.groups, at + 8)];
            let (scale, zero) = (params(g * 2 * COLS), params(g * 2 * COLS + COLS));
            for (m, (a, s)) in acc.iter_mut().zip(sums).enumerate() {
                let sum_x = _mm256_broadcast_ss(&*rows.group_sums.add(m * groups + g));
                for h in 0..2 {
                    let zero = if int4 { _mm256_fnmadd_ps(_mm256_set1_ps(8.0), scale[h], zero[h]) } else { zero[h] };
                    a[h] = _mm256_fmadd_ps(zero, sum_x, _mm256_fmadd_ps(scale[h], s[h], a[h]));
                }
            }
        }
        for (m, a) in acc.into_iter().enumerate() {
            let mut sums = [0.0f32; COLS];
            _mm256_storeu_ps(sums.as_mut_ptr(), a[0]);
            _mm256_storeu_ps(sums.as_mut_ptr().add(8), a[1]);
            out.put(rows.m0 + m, w, &sums);
        }
    }
}

/// An int8 pair (32 bytes, lane `2c + i` column `c`'s input `2p + i`) as f32: `[even 0-7, even
/// 8-15, odd 0-7, odd 8-15]`. Sign-extended to 16 bits, each 32-bit lane holds a column's even
/// value in its low half and its odd one in its high half, split by arithmetic shifts.
///
/// # Safety
/// `q` points at the pair's 32 bytes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn widen8(q: *const u8) -> [__m256; 4] {
    // SAFETY: the caller's 32 bytes.
    let (lo, hi) = unsafe { (_mm_loadu_si128(q.cast()), _mm_loadu_si128(q.add(16).cast())) };
    let (lo, hi) = (_mm256_cvtepi8_epi16(lo), _mm256_cvtepi8_epi16(hi));
    let even = |v: __m256i| _mm256_cvtepi32_ps(_mm256_srai_epi32::<16>(_mm256_slli_epi32::<16>(v)));
    let odd = |v: __m256i| _mm256_cvtepi32_ps(_mm256_srai_epi32::<16>(v));
    [even(lo), even(hi), odd(lo), odd(hi)]
}

/// An int4 pair (16 bytes, byte `j` holding lane `j` in its low nibble and lane `16 + j` in its
/// high one) as f32 `q`, laid out as `widen8`'s. Zero-extended to 16 bits, each 32-bit lane holds
/// bytes `2c` and `2c + 1`: column `c`'s even and odd values in their low nibbles, column `8 +
/// c`'s in their high ones.
///
/// # Safety
/// `q` points at the pair's 16 bytes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn widen4(q: *const u8) -> [__m256; 4] {
    // SAFETY: the caller's 16 bytes.
    let v = _mm256_cvtepu8_epi16(unsafe { _mm_loadu_si128(q.cast()) });
    let nibble = |v: __m256i| _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(0xF)));
    let (e1, o0, o1) = (_mm256_srli_epi32::<4>(v), _mm256_srli_epi32::<16>(v), _mm256_srli_epi32::<20>(v));
    [nibble(v), nibble(e1), nibble(o0), nibble(o1)]
}

/// Values `at .. at + 8` as f32.
///
/// # Safety
/// `v` holds them; the CPU must have AVX2, FMA and F16C.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn widen_values(v: Values<'_>, at: usize) -> __m256 {
    debug_assert!(at + 8 <= v.len());
    // SAFETY: the caller's 8 values; a bf16 is the top half of its f32.
    unsafe {
        match v {
            Values::Bf16(v) => {
                let v = _mm256_cvtepu16_epi32(_mm_loadu_si128(v.as_ptr().add(at).cast()));
                _mm256_castsi256_ps(_mm256_slli_epi32::<16>(v))
            }
            Values::F16(v) => _mm256_cvtph_ps(_mm_loadu_si128(v.as_ptr().add(at).cast())),
            Values::F32(v) => _mm256_loadu_ps(v.as_ptr().add(at)),
        }
    }
}
