//! The only place that knows PyO3: the `neo_rs._core` extension module. Thin wrappers:
//! extract -> call the core with the GIL released -> convert. Errors map one-to-one from
//! `NeoError` onto a Python hierarchy under `NeoRsError`.

mod attn;
mod sched;
mod tensor;

use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::prelude::*;

use crate::error::NeoError;

create_exception!(_core, NeoRsError, PyException, "Root of every neo_rs error.");
create_exception!(_core, ShapeError, NeoRsError, "A tensor's shape or size does not fit the call.");
create_exception!(_core, DTypeError, NeoRsError, "A tensor has the wrong dtype, or dtypes disagree.");
create_exception!(_core, InvalidArgumentError, NeoRsError, "A value is out of range or not allowed.");
create_exception!(_core, BackendError, NeoRsError, "The runtime cannot do what was asked.");

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

/// Asks for 2 MiB pages under a CPU tensor not yet written (a KV pool); returns the bytes advised.
#[pyfunction]
fn advise_huge_pages(tensor: &Bound<'_, PyAny>) -> PyResult<usize> {
    let t = tensor::TensorRef::extract(tensor, "tensor")?;
    let bytes = t.bytes();
    Ok(crate::hugepages::advise_huge_pages(bytes.start, bytes.len()))
}

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("NeoRsError", py.get_type::<NeoRsError>())?;
    m.add("ShapeError", py.get_type::<ShapeError>())?;
    m.add("DTypeError", py.get_type::<DTypeError>())?;
    m.add("InvalidArgumentError", py.get_type::<InvalidArgumentError>())?;
    m.add("BackendError", py.get_type::<BackendError>())?;
    m.add_function(wrap_pyfunction!(simd_tiers, m)?)?;
    m.add_function(wrap_pyfunction!(advise_huge_pages, m)?)?;
    m.add_class::<attn::CpuAttention>()?;
    m.add_class::<attn::AttentionHandle>()?;
    m.add_class::<sched::Scheduler>()?;
    m.add_class::<sched::SchedulerOutput>()?;
    Ok(())
}
