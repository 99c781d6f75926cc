//! The kernel's core types, apart from the code that runs on them so that every kernel module
//! depends on this one and not on each other: the storage dtypes of q, output and the KV pools
//! (f32, f16, bf16; the pools also int8 with a scale per token and KV head; all arithmetic is
//! f32), the dot-product kinds and the pool rows they read, a call's geometry and a thread's
//! workspaces.

use half::{bf16, f16};

use crate::attn::simd::Simd;

/// A dtype tag that crosses the Python boundary as a string.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DType {
    F32,
    F16,
    BF16,
}

impl DType {
    pub fn size_bytes(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F16 | DType::BF16 => 2,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "float32",
            DType::F16 => "float16",
            DType::BF16 => "bfloat16",
        }
    }

    /// Parses torch/numpy spellings (`float32`, `torch.bfloat16`, `f16`, …).
    pub fn parse(s: &str) -> Option<DType> {
        match s.strip_prefix("torch.").unwrap_or(s) {
            "float32" | "float" | "f32" => Some(DType::F32),
            "float16" | "half" | "f16" => Some(DType::F16),
            "bfloat16" | "bf16" => Some(DType::BF16),
            _ => None,
        }
    }
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for half::f16 {}
    impl Sealed for half::bf16 {}
    impl Sealed for i8 {}
}

/// An element type the kernel reads and writes (q, output, and float KV pools).
pub trait Element: KvElement {
    const DTYPE: DType;
    fn to_f32(self) -> f32;
    fn from_f32(x: f32) -> Self;
    /// Widens `S::LANES` elements at `p`.
    ///
    /// # Safety
    /// `p` must be valid for `S::LANES` reads and the CPU must support `S`.
    #[doc(hidden)]
    unsafe fn widen<S: Simd>(p: *const Self) -> S::V;
}

impl Element for f32 {
    const DTYPE: DType = DType::F32;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        x
    }
    #[inline(always)]
    unsafe fn widen<S: Simd>(p: *const Self) -> S::V {
        // SAFETY: forwarded caller contract.
        unsafe { S::load(p) }
    }
}

impl Element for f16 {
    const DTYPE: DType = DType::F16;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        f16::from_f32(x)
    }
    #[inline(always)]
    unsafe fn widen<S: Simd>(p: *const Self) -> S::V {
        // SAFETY: f16 is a transparent u16; forwarded caller contract.
        unsafe { S::widen_f16(p.cast()) }
    }
}

impl Element for bf16 {
    const DTYPE: DType = DType::BF16;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        bf16::from_f32(x)
    }
    #[inline(always)]
    unsafe fn widen<S: Simd>(p: *const Self) -> S::V {
        // SAFETY: bf16 is a transparent u16; forwarded caller contract.
        unsafe { S::widen_bf16(p.cast()) }
    }
}

/// An element type of the KV pools: the float types as they are, or int8 whose rows (one token of
/// one KV head) carry an f32 scale beside the block (`H x = scale * q`: rows are stored rotated,
/// see `rotation.rs`).
pub trait KvElement: Copy + Send + Sync + 'static + sealed::Sealed {
    /// Whether rows carry a scale (the kernel then applies it per token) and are stored rotated
    /// (`rotation.rs`).
    const SCALED: bool;
    /// The dot products that read this element directly where a tier has them (`dot.rs`).
    #[doc(hidden)]
    const DOT: u8;
    /// One element as f32 (unscaled).
    fn widen_one(self) -> f32;
    /// Widens `S::LANES` elements at `p` (unscaled).
    ///
    /// # Safety
    /// `p` must be valid for `S::LANES` reads and the CPU must support `S`.
    #[doc(hidden)]
    unsafe fn widen<S: Simd>(p: *const Self) -> S::V;
    /// Stores a row of `src` into `dst` (the fused append): converted (float pools, which keep
    /// no scale: returns 1), or by `quantize` (int8 pools: `rotation::quantize_kv_row`, passed in
    /// so that this module needs none of the kernels), which returns the row's scale.
    fn store_row<E: Element>(src: &[E], dst: &mut [Self], quantize: impl FnOnce(&[E], &mut [i8]) -> f32) -> f32;
    /// The pool as int8 bytes, for int8 dot products (`None` for float pools).
    fn as_i8(pool: &[Self]) -> Option<&[i8]> {
        let _ = pool;
        None
    }
    /// The pool as bf16 bits, for bf16 dot products (`None` unless a bf16 pool).
    fn as_bf16(pool: &[Self]) -> Option<&[u16]> {
        let _ = pool;
        None
    }
}

