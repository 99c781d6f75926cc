//! NEO's perf predictor: per-layer stage times (ms) from profiled tables with piecewise-linear
//! interpolation, corrected online by a per-term ratio of measured to predicted time (an
//! exponential average), so a wrong table heals as iterations run.

use crate::error::{ensure, Result};

/// A stage whose time the predictor estimates, per layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Term {
    /// Pre- and post-projection (norm, QKV, RoPE, O-proj, FFN) of a sub-batch, by its tokens.
    Linear = 0,
    /// Prefill attention of one chunk, by its equivalent prompt length.
    PrefillAttn = 1,
    /// Device decode attention, by sequences × their total context tokens.
    GpuDecode = 2,
    /// CPU decode attention, by sequences × total context tokens.
    CpuDecode = 3,
    /// Device<->host copies of CPU decodes' Q/K/V and outputs, by bytes.
    Transfer = 4,
}

const NUM_TERMS: usize = 5;

/// y(x) by linear interpolation between grid points (and along the end segments beyond them),
/// never below zero.
#[derive(Debug, Clone, PartialEq)]
pub struct Table1 {
    xs: Vec<f64>,
    ys: Vec<f64>,
}

impl Table1 {
    pub fn new(xs: Vec<f64>, ys: Vec<f64>) -> Result<Self> {
        ensure!(!xs.is_empty() && xs.len() == ys.len(), Value, "a table needs as many x as y values, at least one");
        ensure!(xs.windows(2).all(|w| w[0] < w[1]), Value, "table x values must increase strictly");
        ensure!(ys.iter().chain(&xs).all(|v| v.is_finite()), Value, "table values must be finite");
        Ok(Table1 { xs, ys })
    }

    pub fn eval(&self, x: f64) -> f64 {
        let n = self.xs.len();
        if n == 1 {
            return self.ys[0].max(0.0);
        }
        let i = self.xs.partition_point(|&g| g <= x).clamp(1, n - 1);
        let (x0, x1, y0, y1) = (self.xs[i - 1], self.xs[i], self.ys[i - 1], self.ys[i]);
        (y0 + (y1 - y0) * (x - x0) / (x1 - x0)).max(0.0)
    }
}

/// z(rows, cols): interpolated along `cols` within the two neighbouring rows, then across rows.
#[derive(Debug, Clone, PartialEq)]
pub struct Table2 {
    rows: Vec<f64>,
    by_row: Vec<Table1>,
}

impl Table2 {
    /// `values` is row-major `[rows.len(), cols.len()]`.
    pub fn new(rows: Vec<f64>, cols: Vec<f64>, values: Vec<f64>) -> Result<Self> {
        ensure!(values.len() == rows.len() * cols.len(), Value, "table values must be rows x cols");
        Table1::new(rows.clone(), vec![0.0; rows.len()])?;
        let by_row =
            values.chunks(cols.len().max(1)).map(|r| Table1::new(cols.clone(), r.to_vec())).collect::<Result<_>>()?;
        Ok(Table2 { rows, by_row })
    }

