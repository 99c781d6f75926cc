//! The host tier of the prefix cache: prefix blocks the device cache evicts are copied into a
//! capped share of the host pool instead of being lost, and a later prompt's lookup continues
//! from the device blocks into them. The host manager keeps them as it keeps any cached block:
//! unheld, evictable least recently stored first, and free room for every other use of the
//! host pool (swap-outs and CPU decodes take them when no clean block is left).

use super::{BlockId, Evicted, KvManager, PrefixCache, PrefixHit};

impl KvManager {
    /// Keep at most `cap` cached blocks that no request holds (0: no cache at all). For the
    /// host pool, this is the prefix tier's share.
    pub fn limit_cache(mut self, cap: usize) -> Self {
        self.cache = (cap > 0).then(|| PrefixCache::new(self.num_total_blocks(), self.block_size));
        self.cache_cap = cap;
        self
    }

    /// Keep what every eviction from the cache held, for `take_evicted` (the device pool, when
    /// a host tier takes its evictions).
    pub fn record_evictions(&mut self) {
        self.evicted = Some(Vec::new());
    }

    /// The blocks evicted since the last call, oldest first. Their ids are already handed out
    /// again: their bytes must be copied before anything writes them.
    pub fn take_evicted(&mut self) -> Vec<Evicted> {
        self.evicted.as_mut().map(std::mem::take).unwrap_or_default()
    }

    /// Hold the host blocks of `hit` to copy (from `extend_hit`, none evicted since) while they
    /// are copied to the device, until `unpin_all`.
    pub fn pin_host_hit(&mut self, hit: &PrefixHit) {
        let (blocks, hashes): (Vec<BlockId>, Vec<_>) = hit.host_entries_kept().unzip();
        self.hold(&blocks, &hashes);
        self.pins.extend(blocks);
    }

    /// Let go of every pinned block (the copies that read them are done, or abandoned).
    pub fn unpin_all(&mut self) {
        let pins = std::mem::take(&mut self.pins);
        self.release_blocks(&pins);
    }

    /// Cache the content of evicted device blocks here, unheld: the latest the tier's cap of
    /// them, in eviction order (so a sequence's head, evicted after its tail, also stays here
    /// longer). Each takes a clean block while the tier is under its cap, else the tier's
    /// oldest block (never one stored by this call: every destination is distinct). Content
    /// cached here already is skipped. Returns the `(device, host)` pairs to copy.
    pub fn store(&mut self, evicted: &[Evicted]) -> Vec<(BlockId, BlockId)> {
        let mut pairs: Vec<(BlockId, BlockId)> = Vec::new();
        let Some(cache) = &mut self.cache else { return pairs };
        for e in &evicted[evicted.len().saturating_sub(self.cache_cap)..] {
            if cache.contains(e.hash) {
                continue;
            }
            let block = if cache.num_evictable() < self.cache_cap && self.pool.num_free() > 0 {
                self.pool.allocate(1).expect("a free block")[0]
            } else {
                match cache.oldest() {
                    Some(b) if !pairs.iter().any(|p| p.1 == b) => cache.evict().expect("an evictable block"),
                    _ => break,
                }
            };
            let hash = cache.register(block, e.parent, &e.tokens);
            debug_assert_eq!(hash, e.hash);
            cache.release(block);
            pairs.push((e.block, block));
        }
        pairs
    }

    /// Drop stored blocks whose copies never landed (a failed iteration): back to the pool.
    pub fn forget(&mut self, blocks: &[BlockId]) {
        let cache = self.cache.as_mut().expect("stored blocks need the cache");
        for &b in blocks {
            if cache.hash_of(b).is_some() && cache.is_evictable(b) {
                cache.remove(b);
                self.pool.free(&[b]);
            }
        }
    }

    /// The hash chain of a request's registered blocks, for tests.
    #[cfg(test)]
    fn chain(&self, id: crate::kv::RequestId) -> &[super::BlockHash] {
        self.chains.get(&id).map_or(&[], Vec::as_slice)
    }

