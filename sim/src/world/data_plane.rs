//! The data plane: reads posted as NIC flows, the safety checks on their addresses and blocks,
//! their completion and their aborts.

use std::collections::{BTreeMap, BTreeSet};

use pdkv_core::decode::{DecodeEvent, ReadOp, ReadOutcome};
use pdkv_core::ids::{RankId, RequestId, Role};

use crate::nic::{Finish, FlowId, Nics};

use super::control::Listener;
use crate::result::ViolationKind;
use crate::scenario::FaultKind;
use crate::trace::Link;

use super::{list, Ev, World};
use pdkv_engine::pool::FREE;

/// The network: listeners, registered memory, NICs and the flows on them.
pub(super) struct Network {
    pub(super) listeners: Vec<Listener>,
    /// Which listener binds each (host, port).
    pub(super) listener_at: BTreeMap<(String, u16), usize>,
    /// Registered memory regions by base address: (prefill rank index, length).
    pub(super) regions: BTreeMap<u64, (usize, u64)>,
    /// Regions of crashed incarnations: reads into them fail as a NIC would (stale keys).
    pub(super) retired_regions: BTreeMap<u64, (usize, u64)>,
    pub(super) nics: Nics,
    pub(super) flows: BTreeMap<FlowId, FlowInfo>,
}

pub(super) struct FlowInfo {
    worker: usize,
    ops: Vec<(RequestId, Option<u16>)>,
    transfer: u32,
    server: usize,
    blocks: std::sync::Arc<[u32]>,
    started: u64,
}

impl World {
    fn nic_down(&self, rank: RankId) -> bool {
        let crashed = match rank.engine.role {
            Role::Prefill => self.prefill.down[usize::from(rank.engine.index)],
            Role::Decode => self.decode.down[usize::from(rank.engine.index)],
        };
        crashed
            || self
                .faults
                .iter()
                .flatten()
                .any(|f| matches!(f.kind, FaultKind::NicDown) && f.pattern.matches(rank))
    }

    fn send_queue_full(&mut self, rank: RankId) -> bool {
        let timeline = self
            .faults
            .iter()
            .flatten()
            .any(|f| matches!(f.kind, FaultKind::SendQueueFull) && f.pattern.matches(rank));
        let p = self.sc.faults.swarm.send_queue_full;
        let full = timeline || (p > 0.0 && self.streams.chance(p));
        if full {
            self.touch(rank, self.now, self.now);
        }
        full
    }

    /// Posts the reads of one request from worker `w` as one flow (per-layer reads posted
    /// together move together), after the safety checks on their addresses and blocks.
    pub(super) fn post_reads(&mut self, w: usize, ops: Vec<ReadOp>) {
        let first = &ops[0];
        let request = first.request();
        let me = self.decode.ranks[w];
        if self.send_queue_full(me) {
            for op in &ops {
                let ev = Ev::ReadLater {
                    worker: w,
                    request,
                    layer: op.layer,
                    outcome: Box::new(ReadOutcome::SendQueueFull),
                };
                self.at(1_000, ev);
            }
            return;
        }
        // Which rank's memory do the addresses point into?
        let address = first.first_address();
        let owner = |regions: &BTreeMap<u64, (usize, u64)>| {
            regions
                .range(..=address)
                .next_back()
                .and_then(|(&base, &(rank, len))| (address < base + len).then_some(rank))
        };
        let server = owner(&self.net.regions);
        if server.is_none() && owner(&self.net.retired_regions).is_some() {
            // Memory of a crashed incarnation: its keys died with it, so the NIC refuses the read.
            self.fail_reads(w, &ops, "remote access error (memory of a restarted rank)");
            return;
        }
        let Some(server) = server else {
            self.violation(
                ViolationKind::ReadForeignRegion,
                vec![me.to_string()],
                format!("{request}: address outside every registered region"),
            );
            self.fail_reads(w, &ops, "remote access error");
            return;
        };
        let server_rank = self.prefill.ranks[server];
        // A down NIC (or crashed engine) fails the read before it touches any memory.
        if self.nic_down(server_rank) || self.nic_down(me) {
            self.fail_reads(w, &ops, "NIC down");
            return;
        }
        if server_rank != first.plan.source {
            let detail =
                format!("{request}: read meant for {} reads the memory of {server_rank}", first.plan.source);
            self.violation(
                ViolationKind::ReadForeignRegion,
                vec![me.to_string(), server_rank.to_string()],
                detail,
            );
        }
        let transfer = self.clients.transfers.number(&first.plan.transfer_id).unwrap_or(FREE - 1);
        if self.checks.fenced.contains(&transfer) {
            // The reaper revoked remote access: the read fails at the NIC, touching nothing.
            self.fail_reads(w, &ops, "remote access revoked (fenced)");
            return;
        }
        self.check_blocks(me, server, transfer, &first.plan.remote_block_ids, "posted");
        let nic_src = server;
        let nic_dst = self.decode_nic(w);
        let bytes: u64 = ops.iter().map(ReadOp::bytes).sum();
        self.stats.reads[server] += 1;
        self.stats.bytes[server] += bytes;
        // Every RDMA operation takes one of the NIC's message slots as well as its bytes: at
        // `nic_message_rate_mpps` operations a second, one is worth `nic_gb_s / rate` of the
        // NIC's bandwidth. So a read of many small runs (one-token blocks, a fragmented pool)
        // occupies both ends for longer than its bytes alone would.
        let messages: u64 = ops.iter().map(ReadOp::messages).sum();
        self.stats.messages[server] += messages;
        let hw = &self.sc.hardware;
        let per_message_bytes = hw.nic_gb_s * 1e3 / hw.nic_message_rate_mpps;
        let work = bytes.saturating_add((messages as f64 * per_message_bytes) as u64);
        // A transfer posts its operations on `nic_qps` queue pairs, each carrying at most
        // `nic_qp_message_rate_mpps` of them: a read of many small runs cannot go faster than
        // its queue pairs, however idle the NICs are.
        let cap = if messages == 0 {
            f64::INFINITY
        } else {
            let seconds = messages as f64 / (f64::from(hw.nic_qps) * hw.nic_qp_message_rate_mpps * 1e6);
            work as f64 / (seconds * 1e9)
        };
        let latency = (hw.nic_latency_us * 1e3) as u64;
        let (id, finishes) = self.net.nics.start(self.now + latency, nic_src, nic_dst, work, cap);
        self.schedule_flows(&[nic_src, nic_dst], finishes);
        let info = FlowInfo {
            worker: w,
            ops: ops.iter().map(|op| (op.request(), op.layer)).collect(),
            transfer,
            server,
            blocks: first.plan.remote_block_ids.clone(),
            started: self.now,
        };
        self.net.flows.insert(id, info);
    }

