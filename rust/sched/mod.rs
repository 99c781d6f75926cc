//! Requests, queues and the per-iteration scheduler (vLLM v1's vocabulary: `schedule()` then
//! `update()`), with the KV of both pools accounted in `crate::kv`: the GPU-only policy (NEO's
//! `none` baseline) and the all-CPU-decode policy (`all`) share the queues and managers.

mod config;
mod ngram;
mod output;
mod perf;
mod request;
mod scheduler;
mod stats;

pub use config::{peak_blocks, Drafter, OffloadMode, SchedulerConfig, Speculation, MAX_SPECULATIVE_TOKENS};
pub use ngram::propose;
pub use output::{ModelInputs, ScheduledRequest, SchedulerOutput, StageTimes};
pub use perf::{PerfPredictor, Table1, Table2, Term};
pub use request::{FinishReason, Request, RequestId, RequestStatus};
pub use scheduler::{Scheduler, MAX_HOST_PREFILL_DEFERS};
pub use stats::SchedulerStats;
