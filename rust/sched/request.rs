//! A request as the scheduler sees it (vLLM's `Request`): its tokens (prompt, then outputs),
//! how many have KV computed, its token limit and where it stands.

pub use crate::kv::RequestId;
use crate::kv::{BlockHash, Device};

/// Which queue holds the request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RequestStatus {
    /// FCFS queue; holds no KV blocks (new, or preempted for recomputation).
    Waiting,
    /// Scheduled each iteration; KV in the pool named by `Request::device`.
    Running,
    /// Preempted by swapping; KV wholly in the host pool.
    Swapped,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// An EOS or stop token or string (decided by the caller).
    Stop,
    /// `max_tokens` outputs, or the model's context is full.
    Length,
    /// Aborted by the caller.
    Abort,
}

impl FinishReason {
    pub fn name(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Abort => "abort",
        }
    }
}

#[derive(Debug, Clone)]
pub struct Request {
    pub id: RequestId,
    /// Prompt followed by the outputs so far.
    pub token_ids: Vec<u32>,
    pub num_prompt_tokens: usize,
    pub max_tokens: usize,
    /// Tokens whose KV is in the cache (vLLM's `num_computed_tokens`).
    pub num_computed_tokens: usize,
    pub status: RequestStatus,
    /// The pool holding its KV while running or swapped (a running `Cpu` request decodes on the CPU).
    pub device: Device,
    /// Order of arrival; FCFS ties and preemption victims follow it.
    pub arrival: u64,
    /// Its prefix-cache namespace (`cache_salt`): the parent hash of its first block, so it
    /// shares cached blocks only with requests of the same salt. `None`: the common namespace.
    pub salt: Option<BlockHash>,
    /// Prompt tokens its first admission found in the prefix cache, either tier (vLLM's
    /// `num_cached_tokens`); `None` until admitted, or with prefix caching off.
    pub num_cached_tokens: Option<usize>,
    /// The chained hashes of its prompt's full blocks under `salt` (as many as a lookup can
    /// hit), computed once on arrival as vLLM does: a prompt that waits is looked up every
    /// iteration. Empty with prefix caching off.
    pub block_hashes: Vec<BlockHash>,
    /// Draft tokens at the end of `token_ids`, verified by the iteration in flight.
    pub num_drafts: usize,
}

impl Request {
    pub fn num_tokens(&self) -> usize {
        self.token_ids.len()
    }

    pub fn num_output_tokens(&self) -> usize {
        self.token_ids.len() - self.num_prompt_tokens
    }

    /// Tokens still to run through the model before the next sample.
    pub fn num_pending_tokens(&self) -> usize {
        self.num_tokens() - self.num_computed_tokens
    }
}
