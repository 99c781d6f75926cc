//! One work item of paged decode attention — a (sequence, KV head, token chunk) — written once
//! over the `Simd` primitives. Every query head of the GQA group shares each K/V row load; the
//! chunk is walked block by block with an online (single-pass) softmax, and the result is an
//! unnormalised partial (acc, max, sum) that `split.rs` merges FlashDecoding-style.

use crate::attn::element::Element;
use crate::attn::simd::Simd;

/// Blocks ahead of the current one whose K/V tiles are prefetched into L2.
const PREFETCH_BLOCKS: usize = 2;
const CACHE_LINE: usize = 64;

/// Per-call geometry shared by every item.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Geometry {
    pub head_dim: usize,
    pub block_size: usize,
    pub num_kv_heads: usize,
    /// Query heads per KV head (GQA ratio).
    pub group: usize,
}

impl Geometry {
    /// f32 values in one item's partial: `acc[group][head_dim]`, then `max[group]`, `sum[group]`.
    pub fn partial_len(&self) -> usize {
        self.group * (self.head_dim + 2)
    }
}

/// What one item reads. Slices are pre-checked by `check.rs`; indexing below still bounds-checks
/// every row slice, so a bug can panic but never read out of bounds.
pub(crate) struct Item<'a, E> {
    /// `[group, head_dim]` query rows of this KV head's group.
    pub q: &'a [E],
    /// One layer of the pools, `[num_blocks, num_kv_heads, block_size, head_dim]`.
    pub k: &'a [E],
    pub v: &'a [E],
    /// The sequence's block-table row.
    pub blocks: &'a [i32],
    pub kv_head: usize,
    /// Token range `[start, end)`; `start` is a multiple of the block size.
    pub start: usize,
    pub end: usize,
    pub scale: f32,
}

impl<E> Item<'_, E> {
    /// For block index `b` of the sequence: the number of tokens in it, the pool offset of this
    /// head's tile, and the range of the tile `PREFETCH_BLOCKS` ahead (empty near the end), which
    /// is prefetched row by row as this block's rows are read so the misses in flight stay spread.
    #[inline(always)]
    pub fn block_tile(&self, geo: &Geometry, b: usize) -> (usize, usize, std::ops::Range<usize>) {
        let (bs, tile) = (geo.block_size, geo.block_size * geo.head_dim);
        let offset = |b: usize| (self.blocks[b] as usize * geo.num_kv_heads + self.kv_head) * tile;
        let n = self.end.min((b + 1) * bs) - b * bs;
        let ahead = match b + PREFETCH_BLOCKS < self.end.div_ceil(bs) {
            true => offset(b + PREFETCH_BLOCKS)..offset(b + PREFETCH_BLOCKS) + tile,
            false => 0..0,
        };
        (n, offset(b), ahead)
    }
}

/// Per-thread f32 workspaces, sized once per call for the padded head dim (a multiple of LANES,
/// zero-filled past `head_dim` so padded lanes contribute nothing).
pub(crate) struct Scratch {
    pub padded_dim: usize,
    pub score_stride: usize,
    q: Vec<f32>,
    pub acc: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    pub scores: Vec<f32>,
    pub max: Vec<f32>,
    pub sum: Vec<f32>,
    /// bf16 probability pairs `[group][score_stride / 2]` (the BF16 dot-product tier).
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    pub pairs: Vec<u32>,
}

impl Scratch {
    pub fn new(geo: &Geometry, lanes: usize) -> Self {
        let padded_dim = geo.head_dim.next_multiple_of(lanes);
        // Scores are processed 16 f32 at a time at most, whatever the dim padding.
        let score_stride = geo.block_size.next_multiple_of(16);
        Scratch {
            padded_dim,
            score_stride,
            q: vec![0.0; geo.group * padded_dim],
            acc: vec![0.0; geo.group * padded_dim],
            k: vec![0.0; geo.block_size * padded_dim],
            v: vec![0.0; geo.block_size * padded_dim],
            scores: vec![0.0; geo.group * score_stride],
            max: vec![0.0; geo.group],
            sum: vec![0.0; geo.group],
            pairs: vec![0; geo.group * score_stride / 2],
        }
    }
}

