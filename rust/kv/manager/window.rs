//! KV memory that follows sliding windows. Layers form KV groups (vLLM's KV cache groups): a
//! request's table holds, for each block of tokens `i`, one entry per group (entry `i * G + g`
//! for group `g` of `G`), each a block of the pool that holds that group's layers. A sliding
//! group's query at position `p` reads positions `p + 1 - window ..= p` only, so once a request
//! has computed `n` tokens no later query of that group reads a block that ends at or before
//! position `n - window`. Those blocks go back to the pool and stay in the table as
//! `BlockId::NULL`, so a long generation holds about `window / block_size` blocks per sliding
//! group, not its whole length, while global groups keep every block; table indices (and so
//! positions) do not move. Models whose every layer slides (Mistral v0.1) have one group; hybrid
//! ones (Gemma 2/3) a global group and sliding ones. Prefix hits skip their blocks behind the
//! window the same way.

use super::{BlockId, KvManager, PrefixHit, RequestId};

impl KvManager {
    /// The KV groups' sliding windows (`None`: a global group), a table entry each per block of
    /// tokens; `[None]` by default.
    pub fn with_groups(mut self, windows: Vec<Option<usize>>) -> Self {
        assert!(!windows.is_empty(), "at least one KV group");
        assert!(!windows.contains(&Some(0)), "a sliding window holds at least one token");
        self.windows = windows;
        self
    }

    pub fn num_groups(&self) -> usize {
        self.windows.len()
    }

    /// Leading blocks of tokens of a request that has computed `num_computed` tokens that no
    /// later query of a group with `window` reads: those ending at or before `num_computed - window`.
    fn behind(&self, window: Option<usize>, num_computed: usize) -> usize {
        behind(window, num_computed, self.block_size)
    }

    /// Table entries of a request that has computed `num_computed` tokens that no later query
    /// reads, over every group.
    pub fn blocks_behind_window(&self, num_computed: usize) -> usize {
        self.windows.iter().map(|&w| self.behind(w, num_computed)).sum()
    }

    /// Whether table entry `entry` of a request that has computed `num_computed` tokens lies
    /// behind its group's window.
    pub fn is_behind_window(&self, entry: usize, num_computed: usize) -> bool {
        let g = self.windows.len();
        entry / g < self.behind(self.windows[entry % g], num_computed)
    }

    /// Blocks a request holds once its table covers `num_tokens` tokens, `num_computed` of them
    /// computed (those behind the window released).
    pub fn blocks_held(&self, num_computed: usize, num_tokens: usize) -> usize {
        self.blocks_for(num_tokens).saturating_sub(self.blocks_behind_window(num_computed))
    }

    /// Release the request's blocks behind each sliding group's window now that it has computed
    /// `num_computed` tokens (cached ones stay cached, as any released block). Earlier releases
    /// left each group's leading entries `NULL`: only the entries after them are visited (every
    /// step, for every request).
    pub fn release_behind_window(&mut self, id: RequestId, num_computed: usize) {
        let (g, bs) = (self.windows.len(), self.block_size);
        let Some(table) = self.tables.get_mut(&id) else { return };
        let mut released = Vec::new();
        for (group, &window) in self.windows.iter().enumerate() {
            // Group `group`'s entries behind the window that the table has, last first.
            let end = behind(window, num_computed, bs).min((table.len() + g - 1 - group) / g);
            for e in (0..end).rev().map(|i| i * g + group) {
                if table[e].is_null() {
                    break;
                }
                released.push(std::mem::replace(&mut table[e], BlockId::NULL));
            }
        }
        // In table order: `release_blocks` lets the last ones go first (a tail is evicted first).
        released.reverse();
        self.release_blocks(&released);
    }

