//! Prefix hits: the cached blocks a prompt starts with, found by walking its chained block
//! hashes, and what taking them costs. With several KV groups each group keeps its own chain
//! (in a namespace of its own, `group_salt`). A global group's block must be cached for a
//! block of tokens to count; a sliding group's only inside the window of the prompt's next
//! token (vLLM's rule): the walk passes over its missing blocks and `skip_behind_window` cuts
//! the hit where a window lacks one. The blocks behind each window are skipped: neither held,
//! pinned nor copied, and `NULL` in the table of the request that takes the hit
//! (`grow_past_hit`). The host tier's walk starts where the device's ended: a sliding block
//! inside the window held only by the host tier, its block of tokens' global block being on the
//! device, is not used, and the hit is cut before it.

use std::collections::hash_map::DefaultHasher;
use std::hash::{Hash, Hasher};

use super::{BlockHash, BlockId, KvManager};
use crate::kv::prefix::hash_block;
use crate::kv::RequestId;

/// The namespace of KV group `group`'s chains: the request's own for group 0 (so a model with
/// one group hashes as `Request::block_hashes` does), one apart from it for each other group.
fn group_salt(salt: Option<BlockHash>, group: usize) -> Option<BlockHash> {
    if group == 0 {
        return salt;
    }
    let mut h = DefaultHasher::new();
    "neo_rs kv group".hash(&mut h);
    group.hash(&mut h);
    salt.hash(&mut h);
    Some(h.finish())
}

/// The cached blocks a prompt starts with: device blocks (`KvManager::lookup`), then the host
/// tier's blocks that continue the chain (`KvManager::extend_hit`), copied to the device. Both
/// are table entries: a block per KV group per block of tokens.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PrefixHit {
    /// The namespace it was looked up in (its first block's parent).
    pub(super) salt: Option<BlockHash>,
    pub blocks: Vec<BlockId>,
    pub(super) hashes: Vec<BlockHash>,
    /// Of the device blocks, how many no request holds (taking them uses up free blocks).
    pub evictable: usize,
    pub host: Vec<BlockId>,
    pub(super) host_hashes: Vec<BlockHash>,
    /// Table entries per block of tokens (the manager's KV groups; 0 for no lookup: one).
    pub(super) groups: usize,
    /// Per group, its leading blocks of tokens (device ones first) behind the sliding window of
    /// the prompt's next token: found, but neither held, pinned nor copied
    /// (`KvManager::skip_behind_window`). Empty: none.
    pub(super) skip: Vec<usize>,
}

impl PrefixHit {
    fn entries_per_block(&self) -> usize {
        self.groups.max(1)
    }

    /// Leading blocks of tokens of the prompt found, on both tiers.
    pub fn num_blocks(&self) -> usize {
        (self.blocks.len() + self.host.len()) / self.entries_per_block()
    }

    /// Of them, those found on the host tier.
    pub fn num_host_blocks(&self) -> usize {
        self.host.len() / self.entries_per_block()
    }

    /// Keep the device blocks only (the host ones are to be recomputed); skip none until
    /// `KvManager::skip_behind_window` counts them again.
    pub fn drop_host(&mut self) {
        self.host.clear();
        self.host_hashes.clear();
        self.skip.clear();
    }

    /// Whether entry `e` of the hit (device entries first, then the host's) is skipped.
    pub(super) fn is_skipped(&self, e: usize) -> bool {
        let g = self.entries_per_block();
        self.skip.get(e % g).is_some_and(|&behind| e / g < behind)
    }

