//! Criterion bench of CPU paged decode attention: GB/s of K+V read for Llama-3-8B (32 q / 8 kv /
//! 128) and Llama-2-7B (32 / 32 / 128) shapes, bf16 and f32, batch x context in {1x8192, 16x2048,
//! 64x512, 256x256}, 1 thread and all threads, per supported tier. Figures only; not a CI gate.
//! Filter with e.g. `cargo bench --bench attn_cpu -- 'llama3/bf16/16x2048'`.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use half::bf16;
use neo_rs::attn::{CpuAttention, DecodeBatch, DecodeParams, Element, PagedShape, Tier};
use std::time::Duration;

const BLOCK_SIZE: usize = 16;
const HEAD_DIM: usize = 128;

struct Setup<E> {
    shape: PagedShape,
    q: Vec<E>,
    k: Vec<E>,
    v: Vec<E>,
    tables: Vec<i32>,
    lens: Vec<i32>,
    max_blocks: usize,
    num_q_heads: usize,
}

fn setup<E: Element>(num_q_heads: usize, num_kv_heads: usize, batch: usize, context: usize) -> Setup<E> {
    let max_blocks = context.div_ceil(BLOCK_SIZE);
    let num_blocks = batch * max_blocks;
    let shape = PagedShape { num_blocks, num_kv_heads, block_size: BLOCK_SIZE, head_dim: HEAD_DIM, interleaved: false };
    let n = shape.layer_numel().unwrap();
    let mut x = 0x2545_F491_4F6C_DD1Du64;
    let mut rnd = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        E::from_f32((x >> 40) as f32 / (1u64 << 24) as f32 - 0.5)
    };
    // A scattered block table (a fixed odd stride through the pool), as a long-running server has.
    let tables = (0..num_blocks).map(|i| ((i * 7919) % num_blocks) as i32).collect();
    Setup {
        shape,
        q: (0..batch * num_q_heads * HEAD_DIM).map(|_| rnd()).collect(),
        k: (0..n).map(|_| rnd()).collect(),
        v: (0..n).map(|_| rnd()).collect(),
        tables,
        lens: vec![context as i32; batch],
        max_blocks,
        num_q_heads,
    }
}

fn bench_model<E: Element>(c: &mut Criterion, model: &str, num_q_heads: usize, num_kv_heads: usize) {
    let all = std::thread::available_parallelism().map_or(1, |n| n.get());
    let thread_counts: Vec<usize> = if all > 1 { vec![1, all] } else { vec![1] };
    for (batch, context) in [(1, 8192), (16, 2048), (64, 512), (256, 256)] {
        let s = setup::<E>(num_q_heads, num_kv_heads, batch, context);
        let bytes = 2 * batch * context * num_kv_heads * HEAD_DIM * std::mem::size_of::<E>();
        let mut group = c.benchmark_group(format!("{model}/{}/{batch}x{context}", E::DTYPE.name()));
        group.throughput(Throughput::Bytes(bytes as u64));
        for tier in Tier::supported() {
            for &threads in &thread_counts {
                let attn = CpuAttention::new(Some(threads), Some(tier)).unwrap();
                let batch_ =
                    DecodeBatch { block_tables: &s.tables, max_blocks_per_seq: s.max_blocks, seq_lens: &s.lens };
                let params = DecodeParams::new(s.num_q_heads, 0.088);
                let mut out = vec![E::from_f32(0.0); s.q.len()];
                group.bench_function(BenchmarkId::new(tier.name(), format!("{threads}t")), |b| {
                    b.iter(|| attn.decode(&s.q, &s.k, &s.v, &s.shape, &batch_, &params, &mut out).unwrap())
                });
            }
        }
        group.finish();
    }
}

fn attn_cpu(c: &mut Criterion) {
    bench_model::<bf16>(c, "llama3", 32, 8);
    bench_model::<f32>(c, "llama3", 32, 8);
    bench_model::<bf16>(c, "llama2", 32, 32);
    bench_model::<f32>(c, "llama2", 32, 32);
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .sample_size(10)
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(1));
    targets = attn_cpu
}
criterion_main!(benches);