macro_rules! float_kv {
    ($($t:ty),*) => {$(
        impl KvElement for $t {
            const SCALED: bool = false;
            const DOT: u8 = if matches!(<$t as Element>::DTYPE, DType::BF16) { dot_kind::BF16 } else { dot_kind::NONE };
            #[inline(always)]
            fn widen_one(self) -> f32 {
                Element::to_f32(self)
            }
            #[inline(always)]
            unsafe fn widen<S: Simd>(p: *const Self) -> S::V {
                // SAFETY: forwarded caller contract.
                unsafe { <$t as Element>::widen::<S>(p) }
            }
            #[inline(always)]
            fn store_row<E: Element>(src: &[E], dst: &mut [Self], _: impl FnOnce(&[E], &mut [i8]) -> f32) -> f32 {
                for (d, s) in dst.iter_mut().zip(src) {
                    *d = <$t as Element>::from_f32(s.to_f32());
                }
                1.0
            }
            #[inline(always)]
            fn as_bf16(pool: &[Self]) -> Option<&[u16]> {
                if <$t as Element>::DTYPE != DType::BF16 {
                    return None;
                }
                // SAFETY: bf16 is a transparent u16: same size, alignment and length.
                Some(unsafe { std::slice::from_raw_parts(pool.as_ptr().cast::<u16>(), pool.len()) })
            }
        }
    )*};
}
float_kv!(f32, f16, bf16);

impl KvElement for i8 {
    const SCALED: bool = true;
    const DOT: u8 = dot_kind::INT8;
    #[inline(always)]
    fn widen_one(self) -> f32 {
        f32::from(self)
    }
    #[inline(always)]
    unsafe fn widen<S: Simd>(p: *const Self) -> S::V {
        // SAFETY: forwarded caller contract.
        unsafe { S::widen_i8(p) }
    }
    fn store_row<E: Element>(src: &[E], dst: &mut [Self], quantize: impl FnOnce(&[E], &mut [i8]) -> f32) -> f32 {
        quantize(src, dst)
    }
    fn as_i8(pool: &[Self]) -> Option<&[i8]> {
        Some(pool)
    }
}

/// Which dot products an item function is compiled with (its `DOT` const parameter; `dot.rs`).
pub(crate) mod dot_kind {
    pub(crate) const NONE: u8 = 0;
    pub(crate) const INT8: u8 = 1;
    pub(crate) const BF16: u8 = 2;
}

/// One layer of a pool as its dot products read it.
#[derive(Clone, Copy)]
pub(crate) enum Rows<'a> {
    I8(&'a [i8]),
    Bf16(&'a [u16]),
}

impl<'a> Rows<'a> {
    /// The pool of `K` for an item compiled with dot products `DOT`, if they fit its element.
    #[inline(always)]
    pub fn of<K: KvElement, const DOT: u8>(pool: &'a [K]) -> Option<Self> {
        match DOT {
            dot_kind::INT8 => K::as_i8(pool).map(Rows::I8),
            dot_kind::BF16 => K::as_bf16(pool).map(Rows::Bf16),
            _ => None,
        }
    }
}

/// Tiles one step of the block loop reads together, their rows interleaved (position `u` of a
/// step is row `u / g` of its tile `u % g`), so that a core keeps several hardware prefetch
/// streams going over scattered tiles: under the kernel's arithmetic, a read of random 4 KiB
/// tiles four at a time ran about 1.4x one at a time on the VMs we measure on, whatever the
/// software prefetching of the one-at-a-time read.
pub(crate) const STREAMS: usize = 4;

/// Rows of one step at most: p·v's int16 pair sums stay exact up to 128 rows (`dot.rs`).
pub(crate) const MAX_STEP_ROWS: usize = 128;

/// Per-call geometry shared by every item.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Geometry {
    pub head_dim: usize,
    pub block_size: usize,
    pub num_kv_heads: usize,
    /// Query heads per KV head (GQA ratio).
    pub group: usize,
    /// Tiles from one (block, KV head) to the next in a pool slice (`PagedShape::tile_stride`).
    pub tile_stride: usize,
}

impl Geometry {
    /// Tiles per step of the block loop (`STREAMS`, fewer where a step would pass
    /// `MAX_STEP_ROWS`); the tiles of the step after are the ones prefetched.
    pub fn streams(&self) -> usize {
        (MAX_STEP_ROWS / self.block_size).clamp(1, STREAMS)
    }

    /// Query heads the register tiles cover: a group of 3 or 7 is padded with a head of zeros
    /// (never softmaxed, never written out), so it runs as 4-head tiles only. SmolLM2's 3 ran as
    /// a 2-head and a 1-head tile, two passes over each step's K and V rows, the second on the
    /// widening path: 1.15-1.2x the time of one 4-head tile, whose padding lanes cost less than
    /// the extra pass (7: 1.1x; 5 as 4 + 2 instead of 4 + 1 gained nothing).
    pub fn tiled_group(&self) -> usize {
        if self.group % 4 == 3 {
            self.group + 1
        } else {
            self.group
        }
    }

    /// f32 values in one item's partial: `acc[group][head_dim]`, then `max[group]`, `sum[group]`.
    pub fn partial_len(&self) -> usize {
        self.group * (self.head_dim + 2)
    }
}

