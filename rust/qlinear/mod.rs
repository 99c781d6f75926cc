//! Weight-only quantized linears on the CPU, int8 and int4: `out = x · Wᵀ + bias` with `x` and
//! `out` of the model's dtype (bf16, f16 or f32) and `W` kept as its int8 or 4-bit values.
//! torch's kernels (`_weight_int8pack_mm`, tinygemm's `_weight_int4pack_mm_for_cpu`) widen the
//! weight again for every row of `x`, so at 64 rows they ran at 0.4-0.6x bf16's speed (and in
//! f32 or f16 at a few hundredths of it); here each weight block is widened once a call and then
//! multiplied by every row.
//!
//! The weight is packed in blocks of 16 output columns (`COLS`). Pair `p` of a block holds, for
//! each of its columns, that column's weights at inputs `2p` and `2p + 1` (`k` padded to even,
//! `n` to whole blocks, with zeros): 32 weights, lane `2c + i` column `c`'s input `2p + i`.
//! Widened to bf16, they are one operand of `vdpbf16ps`, the other being the pair `x[2p], x[2p +
//! 1]` broadcast: each f32 lane then sums its own column's products, and no lane ever needs a
//! horizontal sum. A block's pairs are one stream, front to back, as the prefetcher likes.
//!
//! - `Format::Int8`: a pair is 32 bytes in lane order; `w = q · scale` with a scale per column,
//!   applied to the f32 sums (widening is exact: every int8 is a bf16).
//! - `Format::Int4`: a pair is 16 bytes, byte `j` holding lane `j` in its low nibble and lane
//!   `16 + j` in its high one; `w = (q - 8) · scale + zero` with a bf16 scale and zero per column
//!   and group of inputs, stored per block and group (`[16 scales, 16 zeros]`). The kernels
//!   multiply `128 + q`, exact as a bf16 whose bits are `0x4300 | q` (a few logic instructions a
//!   pair, no conversions), and apply each group's scale and zero to the f32 sums with the row's
//!   sum over the group: `x · w = scale · (x · (128 + q)) + (zero - 136 · scale) · Σx`. Rounding
//!   `w` itself to bf16 instead, as a first version did, moved SmolLM2's logits enough to flip a
//!   near-tied greedy token against torch's kernel, which keeps `w` in f32.
//! - `Format::GroupedInt8`: int8's pairs with int4's groups, `w = q · scale + zero` (`q` any
//!   int8), for blocks of 2 to 8 bits with a scale (and offset) per 16 or 32 inputs, such as
//!   GGUF's Q8_0, Q5_*, Q2_K, Q3_K and Q6_K, or 8-bit GPTQ: `x · w = scale · (x · q) + zero · Σx`.
//!
//! - A few rows (`FUSED_ROWS`): the weight is widened pair by pair in registers and used at once.
//! - More rows: blocks are widened two at a time (`SPAN`) into a thread's scratch (18 KiB a block
//!   for a 576-wide input), then multiplied by the rows in tiles of up to `TILE` rows, one
//!   accumulator each per block, each row's broadcast `x` feeding both blocks.
//!
//! That is the AVX512_BF16 path (`avx512.rs`) for bf16 models. Without `vdpbf16ps`, the AVX2
//! path (`avx2.rs`) widens the same packed pairs to f32 and multiplies-adds them with `x` widened
//! once a call; the AVX512_BF16 path does the same in 16 lanes for f16 and f32 models, whose `x`
//! would lose bits as bf16 (`avx512_f32.rs`); on aarch64 the NEON path (`neon.rs`) in 128-bit
//! vectors. The grouped formats' scales and zeros are of the model's dtype too (a GGUF's f16
//! scales lose nothing in f32 or f16).
//!
//! Sums are f32, then scaled (int8), biased (f32) and rounded to the model's dtype once. Work is
//! split by blocks over the calling thread's OpenMP team (`crate::team`), as `crate::gemv` does.

/// `$against::<c>(args)`: a tile of `c` rows (1 to 4) as a constant.
macro_rules! f32_tile {
    ($against:ident, $c:expr, $($arg:expr),*) => {
        match $c {
            1 => $against::<1>($($arg),*),
            2 => $against::<2>($($arg),*),
            3 => $against::<3>($($arg),*),
            _ => $against::<4>($($arg),*),
        }
    };
}

