//! One pool's KV manager (vLLM's `KvCacheManager`): a block table per request, grown by
//! `allocate_slots` (which answers "no room" instead of failing), whole-request swap plans, and
//! with prefix caching on, blocks shared by reference count between requests whose prompts
//! start alike (`prefix.rs`). Layers form KV groups (vLLM's KV cache groups), each with a
//! table entry per block of tokens; a sliding group's blocks behind its window leave the tables
//! (`window.rs`).

use std::collections::HashMap;

use super::prefix::{BlockHash, Evicted, PrefixCache};
use super::{BlockId, BlockPool, Device};
use crate::kv::RequestId;

mod hits;
mod host_tier;
mod window;

pub use hits::PrefixHit;

#[derive(Debug, Clone)]
pub struct KvManager {
    device: Device,
    block_size: usize,
    pool: BlockPool,
    tables: HashMap<RequestId, Vec<BlockId>>,
    /// Holders of each block (tables naming it); a block shared through the prefix cache has
    /// several.
    refs: Vec<u32>,
    cache: Option<PrefixCache>,
    /// Most cached blocks no request holds (the host tier's share; the whole pool otherwise).
    cache_cap: usize,
    /// With the cache: the chained hashes of each request's leading full blocks seen so far.
    chains: HashMap<RequestId, Vec<BlockHash>>,
    /// When a host tier takes them: blocks evicted since the last `take_evicted`.
    evicted: Option<Vec<Evicted>>,
    /// Host-tier blocks held while they are copied to the device (`pin_host_hit`).
    pins: Vec<BlockId>,
    /// Each KV group's sliding window (tokens; `None`: global), one table entry per group per
    /// block of tokens (`with_groups`).
    windows: Vec<Option<usize>>,
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
    /// A manager of `num_blocks` blocks; `prefix_caching` keeps computed full blocks for reuse.
    pub fn new(device: Device, num_blocks: u32, block_size: usize, prefix_caching: bool) -> Self {
        assert!(block_size > 0, "block_size must be positive");
        KvManager {
            device,
            block_size,
            pool: BlockPool::new(num_blocks),
            tables: HashMap::new(),
            refs: vec![0; num_blocks as usize],
            cache: prefix_caching.then(|| PrefixCache::new(num_blocks as usize, block_size)),
            cache_cap: num_blocks as usize,
            chains: HashMap::new(),
            evicted: None,
            pins: Vec::new(),
            windows: vec![None],
        }
    }

