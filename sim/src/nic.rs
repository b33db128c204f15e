//! NICs: one per GPU, each a processor-sharing server; a read is a flow between two NICs.
//!
//! A flow's rate is the smaller of its two ends' fair shares: the source NIC's bandwidth split
//! evenly among the flows it serves, and likewise at the destination. Shares change only when a
//! flow starts or ends on a NIC, so only that NIC's flows are re-timed. Completion events carry a
//! version; a re-timed flow gets a new version and its old event is ignored.

use std::collections::{BTreeMap, BTreeSet};

/// Bucket width of the utilisation record, in nanoseconds (one virtual second).
pub const BUCKET_NS: u64 = 1_000_000_000;

/// A flow's handle.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct FlowId(pub u64);

#[derive(Clone, Debug)]
struct Flow {
    src: usize,
    dst: usize,
    remaining: f64,
    /// The most the flow can move per nanosecond whatever the NICs' shares (its queue pairs'
    /// message rate); infinite when nothing limits it.
    cap: f64,
    rate: f64,
    last_ns: u64,
    version: u64,
}

/// When a flow will finish, at its current rate; schedule a completion event for it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Finish {
    /// The flow.
    pub id: FlowId,
    /// Virtual time it finishes at.
    pub at_ns: u64,
    /// The version the completion event must carry.
    pub version: u64,
}

/// Every NIC of the run and the flows between them.
#[derive(Clone, Debug)]
pub struct Nics {
    bytes_per_ns: Vec<f64>,
    factor: Vec<f64>,
    /// Share of each NIC's time other traffic takes (an expert all-to-all that leaves the node).
    background: Vec<f64>,
    flows: BTreeMap<FlowId, Flow>,
    on_nic: Vec<BTreeSet<FlowId>>,
    next_id: u64,
    /// Bytes sent per NIC per utilisation bucket.
    sent: Vec<Vec<f64>>,
}

impl Nics {
    /// `count` NICs of `gb_s` gigabytes per second each.
    pub fn new(count: usize, gb_s: f64) -> Nics {
        Nics {
            bytes_per_ns: vec![gb_s; count],
            factor: vec![1.0; count],
            background: vec![0.0; count],
            flows: BTreeMap::new(),
            on_nic: vec![BTreeSet::new(); count],
            next_id: 0,
            sent: vec![Vec::new(); count],
        }
    }

    /// The bandwidth factor `nic` runs at (1.0 at full speed).
    pub fn factor(&self, nic: usize) -> f64 {
        self.factor[nic]
    }

    /// Flows in progress on `nic`.
    pub fn active(&self, nic: usize) -> usize {
        self.on_nic[nic].len()
    }

    /// The flows moving through `nic` now and the bytes a nanosecond they move together.
    pub fn load(&self, nic: usize) -> (usize, f64) {
        let rate = self.on_nic[nic].iter().map(|id| self.flows[id].rate).sum();
        (self.on_nic[nic].len(), rate)
    }

    /// The source and destination NICs of flow `id`, while it runs.
    pub fn ends(&self, id: FlowId) -> Option<(usize, usize)> {
        self.flows.get(&id).map(|f| (f.src, f.dst))
    }

    /// Bytes `nic` sent in each one-second bucket so far.
    pub fn sent_per_bucket(&self, nic: usize) -> &[f64] {
        &self.sent[nic]
    }

    fn share(&self, nic: usize) -> f64 {
        self.bytes_per_ns[nic] * self.factor[nic] * (1.0 - self.background[nic])
            / self.on_nic[nic].len().max(1) as f64
    }

    /// Accounts the bytes `flow` moved since its last update.
    fn advance(sent: &mut [Vec<f64>], flow: &mut Flow, now_ns: u64) {
        if now_ns <= flow.last_ns {
            return;
        }
        let moved = (flow.rate * (now_ns - flow.last_ns) as f64).min(flow.remaining);
        flow.remaining -= moved;
        // Spread the bytes over the buckets the interval covers.
        let (mut t, end) = (flow.last_ns, now_ns);
        let per_ns = moved / (end - t) as f64;
        let buckets = &mut sent[flow.src];
        while t < end {
            let bucket = (t / BUCKET_NS) as usize;
            let bucket_end = (bucket as u64 + 1) * BUCKET_NS;
            let span = bucket_end.min(end) - t;
            if buckets.len() <= bucket {
                buckets.resize(bucket + 1, 0.0);
            }
            buckets[bucket] += per_ns * span as f64;
            t += span;
        }
        flow.last_ns = now_ns;
    }

