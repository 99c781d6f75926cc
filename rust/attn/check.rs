//! The safe entry of the CPU attention kernel: every shape, length, block id and parameter is
//! checked here, before any unsafe code runs. PACPU trusted its caller; we do not.

use crate::error::{ensure, Result};

/// Geometry of one layer of a paged KV pool: `[num_blocks, num_kv_heads, block_size, head_dim]`
/// (the pools themselves are `[num_layers, …]` of that; callers pass one layer's slice).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PagedShape {
    pub num_blocks: usize,
    pub num_kv_heads: usize,
    pub block_size: usize,
    pub head_dim: usize,
    /// K and V interleaved in one pool, `[num_blocks, num_kv_heads, 2, block_size, head_dim]`
    /// (row scales `[num_blocks, num_kv_heads, 2, block_size]`): each (block, KV head)'s K tile
    /// followed by its V tile, so the kernel reads one run per tile pair where separate pools
    /// give it two runs half as long (scattered runs read from memory well below a streaming
    /// read, the shorter the slower). The K slice of a layer is then the pool layer less its last
    /// V tile and the V slice the pool layer from its first V tile: both index a (block, KV head)
    /// at the same offset (`Pools::interleaved`).
    pub interleaved: bool,
}

impl PagedShape {
    /// Elements in one layer of one pool (K or V).
    pub fn layer_numel(&self) -> Option<usize> {
        self.num_blocks.checked_mul(self.num_kv_heads)?.checked_mul(self.block_size)?.checked_mul(self.head_dim)
    }

    /// Elements of one (block, KV head) tile of K or V.
    pub fn tile(&self) -> usize {
        self.block_size * self.head_dim
    }

    /// Tiles from one (block, KV head) to the next in a K or V slice.
    pub fn tile_stride(&self) -> usize {
        if self.interleaved {
            2
        } else {
            1
        }
    }

    /// Elements of the K (and of the V) slice of one layer.
    pub fn slice_len(&self) -> Option<usize> {
        self.strided(self.layer_numel()?, self.tile())
    }

    /// Row scales in the K (and in the V) scale slice of one layer.
    pub fn scales_len(&self) -> Option<usize> {
        self.strided(self.layer_numel()? / self.head_dim.max(1), self.block_size)
    }

    fn strided(&self, per_pool: usize, tile: usize) -> Option<usize> {
        if self.interleaved {
            per_pool.checked_mul(2)?.checked_sub(tile)
        } else {
            Some(per_pool)
        }
    }
}

/// The sequences of one decode call: block-table rows `[num_seqs, max_blocks_per_seq]` and
/// the length of each sequence *including* the token being decoded.
#[derive(Debug, Clone, Copy)]
pub struct DecodeBatch<'a> {
    pub block_tables: &'a [i32],
    pub max_blocks_per_seq: usize,
    pub seq_lens: &'a [i32],
}

impl DecodeBatch<'_> {
    pub fn num_seqs(&self) -> usize {
        self.seq_lens.len()
    }

    /// Block-table row of sequence `s` (valid after `check_decode`).
    pub(crate) fn row(&self, s: usize) -> &[i32] {
        &self.block_tables[s * self.max_blocks_per_seq..(s + 1) * self.max_blocks_per_seq]
    }

    /// Length of sequence `s` (non-negative after `check_decode`).
    pub(crate) fn len(&self, s: usize) -> usize {
        self.seq_lens[s] as usize
    }
}

/// Head counts, the softmax scale, and the layer's attention kind.
#[derive(Debug, Clone, Copy)]
pub struct DecodeParams {
    pub num_q_heads: usize,
    pub scale: f32,
    /// Sliding window: a row attends to its last `window` positions, its own included (a
    /// sequence of length `len` to `len - window..len`); `None`: to all of them.
    pub window: Option<usize>,
    /// Soft-capping (Gemma 2): scaled scores become `cap * tanh(score / cap)` before the softmax.
    pub softcap: Option<f32>,
}

impl DecodeParams {
    /// Global attention without soft-capping.
    pub fn new(num_q_heads: usize, scale: f32) -> Self {
        DecodeParams { num_q_heads, scale, window: None, softcap: None }
    }

    /// The first position a sequence of length `len` attends to.
    pub(crate) fn first_position(&self, len: usize) -> usize {
        self.window.map_or(0, |w| len.saturating_sub(w))
    }
}

pub const MAX_HEAD_DIM: usize = 256;
pub const MAX_BLOCK_SIZE: usize = 128;