/// Computes one item into `partial` (`geo.partial_len()` values).
///
/// # Safety
/// The CPU must support `S`; `scratch` must come from `Scratch::new(geo, S::LANES)`.
#[inline(always)]
pub(crate) unsafe fn attend_item<S: Simd, E: Element>(
    it: &Item<'_, E>,
    geo: &Geometry,
    scratch: &mut Scratch,
    partial: &mut [f32],
) {
    let (d, bs, group) = (geo.head_dim, geo.block_size, geo.group);
    let dp = scratch.padded_dim;
    let sp = scratch.score_stride;
    assert!(dp.is_multiple_of(S::LANES) && sp.is_multiple_of(S::LANES) && partial.len() == geo.partial_len());
    assert!(it.q.len() == group * d && it.start.is_multiple_of(bs) && it.start < it.end);

    for g in 0..group {
        let row = &mut scratch.q[g * dp..(g + 1) * dp];
        // SAFETY: forwarded caller contract (CPU supports S).
        unsafe { widen_row::<S, E>(&it.q[g * d..(g + 1) * d], row) };
        row.iter_mut().for_each(|x| *x *= it.scale);
    }
    scratch.acc.fill(0.0);
    scratch.max.fill(f32::NEG_INFINITY);
    scratch.sum.fill(0.0);

    for b in it.start / bs..it.end.div_ceil(bs) {
        let (n, off, ahead) = it.block_tile(geo, b);
        let (k_ahead, v_ahead) = (&it.k[ahead.clone()], &it.v[ahead]);
        // SAFETY: forwarded caller contract; the rows/scratch sizes are asserted inside.
        unsafe {
            let (k, ks) = rows_f32::<S, E>(&it.k[off..off + n * d], k_ahead, n, d, dp, &mut scratch.k);
            let mut g0 = 0;
            while g0 < group {
                let gt = group_tile(group - g0);
                let (q, sc) = (&scratch.q[g0 * dp..], &mut scratch.scores[g0 * sp..]);
                match gt {
                    8 => qk_tile::<S, 8>(q, k, ks, n, dp, sc, sp),
                    4 => qk_tile::<S, 4>(q, k, ks, n, dp, sc, sp),
                    2 => qk_tile::<S, 2>(q, k, ks, n, dp, sc, sp),
                    _ => qk_tile::<S, 1>(q, k, ks, n, dp, sc, sp),
                }
                g0 += gt;
            }
            for g in 0..group {
                online_softmax_step::<S>(
                    &mut scratch.scores[g * sp..(g + 1) * sp],
                    n,
                    &mut scratch.acc[g * dp..(g + 1) * dp],
                    &mut scratch.max[g],
                    &mut scratch.sum[g],
                );
            }
            let (v, vs) = rows_f32::<S, E>(&it.v[off..off + n * d], v_ahead, n, d, dp, &mut scratch.v);
            let mut g0 = 0;
            while g0 < group {
                let gt = group_tile(group - g0);
                let (p, acc) = (&scratch.scores[g0 * sp..], &mut scratch.acc[g0 * dp..]);
                match gt {
                    8 => pv_tile::<S, 8>(p, sp, v, vs, n, dp, acc),
                    4 => pv_tile::<S, 4>(p, sp, v, vs, n, dp, acc),
                    2 => pv_tile::<S, 2>(p, sp, v, vs, n, dp, acc),
                    _ => pv_tile::<S, 1>(p, sp, v, vs, n, dp, acc),
                }
                g0 += gt;
            }
        }
    }
    write_partial(geo, &scratch.acc, &scratch.max, &scratch.sum, partial, |g, acc, out| {
        out.copy_from_slice(&acc[g * dp..g * dp + d])
    });
}

