//! AVX512_BF16: 32 weights (a pair of inputs for each of a block's 16 columns) widened to bf16,
//! against the pair of `x` values broadcast, in one `vdpbf16ps` per row (module docs of `super`).

use std::arch::x86_64::*;

use half::bf16;

use super::{Block, Format, Out, Rows, Scratch, COLS, FUSED_ROWS, TILE};

/// Values of a pair: a block's weights for two inputs.
const PAIR: usize = 2 * COLS;
/// Pairs per chunk: 8 KiB of widened weight.
const CHUNK: usize = 128;
/// Accumulator sets the fused kernel alternates between, so that a row's chain of `vdpbf16ps`
/// does not wait on its own latency.
const SETS: usize = 4;

/// # Safety
/// The CPU must have AVX512F, AVX512BW and AVX512_BF16; `x` holds `rows` rows of `k`, `w` is a
/// block of a weight `k` wide, and this call alone writes `w`'s columns of `out`.
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
pub(super) unsafe fn block(x: Rows<'_>, rows: usize, k: usize, w: &Block<'_>, scratch: &mut Scratch, out: Out) {
    let pairs = k.div_ceil(2);
    let Rows { x, stride, group_sums } = x;
    assert!(stride >= k && x.len() >= (rows - 1) * stride + k, "block: rows shorter than their shapes");
    assert!(w.q.len() >= pairs * w.format.pair_bytes(), "block: a block shorter than its shape");
    let group_pairs = w.format.group_pairs(pairs);
    let int4 = matches!(w.format, Format::Int4 { .. });
    assert!(!int4 || w.groups.len() >= pairs.div_ceil(group_pairs) * PAIR, "block: groups shorter than their shape");
    let x = x.as_ptr();
    if rows <= FUSED_ROWS {
        // SAFETY: rows of `k` values `stride` apart, `pairs` pairs of `w` and its groups, each
        // row's group sums (asserted); the features and the columns are the caller's.
        unsafe {
            match w.format {
                Format::Int8 => [fused8::<1>, fused8::<2>, fused8::<3>, fused8::<4>][rows - 1](x, stride, k, w, out),
                Format::Int4 { group } => {
                    assert!(group_sums.len() >= rows * (k / group), "block: no group sums of the rows");
                    let sums = group_sums.as_ptr();
                    [fused4::<1>, fused4::<2>, fused4::<3>, fused4::<4>][rows - 1](x, stride, k, group, sums, w, out)
                }
            }
        };
        return;
    }
    scratch.wide.resize(pairs * PAIR, bf16::ZERO);
    scratch.sums.resize(rows * COLS, 0.0);
    for (g, wide) in scratch.wide.chunks_mut(group_pairs * PAIR).enumerate() {
        // SAFETY: group `g` and its pairs (asserted), into their values of the scratch.
        unsafe {
            let params = if int4 { group(w, g) } else { Group::none() };
            for (i, wide) in wide.chunks_exact_mut(PAIR).enumerate() {
                let v = widen(w, &params, g * group_pairs + i, int4);
                _mm512_storeu_si512(wide.as_mut_ptr().cast(), bits(v));
            }
        }
    }
    let tiles = [
        tile::<1>, tile::<2>, tile::<3>, tile::<4>, tile::<5>, tile::<6>, tile::<7>, tile::<8>, tile::<9>, tile::<10>,
        tile::<11>, tile::<12>,
    ];
    // Tiles of even sizes: 16 rows as 8 + 8 rather than 12 + 4, whose 4 chains of `vdpbf16ps`
    // would wait on their own latency.
    let tile_rows = rows.div_ceil(rows.div_ceil(TILE));
    // The pairs in chunks that stay in L1 while every tile of rows passes over them (a whole
    // widened block of a 2,048-wide input, 64 KiB, would be read from L2 by each tile).
    let mut p0 = 0;
    while p0 < pairs {
        let chunk = Chunk { p0, p1: (p0 + CHUNK).min(pairs), k, stride };
        let mut m = 0;
        while m < rows {
            let c = tile_rows.min(rows - m);
            let sums = scratch.sums[m * COLS..].as_mut_ptr();
            // SAFETY: rows `m .. m + c` (asserted), the widened pairs and `c * COLS` sums (sized
            // above); the features and the columns are the caller's.
            unsafe { tiles[c - 1](x.add(m * stride), chunk, scratch.wide.as_ptr(), sums, w, out, m) };
            m += c;
        }
        p0 = chunk.p1;
    }
}