    /// Re-times every flow on the given NICs at `now_ns`.
    fn retime(&mut self, now_ns: u64, nics: &[usize], out: &mut Vec<Finish>) {
        let mut ids: Vec<FlowId> = nics.iter().flat_map(|&n| self.on_nic[n].iter().copied()).collect();
        if nics.len() > 1 {
            ids.sort_unstable();
            ids.dedup();
        }
        for id in ids {
            let (src, dst, cap) = {
                let flow = &self.flows[&id];
                (flow.src, flow.dst, flow.cap)
            };
            let rate = self.share(src).min(self.share(dst)).min(cap);
            let flow = self.flows.get_mut(&id).expect("listed flows exist");
            // A timed flow whose rate stays keeps its finish time and its event: progress is
            // linear, so settling it now and later or only later accounts the same bytes (and
            // the completion events of a busy NIC are mostly such re-timings).
            if flow.version > 0 && flow.rate == rate {
                continue;
            }
            Self::advance(&mut self.sent, flow, now_ns);
            flow.rate = rate;
            flow.version += 1;
            // A flow too slow to finish within u64 time saturates to "never" (the run's time
            // budget ends first) instead of wrapping to a finish time in the past.
            let at_ns = now_ns.saturating_add((flow.remaining / rate.max(1e-12)).ceil() as u64);
            out.push(Finish { id, at_ns, version: flow.version });
        }
    }

    /// Starts a flow of `bytes` from `src` to `dst` at `now_ns`, moving at most `cap` bytes a
    /// nanosecond (`f64::INFINITY` for no limit of its own); returns its id and the new finish
    /// times of every flow it slowed down (its own included).
    pub fn start(
        &mut self,
        now_ns: u64,
        src: usize,
        dst: usize,
        bytes: u64,
        cap: f64,
    ) -> (FlowId, Vec<Finish>) {
        let id = FlowId(self.next_id);
        self.next_id += 1;
        let flow = Flow { src, dst, remaining: bytes as f64, cap, rate: 0.0, last_ns: now_ns, version: 0 };
        // `retime` settles every flow's progress at its old rate before giving it the new share.
        let mut out = Vec::new();
        self.flows.insert(id, flow);
        self.on_nic[src].insert(id);
        self.on_nic[dst].insert(id);
        self.retime(now_ns, &[src, dst], &mut out);
        (id, out)
    }

    /// Ends `id` if `version` is current: returns `None` for a stale event, else the flow's
    /// ends and the new finish times of the flows that speed up.
    pub fn finish(&mut self, now_ns: u64, id: FlowId, version: u64) -> Option<((usize, usize), Vec<Finish>)> {
        let flow = self.flows.get(&id)?;
        if flow.version != version {
            return None;
        }
        Some(self.remove(now_ns, id))
    }

    /// Ends `id` now whatever its progress (a failed read); returns its ends and re-timings.
    pub fn abort(&mut self, now_ns: u64, id: FlowId) -> Option<((usize, usize), Vec<Finish>)> {
        if !self.flows.contains_key(&id) {
            return None;
        }
        Some(self.remove(now_ns, id))
    }

    fn remove(&mut self, now_ns: u64, id: FlowId) -> ((usize, usize), Vec<Finish>) {
        let mut flow = self.flows.remove(&id).expect("checked");
        Self::advance(&mut self.sent, &mut flow, now_ns);
        self.on_nic[flow.src].remove(&id);
        self.on_nic[flow.dst].remove(&id);
        let mut out = Vec::new();
        self.retime(now_ns, &[flow.src, flow.dst], &mut out);
        ((flow.src, flow.dst), out)
    }

    /// Scales `nic`'s bandwidth by `factor` from `now_ns` on (1.0 restores it).
    pub fn set_factor(&mut self, now_ns: u64, nic: usize, factor: f64) -> Vec<Finish> {
        let mut out = Vec::new();
        // Settle progress at the old rate first.
        self.retime(now_ns, &[nic], &mut Vec::new());
        self.factor[nic] = factor;
        self.retime(now_ns, &[nic], &mut out);
        out
    }

    /// Gives `share` (in [0, 1]) of `nic`'s time to other traffic from `now_ns` on, so reads
    /// share what is left (0 gives it back); returns the re-timed flows.
    pub fn set_background(&mut self, now_ns: u64, nic: usize, share: f64) -> Vec<Finish> {
        let share = share.clamp(0.0, 1.0);
        if self.background[nic] == share {
            return Vec::new();
        }
        let mut out = Vec::new();
        self.retime(now_ns, &[nic], &mut Vec::new());
        self.background[nic] = share;
        self.retime(now_ns, &[nic], &mut out);
        out
    }

