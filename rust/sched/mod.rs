//! Requests, queues and the per-iteration scheduler (vLLM v1's vocabulary: `schedule()` then
//! `update()`), with the KV of both pools accounted in `crate::kv`: the GPU-only policy (NEO's
//! `none` baseline) and the all-CPU-decode policy (`all`) share the queues and managers.

mod output;
mod request;
mod scheduler;

pub use output::{ModelInputs, ScheduledRequest, SchedulerOutput};
pub use request::{FinishReason, Request, RequestId, RequestStatus};
pub use scheduler::{OffloadMode, Scheduler, SchedulerConfig, SchedulerStats};
