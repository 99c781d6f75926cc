//! Property tests of the scheduler and KV managers: random workloads (arrivals, lengths, aborts,
//! stops, tiny pools, prompts sharing prefixes, prefix caching on and off, host tiers of every
//! share) driven through
//! schedule -> fake model -> update, with every invariant checked after every step, a fake KV
//! (each slot holds the token written there, copied by swaps) checked under every request the
//! model runs, and every request accounted for at the end.

use std::collections::HashMap;

use neo_rs::kv::{BlockId, Device};
use neo_rs::sched::{
    Drafter, FinishReason, OffloadMode, RequestId, RequestStatus, Scheduler, SchedulerConfig, SchedulerOutput,
    Speculation,
};
use proptest::prelude::*;

/// The token at `pos` of request `id`, for prompts and fake samples alike, so the plan's
/// `input_ids` can be checked against what each request must hold.
fn token(id: u64, pos: usize) -> u32 {
    (id.wrapping_mul(2_654_435_761).wrapping_add(pos as u64 * 40_503) % 50_000) as u32
}

#[derive(Debug, Clone)]
struct Job {
    arrival_step: usize,
    /// The prompt starts with `shared` tokens of family `family`'s prompt (a common system
    /// prompt), then its own.
    family: u64,
    shared: usize,
    prompt_len: usize,
    max_tokens: usize,
    abort_at_step: Option<usize>,
    stop_after: Option<usize>,
    /// Its outputs come from a 3-token alphabet, so that prompt lookup finds drafts.
    repetitive: bool,
}

#[derive(Debug, Clone)]
struct Workload {
    config: SchedulerConfig,
    jobs: Vec<Job>,
    /// Steps whose model run "fails": `abort_step()` instead of `update()`.
    failed_steps: Vec<usize>,
}

fn workload(mode: impl Strategy<Value = OffloadMode>) -> impl Strategy<Value = Workload> {
    let config = (
        (1usize..=6, 1usize..=48, prop_oneof![Just(1usize), Just(2), Just(4), Just(16)]),
        (1u32..=24, 0u32..=24, mode, any::<bool>()),
    )
        .prop_map(|((max_num_seqs, budget, block_size), (gpu, cpu, offload, force_pipeline))| SchedulerConfig {
            enable_prefix_caching: false,
            max_num_seqs,
            max_num_batched_tokens: budget,
            max_model_len: 64,
            block_size,
            num_gpu_blocks: gpu,
            num_cpu_blocks: cpu,
            offload,
            transfer_bytes_per_decode: 4096,
            kv_bytes_per_token: 1024,
            force_pipeline,
            num_cpu_prefix_blocks: 0,
            kv_group_windows: vec![None],
            speculation: None,
        });
    // Prefix caching on in most workloads, with a host tier of up to the whole host pool.
    // Copies priced from free to dearer than any compute, which moves NEO's choices (host-prefill
    // copies, a host-tier hit copied in or attended in place).
    let copy_cost = prop_oneof![Just(0usize), Just(1024), Just(1 << 24)];
    // KV groups: one global (most), one sliding (every layer slides, Mistral v0.1), or hybrid
    // (Gemma 2/3: global and sliding groups); the blocks behind a sliding group's window are
    // released.
    let groups = (1usize..24, 0u8..10).prop_map(|(w, kind)| match kind {
        0..=4 => vec![None],
        5..=6 => vec![Some(w)],
        7..=8 => vec![None, Some(w)],
        _ => vec![Some(w), None, Some(w)],
    });
    // Speculative decoding in some, verified by the fake model with random acceptance.
    // Drafts by prompt lookup, or handed in as a draft model's (`propose`, before each step).
    let speculation =
        prop::option::weighted(0.4, (1usize..=4, 1usize..=3, any::<bool>(), any::<bool>())).prop_map(|s| {
            s.map(|(num_tokens, lookup_max, always, model)| Speculation {
                num_tokens,
                drafter: if model { Drafter::Model } else { Drafter::PromptLookup { min: 1, max: lookup_max } },
                always,
            })
        });
    let config = (config, prop::bool::weighted(0.7), 0u32..=24, copy_cost, groups, speculation).prop_map(
        |(c, enable_prefix_caching, tier, kv_bytes_per_token, kv_group_windows, speculation)| {
            let num_cpu_prefix_blocks = if enable_prefix_caching { tier.min(c.num_cpu_blocks) } else { 0 };
            SchedulerConfig {
                enable_prefix_caching,
                num_cpu_prefix_blocks,
                kv_bytes_per_token,
                kv_group_windows,
                speculation,
                ..c
            }
        },
    );
    let job = (
        (0usize..40, 0u64..3, 0usize..40),
        1usize..40,
        1usize..24,
        prop::option::weighted(0.15, 0usize..80),
        (prop::option::weighted(0.2, 1usize..12), any::<bool>()),
    )
        .prop_map(
            |((arrival_step, family, shared), prompt_len, max_tokens, abort_at_step, (stop_after, repetitive))| Job {
                arrival_step,
                family,
                shared: shared.min(prompt_len),
                prompt_len,
                max_tokens,
                abort_at_step,
                stop_after,
                repetitive,
            },
        );
    let failed_steps = prop::collection::vec(0usize..60, 0..3);
    (config, prop::collection::vec(job, 1..24), failed_steps).prop_map(|(config, jobs, failed_steps)| Workload {
        config,
        jobs,
        failed_steps,
    })
}

