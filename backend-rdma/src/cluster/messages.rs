//! Message faults in the scheduler: what each sender is told to inject, the dispatches the
//! scheduler itself loses or delays, the fault log, and what each injected message fault
//! excuses.
//!
//! A fault excuses exactly what it can cause, as the simulator's do. A lost or delayed release
//! can only leave its transfer to the reaper. A lost or delayed read lease can also let the
//! reaper fence the blocks under a read, so its request's failure is excused too, and so is a
//! lost or delayed dispatch's. A lost or delayed handshake message fails the dialler's step (the
//! group's vote), so it touches the DP groups at both ends for the delay plus a handshake and a
//! transfer timeout, and a request of either group that fails while it was in flight in that
//! window is excused. A duplicate excuses nothing: every copy after the first must be counted
//! once.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use pdkv_core::ids::{EngineId, RankId, Role, TransferId};

use super::clients::Req;
use super::{Cluster, ClusterConfig, Fault};
use crate::message_faults::{
    Injector, Later, MessageAction, MessageFault, MessageHit, MessageKind, SenderFaults,
};
use pdkv_core::decode::RecvRequest;

/// Most message-fault lines listed in the fault log; the rest are counted in its summary line.
const MAX_LISTED: usize = 1000;
/// The stream of the scheduler's own draws (dispatches): apart from the request stream (1) and
/// the cluster fuzzer's (0).
const DISPATCH_STREAM: u64 = 2;
/// The first stream of the ranks' draws: each rank and life gets its own.
const RANK_STREAMS: u64 = 16;

/// A DP group: its engine and DP rank.
type Group = (EngineId, u16);

/// The run's message faults and what they did.
pub(super) struct Messages {
    /// Every message fault of the run: the explicit ones, then `--drop-releases`.
    faults: Vec<MessageFault>,
    seed: u64,
    /// The scheduler's own fault layer (dispatches).
    injector: Injector,
    /// Dispatches a delay holds, with their decode group.
    delayed: Later<(usize, RecvRequest)>,
    /// Messages each fault hit, per sender: a restarted sender gets what is left of a count.
    used: BTreeMap<(u16, RankId), u32>,
    /// When a fault touched each DP group.
    touched: Touches,
    /// How long a handshake fault's effects may last after its delay: a handshake timeout
    /// (the dial) and a transfer timeout (the reads it held up).
    grace: Duration,
    /// Messages hit, by what happened and kind.
    counts: BTreeMap<(&'static str, MessageKind), u64>,
    listed: usize,
}

impl Messages {
    pub(super) fn new(config: &ClusterConfig) -> Messages {
        let faults = config.message_faults();
        let indexed = faults.iter().enumerate().map(|(i, f)| (i as u16, f.clone())).collect();
        let scheduler = SenderFaults { seed: config.seed, stream: DISPATCH_STREAM, faults: indexed };
        Messages {
            injector: Injector::new(&scheduler),
            faults,
            seed: config.seed,
            delayed: Later::default(),
            used: BTreeMap::new(),
            touched: Touches::default(),
            grace: Duration::from_millis(
                config.timeouts.handshake_ms.saturating_add(config.timeouts.transfer_ms),
            ),
            counts: BTreeMap::new(),
            listed: 0,
        }
    }

    /// How long until a held dispatch is due.
    pub(super) fn wait(&self) -> Option<Duration> {
        self.delayed.wait()
    }
}

impl ClusterConfig {
    /// Every message fault of the run, in the order they are tried: the `--lose-messages`,
    /// `--duplicate-messages` and `--delay-messages` flags, then each `--drop-releases
    /// RANK=N`, which is `--lose-messages RANK:release=N`.
    pub fn message_faults(&self) -> Vec<MessageFault> {
        let drops = self.faults.iter().filter_map(|f| match *f {
            Fault::DropReleases { rank, count } => Some(MessageFault {
                action: MessageAction::Lose,
                target: rank.to_string(),
                kinds: Some(vec![MessageKind::Release]),
                count: Some(count),
                probability_ppm: None,
            }),
            Fault::KillPrefill { .. } => None,
        });
        self.messages.iter().cloned().chain(drops).collect()
    }
}

/// What a message fault excuses (see the module doc).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum Excuse {
    /// Nothing: a duplicate.
    Nothing,
    /// The reaping of this transfer.
    Reaping(TransferId),
    /// The failure of this transfer's request, and the transfer's reaping.
    Request(TransferId),
    /// Failures of requests of these ranks' DP groups in flight for this long from now.
    Touch {
        /// The message's ends.
        ranks: Vec<RankId>,
        /// The message's delay plus the grace.
        lasting: Duration,
    },
}

