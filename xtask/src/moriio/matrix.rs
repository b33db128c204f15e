//! The compatibility matrix: one row per interaction × direction × layout class, with how many
//! cases fell in it and their verdict (works, differs as documented, fails). The documented
//! differences live in one table here, [`DOCUMENTED`], each with the pdkv rule it comes from.
//!
//! The row type covers the pure rules compared now and the wire interactions ([`Wire`]:
//! handshake listener and dialer both ways, notify and release both ways, a read lease to
//! vLLM's receiver, foreign agent metadata, every message pdkv sends delivered to vLLM's
//! listeners), so adding one is adding its cases.

use std::collections::BTreeMap;
use std::fmt::Write as _;

/// A rule pdkv re-implements, compared value by value with vLLM's function.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Rule {
    SourceRank,
    ReleaseTargets,
    Acks,
    ExpectedAcks,
    HandshakeListenPort,
    NotifyListenPort,
    HandshakeDialPort,
    ReleaseDialPort,
    HeadGuard,
    WriteMapping,
    WriteSpread,
}

impl Rule {
    pub fn name(self) -> &'static str {
        match self {
            Rule::SourceRank => "source rank (every read)",
            Rule::ReleaseTargets => "release targets and message",
            Rule::Acks => "acks counted per prefill rank",
            Rule::ExpectedAcks => "expected ack count formula",
            Rule::HandshakeListenPort => "handshake listener port",
            Rule::NotifyListenPort => "notify listener port",
            Rule::HandshakeDialPort => "handshake dial port",
            Rule::ReleaseDialPort => "release dial port",
            Rule::HeadGuard => "KV head guard",
            Rule::WriteMapping => "WRITE TP mapping (vLLM's rule)",
            Rule::WriteSpread => "WRITE spread holders as a vLLM decode sees them",
        }
    }

    /// The vLLM code asked, and pdkv's counterpart.
    pub fn sources(self) -> (&'static str, &'static str) {
        match self {
            Rule::SourceRank => (
                "MoRIIOConnectorWorker._resolve_read_source, _next_flex_tp_rank, get_moriio_remote_tp_rank",
                "routing::ReadRouter::resolve, routing::is_flexible",
            ),
            Rule::ReleaseTargets => (
                "MoRIIOConnectorWorker._read_blocks_for_req -> _read_blocks (get_moriio_read_holder_tp_ranks) -> _send_read_release -> MoRIIOWrapper.send_notify",
                "ports::ReadTarget::for_engine (notify endpoint of the source rank)",
            ),
            Rule::Acks => (
                "MoRIIOWrapper._handle_message, MoRIIOConnectorWorker.get_finished (pop_finished_req_ids, resolve_moriio_transfer_ack, get_moriio_expected_ack_count)",
                "release::quorum_plan, release::RankLedger (handle_group_done for flexible reads)",
            ),
            Rule::ExpectedAcks => ("get_moriio_expected_ack_count", "release::expected_releases"),
            Rule::HandshakeListenPort => (
                "MoRIIOConnectorWorker.__init__ side_channel_port (its expression, evaluated), MoRIIOConfig.from_vllm_config",
                "ports::EngineAddress::listen(Handshake)",
            ),
            Rule::NotifyListenPort => ("MoRIIOConfig.from_vllm_config notify_port", "ports::EngineAddress::listen(Notify)"),
            Rule::HandshakeDialPort => ("MoRIIOConnectorWorker._moriio_handshake", "ports::EngineAddress::dial(Handshake)"),
            Rule::ReleaseDialPort => ("MoRIIOConnectorWorker._read_blocks", "ports::EngineAddress::dial(Notify)"),
            Rule::HeadGuard => ("validate_moriio_heterogeneous_tp_kv_heads", "routing::check_heads"),
            Rule::WriteMapping => (
                "moriio_tp_mapping.compute_write_tp_mapping (validate_write_tp_topology, _producer_targets)",
                "write::write_plan under WriteRule::FirstHolder",
            ),
            Rule::WriteSpread => (
                "moriio_tp_mapping.compute_write_tp_mapping, each decode rank's targets and num_writers",
                "write::writers_of under WriteRule::SpreadHolders, every pick",
            ),
        }
    }
}

