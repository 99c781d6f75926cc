//! AVX-512 for models in f16 or f32 on CPUs with the AVX512_BF16 path (whose `vdpbf16ps` would
//! round their `x` to bf16): `avx2.rs`'s kernels in 16 lanes. A block's pair widens to two
//! vectors, its 16 columns' weights at the pair's even input and at its odd one (the scratch holds
//! them in the AVX2 path's order, 128 bytes a pair), each multiplied-added with a row's value of
//! `x` broadcast; rows of `x` are widened once a call by the AVX2 path's `prepare`. A row's even
//! and odd inputs feed chains of their own, so a tile of 4 rows keeps 8 `vfmadd` chains going.

use std::arch::x86_64::*;

use super::{Block, F32Tile, Format, Out, Rows, Scratch, Values, COLS, FUSED_ROWS};

/// f32 values of a widened pair: the even input's 16 columns, then the odd one's.
const PAIR: usize = 2 * COLS;

/// # Safety
/// The CPU must have AVX512F and AVX512BW; `x` is `avx2::prepare`'s for `rows` rows of `k`, `ws`
/// are blocks of one weight `k` wide, and this call alone writes their columns of `out`.
#[target_feature(enable = "avx512f,avx512bw")]
pub(super) unsafe fn blocks(x: Rows<'_>, rows: usize, k: usize, ws: &[Block<'_>], scratch: &mut Scratch, out: Out) {
    f32_passes!(x, rows, k, ws, scratch, out, pair: PAIR, widen4: widen4, widen8: widen8, store: store, load: load, against: rows_against)
}

/// A widened pair into the scratch at `to`.
///
/// # Safety
/// `to` has room for `PAIR` values.
#[inline]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn store(pair: [__m512; 2], to: *mut f32) {
    // SAFETY: the caller's.
    unsafe {
        _mm512_storeu_ps(to, pair[0]);
        _mm512_storeu_ps(to.add(COLS), pair[1]);
    }
}

/// A widened pair back from the scratch at `from`.
///
/// # Safety
/// `from` holds `PAIR` values.
#[inline]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn load(from: *const f32) -> [__m512; 2] {
    // SAFETY: the caller's.
    unsafe { [_mm512_loadu_ps(from), _mm512_loadu_ps(from.add(COLS))] }
}

/// `M` rows against block `w`, pair `p`'s widened weights from `pair(p)`: each group's products
/// summed, then scaled and offset by its rows' `Σx` into the rows' sums (int8: one group of every
/// pair, its scales applied by `Out::put`), as `avx2::rows_against` does.
///
/// # Safety
/// The CPU must have AVX512F and AVX512BW; `rows` holds `M` rows of `prepare`'s and their group
/// sums; `pair` may be called for each of the block's pairs; this call alone writes `w`'s columns.
#[inline]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn rows_against<const M: usize>(
    rows: &F32Tile,
    k: usize,
    w: &Block<'_>,
    out: Out,
    pair: &impl Fn(usize) -> [__m512; 2],
) {
    let (groups, group_pairs) = w.format.group().map_or((1, k.div_ceil(2)), |group| (k / group, group / 2));
    let int4 = matches!(w.format, Format::Int4 { .. });
    let mut acc = [_mm512_setzero_ps(); M];
    // SAFETY: the caller's rows, group sums and pairs.
    unsafe {
        for g in 0..groups {
            let mut dots = [[_mm512_setzero_ps(); 2]; M];
            for p in g * group_pairs..(g + 1) * group_pairs {
                let [even, odd] = pair(p);
                for (m, d) in dots.iter_mut().enumerate() {
                    let x = rows.x.add(m * rows.width + 2 * p);
                    d[0] = _mm512_fmadd_ps(even, _mm512_set1_ps(*x), d[0]);
                    d[1] = _mm512_fmadd_ps(odd, _mm512_set1_ps(*x.add(1)), d[1]);
                }
            }
            let sums = dots.map(|d| _mm512_add_ps(d[0], d[1]));
            if w.format.group().is_none() {
                acc = sums;
                continue;
            }
            let (scale, zero) = (widen_values(w.groups, g * 2 * COLS), widen_values(w.groups, g * 2 * COLS + COLS));
            let zero = if int4 { _mm512_fnmadd_ps(_mm512_set1_ps(8.0), scale, zero) } else { zero };
            for (m, (a, s)) in acc.iter_mut().zip(sums).enumerate() {
                let sum_x = _mm512_set1_ps(*rows.group_sums.add(m * groups + g));
                *a = _mm512_fmadd_ps(zero, sum_x, _mm512_fmadd_ps(scale, s, *a));
            }
        }
        for (m, a) in acc.into_iter().enumerate() {
            let mut sums = [0.0f32; COLS];
            _mm512_storeu_ps(sums.as_mut_ptr(), a);
            out.put(rows.m0 + m, w, &sums);
        }
    }
}

/// An int8 pair (32 bytes, lane `2c + i` column `c`'s input `2p + i`) as f32. Sign-extended to
/// 16 bits, each 32-bit lane holds a column's even value in its low half and its odd one in its
/// high half, split by arithmetic shifts.
///
/// # Safety
/// `q` points at the pair's 32 bytes.
#[inline]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn widen8(q: *const u8) -> [__m512; 2] {
    // SAFETY: the caller's 32 bytes.
    let v = _mm512_cvtepi8_epi16(unsafe { _mm256_loadu_si256(q.cast()) });
    let even = _mm512_srai_epi32::<16>(_mm512_slli_epi32::<16>(v));
    [_mm512_cvtepi32_ps(even), _mm512_cvtepi32_ps(_mm512_srai_epi32::<16>(v))]
}

/// An int4 pair (16 bytes, byte `j` holding lane `j` in its low nibble and lane `16 + j` in its
/// high one) as f32 `q`, laid out as `widen8`'s. Zero-extended to 16 bits, 32-bit lane `c` holds
/// bytes `2c` and `2c + 1`: column `c`'s even and odd values in their low nibbles, column `8 +
/// c`'s in their high ones, which the upper half takes shifted down by a nibble.
///
/// # Safety
/// `q` points at the pair's 16 bytes.
#[inline]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn widen4(q: *const u8) -> [__m512; 2] {
    // SAFETY: the caller's 16 bytes.
    let v = _mm256_cvtepu8_epi16(unsafe { _mm_loadu_si128(q.cast()) });
    let v = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(v), _mm256_srli_epi32::<4>(v));
    let nibble = |v: __m512i| _mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(0xF)));
    [nibble(v), nibble(_mm512_srli_epi32::<16>(v))]
}

/// Values `at .. at + 16` of an f16 or f32 model as f32 (a bf16 model's go to the `vdpbf16ps`
/// kernels, `Path::blocks`).
///
/// # Safety
/// `v` holds them; the CPU must have AVX512F.
#[inline]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn widen_values(v: Values<'_>, at: usize) -> __m512 {
    debug_assert!(at + COLS <= v.len());
    // SAFETY: the caller's 16 values.
    unsafe {
        match v {
            Values::F16(v) => _mm512_cvtph_ps(_mm256_loadu_si256(v.as_ptr().add(at).cast())),
            Values::F32(v) => _mm512_loadu_ps(v.as_ptr().add(at)),
            Values::Bf16(_) => unreachable!("a bf16 model takes AVX-512's bf16 kernels (`Path::blocks`)"),
        }
    }
}