/// What one plan must satisfy on its own.
fn check_plan(s: &Scheduler, out: &SchedulerOutput) -> Result<(), TestCaseError> {
    let c = s.config();
    prop_assert!(out.num_batched_tokens() <= c.max_num_batched_tokens);
    prop_assert!(out.scheduled.len() <= c.max_num_seqs);
    prop_assert!(out.swap_out.pairs.is_empty() || out.swap_in.pairs.is_empty());
    match c.offload {
        OffloadMode::AllCpu => prop_assert!(out.swap_out.pairs.is_empty() && out.swap_in.pairs.is_empty()),
        OffloadMode::GpuOnly => prop_assert!(out.num_cpu_decodes == 0 && out.prefill_to_host.pairs.is_empty()),
        OffloadMode::Neo => {}
    }
    if c.offload != OffloadMode::Neo {
        prop_assert_eq!(out.sub_batch1_start, out.scheduled.len());
    }
    let m = &out.inputs;
    prop_assert_eq!(m.input_ids.len(), out.num_batched_tokens());
    prop_assert_eq!(m.query_start_loc.len(), out.scheduled.len() + 1);
    let num_gpu_decodes = out.num_decodes - out.num_cpu_decodes;
    let mut slots = std::collections::HashSet::new();
    let mut staged = Vec::new();
    for (i, sr) in out.scheduled.iter().enumerate() {
        let req = s.request(sr.id).expect("scheduled request exists");
        prop_assert_eq!(req.status, RequestStatus::Running);
        prop_assert_eq!(sr.sub_batch == 1, i >= out.sub_batch1_start);
        if i < out.sub_batch1_start {
            // Sub-batch 0: GPU decodes, CPU attention (decodes, prompts decoded in place over
            // host blocks), device prefills, host prefills.
            let host_prefill = i >= out.sub_batch1_start - out.num_host_prefills;
            prop_assert_eq!(i < num_gpu_decodes, sr.device == Device::Gpu && sr.num_new_tokens == 1);
            prop_assert_eq!(i >= num_gpu_decodes && i < out.num_decodes, sr.attends_on_cpu());
            prop_assert_eq!((i >= num_gpu_decodes && i < out.num_decodes) || host_prefill, sr.device == Device::Cpu);
            if host_prefill {
                prop_assert!(sr.num_computed_tokens == 0 && sr.sample && c.offload != OffloadMode::GpuOnly);
            }
        } else {
            // Sub-batch 1 holds CPU decodes only (with their drafts).
            prop_assert!(sr.num_new_tokens == 1 + req.num_drafts && sr.device == Device::Cpu);
        }
        prop_assert!(sr.num_new_tokens >= 1);
        if sr.attends_on_cpu() {
            // CPU attention finishes a prompt in one go (no prefill crawls on the CPU), and only
            // under `neo` runs more than one row of a request.
            prop_assert!(sr.sample, "request {} decodes on the CPU before its prefill is done", sr.id);
            prop_assert!(
                sr.num_new_tokens == 1 + req.num_drafts || (c.offload == OffloadMode::Neo && sr.sub_batch == 0)
            );
        }
        // Drafts only where speculation is on, only for decodes, within max_tokens; each
        // drafted row is sampled.
        if req.num_drafts > 0 {
            prop_assert!(c.speculation.is_some_and(|sp| req.num_drafts <= sp.num_tokens));
            prop_assert!(
                sr.sample && sr.num_new_tokens == 1 + req.num_drafts && req.num_output_tokens() > req.num_drafts
            );
            // The drafts and the token after them fit max_tokens.
            prop_assert!(req.num_output_tokens() < req.max_tokens);
        }
        prop_assert_eq!(sr.sample, sr.num_computed_tokens + sr.num_new_tokens == req.num_tokens());
        let table = s.kv(sr.device).table(sr.id);
        let groups = c.kv_group_windows.len();
        prop_assert_eq!((m.num_groups, table.len() % groups), (groups, 0));
        prop_assert_eq!(m.seq_lens[i] as usize, sr.num_computed_tokens + sr.num_new_tokens);
        prop_assert!(table.len() / groups * c.block_size >= m.seq_lens[i] as usize);
        let start = m.query_start_loc[i] as usize;
        for g in 0..groups {
            // Group g's entries (every `groups`-th); blocks released behind the window show as 0.
            let row = &m.block_tables[(g * out.scheduled.len() + i) * m.max_blocks..][..m.max_blocks];
            let shown = |b: &BlockId| if b.is_null() { 0 } else { b.0 as i32 };
            prop_assert!(table.iter().skip(g).step_by(groups).zip(row).all(|(b, &r)| shown(b) == r));
            for (k, pos) in (sr.num_computed_tokens..sr.num_computed_tokens + sr.num_new_tokens).enumerate() {
                prop_assert_eq!(m.input_ids[start + k], i64::from(req.token_ids[pos]));
                prop_assert_eq!(m.positions[start + k], pos as i64);
                let slot = m.slot_mapping[g * m.input_ids.len() + start + k];
                if sr.attends_on_cpu() {
                    prop_assert_eq!(slot, -1);
                    continue;
                }
                let slot = slot as usize;
                prop_assert_eq!(slot / c.block_size, table[pos / c.block_size * groups + g].0 as usize);
                prop_assert!(slots.insert((sr.device, slot)), "slot {} written twice", slot);
            }
        }
        // A prefill finishing into the host pool stages every device block to its host twin
        // (blocks released behind the window are released in both).
        let host = s.kv(Device::Cpu).table(sr.id);
        if sr.device == Device::Gpu && !host.is_empty() {
            prop_assert!(sr.sample && c.offload != OffloadMode::GpuOnly);
            prop_assert_eq!(host.len(), table.len());
            prop_assert!(table.iter().zip(host).all(|(d, h)| d.is_null() == h.is_null()));
            staged.extend(table.iter().copied().zip(host.iter().copied()).filter(|(d, _)| !d.is_null()));
        }
    }
    let pipelined = out.sub_batch1_start < out.scheduled.len();
    if c.offload == OffloadMode::Neo && !c.force_pipeline && pipelined && out.num_host_prefills == 0 {
        // A pipelined plan hides each sub-batch's CPU attention (with its copies) under the other
        // sub-batch's device work, by the predictor's own estimates: no negative slack. (Host
        // prefills' KV copies are priced into transfer_ms[0] too; those plans are left out.)
        let p = &out.predicted;
        {
            let slack0 = p.linear_ms[1] + p.prefill_attn_ms + p.gpu_decode_ms - p.cpu_attn_ms[0] - p.transfer_ms[0];
            let slack1 = p.linear_ms[0] - p.cpu_attn_ms[1] - p.transfer_ms[1];
            prop_assert!(slack0 >= -1e-9 && slack1 >= -1e-9, "slack {} {}: {:?}", slack0, slack1, p);
        }
    }
    if c.offload == OffloadMode::Neo && out.num_host_prefills > 0 {
        // Host-bound prefills leave the host room to swap out everything the device holds.
        let (gpu, cpu) = (s.kv(Device::Gpu), s.kv(Device::Cpu));
        prop_assert!(cpu.num_free_blocks() >= gpu.num_total_blocks() - gpu.num_free_blocks());
    }
    // Each kind of copy writes a host block at most once (two kinds may write one block: the
    // fake KV plays them in the runner's order).
    for pairs in [&out.swap_out.pairs, &out.cache_to_host.pairs] {
        let mut written = std::collections::HashSet::new();
        prop_assert!(pairs.iter().all(|p| written.insert(p.1)), "a host block written twice: {:?}", pairs);
    }
    let mut planned = out.prefill_to_host.pairs.clone();
    planned.sort();
    staged.sort();
    prop_assert_eq!(staged, planned);
    Ok(())
}