/// Width of the next register tile of query heads when `remaining` are left: 8, 4, 2 or 1.
/// (Loops, not closures, drive the tiles: a closure would not inherit the tier's target features.)
#[inline(always)]
pub(crate) fn group_tile(remaining: usize) -> usize {
    match remaining {
        r if r >= 8 => 8,
        r if r >= 4 => 4,
        r if r >= 2 => 2,
        _ => 1,
    }
}

/// Writes `acc` (via `copy_acc(g, acc, out_row)`, which may un-permute), `max` and `sum` into the
/// partial layout of `Geometry::partial_len`.
#[inline(always)]
pub(crate) fn write_partial(
    geo: &Geometry,
    acc: &[f32],
    max: &[f32],
    sum: &[f32],
    partial: &mut [f32],
    mut copy_acc: impl FnMut(usize, &[f32], &mut [f32]),
) {
    let (d, group) = (geo.head_dim, geo.group);
    for g in 0..group {
        copy_acc(g, acc, &mut partial[g * d..(g + 1) * d]);
    }
    partial[group * d..group * (d + 1)].copy_from_slice(&max[..group]);
    partial[group * (d + 1)..].copy_from_slice(&sum[..group]);
}

/// Issues L2 prefetches for every cache line of `rows`.
///
/// # Safety
/// The CPU must support `S`.
#[inline(always)]
pub(crate) unsafe fn prefetch_rows<S: Simd, E>(rows: &[E]) {
    for off in (0..std::mem::size_of_val(rows)).step_by(CACHE_LINE) {
        // SAFETY: `off` is inside `rows`; prefetch never faults anyway.
        unsafe { S::prefetch_l2(rows.as_ptr().cast::<u8>().add(off)) };
    }
}

/// Widens `src` (`head_dim` values) into `dst` (`padded_dim` values; the tail is left as is,
/// which the scratch keeps at zero).
#[inline(always)]
unsafe fn widen_row<S: Simd, E: Element>(src: &[E], dst: &mut [f32]) {
    assert!(dst.len() >= src.len() && dst.len().is_multiple_of(S::LANES));
    let full = src.len() / S::LANES * S::LANES;
    for c in (0..full).step_by(S::LANES) {
        // SAFETY: c + LANES <= full <= src.len() <= dst.len(); the CPU supports S (caller).
        unsafe { S::store(dst.as_mut_ptr().add(c), E::widen::<S>(src.as_ptr().add(c))) };
    }
    for c in full..src.len() {
        dst[c] = src[c].to_f32();
    }
}

/// `n` rows of `head_dim` elements as f32 rows of stride `padded_dim`: the pool itself for f32
/// when no padding is needed, else widened into `buf`. Returns (rows, row stride). Prefetches
/// `ahead` (the same head's tile of a later block, or empty) on the way.
#[inline(always)]
unsafe fn rows_f32<'a, S: Simd, E: Element>(
    src: &'a [E],
    ahead: &[E],
    n: usize,
    d: usize,
    dp: usize,
    buf: &'a mut [f32],
) -> (&'a [f32], usize) {
    if d == dp {
        if let Some(rows) = E::as_f32(src) {
            // SAFETY: forwarded caller contract.
            unsafe { prefetch_rows::<S, E>(ahead) };
            return (rows, d);
        }
    }
    for t in 0..n {
        // SAFETY: forwarded caller contract.
        unsafe {
            if let Some(row) = ahead.get(t * d..(t + 1) * d) {
                prefetch_rows::<S, E>(row);
            }
            widen_row::<S, E>(&src[t * d..(t + 1) * d], &mut buf[t * dp..(t + 1) * dp]);
        }
    }
    (&buf[..n * dp], dp)
}