    #[cfg(test)]
    fn hash_of(&self, block: BlockId) -> Option<super::BlockHash> {
        self.cache.as_ref()?.hash_of(block)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::prefix::hash_block;
    use crate::kv::Device;
    use crate::kv::RequestId;

    fn tokens(seed: u32, n: usize) -> Vec<u32> {
        (0..n as u32).map(|i| seed * 1000 + i).collect()
    }

    /// A device pool of `dev` blocks with every eviction going to a host tier of `cap` blocks.
    fn tiers(dev: u32, host: u32, cap: usize) -> (KvManager, KvManager) {
        let mut gpu = KvManager::new(Device::Gpu, dev, 2, true);
        gpu.record_evictions();
        (gpu, KvManager::new(Device::Cpu, host, 2, false).limit_cache(cap))
    }

    fn demote(gpu: &mut KvManager, cpu: &mut KvManager) -> Vec<(BlockId, BlockId)> {
        let pairs = cpu.store(&gpu.take_evicted());
        gpu.check().unwrap();
        cpu.check().unwrap();
        pairs
    }

    #[test]
    fn evicted_device_blocks_continue_the_chain_on_the_host() {
        let (mut gpu, mut cpu) = tiers(3, 8, 4);
        let a = tokens(1, 7); // 3 full blocks, looked up at most 3
        assert!(gpu.allocate_slots(RequestId(1), 6));
        gpu.cache_full_blocks(RequestId(1), &a, 6, None);
        let chain = gpu.chain(RequestId(1)).to_vec();
        gpu.free(RequestId(1)); // tail first: block 2 is the oldest to evict
        assert!(gpu.allocate_slots(RequestId(2), 2)); // evicts a's third block
        let pairs = demote(&mut gpu, &mut cpu);
        assert_eq!(pairs.len(), 1);
        let mut hit = gpu.lookup(&a, None, &[]);
        assert_eq!(hit.blocks.len(), 2);
        cpu.extend_hit(&mut hit, &a, &[]);
        assert_eq!((hit.host.as_slice(), hit.num_blocks()), (&[pairs[0].1][..], 3));
        assert_eq!(hit.host_hashes, chain[2..]);
        // Its chain, not its tokens alone: another prefix with the same third block misses.
        let mut b = a.clone();
        b[0] = 9;
        let mut other = gpu.lookup(&b, None, &[]);
        cpu.extend_hit(&mut other, &b, &[]);
        assert_eq!(other.num_blocks(), 0);
        // Pinned while copied back, it is no room for others and is not evicted; then unheld.
        cpu.pin_host_hit(&hit);
        assert_eq!(cpu.num_free_blocks(), 7);
        cpu.check().unwrap();
        cpu.unpin_all();
        assert_eq!((cpu.num_free_blocks(), cpu.num_cached_blocks()), (8, 1));
        // Stored twice, kept once.
        let e = Evicted { block: BlockId(0), hash: chain[2], parent: Some(chain[1]), tokens: a[4..6].to_vec() };
        assert_eq!(cpu.store(&[e]), vec![]);
    }

    fn content(seed: u32) -> Evicted {
        let tokens = tokens(seed, 2);
        Evicted { block: BlockId(0), hash: hash_block(None, &tokens), parent: None, tokens }
    }

    #[test]
    fn the_tier_keeps_its_cap_and_gives_way_to_every_other_use() {
        let (mut gpu, mut cpu) = tiers(4, 6, 2);
        for seed in 1..=3u32 {
            let id = RequestId(seed.into());
            let t = tokens(seed, 8);
            assert!(gpu.allocate_slots(id, 8));
            gpu.cache_full_blocks(id, &t, 8, None);
            gpu.free(id);
        }
        // Three prompts of four cached blocks through a pool of four: eight evictions, the
        // latest two kept (the second prompt's head).
        let evicted = gpu.take_evicted();
        assert_eq!(evicted.len(), 8);
        let pairs = cpu.store(&evicted);
        assert_eq!(pairs.iter().map(|p| p.0).collect::<Vec<_>>(), [evicted[6].block, evicted[7].block]);
        let mut hit = gpu.lookup(&tokens(2, 8), None, &[]);
        cpu.extend_hit(&mut hit, &tokens(2, 8), &[]);
        assert_eq!(hit.host, [pairs[1].1, pairs[0].1]);
        // The head (stored last) is the tier's newest: its tail goes first.
        assert_eq!(cpu.cache.as_ref().unwrap().oldest(), Some(pairs[0].1));
        assert_eq!((cpu.num_cached_blocks(), cpu.num_free_blocks()), (2, 6));
        // Swap-outs take the tier's blocks when no clean block is left.
        assert!(cpu.allocate_slots(RequestId(9), 12));
        assert_eq!((cpu.num_cached_blocks(), cpu.num_free_blocks()), (0, 0));
        cpu.check().unwrap();
        cpu.free(RequestId(9));
        // A pinned block is not the tier's: one more fits, and the oldest goes when it returns.
        let mut cpu = KvManager::new(Device::Cpu, 6, 2, false).limit_cache(1);
        let (e1, e2) = (content(1), content(2));
        let b1 = cpu.store(std::slice::from_ref(&e1))[0].1;
        // A full tier with no clean block left takes its oldest, never a block it just stored.
        let mut full = KvManager::new(Device::Cpu, 2, 2, false).limit_cache(2);
        assert_eq!(full.store(&[content(3), content(4), content(5)]).len(), 2);
        assert_eq!(full.store(&[content(6), content(7), content(8)]).len(), 2);
        let hit = PrefixHit { host: vec![b1], host_hashes: vec![e1.hash], ..Default::default() };
        cpu.pin_host_hit(&hit);
        let b2 = cpu.store(&[e2])[0].1;
        assert_eq!(cpu.num_cached_blocks(), 2);
        cpu.unpin_all();
        assert_eq!((cpu.num_cached_blocks(), cpu.hash_of(b1), cpu.hash_of(b2)), (1, Some(e1.hash), None));
        cpu.check().unwrap();
        // A failed iteration's stores are forgotten.
        cpu.forget(&[b1]);
        assert_eq!((cpu.num_cached_blocks(), cpu.num_free_blocks()), (0, 6));
        cpu.check().unwrap();
    }

    #[test]
    fn a_hybrid_host_hit_copies_the_blocks_inside_each_groups_window() {
        // A global group and a sliding one (window 3), blocks of 2: entries alternate.
        let hybrid = || vec![None, Some(3)];
        let mut gpu = KvManager::new(Device::Gpu, 10, 2, true).with_groups(hybrid());
        gpu.record_evictions();
        let mut cpu = KvManager::new(Device::Cpu, 16, 2, false).limit_cache(16).with_groups(hybrid());
        let a = tokens(1, 9);
        assert!(gpu.allocate_slots(RequestId(1), 9));
        gpu.cache_full_blocks(RequestId(1), &a, 9, None);
        gpu.free(RequestId(1));
        assert!(gpu.allocate_slots(RequestId(2), 10)); // ten entries: evicts all eight cached
        assert_eq!(demote(&mut gpu, &mut cpu).len(), 8);
        gpu.free(RequestId(2));
        let mut hit = gpu.lookup(&a, None, &[]);
        cpu.extend_hit(&mut hit, &a, &[]);
        assert_eq!((hit.blocks.len(), hit.num_blocks(), hit.num_host_blocks()), (0, 4, 4));
        // Position 8 reads 6..=8 in the sliding group: its first three host blocks are skipped.
        gpu.skip_behind_window(&mut hit);
        let kept: Vec<BlockId> = hit.host_entries_kept().map(|(b, _)| b).collect();
        assert_eq!(
            (kept, hit.num_host_kept(), hit.blocks_taken(10)),
            ([0, 2, 4, 6, 7].map(|j| hit.host[j]).to_vec(), 5, 7)
        );
        assert!(gpu.allocate_with_prefix(RequestId(3), &hit, 9));
        cpu.pin_host_hit(&hit);
        let table = gpu.table(RequestId(3)).to_vec();
        let nulls: Vec<usize> = (0..10).filter(|&e| table[e].is_null()).collect();
        assert_eq!((nulls, gpu.num_used_blocks()), (vec![1, 3, 5], 7));
        let pairs: Vec<_> = hit.host_copies(&table).collect();
        assert_eq!(pairs, [0, 2, 4, 6, 7].map(|e| (hit.host[e], table[e])));
        assert_eq!(cpu.num_free_blocks(), 16 - 5);
        cpu.unpin_all();
        for kv in [&gpu, &cpu] {
            kv.check().unwrap();
        }
    }
}
