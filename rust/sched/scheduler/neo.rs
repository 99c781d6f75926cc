//! NEO's load-aware policy (`--offload neo`), the paper's six steps per iteration: GPU work
//! first (swapping the newest GPU request out when the device is full, back in under a
//! watermark), prefills to the device or (layer-wise) to the host, CPU decodes placed into
//! sub-batch 0 or 1 while `T_ca1 <= T_l0` and `T_ca0 <= T_l1 + T_ga0` hold, trailing host-bound
//! prefills trimmed, then the pipelined plan against the GPU-only one by estimated throughput.
//! Unlike the authors' code, dropped prefills refund their budget and CPU decodes run alone when
//! there is no device work to hide behind (they never starve).

use super::*;

mod prefills;

use prefills::Tentative;

/// Swap CPU requests in only while the device pool stays below this share of its blocks.
const SWAP_IN_WATERMARK: f64 = 0.95;
/// Host-bound prefills are trimmed only while a sub-batch keeps this many tokens of linear
/// work (below it GEMMs run at a poor rate anyway).
const MIN_LINEAR_TOKENS: usize = 128;
/// GPU-only iterations in a row that left CPU requests waiting, after which they are owed the
/// device (NEO falls back to the GPU-only order until they are served).
const MAX_CPU_IDLE_STEPS: u32 = 8;
/// Iterations in a row whose plan dropped every host-bound prefill, after which the host-bound
/// prompts at the head of the queue are owed admission: neither trim may drop them. Trimming
/// shortens pipelined iterations, but with the device full it would otherwise leave the queue
/// to drain only as device requests finish.
pub const MAX_HOST_PREFILL_DEFERS: u32 = 8;

/// What the predictor prices of one sub-batch, per layer.
#[derive(Debug, Clone, Copy, Default)]
struct Load {
    /// Requests (each emits at most one token).
    reqs: usize,
    /// Tokens through the linear layers.
    tokens: usize,
    /// Device attention of its prefill chunks.
    prefill_ms: f64,
    /// Prompt tokens whose KV is copied to the host pool as each layer writes it.
    host_kv_tokens: usize,
    /// Its GPU decodes and their context tokens (priced together: one kernel for the batch).
    decode_seqs: usize,
    decode_ctx: usize,
    cpu_seqs: usize,
    cpu_ctx: usize,
}

/// CPU decodes placed so far, the budget left for them, and the shortest context that failed.
struct Placement {
    placed: Vec<(RequestId, u8)>,
    placed_ids: HashSet<RequestId>,
    budget: usize,
    fail_ctx: usize,
}

impl Scheduler {
    pub(super) fn schedule_neo(&mut self, step: &mut Step) {
        let admitted = self.stats.num_prefills_to_host;
        let host_bound = self.plan_neo(step);
        let deferred = host_bound && self.stats.num_prefills_to_host == admitted;
        self.host_prefill_defers = if deferred { self.host_prefill_defers + 1 } else { 0 };
    }

