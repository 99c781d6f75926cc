//! AVX512_BF16: 32 weights (a pair of inputs for each of a block's 16 columns) widened to bf16,
//! against the pair of `x` values broadcast, in one `vdpbf16ps` per row (module docs of `super`).

use std::arch::x86_64::*;

use half::bf16;

use super::{Block, Format, Out, Rows, Scratch, COLS, FUSED_ROWS, SPAN, TILE};

/// Values of a pair: a block's weights for two inputs.
const PAIR: usize = 2 * COLS;
/// Accumulator sets the fused kernel alternates between, so that a row's chain of `vdpbf16ps`
/// does not wait on its own latency.
const SETS: usize = 4;

/// # Safety
/// The CPU must have AVX512F, AVX512BW and AVX512_BF16; `x` holds `rows` rows of `k`, `ws` are
/// blocks of one weight `k` wide (more than one only past `FUSED_ROWS` rows), and this call
/// alone writes their columns of `out`.
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
pub(super) unsafe fn blocks(x: Rows<'_>, rows: usize, k: usize, ws: &[Block<'_>], scratch: &mut Scratch, out: Out) {
    let pairs = k.div_ceil(2);
    let Rows { x, stride, group_sums, .. } = x;
    let x = x.bf16();
    assert!(stride >= k && x.len() >= (rows - 1) * stride + k, "block: rows shorter than their shapes");
    assert!((1..=SPAN).contains(&ws.len()) && (ws.len() == 1 || rows > FUSED_ROWS), "block: a span of blocks");
    let format = ws[0].format;
    let group = format.group();
    let int4 = matches!(format, Format::Int4 { .. });
    for w in ws {
        assert!(
            w.format == format && w.q.len() >= pairs * format.pair_bytes(),
            "block: a block shorter than its shape"
        );
        assert!(group.is_none_or(|group| w.groups.len() >= k / group * PAIR), "block: groups shorter than their shape");
    }
    if let Some(group) = group {
        assert!(group_sums.len() >= rows * (k / group), "block: no group sums of the rows");
    }
    let x = x.as_ptr();
    if rows <= FUSED_ROWS {
        let w = &ws[0];
        // SAFETY: rows of `k` values `stride` apart, `pairs` pairs of `w` and its groups, each
        // row's group sums (asserted); the features and the columns are the caller's.
        unsafe {
            match group {
                None => [fused8::<1>, fused8::<2>, fused8::<3>, fused8::<4>][rows - 1](x, stride, k, w, out),
                Some(group) => FUSED[usize::from(int4)][rows - 1](x, stride, k, group, group_sums.as_ptr(), w, out),
            }
        };
        return;
    }
    let span = ws.len();
    scratch.wide.resize(span * pairs * PAIR, bf16::ZERO);
    if group.is_some() {
        // The grouped tiles add each group into their rows' sums.
        scratch.sums.clear();
        scratch.sums.resize(span * rows * COLS, 0.0);
    }
    let shifts = nibble_shifts();
    for (w, wide) in ws.iter().zip(scratch.wide.chunks_exact_mut(pairs * PAIR)) {
        for (p, wide) in wide.chunks_exact_mut(PAIR).enumerate() {
            // SAFETY: pair `p` of the block (asserted) into its values of the scratch.
            unsafe {
                let v =
                    if int4 { exact4(w.q.as_ptr().add(p * COLS), shifts) } else { widen8(w.q.as_ptr().add(p * PAIR)) };
                _mm512_storeu_si512(wide.as_mut_ptr().cast(), bits(v));
            }
        }
    }
    // Tiles of even sizes: 16 rows as 8 + 8 rather than 12 + 4, whose 4 chains of `vdpbf16ps`
    // would wait on their own latency. Each tile passes over the whole widened span (L2 holds
    // it): passing in chunks that stay in L1 measured slower on Zen 5 (int4 at 64 rows, 1B
    // down_proj 1.43-1.52x -> 0.99-1.11x of oneDNN's time without) and no faster on Zen 4.
    let tile_rows = rows.div_ceil(rows.div_ceil(TILE));
    let mut m = 0;
    while m < rows {
        let c = tile_rows.min(rows - m);
        let tiled = Tiled {
            wide: scratch.wide.as_ptr(),
            wide_stride: pairs * PAIR,
            sums: scratch.sums.as_mut_ptr().wrapping_add(m * COLS),
            sums_stride: rows * COLS,
            blocks: ws,
            out,
            m0: m,
        };
        // SAFETY: rows `m .. m + c` (asserted) and their group sums, the widened pairs and
        // `span * rows * COLS` sums (sized above); the features and the columns are the caller's.
        unsafe {
            let x = x.add(m * stride);
            match group {
                None => TILES8[span - 1][c - 1](x, k, stride, &tiled),
                Some(group) => {
                    let group_sums = group_sums.as_ptr().add(m * (k / group));
                    TILES_GROUPED[usize::from(int4)][span - 1][c - 1](x, k, stride, &tiled, group_sums, group)
                }
            }
        };
        m += c;
    }
}

