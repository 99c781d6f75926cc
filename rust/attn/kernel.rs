//! One work item of paged decode attention — a (sequence, KV head, token chunk) — written once
//! over the `Simd` primitives. The chunk is walked a few blocks at a time (a step, their rows
//! interleaved: `Geometry::streams`) with an online (single-pass) softmax; q·k and p·v widen K/V
//! rows to f32 (`widen.rs`) or run on the tier's int8/bf16 dot products where they fit
//! (`dot.rs`). The result is an unnormalised partial (acc, max, sum) that `split.rs` merges
//! FlashDecoding-style.

use std::ops::Range;

use crate::attn::dot::{self, group_tile};
use crate::attn::rotation;
use crate::attn::simd::Simd;
use crate::attn::types::{Element, Geometry, KvElement, Rows, Scratch, MAX_STEP_ROWS};
use crate::attn::widen::{pv_tile, qk_tile};

/// What one item reads. Slices are pre-checked by `check.rs`; indexing below still bounds-checks
/// every row slice, so a bug can panic but never read out of bounds.
pub(crate) struct Item<'a, Q, K> {
    /// `[group, head_dim]` query rows of this KV head's group.
    pub q: &'a [Q],
    /// One layer's K and V slices (`Pools`): the tile of (block, KV head) at `(block *
    /// num_kv_heads + kv_head) * tile_stride` tiles.
    pub k: &'a [K],
    pub v: &'a [K],
    /// With scaled (int8) pools, one layer of their row scales, laid out as the rows are; empty
    /// otherwise.
    pub k_scale: &'a [f32],
    pub v_scale: &'a [f32],
    /// The sequence's block-table row.
    pub blocks: &'a [i32],
    pub kv_head: usize,
    /// Token range `[start, end)`; `start` is a multiple of the block size.
    pub start: usize,
    pub end: usize,
    /// The sequence's first attended position (a sliding window's; 0 otherwise): rows before it
    /// in the item's first block are masked out.
    pub first: usize,
    pub scale: f32,
    /// Soft-capping of the scaled scores (`DecodeParams::softcap`).
    pub softcap: Option<f32>,
    /// The item this thread most likely runs next: its first tiles are prefetched during this
    /// item's last blocks, so the switch does not stall on cold misses.
    pub next: Option<NextItem<'a>>,
}

/// The part of the following item that prefetching needs.
pub(crate) struct NextItem<'a> {
    pub blocks: &'a [i32],
    pub kv_head: usize,
    pub start: usize,
    pub end: usize,
}

/// The tiles of one step of the block loop: `whole` full blocks, their rows interleaved
/// (`Geometry::streams`), then the item's partial last block when it fits beside them. A partial
/// block ran as a step of its own: each step pays a softmax update and the pair packing per
/// head, about a fifth of a 64-token item of SmolLM2 (group 3, head_dim 64).
#[derive(Clone, Copy)]
struct Step {
    whole: usize,
    partial: bool,
}

impl Step {
    /// The step from block index `b` of an item of `full` full blocks out of `last`.
    #[inline(always)]
    fn at(geo: &Geometry, b: usize, full: usize, last: usize) -> Step {
        let whole = if b < full { geo.streams().min(full - b) } else { 0 };
        Step { whole, partial: b + whole == full && full < last && whole < geo.streams() }
    }

    fn tiles(self) -> usize {
        self.whole + usize::from(self.partial)
    }

    /// Where row `t` of the step's tile `j` sits: row `t` of whole tile `j` at `t * whole + j`,
    /// the partial block's rows after every whole tile's.
    #[inline(always)]
    fn position(self, j: usize, t: usize, block_size: usize) -> usize {
        if j < self.whole {
            t * self.whole + j
        } else {
            self.whole * block_size + t
        }
    }
}

/// Pool range of the whole tile of block `blocks[b]`, KV head `kv_head`.
#[inline(always)]
fn tile_range(geo: &Geometry, blocks: &[i32], kv_head: usize, b: usize) -> Range<usize> {
    let tile = geo.block_size * geo.head_dim;
    let offset = (blocks[b] as usize * geo.num_kv_heads + kv_head) * geo.tile_stride * tile;
    offset..offset + tile
}

