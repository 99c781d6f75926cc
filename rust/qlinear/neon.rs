//! NEON (aarch64): `avx2.rs`'s passes in 128-bit vectors. Each pair of a block is widened to f32
//! as eight vectors of 4 lanes, the 16 columns' weights at the pair's even input, then at its odd
//! one: an int8 pair is split into its even and odd bytes as it is loaded (`vld2q_s8`), an int4
//! pair's nibbles by `vuzp`. Rows of `x` are widened to f32 once a call (`prepare`) and each value
//! multiplied-added against the widened weights by `fmla` with a scalar operand. Int4 multiplies
//! its values `q` (0..15) and offsets each group by `(zero - 8 · scale) · Σx`; grouped int8 by
//! `zero · Σx`; the rows' group sums are taken in f64 and rounded once.
//!
//! A few rows (`FUSED_ROWS`) widen each pair in registers and use it at once; more widen the block
//! once into the thread's scratch, then pass over it 4 rows at a time (`f32_passes!`): 16
//! accumulators, the pair's 8 vectors and the rows' values in the 32 vector registers.
//!
//! Tested against the scalar reference under qemu-user (`make test-aarch64`); not yet timed on an
//! Arm CPU, so the engine runs it only when asked (`model/rust_linears.py`).

use std::arch::aarch64::*;

use super::{Block, F32Tile, Format, Out, Rows, Scratch, Values, COLS, FUSED_ROWS};

/// Vectors of a widened pair: even inputs' columns in fours, then odd inputs'.
const VECTORS: usize = 8;
/// f32 values of a widened pair.
const PAIR: usize = 4 * VECTORS;

/// For the grouped formats each row's sum over each group of `group` inputs (`[rows][k / group]`),
/// and the rows of `x` in f32, `2 * k.div_ceil(2)` values each (an odd `k`'s pad weight meets a
/// zero, never what follows the row). Sums in f64, in which sums of bf16 or f16 values lose
/// nothing at any realistic width or range (and of f32 values next to nothing).
pub(super) fn prepare(x: Values<'_>, rows: usize, k: usize, group: Option<usize>) -> (Vec<f32>, Vec<f32>) {
    assert!(x.len() >= rows * k, "prepare: rows shorter than their shapes");
    let width = 2 * k.div_ceil(2);
    let mut wide = vec![0.0f32; rows * width];
    for (m, to) in wide.chunks_exact_mut(width).enumerate() {
        let row = m * k..(m + 1) * k;
        match x {
            Values::Bf16(v) => to.iter_mut().zip(&v[row]).for_each(|(t, v)| *t = v.to_f32()),
            Values::F16(v) => to.iter_mut().zip(&v[row]).for_each(|(t, v)| *t = v.to_f32()),
            Values::F32(v) => to[..k].copy_from_slice(&v[row]),
        }
    }
    let sums = group.map_or_else(Vec::new, |group| {
        let groups = wide.chunks_exact(width).flat_map(|row| row[..k].chunks_exact(group));
        groups.map(|g| g.iter().map(|&v| f64::from(v)).sum::<f64>() as f32).collect()
    });
    (sums, wide)
}

/// # Safety
/// `x` is `prepare`'s for `rows` rows of `k`, `ws` are blocks of one weight `k` wide, and this
/// call alone writes their columns of `out`.
pub(super) unsafe fn blocks(x: Rows<'_>, rows: usize, k: usize, ws: &[Block<'_>], scratch: &mut Scratch, out: Out) {
    f32_passes!(x, rows, k, ws, scratch, out, pair: PAIR, widen4: widen4, widen8: widen8, store: store, load: load, against: rows_against)
}

/// A widened pair into the scratch at `to`.
///
/// # Safety
/// `to` has room for `PAIR` values.
#[inline]
unsafe fn store(pair: [float32x4_t; VECTORS], to: *mut f32) {
    for (i, v) in pair.into_iter().enumerate() {
        // SAFETY: the caller's.
        unsafe { vst1q_f32(to.add(4 * i), v) };
    }
}

/// A widened pair back from the scratch at `from`.
///
/// # Safety
/// `from` holds `PAIR` values.
#[inline]
unsafe fn load(from: *const f32) -> [float32x4_t; VECTORS] {
    // SAFETY: the caller's.
    std::array::from_fn(|i| unsafe { vld1q_f32(from.add(4 * i)) })
}

