//! `CpuAttention` for Python: blocking `forward` and asynchronous `submit` (a handle whose
//! `wait()` releases the GIL), so Python can keep launching device work while the Rust pool
//! runs CPU attention.

use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use half::{bf16, f16};
use pyo3::prelude::*;

use super::tensor::{overlaps, Kind, TensorRef};
use crate::attn::{
    self, DType, DecodeBatch, DecodeParams, DotProducts, Element, KvElement, PagedShape, Pools, PoolsMut, Tier,
};
use crate::error::{ensure, NeoError, Result};

/// A checked call: raw addresses and sizes of every tensor, valid while the tensors live.
struct Call {
    /// Of q, out and the new rows; of the pools too unless `scales` is set.
    dtype: DType,
    /// With int8 pools: the addresses of this layer's K and V row scales (f32).
    scales: Option<(usize, usize)>,
    shape: PagedShape,
    num_seqs: usize,
    max_blocks: usize,
    params: DecodeParams,
    q: usize,
    k_layer: usize,
    v_layer: usize,
    tables: usize,
    lens: usize,
    out: usize,
    append: Option<(usize, usize)>,
}

impl Call {
    #[allow(clippy::too_many_arguments)]
    fn prepare(
        q: &TensorRef,
        k: &TensorRef,
        v: &TensorRef,
        layer: usize,
        tables: &TensorRef,
        lens: &TensorRef,
        kind: DecodeParams,
        out: &TensorRef,
        new_kv: Option<(&TensorRef, &TensorRef)>,
        scales: Option<(&TensorRef, &TensorRef)>,
    ) -> Result<Call> {
        let dtype = q.float()?;
        let int8 = k.kind == Kind::Int8;
        let mut floats = vec![out];
        if !int8 {
            floats.extend([k, v]);
        }
        floats.extend(new_kv.iter().flat_map(|(a, b)| [*a, *b]));
        for t in &floats {
            ensure!(t.float()? == dtype, DType, "{} is {}, but q is {}", t.name, t.float()?.name(), dtype.name());
        }
        ensure!(
            (v.kind == Kind::Int8) == int8 && int8 == scales.is_some(),
            DType,
            "int8 k_cache and v_cache go with k_scale and v_scale; float caches without them"
        );
        let qd = q.dims(3)?;
        let kd = k.dims(5)?;
        ensure!(v.shape == k.shape, Shape, "v_cache shape {:?} differs from k_cache {:?}", v.shape, k.shape);
        let pools = [Some((k, v)), scales];
        let interleaved = !pools.iter().flatten().all(|(a, b)| a.contiguous && b.contiguous);
        ensure!(
            !interleaved || pools.iter().flatten().all(|(a, b)| interleaved_halves(a, b)),
            Value,
            "k_cache and v_cache (and k_scale and v_scale) must be contiguous, or the halves x[:, :, :, 0] and \
             x[:, :, :, 1] of one contiguous tensor x of [num_layers, num_blocks, num_kv_heads, 2, ...]"
        );
        if let Some((ks, vs)) = scales {
            for t in [ks, vs] {
                ensure!(t.float()? == DType::F32, DType, "{} must be float32", t.name);
                ensure!(t.shape == kd[..4], Shape, "{} must be {:?} (the cache without head_dim)", t.name, &kd[..4]);
            }
        }
        ensure!(out.shape == q.shape, Shape, "out shape {:?} differs from q {:?}", out.shape, q.shape);
        tables.require_int32()?;
        lens.require_int32()?;
        let td = tables.dims(2)?;
        let num_seqs = lens.dims(1)?[0];
        ensure!(qd[0] == num_seqs && td[0] == num_seqs, Shape, "q, block_tables and seq_lens disagree on num_seqs");
        ensure!(layer < kd[0], Value, "layer {layer} is out of range for {} layers", kd[0]);
        ensure!(qd[2] == kd[4], Shape, "q head_dim {} differs from the cache's {}", qd[2], kd[4]);
        let shape =
            PagedShape { num_blocks: kd[1], num_kv_heads: kd[2], block_size: kd[3], head_dim: kd[4], interleaved };
        // Bytes of one layer of the pool(s): K and V together when interleaved.
        let layer_bytes = shape.layer_numel().unwrap_or(usize::MAX).saturating_mul(k.elem_size() * shape.tile_stride());
        let k_layer = k.addr + layer * layer_bytes;
        let v_layer = v.addr + layer * layer_bytes;
        let scale_bytes = shape.num_blocks * shape.num_kv_heads * shape.block_size * 4 * shape.tile_stride();
        let scale_layers = scales.map(|(ks, vs)| (ks.addr + layer * scale_bytes, vs.addr + layer * scale_bytes));
        // What the call may touch of the pools, by name: an interleaved pool's layer is one range.
        let mut caches: Vec<(&str, Range<usize>)> = Vec::new();
        if interleaved {
            caches.push(("k_cache/v_cache", k_layer..k_layer + layer_bytes));
            caches.extend(scale_layers.map(|(ks, _)| ("k_scale/v_scale", ks..ks + scale_bytes)));
        } else {
            caches.extend([("k_cache", k_layer..k_layer + layer_bytes), ("v_cache", v_layer..v_layer + layer_bytes)]);
            if let Some((ks, vs)) = scale_layers {
                caches.extend([("k_scale", ks..ks + scale_bytes), ("v_scale", vs..vs + scale_bytes)]);
            }
        }
        if let Some((nk, nv)) = new_kv {
            let want = [num_seqs, shape.num_kv_heads, shape.head_dim];
            ensure!(nk.shape == want && nv.shape == want, Shape, "new_k/new_v must be {want:?}");
        }
        // Nothing written may alias anything else: `out` always, the cache layers when appending.
        let mut written: Vec<(&str, Range<usize>)> = vec![(out.name, out.bytes())];
        if new_kv.is_some() {
            written.extend(caches.iter().cloned());
        }
        let mut all: Vec<(&str, Range<usize>)> = vec![
            (q.name, q.bytes()),
            (tables.name, tables.bytes()),
            (lens.name, lens.bytes()),
            (out.name, out.bytes()),
        ];
        all.extend(caches);
        all.extend(new_kv.iter().flat_map(|(a, b)| [(a.name, a.bytes()), (b.name, b.bytes())]));
        for (wn, w) in &written {
            for (n, r) in &all {
                ensure!(wn == n || !overlaps(w, r), Value, "{wn} overlaps {n} in memory");
            }
        }
        Ok(Call {
            dtype,
            scales: scale_layers,
            shape,
            num_seqs,
            max_blocks: td[1],
            params: DecodeParams { num_q_heads: qd[1], ..kind },
            q: q.addr,
            k_layer,
            v_layer,
            tables: tables.addr,
            lens: lens.addr,
            out: out.addr,
            append: new_kv.map(|(a, b)| (a.addr, b.addr)),
        })
    }