    /// Indices into `host` of the host entries not skipped.
    fn host_kept(&self) -> impl Iterator<Item = usize> + '_ {
        (0..self.host.len()).filter(|&j| !self.is_skipped(self.blocks.len() + j))
    }

    /// The host entries not skipped, with their hashes.
    pub(super) fn host_entries_kept(&self) -> impl Iterator<Item = (BlockId, BlockHash)> + '_ {
        self.host_kept().map(|j| (self.host[j], self.host_hashes[j]))
    }

    /// How many host blocks are copied to the device: those not behind the window.
    pub fn num_host_kept(&self) -> usize {
        self.host_kept().count()
    }

    /// The `(host, device)` pairs that copy the kept host blocks into the table of the request
    /// that took the hit (`table`, grown past it), entry for entry.
    pub fn host_copies<'a>(&'a self, table: &'a [BlockId]) -> impl Iterator<Item = (BlockId, BlockId)> + 'a {
        self.host_kept().map(|j| (self.host[j], table[self.blocks.len() + j]))
    }

    /// Blocks a request takes up by growing from the hit to `table_blocks` table entries: new
    /// ones (none for the entries skipped), and the cached ones it holds that no request held.
    pub fn blocks_taken(&self, table_blocks: usize) -> usize {
        (self.blocks.len()..table_blocks).filter(|&e| !self.is_skipped(e)).count() + self.evictable
    }
}

impl KvManager {
    /// The cached full blocks `tokens` starts with, at most `(len - 1) / block_size` of them (the
    /// last token is always computed, for its logits, into a block of the request's own), in
    /// the namespace `salt` (`Request::salt`). `known`: the hashes of the first blocks, if the
    /// caller keeps them (`Request::block_hashes`, group 0's chain); the rest are hashed here.
    /// Empty without prefix caching.
    pub fn lookup(&self, tokens: &[u32], salt: Option<BlockHash>, known: &[BlockHash]) -> PrefixHit {
        let groups = self.num_groups();
        let parents = (0..groups).map(|g| group_salt(salt, g)).collect();
        let (blocks, hashes) = self.walk(parents, tokens, 0, known);
        let evictable = blocks.iter().filter(|b| !b.is_null() && self.refs[b.0 as usize] == 0).count();
        PrefixHit { salt, blocks, hashes, evictable, groups, ..PrefixHit::default() }
    }

    /// Extend a device `hit` with this pool's cached blocks that continue its chains.
    pub fn extend_hit(&self, hit: &mut PrefixHit, tokens: &[u32], known: &[BlockHash]) {
        let (g, n) = (hit.entries_per_block(), hit.hashes.len());
        let parents =
            (0..g).map(|k| if n >= g { Some(hit.hashes[n - g + k]) } else { group_salt(hit.salt, k) }).collect();
        let (blocks, hashes) = self.walk(parents, tokens, hit.blocks.len() / g, known);
        (hit.host, hit.host_hashes) = (blocks, hashes);
    }

    /// The cached entries that hold `tokens`' full blocks from block `from` on, each group's
    /// first one's parent being `parents[group]`, up to the lookup's cap; `known[i]` is block
    /// `i`'s hash in group 0, where given. A sliding group's block may be missing (`NULL`: no
    /// later query may need it, `skip_behind_window` decides); the walk ends at a block of
    /// tokens a global group lacks, or every group does.
    fn walk(
        &self,
        mut parents: Vec<Option<BlockHash>>,
        tokens: &[u32],
        from: usize,
        known: &[BlockHash],
    ) -> (Vec<BlockId>, Vec<BlockHash>) {
        let (mut blocks, mut hashes) = (Vec::new(), Vec::new());
        let Some(cache) = &self.cache else { return (blocks, hashes) };
        let max_blocks = tokens.len().saturating_sub(1) / self.block_size;
        let mut found = Vec::with_capacity(parents.len());
        for (i, block) in tokens.chunks_exact(self.block_size).enumerate().take(max_blocks).skip(from) {
            found.clear();
            found.extend(parents.iter().enumerate().map(|(g, &parent)| {
                let given = if g == 0 { known.get(i).copied() } else { None };
                let hash = given.unwrap_or_else(|| hash_block(parent, block));
                cache.get(hash, parent, block).unwrap_or((BlockId::NULL, hash))
            }));
            let missing = |(g, (b, _)): (usize, &(BlockId, BlockHash))| b.is_null() && self.windows[g].is_none();
            if found.iter().enumerate().any(missing) || found.iter().all(|(b, _)| b.is_null()) {
                break;
            }
            for (&(b, hash), parent) in found.iter().zip(&mut parents) {
                blocks.push(b);
                hashes.push(hash);
                *parent = Some(hash);
            }
        }
        (blocks, hashes)
    }

