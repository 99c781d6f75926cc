//! bf16 item on AVX-512 with the BF16 dot-product instruction (`vdpbf16ps`, 32 bf16 MACs per
//! instruction): no widening of K/V at all. q·k runs on (query heads x tokens) register tiles of
//! 16 accumulators folded by one transposed reduction; p·v pairs consecutive tokens
//! (`unpack{lo,hi}_epi16`), so the accumulator's dims come out permuted within each 32-dim chunk
//! and are put back in order once per item. Probabilities are rounded to bf16 for p·v, as GPU
//! flash-decoding kernels do; the softmax itself stays in f32.

use std::arch::x86_64::*;

use crate::attn::element::{DType, Element};
use crate::attn::kernel::{self, group_tile, Geometry, Item, Scratch};
use crate::attn::x86::avx512::Avx512;

/// bf16 values per 512-bit vector: the chunk of a head dim handled at once.
const CHUNK: usize = 32;

/// # Safety
/// The CPU must support AVX-512 F/BW/VL/BF16; `E` must be bf16; `scratch` must be made for 32
/// lanes (`Scratch::new(geo, 32)`).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma,f16c")]
pub(crate) unsafe fn attend_item<E: Element>(
    it: &Item<'_, E>,
    geo: &Geometry,
    scratch: &mut Scratch,
    partial: &mut [f32],
) {
    assert!(E::DTYPE == DType::BF16);
    // SAFETY: E is bf16 (asserted), a transparent 16-bit type, so its slices are u16 slices.
    let (q, k, v) = unsafe { (as_bits(it.q), as_bits(it.k), as_bits(it.v)) };
    let (d, group) = (geo.head_dim, geo.group);
    let (dp, sp) = (scratch.padded_dim, scratch.score_stride);
    assert!(dp % CHUNK == 0 && sp % 16 == 0 && q.len() == group * d && it.start < it.end);
    let chunks = d.div_ceil(CHUNK);
    let tail_mask: __mmask32 = match d % CHUNK {
        0 => !0,
        r => (1u32 << r) - 1,
    };
    let shape = Shape { d, dp, sp, chunks, tail_mask };
    scratch.acc.fill(0.0);
    scratch.max.fill(f32::NEG_INFINITY);
    scratch.sum.fill(0.0);

    for b in it.start / geo.block_size..it.end.div_ceil(geo.block_size) {
        let (n, off, ahead) = it.block_tile(geo, b);
        let (k_tile, v_tile) = (&k[off..off + n * d], &v[off..off + n * d]);
        let (k_ahead, v_ahead) = (&k[ahead.clone()], &v[ahead]);
        // SAFETY: (whole block) the CPU supports this tier (caller); every slice length a
        // helper relies on is asserted inside it.
        unsafe {
            let mut g0 = 0;
            while g0 < group {
                let gt = group_tile(group - g0).min(4);
                let (qg, ka) = (&q[g0 * d..], if g0 == 0 { k_ahead } else { &[][..] });
                let sc = &mut scratch.scores[g0 * sp..];
                match gt {
                    4 => qk_tile::<4, 4>(qg, k_tile, ka, n, &shape, it.scale, sc),
                    2 => qk_tile::<2, 8>(qg, k_tile, ka, n, &shape, it.scale, sc),
                    _ => qk_tile::<1, 16>(qg, k_tile, ka, n, &shape, it.scale, sc),
                }
                g0 += gt;
            }
            for g in 0..group {
                let scores = &mut scratch.scores[g * sp..(g + 1) * sp];
                let acc = &mut scratch.acc[g * dp..(g + 1) * dp];
                kernel::online_softmax_step::<Avx512>(scores, n, acc, &mut scratch.max[g], &mut scratch.sum[g]);
                pack_bf16(scores, n, &mut scratch.pairs[g * sp / 2..(g + 1) * sp / 2]);
            }
            let mut g0 = 0;
            while g0 < group {
                let gt = group_tile(group - g0).min(4);
                let (pairs, acc) = (&scratch.pairs[g0 * sp / 2..], &mut scratch.acc[g0 * dp..]);
                let va = if g0 == 0 { v_ahead } else { &[][..] };
                match gt {
                    4 => pv_tile::<4>(pairs, v_tile, va, n, &shape, acc),
                    2 => pv_tile::<2>(pairs, v_tile, va, n, &shape, acc),
                    _ => pv_tile::<1>(pairs, v_tile, va, n, &shape, acc),
                }
                g0 += gt;
            }
        }
    }
    kernel::write_partial(geo, &scratch.acc, &scratch.max, &scratch.sum, partial, |g, acc, out| {
        // Undo the pairing permutation: in chunk c, lane j of the low half holds dim
        // c*32 + 8*(j/4) + j%4 and lane j of the high half the dim 4 above it.
        for (i, o) in out.iter_mut().enumerate() {
            let (c, r) = (i / CHUNK, i % CHUNK);
            let (lane, half) = ((r / 8) * 4 + r % 4, (r % 8) / 4);
            *o = acc[g * dp + c * CHUNK + half * 16 + lane];
        }
    });
}

