//! The only place that knows PyO3: the `neo_rs._core` extension module. Thin wrappers:
//! extract -> call the core with the GIL released -> convert. Errors map one-to-one from
//! `NeoError` onto the Python hierarchy under `NeoRsError` that `neo_rs.errors` defines (in
//! Python, because each class also derives from the builtin it refines, e.g. `ValueError`).

mod attn;
mod gemv;
mod qlinear;
mod quant;
mod sample;
mod sched;
mod tensor;

use pyo3::import_exception;
use pyo3::prelude::*;

use crate::error::NeoError;

import_exception!(neo_rs.errors, ShapeError);
import_exception!(neo_rs.errors, DTypeError);
import_exception!(neo_rs.errors, InvalidArgumentError);
import_exception!(neo_rs.errors, BackendError);

impl From<NeoError> for PyErr {
    fn from(e: NeoError) -> PyErr {
        match e {
            NeoError::Shape(m) => ShapeError::new_err(m),
            NeoError::DType(m) => DTypeError::new_err(m),
            NeoError::Value(m) => InvalidArgumentError::new_err(m),
            NeoError::Runtime(m) => BackendError::new_err(m),
        }
    }
}

/// SIMD tiers this CPU supports, slowest first.
#[pyfunction]
fn simd_tiers() -> Vec<&'static str> {
    crate::attn::Tier::supported().into_iter().map(|t| t.name()).collect()
}

/// The most KV blocks of a pool a request of `num_tokens` cached tokens holds at once (the
/// scheduler refuses one that needs more than a pool has).
#[pyfunction]
#[pyo3(signature = (num_tokens, *, block_size, max_num_batched_tokens, kv_group_windows = None))]
fn peak_kv_blocks(
    num_tokens: usize,
    block_size: usize,
    max_num_batched_tokens: usize,
    kv_group_windows: Option<Vec<Option<usize>>>,
) -> PyResult<usize> {
    let windows = kv_group_windows.unwrap_or_else(|| vec![None]);
    crate::error::ensure!(
        block_size >= 1 && !windows.is_empty() && !windows.contains(&Some(0)),
        Value,
        "block_size and every sliding window must be positive, with at least one KV group"
    );
    Ok(crate::sched::peak_blocks(num_tokens, block_size, max_num_batched_tokens, &windows))
}

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("MAX_SPECULATIVE_TOKENS", crate::sched::MAX_SPECULATIVE_TOKENS)?;
    m.add_function(wrap_pyfunction!(simd_tiers, m)?)?;
    m.add_function(wrap_pyfunction!(peak_kv_blocks, m)?)?;
    m.add_function(wrap_pyfunction!(quant::quantize_rows, m)?)?;
    m.add_function(wrap_pyfunction!(quant::dequantize_rows, m)?)?;
    m.add_class::<gemv::Bf16Linear>()?;
    m.add_class::<qlinear::QuantGemm>()?;
    m.add_class::<sample::Categorical>()?;
    m.add_class::<attn::CpuAttention>()?;
    m.add_class::<attn::AttentionHandle>()?;
    m.add_class::<sched::Scheduler>()?;
    m.add_class::<sched::SchedulerOutput>()?;
    Ok(())
}