/// The passes of an f32 path (`avx2.rs`, `avx512_f32.rs`, `neon.rs`) over blocks `$ws` of one
/// weight, `$rows` rows of `$x` (`prepare`'s) `$k` wide: up to `FUSED_ROWS` rows each pair is
/// widened in registers (`$widen4(q)` for int4's 16 bytes at `q`, `$widen8(q)` for the other
/// formats' 32) and used at once; past that each block is widened once into the thread's scratch
/// (`$store(pair, to)`, `$pair` f32 values a pair; `$load(from)` reads one back), then passed
/// over in tiles of up to 4 rows split evenly (6 rows as 3 + 3), each tile by
/// `$against::<rows>(&F32Tile, k, block, out, pair)`. A macro, so that the path's kernels inline
/// under the calling function's target features.
macro_rules! f32_passes {
    ($x:expr, $rows:expr, $k:expr, $ws:expr, $scratch:expr, $out:expr,
     pair: $pair:expr, widen4: $widen4:ident, widen8: $widen8:ident, store: $store:ident, load: $load:ident,
     against: $against:ident) => {{
        let (x, rows, k, ws, scratch, out) = ($x, $rows, $k, $ws, $scratch, $out);
        let pairs = k.div_ceil(2);
        let width = 2 * pairs;
        let format = ws[0].format;
        assert!(x.wide.len() >= rows * width, "block: rows shorter than their shapes");
        if let Some(group) = format.group() {
            assert!(x.group_sums.len() >= rows * (k / group), "block: no group sums of the rows");
        }
        for w in ws {
            assert!(
                w.format == format && w.q.len() >= pairs * format.pair_bytes(),
                "block: a block shorter than its shape"
            );
            assert!(
                format.group().is_none_or(|group| w.groups.len() >= k / group * 2 * COLS),
                "block: groups shorter than their shape"
            );
        }
        let rows_of = |m: usize| F32Tile {
            x: x.wide.as_ptr().wrapping_add(m * width),
            width,
            group_sums: x.group_sums.as_ptr().wrapping_add(format.group().map_or(0, |group| m * (k / group))),
            m0: m,
        };
        let int4 = matches!(format, Format::Int4 { .. });
        for w in ws {
            // SAFETY: pair `p` of the block (asserted).
            let widen = |p: usize| unsafe {
                let q = w.q.as_ptr().add(p * format.pair_bytes());
                if int4 {
                    $widen4(q)
                } else {
                    $widen8(q)
                }
            };
            if rows <= FUSED_ROWS {
                let pair = &widen;
                // SAFETY: every row of `x` and its group sums (asserted); the columns are the
                // caller's.
                unsafe { f32_tile!($against, rows, &rows_of(0), k, w, out, pair) };
                continue;
            }
            scratch.wide32.resize(pairs * $pair, 0.0);
            for (p, to) in scratch.wide32.chunks_exact_mut($pair).enumerate() {
                // SAFETY: pair `p` into its values of the scratch.
                unsafe { $store(widen(p), to.as_mut_ptr()) };
            }
            let wide = scratch.wide32.as_ptr();
            // SAFETY: the `pairs` pairs just widened.
            let pair = |p: usize| unsafe { $load(wide.add(p * $pair)) };
            let tile_rows = rows.div_ceil(rows.div_ceil(4));
            let mut m = 0;
            while m < rows {
                let c = tile_rows.min(rows - m);
                // SAFETY: rows `m .. m + c` and their group sums (asserted); the columns are the
                // caller's.
                unsafe { f32_tile!($against, c, &rows_of(m), k, w, out, &pair) };
                m += c;
            }
        }
    }};
}

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
#[cfg(target_arch = "x86_64")]
mod avx512_f32;
#[cfg(target_arch = "aarch64")]
mod neon;
mod scalar;

use half::{bf16, f16};

use crate::attn::{DType, Element};
use crate::error::{ensure, Result};
pub use crate::gemv::{Gemv, Path};

/// Output columns per block: one f32 vector of sums.
pub const COLS: usize = 16;
/// Rows up to which the weight is widened in registers rather than into scratch.
const FUSED_ROWS: usize = 4;
/// Rows per pass over a widened block: one accumulator each, enough of them to hide the latency
/// of `vdpbf16ps`, with registers left for the weight and the broadcasts.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
const TILE: usize = 12;
/// Blocks a tile passes over together (past `FUSED_ROWS` rows): each row's broadcast pair of
/// `x` then feeds two blocks' `vdpbf16ps`, half a load per product rather than one.
const SPAN: usize = 2;

/// How a packed weight holds its values (module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    Int8,
    /// A scale and a zero per `group` inputs (even) and column.
    Int4 {
        group: usize,
    },
    /// int8 values with a scale and a zero per `group` inputs (even) and column.
    GroupedInt8 {
        group: usize,
    },
}

