//! NEO's step 3: tentative prefills from the head of the queue, each on the device or bound for
//! the host pool (in place over the host blocks it starts with, where it has some), and their
//! admission once steps 4-6 have kept them.

use super::*;

/// A prefill the policy may still drop.
#[derive(Debug, Clone)]
pub(super) struct Tentative {
    pub(super) id: RequestId,
    pub(super) n: usize,
    pub(super) target: usize,
    pub(super) to_host: bool,
    pub(super) attn_ms: f64,
    /// Cached blocks it starts from: on the device (then the host tier's, copied in) for a
    /// device prefill; the host blocks it attends over in place for a host-bound one.
    pub(super) hit: PrefixHit,
    /// In place although the device had room: the estimates found it cheaper than copying its
    /// prefix in (`in_place_pays`), so it is no overflow for steps 5-6 to drop.
    pub(super) over_device: bool,
}

impl Tentative {
    /// A host-bound prompt with host blocks to start from: its rows attend on the CPU.
    pub(super) fn in_place(&self) -> bool {
        self.to_host && !self.hit.blocks.is_empty()
    }

    /// Overflow the device had no room for: steps 5-6 may leave it waiting.
    pub(super) fn droppable(&self) -> bool {
        self.to_host && !self.over_device
    }
}

impl Scheduler {
    /// Prefill chunks from the head of the waiting queue: on the device while it keeps headroom
    /// for the running requests' growth, else (a whole prompt in one chunk) with its KV written
    /// straight to the host pool, layer by layer, as long as the host keeps room to swap out
    /// what the device holds. Stops at the first that fits nowhere. A prompt whose cached prefix
    /// is in the host pool may start in place there although the device has room, where the
    /// estimates say so (`in_place_pays`); `gpu` is the device work already planned.
    pub(super) fn tentative_prefills(&self, gpu: &Load, mut budget: usize, mut seats: usize) -> Vec<Tentative> {
        let mut free_gpu = self.gpu.num_free_blocks();
        let mut free_cpu = self.cpu.num_free_blocks();
        // Keep a block of growth per device request, up to the share above the watermark.
        let max_headroom = ((1.0 - SWAP_IN_WATERMARK) * self.gpu.num_total_blocks() as f64).ceil() as usize;
        let mut on_device = self.running.iter().filter(|id| self.requests[*id].device == Device::Gpu).count();
        let mut host_bound = false;
        let mut load = *gpu;
        let mut out = Vec::new();
        for &id in &self.waiting {
            if budget == 0 || seats == 0 {
                break;
            }
            let req = &self.requests[&id];
            // Host room stays for swapping out every block the device holds (counting the
            // device prefills placed above): a preempted device request must find it, or it
            // is recomputed. NEO's reference caps host-bound prefills at cpu_blocks - gpu_blocks.
            let swap_reserve = self.gpu.num_total_blocks() - free_gpu;
            // The whole prompt to the host pool, after the host blocks it starts with.
            let to_host = || {
                let place = self.in_place_hit(req);
                let n = req.num_pending_tokens() - place.num_blocks() * self.config.block_size;
                let host_blocks = place.blocks_taken(self.cpu.blocks_for(req.num_tokens()));
                let fits = n <= budget && host_blocks + swap_reserve <= free_cpu;
                let attn_ms = self.prefill_attn_ms(req.num_computed_tokens, n);
                let t = Tentative {
                    id,
                    n,
                    target: req.num_tokens(),
                    to_host: true,
                    attn_ms,
                    hit: place,
                    over_device: false,
                };
                fits.then_some((t, host_blocks))
            };
            // Once host-bound, no later prompt goes to the device: no device lookup for it.
            let mut hit = if host_bound { PrefixHit::default() } else { self.prefix_hit(req) };
            if hit.num_host_kept() > free_cpu {
                // Its host-tier blocks are pinned while copied in, and the prefills placed above
                // took the host room for that: they are recomputed instead.
                self.drop_host_tier(&mut hit);
            }
            let computed = req.num_computed_tokens + hit.num_blocks() * self.config.block_size;
            let n_dev = (req.num_tokens() - computed).min(budget);
            // Device blocks it takes up: new ones, and cached ones no request holds.
            let blocks = hit.blocks_taken(self.gpu.blocks_for(computed + n_dev));
            // A prompt longer than the budget runs in chunks over several iterations: it starts
            // only where all of it fits. Preempted halfway it is recomputed (`preempt`), and
            // admitted again on a chunk's room it would be preempted again, each time losing
            // the chunks it ran (prompts over the budget ran at a fifth of `none`'s rate).
            let whole =
                hit.blocks_taken(self.gpu.blocks_for(req.num_tokens())).min(self.config.peak_blocks(req.num_tokens()));
            let (t, host_blocks) = if !host_bound && whole + max_headroom.min(on_device) <= free_gpu {
                // Priced with a layer's share of copying its host-tier blocks in.
                let copied = hit.num_host_kept() * self.config.block_size * self.config.kv_bytes_per_token;
                let attn_ms = self.prefill_attn_ms(computed, n_dev) + self.predictor.transfer_ms(copied);
                let host_hit = hit.num_host_kept() > 0;
                let dev = Tentative {
                    id,
                    n: n_dev,
                    target: computed + n_dev,
                    to_host: false,
                    attn_ms,
                    hit,
                    over_device: false,
                };
                match to_host().filter(|(t, _)| host_hit && t.in_place()) {
                    Some((t, host_blocks)) if self.in_place_pays(&load, &dev, &t, free_gpu) => {
                        (Tentative { over_device: true, ..t }, host_blocks)
                    }
                    _ => (dev, 0),
                }
            } else {
                match to_host() {
                    Some(t) => t,
                    None => break,
                }
            };
            if t.to_host {
                free_cpu -= host_blocks;
            } else {
                // Its host-tier blocks are pinned while copied: no room for others this plan
                // (counted twice when two prefills pin one block: a safe overestimate).
                free_cpu -= t.hit.num_host_kept();
                free_gpu -= blocks;
                on_device += 1;
            }
            // Once one prefill overflows to the host, later ones follow (FCFS fairness).
            host_bound |= t.droppable();
            self.add_prefill(&mut load, &t, 1);
            budget -= t.n;
            seats -= 1;
            out.push(t);
        }
        out
    }

