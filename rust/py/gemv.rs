//! The CPU linears for Python, each weight checked once and held, so each `forward` checks only
//! its `x` and `out`: `Bf16Linear` (`crate::gemv`, a few rows of a bf16 weight) and `Int8Gemm`
//! (`crate::int8`, any rows of an int8 weight).

use half::bf16;
use pyo3::prelude::*;

use super::tensor::{overlaps, Kind, TensorRef};
use crate::attn::DType;
use crate::error::{ensure, Result};
use crate::gemv::{Gemv, Path, Weight};
use crate::int8::{Int8Gemm as Kernel, Int8Weight, COLS};

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

fn require_bf16(t: &TensorRef) -> Result<()> {
    ensure!(t.float()? == DType::BF16, DType, "{} must be bfloat16, got {:?}", t.name, t.kind);
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
        require_bf16(&w)?;
        let n = w.dims(2)?[0];
        let b = bias.map(|b| TensorRef::extract(b, "bias")).transpose()?;
        if let Some(b) = &b {
            require_bf16(b)?;
            ensure!(b.shape == [n], Shape, "bias must have shape [{n}], got {:?}", b.shape);
        }
        let gemv = Gemv::new(path.map(Path::parse).transpose()?, num_threads)?;
        let tensors = std::iter::once(weight).chain(bias).map(|t| t.clone().unbind()).collect();
        Ok(Bf16Linear { gemv, _tensors: tensors, weight: w, bias: b })
    }

    /// The kernel this CPU runs (`scalar` or `avx512_bf16`).
    #[getter]
    fn path(&self) -> &'static str {
        self.gemv.path().name()
    }

    /// `out` (`[rows, n]`) = `x` (`[rows, k]`) · weightᵀ + bias. GIL released.
    fn forward(&self, py: Python<'_>, x: &Bound<'_, PyAny>, out: &Bound<'_, PyAny>) -> PyResult<()> {
        let (n, k) = (self.weight.shape[0], self.weight.shape[1]);
        let held = std::iter::once(&self.weight).chain(&self.bias);
        let (x, out, rows) = rows_in_out(x, out, n, k, held)?;
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

/// `x` (`[rows, k]`) and `out` (`[rows, n]`) of a linear's call: contiguous bfloat16, `out`
/// overlapping neither `x` nor the tensors the linear holds. Returns them and `rows`.
fn rows_in_out<'a>(
    x: &Bound<'_, PyAny>,
    out: &Bound<'_, PyAny>,
    n: usize,
    k: usize,
    held: impl Iterator<Item = &'a TensorRef>,
) -> PyResult<(TensorRef, TensorRef, usize)> {
    let (x, out) = (TensorRef::extract(x, "x")?, TensorRef::extract(out, "out")?);
    require_bf16(&x)?;
    require_bf16(&out)?;
    let rows = x.dims(2)?[0];
    ensure!(x.shape[1] == k, Shape, "x must have {k} columns, got shape {:?}", x.shape);
    ensure!(out.shape == [rows, n], Shape, "out must have shape [{rows}, {n}], got {:?}", out.shape);
    let mut held = held;
    let clear = !overlaps(&x.bytes(), &out.bytes()) && held.all(|t| !overlaps(&t.bytes(), &out.bytes()));
    ensure!(clear, Value, "out overlaps an input");
    Ok((x, out, rows))
}

/// A weight-only int8 linear on the CPU: `out = (x · qᵀ) ⊙ scales + bias`, for any number of rows.
#[pyclass(frozen, module = "neo_rs._core")]
pub(crate) struct Int8Gemm {
    kernel: Kernel,
    _packed: Py<PyAny>,
    packed: TensorRef,
    n: usize,
    k: usize,
    /// f32, padded to whole blocks of `COLS` columns.
    scales: Vec<f32>,
    bias: Vec<f32>,
}