    /// One iteration's plan; whether a host-bound prefill was among its candidates.
    fn plan_neo(&mut self, step: &mut Step) -> bool {
        // Steps 1-2: GPU requests, with swap-out on a full device; swap-in below the watermark.
        // CPU requests the estimates have left waiting too long (the CPU cannot hide their
        // attention) are owed the device first: they swap in up to a full pool, and no new
        // prefill overtakes them. This is the GPU-only baseline's order, NEO's fallback.
        self.schedule_running(step, Some(Device::Gpu));
        let owed = self.cpu_idle_steps >= MAX_CPU_IDLE_STEPS;
        self.swap_in_cpu_requests(step, if owed { 1.0 } else { SWAP_IN_WATERMARK });
        self.grow_cpu_requests(step);
        let mut gpu = Load::default();
        for s in &step.scheduled {
            self.add_gpu_work(&mut gpu, s.num_computed_tokens, s.num_new_tokens);
        }
        let cpu_reqs: Vec<RequestId> =
            self.running.iter().copied().filter(|id| self.requests[id].device == Device::Cpu).collect();
        if cpu_reqs.is_empty() {
            self.cpu_idle_steps = 0;
        }
        // Step 3: tentative prefills, FCFS.
        let mut prefills = if owed && !cpu_reqs.is_empty() {
            Vec::new()
        } else {
            self.tentative_prefills(&gpu, step.budget, self.config.max_num_seqs - self.running.len())
        };
        let prefill_tokens: usize = prefills.iter().map(|p| p.n).sum();
        let host_bound = prefills.iter().any(Tentative::droppable);
        let keep_host_bound = self.host_prefill_defers >= MAX_HOST_PREFILL_DEFERS;

        if gpu.reqs == 0 && prefills.is_empty() {
            // No device work to hide behind: CPU decodes run alone rather than wait.
            self.commit_cpu_decodes(step, &cpu_reqs, &vec![0; cpu_reqs.len()]);
            return false;
        }
        let mut b0 = gpu;
        for p in &prefills {
            self.add_prefill(&mut b0, p, 1);
        }
        // Step 4: CPU decodes into sub-batch 1 or 0 while both invariants hold.
        let mut b1 = Load::default();
        let mut place = Placement {
            placed: Vec::new(),
            placed_ids: HashSet::new(),
            budget: step.budget - prefill_tokens,
            fail_ctx: usize::MAX,
        };
        self.place_cpu_decodes(&cpu_reqs, &mut place, &mut b0, &mut b1);
        // Step 5: trim trailing host-bound prefills while sub-batch 0 keeps enough linear work
        // (unless they are owed admission); their budget goes back to the CPU decodes.
        let mut trimmed_any = false;
        while let Some(p) = prefills.last().filter(|_| !keep_host_bound) {
            let mut trimmed = b0;
            self.add_prefill(&mut trimmed, p, -1);
            if !p.droppable()
                || trimmed.tokens < MIN_LINEAR_TOKENS
                || b1.reqs == 0
                || self.min_remains(&trimmed, &b1) < 0.0
            {
                break;
            }
            place.budget += p.n;
            prefills.pop();
            b0 = trimmed;
            trimmed_any = true;
        }
        if trimmed_any {
            place.fail_ctx = usize::MAX;
            self.place_cpu_decodes(&cpu_reqs, &mut place, &mut b0, &mut b1);
        }
        // Step 6: the GPU-only alternative keeps every device prefill and host-bound ones only to
        // reach the linear-work threshold; pick the plan with the higher estimated throughput.
        let mut g_prefills = prefills.clone();
        let mut g_tokens = gpu.tokens + prefills.iter().map(|p| p.n).sum::<usize>();
        while let Some(p) = g_prefills.last().filter(|_| !keep_host_bound) {
            if !p.droppable() || g_tokens - p.n < MIN_LINEAR_TOKENS {
                break;
            }
            g_tokens -= p.n;
            g_prefills.pop();
        }
        let mut g = gpu;
        for p in &g_prefills {
            self.add_prefill(&mut g, p, 1);
        }
        let forced = self.config.force_pipeline && !cpu_reqs.is_empty();
        // With no request on the CPU tier yet, the estimates have no CPU decode to judge, and
        // the GPU-only plan would leave the overflow waiting for device room for good: admit
        // the host-bound prefills. Should the CPU prove too slow for them, they are owed the
        // device after MAX_CPU_IDLE_STEPS and swapped in (the GPU-only order).
        let bootstrap = cpu_reqs.is_empty() && host_bound;
        if !forced && !bootstrap && (place.placed.is_empty() || !self.pipeline_pays(&g, &b0, &b1)) {
            self.commit_prefills(step, &g_prefills);
            self.cpu_idle_steps += u32::from(!cpu_reqs.is_empty());
            return host_bound;
        }
        self.commit_prefills(step, &prefills);
        let (ids, subs): (Vec<RequestId>, Vec<u8>) = if place.placed.is_empty() {
            (cpu_reqs.clone(), vec![0; cpu_reqs.len()]) // forced, and nothing fits the invariants
        } else {
            place.placed.into_iter().unzip()
        };
        step.pipelined = subs.contains(&1);
        self.commit_cpu_decodes(step, &ids, &subs);
        host_bound
    }

