//! Continuous batching with chunked prefill: running requests first (FCFS), then swapped-out ones
//! back in, then new prefills, all under `max_num_seqs` and the token budget. When the device
//! pool is full the newest running request is preempted: swapped to the host pool when it has
//! room, else dropped for recomputation.

use std::collections::{HashMap, HashSet, VecDeque};

mod invariants;
mod neo;
mod prefix_tiers;
mod speculate;
mod to_host;
mod update;

pub use neo::MAX_HOST_PREFILL_DEFERS;

use super::config::{OffloadMode, SchedulerConfig};
use super::output::{ModelInputs, ScheduledRequest, SchedulerOutput, StageTimes};
use super::perf::PerfPredictor;
use super::request::{Request, RequestId, RequestStatus};
use super::stats::SchedulerStats;
use crate::error::{ensure, Result};
use crate::kv::{chain_hashes, salt_hash, BlockId, Device, KvManager, PrefixHit, SwapPlan};

/// One `schedule()` call's growing plan.
struct Step {
    budget: usize,
    scheduled: Vec<ScheduledRequest>,
    swap_out: SwapPlan,
    swap_in: SwapPlan,
    to_host: SwapPlan,
    cache_to_host: SwapPlan,
    cache_to_device: SwapPlan,
    recomputed: Vec<RequestId>,
    /// Requests whose KV this plan moves between pools (swaps); a failed step must drop them.
    moved: Vec<RequestId>,
    pipelined: bool,
}

impl Step {
    fn push(&mut self, s: ScheduledRequest) {
        self.budget -= s.num_new_tokens;
        self.scheduled.push(s);
    }

    fn preempted(&self) -> bool {
        !self.swap_out.pairs.is_empty() || !self.recomputed.is_empty()
    }
}

#[derive(Debug)]
pub struct Scheduler {
    config: SchedulerConfig,
    gpu: KvManager,
    cpu: KvManager,
    requests: HashMap<RequestId, Request>,
    waiting: VecDeque<RequestId>,
    /// In admission order; preemption takes from the back.
    running: Vec<RequestId>,
    /// In arrival order.
    swapped: VecDeque<RequestId>,
    /// Whether a `schedule()` awaits its `update()` (or `abort_step()`).
    awaiting_update: bool,
    /// The last `schedule()`'s requests, consumed by `update()`.
    in_flight: Vec<ScheduledRequest>,
    /// The last `schedule()`'s swapped requests (see `Step::moved`).
    in_flight_moved: Vec<RequestId>,
    /// Requests whose prefill KV is being copied to the host pool this iteration.
    moving_to_host: Vec<RequestId>,
    next_arrival: u64,
    stats: SchedulerStats,
    /// Prices sub-batches for the `neo` policy.
    predictor: PerfPredictor,
    /// `neo`: consecutive iterations that left CPU requests waiting.
    cpu_idle_steps: u32,
    /// `neo`: consecutive iterations whose plan dropped every host-bound prefill.
    host_prefill_defers: u32,
    /// The last plan's host-tier blocks being filled, and requests given device copies of
    /// host-tier blocks (registered in the device cache once they land).
    stored_in_flight: Vec<BlockId>,
    host_hit_copies: Vec<RequestId>,
    /// How often drafts have held (speculative decoding).
    acceptance: speculate::Acceptance,
    /// `Drafter::Model`: the draft model's tokens for the next `schedule()`, and its cost.
    proposals: HashMap<RequestId, Vec<u32>>,
    draft_cost: speculate::DraftCost,
}