    /// A read touches blocks that are not its transfer's: freed, or another request's.
    fn check_blocks(&mut self, me: RankId, server: usize, transfer: u32, blocks: &[u32], when: &str) {
        let rank = self.prefill.ranks[server];
        let g = self.prefill.group_base[usize::from(rank.engine.index)] + usize::from(rank.dp);
        let pool = self.prefill.groups[g].sched.pool();
        let wrong = pool.not_owned_by(blocks, transfer);
        if wrong.is_empty() {
            return;
        }
        let freed = wrong.iter().all(|&b| pool.owner_of(b) == FREE && b < pool.capacity());
        let what = if freed { "freed" } else { "another request's (or unallocated)" };
        let name = self.clients.transfers.id(transfer).map_or("?".to_string(), |t| t.to_string());
        let shown: Vec<u32> = wrong.iter().copied().take(4).collect();
        let more = if wrong.len() > shown.len() {
            format!(" and {} more", wrong.len() - shown.len())
        } else {
            String::new()
        };
        let detail = format!("read of {name} {when}: blocks {}{more} on {rank} are {what}", list(&shown));
        self.violation(ViolationKind::ReadFreedBlock, vec![me.to_string(), rank.to_string()], detail);
    }

    fn fail_reads(&mut self, w: usize, ops: &[ReadOp], reason: &str) {
        let latency = (self.sc.hardware.nic_latency_us * 1e3) as u64;
        for op in ops {
            let outcome = ReadOutcome::Failed(reason.to_string());
            self.at(
                latency,
                Ev::ReadLater {
                    worker: w,
                    request: op.request(),
                    layer: op.layer,
                    outcome: Box::new(outcome),
                },
            );
        }
    }

    /// Schedules the completion of every re-timed flow in `finishes`, after a change on the NICs
    /// `ends`; with a trace on, records the load of every NIC whose flows changed.
    pub(super) fn schedule_flows(&mut self, ends: &[usize], finishes: Vec<Finish>) {
        if self.trace_on {
            self.trace_nic_loads(ends, &finishes);
        }
        for f in finishes {
            let delay = f.at_ns.saturating_sub(self.now);
            self.at(delay, Ev::Flow { id: f.id, version: f.version });
        }
    }

    /// Records, as counters, the load of the NICs `ends` and of both ends of every flow in
    /// `finishes` (a re-timed flow changes what its other end moves too), once each.
    fn trace_nic_loads(&mut self, ends: &[usize], finishes: &[Finish]) {
        let mut nics: BTreeSet<usize> = ends.iter().copied().collect();
        for f in finishes {
            if let Some((src, dst)) = self.net.nics.ends(f.id) {
                nics.extend([src, dst]);
            }
        }
        let prefill = self.prefill.ranks.len();
        for nic in nics {
            let (reads, bytes_per_ns) = self.net.nics.load(nic);
            let track = if nic < prefill {
                self.prefill.ranks[nic].to_string()
            } else {
                self.decode.ranks[nic - prefill].to_string()
            };
            let rate_mb_s = (bytes_per_ns * 1e3).round() as u64;
            let link = Some(Link::NicLoad { reads: reads as u64, rate_mb_s });
            let detail = format!("reads={reads} MB/s={rate_mb_s}");
            self.record_linked(self.now, "nic", "load", track, None, detail, link);
        }
    }

