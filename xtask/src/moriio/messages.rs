//! Every message pdkv sends to a prefill rank, as the bytes that travel, for the harness to
//! deliver to vLLM's own listeners (tests/moriio/harness.py `--messages`).
//!
//! The messages come from pdkv's real code, not from bytes written here: for each capability
//! set a prefill rank can advertise (every subset of the [`Extension`]s this pdkv knows, so a
//! new extension is covered without a change here), pdkv-core's [`DecodeWorker`] is driven
//! through one request to its end along every path that sends something (read at once, queued
//! first with a lease renewal, a failed read, a read past its deadline), under both rule sets
//! and with the engine's `pdkv_extensions` absent or naming the set. What it asks its driver to
//! send ([`DecodeAction::DialHandshake`], [`DecodeAction::SendLease`],
//! [`DecodeAction::SendRelease`]) is encoded with `pdkv_core::wire::encode` into the one frame
//! backend-rdma/src/decode_rank.rs sends for it: `[get_meta_msg]` to the handshake listener,
//! `[message]` to the notify listener, each from a DEALER whose identity is the rank's name.
//!
//! Next to those, every [`ControlMessage`] variant is encoded ("every variant") and sent to both
//! listeners, because a pdkv prefill rank or a future path could send it; [`variant`] is an
//! exhaustive `match`, so a new variant does not build until it is named and given a sample.
//! Each message records whether the decode node emitted that message to that listener for that
//! set, which is what the judging in compare.rs turns on.

use std::collections::VecDeque;
use std::fmt;

use pdkv_core::decode::{
    DecodeAction, DecodeConfig, DecodeEvent, DecodeWorker, ReadOp, ReadOutcome, RecvRequest,
};
use pdkv_core::ids::{EngineId, Incarnation, RankId, RequestId, TransferId};
use pdkv_core::params::{extension_names, KvTransferParams};
use pdkv_core::policy::{PeerBook, PeerRules, Policy};
use pdkv_core::ports::{Endpoint, EngineAddress};
use pdkv_core::release::{Release, ReleaseSender};
use pdkv_core::time::Instant;
use pdkv_core::topology::Deployment;
use pdkv_core::wire::{
    self, ControlMessage, DataPlane, DataTransport, Extension, Extensions, HandshakeMetadata,
    LayerMemoryDesc, RankInfo, ReadLease, RemoteBlocks, WriteDone, WriteFailed,
};

/// The transfer the driven request and the samples name; the harness's probe uses another.
pub const TRANSFER_ID: &str = "tx-pdkv-message";
/// The prefill engine's address in the driven runs (the bytes do not depend on it).
const HOST: &str = "127.0.0.1";
/// Deployments driven: equal TP (one release), and a flexible read from a TP2 prefill engine
/// (DeepSeek-R1, MLA), where vLLM 0.33's rules release every holder.
const DEPLOYMENTS: [&str; 2] = ["1P_TP1:1D_TP1", "1P_TP2:1D_TP1"];
/// Events one run may take before the driver gives up (a run takes a few dozen).
const MAX_EVENTS: usize = 10_000;
/// Number of [`ControlMessage`] variants, as [`variant`] numbers them.
pub const VARIANTS: usize = 8;

/// Which listener of a prefill rank a message is delivered to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Socket {
    /// The notify listener (`MoRIIOWrapper.async_wait_reqid`).
    Notify,
    /// The handshake listener (`MoRIIOConnectorWorker._moriio_handshake_listener`).
    Handshake,
}

impl Socket {
    pub fn name(self) -> &'static str {
        match self {
            Socket::Notify => "notify",
            Socket::Handshake => "handshake",
        }
    }
}

/// Where a message in the list comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Origin {
    /// pdkv-core's decode node asked for it to be sent.
    DecodeNode,
    /// A sample of a [`ControlMessage`] variant, sent to both listeners.
    EveryVariant,
}

impl Origin {
    pub fn name(self) -> &'static str {
        match self {
            Origin::DecodeNode => "decode node",
            Origin::EveryVariant => "every variant",
        }
    }
}

