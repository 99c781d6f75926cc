//! AVX-512 (F, BW, VL) implementation of the kernel primitives (16 f32 lanes).

use std::arch::x86_64::*;

use crate::attn::kernel::{self, Item};
use crate::attn::simd::{exp_consts as ec, Simd};
use crate::attn::types::{dot_kind, Element, Geometry, KvElement, Scratch};

#[derive(Clone, Copy)]
pub(crate) struct Avx512;

impl Simd for Avx512 {
    const LANES: usize = 16;
    type V = __m512;
    const I8_K_OFFSET: f32 = 128.0;
    const PAIR_DOTS: bool = true;
    const I8_DOT_BY_HEADS: bool = true;

    #[inline(always)]
    unsafe fn zero() -> __m512 {
        // SAFETY: the tier is only dispatched on CPUs with AVX-512 F/BW/VL (+ AVX2, FMA, F16C).
        unsafe { _mm512_setzero_ps() }
    }
    #[inline(always)]
    unsafe fn splat(x: f32) -> __m512 {
        // SAFETY: as above.
        unsafe { _mm512_set1_ps(x) }
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> __m512 {
        // SAFETY: the caller guarantees 16 readable f32 at `p`; unaligned load.
        unsafe { _mm512_loadu_ps(p) }
    }
    #[inline(always)]
    unsafe fn store(p: *mut f32, v: __m512) {
        // SAFETY: the caller guarantees 16 writable f32 at `p`; unaligned store.
        unsafe { _mm512_storeu_ps(p, v) }
    }
    #[inline(always)]
    unsafe fn fma(a: __m512, b: __m512, c: __m512) -> __m512 {
        // SAFETY: AVX-512F.
        unsafe { _mm512_fmadd_ps(a, b, c) }
    }
    #[inline(always)]
    unsafe fn mul(a: __m512, b: __m512) -> __m512 {
        // SAFETY: AVX-512F.
        unsafe { _mm512_mul_ps(a, b) }
    }
    #[inline(always)]
    unsafe fn add(a: __m512, b: __m512) -> __m512 {
        // SAFETY: part of this tier's feature set.
        unsafe { _mm512_add_ps(a, b) }
    }
    #[inline(always)]
    unsafe fn max(a: __m512, b: __m512) -> __m512 {
        // SAFETY: part of this tier's feature set.
        unsafe { _mm512_max_ps(a, b) }
    }
    #[inline(always)]
    unsafe fn reduce_max(v: __m512) -> f32 {
        // SAFETY: part of this tier's feature set.
        unsafe { _mm512_reduce_max_ps(v) }
    }
    #[inline(always)]
    unsafe fn sub(a: __m512, b: __m512) -> __m512 {
        // SAFETY: AVX-512F.
        unsafe { _mm512_sub_ps(a, b) }
    }
    #[inline(always)]
    unsafe fn reduce_add(v: __m512) -> f32 {
        // SAFETY: AVX-512F.
        unsafe { _mm512_reduce_add_ps(v) }
    }
    #[inline(always)]
    unsafe fn transpose_sum(v: &[__m512]) -> __m512 {
        assert!(v.len() == 16);
        // SAFETY: register arithmetic of this tier.
        unsafe {
            // 16 -> 8: per 128-bit lane [a0+a2, b0+b2, a1+a3, b1+b3].
            let mut x = [_mm512_setzero_ps(); 8];
            for (i, x) in x.iter_mut().enumerate() {
                let (a, b) = (v[2 * i], v[2 * i + 1]);
                *x = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
            }
            // 8 -> 4: per 128-bit lane the four vectors' lane sums [a, b, c, d].
            let mut y = [_mm512_setzero_ps(); 4];
            for (i, y) in y.iter_mut().enumerate() {
                let (a, b) = (_mm512_castps_pd(x[2 * i]), _mm512_castps_pd(x[2 * i + 1]));
                let (lo, hi) = (_mm512_unpacklo_pd(a, b), _mm512_unpackhi_pd(a, b));
                *y = _mm512_add_ps(_mm512_castpd_ps(lo), _mm512_castpd_ps(hi));
            }
            // 4 -> 2 -> 1: add the four 128-bit lanes together, keeping vectors in order.
            let z0 = fold_lanes(y[0], y[1]);
            let z1 = fold_lanes(y[2], y[3]);
            fold_lanes(z0, z1)
        }
    }
    #[inline(always)]
    unsafe fn exp(x: __m512) -> __m512 {
        // SAFETY: AVX-512F.
        unsafe {
            let x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(ec::LO)), _mm512_set1_ps(ec::HI));
            let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm512_mul_ps(
                x,
                _mm512_set1_ps(ec::LOG2E),
            ));
            let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(ec::LN2_HI), x);
            let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(ec::LN2_LO), r);
            let mut y = _mm512_set1_ps(ec::POLY[0]);
            for c in &ec::POLY[1..] {
                y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(*c));
            }
            let y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0)));
            _mm512_scalef_ps(y, n)
        }
    }
    #[inline(always)]
    unsafe fn widen_bf16(p: *const u16) -> __m512 {
        // SAFETY: the caller guarantees 16 readable u16 at `p`; bf16 is the top half of an f32.
        unsafe {
            let raw = _mm256_loadu_si256(p.cast());
            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(raw)))
        }
    }
    #[inline(always)]
    unsafe fn widen_f16(p: *const u16) -> __m512 {
        // SAFETY: the caller guarantees 16 readable u16 at `p`; AVX-512F converts f16 to f32.
        unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(p.cast())) }
    }
    #[inline(always)]
    unsafe fn widen_i8(p: *const i8) -> __m512 {
        // SAFETY: the caller guarantees 16 readable i8 at `p`; sign-extend, then convert.
        unsafe { _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p.cast()))) }
    }
    #[inline(always)]
    unsafe fn prefetch_l2(p: *const u8) {
        // SAFETY: prefetch never faults, whatever the address.
        unsafe { _mm_prefetch::<_MM_HINT_T1>(p.cast()) }
    }
    /// VNNI: `vpdpbusd` takes unsigned bytes times signed bytes, so K rows are offset by 128
    /// (an XOR of the sign bit) and the caller subtracts `128 * Σ q8`. 64 dims per instruction;
    /// the last chunk of a row is a masked load (masked-off bytes never fault).
    #[inline(always)]
    unsafe fn dot_i8<const GT: usize, const TT: usize>(
        q8: *const i8,
        dq: usize,
        rows: &[*const i8; TT],
        ahead: &[*const i8; TT],
        d: usize,
    ) -> __m512 {
        assert!(GT * TT == 16 && dq >= d && dq.is_multiple_of(64));
        // SAFETY: the caller guarantees the row and q8 extents above and dispatches this only
        // on CPUs with AVX-512 VNNI; loads past `d` are masked off.
        unsafe {
            let bias = _mm512_set1_epi8(-128);
            let mut acc = [[_mm512_setzero_si512(); TT]; GT];
            let mut c = 0;
            while c < d {
                let mask: __mmask64 = if d - c >= 64 { !0 } else { (1u64 << (d - c)) - 1 };
                let mut qv = [_mm512_setzero_si512(); GT];
                for (g, x) in qv.iter_mut().enumerate() {
                    *x = _mm512_loadu_si512(q8.add(g * dq + c).cast());
                }
                for i in 0..TT {
                    _mm_prefetch::<_MM_HINT_T1>(ahead[i].add(c).cast());
                    let k = _mm512_xor_si512(_mm512_maskz_loadu_epi8(mask, rows[i].add(c)), bias);
                    for g in 0..GT {
                        acc[g][i] = _mm512_dpbusd_epi32(acc[g][i], k, qv[g]);
                    }
                }
                c += 64;
            }
            let mut sums = [_mm512_setzero_ps(); 16];
            for (s, a) in sums.iter_mut().zip(acc.as_flattened()) {
                *s = _mm512_cvtepi32_ps(*a);
            }
            Self::transpose_sum(&sums)
        }
    }
    /// VNNI: 16 dims of a row (offset by 128, as in `dot_i8`) broadcast to the four 128-bit
    /// lanes against 16 dims of each head; dword s of lane g sums dims 4s..4s+3 of every chunk,
    /// and a 4 x 4 transpose within the lanes adds them up. A row's last partial chunk is a
    /// masked load (masked-off bytes never fault).
    #[inline(always)]
    unsafe fn dot_i8_heads(qx: *const i8, rows: &[*const i8], ahead: &[*const i8], d: usize) -> __m512 {
        assert!(rows.len() == 4 && ahead.len() == 4 && d.is_multiple_of(8));
        // SAFETY: the caller guarantees d readable bytes at each row, 4 * d.next_multiple_of(16)
        // at qx, and dispatches this only on CPUs with AVX-512 VNNI; the partial chunk's load is
        // masked to the row.
        unsafe {
            let bias = _mm512_set1_epi8(-128);
            let mut acc = [_mm512_setzero_si512(); 4];
            let mut c = 0;
            while c < d {
                let q = _mm512_loadu_si512(qx.add(4 * c).cast());
                for i in 0..4 {
                    if c.is_multiple_of(64) {
                        _mm_prefetch::<_MM_HINT_T1>(ahead[i].add(c).cast());
                    }
                    let chunk = if d - c >= 16 {
                        _mm_loadu_si128(rows[i].add(c).cast())
                    } else {
                        _mm_maskz_loadu_epi8((1 << (d - c)) - 1, rows[i].add(c))
                    };
                    let k = _mm512_xor_si512(_mm512_broadcast_i32x4(chunk), bias);
                    acc[i] = _mm512_dpbusd_epi32(acc[i], k, q);
                }
                c += 16;
            }
            // Per lane g: [row 0 .. row 3] of [s0 .. s3] -> the four rows' totals.
            let pair =
                |a: __m512i, b: __m512i| _mm512_add_epi32(_mm512_unpacklo_epi32(a, b), _mm512_unpackhi_epi32(a, b));
            let (r01, r23) = (pair(acc[0], acc[1]), pair(acc[2], acc[3]));
            _mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_unpacklo_epi64(r01, r23), _mm512_unpackhi_epi64(r01, r23)))
        }
    }
    /// AVX512_BF16: `vdpbf16ps` sums pairs of adjacent dims, 32 dims per instruction; the last
    /// chunk of a row is a masked load.
    #[inline(always)]
    unsafe fn dot_bf16<const GT: usize, const TT: usize>(
        q: *const u16,
        dq: usize,
        rows: &[*const u16; TT],
        ahead: &[*const u16; TT],
        d: usize,
    ) -> __m512 {
        assert!(GT * TT == 16 && dq >= d && dq.is_multiple_of(32));
        // SAFETY: the caller guarantees the row and q extents above and dispatches this only on
        // CPUs with AVX512_BF16; loads past `d` are masked off.
        unsafe {
            let mut acc = [[_mm512_setzero_ps(); TT]; GT];
            let mut c = 0;
            while c < d {
                let mask = mask32(d - c);
                let mut qv = [_mm512_setzero_si512(); GT];
                for (g, x) in qv.iter_mut().enumerate() {
                    *x = _mm512_loadu_si512(q.add(g * dq + c).cast());
                }
                for i in 0..TT {
                    _mm_prefetch::<_MM_HINT_T1>(ahead[i].add(c).cast());
                    let k = _mm512_maskz_loadu_epi16(mask, rows[i].add(c).cast());
                    for g in 0..GT {
                        acc[g][i] = _mm512_dpbf16_ps(acc[g][i], bh(k), bh(qv[g]));
                    }
                }
                c += 32;
            }
            Self::transpose_sum(acc.as_flattened())
        }
    }
    #[inline(always)]
    unsafe fn narrow_bf16(v: __m512, p: *mut u16) {
        // SAFETY: the caller guarantees 16 writable u16 at `p` and AVX512_BF16.
        unsafe { _mm256_storeu_si256(p.cast(), std::mem::transmute::<__m256bh, __m256i>(_mm512_cvtneps_pbh(v))) }
    }
    #[inline(always)]
    unsafe fn narrow_i16(v: __m512, p: *mut i16) {
        // SAFETY: the caller guarantees 16 writable i16 at `p`; values fit int16 (caller), so
        // the truncating narrow is exact.
        unsafe { _mm256_storeu_si256(p.cast(), _mm512_cvtepi32_epi16(_mm512_cvtps_epi32(v))) }
    }
    /// VNNI: each pair of rows is widened to int16 and interleaved (`vpunpck[lh]wd`), so that
    /// `vpdpwssd` adds both tokens' products per dim; 32 dims per pass, int32 sums per step.
    #[inline(always)]
    unsafe fn pv_i8<const GT: usize>(
        pairs: *const u32,
        ps: usize,
        scale: &[f32],
        v: *const i8,
        rows: &[usize],
        ahead: &[usize],
        d: usize,
        acc: *mut f32,
        dp: usize,
    ) {
        let n = rows.len();
        assert!(scale.len() >= GT && n >= 1 && ahead.len() == n && dp >= d && dp.is_multiple_of(16));
        let xs = pair_pass::<GT>();
        // SAFETY: the caller guarantees d bytes at `v` + each of `rows` (and `ahead`, only prefetched),
        // ceil(n / 2) pair words per head at stride ps, GT acc rows of dp f32, and VNNI; loads
        // past `d` are masked off and acc is written below dp only.
        unsafe {
            let mut c = 0;
            while c < d {
                let mask: [__mmask32; 4] = std::array::from_fn(|x| mask32(d.saturating_sub(c + 32 * x)));
                let mut lo = [[_mm512_setzero_si512(); 4]; GT];
                let mut hi = [[_mm512_setzero_si512(); 4]; GT];
                for j in 0..n.div_ceil(2) {
                    let (u0, u1) = (2 * j, (2 * j + 1).min(n - 1));
                    let (r0, r1, a0, a1) = (rows[u0] + c, rows[u1] + c, ahead[u0] + c, ahead[u1] + c);
                    let mut l = [_mm512_setzero_si512(); 4];
                    let mut h = [_mm512_setzero_si512(); 4];
                    for x in 0..xs {
                        // Every line of the pass (two 32-byte chunks per line; c is line-aligned).
                        if x % 2 == 0 {
                            _mm_prefetch::<_MM_HINT_T1>(v.add(a0 + 32 * x).cast());
                            _mm_prefetch::<_MM_HINT_T1>(v.add(a1 + 32 * x).cast());
                        }
                        let a = _mm512_cvtepi8_epi16(_mm256_maskz_loadu_epi8(mask[x], v.add(r0 + 32 * x)));
                        let b = _mm512_cvtepi8_epi16(_mm256_maskz_loadu_epi8(mask[x], v.add(r1 + 32 * x)));
                        (l[x], h[x]) = (_mm512_unpacklo_epi16(a, b), _mm512_unpackhi_epi16(a, b));
                    }
                    for g in 0..GT {
                        let p = _mm512_set1_epi32(*pairs.add(g * ps + j) as i32);
                        for x in 0..xs {
                            lo[g][x] = _mm512_dpwssd_epi32(lo[g][x], l[x], p);
                            hi[g][x] = _mm512_dpwssd_epi32(hi[g][x], h[x], p);
                        }
                    }
                }
                for g in 0..GT {
                    for x in 0..xs {
                        let (l, h) = (_mm512_cvtepi32_ps(lo[g][x]), _mm512_cvtepi32_ps(hi[g][x]));
                        add_pair_sums(acc.add(g * dp + c + 32 * x), l, h, scale[g], c + 32 * x, dp);
                    }
                }
                c += 32 * xs;
            }
        }
    }
    /// AVX512_BF16: as `pv_i8`, the pairs of bf16 rows interleaved for `vdpbf16ps`.
    #[inline(always)]
    unsafe fn pv_bf16<const GT: usize>(
        pairs: *const u32,
        ps: usize,
        v: *const u16,
        rows: &[usize],
        ahead: &[usize],
        d: usize,
        acc: *mut f32,
        dp: usize,
    ) {
        let n = rows.len();
        assert!(n >= 1 && ahead.len() == n && dp >= d && dp.is_multiple_of(16));
        let xs = pair_pass::<GT>();
        // SAFETY: as for `pv_i8`, with bf16 rows and AVX512_BF16.
        unsafe {
            let mut c = 0;
            while c < d {
                let mask: [__mmask32; 4] = std::array::from_fn(|x| mask32(d.saturating_sub(c + 32 * x)));
                let mut lo = [[_mm512_setzero_ps(); 4]; GT];
                let mut hi = [[_mm512_setzero_ps(); 4]; GT];
                for j in 0..n.div_ceil(2) {
                    let (u0, u1) = (2 * j, (2 * j + 1).min(n - 1));
                    let (r0, r1, a0, a1) = (rows[u0] + c, rows[u1] + c, ahead[u0] + c, ahead[u1] + c);
                    let mut l = [bh(_mm512_setzero_si512()); 4];
                    let mut h = [bh(_mm512_setzero_si512()); 4];
                    for x in 0..xs {
                        _mm_prefetch::<_MM_HINT_T1>(v.add(a0 + 32 * x).cast());
                        _mm_prefetch::<_MM_HINT_T1>(v.add(a1 + 32 * x).cast());
                        let a = _mm512_maskz_loadu_epi16(mask[x], v.add(r0 + 32 * x).cast());
                        let b = _mm512_maskz_loadu_epi16(mask[x], v.add(r1 + 32 * x).cast());
                        (l[x], h[x]) = (bh(_mm512_unpacklo_epi16(a, b)), bh(_mm512_unpackhi_epi16(a, b)));
                    }
                    for g in 0..GT {
                        let p = bh(_mm512_set1_epi32(*pairs.add(g * ps + j) as i32));
                        for x in 0..xs {
                            lo[g][x] = _mm512_dpbf16_ps(lo[g][x], l[x], p);
                            hi[g][x] = _mm512_dpbf16_ps(hi[g][x], h[x], p);
                        }
                    }
                }
                for g in 0..GT {
                    for x in 0..xs {
                        add_pair_sums(acc.add(g * dp + c + 32 * x), lo[g][x], hi[g][x], 1.0, c + 32 * x, dp);
                    }
                }
                c += 32 * xs;
            }
        }
    }
}