/// A wire interaction: real sockets, real bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Wire {
    /// A handshake dialer against a handshake listener.
    Handshake,
    /// A release (notify) sender against a notify listener.
    ReleaseNotify,
    /// pdkv's read lease sent to vLLM's notify receiver.
    ReadLease,
    /// Agent metadata from the other implementation, decoded.
    AgentMetadata,
    /// A stream of requests through a deployment with vLLM's code on one side and pdkv's
    /// processes on the other, every transfer accounted once on both sides.
    Mixed,
    /// Every message pdkv sends (and every `ControlMessage` variant), delivered to a fresh vLLM
    /// listener each, under each capability set a peer can advertise: does the listener live on?
    EveryMessage,
}

impl Wire {
    pub fn name(self) -> &'static str {
        match self {
            Wire::Handshake => "handshake (wire)",
            Wire::ReleaseNotify => "release notify (wire)",
            Wire::ReadLease => "read lease (wire)",
            Wire::AgentMetadata => "foreign agent_metadata (wire)",
            Wire::Mixed => "mixed deployment, end to end",
            Wire::EveryMessage => "every pdkv message (wire)",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Interaction {
    Rule(Rule),
    Wire(Wire),
}

impl Interaction {
    pub fn name(self) -> &'static str {
        match self {
            Interaction::Rule(r) => r.name(),
            Interaction::Wire(w) => w.name(),
        }
    }
}

/// Who talks to whom; for a pure rule, whose answers are compared.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Direction {
    /// vLLM's function against pdkv's, same inputs.
    VllmVsPdkv,
    /// vLLM's function against pdkv under its `vllm-0.33` rule set (`PeerRules::Vllm033`),
    /// which must give vLLM's answer exactly, documented differences included.
    VllmVsPdkvVllmRules,
    /// vLLM's code on both ends (proves the harness's stubs faithful).
    VllmToVllm,
    /// pdkv's side initiates (dials, sends) to vLLM's.
    PdkvToVllm,
    /// vLLM's side initiates to pdkv's.
    VllmToPdkv,
}

impl Direction {
    pub fn name(self) -> &'static str {
        match self {
            Direction::VllmVsPdkv => "vLLM vs pdkv",
            Direction::VllmVsPdkvVllmRules => "vLLM vs pdkv under its dialect",
            Direction::VllmToVllm => "vLLM -> vLLM",
            Direction::PdkvToVllm => "pdkv -> vLLM",
            Direction::VllmToPdkv => "vLLM -> pdkv",
        }
    }
}

/// A deliberate difference: pdkv departs from vLLM 0.33 on purpose (and what vLLM then does,
/// where a mixed run records it).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Documented {
    ListenerOffset,
    UnreadHolders,
    FlexibleHolders,
    UnreadHoldersReaped,
    StrictAckCount,
    AdvertisedOnly,
    NeverSent,
    RestartStaleRead,
    RestartDeadSession,
    RestartUnfenced,
    ReadsDp0,
    NoFlexibleRead,
}