    /// Step 6's test: whether the pipelined plan `b0`/`b1` has a higher estimated throughput
    /// (requests per unit time) than the GPU-only plan `g`, each priced with its host-prefill
    /// KV copies.
    fn pipeline_pays(&self, g: &Load, b0: &Load, b1: &Load) -> bool {
        let g_rate = g.reqs as f64 / self.sequential_ms(g).max(1e-9);
        let p_rate = (b0.reqs + b1.reqs) as f64 / self.pipelined_ms(b0, b1).max(1e-9);
        p_rate > g_rate
    }

    /// Greedy placement of step 4: each CPU decode (in queue order) goes to the sub-batch with
    /// more slack (sub-batch 1 first) unless that breaks an invariant; then every longer one is
    /// skipped too, as it would break it as well.
    fn place_cpu_decodes(&self, cands: &[RequestId], place: &mut Placement, b0: &mut Load, b1: &mut Load) {
        for &id in cands {
            if place.budget == 0 {
                break;
            }
            let ctx = self.requests[&id].num_computed_tokens + 1;
            if ctx >= place.fail_ctx || place.placed_ids.contains(&id) {
                continue;
            }
            let r = self.remains(b0, b1);
            let sub = if self.config.force_pipeline {
                u8::from(b1.cpu_seqs <= b0.cpu_seqs)
            } else {
                u8::from(place.placed.is_empty() || r[1] > r[0])
            };
            let target = if sub == 1 { &mut *b1 } else { &mut *b0 };
            let windows = &self.config.kv_group_windows;
            add_cpu_decode(target, ctx, windows, 1);
            if !self.config.force_pipeline && self.min_remains(b0, b1) < 0.0 {
                let target = if sub == 1 { &mut *b1 } else { &mut *b0 };
                add_cpu_decode(target, ctx, windows, -1);
                place.fail_ctx = ctx;
                continue;
            }
            place.placed.push((id, sub));
            place.placed_ids.insert(id);
            place.budget -= 1;
        }
    }

    /// The predictor's stage times of a final plan (any mode).
    pub(super) fn price(&self, scheduled: &[ScheduledRequest]) -> StageTimes {
        let p = &self.predictor;
        let mut loads = [Load::default(); 2];
        for s in scheduled {
            let b = &mut loads[usize::from(s.sub_batch)];
            if s.attends_on_cpu() {
                add_cpu_rows(b, s.num_computed_tokens, s.num_new_tokens, &self.config.kv_group_windows, 1);
            } else {
                if s.device == Device::Cpu {
                    b.host_kv_tokens += s.num_new_tokens;
                }
                self.add_gpu_work(b, s.num_computed_tokens, s.num_new_tokens);
            }
        }
        let [b0, b1] = loads;
        let kernel = |b: &Load| p.cpu_decode_ms(b.cpu_seqs, b.cpu_ctx);
        let layer_ms = if b1.reqs > 0 { self.pipelined_ms(&b0, &b1) } else { self.sequential_ms(&b0) };
        StageTimes {
            linear_ms: [p.linear_ms(b0.tokens), p.linear_ms(b1.tokens)],
            prefill_attn_ms: b0.prefill_ms,
            gpu_decode_ms: p.gpu_decode_ms(b0.decode_seqs, b0.decode_ctx),
            cpu_attn_ms: [kernel(&b0), kernel(&b1)],
            transfer_ms: [self.cpu_ms(&b0) - kernel(&b0) + self.host_kv_ms(&b0), self.cpu_ms(&b1) - kernel(&b1)],
            copy_ms: p.transfer_ms(
                (b0.cpu_seqs + b1.cpu_seqs) * self.config.transfer_bytes_per_decode
                    + b0.host_kv_tokens * self.config.kv_bytes_per_token,
            ),
            layer_ms,
        }
    }

