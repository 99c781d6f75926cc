//! One `schedule()` + `update()` at 64 … 4096 running requests in steady state: requests of
//! 100–1000 prompt tokens and 128–384 outputs, each replaced by a new one when it finishes.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use neo_rs::sched::{OffloadMode, RequestId, Scheduler, SchedulerConfig};

struct Load {
    s: Scheduler,
    next_id: u64,
}

impl Load {
    fn new(num_running: usize) -> Self {
        let block_size = 16;
        let s = Scheduler::new(SchedulerConfig {
            max_num_seqs: num_running,
            max_num_batched_tokens: num_running + 2048,
            max_model_len: 2048,
            block_size,
            num_gpu_blocks: (num_running * 1400 / block_size) as u32,
            num_cpu_blocks: 0,
            offload: OffloadMode::GpuOnly,
            transfer_bytes_per_decode: 0,
            kv_bytes_per_token: 0,
            force_pipeline: false,
        })
        .expect("valid config");
        let mut load = Load { s, next_id: 0 };
        for _ in 0..num_running {
            load.add();
        }
        // Warm up until every request is past its prefill.
        for _ in 0..64 {
            load.step();
        }
        load
    }

    fn add(&mut self) {
        let id = self.next_id;
        self.next_id += 1;
        let h = id.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 40;
        let prompt = vec![1; 100 + (h % 900) as usize];
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
        let mut load = Load::new(n);
        group.bench_function(BenchmarkId::from_parameter(n), |b| b.iter(|| load.step()));
    }
    group.finish();
}

criterion_group!(benches, schedule_update);
criterion_main!(benches);
