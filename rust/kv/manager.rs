//! One pool's KV manager (vLLM's `KvCacheManager`): a block table per request, grown by
//! `allocate_slots` (which answers "no room" instead of failing), and whole-request swap plans.

use std::collections::HashMap;

use super::{BlockId, BlockPool, Device};
use crate::sched::RequestId;

#[derive(Debug, Clone)]
pub struct KvManager {
    device: Device,
    block_size: usize,
    pool: BlockPool,
    tables: HashMap<RequestId, Vec<BlockId>>,
}

/// Block pairs `(src, dst)` that move one or more requests from pool `src` to pool `dst`; every
/// layer of K and V is copied for each pair.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SwapPlan {
    pub src: Device,
    pub dst: Device,
    pub pairs: Vec<(BlockId, BlockId)>,
}

impl SwapPlan {
    pub fn new(src: Device, dst: Device) -> Self {
        SwapPlan { src, dst, pairs: Vec::new() }
    }
}

impl KvManager {
    pub fn new(device: Device, num_blocks: u32, block_size: usize) -> Self {
        assert!(block_size > 0, "block_size must be positive");
        KvManager { device, block_size, pool: BlockPool::new(num_blocks), tables: HashMap::new() }
    }

    pub fn device(&self) -> Device {
        self.device
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn pool(&self) -> &BlockPool {
        &self.pool
    }

    pub fn num_free_blocks(&self) -> usize {
        self.pool.num_free()
    }

    pub fn num_total_blocks(&self) -> usize {
        self.pool.num_blocks()
    }

    /// Blocks that hold `num_tokens` tokens.
    pub fn blocks_for(&self, num_tokens: usize) -> usize {
        num_tokens.div_ceil(self.block_size)
    }

    /// The request's block table (empty when it holds no blocks here).
    pub fn table(&self, id: RequestId) -> &[BlockId] {
        self.tables.get(&id).map_or(&[], Vec::as_slice)
    }

    pub fn holds(&self, id: RequestId) -> bool {
        self.tables.contains_key(&id)
    }

    /// Every request with blocks here and its table (tests and invariant checks).
    pub fn tables(&self) -> impl Iterator<Item = (RequestId, &[BlockId])> {
        self.tables.iter().map(|(&id, t)| (id, t.as_slice()))
    }

    /// New blocks the request needs so its table covers `num_tokens` tokens.
    pub fn blocks_needed(&self, id: RequestId, num_tokens: usize) -> usize {
        self.blocks_for(num_tokens).saturating_sub(self.table(id).len())
    }

    /// Grow the request's table to cover `num_tokens` tokens. `false` (and nothing allocated)
    /// when the pool has no room.
    pub fn allocate_slots(&mut self, id: RequestId, num_tokens: usize) -> bool {
        let need = self.blocks_needed(id, num_tokens);
        if need == 0 {
            return true;
        }
        match self.pool.allocate(need) {
            Some(blocks) => {
                self.tables.entry(id).or_default().extend(blocks);
                true
            }
            None => false,
        }
    }

    /// Free every block of the request (a no-op when it holds none here).
    pub fn free(&mut self, id: RequestId) {
        if let Some(blocks) = self.tables.remove(&id) {
            self.pool.free(&blocks);
        }
    }

    /// Move request `id` wholly from `self` to `dst`: allocate its blocks in `dst`, free them
    /// here, and append the block pairs to `plan`. `false` (nothing changed) when `dst` has no room.
    pub fn swap_to(&mut self, dst: &mut KvManager, id: RequestId, plan: &mut SwapPlan) -> bool {
        debug_assert!(plan.src == self.device && plan.dst == dst.device && self.block_size == dst.block_size);
        debug_assert!(!dst.holds(id), "request {id} already holds blocks in the destination pool");
        let Some(src_blocks) = self.tables.remove(&id) else { return true };
        let Some(dst_blocks) = dst.pool.allocate(src_blocks.len()) else {
            self.tables.insert(id, src_blocks);
            return false;
        };
        plan.pairs.extend(src_blocks.iter().copied().zip(dst_blocks.iter().copied()));
        self.pool.free(&src_blocks);
        dst.tables.insert(id, dst_blocks);
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocate_grows_and_answers_no_room() {
        let mut m = KvManager::new(Device::Gpu, 3, 4);
        let (a, b) = (RequestId(1), RequestId(2));
        assert!(m.allocate_slots(a, 5));
        assert_eq!(m.table(a).len(), 2);
        assert!(m.allocate_slots(a, 8));
        assert_eq!(m.table(a).len(), 2);
        assert!(!m.allocate_slots(b, 5));
        assert!(!m.holds(b));
        assert!(m.allocate_slots(b, 4));
        assert_eq!(m.num_free_blocks(), 0);
        m.free(a);
        m.free(b);
        assert_eq!(m.num_free_blocks(), 3);
    }

    #[test]
    fn swap_moves_every_block_or_none() {
        let mut gpu = KvManager::new(Device::Gpu, 4, 2);
        let mut cpu = KvManager::new(Device::Cpu, 2, 2);
        let id = RequestId(7);
        assert!(gpu.allocate_slots(id, 5));
        let mut plan = SwapPlan::new(Device::Gpu, Device::Cpu);
        assert!(!gpu.swap_to(&mut cpu, id, &mut plan));
        assert!(plan.pairs.is_empty() && gpu.table(id).len() == 3 && cpu.num_free_blocks() == 2);
        let mut big = KvManager::new(Device::Cpu, 8, 2);
        let src = gpu.table(id).to_vec();
        assert!(gpu.swap_to(&mut big, id, &mut plan));
        assert_eq!(plan.pairs.iter().map(|p| p.0).collect::<Vec<_>>(), src);
        assert_eq!(plan.pairs.iter().map(|p| p.1).collect::<Vec<_>>(), big.table(id));
        assert_eq!(gpu.num_free_blocks(), 4);
    }
}
