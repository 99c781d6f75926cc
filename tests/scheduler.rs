//! Property tests of the scheduler and KV managers: random workloads (arrivals, lengths, aborts,
//! stops, tiny pools, prompts sharing prefixes, prefix caching on and off) driven through
//! schedule -> fake model -> update, with every invariant checked after every step, a fake KV
//! (each slot holds the token written there, copied by swaps) checked under every request the
//! model runs, and every request accounted for at the end.

use std::collections::{HashMap, VecDeque};

use neo_rs::kv::Device;
use neo_rs::sched::{FinishReason, OffloadMode, RequestId, RequestStatus, Scheduler, SchedulerConfig, SchedulerOutput};
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
        });
    let config = (config, prop::bool::weighted(0.7))
        .prop_map(|(c, enable_prefix_caching)| SchedulerConfig { enable_prefix_caching, ..c });
    let job = (
        (0usize..40, 0u64..3, 0usize..40),
        1usize..40,
        1usize..24,
        prop::option::weighted(0.15, 0usize..80),
        prop::option::weighted(0.2, 1usize..12),
    )
        .prop_map(|((arrival_step, family, shared), prompt_len, max_tokens, abort_at_step, stop_after)| Job {
            arrival_step,
            family,
            shared: shared.min(prompt_len),
            prompt_len,
            max_tokens,
            abort_at_step,
            stop_after,
        });
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
            // Sub-batch 0: GPU decodes, CPU decodes, device prefills, host prefills.
            let host_prefill = i >= out.sub_batch1_start - out.num_host_prefills;
            prop_assert_eq!(i < out.num_decodes, sr.num_new_tokens == 1);
            prop_assert_eq!((i >= num_gpu_decodes && i < out.num_decodes) || host_prefill, sr.device == Device::Cpu);
            if host_prefill {
                prop_assert!(sr.num_computed_tokens == 0 && sr.sample && c.offload != OffloadMode::GpuOnly);
            }
        } else {
            // Sub-batch 1 holds CPU decodes only.
            prop_assert!(sr.num_new_tokens == 1 && sr.device == Device::Cpu);
        }
        prop_assert!(sr.num_new_tokens >= 1);
        if sr.device == Device::Cpu && sr.num_new_tokens == 1 {
            // A CPU decode is a real decode: its prompt is done (no prefill crawls on the CPU).
            prop_assert!(sr.sample, "request {} decodes on the CPU before its prefill is done", sr.id);
        }
        prop_assert_eq!(sr.sample, sr.num_computed_tokens + sr.num_new_tokens == req.num_tokens());
        let table = s.kv(sr.device).table(sr.id);
        let row = &m.block_tables[i * m.max_blocks..(i + 1) * m.max_blocks];
        prop_assert!(table.iter().zip(row).all(|(b, &r)| b.0 as i32 == r));
        prop_assert_eq!(m.seq_lens[i] as usize, sr.num_computed_tokens + sr.num_new_tokens);
        prop_assert!(table.len() * c.block_size >= m.seq_lens[i] as usize);
        let start = m.query_start_loc[i] as usize;
        for (k, pos) in (sr.num_computed_tokens..sr.num_computed_tokens + sr.num_new_tokens).enumerate() {
            prop_assert_eq!(m.input_ids[start + k], i64::from(req.token_ids[pos]));
            prop_assert_eq!(m.positions[start + k], pos as i64);
            let slot = m.slot_mapping[start + k];
            if sr.device == Device::Cpu && sr.num_new_tokens == 1 {
                prop_assert_eq!(slot, -1);
                continue;
            }
            let slot = slot as usize;
            prop_assert_eq!(slot / c.block_size, table[pos / c.block_size].0 as usize);
            prop_assert!(slots.insert((sr.device, slot)), "slot {} written twice", slot);
        }
        // A prefill finishing into the host pool stages every device block to its host twin.
        let host = s.kv(Device::Cpu).table(sr.id);
        if sr.device == Device::Gpu && !host.is_empty() {
            prop_assert!(sr.sample && c.offload != OffloadMode::GpuOnly);
            prop_assert_eq!(host.len(), table.len());
            staged.extend(table.iter().copied().zip(host.iter().copied()));
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
    let mut planned = out.prefill_to_host.pairs.clone();
    planned.sort();
    staged.sort();
    prop_assert_eq!(staged, planned);
    Ok(())
}

/// What the model would leave in the pools: the token whose KV each slot holds.
#[derive(Default)]
struct FakeKv {
    slots: HashMap<(Device, u32, usize), u32>,
}

