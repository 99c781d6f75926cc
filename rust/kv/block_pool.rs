//! A pool of KV blocks with its free list threaded through indices (O(1) allocate and free,
//! no `unsafe`, no `Rc`): `next[b]` links free block `b` to the next free one.

use super::BlockId;

const NIL: u32 = u32::MAX;

#[derive(Debug, Clone)]
pub struct BlockPool {
    /// For a free block, the next free block (or `NIL`); unused for a block in use.
    next: Vec<u32>,
    in_use: Vec<bool>,
    head: u32,
    num_free: usize,
}

impl BlockPool {
    /// A pool of `num_blocks` free blocks, handed out lowest id first.
    pub fn new(num_blocks: u32) -> Self {
        assert!(num_blocks < NIL, "a pool holds fewer than {NIL} blocks");
        let next = (0..num_blocks).map(|b| if b + 1 < num_blocks { b + 1 } else { NIL }).collect();
        BlockPool {
            next,
            in_use: vec![false; num_blocks as usize],
            head: if num_blocks > 0 { 0 } else { NIL },
            num_free: num_blocks as usize,
        }
    }

    pub fn num_blocks(&self) -> usize {
        self.next.len()
    }

    pub fn num_free(&self) -> usize {
        self.num_free
    }

    pub fn num_used(&self) -> usize {
        self.num_blocks() - self.num_free
    }

    pub fn is_in_use(&self, block: BlockId) -> bool {
        self.in_use.get(block.0 as usize).copied().unwrap_or(false)
    }

    /// Take `n` blocks, all or none: `None` when fewer than `n` are free.
    pub fn allocate(&mut self, n: usize) -> Option<Vec<BlockId>> {
        if n > self.num_free {
            return None;
        }
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            let b = self.head;
            debug_assert!(b != NIL && !self.in_use[b as usize]);
            self.head = self.next[b as usize];
            self.in_use[b as usize] = true;
            out.push(BlockId(b));
        }
        self.num_free -= n;
        Some(out)
    }

    /// Return blocks to the pool. Freeing a block that is not in use is a bug in the caller.
    pub fn free(&mut self, blocks: &[BlockId]) {
        for &BlockId(b) in blocks {
            assert!(self.in_use[b as usize], "block {b} freed twice");
            self.in_use[b as usize] = false;
            self.next[b as usize] = self.head;
            self.head = b;
        }
        self.num_free += blocks.len();
    }

    /// Walk the free list and check it agrees with the counters (tests and debugging).
    pub fn check(&self) -> Result<(), String> {
        let mut seen = vec![false; self.num_blocks()];
        let (mut b, mut n) = (self.head, 0);
        while b != NIL {
            let i = b as usize;
            if seen[i] || self.in_use[i] {
                return Err(format!("free list reaches block {b} twice or while in use"));
            }
            seen[i] = true;
            n += 1;
            b = self.next[i];
        }
        let used = self.in_use.iter().filter(|&&u| u).count();
        if n != self.num_free || n + used != self.num_blocks() {
            return Err(format!("free list {n}, counter {}, used {used}, total {}", self.num_free, self.num_blocks()));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn all_or_nothing_and_reuse() {
        let mut p = BlockPool::new(4);
        let a = p.allocate(3).unwrap();
        assert_eq!(a, vec![BlockId(0), BlockId(1), BlockId(2)]);
        assert!(p.allocate(2).is_none());
        assert_eq!(p.num_free(), 1);
        p.free(&a[1..2]);
        assert_eq!(p.allocate(2).unwrap(), vec![BlockId(1), BlockId(3)]);
        p.check().unwrap();
        assert_eq!(p.num_free(), 0);
        assert!(BlockPool::new(0).allocate(1).is_none());
    }

    #[test]
    #[should_panic(expected = "freed twice")]
    fn double_free_panics() {
        let mut p = BlockPool::new(2);
        let a = p.allocate(1).unwrap();
        p.free(&a);
        p.free(&a);
    }
}
