//! Reading torch tensors without linking torch: pointer, shape, dtype, device and contiguity
//! through their Python attributes. Rust then checks these against what each call needs.

use pyo3::prelude::*;

use crate::attn::DType;
use crate::error::{ensure, NeoError, Result};

/// Element type of a tensor argument.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    Float(DType),
    Int32,
    /// int8 KV pools (their scales are float32 tensors beside them).
    Int8,
}

/// A CPU tensor seen as (address, shape, element type); contiguous unless taken by
/// `extract_view`.
#[derive(Debug, Clone)]
pub(crate) struct TensorRef {
    pub name: &'static str,
    pub addr: usize,
    pub shape: Vec<usize>,
    pub contiguous: bool,
    /// Element strides of a tensor that is not contiguous (empty otherwise: one Python call
    /// fewer per tensor of every call).
    pub strides: Vec<usize>,
    pub kind: Kind,
}

impl TensorRef {
    pub fn extract(obj: &Bound<'_, PyAny>, name: &'static str) -> PyResult<TensorRef> {
        let t = TensorRef::extract_view(obj, name)?;
        ensure!(t.contiguous, Value, "{name} must be contiguous");
        Ok(t)
    }

    /// A tensor that may be a strided view; the caller checks its layout.
    pub fn extract_view(obj: &Bound<'_, PyAny>, name: &'static str) -> PyResult<TensorRef> {
        let is_tensor = obj.hasattr("data_ptr")? && obj.hasattr("dtype")? && obj.hasattr("shape")?;
        if !is_tensor {
            return Err(pyo3::exceptions::PyTypeError::new_err(format!(
                "{name} must be a torch.Tensor, got {}",
                obj.get_type().name()?
            )));
        }
        let device: String = obj.getattr("device")?.getattr("type")?.extract()?;
        let dtype: String = obj.getattr("dtype")?.str()?.extract()?;
        let kind = match dtype.as_str() {
            "torch.int32" => Kind::Int32,
            "torch.int8" => Kind::Int8,
            s => Kind::Float(
                DType::parse(s).ok_or_else(|| NeoError::DType(format!("{name} has unsupported dtype {s}")))?,
            ),
        };
        ensure!(device == "cpu", Value, "{name} must be a CPU tensor, got device {device}");
        let contiguous: bool = obj.call_method0("is_contiguous")?.extract()?;
        Ok(TensorRef {
            name,
            addr: obj.call_method0("data_ptr")?.extract()?,
            shape: obj.getattr("shape")?.extract()?,
            contiguous,
            strides: if contiguous { Vec::new() } else { obj.call_method0("stride")?.extract()? },
            kind,
        })
    }

    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    pub fn elem_size(&self) -> usize {
        match self.kind {
            Kind::Float(d) => d.size_bytes(),
            Kind::Int32 => 4,
            Kind::Int8 => 1,
        }
    }

    /// Requires `ndim` dimensions.
    pub fn dims(&self, ndim: usize) -> Result<&[usize]> {
        ensure!(
            self.shape.len() == ndim,
            Shape,
            "{} must have {ndim} dimensions, got shape {:?}",
            self.name,
            self.shape
        );
        Ok(&self.shape)
    }

    pub fn require_int32(&self) -> Result<()> {
        ensure!(self.kind == Kind::Int32, DType, "{} must be int32, got {:?}", self.name, self.kind);
        Ok(())
    }

    pub fn float(&self) -> Result<DType> {
        match self.kind {
            Kind::Float(d) => Ok(d),
            k => Err(NeoError::DType(format!("{} must be a float tensor, got {k:?}", self.name))),
        }
    }

    /// Byte range `[addr + offset, addr + offset + bytes)` for overlap checks.
    pub fn bytes(&self) -> std::ops::Range<usize> {
        self.addr..self.addr + self.numel() * self.elem_size()
    }
}

/// Whether two byte ranges share any byte.
pub(crate) fn overlaps(a: &std::ops::Range<usize>, b: &std::ops::Range<usize>) -> bool {
    a.start < b.end && b.start < a.end && !a.is_empty() && !b.is_empty()
}
