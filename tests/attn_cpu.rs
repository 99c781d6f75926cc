//! CPU paged decode attention: every tier this host supports against an f64 reference on random,
//! awkward shapes (ragged lengths, seq_len 1, partial last blocks, shuffled block tables, GQA
//! ratios, every dtype, int8 pools against the reference on their dequantized values, fused
//! append on and off), plus the safe entry's rejections, and calls on an OpenMP team.

use half::bf16;
use std::sync::atomic::{AtomicUsize, Ordering};

use neo_rs::attn::rotation::rotate;
use neo_rs::attn::{CpuAttention, DecodeBatch, DecodeParams, Tier};
use neo_rs::team::Team;
use neo_rs::NeoError;
use proptest::prelude::*;

#[path = "common/attn.rs"]
mod reference;
use reference::*;

#[test]
fn rotation_is_the_hadamard_matrix_orthonormal_and_its_own_inverse() {
    let mut rng = reference::Rng(7);
    for len in [8, 16, 24, 48, 64, 80, 96, 128, 256] {
        let x: Vec<f32> = rng.vec(len, 1.0);
        let mut want: Vec<f64> = x.iter().map(|&v| v as f64).collect();
        hadamard_f64(&mut want);
        let mut y = x.clone();
        rotate(&mut y);
        assert!(y.iter().zip(&want).all(|(a, b)| (*a as f64 - b).abs() < 1e-5), "len {len}");
        let norm = |v: &[f32]| v.iter().map(|a| a * a).sum::<f32>();
        assert!((norm(&x) - norm(&y)).abs() < 1e-4 * norm(&x), "norm kept, len {len}");
        rotate(&mut y);
        assert!(x.iter().zip(&y).all(|(a, b)| (a - b).abs() < 1e-5), "len {len} back");
    }
}

#[test]
fn head_dims_and_gqa_ratios() {
    let engines = engines(2);
    for (i, &d) in [64, 80, 96, 128, 256, 8, 24].iter().enumerate() {
        for &group in &[1, 2, 3, 4, 7, 8] {
            let mut c = case(d, 16, 2, group, &[1, 17, 40, 5], i % 2 == 0);
            c.seed = (i * 31 + group) as u64;
            run_all_dtypes(&c, &engines);
        }
    }
}

#[test]
fn block_sizes_ragged_lengths_and_append() {
    let engines = engines(3);
    for &bs in &[8, 16, 32] {
        for append in [false, true] {
            let lens = [1, bs - 1, bs, bs + 1, 3 * bs + 5, 2, 100];
            run_all_dtypes(&case(128, bs, 4, 4, &lens, append), &engines);
        }
    }
}

#[test]
fn empty_sequences_give_zeros_without_nan() {
    let engines = engines(2);
    run_all_dtypes(&case(64, 16, 2, 2, &[0, 5, 0], false), &engines);
    run_all_dtypes(&case(64, 16, 2, 2, &[0], false), &engines);
}

#[test]
fn huge_scores_stay_finite() {
    let engines = engines(2);
    for append in [false, true] {
        let mut c = case(128, 16, 2, 4, &[1, 33, 300], append);
        c.q_amp = 2000.0; // |q·k|/sqrt(d) reaches ~1e4
        run_all_dtypes(&c, &engines);
    }
}

#[test]
fn long_sequence_is_split_and_merged() {
    // With 4 threads the planner cuts these into several chunks per (sequence, head).
    for e in engines(4) {
        let c = case(128, 16, 2, 4, &[6000, 1, 2500], true);
        run_case::<f32>(&c, &e);
        run_case::<bf16>(&c, &e);
        run_case_int8::<bf16>(&c, &e);
    }
}

#[test]
fn sliding_windows_and_soft_capping() {
    // Windows shorter than a block, inside one, across block edges, equal to and longer than the
    // sequence; soft-capping alone and with a window, at scores that reach the cap.
    let all = engines(2);
    for &bs in &[8, 16] {
        for (window, softcap, q_amp) in [
            (Some(1), None, 1.0),
            (Some(5), None, 1.0),
            (Some(bs + 3), None, 1.0),
            (Some(40), None, 1.0),
            (Some(100), None, 1.0),
            (None, Some(1.5), 8.0),
            (Some(2 * bs + 1), Some(3.0), 8.0),
        ] {
            for append in [false, true] {
                let mut c = case(64, bs, 2, 4, &[1, bs - 1, bs, bs + 1, 3 * bs + 5, 40, 100], append);
                (c.window, c.softcap, c.q_amp) = (window, softcap, q_amp);
                run_all_dtypes(&c, &all);
            }
        }
    }
    // A window inside a sequence cut into chunks (4 threads split 6000 tokens).
    for e in engines(4) {
        let mut c = case(128, 16, 2, 4, &[6000, 1, 2500], true);
        c.window = Some(4093);
        run_case::<f32>(&c, &e);
        run_case_int8::<bf16>(&c, &e);
    }
}

