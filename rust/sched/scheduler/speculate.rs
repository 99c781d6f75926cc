//! Speculative decoding's share of the scheduler. Once the policy has planned an iteration, each
//! decode in it drafts tokens by prompt lookup (`ngram.rs`) into the token budget and the blocks
//! left over: drafts never preempt, swap or delay anything the policy chose. Its rows verify the
//! drafts in the same forward pass, in the pool its KV is in (a CPU decode's rows in the CPU
//! kernel). `update()` then keeps the accepted drafts' KV and gives back the blocks that held
//! only rejected ones, before any block is registered in the prefix cache.

use super::{Scheduler, Step};
use crate::error::{ensure, Result};
use crate::kv::Device;
use crate::sched::config::{OffloadMode, MAX_SPECULATIVE_TOKENS};
use crate::sched::ngram::propose;
use crate::sched::output::ScheduledRequest;
use crate::sched::request::Request;

impl Scheduler {
    /// Add drafts to the plan's decodes, as many per decode as pay (`draft_depth`), while
    /// budget and blocks last.
    pub(super) fn draft(&mut self, step: &mut Step) {
        let Some(spec) = self.config.speculation else { return };
        let mut proposals = Vec::new();
        for (i, s) in step.scheduled.iter().enumerate() {
            let req = &self.requests[&s.id];
            let decode = s.sample && s.num_new_tokens == 1 && req.num_output_tokens() > 0;
            if !decode || self.moving_to_host.contains(&s.id) {
                continue;
            }
            // Every draft accepted plus the token after them stays within max_tokens.
            let room = req.max_tokens - req.num_output_tokens() - 1;
            let drafts = propose(&req.token_ids, &spec, spec.num_tokens.min(room));
            if !drafts.is_empty() {
                proposals.push((i, drafts.to_vec()));
            }
        }
        let depth = if spec.always { usize::MAX } else { self.draft_depth(&step.scheduled, &proposals) };
        // NEO keeps the host able to take every device block while prompts go to the host
        // pool (`neo/prefills.rs`); drafts keep that room too.
        let host_prefills = self.config.offload == OffloadMode::Neo
            && step.scheduled.iter().any(|s| s.device == Device::Cpu && !s.attends_on_cpu());
        for (i, mut drafts) in proposals {
            drafts.truncate(depth.min(step.budget));
            if drafts.is_empty() {
                continue;
            }
            let s = &mut step.scheduled[i];
            let target = s.num_computed_tokens + 1 + drafts.len();
            let (kv, other) = match s.device {
                Device::Gpu => (&mut self.gpu, &self.cpu),
                Device::Cpu => (&mut self.cpu, &self.gpu),
            };
            if host_prefills {
                let need = kv.blocks_needed(s.id, target);
                let (used_gpu, free_cpu) = match s.device {
                    Device::Gpu => (kv.num_used_blocks() + need, other.num_free_blocks()),
                    Device::Cpu => (other.num_used_blocks(), kv.num_free_blocks().saturating_sub(need)),
                };
                if free_cpu < used_gpu {
                    continue;
                }
            }
            if !kv.allocate_slots(s.id, target) {
                continue;
            }
            let req = self.requests.get_mut(&s.id).expect("scheduled request exists");
            req.num_drafts = drafts.len();
            req.token_ids.extend(drafts);
            s.num_new_tokens += req.num_drafts;
            step.budget -= req.num_drafts;
        }
    }

    /// How many drafts per decode pay, by the predictor: position by position (every decode's
    /// `i`-th draft at once), while the tokens the plan is expected to yield per predicted ms
    /// rise. A draft yields a token if it and those before it are accepted (`Acceptance`); each
    /// costs a row in the linears and the attention. One stream gains from every draft likely
    /// to hold; a batch large enough that rows are no longer nearly free gains from none
    /// (vLLM's `disable_by_batch_size`, priced).
    fn draft_depth(&self, scheduled: &[ScheduledRequest], proposals: &[(usize, Vec<u32>)]) -> usize {
        let longest = proposals.iter().map(|(_, d)| d.len()).max().unwrap_or(0);
        let mut plan = scheduled.to_vec();
        let mut ms = self.price(&plan).layer_ms;
        let mut tokens = plan.iter().filter(|s| s.sample).count() as f64;
        let mut reach = 1.0;
        for depth in 0..longest {
            reach *= self.acceptance.rate(depth);
            let mut rows = 0.0;
            for (i, _) in proposals.iter().filter(|(_, d)| d.len() > depth) {
                plan[*i].num_new_tokens += 1;
                rows += 1.0;
            }
            let (more_ms, more_tokens) = (self.price(&plan).layer_ms, tokens + reach * rows);
            if more_tokens * ms <= tokens * more_ms {
                return depth;
            }
            (ms, tokens) = (more_ms, more_tokens);
        }
        longest
    }

