//! The scheduler's counters since start, read by the metrics.

/// Counters since start (for metrics).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SchedulerStats {
    pub num_swapped_out: u64,
    pub num_swapped_in: u64,
    pub num_recomputed: u64,
    pub num_swapped_out_blocks: u64,
    pub num_swapped_in_blocks: u64,
    /// Prefills whose KV went to the host pool (straight, or staged on the device).
    pub num_prefills_to_host: u64,
    /// Iterations run as NEO's two-sub-batch pipeline.
    pub num_pipelined_steps: u64,
    /// Prompt tokens of admitted prefills looked up in the device prefix cache, and of those,
    /// the tokens whose KV was found there.
    pub prefix_cache_queries: u64,
    pub prefix_cache_hits: u64,
    /// Of the prompt tokens looked up, those found in the host tier.
    pub prefix_cache_host_hits: u64,
    /// Blocks copied into the host tier (evicted from the device cache), and out of it (hits).
    pub num_cache_blocks_to_host: u64,
    pub num_cache_blocks_to_device: u64,
}
