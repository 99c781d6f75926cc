//! `Bf16Linear` for Python: one bf16 linear's weight (and bias) checked once and held, so each
//! `forward` checks only its `x` and `out` (`crate::gemv`).

use half::bf16;
use pyo3::prelude::*;

use super::tensor::{overlaps, TensorRef};
use crate::attn::DType;
use crate::error::{ensure, Result};
use crate::gemv::{Gemv, Path, Weight};

/// A bf16 linear of a few rows on the CPU: `out = x · weightᵀ + bias`.
#[pyclass(frozen, module = "neo_rs._core")]
pub(crate) struct Bf16Linear {
    gemv: Gemv,
    /// The tensors themselves, held so that the memory the addresses point at outlives this
    /// object (they must not be resized in place).
    _tensors: Vec<Py<PyAny>>,
    weight: TensorRef,
    bias: Option<TensorRef>,
}

/// `t` is a float tensor of `dtype`.
pub(super) fn require(t: &TensorRef, dtype: DType) -> Result<()> {
    ensure!(t.float()? == dtype, DType, "{} must be {}, got {:?}", t.name, dtype.name(), t.kind);
    Ok(())
}

#[pymethods]
impl Bf16Linear {
    /// `weight`: `[n, k]`; `bias`: `[n]`; both contiguous bfloat16 CPU tensors. The work is split
    /// over the calling thread's OpenMP team of `num_threads`; `path` forces a kernel.
    #[new]
    #[pyo3(signature = (weight, bias=None, *, num_threads, path=None))]
    fn new(
        weight: &Bound<'_, PyAny>,
        bias: Option<&Bound<'_, PyAny>>,
        num_threads: usize,
        path: Option<&str>,
    ) -> PyResult<Self> {
        let w = TensorRef::extract(weight, "weight")?;
        require(&w, DType::BF16)?;
        let n = w.dims(2)?[0];
        let b = bias.map(|b| TensorRef::extract(b, "bias")).transpose()?;
        if let Some(b) = &b {
            require(b, DType::BF16)?;
            ensure!(b.shape == [n], Shape, "bias must have shape [{n}], got {:?}", b.shape);
        }
        let gemv = Gemv::new(path.map(Path::parse).transpose()?, num_threads)?;
        let tensors = std::iter::once(weight).chain(bias).map(|t| t.clone().unbind()).collect();
        Ok(Bf16Linear { gemv, _tensors: tensors, weight: w, bias: b })
    }

    /// The kernel this CPU runs (`scalar`, `avx2`, `avx512_bf16`, `neon` or `neon_bf16`).
    #[getter]
    fn path(&self) -> &'static str {
        self.gemv.path().name()
    }

    /// `out` (`[rows, n]`) = `x` (`[rows, k]`) · weightᵀ + bias. GIL released.
    fn forward(&self, py: Python<'_>, x: &Bound<'_, PyAny>, out: &Bound<'_, PyAny>) -> PyResult<()> {
        let (n, k) = (self.weight.shape[0], self.weight.shape[1]);
        let held = std::iter::once(&self.weight).chain(&self.bias);
        let (x, out, rows) = rows_in_out(x, out, n, k, DType::BF16, held)?;
        let gemv = self.gemv;
        let (w, b) = (self.weight.addr, self.bias.as_ref().map(|b| b.addr));
        py.detach(|| {
            // SAFETY: contiguous bfloat16 CPU tensors of these shapes (checked above and at
            // construction), alive for the call (`x` and `out` are the caller's arguments, the
            // weight and bias held by `self`); `out` overlaps none of the others.
            let (x, w, out) = unsafe {
                (
                    std::slice::from_raw_parts(x.addr as *const bf16, rows * k),
                    std::slice::from_raw_parts(w as *const bf16, n * k),
                    std::slice::from_raw_parts_mut(out.addr as *mut bf16, rows * n),
                )
            };
            // SAFETY: as above, `n` values of the held bias.
            let bias = b.map(|b| unsafe { std::slice::from_raw_parts(b as *const bf16, n) });
            gemv.run(x, Weight { w, n, k, bias }, out)
        })?;
        Ok(())
    }
}

/// `x` (`[rows, k]`) and `out` (`[rows, n]`) of a linear's call: contiguous, of the linear's
/// `dtype`, `out` overlapping neither `x` nor the tensors the linear holds. Returns them and
/// `rows`.
pub(super) fn rows_in_out<'a>(
    x: &Bound<'_, PyAny>,
    out: &Bound<'_, PyAny>,
    n: usize,
    k: usize,
    dtype: DType,
    held: impl Iterator<Item = &'a TensorRef>,
) -> PyResult<(TensorRef, TensorRef, usize)> {
    let (x, out) = (TensorRef::extract(x, "x")?, TensorRef::extract(out, "out")?);
    require(&x, dtype)?;
    require(&out, dtype)?;
    let rows = x.dims(2)?[0];
    ensure!(x.shape[1] == k, Shape, "x must have {k} columns, got shape {:?}", x.shape);
    ensure!(out.shape == [rows, n], Shape, "out must have shape [{rows}, {n}], got {:?}", out.shape);
    let mut held = held;
    let clear = !overlaps(&x.bytes(), &out.bytes()) && held.all(|t| !overlaps(&t.bytes(), &out.bytes()));
    ensure!(clear, Value, "out overlaps an input");
    Ok((x, out, rows))
}