/// One message to deliver to a fresh vLLM listener.
#[derive(Clone, Debug)]
pub struct Message {
    /// Its index in [`Messages::messages`]; the harness answers by it.
    pub id: usize,
    pub message: ControlMessage,
    /// The capability set the receiving rank advertised.
    pub capabilities: Extensions,
    pub origin: Origin,
    pub socket: Socket,
    /// Whether pdkv's decode node emitted this variant to this listener for this set.
    pub emitted: bool,
    /// The ZeroMQ frames as pdkv's DEALER sends them.
    pub frames: Vec<Vec<u8>>,
}

impl Message {
    pub fn name(&self) -> &'static str {
        variant(&self.message).1
    }
}

/// Every message, and what the decode node emitted per capability set.
#[derive(Clone, Debug)]
pub struct Messages {
    /// The DEALER identity pdkv's decode rank uses (its rank's name).
    pub identity: String,
    pub messages: Vec<Message>,
    /// Per capability set, the (variant, listener) pairs the decode node emitted.
    pub emitted: Vec<(Extensions, Vec<(&'static str, Socket)>)>,
}

impl Messages {
    /// Whether the decode node emitted `name` to `socket` under any capability set.
    pub fn emitted_under_some_set(&self, name: &str, socket: Socket) -> bool {
        self.emitted.iter().any(|(_, pairs)| pairs.iter().any(|(n, s)| *n == name && *s == socket))
    }

    /// The document the harness reads with `--messages`.
    pub fn to_json(&self) -> serde_json::Value {
        let messages: Vec<serde_json::Value> = self
            .messages
            .iter()
            .map(|m| {
                serde_json::json!({
                    "id": m.id,
                    "name": m.name(),
                    "capabilities": set_name(m.capabilities),
                    "origin": m.origin.name(),
                    "socket": m.socket.name(),
                    "emitted": m.emitted,
                    "frames": m.frames.iter().map(|f| hex(f)).collect::<Vec<_>>(),
                })
            })
            .collect();
        serde_json::json!({ "identity": self.identity, "messages": messages })
    }
}

/// Why the messages could not be produced: the decode node did not do what every run needs
/// (a change in the core the driver here does not follow).
#[derive(Debug, PartialEq, Eq)]
pub struct MessagesError {
    pub run: String,
    pub detail: String,
}

impl fmt::Display for MessagesError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "driving pdkv's decode node ({}): {}", self.run, self.detail)
    }
}

impl std::error::Error for MessagesError {}

/// Every subset of the extensions this pdkv knows, the empty set first.
pub fn capability_sets() -> Vec<Extensions> {
    let mut sets = vec![Extensions::NONE];
    for extension in Extension::ALL {
        let more: Vec<Extensions> = sets.iter().map(|s| s.with(extension)).collect();
        sets.extend(more);
    }
    sets
}

/// `{}`, `{read_lease}`, ...: a set as the matrix names it.
pub fn set_name(set: Extensions) -> String {
    format!("{{{}}}", set.iter().map(Extension::wire_name).collect::<Vec<_>>().join(", "))
}

/// The number and name of a message's variant. Exhaustive: a new [`ControlMessage`] variant
/// does not build until it is numbered here (below [`VARIANTS`]), and the
/// `every_variant_has_one_sample` test fails until [`every_variant`] has a sample of it.
pub fn variant(message: &ControlMessage) -> (usize, &'static str) {
    match message {
        ControlMessage::Release(_) => (0, "release"),
        ControlMessage::LegacyCompletion(_) => (1, "legacy_completion"),
        ControlMessage::RemoteBlocks(_) => (2, "remote_blocks"),
        ControlMessage::WriteDone(_) => (3, "write_done"),
        ControlMessage::ReadLease(_) => (4, "read_lease"),
        ControlMessage::HandshakeRequest => (5, "handshake_request"),
        ControlMessage::HandshakeMetadata(_) => (6, "handshake_metadata"),
        ControlMessage::WriteFailed(_) => (7, "write_failed"),
    }
}