/// Pairs `p0 .. p1` of a block whose input is `k` wide, for rows `stride` apart.
#[derive(Clone, Copy)]
struct Chunk {
    p0: usize,
    p1: usize,
    k: usize,
    stride: usize,
}

/// Rows `0 .. M` against an int8 block, widening each pair in registers.
///
/// # Safety
/// As `block`'s: `M` rows of `x`, `stride` apart.
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
unsafe fn fused8<const M: usize>(x: *const bf16, stride: usize, k: usize, w: &Block<'_>, out: Out) {
    let mut acc = [[_mm512_setzero_ps(); M]; SETS];
    let full = k / 2;
    let none = Group::none();
    let row = |m: usize| x.wrapping_add(m * stride);
    // SAFETY: pairs below `k.div_ceil(2)` of the block, values below `k` of the rows: the
    // caller's.
    unsafe {
        let mut p = 0;
        while p + SETS <= full {
            for (s, set) in acc.iter_mut().enumerate() {
                let wv = widen(w, &none, p + s, false);
                for (m, a) in set.iter_mut().enumerate() {
                    *a = _mm512_dpbf16_ps(*a, wv, both(row(m).add(2 * (p + s))));
                }
            }
            p += SETS;
        }
        for p in p..full {
            let wv = widen(w, &none, p, false);
            for (m, a) in acc[0].iter_mut().enumerate() {
                *a = _mm512_dpbf16_ps(*a, wv, both(row(m).add(2 * p)));
            }
        }
        if k % 2 == 1 {
            // An odd `k`'s last input.
            let wv = widen(w, &none, full, false);
            for (m, a) in acc[0].iter_mut().enumerate() {
                *a = _mm512_dpbf16_ps(*a, wv, last(row(m).add(k - 1)));
            }
        }
        for (m, sum) in sum_sets(acc).into_iter().enumerate() {
            store(out, m, w, sum);
        }
    }
}

/// Rows `0 .. M` against an int4 block: each group's `x · (128 + q)` summed in registers, then
/// scaled and offset by the group's `Σx` (`sums`: `[M][k / group]`) into the rows' sums (module
/// docs of `super`).
///
/// # Safety
/// As `block`'s: `M` rows of `x`, `stride` apart, and their group sums.
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
unsafe fn fused4<const M: usize>(
    x: *const bf16,
    stride: usize,
    k: usize,
    group: usize,
    sums: *const f32,
    w: &Block<'_>,
    out: Out,
) {
    let (groups, group_pairs) = (k / group, group / 2);
    let mut acc = [_mm512_setzero_ps(); M];
    let row = |m: usize| x.wrapping_add(m * stride);
    // Shift the upper 16 lanes' bytes by 4: their high nibbles.
    let shifts = _mm512_inserti64x4::<1>(_mm512_setzero_si512(), _mm256_set1_epi16(4));
    // SAFETY: the block's pairs and groups, the rows' values below `k` and their group sums: the
    // caller's.
    unsafe {
        for g in 0..groups {
            let mut dots = [[_mm512_setzero_ps(); M]; SETS];
            let (start, end) = (g * group_pairs, (g + 1) * group_pairs);
            let mut p = start;
            while p + SETS <= end {
                for (s, set) in dots.iter_mut().enumerate() {
                    let wv = exact4(w.q.as_ptr().add((p + s) * COLS), shifts);
                    for (m, a) in set.iter_mut().enumerate() {
                        *a = _mm512_dpbf16_ps(*a, wv, both(row(m).add(2 * (p + s))));
                    }
                }
                p += SETS;
            }
            for p in p..end {
                let wv = exact4(w.q.as_ptr().add(p * COLS), shifts);
                for (m, a) in dots[0].iter_mut().enumerate() {
                    *a = _mm512_dpbf16_ps(*a, wv, both(row(m).add(2 * p)));
                }
            }
            let scale = widen_bf16(w.groups.as_ptr().add(g * PAIR));
            let zero =
                _mm512_fnmadd_ps(_mm512_set1_ps(136.0), scale, widen_bf16(w.groups.as_ptr().add(g * PAIR + COLS)));
            for (m, (a, dot)) in acc.iter_mut().zip(sum_sets(dots)).enumerate() {
                *a = _mm512_fmadd_ps(scale, dot, *a);
                *a = _mm512_fmadd_ps(zero, _mm512_set1_ps(*sums.add(m * groups + g)), *a);
            }
        }
        for (m, a) in acc.into_iter().enumerate() {
            store(out, m, w, a);
        }
    }
}