    fn add_gpu_work(&self, load: &mut Load, computed: usize, n: usize) {
        load.reqs += 1;
        load.tokens += n;
        if n == 1 {
            load.decode_seqs += 1;
            load.decode_ctx += self.attended(computed + 1);
        } else {
            load.prefill_ms += self.prefill_attn_ms(computed, n);
        }
    }

    /// The context a row at `ctx` tokens reads: at most the window in a KV group that slides
    /// (the mean over the groups, which hold as many layers each).
    pub(super) fn attended(&self, ctx: usize) -> usize {
        let windows = &self.config.kv_group_windows;
        windows.iter().map(|w| w.map_or(ctx, |w| ctx.min(w))).sum::<usize>() / windows.len()
    }

    /// A prefill chunk's attention, its earlier context read only as far as the window reaches.
    pub(super) fn prefill_attn_ms(&self, computed: usize, n: usize) -> f64 {
        self.predictor.prefill_attn_ms(self.attended(computed), n)
    }

    /// Device attention of a sub-batch: its prefill chunks, and its GPU decodes as one kernel.
    fn gpu_attn_ms(&self, b: &Load) -> f64 {
        b.prefill_ms + self.predictor.gpu_decode_ms(b.decode_seqs, b.decode_ctx)
    }

    /// CPU attention of one sub-batch with its transfers and hand-off.
    fn cpu_ms(&self, b: &Load) -> f64 {
        if b.cpu_seqs == 0 {
            return 0.0;
        }
        self.predictor.cpu_decode_ms(b.cpu_seqs, b.cpu_ctx)
            + self.predictor.transfer_ms(b.cpu_seqs * self.config.transfer_bytes_per_decode)
            + self.predictor.launch_ms
    }

    /// Slack of each sub-batch's CPU attention under the device work it overlaps with:
    /// `remains[j] = T_l(B_{1-j}) + T_ga(B_j) - T_ca(B_j)`.
    fn remains(&self, b0: &Load, b1: &Load) -> [f64; 2] {
        let l = |b: &Load| self.predictor.linear_ms(b.tokens);
        [l(b1) + self.gpu_attn_ms(b0) - self.cpu_ms(b0), l(b0) + self.gpu_attn_ms(b1) - self.cpu_ms(b1)]
    }

    fn min_remains(&self, b0: &Load, b1: &Load) -> f64 {
        let r = self.remains(b0, b1);
        r[0].min(r[1])
    }

    /// Per-layer time of the pipeline: `max(T_l0, T_ca1) + max(T_l1 + T_ga0, T_ca0)`, or of
    /// sub-batch 0's host-prefill KV copies if they take longer.
    fn pipelined_ms(&self, b0: &Load, b1: &Load) -> f64 {
        let l = |b: &Load| self.predictor.linear_ms(b.tokens);
        let compute = l(b0).max(self.cpu_ms(b1)) + (l(b1) + self.gpu_attn_ms(b0)).max(self.cpu_ms(b0));
        compute.max(self.host_kv_ms(b0))
    }

    /// Per-layer time of one sub-batch run alone (its CPU decodes, if any, under its device
    /// attention), or of its host-prefill KV copies if they take longer.
    fn sequential_ms(&self, b: &Load) -> f64 {
        let compute = self.predictor.linear_ms(b.tokens) + self.gpu_attn_ms(b).max(self.cpu_ms(b));
        compute.max(self.host_kv_ms(b))
    }

    /// The host-prefill KV copies of a sub-batch, per layer. They leave on the copy stream
    /// while the layer computes, so they bound its time rather than add to it.
    fn host_kv_ms(&self, b: &Load) -> f64 {
        self.predictor.transfer_ms(b.host_kv_tokens * self.config.kv_bytes_per_token)
    }