    /// The share of `nic`'s time other traffic takes now.
    pub fn background(&self, nic: usize) -> f64 {
        self.background[nic]
    }

    /// Flows that touch `nic`, in id order.
    pub fn flows_on(&self, nic: usize) -> Vec<FlowId> {
        self.on_nic[nic].iter().copied().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn two_flows_share_a_source_and_the_survivor_speeds_up() {
        // 1 GB/s = 1 byte/ns.
        let mut nics = Nics::new(3, 1.0);
        let (a, f) = nics.start(0, 0, 1, 1000, f64::INFINITY);
        assert_eq!(f, [Finish { id: a, at_ns: 1000, version: 1 }]);
        let (b, f) = nics.start(0, 0, 2, 500, f64::INFINITY);
        // Both at 0.5 byte/ns now: a needs 2000 ns, b 1000 ns.
        let finish: BTreeMap<FlowId, u64> = f.iter().map(|x| (x.id, x.at_ns)).collect();
        assert_eq!((finish[&a], finish[&b]), (2000, 1000));
        let b_version = f.iter().find(|x| x.id == b).unwrap().version;
        let ((src, dst), f) = nics.finish(1000, b, b_version).unwrap();
        assert_eq!((src, dst), (0, 2));
        // a moved 500 bytes by t = 1000 and has 500 left at the full rate.
        assert_eq!(f.len(), 1);
        assert_eq!(f[0].at_ns, 1500);
        assert_eq!(nics.finish(1500, a, 1), None, "stale version ignored");
        assert!(nics.finish(1500, a, f[0].version).is_some());
        let total: f64 = nics.sent_per_bucket(0).iter().sum();
        assert!((total - 1500.0).abs() < 1e-6, "{total}");
    }

    #[test]
    fn a_capped_flow_leaves_the_rest_to_its_neighbour() {
        // Two flows share a 1 byte/ns source; one can move only 0.2 byte/ns (its queue pairs),
        // so it takes 0.2 and the other 0.5, its fair share (the cap does not hand back).
        let mut nics = Nics::new(3, 1.0);
        let (_, out) = nics.start(0, 0, 1, 1000, 0.2);
        assert_eq!(out[0].at_ns, 5000);
        let (b, out) = nics.start(0, 0, 2, 1000, f64::INFINITY);
        let own = out.iter().find(|f| f.id == b).expect("b is timed");
        assert_eq!(own.at_ns, 2000);
    }

    #[test]
    fn background_traffic_slows_reads_until_it_stops() {
        // 1 byte/ns; a 1,000-byte read alone takes 1,000 ns. Half the NIC goes to an all-to-all
        // from t = 0 to t = 500: the read moves 250 bytes by then, the rest at full speed.
        let mut nics = Nics::new(2, 1.0);
        nics.set_background(0, 0, 0.5);
        let (_, out) = nics.start(0, 0, 1, 1000, f64::INFINITY);
        assert_eq!(out[0].at_ns, 2000);
        let out = nics.set_background(500, 0, 0.0);
        assert_eq!(out[0].at_ns, 1250);
        assert!(nics.set_background(600, 0, 0.0).is_empty(), "no change, no re-timing");
    }

    #[test]
    fn a_nic_load_is_its_flows_and_their_rates() {
        // 1 byte/ns: two flows from NIC 0 share it, so NIC 0 moves 1 byte/ns in all and each
        // destination half of that.
        let mut nics = Nics::new(3, 1.0);
        let (a, _) = nics.start(0, 0, 1, 1000, f64::INFINITY);
        nics.start(0, 0, 2, 1000, f64::INFINITY);
        assert_eq!(nics.load(0), (2, 1.0));
        assert_eq!(nics.load(1), (1, 0.5));
        assert_eq!(nics.ends(a), Some((0, 1)));
        nics.abort(10, a);
        assert_eq!((nics.load(0), nics.load(1), nics.ends(a)), ((1, 1.0), (0, 0.0), None));
    }

    #[test]
    fn slow_nic_stretches_its_flows() {
        let mut nics = Nics::new(2, 1.0);
        let (a, _) = nics.start(0, 0, 1, 1000, f64::INFINITY);
        let f = nics.set_factor(500, 0, 0.5);
        assert_eq!(f[0].id, a);
        assert_eq!(f[0].at_ns, 1500, "500 bytes left at half speed");
    }
}