    /// How many of `sampled` each sampled request of the iteration in flight takes: one each
    /// (`counts` empty), or `counts[i]`: the drafts it accepted, in order, then one more token.
    /// Checked whole before `update()` changes anything.
    pub(super) fn sampled_counts(&self, sampled: &[u32], counts: &[usize]) -> Result<Vec<usize>> {
        let rows: Vec<_> = self.in_flight.iter().filter(|s| s.sample).collect();
        if counts.is_empty() {
            ensure!(
                sampled.len() == rows.len(),
                Shape,
                "update() got {} sampled tokens, but the plan samples {} requests",
                sampled.len(),
                rows.len()
            );
            return Ok(vec![1; rows.len()]);
        }
        ensure!(
            counts.len() == rows.len() && counts.iter().sum::<usize>() == sampled.len(),
            Shape,
            "update() got {} counts of {} tokens, but the plan samples {} requests",
            counts.len(),
            sampled.len(),
            rows.len()
        );
        let mut at = 0;
        for (s, &n) in rows.iter().zip(counts) {
            let Some(req) = self.requests.get(&s.id) else {
                at += n;
                continue;
            };
            ensure!(
                (1..=1 + req.num_drafts).contains(&n),
                Value,
                "request {}: {n} tokens for {} drafts (1 to drafts + 1 expected)",
                s.id,
                req.num_drafts
            );
            ensure!(
                sampled[at..at + n - 1] == req.token_ids[req.num_tokens() - req.num_drafts..][..n - 1],
                Value,
                "request {}: the tokens accepted are not its drafts",
                s.id
            );
            at += n;
        }
        Ok(counts.to_vec())
    }
}

/// Drop the drafts the request rejected from its tokens, `emitted` being what it sampled (the
/// drafts it accepted, which stay, then one more token); returns its drafts and how many of
/// them it kept.
pub(super) fn settle_drafts(req: &mut Request, emitted: &[u32]) -> (usize, usize) {
    let drafts = std::mem::take(&mut req.num_drafts);
    let kept = emitted.len().saturating_sub(1).min(drafts);
    req.token_ids.truncate(req.num_tokens() - (drafts - kept));
    (drafts, kept)
}

/// How often drafts hold, per position: `rate(i)` is the chance that a decode's draft `i` is
/// accepted once those before it were. Counts decay, so the rates follow the workload, over an
/// even prior worth two verifications: speculation gets tried, and a rate never falls below
/// about 1% (a draft then pays only where a row costs nearly nothing).
#[derive(Debug, Clone, Default)]
pub(crate) struct Acceptance {
    reached: [f64; MAX_SPECULATIVE_TOKENS],
    accepted: [f64; MAX_SPECULATIVE_TOKENS],
}

/// Weight of each earlier verification against the newest (about the last 100 count).
const DECAY: f64 = 0.99;

impl Acceptance {
    pub(crate) fn rate(&self, position: usize) -> f64 {
        (self.accepted[position] + 1.0) / (self.reached[position] + 2.0)
    }

    /// A decode verified `drafts` drafts and accepted the first `accepted` of them.
    pub(crate) fn observe(&mut self, drafts: usize, accepted: usize) {
        for i in 0..drafts.min(accepted + 1) {
            self.reached[i] = self.reached[i] * DECAY + 1.0;
            self.accepted[i] = self.accepted[i] * DECAY + f64::from(u8::from(i < accepted));
        }
    }
}
