//! AVX2 + FMA + F16C implementation of the kernel primitives (8 f32 lanes).

use std::arch::x86_64::*;

use crate::attn::dot;
use crate::attn::element::{Element, KvElement};
use crate::attn::kernel::{self, Geometry, Item, Scratch};
use crate::attn::simd::{exp_consts as ec, Simd};

#[derive(Clone, Copy)]
pub(crate) struct Avx2;

impl Simd for Avx2 {
    const LANES: usize = 8;
    type V = __m256;

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
    unsafe { kernel::attend_item::<Avx2, Q, K, { dot::NONE }>(it, geo, scratch, partial) }
}