struct Shape {
    d: usize,
    dp: usize,
    sp: usize,
    chunks: usize,
    tail_mask: __mmask32,
}

impl Shape {
    #[inline(always)]
    fn mask(&self, c: usize) -> __mmask32 {
        if c + 1 == self.chunks {
            self.tail_mask
        } else {
            !0
        }
    }
}

/// # Safety
/// `E` must be bf16.
unsafe fn as_bits<E>(s: &[E]) -> &[u16] {
    // SAFETY: the caller guarantees E is bf16: same size and alignment as u16, any bits valid.
    unsafe { std::slice::from_raw_parts(s.as_ptr().cast(), s.len()) }
}

/// Rounds `p[..n]` to bf16, two per u32 (`p[2i]` in the low half): the token pairs of p·v.
/// Entries past `n` (up to the next multiple of 16) are the softmax step's near-zero padding.
#[inline(always)]
unsafe fn pack_bf16(p: &[f32], n: usize, pairs: &mut [u32]) {
    let padded = n.next_multiple_of(16);
    assert!(padded <= p.len() && padded <= 2 * pairs.len());
    for c in (0..padded).step_by(16) {
        // SAFETY: c + 16 <= padded <= p.len(), and 16 bf16 = 8 u32 fit at pairs[c / 2..];
        // AVX-512 BF16 is supported (caller).
        unsafe {
            let h = _mm512_cvtneps_pbh(_mm512_loadu_ps(p.as_ptr().add(c)));
            _mm256_storeu_si256(pairs.as_mut_ptr().add(c / 2).cast(), std::mem::transmute::<__m256bh, __m256i>(h));
        }
    }
}

/// 32 bf16 at `p` (masked lanes read as zero and are never touched).
#[inline(always)]
unsafe fn load_bf16(mask: __mmask32, p: *const u16) -> __m512bh {
    // SAFETY: the caller guarantees the unmasked lanes are readable; AVX-512BW masked loads do
    // not fault on masked lanes. __m512i and __m512bh are both 64 plain bytes.
    unsafe { std::mem::transmute::<__m512i, __m512bh>(_mm512_maskz_loadu_epi16(mask, p.cast())) }
}

/// Scaled scores of `GT` query heads x `TT` tokens (GT * TT = 16) for all `n` tokens of a tile.
#[inline(always)]
unsafe fn qk_tile<const GT: usize, const TT: usize>(
    q: &[u16],
    k: &[u16],
    k_ahead: &[u16],
    n: usize,
    sh: &Shape,
    scale: f32,
    scores: &mut [f32],
) {
    let d = sh.d;
    assert!(GT * TT == 16 && q.len() >= GT * d && k.len() >= n * d && scores.len() >= (GT - 1) * sh.sp + n);
    for t0 in (0..n).step_by(TT) {
        // SAFETY: rows are clamped to n - 1 and chunk lanes past d are masked, so every unmasked
        // lane read lies inside `q` / `k` (asserted above); the CPU supports the tier (caller).
        unsafe {
            if let Some(rows) = k_ahead.get(t0 * d..(t0 + TT).min(n) * d) {
                kernel::prefetch_rows::<Avx512, u16>(rows);
            }
            let mut acc = [_mm512_setzero_ps(); 16];
            for c in 0..sh.chunks {
                let m = sh.mask(c);
                let qv: [__m512bh; GT] = std::array::from_fn(|g| load_bf16(m, q.as_ptr().add(g * d + c * CHUNK)));
                for i in 0..TT {
                    let kv = load_bf16(m, k.as_ptr().add((t0 + i).min(n - 1) * d + c * CHUNK));
                    for g in 0..GT {
                        acc[g * TT + i] = _mm512_dpbf16_ps(acc[g * TT + i], qv[g], kv);
                    }
                }
            }
            let mut s = [0f32; 16];
            _mm512_storeu_ps(s.as_mut_ptr(), _mm512_mul_ps(reduce16(&acc), _mm512_set1_ps(scale)));
            for g in 0..GT {
                for i in 0..TT.min(n - t0) {
                    scores[g * sh.sp + t0 + i] = s[g * TT + i];
                }
            }
        }
    }
}

/// Lane i of the result is the sum of the 16 lanes of `v[i]` (a transposed reduction: 45 adds
/// and shuffles for 16 sums instead of 16 full horizontal reductions).
#[inline(always)]
unsafe fn reduce16(v: &[__m512; 16]) -> __m512 {
    // SAFETY: plain AVX-512F register arithmetic; the CPU supports it (caller). Loops, not
    // closures: a closure would not inherit the target features.
    unsafe {
        // 16 -> 8: per 128-bit lane [a0+a2, b0+b2, a1+a3, b1+b3].
        let mut x = [_mm512_setzero_ps(); 8];
        for (i, x) in x.iter_mut().enumerate() {
            let (a, b) = (v[2 * i], v[2 * i + 1]);
            *x = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
        }
        // 8 -> 4: per 128-bit lane the four vectors' lane sums [a, b, c, d].
        let mut y = [_mm512_setzero_ps(); 4];
        for (i, y) in y.iter_mut().enumerate() {
            let (a, b) = (_mm512_castps_pd(x[2 * i]), _mm512_castps_pd(x[2 * i + 1]));
            let (lo, hi) = (_mm512_unpacklo_pd(a, b), _mm512_unpackhi_pd(a, b));
            *y = _mm512_add_ps(_mm512_castpd_ps(lo), _mm512_castpd_ps(hi));
        }
        // 4 -> 2 -> 1: add the four 128-bit lanes together, keeping vectors in order.
        let z0 = fold_lanes(y[0], y[1]);
        let z1 = fold_lanes(y[2], y[3]);
        fold_lanes(z0, z1)
    }
}