/// Each row's four accumulator sets added.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
fn sum_sets<const M: usize>(sets: [[__m512; M]; SETS]) -> [__m512; M] {
    let [s0, s1, s2, s3] = sets;
    std::array::from_fn(|m| _mm512_add_ps(_mm512_add_ps(s0[m], s1[m]), _mm512_add_ps(s2[m], s3[m])))
}

/// An int4 pair as the bf16 values `128 + q` (exact: the bits `0x4300 | q`).
///
/// # Safety
/// `q` points at the pair's 16 bytes.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
unsafe fn exact4(q: *const u8, shifts: __m512i) -> __m512bh {
    // SAFETY: the caller's 16 bytes, read into both halves.
    let bytes = unsafe { _mm256_broadcastsi128_si256(_mm_loadu_si128(q.cast())) };
    let nibbles = _mm512_srlv_epi16(_mm512_cvtepu8_epi16(bytes), shifts);
    // (nibbles & 0xF) | 0x4300
    bh(_mm512_ternarylogic_epi32::<0xEA>(nibbles, _mm512_set1_epi16(0xF), _mm512_set1_epi16(0x4300)))
}

/// 16 bf16 as 16 f32.
///
/// # Safety
/// `v` points at 16 values.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
unsafe fn widen_bf16(v: *const bf16) -> __m512 {
    // SAFETY: the caller's 16 values.
    let halves = _mm512_cvtepu16_epi32(unsafe { _mm256_loadu_si256(v.cast()) });
    _mm512_castsi512_ps(_mm512_slli_epi32::<16>(halves))
}

/// Rows `x[0 .. M]` (output rows `m0 ..`) against `chunk` of the block widened into `wide`,
/// adding to the rows' partial `sums` (`[M][COLS]`; none before the first chunk) and, after the
/// last chunk, storing them.
///
/// # Safety
/// As `block`'s: `M` rows of `x`, `chunk.stride` apart; the widened pairs; `M * COLS` sums.
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
unsafe fn tile<const M: usize>(
    x: *const bf16,
    chunk: Chunk,
    wide: *const bf16,
    sums: *mut f32,
    w: &Block<'_>,
    out: Out,
    m0: usize,
) {
    let Chunk { p0, p1, k, stride } = chunk;
    let mut acc = [_mm512_setzero_ps(); M];
    let full = p1.min(k / 2);
    // SAFETY: the caller's rows, pairs and sums.
    unsafe {
        if p0 > 0 {
            for (m, a) in acc.iter_mut().enumerate() {
                *a = _mm512_loadu_ps(sums.add(m * COLS));
            }
        }
        for p in p0..full {
            let wv = bh(_mm512_loadu_si512(wide.add(p * PAIR).cast()));
            for (m, a) in acc.iter_mut().enumerate() {
                *a = _mm512_dpbf16_ps(*a, wv, both(x.add(m * stride + 2 * p)));
            }
        }
        if full < p1 {
            // An odd `k`'s last input, in the last chunk.
            let wv = bh(_mm512_loadu_si512(wide.add(full * PAIR).cast()));
            for (m, a) in acc.iter_mut().enumerate() {
                *a = _mm512_dpbf16_ps(*a, wv, last(x.add(m * stride + k - 1)));
            }
        }
        for (m, a) in acc.into_iter().enumerate() {
            if p1 == k.div_ceil(2) {
                store(out, m0 + m, w, a);
            } else {
                _mm512_storeu_ps(sums.add(m * COLS), a);
            }
        }
    }
}

/// An int4 group's scales and zeros for the 32 lanes of a pair (lane `2c + i`: column `c`), low
/// and high half, the zeros less 8 scales (`w = q · scale + (zero - 8 · scale)`).
#[derive(Clone, Copy)]
struct Group {
    scale: [__m512; 2],
    zero: [__m512; 2],
}

impl Group {
    /// For int8, whose pairs need none.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    fn none() -> Group {
        Group { scale: [_mm512_setzero_ps(); 2], zero: [_mm512_setzero_ps(); 2] }
    }
}

