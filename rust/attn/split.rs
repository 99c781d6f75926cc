//! Work split and merge (FlashDecoding-style): the batch is cut into (sequence, KV head, chunk)
//! items sized so every thread gets several, whether the batch is one 32k-token sequence or 256
//! short ones; items run on the pool, then each (sequence, KV head) merges its chunks' partials by
//! log-sum-exp into the output (in the same pass when no sequence needed cutting).

use std::marker::PhantomData;

use rayon::prelude::*;
use rayon::ThreadPool;

use crate::attn::check::{DecodeBatch, DecodeParams, PagedShape};
use crate::attn::kernel::{Item, NextItem};
use crate::attn::types::{Element, Geometry, KvElement, Scratch};
use crate::team::Team;

/// Items each thread should get when the batch is big enough (room for work stealing).
const ITEMS_PER_THREAD: usize = 4;
/// Never cut a sequence into chunks shorter than this many tokens (merge and scratch overheads).
const MIN_CHUNK_TOKENS: usize = 512;

/// One tier's item function and its vector width (which sizes the scratch padding).
pub(crate) struct Kernel<Q, K> {
    pub lanes: usize,
    /// # Safety
    /// Only constructed for tiers the running CPU supports.
    pub item: unsafe fn(&Item<'_, Q, K>, &Geometry, &mut Scratch, &mut [f32]),
}

/// One layer of the K and V pools, with their row scales when `K` is scaled (else empty): each
/// `[num_blocks, num_kv_heads, block_size, head_dim]` (scales without head_dim), or the two
/// overlapping views of an interleaved layer (`PagedShape::interleaved`, `Pools::interleaved`).
pub struct Pools<'a, K> {
    pub k: &'a [K],
    pub v: &'a [K],
    pub k_scale: &'a [f32],
    pub v_scale: &'a [f32],
}

impl<'a, K> Pools<'a, K> {
    /// The K and V slices of one layer `kv` of an interleaved pool (`PagedShape::interleaved`),
    /// and of its row scales `scales` (empty for an unscaled pool).
    pub fn interleaved(kv: &'a [K], scales: &'a [f32], shape: &PagedShape) -> Self {
        let (tile, bs) = (shape.tile().min(kv.len()), shape.block_size.min(scales.len()));
        Pools {
            k: &kv[..kv.len() - tile],
            v: &kv[tile..],
            k_scale: &scales[..scales.len() - bs],
            v_scale: &scales[bs..],
        }
    }
}

struct ItemSpec {
    seq: usize,
    kv_head: usize,
    start: usize,
    end: usize,
}

/// Where a call's items run.
pub(crate) enum Workers<'a> {
    /// The calling thread alone.
    Caller,
    /// The engine's rayon pool.
    Pool(&'a ThreadPool),
    /// The calling thread's OpenMP team (`team.rs`).
    Team(Team),
}

impl Workers<'_> {
    fn threads(&self) -> usize {
        match self {
            Workers::Caller => 1,
            Workers::Pool(pool) => pool.current_num_threads(),
            Workers::Team(team) => team.threads(),
        }
    }

    /// `f(state, i)` for every `i` in `0..n`, each worker with its own `state` from `init`.
    fn for_each_init<S>(&self, n: usize, init: impl Fn() -> S + Sync + Send, f: impl Fn(&mut S, usize) + Sync + Send) {
        match self {
            Workers::Caller => {
                let mut state = init();
                (0..n).for_each(|i| f(&mut state, i));
            }
            Workers::Pool(pool) => pool.install(|| (0..n).into_par_iter().for_each_init(init, f)),
            Workers::Team(team) => team.for_each_init(n, init, f),
        }
    }
}

/// A slice cut into chunks that the workers of one `for_each_init` write, chunk `i` by the call
/// for index `i` alone.
struct Chunks<'a, T> {
    ptr: *mut T,
    len: usize,
    chunk: usize,
    _slice: PhantomData<&'a mut [T]>,
}

// SAFETY: a `Chunks` hands out disjoint `&mut` chunks of a slice it borrows mutably; sharing it
// across threads is sharing that `&mut [T]`, sound for `T: Send`.
unsafe impl<T: Send> Sync for Chunks<'_, T> {}

impl<'a, T> Chunks<'a, T> {
    fn new(slice: &'a mut [T], chunk: usize) -> Self {
        Chunks { ptr: slice.as_mut_ptr(), len: slice.len(), chunk, _slice: PhantomData }
    }

    /// # Safety
    /// No two live references may come from the same `i`.
    #[allow(clippy::mut_from_ref)]
    unsafe fn get(&self, i: usize) -> &mut [T] {
        let start = (i * self.chunk).min(self.len);
        let end = (start + self.chunk).min(self.len);
        // SAFETY: in bounds of the borrowed slice; disjoint from every other index's chunk,
        // and the caller takes each index once.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(start), end - start) }
    }
}