    /// Move the oldest CPU requests to the device while it stays under `watermark` of its
    /// blocks (never in an iteration that preempted). Hysteresis against ping-pong: a swap-in
    /// must leave the device a block of growth for every device request (see
    /// `device_growth`), so that for `block_size` iterations decodes cannot preempt the
    /// request (the newest on the device, so the first victim) right after its copy.
    fn swap_in_cpu_requests(&mut self, step: &mut Step, watermark: f64) {
        if step.preempted() {
            return;
        }
        let limit = (watermark * self.gpu.num_total_blocks() as f64) as usize;
        let mut reserve = self.device_growth();
        let horizon = self.gpu.block_size();
        let mut i = 0;
        while i < self.running.len() && step.budget > 0 {
            let id = self.running[i];
            i += 1;
            let req = &self.requests[&id];
            if req.device != Device::Cpu {
                continue;
            }
            let need = self.gpu.blocks_held(req.num_computed_tokens, req.num_computed_tokens + 1);
            let grows = self.gpu.blocks_for(req.num_tokens() + horizon) - need;
            let used = self.gpu.num_used_blocks() + need;
            if used > limit || (reserve > 0 && used + reserve + grows > self.gpu.num_total_blocks()) {
                break;
            }
            reserve += grows;
            let moved = self.cpu.swap_to(&mut self.gpu, id, &mut step.swap_in);
            let grown = self.gpu.allocate_slots(id, req.num_computed_tokens + 1);
            debug_assert!(moved && grown);
            step.moved.push(id);
            self.requests.get_mut(&id).expect("running request exists").device = Device::Gpu;
            self.stats.num_swapped_in += 1;
            step.push(self.scheduled(id, 1));
        }
        self.stats.num_swapped_in_blocks += step.swap_in.pairs.len() as u64;
    }

    /// Blocks the device requests will still take: the rest of their prompts and one block of
    /// decodes each (room for `block_size` iterations). 0 with no request on the device.
    fn device_growth(&self) -> usize {
        let device_reqs = self.running.iter().map(|id| &self.requests[id]).filter(|r| r.device == Device::Gpu);
        device_reqs.map(|r| self.gpu.blocks_needed(r.id, r.num_tokens() + self.gpu.block_size())).sum()
    }

    /// Give every CPU request the host slot of its next token now, recomputing the newest CPU
    /// requests when the host pool is full.
    fn grow_cpu_requests(&mut self, step: &mut Step) {
        let mut i = 0;
        while i < self.running.len() {
            let id = self.running[i];
            let req = &self.requests[&id];
            if req.device == Device::Cpu && !self.make_room(i, req.num_computed_tokens + 1, step) {
                continue;
            }
            i += 1;
        }
    }

    fn commit_cpu_decodes(&mut self, step: &mut Step, ids: &[RequestId], subs: &[u8]) {
        self.cpu_idle_steps = 0;
        for (&id, &sub) in ids.iter().zip(subs) {
            if step.budget == 0 || step.scheduled.len() >= self.config.max_num_seqs {
                break;
            }
            let mut s = self.scheduled(id, 1);
            s.sub_batch = sub;
            step.push(s);
        }
    }
}

/// Add (`sign` 1) or take back (-1) one CPU decode of context `ctx`.
fn add_cpu_decode(b: &mut Load, ctx: usize, windows: &[Option<usize>], sign: isize) {
    add_cpu_rows(b, ctx - 1, 1, windows, sign);
}

