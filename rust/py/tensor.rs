//! Reading torch tensors without linking torch: pointer, shape, dtype, device and contiguity
//! through their Python attributes. Rust then checks these against what each call needs.

use pyo3::intern;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::PyType;

use crate::attn::DType;
use crate::error::{ensure, NeoError, Result};

/// Element type of a tensor argument.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    Float(DType),
    Int32,
    /// int8 KV pools (their scales are float32 tensors beside them), int8 weights.
    Int8,
    /// Packed int4 weights.
    UInt8,
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

    /// A tensor that may be a strided view; the caller checks its layout. Every call of every
    /// kernel reads its tensors here, so each attribute is one interned lookup and the dtype is
    /// matched by identity (a per-token cost: 30 layers' attention and 120 linears a token).
    pub fn extract_view(obj: &Bound<'_, PyAny>, name: &'static str) -> PyResult<TensorRef> {
        let py = obj.py();
        let torch = torch(py)?;
        if !obj.is_instance(torch.tensor.bind(py))? {
            let type_name = obj.get_type().name()?;
            return Err(pyo3::exceptions::PyTypeError::new_err(format!(
                "{name} must be a torch.Tensor, got {type_name}"
            )));
        }
        let dtype = obj.getattr(intern!(py, "dtype"))?;
        let kind = torch.kinds.iter().find(|(d, _)| d.bind(py).is(&dtype)).map(|&(_, k)| k);
        let kind = kind.ok_or_else(|| NeoError::DType(format!("{name} has unsupported dtype {dtype}")))?;
        if !obj.getattr(intern!(py, "is_cpu"))?.extract::<bool>()? {
            let device: String = obj.getattr(intern!(py, "device"))?.getattr(intern!(py, "type"))?.extract()?;
            return Err(NeoError::Value(format!("{name} must be a CPU tensor, got device {device}")).into());
        }
        let addr = obj.call_method0(intern!(py, "data_ptr"))?.extract()?;
        let contiguous: bool = obj.call_method0(intern!(py, "is_contiguous"))?.extract()?;
        Ok(TensorRef {
            name,
            addr,
            shape: obj.getattr(intern!(py, "shape"))?.extract()?,
            contiguous,
            strides: if contiguous { Vec::new() } else { obj.call_method0(intern!(py, "stride"))?.extract()? },
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
            Kind::Int8 | Kind::UInt8 => 1,
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

/// torch's tensor type and the dtype objects of the element types we read, looked up once: every
/// argument is then checked by type and dtype identity.
struct Torch {
    tensor: Py<PyType>,
    kinds: Vec<(Py<PyAny>, Kind)>,
}

fn torch(py: Python<'_>) -> PyResult<&'static Torch> {
    static TORCH: PyOnceLock<Torch> = PyOnceLock::new();
    TORCH.get_or_try_init(py, || {
        let torch = py.import("torch")?;
        let table = [
            ("float32", Kind::Float(DType::F32)),
            ("float16", Kind::Float(DType::F16)),
            ("bfloat16", Kind::Float(DType::BF16)),
            ("int32", Kind::Int32),
            ("int8", Kind::Int8),
            ("uint8", Kind::UInt8),
        ];
        Ok(Torch {
            tensor: torch.getattr("Tensor")?.cast_into::<PyType>()?.unbind(),
            kinds: table.into_iter().map(|(n, k)| Ok((torch.getattr(n)?.unbind(), k))).collect::<PyResult<_>>()?,
        })
    })
}

/// Whether two byte ranges share any byte.
pub(crate) fn overlaps(a: &std::ops::Range<usize>, b: &std::ops::Range<usize>) -> bool {
    a.start < b.end && b.start < a.end && !a.is_empty() && !b.is_empty()
}
