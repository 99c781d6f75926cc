//! `QuantGemm` for Python: a weight-only int8, int4 or grouped int8 linear (`crate::qlinear`), its packed
//! weight (and groups) held and checked once, its scales and bias copied, so each `forward`
//! checks only its `x` and `out`.

use half::{bf16, f16};
use pyo3::prelude::*;

use super::gemv::{require, rows_in_out};
use super::tensor::{Kind, TensorRef};
use crate::attn::{DType, Element};
use crate::error::{ensure, Result};
use crate::qlinear::{Format, Gemv, Path, QuantWeight, COLS};

/// A weight-only quantized linear on the CPU for any number of rows, `out = x · Wᵀ + bias`.
#[pyclass(frozen, module = "neo_rs._core")]
pub(crate) struct QuantGemm {
    kernel: Gemv,
    format: Format,
    /// The model's: `x`'s, `out`'s and the groups'.
    dtype: DType,
    /// The tensors `packed` and `groups` point into, held so that their memory outlives this
    /// object (they must not be resized in place).
    _tensors: Vec<Py<PyAny>>,
    packed: TensorRef,
    /// The grouped formats' scales and zeros, per block and group.
    groups: Option<TensorRef>,
    n: usize,
    k: usize,
    /// f32, padded to whole blocks of `COLS` columns.
    scales: Vec<f32>,
    bias: Vec<f32>,
}

/// `t`'s `n` values (a float tensor of at least that many) as f32, padded with zeros to `padded`.
fn widened(t: &TensorRef, n: usize, padded: usize) -> Result<Vec<f32>> {
    fn read<E: Element>(t: &TensorRef, n: usize) -> Vec<f32> {
        // SAFETY: the caller's: a contiguous CPU tensor of `E`, at least `n` values, alive for
        // the call.
        unsafe { std::slice::from_raw_parts(t.addr as *const E, n) }.iter().map(|v| v.to_f32()).collect()
    }
    let mut values = match t.float()? {
        DType::BF16 => read::<bf16>(t, n),
        DType::F16 => read::<f16>(t, n),
        DType::F32 => read::<f32>(t, n),
    };
    values.resize(padded, 0.0);
    Ok(values)
}

/// `bias` (`[n]`, of `dtype`) as f32, padded to `padded` with zeros (none: all zeros).
fn bias_f32(bias: Option<&Bound<'_, PyAny>>, dtype: DType, n: usize, padded: usize) -> PyResult<Vec<f32>> {
    let Some(b) = bias else { return Ok(vec![0.0; padded]) };
    let b = TensorRef::extract(b, "bias")?;
    require(&b, dtype)?;
    ensure!(b.shape == [n], Shape, "bias must have shape [{n}], got {:?}", b.shape);
    Ok(widened(&b, n, padded)?)
}

/// The packed weight: `dtype` bytes of `shape`.
fn packed_ref(packed: &Bound<'_, PyAny>, kind: Kind, shape: &[usize]) -> Result<TensorRef> {
    let q = TensorRef::extract(packed, "packed").map_err(|e| crate::error::NeoError::Value(e.to_string()))?;
    ensure!(q.kind == kind, DType, "packed must be {kind:?}, got {:?}", q.kind);
    ensure!(q.shape == shape, Shape, "packed must have shape {shape:?}, got {:?}", q.shape);
    Ok(q)
}

#[pymethods]
impl QuantGemm {
    /// An int8 linear: `packed`, the int8 weight `[n, k]` in the kernel's layout, `[ceil(n / 16),
    /// ceil(k / 2), 16, 2]`; `scales`: `[n]` of the model's dtype (bfloat16, float16 or float32,
    /// which `x` and `out` then take); `bias`: `[n]`, the same dtype. Contiguous CPU tensors. The
    /// work is split over the calling thread's OpenMP team of `num_threads`; `path` forces a
    /// kernel.
    #[staticmethod]
    #[pyo3(signature = (packed, scales, bias=None, *, n, k, num_threads, path=None))]
    #[allow(clippy::too_many_arguments)]
    fn int8(
        packed: &Bound<'_, PyAny>,
        scales: &Bound<'_, PyAny>,
        bias: Option<&Bound<'_, PyAny>>,
        n: usize,
        k: usize,
        num_threads: usize,
        path: Option<&str>,
    ) -> PyResult<Self> {
        ensure!(n > 0 && k > 0, Shape, "a linear's weight must not be empty, got [{n}, {k}]");
        let q = packed_ref(packed, Kind::Int8, &[n.div_ceil(COLS), k.div_ceil(2), COLS, 2])?;
        let padded = n.div_ceil(COLS) * COLS;
        let s = TensorRef::extract(scales, "scales")?;
        let dtype = s.float()?;
        ensure!(s.shape == [n], Shape, "scales must have shape [{n}], got {:?}", s.shape);
        Ok(QuantGemm {
            kernel: Gemv::new(path.map(Path::parse).transpose()?, num_threads)?,
            format: Format::Int8,
            dtype,
            _tensors: vec![packed.clone().unbind()],
            packed: q,
            groups: None,
            n,
            k,
            scales: widened(&s, n, padded)?,
            bias: bias_f32(bias, dtype, n, padded)?,
        })
    }