    pub fn eval(&self, row: f64, col: f64) -> f64 {
        let across: Vec<f64> = self.by_row.iter().map(|t| t.eval(col)).collect();
        Table1 { xs: self.rows.clone(), ys: across }.eval(row)
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct PerfPredictor {
    pub linear: Table1,
    pub prefill_attn: Table1,
    pub gpu_decode: Table2,
    pub cpu_decode: Table2,
    pub transfer: Table1,
    /// Fixed cost of one CPU-attention hand-off (submit, wait, copies issued), ms.
    pub launch_ms: f64,
    /// Measured / predicted, per term (starts at 1).
    correction: [f64; NUM_TERMS],
    /// Weight of each new observation in the correction.
    alpha: f64,
}

impl PerfPredictor {
    pub fn new(
        linear: Table1,
        prefill_attn: Table1,
        gpu_decode: Table2,
        cpu_decode: Table2,
        transfer: Table1,
        launch_ms: f64,
    ) -> Self {
        PerfPredictor {
            linear,
            prefill_attn,
            gpu_decode,
            cpu_decode,
            transfer,
            launch_ms,
            correction: [1.0; NUM_TERMS],
            alpha: 0.05,
        }
    }

    /// A made-up GPU and host for tests and the simulator's defaults: linear work 0.2 ms + 2 µs
    /// per token, attention proportional to context, the CPU ~8x slower per token than the device.
    pub fn synthetic() -> Self {
        let t = |xs: &[f64], ys: &[f64]| Table1::new(xs.to_vec(), ys.to_vec()).expect("valid synthetic table");
        PerfPredictor::new(
            t(&[1.0, 4096.0], &[0.2, 0.2 + 4095.0 * 0.002]),
            t(&[1.0, 4096.0], &[0.01, 2.0]),
            Table2::new(vec![1.0, 1024.0], vec![0.0, 1e6], vec![0.01, 0.01 + 1e6 * 5e-6, 0.05, 0.05 + 1e6 * 5e-6])
                .expect("valid"),
            Table2::new(vec![1.0, 1024.0], vec![0.0, 1e6], vec![0.02, 0.02 + 1e6 * 4e-5, 0.5, 0.5 + 1e6 * 4e-5])
                .expect("valid"),
            t(&[0.0, 1e9], &[0.005, 0.005 + 1e9 * 4e-8]),
            0.05,
        )
    }

    fn corrected(&self, term: Term, raw: f64) -> f64 {
        raw * self.correction[term as usize]
    }

    pub fn linear_ms(&self, tokens: usize) -> f64 {
        if tokens == 0 {
            return 0.0;
        }
        self.corrected(Term::Linear, self.linear.eval(tokens as f64))
    }

    /// One prefill chunk of `new_tokens` after `computed` cached ones, priced as the full prompt
    /// whose causal attention has the same area.
    pub fn prefill_attn_ms(&self, computed: usize, new_tokens: usize) -> f64 {
        let area = new_tokens as f64 * (computed as f64 + new_tokens as f64 / 2.0);
        self.corrected(Term::PrefillAttn, self.prefill_attn.eval((2.0 * area).sqrt()))
    }

    pub fn gpu_decode_ms(&self, seqs: usize, context_tokens: usize) -> f64 {
        if seqs == 0 {
            return 0.0;
        }
        self.corrected(Term::GpuDecode, self.gpu_decode.eval(seqs as f64, context_tokens as f64))
    }

    pub fn cpu_decode_ms(&self, seqs: usize, context_tokens: usize) -> f64 {
        if seqs == 0 {
            return 0.0;
        }
        self.corrected(Term::CpuDecode, self.cpu_decode.eval(seqs as f64, context_tokens as f64))
    }

    pub fn transfer_ms(&self, bytes: usize) -> f64 {
        if bytes == 0 {
            return 0.0;
        }
        self.corrected(Term::Transfer, self.transfer.eval(bytes as f64))
    }

    /// Fold a measured stage time into the term's correction (ignored when either is ~0).
    pub fn observe(&mut self, term: Term, predicted_ms: f64, measured_ms: f64) {
        let uncorrected = predicted_ms / self.correction[term as usize];
        if uncorrected > 1e-6 && measured_ms.is_finite() && measured_ms > 0.0 {
            let ratio = (measured_ms / uncorrected).clamp(0.01, 100.0);
            let c = &mut self.correction[term as usize];
            *c += self.alpha * (ratio - *c);
        }
    }

    pub fn correction(&self, term: Term) -> f64 {
        self.correction[term as usize]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tables_interpolate_and_extrapolate() {
        let t = Table1::new(vec![1.0, 3.0, 7.0], vec![1.0, 2.0, 4.0]).unwrap();
        assert_eq!(t.eval(2.0), 1.5);
        assert_eq!(t.eval(5.0), 3.0);
        assert_eq!(t.eval(9.0), 5.0);
        assert_eq!(t.eval(-10.0), 0.0);
        assert!(Table1::new(vec![1.0, 1.0], vec![0.0, 0.0]).is_err());
        let t2 = Table2::new(vec![1.0, 3.0], vec![0.0, 10.0], vec![0.0, 10.0, 2.0, 30.0]).unwrap();
        assert_eq!(t2.eval(2.0, 5.0), (5.0 + 16.0) / 2.0);
    }

    #[test]
    fn online_correction_heals_a_wrong_table() {
        let mut p = PerfPredictor::synthetic();
        let truth = 3.0 * p.linear_ms(256);
        for _ in 0..300 {
            let predicted = p.linear_ms(256);
            p.observe(Term::Linear, predicted, truth);
        }
        assert!((p.linear_ms(256) / truth - 1.0).abs() < 0.01, "{}", p.correction(Term::Linear));
        assert_eq!(p.correction(Term::CpuDecode), 1.0);
    }
}