    /// Give a request that holds nothing here a table like `pattern` (its table in the other
    /// pool): `NULL` where `pattern` is (released behind the window there), a fresh block
    /// elsewhere, then grown to `num_tokens` tokens. `false` (nothing changed) when the pool has
    /// no room.
    pub fn allocate_like(&mut self, id: RequestId, pattern: &[BlockId], num_tokens: usize) -> bool {
        assert!(!self.holds(id), "request {id} already holds blocks");
        let grow = self.blocks_for(num_tokens).saturating_sub(pattern.len());
        let live = pattern.iter().filter(|b| !b.is_null()).count();
        if live + grow > self.num_free_blocks() {
            return false;
        }
        let table = self.take_like(pattern).expect("room was checked");
        if !table.is_empty() {
            self.tables.insert(id, table);
        }
        let grown = self.allocate_slots(id, num_tokens);
        debug_assert!(grown, "room was checked");
        grown
    }

    /// Cut `hit` (found here, on either tier) to its longest run of blocks of tokens whose
    /// sliding groups hold every block inside the window of the prompt's next token (the walk
    /// passes over their missing ones), and mark the blocks behind each group's window as
    /// skipped: taking the hit neither holds nor copies them. Recounts the evictable device
    /// blocks it takes.
    pub fn skip_behind_window(&self, hit: &mut PrefixHit) {
        let g = self.windows.len();
        let entry = |e: usize| if e < hit.blocks.len() { hit.blocks[e] } else { hit.host[e - hit.blocks.len()] };
        // The walks leave no global group's block missing: only the sliding groups' windows are
        // checked.
        let sliding = self.windows.iter().enumerate().filter(|(_, w)| w.is_some());
        let whole = |n: usize| {
            sliding.clone().all(|(k, &w)| (self.behind(w, n * self.block_size)..n).all(|i| !entry(i * g + k).is_null()))
        };
        let n = (0..=hit.num_blocks()).rev().find(|&n| whole(n)).unwrap_or(0);
        let (device, host) = ((n * g).min(hit.blocks.len()), (n * g).saturating_sub(hit.blocks.len()));
        hit.blocks.truncate(device);
        hit.hashes.truncate(device);
        hit.host.truncate(host);
        hit.host_hashes.truncate(host);
        hit.skip = self.windows.iter().map(|&w| self.behind(w, n * self.block_size)).collect();
        let unheld = |(e, b): (usize, &BlockId)| !hit.is_skipped(e) && self.refs[b.0 as usize] == 0;
        hit.evictable = hit.blocks.iter().enumerate().filter(|&x| unheld(x)).count();
    }
}