    /// A linear with a scale and a zero per `group` inputs and column: `bits` 4, int4's `w = (q -
    /// 8) · scale + zero` with `packed` uint8 `[ceil(n / 16), k / 2, 16]` (`crate::qlinear`'s
    /// int4 layout); `bits` 8, grouped int8's `w = q · scale + zero` with `packed` in `int8`'s
    /// layout (GGUF's blocks of 2 to 8 bits but Q4's, 8-bit GPTQ). `groups`: `[ceil(n / 16), k /
    /// group, 2, 16]` of the model's dtype (as `int8`'s scales), each block's and group's 16
    /// scales, then 16 zeros, held; `bias`: `[n]`, the same dtype. As `int8` otherwise.
    #[staticmethod]
    #[pyo3(signature = (packed, groups, bias=None, *, n, k, group, bits, num_threads, path=None))]
    #[allow(clippy::too_many_arguments)]
    fn grouped(
        packed: &Bound<'_, PyAny>,
        groups: &Bound<'_, PyAny>,
        bias: Option<&Bound<'_, PyAny>>,
        n: usize,
        k: usize,
        group: usize,
        bits: u32,
        num_threads: usize,
        path: Option<&str>,
    ) -> PyResult<Self> {
        ensure!(n > 0 && k > 0, Shape, "a linear's weight must not be empty, got [{n}, {k}]");
        ensure!(
            group > 0 && group.is_multiple_of(2) && k.is_multiple_of(group),
            Shape,
            "group {group} must be even and divide k = {k}"
        );
        let blocks = n.div_ceil(COLS);
        let (format, q) = match bits {
            4 => (Format::Int4 { group }, packed_ref(packed, Kind::UInt8, &[blocks, k / 2, COLS])?),
            8 => (Format::GroupedInt8 { group }, packed_ref(packed, Kind::Int8, &[blocks, k / 2, COLS, 2])?),
            _ => return Err(crate::error::NeoError::Value(format!("bits must be 4 or 8, got {bits}")).into()),
        };
        let g = TensorRef::extract(groups, "groups")?;
        let dtype = g.float()?;
        let shape = [blocks, k / group, 2, COLS];
        ensure!(g.shape == shape, Shape, "groups must have shape {shape:?}, got {:?}", g.shape);
        Ok(QuantGemm {
            kernel: Gemv::new(path.map(Path::parse).transpose()?, num_threads)?,
            format,
            dtype,
            _tensors: vec![packed.clone().unbind(), groups.clone().unbind()],
            packed: q,
            groups: Some(g),
            n,
            k,
            scales: vec![1.0; blocks * COLS],
            bias: bias_f32(bias, dtype, n, blocks * COLS)?,
        })
    }

    /// The kernel this CPU runs (`scalar`, `avx2`, `avx512_bf16`, `neon` or `neon_bf16`).
    #[getter]
    fn path(&self) -> &'static str {
        self.kernel.path().name()
    }

    /// `out` (`[rows, n]`) = `x` (`[rows, k]`) · Wᵀ + bias, both of the linear's dtype. GIL released.
    fn forward(&self, py: Python<'_>, x: &Bound<'_, PyAny>, out: &Bound<'_, PyAny>) -> PyResult<()> {
        let held = std::iter::once(&self.packed).chain(&self.groups);
        let (x, out, rows) = rows_in_out(x, out, self.n, self.k, self.dtype, held)?;
        let (x, out) = (x.addr, out.addr);
        py.detach(|| match self.dtype {
            DType::BF16 => self.run::<bf16>(x, out, rows),
            DType::F16 => self.run::<f16>(x, out, rows),
            DType::F32 => self.run::<f32>(x, out, rows),
        })?;
        Ok(())
    }
}

impl QuantGemm {
    /// `forward`'s call of the kernel, `x` and `out` at those addresses, checked by `forward`.
    fn run<E: Element>(&self, x: usize, out: usize, rows: usize) -> Result<()> {
        let (n, k) = (self.n, self.k);
        let groups = self.groups.as_ref().map_or((0, 0), |g| (g.addr, g.numel()));
        // SAFETY: contiguous CPU tensors of these shapes and of `E` (`self.dtype`'s type; checked
        // by `forward` and at construction), alive for the call (`x` and `out` are the caller's,
        // the packed weight and groups held by `self`); `out` overlaps none of the others.
        let (x, packed, groups, out) = unsafe {
            (
                std::slice::from_raw_parts(x as *const E, rows * k),
                std::slice::from_raw_parts(self.packed.addr as *const u8, self.packed.numel()),
                if groups.1 == 0 { &[][..] } else { std::slice::from_raw_parts(groups.0 as *const E, groups.1) },
                std::slice::from_raw_parts_mut(out as *mut E, rows * n),
            )
        };
        let (scales, bias) = (&self.scales[..], &self.bias[..]);
        self.kernel.run_quantized(x, QuantWeight { format: self.format, packed, groups, n, k, scales, bias }, out)
    }
}