    /// # Safety
    /// The tensors `prepare` saw must still be alive and unchanged in size, and nothing else may
    /// write them (or read what this call writes) until it returns.
    unsafe fn execute(&self, engine: &attn::CpuAttention) -> Result<()> {
        // SAFETY: forwarded caller contract.
        unsafe {
            match (self.dtype, self.scales.is_some()) {
                (DType::F32, false) => self.run::<f32, f32>(engine),
                (DType::F16, false) => self.run::<f16, f16>(engine),
                (DType::BF16, false) => self.run::<bf16, bf16>(engine),
                (DType::F32, true) => self.run::<f32, i8>(engine),
                (DType::F16, true) => self.run::<f16, i8>(engine),
                (DType::BF16, true) => self.run::<bf16, i8>(engine),
            }
        }
    }

    /// The block tables and lengths.
    ///
    /// # Safety
    /// As for `execute`: the tensors `prepare` saw are alive.
    unsafe fn batch(&self) -> DecodeBatch<'_> {
        // SAFETY: live, contiguous int32 CPU tensors of these sizes (checked in `prepare`).
        unsafe {
            DecodeBatch {
                block_tables: std::slice::from_raw_parts(self.tables as *const i32, self.num_seqs * self.max_blocks),
                max_blocks_per_seq: self.max_blocks,
                seq_lens: std::slice::from_raw_parts(self.lens as *const i32, self.num_seqs),
            }
        }
    }

    /// Whether `engine` finds this call too small to hand to its pool.
    ///
    /// # Safety
    /// As for `execute`.
    unsafe fn is_small(&self, engine: &attn::CpuAttention) -> bool {
        let elem_bytes = if self.scales.is_some() { 1 } else { self.dtype.size_bytes() };
        // SAFETY: forwarded caller contract.
        engine.is_small(&self.shape, &unsafe { self.batch() }, elem_bytes)
    }

    /// # Safety
    /// As for `execute`; the caches hold `K` (int8 when `scales` is set, else `E`).
    unsafe fn run<E: Element, K: KvElement>(&self, engine: &attn::CpuAttention) -> Result<()> {
        let qn = self.num_seqs * self.params.num_q_heads * self.shape.head_dim;
        // Elements (and row scales) of one layer of the pool(s): K and V together when interleaved.
        let stride = self.shape.tile_stride();
        let layer = self.shape.layer_numel().ok_or_else(|| NeoError::Shape("cache too large".into()))?;
        let new_n = self.num_seqs * self.shape.num_kv_heads * self.shape.head_dim;
        let rows = if self.scales.is_some() { layer / self.shape.head_dim } else { 0 };
        let (layer, rows) = (layer * stride, rows * stride);
        // Without scales: empty slices, at a well-aligned dangling address as empty slices need.
        let dangling = std::ptr::NonNull::<f32>::dangling().as_ptr() as usize;
        let (ks, vs) = self.scales.unwrap_or((dangling, dangling));
        // SAFETY: addresses and element counts come from live, contiguous CPU tensors of these
        // dtypes (checked in `prepare`, kept alive by the caller; no scales means empty scale
        // slices, never read); written ranges were checked not to overlap anything else the call
        // touches.
        unsafe {
            let q = std::slice::from_raw_parts(self.q as *const E, qn);
            let out = std::slice::from_raw_parts_mut(self.out as *mut E, qn);
            let batch = self.batch();
            // Shared slices unless the call writes the caches (other calls may read them).
            let shared = |addr: usize, n: usize| std::slice::from_raw_parts(addr as *const K, n);
            let scales = |addr: usize| std::slice::from_raw_parts(addr as *const f32, rows);
            match self.append {
                None if self.shape.interleaved => {
                    let kv = Pools::interleaved(shared(self.k_layer, layer), scales(ks), &self.shape);
                    engine.decode_pools(q, &kv, &self.shape, &batch, &self.params, out)
                }
                None => {
                    let (k, v) = (shared(self.k_layer, layer), shared(self.v_layer, layer));
                    let kv = Pools { k, v, k_scale: scales(ks), v_scale: scales(vs) };
                    engine.decode_pools(q, &kv, &self.shape, &batch, &self.params, out)
                }
                Some((nk, nv)) => {
                    let kv = if self.shape.interleaved {
                        PoolsMut::Interleaved {
                            kv: std::slice::from_raw_parts_mut(self.k_layer as *mut K, layer),
                            scales: std::slice::from_raw_parts_mut(ks as *mut f32, rows),
                        }
                    } else {
                        PoolsMut::Separate {
                            k: std::slice::from_raw_parts_mut(self.k_layer as *mut K, layer),
                            v: std::slice::from_raw_parts_mut(self.v_layer as *mut K, layer),
                            k_scale: std::slice::from_raw_parts_mut(ks as *mut f32, rows),
                            v_scale: std::slice::from_raw_parts_mut(vs as *mut f32, rows),
                        }
                    };
                    let nk = std::slice::from_raw_parts(nk as *const E, new_n);
                    let nv = std::slice::from_raw_parts(nv as *const E, new_n);
                    engine.append_and_decode_pools(q, kv, &self.shape, &batch, &self.params, nk, nv, out)
                }
            }
        }
    }
}

