//! `update()`: an iteration's results applied to its requests (tokens, computed KV, prefix-cache
//! registration, blocks behind the window, finishes), or `abort_step()` when it failed.

use std::collections::HashSet;

use super::{speculate, Scheduler};
use crate::error::{ensure, Result};
use crate::kv::Device;
use crate::sched::request::{FinishReason, RequestId};

impl Scheduler {
    /// Apply the last iteration's results: `sampled` holds one token per sampled request (in
    /// the plan's `sample_ids` order); `stopped` lists requests the caller finished (EOS, stop
    /// string). Returns every request that finished, with why. Aborted requests are skipped.
    pub fn update(&mut self, sampled: &[u32], stopped: &[RequestId]) -> Result<Vec<(RequestId, FinishReason)>> {
        self.update_speculative(sampled, &[], stopped)
    }

    /// `update` after an iteration that verified drafts: the `i`-th sampled request takes the
    /// next `counts[i]` tokens of `sampled` (the drafts it accepted, then one more); empty
    /// `counts`: one each.
    pub fn update_speculative(
        &mut self,
        sampled: &[u32],
        counts: &[usize],
        stopped: &[RequestId],
    ) -> Result<Vec<(RequestId, FinishReason)>> {
        ensure!(self.awaiting_update, Runtime, "update() called without a schedule() to pair with");
        let counts = self.sampled_counts(sampled, counts)?;
        self.awaiting_update = false;
        self.in_flight_moved.clear();
        // A stop on the last allowed token is a stop, not a length finish.
        let stopped: HashSet<RequestId> = stopped.iter().copied().filter(|id| self.requests.contains_key(id)).collect();
        let mut finished: Vec<_> = stopped.iter().map(|&id| (id, FinishReason::Stop)).collect();
        let (mut counts, mut at) = (counts.into_iter(), 0);
        let mut verified = false;
        for s in std::mem::take(&mut self.in_flight) {
            let n = if s.sample { counts.next().expect("counted") } else { 0 };
            let emitted = &sampled[at..at + n];
            at += n;
            let Some(req) = self.requests.get_mut(&s.id) else { continue };
            let (drafts, kept) = speculate::settle_drafts(req, emitted);
            verified |= drafts > 0;
            if drafts > 0 && !stopped.contains(&s.id) {
                // (A sequence stopped inside its drafts says nothing of those after the stop.)
                self.acceptance.observe(drafts, kept);
            }
            let rejected = drafts - kept;
            let ran = s.num_new_tokens - rejected;
            req.num_computed_tokens += ran;
            if rejected > 0 {
                let kv = if req.device == Device::Gpu { &mut self.gpu } else { &mut self.cpu };
                kv.truncate(s.id, kv.blocks_for(req.num_computed_tokens));
            }
            let bs = self.config.block_size;
            let filled = req.num_computed_tokens / bs > (req.num_computed_tokens - ran) / bs;
            match req.device {
                Device::Gpu if filled || self.host_hit_copies.contains(&s.id) => {
                    self.gpu.cache_full_blocks(s.id, &req.token_ids, req.num_computed_tokens, req.salt);
                }
                // With a host tier, the host pool caches its requests' blocks too.
                Device::Cpu if filled => {
                    self.cpu.cache_full_blocks(s.id, &req.token_ids, req.num_computed_tokens, req.salt);
                }
                _ => {}
            }
            if req.device == Device::Gpu && self.moving_to_host.contains(&s.id) {
                // The staging blocks (cached first); the KV is in the host pool now.
                self.gpu.free(s.id);
                req.device = Device::Cpu;
            }
            match req.device {
                Device::Gpu => self.gpu.release_behind_window(s.id, req.num_computed_tokens),
                Device::Cpu => self.cpu.release_behind_window(s.id, req.num_computed_tokens),
            }
            if let Some(&t) = emitted.last() {
                req.token_ids.push(t);
                if req.num_output_tokens() >= req.max_tokens && !stopped.contains(&s.id) {
                    finished.push((s.id, FinishReason::Length));
                }
            }
        }
        if !verified {
            self.acceptance.forget();
        }
        self.moving_to_host.clear();
        self.land_cache_copies();
        if !finished.is_empty() {
            for &(id, _) in &finished {
                self.release(id);
            }
            let requests = &self.requests;
            self.running.retain(|id| requests.contains_key(id));
            self.waiting.retain(|id| requests.contains_key(id));
            self.swapped.retain(|id| requests.contains_key(id));
        }
        Ok(finished)
    }

    /// The last `schedule()`'s iteration failed before `update()`: its KV writes and copies may
    /// be half done, so every request it ran or swapped is aborted (blocks freed in both pools)
    /// and the scheduler is ready for the next `schedule()`. Returns those requests.
    pub fn abort_step(&mut self) -> Vec<RequestId> {
        if !std::mem::take(&mut self.awaiting_update) {
            return Vec::new();
        }
        let mut ids: Vec<RequestId> = std::mem::take(&mut self.in_flight).into_iter().map(|s| s.id).collect();
        ids.append(&mut self.in_flight_moved);
        ids.append(&mut self.moving_to_host);
        self.drop_cache_copies();
        let mut seen = HashSet::new();
        ids.retain(|&id| seen.insert(id) && self.abort(id));
        ids
    }
}