/// What a tile works on besides its rows: its blocks (`SPAN` at most) widened into `wide`, one
/// after another `wide_stride` values apart, the grouped formats' rows' sums (`sums`, from the
/// tile's first row, `[blocks][rows][COLS]`, `sums_stride` values a block; dangling else), and
/// its first output row, `m0`.
struct Tiled<'a> {
    wide: *const bf16,
    wide_stride: usize,
    sums: *mut f32,
    sums_stride: usize,
    blocks: &'a [Block<'a>],
    out: Out,
    m0: usize,
}

type Tile8 = unsafe fn(*const bf16, usize, usize, &Tiled<'_>);
type TileGrouped = unsafe fn(*const bf16, usize, usize, &Tiled<'_>, *const f32, usize);
type FusedGrouped = unsafe fn(*const bf16, usize, usize, usize, *const f32, &Block<'_>, Out);
const TILES8: [[Tile8; TILE]; SPAN] = [tiles8::<1>(), tiles8::<2>()];
/// The grouped formats' kernels, grouped int8's first, then int4's.
const TILES_GROUPED: [[[TileGrouped; TILE]; SPAN]; 2] = [
    [tiles_grouped::<false, 1>(), tiles_grouped::<false, 2>()],
    [tiles_grouped::<true, 1>(), tiles_grouped::<true, 2>()],
];
const FUSED: [[FusedGrouped; FUSED_ROWS]; 2] = [
    [fused_grouped::<false, 1>, fused_grouped::<false, 2>, fused_grouped::<false, 3>, fused_grouped::<false, 4>],
    [fused_grouped::<true, 1>, fused_grouped::<true, 2>, fused_grouped::<true, 3>, fused_grouped::<true, 4>],
];

const fn tiles8<const N: usize>() -> [Tile8; TILE] {
    [
        tile8::<N, 1>,
        tile8::<N, 2>,
        tile8::<N, 3>,
        tile8::<N, 4>,
        tile8::<N, 5>,
        tile8::<N, 6>,
        tile8::<N, 7>,
        tile8::<N, 8>,
        tile8::<N, 9>,
        tile8::<N, 10>,
        tile8::<N, 11>,
        tile8::<N, 12>,
    ]
}

const fn tiles_grouped<const INT4: bool, const N: usize>() -> [TileGrouped; TILE] {
    [
        tile_grouped::<INT4, N, 1>,
        tile_grouped::<INT4, N, 2>,
        tile_grouped::<INT4, N, 3>,
        tile_grouped::<INT4, N, 4>,
        tile_grouped::<INT4, N, 5>,
        tile_grouped::<INT4, N, 6>,
        tile_grouped::<INT4, N, 7>,
        tile_grouped::<INT4, N, 8>,
        tile_grouped::<INT4, N, 9>,
        tile_grouped::<INT4, N, 10>,
        tile_grouped::<INT4, N, 11>,
        tile_grouped::<INT4, N, 12>,
    ]
}

/// Rows `0 .. M` against an int8 block, widening each pair in registers.
///
/// # Safety
/// As `block`'s: `M` rows of `x`, `stride` apart.
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
unsafe fn fused8<const M: usize>(x: *const bf16, stride: usize, k: usize, w: &Block<'_>, out: Out) {
    let mut acc = [[_mm512_setzero_ps(); M]; SETS];
    let full = k / 2;
    let row = |m: usize| x.wrapping_add(m * stride);
    // SAFETY: pairs below `k.div_ceil(2)` of the block, values below `k` of the rows: the
    // caller's.
    unsafe {
        let mut p = 0;
        while p + SETS <= full {
            for (s, set) in acc.iter_mut().enumerate() {
                let wv = widen8(w.q.as_ptr().add((p + s) * PAIR));
                for (m, a) in set.iter_mut().enumerate() {
                    *a = _mm512_dpbf16_ps(*a, wv, both(row(m).add(2 * (p + s))));
                }
            }
            p += SETS;
        }
        for p in p..full {
            let wv = widen8(w.q.as_ptr().add(p * PAIR));
            for (m, a) in acc[0].iter_mut().enumerate() {
                *a = _mm512_dpbf16_ps(*a, wv, both(row(m).add(2 * p)));
            }
        }
        if k % 2 == 1 {
            // An odd `k`'s last input.
            let wv = widen8(w.q.as_ptr().add(full * PAIR));
            for (m, a) in acc[0].iter_mut().enumerate() {
                *a = _mm512_dpbf16_ps(*a, wv, last(row(m).add(k - 1)));
            }
        }
        for (m, sum) in sum_sets(acc).into_iter().enumerate() {
            store(out, m, w, sum);
        }
    }
}

/// Rows `0 .. M` against a grouped block (`INT4`: int4's, else grouped int8's): each group's
/// `x · v` summed in registers (`v`: the widened values, `wide::<INT4>`), then scaled and offset
/// by the group's `Σx` (`sums`: `[M][k / group]`) into the rows' sums (module docs of `super`).
///
/// # Safety
/// As `block`'s: `M` rows of `x`, `stride` apart, and their group sums.
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
unsafe fn fused_grouped<const INT4: bool, const M: usize>(
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
    let shifts = nibble_shifts();
    // SAFETY: the block's pairs and groups, the rows' values below `k` and their group sums: the
    // caller's.
    unsafe {
        for g in 0..groups {
            let mut dots = [[_mm512_setzero_ps(); M]; SETS];
            let (start, end) = (g * group_pairs, (g + 1) * group_pairs);
            let mut p = start;
            while p + SETS <= end {
                for (s, set) in dots.iter_mut().enumerate() {
                    let wv = wide::<INT4>(w.q.as_ptr(), p + s, shifts);
                    for (m, a) in set.iter_mut().enumerate() {
                        *a = _mm512_dpbf16_ps(*a, wv, both(row(m).add(2 * (p + s))));
                    }
                }
                p += SETS;
            }
            for p in p..end {
                let wv = wide::<INT4>(w.q.as_ptr(), p, shifts);
                for (m, a) in dots[0].iter_mut().enumerate() {
                    *a = _mm512_dpbf16_ps(*a, wv, both(row(m).add(2 * p)));
                }
            }
            let (scale, zero) = group_params::<INT4>(w, g);
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

/// Pair `p` of a grouped block as bf16: int4's `128 + q` (`INT4`), else grouped int8's `q`.
///
/// # Safety
/// `q` points at the block's pairs, of which `p` is one.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
unsafe fn wide<const INT4: bool>(q: *const u8, p: usize, shifts: __m512i) -> __m512bh {
    // SAFETY: the caller's pair.
    unsafe {
        if INT4 {
            exact4(q.add(p * COLS), shifts)
        } else {
            widen8(q.add(p * PAIR))
        }
    }
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

/// Pairs `pairs` of `tiled`'s `N` widened blocks into `M` rows' sums each, row `m`'s operand
/// for pair `p` from `x(m, p)` (its broadcast pair of inputs), fed to every block.
///
/// # Safety
/// `tiled` holds the pairs; `x` may be called for each row and pair.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
unsafe fn pass<const N: usize, const M: usize>(
    acc: &mut [[__m512; M]; N],
    tiled: &Tiled<'_>,
    pairs: std::ops::Range<usize>,
    x: impl Fn(usize, usize) -> __m512bh,
) {
    let wide = |b: usize, p: usize| tiled.wide.wrapping_add(b * tiled.wide_stride + p * PAIR);
    for p in pairs {
        // SAFETY: the caller's pairs.
        let wv: [__m512bh; N] = std::array::from_fn(|b| bh(unsafe { _mm512_loadu_si512(wide(b, p).cast()) }));
        for m in 0..M {
            let xv = x(m, p);
            for (block, w) in acc.iter_mut().zip(wv) {
                block[m] = _mm512_dpbf16_ps(block[m], w, xv);
            }
        }
    }
}

/// Rows `x[0 .. M]` (`stride` apart, `k` wide; output rows `tiled.m0 ..`) against `N` int8
/// blocks widened, each pair's broadcast `x` feeding every block, their sums stored.
///
/// # Safety
/// As `blocks`'s: `M` rows of `x`; `N` blocks of `tiled`, widened.
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
unsafe fn tile8<const N: usize, const M: usize>(x: *const bf16, k: usize, stride: usize, tiled: &Tiled<'_>) {
    let mut acc = [[_mm512_setzero_ps(); M]; N];
    let full = k / 2;
    // SAFETY: the caller's rows and pairs.
    unsafe {
        pass(&mut acc, tiled, 0..full, |m, p| both(x.add(m * stride + 2 * p)));
        if k % 2 == 1 {
            // An odd `k`'s last input.
            pass(&mut acc, tiled, full..full + 1, |m, _| last(x.add(m * stride + k - 1)));
        }
        for (b, block) in acc.into_iter().enumerate() {
            for (m, a) in block.into_iter().enumerate() {
                store(tiled.out, tiled.m0 + m, &tiled.blocks[b], a);
            }
        }
    }
}

/// Each row's sum over each group of `group` inputs (`[rows][k / group]`), by `vdpbf16ps`
/// against ones.
///
/// # Safety
/// The CPU must have AVX512F, AVX512BW and AVX512_BF16.
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
pub(super) unsafe fn group_sums(x: &[bf16], k: usize, group: usize) -> Vec<f32> {
    let ones = bh(_mm512_set1_epi16(0x3F80)); // bf16 1.0
    let mut sums = Vec::with_capacity(x.len() / group);
    for g in x.chunks_exact(group).take(x.len() / k * (k / group)) {
        let mut acc = _mm512_setzero_ps();
        for c in g.chunks(32) {
            let mask = if c.len() == 32 { u32::MAX } else { (1u32 << c.len()) - 1 };
            // SAFETY: the mask keeps the load inside the chunk.
            let v = bh(unsafe { _mm512_maskz_loadu_epi16(mask, c.as_ptr().cast()) });
            acc = _mm512_dpbf16_ps(acc, v, ones);
        }
        sums.push(_mm512_reduce_add_ps(acc));
    }
    sums
}

/// Group `g`'s 16 scales, and its 16 zeros (int4's less 136 scales: `x · w = scale · (x · (128 +
/// q)) + (zero - 136 · scale) · Σx`), one lane a column.
///
/// # Safety
/// `w.groups` holds group `g`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
unsafe fn group_params<const INT4: bool>(w: &Block<'_>, g: usize) -> (__m512, __m512) {
    let groups = w.groups.bf16().as_ptr();
    // SAFETY: the caller's 32 values of group `g`.
    let (scale, zero) = unsafe { (widen_bf16(groups.add(g * PAIR)), widen_bf16(groups.add(g * PAIR + COLS))) };
    (scale, if INT4 { _mm512_fnmadd_ps(_mm512_set1_ps(136.0), scale, zero) } else { zero })
}

/// An int8 pair as 32 bf16, exactly (an int8 needs 7 bits of significand).
///
/// # Safety
/// `q` points at the pair's 32 bytes.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
unsafe fn widen8(q: *const u8) -> __m512bh {
    // SAFETY: the caller's 32 bytes.
    let (lo, hi) = unsafe { (_mm_loadu_si128(q.cast()), _mm_loadu_si128(q.add(16).cast())) };
    let (lo, hi) = (_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(lo)), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(hi)));
    // The second operand fills the low half.
    _mm512_cvtne2ps_pbh(hi, lo)
}

/// Shifts for `exact4`: the upper 16 lanes take their bytes' high nibbles.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
fn nibble_shifts() -> __m512i {
    _mm512_inserti64x4::<1>(_mm512_setzero_si512(), _mm256_set1_epi16(4))
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

/// A grouped tile: as `tile8`, over `N` blocks widened (`wide::<INT4>`'s values), each group's
/// sums scaled and offset by the rows' `group_sums` (`[M][k / group]`) as in `fused_grouped`
/// and added to the rows' sums in `tiled` (zeros before the first group; two blocks' rows'
/// sums would not fit in registers beside the group's), stored after the last group.
///
/// # Safety
/// As `tile8`'s, and the rows' group sums and sums.
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
unsafe fn tile_grouped<const INT4: bool, const N: usize, const M: usize>(
    x: *const bf16,
    k: usize,
    stride: usize,
    tiled: &Tiled<'_>,
    group_sums: *const f32,
    group: usize,
) {
    let (groups, group_pairs) = (k / group, group / 2);
    let sums = |b: usize, m: usize| tiled.sums.wrapping_add(b * tiled.sums_stride + m * COLS);
    // SAFETY: the caller's rows, pairs, groups and sums.
    unsafe {
        for g in 0..groups {
            let mut dots = [[_mm512_setzero_ps(); M]; N];
            pass(&mut dots, tiled, g * group_pairs..(g + 1) * group_pairs, |m, p| both(x.add(m * stride + 2 * p)));
            for (b, block) in dots.into_iter().enumerate() {
                let (scale, zero) = group_params::<INT4>(&tiled.blocks[b], g);
                for (m, d) in block.into_iter().enumerate() {
                    let a = _mm512_fmadd_ps(scale, d, _mm512_loadu_ps(sums(b, m)));
                    let a = _mm512_fmadd_ps(zero, _mm512_set1_ps(*group_sums.add(m * groups + g)), a);
                    _mm512_storeu_ps(sums(b, m), a);
                }
            }
        }
        for b in 0..N {
            for m in 0..M {
                store(tiled.out, tiled.m0 + m, &tiled.blocks[b], _mm512_loadu_ps(sums(b, m)));
            }
        }
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