/// Checks everything a decode call reads or writes. `q_len` and `out_len` are element counts of
/// `[num_seqs, num_q_heads, head_dim]` tensors; `k_len`/`v_len` of one pool layer.
pub(crate) fn check_decode(
    shape: &PagedShape,
    batch: &DecodeBatch<'_>,
    params: &DecodeParams,
    q_len: usize,
    k_len: usize,
    v_len: usize,
    out_len: usize,
) -> Result<()> {
    let PagedShape { num_blocks, num_kv_heads, block_size, head_dim, .. } = *shape;
    ensure!(
        head_dim % 8 == 0 && (8..=MAX_HEAD_DIM).contains(&head_dim),
        Shape,
        "head_dim must be a multiple of 8 in 8..={MAX_HEAD_DIM}, got {head_dim}"
    );
    ensure!(
        block_size.is_power_of_two() && (8..=MAX_BLOCK_SIZE).contains(&block_size),
        Shape,
        "block_size must be a power of two in 8..={MAX_BLOCK_SIZE}, got {block_size}"
    );
    ensure!(num_kv_heads >= 1, Shape, "num_kv_heads must be at least 1");
    ensure!(
        params.num_q_heads >= 1 && params.num_q_heads.is_multiple_of(num_kv_heads),
        Shape,
        "num_q_heads ({}) must be a positive multiple of num_kv_heads ({num_kv_heads})",
        params.num_q_heads
    );
    ensure!(params.scale.is_finite(), Value, "softmax scale must be finite, got {}", params.scale);
    ensure!(params.window != Some(0), Value, "a sliding window must hold at least one position");
    if let Some(cap) = params.softcap {
        ensure!(cap.is_finite() && cap > 0.0, Value, "softcap must be positive and finite, got {cap}");
    }
    ensure!(
        shape.slice_len().is_some_and(|n| n == k_len && n == v_len),
        Shape,
        "K/V layer slices hold {k_len}/{v_len} elements, expected {} ({num_blocks}x{num_kv_heads}x{block_size}x{head_dim}{})",
        shape.slice_len().map_or("more than fit in memory".into(), |n| n.to_string()),
        if shape.interleaved { ", K and V interleaved" } else { "" }
    );
    let num_seqs = batch.num_seqs();
    let rows = num_seqs.checked_mul(params.num_q_heads * head_dim);
    ensure!(
        rows.is_some_and(|n| n == q_len && n == out_len),
        Shape,
        "q/out hold {q_len}/{out_len} elements, expected {num_seqs}x{}x{head_dim}",
        params.num_q_heads
    );
    ensure!(
        num_seqs.checked_mul(batch.max_blocks_per_seq) == Some(batch.block_tables.len()),
        Shape,
        "block_tables hold {} entries, expected {num_seqs}x{}",
        batch.block_tables.len(),
        batch.max_blocks_per_seq
    );
    let capacity = batch.max_blocks_per_seq.saturating_mul(block_size);
    for (s, &len) in batch.seq_lens.iter().enumerate() {
        ensure!(
            len >= 0 && (len as usize) <= capacity,
            Value,
            "seq_lens[{s}] = {len} is outside 0..={capacity} (max_blocks_per_seq x block_size)"
        );
        let used = (len as usize).div_ceil(block_size);
        for (j, &b) in batch.row(s)[..used].iter().enumerate() {
            ensure!(
                b >= 0 && (b as usize) < num_blocks,
                Value,
                "block_tables[{s}][{j}] = {b} is not a block id in 0..{num_blocks}"
            );
        }
    }
    Ok(())
}

/// Checks the row scales of int8 pools: one f32 per row of one layer, for K and for V.
pub(crate) fn check_scales(shape: &PagedShape, k_scale_len: usize, v_scale_len: usize) -> Result<()> {
    ensure!(
        shape.scales_len().is_some_and(|n| n == k_scale_len && n == v_scale_len),
        Shape,
        "k_scale/v_scale layer slices hold {k_scale_len}/{v_scale_len} values, expected {}",
        shape.scales_len().map_or("more than fit in memory".into(), |n| n.to_string())
    );
    Ok(())
}

/// Checks the fused append's new K/V rows `[num_seqs, num_kv_heads, head_dim]`; every sequence
/// must be non-empty (the new token sits at position `seq_len - 1`). Call after `check_decode`.
pub(crate) fn check_append(
    shape: &PagedShape,
    batch: &DecodeBatch<'_>,
    new_k_len: usize,
    new_v_len: usize,
) -> Result<()> {
    let n = batch.num_seqs() * shape.num_kv_heads * shape.head_dim;
    ensure!(
        new_k_len == n && new_v_len == n,
        Shape,
        "new_k/new_v hold {new_k_len}/{new_v_len} elements, expected {}x{}x{}",
        batch.num_seqs(),
        shape.num_kv_heads,
        shape.head_dim
    );
    if let Some(s) = batch.seq_lens.iter().position(|&l| l < 1) {
        return Err(crate::error::NeoError::Value(format!(
            "seq_lens[{s}] = {} but appending needs a length of at least 1",
            batch.seq_lens[s]
        )));
    }
    Ok(())
}
