//! Automatic prefix caching for one pool (vLLM v1's, in spirit): every full block a request
//! computes is registered under a chained hash of its tokens (the parent block's hash, then its
//! own tokens), so a later prompt with the same prefix takes those blocks instead of computing
//! them. A registered block that no request holds stays cached and is evicted least recently
//! freed first, only when the pool has no clean block left. Each entry keeps its parent hash
//! and tokens: a hash collision is a miss, never wrong KV.

use std::collections::hash_map::DefaultHasher;
use std::collections::{BTreeMap, HashMap};
use std::hash::{BuildHasherDefault, Hash, Hasher};

use super::BlockId;

/// The chained hash of one full block of tokens.
pub type BlockHash = u64;

/// The hash of the block of `tokens` that follows the block hashed `parent` (`None` for a
/// prompt's first block). Deterministic across runs (fixed-key SipHash).
pub fn hash_block(parent: Option<BlockHash>, tokens: &[u32]) -> BlockHash {
    let mut h = DefaultHasher::new();
    parent.hash(&mut h);
    tokens.hash(&mut h);
    h.finish()
}

/// The chained hashes of `tokens`' first `num_blocks` full blocks, the first one's parent being
/// `parent` (a request's, computed once: lookups walk them instead of rehashing its prompt).
pub fn chain_hashes(
    mut parent: Option<BlockHash>,
    tokens: &[u32],
    block_size: usize,
    num_blocks: usize,
) -> Vec<BlockHash> {
    tokens
        .chunks_exact(block_size)
        .take(num_blocks)
        .map(|block| {
            let hash = hash_block(parent, block);
            parent = Some(hash);
            hash
        })
        .collect()
}

/// A block evicted from the cache with the content it was registered under (what the host
/// tier needs to keep it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Evicted {
    pub block: BlockId,
    pub hash: BlockHash,
    pub parent: Option<BlockHash>,
    pub tokens: Vec<u32>,
}

/// The namespace of a request's `cache_salt`: its first block's parent hash. Deterministic, and
/// apart from every block hash (a distinct domain is hashed in).
pub fn salt_hash(salt: &str) -> BlockHash {
    let mut h = DefaultHasher::new();
    "neo_rs cache_salt".hash(&mut h);
    salt.hash(&mut h);
    h.finish()
}

#[derive(Debug, Clone, Copy)]
struct Entry {
    hash: BlockHash,
    parent: Option<BlockHash>,
}

/// Keys of `by_hash` are SipHash outputs already: hashing them again would only cost time.
#[derive(Debug, Clone, Copy, Default)]
struct Prehashed(u64);

impl Hasher for Prehashed {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, _: &[u8]) {
        unreachable!("only u64 keys")
    }
    fn write_u64(&mut self, x: u64) {
        self.0 = x;
    }
}

#[derive(Debug, Clone, Default)]
pub struct PrefixCache {
    block_size: usize,
    by_hash: HashMap<BlockHash, BlockId, BuildHasherDefault<Prehashed>>,
    /// The registered content of each block (indexed by block id): its hashes here, its tokens
    /// in `tokens` (`block_size` per block, no allocation per registration).
    entries: Vec<Option<Entry>>,
    tokens: Vec<u32>,
    /// Registered blocks no request holds, by the order they were freed (oldest first).
    evictable: BTreeMap<u64, BlockId>,
    freed_at: Vec<u64>,
    clock: u64,
}

impl PrefixCache {
    pub fn new(num_blocks: usize, block_size: usize) -> Self {
        PrefixCache {
            block_size,
            entries: vec![None; num_blocks],
            tokens: vec![0; num_blocks * block_size],
            freed_at: vec![0; num_blocks],
            ..Default::default()
        }
    }

    fn tokens_of(&self, block: BlockId) -> &[u32] {
        let i = block.0 as usize * self.block_size;
        &self.tokens[i..i + self.block_size]
    }

    /// The block holding exactly this content, `hash` being `hash_block(parent, tokens)`, if
    /// registered.
    pub fn get(&self, hash: BlockHash, parent: Option<BlockHash>, tokens: &[u32]) -> Option<(BlockId, BlockHash)> {
        let b = *self.by_hash.get(&hash)?;
        let e = self.entries[b.0 as usize]?;
        (e.parent == parent && self.tokens_of(b) == tokens).then_some((b, hash))
    }