/// Every documented difference: its key in the matrix, and why pdkv differs, naming pdkv's rule.
pub const DOCUMENTED: &[(Documented, &str, &str)] = &[
    (
        Documented::ReadsDp0,
        "reads-dp0",
        "vLLM 0.25 and 0.26 read DP rank 0 whatever rank owns the request: ReqMeta has no \
         remote_dp_rank (a request naming one is refused), _read_blocks takes DP rank 0's session \
         and releases DP rank 0's port, and _moriio_handshake dials base + dp + tp. pdkv reads and \
         releases the owner DP rank at base + dp * T + tp (routing::ReadRouter::resolve with \
         ReadOwner::OwnerDp); its vllm-0.25 and vllm-0.26 rule sets read DP rank 0 as those \
         releases do (ReadOwner::Dp0, legacy read-from-dp0), which is what the vLLM-rules rows \
         check.",
    ),
    (
        Documented::NoFlexibleRead,
        "no-flexible-read",
        "vLLM 0.25 and 0.26 have no flexible read: a TP1 decode rank reading a TP-replicated MLA \
         prefill reads TP rank 0 every time (the fixed mapping, _remote_tp_rank). pdkv reads the \
         prefill TP ranks round-robin (routing::is_flexible, FlexibleReads::RoundRobin); its \
         vllm-0.25 and vllm-0.26 rule sets read as those releases do (FlexibleReads::Off, legacy \
         no-flexible-reads).",
    ),
    (
        Documented::ListenerOffset,
        "listener-offset",
        "vLLM 0.33's listeners bind base + get_port_offset(dp, tp) with tp_size left at 1, that \
         is base + dp + tp, while its own READ-mode dialers (_moriio_handshake, _read_blocks) use \
         base + dp * T + tp; with DP > 1 and TP > 1 two ranks bind one port and dials miss. pdkv \
         listens where the dialers dial: ports::listener_offset with \
         ListenerOffset::DpTimesTpSizePlusTp (legacy listener-offset-dp-plus-tp restores vLLM's \
         listener). docs/reference.md, Ports.",
    ),
    (
        Documented::UnreadHolders,
        "unread-holders",
        "Prefill TP larger than decode TP: vLLM releases every prefill rank holding the decode \
         rank's share (get_moriio_read_holder_tp_ranks: P/D ranks, one ack each), though it read \
         one; pdkv releases only the rank it read (ports::ReadTarget::derive, one rank for read \
         and release) and gives the ranks nobody reads quorum 0, freed at registration \
         (release::quorum_plan). Both free every rank once.",
    ),
    (
        Documented::FlexibleHolders,
        "flexible-holders",
        "Flexible read (decode TP1, MLA, prefill DP1 TP>1): vLLM reads one prefill rank round-robin \
         but releases all T ranks of the owner DP group (the holders of a TP1 decode rank), each \
         expecting one ack; pdkv releases only the rank it read, whose release completes the \
         transfer, and the prefill engine completes the group's other ranks \
         (Quorum::AnyOfGroup, RankLedger::handle_group_done). Both free every rank once.",
    ),
    (
        Documented::UnreadHoldersReaped,
        "unread-holders-reaped",
        "Before vLLM 0.33 (dialects vllm-0.27 to vllm-0.30): a decode rank releases only the \
         prefill rank it read (its newest read status), while every prefill rank waits for \
         get_moriio_expected_ack_count's uniform count, so a larger prefill's unread holders (and \
         a flexible read's other TP ranks) get no release and wait for the scheduler's 60 s \
         reaper. pdkv gives them quorum 0, or completes the flexible group with its first rank \
         (release::quorum_plan, Quorum::AnyOfGroup), and frees them at once; a pdkv prefill \
         engine read by such a decode does the same (Policy::between), two vLLM engines of these \
         releases leak until the reaper (docs/moriio-releases.md).",
    ),
    (
        Documented::StrictAckCount,
        "strict-ack-count",
        "Prefill TP larger than decode TP and not a multiple of it (P3/D2, P8/D6, ...): vLLM's \
         get_moriio_expected_ack_count answers 1, checking divisibility only when the consumer is \
         larger; pdkv's release::expected_releases refuses the pair (RoutingError::NotMultiple) \
         like every other pdkv rule. Unreachable either way: both sides already refuse the pair \
         when routing (get_moriio_remote_tp_rank raises, ReadRouter::resolve errs; the source-rank \
         rows 'TP sizes not multiples (refused)' check that), so no ack is ever counted for it.",
    ),
    (
        Documented::AdvertisedOnly,
        "advertised-only",
        "pdkv's own read_lease ends vLLM 0.33's notify listener thread (_handle_structured_message \
         raises on a type it does not know and _async_wait re-raises, so every later release to \
         that rank is lost). pdkv's decode node sends it only to a rank that advertised \
         Extension::ReadLease, in its handshake metadata or its engine's pdkv_extensions \
         (decode::lease), and vLLM 0.33 advertises nothing: its listener's metadata, decoded by \
         pdkv_core::wire::decode, has Extensions::NONE (the 'handshake (wire)' row vLLM -> pdkv). \
         The node was driven under every capability set and did not send it where this row's \
         set lacks the extension.",
    ),
    (
        Documented::NeverSent,
        "never-sent",
        "pdkv's decode node never sends this message to this listener: driven through every \
         path (read at once, queued with a lease renewal, failed read, deadline) under every \
         capability set and both rule sets, its actions (DecodeAction::DialHandshake, SendLease, \
         SendRelease) hold only the handshake request for the handshake listener and releases \
         and leases for the notify listener. The WRITE-mode messages (remote_blocks, write_done, write_failed), \
         a prefill rank's handshake_metadata (pdkv_core::wire::handshake_reply sends it only as an \
         answer, behind the delimiter frame) and any notify message on the handshake socket are \
         listed because a pdkv prefill rank or a future path could send them; vLLM's listener \
         raises on them and its thread ends.",
    ),
    (
        Documented::RestartStaleRead,
        "restart-stale-read",
        "vLLM 0.33's decode names a prefill engine by host:handshake_port, keys its sessions by \
         that name (_dp<rank>) and checks no identity on a handshake, and it ignores \
         pdkv_incarnations: a decode worker whose first handshake with a rank comes after the \
         rank restarted reads transfers the dead process held through the new process's session, \
         their block ids in memory that never held their KV (a stale read; wrong KV on hardware). \
         pdkv's decode reads, leases and releases a transfer only through a session of the \
         incarnation holding it, and fails it unread when that incarnation is gone \
         (fence::step, decode::fence); docs/interop.md, Finding.",
    ),
    (
        Documented::RestartDeadSession,
        "restart-dead-session",
        "vLLM 0.33's decode handshakes with a prefill engine once (_eager_handshaked_engines) and \
         builds its read sessions once (built_write_session); nothing drops them, not even a failed \
         read: after a prefill rank restarts, every read of it goes through the dead process's \
         session, the restarted process's transfers too (on hardware each fails and its request is \
         recomputed, for as long as the decode process lives). pdkv's decode drops a session whose \
         read failed (HandshakeEvent::ReadFailed) and one another incarnation supersedes \
         (HandshakeEvent::Superseded), and dials again; docs/interop.md, Finding.",
    ),
    (
        Documented::RestartUnfenced,
        "restart-unfenced",
        "vLLM 0.33's prefill names no incarnation (no pdkv_incarnation in its handshake metadata, \
         no pdkv_incarnations in its answer), so pdkv's decode cannot fence its transfers: after a \
         vLLM prefill rank restarts, pdkv's decode handshakes with the restarted process (its \
         first dial after the kill, or a new one once a read failed: HandshakeEvent::ReadFailed) \
         and reads old block ids through the new session, as MoRIIO would. Against a pdkv prefill \
         rank the fence fails such a transfer unread (fence::step). Here the restarted rank's pdkv \
         data-plane server refuses the blocks its process never filled (memory::Regions::fence), \
         so the stale read fails instead of returning wrong bytes; docs/interop.md, Incarnations.",
    ),
];