/// A slot a copy writes (block, offset), and what it receives (nothing: a slot never written).
type Gathered = ((u32, usize), Option<(u32, usize)>);

/// What the model would leave in the pools: the token whose KV each slot holds.
#[derive(Default)]
struct FakeKv {
    /// The token and the KV group (whose layers the block holds) of each slot's KV.
    slots: HashMap<(Device, u32, usize), (u32, usize)>,
}

impl FakeKv {
    /// The token each slot of `pairs`' source blocks holds, keyed by destination slot.
    fn gather(&self, pairs: &[(BlockId, BlockId)], src: Device, bs: usize) -> Vec<Gathered> {
        let held = |a: BlockId, o| self.slots.get(&(src, a.0, o)).copied();
        pairs.iter().flat_map(|&(a, b)| (0..bs).map(move |o| ((b.0, o), held(a, o)))).collect()
    }

    fn land(&mut self, gathered: Vec<Gathered>, dst: Device) {
        for ((b, o), t) in gathered {
            match t {
                Some(t) => self.slots.insert((dst, b, o), t),
                None => self.slots.remove(&(dst, b, o)),
            };
        }
    }

    /// Play one plan in the runner's order: every copy's source is read before anything the plan
    /// writes (device blocks evicted from the prefix cache, swap-outs; host blocks bound for the
    /// device), swap-outs land before the forward and copies into the device at its start; every
    /// scheduled request reads the KV of its computed tokens within the window of its first new
    /// token (checked: each slot of its table holds its own token there, shared and host-tier
    /// prefix blocks included) and writes its new tokens;
    /// then host-bound prefills are staged to the host, and the evicted blocks land in the tier.
    fn run(&mut self, s: &Scheduler, out: &SchedulerOutput) -> Result<(), TestCaseError> {
        let bs = s.config().block_size;
        let swapped_out = self.gather(&out.swap_out.pairs, Device::Gpu, bs);
        let demoted = self.gather(&out.cache_to_host.pairs, Device::Gpu, bs);
        let mut incoming = self.gather(&out.swap_in.pairs, Device::Cpu, bs);
        incoming.extend(self.gather(&out.cache_to_device.pairs, Device::Cpu, bs));
        self.land(swapped_out, Device::Cpu);
        self.land(incoming, Device::Gpu);
        let windows = &s.config().kv_group_windows;
        for sr in &out.scheduled {
            let req = s.request(sr.id).expect("scheduled request exists");
            let table = s.kv(sr.device).table(sr.id);
            for (g, window) in windows.iter().enumerate() {
                let entry = |pos: usize| table[pos / bs * windows.len() + g];
                let first = window.map_or(0, |w| (sr.num_computed_tokens + 1).saturating_sub(w));
                for pos in first..sr.num_computed_tokens {
                    let held = self.slots.get(&(sr.device, entry(pos).0, pos % bs)).copied();
                    let want = Some((req.token_ids[pos], g));
                    prop_assert_eq!(held, want, "request {} reads wrong KV at {} in group {}", sr.id, pos, g);
                }
                for pos in sr.num_computed_tokens..sr.num_computed_tokens + sr.num_new_tokens {
                    prop_assert!(!entry(pos).is_null(), "request {} writes a released block at {}", sr.id, pos);
                    self.slots.insert((sr.device, entry(pos).0, pos % bs), (req.token_ids[pos], g));
                }
            }
        }
        let staged = self.gather(&out.prefill_to_host.pairs, Device::Gpu, bs);
        self.land(staged, Device::Cpu);
        self.land(demoted, Device::Cpu);
        Ok(())
    }
}