impl<Q, K> Item<'_, Q, K> {
    /// For block index `b` of the sequence: the number of tokens in it, and the pool ranges of
    /// this head's tile and of the tile to prefetch — a step (`Geometry::streams`) ahead, running
    /// on into the next item, or the current one at the very end (a harmless hint that keeps the
    /// hot loops branch-free). Both ranges hold at least `n` rows.
    #[inline(always)]
    fn block_tile(&self, geo: &Geometry, b: usize) -> (usize, Range<usize>, Range<usize>) {
        let bs = geo.block_size;
        let n = self.end.min((b + 1) * bs) - b * bs;
        let mut current = tile_range(geo, self.blocks, self.kv_head, b);
        current.end = current.start + n * geo.head_dim;
        let (ahead, last) = (b + geo.streams(), self.end.div_ceil(bs));
        let ahead = if ahead < last {
            tile_range(geo, self.blocks, self.kv_head, ahead)
        } else {
            match &self.next {
                Some(nx) if nx.start / bs + ahead - last < nx.end.div_ceil(bs) => {
                    tile_range(geo, nx.blocks, nx.kv_head, nx.start / bs + ahead - last)
                }
                _ => current.clone(),
            }
        };
        (n, current, ahead)
    }

    /// The step `step` from block index `b`: the pool offset of each of its rows into `rows` and
    /// of the same row of the tile to prefetch into `ahead`, at `Step::position`; prefetches the
    /// row scales of the tiles ahead. Returns the number of rows. Every row lies inside both pool
    /// slices (asserted), so the pointers the loops derive from them stay in bounds.
    ///
    /// # Safety
    /// The CPU must support `S`.
    #[inline(always)]
    unsafe fn step_rows<S: Simd>(
        &self,
        geo: &Geometry,
        b: usize,
        step: Step,
        rows: &mut [usize],
        ahead: &mut [usize],
    ) -> usize
    where
        K: KvElement,
    {
        let (d, len) = (geo.head_dim, self.k.len().min(self.v.len()));
        let mut n = 0;
        for j in 0..step.tiles() {
            let (m, tile, next) = self.block_tile(geo, b + j);
            assert!(tile.end <= len && next.end <= len);
            // SAFETY: forwarded caller contract.
            unsafe { prefetch_scales::<S, Q, K>(self, geo, &next) };
            for t in 0..m {
                let u = step.position(j, t, geo.block_size);
                (rows[u], ahead[u]) = (tile.start + t * d, next.start + t * d);
            }
            n += m;
        }
        n
    }
}

