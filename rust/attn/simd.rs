//! The small per-ISA primitive set the attention kernel is written once against (candle / ggml
//! style): f32 vectors, FMA, reductions, a vector `exp`, half-precision widening and an L2 prefetch.
//! Each tier implements it under `x86/` or `aarch64/`; `Portable` is the scalar reference tier.

/// Lane-parallel f32 operations of one instruction set.
///
/// # Safety
/// Every method is `unsafe`: the caller guarantees that the CPU supports the tier (dispatch checks
/// this once) and that each pointer is valid for `LANES` elements.
pub trait Simd {
    /// f32 lanes per vector; every padded head dimension is a multiple of this.
    const LANES: usize;
    type V: Copy;
    /// What `dot_i8` adds to every K byte: 128 where its instruction takes unsigned bytes
    /// (VNNI's `vpdpbusd`), 0 where it takes signed ones (`sdot`). The caller subtracts
    /// `I8_K_OFFSET * Σ q8`.
    const I8_K_OFFSET: f32 = 0.0;
    /// Whether p·v runs on pair dot products (`pv_i8`, `pv_bf16`) when the tier's dot products
    /// are in use; otherwise p·v widens V, and only q·k takes the dot products.
    const PAIR_DOTS: bool = false;
    /// Whether 4-head int8 tiles take `dot_i8_heads` (the tier implements it) rather than
    /// `dot_i8::<4, 4>`; q8 is then also kept interleaved for it (`Scratch::q8x`).
    const I8_DOT_BY_HEADS: bool = false;

