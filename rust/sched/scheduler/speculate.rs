//! Speculative decoding's share of the scheduler. Once the policy has planned an iteration, each
//! decode in it drafts tokens (by prompt lookup, `ngram.rs`, or the draft model's tokens handed
//! in by `propose()`) into the token budget and the blocks left over: drafts never preempt,
//! swap or delay anything the policy chose. Its rows verify the drafts in the same forward
//! pass, in the pool its KV is in (a CPU decode's rows in the CPU kernel). `update()` then keeps
//! the accepted drafts' KV and gives back the blocks that held only rejected ones, before any
//! block is registered in the prefix cache.

use super::{Scheduler, Step};
use crate::error::{ensure, NeoError, Result};
use crate::kv::Device;
use crate::sched::config::{Drafter, OffloadMode, MAX_SPECULATIVE_TOKENS};
use crate::sched::ngram::propose;
use crate::sched::output::ScheduledRequest;
use crate::sched::perf::PerfPredictor;
use crate::sched::request::{Request, RequestId};

impl Scheduler {
    /// Add drafts to the plan's decodes, as many per decode as pay (`draft_depth`), while
    /// budget and blocks last.
    pub(super) fn draft(&mut self, step: &mut Step) {
        let Some(spec) = self.config.speculation else { return };
        let mut given = std::mem::take(&mut self.proposals);
        let mut proposals = Vec::new();
        for (i, s) in step.scheduled.iter().enumerate() {
            let req = &self.requests[&s.id];
            let decode = s.sample && s.num_new_tokens == 1 && req.num_output_tokens() > 0;
            if !decode || self.moving_to_host.contains(&s.id) {
                continue;
            }
            // Every draft accepted plus the token after them stays within max_tokens.
            let room = spec.num_tokens.min(req.max_tokens - req.num_output_tokens() - 1);
            let mut drafts = match spec.drafter {
                Drafter::PromptLookup { min, max } => propose(&req.token_ids, (min, max), room).to_vec(),
                Drafter::Model => given.remove(&s.id).unwrap_or_default(),
            };
            drafts.truncate(room);
            if !drafts.is_empty() {
                proposals.push((i, drafts));
            }
        }
        // A draft model's rounds are spent by now: only the verifying rows are priced.
        let lengths: Vec<_> = proposals.iter().map(|(i, d)| (*i, d.len())).collect();
        let depth = if spec.always { usize::MAX } else { self.draft_depth(&step.scheduled, &lengths, |_| 0.0) };
        // NEO keeps the host able to take every device block while prompts go to the host
        // pool (`neo/prefills.rs`); drafts keep that room too.
        let host_prefills = self.config.offload == OffloadMode::Neo
            && step.scheduled.iter().any(|s| s.device == Device::Cpu && !s.attends_on_cpu());
        let mut drafted_on_cpu = Vec::new();
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
            if s.attends_on_cpu() {
                drafted_on_cpu.push(i);
            }
        }
        if step.pipelined && !self.config.force_pipeline {
            self.rebalance_sub_batches(&mut step.scheduled, &drafted_on_cpu);
            step.pipelined = step.scheduled.iter().any(|s| s.sub_batch == 1);
        }
    }

    /// NEO split the CPU decodes between its two sub-batches before any drafted: a CPU decode
    /// with `d` drafts attends `d + 1` rows, which can leave one sub-batch's CPU attention far
    /// longer than the device work it hides under. Each of `drafted` (indices of CPU decodes
    /// that drafted) moves to the other sub-batch where that lowers the plan's predicted layer
    /// time, one pass in order. Sub-batch 1 holds CPU decodes only either way, and nothing else
    /// about the plan changes (its blocks are the same in either sub-batch); a sub-batch 1 left
    /// empty makes the step sequential, which the price then says is faster. A forced pipeline
    /// (`force_pipeline`, tests) keeps its split.
    fn rebalance_sub_batches(&self, scheduled: &mut [ScheduledRequest], drafted: &[usize]) {
        let mut best = self.price(scheduled).layer_ms;
        for &i in drafted {
            scheduled[i].sub_batch ^= 1;
            let layer_ms = self.price(scheduled).layer_ms;
            if layer_ms < best {
                best = layer_ms;
            } else {
                scheduled[i].sub_batch ^= 1;
            }
        }
    }

    /// `Drafter::Model`, between `update()` and `schedule()`: the running decodes a draft model
    /// should draft for, each with how many tokens (within `num_speculative_tokens` and its
    /// `max_tokens`) and the most tokens it may reach (prompt and `max_tokens`). Priced as
    /// `draft()` prices drafts, on a plan of every running decode, with the draft model's
    /// rounds added (`DraftCost`: one round per draft position, over the requests drafting that
    /// far). Empty where no draft pays, or under prompt lookup.
    pub fn draft_requests(&self) -> Vec<(RequestId, usize, usize)> {
        let Some(spec) = self.config.speculation.filter(|s| s.drafter == Drafter::Model) else { return Vec::new() };
        let (mut plan, mut wanted) = (Vec::new(), Vec::new());
        for &id in &self.running {
            let req = &self.requests[&id];
            if req.num_output_tokens() == 0 || req.num_pending_tokens() != 1 {
                continue;
            }
            let room = spec.num_tokens.min(req.max_tokens - req.num_output_tokens() - 1);
            if room > 0 {
                wanted.push((plan.len(), room));
            }
            plan.push(self.scheduled(id, 1));
        }
        let depth = if spec.always {
            usize::MAX
        } else {
            self.draft_depth(&plan, &wanted, |tokens| self.draft_cost.round_ms(&self.predictor, tokens))
        };
        let longest = |id| self.requests[&id].num_prompt_tokens + self.requests[&id].max_tokens;
        wanted
            .into_iter()
            .map(|(i, room)| (plan[i].id, room.min(depth), longest(plan[i].id)))
            .filter(|&(_, n, _)| n > 0)
            .collect()
    }

    /// `Drafter::Model`: the draft model's tokens for requests `draft_requests()` named. The
    /// next `schedule()` verifies as many of them as pay in its plan (none where it does not
    /// decode the request).
    pub fn propose(&mut self, drafts: Vec<(RequestId, Vec<u32>)>) -> Result<()> {
        ensure!(!self.awaiting_update, Runtime, "propose() called between schedule() and update()");
        let Some(spec) = self.config.speculation.filter(|s| s.drafter == Drafter::Model) else {
            return Err(NeoError::Runtime("propose() needs speculation by a draft model".into()));
        };
        for (id, tokens) in &drafts {
            ensure!(self.requests.contains_key(id), Value, "propose(): unknown request {id}");
            ensure!(
                tokens.len() <= spec.num_tokens,
                Value,
                "propose(): {} drafts for request {id}, more than num_speculative_tokens ({})",
                tokens.len(),
                spec.num_tokens
            );
        }
        self.proposals.extend(drafts);
        Ok(())
    }

    /// The draft model ran a round over `tokens` tokens in `layer_ms` milliseconds per layer of
    /// this (the target) model.
    pub fn observe_draft_round(&mut self, tokens: usize, layer_ms: f64) {
        self.draft_cost.observe(&self.predictor, tokens, layer_ms);
    }

    /// Make request `id`'s tokens `tokens`: a draft model's scheduler following its target,
    /// its own drafts replaced by the tokens the target kept. The KV of the tokens both share
    /// stays; the rest of its blocks are given back, and its tokens computed again. Between
    /// `update()` and `schedule()`, without prefix caching or a window (blocks are given back
    /// from the end only).
    pub fn rewind(&mut self, id: RequestId, tokens: Vec<u32>) -> Result<()> {
        ensure!(!self.awaiting_update, Runtime, "rewind() called between schedule() and update()");
        ensure!(
            !self.gpu.prefix_caching() && self.config.kv_group_windows == [None],
            Runtime,
            "rewind() needs a scheduler without prefix caching or a sliding window"
        );
        let req =
            self.requests.get_mut(&id).ok_or_else(|| NeoError::Value(format!("rewind(): unknown request {id}")))?;
        let (prompt, limit) = (req.num_prompt_tokens, req.num_prompt_tokens + req.max_tokens);
        ensure!(
            (prompt..limit).contains(&tokens.len()),
            Value,
            "rewind(): request {id} takes {prompt} to {} tokens, got {}",
            limit - 1,
            tokens.len()
        );
        let same = req.token_ids.iter().zip(&tokens).take_while(|(a, b)| a == b).count();
        // The last token is always computed again: its logits are what the caller samples.
        req.num_computed_tokens = req.num_computed_tokens.min(same).min(tokens.len() - 1);
        req.token_ids = tokens;
        let kv = if req.device == Device::Gpu { &mut self.gpu } else { &mut self.cpu };
        kv.truncate(id, kv.blocks_for(req.num_computed_tokens));
        Ok(())
    }

    /// How many drafts per decode pay, by the predictor: the depth (every decode's first `d`
    /// drafts) at which the plan yields the most tokens per predicted ms. A draft yields a token
    /// if it and those before it are accepted (`Acceptance`); each costs a row in the linears
    /// and the attention, and `round_ms(rows)` to draft for `rows` requests. Every depth is
    /// priced: a row can cost less than the one before it (another kernel takes over). One
    /// stream gains from every draft likely to hold; a batch large enough that rows are no
    /// longer nearly free gains from none (vLLM's `disable_by_batch_size`, priced).
    /// `proposals`: each drafting request's index in `scheduled` and its drafts' count.
    fn draft_depth(
        &self,
        scheduled: &[ScheduledRequest],
        proposals: &[(usize, usize)],
        round_ms: impl Fn(usize) -> f64,
    ) -> usize {
        let longest = proposals.iter().map(|&(_, n)| n).max().unwrap_or(0);
        let mut plan = scheduled.to_vec();
        let mut tokens = plan.iter().filter(|s| s.sample).count() as f64;
        let (mut best, mut best_rate) = (0, tokens / self.price(&plan).layer_ms);
        let (mut reach, mut drafting, mut rates) = (1.0, 0.0, self.acceptance.rates());
        for depth in 1..=longest {
            reach *= rates.next().expect("a rate for every position up to MAX_SPECULATIVE_TOKENS");
            let mut rows = 0;
            for &(i, _) in proposals.iter().filter(|&&(_, n)| n >= depth) {
                plan[i].num_new_tokens += 1;
                rows += 1;
            }
            drafting += round_ms(rows);
            tokens += reach * rows as f64;
            let rate = tokens / (self.price(&plan).layer_ms + drafting);
            if rate > best_rate {
                (best, best_rate) = (depth, rate);
            }
        }
        best
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
/// accepted once those before it were. Counts decay, so the rates follow the workload, over a
/// prior worth two verifications (even for the first position, the rate before it for the
/// others): speculation gets tried, and a rate never falls below about 1% (a draft then pays
/// only where a row costs nearly nothing). They decay in iterations
/// that verify nothing too, so rates that stopped drafts drift back to the prior and drafts
/// are tried again: a few unlucky verifications do not end speculation for good.
#[derive(Debug, Clone, Default)]
pub(crate) struct Acceptance {
    reached: [f64; MAX_SPECULATIVE_TOKENS],
    accepted: [f64; MAX_SPECULATIVE_TOKENS],
}

/// Weight of each earlier verification against the newest (about the last 100 count).
const DECAY: f64 = 0.99;

impl Acceptance {
    /// `rate(0), rate(1), ...`. A position seldom reached takes the rate of the one before it (a
    /// draft after accepted ones holds about as often as they did), the first an even one:
    /// deeper drafts get tried where the first ones hold, and so get measured.
    pub(crate) fn rates(&self) -> impl Iterator<Item = f64> + '_ {
        self.reached.iter().zip(&self.accepted).scan(0.5, |prior, (reached, accepted)| {
            *prior = (accepted + 2.0 * *prior) / (reached + 2.0);
            Some(*prior)
        })
    }

    /// An iteration verified no draft.
    pub(crate) fn forget(&mut self) {
        for (r, a) in self.reached.iter_mut().zip(&mut self.accepted) {
            (*r, *a) = (*r * DECAY, *a * DECAY);
        }
    }

    /// A decode verified `drafts` drafts and accepted the first `accepted` of them.
    pub(crate) fn observe(&mut self, drafts: usize, accepted: usize) {
        for i in 0..drafts.min(accepted + 1) {
            self.reached[i] = self.reached[i] * DECAY + 1.0;
            self.accepted[i] = self.accepted[i] * DECAY + f64::from(u8::from(i < accepted));
        }
    }
}

