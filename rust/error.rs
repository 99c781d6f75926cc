//! The crate's one error enum. Running out of blocks is a normal outcome elsewhere, never an error;
//! these are caller mistakes (bad shapes, ids, lengths) and environment failures.

use thiserror::Error;

#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum NeoError {
    /// A tensor's shape or size does not match what the call needs.
    #[error("shape error: {0}")]
    Shape(String),
    /// A tensor has the wrong dtype, or dtypes that must agree do not.
    #[error("dtype error: {0}")]
    DType(String),
    /// A value (sequence length, block id, layer index, parameter) is out of range.
    #[error("value error: {0}")]
    Value(String),
    /// The runtime cannot do what was asked (e.g. a forced SIMD tier the CPU lacks, thread pool failure).
    #[error("runtime error: {0}")]
    Runtime(String),
}

pub type Result<T> = std::result::Result<T, NeoError>;

/// `return Err(NeoError::$kind(format!(...)))` unless `cond` holds.
macro_rules! ensure {
    ($cond:expr, $kind:ident, $($fmt:tt)+) => {
        if !$cond {
            return Err($crate::error::NeoError::$kind(format!($($fmt)+)).into());
        }
    };
}
pub(crate) use ensure;
