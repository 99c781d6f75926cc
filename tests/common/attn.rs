//! The f64 reference of CPU paged decode attention and the random cases `attn_cpu.rs` holds every
//! tier to: shuffled block tables, ragged lengths, sliding windows, soft-capping, every dtype,
//! int8 pools against their dequantized values, interleaved pools bit for bit.

use half::{bf16, f16};

use neo_rs::attn::rotation::{quantize_kv_row, rotate};
use neo_rs::attn::{
    quantize_row, CpuAttention, DecodeBatch, DecodeParams, DotProducts, Element, KvElement, PagedShape, Pools,
    PoolsMut, Tier,
};

pub(crate) struct Rng(pub(crate) u64);

impl Rng {
    pub(crate) fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    pub(crate) fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    pub(crate) fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    }
    pub(crate) fn vec<E: Element>(&mut self, n: usize, amp: f32) -> Vec<E> {
        (0..n).map(|_| E::from_f32(self.unit() * amp)).collect()
    }
}

#[derive(Debug, Clone)]
pub(crate) struct Case {
    pub(crate) head_dim: usize,
    pub(crate) block_size: usize,
    pub(crate) num_kv_heads: usize,
    pub(crate) group: usize,
    pub(crate) seq_lens: Vec<usize>,
    pub(crate) append: bool,
    /// Scale of q (1 gives ordinary scores; large values give scores of magnitude ~1e4).
    pub(crate) q_amp: f32,
    pub(crate) seed: u64,
    /// The layer's attention kind (`DecodeParams`).
    pub(crate) window: Option<usize>,
    pub(crate) softcap: Option<f32>,
}

pub(crate) struct Inputs<E> {
    pub(crate) shape: PagedShape,
    pub(crate) layer: usize,
    pub(crate) q: Vec<E>,
    pub(crate) k: Vec<E>,
    pub(crate) v: Vec<E>,
    pub(crate) new_k: Vec<E>,
    pub(crate) new_v: Vec<E>,
    pub(crate) tables: Vec<i32>,
    pub(crate) max_blocks: usize,
    pub(crate) lens: Vec<i32>,
    pub(crate) scale: f32,
    pub(crate) window: Option<usize>,
    pub(crate) softcap: Option<f32>,
}

pub(crate) fn make_inputs<E: Element>(c: &Case) -> Inputs<E> {
    let mut rng = Rng(c.seed);
    let (d, bs, hkv) = (c.head_dim, c.block_size, c.num_kv_heads);
    let hq = hkv * c.group;
    let blocks_needed: Vec<usize> = c.seq_lens.iter().map(|l| l.div_ceil(bs)).collect();
    let max_blocks = blocks_needed.iter().copied().max().unwrap_or(0) + 1;
    let num_blocks = blocks_needed.iter().sum::<usize>() + 3;
    // A shuffled pool: block ids handed out in random order, padding entries are -1.
    let mut ids: Vec<i32> = (0..num_blocks as i32).collect();
    for i in (1..ids.len()).rev() {
        ids.swap(i, rng.below(i + 1));
    }
    let mut next = ids.into_iter();
    let mut tables = vec![-1i32; c.seq_lens.len() * max_blocks];
    for (s, &nb) in blocks_needed.iter().enumerate() {
        for j in 0..nb {
            tables[s * max_blocks + j] = next.next().unwrap();
        }
    }
    let shape = PagedShape { num_blocks, num_kv_heads: hkv, block_size: bs, head_dim: d, interleaved: false };
    let num_layers = 2;
    let pool = num_layers * num_blocks * hkv * bs * d;
    let n = c.seq_lens.len();
    Inputs {
        shape,
        layer: 1,
        q: rng.vec(n * hq * d, c.q_amp),
        k: rng.vec(pool, 1.0),
        v: rng.vec(pool, 1.0),
        new_k: rng.vec(n * hkv * d, 1.0),
        new_v: rng.vec(n * hkv * d, 1.0),
        tables,
        max_blocks,
        lens: c.seq_lens.iter().map(|&l| l as i32).collect(),
        scale: 1.0 / (d as f32).sqrt(),
        window: c.window,
        softcap: c.softcap,
    }
}