/// What one round of the draft model costs, in the predictor's milliseconds per layer (of the
/// target): a measured multiple of the target's linears over as many tokens, since the draft
/// is a smaller model of the same kind. Until a round is measured, nothing: the first steps
/// draft, and measure it.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct DraftCost {
    ratio: Option<f64>,
}

impl DraftCost {
    fn round_ms(&self, p: &PerfPredictor, tokens: usize) -> f64 {
        self.ratio.map_or(0.0, |r| r * p.linear_ms(tokens))
    }

    fn observe(&mut self, p: &PerfPredictor, tokens: usize, layer_ms: f64) {
        let x = layer_ms / p.linear_ms(tokens.max(1)).max(1e-9);
        // Weighted toward the newest rounds, as `Acceptance` is. A round slowed by something
        // else counts as twice the estimate at most: priced out, drafts would not be measured
        // again.
        self.ratio = Some(self.ratio.map_or(x, |r| r * 0.9 + x.min(2.0 * r) * 0.1));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sched::scheduler::neo::tests::scheduler;

    fn decode(id: u64, ctx: usize, device: Device, sub_batch: u8, rows: usize) -> ScheduledRequest {
        ScheduledRequest {
            id: RequestId(id),
            num_computed_tokens: ctx - 1,
            num_new_tokens: rows,
            sample: true,
            device,
            sub_batch,
        }
    }

    #[test]
    fn drafted_cpu_decodes_move_to_the_sub_batch_with_room() {
        // A pipelined plan split evenly before drafting: GPU decodes, and CPU decodes half in
        // each sub-batch. Then every CPU decode of sub-batch 1 drafts 4 tokens: its CPU
        // attention, five rows a request, outlasts the device work it hides under.
        let s = scheduler(0);
        let mut plan: Vec<_> = (0..150).map(|i| decode(i, 500, Device::Gpu, 0, 1)).collect();
        for i in 0..60 {
            plan.push(decode(1000 + i, 300, Device::Cpu, u8::from(i % 2 == 1), 1));
        }
        let drafted: Vec<_> = (150..plan.len()).filter(|&i| plan[i].sub_batch == 1).collect();
        for &i in &drafted {
            plan[i].num_new_tokens = 5;
        }
        let before = s.price(&plan).layer_ms;
        let placed = plan.clone();
        s.rebalance_sub_batches(&mut plan, &drafted);
        let after = s.price(&plan).layer_ms;
        assert!(after < before, "{after} >= {before}");
        let moved = drafted.iter().filter(|&&i| plan[i].sub_batch != placed[i].sub_batch).count();
        assert!(moved > 0 && plan.iter().any(|r| r.sub_batch == 1), "moved {moved}");
        // Nothing else changed, and no single drafted decode moved back would do better.
        for (i, (a, b)) in plan.iter().zip(&placed).enumerate() {
            assert!(drafted.contains(&i) || a == b, "request {i} changed");
            assert_eq!((a.num_new_tokens, a.device), (b.num_new_tokens, b.device));
        }
        for &i in &drafted {
            plan[i].sub_batch ^= 1;
            assert!(s.price(&plan).layer_ms >= after, "moving {i} again pays");
            plan[i].sub_batch ^= 1;
        }
    }
}