    unsafe fn zero() -> Self::V;
    unsafe fn splat(x: f32) -> Self::V;
    unsafe fn load(p: *const f32) -> Self::V;
    unsafe fn store(p: *mut f32, v: Self::V);
    /// `a * b + c`
    unsafe fn fma(a: Self::V, b: Self::V, c: Self::V) -> Self::V;
    unsafe fn mul(a: Self::V, b: Self::V) -> Self::V;
    unsafe fn add(a: Self::V, b: Self::V) -> Self::V;
    unsafe fn sub(a: Self::V, b: Self::V) -> Self::V;
    unsafe fn max(a: Self::V, b: Self::V) -> Self::V;
    unsafe fn reduce_max(v: Self::V) -> f32;
    unsafe fn reduce_add(v: Self::V) -> f32;
    /// Lane i of the result is the sum of the lanes of `v[i]`; `v.len() == LANES` (a transposed
    /// reduction: far fewer shuffles than LANES separate horizontal sums).
    unsafe fn transpose_sum(v: &[Self::V]) -> Self::V;
    /// `e^x` to a few ulp; inputs below about -87 give (near) zero, never NaN for finite or -inf input.
    unsafe fn exp(v: Self::V) -> Self::V;
    /// `LANES` bf16 values (raw bits) widened to f32.
    unsafe fn widen_bf16(p: *const u16) -> Self::V;
    /// `LANES` IEEE f16 values (raw bits) widened to f32.
    unsafe fn widen_f16(p: *const u16) -> Self::V;
    /// `LANES` signed bytes widened to f32 (int8 KV; the per-row scale is applied by the caller).
    unsafe fn widen_i8(p: *const i8) -> Self::V;
    /// Int8 dot products (VNNI and DotProd tiers only; the kernel calls this only when dispatched
    /// with them): lane `g * TT + i` of the result is `Σ_d q8[g * dq + d] * (rows[i][d] +
    /// I8_K_OFFSET)` over `d` dims, as f32 (exact: |sum| < 2^24 for d <= 256). `q8` rows hold `dq`
    /// bytes (a multiple of 64, zero past `d`); each row of K holds `d` readable bytes; `ahead`
    /// rows are prefetched.
    unsafe fn dot_i8<const GT: usize, const TT: usize>(
        _q8: *const i8,
        _dq: usize,
        _rows: &[*const i8; TT],
        _ahead: &[*const i8; TT],
        _d: usize,
    ) -> Self::V {
        unreachable!("this tier has no int8 dot product")
    }
    /// `dot_i8` for 4 heads x 4 rows, which tiers with `I8_DOT_BY_HEADS` take instead
    /// of `dot_i8::<4, 4>`, reading q from `qx`: the 4 heads' q8 rows interleaved by 16-byte
    /// chunks (dims 16c.. of head g at byte 64c + 16g, zero past `d`), so that one instruction
    /// takes 16 dims of a row against all 4 heads and each row's sums fold within their lane
    /// (far fewer shuffles than `dot_i8`'s transposed reduction). `rows` and `ahead` hold 4
    /// pointers.
    unsafe fn dot_i8_heads(_qx: *const i8, _rows: &[*const i8], _ahead: &[*const i8], _d: usize) -> Self::V {
        unreachable!("this tier has no int8 dot product by heads")
    }
    /// bf16 dot products (AVX512_BF16 tiers only), as `dot_i8` for bf16 q and K rows: lane
    /// `g * TT + i` is `Σ_d q[g * dq + d] * rows[i][d]` in f32; `q` rows hold `dq` bf16 (a
    /// multiple of 32, zero past `d`).
    unsafe fn dot_bf16<const GT: usize, const TT: usize>(
        _q: *const u16,
        _dq: usize,
        _rows: &[*const u16; TT],
        _ahead: &[*const u16; TT],
        _d: usize,
    ) -> Self::V {
        unreachable!("this tier has no bf16 dot product")
    }
    /// `LANES` f32 rounded to bf16 (to nearest even) at `p` (bf16 dot-product tiers only).
    unsafe fn narrow_bf16(_v: Self::V, _p: *mut u16) {
        unreachable!("this tier has no bf16 dot product")
    }
    /// `LANES` f32 rounded to the nearest integer, which must fit int16, at `p` (int16
    /// dot-product tiers only).
    unsafe fn narrow_i16(_v: Self::V, _p: *mut i16) {
        unreachable!("this tier has no int16 dot product")
    }
    /// Int8 V rows by int16 pair dot products (VNNI tiers only): `acc[g * dp + x] += scale[g] *
    /// Σ_j (lo(pairs[g * ps + j]) * v[2j][x] + hi(…) * v[2j + 1][x])` for `x < d`, over the
    /// `ceil(n / 2)` pairs of the `n` rows at `v + rows[..]` (row `n` stands in as row `n - 1`
    /// with a zero weight); the rows at `v + ahead[..]` are prefetched. Each row holds `d`
    /// readable bytes; `acc` rows hold `dp >= d` f32, a multiple of 16.
    #[allow(clippy::too_many_arguments)]
    unsafe fn pv_i8<const GT: usize>(
        _pairs: *const u32,
        _ps: usize,
        _scale: &[f32],
        _v: *const i8,
        _rows: &[usize],
        _ahead: &[usize],
        _d: usize,
        _acc: *mut f32,
        _dp: usize,
    ) {
        unreachable!("this tier has no int16 dot product")
    }
    /// bf16 V rows by bf16 pair dot products (AVX512_BF16 tiers only): as `pv_i8` with bf16
    /// pairs and no scale.
    #[allow(clippy::too_many_arguments)]
    unsafe fn pv_bf16<const GT: usize>(
        _pairs: *const u32,
        _ps: usize,
        _v: *const u16,
        _rows: &[usize],
        _ahead: &[usize],
        _d: usize,
        _acc: *mut f32,
        _dp: usize,
    ) {
        unreachable!("this tier has no bf16 dot product")
    }
    /// Hint that the cache line at `p` is needed soon, into L2 (see CPU-ATTN-ANCHOR.md: `prefetcht1`
    /// ahead of the 16-token paged tiles is what lets a core keep enough misses in flight).
    unsafe fn prefetch_l2(p: *const u8);
}

/// Scalar reference tier: plain Rust over `[f32; 8]`, compiled for any target.
#[derive(Clone, Copy)]
pub(crate) struct Portable;

const PL: usize = 8;

impl Simd for Portable {
    const LANES: usize = PL;
    type V = [f32; PL];