impl<E: Element> Inputs<E> {
    pub(crate) fn layer_range(&self) -> std::ops::Range<usize> {
        let n = self.shape.layer_numel().unwrap();
        self.layer * n..(self.layer + 1) * n
    }
    pub(crate) fn batch(&self) -> DecodeBatch<'_> {
        DecodeBatch { block_tables: &self.tables, max_blocks_per_seq: self.max_blocks, seq_lens: &self.lens }
    }
    pub(crate) fn params(&self, group: usize) -> DecodeParams {
        let p = DecodeParams::new(self.shape.num_kv_heads * group, self.scale);
        DecodeParams { window: self.window, softcap: self.softcap, ..p }
    }

    /// How far f32 arithmetic may move an output whatever the kernel's order of operations: a
    /// score summed in f32 over head_dim products is off by about sqrt(head_dim) * eps *
    /// |q| |k| (a random walk of roundings; 4 sigma here), and scores off by at most δ move the
    /// softmax weights, hence the output, by at most (e^{2δ} - 1) max|v|. Negligible for
    /// ordinary scores; at scores of ~1e4, where two near-tied tokens make the output sensitive
    /// to the last bit of their scores, it is what any f32 kernel can promise.
    pub(crate) fn score_slack(&self) -> f64 {
        let d = self.shape.head_dim;
        let max_norm = |x: &[E]| {
            x.chunks(d).map(|r| r.iter().map(|v| (v.to_f32() as f64).powi(2)).sum::<f64>().sqrt()).fold(0.0, f64::max)
        };
        let max_abs = |x: &[E]| x.iter().map(|v| v.to_f32().abs() as f64).fold(0.0, f64::max);
        let (q, k) = (max_norm(&self.q), max_norm(&self.k).max(max_norm(&self.new_k)));
        let delta = 4.0 * (d as f64).sqrt() * f32::EPSILON as f64 * q * k * self.scale as f64;
        (2.0 * delta).exp_m1() * max_abs(&self.v).max(max_abs(&self.new_v))
    }

    /// f64 reference on the element values (after appending, when asked): a row attends to the
    /// last `window` positions, its scaled scores capped at `softcap` by tanh.
    pub(crate) fn reference(&self, group: usize, append: bool) -> Vec<f64> {
        let PagedShape { num_kv_heads: hkv, block_size: bs, head_dim: d, .. } = self.shape;
        let hq = hkv * group;
        let r = self.layer_range();
        let (k, v) = (&self.k[r.clone()], &self.v[r]);
        let mut out = vec![0.0f64; self.lens.len() * hq * d];
        for (s, &len) in self.lens.iter().enumerate() {
            let len = len as usize;
            for h in 0..hq {
                let kvh = h / group;
                let row = |pool: &[E], new: &[E], t: usize| -> Vec<f64> {
                    if append && t == len - 1 {
                        let o = (s * hkv + kvh) * d;
                        return new[o..o + d].iter().map(|x| x.to_f32() as f64).collect();
                    }
                    let b = self.tables[s * self.max_blocks + t / bs] as usize;
                    let o = ((b * hkv + kvh) * bs + t % bs) * d;
                    pool[o..o + d].iter().map(|x| x.to_f32() as f64).collect()
                };
                let qo = (s * hq + h) * d;
                let q: Vec<f64> = self.q[qo..qo + d].iter().map(|x| x.to_f32() as f64).collect();
                let first = self.window.map_or(0, |w| len.saturating_sub(w));
                let cap = |x: f64| self.softcap.map_or(x, |c| c as f64 * (x / c as f64).tanh());
                let scores: Vec<f64> = (first..len)
                    .map(|t| {
                        cap(row(k, &self.new_k, t).iter().zip(&q).map(|(a, b)| a * b).sum::<f64>() * self.scale as f64)
                    })
                    .collect();
                let m = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let w: Vec<f64> = scores.iter().map(|x| (x - m).exp()).collect();
                let z: f64 = w.iter().sum();
                for (t, wt) in (first..len).zip(&w) {
                    for (i, x) in row(v, &self.new_v, t).iter().enumerate() {
                        out[qo + i] += wt / z * x;
                    }
                }
            }
        }
        out
    }
}

pub(crate) fn tolerance<E: Element>() -> (f64, f64) {
    match E::DTYPE {
        neo_rs::attn::DType::F32 => (2e-5, 2e-4),
        neo_rs::attn::DType::F16 => (2e-3, 4e-3),
        neo_rs::attn::DType::BF16 => (1.5e-2, 2e-2),
    }
}

/// Every output within `E`'s tolerance of the reference, widened by `slack` (`score_slack`);
/// `what` names the case on failure.
pub(crate) fn assert_matches<E: Element>(out: &[E], want: &[f64], slack: f64, what: impl Fn() -> String) {
    let (atol, rtol) = tolerance::<E>();
    let atol = atol + slack;
    for (i, (got, want)) in out.iter().zip(want).enumerate() {
        let got = got.to_f32() as f64;
        assert!((got - want).abs() <= atol + rtol * want.abs(), "{}: out[{i}] = {got}, reference {want}", what());
    }
}

