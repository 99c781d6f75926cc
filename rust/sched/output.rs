//! The per-iteration plan (vLLM's `SchedulerOutput`): which requests run how many tokens, the
//! swaps to apply first, and the flat model inputs, built here so Python never loops per token.

use super::request::{Request, RequestId};
use crate::kv::{Device, KvManager, SwapPlan};

/// One request's share of an iteration.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ScheduledRequest {
    pub id: RequestId,
    /// Tokens already in the cache before this iteration.
    pub num_computed_tokens: usize,
    /// Tokens this iteration runs (1 for a decode, a chunk for a prefill).
    pub num_new_tokens: usize,
    /// Whether the last row is sampled (the request is caught up after this iteration).
    pub sample: bool,
    /// The pool its attention reads this iteration (`Cpu`: a CPU decode).
    pub device: Device,
    /// NEO sub-batch: 0 (prefills, GPU decodes, some CPU decodes) or 1 (CPU decodes only).
    pub sub_batch: u8,
}

impl ScheduledRequest {
    /// Whether its rows attend on the CPU over the host pool (the kernel appends their K/V):
    /// a CPU decode, or under `neo` a prompt decoded in place over host-tier prefix blocks.
    /// Host prefills (whole prompts bound for the host pool) attend on the device.
    pub fn attends_on_cpu(&self) -> bool {
        self.device == Device::Cpu && self.num_computed_tokens > 0
    }
}

/// Flat inputs of one forward pass, rows in batch order (GPU decodes, CPU attention, prefills).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ModelInputs {
    /// `[num_tokens]` token ids and their positions.
    pub input_ids: Vec<i64>,
    pub positions: Vec<i64>,
    /// `[num_groups, num_tokens]` flat slot `block * block_size + offset` each token's K/V goes
    /// to, per KV group: in the device pool, or for host prefills in the host pool; -1 for rows
    /// attending on the CPU (the CPU kernel appends their K/V to the host pool itself).
    pub slot_mapping: Vec<i64>,
    /// `[num_reqs + 1]` start row of each request (cumulative `num_new_tokens`).
    pub query_start_loc: Vec<i32>,
    /// `[num_reqs]` context length after this iteration (`num_computed + num_new`).
    pub seq_lens: Vec<i32>,
    /// `[num_groups, num_reqs, max_blocks]` block tables (of the row's pool) per KV group,
    /// row-major, padded with block 0 (which also stands for the blocks released behind a
    /// sliding window).
    pub block_tables: Vec<i32>,
    pub num_groups: usize,
    pub max_blocks: usize,
    /// Rows whose logits are sampled, and their requests, in batch order: a request verifying
    /// `k` drafts has `k + 1` consecutive rows (its last ones).
    pub sample_rows: Vec<i64>,
    pub sample_ids: Vec<u64>,
}

#[derive(Debug, Clone)]
pub struct SchedulerOutput {
    /// Batch order: the first `num_decodes` attend over paged KV, GPU decodes (one token each)
    /// then the last `num_cpu_decodes` on the CPU over the host pool (a token each, or a
    /// prompt's rest after host-tier blocks it decodes in place over); the rest are prefill
    /// chunks.
    pub scheduled: Vec<ScheduledRequest>,
    pub num_decodes: usize,
    pub num_cpu_decodes: usize,
    /// The last `num_host_prefills` prefills of sub-batch 0 write their KV straight to the host
    /// pool (whole prompts whose request decodes on the CPU).
    pub num_host_prefills: usize,
    /// Requests from this index on form sub-batch 1 (CPU decodes, pipelined half a layer behind
    /// sub-batch 0); `scheduled.len()` when the iteration is not pipelined. `num_decodes` and
    /// `num_cpu_decodes` describe sub-batch 0.
    pub sub_batch1_start: usize,
    /// Swap-outs are gathered before the forward pass; swap-ins land layer by layer, each layer
    /// before its KV writes. One iteration never has both.
    pub swap_out: SwapPlan,
    pub swap_in: SwapPlan,
    /// Prefills finishing this iteration whose KV moves to the host pool: copy each layer's
    /// blocks right after that layer writes them. The device blocks are freed by `update()`.
    pub prefill_to_host: SwapPlan,
    /// Prefix blocks the device cache evicted this iteration, into the host tier: gather each
    /// layer of them before anything writes that layer of the device blocks (handed out again in
    /// this plan: KV writes, swap-ins, `cache_to_device`); nothing reads the host blocks before
    /// the next plan.
    pub cache_to_host: SwapPlan,
    /// Host-tier prefix hits into the device blocks of the requests that found them: with the
    /// swap-ins, layer by layer.
    pub cache_to_device: SwapPlan,
    /// Preempted this iteration; their KV was dropped and will be recomputed.
    pub recomputed: Vec<RequestId>,
    pub inputs: ModelInputs,
    /// The predictor's per-layer stage times of this plan, to compare with measured ones.
    pub predicted: StageTimes,
}