fn decode_rank() -> RankId {
    RankId::new(EngineId::decode(0), 0, 0)
}

fn address() -> EngineAddress {
    EngineAddress { host: HOST.into(), handshake_port_base: 6301, notify_port_base: 61005 }
}

/// A sample of every variant, with the values pdkv would put in it.
pub fn every_variant() -> Vec<ControlMessage> {
    let id = || TransferId::new(TRANSFER_ID);
    let rank = decode_rank();
    let prefill = RankId::new(EngineId::prefill(0), 0, 0);
    let data = DataPlane { transport: DataTransport::Tcp, addr: Endpoint { host: HOST.into(), port: 7000 } };
    vec![
        ControlMessage::Release(Release {
            transfer_id: id(),
            consumer_tp_size: Some(1),
            sender: Some(ReleaseSender {
                engine_id: "decode-0:6301".into(),
                dp_rank: rank.dp,
                tp_rank: rank.tp,
            }),
            // Named only to a rank that advertised incarnations: a pdkv rank.
            incarnation: Incarnation::new(0x1f_2e3d_4c5b),
            mac: None,
        }),
        ControlMessage::LegacyCompletion(id()),
        ControlMessage::RemoteBlocks(RemoteBlocks {
            req_id: "req-pdkv-message".into(),
            transfer_id: id(),
            block_ids: vec![1, 2, 3],
            decode_dp_rank: 0,
        }),
        ControlMessage::WriteDone(WriteDone::single(id())),
        ControlMessage::WriteFailed(WriteFailed { transfer_id: id() }),
        ControlMessage::ReadLease(ReadLease {
            transfer_id: id(),
            lease_ms: 30_000,
            incarnation: Incarnation::new(0x1f_2e3d_4c5b),
            mac: None,
        }),
        ControlMessage::HandshakeRequest,
        // What a pdkv prefill rank answers a dial with (the first reply part's payload).
        ControlMessage::HandshakeMetadata(HandshakeMetadata {
            engine_id: address().engine_id(),
            agent_metadata: data.encode(),
            kv_caches_base_addr: vec![1 << 30],
            num_blocks: 16,
            block_len: 4096,
            attn_backend_name: "FLASHMLA".into(),
            rank: Some(RankInfo { dp_rank: prefill.dp, tp_rank: prefill.tp, tp_size: 1 }),
            extensions: Extensions::ALL,
            incarnation: Incarnation::new(0x1f_2e3d_4c5b),
        }),
    ]
}

/// How the driven request's reads are answered.
#[derive(Clone, Copy, Debug)]
enum Path {
    /// Taken by a step and read at once.
    Direct,
    /// Queued by the engine first (leased and renewed while it waits), then taken.
    Queued,
    /// Its reads fail.
    ReadFails,
    /// Its reads are never answered until the deadline aborts them.
    Deadline,
}

const PATHS: [Path; 4] = [Path::Direct, Path::Queued, Path::ReadFails, Path::Deadline];

/// One run: the node, what it has sent, and how reads are answered.
struct Driver {
    worker: DecodeWorker,
    now: Instant,
    /// What the rank's handshake metadata advertises.
    advertised: Extensions,
    path: Path,
    /// Reads posted and not answered yet (the deadline path answers them when aborted).
    unanswered: Vec<ReadOp>,
    ended: bool,
    sent: Vec<(ControlMessage, Socket)>,
}