#[test]
fn small_calls_run_on_the_calling_thread() {
    for t in Tier::supported() {
        let e = CpuAttention::new(Some(2), Some(t)).unwrap(); // default inline limit
        for append in [false, true] {
            run_all_dtypes(&case(64, 16, 2, 4, &[1, 17, 40, 5], append), std::slice::from_ref(&e));
        }
    }
}

#[test]
fn many_short_sequences() {
    let lens: Vec<usize> = (0..64).map(|i| 1 + (i * 37) % 90).collect();
    for e in engines(2) {
        run_case::<bf16>(&case(128, 16, 8, 4, &lens, true), &e);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]
    #[test]
    fn random_shapes_match_reference(
        d8 in 1usize..=32,
        bs_pow in 3u32..=5,
        hkv in 1usize..=3,
        group in 1usize..=8,
        lens in proptest::collection::vec(0usize..=120, 1..6),
        append in any::<bool>(),
        threads in 1usize..=3,
        seed in any::<u64>(),
        window in proptest::option::of(1usize..=130),
        softcap in proptest::option::of(0.5f32..50.0),
    ) {
        let mut c = case(d8 * 8, 1 << bs_pow, hkv, group, &lens, append);
        (c.seed, c.window, c.softcap) = (seed, window, softcap);
        if append {
            c.seq_lens.iter_mut().for_each(|l| *l = (*l).max(1));
        }
        run_all_dtypes(&c, &engines(threads));
    }
}

fn expect_err(res: neo_rs::Result<()>, kind: fn(&NeoError) -> bool, what: &str) {
    match res {
        Err(e) if kind(&e) => {}
        other => panic!("{what}: expected a typed error, got {other:?}"),
    }
}

#[test]
fn bad_inputs_are_rejected_before_any_work() {
    let e = CpuAttention::new(Some(2), None).unwrap();
    let c = case(64, 16, 2, 2, &[5, 20], true);
    let inp = make_inputs::<f32>(&c);
    let r = inp.layer_range();
    let (k, v) = (&inp.k[r.clone()], &inp.v[r]);
    let p = inp.params(2);
    let mut out = vec![0.0f32; inp.q.len()];
    let shape = inp.shape;
    let is_shape = |e: &NeoError| matches!(e, NeoError::Shape(_));
    let is_value = |e: &NeoError| matches!(e, NeoError::Value(_));
    let b = inp.batch();

    let mut s = shape;
    s.head_dim = 60;
    expect_err(e.decode(&inp.q, k, v, &s, &b, &p, &mut out), is_shape, "head_dim not a multiple of 8");
    let mut s = shape;
    s.block_size = 12;
    expect_err(e.decode(&inp.q, k, v, &s, &b, &p, &mut out), is_shape, "block size 12");
    expect_err(e.decode(&inp.q[1..], k, v, &shape, &b, &p, &mut out), is_shape, "short q");
    expect_err(e.decode(&inp.q, &k[1..], v, &shape, &b, &p, &mut out), is_shape, "short k");
    expect_err(e.decode(&inp.q, k, v, &shape, &b, &p, &mut out[2..]), is_shape, "short out");
    let bad_p = DecodeParams::new(3, p.scale);
    expect_err(e.decode(&inp.q, k, v, &shape, &b, &bad_p, &mut out), is_shape, "heads not a multiple");
    let bad_p = DecodeParams::new(4, f32::NAN);
    expect_err(e.decode(&inp.q, k, v, &shape, &b, &bad_p, &mut out), is_value, "NaN scale");
    let bad_p = DecodeParams { window: Some(0), ..p };
    expect_err(e.decode(&inp.q, k, v, &shape, &b, &bad_p, &mut out), is_value, "empty window");
    for cap in [0.0, -1.0, f32::INFINITY] {
        let bad_p = DecodeParams { softcap: Some(cap), ..p };
        expect_err(e.decode(&inp.q, k, v, &shape, &b, &bad_p, &mut out), is_value, "bad softcap");
    }

    let mut tables = inp.tables.clone();
    tables[1] = shape.num_blocks as i32; // second block of sequence 0 does not exist
    let lens = [20, 5];
    let bb = DecodeBatch { block_tables: &tables, max_blocks_per_seq: inp.max_blocks, seq_lens: &lens };
    expect_err(e.decode(&inp.q, k, v, &shape, &bb, &p, &mut out), is_value, "block id out of range");
    tables[1] = -1;
    let bb = DecodeBatch { block_tables: &tables, max_blocks_per_seq: inp.max_blocks, seq_lens: &lens };
    expect_err(e.decode(&inp.q, k, v, &shape, &bb, &p, &mut out), is_value, "negative block id");
    let lens = [(inp.max_blocks * 16 + 1) as i32, 5];
    let bb = DecodeBatch { block_tables: &inp.tables, max_blocks_per_seq: inp.max_blocks, seq_lens: &lens };
    expect_err(e.decode(&inp.q, k, v, &shape, &bb, &p, &mut out), is_value, "seq_len beyond the table");
    let lens = [-1, 5];
    let bb = DecodeBatch { block_tables: &inp.tables, max_blocks_per_seq: inp.max_blocks, seq_lens: &lens };
    expect_err(e.decode(&inp.q, k, v, &shape, &bb, &p, &mut out), is_value, "negative seq_len");
    let bb = DecodeBatch { block_tables: &inp.tables[1..], max_blocks_per_seq: inp.max_blocks, seq_lens: &inp.lens };
    expect_err(e.decode(&inp.q, k, v, &shape, &bb, &p, &mut out), is_shape, "short block table");

    // Fused append: a bad call writes nothing.
    let (mut k2, mut v2) = (k.to_vec(), v.to_vec());
    expect_err(
        e.append_and_decode(&inp.q, &mut k2, &mut v2, &shape, &b, &p, &inp.new_k[1..], &inp.new_v, &mut out),
        is_shape,
        "short new_k",
    );
    let lens = [0, 5];
    let bb = DecodeBatch { block_tables: &inp.tables, max_blocks_per_seq: inp.max_blocks, seq_lens: &lens };
    expect_err(
        e.append_and_decode(&inp.q, &mut k2, &mut v2, &shape, &bb, &p, &inp.new_k, &inp.new_v, &mut out),
        is_value,
        "append to an empty sequence",
    );
    assert!(k2 == k && v2 == v, "a rejected call modified the pool");
}

