//! KV memory that follows a sliding window on every layer (Mistral v0.1 style): a query at
//! position `p` reads positions `p + 1 - window ..= p` only, so once a request has computed
//! `n` tokens no later query reads a block that ends at or before position `n - window`. Those
//! blocks go back to the pool and stay in the table as `BlockId::NULL`, so a long generation
//! holds about `window / block_size` blocks, not its whole length; table indices (and so
//! positions) do not move. Prefix hits skip their blocks behind the window the same way.

use super::{BlockId, KvManager, PrefixHit, RequestId};

impl KvManager {
    /// Release blocks behind `window` tokens (every layer's window; `None`: keep every block).
    pub fn with_window(mut self, window: Option<usize>) -> Self {
        assert!(window != Some(0), "a sliding window holds at least one token");
        self.window = window;
        self
    }

    /// Leading blocks of a request that has computed `num_computed` tokens that no later query
    /// reads: those ending at or before position `num_computed - window`.
    pub fn blocks_behind_window(&self, num_computed: usize) -> usize {
        self.window.map_or(0, |w| (num_computed + 1).saturating_sub(w) / self.block_size)
    }

    /// Blocks a request holds once its table covers `num_tokens` tokens, `num_computed` of them
    /// computed (those behind the window released).
    pub fn blocks_held(&self, num_computed: usize, num_tokens: usize) -> usize {
        self.blocks_for(num_tokens).saturating_sub(self.blocks_behind_window(num_computed))
    }

    /// Release the request's blocks behind the window now that it has computed `num_computed`
    /// tokens (cached ones stay cached, as any released block). Earlier releases left a prefix
    /// of `NULL`s: only the blocks after it are visited (every step, for every request).
    pub fn release_behind_window(&mut self, id: RequestId, num_computed: usize) {
        let behind = self.blocks_behind_window(num_computed);
        let Some(table) = self.tables.get_mut(&id) else { return };
        let end = behind.min(table.len());
        let live = table[..end].iter().rev().take_while(|b| !b.is_null()).count();
        let released: Vec<BlockId> =
            table[end - live..end].iter_mut().map(|b| std::mem::replace(b, BlockId::NULL)).collect();
        self.release_blocks(&released);
    }

    /// Start the table of a request that holds nothing here with `n` `NULL` entries: it comes
    /// from the other pool, where its first `n` blocks were released behind the window.
    pub fn skip_blocks(&mut self, id: RequestId, n: usize) {
        assert!(!self.holds(id), "request {id} already holds blocks");
        if n > 0 {
            self.tables.insert(id, vec![BlockId::NULL; n]);
        }
    }

    /// Mark the blocks of `hit` (found here, on either tier) behind the window of the prompt's
    /// next token as skipped: taking the hit neither holds nor copies them. Recounts the
    /// evictable device blocks it takes.
    pub fn skip_behind_window(&self, hit: &mut PrefixHit) {
        hit.skip = self.blocks_behind_window(hit.num_blocks() * self.block_size);
        let kept = &hit.blocks[hit.skipped_device()..];
        hit.evictable = kept.iter().filter(|b| self.refs[b.0 as usize] == 0).count();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::{Device, SwapPlan};

    #[test]
    fn blocks_behind_the_window_go_back_and_swaps_keep_their_places() {
        // Window 6, blocks of 4: after 9 tokens the next query (position 9) reads 4..=9, so
        // block 0 (positions 0..=3) goes; after 11, block 1 (4..=7) is still read by 6..=11.
        let mut gpu = KvManager::new(Device::Gpu, 8, 4, false).with_window(Some(6));
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

        let mut cpu = KvManager::new(Device::Cpu, 8, 4, false).with_window(Some(6));
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
        let mut m = KvManager::new(Device::Gpu, 8, 2, true).with_window(Some(3));
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
}