impl Format {
    /// Bytes of a block's pair.
    pub fn pair_bytes(self) -> usize {
        match self {
            Format::Int8 | Format::GroupedInt8 { .. } => 2 * COLS,
            Format::Int4 { .. } => COLS,
        }
    }

    /// Inputs per group of scales and zeros (none: a scale per column).
    pub fn group(self) -> Option<usize> {
        match self {
            Format::Int8 => None,
            Format::Int4 { group } | Format::GroupedInt8 { group } => Some(group),
        }
    }
}

/// A linear packed for this kernel (module docs), of a model in `E`. `groups`: the grouped
/// formats' scales and zeros, `[blocks][k / group][2][COLS]` (empty for int8); `scales` (int8's
/// per column; ones for the grouped formats) and `bias` are f32 and padded to whole blocks (the
/// padding's values are never stored).
#[derive(Debug, Clone, Copy)]
pub struct QuantWeight<'a, E = bf16> {
    pub format: Format,
    pub packed: &'a [u8],
    pub groups: &'a [E],
    pub n: usize,
    pub k: usize,
    pub scales: &'a [f32],
    pub bias: &'a [f32],
}

impl<E> QuantWeight<'_, E> {
    pub fn blocks(&self) -> usize {
        self.n.div_ceil(COLS)
    }

    /// Input pairs per block (`k` rounded up to even, halved).
    pub fn pairs(&self) -> usize {
        self.k.div_ceil(2)
    }

    /// Values of `groups` per block.
    fn group_len(&self) -> usize {
        self.format.group().map_or(0, |group| self.k / group * 2 * COLS)
    }

    pub fn check(&self) -> Result<()> {
        let (n, k) = (self.n, self.k);
        ensure!(n > 0 && k > 0, Shape, "a linear's weight must not be empty, got [{n}, {k}]");
        if let Some(group) = self.format.group() {
            ensure!(
                group > 0 && group.is_multiple_of(2) && k.is_multiple_of(group),
                Shape,
                "groups must be even and divide the input width {k}, got {group}"
            );
        }
        let padded = self.blocks() * COLS;
        let bytes = self.blocks() * self.pairs() * self.format.pair_bytes();
        ensure!(
            self.packed.len() == bytes,
            Shape,
            "packed weight holds {} bytes, not the {bytes} of a [{n}, {k}] weight",
            self.packed.len()
        );
        let group_len = self.blocks() * self.group_len();
        ensure!(self.groups.len() == group_len, Shape, "groups hold {} values, not {group_len}", self.groups.len());
        ensure!(self.scales.len() == padded, Shape, "scales hold {} values, not {padded}", self.scales.len());
        ensure!(self.bias.len() == padded, Shape, "bias holds {} values, not {padded}", self.bias.len());
        Ok(())
    }
}