impl FakeKv {
    fn copy(&mut self, pairs: &[(neo_rs::kv::BlockId, neo_rs::kv::BlockId)], src: Device, dst: Device, bs: usize) {
        for &(a, b) in pairs {
            for o in 0..bs {
                match self.slots.get(&(src, a.0, o)).copied() {
                    Some(t) => self.slots.insert((dst, b.0, o), t),
                    None => self.slots.remove(&(dst, b.0, o)),
                };
            }
        }
    }

    /// Play one plan: swaps, then every scheduled request reads the KV of its computed tokens
    /// (checked: each slot of its table holds its own token there, shared prefix blocks
    /// included) and writes its new tokens, then host-bound prefills are copied to the host.
    fn run(&mut self, s: &Scheduler, out: &SchedulerOutput) -> Result<(), TestCaseError> {
        let bs = s.config().block_size;
        self.copy(&out.swap_out.pairs, Device::Gpu, Device::Cpu, bs);
        self.copy(&out.swap_in.pairs, Device::Cpu, Device::Gpu, bs);
        for sr in &out.scheduled {
            let req = s.request(sr.id).expect("scheduled request exists");
            let table = s.kv(sr.device).table(sr.id);
            for pos in 0..sr.num_computed_tokens {
                let held = self.slots.get(&(sr.device, table[pos / bs].0, pos % bs)).copied();
                prop_assert_eq!(held, Some(req.token_ids[pos]), "request {} reads wrong KV at {}", sr.id, pos);
            }
            for pos in sr.num_computed_tokens..sr.num_computed_tokens + sr.num_new_tokens {
                self.slots.insert((sr.device, table[pos / bs].0, pos % bs), req.token_ids[pos]);
            }
        }
        self.copy(&out.prefill_to_host.pairs, Device::Gpu, Device::Cpu, bs);
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
            let need = (job.prompt_len + job.max_tokens - 1).div_ceil(w.config.block_size);
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
        let sampled: Vec<u32> = out
            .inputs
            .sample_ids
            .iter()
            .map(|&id| token(id, s.request(RequestId(id)).expect("sampled request exists").num_tokens()))
            .collect();
        let stopped: Vec<RequestId> = out
            .inputs
            .sample_ids
            .iter()
            .filter(|&&id| {
                let req = s.request(RequestId(id)).expect("sampled request exists");
                w.jobs[id as usize].stop_after == Some(req.num_output_tokens() + 1)
            })
            .map(|&id| RequestId(id))
            .collect();
        for (id, reason) in s.update(&sampled, &stopped).map_err(|e| TestCaseError::fail(e.to_string()))? {
            prop_assert!(outcome.insert(id.0, reason).is_none(), "request {} finished twice", id);
        }
        s.check_invariants().map_err(TestCaseError::fail)?;
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

fn config(gpu: u32, cpu: u32, budget: usize) -> SchedulerConfig {
    SchedulerConfig {
        max_num_seqs: 8,
        max_num_batched_tokens: budget,
        max_model_len: 64,
        block_size: 4,
        num_gpu_blocks: gpu,
        num_cpu_blocks: cpu,
        offload: OffloadMode::GpuOnly,
        transfer_bytes_per_decode: 0,
        kv_bytes_per_token: 0,
        force_pipeline: false,
        enable_prefix_caching: false,
    }
}

/// Drive to completion with fake tokens; return every plan.
fn drain(s: &mut Scheduler) -> Vec<SchedulerOutput> {
    let mut plans = Vec::new();
    while s.has_unfinished() {
        let out = s.schedule().unwrap();
        let sampled: Vec<u32> = out.inputs.sample_ids.iter().map(|_| 7).collect();
        s.update(&sampled, &[]).unwrap();
        s.check_invariants().unwrap();
        plans.push(out);
        assert!(plans.len() < 1000);
    }
    plans
}

#[test]
fn chunked_prefill_splits_a_long_prompt_and_decodes_ride_along() {
    let mut s = Scheduler::new(config(32, 0, 8)).unwrap();
    s.add_request(RequestId(0), vec![1; 3], 4).unwrap();
    s.add_request(RequestId(1), vec![2; 20], 2).unwrap();
    let plans = drain(&mut s);
    let chunks: Vec<usize> = plans[0].scheduled.iter().map(|r| r.num_new_tokens).collect();
    assert_eq!(chunks, vec![3, 5]);
    // Next step: request 0 decodes, request 1 continues its prompt with the remaining budget.
    assert_eq!(plans[1].num_decodes, 1);
    assert_eq!(plans[1].scheduled[1].num_new_tokens, 7);
    assert!(!plans[1].scheduled[1].sample);
}

#[test]
fn full_device_pool_swaps_out_then_back_in() {
    // 3 requests of 8 prompt tokens fill 6 blocks; their first decode needs a 7th.
    let mut s = Scheduler::new(config(6, 16, 64)).unwrap();
    for id in 0..3 {
        s.add_request(RequestId(id), vec![3; 8], 4).unwrap();
    }
    let plans = drain(&mut s);
    let out = plans.iter().position(|p| !p.swap_out.pairs.is_empty()).expect("a swap-out happened");
    assert_eq!(plans[out].swap_out.pairs.len(), 2);
    assert!(plans[out + 1..].iter().any(|p| !p.swap_in.pairs.is_empty()));
    assert!(plans.iter().all(|p| p.recomputed.is_empty()));
    let st = s.stats();
    assert!(st.num_swapped_out > 0);
    assert_eq!(st.num_swapped_in, st.num_swapped_out, "every swapped-out request came back");
}

#[test]
fn no_host_room_means_recompute() {
    let mut s = Scheduler::new(config(6, 0, 64)).unwrap();
    for id in 0..3 {
        s.add_request(RequestId(id), vec![3; 8], 4).unwrap();
    }
    let plans = drain(&mut s);
    assert!(plans.iter().any(|p| !p.recomputed.is_empty()));
    assert!(plans.iter().all(|p| p.swap_out.pairs.is_empty()));
    // A recomputed request prefills its prompt and its outputs so far again.
    let victim = plans.iter().find_map(|p| p.recomputed.first()).copied().unwrap();
    assert!(plans.iter().any(|p| p.scheduled.iter().any(|r| r.id == victim && r.num_new_tokens > 8)));
}

#[test]
fn bad_requests_are_refused_and_abort_frees_everything() {
    let mut s = Scheduler::new(config(4, 4, 64)).unwrap();
    assert!(s.add_request(RequestId(0), vec![], 4).is_err());
    assert!(s.add_request(RequestId(0), vec![1], 0).is_err());
    assert!(s.add_request(RequestId(0), vec![1; 60], 5).is_err(), "over max_model_len");
    assert!(s.add_request(RequestId(0), vec![1; 16], 2).is_err(), "more blocks than the pool");
    s.add_request(RequestId(0), vec![1; 10], 3).unwrap();
    assert!(s.add_request(RequestId(0), vec![1; 2], 3).is_err(), "duplicate id");
    let out = s.schedule().unwrap();
    assert_eq!(out.inputs.sample_ids, vec![0]);
    assert!(s.update(&[], &[]).is_err(), "one sampled token expected");
    assert!(s.abort(RequestId(0)));
    assert!(!s.abort(RequestId(0)));
    assert_eq!(s.kv(Device::Gpu).num_free_blocks(), 4);
    s.check_invariants().unwrap();
    assert!(Scheduler::new(config(0, 4, 64)).is_err());
}

#[test]
fn all_mode_moves_finished_prefills_to_the_host_and_decodes_there() {
    let mut s = Scheduler::new(SchedulerConfig { offload: OffloadMode::AllCpu, ..config(4, 12, 6) }).unwrap();
    s.add_request(RequestId(0), vec![1; 9], 3).unwrap();
    s.add_request(RequestId(1), vec![2; 2], 3).unwrap();
    let plans = drain(&mut s);
    // Request 0's prompt is chunked (6 + 3): its last chunk stages its 3 device blocks to the
    // host. Request 1's whole prompt fits the next chunk and is written to the host directly.
    assert_eq!(plans[0].prefill_to_host.pairs.len(), 0);
    assert_eq!(plans[1].prefill_to_host.pairs.len(), 3);
    assert_eq!(plans[1].num_host_prefills, 1);
    // Then both decode on the CPU, never on the device.
    assert!(plans[2..].iter().all(|p| p.num_cpu_decodes == p.scheduled.len() && p.num_decodes == p.scheduled.len()));
    assert!(plans[2..].iter().all(|p| p.inputs.slot_mapping.iter().all(|&x| x == -1)));
    assert_eq!(s.stats().num_prefills_to_host, 2);
}

#[test]
fn neo_mode_offloads_pipelines_and_swaps_both_ways() {
    let cfg = SchedulerConfig {
        offload: OffloadMode::Neo,
        max_num_seqs: 16,
        max_num_batched_tokens: 256,
        block_size: 4,
        num_gpu_blocks: 24,
        num_cpu_blocks: 128,
        transfer_bytes_per_decode: 4096,
        kv_bytes_per_token: 1024,
        force_pipeline: false,
        enable_prefix_caching: false,
        max_model_len: 128,
    };
    let mut s = Scheduler::new(cfg).unwrap();
    for id in 0..12 {
        s.add_request(RequestId(id), vec![1; 20 + id as usize], 40).unwrap();
    }
    let plans = drain(&mut s);
    let st = s.stats();
    assert!(st.num_pipelined_steps > 0, "{st:?}");
    assert!(st.num_prefills_to_host > 0 && st.num_swapped_in > 0, "{st:?}");
    let pipelined = plans.iter().find(|p| p.sub_batch1_start < p.scheduled.len()).unwrap();
    assert!(pipelined.scheduled[pipelined.sub_batch1_start..].iter().all(|r| r.device == Device::Cpu));
    assert!(plans.iter().any(|p| p.num_cpu_decodes > 0 && p.num_decodes > p.num_cpu_decodes));
}

#[test]
fn a_failed_step_aborts_what_it_ran_and_swapped() {
    let mut s = Scheduler::new(config(6, 16, 64)).unwrap();
    for id in 0..3 {
        s.add_request(RequestId(id), vec![3; 8], 4).unwrap();
    }
    assert!(s.abort_step().is_empty(), "nothing in flight");
    assert!(s.update(&[], &[]).is_err(), "update() without schedule()");
    loop {
        let out = s.schedule().unwrap();
        if !out.swap_out.pairs.is_empty() {
            // Two requests decode; the third was swapped out by this very plan.
            assert_eq!(out.scheduled.len(), 2);
            assert_eq!(s.abort_step().len(), 3);
            break;
        }
        let sampled: Vec<u32> = out.inputs.sample_ids.iter().map(|_| 7).collect();
        s.update(&sampled, &[]).unwrap();
    }
    s.check_invariants().unwrap();
    assert!(!s.has_unfinished());
    assert_eq!((s.kv(Device::Gpu).num_free_blocks(), s.kv(Device::Cpu).num_free_blocks()), (6, 16));
    s.add_request(RequestId(9), vec![1; 4], 2).unwrap();
    assert_eq!(drain(&mut s).len(), 2, "the scheduler serves new requests after a failed step");
}

#[test]
fn neo_keeps_host_room_for_swap_outs() {
    // Host-bound prefills may not take the host blocks that device requests would need when the
    // device fills up and they are preempted (before this rule, this workload swapped nothing
    // out and recomputed instead).
    let cfg = SchedulerConfig { offload: OffloadMode::Neo, force_pipeline: true, ..config(8, 16, 64) };
    let mut s = Scheduler::new(cfg).unwrap();
    for id in 0..8 {
        s.add_request(RequestId(id), vec![3; 12], 10).unwrap();
    }
    while s.has_unfinished() {
        let out = s.schedule().unwrap();
        if out.num_host_prefills > 0 {
            let (gpu, cpu) = (s.kv(Device::Gpu), s.kv(Device::Cpu));
            assert!(cpu.num_free_blocks() >= gpu.num_total_blocks() - gpu.num_free_blocks());
        }
        let sampled: Vec<u32> = out.inputs.sample_ids.iter().map(|_| 7).collect();
        s.update(&sampled, &[]).unwrap();
    }
    let st = s.stats();
    assert!(st.num_prefills_to_host > 0 && st.num_swapped_out > 0, "{st:?}");
}

#[test]
fn neo_never_pipelines_when_the_cpu_cannot_hide_under_the_device() {
    // A CPU whose attention takes 100x the device's whole layer: no CPU decode fits under the
    // other sub-batch's work, so no iteration pipelines; the requests whose prompts went to the
    // host pool still finish (swapped in once they are owed the device, or alone).
    let cfg = SchedulerConfig { offload: OffloadMode::Neo, ..config(8, 32, 64) };
    let mut s = Scheduler::new(cfg).unwrap();
    let slow = neo_rs::sched::Table2::new(vec![1.0, 1024.0], vec![0.0, 1e6], vec![100.0; 4]).unwrap();
    s.predictor_mut().cpu_decode = slow;
    for id in 0..8 {
        s.add_request(RequestId(id), vec![3; 12], 10).unwrap();
    }
    let plans = drain(&mut s);
    assert!(s.stats().num_prefills_to_host > 0, "the host pool was used");
    assert!(plans.iter().all(|p| p.sub_batch1_start == p.scheduled.len()));
    assert_eq!(s.stats().num_pipelined_steps, 0);
}

#[test]
fn neo_sends_overflow_prompts_to_the_host_before_any_cpu_decode_exists() {
    // The device holds 3 of the 6 prompts, enough linear work on its own. With no request on
    // the CPU tier yet, the rest are prefilled into the host pool rather than left waiting for
    // device room (before, neo offloaded nothing here until something was preempted).
    let cfg = SchedulerConfig { offload: OffloadMode::Neo, ..config(40, 128, 512) };
    let mut s = Scheduler::new(cfg).unwrap();
    for id in 0..6 {
        s.add_request(RequestId(id), vec![3; 48], 4).unwrap();
    }
    let first = s.schedule().unwrap();
    assert!(first.num_host_prefills > 0, "{first:?}");
    let sampled: Vec<u32> = first.inputs.sample_ids.iter().map(|_| 7).collect();
    s.update(&sampled, &[]).unwrap();
    drain(&mut s);
    s.check_invariants().unwrap();
}

#[test]
fn neo_admits_host_bound_prompts_while_the_device_is_full() {
    // Steady state at 256 running requests (each replaced when it finishes) with a device pool
    // for about 150 of them: the prompt at the head of the queue must not wait for the
    // device while the host pool has room for it (and for a swap-out of everything the device
    // holds). Before, step 5 trimmed every host-bound prefill of every iteration whose GPU
    // decodes alone made 128 tokens of linear work, so the queue only drained into the device.
    let cfg = SchedulerConfig {
        offload: OffloadMode::Neo,
        max_num_seqs: 256,
        max_num_batched_tokens: 256 + 512,
        block_size: 16,
        num_gpu_blocks: 150 * 8,
        num_cpu_blocks: 256 * 12,
        max_model_len: 1024,
        transfer_bytes_per_decode: 4096,
        kv_bytes_per_token: 1024,
        force_pipeline: true,
        enable_prefix_caching: false,
    };
    let mut s = Scheduler::new(cfg).unwrap();
    let mut order = VecDeque::new();
    let mut next = 0u64;
    let mut add = |s: &mut Scheduler, order: &mut VecDeque<u64>| {
        let h = next.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 40;
        s.add_request(RequestId(next), vec![1; 40 + (h % 60) as usize], 32 + (h % 64) as usize).unwrap();
        order.push_back(next);
        next += 1;
    };
    for _ in 0..256 {
        add(&mut s, &mut order);
    }
    let (mut stuck, mut longest) = (0, 0);
    for _ in 0..600 {
        order.retain(|&id| s.request(RequestId(id)).is_some_and(|r| r.status == RequestStatus::Waiting));
        let head_fits_host = order.front().is_some_and(|&id| {
            let (gpu, cpu) = (s.kv(Device::Gpu), s.kv(Device::Cpu));
            let need = cpu.blocks_for(s.request(RequestId(id)).unwrap().num_prompt_tokens);
            s.num_running() < 256 && need + gpu.num_total_blocks() - gpu.num_free_blocks() <= cpu.num_free_blocks()
        });
        let out = s.schedule().unwrap();
        let admitted = out.scheduled.iter().any(|r| order.front() == Some(&r.id.0));
        stuck = if head_fits_host && !admitted { stuck + 1 } else { 0 };
        longest = longest.max(stuck);
        let sampled: Vec<u32> = out.inputs.sample_ids.iter().map(|_| 7).collect();
        for _ in s.update(&sampled, &[]).unwrap() {
            add(&mut s, &mut order);
        }
        s.check_invariants().unwrap();
    }
    assert!(
        longest <= neo_rs::sched::MAX_HOST_PREFILL_DEFERS as usize + 1,
        "the queue's head waited {longest} iterations"
    );
}

/// A steady neo load of `n` running requests, each replaced when it finishes (prompts of 40-99
/// tokens, outputs of `min_output` + 0-199), on a device pool of `gpu_blocks` blocks of 16
/// tokens and a host pool for the rest, with CPU attention priced at `cpu_ms` whatever its
/// size; `each` sees every plan and the next request id.
fn neo_steady_state(
    n: usize,
    gpu_blocks: u32,
    cpu_ms: f64,
    min_output: usize,
    mut each: impl FnMut(&Scheduler, &SchedulerOutput, u64),
) {
    let cfg = SchedulerConfig {
        offload: OffloadMode::Neo,
        max_num_seqs: n,
        max_num_batched_tokens: n + 512,
        block_size: 16,
        num_gpu_blocks: gpu_blocks,
        num_cpu_blocks: n as u32 * 20,
        max_model_len: 1024,
        transfer_bytes_per_decode: 4096,
        kv_bytes_per_token: 1024,
        force_pipeline: false,
        enable_prefix_caching: false,
    };
    let mut s = Scheduler::new(cfg).unwrap();
    s.predictor_mut().cpu_decode = neo_rs::sched::Table2::new(vec![1.0, 1e6], vec![0.0, 1e7], vec![cpu_ms; 4]).unwrap();
    let add = |s: &mut Scheduler, id: u64| {
        let h = id.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 40;
        s.add_request(RequestId(id), vec![1; 40 + (h % 60) as usize], min_output + (h % 200) as usize).unwrap();
    };
    for id in 0..n as u64 {
        add(&mut s, id);
    }
    let mut next = n as u64;
    for _ in 0..600 {
        let out = s.schedule().unwrap();
        each(&s, &out, next);
        let sampled: Vec<u32> = out.inputs.sample_ids.iter().map(|_| 7).collect();
        for _ in s.update(&sampled, &[]).unwrap() {
            add(&mut s, next);
            next += 1;
        }
        s.check_invariants().unwrap();
    }
}

#[test]
fn neo_swaps_do_not_ping_pong() {
    // Device pools far too small for the load, with a CPU too slow to hide any attention (its
    // requests are owed the device) and one fast enough to pipeline. A request swapped in must
    // not be swapped out again within the horizon (before the hysteresis, with the slow CPU,
    // the request swapped in was the newest on the device and the next preemption's victim:
    // 85 of 330 moves were such bounces).
    for (gpu_blocks, cpu_ms, min_output) in [(600, 100.0, 200), (600, 0.001, 200), (1200, 100.0, 32)] {
        let mut last_move: HashMap<u64, (Device, Option<usize>)> = HashMap::new();
        let (mut step, mut moves, mut bounces) = (0, 0, Vec::new());
        neo_steady_state(256, gpu_blocks, cpu_ms, min_output, |s, _, next| {
            step += 1;
            for id in 0..next {
                let Some(r) = s.request(RequestId(id)).filter(|r| r.status == RequestStatus::Running) else { continue };
                let e = last_move.entry(id).or_insert((r.device, None));
                if e.0 != r.device {
                    moves += 1;
                    if r.device == Device::Cpu && e.1.is_some_and(|t| step - t < 16) {
                        bounces.push((id, step));
                    }
                    *e = (r.device, Some(step));
                }
            }
        });
        assert!(moves > 50, "the load moves requests between the pools ({moves} moves)");
        assert!(bounces.is_empty(), "swapped in, then out within the horizon: {bounces:?}");
    }
}

#[test]
fn prefix_hits_skip_cached_blocks_and_are_counted() {
    let cfg = SchedulerConfig { enable_prefix_caching: true, ..config(32, 0, 64) };
    let mut s = Scheduler::new(cfg).unwrap();
    let system: Vec<u32> = (100..110).collect();
    s.add_request(RequestId(1), system.clone(), 3).unwrap();
    drain(&mut s);
    // Request 1 computed 12 tokens (10 of prompt, 2 of output): 3 full blocks are cached. The
    // same 10-token prefix and more hits blocks 0 and 1; block 2 holds request 1's outputs.
    let mut follow = system.clone();
    follow.extend([1, 2, 3]);
    s.add_request(RequestId(2), follow, 2).unwrap();
    let out = s.schedule().unwrap();
    assert_eq!((out.scheduled[0].num_computed_tokens, out.scheduled[0].num_new_tokens), (8, 5));
    assert_eq!(s.kv(Device::Gpu).num_cached_blocks(), 3);
    s.update(&[7], &[]).unwrap();
    drain(&mut s);
    let st = s.stats();
    assert_eq!((st.prefix_cache_queries, st.prefix_cache_hits), (10 + 13, 8));
    // Off: nothing is looked up.
    let mut off = Scheduler::new(config(32, 0, 64)).unwrap();
    off.add_request(RequestId(1), system.clone(), 1).unwrap();
    drain(&mut off);
    off.add_request(RequestId(2), system, 1).unwrap();
    assert_eq!(off.schedule().unwrap().scheduled[0].num_computed_tokens, 0);
}
