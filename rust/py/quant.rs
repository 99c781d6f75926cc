//! `quantize_rows` for Python: the host pool's int8 rows written from float rows (swap-outs,
//! host-bound prefills), with the same rounding as the kernel's fused append.

use half::{bf16, f16};
use pyo3::prelude::*;

use super::tensor::{overlaps, Kind, TensorRef};
use crate::attn::{quantize_row, DType, Element};
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
    check(&src, &out, &scales)?;
    let width = *src.shape.last().unwrap_or(&1);
    let rows = src.numel().checked_div(width).unwrap_or(0);
    let (s, o, sc) = (src.addr, out.addr, scales.addr);
    // SAFETY: live, contiguous CPU tensors of these sizes and types (checked above), held by the
    // caller's arguments for the whole call; `out` and `scales` overlap nothing else.
    py.detach(|| unsafe {
        match dtype {
            DType::F32 => run::<f32>(s, o, sc, rows, width),
            DType::F16 => run::<f16>(s, o, sc, rows, width),
            DType::BF16 => run::<bf16>(s, o, sc, rows, width),
        }
    });
    Ok(())
}

fn check(src: &TensorRef, out: &TensorRef, scales: &TensorRef) -> Result<()> {
    ensure!(out.kind == Kind::Int8, DType, "out must be int8, got {:?}", out.kind);
    ensure!(scales.float()? == DType::F32, DType, "scales must be float32");
    ensure!(!src.shape.is_empty(), Shape, "src must have at least one dimension");
    ensure!(out.shape == src.shape, Shape, "out shape {:?} differs from src {:?}", out.shape, src.shape);
    let rows = &src.shape[..src.shape.len() - 1];
    ensure!(scales.shape == rows, Shape, "scales must be {rows:?}, got {:?}", scales.shape);
    let (o, s) = (out.bytes(), scales.bytes());
    ensure!(
        !overlaps(&o, &src.bytes()) && !overlaps(&s, &src.bytes()) && !overlaps(&o, &s),
        Value,
        "src, out and scales must not overlap"
    );
    Ok(())
}

/// # Safety
/// `src` holds `rows * width` values of `E`, `out` as many i8, `scales` `rows` f32, all live.
unsafe fn run<E: Element>(src: usize, out: usize, scales: usize, rows: usize, width: usize) {
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
    for ((s, o), scale) in src.chunks(width).zip(out.chunks_mut(width)).zip(scales) {
        *scale = quantize_row(s, o);
    }
}
