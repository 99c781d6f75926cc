//! CPU paged decode attention (NEO's CPU side; PACPU in the paper): one query token per
//! sequence against a paged K/V pool, optional fused append of the new token's K/V, multithreaded
//! over (sequence, KV head, chunk) with a log-sum-exp merge, SIMD tier chosen at run time.

pub mod check;
pub mod dispatch;
mod dot;
mod kernel;
mod membw;
pub mod rotation;
pub(crate) mod simd;
mod split;
pub mod types;
mod widen;

#[cfg(target_arch = "aarch64")]
pub(crate) mod aarch64;
#[cfg(target_arch = "x86_64")]
pub(crate) mod x86;

use std::ops::Range;
use std::sync::{Arc, Mutex, MutexGuard};

use rayon::{ThreadPool, ThreadPoolBuilder};

use crate::team::Team;
pub use check::{DecodeBatch, DecodeParams, PagedShape};
pub use dispatch::{DotProducts, Tier};
pub use split::Pools;
use split::Workers;
pub use types::{quantize_row, DType, Element, KvElement};

use crate::config;
use crate::error::{ensure, NeoError, Result};

/// Calls that read less K/V than this run on the calling thread: handing a call to the pool and
/// back costs tens of microseconds (45-80 in this project's 2-vCPU VMs), more than one core needs
/// to read this much (~25 us), and the engine makes such calls per layer for small CPU batches.
pub const INLINE_BELOW_BYTES: usize = 256 << 10;

/// A CPU attention engine: a SIMD tier and a persistent thread pool. Fork-safe: a child process
/// (aiohttp, torch and multiprocessing fork) gets a fresh pool on first use.
pub struct CpuAttention {
    tier: Tier,
    /// The dot products the kernel uses (`Tier::dot_products`, read once).
    dots: DotProducts,
    num_threads: usize,
    inline_below: usize,
    pool: Mutex<PoolSlot>,
    /// Where blocking calls run instead of the pool, if set (`with_team`).
    team: Option<Team>,
    /// Reusable merge workspaces, one per call in flight (calls may overlap from several threads).
    workspaces: Mutex<Vec<Vec<f32>>>,
}

struct PoolSlot {
    pid: u32,
    pool: Arc<ThreadPool>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding these locks leaves no broken invariant behind.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn build_pool(num_threads: usize) -> Result<Arc<ThreadPool>> {
    ThreadPoolBuilder::new()
        .num_threads(num_threads)
        .thread_name(|i| format!("neo-attn-{i}"))
        .build()
        .map(Arc::new)
        .map_err(|e| NeoError::Runtime(format!("cannot start the CPU attention thread pool: {e}")))
}

impl CpuAttention {
    /// `num_threads`: `None` means `NEO_RS_CPU_THREADS`, else the machine's cores.
    /// `tier`: `None` means `NEO_RS_SIMD`, else the best tier of this CPU.
    pub fn new(num_threads: Option<usize>, tier: Option<Tier>) -> Result<Self> {
        let tier = match tier {
            Some(t) => t.require()?,
            None => Tier::from_env()?,
        };
        let num_threads = match num_threads {
            Some(0) => return Err(NeoError::Value("num_threads must be at least 1".into())),
            Some(n) => n,
            None => {
                config::cpu_threads()?.unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
            }
        };
        let pool = build_pool(num_threads)?;
        Ok(CpuAttention {
            tier,
            dots: tier.dot_products(),
            num_threads,
            inline_below: INLINE_BELOW_BYTES,
            pool: Mutex::new(PoolSlot { pid: std::process::id(), pool }),
            team: None,
            workspaces: Mutex::new(Vec::new()),
        })
    }

    /// Sets the K/V size below which a call runs on the calling thread (0: always on the pool).
    pub fn with_inline_below(mut self, bytes: usize) -> Self {
        self.inline_below = bytes;
        self
    }

    /// Runs calls made outside the pool (blocking ones, and submitted ones, which the binding
    /// then runs before returning) on the calling thread's OpenMP team of `num_threads` threads
    /// when an OpenMP runtime is loaded (see `team.rs`); whether one was found is `team()`.
    pub fn with_team(mut self) -> Self {
        self.team = Team::find(self.num_threads);
        self
    }

    pub fn team(&self) -> Option<Team> {
        self.team
    }

    pub fn tier(&self) -> Tier {
        self.tier
    }

    /// The dot products the kernel reads pools with here (see `DotProducts`).
    pub fn dot_products(&self) -> DotProducts {
        self.dots
    }