/// Runs a checked decode call on `workers`. `partials` is a reusable workspace.
#[allow(clippy::too_many_arguments)]
pub(crate) fn run<Q: Element, K: KvElement>(
    kernel: &Kernel<Q, K>,
    workers: &Workers<'_>,
    q: &[Q],
    kv: &Pools<'_, K>,
    shape: &PagedShape,
    batch: &DecodeBatch<'_>,
    params: &DecodeParams,
    out: &mut [Q],
    partials: &mut Vec<f32>,
) {
    let geo = Geometry {
        head_dim: shape.head_dim,
        block_size: shape.block_size,
        num_kv_heads: shape.num_kv_heads,
        group: params.num_q_heads / shape.num_kv_heads,
        tile_stride: shape.tile_stride(),
    };
    let (items, first_item) = plan(&geo, batch, params, workers.threads());
    let pl = geo.partial_len();
    let group_len = geo.group * geo.head_dim;
    let attend = |scratch: &mut Scratch, i: usize, partial: &mut [f32]| {
        let spec = &items[i];
        // Each thread runs consecutive items, so i + 1 usually runs next.
        let next = items.get(i + 1).map(|nx| NextItem {
            blocks: batch.row(nx.seq),
            kv_head: nx.kv_head,
            start: nx.start,
            end: nx.end,
        });
        let q_off = (spec.seq * geo.num_kv_heads + spec.kv_head) * group_len;
        let item = Item {
            q: &q[q_off..q_off + group_len],
            k: kv.k,
            v: kv.v,
            k_scale: kv.k_scale,
            v_scale: kv.v_scale,
            blocks: batch.row(spec.seq),
            kv_head: spec.kv_head,
            start: spec.start,
            end: spec.end,
            first: params.first_position(batch.len(spec.seq)),
            scale: params.scale,
            softcap: params.softcap,
            next,
        };
        // SAFETY: `kernel` only exists for tiers this CPU supports, and the scratch was made
        // for its lane count.
        unsafe { (kernel.item)(&item, &geo, scratch, partial) };
    };
    let merge_pair = |sh: usize, out: &mut [Q], partials: &[f32]| {
        merge(&geo, &partials[first_item[sh] * pl..first_item[sh + 1] * pl], out);
    };
    let pairs = out.len() / group_len;
    let outs = Chunks::new(out, group_len);
    if first_item.windows(2).all(|w| w[1] - w[0] <= 1) {
        // No sequence was cut into chunks: one pass, each (sequence, head) attended and
        // normalised straight into `out`, its partial never leaving the thread's cache.
        let fused = |(scratch, partial): &mut (Scratch, Vec<f32>), sh: usize| {
            let n = first_item[sh + 1] - first_item[sh];
            if n == 1 {
                attend(scratch, first_item[sh], partial);
            }
            // SAFETY: `for_each_init` passes each `sh` once.
            merge(&geo, &partial[..n * pl], unsafe { outs.get(sh) });
        };
        workers.for_each_init(pairs, || (Scratch::new(&geo, kernel.lanes), vec![0.0; pl]), fused);
        return;
    }
    partials.resize(items.len() * pl, 0.0);
    let parts = Chunks::new(partials, pl);
    workers.for_each_init(
        items.len(),
        || Scratch::new(&geo, kernel.lanes),
        // SAFETY: `for_each_init` passes each item once.
        |scratch, i| attend(scratch, i, unsafe { parts.get(i) }),
    );
    let partials = &partials[..];
    // SAFETY: `for_each_init` passes each pair once.
    let merged = |_: &mut (), sh: usize| merge_pair(sh, unsafe { outs.get(sh) }, partials);
    workers.for_each_init(pairs, || (), merged);
}

/// Cuts the batch into items; `first_item[s * num_kv_heads + h]` is the first item of that pair
/// (items of a pair are consecutive; empty sequences have none). Under a sliding window a
/// sequence's items start at the block holding its first attended position.
fn plan(geo: &Geometry, batch: &DecodeBatch<'_>, params: &DecodeParams, threads: usize) -> (Vec<ItemSpec>, Vec<usize>) {
    let bs = geo.block_size;
    let skipped = |len: usize| params.first_position(len) / bs * bs;
    let total: usize =
        (0..batch.num_seqs()).map(|s| batch.len(s) - skipped(batch.len(s))).sum::<usize>() * geo.num_kv_heads;
    let chunk = if threads <= 1 {
        usize::MAX
    } else {
        (total / (threads * ITEMS_PER_THREAD)).max(MIN_CHUNK_TOKENS).next_multiple_of(geo.block_size)
    };
    let mut items = Vec::new();
    let mut first_item = Vec::with_capacity(batch.num_seqs() * geo.num_kv_heads + 1);
    for seq in 0..batch.num_seqs() {
        let len = batch.len(seq);
        for kv_head in 0..geo.num_kv_heads {
            first_item.push(items.len());
            let mut start = skipped(len);
            while start < len {
                let end = len.min(start.saturating_add(chunk));
                items.push(ItemSpec { seq, kv_head, start, end });
                start = end;
            }
        }
    }
    first_item.push(items.len());
    (items, first_item)
}

/// Log-sum-exp merge of one (sequence, KV head)'s partials into its `[group, head_dim]` output.
fn merge<E: Element>(geo: &Geometry, partials: &[f32], out: &mut [E]) {
    let (d, group, pl) = (geo.head_dim, geo.group, geo.partial_len());
    if partials.is_empty() {
        out.fill(E::from_f32(0.0));
        return;
    }
    let max_of = |p: &[f32], g: usize| p[group * d + g];
    let sum_of = |p: &[f32], g: usize| p[group * (d + 1) + g];
    for g in 0..group {
        let out = &mut out[g * d..(g + 1) * d];
        if partials.len() == pl {
            let inv = 1.0 / sum_of(partials, g);
            for (o, a) in out.iter_mut().zip(&partials[g * d..(g + 1) * d]) {
                *o = E::from_f32(a * inv);
            }
            continue;
        }
        let global_max = partials.chunks(pl).map(|p| max_of(p, g)).fold(f32::NEG_INFINITY, f32::max);
        let weights: Vec<f32> = partials.chunks(pl).map(|p| (max_of(p, g) - global_max).exp()).collect();
        let total: f32 = partials.chunks(pl).zip(&weights).map(|(p, w)| w * sum_of(p, g)).sum();
        for (i, o) in out.iter_mut().enumerate() {
            let x: f32 = partials.chunks(pl).zip(&weights).map(|(p, w)| w * p[g * d + i]).sum();
            *o = E::from_f32(x / total);
        }
    }
}