#[test]
fn tiers_parse_and_unsupported_tiers_are_refused() {
    assert_eq!(Tier::parse("AVX512").unwrap(), Tier::Avx512);
    assert!(Tier::parse("sse9").is_err());
    assert!(Tier::Scalar.is_supported());
    for t in Tier::ALL {
        assert_eq!(CpuAttention::new(Some(1), Some(t)).is_ok(), t.is_supported(), "{t:?}");
    }
    assert!(CpuAttention::new(Some(0), None).is_err());
}

/// Loads libgomp into the process's global scope, as torch does in the engine, so that
/// `Team::find` finds it (cargo tests link no OpenMP runtime of their own).
fn load_openmp() {
    // SAFETY: dlopen with a NUL-terminated name; the handle is kept for the process's life.
    let handle = unsafe { libc::dlopen(c"libgomp.so.1".as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) };
    assert!(!handle.is_null(), "libgomp.so.1 (GCC's OpenMP runtime) must be installed for this test");
}

#[test]
fn calls_on_the_openmp_team_match_the_reference_and_the_pool() {
    load_openmp();
    for pool in engines(2) {
        let tier = pool.tier();
        let team = CpuAttention::new(Some(2), Some(tier))
            .unwrap()
            .with_inline_below(0)
            .with_dot_products(pool.dot_products())
            .with_team();
        assert!(team.team().is_some());
        // One pass (no sequence cut) and split-and-merge (6000 tokens on 2 threads).
        for lens in [&[1, 17, 40, 5, 33][..], &[6000, 1, 2500]] {
            let c = case(64, 16, 2, 4, lens, true);
            run_case::<bf16>(&c, &team);
            run_case_int8::<f32>(&c, &team);
            let (a, b) = (outputs(&c, &pool), outputs(&c, &team));
            assert!(a == b, "{tier:?}: the team's output differs from the pool's for {lens:?}");
        }
    }
}

/// One call's output bits (f32, no append).
fn outputs(c: &Case, attn: &CpuAttention) -> Vec<u32> {
    let inp = make_inputs::<f32>(c);
    let mut out = vec![f32::NAN; inp.q.len()];
    let r = inp.layer_range();
    let (k, v) = (&inp.k[r.clone()], &inp.v[r]);
    attn.decode(&inp.q, k, v, &inp.shape, &inp.batch(), &inp.params(c.group), &mut out).unwrap();
    out.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn the_team_runs_every_index_once_and_reraises_panics() {
    load_openmp();
    let team = Team::find(2).expect("an OpenMP runtime is loaded");
    let seen: Vec<AtomicUsize> = (0..1000).map(|_| AtomicUsize::new(0)).collect();
    team.for_each_init(seen.len(), || (), |_, i| _ = seen[i].fetch_add(1, Ordering::Relaxed));
    assert!(seen.iter().all(|n| n.load(Ordering::Relaxed) == 1));
    let r = std::panic::catch_unwind(|| team.for_each_init(100, || (), |_, i| assert!(i != 37, "item 37")));
    assert!(r.is_err(), "a panic on the team must reach the caller");
    // The team still works after it.
    let total = AtomicUsize::new(0);
    team.for_each_init(10, || (), |_, i| _ = total.fetch_add(i, Ordering::Relaxed));
    assert_eq!(total.load(Ordering::Relaxed), 45);
}