/// `[a.L0+a.L1, a.L2+a.L3, b.L0+b.L1, b.L2+b.L3]` over 128-bit lanes.
#[inline(always)]
unsafe fn fold_lanes(a: __m512, b: __m512) -> __m512 {
    // SAFETY: register arithmetic of this tier; the CPU supports it (caller).
    unsafe { _mm512_add_ps(_mm512_shuffle_f32x4::<0b10_00_10_00>(a, b), _mm512_shuffle_f32x4::<0b11_01_11_01>(a, b)) }
}

/// Chunks of 32 dims per pass of the pair dot products over a V tile: as many as 2 x GT x 2
/// accumulators per chunk leave registers for (a pass reads whole rows up to 128 dims when it
/// can: longer runs of each row stream better).
#[inline(always)]
fn pair_pass<const GT: usize>() -> usize {
    if GT <= 2 {
        4
    } else {
        2
    }
}

/// Mask of the first `min(left, 32)` lanes of a 32-lane load.
#[inline(always)]
fn mask32(left: usize) -> __mmask32 {
    if left >= 32 {
        !0
    } else {
        (1u32 << left) - 1
    }
}

/// The same 512 bits as 32 bf16 lanes.
#[inline(always)]
fn bh(x: __m512i) -> __m512bh {
    // SAFETY: both are plain 64-byte vectors; every bit pattern is valid for either.
    unsafe { std::mem::transmute::<__m512i, __m512bh>(x) }
}