/// The matrix key and sentence of a documented difference.
pub fn documented(d: Documented) -> (&'static str, &'static str) {
    DOCUMENTED.iter().find(|(k, _, _)| *k == d).map(|(_, key, why)| (*key, *why)).unwrap_or(("?", "?"))
}

#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Verdict {
    Works,
    Documented(Documented),
    Fails,
}

/// One compared case: a layout (or wire run) under one interaction.
#[derive(Clone, Debug)]
pub struct Case {
    pub interaction: Interaction,
    pub direction: Direction,
    pub class: String,
    pub verdict: Verdict,
    /// For a failure: the exact layout, vLLM's answer and pdkv's.
    pub detail: Option<String>,
}

impl Case {
    pub fn rule(rule: Rule, class: impl Into<String>, verdict: Verdict, detail: Option<String>) -> Case {
        Case {
            interaction: Interaction::Rule(rule),
            direction: Direction::VllmVsPdkv,
            class: class.into(),
            verdict,
            detail,
        }
    }
}

/// The aggregated cases: counts per row, and every failure's detail.
#[derive(Default)]
pub struct Matrix {
    rows: BTreeMap<(Interaction, Direction, String, Verdict), usize>,
    failures: Vec<String>,
}

impl Matrix {
    pub fn add(&mut self, case: Case) {
        if case.verdict == Verdict::Fails {
            let detail = case.detail.clone().unwrap_or_default();
            self.failures.push(format!(
                "{} [{}] {}: {detail}",
                case.interaction.name(),
                case.direction.name(),
                case.class
            ));
        }
        *self.rows.entry((case.interaction, case.direction, case.class, case.verdict)).or_default() += 1;
    }

    pub fn failures(&self) -> &[String] {
        &self.failures
    }

    /// Cases per verdict: (works, documented, fails).
    pub fn totals(&self) -> (usize, usize, usize) {
        let mut t = (0, 0, 0);
        for ((_, _, _, verdict), n) in &self.rows {
            match verdict {
                Verdict::Works => t.0 += n,
                Verdict::Documented(_) => t.1 += n,
                Verdict::Fails => t.2 += n,
            }
        }
        t
    }