/// Per-layer stage times (ms) of one iteration; index 0/1 = sub-batch.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StageTimes {
    pub linear_ms: [f64; 2],
    pub prefill_attn_ms: f64,
    pub gpu_decode_ms: f64,
    /// CPU attention kernels alone (what the kernel's own timer measures).
    pub cpu_attn_ms: [f64; 2],
    /// Q/K/V out and outputs back, with the hand-off cost.
    pub transfer_ms: [f64; 2],
    /// The copies alone (the transfer term): CPU decodes' rows and outputs, host-prefill KV.
    pub copy_ms: f64,
    /// The iteration per layer: the pipeline formula when pipelined, else the plain sum.
    pub layer_ms: f64,
}

impl SchedulerOutput {
    pub fn num_batched_tokens(&self) -> usize {
        self.scheduled.iter().map(|s| s.num_new_tokens).sum()
    }
}

impl ModelInputs {
    /// Build the rows of `scheduled` (already in batch order) from the requests' tokens and
    /// their block tables in `gpu` or `cpu`.
    pub fn build<'a>(
        scheduled: &[ScheduledRequest],
        mut request: impl FnMut(RequestId) -> &'a Request,
        gpu: &KvManager,
        cpu: &KvManager,
    ) -> ModelInputs {
        let kv_of = |s: &ScheduledRequest| if s.device == Device::Gpu { gpu } else { cpu };
        let (bs, groups) = (gpu.block_size(), gpu.num_groups());
        let num_tokens: usize = scheduled.iter().map(|s| s.num_new_tokens).sum();
        let max_blocks = scheduled.iter().map(|s| kv_of(s).table(s.id).len() / groups).max().unwrap_or(0);
        let mut m = ModelInputs {
            input_ids: Vec::with_capacity(num_tokens),
            positions: Vec::with_capacity(num_tokens),
            slot_mapping: vec![0; groups * num_tokens],
            query_start_loc: Vec::with_capacity(scheduled.len() + 1),
            seq_lens: Vec::with_capacity(scheduled.len()),
            block_tables: vec![0; groups * scheduled.len() * max_blocks],
            num_groups: groups,
            max_blocks,
            ..ModelInputs::default()
        };
        m.query_start_loc.push(0);
        for (i, s) in scheduled.iter().enumerate() {
            let req = request(s.id);
            let table = kv_of(s).table(s.id);
            let range = s.num_computed_tokens..s.num_computed_tokens + s.num_new_tokens;
            debug_assert!(table.len() / groups * bs >= range.end, "request {} has too few blocks", s.id);
            let row0 = m.input_ids.len();
            m.input_ids.extend(req.token_ids[range.clone()].iter().map(|&t| i64::from(t)));
            m.positions.extend(range.clone().map(|pos| pos as i64));
            for g in 0..groups {
                // Group `g`'s entries: one per block of tokens (`KvManager`'s table layout).
                let entries = table.iter().skip(g).step_by(groups);
                for (row, pos) in range.clone().enumerate() {
                    let b = table[pos / bs * groups + g];
                    debug_assert!(!b.is_null(), "request {} writes a released block", s.id);
                    let slot = if s.attends_on_cpu() { -1 } else { (b.0 as usize * bs + pos % bs) as i64 };
                    m.slot_mapping[g * num_tokens + row0 + row] = slot;
                }
                let start = (g * scheduled.len() + i) * max_blocks;
                // Blocks released behind the window read as block 0; no kernel reads them.
                for (dst, b) in m.block_tables[start..start + max_blocks].iter_mut().zip(entries) {
                    if !b.is_null() {
                        *dst = b.0 as i32;
                    }
                }
            }
            m.query_start_loc.push(m.input_ids.len() as i32);
            m.seq_lens.push(range.end as i32);
            if s.sample {
                // A decode verifying drafts samples a row per draft and one after them.
                let end = m.input_ids.len() as i64;
                for row in end - 1 - req.num_drafts as i64..end {
                    m.sample_rows.push(row);
                    m.sample_ids.push(s.id.0);
                }
            }
        }
        m
    }
}