impl Driver {
    /// Feeds one event and answers every action as a driver would, until nothing is left to
    /// answer; what is sent is recorded.
    fn feed(&mut self, event: DecodeEvent) -> Result<(), String> {
        let mut queue = VecDeque::from([event]);
        let mut events = 0;
        while let Some(event) = queue.pop_front() {
            events += 1;
            if events > MAX_EVENTS {
                return Err(format!("more than {MAX_EVENTS} events without settling"));
            }
            let mut out = Vec::new();
            self.worker.handle(self.now, event, &mut out);
            for action in out {
                // Every action is listed, so one that sends something new cannot be missed.
                match action {
                    DecodeAction::DialHandshake { session, .. } => {
                        self.sent.push((ControlMessage::HandshakeRequest, Socket::Handshake));
                        let metadata = HandshakeMetadata {
                            engine_id: address().engine_id(),
                            agent_metadata: Vec::new(),
                            kv_caches_base_addr: vec![1 << 30, 2 << 30],
                            num_blocks: 16,
                            block_len: 4096,
                            attn_backend_name: "FLASHMLA".into(),
                            rank: None,
                            extensions: self.advertised,
                            incarnation: None,
                        };
                        let metadata = Box::new(metadata);
                        let layers = vec![LayerMemoryDesc { layer_name: "l0".into(), descs: vec![vec![0]] }];
                        queue
                            .push_back(DecodeEvent::HandshakeMetadata { session: session.clone(), metadata });
                        queue.push_back(DecodeEvent::HandshakeDescriptors { session, layers });
                    }
                    DecodeAction::PostRead(op) => {
                        let outcome = match self.path {
                            Path::Direct | Path::Queued => ReadOutcome::Ok,
                            Path::ReadFails => ReadOutcome::Failed("remote access error".into()),
                            Path::Deadline => {
                                self.unanswered.push(op);
                                continue;
                            }
                        };
                        queue.push_back(DecodeEvent::ReadDone {
                            request: op.request(),
                            layer: op.layer,
                            outcome,
                        });
                    }
                    DecodeAction::AbortReads { request } => {
                        let (aborted, kept) =
                            self.unanswered.drain(..).partition(|op| op.request() == request);
                        self.unanswered = kept;
                        for op in aborted {
                            let outcome = ReadOutcome::Aborted;
                            queue.push_back(DecodeEvent::ReadDone { request, layer: op.layer, outcome });
                        }
                    }
                    DecodeAction::SendRelease { release, .. } => {
                        self.sent.push((ControlMessage::Release(*release), Socket::Notify))
                    }
                    DecodeAction::SendLease { lease, .. } => {
                        self.sent.push((ControlMessage::ReadLease(*lease), Socket::Notify))
                    }
                    DecodeAction::CastVote { step, ok } => {
                        queue.push_back(DecodeEvent::VoteResult { step, ok })
                    }
                    DecodeAction::RequestReceived { .. } | DecodeAction::RequestFailed { .. } => {
                        self.ended = true
                    }
                    DecodeAction::StepReady { .. }
                    | DecodeAction::StepFailed { .. }
                    | DecodeAction::InvalidateBlocks { .. } => {}
                }
            }
        }
        Ok(())
    }

    /// Ticks the node at each time it asks for, until the request ended.
    fn tick_until_ended(&mut self) -> Result<(), String> {
        for _ in 0..MAX_EVENTS {
            if self.ended {
                return Ok(());
            }
            self.now = self.worker.poll_timeout().ok_or("the request did not end and no timer is armed")?;
            self.feed(DecodeEvent::Tick)?;
        }
        Err("the request did not end".into())
    }
}

