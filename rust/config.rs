//! Environment variables (`NEO_RS_*`), read in one place.

use crate::error::{NeoError, Result};

/// `NEO_RS_CPU_THREADS`: threads of the CPU attention pool (default: the machine's cores).
pub fn cpu_threads() -> Result<Option<usize>> {
    match std::env::var("NEO_RS_CPU_THREADS") {
        Ok(s) if !s.trim().is_empty() => match s.trim().parse::<usize>() {
            Ok(n) if n >= 1 => Ok(Some(n)),
            _ => Err(NeoError::Value(format!("NEO_RS_CPU_THREADS must be a positive integer, got {s:?}"))),
        },
        _ => Ok(None),
    }
}

/// `NEO_RS_SIMD`: force a kernel tier (`scalar`, `avx2`, `avx512`, `neon`).
pub fn simd_tier() -> Option<String> {
    std::env::var("NEO_RS_SIMD").ok().filter(|s| !s.trim().is_empty())
}

/// `NEO_RS_INT8_DOT=0`: int8 K pools are widened to f32 for q·k even where the CPU has int8 dot
/// products (to compare the two paths).
pub fn int8_dot_allowed() -> bool {
    std::env::var("NEO_RS_INT8_DOT").map_or(true, |v| v.trim() != "0")
}

/// `NEO_RS_BF16_DOT=0`: bf16 pools are widened to f32 even where the CPU has bf16 dot products
/// (to compare the two paths).
pub fn bf16_dot_allowed() -> bool {
    std::env::var("NEO_RS_BF16_DOT").map_or(true, |v| v.trim() != "0")
}