    /// Register `block` as holding `tokens` after `parent`; returns the hash. A content already
    /// registered under another block keeps that one (this block then stays unregistered).
    pub fn register(&mut self, block: BlockId, parent: Option<BlockHash>, tokens: &[u32]) -> BlockHash {
        debug_assert_eq!(tokens.len(), self.block_size);
        let hash = hash_block(parent, tokens);
        let i = block.0 as usize;
        if self.entries[i].is_none() && !self.by_hash.contains_key(&hash) {
            self.by_hash.insert(hash, block);
            self.entries[i] = Some(Entry { hash, parent });
            self.tokens[i * self.block_size..(i + 1) * self.block_size].copy_from_slice(tokens);
        }
        hash
    }

    /// Whether some block is registered under `hash`.
    pub fn contains(&self, hash: BlockHash) -> bool {
        self.by_hash.contains_key(&hash)
    }

    /// The hash `block` is registered under.
    pub fn hash_of(&self, block: BlockId) -> Option<BlockHash> {
        self.entries[block.0 as usize].map(|e| e.hash)
    }

    pub fn is_registered(&self, block: BlockId) -> bool {
        self.entries[block.0 as usize].is_some()
    }

    pub fn is_evictable(&self, block: BlockId) -> bool {
        self.evictable.get(&self.freed_at[block.0 as usize]) == Some(&block)
    }

    pub fn num_evictable(&self) -> usize {
        self.evictable.len()
    }

    /// Registered blocks in total (held or evictable).
    pub fn num_registered(&self) -> usize {
        self.by_hash.len()
    }

    /// A registered block's last holder let it go: it becomes the most recent to evict.
    pub fn release(&mut self, block: BlockId) {
        debug_assert!(self.is_registered(block) && !self.is_evictable(block));
        self.clock += 1;
        self.freed_at[block.0 as usize] = self.clock;
        self.evictable.insert(self.clock, block);
    }

    /// An evictable block is taken again by a request whose prefix it holds.
    pub fn reuse(&mut self, block: BlockId) {
        let removed = self.evictable.remove(&self.freed_at[block.0 as usize]);
        assert_eq!(removed, Some(block), "reused block {block} was not evictable");
    }

    /// The block `evict` would take.
    pub fn oldest(&self) -> Option<BlockId> {
        self.evictable.first_key_value().map(|(_, &b)| b)
    }

    /// Evict the least recently freed block: unregistered, it is the caller's to reuse.
    pub fn evict(&mut self) -> Option<BlockId> {
        let (_, block) = self.evictable.pop_first()?;
        self.unregister(block);
        Some(block)
    }

    /// `evict`, keeping what the block held.
    pub fn evict_entry(&mut self) -> Option<Evicted> {
        let (_, block) = self.evictable.pop_first()?;
        let e = self.unregister(block);
        Some(Evicted { block, hash: e.hash, parent: e.parent, tokens: self.tokens_of(block).to_vec() })
    }

    /// Drop an evictable block from the cache (its content is not to be trusted).
    pub fn remove(&mut self, block: BlockId) {
        self.reuse(block);
        self.unregister(block);
    }

    fn unregister(&mut self, block: BlockId) -> Entry {
        let e = self.entries[block.0 as usize].take().expect("evictable blocks are registered");
        self.by_hash.remove(&e.hash);
        e
    }

    /// Evictable blocks, oldest first.
    #[cfg(test)]
    pub fn eviction_order(&self) -> impl Iterator<Item = BlockId> + '_ {
        self.evictable.values().copied()
    }

    /// The index and the entries agree (tests and invariant checks).
    pub fn check(&self) -> Result<(), String> {
        for (&hash, &b) in &self.by_hash {
            match &self.entries[b.0 as usize] {
                Some(e) if e.hash == hash => {}
                _ => return Err(format!("hash {hash:x} points at block {b}, which holds other content")),
            }
        }
        let registered = self.entries.iter().filter(|e| e.is_some()).count();
        if registered != self.by_hash.len() {
            return Err(format!("{registered} registered blocks, {} hashes", self.by_hash.len()));
        }
        for (&t, &b) in &self.evictable {
            if self.freed_at[b.0 as usize] != t || !self.is_registered(b) {
                return Err(format!("evictable block {b} is stale or unregistered"));
            }
        }
        Ok(())
    }
}