impl Gemv {
    /// `out[m] = x[m] · Wᵀ + bias` for each of the `x.len() / k` rows of `x` (`out`: `[rows, n]`).
    pub fn run_quantized<E: Element>(&self, x: &[E], weight: QuantWeight<'_, E>, out: &mut [E]) -> Result<()> {
        weight.check()?;
        let (n, k) = (weight.n, weight.k);
        ensure!(x.len().is_multiple_of(k) && !x.is_empty(), Shape, "x holds {} values, not rows of {k}", x.len());
        let rows = x.len() / k;
        ensure!(out.len() == rows * n, Shape, "out holds {} values, not {rows} x {n}", out.len());
        let out = Out { addr: out.as_mut_ptr() as usize, n, dtype: E::DTYPE };
        let (path, x) = (self.path(), Values::of(x));
        // What each path reads of `x` besides its rows: AVX-512 spreads bf16 rows over the L1's
        // sets; AVX2, NEON and AVX-512's f16 and f32 models widen them to f32. All take the
        // grouped formats' sums of each group.
        let bf16_dots = path == Path::Avx512Bf16 && E::DTYPE == DType::BF16;
        let spread = if bf16_dots { Rows::spread(x.bf16(), rows, k) } else { None };
        let (group_sums, wide): (Vec<f32>, Vec<f32>) = match (path, weight.format.group()) {
            #[cfg(target_arch = "x86_64")]
            (Path::Avx512Bf16, Some(group)) if bf16_dots => {
                // SAFETY: the path was checked when it was chosen (`Gemv::new`).
                (unsafe { avx512::group_sums(x.bf16(), k, group) }, Vec::new())
            }
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as above (an AVX-512 CPU has AVX2, FMA and F16C).
            (Path::Avx2 | Path::Avx512Bf16, group) => unsafe { avx2::prepare(x, rows, k, group) },
            #[cfg(target_arch = "aarch64")]
            (Path::Neon | Path::NeonBf16, group) => neon::prepare(x, rows, k, group),
            _ => (Vec::new(), Vec::new()),
        };
        let x = match &spread {
            Some(s) => Rows { x: Values::Bf16(s), stride: s.len() / rows, group_sums: &group_sums, wide: &wide },
            None => Rows { x, stride: k, group_sums: &group_sums, wide: &wide },
        };
        let (block_len, group_len) = (weight.pairs() * weight.format.pair_bytes(), weight.group_len());
        let block = |b: usize| Block {
            format: weight.format,
            q: &weight.packed[b * block_len..(b + 1) * block_len],
            groups: Values::of(&weight.groups[b * group_len..(b + 1) * group_len]),
            scales: &weight.scales[b * COLS..(b + 1) * COLS],
            bias: &weight.bias[b * COLS..(b + 1) * COLS],
            first: b * COLS,
            cols: COLS.min(n - b * COLS),
        };
        let (blocks, span) = (weight.blocks(), if rows > FUSED_ROWS { SPAN } else { 1 });
        let task = |scratch: &mut Scratch, t: usize| {
            let (first, end) = (t * span, ((t + 1) * span).min(blocks));
            let ws: [Block<'_>; SPAN] = std::array::from_fn(|i| block((first + i).min(end - 1)));
            path.blocks(x, rows, k, &ws[..end - first], scratch, out);
        };
        self.for_each_init(blocks.div_ceil(span), Scratch::default, task);
        Ok(())
    }
}

/// Values of a linear's dtype (rows of `x`, the grouped formats' scales and zeros), its type
/// parameter dropped: the kernels take it where they read them, not throughout.
#[derive(Clone, Copy)]
enum Values<'a> {
    Bf16(&'a [bf16]),
    F16(&'a [f16]),
    F32(&'a [f32]),
}

impl<'a> Values<'a> {
    fn of<E: Element>(v: &'a [E]) -> Values<'a> {
        let (at, len) = (v.as_ptr(), v.len());
        // SAFETY: `Element` is sealed, and each of its three types names itself by `DTYPE`.
        unsafe {
            match E::DTYPE {
                DType::BF16 => Values::Bf16(std::slice::from_raw_parts(at.cast(), len)),
                DType::F16 => Values::F16(std::slice::from_raw_parts(at.cast(), len)),
                DType::F32 => Values::F32(std::slice::from_raw_parts(at.cast(), len)),
            }
        }
    }

    #[cfg_attr(not(any(target_arch = "x86_64", target_arch = "aarch64")), allow(dead_code))]
    fn len(self) -> usize {
        match self {
            Values::Bf16(v) => v.len(),
            Values::F16(v) => v.len(),
            Values::F32(v) => v.len(),
        }
    }

    /// Value `i` in f32 (the scalar path's).
    fn get(self, i: usize) -> f32 {
        match self {
            Values::Bf16(v) => v[i].to_f32(),
            Values::F16(v) => v[i].to_f32(),
            Values::F32(v) => v[i],
        }
    }

    /// The values as bf16: AVX-512's `vdpbf16ps` kernels', which `run_quantized` gives bf16
    /// models alone.
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    fn bf16(self) -> &'a [bf16] {
        match self {
            Values::Bf16(v) => v,
            _ => unreachable!("AVX-512's bf16 kernels take bf16 models alone (`run_quantized`)"),
        }
    }
}

/// One block of a packed weight: its pairs (and the grouped formats' groups), its columns'
/// scales and bias, and where its columns start in the output (`cols` of them are real).
#[derive(Clone, Copy)]
struct Block<'a> {
    format: Format,
    q: &'a [u8],
    groups: Values<'a>,
    scales: &'a [f32],
    bias: &'a [f32],
    first: usize,
    cols: usize,
}

/// The rows of `x`, `stride` values apart, for the grouped formats each row's sum over each
/// group of inputs (`[rows][k / group]`; empty otherwise), and for the f32 paths the rows in f32
/// (`avx2::prepare`, `neon::prepare`; empty otherwise).
#[derive(Clone, Copy)]
struct Rows<'a> {
    x: Values<'a>,
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    stride: usize,
    #[cfg_attr(not(any(target_arch = "x86_64", target_arch = "aarch64")), allow(dead_code))]
    group_sums: &'a [f32],
    #[cfg_attr(not(any(target_arch = "x86_64", target_arch = "aarch64")), allow(dead_code))]
    wide: &'a [f32],
}

impl Rows<'_> {
    /// Rows whose cache lines fall in many sets of the L1 cache. A tile reads its rows side by
    /// side; rows 4 KiB apart (a 2,048-wide input) would all fall in one set (of 64), and twelve
    /// of them evict each other from its eight ways. Rows a multiple of 32 lines apart (two
    /// sets at most) are copied to a stride of an odd number of lines, which visits every set
    /// before it repeats one; the copy costs more than it saves for rows of 16 lines (four
    /// sets), measured on SmolLM2's 1,536-wide input.
    fn spread(x: &[bf16], rows: usize, k: usize) -> Option<Vec<bf16>> {
        const LINE: usize = 32; // bf16 values a line
        let lines = k.div_ceil(LINE);
        if rows <= FUSED_ROWS || lines.trailing_zeros() < 5 {
            return None;
        }
        let stride = (lines | 1) * LINE;
        let mut spread = vec![bf16::ZERO; rows * stride];
        for (to, from) in spread.chunks_exact_mut(stride).zip(x.chunks_exact(k)) {
            to[..k].copy_from_slice(from);
        }
        Some(spread)
    }
}

