//! The kernel's steps on a tier's low-precision dot-product instructions, for the pool element
//! they fit: int8 pools on VNNI, AVX-512's or AVX-VNNI (q·k as int8 x int8 against q quantized
//! per head, p·v as int16 x int16 against p quantized per head and step) or on Arm's DotProd (q·k
//! alone, by `sdot`); bf16 pools on AVX512_BF16 (q·k against q as bf16, p·v against p rounded
//! to bf16, as GPU kernels compute P·V for a bf16 model). Both accumulate exactly or in f32; p·v
//! reads V rows in pairs (two tokens per 32-bit lane), which is what these instructions sum.

use crate::attn::simd::Simd;
use crate::attn::types::{Element, Rows, Scratch};

impl Rows<'_> {
    /// q in the form these rows' dot products on tier `S` take (see `Scratch`), for the `group`
    /// heads of `q` and the zero heads that pad them to `tiled` (`Geometry::tiled_group`).
    #[inline(always)]
    pub fn prepare_q<S: Simd, Q: Element>(self, scratch: &mut Scratch, q: &[Q], group: usize, tiled: usize, d: usize) {
        match self {
            // The scaled q rows of the padding head are zeros: it quantizes to zeros, scale 0.
            Rows::I8(_) => quantize_q(scratch, tiled, d, S::I8_K_OFFSET, S::I8_DOT_BY_HEADS),
            Rows::Bf16(_) => round_q_bf16(scratch, q, group, d),
        }
    }
}

/// Scores of every head of the group against the rows of a step (pool offsets `rows` into the
/// K pool `k`), prefetching the rows at `ahead`: scaled like the widening path's (int8 rows still
/// without their row scales).
///
/// # Safety
/// The CPU must support `S` with these rows' dot products; `scratch` as for `pv_pairs`, q
/// prepared by `Rows::prepare_q`; each offset in `rows` and `ahead` starts `d` elements of `k`.
#[inline(always)]
pub(crate) unsafe fn qk<S: Simd>(
    scratch: &mut Scratch,
    group: usize,
    k: Rows<'_>,
    rows: &[usize],
    ahead: &[usize],
    d: usize,
    scale: f32,
) {
    let (dq, sp) = (scratch.dot_dim, scratch.score_stride);
    let mut g0 = 0;
    while g0 < group {
        let gt = group_tile(group - g0);
        let s = &mut scratch.scores[g0 * sp..];
        // SAFETY: forwarded caller contract; slice lengths are asserted in the tiles.
        unsafe {
            match k {
                Rows::I8(k) => {
                    let q8 = (&scratch.q8[g0 * dq..], &scratch.q8x[g0 * dq..]);
                    let (qs, qo) = (&scratch.q8_scale[g0..], &scratch.q8_offset[g0..]);
                    match (S::LANES, gt) {
                        (16, 4) => qk_tile_i8::<S, 4, 4>(q8, dq, qs, qo, k, rows, ahead, d, s, sp),
                        (16, 2) => qk_tile_i8::<S, 2, 8>(q8, dq, qs, qo, k, rows, ahead, d, s, sp),
                        (16, _) => qk_tile_i8::<S, 1, 16>(q8, dq, qs, qo, k, rows, ahead, d, s, sp),
                        (8, 4) => qk_tile_i8::<S, 4, 2>(q8, dq, qs, qo, k, rows, ahead, d, s, sp),
                        (8, 2) => qk_tile_i8::<S, 2, 4>(q8, dq, qs, qo, k, rows, ahead, d, s, sp),
                        (8, _) => qk_tile_i8::<S, 1, 8>(q8, dq, qs, qo, k, rows, ahead, d, s, sp),
                        (4, 4) => qk_tile_i8::<S, 4, 1>(q8, dq, qs, qo, k, rows, ahead, d, s, sp),
                        (4, 2) => qk_tile_i8::<S, 2, 2>(q8, dq, qs, qo, k, rows, ahead, d, s, sp),
                        _ => qk_tile_i8::<S, 1, 4>(q8, dq, qs, qo, k, rows, ahead, d, s, sp),
                    }
                }
                Rows::Bf16(k) => {
                    let qb = &scratch.qb[g0 * dq..];
                    match gt {
                        4 => qk_tile_bf16::<S, 4, 4>(qb, dq, scale, k, rows, ahead, d, s, sp),
                        2 => qk_tile_bf16::<S, 2, 8>(qb, dq, scale, k, rows, ahead, d, s, sp),
                        _ => qk_tile_bf16::<S, 1, 16>(qb, dq, scale, k, rows, ahead, d, s, sp),
                    }
                }
            }
        }
        g0 += gt;
    }
}