/// Computes one item into `partial` (`geo.partial_len()` values). With dot products `DOT`
/// (`dot.rs`) fitting the pool's element, q·k and p·v run on them.
///
/// # Safety
/// The CPU must support `S` (and its dot products `DOT`); `scratch` must come from
/// `Scratch::new(geo, S::LANES)`.
#[inline(always)]
pub(crate) unsafe fn attend_item<S: Simd, Q: Element, K: KvElement, const DOT: u8>(
    it: &Item<'_, Q, K>,
    geo: &Geometry,
    scratch: &mut Scratch,
    partial: &mut [f32],
) {
    let (d, group, tiled) = (geo.head_dim, geo.group, geo.tiled_group());
    let (dp, sp) = (scratch.padded_dim, scratch.score_stride);
    assert!(dp.is_multiple_of(S::LANES) && sp.is_multiple_of(S::LANES) && partial.len() == geo.partial_len());
    assert!(it.q.len() == group * d && it.start.is_multiple_of(geo.block_size) && it.start < it.end);

    for g in 0..group {
        let row = &mut scratch.q[g * dp..(g + 1) * dp];
        for (x, y) in row.iter_mut().zip(&it.q[g * d..(g + 1) * d]) {
            *x = y.to_f32() * it.scale;
        }
    }
    if K::SCALED {
        // int8 rows are stored rotated: score them against q rotated the same way.
        for g in 0..group {
            rotation::rotate(&mut scratch.q[g * dp..g * dp + d]);
        }
    }
    scratch.acc.fill(0.0);
    scratch.max.fill(f32::NEG_INFINITY);
    scratch.sum.fill(0.0);
    let dot_kv = Rows::of::<K, DOT>(it.k).zip(Rows::of::<K, DOT>(it.v));
    if let Some((k, _)) = dot_kv {
        k.prepare_q::<S, Q>(scratch, it.q, group, tiled, d);
    }

    let bs = geo.block_size;
    let (first, last, full) = (it.start / bs, it.end.div_ceil(bs), it.end / bs);
    // The tiles the loop below does not prefetch itself (warm already when the previous item
    // ran on this thread and looked ahead into this one).
    for b in first..last.min(first + geo.streams()) {
        let tile = tile_range(geo, it.blocks, it.kv_head, b);
        // SAFETY: the CPU supports S (caller); a prefetch never faults.
        unsafe {
            prefetch_lines::<S, K>(&it.k[tile.clone()]);
            prefetch_lines::<S, K>(&it.v[tile.clone()]);
            prefetch_scales::<S, Q, K>(it, geo, &tile);
        }
    }
    let (mut row_buf, mut ahead_buf) = ([0usize; MAX_STEP_ROWS], [0usize; MAX_STEP_ROWS]);
    let mut b = first;
    while b < last {
        let step = Step::at(geo, b, full, last);
        // SAFETY: the CPU supports S (caller).
        let n = unsafe { it.step_rows::<S>(geo, b, step, &mut row_buf, &mut ahead_buf) };
        // Rows of this step before the first attended position (only in the window's first block).
        let masked = it.first.saturating_sub(b * bs).min(bs);
        b += step.tiles();
        let (rows, ahead) = (&row_buf[..n], &ahead_buf[..n]);
        // SAFETY: (whole step) the CPU supports S (caller); every row lies in both pool slices
        // (`step_rows`), and every slice length a helper relies on is asserted inside it.
        unsafe {
            if let Some((dk, _)) = dot_kv {
                dot::qk::<S>(scratch, tiled, dk, rows, ahead, d, it.scale);
            } else {
                let mut g0 = 0;
                while g0 < tiled {
                    let gt = group_tile(tiled - g0);
                    let (q, sc, k) = (&scratch.q[g0 * dp..], &mut scratch.scores[g0 * sp..], it.k);
                    match (S::LANES, gt) {
                        (16, 4) => qk_tile::<S, K, 4, 4>(q, k, rows, ahead, d, dp, sc, sp),
                        (16, 2) => qk_tile::<S, K, 2, 8>(q, k, rows, ahead, d, dp, sc, sp),
                        (16, _) => qk_tile::<S, K, 1, 16>(q, k, rows, ahead, d, dp, sc, sp),
                        (8, 4) => qk_tile::<S, K, 4, 2>(q, k, rows, ahead, d, dp, sc, sp),
                        (8, 2) => qk_tile::<S, K, 2, 4>(q, k, rows, ahead, d, dp, sc, sp),
                        (8, _) => qk_tile::<S, K, 1, 8>(q, k, rows, ahead, d, dp, sc, sp),
                        (4, 4) => qk_tile::<S, K, 4, 1>(q, k, rows, ahead, d, dp, sc, sp),
                        (4, 2) => qk_tile::<S, K, 2, 2>(q, k, rows, ahead, d, dp, sc, sp),
                        _ => qk_tile::<S, K, 1, 4>(q, k, rows, ahead, d, dp, sc, sp),
                    }
                    g0 += gt;
                }
            }
            // int8 rows: score_t = k_scale_t * (q . k_t), and each probability weighs its V row
            // times v_scale_t (after the softmax sum, which is over the probabilities alone).
            // The scales are staged zero-padded to the score stride, then applied a vector at a
            // time (entries past n are overwritten by the softmax step, or multiplied by 0).
            if K::SCALED {
                let (ks, vs) = (&mut scratch.k_scale[..sp], &mut scratch.v_scale[..sp]);
                // Tile j's rows sit at `step.position(j, _)`, its scales in one run.
                for j in 0..step.tiles() {
                    let m = if j < step.whole { bs } else { n - step.whole * bs };
                    let row0 = rows[step.position(j, 0, bs)] / d;
                    let (kr, vr) = (&it.k_scale[row0..row0 + m], &it.v_scale[row0..row0 + m]);
                    for t in 0..m {
                        let u = step.position(j, t, bs);
                        (ks[u], vs[u]) = (kr[t], vr[t]);
                    }
                }
                ks[n..].fill(0.0);
                vs[n..].fill(0.0);
            }
            for g in 0..group {
                let scores = &mut scratch.scores[g * sp..(g + 1) * sp];
                if K::SCALED {
                    scale_scores::<S>(scores, &scratch.k_scale, n);
                }
                if let Some(cap) = it.softcap {
                    // Scalar tanh: only Gemma 2 caps, and its scores are few beside the dot products.
                    for x in &mut scores[..n] {
                        *x = cap * (*x / cap).tanh();
                    }
                }
                for t in 0..masked {
                    scores[step.position(0, t, bs)] = f32::NEG_INFINITY;
                }
                online_softmax_step::<S>(
                    scores,
                    n,
                    &mut scratch.acc[g * dp..(g + 1) * dp],
                    &mut scratch.max[g],
                    &mut scratch.sum[g],
                );
                if K::SCALED {
                    scale_scores::<S>(scores, &scratch.v_scale, n);
                }
            }
            // The padding head's scores are its q·k, zeros: as probabilities they add nothing.
            let mut g0 = 0;
            while g0 < tiled {
                let gt = group_tile(tiled - g0);
                if let (Some((_, dv)), 2.., true) = (dot_kv, gt, S::PAIR_DOTS) {
                    dot::pv_pairs::<S>(scratch, g0, gt, dv, rows, ahead, d);
                    g0 += gt;
                    continue;
                }
                let (p, acc) = (&scratch.scores[g0 * sp..], &mut scratch.acc[g0 * dp..]);
                match gt {
                    4 => pv_tile::<S, K, 4, 2>(p, sp, it.v, rows, ahead, d, dp, acc),
                    2 => pv_tile::<S, K, 2, 4>(p, sp, it.v, rows, ahead, d, dp, acc),
                    _ => pv_tile::<S, K, 1, 8>(p, sp, it.v, rows, ahead, d, dp, acc),
                }
                g0 += gt;
            }
        }
    }
    for g in 0..group {
        partial[g * d..(g + 1) * d].copy_from_slice(&scratch.acc[g * dp..g * dp + d]);
    }
    if K::SCALED {
        // Sums of rotated V rows, rotated back (the merge that follows is linear in them). A
        // plain loop, so that `rotate` inlines here under the tier's target features (passed to
        // `for_each` as a function, it ran as a baseline-SSE copy: 20% of a 64-token call).
        for row in partial[..group * d].chunks_exact_mut(d) {
            rotation::rotate(row);
        }
    }
    partial[group * d..group * (d + 1)].copy_from_slice(&scratch.max);
    partial[group * (d + 1)..].copy_from_slice(&scratch.sum);
}