/// What `hit` excuses, `grace` past its delay for a handshake message.
pub(super) fn excuse(hit: &MessageHit, grace: Duration) -> Excuse {
    if hit.fate.only_duplicated() {
        return Excuse::Nothing;
    }
    match (hit.kind, &hit.transfer_id) {
        (MessageKind::Release, Some(t)) => Excuse::Reaping(t.clone()),
        (MessageKind::Lease | MessageKind::Dispatch, Some(t)) => Excuse::Request(t.clone()),
        _ => Excuse::Touch {
            ranks: [Some(hit.from), hit.to].into_iter().flatten().collect(),
            lasting: Duration::from_millis(hit.fate.delay_ms).saturating_add(grace),
        },
    }
}

/// When faults touched each DP group: a request of a touched group whose life overlaps a
/// window may fail because of it.
#[derive(Default)]
pub(super) struct Touches(BTreeMap<Group, Vec<(Instant, Instant)>>);

impl Touches {
    /// A fault touched `group` from `from` to `to`. Touches come in time order, so one that
    /// overlaps the last window widens it and the list stays short.
    pub(super) fn touch(&mut self, group: Group, from: Instant, to: Instant) {
        let windows = self.0.entry(group).or_default();
        match windows.last_mut() {
            Some(last) if last.1 >= from => last.1 = last.1.max(to),
            _ => windows.push((from, to)),
        }
    }

    /// Whether a fault touched one of `groups` between `from` and `to`.
    pub(super) fn during(&self, groups: &[Group], from: Instant, to: Instant) -> bool {
        groups.iter().filter_map(|g| self.0.get(g)).flatten().any(|&(a, b)| a <= to && b >= from)
    }
}

impl Cluster {
    /// What `rank`'s process applies to what it sends: every fault, with what earlier
    /// lives used of its count, and a stream of its own.
    pub(super) fn sender_faults(&self, rank: RankId, life: u32) -> SenderFaults {
        let m = &self.messages;
        let slot = match rank.engine.role {
            Role::Prefill => self.d.rank_index(rank),
            Role::Decode => self.d.ranks(Role::Prefill).len() + self.d.rank_index(rank),
        };
        let faults = m
            .faults
            .iter()
            .enumerate()
            .map(|(i, f)| {
                let used = m.used.get(&(i as u16, rank)).copied().unwrap_or(0);
                let count = f.count.map(|n| n.saturating_sub(used));
                (i as u16, MessageFault { count, ..f.clone() })
            })
            .collect();
        let stream = RANK_STREAMS + slot as u64 + (u64::from(life) << 16);
        SenderFaults { seed: m.seed, stream, faults }
    }

    /// The fault log's first lines: what each message fault does.
    pub(super) fn log_message_faults(&mut self) {
        for fault in &self.messages.faults {
            self.tally.faults_log.push(fault.describe());
        }
    }

    /// A rank's fault layer changed a message it sent: logged, and what it can cause excused.
    pub(super) fn on_message_fault(&mut self, rank: RankId, hit: MessageHit) {
        for &i in &hit.fate.faults {
            *self.messages.used.entry((i, rank)).or_default() += 1;
        }
        self.log_message_hit(
            &hit,
            hit.from.to_string(),
            hit.to.map_or_else(|| "its dialler".into(), |r| r.to_string()),
        );
        match excuse(&hit, self.messages.grace) {
            Excuse::Nothing => {}
            Excuse::Reaping(t) => {
                self.faults.expose(t);
            }
            Excuse::Request(t) => self.expose_request(t),
            Excuse::Touch { ranks, lasting } => {
                let now = Instant::now();
                for rank in ranks {
                    self.messages.touched.touch((rank.engine, rank.dp), now, now + lasting);
                }
            }
        }
    }

    fn expose_request(&mut self, t: TransferId) {
        if let Some(id) = self.clients.request_of(&t) {
            if let Some(req) = self.clients.requests.get_mut(&id) {
                req.exposed = true;
            }
        }
        self.faults.expose(t);
    }