    /// Keeps only the dot products `dots` allows (to compare paths; none can be added).
    pub fn with_dot_products(mut self, dots: DotProducts) -> Self {
        self.dots = DotProducts { int8: self.dots.int8 && dots.int8, bf16: self.dots.bf16 && dots.bf16 };
        self
    }

    pub fn num_threads(&self) -> usize {
        self.num_threads
    }

    /// The thread pool, rebuilt if this process is a fork of the one that built it (a forked
    /// child has the pool's bookkeeping but none of its threads).
    pub fn pool(&self) -> Result<Arc<ThreadPool>> {
        let mut slot = lock(&self.pool);
        let pid = std::process::id();
        if slot.pid != pid {
            let fresh = build_pool(self.num_threads)?;
            // The old pool's threads do not exist here; dropping it could wait on them.
            std::mem::forget(std::mem::replace(&mut slot.pool, fresh));
            slot.pid = pid;
        }
        Ok(Arc::clone(&slot.pool))
    }

    /// Whether a call over `batch` reads too little K/V to be worth handing to the pool (see
    /// `INLINE_BELOW_BYTES`). `elem_bytes`: the size of one K/V element.
    pub fn is_small(&self, shape: &PagedShape, batch: &DecodeBatch<'_>, elem_bytes: usize) -> bool {
        // Raw lengths: this may run before the batch is checked.
        let tokens = batch.seq_lens.iter().fold(0usize, |a, &l| a.saturating_add(l.max(0) as usize));
        tokens.saturating_mul(2 * shape.num_kv_heads * shape.head_dim * elem_bytes) < self.inline_below
    }

    /// Decode attention of `q` `[num_seqs, num_q_heads, head_dim]` against one pool layer
    /// (`k`, `v`: `[num_blocks, num_kv_heads, block_size, head_dim]`) into `out` (shaped like `q`).
    /// Sequences of length 0 give zeros.
    #[allow(clippy::too_many_arguments)]
    pub fn decode<E: Element>(
        &self,
        q: &[E],
        k: &[E],
        v: &[E],
        shape: &PagedShape,
        batch: &DecodeBatch<'_>,
        params: &DecodeParams,
        out: &mut [E],
    ) -> Result<()> {
        self.decode_pools(q, &Pools { k, v, k_scale: &[], v_scale: &[] }, shape, batch, params, out)
    }

    /// `decode` over pools of any `KvElement`: with int8 pools, whose rows (one token of one KV
    /// head) are `scale * k`, `kv` carries the row scales of the layer, `[num_blocks,
    /// num_kv_heads, block_size]`.
    pub fn decode_pools<E: Element, K: KvElement>(
        &self,
        q: &[E],
        kv: &Pools<'_, K>,
        shape: &PagedShape,
        batch: &DecodeBatch<'_>,
        params: &DecodeParams,
        out: &mut [E],
    ) -> Result<()> {
        check::check_decode(shape, batch, params, q.len(), kv.k.len(), kv.v.len(), out.len())?;
        if K::SCALED {
            check::check_scales(shape, kv.k_scale.len(), kv.v_scale.len())?;
        }
        self.run(q, kv, shape, batch, params, out)
    }

    /// `decode` after writing each sequence's new K/V row `[num_seqs, num_kv_heads, head_dim]` at
    /// position `seq_len - 1` (how CPU-resident requests grow their cache). Nothing is written
    /// unless every input is valid.
    #[allow(clippy::too_many_arguments)]
    pub fn append_and_decode<E: Element>(
        &self,
        q: &[E],
        k: &mut [E],
        v: &mut [E],
        shape: &PagedShape,
        batch: &DecodeBatch<'_>,
        params: &DecodeParams,
        new_k: &[E],
        new_v: &[E],
        out: &mut [E],
    ) -> Result<()> {
        let kv = PoolsMut::Separate { k, v, k_scale: &mut [], v_scale: &mut [] };
        self.append_and_decode_pools(q, kv, shape, batch, params, new_k, new_v, out)
    }