    /// Give a request that holds nothing here the blocks of `hit` (from `lookup`, with nothing
    /// changed since) and new ones up to `num_tokens` tokens. `false` (nothing changed) when the
    /// pool has no room for the new ones.
    pub fn allocate_with_prefix(&mut self, id: RequestId, hit: &PrefixHit, num_tokens: usize) -> bool {
        if hit.blocks_taken(self.blocks_for(num_tokens)) > self.num_free_blocks() {
            return false;
        }
        self.take_prefix(id, hit);
        let grown = self.grow_past_hit(id, hit, num_tokens);
        debug_assert!(grown, "room was checked");
        grown
    }

    /// Give a request that holds nothing here the blocks of `hit` (from `lookup`; blocks freed
    /// since may have been taken again, none evicted), so that allocations for other requests
    /// cannot evict them before its own. Its skipped blocks enter the table as `NULL`s.
    pub fn take_prefix(&mut self, id: RequestId, hit: &PrefixHit) {
        assert!(!self.holds(id), "request {id} already holds blocks");
        if hit.blocks.is_empty() {
            return;
        }
        let kept: Vec<usize> = (0..hit.blocks.len()).filter(|&e| !hit.is_skipped(e)).collect();
        let blocks: Vec<BlockId> = kept.iter().map(|&e| hit.blocks[e]).collect();
        debug_assert!(
            !blocks.contains(&BlockId::NULL),
            "a hit's missing blocks lie behind the window (skip_behind_window)"
        );
        let hashes: Vec<BlockHash> = kept.iter().map(|&e| hit.hashes[e]).collect();
        self.hold(&blocks, &hashes);
        let table = (0..hit.blocks.len()).map(|e| if hit.is_skipped(e) { BlockId::NULL } else { hit.blocks[e] });
        self.tables.insert(id, table.collect());
        self.chains.insert(id, hit.hashes.clone());
    }

    /// Grow the table of a request that took `hit` (`take_prefix`) to `num_tokens` tokens: a
    /// `NULL` for each entry the hit skips (its host blocks behind the window), fresh blocks
    /// elsewhere (the host blocks kept are copied into theirs). `false` (nothing allocated)
    /// when the pool has no room.
    pub fn grow_past_hit(&mut self, id: RequestId, hit: &PrefixHit, num_tokens: usize) -> bool {
        let entries = self.table(id).len()..self.blocks_for(num_tokens);
        if entries.is_empty() {
            return true;
        }
        let Some(fresh) = self.take_blocks(entries.clone().filter(|&e| !hit.is_skipped(e)).count()) else {
            return false;
        };
        let mut fresh = fresh.into_iter();
        let grown = entries.map(|e| if hit.is_skipped(e) { BlockId::NULL } else { fresh.next().expect("counted") });
        self.tables.entry(id).or_default().extend(grown);
        true
    }

    /// One more holder for each cached block (registered under `hashes` at the lookup, none
    /// evicted since); `release_blocks` drops it.
    pub(super) fn hold(&mut self, blocks: &[BlockId], hashes: &[BlockHash]) {
        if blocks.is_empty() {
            return;
        }
        let cache = self.cache.as_mut().expect("a hit needs the cache");
        for (&b, &hash) in blocks.iter().zip(hashes) {
            assert_eq!(cache.hash_of(b), Some(hash), "prefix block {b} was evicted after the lookup");
            let r = &mut self.refs[b.0 as usize];
            if *r == 0 {
                cache.reuse(b);
            }
            *r += 1;
        }
    }