/// `[a.L0+a.L1, a.L2+a.L3, b.L0+b.L1, b.L2+b.L3]` over 128-bit lanes.
#[inline(always)]
unsafe fn fold_lanes(a: __m512, b: __m512) -> __m512 {
    // SAFETY: plain AVX-512F register arithmetic; the CPU supports it (caller).
    unsafe { _mm512_add_ps(_mm512_shuffle_f32x4::<0b10_00_10_00>(a, b), _mm512_shuffle_f32x4::<0b11_01_11_01>(a, b)) }
}

/// `acc[g] += Σ_t p[g][t] · v[t]` over token pairs with `vdpbf16ps`; `acc` rows are in the
/// paired (permuted) dim order.
#[inline(always)]
unsafe fn pv_tile<const GT: usize>(pairs: &[u32], v: &[u16], v_ahead: &[u16], n: usize, sh: &Shape, acc: &mut [f32]) {
    let (d, dp, ps) = (sh.d, sh.dp, sh.sp / 2);
    let npairs = n.div_ceil(2);
    assert!(pairs.len() >= (GT - 1) * ps + npairs && v.len() >= n * d && acc.len() >= GT * dp);
    for c in 0..sh.chunks {
        let m = sh.mask(c);
        // SAFETY: rows < n and unmasked lanes < d lie inside `v`; acc offsets < GT * dp; pairs
        // offsets < (GT - 1) * ps + npairs (asserted above); the CPU supports the tier (caller).
        unsafe {
            let a = acc.as_mut_ptr().add(c * CHUNK);
            let mut lo: [__m512; GT] = std::array::from_fn(|g| _mm512_loadu_ps(a.add(g * dp)));
            let mut hi: [__m512; GT] = std::array::from_fn(|g| _mm512_loadu_ps(a.add(g * dp + 16)));
            for tp in 0..npairs {
                let t = 2 * tp;
                if c == 0 {
                    if let Some(rows) = v_ahead.get(t * d..(t + 2).min(n) * d) {
                        kernel::prefetch_rows::<Avx512, u16>(rows);
                    }
                }
                let v0 = _mm512_maskz_loadu_epi16(m, v.as_ptr().add(t * d + c * CHUNK).cast());
                let v1 = match t + 1 < n {
                    true => _mm512_maskz_loadu_epi16(m, v.as_ptr().add((t + 1) * d + c * CHUNK).cast()),
                    false => _mm512_setzero_si512(),
                };
                let l = std::mem::transmute::<__m512i, __m512bh>(_mm512_unpacklo_epi16(v0, v1));
                let h = std::mem::transmute::<__m512i, __m512bh>(_mm512_unpackhi_epi16(v0, v1));
                for g in 0..GT {
                    let pp = _mm512_set1_epi32(*pairs.get_unchecked(g * ps + tp) as i32);
                    let pp = std::mem::transmute::<__m512i, __m512bh>(pp);
                    lo[g] = _mm512_dpbf16_ps(lo[g], l, pp);
                    hi[g] = _mm512_dpbf16_ps(hi[g], h, pp);
                }
            }
            for g in 0..GT {
                _mm512_storeu_ps(a.add(g * dp), lo[g]);
                _mm512_storeu_ps(a.add(g * dp + 16), hi[g]);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reduce16_sums_each_vector_in_order() {
        if !std::arch::is_x86_feature_detected!("avx512f") {
            return;
        }
        let rows: Vec<[f32; 16]> = (0..16).map(|i| std::array::from_fn(|j| (i * 100 + j) as f32)).collect();
        #[target_feature(enable = "avx512f")]
        fn run(rows: &[[f32; 16]]) -> [f32; 16] {
            let mut v = [_mm512_setzero_ps(); 16];
            let mut out = [0f32; 16];
            // SAFETY: each row holds 16 f32; the feature is enabled on this function.
            unsafe {
                for (v, r) in v.iter_mut().zip(rows) {
                    *v = _mm512_loadu_ps(r.as_ptr());
                }
                _mm512_storeu_ps(out.as_mut_ptr(), reduce16(&v));
            }
            out
        }
        // SAFETY: AVX-512F checked above.
        let got = unsafe { run(&rows) };
        for (i, r) in rows.iter().enumerate() {
            assert_eq!(got[i], r.iter().sum::<f32>(), "lane {i}");
        }
    }
}