/// Add (`sign` 1) or take back (-1) one request's `n` rows attending on the CPU after its
/// first `computed` tokens: each costs the kernel a decode over its own context, or in a KV
/// group of `windows` that slides, over the window once the context is longer (the mean over
/// the groups, which hold as many layers each).
fn add_cpu_rows(b: &mut Load, computed: usize, n: usize, windows: &[Option<usize>], sign: isize) {
    let step = |x: &mut usize, by: usize| *x = x.wrapping_add_signed(sign * by as isize);
    // Rows at contexts computed + 1 ..= computed + n; those past the window read the window.
    let read = |window: Option<usize>| {
        let below = window.map_or(n, |w| n.min(w.saturating_sub(computed)));
        below * computed + below * (below + 1) / 2 + (n - below) * window.unwrap_or(0)
    };
    let ctx = windows.iter().map(|&w| read(w)).sum::<usize>() / windows.len();
    step(&mut b.reqs, 1);
    step(&mut b.tokens, n);
    step(&mut b.cpu_seqs, n);
    step(&mut b.cpu_ctx, ctx);
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;

    /// A `neo` scheduler of 64 device and 64 host blocks (`speculate.rs`'s tests too).
    pub(in crate::sched::scheduler) fn scheduler(kv_bytes_per_token: usize) -> Scheduler {
        windowed(kv_bytes_per_token, None)
    }

    fn windowed(kv_bytes_per_token: usize, sliding_window: Option<usize>) -> Scheduler {
        Scheduler::new(SchedulerConfig {
            max_num_seqs: 256,
            max_num_batched_tokens: 4096,
            max_model_len: 4096,
            block_size: 16,
            num_gpu_blocks: 64,
            num_cpu_blocks: 64,
            offload: OffloadMode::Neo,
            transfer_bytes_per_decode: 0,
            kv_bytes_per_token,
            force_pipeline: false,
            enable_prefix_caching: false,
            num_cpu_prefix_blocks: 0,
            kv_group_windows: vec![sliding_window],
            speculation: None,
        })
        .unwrap()
    }

    #[test]
    fn a_window_on_every_layer_caps_the_context_each_row_is_priced_for() {
        let s = windowed(0, Some(256));
        // Rows at contexts 250 ..= 260: seven read their context, four the window.
        let mut b = Load::default();
        let sliding = (250..=256).sum::<usize>() + 4 * 256;
        add_cpu_rows(&mut b, 249, 11, &[Some(256)], 1);
        assert_eq!(b.cpu_ctx, sliding);
        add_cpu_rows(&mut b, 249, 11, &[Some(256)], -1);
        assert_eq!(b.cpu_ctx, 0);
        // A hybrid model: a global group reads every row's context, a sliding one the window.
        add_cpu_rows(&mut b, 249, 11, &[None, Some(256)], 1);
        assert_eq!(b.cpu_ctx, ((250..=260).sum::<usize>() + sliding) / 2);
        let hybrid = Scheduler::new(SchedulerConfig { kv_group_windows: vec![None, Some(256)], ..s.config.clone() });
        assert_eq!(hybrid.unwrap().attended(4000), (4000 + 256) / 2);
        let mut g = Load::default();
        s.add_gpu_work(&mut g, 4000, 1);
        assert_eq!(g.decode_ctx, 256);
        assert!(s.predictor.prefill_attn_ms(4000, 8) > s.predictor.prefill_attn_ms(256, 8));
        assert_eq!(s.prefill_attn_ms(4000, 8), s.predictor.prefill_attn_ms(256, 8));
        assert_eq!(scheduler(0).prefill_attn_ms(4000, 8), s.predictor.prefill_attn_ms(4000, 8));
    }

    #[test]
    fn host_prefill_copies_are_priced_in_the_choice_of_plan() {
        // 150 GPU decodes; the pipelined plan also carries a 20-token prompt bound for the host
        // and 100 CPU decodes in sub-batch 1. Without copies it wins; when the prompt's KV copy
        // (per layer) outlasts the layer, the GPU-only plan without that prompt wins.
        let host_prompt = Tentative {
            id: RequestId(0),
            n: 20,
            target: 20,
            to_host: true,
            attn_ms: 0.05,
            hit: PrefixHit::default(),
            over_device: false,
        };
        for (kv_bytes_per_token, pays) in [(0, true), (4 << 20, false)] {
            let s = scheduler(kv_bytes_per_token);
            let mut g = Load::default();
            for _ in 0..150 {
                s.add_gpu_work(&mut g, 500, 1);
            }
            let mut b0 = g;
            s.add_prefill(&mut b0, &host_prompt, 1);
            let mut b1 = Load::default();
            for _ in 0..100 {
                add_cpu_decode(&mut b1, 100, &[None], 1);
            }
            assert_eq!(s.pipeline_pays(&g, &b0, &b1), pays, "{kv_bytes_per_token} B/token");
            let copy = s.host_kv_ms(&b0);
            assert!(s.pipelined_ms(&b0, &b1) >= copy && s.sequential_ms(&b0) >= copy);
        }
    }
}