/// One request through pdkv's decode node to its end; what the node asked to send.
fn run(
    notation: &str,
    rules: PeerRules,
    engine_word: Option<Extensions>,
    advertised: Extensions,
    path: Path,
) -> Result<Vec<(ControlMessage, Socket)>, String> {
    let d = Deployment::parse(notation).map_err(|e| e.to_string())?;
    let rank = decode_rank();
    let prefill = EngineId::prefill(0);
    let mut config = DecodeConfig::new(
        rank,
        d.layout(rank.engine),
        d.model.clone(),
        Policy::fixed(),
        "decode-0:6301".into(),
    );
    config.peers = PeerBook::pdkv().with(prefill, rules);
    let remote = d.layout(prefill);
    let request = RecvRequest {
        request: RequestId(1),
        prefill_engine: prefill,
        prefill_address: address(),
        params: KvTransferParams {
            do_remote_prefill: true,
            transfer_id: Some(TRANSFER_ID.into()),
            remote_block_ids: vec![1, 2].into(),
            remote_engine_id: Some(address().engine_id()),
            remote_dp_size: Some(i64::from(remote.dp)),
            remote_tp_size: Some(i64::from(remote.tp)),
            pdkv_extensions: engine_word.and_then(extension_names),
            ..Default::default()
        },
        local_block_ids: vec![5, 6],
    };
    let mut driver = Driver {
        worker: DecodeWorker::new(config),
        now: Instant::ZERO,
        advertised,
        path,
        unanswered: Vec::new(),
        ended: false,
        sent: Vec::new(),
    };
    if let Path::Queued = path {
        driver.feed(DecodeEvent::Queued { requests: vec![request.clone()] })?;
        // The first renewal falls due while the request waits.
        driver.now = driver.worker.poll_timeout().ok_or("a queued request arms no renewal")?;
        driver.feed(DecodeEvent::Tick)?;
    }
    driver.feed(DecodeEvent::StepBegin { step: 1, requests: vec![request] })?;
    driver.tick_until_ended()?;
    let sent = driver.sent;
    if !sent.iter().any(|(m, _)| *m == ControlMessage::HandshakeRequest) {
        return Err("the node never dialled the prefill rank".into());
    }
    if !sent.iter().any(|(m, _)| matches!(m, ControlMessage::Release(_))) {
        return Err("the request ended without a release".into());
    }
    Ok(sent)
}

/// The frames pdkv's DEALER sends for a message: one frame holding its encoding, on either
/// socket (backend-rdma/src/decode_rank.rs: `conn.send(&[wire::HANDSHAKE_REQUEST])` when it
/// dials, `conn.send(&[&bytes])` in its notifier).
fn frames(message: &ControlMessage) -> Vec<Vec<u8>> {
    vec![wire::encode(message)]
}

