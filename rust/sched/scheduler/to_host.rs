//! Prefills whose KV ends in the host pool under `all` (every decode on the CPU): a whole prompt
//! is written there directly; one whose earlier chunks sit on the device is staged, its device
//! blocks copied layer by layer as its last chunk writes them.

use super::*;

impl Scheduler {
    /// Whether running `n` tokens after the first `computed` of this device-resident request
    /// finishes its prefill and its KV must then live in the host pool (every decode on the CPU).
    pub(super) fn prefill_goes_to_host(&self, req: &Request, computed: usize, n: usize) -> bool {
        self.config.offload == OffloadMode::AllCpu && req.device == Device::Gpu && computed + n == req.num_tokens()
    }

    /// Whether the host pool has blocks for `num_tokens` tokens, `computed` of them computed,
    /// once `pinned` more of its free (cached) blocks are pinned for a host-tier hit.
    pub(super) fn host_has_room(&self, computed: usize, num_tokens: usize, pinned: usize) -> bool {
        self.cpu.blocks_held(computed, num_tokens) + pinned <= self.cpu.num_free_blocks()
    }

    /// Give the request host blocks for `num_tokens` tokens and plan the layer-wise copy of its
    /// device blocks (which stay allocated as staging until `update()`). Only for a prompt whose
    /// earlier chunks already sit on the device; whole prompts go straight to the host.
    pub(super) fn stage_to_host(&mut self, id: RequestId, num_tokens: usize, step: &mut Step) {
        let grown = self.cpu.allocate_like(id, self.gpu.table(id), num_tokens);
        debug_assert!(grown, "host room was checked");
        let pairs = self.gpu.table(id).iter().copied().zip(self.cpu.table(id).iter().copied());
        step.to_host.pairs.extend(pairs.filter(|(g, _)| !g.is_null()));
        self.moving_to_host.push(id);
        self.stats.num_prefills_to_host += 1;
    }
}