/// `M` rows against block `w`, pair `p`'s widened weights from `pair(p)`: each group's products
/// summed, then scaled and offset by its rows' `Σx` into the rows' sums (int8: one group of every
/// pair, its scales applied by `Out::put`). Up to 2 rows, a row's odd inputs feed chains of their
/// own, else the `fmla` chains would wait on their own latency.
///
/// # Safety
/// `rows` holds `M` rows of `prepare`'s and their group sums; `pair` may be called for each of
/// the block's pairs; this call alone writes `w`'s columns.
#[inline]
unsafe fn rows_against<const M: usize>(
    rows: &F32Tile,
    k: usize,
    w: &Block<'_>,
    out: Out,
    pair: &impl Fn(usize) -> [float32x4_t; VECTORS],
) {
    const QUARTERS: usize = COLS / 4;
    let odd = if M <= 2 { QUARTERS } else { 0 };
    let (groups, group_pairs) = w.format.group().map_or((1, k.div_ceil(2)), |group| (k / group, group / 2));
    let int4 = matches!(w.format, Format::Int4 { .. });
    // SAFETY: the caller's rows, group sums and pairs.
    unsafe {
        let mut acc = [[vdupq_n_f32(0.0); QUARTERS]; M];
        for g in 0..groups {
            let mut dots = [[vdupq_n_f32(0.0); 2 * QUARTERS]; M];
            for p in g * group_pairs..(g + 1) * group_pairs {
                let v = pair(p);
                for (m, d) in dots.iter_mut().enumerate() {
                    let (xe, xo) = (*rows.x.add(m * rows.width + 2 * p), *rows.x.add(m * rows.width + 2 * p + 1));
                    for q in 0..QUARTERS {
                        d[q] = vfmaq_n_f32(d[q], v[q], xe);
                        d[odd + q] = vfmaq_n_f32(d[odd + q], v[QUARTERS + q], xo);
                    }
                }
            }
            // Above 2 rows the odd inputs shared the even ones' chains: their halves are zeros.
            let sums = dots.map(|d| std::array::from_fn::<_, QUARTERS, _>(|q| vaddq_f32(d[q], d[QUARTERS + q])));
            if w.format.group().is_none() {
                acc = sums;
                continue;
            }
            // The group's scales and zeros, once for all the rows.
            let params = |at: usize| std::array::from_fn::<_, QUARTERS, _>(|q| widen_values(w.groups, at + 4 * q));
            let (scale, zero) = (params(g * 2 * COLS), params(g * 2 * COLS + COLS));
            let zero =
                if int4 { std::array::from_fn(|q| vfmsq_f32(zero[q], scale[q], vdupq_n_f32(8.0))) } else { zero };
            for (m, (a, s)) in acc.iter_mut().zip(sums).enumerate() {
                let sum_x = *rows.group_sums.add(m * groups + g);
                for q in 0..QUARTERS {
                    a[q] = vfmaq_n_f32(vfmaq_f32(a[q], scale[q], s[q]), zero[q], sum_x);
                }
            }
        }
        for (m, a) in acc.into_iter().enumerate() {
            let mut sums = [0.0f32; COLS];
            for (q, v) in a.into_iter().enumerate() {
                vst1q_f32(sums.as_mut_ptr().add(4 * q), v);
            }
            out.put(rows.m0 + m, w, &sums);
        }
    }
}

/// An int4 pair (16 bytes at `q`) as f32: `[even 0-3, 4-7, 8-11, 12-15, odd 0-3, ...]`. Byte `j`
/// holds lane `j` (column `j / 2`) in its low nibble, lane `16 + j` (column `8 + j / 2`) in its
/// high one; a lane's input is its parity.
///
/// # Safety
/// `q` points at the pair's 16 bytes.
#[inline]
unsafe fn widen4(q: *const u8) -> [float32x4_t; VECTORS] {
    // SAFETY: the caller's 16 bytes; NEON is part of every aarch64 CPU.
    unsafe {
        let v = vld1q_u8(q);
        let (lo, hi) = (vandq_u8(v, vdupq_n_u8(0xF)), vshrq_n_u8::<4>(v));
        pair_of(vreinterpretq_s8_u8(vuzp1q_u8(lo, hi)), vreinterpretq_s8_u8(vuzp2q_u8(lo, hi)))
    }
}

/// An int8 pair (32 bytes at `q`, lane `2c + i` column `c`'s input `i`) as `widen4`'s.
///
/// # Safety
/// `q` points at the pair's 32 bytes.
#[inline]
unsafe fn widen8(q: *const u8) -> [float32x4_t; VECTORS] {
    // SAFETY: the caller's 32 bytes.
    let v = unsafe { vld2q_s8(q.cast()) };
    pair_of(v.0, v.1)
}

/// A pair's even and odd inputs' 16 columns as f32.
#[inline]
fn pair_of(even: int8x16_t, odd: int8x16_t) -> [float32x4_t; VECTORS] {
    let (e, o) = (widen_i8(even), widen_i8(odd));
    [e[0], e[1], e[2], e[3], o[0], o[1], o[2], o[3]]
}

/// 16 int8 (int4's 0..15 among them) as 4 vectors of f32.
#[inline]
fn widen_i8(v: int8x16_t) -> [float32x4_t; 4] {
    // SAFETY: NEON is part of every aarch64 CPU.
    unsafe {
        let (lo, hi) = (vmovl_s8(vget_low_s8(v)), vmovl_high_s8(v));
        let f = |v: int32x4_t| vcvtq_f32_s32(v);
        [f(vmovl_s16(vget_low_s16(lo))), f(vmovl_high_s16(lo)), f(vmovl_s16(vget_low_s16(hi))), f(vmovl_high_s16(hi))]
    }
}

/// Values `at .. at + 4` as f32.
///
/// # Safety
/// `v` holds them.
#[inline]
unsafe fn widen_values(v: Values<'_>, at: usize) -> float32x4_t {
    debug_assert!(at + 4 <= v.len());
    // SAFETY: the caller's 4 values; a bf16 is the top half of its f32.
    unsafe {
        match v {
            Values::Bf16(v) => vreinterpretq_f32_u32(vshll_n_u16::<16>(vld1_u16(v.as_ptr().add(at).cast()))),
            // Rust has no stable f16 vectors: one at a time (only the groups of an f16 model).
            Values::F16(v) => vld1q_f32(std::array::from_fn::<f32, 4, _>(|i| v[at + i].to_f32()).as_ptr()),
            Values::F32(v) => vld1q_f32(v.as_ptr().add(at)),
        }
    }
}
