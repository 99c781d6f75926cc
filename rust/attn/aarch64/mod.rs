//! aarch64 tier: NEON (always present on aarch64; f16 widening goes through `half`, since Rust's
//! f16 NEON intrinsics are not stable).

pub(crate) mod neon;
