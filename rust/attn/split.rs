//! Work split and merge (FlashDecoding-style): the batch is cut into (sequence, KV head, chunk)
//! items sized so every thread gets several, whether the batch is one 32k-token sequence or 256
//! short ones; items run on the pool, then each (sequence, KV head) merges its chunks' partials by
//! log-sum-exp into the output (in the same pass when no sequence needed cutting).

use rayon::prelude::*;
use rayon::ThreadPool;

use crate::attn::check::{DecodeBatch, DecodeParams, PagedShape};
use crate::attn::element::{Element, KvElement};
use crate::attn::kernel::{Geometry, Item, NextItem, Scratch};

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

/// One layer of the K and V pools, with their row scales when `K` is scaled (else empty).
pub struct Pools<'a, K> {
    pub k: &'a [K],
    pub v: &'a [K],
    pub k_scale: &'a [f32],
    pub v_scale: &'a [f32],
}

struct ItemSpec {
    seq: usize,
    kv_head: usize,
    start: usize,
    end: usize,
}

/// Runs a checked decode call on `pool`, or on the calling thread when `pool` is `None`.
/// `partials` is a reusable workspace.
#[allow(clippy::too_many_arguments)]
pub(crate) fn run<Q: Element, K: KvElement>(
    kernel: &Kernel<Q, K>,
    pool: Option<&ThreadPool>,
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
    };
    let (items, first_item) = plan(&geo, batch, pool.map_or(1, ThreadPool::current_num_threads));
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
            scale: params.scale,
            next,
        };
        // SAFETY: `kernel` only exists for tiers this CPU supports, and the scratch was made
        // for its lane count.
        unsafe { (kernel.item)(&item, &geo, scratch, partial) };
    };
    let merge_pair = |sh: usize, out: &mut [Q], partials: &[f32]| {
        merge(&geo, &partials[first_item[sh] * pl..first_item[sh + 1] * pl], out);
    };
    if first_item.windows(2).all(|w| w[1] - w[0] <= 1) {
        // No sequence was cut into chunks: one pass, each (sequence, head) attended and
        // normalised straight into `out`, its partial never leaving the thread's cache.
        let fused = |(scratch, partial): &mut (Scratch, Vec<f32>), (sh, out): (usize, &mut [Q])| {
            let n = first_item[sh + 1] - first_item[sh];
            if n == 1 {
                attend(scratch, first_item[sh], partial);
            }
            merge(&geo, &partial[..n * pl], out);
        };
        let init = || (Scratch::new(&geo, kernel.lanes), vec![0.0; pl]);
        match pool {
            Some(pool) => pool.install(|| out.par_chunks_mut(group_len).enumerate().for_each_init(init, fused)),
            None => {
                let mut state = init();
                out.chunks_mut(group_len).enumerate().for_each(|g| fused(&mut state, g));
            }
        }
        return;
    }
    partials.resize(items.len() * pl, 0.0);
    match pool {
        Some(pool) => pool.install(|| {
            partials.par_chunks_mut(pl).enumerate().for_each_init(
                || Scratch::new(&geo, kernel.lanes),
                |scratch, (i, partial)| attend(scratch, i, partial),
            );
            let partials = &partials[..];
            out.par_chunks_mut(group_len).enumerate().for_each(|(sh, out)| merge_pair(sh, out, partials));
        }),
        None => {
            let mut scratch = Scratch::new(&geo, kernel.lanes);
            for (i, partial) in partials.chunks_mut(pl).enumerate() {
                attend(&mut scratch, i, partial);
            }
            for (sh, out) in out.chunks_mut(group_len).enumerate() {
                merge_pair(sh, out, partials);
            }
        }
    }
}

/// Cuts the batch into items; `first_item[s * num_kv_heads + h]` is the first item of that pair
/// (items of a pair are consecutive; empty sequences have none).
fn plan(geo: &Geometry, batch: &DecodeBatch<'_>, threads: usize) -> (Vec<ItemSpec>, Vec<usize>) {
    let total: usize = (0..batch.num_seqs()).map(|s| batch.len(s)).sum::<usize>() * geo.num_kv_heads;
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
            let mut start = 0;
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
