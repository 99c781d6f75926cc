//! AVX-512 (F, BW, VL) implementation of the kernel primitives (16 f32 lanes).

use std::arch::x86_64::*;

use crate::attn::element::Element;
use crate::attn::kernel::{self, Geometry, Item, Scratch};
use crate::attn::simd::{exp_consts as ec, Simd};

#[derive(Clone, Copy)]
pub(crate) struct Avx512;

impl Simd for Avx512 {
    const LANES: usize = 16;
    type V = __m512;

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
    unsafe fn prefetch_l2(p: *const u8) {
        // SAFETY: prefetch never faults, whatever the address.
        unsafe { _mm_prefetch::<_MM_HINT_T1>(p.cast()) }
    }
}

/// The kernel item compiled for AVX-512 F/BW/VL.
///
/// # Safety
/// The CPU must support AVX-512 F/BW/VL, AVX2, FMA and F16C; `scratch` must be made for 16 lanes.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
pub(crate) unsafe fn attend_item<E: Element>(
    it: &Item<'_, E>,
    geo: &Geometry,
    scratch: &mut Scratch,
    partial: &mut [f32],
) {
    // SAFETY: forwarded caller contract.
    unsafe { kernel::attend_item::<Avx512, E>(it, geo, scratch, partial) }
}
