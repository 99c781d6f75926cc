//! `Scheduler` for Python: requests in by id and token list, plans out as numpy arrays (the flat
//! model inputs are built in Rust), sampled tokens back in. `schedule`/`update` release the GIL.

use numpy::{IntoPyArray, PyArray1, PyArray2, PyArray3, PyArrayMethods};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::kv::{Device, SwapPlan};
use crate::sched::{
    self, Drafter, OffloadMode, PerfPredictor, RequestId, SchedulerConfig, Speculation, StageTimes, Table1, Table2,
    Term,
};

/// `speculation=`: `(k, (lookup_min, lookup_max) or None for a draft model, always)`.
type SpeculationArgs = (usize, Option<(usize, usize)>, bool);

#[pyclass(module = "neo_rs._core")]
pub struct Scheduler {
    inner: sched::Scheduler,
}

/// One iteration's plan. Rows are in batch order: sub-batch 0 (`num_decodes` one-token decodes,
/// the last `num_cpu_decodes` of them over the host pool, then prefill chunks), then from request
/// `sub_batch1_start` on, sub-batch 1 (CPU decodes, pipelined half a layer behind).
#[pyclass(module = "neo_rs._core", get_all, frozen)]
pub struct SchedulerOutput {
    req_ids: Py<PyArray1<i64>>,
    num_computed_tokens: Py<PyArray1<i64>>,
    num_new_tokens: Py<PyArray1<i64>>,
    num_decodes: usize,
    num_cpu_decodes: usize,
    num_host_prefills: usize,
    sub_batch1_start: usize,
    input_ids: Py<PyArray1<i64>>,
    positions: Py<PyArray1<i64>>,
    slot_mapping: Py<PyArray2<i64>>,
    query_start_loc: Py<PyArray1<i32>>,
    seq_lens: Py<PyArray1<i32>>,
    block_tables: Py<PyArray3<i32>>,
    sample_rows: Py<PyArray1<i64>>,
    sample_ids: Py<PyArray1<i64>>,
    swap_out: Py<PyArray2<i64>>,
    swap_in: Py<PyArray2<i64>>,
    prefill_to_host: Py<PyArray2<i64>>,
    cache_to_host: Py<PyArray2<i64>>,
    cache_to_device: Py<PyArray2<i64>>,
    recomputed: Vec<u64>,
    /// Predicted per-layer stage times (ms): linear0/1, prefill_attn, gpu_decode, cpu_attn0/1,
    /// transfer0/1, layer.
    predicted: Py<PyDict>,
}

fn device(name: &str) -> PyResult<Device> {
    match name {
        "gpu" => Ok(Device::Gpu),
        "cpu" => Ok(Device::Cpu),
        _ => Err(super::InvalidArgumentError::new_err(format!("device must be 'gpu' or 'cpu', got {name:?}"))),
    }
}

fn pairs<'py>(py: Python<'py>, plan: &SwapPlan) -> PyResult<Bound<'py, PyArray2<i64>>> {
    let flat: Vec<i64> = plan.pairs.iter().flat_map(|(s, d)| [i64::from(s.0), i64::from(d.0)]).collect();
    flat.into_pyarray(py).reshape([plan.pairs.len(), 2])
}

fn stage_times<'py>(py: Python<'py>, t: &StageTimes) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    for (k, v) in [
        ("linear0", t.linear_ms[0]),
        ("linear1", t.linear_ms[1]),
        ("prefill_attn", t.prefill_attn_ms),
        ("gpu_decode", t.gpu_decode_ms),
        ("cpu_attn0", t.cpu_attn_ms[0]),
        ("cpu_attn1", t.cpu_attn_ms[1]),
        ("transfer0", t.transfer_ms[0]),
        ("transfer1", t.transfer_ms[1]),
        ("copy", t.copy_ms),
        ("layer", t.layer_ms),
    ] {
        d.set_item(k, v)?;
    }
    Ok(d)
}

fn term(name: &str) -> PyResult<Term> {
    Ok(match name {
        "linear" => Term::Linear,
        "prefill_attn" => Term::PrefillAttn,
        "gpu_decode" => Term::GpuDecode,
        "cpu_decode" => Term::CpuDecode,
        "transfer" => Term::Transfer,
        _ => return Err(super::InvalidArgumentError::new_err(format!("unknown perf term {name:?}"))),
    })
}

