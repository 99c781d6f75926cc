//! The kernel's q·k and p·v on f32 vectors: K/V rows widened to f32 in registers straight from
//! the pool, each load serving a register tile of query heads (q·k: heads x rows = LANES
//! accumulators folded by one transposed reduction; p·v: up to 4 heads per V-row load). Every
//! element type and tier takes this path; `dot.rs` replaces it where a tier's dot products fit.

use crate::attn::dot::{scatter_scores, tile_rows};
use crate::attn::simd::Simd;
use crate::attn::types::KvElement;

/// `count` (<= LANES) elements at `p` widened to f32, the rest of the lanes zero. With
/// `count == LANES` (the literal, after inlining) this is one widening load.
///
/// # Safety
/// `p` must be valid for `count` reads; the CPU must support `S`.
#[inline(always)]
unsafe fn load_chunk<S: Simd, E: KvElement>(p: *const E, count: usize) -> S::V {
    // SAFETY: forwarded caller contract; the partial path reads exactly `count` elements.
    unsafe {
        if count == S::LANES {
            E::widen::<S>(p)
        } else {
            let mut buf = [0f32; 16];
            for (i, x) in buf.iter_mut().enumerate().take(count) {
                *x = (*p.add(i)).widen_one();
            }
            S::load(buf.as_ptr())
        }
    }
}

/// Scaled scores (q is pre-scaled) of `GT` query heads x `TT` rows at a time (GT * TT = LANES
/// accumulators, folded by one transposed reduction) for the rows of a step of the K pool `k`
/// (pool offsets `rows`; `ahead` prefetched).
///
/// # Safety
/// The CPU must support `S`; each offset in `rows` and `ahead` starts `d` elements of `k`.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
pub(crate) unsafe fn qk_tile<S: Simd, E: KvElement, const GT: usize, const TT: usize>(
    q: &[f32],
    k: &[E],
    rows: &[usize],
    ahead: &[usize],
    d: usize,
    dp: usize,
    scores: &mut [f32],
    sp: usize,
) {
    let n = rows.len();
    assert!(GT * TT == S::LANES && S::LANES <= 16 && ahead.len() == n);
    assert!(q.len() >= GT * dp && n >= 1 && scores.len() >= (GT - 1) * sp + n);
    let (full, tail) = (d / S::LANES, d % S::LANES);
    for t0 in (0..n).step_by(TT) {
        // SAFETY: rows are clamped to n - 1 and chunks never pass d, so every read lies inside
        // `k` (caller); q offsets stay below GT * dp (asserted above); the CPU supports S (caller).
        unsafe {
            let (rows, ahead) = tile_rows::<E, TT>(k, rows, ahead, t0);
            let mut acc = [[S::zero(); TT]; GT];
            for c in 0..full {
                qk_chunk::<S, E, GT, TT>(&rows, &ahead, q, dp, c * S::LANES, S::LANES, &mut acc);
            }
            if tail > 0 {
                qk_chunk::<S, E, GT, TT>(&rows, &ahead, q, dp, full * S::LANES, tail, &mut acc);
            }
            let mut s = [0f32; 16];
            S::store(s.as_mut_ptr(), S::transpose_sum(acc.as_flattened()));
            scatter_scores::<GT, TT>(&s, scores, sp, t0, n);
        }
    }
}

#[inline(always)]
unsafe fn qk_chunk<S: Simd, E: KvElement, const GT: usize, const TT: usize>(
    rows: &[*const E; TT],
    ahead: &[*const E; TT],
    q: &[f32],
    dp: usize,
    c: usize,
    count: usize,
    acc: &mut [[S::V; TT]; GT],
) {
    // SAFETY: the caller (qk_tile) guarantees `count` readable elements at rows[i] + c (and
    // ahead[i] + c, only prefetched) and LANES readable f32 at q[g * dp + c] for g < GT.
    unsafe {
        let mut qv = [S::zero(); GT];
        for (g, x) in qv.iter_mut().enumerate() {
            *x = S::load(q.as_ptr().add(g * dp + c));
        }
        // Each line of the K rows a step ahead once (from the chunk that starts it),
        // spread over the rows read.
        let starts_line = (c * size_of::<E>()).is_multiple_of(64);
        for (i, row) in rows.iter().enumerate() {
            if starts_line {
                S::prefetch_l2(ahead[i].add(c).cast());
            }
            let kv = load_chunk::<S, E>(row.add(c), count);
            for g in 0..GT {
                acc[g][i] = S::fma(qv[g], kv, acc[g][i]);
            }
        }
    }
}