#[pymethods]
impl Int8Gemm {
    /// `packed`: the int8 weight `[n, k]` in the kernel's layout, `[ceil(n / 16), ceil(k / 2), 16,
    /// 2]` (`crate::int8`); `scales`: float32 `[n]`; `bias`: bfloat16 `[n]`. Contiguous CPU
    /// tensors; the packed weight is held, the scales and bias copied. The work is split over
    /// the calling thread's OpenMP team of `num_threads`; `path` forces a kernel.
    #[new]
    #[pyo3(signature = (packed, scales, bias=None, *, n, k, num_threads, path=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        packed: &Bound<'_, PyAny>,
        scales: &Bound<'_, PyAny>,
        bias: Option<&Bound<'_, PyAny>>,
        n: usize,
        k: usize,
        num_threads: usize,
        path: Option<&str>,
    ) -> PyResult<Self> {
        ensure!(n > 0 && k > 0, Shape, "a linear's weight must not be empty, got [{n}, {k}]");
        let q = TensorRef::extract(packed, "packed")?;
        ensure!(q.kind == Kind::Int8, DType, "packed must be int8, got {:?}", q.kind);
        let shape = [n.div_ceil(COLS), k.div_ceil(2), COLS, 2];
        ensure!(q.shape == shape, Shape, "packed must have shape {shape:?} for [{n}, {k}], got {:?}", q.shape);
        let padded = shape[0] * COLS;
        let s = TensorRef::extract(scales, "scales")?;
        ensure!(s.float()? == DType::F32, DType, "scales must be float32, got {:?}", s.kind);
        ensure!(s.shape == [n], Shape, "scales must have shape [{n}], got {:?}", s.shape);
        // SAFETY: a contiguous float32 CPU tensor of `n` values, alive for this call.
        let mut scales_f32 = unsafe { std::slice::from_raw_parts(s.addr as *const f32, n) }.to_vec();
        scales_f32.resize(padded, 0.0);
        let mut bias_f32 = vec![0.0; padded];
        if let Some(b) = bias {
            let b = TensorRef::extract(b, "bias")?;
            require_bf16(&b)?;
            ensure!(b.shape == [n], Shape, "bias must have shape [{n}], got {:?}", b.shape);
            // SAFETY: as above, `n` bfloat16 values.
            let values = unsafe { std::slice::from_raw_parts(b.addr as *const bf16, n) };
            bias_f32.iter_mut().zip(values).for_each(|(o, v)| *o = v.to_f32());
        }
        let kernel = Kernel::new(path.map(Path::parse).transpose()?, num_threads)?;
        Ok(Int8Gemm { kernel, _packed: packed.clone().unbind(), packed: q, n, k, scales: scales_f32, bias: bias_f32 })
    }

    /// The kernel this CPU runs (`scalar` or `avx512_bf16`).
    #[getter]
    fn path(&self) -> &'static str {
        self.kernel.path().name()
    }

    /// `out` (`[rows, n]`) = (`x` (`[rows, k]`) · qᵀ) ⊙ scales + bias. GIL released.
    fn forward(&self, py: Python<'_>, x: &Bound<'_, PyAny>, out: &Bound<'_, PyAny>) -> PyResult<()> {
        let (n, k) = (self.n, self.k);
        let (x, out, rows) = rows_in_out(x, out, n, k, std::iter::once(&self.packed))?;
        let kernel = self.kernel;
        let (packed, len) = (self.packed.addr, self.packed.numel());
        py.detach(|| {
            // SAFETY: contiguous CPU tensors of these shapes and types (checked above and at
            // construction), alive for the call (`x` and `out` are the caller's, the packed
            // weight held by `self`); `out` overlaps neither.
            let (x, packed, out) = unsafe {
                (
                    std::slice::from_raw_parts(x.addr as *const bf16, rows * k),
                    std::slice::from_raw_parts(packed as *const i8, len),
                    std::slice::from_raw_parts_mut(out.addr as *mut bf16, rows * n),
                )
            };
            let weight = Int8Weight { packed, n, k, scales: &self.scales, bias: &self.bias };
            kernel.run(x, weight, out)
        })?;
        Ok(())
    }
}