/// Group `g`'s `Group` from its 16 bf16 scales and 16 zeros.
///
/// # Safety
/// `w.groups` holds group `g`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
unsafe fn group(w: &Block<'_>, g: usize) -> Group {
    // SAFETY: the caller's 32 values of group `g`.
    let load = |at: usize| unsafe { widen_bf16(w.groups.as_ptr().add(g * PAIR + at)) };
    let (scale, zero) = (load(0), load(COLS));
    let zero = _mm512_fnmadd_ps(_mm512_set1_ps(8.0), scale, zero);
    // Lane `2c + i` of a pair: column `c` (0-7 in the low half, 8-15 in the high).
    let low = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
    let high = _mm512_add_epi32(low, _mm512_set1_epi32(8));
    let spread = |v| [_mm512_permutexvar_ps(low, v), _mm512_permutexvar_ps(high, v)];
    Group { scale: spread(scale), zero: spread(zero) }
}

/// Pair `p` of the block as 32 bf16: int8 exactly (an int8 needs 7 bits of significand); int4
/// as `q · scale + zero` of `params` in f32, rounded.
///
/// # Safety
/// The block holds pair `p`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
unsafe fn widen(w: &Block<'_>, params: &Group, p: usize, int4: bool) -> __m512bh {
    // SAFETY: the caller's pair.
    let (lo, hi) = unsafe {
        if int4 {
            let bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(w.q.as_ptr().add(p * COLS).cast()));
            let lo = _mm512_cvtepi32_ps(_mm512_and_si512(bytes, _mm512_set1_epi32(15)));
            let hi = _mm512_cvtepi32_ps(_mm512_srli_epi32::<4>(bytes));
            (_mm512_fmadd_ps(lo, params.scale[0], params.zero[0]), _mm512_fmadd_ps(hi, params.scale[1], params.zero[1]))
        } else {
            let q = w.q.as_ptr().add(p * PAIR);
            let lo = _mm512_cvtepi8_epi32(_mm_loadu_si128(q.cast()));
            let hi = _mm512_cvtepi8_epi32(_mm_loadu_si128(q.add(16).cast()));
            (_mm512_cvtepi32_ps(lo), _mm512_cvtepi32_ps(hi))
        }
    };
    // The second operand fills the low half.
    _mm512_cvtne2ps_pbh(hi, lo)
}

/// `x[0], x[1]` in every 32-bit lane.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
unsafe fn both(x: *const bf16) -> __m512bh {
    // SAFETY: the caller's two values.
    bh(_mm512_set1_epi32(unsafe { x.cast::<i32>().read_unaligned() }))
}

/// `x[0], 0` in every 32-bit lane: an odd `k`'s last input (the packing's pad weight is 0, but
/// the value past a row of `x` may be anything, an infinity included).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
unsafe fn last(x: *const bf16) -> __m512bh {
    // SAFETY: the caller's value.
    bh(_mm512_set1_epi32(i32::from(unsafe { x.read() }.to_bits())))
}

/// Row `m`'s block of columns from its sums: scaled, biased, rounded to bf16 (to nearest even,
/// as `bf16::from_f32`), and only the block's real columns stored.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
unsafe fn store(out: Out, m: usize, w: &Block<'_>, sums: __m512) {
    // SAFETY: `scales` and `bias` hold `COLS` values; the row and columns are the caller's.
    unsafe {
        let scaled = _mm512_mul_ps(sums, _mm512_loadu_ps(w.scales.as_ptr()));
        let value = _mm512_add_ps(scaled, _mm512_loadu_ps(w.bias.as_ptr()));
        let half = std::mem::transmute::<__m256bh, __m256i>(_mm512_cvtneps_pbh(value));
        let dst = (out.addr as *mut bf16).add(m * out.n + w.first);
        _mm512_mask_storeu_epi16(dst.cast(), (1u32 << w.cols) - 1, _mm512_castsi256_si512(half));
    }
}

/// The same 512 bits as integers.
#[inline(always)]
fn bits(x: __m512bh) -> __m512i {
    // SAFETY: both are plain 64-byte vectors; every bit pattern is valid for either.
    unsafe { std::mem::transmute::<__m512bh, __m512i>(x) }
}

/// The same 512 bits as 32 bf16 lanes.
#[inline(always)]
fn bh(x: __m512i) -> __m512bh {
    // SAFETY: both are plain 64-byte vectors; every bit pattern is valid for either.
    unsafe { std::mem::transmute::<__m512i, __m512bh>(x) }
}