    fn log_message_hit(&mut self, hit: &MessageHit, from: String, to: String) {
        let what = if hit.fate.lost {
            "lost"
        } else if hit.fate.delay_ms > 0 {
            "delayed"
        } else {
            "duplicated"
        };
        *self.messages.counts.entry((what, hit.kind)).or_default() += 1;
        if self.messages.listed >= MAX_LISTED {
            return;
        }
        self.messages.listed += 1;
        let at = self.started_at.elapsed().as_millis();
        let about = hit.transfer_id.as_ref().map(|t| format!(" of {t}")).unwrap_or_default();
        let faults: Vec<String> =
            hit.fate.faults.iter().map(|&i| self.messages.faults[usize::from(i)].to_string()).collect();
        self.tally.faults_log.push(format!(
            "{at} ms: {} {}{about} from {from} to {to} ({})",
            hit.fate.words(),
            hit.kind.words(),
            faults.join(", ")
        ));
    }

    /// The proxy dispatches a prefilled request to decode group `g`: now, later, or never, as
    /// the dispatch faults say. A lost dispatch fails its request at once (the client would see
    /// its decode request go unanswered), and its registered transfer waits for the reaper.
    pub(super) fn dispatch(&mut self, g: usize, recv: RecvRequest) {
        let id = recv.request;
        let Some(req) = self.clients.requests.get(&id) else { return };
        let (decode, (pe, pdp)) =
            ((self.decode.groups[g].engine, self.decode.groups[g].dp, self.decode.groups[g].tp), req.prefill);
        let prefill = EngineId::prefill(pe as u16);
        let mut ranks: Vec<RankId> =
            (0..decode.2).map(|tp| RankId::new(EngineId::decode(decode.0 as u16), decode.1, tp)).collect();
        ranks.extend((0..self.d.layout(prefill).tp).map(|tp| RankId::new(prefill, pdp, tp)));
        let Some(fate) = self.messages.injector.fate(MessageKind::Dispatch, &ranks) else {
            return self.take_dispatch(g, recv);
        };
        let transfer_id = req.transfer_id.clone();
        let hit = MessageHit {
            kind: MessageKind::Dispatch,
            from: RankId::new(prefill, pdp, 0),
            to: None,
            transfer_id: Some(transfer_id.clone()),
            fate,
        };
        let group = format!("D{}.dp{}", decode.0, decode.1);
        self.log_message_hit(&hit, format!("{prefill}.dp{pdp}"), group.clone());
        self.expose_request(transfer_id);
        match hit.fate.sending() {
            None => {
                let error = format!("the dispatch to {group} was lost (injected message fault)");
                self.end(id, Some(vec![error]));
            }
            Some((_, delay)) => self.messages.delayed.push(delay, (g, recv)),
        }
    }

    /// Hands the dispatches whose delay ended to their decode groups.
    pub(super) fn dispatch_due(&mut self) {
        while let Some((g, recv)) = self.messages.delayed.pop_due() {
            // A delay that ends while the request's prefill group is down holds it again.
            let held = self.config.hold_dispatches_until_restart;
            let Some(recv) = (if held { self.hold(g, recv) } else { Some(recv) }) else { continue };
            if self.clients.requests.contains_key(&recv.request) {
                self.take_dispatch(g, recv);
            }
        }
    }

    fn take_dispatch(&mut self, g: usize, recv: RecvRequest) {
        let (engine, dp) = (EngineId::decode(self.decode.groups[g].engine as u16), self.decode.groups[g].dp);
        // The group died while the dispatch was held: as for a dispatch to a dead group.
        if let Some(gone) = self.gone_rank_of_group(engine, dp) {
            return self.end(recv.request, Some(vec![format!("{gone} is gone")]));
        }
        self.decode_arrival(g, recv);
    }

    /// Whether a handshake fault touched the DP group of `req`'s prefill or decode while it was
    /// in flight (see [`Excuse::Touch`]).
    pub(super) fn touched_by_message_fault(&self, req: &Req) -> bool {
        let groups = [
            (EngineId::prefill(req.prefill.0 as u16), req.prefill.1),
            (EngineId::decode(req.decode.0 as u16), req.decode.1),
        ];
        self.messages.touched.during(&groups, req.started, Instant::now())
    }