/// `KvManager::behind` for blocks of `block_size` tokens.
fn behind(window: Option<usize>, num_computed: usize, block_size: usize) -> usize {
    window.map_or(0, |w| (num_computed + 1).saturating_sub(w) / block_size)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::{Device, SwapPlan};

    #[test]
    fn blocks_behind_the_window_go_back_and_swaps_keep_their_places() {
        // Window 6, blocks of 4: after 9 tokens the next query (position 9) reads 4..=9, so
        // block 0 (positions 0..=3) goes; after 11, block 1 (4..=7) is still read by 6..=11.
        let mut gpu = KvManager::new(Device::Gpu, 8, 4, false).with_groups(vec![Some(6)]);
        let id = RequestId(1);
        assert!(gpu.allocate_slots(id, 10));
        gpu.release_behind_window(id, 9);
        assert_eq!(gpu.table(id)[0], BlockId::NULL);
        assert_eq!((gpu.num_used_blocks(), gpu.blocks_held(9, 10)), (2, 2));
        gpu.release_behind_window(id, 11);
        assert_eq!(gpu.num_used_blocks(), 2);
        assert!(gpu.allocate_slots(id, 13));
        gpu.release_behind_window(id, 13);
        assert_eq!((&gpu.table(id)[..2], gpu.num_used_blocks()), (&[BlockId::NULL; 2][..], 2));
        gpu.check().unwrap();

        let mut cpu = KvManager::new(Device::Cpu, 8, 4, false).with_groups(vec![Some(6)]);
        let mut plan = SwapPlan::new(Device::Gpu, Device::Cpu);
        let live = gpu.table(id)[2..].to_vec();
        assert!(gpu.swap_to(&mut cpu, id, &mut plan));
        assert_eq!(plan.pairs.iter().map(|p| p.0).collect::<Vec<_>>(), live);
        assert_eq!(&cpu.table(id)[..2], &[BlockId::NULL; 2]);
        assert_eq!((gpu.num_used_blocks(), cpu.num_used_blocks()), (0, 2));
        cpu.free(id);
        for kv in [&gpu, &cpu] {
            kv.check().unwrap();
            assert_eq!(kv.num_free_blocks(), 8);
        }
    }

    #[test]
    fn a_prefix_hit_skips_its_blocks_behind_the_window() {
        let mut m = KvManager::new(Device::Gpu, 8, 2, true).with_groups(vec![Some(3)]);
        let prompt: Vec<u32> = (0..9).collect();
        assert!(m.allocate_slots(RequestId(1), 9));
        m.cache_full_blocks(RequestId(1), &prompt, 9, None);
        m.free(RequestId(1));
        let mut hit = m.lookup(&prompt, None, &[]);
        assert_eq!((hit.num_blocks(), hit.evictable), (4, 4));
        // The prompt's next token (position 8) reads 6..=8: blocks 0..=2 are skipped.
        m.skip_behind_window(&mut hit);
        assert_eq!((hit.evictable, hit.blocks_taken(5)), (1, 2));
        let free = m.num_free_blocks();
        assert!(m.allocate_with_prefix(RequestId(2), &hit, 9));
        assert_eq!(&m.table(RequestId(2))[..3], &[BlockId::NULL; 3]);
        assert_eq!(m.table(RequestId(2))[3], hit.blocks[3]);
        assert_eq!(free - m.num_free_blocks(), 2);
        m.check().unwrap();
    }

    #[test]
    fn a_hybrid_table_releases_its_sliding_entries_and_keeps_its_global_ones() {
        // A global group and a sliding one (window 6, blocks of 4): entries alternate.
        let mut gpu = KvManager::new(Device::Gpu, 16, 4, false).with_groups(vec![None, Some(6)]);
        let id = RequestId(1);
        assert!(gpu.allocate_slots(id, 13));
        assert_eq!((gpu.table(id).len(), gpu.blocks_for(13)), (8, 8));
        gpu.release_behind_window(id, 13); // position 13 reads 8..=13: sliding blocks 0 and 1 go
        let nulls: Vec<bool> = gpu.table(id).iter().map(|b| b.is_null()).collect();
        assert_eq!(nulls, [false, true, false, true, false, false, false, false]);
        assert!((0..8).all(|e| nulls[e] == gpu.is_behind_window(e, 13)));
        assert_eq!((gpu.num_used_blocks(), gpu.blocks_held(13, 13)), (6, 6));
        // Staged to the host pool, the table keeps its pattern; the other pool's NULLs stay NULL.
        let mut cpu = KvManager::new(Device::Cpu, 16, 4, false).with_groups(vec![None, Some(6)]);
        assert!(cpu.allocate_like(id, gpu.table(id), 17));
        let host: Vec<bool> = cpu.table(id).iter().map(|b| b.is_null()).collect();
        assert_eq!((&host[..8], host.len(), cpu.num_used_blocks()), (&nulls[..], 10, 8));
        let mut small = KvManager::new(Device::Cpu, 7, 4, false).with_groups(vec![None, Some(6)]);
        assert!(!small.allocate_like(id, gpu.table(id), 17) && !small.holds(id));
        cpu.free(id);
        let mut plan = SwapPlan::new(Device::Gpu, Device::Cpu);
        assert!(gpu.swap_to(&mut cpu, id, &mut plan));
        assert_eq!(plan.pairs.len(), 6);
        for kv in [&gpu, &cpu] {
            kv.check().unwrap();
        }
    }
}
