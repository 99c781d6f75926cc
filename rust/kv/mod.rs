//! Paged KV accounting for both pools (NEO's GPU and CPU KV caches): the block pool with its
//! free list, a per-device manager of block tables, and swap plans that move a whole request.
//! Under a sliding window on every layer, blocks behind the window leave the tables
//! (`BlockId::NULL`) and go back to the pool. Only ids live here; Python owns the pool tensors.

mod block_pool;
mod manager;
mod prefix;

pub use block_pool::BlockPool;
pub use manager::{KvManager, PrefixHit, SwapPlan};
pub use prefix::{chain_hashes, salt_hash, BlockHash, Evicted};

use std::fmt;

/// Where a KV block lives: the device pool or the host pool. `Gpu` is whatever device the model
/// runs on (the CPU itself when there is no GPU).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Device {
    Gpu,
    Cpu,
}

impl Device {
    pub fn name(self) -> &'static str {
        match self {
            Device::Gpu => "gpu",
            Device::Cpu => "cpu",
        }
    }
}

/// Index of a block in one pool's tensors (`[num_layers, num_blocks, ...]`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockId(pub u32);

impl BlockId {
    /// A table entry whose block was released because it lies wholly behind the sliding window
    /// of every layer: no later query reads it (vLLM's null block). Never a pool index: a pool
    /// holds fewer than `u32::MAX` blocks. Model inputs show it as block 0.
    pub const NULL: BlockId = BlockId(u32::MAX);

    pub fn is_null(self) -> bool {
        self == BlockId::NULL
    }
}

impl fmt::Display for BlockId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "#{}", self.0)
    }
}

/// Caller-chosen request id (Python numbers its requests). Defined with the block ids, since the
/// managers key block tables on it; the scheduler re-exports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RequestId(pub u64);

impl fmt::Display for RequestId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}
