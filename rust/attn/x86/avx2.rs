//! AVX2 + FMA + F16C implementation of the kernel primitives (8 f32 lanes), with AVX-VNNI's
//! int8 dot products where the CPU has them (Alder Lake and later cores without AVX-512).

use std::arch::x86_64::*;

use crate::attn::kernel::{self, Item};
use crate::attn::simd::{exp_consts as ec, Simd};
use crate::attn::types::{dot_kind, Element, Geometry, KvElement, Scratch};

#[derive(Clone, Copy)]
pub(crate) struct Avx2;

impl Simd for Avx2 {
    const LANES: usize = 8;
    type V = __m256;
    const I8_K_OFFSET: f32 = 128.0;
    const PAIR_DOTS: bool = true;

    #[inline(always)]
    unsafe fn zero() -> __m256 {
        // SAFETY: the tier is only dispatched on CPUs with AVX2 + FMA + F16C.
        unsafe { _mm256_setzero_ps() }
    }
    #[inline(always)]
    unsafe fn splat(x: f32) -> __m256 {
        // SAFETY: as above.
        unsafe { _mm256_set1_ps(x) }
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> __m256 {
        // SAFETY: the caller guarantees 8 readable f32 at `p`; unaligned load.
        unsafe { _mm256_loadu_ps(p) }
    }
    #[inline(always)]
    unsafe fn store(p: *mut f32, v: __m256) {
        // SAFETY: the caller guarantees 8 writable f32 at `p`; unaligned store.
        unsafe { _mm256_storeu_ps(p, v) }
    }
    #[inline(always)]
    unsafe fn fma(a: __m256, b: __m256, c: __m256) -> __m256 {
        // SAFETY: FMA is part of this tier's feature set.
        unsafe { _mm256_fmadd_ps(a, b, c) }
    }
    #[inline(always)]
    unsafe fn mul(a: __m256, b: __m256) -> __m256 {
        // SAFETY: AVX is part of this tier's feature set.
        unsafe { _mm256_mul_ps(a, b) }
    }
    #[inline(always)]
    unsafe fn add(a: __m256, b: __m256) -> __m256 {
        // SAFETY: part of this tier's feature set.
        unsafe { _mm256_add_ps(a, b) }
    }
    #[inline(always)]
    unsafe fn max(a: __m256, b: __m256) -> __m256 {
        // SAFETY: part of this tier's feature set.
        unsafe { _mm256_max_ps(a, b) }
    }
    #[inline(always)]
    unsafe fn reduce_max(v: __m256) -> f32 {
        // SAFETY: part of this tier's feature set.
        unsafe {
            let s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
            let s = _mm_max_ps(s, _mm_movehl_ps(s, s));
            _mm_cvtss_f32(_mm_max_ss(s, _mm_shuffle_ps(s, s, 1)))
        }
    }
    #[inline(always)]
    unsafe fn sub(a: __m256, b: __m256) -> __m256 {
        // SAFETY: as above.
        unsafe { _mm256_sub_ps(a, b) }
    }
    #[inline(always)]
    unsafe fn reduce_add(v: __m256) -> f32 {
        // SAFETY: as above.
        unsafe {
            let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
            let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
            let s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
            _mm_cvtss_f32(s)
        }
    }
    #[inline(always)]
    unsafe fn transpose_sum(v: &[__m256]) -> __m256 {
        assert!(v.len() == 8);
        // SAFETY: register arithmetic of this tier.
        unsafe {
            // hadd(hadd(a,b), hadd(c,d)): per 128-bit half the four vectors' half sums.
            let q0 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
            let q1 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
            _mm256_add_ps(_mm256_permute2f128_ps::<0x20>(q0, q1), _mm256_permute2f128_ps::<0x31>(q0, q1))
        }
    }
    #[inline(always)]
    unsafe fn exp(x: __m256) -> __m256 {
        // SAFETY: AVX2 + FMA are part of this tier's feature set.
        unsafe {
            let x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(ec::LO)), _mm256_set1_ps(ec::HI));
            let n = _mm256_round_ps(
                _mm256_mul_ps(x, _mm256_set1_ps(ec::LOG2E)),
                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC,
            );
            let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(ec::LN2_HI), x);
            let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(ec::LN2_LO), r);
            let mut y = _mm256_set1_ps(ec::POLY[0]);
            for c in &ec::POLY[1..] {
                y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(*c));
            }
            let y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0)));
            let pow2 = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
            _mm256_mul_ps(y, _mm256_castsi256_ps(pow2))
        }
    }
    #[inline(always)]
    unsafe fn widen_bf16(p: *const u16) -> __m256 {
        // SAFETY: the caller guarantees 8 readable u16 at `p`; bf16 is the top half of an f32.
        unsafe {
            let raw = _mm_loadu_si128(p.cast());
            _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16))
        }
    }
    #[inline(always)]
    unsafe fn widen_f16(p: *const u16) -> __m256 {
        // SAFETY: the caller guarantees 8 readable u16 at `p`; F16C is part of this tier.
        unsafe { _mm256_cvtph_ps(_mm_loadu_si128(p.cast())) }
    }
    #[inline(always)]
    unsafe fn widen_i8(p: *const i8) -> __m256 {
        // SAFETY: the caller guarantees 8 readable i8 at `p` (one 64-bit load); sign-extend,
        // then convert.
        unsafe { _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(p.cast()))) }
    }
    #[inline(always)]
    unsafe fn prefetch_l2(p: *const u8) {
        // SAFETY: prefetch never faults, whatever the address.
        unsafe { _mm_prefetch::<_MM_HINT_T1>(p.cast()) }
    }
    /// AVX-VNNI: `vpdpbusd` takes unsigned bytes times signed bytes, as on AVX-512 VNNI: K rows
    /// are offset by 128 (an XOR of the sign bit) and the caller subtracts `128 * Σ q8`. 32 dims
    /// per instruction.
    #[inline(always)]
    unsafe fn dot_i8<const GT: usize, const TT: usize>(
        q8: *const i8,
        dq: usize,
        rows: &[*const i8; TT],
        ahead: &[*const i8; TT],
        d: usize,
    ) -> __m256 {
        assert!(GT * TT == 8 && dq >= d && dq.is_multiple_of(64));
        // SAFETY: the caller guarantees the row and q8 extents above and dispatches this only
        // on CPUs with AVX-VNNI; a row's last partial chunk reads only its own bytes.
        unsafe {
            let bias = _mm256_set1_epi8(-128);
            let mut acc = [[_mm256_setzero_si256(); TT]; GT];
            let mut c = 0;
            while c < d {
                let mut qv = [_mm256_setzero_si256(); GT];
                for (g, x) in qv.iter_mut().enumerate() {
                    *x = _mm256_loadu_si256(q8.add(g * dq + c).cast());
                }
                for i in 0..TT {
                    if c.is_multiple_of(64) {
                        _mm_prefetch::<_MM_HINT_T1>(ahead[i].add(c).cast());
                    }
                    let k = _mm256_xor_si256(load_bytes::<32>(rows[i].add(c), d - c), bias);
                    for g in 0..GT {
                        acc[g][i] = _mm256_dpbusd_avx_epi32(acc[g][i], k, qv[g]);
                    }
                }
                c += 32;
            }
            let mut sums = [_mm256_setzero_ps(); 8];
            for (s, a) in sums.iter_mut().zip(acc.as_flattened()) {
                *s = _mm256_cvtepi32_ps(*a);
            }
            Self::transpose_sum(&sums)
        }
    }
    #[inline(always)]
    unsafe fn narrow_i16(v: __m256, p: *mut i16) {
        // SAFETY: the caller guarantees 8 writable i16 at `p`; values fit int16 (caller), so the
        // saturating pack is exact.
        unsafe {
            let i = _mm256_cvtps_epi32(v);
            _mm_storeu_si128(p.cast(), _mm_packs_epi32(_mm256_castsi256_si128(i), _mm256_extracti128_si256::<1>(i)));
        }
    }
    /// AVX-VNNI: each pair of rows is widened to int16 and interleaved (`vpunpck[lh]wd`), so
    /// that `vpdpwssd` adds both tokens' products per dim; 16 dims per chunk, int32 sums per step.
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
        assert!(scale.len() >= GT && n >= 1 && ahead.len() == n && dp >= d && dp.is_multiple_of(8));
        // Chunks per pass: as many as 2 x GT accumulators each leave registers for.
        let xs = if GT <= 2 { 2 } else { 1 };
        // SAFETY: the caller guarantees d bytes at `v` + each of `rows` (and `ahead`, only prefetched),
        // ceil(n / 2) pair words per head at stride ps, GT acc rows of dp f32, and AVX-VNNI;
        // chunks at or past d are neither read nor written, a partial one reads only the row's
        // bytes, and acc is written below d only.
        unsafe {
            let mut c = 0;
            while c < d {
                let mut lo = [[_mm256_setzero_si256(); 2]; GT];
                let mut hi = [[_mm256_setzero_si256(); 2]; GT];
                for j in 0..n.div_ceil(2) {
                    let (u0, u1) = (2 * j, (2 * j + 1).min(n - 1));
                    let (r0, r1) = (rows[u0] + c, rows[u1] + c);
                    if c.is_multiple_of(64) {
                        _mm_prefetch::<_MM_HINT_T1>(v.add(ahead[u0] + c).cast());
                        _mm_prefetch::<_MM_HINT_T1>(v.add(ahead[u1] + c).cast());
                    }
                    let mut l = [_mm256_setzero_si256(); 2];
                    let mut h = [_mm256_setzero_si256(); 2];
                    for x in 0..xs {
                        let at = c + 16 * x;
                        if at < d {
                            let (a, b) = (widen_i16(v.add(r0 + 16 * x), d - at), widen_i16(v.add(r1 + 16 * x), d - at));
                            (l[x], h[x]) = (_mm256_unpacklo_epi16(a, b), _mm256_unpackhi_epi16(a, b));
                        }
                    }
                    for g in 0..GT {
                        let p = _mm256_set1_epi32(*pairs.add(g * ps + j) as i32);
                        for x in 0..xs {
                            lo[g][x] = _mm256_dpwssd_avx_epi32(lo[g][x], l[x], p);
                            hi[g][x] = _mm256_dpwssd_avx_epi32(hi[g][x], h[x], p);
                        }
                    }
                }
                for g in 0..GT {
                    for x in 0..xs {
                        let at = c + 16 * x;
                        if at < d {
                            let (l, h) = (_mm256_cvtepi32_ps(lo[g][x]), _mm256_cvtepi32_ps(hi[g][x]));
                            add_pair_sums(acc.add(g * dp + at), l, h, scale[g], d - at);
                        }
                    }
                }
                c += 16 * xs;
            }
        }
    }
}

