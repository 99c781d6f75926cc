//! The memory-bandwidth reference the benchmarks compare the kernel against: a plain streaming
//! read of a buffer on the same thread pool, measured in the same process and run.

use rayon::prelude::*;

use crate::attn::CpuAttention;
use crate::error::Result;

impl CpuAttention {
    /// Reads every word of `words` once on this engine's pool; returns their wrapping sum (so the
    /// read cannot be optimised away). Time it to get the machine's read bandwidth.
    pub fn stream_read(&self, words: &[u64]) -> Result<u64> {
        let pool = self.pool()?;
        Ok(pool.install(|| {
            words
                .par_chunks(1 << 16)
                .map(|c| c.iter().fold(0u64, |a, &x| a.wrapping_add(x)))
                .reduce(|| 0, u64::wrapping_add)
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stream_read_sums_every_word() {
        let e = CpuAttention::new(Some(2), None).unwrap();
        let words: Vec<u64> = (0..300_000).collect();
        assert_eq!(e.stream_read(&words).unwrap(), words.iter().sum::<u64>());
    }
}