fn run(w: &Workload) -> Result<(), TestCaseError> {
    let mut s = Scheduler::new(w.config.clone()).expect("valid config");
    let mut outcome: HashMap<u64, FinishReason> = HashMap::new();
    let mut accepted = Vec::new();
    let mut fake_kv = FakeKv::default();
    let mut step = 0;
    loop {
        for (i, job) in w.jobs.iter().enumerate().filter(|(_, j)| j.arrival_step == step) {
            let id = i as u64;
            let prompt = (0..job.prompt_len)
                .map(|p| if p < job.shared { token(1_000 + job.family, p) } else { token(id, p) })
                .collect();
            // Every block of a global group; at most a chunk's worth beyond the window of a
            // sliding one is held at once.
            let all = (job.prompt_len + job.max_tokens - 1).div_ceil(w.config.block_size);
            let span = |w: usize, c: &SchedulerConfig| (w - 1 + c.max_num_batched_tokens).div_ceil(c.block_size) + 1;
            let need: usize =
                w.config.kv_group_windows.iter().map(|g| g.map_or(all, |win| all.min(span(win, &w.config)))).sum();
            let fits = job.prompt_len + job.max_tokens <= w.config.max_model_len
                && need <= w.config.num_gpu_blocks as usize
                && (w.config.offload == OffloadMode::GpuOnly || need <= w.config.num_cpu_blocks as usize);
            prop_assert_eq!(s.add_request(RequestId(id), prompt, job.max_tokens).is_ok(), fits);
            if fits {
                accepted.push(i);
            }
        }
        for (i, job) in w.jobs.iter().enumerate() {
            if job.abort_at_step == Some(step) && s.abort(RequestId(i as u64)) {
                outcome.insert(i as u64, FinishReason::Abort);
            }
        }
        s.check_invariants().map_err(TestCaseError::fail)?;
        let arrivals_left = w.jobs.iter().any(|j| j.arrival_step > step);
        if !s.has_unfinished() && !arrivals_left {
            break;
        }
        prop_assert!(step < 5_000, "no progress after {} steps", step);
        if let Some(Speculation { drafter: Drafter::Model, num_tokens, .. }) = w.config.speculation {
            // A draft model drafts for running decodes only, within k and their max_tokens.
            let mut drafts = Vec::new();
            for (id, n, longest) in s.draft_requests() {
                let req = s.request(id).expect("a named request exists");
                prop_assert!(req.status == RequestStatus::Running && req.num_pending_tokens() == 1);
                prop_assert!((1..=num_tokens).contains(&n) && req.num_output_tokens() + n < req.max_tokens);
                prop_assert_eq!(longest, req.num_prompt_tokens + req.max_tokens);
                drafts.push((id, (0..n).map(|j| token(id.0 + 7, req.num_tokens() + j)).collect()));
            }
            s.propose(drafts).unwrap();
        }
        let out = s.schedule().unwrap();
        check_plan(&s, &out)?;
        fake_kv.run(&s, &out)?;
        prop_assert!(s.schedule().is_err(), "a second schedule() before update()");
        if s.has_unfinished() && s.num_running() > 0 {
            prop_assert!(!out.scheduled.is_empty(), "running requests but nothing scheduled");
        }
        if w.failed_steps.contains(&step) {
            // Every request the plan ran is aborted (and perhaps some it swapped), nothing else.
            let aborted = s.abort_step();
            for sr in &out.scheduled {
                prop_assert!(aborted.contains(&sr.id), "scheduled request {} survived a failed step", sr.id);
            }
            for id in aborted {
                prop_assert!(s.request(id).is_none());
                prop_assert!(outcome.insert(id.0, FinishReason::Abort).is_none(), "request {} finished twice", id);
            }
            prop_assert!(s.update(&[], &[]).is_err(), "update() after abort_step()");
            s.check_invariants().map_err(TestCaseError::fail)?;
            step += 1;
            continue;
        }
        // The fake sampler: each sampled request (its rows consecutive) accepts a random number
        // of its drafts, then samples one more token; a stop inside what it emits ends it there.
        let (mut sampled, mut counts, mut stopped) = (Vec::new(), Vec::new(), Vec::new());
        for rows in out.inputs.sample_ids.chunk_by(|a, b| a == b) {
            let id = rows[0];
            let (job, req) = (&w.jobs[id as usize], s.request(RequestId(id)).expect("sampled request exists"));
            let drafts = &req.token_ids[req.num_tokens() - req.num_drafts..];
            prop_assert_eq!(rows.len(), drafts.len() + 1);
            let end = req.num_tokens() - drafts.len();
            let accepted = (token(id, end) as usize) % rows.len();
            let fake = |pos| if job.repetitive { token(id, pos) % 3 } else { token(id, pos) };
            let mut emitted = drafts[..accepted].to_vec();
            emitted.push(fake(end + accepted));
            let outputs = req.num_output_tokens() - drafts.len();
            if let Some(at) = job.stop_after.filter(|&n| n > outputs && n <= outputs + emitted.len()) {
                emitted.truncate(at - outputs);
                stopped.push(RequestId(id));
            }
            counts.push(emitted.len());
            sampled.extend(emitted);
        }
        for (id, reason) in
            s.update_speculative(&sampled, &counts, &stopped).map_err(|e| TestCaseError::fail(e.to_string()))?
        {
            prop_assert!(outcome.insert(id.0, reason).is_none(), "request {} finished twice", id);
        }
        s.check_invariants().map_err(TestCaseError::fail)?;
        // However long a request, each sliding group holds the window's blocks and one more.
        let windows = &w.config.kv_group_windows;
        for (g, window) in windows.iter().enumerate().filter_map(|(g, w)| w.map(|w| (g, w))) {
            for kv in [s.kv(Device::Gpu), s.kv(Device::Cpu)] {
                for (id, table) in kv.tables() {
                    let held = table.iter().skip(g).step_by(windows.len()).filter(|b| !b.is_null()).count();
                    prop_assert!(
                        held <= window.div_ceil(w.config.block_size) + 1,
                        "request {} holds {} blocks of group {}",
                        id,
                        held,
                        g
                    );
                }
            }
        }
        step += 1;
    }
    for kv in [s.kv(Device::Gpu), s.kv(Device::Cpu)] {
        prop_assert_eq!(kv.num_free_blocks(), kv.num_total_blocks());
    }
    for i in accepted {
        let job = &w.jobs[i];
        let reason = outcome.get(&(i as u64)).copied();
        prop_assert!(reason.is_some(), "request {} never finished", i);
        if reason != Some(FinishReason::Abort) {
            let stop_first = job.stop_after.is_some_and(|n| n <= job.max_tokens);
            let want = if stop_first { FinishReason::Stop } else { FinishReason::Length };
            prop_assert_eq!(reason, Some(want), "request {}", i);
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 10_000, ..ProptestConfig::default() })]
    #[test]
    fn random_workloads_keep_every_invariant(
        w in workload(prop_oneof![Just(OffloadMode::GpuOnly), Just(OffloadMode::AllCpu)])
    ) {
        run(&w)?;
    }

    /// The NEO policy priced by the synthetic perf model.
    #[test]
    fn random_workloads_under_neo_keep_every_invariant(w in workload(Just(OffloadMode::Neo))) {
        run(&w)?;
    }
}