    /// The table, then the documented reasons it names.
    pub fn render(&self) -> String {
        let header = ["interaction", "direction", "layout class", "cases", "verdict"];
        let mut lines: Vec<[String; 5]> = vec![header.map(String::from)];
        let mut used = Vec::new();
        for ((interaction, direction, class, verdict), n) in &self.rows {
            let verdict = match verdict {
                Verdict::Works => "works".to_string(),
                Verdict::Documented(d) => {
                    if !used.contains(d) {
                        used.push(*d);
                    }
                    format!("differs as documented [{}]", documented(*d).0)
                }
                Verdict::Fails => "FAILS".to_string(),
            };
            lines.push([
                interaction.name().to_string(),
                direction.name().to_string(),
                class.clone(),
                n.to_string(),
                verdict,
            ]);
        }
        let mut widths = [0usize; 5];
        for line in &lines {
            for (w, cell) in widths.iter_mut().zip(line) {
                *w = (*w).max(cell.chars().count());
            }
        }
        let mut out = String::new();
        let mut previous = String::new();
        for (i, line) in lines.iter().enumerate() {
            // The interaction is named once per block of rows.
            let first = if i > 0 && line[0] == previous { String::new() } else { line[0].clone() };
            previous = line[0].clone();
            let _ = writeln!(
                out,
                "{:<w0$}  {:<w1$}  {:<w2$}  {:>w3$}  {}",
                first,
                line[1],
                line[2],
                line[3],
                line[4],
                w0 = widths[0],
                w1 = widths[1],
                w2 = widths[2],
                w3 = widths[3]
            );
        }
        let mut rules: Vec<Rule> = Vec::new();
        for (interaction, _, _, _) in self.rows.keys() {
            if let Interaction::Rule(rule) = interaction {
                if !rules.contains(rule) {
                    rules.push(*rule);
                }
            }
        }
        if !rules.is_empty() {
            out.push_str("\nwhat each rule compares (vLLM | pdkv):\n");
            for rule in rules {
                let (vllm, pdkv) = rule.sources();
                let _ = writeln!(out, "  {}: {vllm} | {pdkv}", rule.name());
            }
        }
        used.sort();
        if !used.is_empty() {
            out.push_str("\ndocumented differences:\n");
            for d in used {
                let (key, why) = documented(d);
                let _ = writeln!(out, "  [{key}] {why}");
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_documented_difference_has_one_key_and_a_pdkv_rule() {
        for d in [
            Documented::ListenerOffset,
            Documented::UnreadHolders,
            Documented::FlexibleHolders,
            Documented::UnreadHoldersReaped,
            Documented::StrictAckCount,
            Documented::AdvertisedOnly,
            Documented::NeverSent,
            Documented::RestartStaleRead,
            Documented::RestartDeadSession,
            Documented::RestartUnfenced,
            Documented::ReadsDp0,
            Documented::NoFlexibleRead,
        ] {
            assert_eq!(DOCUMENTED.iter().filter(|(k, _, _)| *k == d).count(), 1, "{d:?}");
            let (key, why) = documented(d);
            assert!(!key.contains(' '), "{key}");
            assert!(why.contains("pdkv") && why.contains("::"), "{why}");
        }
    }

    #[test]
    fn rows_count_cases_and_failures_keep_their_detail() {
        let mut m = Matrix::default();
        m.add(Case::rule(Rule::HeadGuard, "MLA", Verdict::Works, None));
        m.add(Case::rule(Rule::HeadGuard, "MLA", Verdict::Works, None));
        m.add(Case::rule(
            Rule::HandshakeListenPort,
            "P DP>1 x TP>1",
            Verdict::Documented(Documented::ListenerOffset),
            None,
        ));
        m.add(Case::rule(
            Rule::SourceRank,
            "P TP = D TP",
            Verdict::Fails,
            Some("D TP2 <- P TP2: vLLM 1, pdkv 0".into()),
        ));
        assert_eq!(m.totals(), (2, 1, 1));
        assert_eq!(
            m.failures(),
            ["source rank (every read) [vLLM vs pdkv] P TP = D TP: D TP2 <- P TP2: vLLM 1, pdkv 0"]
        );
        let text = m.render();
        assert!(text.contains("KV head guard"), "{text}");
        assert!(text.contains("differs as documented [listener-offset]"), "{text}");
        assert!(text.contains("[listener-offset] vLLM 0.33's listeners"), "{text}");
        assert!(text.contains("FAILS"), "{text}");
    }
}
