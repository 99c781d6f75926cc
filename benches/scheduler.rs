//! One `schedule()` + `update()` at 64 … 4096 running requests in steady state: requests of
//! 100–1000 prompt tokens and 128–384 outputs, each replaced by a new one when it finishes.
//! GPU-only with room for all; `neo` (pipelining forced) with a device pool for about half of them:
//! it prints how many the policy keeps on the host and how many wait. Host-bound prompts are
//! admitted at least once every `MAX_HOST_PREFILL_DEFERS + 1` iterations, so the host share
//! grows with that rate against the arrival rate: about half at 256. Prompts share no block;
//! `schedule_update_prefix_caching` is the GPU-only case with the prefix cache on (every full
//! block hashed and registered, every prompt looked up), to compare with `schedule_update`.
//! `schedule_update_neo_shared_prefix` is `neo` with the prefix cache on and a 1,024-token prefix
//! common to every prompt: each iteration looks up every waiting prompt, 64 cached blocks deep.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use neo_rs::kv::Device;
use neo_rs::sched::{OffloadMode, RequestId, Scheduler, SchedulerConfig};

struct Load {
    s: Scheduler,
    next_id: u64,
    /// Tokens at the head of every prompt.
    shared_prefix: u64,
}

impl Load {
    fn new(num_running: usize, offload: OffloadMode, enable_prefix_caching: bool, shared_prefix: u64) -> Self {
        let block_size = 16;
        let blocks = num_running * 1400 / block_size;
        let neo = offload == OffloadMode::Neo;
        let s = Scheduler::new(SchedulerConfig {
            max_num_seqs: num_running,
            max_num_batched_tokens: num_running + 2048,
            max_model_len: 2048 + shared_prefix as usize,
            block_size,
            num_gpu_blocks: if neo { blocks / 4 } else { blocks } as u32,
            num_cpu_blocks: if neo { blocks } else { 0 } as u32,
            offload,
            // Llama-3-8B: q, k, v out and the output back, per layer; K and V of one token.
            transfer_bytes_per_decode: (2 * 32 + 2 * 8) * 128 * 2,
            kv_bytes_per_token: 2 * 8 * 128 * 2,
            // neo: pipeline whatever the synthetic estimates say, so the host really holds its
            // share of the requests (the synthetic CPU is too slow for offloading to pay).
            force_pipeline: neo,
            enable_prefix_caching,
            num_cpu_prefix_blocks: 0,
            kv_group_windows: vec![None],
            speculation: None,
        })
        .expect("valid config");
        let mut load = Load { s, next_id: 0, shared_prefix };
        for _ in 0..num_running {
            load.add();
        }
        // Warm up until every request has been admitted and is past its prefill.
        for _ in 0..5000 {
            load.step();
            if load.s.num_waiting() == 0 && load.next_id > 2 * num_running as u64 {
                break;
            }
        }
        if neo {
            let on_host = (0..load.next_id)
                .filter_map(|id| load.s.request(RequestId(id)))
                .filter(|r| r.device == Device::Cpu)
                .count();
            eprintln!("neo at {num_running}: {on_host} running on the host, {} waiting", load.s.num_waiting());
        }
        load
    }

    fn add(&mut self) {
        let id = self.next_id;
        self.next_id += 1;
        let h = id.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 40;
        let shared = (0..self.shared_prefix).map(|t| t as u32);
        let prompt = shared.chain((0..100 + h % 900).map(|t| (id * 1000 + t) as u32)).collect();
        let max_tokens = 128 + (h % 256) as usize;
        self.s.add_request(RequestId(id), prompt, max_tokens).expect("request fits");
    }

    fn step(&mut self) {
        let out = self.s.schedule().expect("paired with update");
        let sampled = vec![5u32; out.inputs.sample_ids.len()];
        let finished = self.s.update(&sampled, &[]).expect("one token per sampled row");
        for _ in finished {
            self.add();
        }
    }
}

fn schedule_update(c: &mut Criterion) {
    let mut group = c.benchmark_group("schedule_update");
    for n in [64, 256, 1024, 4096] {
        let mut load = Load::new(n, OffloadMode::GpuOnly, false, 0);
        group.bench_function(BenchmarkId::from_parameter(n), |b| b.iter(|| load.step()));
    }
    group.finish();
    let mut group = c.benchmark_group("schedule_update_prefix_caching");
    for n in [64, 256, 1024, 4096] {
        let mut load = Load::new(n, OffloadMode::GpuOnly, true, 0);
        group.bench_function(BenchmarkId::from_parameter(n), |b| b.iter(|| load.step()));
    }
    group.finish();
    let mut group = c.benchmark_group("schedule_update_neo");
    for n in [256, 1024, 4096] {
        let mut load = Load::new(n, OffloadMode::Neo, false, 0);
        group.bench_function(BenchmarkId::from_parameter(n), |b| b.iter(|| load.step()));
    }
    group.finish();
    let mut group = c.benchmark_group("schedule_update_neo_shared_prefix");
    for n in [256, 1024] {
        let mut load = Load::new(n, OffloadMode::Neo, true, 1024);
        group.bench_function(BenchmarkId::from_parameter(n), |b| b.iter(|| load.step()));
    }
    group.finish();
}

criterion_group!(benches, schedule_update);
criterion_main!(benches);