/// `scores[g][t] = q[g] · k[t]` for `GT` query heads (rows `dp` apart) and `n` key rows.
#[inline(always)]
unsafe fn qk_tile<S: Simd, const GT: usize>(
    q: &[f32],
    k: &[f32],
    ks: usize,
    n: usize,
    dp: usize,
    scores: &mut [f32],
    sp: usize,
) {
    assert!(q.len() >= GT * dp && k.len() >= (n - 1) * ks + dp && scores.len() >= (GT - 1) * sp + n);
    for t in 0..n {
        // SAFETY: the asserts above bound every offset: c + LANES <= dp for rows t < n, g < GT.
        unsafe {
            let krow = k.as_ptr().add(t * ks);
            let mut acc = [S::zero(); GT];
            for c in (0..dp).step_by(S::LANES) {
                let kv = S::load(krow.add(c));
                for (g, a) in acc.iter_mut().enumerate() {
                    *a = S::fma(S::load(q.as_ptr().add(g * dp + c)), kv, *a);
                }
            }
            for (g, a) in acc.iter().enumerate() {
                scores[g * sp + t] = S::reduce_add(*a);
            }
        }
    }
}

/// Online-softmax step for one query head over one tile: turns `scores[..n]` into
/// probabilities relative to the running max, rescales `acc` and the running sum when the max
/// grows. Entries from `n` up to the next multiple of LANES become (near) zero.
#[inline(always)]
pub(crate) unsafe fn online_softmax_step<S: Simd>(
    scores: &mut [f32],
    n: usize,
    acc: &mut [f32],
    max: &mut f32,
    sum: &mut f32,
) {
    let padded = n.next_multiple_of(S::LANES);
    assert!(acc.len().is_multiple_of(S::LANES) && padded <= scores.len());
    scores[n..padded].fill(f32::NEG_INFINITY);
    // SAFETY: every offset c + LANES <= padded <= scores.len(), or <= acc.len() (a multiple of
    // LANES); the CPU supports S (caller).
    unsafe {
        let mut mv = S::splat(f32::NEG_INFINITY);
        for c in (0..padded).step_by(S::LANES) {
            mv = S::max(mv, S::load(scores.as_ptr().add(c)));
        }
        let new_max = max.max(S::reduce_max(mv));
        if new_max > *max && *max != f32::NEG_INFINITY {
            let alpha = (*max - new_max).exp();
            *sum *= alpha;
            let a = S::splat(alpha);
            for c in (0..acc.len()).step_by(S::LANES) {
                let p = acc.as_mut_ptr().add(c);
                S::store(p, S::mul(S::load(p), a));
            }
        }
        *max = new_max;
        let (m, mut total) = (S::splat(new_max), S::zero());
        for c in (0..padded).step_by(S::LANES) {
            let p = scores.as_mut_ptr().add(c);
            let e = S::exp(S::sub(S::load(p), m));
            S::store(p, e);
            total = S::add(total, e);
        }
        *sum += S::reduce_add(total);
    }
}

/// `acc[g] += Σ_t p[g][t] · v[t]` for `GT` query heads; each V row load is shared by the tile.
#[inline(always)]
unsafe fn pv_tile<S: Simd, const GT: usize>(
    p: &[f32],
    sp: usize,
    v: &[f32],
    vs: usize,
    n: usize,
    dp: usize,
    acc: &mut [f32],
) {
    assert!(p.len() >= (GT - 1) * sp + n && v.len() >= (n - 1) * vs + dp && acc.len() >= GT * dp);
    for c in (0..dp).step_by(S::LANES) {
        // SAFETY: the asserts above bound every offset: c + LANES <= dp, t < n, g < GT.
        unsafe {
            let mut o: [S::V; GT] = std::array::from_fn(|g| S::load(acc.as_ptr().add(g * dp + c)));
            for t in 0..n {
                let vv = S::load(v.as_ptr().add(t * vs + c));
                for (g, og) in o.iter_mut().enumerate() {
                    *og = S::fma(S::splat(*p.get_unchecked(g * sp + t)), vv, *og);
                }
            }
            for (g, og) in o.iter().enumerate() {
                S::store(acc.as_mut_ptr().add(g * dp + c), *og);
            }
        }
    }
}