pub(crate) fn run_case<E: Element>(c: &Case, attn: &CpuAttention) {
    let mut inp = make_inputs::<E>(c);
    let group = c.group;
    let want = inp.reference(group, c.append);
    let mut out = vec![E::from_f32(f32::NAN); inp.q.len()];
    let r = inp.layer_range();
    let (shape, params, max_blocks) = (inp.shape, inp.params(group), inp.max_blocks);
    let before = (inp.k[r.clone()].to_vec(), inp.v[r.clone()].to_vec());
    let res = if c.append {
        let (k, v) = (&mut inp.k[r.clone()], &mut inp.v[r.clone()]);
        let batch = DecodeBatch { block_tables: &inp.tables, max_blocks_per_seq: max_blocks, seq_lens: &inp.lens };
        attn.append_and_decode(&inp.q, k, v, &shape, &batch, &params, &inp.new_k, &inp.new_v, &mut out)
    } else {
        attn.decode(&inp.q, &inp.k[r.clone()], &inp.v[r.clone()], &shape, &inp.batch(), &params, &mut out)
    };
    res.unwrap();
    assert_matches(&out, &want, inp.score_slack(), || {
        format!("tier {} {:?} {:?} {c:?}", attn.tier().name(), attn.dot_products(), E::DTYPE)
    });
    let new = c.append.then_some((&inp.new_k[..], &inp.new_v[..]));
    let call = Call { q: &inp.q, shape, batch: inp.batch(), params, new, out: &out };
    call.check_interleaved(attn, (&before.0, &before.1), (&inp.k[r.clone()], &inp.v[r.clone()]), None);
    if c.append {
        // The new rows really landed in the pool at position len - 1.
        let (bs, d, hkv) = (shape.block_size, shape.head_dim, shape.num_kv_heads);
        let base = inp.layer_range().start;
        for (s, &len) in inp.lens.iter().enumerate() {
            let pos = len as usize - 1;
            let b = inp.tables[s * max_blocks + pos / bs] as usize;
            for h in 0..hkv {
                let o = base + ((b * hkv + h) * bs + pos % bs) * d;
                let n = (s * hkv + h) * d;
                assert!(inp.k[o..o + d].iter().zip(&inp.new_k[n..n + d]).all(|(a, b)| a.to_f32() == b.to_f32()));
                assert!(inp.v[o..o + d].iter().zip(&inp.new_v[n..n + d]).all(|(a, b)| a.to_f32() == b.to_f32()));
            }
        }
    }
}

/// Every tier this host supports, or only the one `NEO_RS_SIMD` forces, with and without its
/// dot products; every call on the pool (these cases are small enough to run inline otherwise).
pub(crate) fn engines(threads: usize) -> Vec<CpuAttention> {
    let tiers = match std::env::var_os("NEO_RS_SIMD") {
        Some(_) => vec![Tier::from_env().unwrap()],
        None => Tier::supported(),
    };
    let engine = |t| CpuAttention::new(Some(threads), Some(t)).unwrap().with_inline_below(0);
    tiers
        .into_iter()
        .flat_map(|t| {
            let mut v = vec![engine(t)];
            if v[0].dot_products() != DotProducts::default() {
                v.push(engine(t).with_dot_products(DotProducts::default()));
            }
            v
        })
        .collect()
}

/// `x = H x` by the normalized Hadamard matrix's definition, `H[i][j] = (-1)^popcount(i & j) /
/// sqrt(n)`, in blocks of the largest power of two dividing the row (as `rotation.rs` rotates).
pub(crate) fn hadamard_f64(x: &mut [f64]) {
    let n = 1 << x.len().trailing_zeros();
    for block in x.chunks_exact_mut(n) {
        let y: Vec<f64> = (0..n)
            .map(|i| (0..n).map(|j| if (i & j).count_ones() % 2 == 0 { block[j] } else { -block[j] }).sum::<f64>())
            .collect();
        for (b, v) in block.iter_mut().zip(y) {
            *b = v / (n as f64).sqrt();
        }
    }
}

