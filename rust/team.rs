//! The calling thread's OpenMP team as the CPU kernels' workers (attention, `gemv`). When the device is the CPU, torch's
//! intra-op threads and the kernel's take turns on the same cores: a layer's GEMM, then its
//! attention, then the next GEMM. On a rayon pool of its own the kernel then shares each core with
//! an OpenMP worker that is still spinning after the GEMM (libgomp spins for milliseconds before it
//! sleeps), and runs slower on two threads than on one (370 -> 534 us per call here, right after a
//! GEMM). Run on the team that just ran the GEMM, the kernel takes those spinning threads instead:
//! one set of threads for all the CPU's work, never more threads than torch was given.
//!
//! The team is reached through libgomp's entry point `GOMP_parallel` (what `#pragma omp parallel`
//! compiles to, also exported by LLVM's libomp), looked up in the process at run time: torch
//! brings the runtime, and without one the kernel keeps its pool.

use std::ffi::{c_int, c_uint, c_void};
use std::panic::{self, AssertUnwindSafe};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock};

type Parallel = unsafe extern "C" fn(extern "C" fn(*mut c_void), *mut c_void, c_uint, c_uint);
type InParallel = unsafe extern "C" fn() -> c_int;

/// The OpenMP runtime's entry points, if one is loaded in this process.
#[derive(Clone, Copy)]
struct Runtime {
    parallel: Parallel,
    in_parallel: InParallel,
}

fn runtime() -> Option<Runtime> {
    static RUNTIME: OnceLock<Option<Runtime>> = OnceLock::new();
    *RUNTIME.get_or_init(|| {
        // SAFETY: dlsym on the process's global scope with NUL-terminated names; each symbol, if
        // present, is the OpenMP ABI function of the type it is cast to.
        unsafe {
            let parallel = libc::dlsym(libc::RTLD_DEFAULT, c"GOMP_parallel".as_ptr());
            let in_parallel = libc::dlsym(libc::RTLD_DEFAULT, c"omp_in_parallel".as_ptr());
            if parallel.is_null() || in_parallel.is_null() {
                return None;
            }
            Some(Runtime {
                parallel: std::mem::transmute::<*mut c_void, Parallel>(parallel),
                in_parallel: std::mem::transmute::<*mut c_void, InParallel>(in_parallel),
            })
        }
    })
}

/// A team of `threads` OpenMP threads led by whichever thread calls `for_each_init`.
#[derive(Clone, Copy)]
pub struct Team {
    runtime: Runtime,
    threads: usize,
}

impl Team {
    /// The team of `threads`, if an OpenMP runtime is loaded in this process (torch's is).
    pub fn find(threads: usize) -> Option<Team> {
        runtime().map(|runtime| Team { runtime, threads: threads.max(1) })
    }

    pub fn threads(&self) -> usize {
        self.threads
    }

    /// Whether the calling thread may lead the team: not from inside a parallel region (a nested
    /// one would get a single thread).
    pub fn usable_here(&self) -> bool {
        // SAFETY: an argument-less query of the runtime.
        unsafe { (self.runtime.in_parallel)() == 0 }
    }

    /// Runs `f(state, i)` for every `i` in `0..n` exactly once across the team, each thread with
    /// its own `state` from `init`. Threads take runs of consecutive indices from a shared counter
    /// (the kernel prefetches the next item of a run). A panic in `f` is raised here afterwards.
    pub fn for_each_init<S>(&self, n: usize, init: impl Fn() -> S + Sync, f: impl Fn(&mut S, usize) + Sync) {
        let next = AtomicUsize::new(0);
        let run = (n / (self.threads * 8)).max(1);
        let panicked = Mutex::new(None);
        let work = || {
            let body = AssertUnwindSafe(|| {
                let mut state = None;
                loop {
                    let start = next.fetch_add(run, Ordering::Relaxed);
                    if start >= n {
                        break;
                    }
                    let state = state.get_or_insert_with(&init);
                    for i in start..n.min(start + run) {
                        f(state, i);
                    }
                }
            });
            if let Err(p) = panic::catch_unwind(body) {
                // No more work for anyone; the first panic is the one re-raised.
                next.store(n, Ordering::Relaxed);
                panicked.lock().unwrap_or_else(|e| e.into_inner()).get_or_insert(p);
            }
        };
        let work: &(dyn Fn() + Sync) = &work;
        extern "C" fn trampoline(data: *mut c_void) {
            // SAFETY: `data` points at `work` below, alive until `GOMP_parallel` returns, which
            // is after every thread of the team has left this function.
            let work = unsafe { &*(data as *const &(dyn Fn() + Sync)) };
            work();
        }
        let threads = c_uint::try_from(self.threads).unwrap_or(c_uint::MAX);
        // SAFETY: the runtime's `GOMP_parallel(fn, data, num_threads, flags)`; it runs `fn(data)`
        // on every thread of the team, the caller included, and returns when all have finished.
        unsafe { (self.runtime.parallel)(trampoline, &work as *const _ as *mut c_void, threads, 0) };
        if let Some(p) = panicked.into_inner().unwrap_or_else(|e| e.into_inner()) {
            panic::resume_unwind(p);
        }
    }
}

/// `f(state, i)` for every `i` in `0..n`: on `team` where it has threads and more than one item to
/// share and this thread may lead it, else on this thread alone (a single stream's greedy token
/// is one item: waking the team for it would cost more than the item).
pub fn for_each_init<S>(team: Option<Team>, n: usize, init: impl Fn() -> S + Sync, f: impl Fn(&mut S, usize) + Sync) {
    match team {
        Some(team) if team.threads() > 1 && n > 1 && team.usable_here() => team.for_each_init(n, init, f),
        _ => {
            let mut state = init();
            (0..n).for_each(|i| f(&mut state, i));
        }
    }
}