    /// The fault log, with a summary of the message faults when any were asked for.
    pub(super) fn fault_lines(&self) -> Vec<String> {
        let m = &self.messages;
        let mut lines = self.tally.faults_log.clone();
        if m.faults.is_empty() {
            return lines;
        }
        let total: u64 = m.counts.values().sum();
        let each: Vec<String> =
            m.counts.iter().map(|((what, kind), &n)| format!("{} {what}", kind.counted(n))).collect();
        let unlisted = total.saturating_sub(m.listed as u64);
        let plural = if total == 1 { "" } else { "s" };
        let mut summary = format!("message faults hit {total} message{plural}");
        if !each.is_empty() {
            summary.push_str(&format!(": {}", each.join(", ")));
        }
        if unlisted > 0 {
            summary.push_str(&format!(" ({unlisted} not listed above)"));
        }
        lines.push(summary);
        lines
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use super::super::result::outcome;
    use super::super::{Ledger, Requests};
    use super::*;
    use crate::message_faults::Fate;

    fn hit(kind: MessageKind, lost: bool, copies: u8, delay_ms: u64) -> MessageHit {
        MessageHit {
            kind,
            from: RankId::new(EngineId::decode(0), 0, 1),
            to: Some(RankId::new(EngineId::prefill(0), 1, 0)),
            transfer_id: (kind != MessageKind::HandshakeRequest).then(|| TransferId::from_u128(9)),
            fate: Fate { lost, copies, delay_ms, faults: vec![0] },
        }
    }

    /// The judging of a run in which one transfer was reaped, given the transfers excused.
    fn judge(reaped: &TransferId, excused: &BTreeSet<TransferId>) -> &'static str {
        let ledger =
            Ledger { reaped: 1, reaped_excused: u64::from(excused.contains(reaped)), ..Ledger::default() };
        outcome(false, false, false, false, &Requests::default(), &ledger).name()
    }

    #[test]
    fn a_lost_release_excuses_its_reaping_and_without_the_excuse_the_run_is_a_leak() {
        let t = TransferId::from_u128(9);
        let mut excused = BTreeSet::new();
        let lost = hit(MessageKind::Release, true, 1, 0);
        if let Excuse::Reaping(transfer) = excuse(&lost, Duration::ZERO) {
            excused.insert(transfer);
        }
        assert_eq!(judge(&t, &excused), "clean");
        // The excuse switched off: the reaper's free of the lost release's transfer is a leak.
        assert_eq!(judge(&t, &BTreeSet::new()), "leak");
    }

    #[test]
    fn each_fault_excuses_what_it_can_cause_and_a_duplicate_nothing() {
        let t = TransferId::from_u128(9);
        let grace = Duration::from_millis(7_000);
        let d = RankId::new(EngineId::decode(0), 0, 1);
        let p = RankId::new(EngineId::prefill(0), 1, 0);
        let check = |hit: MessageHit, expected: Excuse| assert_eq!(excuse(&hit, grace), expected, "{hit:?}");
        check(hit(MessageKind::Release, true, 1, 0), Excuse::Reaping(t.clone()));
        check(hit(MessageKind::Release, false, 1, 300), Excuse::Reaping(t.clone()));
        check(hit(MessageKind::Lease, true, 1, 0), Excuse::Request(t.clone()));
        check(hit(MessageKind::Dispatch, false, 1, 300), Excuse::Request(t.clone()));
        check(
            hit(MessageKind::HandshakeRequest, false, 2, 300),
            Excuse::Touch { ranks: vec![d, p], lasting: Duration::from_millis(7_300) },
        );
        for kind in MessageKind::ALL {
            check(hit(kind, false, 2, 0), Excuse::Nothing);
        }
    }

    #[test]
    fn a_touch_excuses_requests_in_flight_during_it_and_no_others() {
        let t0 = Instant::now();
        let at = |ms| t0 + Duration::from_millis(ms);
        let (p, d) = ((EngineId::prefill(0), 0), (EngineId::decode(0), 1));
        let mut touches = Touches::default();
        touches.touch(p, at(100), at(200));
        touches.touch(p, at(150), at(300));
        touches.touch(p, at(500), at(600));
        let check = |groups: &[Group], from, to, expected: bool| {
            assert_eq!(touches.during(groups, at(from), at(to)), expected, "{groups:?} {from}..{to}");
        };
        check(&[p], 0, 100, true);
        check(&[p], 250, 400, true);
        check(&[p], 301, 499, false);
        check(&[d], 0, 1000, false);
        check(&[d, p], 550, 560, true);
        check(&[p], 601, 900, false);
    }
}