    /// Whether `place` (in place over the host blocks the prompt starts with) is cheaper than
    /// `dev` (its host-tier blocks copied into the device), each priced as the layer time of
    /// sub-batch 0 with it (`load` and `sequential_ms`: in-place rows cost the device nothing
    /// where the CPU keeps up). While the device would have room below the swap-in watermark
    /// for the request, in place also pays the swap-in that would bring it back at once.
    fn in_place_pays(&self, load: &Load, dev: &Tentative, place: &Tentative, free_gpu: usize) -> bool {
        let with = |t: &Tentative| {
            let mut b = *load;
            self.add_prefill(&mut b, t, 1);
            self.sequential_ms(&b)
        };
        let total = self.gpu.num_total_blocks();
        let need = self.gpu.blocks_held(place.target, place.target + 1);
        let swap_back = total - free_gpu + need <= (SWAP_IN_WATERMARK * total as f64) as usize;
        let back_bytes = if swap_back { need * self.config.block_size * self.config.kv_bytes_per_token } else { 0 };
        with(place) + self.predictor.transfer_ms(back_bytes) < with(dev)
    }

    pub(super) fn commit_prefills(&mut self, step: &mut Step, prefills: &[Tentative]) {
        // Every prefill takes its cached prefix first, on both tiers: the new blocks of one must
        // not evict another's (cached blocks no request held when the plan was made).
        for p in prefills {
            if p.to_host {
                self.cpu.take_prefix(p.id, &p.hit);
            } else {
                self.gpu.take_prefix(p.id, &p.hit);
                self.cpu.pin_host_hit(&p.hit);
            }
        }
        for p in prefills {
            debug_assert_eq!(self.waiting.front(), Some(&p.id));
            let kv = if p.to_host { &mut self.cpu } else { &mut self.gpu };
            let grown = kv.grow_past_hit(p.id, &p.hit, p.target);
            assert!(grown, "tentative prefills were counted against the free blocks");
            if !p.to_host {
                self.copy_host_hit(p.id, &p.hit, step);
            }
            self.count_prefix_hit(p.id, &p.hit, p.to_host);
            self.waiting.pop_front();
            self.admit_to(p.id, if p.to_host { Device::Cpu } else { Device::Gpu });
            self.stats.num_prefills_to_host += u64::from(p.to_host);
            step.push(self.scheduled(p.id, p.n));
        }
    }

    /// Add (`sign` 1) or take back (-1) one tentative prefill.
    pub(super) fn add_prefill(&self, b: &mut Load, p: &Tentative, sign: isize) {
        if p.in_place() {
            add_cpu_rows(b, p.target - p.n, p.n, &self.config.kv_group_windows, sign);
            return;
        }
        let step = |x: &mut usize, by: usize| *x = x.wrapping_add_signed(sign * by as isize);
        step(&mut b.reqs, 1);
        step(&mut b.tokens, p.n);
        step(&mut b.host_kv_tokens, if p.to_host { p.n } else { 0 });
        b.prefill_ms += sign as f64 * p.attn_ms;
    }
}