    /// `append_and_decode` over pools of any `KvElement` (int8 pools quantize the new rows, one
    /// scale per KV head, into their row scales).
    #[allow(clippy::too_many_arguments)]
    pub fn append_and_decode_pools<E: Element, K: KvElement>(
        &self,
        q: &[E],
        mut kv: PoolsMut<'_, K>,
        shape: &PagedShape,
        batch: &DecodeBatch<'_>,
        params: &DecodeParams,
        new_k: &[E],
        new_v: &[E],
        out: &mut [E],
    ) -> Result<()> {
        let interleaved = matches!(kv, PoolsMut::Interleaved { .. });
        ensure!(interleaved == shape.interleaved, Shape, "the pools' layout differs from the shape's");
        {
            let view = kv.shared(shape);
            check::check_decode(shape, batch, params, q.len(), view.k.len(), view.v.len(), out.len())?;
            if K::SCALED {
                check::check_scales(shape, view.k_scale.len(), view.v_scale.len())?;
            }
        }
        check::check_append(shape, batch, new_k.len(), new_v.len())?;
        let (tile, bs) = (shape.tile(), shape.block_size);
        // Rows are head_dim long, at most MAX_HEAD_DIM (checked above).
        let store = |src: &[E], dst: &mut [K]| {
            K::store_row(src, dst, |s, d| rotation::quantize_kv_row(s, d, &mut [0.0; check::MAX_HEAD_DIM]))
        };
        for_each_new_row(shape, batch, |src, dst, row| {
            // K's slot, then V's: the same offsets in separate pools, one tile on when interleaved.
            let (k_scale, v_scale) = match &mut kv {
                PoolsMut::Separate { k, v, .. } => {
                    (store(&new_k[src.clone()], &mut k[dst.clone()]), store(&new_v[src], &mut v[dst]))
                }
                PoolsMut::Interleaved { kv, .. } => {
                    let v_dst = dst.start + tile..dst.end + tile;
                    (store(&new_k[src.clone()], &mut kv[dst]), store(&new_v[src], &mut kv[v_dst]))
                }
            };
            if K::SCALED {
                match &mut kv {
                    PoolsMut::Separate { k_scale: ks, v_scale: vs, .. } => (ks[row], vs[row]) = (k_scale, v_scale),
                    PoolsMut::Interleaved { scales, .. } => (scales[row], scales[row + bs]) = (k_scale, v_scale),
                }
            }
        });
        self.run(q, &kv.shared(shape), shape, batch, params, out)
    }

    fn run<E: Element, K: KvElement>(
        &self,
        q: &[E],
        kv: &Pools<'_, K>,
        shape: &PagedShape,
        batch: &DecodeBatch<'_>,
        params: &DecodeParams,
        out: &mut [E],
    ) -> Result<()> {
        let kernel = self.tier.kernel::<E, K>(self.dots)?;
        let pool;
        // One thread, or little work: the calling thread does it (no hand-off to wait for).
        let workers = if self.num_threads == 1 || self.is_small(shape, batch, size_of::<K>()) {
            Workers::Caller
        } else {
            pool = self.pool()?;
            match self.team {
                // Submitted jobs run on the pool's threads, which lead no team of torch's.
                Some(team) if pool.current_thread_index().is_none() && team.usable_here() => Workers::Team(team),
                _ => Workers::Pool(&pool),
            }
        };
        let mut ws = lock(&self.workspaces).pop().unwrap_or_default();
        split::run(&kernel, &workers, q, kv, shape, batch, params, out, &mut ws);
        lock(&self.workspaces).push(ws);
        Ok(())
    }
}

/// One layer of the K and V pools, writable for the fused append, with their row scales when `K`
/// is scaled (else empty).
pub enum PoolsMut<'a, K> {
    Separate {
        k: &'a mut [K],
        v: &'a mut [K],
        k_scale: &'a mut [f32],
        v_scale: &'a mut [f32],
    },
    /// One layer of an interleaved pool and of its row scales (`PagedShape::interleaved`).
    Interleaved {
        kv: &'a mut [K],
        scales: &'a mut [f32],
    },
}

impl<K> PoolsMut<'_, K> {
    /// The layer as the kernel reads it.
    fn shared(&self, shape: &PagedShape) -> Pools<'_, K> {
        match self {
            PoolsMut::Separate { k, v, k_scale, v_scale } => Pools { k, v, k_scale, v_scale },
            PoolsMut::Interleaved { kv, scales } => Pools::interleaved(kv, scales, shape),
        }
    }
}

/// For each sequence's new token and each KV head (inputs already checked): the range of its
/// row in `new_k`/`new_v`, of its slot in the layer's K slice (as `Pools` has it), and its index
/// in the K row scales. Serial: a few KiB per sequence, and two sequences naming the same slot
/// must not race.
fn for_each_new_row(shape: &PagedShape, batch: &DecodeBatch<'_>, mut f: impl FnMut(Range<usize>, Range<usize>, usize)) {
    let (bs, d, hkv) = (shape.block_size, shape.head_dim, shape.num_kv_heads);
    for s in 0..batch.num_seqs() {
        let pos = batch.len(s) - 1;
        let block = batch.row(s)[pos / bs] as usize;
        for h in 0..hkv {
            let row = (block * hkv + h) * shape.tile_stride() * bs + pos % bs;
            let src = (s * hkv + h) * d;
            f(src..src + d, row * d..(row + 1) * d, row);
        }
    }
}