fn column(v: impl Iterator<Item = usize>) -> Vec<i64> {
    v.map(|x| x as i64).collect()
}

#[pymethods]
impl Scheduler {
    #[new]
    #[pyo3(signature = (*, max_num_seqs, max_num_batched_tokens, max_model_len, block_size, num_gpu_blocks, num_cpu_blocks, offload = "none", transfer_bytes_per_decode = 0, kv_bytes_per_token = 0, force_pipeline = false, enable_prefix_caching = false, num_cpu_prefix_blocks = 0, kv_group_windows = None, speculation = None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        max_num_seqs: usize,
        max_num_batched_tokens: usize,
        max_model_len: usize,
        block_size: usize,
        num_gpu_blocks: u32,
        num_cpu_blocks: u32,
        offload: &str,
        transfer_bytes_per_decode: usize,
        kv_bytes_per_token: usize,
        force_pipeline: bool,
        enable_prefix_caching: bool,
        num_cpu_prefix_blocks: u32,
        kv_group_windows: Option<Vec<Option<usize>>>,
        speculation: Option<SpeculationArgs>,
    ) -> PyResult<Self> {
        let config = SchedulerConfig {
            max_num_seqs,
            max_num_batched_tokens,
            max_model_len,
            block_size,
            num_gpu_blocks,
            num_cpu_blocks,
            offload: OffloadMode::parse(offload)?,
            transfer_bytes_per_decode,
            kv_bytes_per_token,
            force_pipeline,
            enable_prefix_caching,
            num_cpu_prefix_blocks,
            kv_group_windows: kv_group_windows.unwrap_or_else(|| vec![None]),
            speculation: speculation.map(|(num_tokens, lookup, always)| Speculation {
                num_tokens,
                drafter: lookup.map_or(Drafter::Model, |(min, max)| Drafter::PromptLookup { min, max }),
                always,
            }),
        };
        Ok(Scheduler { inner: sched::Scheduler::new(config)? })
    }

    #[pyo3(signature = (request_id, prompt_token_ids, max_tokens, cache_salt = None))]
    fn add_request(
        &mut self,
        request_id: u64,
        prompt_token_ids: Vec<u32>,
        max_tokens: usize,
        cache_salt: Option<&str>,
    ) -> PyResult<()> {
        Ok(self.inner.add_salted_request(RequestId(request_id), prompt_token_ids, max_tokens, cache_salt)?)
    }

    fn abort(&mut self, request_id: u64) -> bool {
        self.inner.abort(RequestId(request_id))
    }

    /// Prompt tokens the request's first admission found in the prefix cache (0 before it is
    /// admitted, with prefix caching off, or for an unknown id). Read once per request.
    fn num_cached_tokens(&self, request_id: u64) -> usize {
        self.inner.request(RequestId(request_id)).and_then(|r| r.num_cached_tokens).unwrap_or(0)
    }

    fn schedule(&mut self, py: Python<'_>) -> PyResult<SchedulerOutput> {
        let out = py.detach(|| self.inner.schedule())?;
        let s = &out.scheduled;
        let m = out.inputs;
        let (num_reqs, num_tokens) = (s.len(), m.input_ids.len());
        Ok(SchedulerOutput {
            req_ids: s.iter().map(|r| r.id.0 as i64).collect::<Vec<_>>().into_pyarray(py).unbind(),
            num_computed_tokens: column(s.iter().map(|r| r.num_computed_tokens)).into_pyarray(py).unbind(),
            num_new_tokens: column(s.iter().map(|r| r.num_new_tokens)).into_pyarray(py).unbind(),
            num_decodes: out.num_decodes,
            num_cpu_decodes: out.num_cpu_decodes,
            num_host_prefills: out.num_host_prefills,
            sub_batch1_start: out.sub_batch1_start,
            input_ids: m.input_ids.into_pyarray(py).unbind(),
            positions: m.positions.into_pyarray(py).unbind(),
            slot_mapping: m.slot_mapping.into_pyarray(py).reshape([m.num_groups, num_tokens])?.unbind(),
            query_start_loc: m.query_start_loc.into_pyarray(py).unbind(),
            seq_lens: m.seq_lens.into_pyarray(py).unbind(),
            block_tables: m.block_tables.into_pyarray(py).reshape([m.num_groups, num_reqs, m.max_blocks])?.unbind(),
            sample_rows: m.sample_rows.into_pyarray(py).unbind(),
            sample_ids: m.sample_ids.iter().map(|&i| i as i64).collect::<Vec<_>>().into_pyarray(py).unbind(),
            swap_out: pairs(py, &out.swap_out)?.unbind(),
            swap_in: pairs(py, &out.swap_in)?.unbind(),
            prefill_to_host: pairs(py, &out.prefill_to_host)?.unbind(),
            cache_to_host: pairs(py, &out.cache_to_host)?.unbind(),
            cache_to_device: pairs(py, &out.cache_to_device)?.unbind(),
            recomputed: out.recomputed.iter().map(|r| r.0).collect(),
            predicted: stage_times(py, &out.predicted)?.unbind(),
        })
    }

    /// Returns `[(request_id, finish_reason)]` of the requests that finished.
    #[pyo3(signature = (sampled, stopped, counts = None))]
    fn update(
        &mut self,
        py: Python<'_>,
        sampled: Vec<u32>,
        stopped: Vec<u64>,
        counts: Option<Vec<usize>>,
    ) -> PyResult<Vec<(u64, &'static str)>> {
        let stopped: Vec<RequestId> = stopped.into_iter().map(RequestId).collect();
        let counts = counts.unwrap_or_default();
        let finished = py.detach(|| self.inner.update_speculative(&sampled, &counts, &stopped))?;
        Ok(finished.into_iter().map(|(id, r)| (id.0, r.name())).collect())
    }

    /// A draft model's work before `schedule()`: `[(request_id, drafts to make, longest)]`.
    fn draft_requests(&self) -> Vec<(u64, usize, usize)> {
        self.inner.draft_requests().into_iter().map(|(id, n, longest)| (id.0, n, longest)).collect()
    }

    /// The draft model's tokens, `counts[i]` of `tokens` for `request_ids[i]`, for the next
    /// `schedule()` to verify.
    fn propose(&mut self, request_ids: Vec<u64>, tokens: Vec<u32>, counts: Vec<usize>) -> PyResult<()> {
        if request_ids.len() != counts.len() || counts.iter().sum::<usize>() != tokens.len() {
            return Err(super::InvalidArgumentError::new_err(format!(
                "propose(): {} ids, {} counts of {} tokens",
                request_ids.len(),
                counts.len(),
                tokens.len()
            )));
        }
        let mut at = 0;
        let drafts = request_ids
            .into_iter()
            .zip(counts)
            .map(|(id, n)| {
                at += n;
                (RequestId(id), tokens[at - n..at].to_vec())
            })
            .collect();
        Ok(self.inner.propose(drafts)?)
    }

    /// A draft-model round over `tokens` tokens took `layer_ms` per layer of this model.
    fn observe_draft_round(&mut self, tokens: usize, layer_ms: f64) {
        self.inner.observe_draft_round(tokens, layer_ms);
    }

    /// A draft model's scheduler following its target: request `request_id`'s tokens become
    /// `token_ids`, the KV of the tokens both share kept.
    fn rewind(&mut self, request_id: u64, token_ids: Vec<u32>) -> PyResult<()> {
        Ok(self.inner.rewind(RequestId(request_id), token_ids)?)
    }

    /// The iteration of the last `schedule()` failed: abort every request it ran or swapped.
    fn abort_step(&mut self) -> Vec<u64> {
        self.inner.abort_step().into_iter().map(|id| id.0).collect()
    }

    fn has_unfinished(&self) -> bool {
        self.inner.has_unfinished()
    }

    #[getter]
    fn num_waiting(&self) -> usize {
        self.inner.num_waiting()
    }

    #[getter]
    fn num_running(&self) -> usize {
        self.inner.num_running()
    }

    #[getter]
    fn num_swapped(&self) -> usize {
        self.inner.num_swapped()
    }

    fn num_free_blocks(&self, device_name: &str) -> PyResult<usize> {
        Ok(self.inner.kv(device(device_name)?).num_free_blocks())
    }

    fn num_total_blocks(&self, device_name: &str) -> PyResult<usize> {
        Ok(self.inner.kv(device(device_name)?).num_total_blocks())
    }

    /// Blocks of the pool registered in its prefix cache, held by requests or not.
    fn num_cached_blocks(&self, device_name: &str) -> PyResult<usize> {
        Ok(self.inner.kv(device(device_name)?).num_cached_blocks())
    }

    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.inner.stats();
        let d = PyDict::new(py);
        d.set_item("num_swapped_out", s.num_swapped_out)?;
        d.set_item("num_swapped_in", s.num_swapped_in)?;
        d.set_item("num_recomputed", s.num_recomputed)?;
        d.set_item("num_swapped_out_blocks", s.num_swapped_out_blocks)?;
        d.set_item("num_swapped_in_blocks", s.num_swapped_in_blocks)?;
        d.set_item("num_prefills_to_host", s.num_prefills_to_host)?;
        d.set_item("num_pipelined_steps", s.num_pipelined_steps)?;
        d.set_item("prefix_cache_queries", s.prefix_cache_queries)?;
        d.set_item("prefix_cache_hits", s.prefix_cache_hits)?;
        d.set_item("prefix_cache_host_hits", s.prefix_cache_host_hits)?;
        d.set_item("num_cache_blocks_to_host", s.num_cache_blocks_to_host)?;
        d.set_item("num_cache_blocks_to_device", s.num_cache_blocks_to_device)?;
        Ok(d)
    }

    /// Replace the predictor's tables (per-layer ms): `(xs, ys)` pairs for linear (by tokens),
    /// prefill attention (by prompt length) and transfer (by bytes); GPU and CPU decode as
    /// `(seqs, tokens, values row-major)`. Corrections restart at 1.
    #[allow(clippy::too_many_arguments)]
    fn set_perf_tables(
        &mut self,
        linear: (Vec<f64>, Vec<f64>),
        prefill_attn: (Vec<f64>, Vec<f64>),
        gpu_decode: (Vec<f64>, Vec<f64>, Vec<f64>),
        cpu_decode: (Vec<f64>, Vec<f64>, Vec<f64>),
        transfer: (Vec<f64>, Vec<f64>),
        launch_ms: f64,
    ) -> PyResult<()> {
        let t = |(x, y): (Vec<f64>, Vec<f64>)| Table1::new(x, y);
        *self.inner.predictor_mut() = PerfPredictor::new(
            t(linear)?,
            t(prefill_attn)?,
            Table2::new(gpu_decode.0, gpu_decode.1, gpu_decode.2)?,
            Table2::new(cpu_decode.0, cpu_decode.1, cpu_decode.2)?,
            t(transfer)?,
            launch_ms,
        );
        Ok(())
    }

    /// Fold a measured per-layer stage time into the predictor's correction of `term`
    /// (`linear`, `prefill_attn`, `gpu_decode`, `cpu_decode`, `transfer`).
    fn observe(&mut self, term_name: &str, predicted_ms: f64, measured_ms: f64) -> PyResult<()> {
        self.inner.predictor_mut().observe(term(term_name)?, predicted_ms, measured_ms);
        Ok(())
    }

    /// Measured / predicted ratio the predictor applies, per term.
    fn perf_corrections(&self) -> Vec<(&'static str, f64)> {
        let p = self.inner.predictor();
        [
            ("linear", Term::Linear),
            ("prefill_attn", Term::PrefillAttn),
            ("gpu_decode", Term::GpuDecode),
            ("cpu_decode", Term::CpuDecode),
            ("transfer", Term::Transfer),
        ]
        .into_iter()
        .map(|(n, t)| (n, p.correction(t)))
        .collect()
    }

    /// Raise `BackendError` if the KV accounting is inconsistent (tests, debugging).
    fn check_invariants(&self) -> PyResult<()> {
        self.inner.check_invariants().map_err(super::BackendError::new_err)
    }
}