/// Int8 pools: `k`/`v` quantized row by row as the pool stores them (rotated, one scale per
/// token and KV head), the kernel run on them with q and out in `E`. The f64 reference runs on
/// the stored rows dequantized (the new rows as the fused append quantizes them) against q
/// scaled and rotated as the kernel rotates it, and its output is rotated back: so only the
/// kernel's arithmetic is under test. Where the tier takes q·k as int8 dot products, the
/// reference's q is quantized per head the same way, which is then part of what the kernel
/// computes.
pub(crate) fn run_case_int8<E: Element>(c: &Case, attn: &CpuAttention) {
    let inp = make_inputs::<E>(c);
    let d = c.head_dim;
    let quantize = |x: &[E]| {
        let (mut q, mut buf) = (vec![0i8; x.len()], vec![0.0; d]);
        let scales: Vec<f32> = x.chunks(d).zip(q.chunks_mut(d)).map(|(r, o)| quantize_kv_row(r, o, &mut buf)).collect();
        (q, scales)
    };
    // Rows as stored (rotated): the reference attends in the rotated space, and its output is
    // rotated back in f64 below.
    let dequantize = |q: &[i8], scales: &[f32]| -> Vec<f32> {
        q.chunks(d).zip(scales).flat_map(|(r, s)| r.iter().map(move |&x| f32::from(x) * s)).collect()
    };
    let ((mut k8, mut ks), (mut v8, mut vs)) = (quantize(&inp.k), quantize(&inp.v));
    let ((nk8, nks), (nv8, nvs)) = (quantize(&inp.new_k), quantize(&inp.new_v));
    let q_in: Vec<f32> = inp.q.iter().map(|x| x.to_f32()).collect();
    // q scaled and rotated in f32 as the kernel does it (the rounding of its rotation is part of
    // what the kernel computes: at huge scores it moves the output past f32's tolerance).
    let mut q8 = vec![0i8; d];
    let q_ref = q_in
        .chunks(d)
        .flat_map(|row| {
            let mut scaled: Vec<f32> = row.iter().map(|x| x * inp.scale).collect();
            rotate(&mut scaled);
            if attn.dot_products().int8 {
                let s = quantize_row(&scaled, &mut q8);
                scaled = q8.iter().map(|&x| f32::from(x) * s).collect();
            }
            scaled
        })
        .collect();
    let reference = Inputs::<f32> {
        q: q_ref,
        k: dequantize(&k8, &ks),
        v: dequantize(&v8, &vs),
        new_k: dequantize(&nk8, &nks),
        new_v: dequantize(&nv8, &nvs),
        tables: inp.tables.clone(),
        lens: inp.lens.clone(),
        shape: inp.shape,
        layer: inp.layer,
        max_blocks: inp.max_blocks,
        scale: 1.0,
        window: c.window,
        softcap: c.softcap,
    };
    let mut want = reference.reference(c.group, c.append);
    want.chunks_mut(d).for_each(hadamard_f64);
    let (shape, params) = (inp.shape, inp.params(c.group));
    let (r, rows) = (reference.layer_range(), reference.layer_range().start / d..reference.layer_range().end / d);
    let mut out = vec![E::from_f32(f32::NAN); reference.q.len()];
    let q: Vec<E> = q_in.iter().map(|&x| E::from_f32(x)).collect();
    let before = (k8[r.clone()].to_vec(), v8[r.clone()].to_vec(), ks[rows.clone()].to_vec(), vs[rows.clone()].to_vec());
    let res = if c.append {
        let kv = PoolsMut::Separate {
            k: &mut k8[r.clone()],
            v: &mut v8[r.clone()],
            k_scale: &mut ks[rows.clone()],
            v_scale: &mut vs[rows.clone()],
        };
        attn.append_and_decode_pools(&q, kv, &shape, &reference.batch(), &params, &inp.new_k, &inp.new_v, &mut out)
    } else {
        let kv = Pools { k: &k8[r.clone()], v: &v8[r.clone()], k_scale: &ks[rows.clone()], v_scale: &vs[rows.clone()] };
        attn.decode_pools(&q, &kv, &shape, &reference.batch(), &params, &mut out)
    };
    res.unwrap();
    assert_matches(&out, &want, reference.score_slack(), || {
        format!("tier {} {:?} int8 KV, {:?} q {c:?}", attn.tier().name(), attn.dot_products(), E::DTYPE)
    });
    let new = c.append.then_some((&inp.new_k[..], &inp.new_v[..]));
    let call = Call { q: &q, shape, batch: reference.batch(), params, new, out: &out };
    let after = (&k8[r.clone()], &v8[r.clone()]);
    call.check_interleaved(
        attn,
        (&before.0, &before.1),
        after,
        Some(([&before.2, &before.3], [&ks[rows.clone()], &vs[rows.clone()]])),
    );
    if c.append {
        // The new rows landed quantized, with their scales, at position len - 1.
        let (bs, hkv) = (shape.block_size, shape.num_kv_heads);
        for (s, &len) in reference.lens.iter().enumerate() {
            let pos = len as usize - 1;
            let b = reference.tables[s * reference.max_blocks + pos / bs] as usize;
            for h in 0..hkv {
                let row = rows.start + (b * hkv + h) * bs + pos % bs;
                let n = s * hkv + h;
                assert_eq!(&k8[row * d..(row + 1) * d], &nk8[n * d..(n + 1) * d]);
                assert_eq!(&v8[row * d..(row + 1) * d], &nv8[n * d..(n + 1) * d]);
                assert_eq!((ks[row], vs[row]), (nks[n], nvs[n]));
            }
        }
    }
}