    pub fn device(&self) -> Device {
        self.device
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn prefix_caching(&self) -> bool {
        self.cache.is_some()
    }

    /// Blocks that can be handed out now: clean ones, and cached ones no request holds.
    pub fn num_free_blocks(&self) -> usize {
        self.pool.num_free() + self.cache.as_ref().map_or(0, PrefixCache::num_evictable)
    }

    /// Blocks registered in the prefix cache, held or not.
    pub fn num_cached_blocks(&self) -> usize {
        self.cache.as_ref().map_or(0, PrefixCache::num_registered)
    }

    /// Blocks held by at least one request.
    pub fn num_used_blocks(&self) -> usize {
        self.num_total_blocks() - self.num_free_blocks()
    }

    pub fn num_total_blocks(&self) -> usize {
        self.pool.num_blocks()
    }

    /// Blocks that hold `num_tokens` tokens: a block per KV group per `block_size` tokens (the
    /// table entries of a request of that length).
    pub fn blocks_for(&self, num_tokens: usize) -> usize {
        self.windows.len() * num_tokens.div_ceil(self.block_size)
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

    /// Take `n` blocks, all or none: clean ones first, then by evicting cached ones.
    fn take_blocks(&mut self, n: usize) -> Option<Vec<BlockId>> {
        if n > self.num_free_blocks() {
            return None;
        }
        let clean = n.min(self.pool.num_free());
        let mut blocks = self.pool.allocate(clean).expect("counted free");
        if let Some(cache) = &mut self.cache {
            for _ in clean..n {
                match &mut self.evicted {
                    Some(evicted) => {
                        let e = cache.evict_entry().expect("counted evictable");
                        blocks.push(e.block);
                        evicted.push(e);
                    }
                    None => blocks.push(cache.evict().expect("counted evictable")),
                }
            }
        }
        for b in &blocks {
            self.refs[b.0 as usize] = 1;
        }
        Some(blocks)
    }

    /// Drop one holder of each block; a block nobody holds goes back to the pool, or stays
    /// cached (evictable) if registered, the oldest such evicted past the cache's cap. Released
    /// last block first, so a sequence's tail is evicted before its head (which more prompts
    /// share).
    fn release_blocks(&mut self, blocks: &[BlockId]) {
        for &b in blocks.iter().rev().filter(|b| !b.is_null()) {
            let r = &mut self.refs[b.0 as usize];
            assert!(*r > 0, "block {b} released with no holder");
            *r -= 1;
            if *r > 0 {
                continue;
            }
            match &mut self.cache {
                Some(cache) if cache.is_registered(b) => {
                    cache.release(b);
                    if cache.num_evictable() > self.cache_cap {
                        let oldest = cache.evict().expect("over the cap");
                        self.pool.free(&[oldest]);
                    }
                }
                _ => self.pool.free(&[b]),
            }
        }
    }

    /// Grow the request's table to cover `num_tokens` tokens. `false` (and nothing allocated)
    /// when the pool has no room.
    pub fn allocate_slots(&mut self, id: RequestId, num_tokens: usize) -> bool {
        self.grow_past_hit(id, &PrefixHit::default(), num_tokens)
    }

    /// Shrink the request's table to its first `num_blocks` blocks (speculative tokens rejected:
    /// the blocks after hold only their KV, never registered in the prefix cache).
    pub fn truncate(&mut self, id: RequestId, num_blocks: usize) {
        let Some(table) = self.tables.get_mut(&id) else { return };
        if table.len() > num_blocks {
            let dropped = table.split_off(num_blocks);
            self.release_blocks(&dropped);
        }
    }

    /// Free every block of the request (a no-op when it holds none here); shared blocks stay
    /// with their other holders, cached ones stay cached.
    pub fn free(&mut self, id: RequestId) {
        self.chains.remove(&id);
        if let Some(blocks) = self.tables.remove(&id) {
            self.release_blocks(&blocks);
        }
    }

    /// Move request `id` wholly from `self` to `dst`: allocate its blocks in `dst` (its `NULL`
    /// entries stay `NULL`), release them here, and append the block pairs to `plan`. `false`
    /// (nothing changed) when `dst` has no room.
    pub fn swap_to(&mut self, dst: &mut KvManager, id: RequestId, plan: &mut SwapPlan) -> bool {
        debug_assert!(plan.src == self.device && plan.dst == dst.device && self.block_size == dst.block_size);
        debug_assert!(!dst.holds(id), "request {id} already holds blocks in the destination pool");
        let Some(src_blocks) = self.tables.get(&id) else { return true };
        let Some(dst_blocks) = dst.take_like(src_blocks) else { return false };
        plan.pairs.extend(src_blocks.iter().copied().zip(dst_blocks.iter().copied()).filter(|(s, _)| !s.is_null()));
        self.free(id);
        dst.tables.insert(id, dst_blocks);
        true
    }

    /// A table like `pattern`: `NULL` where it is, a fresh block elsewhere; all or none.
    fn take_like(&mut self, pattern: &[BlockId]) -> Option<Vec<BlockId>> {
        let live = pattern.iter().filter(|b| !b.is_null()).count();
        let mut fresh = self.take_blocks(live)?.into_iter();
        Some(pattern.iter().map(|&b| if b.is_null() { b } else { fresh.next().expect("one per live block") }).collect())
    }

    /// The pool, the reference counts, the tables and the cache agree: every block is clean
    /// and free, cached and evictable, or held by exactly as many tables as its count.
    pub fn check(&self) -> Result<(), String> {
        let name = self.device.name();
        self.pool.check().map_err(|e| format!("{name} pool: {e}"))?;
        let mut holders = vec![0u32; self.num_total_blocks()];
        for b in self.tables.values().flatten().chain(&self.pins).filter(|b| !b.is_null()) {
            holders[b.0 as usize] += 1;
        }
        for (i, (&h, &r)) in holders.iter().zip(&self.refs).enumerate() {
            let b = BlockId(i as u32);
            let evictable = self.cache.as_ref().is_some_and(|c| c.is_evictable(b));
            let ok = match (h, self.pool.is_in_use(b)) {
                (0, false) => r == 0 && !evictable && !self.cache.as_ref().is_some_and(|c| c.is_registered(b)),
                (0, true) => r == 0 && evictable,
                (_, true) => r == h && !evictable,
                (_, false) => false,
            };
            if !ok {
                return Err(format!("{name} block {b}: {h} holders, count {r}, evictable {evictable}"));
            }
        }
        if let Some(cache) = &self.cache {
            cache.check().map_err(|e| format!("{name} prefix cache: {e}"))?;
            if cache.num_evictable() > self.cache_cap {
                return Err(format!(
                    "{name}: {} cached blocks unheld, over the cap {}",
                    cache.num_evictable(),
                    self.cache_cap
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::chain_hashes;

    #[test]
    fn allocate_grows_and_answers_no_room() {
        let mut m = KvManager::new(Device::Gpu, 3, 4, false);
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
        let mut gpu = KvManager::new(Device::Gpu, 4, 2, false);
        let mut cpu = KvManager::new(Device::Cpu, 2, 2, false);
        let id = RequestId(7);
        assert!(gpu.allocate_slots(id, 5));
        let mut plan = SwapPlan::new(Device::Gpu, Device::Cpu);
        assert!(!gpu.swap_to(&mut cpu, id, &mut plan));
        assert!(plan.pairs.is_empty() && gpu.table(id).len() == 3 && cpu.num_free_blocks() == 2);
        let mut big = KvManager::new(Device::Cpu, 8, 2, false);
        let src = gpu.table(id).to_vec();
        assert!(gpu.swap_to(&mut big, id, &mut plan));
        assert_eq!(plan.pairs.iter().map(|p| p.0).collect::<Vec<_>>(), src);
        assert_eq!(plan.pairs.iter().map(|p| p.1).collect::<Vec<_>>(), big.table(id));
        assert_eq!(gpu.num_free_blocks(), 4);
    }

    fn tokens(seed: u32, n: usize) -> Vec<u32> {
        (0..n as u32).map(|i| seed * 1000 + i).collect()
    }

    /// Run a request through the cache: look up, allocate, "compute" everything, register.
    fn run_request(m: &mut KvManager, id: RequestId, toks: &[u32]) -> PrefixHit {
        let hit = m.lookup(toks, None, &[]);
        assert!(m.allocate_with_prefix(id, &hit, toks.len()));
        m.cache_full_blocks(id, toks, toks.len(), None);
        m.check().unwrap();
        hit
    }

    #[test]
    fn lookups_walk_the_hashes_they_are_given() {
        let mut m = KvManager::new(Device::Gpu, 16, 4, true);
        let a = tokens(1, 13);
        run_request(&mut m, RequestId(1), &a);
        let known = chain_hashes(None, &a, 4, 3);
        let hit = m.lookup(&a, None, &known);
        assert_eq!((hit.blocks.as_slice(), &hit.hashes), (&m.table(RequestId(1))[..3], &known));
        // Fewer known hashes than blocks: the rest are hashed as the walk goes.
        assert_eq!(m.lookup(&a, None, &known[..1]).blocks, hit.blocks);
        // The walk trusts what it is given (the tokens still guard against a wrong block): a
        // request's hashes, computed once, are what it looks up.
        let mut wrong = known.clone();
        wrong[1] ^= 1;
        assert_eq!(m.lookup(&a, None, &wrong).num_blocks(), 1);
    }

    #[test]
    fn shared_prefixes_are_found_by_full_block_and_capped_before_the_last_token() {
        let mut m = KvManager::new(Device::Gpu, 16, 4, true);
        let a = tokens(1, 10);
        assert_eq!(run_request(&mut m, RequestId(1), &a).num_blocks(), 0);
        // Same first 9 tokens: blocks 0 and 1 are full and cached, block 2 never was.
        let mut b = a[..9].to_vec();
        b.push(77);
        let hit = run_request(&mut m, RequestId(2), &b);
        assert_eq!((hit.blocks.as_slice(), hit.evictable), (&m.table(RequestId(1))[..2], 0));
        assert_eq!(&m.table(RequestId(2))[..2], &m.table(RequestId(1))[..2]);
        // A prompt of exactly two cached blocks recomputes its last token into a block of its own.
        let c = a[..8].to_vec();
        assert_eq!(m.lookup(&c, None, &[]).num_blocks(), 1);
        // A different first block breaks the chain even when later blocks match.
        let mut d = a.clone();
        d[0] = 5;
        assert_eq!(m.lookup(&d, None, &[]).num_blocks(), 0);
        // Freed, the blocks stay cached and are found again, now evictable.
        m.free(RequestId(1));
        m.free(RequestId(2));
        m.check().unwrap();
        assert_eq!(m.num_free_blocks(), 16);
        let hit = m.lookup(&b, None, &[]);
        assert_eq!((hit.num_blocks(), hit.evictable), (2, 2));
        let off = KvManager::new(Device::Gpu, 16, 4, false);
        assert_eq!(off.lookup(&a, None, &[]).num_blocks(), 0);
    }

    #[test]
    fn cached_blocks_are_evicted_oldest_first_and_only_when_no_clean_block_is_left() {
        let mut m = KvManager::new(Device::Gpu, 6, 2, true);
        let (a, b) = (tokens(1, 5), tokens(2, 5));
        run_request(&mut m, RequestId(1), &a); // 3 blocks, 2 full
        run_request(&mut m, RequestId(2), &b);
        let (ta, tb) = (m.table(RequestId(1)).to_vec(), m.table(RequestId(2)).to_vec());
        m.free(RequestId(1));
        m.free(RequestId(2));
        // Released tail first: a's second block, then its first, then b's.
        let order: Vec<BlockId> = m.cache.as_ref().unwrap().eviction_order().collect();
        assert_eq!(order, vec![ta[1], ta[0], tb[1], tb[0]]);
        // Two clean blocks first (the partial third blocks), then evictions in that order.
        assert!(m.allocate_slots(RequestId(3), 2 * 2));
        assert_eq!(m.num_cached_blocks(), 4);
        assert!(m.allocate_slots(RequestId(3), 3 * 2));
        assert_eq!(m.table(RequestId(3))[2], ta[1]);
        assert_eq!(m.lookup(&a, None, &[]).num_blocks(), 1);
        assert!(m.allocate_slots(RequestId(3), 4 * 2));
        assert_eq!(m.lookup(&a, None, &[]).num_blocks(), 0);
        assert_eq!(m.lookup(&b, None, &[]).num_blocks(), 2);
        m.check().unwrap();
        // A hit takes its evictable blocks back out of the LRU: they are no room for new ones.
        let hit = m.lookup(&b, None, &[]);
        assert!(!m.allocate_with_prefix(RequestId(4), &hit, 5));
        m.check().unwrap();
        assert!(m.allocate_with_prefix(RequestId(4), &hit, 4));
        assert_eq!(m.num_free_blocks(), 0);
        m.check().unwrap();
    }

    #[test]
    fn swapping_a_request_that_shares_blocks_copies_them_and_keeps_the_others() {
        let mut gpu = KvManager::new(Device::Gpu, 8, 2, true);
        let mut cpu = KvManager::new(Device::Cpu, 8, 2, false);
        let a = tokens(1, 6);
        run_request(&mut gpu, RequestId(1), &a);
        run_request(&mut gpu, RequestId(2), &a);
        let shared = gpu.table(RequestId(2))[..2].to_vec();
        let mut plan = SwapPlan::new(Device::Gpu, Device::Cpu);
        assert!(gpu.swap_to(&mut cpu, RequestId(2), &mut plan));
        assert_eq!(plan.pairs.len(), 3);
        assert_eq!(&gpu.table(RequestId(1))[..2], shared.as_slice());
        gpu.check().unwrap();
        cpu.check().unwrap();
        assert_eq!(gpu.num_used_blocks(), 3);
    }
}
