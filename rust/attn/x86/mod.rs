//! x86-64 tiers: AVX2 (+FMA, F16C) and AVX-512 (F, BW, VL; BF16 dot products where present).
//! The only place besides `aarch64/` that uses `std::arch`.

pub(crate) mod avx2;
pub(crate) mod avx512;
pub(crate) mod avx512_bf16;