/// An int8 pool layer's K and V row scales, before a call and after it.
pub(crate) type RowScales<'a> = ([&'a [f32]; 2], [&'a [f32]; 2]);

/// One decode call as a test made it on separate pools, and what it wrote to `out`.
pub(crate) struct Call<'a, E> {
    pub(crate) q: &'a [E],
    pub(crate) shape: PagedShape,
    pub(crate) batch: DecodeBatch<'a>,
    pub(crate) params: DecodeParams,
    /// The appended rows, if the call appended.
    pub(crate) new: Option<(&'a [E], &'a [E])>,
    pub(crate) out: &'a [E],
}

/// `[blocks, kv_heads, 2, tile]` from two `[blocks, kv_heads, tile]` layers.
pub(crate) fn interleave<T: Copy>(k: &[T], v: &[T], tile: usize) -> Vec<T> {
    k.chunks(tile).zip(v.chunks(tile)).flat_map(|(a, b)| a.iter().chain(b).copied()).collect()
}

impl<E: Element> Call<'_, E> {
    /// The same call on an interleaved pool holding the layer as it was before (`before`, with
    /// the row scales of an int8 pool: before and after): the kernel does the same arithmetic at
    /// other addresses, so the output must be bit-identical, and an append must leave the pool
    /// holding what the separate pools hold `after`.
    pub(crate) fn check_interleaved<K: KvElement>(
        &self,
        attn: &CpuAttention,
        before: (&[K], &[K]),
        after: (&[K], &[K]),
        scales: Option<RowScales<'_>>,
    ) {
        let shape = PagedShape { interleaved: true, ..self.shape };
        let (tile, bs) = (shape.tile(), shape.block_size);
        let mut kv = interleave(before.0, before.1, tile);
        let mut sc = scales.map_or(vec![], |([k, v], _)| interleave(k, v, bs));
        let mut out = vec![E::from_f32(f32::NAN); self.out.len()];
        let res = match self.new {
            Some((nk, nv)) => {
                let pools = PoolsMut::Interleaved { kv: &mut kv, scales: &mut sc };
                attn.append_and_decode_pools(self.q, pools, &shape, &self.batch, &self.params, nk, nv, &mut out)
            }
            None => attn.decode_pools(
                self.q,
                &Pools::interleaved(&kv, &sc, &shape),
                &shape,
                &self.batch,
                &self.params,
                &mut out,
            ),
        };
        res.unwrap();
        let bits = |x: &[E]| x.iter().map(|v| v.to_f32().to_bits()).collect::<Vec<_>>();
        assert_eq!(
            bits(&out),
            bits(self.out),
            "interleaved pools, tier {} {:?}",
            attn.tier().name(),
            attn.dot_products()
        );
        let values = |x: &[K]| x.iter().map(|v| v.widen_one().to_bits()).collect::<Vec<_>>();
        assert!(values(&kv) == values(&interleave(after.0, after.1, tile)), "interleaved pool after the call");
        if let Some((_, [k, v])) = scales {
            assert_eq!(sc, interleave(k, v, bs), "interleaved row scales after the call");
        }
    }
}

pub(crate) fn run_all_dtypes(c: &Case, engines: &[CpuAttention]) {
    for e in engines {
        run_case::<f32>(c, e);
        run_case::<f16>(c, e);
        run_case::<bf16>(c, e);
        run_case_int8::<f32>(c, e);
        run_case_int8::<bf16>(c, e);
    }
}

pub(crate) fn case(
    head_dim: usize,
    block_size: usize,
    num_kv_heads: usize,
    group: usize,
    seq_lens: &[usize],
    append: bool,
) -> Case {
    let seq_lens = seq_lens.to_vec();
    Case {
        head_dim,
        block_size,
        num_kv_heads,
        group,
        seq_lens,
        append,
        q_amp: 1.0,
        seed: 7,
        window: None,
        softcap: None,
    }
}
