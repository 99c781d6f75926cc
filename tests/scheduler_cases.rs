//! Scheduler scenarios, each driven to completion with fake tokens: chunked prefill, swaps and
//! recompute, bad requests, the `all` and `neo` offload modes, failed steps, NEO's policy under
//! steady load, and prefix-cache hits. (The random workloads are in `scheduler.rs`.)

use std::collections::{HashMap, VecDeque};

use neo_rs::kv::Device;
use neo_rs::sched::{OffloadMode, RequestId, RequestStatus, Scheduler, SchedulerConfig, SchedulerOutput};

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
        num_cpu_prefix_blocks: 0,
        kv_group_windows: vec![None],
        speculation: None,
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

/// Three requests of 8 prompt tokens fill a 6-block device pool; their first decode needs a
/// 7th block. Driven to completion with `cpu` host blocks.
fn crowded(cpu: u32) -> (Scheduler, Vec<SchedulerOutput>) {
    let mut s = Scheduler::new(config(6, cpu, 64)).unwrap();
    for id in 0..3 {
        s.add_request(RequestId(id), vec![3; 8], 4).unwrap();
    }
    let plans = drain(&mut s);
    (s, plans)
}

#[test]
fn full_device_pool_swaps_out_then_back_in() {
    let (s, plans) = crowded(16);
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
    let (_, plans) = crowded(0);
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
        num_cpu_prefix_blocks: 0,
        kv_group_windows: vec![None],
        speculation: None,
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
        num_cpu_prefix_blocks: 0,
        kv_group_windows: vec![None],
        speculation: None,
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
        num_cpu_prefix_blocks: 0,
        kv_group_windows: vec![None],
        speculation: None,
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

#[test]
fn evicted_prefix_blocks_go_to_the_host_tier_and_hits_there_are_copied_back() {
    let cfg = SchedulerConfig { enable_prefix_caching: true, num_cpu_prefix_blocks: 4, ..config(4, 8, 64) };
    let mut s = Scheduler::new(cfg).unwrap();
    let system: Vec<u32> = (100..112).collect();
    let with = |last: u32| system.iter().copied().chain([last]).collect::<Vec<_>>();
    s.add_request(RequestId(1), with(1), 1).unwrap();
    drain(&mut s);
    // Another prompt needs the whole device pool: the system prompt's three blocks are evicted
    // and copied, in the same plan, into the host tier.
    s.add_request(RequestId(2), (200..213).collect(), 1).unwrap();
    let out = s.schedule().unwrap();
    assert_eq!(out.cache_to_host.pairs.len(), 3);
    let stored: Vec<_> = out.cache_to_host.pairs.iter().map(|p| p.1).collect();
    s.update(&[7], &[]).unwrap();
    assert_eq!(s.kv(Device::Cpu).num_cached_blocks(), 3);
    // The system prompt again: found on the host, copied into the request's first device blocks.
    s.add_request(RequestId(3), with(2), 1).unwrap();
    let out = s.schedule().unwrap();
    assert_eq!((out.scheduled[0].num_computed_tokens, out.scheduled[0].num_new_tokens), (12, 1));
    let table = s.kv(Device::Gpu).table(RequestId(3)).to_vec();
    let mut copied = out.cache_to_device.pairs.clone();
    copied.sort_by_key(|p| p.1 .0);
    assert_eq!(copied.iter().map(|p| p.1).collect::<Vec<_>>(), table[..3].to_vec());
    let mut sources: Vec<_> = copied.iter().map(|p| p.0).collect();
    sources.sort();
    let mut want = stored.clone();
    want.sort();
    assert_eq!(sources, want);
    s.update(&[7], &[]).unwrap();
    s.check_invariants().unwrap();
    let st = s.stats();
    assert_eq!((st.prefix_cache_hits, st.prefix_cache_host_hits), (0, 12));
    // Request 3's device blocks evicted request 2's three: stored too, the tier keeps its cap.
    assert_eq!((st.num_cache_blocks_to_host, st.num_cache_blocks_to_device), (6, 3));
    assert_eq!(s.kv(Device::Cpu).num_cached_blocks(), 4);
    // Landed, the copies are in the device cache: the next hit is on the device.
    s.add_request(RequestId(4), with(3), 1).unwrap();
    let out = s.schedule().unwrap();
    assert!(out.cache_to_device.pairs.is_empty());
    assert_eq!(out.scheduled[0].num_computed_tokens, 12);
    s.update(&[7], &[]).unwrap();
    drain(&mut s);
    assert_eq!(s.stats().prefix_cache_hits, 12);
    // A tier needs the device cache.
    let bad = SchedulerConfig { num_cpu_prefix_blocks: 4, ..config(4, 8, 64) };
    assert!(Scheduler::new(bad).is_err());
}

#[test]
fn under_neo_a_host_bound_prompt_decodes_in_place_over_host_tier_blocks() {
    let cfg = SchedulerConfig {
        offload: OffloadMode::Neo,
        enable_prefix_caching: true,
        num_cpu_prefix_blocks: 8,
        kv_group_windows: vec![None],
        speculation: None,
        ..config(8, 32, 64)
    };
    let mut s = Scheduler::new(cfg).unwrap();
    let system: Vec<u32> = (100..112).collect();
    let with = |t: u32| system.iter().copied().chain([t; 3]).collect::<Vec<_>>();
    s.add_request(RequestId(1), with(1), 1).unwrap();
    drain(&mut s);
    // A long request takes the whole device pool, evicting the system prompt's three cached
    // blocks into the host tier as it grows.
    s.add_request(RequestId(2), (200..216).collect(), 16).unwrap();
    while s.kv(Device::Gpu).num_free_blocks() > 0 {
        let out = s.schedule().unwrap();
        s.update(&vec![7; out.inputs.sample_ids.len()], &[]).unwrap();
    }
    let tier: Vec<_> = {
        let mut b = s.kv(Device::Cpu).lookup(&with(2), None, &[]).blocks;
        b.sort();
        b
    };
    assert_eq!(tier.len(), 3);
    // The system prompt again finds no device room: its three last tokens attend on the CPU
    // over the host blocks, where it then decodes.
    s.add_request(RequestId(3), with(2), 4).unwrap();
    let out = s.schedule().unwrap();
    let r3 = out.scheduled.iter().find(|r| r.id == RequestId(3)).unwrap();
    assert!(r3.attends_on_cpu() && r3.sample);
    assert_eq!((r3.num_computed_tokens, r3.num_new_tokens), (12, 3));
    let mut head = s.kv(Device::Cpu).table(RequestId(3))[..3].to_vec();
    head.sort();
    assert_eq!(head, tier);
    assert!(out.cache_to_device.pairs.is_empty() && out.prefill_to_host.pairs.is_empty());
    assert_eq!(s.stats().prefix_cache_host_hits, 12);
    s.update(&vec![7; out.inputs.sample_ids.len()], &[]).unwrap();
    drain(&mut s);
    assert_eq!(s.kv(Device::Cpu).num_free_blocks(), 32);
}

#[test]
fn cache_salts_keep_prefix_caches_apart() {
    let cfg = SchedulerConfig { enable_prefix_caching: true, ..config(32, 0, 64) };
    let mut s = Scheduler::new(cfg).unwrap();
    let prompt: Vec<u32> = (100..113).collect(); // three full blocks and a token
                                                 // The prompt's tokens found cached when it is scheduled, run to completion.
    let mut cached = |id: u64, salt: Option<&str>| {
        s.add_salted_request(RequestId(id), prompt.clone(), 1, salt).unwrap();
        let computed = s.schedule().unwrap().scheduled[0].num_computed_tokens;
        s.update(&[7], &[]).unwrap();
        drain(&mut s);
        computed
    };
    assert_eq!(cached(1, Some("tenant a")), 0);
    assert_eq!(cached(2, Some("tenant a")), 12);
    assert_eq!(cached(3, Some("tenant b")), 0);
    assert_eq!(cached(4, None), 0);
    assert_eq!(cached(5, None), 12);
    assert!(s.add_salted_request(RequestId(6), prompt, 1, Some("")).is_err());
}

#[test]
fn under_neo_a_host_tier_hit_starts_in_place_where_copying_it_costs_more() {
    // Request 4's system prompt lies in the host tier, and the device has room for it but not
    // below the swap-in watermark once the long request 3 is there. With dear copies it attends
    // in place over the host blocks; with free copies it copies them in. Without request 3 it
    // would be swapped in at once, which costs more than the copy: it copies them in. Either
    // way it stays on its side and every block returns.
    for (kv_bytes_per_token, hog, in_place) in [(1 << 30, true, true), (0, true, false), (1 << 30, false, false)] {
        let cfg = SchedulerConfig {
            offload: OffloadMode::Neo,
            enable_prefix_caching: true,
            num_cpu_prefix_blocks: 128,
            kv_group_windows: vec![None],
            speculation: None,
            max_model_len: 512,
            kv_bytes_per_token,
            ..config(100, 128, 512)
        };
        let mut s = Scheduler::new(cfg).unwrap();
        let system: Vec<u32> = (100..112).collect();
        let with = |t: u32| system.iter().copied().chain([t; 3]).collect::<Vec<_>>();
        s.add_request(RequestId(1), with(1), 1).unwrap();
        drain(&mut s);
        // A prompt of the whole device pool evicts the system prompt's blocks into the tier.
        s.add_request(RequestId(2), (1000..1400).collect(), 1).unwrap();
        drain(&mut s);
        assert_eq!(s.kv(Device::Cpu).lookup(&with(2), None, &[]).blocks.len(), 3);
        if hog {
            s.add_request(RequestId(3), (2000..2372).collect(), 8).unwrap();
            let out = s.schedule().unwrap();
            s.update(&vec![7; out.inputs.sample_ids.len()], &[]).unwrap();
        }
        s.add_request(RequestId(4), with(2), 4).unwrap();
        let out = s.schedule().unwrap();
        let r4 = out.scheduled.iter().find(|r| r.id == RequestId(4)).unwrap();
        assert_eq!(r4.attends_on_cpu(), in_place, "{kv_bytes_per_token} B/token, request 3: {hog}");
        assert_eq!(r4.device == Device::Cpu, in_place);
        assert_eq!((r4.num_computed_tokens, r4.num_new_tokens), (12, 3));
        assert_eq!(out.cache_to_device.pairs.len(), if in_place { 0 } else { 3 });
        assert_eq!(s.stats().prefix_cache_host_hits, 12);
        s.update(&vec![7; out.inputs.sample_ids.len()], &[]).unwrap();
        let plans = drain(&mut s);
        assert!(plans.iter().all(|p| p.swap_in.pairs.is_empty()), "request 4 stays where it started");
        assert_eq!(s.kv(Device::Cpu).num_free_blocks(), 128);
        assert_eq!(s.kv(Device::Gpu).num_free_blocks(), 100);
    }
}

#[test]
fn a_sliding_window_generation_ten_windows_long_holds_the_window() {
    // Window 8, blocks of 4: however long the request, it holds 8 / 4 + 1 blocks after each
    // step (a prefill chunk of 8 more while it runs). 86 tokens would need 22 blocks of a pool
    // of 6 without the window: the request is admitted only because of it.
    for offload in [OffloadMode::GpuOnly, OffloadMode::Neo, OffloadMode::AllCpu] {
        let cfg = SchedulerConfig { offload, max_model_len: 128, kv_group_windows: vec![Some(8)], ..config(6, 6, 8) };
        let mut s = Scheduler::new(cfg.clone()).unwrap();
        s.add_request(RequestId(0), vec![5; 20], 66).unwrap();
        let mut most = 0;
        while s.has_unfinished() {
            let out = s.schedule().unwrap();
            let sampled: Vec<u32> = out.inputs.sample_ids.iter().map(|_| 7).collect();
            s.update(&sampled, &[]).unwrap();
            s.check_invariants().unwrap();
            let used = [Device::Gpu, Device::Cpu].map(|d| s.kv(d).num_used_blocks());
            most = most.max(used[0] + used[1]);
        }
        assert_eq!(most, 3, "{offload:?}");
        let without = SchedulerConfig { kv_group_windows: vec![None], ..cfg };
        assert!(Scheduler::new(without).unwrap().add_request(RequestId(0), vec![5; 20], 66).is_err());
    }
}

#[test]
fn a_hybrid_model_holds_every_block_of_its_global_group_and_the_window_of_its_sliding_one() {
    // Gemma-style: a global group and a sliding one (window 8, blocks of 4). Between steps the
    // request holds every global block (21 for the 84 tokens cached before its last step) and
    // at most 8 / 4 + 1 sliding ones. Admission counts 22 global blocks (85 tokens written) and
    // a sliding chunk's peak of 5: a pool of 27 admits it only because the sliding group releases.
    for offload in [OffloadMode::GpuOnly, OffloadMode::Neo, OffloadMode::AllCpu] {
        let hybrid = vec![None, Some(8)];
        let cfg = SchedulerConfig { offload, max_model_len: 128, kv_group_windows: hybrid, ..config(27, 27, 8) };
        let mut s = Scheduler::new(cfg.clone()).unwrap();
        s.add_request(RequestId(0), vec![5; 20], 66).unwrap();
        let mut most = [0; 2];
        while s.has_unfinished() {
            let out = s.schedule().unwrap();
            let sampled: Vec<u32> = out.inputs.sample_ids.iter().map(|_| 7).collect();
            s.update(&sampled, &[]).unwrap();
            s.check_invariants().unwrap();
            for d in [Device::Gpu, Device::Cpu] {
                let table = s.kv(d).table(RequestId(0));
                for (g, most) in most.iter_mut().enumerate() {
                    *most = (*most).max(table.iter().skip(g).step_by(2).filter(|b| !b.is_null()).count());
                }
            }
        }
        assert_eq!(most, [21, 3], "{offload:?}");
        for d in [Device::Gpu, Device::Cpu] {
            assert_eq!(s.kv(d).num_free_blocks(), 27);
        }
        let global = SchedulerConfig { kv_group_windows: vec![None, None], ..cfg };
        assert!(Scheduler::new(global).unwrap().add_request(RequestId(0), vec![5; 20], 66).is_err());
    }
}
