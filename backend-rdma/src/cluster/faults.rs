//! Injected faults: killing a prefill rank after N requests, and restarting it.

use std::time::Duration;

use pdkv_core::ids::RankId;

use super::{Cluster, Fault};

impl Cluster {
    pub(super) fn maybe_kill(&mut self) {
        let faults = self.config.faults.clone();
        for fault in faults {
            let Fault::KillPrefill { rank, after, restart_after_ms } = fault else { continue };
            if self.prefilled != after {
                continue;
            }
            let Some(proc) = self.ranks.get_mut(&rank) else { continue };
            if let Some(child) = proc.child.as_mut() {
                let _ = child.kill();
                let _ = child.wait();
            }
            proc.killed_by_fault = true;
            proc.alive = false;
            proc.writer = None;
            self.processes.killed_by_fault += 1;
            self.down_by_fault.insert(rank);
            self.expose_group(rank);
            let at = self.started_at.elapsed().as_millis();
            self.faults_log.push(format!("killed {rank} at {at} ms, after {after} prefills"));
            if self.is_foreign(rank.engine) {
                self.foreign_killed(rank);
            }
            if let Some(ms) = restart_after_ms {
                self.restart_at = Some((std::time::Instant::now() + Duration::from_millis(ms), rank));
            }
            self.rank_lost(rank);
        }
    }

    /// A fault hit prefill rank `rank`: every request of its DP group still in flight may fail
    /// because of it (its KV, or part of it, was on the rank), and so may the reaping of every
    /// transfer the group holds.
    /// Requests that the proxy sends to the group while the rank is down are exposed as they are
    /// sent ([`Cluster::submit`]).
    pub(super) fn expose_group(&mut self, rank: RankId) {
        let group = (usize::from(rank.engine.index), rank.dp);
        for req in self.requests.values_mut().filter(|r| r.prefill == group) {
            req.exposed = true;
            self.exposed.insert(req.transfer_id.clone());
        }
        // So is every transfer the group still holds whose request already ended: its releases
        // may be on their way to the killed rank and lost with it (a request ends when its KV
        // arrived, before its release is delivered).
        let held: Vec<_> = self.engines[group.0]
            .held()
            .filter(|t| t.owner_dp == rank.dp)
            .map(|t| t.transfer_id.clone())
            .collect();
        self.exposed.extend(held);
    }

    pub(super) fn restart(&mut self, rank: RankId) {
        let life = self.ranks.get(&rank).map_or(0, |p| p.life + 1);
        if let Err(e) = self.spawn(rank, life) {
            self.problem(format!("restart of {rank}: {e}"));
        }
    }

    // -------------------------------------------------------------------------- the loop
}
