//! The scheduler's accounting checks, run by tests between iterations.

use super::*;

impl Scheduler {
    /// Check the accounting between iterations: pools agree with their tables and reference
    /// counts (`KvManager::check`), every request is in exactly one queue and holds blocks only
    /// where its status says, and none behind a sliding group's window.
    pub fn check_invariants(&self) -> std::result::Result<(), String> {
        for kv in [&self.gpu, &self.cpu] {
            kv.check()?;
            if let Some((id, _)) = kv.tables().find(|(id, _)| !self.requests.contains_key(id)) {
                return Err(format!("{} pool holds blocks of unknown request {id}", kv.device().name()));
            }
            // Exactly the blocks behind each sliding group's window are released.
            for (id, table) in kv.tables() {
                let computed = self.requests[&id].num_computed_tokens;
                if let Some(e) = (0..table.len()).find(|&e| table[e].is_null() != kv.is_behind_window(e, computed)) {
                    return Err(format!(
                        "{} pool: request {id} ({computed} computed) has table entry {e} {}",
                        kv.device().name(),
                        if table[e].is_null() { "released" } else { "held behind the window" }
                    ));
                }
            }
        }
        let queued = self.waiting.len() + self.running.len() + self.swapped.len();
        if queued != self.requests.len() {
            return Err(format!("{queued} queued requests, {} known", self.requests.len()));
        }
        if self.running.len() > self.config.max_num_seqs {
            return Err(format!("{} running > max_num_seqs {}", self.running.len(), self.config.max_num_seqs));
        }
        let queues = [
            (RequestStatus::Waiting, self.waiting.iter().collect::<Vec<_>>()),
            (RequestStatus::Running, self.running.iter().collect()),
            (RequestStatus::Swapped, self.swapped.iter().collect()),
        ];
        for (status, ids) in queues {
            for id in ids {
                let req = self.requests.get(id).ok_or(format!("queued request {id} is unknown"))?;
                if req.status != status {
                    return Err(format!("request {id} is queued as {status:?} but marked {:?}", req.status));
                }
                let (gpu, cpu) = (self.gpu.table(*id).len(), self.cpu.table(*id).len());
                let cached = self.gpu.blocks_for(req.num_computed_tokens);
                let ok = match status {
                    RequestStatus::Waiting => gpu == 0 && cpu == 0 && req.num_computed_tokens == 0,
                    RequestStatus::Running if req.device == Device::Gpu => cpu == 0 && gpu >= cached,
                    RequestStatus::Running => gpu == 0 && cpu >= cached,
                    RequestStatus::Swapped => req.device == Device::Cpu && gpu == 0 && cpu == cached,
                };
                if !ok {
                    return Err(format!(
                        "request {id} ({status:?}, {} computed) holds {gpu} gpu / {cpu} cpu blocks",
                        req.num_computed_tokens
                    ));
                }
            }
        }
        Ok(())
    }
}
