//! `Categorical` for Python: random tokens drawn from float32 logits on the CPU, and greedy
//! tokens from float32 or bf16 ones (`crate::sample`), a step's rows in one call.

use pyo3::prelude::*;

use super::tensor::TensorRef;
use crate::attn::{DType, Tier};
use crate::error::{ensure, Result};
use crate::sample::{self, Logits};
use half::bf16;

/// Inverse-CDF draws from `softmax(logits / temperature)` on the calling thread's OpenMP team.
#[pyclass(frozen, module = "neo_rs._core")]
pub(crate) struct Categorical {
    inner: sample::Categorical,
}

#[pymethods]
impl Categorical {
    /// `num_threads`: the team's size; `tier` forces a SIMD tier (default: `NEO_RS_SIMD`, else
    /// the best this CPU has).
    #[new]
    #[pyo3(signature = (*, num_threads, tier=None))]
    fn new(num_threads: usize, tier: Option<&str>) -> PyResult<Self> {
        let tier = tier.map(Tier::parse).transpose()?;
        Ok(Categorical { inner: sample::Categorical::new(tier, num_threads)? })
    }

    #[getter]
    fn tier(&self) -> &'static str {
        self.inner.tier().name()
    }

    /// The token drawn for each row `rows[i]` of `logits` (`[num_rows, vocab]`, contiguous
    /// float32) at `temperatures[i]`, narrowed by `top_ks[i]` (0: off), `top_ps[i]` (1: off) and
    /// `min_ps[i]` (0: off), at the uniform `uniforms[i]` in `[0, 1)`. GIL released.
    #[allow(clippy::too_many_arguments)] // one list a parameter, as Python holds them
    fn draw(
        &self,
        py: Python<'_>,
        logits: &Bound<'_, PyAny>,
        rows: Vec<usize>,
        temperatures: Vec<f32>,
        top_ks: Vec<usize>,
        top_ps: Vec<f32>,
        min_ps: Vec<f32>,
        uniforms: Vec<f32>,
    ) -> PyResult<Vec<u32>> {
        let t = TensorRef::extract(logits, "logits")?;
        ensure_f32(&t)?;
        let vocab = t.dims(2)?[1];
        let n = rows.len();
        let same = [temperatures.len(), top_ks.len(), top_ps.len(), min_ps.len()].iter().all(|&l| l == n);
        ensure!(same, Shape, "{n} rows need as many temperatures, top_ks, top_ps and min_ps");
        let params: Vec<sample::RowParams> = (0..n)
            .map(|i| sample::RowParams {
                temperature: temperatures[i],
                top_k: top_ks[i],
                top_p: top_ps[i],
                min_p: min_ps[i],
            })
            .collect();
        let mut out = vec![0u32; n];
        let inner = self.inner;
        py.detach(|| {
            // SAFETY: a contiguous float32 CPU tensor of `numel` values (checked above), alive
            // for the call (the caller's argument), only read.
            let logits = unsafe { std::slice::from_raw_parts(t.addr as *const f32, t.numel()) };
            inner.draw(logits, vocab, &rows, &params, &uniforms, &mut out)
        })?;
        Ok(out)
    }

    /// Each row's first largest entry of `logits` (`[rows, vocab]`, contiguous float32 or bf16),
    /// as torch's `max(dim=-1).indices`. GIL released.
    fn argmax(&self, py: Python<'_>, logits: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
        let t = TensorRef::extract(logits, "logits")?;
        let (rows, vocab) = {
            let dims = t.dims(2)?;
            (dims[0], dims[1])
        };
        let dtype = t.float()?;
        ensure!(dtype != DType::F16, DType, "logits must be float32 or bf16, got float16");
        let mut out = vec![0u32; rows];
        let inner = self.inner;
        py.detach(|| {
            // SAFETY: a contiguous CPU tensor of `numel` values of `dtype` (checked above), alive
            // for the call (the caller's argument), only read.
            let logits = unsafe {
                if dtype == DType::F32 {
                    Logits::F32(std::slice::from_raw_parts(t.addr as *const f32, t.numel()))
                } else {
                    Logits::Bf16(std::slice::from_raw_parts(t.addr as *const bf16, t.numel()))
                }
            };
            inner.argmax(logits, vocab, &mut out)
        })?;
        Ok(out)
    }
}

fn ensure_f32(t: &TensorRef) -> Result<()> {
    ensure!(t.float()? == DType::F32, DType, "{} must be float32, got {:?}", t.name, t.kind);
    Ok(())
}
