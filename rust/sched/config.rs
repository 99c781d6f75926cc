//! Scheduler settings: budgets, pool sizes and the offload mode (`--offload neo|none|all`).

use crate::error::{ensure, NeoError, Result};

/// Where decode attention runs (`--offload`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OffloadMode {
    /// `none`: the GPU-only baseline; overflow is swapped to the host and waits.
    #[default]
    GpuOnly,
    /// `all`: every request's KV moves to the host pool once its prefill is done, and every
    /// decode attention runs on the CPU (the FastDecode+ baseline).
    AllCpu,
    /// `neo`: partial offload; each iteration picks GPU-only or the two-sub-batch pipeline.
    Neo,
}

impl OffloadMode {
    pub fn parse(name: &str) -> Result<Self> {
        match name {
            "none" => Ok(OffloadMode::GpuOnly),
            "all" => Ok(OffloadMode::AllCpu),
            "neo" => Ok(OffloadMode::Neo),
            _ => Err(NeoError::Value(format!("offload mode must be 'neo', 'none' or 'all', got {name:?}"))),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            OffloadMode::GpuOnly => "none",
            OffloadMode::AllCpu => "all",
            OffloadMode::Neo => "neo",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SchedulerConfig {
    pub max_num_seqs: usize,
    pub max_num_batched_tokens: usize,
    /// Longest prompt + output a request may reach.
    pub max_model_len: usize,
    pub block_size: usize,
    pub num_gpu_blocks: u32,
    /// Host pool blocks (swap space, and the KV of CPU decodes).
    pub num_cpu_blocks: u32,
    pub offload: OffloadMode,
    /// Bytes one CPU decode moves between device and host per layer (Q, K, V out; output back),
    /// for the predictor's transfer term.
    pub transfer_bytes_per_decode: usize,
    /// Bytes of K and V of one token in one layer (a host prefill's copy per token and layer).
    pub kv_bytes_per_token: usize,
    /// `neo` only, for tests: run every CPU decode in the pipeline whatever the estimates say.
    pub force_pipeline: bool,
    /// Reuse the device KV of full blocks a prompt shares with earlier ones (vLLM's automatic
    /// prefix caching).
    pub enable_prefix_caching: bool,
    /// Host pool blocks that keep prefix blocks evicted from the device cache (the host tier; 0:
    /// none). They stay free room for swap-outs and CPU decodes, which take them when needed.
    pub num_cpu_prefix_blocks: u32,
    /// The KV groups (vLLM's KV cache groups: layers sharing a block table), each with its
    /// sliding window in tokens (`None`: global). A sliding group's blocks behind its window are
    /// released as requests advance, in both pools. `[None]` for a model without windows, one
    /// window for Mistral v0.1 (every layer slides), several groups for Gemma 2/3.
    pub kv_group_windows: Vec<Option<usize>>,
    /// Speculative decoding (`None`: off).
    pub speculation: Option<Speculation>,
}

/// Speculative decoding: each decode drafts up to `num_tokens` tokens, and one forward pass
/// verifies them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Speculation {
    pub num_tokens: usize,
    pub drafter: Drafter,
    /// Tests: verify every draft found, whatever the predictor says drafts are worth.
    pub always: bool,
}

/// Where drafts come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Drafter {
    /// vLLM's `{"method": "ngram", ...}`: the tokens that followed the latest earlier occurrence
    /// of the request's last `min..=max` tokens (`ngram.rs`).
    PromptLookup { min: usize, max: usize },
    /// vLLM's `{"method": "draft_model", ...}`: a small model the caller runs between
    /// `update()` and `schedule()`, for the requests `draft_requests()` names, handing its
    /// tokens in with `propose()`.
    Model,
}

/// The most tokens one step may draft per request (vLLM's bound on `num_speculative_tokens`).
pub const MAX_SPECULATIVE_TOKENS: usize = 16;

/// The most blocks of a pool a request of `num_tokens` cached tokens holds at once, summed over
/// the KV groups `windows`: all of them for a global group; for a sliding one, a chunk of
/// `max_num_batched_tokens` beyond the window (a block more where they straddle block edges).
pub fn peak_blocks(
    num_tokens: usize,
    block_size: usize,
    max_num_batched_tokens: usize,
    windows: &[Option<usize>],
) -> usize {
    let all = num_tokens.div_ceil(block_size);
    let span = |w: usize| (w - 1 + max_num_batched_tokens).div_ceil(block_size) + 1;
    windows.iter().map(|window| window.map_or(all, |w| all.min(span(w)))).sum()
}

impl SchedulerConfig {
    /// `peak_blocks` under these settings.
    pub fn peak_blocks(&self, num_tokens: usize) -> usize {
        peak_blocks(num_tokens, self.block_size, self.max_num_batched_tokens, &self.kv_group_windows)
    }

    pub fn validate(&self) -> Result<()> {
        ensure!(self.max_num_seqs >= 1, Value, "max_num_seqs must be at least 1");
        ensure!(self.max_num_batched_tokens >= 1, Value, "max_num_batched_tokens must be at least 1");
        ensure!(self.max_model_len >= 1, Value, "max_model_len must be at least 1");
        ensure!(self.block_size >= 1, Value, "block_size must be at least 1");
        ensure!(self.num_gpu_blocks >= 1, Value, "num_gpu_blocks must be at least 1");
        ensure!(!self.kv_group_windows.is_empty(), Value, "kv_group_windows needs at least one group");
        ensure!(!self.kv_group_windows.contains(&Some(0)), Value, "a sliding window must be at least 1");
        ensure!(
            self.num_cpu_prefix_blocks <= self.num_cpu_blocks,
            Value,
            "num_cpu_prefix_blocks ({}) exceeds num_cpu_blocks ({})",
            self.num_cpu_prefix_blocks,
            self.num_cpu_blocks
        );
        if let Some(spec) = self.speculation {
            ensure!(
                (1..=MAX_SPECULATIVE_TOKENS).contains(&spec.num_tokens),
                Value,
                "num_speculative_tokens must be in 1..={MAX_SPECULATIVE_TOKENS}, got {}",
                spec.num_tokens
            );
            if let Drafter::PromptLookup { min, max } = spec.drafter {
                ensure!(
                    min >= 1 && min <= max,
                    Value,
                    "prompt_lookup_min ({min}) must be at least 1 and at most prompt_lookup_max ({max})"
                );
            }
        }
        ensure!(
            self.num_cpu_prefix_blocks == 0 || self.enable_prefix_caching,
            Value,
            "a host prefix tier (num_cpu_prefix_blocks) needs enable_prefix_caching"
        );
        Ok(())
    }
}