/// Every message of every capability set. `ungated` feeds the node `Extensions::ALL` under
/// every label, as a pdkv that sent leases to every peer would behave (the demonstration that
/// the judging catches such a pdkv: `--pretend-ungated-leases`).
pub fn build(ungated: bool) -> Result<Messages, MessagesError> {
    let mut numbers: Vec<usize> = every_variant().iter().map(|m| variant(m).0).collect();
    numbers.sort();
    if numbers != (0..VARIANTS).collect::<Vec<_>>() {
        return Err(MessagesError {
            run: "every variant".into(),
            detail: format!("the samples are of variants {numbers:?}, not one of each of 0..{VARIANTS}"),
        });
    }
    let mut messages: Vec<Message> = Vec::new();
    let mut emitted = Vec::new();
    for set in capability_sets() {
        let fed = if ungated { Extensions::ALL } else { set };
        let mut sent: Vec<(ControlMessage, Socket)> = Vec::new();
        for notation in DEPLOYMENTS {
            for rules in [PeerRules::Pdkv, PeerRules::Vllm033] {
                // The engine's answer says nothing (as MoRIIO's) or names the same set.
                for engine_word in [None, Some(fed)] {
                    for path in PATHS {
                        let label = format!(
                            "{notation}, {} rules, rank advertises {}, engine says {}, {path:?}",
                            rules.name(),
                            set_name(set),
                            engine_word.map_or("nothing".into(), set_name),
                        );
                        let run = run(notation, rules, engine_word, fed, path)
                            .map_err(|detail| MessagesError { run: label, detail })?;
                        for item in run {
                            if !sent.contains(&item) {
                                sent.push(item);
                            }
                        }
                    }
                }
            }
        }
        let pairs: Vec<(&'static str, Socket)> = sent.iter().map(|(m, s)| (variant(m).1, *s)).collect();
        for (message, socket) in sent {
            let id = messages.len();
            let frames = frames(&message);
            messages.push(Message {
                id,
                message,
                capabilities: set,
                origin: Origin::DecodeNode,
                socket,
                emitted: true,
                frames,
            });
        }
        for message in every_variant() {
            for socket in [Socket::Notify, Socket::Handshake] {
                let id = messages.len();
                let emitted = pairs.contains(&(variant(&message).1, socket));
                let frames = frames(&message);
                messages.push(Message {
                    id,
                    message: message.clone(),
                    capabilities: set,
                    origin: Origin::EveryVariant,
                    socket,
                    emitted,
                    frames,
                });
            }
        }
        emitted.push((set, pairs));
    }
    Ok(Messages { identity: decode_rank().to_string(), messages, emitted })
}

/// Lower-case hex, as the harness reads frames (`bytes.fromhex`).
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The bytes of a hex string; `None` when it is not one.
pub fn unhex(text: &str) -> Option<Vec<u8>> {
    if !text.len().is_multiple_of(2) || !text.is_ascii() {
        return None;
    }
    (0..text.len()).step_by(2).map(|i| u8::from_str_radix(&text[i..i + 2], 16).ok()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_variant_has_one_sample() {
        let mut numbers: Vec<usize> = every_variant().iter().map(|m| variant(m).0).collect();
        numbers.sort();
        assert_eq!(numbers, (0..VARIANTS).collect::<Vec<_>>());
        assert!(build(false).is_ok());
    }

    #[test]
    fn every_subset_of_the_extensions_is_a_capability_set() {
        let sets = capability_sets();
        assert_eq!(sets.len(), 1 << Extension::ALL.len());
        assert_eq!(sets[0], Extensions::NONE);
        assert!(sets.contains(&Extensions::ALL));
        assert_eq!(set_name(Extensions::NONE), "{}");
        assert_eq!(set_name(Extensions::ALL), "{read_lease, incarnation}");
    }

    /// The decode node sends a rank that advertised nothing a handshake request and releases,
    /// and a rank that advertised read leases a lease too; the frames are what the backend
    /// sends, and the backend's own receivers take them.
    #[test]
    fn the_decode_node_leases_only_ranks_that_advertised_it() {
        let messages = build(false).unwrap();
        let names = |set: Extensions| -> Vec<(&str, Socket)> {
            messages.emitted.iter().find(|(s, _)| *s == set).map(|(_, p)| p.clone()).unwrap()
        };
        let mut none = names(Extensions::NONE);
        none.sort();
        assert_eq!(none, [("handshake_request", Socket::Handshake), ("release", Socket::Notify)]);
        let mut all = names(Extensions::ALL);
        all.sort();
        assert_eq!(
            all,
            [
                ("handshake_request", Socket::Handshake),
                ("read_lease", Socket::Notify),
                ("release", Socket::Notify)
            ]
        );
        for m in &messages.messages {
            assert_eq!(m.frames.len(), 1);
            assert_eq!(wire::decode(&m.frames[0]).as_ref(), Ok(&m.message), "{}", m.name());
            if m.origin == Origin::DecodeNode && m.socket == Socket::Handshake {
                assert_eq!(wire::handshake_request(&m.frames), Ok(wire::HandshakeRequest::Metadata));
            }
            if m.origin == Origin::DecodeNode && m.socket == Socket::Notify {
                assert!(wire::notify_frame(&m.frames).is_ok());
            }
        }
        // With the gate off, a lease is sent to a rank that advertised nothing.
        let ungated = build(true).unwrap();
        assert!(ungated
            .messages
            .iter()
            .any(|m| m.capabilities == Extensions::NONE && m.emitted && m.name() == "read_lease"));
    }

    #[test]
    fn hex_round_trips_and_refuses_what_is_not_hex() {
        assert_eq!(hex(b"\x00\xffa"), "00ff61");
        assert_eq!(unhex("00ff61"), Some(b"\x00\xffa".to_vec()));
        assert_eq!(unhex("0"), None);
        assert_eq!(unhex("zz"), None);
        assert_eq!(unhex("é0"), None);
    }
}