/// Width of the next register tile of query heads when `remaining` are left: 4, 2 or 1.
#[inline(always)]
pub(crate) fn group_tile(remaining: usize) -> usize {
    match remaining {
        r if r >= 4 => 4,
        r if r >= 2 => 2,
        _ => 1,
    }
}

/// Largest int16 p: with |v| <= 128, one pair adds at most 2 * 32767 * 128 < 2^23 to an int32
/// lane, so a step of up to 128 rows (`MAX_STEP_ROWS`, 64 pairs) stays below 2^29.
const P16_MAX: f32 = 32767.0;

/// q (pre-scaled, f32) quantized per head for int8 dot products: symmetric, `max|q| / 127`,
/// with `k_offset * Σ q8`, what the tier's dot products add for their K offset. Inlined into the
/// tier's item function, so rounding compiles to its vector instructions rather than a libm call.
#[inline(always)]
fn quantize_q(scratch: &mut Scratch, group: usize, d: usize, k_offset: f32, heads_in_lanes: bool) {
    let (dp, dq) = (scratch.padded_dim, scratch.dot_dim);
    for g in 0..group {
        let row = &mut scratch.q8[g * dq..g * dq + d];
        let scale = crate::attn::types::quantize_row(&scratch.q[g * dp..g * dp + d], row);
        scratch.q8_scale[g] = scale;
        // An integer sum (exact, and it vectorizes; an f32 sum stays a serial chain of adds,
        // a fifth of a 64-token item).
        scratch.q8_offset[g] = k_offset * row.iter().map(|&x| i32::from(x)).sum::<i32>() as f32;
    }
    // Tiers with `I8_DOT_BY_HEADS` take each whole 4-head tile interleaved by 16-byte chunks too
    // (`Simd::dot_i8_heads`).
    for g4 in 0..if heads_in_lanes { group / 4 } else { 0 } {
        let tile = 4 * g4 * dq;
        for (c, x) in scratch.q8x[tile..tile + 4 * dq].chunks_exact_mut(16).enumerate() {
            let (head, chunk) = (c % 4, c / 4);
            x.copy_from_slice(&scratch.q8[tile + head * dq + 16 * chunk..][..16]);
        }
    }
}

/// q rounded to bf16 per head, before the softmax scale (which the scores take instead, so a
/// bf16 q is used exactly).
#[inline(always)]
fn round_q_bf16<Q: Element>(scratch: &mut Scratch, q: &[Q], group: usize, d: usize) {
    let dq = scratch.dot_dim;
    for g in 0..group {
        for (x, y) in scratch.qb[g * dq..g * dq + d].iter_mut().zip(&q[g * d..(g + 1) * d]) {
            *x = half::bf16::from_f32(y.to_f32()).to_bits();
        }
    }
}

/// Scores of `GT` query heads x `TT` rows at a time of a step of an int8 K pool by int8 dot
/// products (see `Simd::dot_i8`; 4-head tiles by `Simd::dot_i8_heads` where the tier has it, on
/// q8's interleaved copy, the second of `q8`): `(dot - I8_K_OFFSET Σq8) * q_scale` (the K row scales
/// are applied by the caller).
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn qk_tile_i8<S: Simd, const GT: usize, const TT: usize>(
    (q8, qx): (&[i8], &[i8]),
    dq: usize,
    q_scale: &[f32],
    q_offset: &[f32],
    k: &[i8],
    rows: &[usize],
    ahead: &[usize],
    d: usize,
    scores: &mut [f32],
    sp: usize,
) {
    let n = rows.len();
    let heads_in_lanes = GT == 4 && S::I8_DOT_BY_HEADS;
    assert!(GT * TT == S::LANES && S::LANES <= 16 && q8.len() >= GT * dq && q_scale.len() >= GT);
    assert!(!heads_in_lanes || qx.len() >= 4 * d.next_multiple_of(16));
    assert!(ahead.len() == n && n >= 1 && scores.len() >= (GT - 1) * sp + n);
    // Lane g * TT + i takes head g's value (lanes past LANES are never loaded).
    let by_lane = |x: &[f32]| -> [f32; 16] { std::array::from_fn(|l| if l < S::LANES { x[l / TT] } else { 0.0 }) };
    let (offset, scale) = (by_lane(q_offset), by_lane(q_scale));
    for t0 in (0..n).step_by(TT) {
        // SAFETY: rows are clamped to n - 1, so each holds d readable bytes of `k` (caller); q8
        // rows hold dq bytes and qx a 4-head tile where it is read (asserted); the caller
        // dispatched a tier with int8 dot products on a CPU that has them.
        unsafe {
            let (rows, ahead) = tile_rows::<i8, TT>(k, rows, ahead, t0);
            let dot = if heads_in_lanes {
                S::dot_i8_heads(qx.as_ptr(), &rows, &ahead, d)
            } else {
                S::dot_i8::<GT, TT>(q8.as_ptr(), dq, &rows, &ahead, d)
            };
            let (offset, scale) = (S::load(offset.as_ptr()), S::load(scale.as_ptr()));
            let mut s = [0f32; 16];
            S::store(s.as_mut_ptr(), S::mul(S::sub(dot, offset), scale));
            scatter_scores::<GT, TT>(&s, scores, sp, t0, n);
        }
    }
}