/// CPU paged decode attention over torch CPU tensors (see `_core.pyi`).
#[pyclass(module = "neo_rs._core", frozen)]
pub(crate) struct CpuAttention {
    engine: Arc<attn::CpuAttention>,
}

/// The tensors of one call: q, k_cache, v_cache, block_tables, seq_lens, out, then the optional
/// pairs (new_k, new_v) and (k_scale, v_scale).
type Args<'py> = ([Bound<'py, PyAny>; 6], [Option<Bound<'py, PyAny>>; 2], [Option<Bound<'py, PyAny>>; 2]);

/// Both tensors of an optional pair (each taken by `extract`), or neither.
fn pair(
    p: &[Option<Bound<'_, PyAny>>; 2],
    names: [&'static str; 2],
    extract: fn(&Bound<'_, PyAny>, &'static str) -> PyResult<TensorRef>,
) -> PyResult<Option<(TensorRef, TensorRef)>> {
    match p {
        [Some(a), Some(b)] => Ok(Some((extract(a, names[0])?, extract(b, names[1])?))),
        [None, None] => Ok(None),
        _ => Err(NeoError::Value(format!("pass both {} and {}, or neither", names[0], names[1])).into()),
    }
}

/// The scale and attention kind of a call (`num_q_heads` comes from q's shape in `Call::prepare`).
fn kind(scale: f32, window: Option<usize>, softcap: Option<f32>) -> DecodeParams {
    DecodeParams { window, softcap, ..DecodeParams::new(0, scale) }
}

fn prepare(args: &Args<'_>, layer: usize, kind: DecodeParams) -> PyResult<Call> {
    let ([q, k, v, tables, lens, out], new, scales) = args;
    let new_kv = pair(new, ["new_k", "new_v"], TensorRef::extract)?;
    let scales = pair(scales, ["k_scale", "v_scale"], TensorRef::extract_view)?;
    Ok(Call::prepare(
        &TensorRef::extract(q, "q")?,
        &TensorRef::extract_view(k, "k_cache")?,
        &TensorRef::extract_view(v, "v_cache")?,
        layer,
        &TensorRef::extract(tables, "block_tables")?,
        &TensorRef::extract(lens, "seq_lens")?,
        kind,
        &TensorRef::extract(out, "out")?,
        new_kv.as_ref().map(|(a, b)| (a, b)),
        scales.as_ref().map(|(a, b)| (a, b)),
    )?)
}

/// Whether `a` and `b` (the K and V caches, or their row scales) are the halves `x[:, :, :, 0]`
/// and `x[:, :, :, 1]` of one contiguous tensor `x` of `[num_layers, num_blocks, num_kv_heads,
/// 2, ...]`: an interleaved pool (`PagedShape::interleaved`).
fn interleaved_halves(a: &TensorRef, b: &TensorRef) -> bool {
    let n = a.shape.len();
    let views = !a.contiguous && !b.contiguous;
    if !views || n < 4 || a.shape != b.shape || a.strides != b.strides || a.kind != b.kind {
        return false;
    }
    let mut want = vec![0; n];
    let mut step = 1;
    for i in (0..n).rev() {
        want[i] = step;
        // Past a (block, KV head)'s tile comes the other half's.
        step *= a.shape[i] * if i == 3 { 2 } else { 1 };
    }
    let tile: usize = a.shape[3..].iter().product();
    (0..n).all(|i| a.shape[i] == 1 || a.strides[i] == want[i]) && b.addr == a.addr + tile * a.elem_size()
}

/// Completion slot shared by a submitted job and its handle, with how long the job ran.
#[derive(Default)]
struct Completion {
    result: Mutex<Option<Result<()>>>,
    done: Condvar,
    run_ns: AtomicU64,
}

impl Completion {
    fn finish(&self, r: Result<()>, ran: Duration) {
        self.run_ns.store(u64::try_from(ran.as_nanos()).unwrap_or(u64::MAX), Ordering::Relaxed);
        *self.result.lock().unwrap_or_else(|e| e.into_inner()) = Some(r);
        self.done.notify_all();
    }

    fn wait(&self) -> Result<()> {
        let mut slot = self.result.lock().unwrap_or_else(|e| e.into_inner());
        while slot.is_none() {
            slot = self.done.wait(slot).unwrap_or_else(|e| e.into_inner());
        }
        slot.clone().unwrap_or(Ok(()))
    }

    fn is_done(&self) -> bool {
        self.result.lock().unwrap_or_else(|e| e.into_inner()).is_some()
    }
}

#[pymethods]
impl CpuAttention {
    #[new]
    #[pyo3(signature = (num_threads=None, simd=None, openmp_team=false, dot_products=true))]
    fn new(num_threads: Option<usize>, simd: Option<&str>, openmp_team: bool, dot_products: bool) -> PyResult<Self> {
        let tier = simd.map(Tier::parse).transpose()?;
        let engine = attn::CpuAttention::new(num_threads, tier)?;
        let engine = if openmp_team { engine.with_team() } else { engine };
        let engine = if dot_products { engine } else { engine.with_dot_products(DotProducts::default()) };
        Ok(CpuAttention { engine: Arc::new(engine) })
    }

    /// Whether `forward` runs on the calling thread's OpenMP team (asked for with
    /// `openmp_team=True`, and an OpenMP runtime is loaded).
    #[getter]
    fn openmp_team(&self) -> bool {
        self.engine.team().is_some()
    }

    #[getter]
    fn simd(&self) -> &'static str {
        self.engine.tier().name()
    }

    #[getter]
    fn num_threads(&self) -> usize {
        self.engine.num_threads()
    }

    /// Whether int8 caches are read by integer dot products: q·k against q quantized per head
    /// after the softmax scale, p·v against p quantized to int16 per head and step of blocks (AVX-512
    /// VNNI, or AVX-VNNI on the AVX2 tier; on Arm's DotProd q·k alone; unless
    /// `NEO_RS_INT8_DOT=0`).
    #[getter]
    fn int8_dot(&self) -> bool {
        self.engine.dot_products().int8
    }

    /// Whether bf16 caches are read by bf16 dot products: q·k against q as bf16, p·v against
    /// the probabilities rounded to bf16, f32 accumulation (AVX512_BF16, unless
    /// `NEO_RS_BF16_DOT=0`).
    #[getter]
    fn bf16_dot(&self) -> bool {
        self.engine.dot_products().bf16
    }

    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (q, k_cache, v_cache, layer, block_tables, seq_lens, scale, out, new_k=None, new_v=None, k_scale=None, v_scale=None, window=None, softcap=None))]
    fn forward<'py>(
        &self,
        py: Python<'py>,
        q: Bound<'py, PyAny>,
        k_cache: Bound<'py, PyAny>,
        v_cache: Bound<'py, PyAny>,
        layer: usize,
        block_tables: Bound<'py, PyAny>,
        seq_lens: Bound<'py, PyAny>,
        scale: f32,
        out: Bound<'py, PyAny>,
        new_k: Option<Bound<'py, PyAny>>,
        new_v: Option<Bound<'py, PyAny>>,
        k_scale: Option<Bound<'py, PyAny>>,
        v_scale: Option<Bound<'py, PyAny>>,
        window: Option<usize>,
        softcap: Option<f32>,
    ) -> PyResult<()> {
        let args = ([q, k_cache, v_cache, block_tables, seq_lens, out], [new_k, new_v], [k_scale, v_scale]);
        let call = prepare(&args, layer, kind(scale, window, softcap))?;
        let engine = &self.engine;
        // SAFETY: `args` holds every tensor alive across the call; torch cannot resize them
        // while this thread is inside the call, and callers must not write them concurrently.
        py.detach(|| unsafe { call.execute(engine) })?;
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (q, k_cache, v_cache, layer, block_tables, seq_lens, scale, out, new_k=None, new_v=None, k_scale=None, v_scale=None, window=None, softcap=None))]
    fn submit<'py>(
        &self,
        py: Python<'py>,
        q: Bound<'py, PyAny>,
        k_cache: Bound<'py, PyAny>,
        v_cache: Bound<'py, PyAny>,
        layer: usize,
        block_tables: Bound<'py, PyAny>,
        seq_lens: Bound<'py, PyAny>,
        scale: f32,
        out: Bound<'py, PyAny>,
        new_k: Option<Bound<'py, PyAny>>,
        new_v: Option<Bound<'py, PyAny>>,
        k_scale: Option<Bound<'py, PyAny>>,
        v_scale: Option<Bound<'py, PyAny>>,
        window: Option<usize>,
        softcap: Option<f32>,
    ) -> PyResult<AttentionHandle> {
        let args = ([q, k_cache, v_cache, block_tables, seq_lens, out], [new_k, new_v], [k_scale, v_scale]);
        let call = prepare(&args, layer, kind(scale, window, softcap))?;
        let (tensors, new, scales) = args;
        let mut keep: Vec<Py<PyAny>> = tensors.into_iter().map(Bound::unbind).collect();
        keep.extend(new.into_iter().chain(scales).flatten().map(Bound::unbind));
        // SAFETY: `keep` holds the tensors alive here.
        let small = unsafe { call.is_small(&self.engine) };
        let completion = Arc::new(Completion::default());
        let (job_done, engine) = (Arc::clone(&completion), Arc::clone(&self.engine));
        let job = move || {
            let start = Instant::now();
            // SAFETY: the handle keeps every tensor alive until this job finishes (its drop
            // waits for completion); callers must not touch them before `wait()`.
            let r = unsafe { call.execute(&engine) };
            job_done.finish(r, start.elapsed());
        };
        // On a CPU device (an engine with an OpenMP team) the model's OpenMP threads spin on the
        // same cores between torch's ops, so the pool's threads would only contend with them:
        // SmolLM2's 64 CPU decodes under `--offload all` took 22.9 ms of kernel time a step on the
        // pool, 9.6 ms with those threads passive. The calling thread's team runs it instead.
        let on_team = self.engine.team().is_some_and(|team| team.usable_here());
        if small || on_team {
            // Less work than handing it to the pool costs, or the team does it: done before
            // returning.
            py.detach(job);
        } else {
            self.engine.pool()?.spawn(job);
        }
        Ok(AttentionHandle { completion, _keep: keep })
    }

    /// Reads every byte of a CPU tensor once on this engine's pool (GIL released) and returns a
    /// checksum: time it for the read bandwidth the kernel is compared against.
    fn stream_read(&self, py: Python<'_>, buf: Bound<'_, PyAny>) -> PyResult<u64> {
        let t = TensorRef::extract(&buf, "buf")?;
        let bytes = t.numel() * t.elem_size();
        ensure!(t.addr.is_multiple_of(8) && bytes.is_multiple_of(8), Value, "buf must be 8-byte aligned and sized");
        let engine = &self.engine;
        // SAFETY: a live, contiguous CPU tensor of `bytes` bytes at an 8-aligned address, held by
        // `buf` for the whole call; it is only read.
        let words = unsafe { std::slice::from_raw_parts(t.addr as *const u64, bytes / 8) };
        Ok(py.detach(|| engine.stream_read(words))?)
    }

    /// Reads the `run_bytes`-byte runs of a CPU tensor at the run indices of the int32 tensor
    /// `order`, in that order, on this engine's pool (GIL released), and returns a checksum: time
    /// it for what the kernel's access pattern alone reaches.
    fn gather_read(
        &self,
        py: Python<'_>,
        buf: Bound<'_, PyAny>,
        run_bytes: usize,
        order: Bound<'_, PyAny>,
    ) -> PyResult<u64> {
        let (t, o) = (TensorRef::extract(&buf, "buf")?, TensorRef::extract(&order, "order")?);
        o.require_int32()?;
        let bytes = t.numel() * t.elem_size();
        ensure!(
            t.addr.is_multiple_of(8) && bytes.is_multiple_of(8) && run_bytes.is_multiple_of(8),
            Value,
            "buf and run_bytes must be 8-byte aligned and sized"
        );
        let engine = &self.engine;
        // SAFETY: live, contiguous CPU tensors (`bytes` bytes at an 8-aligned address; `order`'s
        // int32 elements), held by `buf` and `order` for the whole call; both are only read.
        let (words, order) = unsafe {
            (
                std::slice::from_raw_parts(t.addr as *const u64, bytes / 8),
                std::slice::from_raw_parts(o.addr as *const i32, o.numel()),
            )
        };
        Ok(py.detach(|| engine.gather_read(words, run_bytes / 8, order))?)
    }

    fn __repr__(&self) -> String {
        format!("CpuAttention(simd={:?}, num_threads={})", self.simd(), self.num_threads())
    }
}

/// A submitted CPU attention call. `wait()` blocks (without the GIL) until it is done and
/// raises its error, if any. Dropping an unfinished handle waits for it too.
#[pyclass(module = "neo_rs._core", frozen)]
pub(crate) struct AttentionHandle {
    completion: Arc<Completion>,
    _keep: Vec<Py<PyAny>>,
}

#[pymethods]
impl AttentionHandle {
    fn wait(&self, py: Python<'_>) -> PyResult<()> {
        let c = &self.completion;
        Ok(py.detach(|| c.wait())?)
    }

    fn done(&self) -> bool {
        self.completion.is_done()
    }

    /// Milliseconds the call ran on the pool (from its start, not its submission); None until done.
    #[getter]
    fn run_ms(&self) -> Option<f64> {
        let c = &self.completion;
        c.is_done().then(|| c.run_ns.load(Ordering::Relaxed) as f64 / 1e6)
    }
}

impl Drop for AttentionHandle {
    fn drop(&mut self) {
        if !self.completion.is_done() {
            let c = &self.completion;
            Python::attach(|py| py.detach(|| c.wait())).ok();
        }
    }
}