    #[inline(always)]
    unsafe fn zero() -> Self::V {
        [0.0; PL]
    }
    #[inline(always)]
    unsafe fn splat(x: f32) -> Self::V {
        [x; PL]
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> Self::V {
        // SAFETY: the caller guarantees `p` is valid for LANES f32 reads.
        unsafe { p.cast::<[f32; PL]>().read_unaligned() }
    }
    #[inline(always)]
    unsafe fn store(p: *mut f32, v: Self::V) {
        // SAFETY: the caller guarantees `p` is valid for LANES f32 writes.
        unsafe { p.cast::<[f32; PL]>().write_unaligned(v) }
    }
    #[inline(always)]
    unsafe fn fma(a: Self::V, b: Self::V, c: Self::V) -> Self::V {
        // Not `mul_add`: without hardware FMA in the baseline target that is a slow libm call.
        std::array::from_fn(|i| a[i] * b[i] + c[i])
    }
    #[inline(always)]
    unsafe fn mul(a: Self::V, b: Self::V) -> Self::V {
        std::array::from_fn(|i| a[i] * b[i])
    }
    #[inline(always)]
    unsafe fn add(a: Self::V, b: Self::V) -> Self::V {
        std::array::from_fn(|i| a[i] + b[i])
    }
    #[inline(always)]
    unsafe fn sub(a: Self::V, b: Self::V) -> Self::V {
        std::array::from_fn(|i| a[i] - b[i])
    }
    #[inline(always)]
    unsafe fn max(a: Self::V, b: Self::V) -> Self::V {
        std::array::from_fn(|i| a[i].max(b[i]))
    }
    #[inline(always)]
    unsafe fn transpose_sum(v: &[Self::V]) -> Self::V {
        std::array::from_fn(|i| v[i].iter().sum())
    }
    #[inline(always)]
    unsafe fn reduce_max(v: Self::V) -> f32 {
        v.into_iter().fold(f32::NEG_INFINITY, f32::max)
    }
    #[inline(always)]
    unsafe fn reduce_add(v: Self::V) -> f32 {
        v.iter().sum()
    }
    #[inline(always)]
    unsafe fn exp(v: Self::V) -> Self::V {
        v.map(f32::exp)
    }
    #[inline(always)]
    unsafe fn widen_bf16(p: *const u16) -> Self::V {
        // SAFETY: the caller guarantees `p` is valid for LANES u16 reads.
        let raw = unsafe { p.cast::<[u16; PL]>().read_unaligned() };
        raw.map(|b| half::bf16::from_bits(b).to_f32())
    }
    #[inline(always)]
    unsafe fn widen_f16(p: *const u16) -> Self::V {
        // SAFETY: the caller guarantees `p` is valid for LANES u16 reads.
        let raw = unsafe { p.cast::<[u16; PL]>().read_unaligned() };
        raw.map(|b| half::f16::from_bits(b).to_f32())
    }
    #[inline(always)]
    unsafe fn widen_i8(p: *const i8) -> Self::V {
        // SAFETY: the caller guarantees `p` is valid for LANES i8 reads.
        let raw = unsafe { p.cast::<[i8; PL]>().read_unaligned() };
        raw.map(f32::from)
    }
    #[inline(always)]
    unsafe fn prefetch_l2(_p: *const u8) {}
}

/// Cody–Waite range reduction constants shared by the vector `exp` of every SIMD tier:
/// `e^x = 2^n · e^r`, `n = round(x·log2 e)`, `r = x − n·ln2` (split in two for accuracy), and a
/// degree-6 polynomial for `e^r` on |r| ≤ ln2/2 (max rel. error ~2 ulp).
#[allow(dead_code)] // unused on targets with no SIMD tier
pub(crate) mod exp_consts {
    pub const LO: f32 = -87.336_54;
    pub const HI: f32 = 88.722_83;
    pub const LOG2E: f32 = std::f32::consts::LOG2_E;
    pub const LN2_HI: f32 = 0.693_359_4;
    pub const LN2_LO: f32 = -2.121_944_4e-4;
    /// Cephes `expf` coefficients of r^7 … r^2, in Horner order: `e^r ≈ poly(r)·r² + r + 1`.
    pub const POLY: [f32; 6] = [1.987_569_1e-4, 1.398_199_9e-3, 8.333_452e-3, 4.166_579_6e-2, 1.666_666_5e-1, 0.5];
}