/// `acc[g] += Σ_t p[g][t] · v[t]` for `GT` query heads over the rows of a step of the V pool `v`
/// (pool offsets `rows`; `ahead` prefetched). Each pass keeps GT heads x CB chunks of LANES dims
/// in registers (GT * CB = 4 or 8), so each widened V load serves every head and the per-row
/// loop overhead is shared by CB chunks.
///
/// # Safety
/// The CPU must support `S`; each offset in `rows` and `ahead` starts `d` elements of `v`.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
pub(crate) unsafe fn pv_tile<S: Simd, E: KvElement, const GT: usize, const CB: usize>(
    p: &[f32],
    sp: usize,
    v: &[E],
    rows: &[usize],
    ahead: &[usize],
    d: usize,
    dp: usize,
    acc: &mut [f32],
) {
    let n = rows.len();
    assert!(p.len() >= (GT - 1) * sp + n && ahead.len() == n && acc.len() >= GT * dp);
    let (full, tail) = (d / S::LANES, d % S::LANES);
    let l = S::LANES;
    // SAFETY: the asserts above and the caller bound every offset (chunks never pass d <= dp);
    // the CPU supports S (caller).
    unsafe {
        let mut c = 0;
        while c + CB <= full {
            pv_chunks::<S, E, GT, CB>(p, sp, v, rows, ahead, dp, c * l, l, acc);
            c += CB;
        }
        while c < full {
            pv_chunks::<S, E, GT, 1>(p, sp, v, rows, ahead, dp, c * l, l, acc);
            c += 1;
        }
        if tail > 0 {
            pv_chunks::<S, E, GT, 1>(p, sp, v, rows, ahead, dp, full * l, tail, acc);
        }
    }
}

/// `CB` consecutive chunks starting at dim `c`; the last holds `count` (<= LANES) dims.
/// (Index loops: the register tile is addressed by head and chunk at once.)
#[allow(clippy::too_many_arguments, clippy::needless_range_loop)]
#[inline(always)]
unsafe fn pv_chunks<S: Simd, E: KvElement, const GT: usize, const CB: usize>(
    p: &[f32],
    sp: usize,
    v: &[E],
    rows: &[usize],
    ahead: &[usize],
    dp: usize,
    c: usize,
    count: usize,
    acc: &mut [f32],
) {
    // SAFETY: the caller (pv_tile) bounds every offset: the rows at `rows` and `ahead` (only
    // prefetched) of `v`, dims c + (CB - 1) * LANES + count <= d, p[g * sp + t] for g < GT and
    // t < rows.len(), acc[g * dp + c..][..CB * LANES].
    unsafe {
        let mut o = [[S::zero(); CB]; GT];
        let mut prow = [p.as_ptr(); GT];
        for g in 0..GT {
            for j in 0..CB {
                o[g][j] = S::load(acc.as_ptr().add(g * dp + c + j * S::LANES));
            }
            prow[g] = p.as_ptr().add(g * sp);
        }
        // Each line of the V tile ahead once (from the chunk that starts it), as these chunks'
        // rows are read.
        let starts_line: [bool; CB] = std::array::from_fn(|j| ((c + j * S::LANES) * size_of::<E>()).is_multiple_of(64));
        for (t, (&r, &a)) in rows.iter().zip(ahead).enumerate() {
            let (vrow, arow) = (v.as_ptr().add(r + c), v.as_ptr().add(a + c));
            let mut vv = [S::zero(); CB];
            for (j, x) in vv.iter_mut().enumerate() {
                if starts_line[j] {
                    S::prefetch_l2(arow.add(j * S::LANES).cast());
                }
                *x = load_chunk::<S, E>(vrow.add(j * S::LANES), if j + 1 == CB { count } else { S::LANES });
            }
            for g in 0..GT {
                let pg = S::splat(*prow[g].add(t));
                for j in 0..CB {
                    o[g][j] = S::fma(pg, vv[j], o[g][j]);
                }
            }
        }
        for g in 0..GT {
            for j in 0..CB {
                S::store(acc.as_mut_ptr().add(g * dp + c + j * S::LANES), o[g][j]);
            }
        }
    }
}
