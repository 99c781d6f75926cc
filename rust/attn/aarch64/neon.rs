//! NEON implementation of the kernel primitives (4 f32 lanes).

use std::arch::aarch64::*;
use std::arch::asm;

use crate::attn::kernel::{self, Item};
use crate::attn::simd::{exp_consts as ec, Simd};
use crate::attn::types::{dot_kind, Element, Geometry, KvElement, Scratch};

#[derive(Clone, Copy)]
pub(crate) struct Neon;

impl Simd for Neon {
    const LANES: usize = 4;
    type V = float32x4_t;
    // `sdot` takes signed bytes (no K offset), and the tier has no pair dot products for p·v.

    #[inline(always)]
    unsafe fn zero() -> float32x4_t {
        // SAFETY: NEON is part of the aarch64 baseline.
        unsafe { vdupq_n_f32(0.0) }
    }
    #[inline(always)]
    unsafe fn splat(x: f32) -> float32x4_t {
        // SAFETY: as above.
        unsafe { vdupq_n_f32(x) }
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> float32x4_t {
        // SAFETY: the caller guarantees 4 readable f32 at `p`.
        unsafe { vld1q_f32(p) }
    }
    #[inline(always)]
    unsafe fn store(p: *mut f32, v: float32x4_t) {
        // SAFETY: the caller guarantees 4 writable f32 at `p`.
        unsafe { vst1q_f32(p, v) }
    }
    #[inline(always)]
    unsafe fn fma(a: float32x4_t, b: float32x4_t, c: float32x4_t) -> float32x4_t {
        // SAFETY: NEON.
        unsafe { vfmaq_f32(c, a, b) }
    }
    #[inline(always)]
    unsafe fn mul(a: float32x4_t, b: float32x4_t) -> float32x4_t {
        // SAFETY: NEON.
        unsafe { vmulq_f32(a, b) }
    }
    #[inline(always)]
    unsafe fn add(a: float32x4_t, b: float32x4_t) -> float32x4_t {
        // SAFETY: part of this tier's feature set.
        unsafe { vaddq_f32(a, b) }
    }
    #[inline(always)]
    unsafe fn max(a: float32x4_t, b: float32x4_t) -> float32x4_t {
        // SAFETY: part of this tier's feature set.
        unsafe { vmaxq_f32(a, b) }
    }
    #[inline(always)]
    unsafe fn reduce_max(v: float32x4_t) -> f32 {
        // SAFETY: part of this tier's feature set.
        unsafe { vmaxvq_f32(v) }
    }
    #[inline(always)]
    unsafe fn sub(a: float32x4_t, b: float32x4_t) -> float32x4_t {
        // SAFETY: NEON.
        unsafe { vsubq_f32(a, b) }
    }
    #[inline(always)]
    unsafe fn reduce_add(v: float32x4_t) -> f32 {
        // SAFETY: NEON.
        unsafe { vaddvq_f32(v) }
    }
    #[inline(always)]
    unsafe fn transpose_sum(v: &[float32x4_t]) -> float32x4_t {
        assert!(v.len() == 4);
        // SAFETY: NEON.
        unsafe { vpaddq_f32(vpaddq_f32(v[0], v[1]), vpaddq_f32(v[2], v[3])) }
    }
    #[inline(always)]
    unsafe fn exp(x: float32x4_t) -> float32x4_t {
        // SAFETY: NEON.
        unsafe {
            let x = vminq_f32(vmaxq_f32(x, vdupq_n_f32(ec::LO)), vdupq_n_f32(ec::HI));
            let n = vrndnq_f32(vmulq_f32(x, vdupq_n_f32(ec::LOG2E)));
            let r = vfmsq_f32(x, n, vdupq_n_f32(ec::LN2_HI));
            let r = vfmsq_f32(r, n, vdupq_n_f32(ec::LN2_LO));
            let mut y = vdupq_n_f32(ec::POLY[0]);
            for c in &ec::POLY[1..] {
                y = vfmaq_f32(vdupq_n_f32(*c), y, r);
            }
            let y = vfmaq_f32(vaddq_f32(r, vdupq_n_f32(1.0)), y, vmulq_f32(r, r));
            let pow2 = vshlq_n_s32::<23>(vaddq_s32(vcvtq_s32_f32(n), vdupq_n_s32(127)));
            vmulq_f32(y, vreinterpretq_f32_s32(pow2))
        }
    }
    #[inline(always)]
    unsafe fn widen_bf16(p: *const u16) -> float32x4_t {
        // SAFETY: the caller guarantees 4 readable u16 at `p`; bf16 is the top half of an f32.
        unsafe { vreinterpretq_f32_u32(vshlq_n_u32::<16>(vmovl_u16(vld1_u16(p)))) }
    }
    #[inline(always)]
    unsafe fn widen_f16(p: *const u16) -> float32x4_t {
        // SAFETY: the caller guarantees 4 readable u16 at `p`.
        let raw = unsafe { p.cast::<[u16; 4]>().read_unaligned() };
        let wide = raw.map(|b| half::f16::from_bits(b).to_f32());
        // SAFETY: `wide` holds 4 f32.
        unsafe { vld1q_f32(wide.as_ptr()) }
    }
    #[inline(always)]
    unsafe fn widen_i8(p: *const i8) -> float32x4_t {
        // SAFETY: the caller guarantees 4 readable i8 at `p` (one 32-bit load); sign-extend
        // twice, then convert.
        unsafe {
            let word = p.cast::<u32>().read_unaligned();
            let bytes = vreinterpret_s8_u32(vdup_n_u32(word));
            vcvtq_f32_s32(vmovl_s16(vget_low_s16(vmovl_s8(bytes))))
        }
    }
    #[inline(always)]
    unsafe fn prefetch_l2(_p: *const u8) {}
    /// DotProd: `sdot` sums 4 products of signed bytes into each of 4 lanes, 16 dims per
    /// instruction. A row's last chunk, if short, is read through a zeroed copy (a whole load
    /// could pass the end of the pool); q is zero past `d` anyway.
    #[inline(always)]
    unsafe fn dot_i8<const GT: usize, const TT: usize>(
        q8: *const i8,
        dq: usize,
        rows: &[*const i8; TT],
        _ahead: &[*const i8; TT],
        d: usize,
    ) -> float32x4_t {
        assert!(GT * TT == 4 && dq >= d && dq.is_multiple_of(64));
        // SAFETY: the caller guarantees the row and q8 extents above (q8 rows hold dq >= c + 16
        // bytes for every chunk c < d) and dispatches this only on CPUs with DotProd.
        unsafe {
            let mut acc = [[vdupq_n_s32(0); TT]; GT];
            let mut c = 0;
            while c < d {
                let mut qv = [vdupq_n_s8(0); GT];
                for (g, x) in qv.iter_mut().enumerate() {
                    *x = vld1q_s8(q8.add(g * dq + c));
                }
                for i in 0..TT {
                    let k = if d - c >= 16 {
                        vld1q_s8(rows[i].add(c))
                    } else {
                        let mut tail = [0i8; 16];
                        tail[..d - c].copy_from_slice(std::slice::from_raw_parts(rows[i].add(c), d - c));
                        vld1q_s8(tail.as_ptr())
                    };
                    for g in 0..GT {
                        acc[g][i] = sdot(acc[g][i], qv[g], k);
                    }
                }
                c += 16;
            }
            let mut sums = [vdupq_n_f32(0.0); 4];
            for (s, a) in sums.iter_mut().zip(acc.as_flattened()) {
                *s = vcvtq_f32_s32(*a);
            }
            Self::transpose_sum(&sums)
        }
    }
}

/// `acc + ` the four 4-byte dot products of `a` and `b` (signed), one per lane.
///
/// # Safety
/// The CPU must have DotProd (FEAT_DotProd); the callers are compiled with it enabled.
#[inline(always)]
unsafe fn sdot(mut acc: int32x4_t, a: int8x16_t, b: int8x16_t) -> int32x4_t {
    // (`vdotq_s32` is not stable in Rust yet; the instruction is.)
    // SAFETY: register-only arithmetic, on CPUs with DotProd (caller).
    unsafe {
        asm!(
            "sdot {acc:v}.4s, {a:v}.16b, {b:v}.16b",
            acc = inout(vreg) acc,
            a = in(vreg) a,
            b = in(vreg) b,
            options(pure, nomem, nostack, preserves_flags),
        );
    }
    acc
}

/// The kernel item compiled for NEON.
///
/// # Safety
/// `scratch` must be made for 4 lanes.
#[target_feature(enable = "neon")]
pub(crate) unsafe fn attend_item<Q: Element, K: KvElement>(
    it: &Item<'_, Q, K>,
    geo: &Geometry,
    scratch: &mut Scratch,
    partial: &mut [f32],
) {
    // SAFETY: forwarded caller contract.
    unsafe { kernel::attend_item::<Neon, Q, K, { dot_kind::NONE }>(it, geo, scratch, partial) }
}

/// The kernel item for NEON with DotProd: int8 pools take q·k as `sdot` dot products.
///
/// # Safety
/// As for `attend_item`, and the CPU must have DotProd.
#[target_feature(enable = "neon,dotprod")]
pub(crate) unsafe fn attend_item_sdot<Q: Element, K: KvElement>(
    it: &Item<'_, Q, K>,
    geo: &Geometry,
    scratch: &mut Scratch,
    partial: &mut [f32],
) {
    // SAFETY: forwarded caller contract.
    unsafe { kernel::attend_item::<Neon, Q, K, { dot_kind::INT8 }>(it, geo, scratch, partial) }
}