/// Dims `c .. c + 32` of pair-product sums back in order, scaled by `s` and added to `acc`
/// (the row's dims `c ..`; each half only below `dp`): after `vpunpck[lh]wd`, 128-bit lane L of
/// `lo` holds dims 8L..8L+3 and of `hi` dims 8L+4..8L+7.
#[inline(always)]
unsafe fn add_pair_sums(acc: *mut f32, lo: __m512, hi: __m512, s: f32, c: usize, dp: usize) {
    const FIRST: [i32; 16] = [0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23];
    const SECOND: [i32; 16] = [8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31];
    // SAFETY: the caller guarantees writable f32 at `acc` up to the row's dp (dims c .. dp) and
    // the tier's features.
    unsafe {
        let s = _mm512_set1_ps(s);
        for (half, idx) in [FIRST, SECOND].iter().enumerate() {
            if c + 16 * half < dp {
                let x = _mm512_permutex2var_ps(lo, _mm512_loadu_si512(idx.as_ptr().cast()), hi);
                let p = acc.add(16 * half);
                _mm512_storeu_ps(p, _mm512_fmadd_ps(x, s, _mm512_loadu_ps(p)));
            }
        }
    }
}

/// The kernel item compiled for AVX-512 F/BW/VL.
///
/// # Safety
/// The CPU must support AVX-512 F/BW/VL, AVX2, FMA and F16C; `scratch` must be made for 16 lanes.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
pub(crate) unsafe fn attend_item<Q: Element, K: KvElement>(
    it: &Item<'_, Q, K>,
    geo: &Geometry,
    scratch: &mut Scratch,
    partial: &mut [f32],
) {
    // SAFETY: forwarded caller contract.
    unsafe { kernel::attend_item::<Avx512, Q, K, { dot_kind::NONE }>(it, geo, scratch, partial) }
}