/// `scores[t] *= scales[t]` for the first `n` scores, a vector at a time (up to the next multiple
/// of LANES, within both slices).
#[inline(always)]
unsafe fn scale_scores<S: Simd>(scores: &mut [f32], scales: &[f32], n: usize) {
    let padded = n.next_multiple_of(S::LANES);
    assert!(padded <= scores.len() && padded <= scales.len());
    // SAFETY: every offset c + LANES <= padded, within both slices (asserted); the CPU supports S
    // (caller).
    unsafe {
        for c in (0..padded).step_by(S::LANES) {
            let p = scores.as_mut_ptr().add(c);
            S::store(p, S::mul(S::load(p), S::load(scales.as_ptr().add(c))));
        }
    }
}

/// With int8 pools, prefetches the row scales of the K/V tile at pool range `tile` (their row
/// index is the tile's offset over head_dim): scattered 64-byte runs, one per block, whose
/// misses would otherwise stall every block.
///
/// # Safety
/// The CPU must support `S`.
#[inline(always)]
unsafe fn prefetch_scales<S: Simd, Q, K: KvElement>(it: &Item<'_, Q, K>, geo: &Geometry, tile: &Range<usize>) {
    if K::SCALED {
        let rows = tile.start / geo.head_dim..tile.end.div_ceil(geo.head_dim);
        // SAFETY: forwarded caller contract.
        unsafe {
            prefetch_lines::<S, f32>(&it.k_scale[rows.clone()]);
            prefetch_lines::<S, f32>(&it.v_scale[rows]);
        }
    }
}

/// Prefetches every cache line of `x` into L2.
///
/// # Safety
/// The CPU must support `S`.
#[inline(always)]
unsafe fn prefetch_lines<S: Simd, E>(x: &[E]) {
    let p = x.as_ptr().cast::<u8>();
    for off in (0..size_of_val(x)).step_by(64) {
        // SAFETY: in bounds of `x`; the CPU supports S (caller).
        unsafe { S::prefetch_l2(p.add(off)) };
    }
}

/// Online-softmax update for one query head over one step's scores: turns `scores[..n]` into
/// probabilities relative to the running max, rescales `acc` and the running sum when the max
/// grows. Entries from `n` up to the next multiple of LANES become (near) zero.
#[inline(always)]
unsafe fn online_softmax_step<S: Simd>(scores: &mut [f32], n: usize, acc: &mut [f32], max: &mut f32, sum: &mut f32) {
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
