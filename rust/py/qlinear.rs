//! `QuantGemm` for Python: a weight-only int8, int4 or grouped int8 linear (`crate::qlinear`), its packed
//! weight held and checked once, its scales and bias copied, so each `forward` checks only its
//! `x` and `out`.

use half::bf16;
use pyo3::prelude::*;

use super::gemv::{require_bf16, rows_in_out};
use super::tensor::{Kind, TensorRef};
use crate::attn::DType;
use crate::error::{ensure, Result};
use crate::qlinear::{Format, Gemv, Path, QuantWeight, COLS};

/// A weight-only quantized linear on the CPU for any number of rows, `out = x · Wᵀ + bias`.
#[pyclass(frozen, module = "neo_rs._core")]
pub(crate) struct QuantGemm {
    kernel: Gemv,
    format: Format,
    _packed: Py<PyAny>,
    packed: TensorRef,
    n: usize,
    k: usize,
    /// The grouped formats' scales and zeros, per block and group.
    groups: Vec<bf16>,
    /// f32, padded to whole blocks of `COLS` columns.
    scales: Vec<f32>,
    bias: Vec<f32>,
}

/// `t`'s `len` values, copied (`t`: a contiguous CPU tensor of at least that many, alive for the
/// call).
fn copied<T: Copy>(t: &TensorRef, len: usize) -> Vec<T> {
    // SAFETY: the caller's.
    unsafe { std::slice::from_raw_parts(t.addr as *const T, len) }.to_vec()
}

/// `bias` (bfloat16 `[n]`) as f32, padded to `padded` with zeros (none: all zeros).
fn bias_f32(bias: Option<&Bound<'_, PyAny>>, n: usize, padded: usize) -> PyResult<Vec<f32>> {
    let mut out = vec![0.0; padded];
    if let Some(b) = bias {
        let b = TensorRef::extract(b, "bias")?;
        require_bf16(&b)?;
        ensure!(b.shape == [n], Shape, "bias must have shape [{n}], got {:?}", b.shape);
        out.iter_mut().zip(copied::<bf16>(&b, n)).for_each(|(o, v)| *o = v.to_f32());
    }
    Ok(out)
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
    /// ceil(k / 2), 16, 2]`; `scales`: float32 `[n]`; `bias`: bfloat16 `[n]`. Contiguous CPU
    /// tensors. The work is split over the calling thread's OpenMP team of `num_threads`; `path`
    /// forces a kernel.
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
        ensure!(s.float()? == DType::F32, DType, "scales must be float32, got {:?}", s.kind);
        ensure!(s.shape == [n], Shape, "scales must have shape [{n}], got {:?}", s.shape);
        let mut scales_f32 = copied::<f32>(&s, n);
        scales_f32.resize(padded, 0.0);
        Ok(QuantGemm {
            kernel: Gemv::quantized(path.map(Path::parse).transpose()?, num_threads)?,
            format: Format::Int8,
            _packed: packed.clone().unbind(),
            packed: q,
            n,
            k,
            groups: Vec::new(),
            scales: scales_f32,
            bias: bias_f32(bias, n, padded)?,
        })
    }

    /// A linear with a scale and a zero per `group` inputs and column: `bits` 4, int4's `w = (q -
    /// 8) · scale + zero` with `packed` uint8 `[ceil(n / 16), k / 2, 16]` (`crate::qlinear`'s
    /// int4 layout); `bits` 8, grouped int8's `w = q · scale + zero` with `packed` in `int8`'s
    /// layout (GGUF's blocks of 2 to 8 bits but Q4's, 8-bit GPTQ). `groups`: bfloat16 `[ceil(n / 16), k / group, 2,
    /// 16]`, each block's and group's 16 scales, then 16 zeros; `bias`: bfloat16 `[n]`. As
    /// `int8` otherwise.
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
        require_bf16(&g)?;
        let shape = [blocks, k / group, 2, COLS];
        ensure!(g.shape == shape, Shape, "groups must have shape {shape:?}, got {:?}", g.shape);
        Ok(QuantGemm {
            kernel: Gemv::quantized(path.map(Path::parse).transpose()?, num_threads)?,
            format,
            _packed: packed.clone().unbind(),
            packed: q,
            n,
            k,
            groups: copied::<bf16>(&g, g.numel()),
            scales: vec![1.0; blocks * COLS],
            bias: bias_f32(bias, n, blocks * COLS)?,
        })
    }

    /// The kernel this CPU runs (`scalar` or `avx512_bf16`: the int8 and int4 linears have no NEON one).
    #[getter]
    fn path(&self) -> &'static str {
        self.kernel.path().name()
    }

    /// `out` (`[rows, n]`) = `x` (`[rows, k]`) · Wᵀ + bias. GIL released.
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
                    std::slice::from_raw_parts(packed as *const u8, len),
                    std::slice::from_raw_parts_mut(out.addr as *mut bf16, rows * n),
                )
            };
            let (groups, scales, bias) = (&self.groups[..], &self.scales[..], &self.bias[..]);
            kernel.run_quantized(x, QuantWeight { format: self.format, packed, groups, n, k, scales, bias }, out)
        })?;
        Ok(())
    }
}