/// Found by the NEO property test: a prompt placed in place over its host blocks took the host
/// room, then a device prefill pinned host-tier blocks to copy in, and the first prompt's
/// blocks were no longer there at commit.
#[test]
fn a_device_prefill_does_not_pin_the_host_room_of_an_earlier_in_place_one() {
    let job = |arrival_step, family, shared, prompt_len, max_tokens| Job {
        arrival_step,
        family,
        shared,
        prompt_len,
        max_tokens,
        abort_at_step: None,
        stop_after: None,
        repetitive: false,
    };
    let w = Workload {
        config: SchedulerConfig {
            max_num_seqs: 2,
            max_num_batched_tokens: 35,
            max_model_len: 64,
            block_size: 2,
            num_gpu_blocks: 21,
            num_cpu_blocks: 22,
            offload: OffloadMode::Neo,
            transfer_bytes_per_decode: 4096,
            kv_bytes_per_token: 16 << 20,
            force_pipeline: false,
            enable_prefix_caching: true,
            num_cpu_prefix_blocks: 22,
            kv_group_windows: vec![None],
            speculation: None,
        },
        jobs: vec![
            job(15, 1, 8, 8, 16),
            job(22, 2, 0, 1, 5),
            job(23, 0, 2, 12, 12),
            job(27, 2, 4, 38, 1),
            job(12, 2, 4, 4, 14),
            job(22, 0, 0, 14, 1),
            job(27, 1, 8, 9, 1),
        ],
        failed_steps: vec![],
    };
    run(&w).unwrap();
}