/// `min(left, N)` bytes at `p` (N = 16 or 32) in the low bytes of a vector, the rest zero.
///
/// # Safety
/// `p` must be valid for `min(left, N)` reads; the CPU must support AVX2.
#[inline(always)]
unsafe fn load_bytes<const N: usize>(p: *const i8, left: usize) -> __m256i {
    // SAFETY: reads only min(left, N) bytes at `p` (caller).
    unsafe {
        if left >= N {
            if N == 32 {
                _mm256_loadu_si256(p.cast())
            } else {
                _mm256_castsi128_si256(_mm_loadu_si128(p.cast()))
            }
        } else {
            let mut buf = [0i8; 32];
            std::ptr::copy_nonoverlapping(p, buf.as_mut_ptr(), left);
            _mm256_loadu_si256(buf.as_ptr().cast())
        }
    }
}

/// `min(left, 16)` signed bytes at `p` widened to int16 lanes, the rest zero.
///
/// # Safety
/// As for `load_bytes`.
#[inline(always)]
unsafe fn widen_i16(p: *const i8, left: usize) -> __m256i {
    // SAFETY: forwarded caller contract.
    unsafe { _mm256_cvtepi8_epi16(_mm256_castsi256_si128(load_bytes::<16>(p, left))) }
}

/// Dims `0 .. min(left, 16)` of a 16-dim chunk's pair-product sums back in order, scaled by `s`
/// and added to `acc`: after `vpunpck[lh]wd`, 128-bit lane L of `lo` holds dims 8L..8L+3 and of
/// `hi` dims 8L+4..8L+7. `left` is a multiple of 8 (head dims are).
#[inline(always)]
unsafe fn add_pair_sums(acc: *mut f32, lo: __m256, hi: __m256, s: f32, left: usize) {
    // SAFETY: the caller guarantees min(left, 16) writable f32 at `acc` and the tier's features.
    unsafe {
        let s = _mm256_set1_ps(s);
        let halves = [_mm256_permute2f128_ps::<0x20>(lo, hi), _mm256_permute2f128_ps::<0x31>(lo, hi)];
        for (k, x) in halves.into_iter().enumerate() {
            if 8 * k < left {
                let p = acc.add(8 * k);
                _mm256_storeu_ps(p, _mm256_fmadd_ps(x, s, _mm256_loadu_ps(p)));
            }
        }
    }
}

/// The kernel item compiled for AVX2 + FMA + F16C.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C; `scratch` must be made for 8 lanes.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn attend_item<Q: Element, K: KvElement>(
    it: &Item<'_, Q, K>,
    geo: &Geometry,
    scratch: &mut Scratch,
    partial: &mut [f32],
) {
    // SAFETY: forwarded caller contract.
    unsafe { kernel::attend_item::<Avx2, Q, K, { dot_kind::NONE }>(it, geo, scratch, partial) }
}

/// The kernel item for AVX2 with AVX-VNNI: int8 pools take q·k and p·v as integer dot products.
///
/// # Safety
/// As for `attend_item`, and the CPU must support AVX-VNNI.
#[target_feature(enable = "avx2,fma,f16c,avxvnni")]
pub(crate) unsafe fn attend_item_vnni<Q: Element, K: KvElement>(
    it: &Item<'_, Q, K>,
    geo: &Geometry,
    scratch: &mut Scratch,
    partial: &mut [f32],
) {
    // SAFETY: forwarded caller contract.
    unsafe { kernel::attend_item::<Avx2, Q, K, { dot_kind::INT8 }>(it, geo, scratch, partial) }
}
