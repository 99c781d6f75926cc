//! Prefix caching across both pools: a waiting prompt's lookup runs through the device cache,
//! then on into the host tier (`kv/manager/host_tier.rs`), whose blocks are copied into new
//! device blocks ahead of the prefill; under `neo` a prompt bound for the host pool instead
//! attends over the host blocks it starts with, in place. Device blocks the cache evicts are
//! copied into the host tier at the end of each plan, before anything can write them.

use super::*;

impl Scheduler {
    /// The cached blocks a waiting request could start from, device first, then the host tier
    /// (none once it has computed anything: a recomputed request looks up again when its KV
    /// was dropped).
    pub(super) fn prefix_hit(&self, req: &Request) -> PrefixHit {
        if req.num_computed_tokens > 0 {
            return PrefixHit::default();
        }
        let mut hit = self.gpu.lookup(&req.token_ids, req.salt, &req.block_hashes);
        if self.config.num_cpu_prefix_blocks > 0 {
            self.cpu.extend_hit(&mut hit, &req.token_ids, &req.block_hashes);
        }
        self.gpu.skip_behind_window(&mut hit);
        hit
    }

    /// Keep only the device part of `hit`: its host-tier blocks are recomputed instead of copied
    /// in (the host pool has no room to pin them), and the window's skip counted again.
    pub(super) fn drop_host_tier(&self, hit: &mut PrefixHit) {
        hit.drop_host();
        self.gpu.skip_behind_window(hit);
    }

    /// Under `neo`, the host blocks a host-bound prompt starts with (the host tier's, and those
    /// of the host pool's requests): the prompt's rest attends on the CPU over them, in place,
    /// and it decodes there.
    pub(super) fn in_place_hit(&self, req: &Request) -> PrefixHit {
        match (self.config.num_cpu_prefix_blocks, req.num_computed_tokens) {
            (1.., 0) => {
                let mut hit = self.cpu.lookup(&req.token_ids, req.salt, &req.block_hashes);
                self.cpu.skip_behind_window(&mut hit);
                hit
            }
            _ => PrefixHit::default(),
        }
    }

    /// An admitted prefill starts after its cached prefix: count the lookup and skip the hit
    /// tokens. `in_place`: the hit's blocks are host blocks (`in_place_hit`).
    pub(super) fn count_prefix_hit(&mut self, id: RequestId, hit: &PrefixHit, in_place: bool) {
        let req = self.requests.get_mut(&id).expect("admitted request exists");
        if self.gpu.prefix_caching() && req.num_computed_tokens == 0 {
            let bs = self.config.block_size;
            let on_host = if in_place { hit.num_blocks() } else { hit.num_host_blocks() };
            self.stats.prefix_cache_queries += req.num_tokens() as u64;
            self.stats.prefix_cache_hits += ((hit.num_blocks() - on_host) * bs) as u64;
            self.stats.prefix_cache_host_hits += (on_host * bs) as u64;
            req.num_computed_tokens = hit.num_blocks() * bs;
            req.num_cached_tokens.get_or_insert(req.num_computed_tokens);
        }
    }

    /// Plan the copy of `hit`'s host blocks (those not behind the window) into the device
    /// blocks at their entries of the request's table (just allocated). The host
    /// blocks must be pinned (`KvManager::pin_host_hit`) since the lookup; the device copies
    /// are registered in the cache by `update()`, once they hold the bytes.
    pub(super) fn copy_host_hit(&mut self, id: RequestId, hit: &PrefixHit, step: &mut Step) {
        let before = step.cache_to_device.pairs.len();
        step.cache_to_device.pairs.extend(hit.host_copies(self.gpu.table(id)));
        let copied = step.cache_to_device.pairs.len() - before;
        if copied > 0 {
            self.stats.num_cache_blocks_to_device += copied as u64;
            self.host_hit_copies.push(id);
        }
    }

    /// Copy the device blocks this plan evicted from the cache into the host tier. Their ids
    /// are handed out again in this plan; the runner gathers each layer of them before anything
    /// writes it. A store may take a host block this plan freed: a swap-in's source (the runner
    /// reads it before any copy into the host pool lands) or the swap-out destination of a
    /// request recomputed since (the swap-out lands before the forward, the store after it).
    pub(super) fn store_evicted(&mut self, step: &mut Step) {
        let evicted = self.gpu.take_evicted();
        step.cache_to_host.pairs = self.cpu.store(&evicted);
        self.stored_in_flight.extend(step.cache_to_host.pairs.iter().map(|p| p.1));
        self.stats.num_cache_blocks_to_host += step.cache_to_host.pairs.len() as u64;
    }

    /// `update()`: the copies of the last plan have landed.
    pub(super) fn land_cache_copies(&mut self) {
        self.cpu.unpin_all();
        self.stored_in_flight.clear();
        self.host_hit_copies.clear();
    }

    /// `abort_step()`: the copies of the failed plan may never have run. Host blocks they were
    /// to fill leave the cache; the requests given device copies are aborted by the caller.
    pub(super) fn drop_cache_copies(&mut self) {
        self.cpu.unpin_all();
        if !self.stored_in_flight.is_empty() {
            self.cpu.forget(&std::mem::take(&mut self.stored_in_flight));
        }
        self.host_hit_copies.clear();
    }
}
