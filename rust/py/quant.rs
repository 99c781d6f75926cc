//! The host pool's int8 rows for Python: `quantize_rows` writes them from float rows (swap-outs,
//! host-bound prefills) with the same rotation and rounding as the kernel's fused append, and
//! `dequantize_rows` reads them back (swap-ins). See `attn::rotation`.

use half::{bf16, f16};
use pyo3::prelude::*;

use super::tensor::{overlaps, Kind, TensorRef};
use crate::attn::rotation::{dequantize_kv_rows, quantize_kv_rows};
use crate::attn::{DType, Element};
use crate::error::{ensure, Result};

/// Quantizes each row (last dimension) of `src` into `out` (int8, same shape), its scale into
/// `scales` (float32, `src`'s shape without the last dimension). GIL released.
#[pyfunction]
pub(crate) fn quantize_rows(
    py: Python<'_>,
    src: &Bound<'_, PyAny>,
    out: &Bound<'_, PyAny>,
    scales: &Bound<'_, PyAny>,
) -> PyResult<()> {
    let (src, out, scales) =
        (TensorRef::extract(src, "src")?, TensorRef::extract(out, "out")?, TensorRef::extract(scales, "scales")?);
    let dtype = src.float()?;
    check(&out, &src, &scales)?;
    let (rows, width) = rows(&src);
    let (s, o, sc) = (src.addr, out.addr, scales.addr);
    // SAFETY: live, contiguous CPU tensors of these sizes and types (checked above), held by the
    // caller's arguments for the whole call; `out` and `scales` overlap nothing else.
    py.detach(|| unsafe {
        match dtype {
            DType::F32 => quantize::<f32>(s, o, sc, rows, width),
            DType::F16 => quantize::<f16>(s, o, sc, rows, width),
            DType::BF16 => quantize::<bf16>(s, o, sc, rows, width),
        }
    });
    Ok(())
}

/// Reads `quantize_rows`' int8 rows `src` with their `scales` back into `out` (a float tensor
/// shaped like `src`). GIL released.
#[pyfunction]
pub(crate) fn dequantize_rows(
    py: Python<'_>,
    src: &Bound<'_, PyAny>,
    scales: &Bound<'_, PyAny>,
    out: &Bound<'_, PyAny>,
) -> PyResult<()> {
    let (src, scales, out) =
        (TensorRef::extract(src, "src")?, TensorRef::extract(scales, "scales")?, TensorRef::extract(out, "out")?);
    let dtype = out.float()?;
    check(&src, &out, &scales)?;
    let (rows, width) = rows(&src);
    let (s, sc, o) = (src.addr, scales.addr, out.addr);
    // SAFETY: as in `quantize_rows`, with `out` the only tensor written.
    py.detach(|| unsafe {
        match dtype {
            DType::F32 => dequantize::<f32>(s, sc, o, rows, width),
            DType::F16 => dequantize::<f16>(s, sc, o, rows, width),
            DType::BF16 => dequantize::<bf16>(s, sc, o, rows, width),
        }
    });
    Ok(())
}

/// `int8` and `float` are the int8 rows and the float rows (either way round), `scales` theirs.
fn check(int8: &TensorRef, float: &TensorRef, scales: &TensorRef) -> Result<()> {
    ensure!(int8.kind == Kind::Int8, DType, "{} must be int8, got {:?}", int8.name, int8.kind);
    ensure!(scales.float()? == DType::F32, DType, "scales must be float32");
    ensure!(!float.shape.is_empty(), Shape, "{} must have at least one dimension", float.name);
    ensure!(
        int8.shape == float.shape,
        Shape,
        "{} shape {:?} differs from {} {:?}",
        int8.name,
        int8.shape,
        float.name,
        float.shape
    );
    let rows = &float.shape[..float.shape.len() - 1];
    ensure!(scales.shape == rows, Shape, "scales must be {rows:?}, got {:?}", scales.shape);
    let (i, f, s) = (int8.bytes(), float.bytes(), scales.bytes());
    ensure!(!overlaps(&i, &f) && !overlaps(&s, &f) && !overlaps(&i, &s), Value, "src, out and scales must not overlap");
    Ok(())
}

/// Rows and row width of `t`.
fn rows(t: &TensorRef) -> (usize, usize) {
    let width = *t.shape.last().unwrap_or(&1);
    (t.numel().checked_div(width).unwrap_or(0), width)
}

/// # Safety
/// `src` holds `rows * width` values of `E`, `out` as many i8, `scales` `rows` f32, all live.
unsafe fn quantize<E: Element>(src: usize, out: usize, scales: usize, rows: usize, width: usize) {
    if width == 0 {
        return; // rows of nothing: their scales stay as they are
    }
    // SAFETY: forwarded caller contract.
    let (src, out, scales) = unsafe {
        (
            std::slice::from_raw_parts(src as *const E, rows * width),
            std::slice::from_raw_parts_mut(out as *mut i8, rows * width),
            std::slice::from_raw_parts_mut(scales as *mut f32, rows),
        )
    };
    quantize_kv_rows(src, out, scales, width);
}

/// # Safety
/// `src` holds `rows * width` i8, `scales` `rows` f32, `out` `rows * width` values of `E`, all
/// live.
unsafe fn dequantize<E: Element>(src: usize, scales: usize, out: usize, rows: usize, width: usize) {
    if width == 0 {
        return;
    }
    // SAFETY: forwarded caller contract.
    let (src, scales, out) = unsafe {
        (
            std::slice::from_raw_parts(src as *const i8, rows * width),
            std::slice::from_raw_parts(scales as *const f32, rows),
            std::slice::from_raw_parts_mut(out as *mut E, rows * width),
        )
    };
    dequantize_kv_rows(src, scales, out, width);
}