/// Rows of an f32 path's tile (`f32_passes!`): the first's widened `x` (rows `width` apart) and
/// group sums, its output row.
#[cfg_attr(not(any(target_arch = "x86_64", target_arch = "aarch64")), allow(dead_code))]
struct F32Tile {
    x: *const f32,
    width: usize,
    group_sums: *const f32,
    m0: usize,
}

/// A thread's room for its blocks widened (AVX-512's bf16 kernels: to bf16; the f32 paths: to
/// f32) and (AVX-512's bf16 grouped formats) their rows' sums.
#[derive(Default)]
struct Scratch {
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    wide: Vec<bf16>,
    #[cfg_attr(not(any(target_arch = "x86_64", target_arch = "aarch64")), allow(dead_code))]
    wide32: Vec<f32>,
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    sums: Vec<f32>,
}

/// The output, `[rows, n]` of `dtype`, written by blocks: each block alone writes its columns.
#[derive(Clone, Copy)]
struct Out {
    addr: usize,
    n: usize,
    dtype: DType,
}

impl Out {
    /// Row `m`'s values for `block`'s columns, from their f32 sums.
    ///
    /// # Safety
    /// `m` is a row of the output, and no other thread writes `block`'s columns.
    unsafe fn put(&self, m: usize, block: &Block<'_>, sums: &[f32; COLS]) {
        // SAFETY: the caller's.
        unsafe {
            match self.dtype {
                DType::BF16 => self.put_as::<bf16>(m, block, sums),
                DType::F16 => self.put_as::<f16>(m, block, sums),
                DType::F32 => self.put_as::<f32>(m, block, sums),
            }
        }
    }

    /// `put` of an output in `E` (`dtype`'s type).
    ///
    /// # Safety
    /// As `put`'s.
    unsafe fn put_as<E: Element>(&self, m: usize, block: &Block<'_>, sums: &[f32; COLS]) {
        let columns = sums.iter().zip(block.scales).zip(block.bias).take(block.cols);
        for (c, ((sum, scale), bias)) in columns.enumerate() {
            let value = E::from_f32(sum * scale + bias);
            // SAFETY: the caller's; column `first + c` < n.
            unsafe { *(self.addr as *mut E).add(m * self.n + block.first + c) = value };
        }
    }
}

impl Path {
    #[cfg_attr(not(any(target_arch = "x86_64", target_arch = "aarch64")), allow(unused_variables))] // `scratch`: SIMD's
    fn blocks(self, x: Rows<'_>, rows: usize, k: usize, ws: &[Block<'_>], scratch: &mut Scratch, out: Out) {
        match self {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `Path::is_supported` was checked when the path was chosen (`Gemv::new`);
            // `run` checked the shapes, and each block's columns are written by this call alone.
            Path::Avx512Bf16 if matches!(x.x, Values::Bf16(_)) => unsafe {
                avx512::blocks(x, rows, k, ws, scratch, out)
            },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as above (`run_quantized` widened the rows of an f16 or f32 model).
            Path::Avx512Bf16 => unsafe { avx512_f32::blocks(x, rows, k, ws, scratch, out) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as above.
            Path::Avx2 => unsafe { avx2::blocks(x, rows, k, ws, scratch, out) },
            #[cfg(target_arch = "aarch64")]
            // SAFETY: as above.
            Path::Neon | Path::NeonBf16 => unsafe { neon::blocks(x, rows, k, ws, scratch, out) },
            // SAFETY: as above.
            _ => ws.iter().for_each(|w| unsafe { scalar::block(x.x, rows, k, w, out) }),
        }
    }
}

#[cfg(test)]
mod tests;
