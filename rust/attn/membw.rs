//! The memory-bandwidth references the benchmarks compare the kernel against, on the same thread
//! pool, measured in the same process and run: a plain streaming read of a buffer, and a read of
//! the kernel's own access pattern (KV tiles in block-table order) without its arithmetic.

use rayon::prelude::*;

use crate::attn::types::STREAMS;
use crate::attn::CpuAttention;
use crate::error::{ensure, Result};

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

    /// Reads the runs of `run` words of `words` at the run indices `order`, in that order, spread
    /// over this engine's pool, as the kernel reads a step's tiles (`STREAMS` runs at a time, a
    /// cache line of each in turn); returns their wrapping sum. With a KV tile as the run and a
    /// block table's tiles as the order, time it to get what the kernel's memory accesses alone
    /// reach: scattered 4 KiB tiles read below a streaming read's bandwidth.
    pub fn gather_read(&self, words: &[u64], run: usize, order: &[i32]) -> Result<u64> {
        ensure!(run > 0, Value, "run must be positive");
        let runs = words.len() / run;
        ensure!(
            order.iter().all(|&i| usize::try_from(i).is_ok_and(|i| i < runs)),
            Value,
            "order holds a run index outside 0..{runs}"
        );
        let pool = self.pool()?;
        Ok(pool.install(|| {
            order
                .par_chunks(64)
                .map(|c| {
                    c.chunks(STREAMS).fold(0u64, |mut a, step| {
                        let runs: [&[u64]; STREAMS] = std::array::from_fn(|j| {
                            step.get(j).map_or(&[][..], |&i| &words[i as usize * run..][..run])
                        });
                        for line in (0..run).step_by(8) {
                            for r in &runs {
                                a = r
                                    .get(line..(line + 8).min(r.len()))
                                    .into_iter()
                                    .flatten()
                                    .fold(a, |a, &x| a.wrapping_add(x));
                            }
                        }
                        a
                    })
                })
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

    #[test]
    fn gather_read_sums_the_runs_in_order() {
        let e = CpuAttention::new(Some(2), None).unwrap();
        let words: Vec<u64> = (0..1000).collect();
        let order: Vec<i32> = (0..300).map(|i| i * 7 % 100).chain([3, 3]).collect();
        let want: u64 = order.iter().flat_map(|&i| &words[i as usize * 10..][..10]).sum();
        assert_eq!(e.gather_read(&words, 10, &order).unwrap(), want);
        assert!(e.gather_read(&words, 10, &[100]).is_err());
        assert!(e.gather_read(&words, 10, &[-1]).is_err());
        assert!(e.gather_read(&words, 0, &[0]).is_err());
    }
}