    pub(super) fn on_flow(&mut self, id: FlowId, version: u64) {
        let Some((ends, finishes)) = self.net.nics.finish(self.now, id, version) else { return };
        self.schedule_flows(&[ends.0, ends.1], finishes);
        let Some(info) = self.net.flows.remove(&id) else { return };
        self.stats.last_progress_ns = self.now;
        self.stats.kv_read_ms.push((self.now - info.started) as f64 / 1e6);
        let me = self.decode.ranks[info.worker];
        let server_rank = self.prefill.ranks[info.server];
        if self.trace_on {
            // A read flow is one request's: it names it, and the first to complete ends the
            // arrow from the request's prefill step.
            let request = info.ops.first().map(|(r, _)| *r);
            let detail = format!(
                "to {me} layers={}{}",
                info.ops.len(),
                request.map_or_else(String::new, |r| format!(" request={r}"))
            );
            let link = request.map(|r| Link::FlowEnd { request: r.0 });
            let (t, dur) = (info.started, Some(self.now - info.started));
            self.record_linked(t, "nic", "read", server_rank.to_string(), dur, detail, link);
        }
        let outcome = if self.checks.fenced.contains(&info.transfer) {
            ReadOutcome::Failed("remote access revoked (fenced)".into())
        } else {
            self.check_blocks(me, info.server, info.transfer, &info.blocks, "completed");
            ReadOutcome::Ok
        };
        for (request, layer) in info.ops {
            self.decode_worker(
                info.worker,
                DecodeEvent::ReadDone { request, layer, outcome: outcome.clone() },
            );
        }
    }

    /// The worker aborts a request's posted reads, as a verbs driver does by moving the queue
    /// pair to the error state: the NIC stops the flows at once and, one NIC latency later,
    /// answers each read aborted (its flushed completion). Reads not on the NIC yet (refused
    /// with a full send queue, or failing at posting) are answered by their own pending events.
    pub(super) fn abort_reads(&mut self, w: usize, request: RequestId) {
        let ids: Vec<FlowId> = self
            .net
            .flows
            .iter()
            .filter(|(_, info)| info.worker == w && info.ops.iter().any(|(r, _)| *r == request))
            .map(|(id, _)| *id)
            .collect();
        let latency = (self.sc.hardware.nic_latency_us * 1e3) as u64;
        for id in ids {
            if let Some((ends, finishes)) = self.net.nics.abort(self.now, id) {
                self.schedule_flows(&[ends.0, ends.1], finishes);
            }
            let Some(info) = self.net.flows.remove(&id) else { continue };
            trace!(
                self,
                "nic",
                "read_aborted",
                self.prefill.ranks[info.server].to_string(),
                Some(self.now - info.started),
                format!("to {} layers={} request={request}", self.decode.ranks[w], info.ops.len()),
            );
            for (request, layer) in info.ops {
                let outcome = Box::new(ReadOutcome::Aborted);
                self.at(latency, Ev::ReadLater { worker: w, request, layer, outcome });
            }
        }
    }

    /// Ends every flow touching `nic`; the reading workers get a failed read.
    pub(super) fn abort_flows_on(&mut self, nic: usize, reason: &str) {
        for id in self.net.nics.flows_on(nic) {
            if let Some((ends, finishes)) = self.net.nics.abort(self.now, id) {
                self.schedule_flows(&[ends.0, ends.1], finishes);
            }
            if let Some(info) = self.net.flows.remove(&id) {
                for (request, layer) in info.ops {
                    let outcome = ReadOutcome::Failed(reason.to_string());
                    self.decode_worker(info.worker, DecodeEvent::ReadDone { request, layer, outcome });
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::scenario::{Clients, Length, Scenario};
    use crate::world::RunOptions;

    /// With one-token blocks a read is thousands of operations, so the queue pairs a transfer
    /// posts them on bound it: fewer queue pairs, slower reads, on otherwise idle NICs.
    #[test]
    fn a_read_of_many_operations_waits_for_its_queue_pairs() {
        let read_ms = |qps: u16| {
            let mut sc = Scenario::from_notation("2P_TP8:1D_DP8EP");
            sc.model.block_size_tokens = 1;
            // A pool small enough to wrap: a reused pool hands out scattered blocks.
            sc.engines.kv_blocks_per_gpu = 30_000;
            sc.hardware.nic_qps = qps;
            sc.workload.clients = Clients::Closed { concurrency: 8, requests: 96 };
            sc.workload.input_tokens = Length::Fixed(2048);
            sc.workload.output_tokens = Length::Fixed(4);
            let r = crate::run(&sc, RunOptions::default()).unwrap_or_else(|e| panic!("{e}")).result;
            r.latency_ms.kv_read.map_or(0.0, |s| s.mean)
        };
        let (one, four, many) = (read_ms(1), read_ms(4), read_ms(64));
        // One queue pair carries 1.09 M operations a second; 64 would outrun the NIC's 7.1 M
        // ceiling, which then sets the time (45.5, 12.0 and 8.4 ms here).
        assert!(one > 2.0 * four, "1 QP {one} ms, 4 QPs {four} ms");
        assert!(four > many, "4 QPs {four} ms, 64 QPs {many} ms");
        assert!(many > 0.0);
    }
}
