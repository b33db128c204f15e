//! Control messages: handshake dials, releases and leases sent to the prefill ranks'
//! listeners, and how the listeners serve them.

use pdkv_core::decode::DecodeEvent;
use pdkv_core::ids::RankId;
use pdkv_core::ports::ListenerKind;
use pdkv_core::prefill::{WorkerAction, WorkerEvent};
use pdkv_core::time::Instant;
use pdkv_core::wire::{self, ControlMessage};

use crate::result::ViolationKind;
use crate::scenario::FaultKind;

use super::{ms_ns, us_ns, Ev, Msg, World};

pub(super) struct Listener {
    pub(super) rank: RankId,
    pub(super) kind: ListenerKind,
    pub(super) busy_until: u64,
}

impl World {
    pub(super) fn control_ns(&self) -> u64 {
        us_ns(self.sc.hardware.control_latency_us)
    }

    /// Sends a control message from decode worker `w` about prefill rank `peer` to `to`.
    pub(super) fn send(&mut self, w: usize, peer: RankId, to: (String, u16), msg: Msg) {
        let Some(&listener) = self.net.listener_at.get(&to) else {
            let detail = format!(
                "{} sent {} to {}:{}, where no listener is bound",
                self.decode.ranks[w],
                msg_name(&msg),
                to.0,
                to.1
            );
            self.violation(
                ViolationKind::PortWithoutListener,
                vec![self.decode.ranks[w].to_string(), peer.to_string()],
                detail,
            );
            if let Msg::Dial { session, .. } = msg {
                let event = DecodeEvent::HandshakeFailed { session, reason: "connection refused".into() };
                let latency = self.control_ns();
                self.at(latency, Ev::ToDecode { worker: w, event: Box::new(event) });
            }
            return;
        };
        let owner = self.net.listeners[listener].rank;
        if self.prefill.down[usize::from(owner.engine.index)] {
            // The port is known but its engine is down: the connection is refused, which is a
            // failure the protocol must handle, not an arithmetic bug.
            trace!(
                self,
                "fault",
                "refused",
                self.decode.ranks[w].to_string(),
                None,
                format!("{owner} is down")
            );
            self.touch(self.decode.ranks[w], self.now, self.now);
            if let Msg::Dial { session, .. } = msg {
                let event = DecodeEvent::HandshakeFailed {
                    session,
                    reason: "connection refused (engine down)".into(),
                };
                let latency = self.control_ns();
                self.at(latency, Ev::ToDecode { worker: w, event: Box::new(event) });
            }
            return;
        }
        let ranks = [self.decode.ranks[w], owner];
        let Some(delays) = self.fate(&ranks) else {
            trace!(self, "fault", "lost", self.decode.ranks[w].to_string(), None, msg_name(&msg).to_string());
            // A lost release or lease leaves its transfer to the reaper, the designed recovery.
            if let Msg::Notify { transfer: Some(t), .. } = msg {
                self.checks.excused.insert(t);
            }
            return;
        };
        // A release or lease that a fault delays past the reaper's delay arrives after the
        // reaper could have fired: for the ledger that is a lost message, and reaping the
        // design's recovery.
        if let (Msg::Notify { transfer: Some(t), .. }, Some(&first)) = (&msg, delays.first()) {
            if first >= self.sc.timeouts().defer_ns() {
                self.checks.excused.insert(*t);
            }
        }
        let latency = self.control_ns();
        let mut copies = delays.into_iter();
        let first = copies.next().unwrap_or(0);
        for extra in copies {
            self.at(latency.saturating_add(extra), Ev::AtListener { listener, msg: Box::new(msg.clone()) });
        }
        self.at(latency.saturating_add(first), Ev::AtListener { listener, msg: Box::new(msg) });
    }