/// The kernel item for AVX-512 with VNNI: int8 pools take q·k and p·v as integer dot products.
///
/// # Safety
/// As for `attend_item`, and the CPU must support AVX-512 VNNI.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(crate) unsafe fn attend_item_vnni<Q: Element, K: KvElement>(
    it: &Item<'_, Q, K>,
    geo: &Geometry,
    scratch: &mut Scratch,
    partial: &mut [f32],
) {
    // SAFETY: forwarded caller contract.
    unsafe { kernel::attend_item::<Avx512, Q, K, { dot_kind::INT8 }>(it, geo, scratch, partial) }
}

/// The kernel item for AVX-512 with AVX512_BF16: bf16 pools take q·k and p·v as bf16 dot
/// products.
///
/// # Safety
/// As for `attend_item`, and the CPU must support AVX512_BF16.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma,f16c")]
pub(crate) unsafe fn attend_item_bf16<Q: Element, K: KvElement>(
    it: &Item<'_, Q, K>,
    geo: &Geometry,
    scratch: &mut Scratch,
    partial: &mut [f32],
) {
    // SAFETY: forwarded caller contract.
    unsafe { kernel::attend_item::<Avx512, Q, K, { dot_kind::BF16 }>(it, geo, scratch, partial) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transpose_sum_adds_each_vector_in_order() {
        if !std::arch::is_x86_feature_detected!("avx512f") {
            return;
        }
        let rows: Vec<[f32; 16]> = (0..16).map(|i| std::array::from_fn(|j| (i * 100 + j) as f32)).collect();
        #[target_feature(enable = "avx512f")]
        fn run(rows: &[[f32; 16]]) -> [f32; 16] {
            let mut v = [_mm512_setzero_ps(); 16];
            let mut out = [0f32; 16];
            // SAFETY: each row holds 16 f32; the feature is enabled on this function.
            unsafe {
                for (v, r) in v.iter_mut().zip(rows) {
                    *v = _mm512_loadu_ps(r.as_ptr());
                }
                _mm512_storeu_ps(out.as_mut_ptr(), Avx512::transpose_sum(&v));
            }
            out
        }
        // SAFETY: AVX-512F checked above.
        let got = unsafe { run(&rows) };
        for (i, r) in rows.iter().enumerate() {
            assert_eq!(got[i], r.iter().sum::<f32>(), "lane {i}");
        }
    }
}