impl Scheduler {
    pub fn new(config: SchedulerConfig) -> Result<Self> {
        config.validate()?;
        let mut gpu =
            KvManager::new(Device::Gpu, config.num_gpu_blocks, config.block_size, config.enable_prefix_caching)
                .with_groups(config.kv_group_windows.clone());
        let tier = config.num_cpu_prefix_blocks as usize;
        if tier > 0 {
            gpu.record_evictions();
        }
        Ok(Scheduler {
            gpu,
            cpu: KvManager::new(Device::Cpu, config.num_cpu_blocks, config.block_size, false)
                .limit_cache(tier)
                .with_groups(config.kv_group_windows.clone()),
            config,
            requests: HashMap::new(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            swapped: VecDeque::new(),
            awaiting_update: false,
            in_flight: Vec::new(),
            in_flight_moved: Vec::new(),
            moving_to_host: Vec::new(),
            next_arrival: 0,
            stats: SchedulerStats::default(),
            predictor: PerfPredictor::synthetic(),
            cpu_idle_steps: 0,
            host_prefill_defers: 0,
            stored_in_flight: Vec::new(),
            host_hit_copies: Vec::new(),
            acceptance: speculate::Acceptance::default(),
            proposals: HashMap::new(),
            draft_cost: speculate::DraftCost::default(),
        })
    }

    pub fn config(&self) -> &SchedulerConfig {
        &self.config
    }

    pub fn stats(&self) -> SchedulerStats {
        self.stats
    }

    pub fn predictor(&self) -> &PerfPredictor {
        &self.predictor
    }

    /// Profiled tables replace the synthetic ones; measured stage times go to `observe`.
    pub fn predictor_mut(&mut self) -> &mut PerfPredictor {
        &mut self.predictor
    }

    pub fn kv(&self, device: Device) -> &KvManager {
        match device {
            Device::Gpu => &self.gpu,
            Device::Cpu => &self.cpu,
        }
    }

    pub fn request(&self, id: RequestId) -> Option<&Request> {
        self.requests.get(&id)
    }

    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    pub fn num_swapped(&self) -> usize {
        self.swapped.len()
    }

    pub fn has_unfinished(&self) -> bool {
        !self.requests.is_empty()
    }

    /// Queue a request. Fails (nothing queued) on a duplicate id, an empty prompt, no token to
    /// generate, or a request that could never fit the context or the device pool.
    pub fn add_request(&mut self, id: RequestId, prompt: Vec<u32>, max_tokens: usize) -> Result<()> {
        self.add_salted_request(id, prompt, max_tokens, None)
    }

    /// `add_request` with a `cache_salt`: the request shares prefix-cache blocks only with
    /// requests of the same salt (vLLM's isolation between tenants). `Some("")` is an error.
    pub fn add_salted_request(
        &mut self,
        id: RequestId,
        prompt: Vec<u32>,
        max_tokens: usize,
        cache_salt: Option<&str>,
    ) -> Result<()> {
        ensure!(cache_salt != Some(""), Value, "request {id}: cache_salt must be a non-empty string");
        ensure!(!self.requests.contains_key(&id), Value, "request id {id} is already in use");
        ensure!(!prompt.is_empty(), Value, "request {id}: the prompt is empty");
        ensure!(max_tokens >= 1, Value, "request {id}: max_tokens must be at least 1");
        let total = prompt.len() + max_tokens;
        ensure!(
            total <= self.config.max_model_len,
            Value,
            "request {id}: prompt ({} tokens) + max_tokens ({max_tokens}) exceeds max_model_len {}",
            prompt.len(),
            self.config.max_model_len
        );
        // The last sampled token is never written to the cache.
        let need = self.config.peak_blocks(total - 1);
        ensure!(
            need <= self.gpu.num_total_blocks(),
            Value,
            "request {id}: {total} tokens need {need} KV blocks, but the device pool has {}",
            self.gpu.num_total_blocks()
        );
        ensure!(
            self.config.offload == OffloadMode::GpuOnly || need <= self.cpu.num_total_blocks(),
            Value,
            "request {id}: {total} tokens need {need} KV blocks, but the host pool has {}",
            self.cpu.num_total_blocks()
        );
        let salt = cache_salt.map(salt_hash);
        let block_hashes = if self.gpu.prefix_caching() {
            let bs = self.config.block_size;
            chain_hashes(salt, &prompt, bs, (prompt.len() - 1) / bs)
        } else {
            Vec::new()
        };
        let request = Request {
            id,
            num_prompt_tokens: prompt.len(),
            token_ids: prompt,
            max_tokens,
            num_computed_tokens: 0,
            status: RequestStatus::Waiting,
            device: Device::Gpu,
            arrival: self.next_arrival,
            salt,
            num_cached_tokens: None,
            block_hashes,
            num_drafts: 0,
        };
        self.next_arrival += 1;
        self.requests.insert(id, request);
        self.waiting.push_back(id);
        Ok(())
    }

    /// Drop a request wherever it is and free its blocks in both pools. `false` if unknown.
    pub fn abort(&mut self, id: RequestId) -> bool {
        let Some(req) = self.requests.get(&id) else { return false };
        match req.status {
            RequestStatus::Waiting => self.waiting.retain(|&r| r != id),
            RequestStatus::Running => self.running.retain(|&r| r != id),
            RequestStatus::Swapped => self.swapped.retain(|&r| r != id),
        }
        self.release(id);
        true
    }

    fn release(&mut self, id: RequestId) {
        self.gpu.free(id);
        self.cpu.free(id);
        self.requests.remove(&id);
    }

    /// Plan one iteration. Call `update()` with its sampled tokens (or `abort_step()` if the
    /// iteration failed) before the next `schedule()`; a second `schedule()` is an error.
    pub fn schedule(&mut self) -> Result<SchedulerOutput> {
        ensure!(!self.awaiting_update, Runtime, "schedule() called again before update() or abort_step()");
        let mut step = Step {
            budget: self.config.max_num_batched_tokens,
            scheduled: Vec::with_capacity(self.running.len() + 1),
            swap_out: SwapPlan::new(Device::Gpu, Device::Cpu),
            swap_in: SwapPlan::new(Device::Cpu, Device::Gpu),
            to_host: SwapPlan::new(Device::Gpu, Device::Cpu),
            cache_to_host: SwapPlan::new(Device::Gpu, Device::Cpu),
            cache_to_device: SwapPlan::new(Device::Cpu, Device::Gpu),
            recomputed: Vec::new(),
            moved: Vec::new(),
            pipelined: false,
        };
        match self.config.offload {
            OffloadMode::GpuOnly => {
                self.schedule_running(&mut step, None);
                self.schedule_swapped(&mut step);
                self.schedule_waiting(&mut step);
            }
            OffloadMode::AllCpu => {
                self.schedule_running(&mut step, None);
                self.schedule_waiting(&mut step);
            }
            OffloadMode::Neo => self.schedule_neo(&mut step),
        }
        self.draft(&mut step);
        self.store_evicted(&mut step);
        self.stats.num_pipelined_steps += u64::from(step.pipelined);

        // Batch order: sub-batch 0's GPU decodes, CPU attention, device prefill chunks and host
        // prefills, then sub-batch 1 (CPU decodes only); stable, so FCFS within each group.
        let group = |s: &ScheduledRequest| match (s.sub_batch, s.device) {
            (1, _) => 4,
            (_, Device::Gpu) if s.num_new_tokens == 1 => 0,
            _ if s.attends_on_cpu() => 1,
            (_, Device::Gpu) => 2,
            (_, Device::Cpu) => 3,
        };
        let mut scheduled = step.scheduled;
        scheduled.sort_by_key(group);
        let mut count = [0usize; 5];
        for s in &scheduled {
            count[group(s)] += 1;
        }
        let (num_cpu_decodes, num_host_prefills) = (count[1], count[3]);
        let num_decodes = count[0] + num_cpu_decodes;
        let sub_batch1_start = scheduled.len() - count[4];
        let requests = &self.requests;
        let inputs = ModelInputs::build(&scheduled, |id| &requests[&id], &self.gpu, &self.cpu);
        let predicted = self.price(&scheduled);
        self.in_flight.clone_from(&scheduled);
        self.in_flight_moved = step.moved;
        self.awaiting_update = true;
        Ok(SchedulerOutput {
            scheduled,
            num_decodes,
            num_cpu_decodes,
            num_host_prefills,
            sub_batch1_start,
            swap_out: step.swap_out,
            swap_in: step.swap_in,
            prefill_to_host: step.to_host,
            cache_to_host: step.cache_to_host,
            cache_to_device: step.cache_to_device,
            recomputed: step.recomputed,
            inputs,
            predicted,
        })
    }

    /// Running requests (those in pool `only`, or all), oldest first, each in its own pool;
    /// room is made by preempting the newest running request of the same pool.
    fn schedule_running(&mut self, step: &mut Step, only: Option<Device>) {
        let mut i = 0;
        while i < self.running.len() && step.budget > 0 {
            let id = self.running[i];
            let req = &self.requests[&id];
            if only.is_some_and(|d| d != req.device) {
                i += 1;
                continue;
            }
            let n = req.num_pending_tokens().min(step.budget);
            let target = req.num_computed_tokens + n;
            let to_host = self.prefill_goes_to_host(req, req.num_computed_tokens, n);
            if to_host && !self.host_has_room(req.num_computed_tokens, target, 0) {
                i += 1; // its last chunk waits for host room
                continue;
            }
            if !self.make_room(i, target, step) {
                continue; // preempted itself; running[i] is now the next request
            }
            if to_host {
                self.stage_to_host(id, target, step);
            }
            step.push(self.scheduled(id, n));
            i += 1;
        }
    }

    /// Grow `running[i]`'s table to `target` tokens, preempting newer requests of its pool as
    /// needed. `false` if it had to preempt itself (it then left `running`, or moved to the host).
    fn make_room(&mut self, i: usize, target: usize, step: &mut Step) -> bool {
        let id = self.running[i];
        let device = self.requests[&id].device;
        loop {
            let kv = match device {
                Device::Gpu => &mut self.gpu,
                Device::Cpu => &mut self.cpu,
            };
            if kv.allocate_slots(id, target) {
                return true;
            }
            let victim = (i + 1..self.running.len()).rev().find(|&j| self.requests[&self.running[j]].device == device);
            let j = victim.unwrap_or(i);
            if !self.preempt(self.running[j], step) {
                self.running.remove(j);
            }
            if j == i {
                return false;
            }
        }
    }

    /// Swapped requests back in, oldest first (GPU-only mode) — not in an iteration that
    /// preempted, so host blocks are never freed and reused within one iteration's copies.
    fn schedule_swapped(&mut self, step: &mut Step) {
        let preempted = step.preempted();
        while !preempted && step.budget > 0 && self.running.len() < self.config.max_num_seqs {
            let Some(&id) = self.swapped.front() else { break };
            let req = &self.requests[&id];
            let n = req.num_pending_tokens().min(step.budget);
            if self.gpu.blocks_held(req.num_computed_tokens, req.num_computed_tokens + n) > self.gpu.num_free_blocks() {
                break;
            }
            let moved = self.cpu.swap_to(&mut self.gpu, id, &mut step.swap_in);
            let grown = self.gpu.allocate_slots(id, req.num_computed_tokens + n);
            debug_assert!(moved && grown);
            step.moved.push(id);
            self.swapped.pop_front();
            self.stats.num_swapped_in += 1;
            self.admit(id);
            step.push(self.scheduled(id, n));
        }
        self.stats.num_swapped_in_blocks += step.swap_in.pairs.len() as u64;
    }

    /// New prefills (FCFS, no skipping) into the device pool, only once every swapped request
    /// is back.
    fn schedule_waiting(&mut self, step: &mut Step) {
        while self.swapped.is_empty() && step.budget > 0 && self.running.len() < self.config.max_num_seqs {
            let Some(&id) = self.waiting.front() else { break };
            let req = &self.requests[&id];
            let mut hit = self.prefix_hit(req);
            let hit_tokens = hit.num_blocks() * self.config.block_size;
            if self.config.offload == OffloadMode::AllCpu
                && !self.host_has_room(hit_tokens, req.num_tokens(), hit.num_host_kept())
            {
                // Its KV ends in the host pool: room for it comes before pinning the tier's
                // blocks, which would otherwise keep it waiting for good.
                self.drop_host_tier(&mut hit);
            }
            let computed = req.num_computed_tokens + hit.num_blocks() * self.config.block_size;
            let pinned = hit.num_host_kept();
            let n = (req.num_tokens() - computed).min(step.budget);
            let target = computed + n;
            let to_host = self.prefill_goes_to_host(req, computed, n);
            if to_host && computed == 0 {
                // The whole prompt in one chunk: its KV is written straight to the host pool.
                if !self.cpu.allocate_slots(id, target) {
                    break;
                }
                self.waiting.pop_front();
                self.count_prefix_hit(id, &hit, false);
                self.admit_to(id, Device::Cpu);
                self.stats.num_prefills_to_host += 1;
                step.push(self.scheduled(id, n));
                continue;
            }
            if (to_host && !self.host_has_room(computed, target, pinned))
                || !self.gpu.allocate_with_prefix(id, &hit, target)
            {
                break;
            }
            self.cpu.pin_host_hit(&hit);
            self.copy_host_hit(id, &hit, step);
            self.waiting.pop_front();
            self.count_prefix_hit(id, &hit, false);
            self.admit(id);
            if to_host {
                self.stage_to_host(id, target, step);
            }
            step.push(self.scheduled(id, n));
        }
    }

    fn scheduled(&self, id: RequestId, n: usize) -> ScheduledRequest {
        let req = &self.requests[&id];
        ScheduledRequest {
            id,
            num_computed_tokens: req.num_computed_tokens,
            num_new_tokens: n,
            sample: n == req.num_pending_tokens(),
            device: req.device,
            sub_batch: 0,
        }
    }

    fn admit(&mut self, id: RequestId) {
        self.admit_to(id, Device::Gpu);
    }

    fn admit_to(&mut self, id: RequestId, device: Device) {
        let req = self.requests.get_mut(&id).expect("admitted request exists");
        req.status = RequestStatus::Running;
        req.device = device;
        self.running.push(id);
    }

    /// Take running request `id` off its pool. A device request moves to the host pool if it
    /// has room: in GPU-only mode it waits there (`true` is never returned), under `neo` it stays
    /// running as a CPU request (returns `true`, the caller keeps it in `running`) if its prompt
    /// is done. Otherwise its KV is dropped and it is recomputed from the front of the waiting
    /// queue. The caller takes it out of `running` unless this returns `true`.
    fn preempt(&mut self, id: RequestId, step: &mut Step) -> bool {
        let before = step.swap_out.pairs.len();
        let req = self.requests.get_mut(&id).expect("preempted request exists");
        // Under `neo` a swapped-out request decodes on the CPU, one token per iteration: one
        // stopped halfway through its prompt would crawl through the rest that way, so it is
        // recomputed instead.
        let prefill_done = req.num_pending_tokens() <= 1;
        let may_swap = match self.config.offload {
            OffloadMode::AllCpu => false,
            OffloadMode::Neo => req.device == Device::Gpu && prefill_done,
            OffloadMode::GpuOnly => req.device == Device::Gpu,
        };
        if may_swap && self.gpu.swap_to(&mut self.cpu, id, &mut step.swap_out) {
            step.moved.push(id);
            req.device = Device::Cpu;
            self.stats.num_swapped_out += 1;
            self.stats.num_swapped_out_blocks += (step.swap_out.pairs.len() - before) as u64;
            if self.config.offload == OffloadMode::Neo {
                return true;
            }
            req.status = RequestStatus::Swapped;
            let arrival = req.arrival;
            let at = self.swapped.partition_point(|r| self.requests[r].arrival < arrival);
            self.swapped.insert(at, id);
        } else {
            self.gpu.free(id);
            self.cpu.free(id);
            req.num_computed_tokens = 0;
            req.status = RequestStatus::Waiting;
            self.waiting.push_front(id);
            step.recomputed.push(id);
            self.stats.num_recomputed += 1;
        }
        false
    }
}