/// Lane `g * TT + i` of `s` into `scores[g * sp + t0 + i]`, for tokens below `n`.
#[inline(always)]
pub(crate) fn scatter_scores<const GT: usize, const TT: usize>(
    s: &[f32; 16],
    scores: &mut [f32],
    sp: usize,
    t0: usize,
    n: usize,
) {
    let m = TT.min(n - t0);
    for g in 0..GT {
        let row = &mut scores[g * sp + t0..];
        if m == TT {
            row[..TT].copy_from_slice(&s[g * TT..(g + 1) * TT]);
        } else {
            row[..m].copy_from_slice(&s[g * TT..g * TT + m]);
        }
    }
}

/// Scores of `GT` query heads x `TT` rows at a time of a step of a bf16 K pool by bf16 dot
/// products (see `Simd::dot_bf16`), times the softmax `scale`.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn qk_tile_bf16<S: Simd, const GT: usize, const TT: usize>(
    qb: &[u16],
    dq: usize,
    scale: f32,
    k: &[u16],
    rows: &[usize],
    ahead: &[usize],
    d: usize,
    scores: &mut [f32],
    sp: usize,
) {
    let n = rows.len();
    assert!(GT * TT == S::LANES && S::LANES == 16 && qb.len() >= GT * dq);
    assert!(ahead.len() == n && n >= 1 && scores.len() >= (GT - 1) * sp + n);
    for t0 in (0..n).step_by(TT) {
        // SAFETY: as in `qk_tile_i8`, for bf16 rows and a tier with bf16 dot products.
        unsafe {
            let (rows, ahead) = tile_rows::<u16, TT>(k, rows, ahead, t0);
            let mut s = [0f32; 16];
            S::store(s.as_mut_ptr(), S::mul(S::dot_bf16::<GT, TT>(qb.as_ptr(), dq, &rows, &ahead, d), S::splat(scale)));
            scatter_scores::<GT, TT>(&s, scores, sp, t0, n);
        }
    }
}

/// Pointers into the pool `k` at the offsets of positions `t0 .. t0 + TT` of a step (clamped to
/// its last row, so every pointer is to a whole row) and of the same positions ahead.
///
/// # Safety
/// Each offset in `rows` and `ahead` lies in `k`; `ahead` is at least as long as `rows`, which
/// is not empty.
#[inline(always)]
pub(crate) unsafe fn tile_rows<T, const TT: usize>(
    k: &[T],
    rows: &[usize],
    ahead: &[usize],
    t0: usize,
) -> ([*const T; TT], [*const T; TT]) {
    let mut out = ([k.as_ptr(); TT], [k.as_ptr(); TT]);
    for i in 0..TT {
        let u = (t0 + i).min(rows.len() - 1);
        // SAFETY: both offsets lie in `k` (caller).
        (out.0[i], out.1[i]) = unsafe { (k.as_ptr().add(rows[u]), k.as_ptr().add(ahead[u])) };
    }
    out
}

