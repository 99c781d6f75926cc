//! neo_rs core: the NEO scheduler's memory accounting and the CPU side of its asymmetric
//! pipeline. Python (`python/neo_rs`) owns tensors and the model; Rust owns decisions, host-side
//! accounting and CPU attention. PyO3 bindings live in `py/`, behind the `python` feature.

pub mod attn;
pub mod config;
pub mod error;
pub mod gemv;
pub mod kv;
pub mod qlinear;
pub mod sample;
pub mod sched;
pub mod team;

#[cfg(feature = "python")]
mod py;

pub use error::{NeoError, Result};