    /// Register the request's full blocks among its first `num_computed` tokens (`tokens`: its
    /// prompt and outputs; `salt`: its namespace), each group's in its own chain, for later
    /// prompts to reuse; a block released behind the window only extends the chain. A no-op
    /// without prefix caching.
    pub fn cache_full_blocks(&mut self, id: RequestId, tokens: &[u32], num_computed: usize, salt: Option<BlockHash>) {
        let (g, bs) = (self.num_groups(), self.block_size);
        let Some(cache) = &mut self.cache else { return };
        let Some(table) = self.tables.get(&id) else { return };
        let chain = self.chains.entry(id).or_default();
        let full = (num_computed / bs * g).min(table.len());
        for e in chain.len()..full {
            let i = e / g;
            let block = &tokens[i * bs..(i + 1) * bs];
            let parent = if e >= g { Some(chain[e - g]) } else { group_salt(salt, e) };
            let hash =
                if table[e].is_null() { hash_block(parent, block) } else { cache.register(table[e], parent, block) };
            chain.push(hash);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::Device;

    #[test]
    fn a_hybrid_hit_needs_the_global_blocks_and_the_sliding_ones_inside_the_window() {
        // A global group and a sliding one (window 3), blocks of 2: entries alternate.
        let mut m = KvManager::new(Device::Gpu, 32, 2, true).with_groups(vec![None, Some(3)]);
        let prompt: Vec<u32> = (0..9).collect();
        assert!(m.allocate_slots(RequestId(1), 9));
        m.cache_full_blocks(RequestId(1), &prompt, 9, None);
        let (table, chain) = (m.table(RequestId(1)).to_vec(), m.chains[&RequestId(1)].clone());
        // Each group chains its own hashes: the same tokens, different namespaces.
        assert_eq!(chain.len(), 8);
        assert!(chain[0] != chain[1] && chain[2] == hash_block(Some(chain[0]), &prompt[2..4]));
        m.free(RequestId(1));
        let mut hit = m.lookup(&prompt, None, &[]);
        assert_eq!((hit.num_blocks(), hit.blocks.as_slice(), hit.evictable), (4, &table[..8], 8));
        // The prompt's next token (position 8) reads 6..=8 in the sliding group: its blocks 0..=2
        // are skipped; the global group takes all four.
        m.skip_behind_window(&mut hit);
        assert_eq!((hit.evictable, hit.blocks_taken(10)), (5, 7));
        assert!(m.allocate_with_prefix(RequestId(2), &hit, 9));
        let (t2, n) = (m.table(RequestId(2)), BlockId::NULL);
        assert_eq!(&t2[..8], &[table[0], n, table[2], n, table[4], n, table[6], table[7]]);
        assert!(t2[8..].iter().all(|b| !b.is_null() && !table[..8].contains(b)));
        m.check().unwrap();
        m.free(RequestId(2));
        // Sliding blocks released before they were registered only extend the chain: a hit
        // passes over those behind the window of the prompt's next token ...
        let other: Vec<u32> = (100..109).collect();
        assert!(m.allocate_slots(RequestId(3), 9));
        m.release_behind_window(RequestId(3), 9); // sliding blocks 0..=2 go first
        m.cache_full_blocks(RequestId(3), &other, 9, None);
        let mut hit = m.lookup(&other, None, &[]);
        m.skip_behind_window(&mut hit);
        assert_eq!((hit.num_blocks(), hit.skip.as_slice(), hit.evictable), (4, &[0, 3][..], 0));
        // ... but ends before a block of tokens whose window lacks one.
        let third: Vec<u32> = (200..209).collect();
        assert!(m.allocate_slots(RequestId(4), 9));
        m.release_behind_window(RequestId(4), 11); // sliding blocks 0..=3
        m.cache_full_blocks(RequestId(4), &third, 9, None);
        let mut hit = m.lookup(&third, None, &[]);
        assert_eq!(hit.num_blocks(), 4);
        m.skip_behind_window(&mut hit);
        assert_eq!(hit.num_blocks(), 0);
        m.check().unwrap();
    }
}