/// The probabilities `p` of one head (zero from `n` to the next multiple of 16) as
/// int16 on a scale of `max p / P16_MAX`, which is returned (p >= 0): `out` read as words holds
/// `p[2j]` in the low half of word `j`, as `Simd::pv_i8` takes them.
///
/// # Safety
/// The CPU must support `S` with int16 dot products; `p` and `out` hold `n` rounded up to 16.
#[inline(always)]
unsafe fn pack_i16<S: Simd>(p: &[f32], n: usize, out: &mut [u32]) -> f32 {
    let padded = n.next_multiple_of(16);
    assert!(p.len() >= padded && out.len() * 2 >= padded);
    // SAFETY: offsets below padded, within both (asserted); the CPU supports S (caller).
    unsafe {
        let mut m = S::zero();
        for c in (0..padded).step_by(S::LANES) {
            m = S::max(m, S::load(p.as_ptr().add(c)));
        }
        let max = S::reduce_max(m);
        let inv = S::splat(if max > 0.0 { P16_MAX / max } else { 0.0 });
        for c in (0..padded).step_by(S::LANES) {
            S::narrow_i16(S::mul(S::load(p.as_ptr().add(c)), inv), out.as_mut_ptr().cast::<i16>().add(c));
        }
        max / P16_MAX
    }
}

/// The probabilities `p[..n]` of one head (zero past `n`) rounded to bf16, laid out as
/// `pack_i16`'s for `Simd::pv_bf16`.
///
/// # Safety
/// As for `pack_i16`, with bf16 dot products.
#[inline(always)]
unsafe fn pack_bf16<S: Simd>(p: &[f32], n: usize, out: &mut [u32]) {
    let padded = n.next_multiple_of(16);
    assert!(p.len() >= padded && out.len() * 2 >= padded);
    // SAFETY: as in `pack_i16`.
    unsafe {
        for c in (0..padded).step_by(S::LANES) {
            S::narrow_bf16(S::load(p.as_ptr().add(c)), out.as_mut_ptr().cast::<u16>().add(c));
        }
    }
}

/// `acc[g] += Σ_t p[g][t] · v[t]` for the `gt` (4 or 2) heads from `g0` over the rows of a
/// step (pool offsets `rows` into the V pool `v`) by the rows' pair dot products, prefetching the
/// rows at `ahead` (int8 rows take p already times their row scales). Pairs pay only when their
/// interleaving serves several heads: a single head takes the widening path.
///
/// # Safety
/// The CPU must support `S` with these rows' dot products; `scratch` comes from `Scratch::new`
/// for this geometry and its scores hold this step's probabilities; each offset in `rows` and
/// `ahead` starts `d` elements of `v`.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
pub(crate) unsafe fn pv_pairs<S: Simd>(
    scratch: &mut Scratch,
    g0: usize,
    gt: usize,
    v: Rows<'_>,
    rows: &[usize],
    ahead: &[usize],
    d: usize,
) {
    let (dp, sp, n) = (scratch.padded_dim, scratch.score_stride, rows.len());
    let ps = sp / 2;
    assert!(gt == 4 || gt == 2);
    assert!(n >= 1 && n <= sp && scratch.pairs.len() >= (g0 + gt) * ps && scratch.acc.len() >= (g0 + gt) * dp);
    assert!(ahead.len() == n);
    for g in g0..g0 + gt {
        let (p, pairs) = (&mut scratch.scores[g * sp..(g + 1) * sp], &mut scratch.pairs[g * ps..(g + 1) * ps]);
        // Past n the softmax leaves (near) zeros; exact zeros keep the odd row out of the sums.
        p[n..n.next_multiple_of(16)].fill(0.0);
        // SAFETY: the CPU supports S with these rows' dot products (caller).
        scratch.pair_scale[g] = unsafe {
            match v {
                Rows::I8(_) => pack_i16::<S>(p, n, pairs),
                Rows::Bf16(_) => {
                    pack_bf16::<S>(p, n, pairs);
                    1.0
                }
            }
        };
    }
    let pairs = scratch.pairs[g0 * ps..].as_ptr();
    let scales = &scratch.pair_scale[g0..];
    let acc = scratch.acc[g0 * dp..].as_mut_ptr();
    // SAFETY: each row holds d elements of the pool (caller); pairs hold ceil(n / 2) words per
    // head at stride ps, acc gt rows of dp >= d at stride dp (asserted above); the CPU supports S
    // with these dot products (caller).
    unsafe {
        match (v, gt) {
            (Rows::I8(v), 4) => S::pv_i8::<4>(pairs, ps, scales, v.as_ptr(), rows, ahead, d, acc, dp),
            (Rows::I8(v), _) => S::pv_i8::<2>(pairs, ps, scales, v.as_ptr(), rows, ahead, d, acc, dp),
            (Rows::Bf16(v), 4) => S::pv_bf16::<4>(pairs, ps, v.as_ptr(), rows, ahead, d, acc, dp),
            (Rows::Bf16(v), _) => S::pv_bf16::<2>(pairs, ps, v.as_ptr(), rows, ahead, d, acc, dp),
        }
    }
}