/// Per-thread f32 workspaces, sized once per call for the padded head dim (a multiple of LANES,
/// zero-filled past `head_dim` so padded lanes contribute nothing) and, but for `max` and `sum`,
/// for the tiled group (`Geometry::tiled_group`), whose padding head's q rows stay zero.
pub(crate) struct Scratch {
    pub(super) padded_dim: usize,
    pub(super) score_stride: usize,
    pub(super) q: Vec<f32>,
    /// With dot products (`dot.rs`), rows of `dot_dim` (zero past head_dim) per head: q
    /// quantized to int8, with each head's scale and `128 * Σ q8` (see `Simd::dot_i8`), or q
    /// rounded to bf16.
    pub(super) dot_dim: usize,
    pub(super) q8: Vec<i8>,
    /// On tiers with `Simd::I8_DOT_BY_HEADS`, q8's whole 4-head tiles interleaved by 16-byte chunks
    /// (`Simd::dot_i8_heads`).
    pub(super) q8x: Vec<i8>,
    pub(super) q8_scale: Vec<f32>,
    pub(super) q8_offset: Vec<f32>,
    pub(super) qb: Vec<u16>,
    /// With dot products, the current step's probabilities as pairs (`score_stride / 2` words
    /// per head) and each head's scale of them.
    pub(super) pairs: Vec<u32>,
    pub(super) pair_scale: Vec<f32>,
    /// With int8 pools: the current step's K and V row scales, zero-padded to the score stride.
    pub(super) k_scale: Vec<f32>,
    pub(super) v_scale: Vec<f32>,
    pub(super) acc: Vec<f32>,
    pub(super) scores: Vec<f32>,
    pub(super) max: Vec<f32>,
    pub(super) sum: Vec<f32>,
}

impl Scratch {
    pub fn new(geo: &Geometry, lanes: usize) -> Self {
        let padded_dim = geo.head_dim.next_multiple_of(lanes);
        // Scores are processed up to 16 f32 at a time, whatever the tier.
        let score_stride = (geo.streams() * geo.block_size).next_multiple_of(16);
        let dot_dim = geo.head_dim.next_multiple_of(64);
        let tiled = geo.tiled_group();
        Scratch {
            padded_dim,
            score_stride,
            q: vec![0.0; tiled * padded_dim],
            dot_dim,
            q8: vec![0; tiled * dot_dim],
            q8x: vec![0; tiled * dot_dim],
            q8_scale: vec![0.0; tiled],
            q8_offset: vec![0.0; tiled],
            qb: vec![0; tiled * dot_dim],
            pairs: vec![0; tiled * score_stride / 2],
            pair_scale: vec![0.0; tiled],
            k_scale: vec![0.0; score_stride],
            v_scale: vec![0.0; score_stride],
            acc: vec![0.0; tiled * padded_dim],
            scores: vec![0.0; tiled * score_stride],
            max: vec![0.0; geo.group],
            sum: vec![0.0; geo.group],
        }
    }
}

/// Symmetric int8 quantization of one row (q for int8 dot products): `dst[i] = round(src[i] /
/// scale)`, half to even, with `scale = max|src| / 127`, returned (0 for an all-zero row, which
/// stores zeros). K/V rows go through `rotation::quantize_kv_row`, which rotates them first.
#[inline(always)]
pub fn quantize_row<E: Element>(src: &[E], dst: &mut [i8]) -> f32 {
    // Sixteen running maxima, so the loop vectorizes (a single fold would be serial).
    let mut lanes = [0f32; 16];
    for chunk in src.chunks(16) {
        for (m, x) in lanes.iter_mut().zip(chunk) {
            *m = m.max(x.to_f32().abs());
        }
    }
    let amax = lanes.iter().fold(0f32, |m, &x| m.max(x));
    let scale = amax / 127.0;
    let inv = if amax > 0.0 { 127.0 / amax } else { 0.0 };
    for (d, x) in dst.iter_mut().zip(src) {
        *d = round_i8(x.to_f32() * inv);
    }
    scale
}

/// `x` rounded half to even and clamped to ±127 (NaN gives 0). Adding 1.5 * 2^23 leaves the
/// integer in the low bits of f32's mantissa, rounded by the FPU's own mode: integer arithmetic
/// on those bits vectorizes on every tier, where `f32::round` is a libm call and a float to i8
/// cast is scalar.
#[inline(always)]
fn round_i8(x: f32) -> i8 {
    const MAGIC: f32 = 12_582_912.0;
    ((x.clamp(-127.0, 127.0) + MAGIC).to_bits() as i32 - MAGIC.to_bits() as i32) as i8
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rounding_is_half_to_even_and_clamped() {
        let cases = [
            (0.5, 0),
            (1.5, 2),
            (-2.5, -2),
            (2.4999, 2),
            (-0.7, -1),
            (127.4, 127),
            (-127.5, -127),
            (1e9, 127),
            (f32::NAN, 0),
        ];
        for (x, want) in cases {
            assert_eq!(round_i8(x), want, "{x}");
        }
    }
}