    fn listener_service_ns(&self, listener: usize) -> Option<u64> {
        let l = &self.net.listeners[listener];
        let mut service = us_ns(self.sc.hardware.listener_service_us);
        for fault in self.faults.iter().flatten() {
            if l.kind != ListenerKind::Handshake || !fault.pattern.matches(l.rank) {
                continue;
            }
            match fault.kind {
                FaultKind::DeadListener => return None,
                FaultKind::SlowListener { service_ms } => service = service.max(ms_ns(service_ms)),
                _ => {}
            }
        }
        Some(service)
    }

    pub(super) fn on_at_listener(&mut self, listener: usize, msg: Msg) {
        let service = self.listener_service_ns(listener);
        // A dead or slow listener holds up the dialling decode rank's whole step (its group vote
        // waits for every dial), so the fault touches the dialler too.
        if service.is_none_or(|ns| ns > us_ns(self.sc.hardware.listener_service_us)) {
            if let Msg::Dial { from, .. } = msg {
                self.touch(self.decode.ranks[from], self.now, self.now);
            }
        }
        let Some(service) = service else {
            let rank = self.net.listeners[listener].rank.to_string();
            trace!(self, "fault", "dead_listener", rank, None, msg_name(&msg).to_string());
            return;
        };
        let l = &mut self.net.listeners[listener];
        let start = l.busy_until.max(self.now);
        l.busy_until = start.saturating_add(service);
        let delay = l.busy_until - self.now;
        self.at(delay, Ev::Serve { listener, msg: Box::new(msg) });
    }

    pub(super) fn on_serve(&mut self, listener: usize, msg: Msg) {
        let rank = self.net.listeners[listener].rank;
        if self.prefill.down[usize::from(rank.engine.index)] {
            // Dropped by a crashed engine: the crash touches the dialler's step as well.
            if let Msg::Dial { from, .. } = msg {
                self.touch(self.decode.ranks[from], self.now, self.now);
            }
            return;
        }
        let i = self.pworker_index(rank);
        match msg {
            Msg::Dial { from, session } => {
                let mut out = Vec::new();
                self.prefill.nodes.worker_mut(i).handle(
                    Instant(self.now),
                    WorkerEvent::HandshakeRequest { peer: from as u64 },
                    &mut out,
                );
                for action in out {
                    if let WorkerAction::SendHandshakeReply { metadata, layers, .. } = action {
                        let Some(delays) = self.fate(&[self.decode.ranks[from], rank]) else { continue };
                        let latency = self.control_ns().saturating_add(delays[0]);
                        let meta = DecodeEvent::HandshakeMetadata { session: session.clone(), metadata };
                        self.at(latency, Ev::ToDecode { worker: from, event: Box::new(meta) });
                        let desc = DecodeEvent::HandshakeDescriptors { session: session.clone(), layers };
                        self.at(latency, Ev::ToDecode { worker: from, event: Box::new(desc) });
                    }
                }
            }
            Msg::Notify { bytes, .. } => match wire::decode(&bytes) {
                Ok(ControlMessage::ReadLease(lease)) => {
                    let event = WorkerEvent::Lease {
                        transfer_id: lease.transfer_id,
                        lease_ms: lease.lease_ms,
                        incarnation: lease.incarnation,
                        mac: lease.mac,
                    };
                    self.prefill_worker(rank, event);
                }
                Ok(message) => match message.as_release() {
                    Some(release) => self.prefill_worker(rank, WorkerEvent::Release(release)),
                    None => self.violation(
                        ViolationKind::ProtocolError,
                        vec![rank.to_string()],
                        "unexpected notify message".into(),
                    ),
                },
                Err(error) => {
                    self.violation(
                        ViolationKind::ProtocolError,
                        vec![rank.to_string()],
                        format!("undecodable notify frame: {error}"),
                    );
                }
            },
        }
    }
}

fn msg_name(msg: &Msg) -> &'static str {
    match msg {
        Msg::Dial { .. } => "handshake request",
        Msg::Notify { .. } => "notify message",
    }
}
