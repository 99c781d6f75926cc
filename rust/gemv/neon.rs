//! NEON (aarch64): the passes of `avx512.rs`, one weight row against up to 8 `x` rows, in 128-bit
//! vectors. Two ways to multiply: `bfdot` (Armv8.6's BF16: 8 products an instruction, summed
//! pairwise into 4 f32 lanes) where the CPU has it, else each bf16 widened to f32 (a bf16 is the
//! top half of an f32, so a shift) and multiplied-added in f32, which every aarch64 CPU runs.
//! Each row keeps two chains of accumulators, so that its multiply-adds do not wait on their own
//! latency. Values past the last whole step are summed in f32 one by one.
//!
//! Tested against the scalar reference under qemu-user (`make test-aarch64`); not yet timed on an
//! Arm CPU, so the engine runs it only when asked (`model/rust_linears.py`).

use std::arch::aarch64::*;
use std::arch::asm;

use half::bf16;

/// `x` rows per pass over a weight row: 16 accumulators, a widened weight step and an `x` step
/// fit the 32 vector registers.
const ROWS: usize = 8;

/// The sums `sums[r * rows + m] = x[m] · w[r]` for the `w.len() / k` rows of `w`, in f32
/// multiply-adds on the widened values.
pub(super) fn dots_widen(x: &[bf16], rows: usize, k: usize, w: &[bf16], sums: &mut [f32]) {
    passes!(row_widen, ROWS, [1, 2, 3, 4, 5, 6, 7], x, rows, k, w, sums);
}

/// As `dots_widen`, by `bfdot`.
///
/// # Safety
/// The CPU must have BF16 (`is_aarch64_feature_detected!("bf16")`).
pub(super) unsafe fn dots_bfdot(x: &[bf16], rows: usize, k: usize, w: &[bf16], sums: &mut [f32]) {
    passes!(row_bfdot, ROWS, [1, 2, 3, 4, 5, 6, 7], x, rows, k, w, sums);
}

/// One step of a row's products: `VALUES` values of a weight row (loaded once as `W` for every
/// `x` row of the pass) against the same of an `x` row, added into the row's two accumulators.
trait Step {
    const VALUES: usize;
    type W: Copy;

    /// # Safety
    /// `VALUES` values from `w` are readable.
    unsafe fn load(w: *const bf16) -> Self::W;

    /// # Safety
    /// `VALUES` values from `x` are readable; the CPU runs the step's instructions.
    unsafe fn step(acc: &mut [float32x4_t; 2], x: *const bf16, w: Self::W);
}

struct Widen;

impl Step for Widen {
    const VALUES: usize = 8;
    type W = [float32x4_t; 2];

    #[inline(always)]
    unsafe fn load(w: *const bf16) -> Self::W {
        // SAFETY: the caller's.
        widened(unsafe { vld1q_u16(w.cast()) })
    }

    #[inline(always)]
    unsafe fn step(acc: &mut [float32x4_t; 2], x: *const bf16, w: Self::W) {
        // SAFETY: the caller's; NEON is part of every aarch64 target.
        unsafe {
            let xv = widened(vld1q_u16(x.cast()));
            acc[0] = vfmaq_f32(acc[0], xv[0], w[0]);
            acc[1] = vfmaq_f32(acc[1], xv[1], w[1]);
        }
    }
}

/// 8 bf16 as two vectors of 4 f32.
#[inline(always)]
fn widened(v: uint16x8_t) -> [float32x4_t; 2] {
    // SAFETY: registers only; NEON is part of every aarch64 target.
    unsafe {
        [vreinterpretq_f32_u32(vshll_n_u16::<16>(vget_low_u16(v))), vreinterpretq_f32_u32(vshll_high_n_u16::<16>(v))]
    }
}

struct Bfdot;

impl Step for Bfdot {
    const VALUES: usize = 16;
    type W = [uint16x8_t; 2];

    #[inline(always)]
    unsafe fn load(w: *const bf16) -> Self::W {
        // SAFETY: the caller's.
        unsafe { [vld1q_u16(w.cast()), vld1q_u16(w.add(8).cast())] }
    }

    #[inline(always)]
    unsafe fn step(acc: &mut [float32x4_t; 2], x: *const bf16, w: Self::W) {
        // SAFETY: the caller's (the values and BF16).
        unsafe {
            acc[0] = bfdot(acc[0], vld1q_u16(x.cast()), w[0]);
            acc[1] = bfdot(acc[1], vld1q_u16(x.add(8).cast()), w[1]);
        }
    }
}

/// `acc[i] += a[2i]·b[2i] + a[2i+1]·b[2i+1]`, the 8 lanes of `a` and `b` bf16.
#[inline(always)]
unsafe fn bfdot(mut acc: float32x4_t, a: uint16x8_t, b: uint16x8_t) -> float32x4_t {
    // (`vbfdotq_f32` is not stable in Rust yet; the instruction is. The directive lets the
    // assembler take it in a function built without the feature.)
    // SAFETY: registers only; the caller's CPU has BF16.
    unsafe {
        asm!(
            ".arch_extension bf16",
            "bfdot {acc:v}.4s, {a:v}.8h, {b:v}.8h",
            acc = inout(vreg) acc,
            a = in(vreg) a,
            b = in(vreg) b,
            options(pure, nomem, nostack, preserves_flags),
        );
    }
    acc
}

/// `row` by widening (NEON, part of every aarch64 target).
#[inline(always)]
unsafe fn row_widen<const M: usize>(x: &[bf16], w: &[bf16], k: usize, out: &mut [f32]) {
    // SAFETY: the caller's.
    unsafe { row::<Widen, M>(x, w, k, out) }
}

/// `row` by `bfdot`.
///
/// # Safety
/// The CPU has BF16.
#[inline(always)]
unsafe fn row_bfdot<const M: usize>(x: &[bf16], w: &[bf16], k: usize, out: &mut [f32]) {
    // SAFETY: the caller's.
    unsafe { row::<Bfdot, M>(x, w, k, out) }
}

/// `out[m] = x[m] · w` for the `M` rows of `x`, `k` values each.
///
/// # Safety
/// The CPU runs `S`'s instructions.
#[inline(always)]
unsafe fn row<S: Step, const M: usize>(x: &[bf16], w: &[bf16], k: usize, out: &mut [f32]) {
    // SAFETY: registers only; NEON is part of every aarch64 target.
    let mut acc = [[unsafe { vdupq_n_f32(0.0) }; 2]; M];
    let whole = k - k % S::VALUES;
    let (xp, wp) = (x.as_ptr(), w.as_ptr());
    let mut c = 0;
    while c < whole {
        // SAFETY: values `c .. c + VALUES` of each row lie before `whole` <= `k`.
        unsafe {
            let wv = S::load(wp.add(c));
            for (m, a) in acc.iter_mut().enumerate() {
                S::step(a, xp.add(m * k + c), wv);
            }
        }
        c += S::VALUES;
    }
    for (m, o) in out.iter_mut().enumerate() {
        let tail = super::scalar::dot(&x[m * k + whole..(m + 1) * k], &w[whole..]);
        // SAFETY: see `acc`.
        *o = unsafe { vaddvq_f32(vaddq_f32(acc[m][0], acc[m][1])) } + tail;
    }
}
