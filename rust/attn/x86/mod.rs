//! x86-64 tiers: AVX2 (+FMA, F16C) and AVX-512 (F, BW, VL).
//! The only place besides `aarch64/` that uses `std::arch`.

pub(crate) mod avx2;
pub(crate) mod avx512;
