//! pdkv-core's answers to the questions the harness asked vLLM, and the verdict of each case:
//! identical (works), a difference listed in [`matrix::DOCUMENTED`], or a failure that names the
//! layout, vLLM's answer and pdkv's. [`message_cases`] judges what vLLM's listeners did with
//! every message pdkv sends (`messages.rs`).
//!
//! The harness and this file use the same inputs: host 127.0.0.1, handshake base 6301, notify
//! base 61005, one transfer id; an MLA model, or GQA with one KV head (routing does not depend on
//! the head count in either implementation; the head guard is its own rule over 1 to 16 heads).

use std::collections::BTreeSet;

use pdkv_core::ids::{EngineId, RankId, TransferId};
use pdkv_core::legacy::{Legacy, LegacyOptions};
use pdkv_core::policy::{PeerRules, Policy, ReadOwner, ReleasePlan, SessionKeyRule};
use pdkv_core::ports::{EngineAddress, ListenerKind, ReadTarget};
use pdkv_core::release::{self, Quorum, RankLedger, Release, ReleaseOutcome, ReleaseSender};
use pdkv_core::routing::{self, ReadRouter, RoutingError, Source};
use pdkv_core::topology::{Layout, ModelSpec};
use pdkv_core::wire::{self, ControlMessage, Extensions, ReplyPart};
use pdkv_core::write::{self, WriteError, WriteRule, WriteShape, WriteTarget};

use super::answers::{
    AckGroup, Answers, Combo, DecodeRank, Delivery, ExpectedAcks, HeadGuard, PortLayout, VllmMetadata,
    WireRow, WriteAnswer,
};
use super::matrix::{Case, Direction, Documented, Interaction, Rule, Verdict, Wire};
use super::messages::{self, Message, Messages, Origin};

/// The values tests/moriio/harness.py uses.
const HOST: &str = "127.0.0.1";
const HANDSHAKE_BASE: u16 = 6301;
const NOTIFY_BASE: u16 = 61005;
const TRANSFER_ID: &str = "tx-pdkv-conformance";

fn address() -> EngineAddress {
    EngineAddress { host: HOST.into(), handshake_port_base: HANDSHAKE_BASE, notify_port_base: NOTIFY_BASE }
}

fn model(mla: bool) -> ModelSpec {
    if mla {
        ModelSpec::deepseek_r1()
    } else {
        ModelSpec::gqa(1)
    }
}

/// MoRIIO's `backend` under the release's rules: RDMA reads flexibly; from vLLM 0.33 xGMI never
/// does (`_spreads_replicated_reads`), which is pdkv's `no-flexible-reads`; before 0.33 xGMI
/// reads flexibly too.
fn policy(backend: &str, rules: PeerRules) -> Policy {
    if backend == "xgmi" && rules == PeerRules::Vllm033 {
        Policy::from(LegacyOptions::none().with(Legacy::NoFlexibleReads))
    } else {
        Policy::fixed()
    }
}

/// Every case of every rule and wire row, in the harness's order.
pub fn cases(answers: &Answers, rules: PeerRules) -> Vec<Case> {
    let mut out = Vec::new();
    for layout in &answers.ports {
        out.extend(ports(layout, rules));
    }
    out.extend(answers.expected_acks.iter().map(expected_acks));
    out.extend(answers.heads.iter().map(head_guard));
    out.push(write_module(answers.writes.module.as_deref(), rules));
    for shape in &answers.writes.shapes {
        out.push(write_mapping(shape, WriteRule::FirstHolder));
        out.push(write_spread(shape));
    }
    for combo in &answers.combos {
        out.extend(source_and_release(combo, rules));
        for group in &combo.acks {
            out.extend(acks(combo, group, rules));
        }
        out.extend(as_vllm_rules(combo, rules));
    }
    out.extend(answers.wire.iter().map(wire));
    out
}

fn layout(sizes: [u16; 2]) -> Layout {
    Layout::new(sizes[0], sizes[1], false)
}

fn name(sizes: [u16; 2]) -> String {
    layout(sizes).to_string()
}

/// The layout class of a decode/prefill pair, as the matrix groups it.
fn combo_class(c: &Combo) -> String {
    let (w, [p_dp, p_tp]) = (c.decode[1], c.prefill);
    if w == 1 && c.mla && p_dp == 1 && p_tp > 1 {
        return if c.backend == "xgmi" {
            "flexible shape on xGMI (fixed mapping)".into()
        } else {
            "flexible (D TP1, MLA, P DP1 TP>1)".into()
        };
    }
    let ratio = if w.max(p_tp) % w.min(p_tp) != 0 {
        "TP sizes not multiples (refused)"
    } else if p_tp == w {
        "P TP = D TP"
    } else if p_tp > w {
        "P TP > D TP"
    } else {
        "P TP < D TP"
    };
    format!("{ratio}, {}", if p_dp > 1 { "P DP>1" } else { "P DP1" })
}

fn combo_name(c: &Combo) -> String {
    format!(
        "D {} <- P {} ({}, {}, owner DP {})",
        name(c.decode),
        name(c.prefill),
        if c.mla { "MLA" } else { "GQA" },
        c.backend,
        c.owner
    )
}

fn router(c: &Combo, rules: PeerRules, dp: u16, tp: u16) -> ReadRouter {
    ReadRouter::new(
        RankId::new(EngineId::decode(0), dp, tp),
        layout(c.decode),
        model(c.mla),
        policy(&c.backend, rules),
    )
}

/// Whether the release's decode reads as 0.25 and 0.26 do: DP rank 0, never flexibly.
fn reads_dp0(rules: PeerRules) -> bool {
    rules.read_owner() == ReadOwner::Dp0
}

fn resolve(r: &mut ReadRouter, c: &Combo) -> Result<Source, RoutingError> {
    r.resolve(EngineId::prefill(0), layout(c.prefill), Some(c.owner))
}

/// The notify port pdkv releases `source` at.
fn release_port(c: &Combo, source: RankId) -> Result<u32, String> {
    ReadTarget::for_engine(&address(), layout(c.prefill), source, SessionKeyRule::PerRank)
        .map(|t| u32::from(t.notify.port))
        .map_err(|e| e.to_string())
}

/// Source rank and release targets of every decode rank over its reads: one case each.
fn source_and_release(c: &Combo, rules: PeerRules) -> Vec<Case> {
    let class = combo_class(c);
    let mut out = Vec::new();
    for rank in &c.ranks {
        let (source, release) = decode_rank(c, rules, rank);
        out.push(Case::rule(Rule::SourceRank, class.clone(), source.0, source.1));
        if let Some((verdict, detail)) = release {
            out.push(Case::rule(Rule::ReleaseTargets, class.clone(), verdict, detail));
        }
    }
    out
}

type Outcome = (Verdict, Option<String>);

fn fails(detail: String) -> Outcome {
    (Verdict::Fails, Some(detail))
}

/// The worst of two outcomes: a failure over a documented difference over works.
fn worst(a: Outcome, b: Outcome) -> Outcome {
    if b.0 > a.0 {
        b
    } else {
        a
    }
}

/// (source outcome, release outcome; None when both refused the pair).
fn decode_rank(c: &Combo, rules: PeerRules, rank: &DecodeRank) -> (Outcome, Option<Outcome>) {
    let at = format!("{} decode rank (dp {}, tp {})", combo_name(c), rank.dp, rank.tp);
    let mut r = router(c, rules, rank.dp, rank.tp);
    if let Some(err) = &rank.error {
        // Both must refuse, for the same reason: sizes that are not multiples.
        let outcome = match resolve(&mut r, c) {
            Err(RoutingError::NotMultiple { .. }) if err.contains("multiple") => (Verdict::Works, None),
            // A release whose requests cannot name their owner (0.25, 0.26) refuses one that
            // does; pdkv reads the owner it names.
            Ok(s)
                if reads_dp0(rules)
                    && c.owner > 0
                    && err.contains("remote_dp_rank")
                    && s.rank.dp == c.owner =>
            {
                (Verdict::Documented(Documented::ReadsDp0), None)
            }
            // It refuses the owner before it looks at the sizes, which pdkv refuses.
            Err(RoutingError::NotMultiple { .. })
                if reads_dp0(rules) && c.owner > 0 && err.contains("remote_dp_rank") =>
            {
                (Verdict::Documented(Documented::ReadsDp0), None)
            }
            Err(e) => fails(format!("{at}: vLLM refuses ({err}), pdkv refuses for another reason ({e})")),
            Ok(s) => fails(format!("{at}: vLLM refuses ({err}), pdkv reads {}", s.rank)),
        };
        return (outcome, None);
    }
    if rank.reads.is_empty() {
        return (fails(format!("{at}: the harness recorded no read")), None);
    }
    let mut source = (Verdict::Works, None);
    let mut release = (Verdict::Works, None);
    let want =
        serde_json::json!({"type": "release", "transfer_id": TRANSFER_ID, "consumer_tp_size": c.decode[1]});
    for payload in &rank.payloads {
        if *payload != want {
            release = worst(
                release,
                fails(format!("{at}: vLLM's release is {payload}, pdkv's ledger reads {want}")),
            );
        }
    }
    for (k, (tp, flexible, ports)) in rank.reads.iter().enumerate() {
        let at = format!("{at} read {k}");
        let s = match resolve(&mut r, c) {
            Ok(s) => s,
            Err(e) => {
                source = worst(source, fails(format!("{at}: vLLM reads TP rank {tp}, pdkv refuses: {e}")));
                continue;
            }
        };
        if !*flexible && s.flexible && s.rank.dp == c.owner && reads_dp0(rules) {
            // A release without the flexible read reads the fixed mapping's rank and releases it.
            source = worst(source, (Verdict::Documented(Documented::NoFlexibleRead), None));
            let fixed = release_port(c, RankId::new(EngineId::prefill(0), c.owner, *tp));
            release = worst(
                release,
                if fixed.as_ref().is_ok_and(|p| *ports == [*p]) {
                    (Verdict::Documented(Documented::NoFlexibleRead), None)
                } else {
                    fails(format!("{at}: vLLM releases ports {ports:?} after a fixed read of TP rank {tp}, pdkv's fixed port {fixed:?}"))
                },
            );
            continue;
        }
        if (s.rank.dp, s.rank.tp, s.flexible) != (c.owner, *tp, *flexible) {
            source = worst(
                source,
                fails(format!(
                    "{at}: vLLM reads (dp {}, tp {tp}) flexible={flexible}, pdkv reads (dp {}, tp {}) flexible={}",
                    c.owner, s.rank.dp, s.rank.tp, s.flexible
                )),
            );
        }
        release = worst(release, release_targets(c, &at, s, ports));
    }
    (source, Some(release))
}

/// vLLM's release ports for one read against pdkv's single release to the rank it read.
fn release_targets(c: &Combo, at: &str, s: Source, ports: &[u32]) -> Outcome {
    let mine = match release_port(c, s.rank) {
        Ok(p) => p,
        Err(e) => return fails(format!("{at}: pdkv has no release port: {e}")),
    };
    if ports == [mine] {
        return (Verdict::Works, None);
    }
    let (w, p_tp) = (c.decode[1], c.prefill[1]);
    // vLLM's extra releases must go to other ranks of the owner DP group that hold the same
    // share: P/W ranks for a larger prefill, all of them for a flexible read.
    let (documented, holders) = if s.flexible {
        (Documented::FlexibleHolders, p_tp)
    } else if p_tp > w && p_tp % w == 0 {
        (Documented::UnreadHolders, p_tp / w)
    } else {
        return fails(format!("{at}: vLLM releases ports {ports:?}, pdkv releases port {mine}"));
    };
    let group: BTreeSet<u32> = (0..p_tp)
        .filter_map(|tp| release_port(c, RankId::new(EngineId::prefill(0), c.owner, tp)).ok())
        .collect();
    let distinct: BTreeSet<u32> = ports.iter().copied().collect();
    if ports.contains(&mine)
        && distinct.len() == ports.len()
        && ports.len() == usize::from(holders)
        && distinct.is_subset(&group)
    {
        (Verdict::Documented(documented), None)
    } else {
        fails(format!("{at}: vLLM releases ports {ports:?}, pdkv releases port {mine}"))
    }
}

/// When pdkv's ledger of one prefill rank reports the transfer done.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Done {
    /// After this many releases (0: at registration).
    After(u32),
    /// A flexible read completed on another rank of the group.
    ByGroup,
    Never,
}

/// The releases one decode DP group sends for one request, as each prefill rank of the owner
/// DP group counts them: vLLM's `get_finished` against pdkv's quorum plan and ledger.
fn acks(c: &Combo, g: &AckGroup, rules: PeerRules) -> Vec<Case> {
    let class = combo_class(c);
    let at = format!("{} decode group {}", combo_name(c), g.group);
    let (p_tp, w) = (c.prefill[1], c.decode[1]);
    let policy = policy(&c.backend, rules);
    let plan = match release::quorum_plan(layout(c.prefill), layout(c.decode), &model(c.mla), &policy) {
        Ok(plan) => plan,
        Err(e) => {
            return vec![Case::rule(
                Rule::Acks,
                class,
                Verdict::Fails,
                Some(format!("{at}: vLLM counts acks, pdkv has no quorum plan: {e}")),
            )]
        }
    };
    // pdkv's releases: each decode rank of the group releases the rank its first read chose.
    let mut inbox: Vec<Vec<ReleaseSender>> = vec![Vec::new(); usize::from(p_tp)];
    for r in 0..w {
        match resolve(&mut router(c, rules, g.group, r), c) {
            Ok(s) => inbox[usize::from(s.rank.tp)].push(ReleaseSender {
                engine_id: format!("{HOST}:{HANDSHAKE_BASE}"),
                dp_rank: g.group,
                tp_rank: r,
            }),
            Err(e) => {
                return vec![Case::rule(
                    Rule::Acks,
                    class,
                    Verdict::Fails,
                    Some(format!("{at}: pdkv cannot route decode rank {r}: {e}")),
                )]
            }
        }
    }
    let id = TransferId::new(TRANSFER_ID);
    let mut pdkv: Vec<(u32, Quorum, Done)> = Vec::new();
    for (tp, senders) in inbox.iter().enumerate() {
        let quorum = plan.per_tp_rank.get(tp).copied().unwrap_or(Quorum::Exact(0));
        let mut ledger = RankLedger::new(&policy);
        let mut done = match ledger.handle_transfer(&id, quorum) {
            Ok(ReleaseOutcome::Completed) => Done::After(0),
            _ => Done::Never,
        };
        for (i, sender) in senders.iter().enumerate() {
            let release = Release {
                transfer_id: id.clone(),
                consumer_tp_size: Some(w),
                sender: Some(sender.clone()),
                incarnation: None,
                mac: None,
            };
            if ledger.handle_release(release) == ReleaseOutcome::Completed && done == Done::Never {
                done = Done::After(i as u32 + 1);
            }
        }
        pdkv.push((senders.len() as u32, quorum, done));
    }
    // The prefill engine completes a flexible transfer's other ranks once one rank completed.
    if plan.flexible && pdkv.iter().any(|(_, _, d)| matches!(d, Done::After(_))) {
        for entry in pdkv.iter_mut().filter(|(_, _, d)| *d == Done::Never) {
            entry.2 = Done::ByGroup;
        }
    }
    if g.ranks.len() != usize::from(p_tp) {
        return vec![Case::rule(
            Rule::Acks,
            class,
            Verdict::Fails,
            Some(format!("{at}: vLLM answered for {} prefill ranks of {p_tp}", g.ranks.len())),
        )];
    }
    g.ranks
        .iter()
        .map(|v| {
            let (received, quorum, done) = pdkv[usize::from(v.tp)];
            let vllm_done = v.reported.first().copied();
            let at = format!(
                "{at} prefill rank (dp {}, tp {}): vLLM got {} release(s), expects {:?}, reported done {:?}; \
                 pdkv got {received}, quorum {quorum:?}, done {done:?}",
                c.owner, v.tp, v.received, g.expected, v.reported
            );
            let verdict = if v.reported.len() > 1 {
                fails(format!("{at} (vLLM reported it twice)"))
            } else if v.received == received && vllm_done.map(Done::After).unwrap_or(Done::Never) == done {
                (Verdict::Works, None)
            } else if (v.received, vllm_done) == (1, Some(1))
                && received == 0
                && quorum == Quorum::Exact(0)
                && done == Done::After(0)
            {
                (Verdict::Documented(Documented::UnreadHolders), None)
            } else if (v.received, vllm_done) == (1, Some(1))
                && received == 0
                && quorum == Quorum::AnyOfGroup
                && done == Done::ByGroup
            {
                (Verdict::Documented(Documented::FlexibleHolders), None)
            } else if reads_dp0(rules)
                && plan.flexible
                && u32::try_from((0..w).filter(|&r| routing::fixed_tp_source(w, r, p_tp) == Ok(v.tp)).count())
                    == Ok(v.received)
            {
                // Without the flexible read every decode rank reads (and releases) the fixed
                // mapping's rank; pdkv's round-robin picked another.
                (Verdict::Documented(Documented::NoFlexibleRead), None)
            } else if rules.release_plan() == ReleasePlan::RankRead
                && (v.received, vllm_done) == (0, None)
                && g.expected.is_some_and(|n| n > 0)
                && received == 0
                && matches!(
                    (quorum, done),
                    (Quorum::Exact(0), Done::After(0)) | (Quorum::AnyOfGroup, Done::ByGroup)
                )
            {
                // Before 0.33 vLLM leaves the holders it did not read to its reaper.
                (Verdict::Documented(Documented::UnreadHoldersReaped), None)
            } else {
                fails(at)
            };
            Case::rule(Rule::Acks, class.clone(), verdict.0, verdict.1)
        })
        .collect()
}

/// pdkv's rule set for the release (`vllm-0.33` for 0.33 and 0.34) against vLLM: the release ports of
/// every read and the acks each prefill rank counts must be vLLM's exactly, with no documented
/// difference, since that rule set is how a pdkv rank talks to a vLLM 0.33 rank.
fn as_vllm_rules(c: &Combo, rules: PeerRules) -> Vec<Case> {
    if c.ranks.iter().any(|r| r.error.is_some()) {
        // Both refuse the pair; the pdkv-rules rows already compared the refusals.
        return Vec::new();
    }
    let class = combo_class(c);
    let policy = policy(&c.backend, rules).under(rules);
    let (p_tp, w) = (c.prefill[1], c.decode[1]);
    let case = |rule, (verdict, detail): Outcome| {
        let mut case = Case::rule(rule, class.clone(), verdict, detail);
        case.direction = Direction::VllmVsPdkvVllmRules;
        case
    };
    let router = |dp: u16, tp: u16| {
        ReadRouter::new(RankId::new(EngineId::decode(0), dp, tp), layout(c.decode), model(c.mla), policy)
    };
    // The prefill ranks pdkv releases after one read resolved to `source`, as notify ports.
    let releases = |tp: u16, source: Source| -> Result<Vec<u32>, String> {
        let ranks = release::release_ranks(policy.release_plan, source.rank, w, tp, p_tp)
            .map_err(|e| e.to_string())?;
        ranks.into_iter().map(|rank| release_port(c, rank)).collect()
    };
    let mut out = Vec::new();
    for rank in &c.ranks {
        let at = format!("{} decode rank (dp {}, tp {})", combo_name(c), rank.dp, rank.tp);
        let mut r = router(rank.dp, rank.tp);
        let mut outcome = (Verdict::Works, None);
        for (k, (tp, flexible, ports)) in rank.reads.iter().enumerate() {
            let mine = resolve(&mut r, c).map_err(|e| e.to_string()).and_then(|s| {
                if (s.rank.dp, s.rank.tp, s.flexible) != (c.owner, *tp, *flexible) {
                    return Err(format!(
                        "reads (dp {}, tp {}), vLLM (dp {}, tp {tp})",
                        s.rank.dp, s.rank.tp, c.owner
                    ));
                }
                releases(rank.tp, s)
            });
            if mine.as_deref() != Ok(ports.as_slice()) {
                outcome = worst(
                    outcome,
                    fails(format!("{at} read {k}: vLLM releases {ports:?}, pdkv as {rules} {mine:?}")),
                );
            }
        }
        out.push(case(Rule::ReleaseTargets, outcome));
    }
    let plan = release::quorum_plan(layout(c.prefill), layout(c.decode), &model(c.mla), &policy);
    for g in &c.acks {
        let at = format!("{} decode group {}", combo_name(c), g.group);
        let plan = match &plan {
            Ok(plan) => plan,
            Err(e) => {
                out.push(case(Rule::Acks, fails(format!("{at}: pdkv as {rules} has no quorum plan: {e}"))));
                continue;
            }
        };
        // Each decode rank's first read releases these ranks, as vLLM's first read did.
        let mut inbox: Vec<Vec<ReleaseSender>> = vec![Vec::new(); usize::from(p_tp)];
        for tp in 0..w {
            let source = resolve(&mut router(g.group, tp), c);
            let ranks = source.map_err(|e| e.to_string()).and_then(|s| {
                release::release_ranks(policy.release_plan, s.rank, w, tp, p_tp).map_err(|e| e.to_string())
            });
            match ranks {
                Ok(ranks) => {
                    for rank in ranks {
                        let sender = ReleaseSender {
                            engine_id: format!("{HOST}:{HANDSHAKE_BASE}"),
                            dp_rank: g.group,
                            tp_rank: tp,
                        };
                        inbox[usize::from(rank.tp)].push(sender);
                    }
                }
                Err(e) => out
                    .push(case(Rule::Acks, fails(format!("{at}: pdkv cannot route decode rank {tp}: {e}")))),
            }
        }
        let id = TransferId::new(TRANSFER_ID);
        for v in &g.ranks {
            let quorum = plan.per_tp_rank.get(usize::from(v.tp)).copied().unwrap_or(Quorum::Exact(0));
            let mut ledger = RankLedger::new(&policy);
            let mut reported = Vec::new();
            if ledger.handle_transfer(&id, quorum) == Ok(ReleaseOutcome::Completed) {
                reported.push(0);
            }
            let senders = &inbox[usize::from(v.tp)];
            for (i, sender) in senders.iter().enumerate() {
                let release = Release {
                    transfer_id: id.clone(),
                    consumer_tp_size: Some(w),
                    sender: Some(sender.clone()),
                    incarnation: None,
                    mac: None,
                };
                if ledger.handle_release(release) == ReleaseOutcome::Completed {
                    reported.push(i as u32 + 1);
                }
            }
            let outcome =
                if (senders.len() as u32, &reported) == (v.received, &v.reported) {
                    (Verdict::Works, None)
                } else {
                    fails(format!(
                    "{at} prefill rank (dp {}, tp {}): vLLM got {} release(s), reported done {:?}; pdkv as \
                     {rules} got {}, quorum {quorum:?}, done {reported:?}",
                    c.owner, v.tp, v.received, v.reported, senders.len()
                ))
                };
            out.push(case(Rule::Acks, outcome));
        }
    }
    out
}

fn port_class(p: [u16; 2]) -> &'static str {
    match p {
        [1, _] => "P DP1 (pure TP)",
        [_, 1] => "P TP1 (pure DP)",
        _ => "P DP>1 x TP>1",
    }
}

/// vLLM's listener and dial ports of every rank of one prefill layout against pdkv's.
fn ports(p: &PortLayout, rules: PeerRules) -> Vec<Case> {
    let class = port_class(p.prefill);
    let (addr, lay, fixed) = (address(), layout(p.prefill), Policy::fixed());
    let vllm_rules = fixed.under(rules);
    let mut out = Vec::new();
    for r in &p.ranks {
        let rank = RankId::new(EngineId::prefill(0), r.dp, r.tp);
        let at = format!("P {} rank (dp {}, tp {})", name(p.prefill), r.dp, r.tp);
        let port = |e: Result<pdkv_core::ports::Endpoint, pdkv_core::ports::PortError>| {
            e.map(|e| u32::from(e.port)).ok()
        };
        let checks = [
            (
                Rule::HandshakeListenPort,
                Some(r.handshake_listen),
                port(addr.listen(lay, rank, ListenerKind::Handshake, &fixed)),
                HANDSHAKE_BASE,
                true,
            ),
            (
                Rule::NotifyListenPort,
                Some(r.notify_listen),
                port(addr.listen(lay, rank, ListenerKind::Notify, &fixed)),
                NOTIFY_BASE,
                true,
            ),
            (
                Rule::HandshakeDialPort,
                Some(r.handshake_dial),
                port(addr.dial(lay, rank, ListenerKind::Handshake)),
                HANDSHAKE_BASE,
                false,
            ),
            (
                Rule::ReleaseDialPort,
                r.release_dial,
                port(addr.dial(lay, rank, ListenerKind::Notify)),
                NOTIFY_BASE,
                false,
            ),
        ];
        // A release whose decode reads DP rank 0 alone never releases a DP rank above it, and
        // dials base + dp + tp (which equals base + dp * T + tp on DP rank 0).
        let reads_dp0 = vllm_rules.read_owner == ReadOwner::Dp0;
        for (rule, vllm, pdkv, base, listener) in checks {
            let vllm_dp_plus_tp = u32::from(base) + u32::from(r.dp) + u32::from(r.tp);
            let (verdict, detail) = match (vllm, pdkv) {
                (Some(vllm), Some(mine)) if mine == vllm => (Verdict::Works, None),
                (Some(vllm), Some(mine))
                    if listener
                        && vllm == vllm_dp_plus_tp
                        && mine == u32::from(base) + lay.flat_index(r.dp, r.tp) =>
                {
                    (Verdict::Documented(Documented::ListenerOffset), None)
                }
                (Some(vllm), Some(_)) if !listener && reads_dp0 && r.dp > 0 && vllm == vllm_dp_plus_tp => {
                    (Verdict::Documented(Documented::ReadsDp0), None)
                }
                (None, Some(_)) if rule == Rule::ReleaseDialPort && reads_dp0 && r.dp > 0 => {
                    (Verdict::Documented(Documented::ReadsDp0), None)
                }
                (vllm, mine) => fails(format!("{at}: vLLM {vllm:?}, pdkv {mine:?}")),
            };
            out.push(Case::rule(rule, class, verdict, detail));
        }
        // pdkv's rule set for the release must bind where its listeners bind, in every layout.
        let as_vllm = [
            (Rule::HandshakeListenPort, r.handshake_listen, ListenerKind::Handshake),
            (Rule::NotifyListenPort, r.notify_listen, ListenerKind::Notify),
        ];
        for (rule, vllm, kind) in as_vllm {
            let (verdict, detail) = match port(addr.listen(lay, rank, kind, &vllm_rules)) {
                Some(mine) if mine == vllm => (Verdict::Works, None),
                mine => fails(format!("{at}: vLLM {vllm}, pdkv as {rules} {mine:?}")),
            };
            let mut case = Case::rule(rule, class, verdict, detail);
            case.direction = Direction::VllmVsPdkvVllmRules;
            out.push(case);
        }
    }
    out
}

fn expected_acks(e: &ExpectedAcks) -> Case {
    let (p, c) = (e.producer, e.consumer);
    let class = if p.max(c) % p.min(c) != 0 {
        "TP sizes not multiples"
    } else if c <= p {
        "D TP <= P TP"
    } else {
        "D TP > P TP"
    };
    let at = format!("producer TP{p}, consumer TP{c}");
    let (verdict, detail) = match (e.value, &e.error, release::expected_releases(p, c)) {
        (Some(v), None, Ok(mine)) if v == mine => (Verdict::Works, None),
        (None, Some(err), Err(RoutingError::NotMultiple { .. })) if err.contains("multiple") => {
            (Verdict::Works, None)
        }
        // vLLM checks divisibility only when the consumer is larger; pdkv everywhere.
        (Some(1), None, Err(RoutingError::NotMultiple { .. })) if p > c && p % c != 0 => {
            (Verdict::Documented(Documented::StrictAckCount), None)
        }
        (v, err, mine) => fails(format!("{at}: vLLM {v:?} {err:?}, pdkv {mine:?}")),
    };
    Case::rule(Rule::ExpectedAcks, class, verdict, detail)
}

fn head_guard(h: &HeadGuard) -> Case {
    let (w, p, heads) = (h.decode_tp, h.prefill_tp, h.kv_heads);
    let class = if h.mla {
        "MLA"
    } else if w == p {
        "GQA, equal TP"
    } else if w.min(p) >= heads {
        "GQA, unequal TP, min(TP) >= KV heads"
    } else {
        "GQA, unequal TP, min(TP) < KV heads"
    };
    let model = ModelSpec { use_mla: h.mla, ..ModelSpec::gqa(heads) };
    let at = format!("D TP{w}, P TP{p}, {heads} KV heads, mla={}", h.mla);
    let (verdict, detail) = match (&h.error, routing::check_heads(w, p, &model)) {
        (None, Ok(())) => (Verdict::Works, None),
        (Some(err), Err(RoutingError::RequiresReplicatedHeads { .. }))
            if err.contains("replicated KV heads") =>
        {
            (Verdict::Works, None)
        }
        (err, mine) => fails(format!("{at}: vLLM {err:?}, pdkv {mine:?}")),
    };
    Case::rule(Rule::HeadGuard, class, verdict, detail)
}

/// The release has `compute_write_tp_mapping` exactly when pdkv's rule set for it writes by
/// [`WriteRule::FirstHolder`]; without it, its write path pairs prefill TP rank k with decode TP
/// rank k ([`WriteRule::SameRank`]).
fn write_module(module: Option<&str>, rules: PeerRules) -> Case {
    let rule = WriteRule::of(rules);
    let (class, agrees) = match module {
        Some(_) => ("release with a WRITE TP mapping", rule == WriteRule::FirstHolder),
        None => ("release without a WRITE TP mapping (TP rank k writes rank k)", rule == WriteRule::SameRank),
    };
    let (verdict, detail) = if agrees {
        (Verdict::Works, None)
    } else {
        fails(format!("the release's mapping module is {module:?}, but rule set {rules} writes by {rule}"))
    };
    Case::rule(Rule::WriteMapping, class, verdict, detail)
}

fn write_shape(w: &WriteAnswer) -> WriteShape {
    WriteShape {
        prefill_tp: w.prefill_tp,
        decode_tp: w.decode_tp,
        kv_heads: w.kv_heads,
        use_mla: w.mla,
        has_mamba: w.mamba,
    }
}

fn write_class(w: &WriteAnswer) -> String {
    let (p, d) = (w.prefill_tp, w.decode_tp);
    let ratio = if p.max(d) % p.min(d) != 0 {
        "TP sizes not multiples (refused)"
    } else if p == d {
        "P TP = D TP"
    } else if p > d {
        "P TP > D TP (gather)"
    } else {
        "P TP < D TP (slice)"
    };
    let model = if w.mla {
        "MLA"
    } else if p.min(d) >= w.kv_heads || p == d {
        "GQA, heads replicated or equal TP"
    } else {
        "GQA, heads split"
    };
    format!("{ratio}, {model}{}", if w.mamba { ", with recurrent state" } else { "" })
}

fn target_row(t: &WriteTarget) -> [u16; 9] {
    [
        t.decode_tp_rank,
        t.local_head,
        t.remote_head,
        t.heads,
        t.local_slice,
        t.local_slices,
        t.remote_slice,
        t.remote_slices,
        t.writers,
    ]
}

/// vLLM's refusal and pdkv's name the same rule.
fn same_write_refusal(vllm: &str, mine: &WriteError) -> bool {
    match mine {
        WriteError::NotMultiple { .. } => vllm.contains("multiple of the other"),
        WriteError::Unshardable { .. } => vllm.contains("cannot shard"),
        WriteError::ZeroTp => vllm.contains("must be positive"),
        WriteError::UnequalTp { .. } | WriteError::RankOutOfRange { .. } => false,
    }
}

/// Every prefill rank's targets under vLLM 0.33's rule (`compute_write_tp_mapping`) against
/// pdkv's plan under `rule` ([`WriteRule::FirstHolder`] in the matrix), field by field, or both
/// refusing the shape.
fn write_mapping(w: &WriteAnswer, rule: WriteRule) -> Case {
    let shape = write_shape(w);
    let at = format!(
        "P TP{} -> D TP{}, {} KV heads, mla={}, mamba={}",
        w.prefill_tp, w.decode_tp, w.kv_heads, w.mla, w.mamba
    );
    let mine: Result<Vec<_>, _> = (0..w.prefill_tp).map(|r| write::write_plan(shape, r, rule, 1)).collect();
    let (verdict, detail) = match (&w.ranks, &w.error, mine) {
        (Some(ranks), None, Ok(plans)) => {
            let differ = ranks.iter().zip(&plans).enumerate().find(|(_, (v, m))| {
                let targets: Vec<[u16; 9]> = m.targets.iter().map(target_row).collect();
                v.local_heads != m.local_heads || v.remote_heads != m.remote_heads || v.targets != targets
            });
            match differ {
                None => (Verdict::Works, None),
                Some((rank, (v, m))) => fails(format!("{at}, prefill rank {rank}: vLLM {v:?}, pdkv {m:?}")),
            }
        }
        (None, Some(err), Err(mine)) if same_write_refusal(err, &mine) => (Verdict::Works, None),
        (ranks, err, mine) => fails(format!("{at}: vLLM {ranks:?} {err:?}, pdkv {mine:?}")),
    };
    Case::rule(Rule::WriteMapping, write_class(w), verdict, detail)
}

/// pdkv's own rule ([`WriteRule::SpreadHolders`]) against what a vLLM 0.33 decode rank expects:
/// for every pick of the writing holder, each decode rank gets as many writers as vLLM's mapping
/// sends it, each carrying that count in `num_writers`, and the same heads at the same offsets.
/// A vLLM decode rank counts `write_done`s and does not ask who sent them, so these are all it
/// can see.
fn write_spread(w: &WriteAnswer) -> Case {
    let shape = write_shape(w);
    let at = format!("P TP{} -> D TP{}, {} KV heads, mla={}", w.prefill_tp, w.decode_tp, w.kv_heads, w.mla);
    let Some(ranks) = &w.ranks else {
        return Case::rule(Rule::WriteSpread, write_class(w), Verdict::Works, None);
    };
    // What decode rank d receives: the sorted (remote head, heads, remote slice, writers) rows.
    let seen = |targets: &mut dyn Iterator<Item = [u16; 9]>, d: u16| {
        let mut rows: Vec<[u16; 4]> =
            targets.filter(|t| t[0] == d).map(|t| [t[2], t[3], t[6], t[8]]).collect();
        rows.sort_unstable();
        rows
    };
    let picks = u64::from(w.prefill_tp.max(1));
    for spread in 0..picks {
        for d in 0..w.decode_tp {
            let vllm = seen(&mut ranks.iter().flat_map(|r| r.targets.iter().copied()), d);
            let mine = match write::writers_of(shape, d, WriteRule::SpreadHolders, spread) {
                Ok(writers) => seen(&mut writers.iter().map(|(_, t)| target_row(t)), d),
                Err(e) => {
                    return Case::rule(
                        Rule::WriteSpread,
                        write_class(w),
                        Verdict::Fails,
                        Some(format!("{at}: {e}")),
                    )
                }
            };
            // The writing holder changes, so a writer's remote slice does too; heads and counts
            // must not.
            let strip = |rows: &[[u16; 4]]| {
                let mut r: Vec<[u16; 3]> = rows.iter().map(|x| [x[0], x[1], x[3]]).collect();
                r.sort_unstable();
                r
            };
            if strip(&vllm) != strip(&mine) {
                return Case::rule(
                    Rule::WriteSpread,
                    write_class(w),
                    Verdict::Fails,
                    Some(format!(
                        "{at}, spread {spread}, decode rank {d}: vLLM sends {vllm:?}, pdkv {mine:?}"
                    )),
                );
            }
        }
    }
    Case::rule(Rule::WriteSpread, write_class(w), Verdict::Works, None)
}

fn wire(row: &WireRow) -> Case {
    let interaction = match row.interaction.as_str() {
        "handshake" => Some(Wire::Handshake),
        "release notify" => Some(Wire::ReleaseNotify),
        "read lease" => Some(Wire::ReadLease),
        "agent metadata" => Some(Wire::AgentMetadata),
        _ => None,
    };
    let direction = match row.direction.as_str() {
        "vllm->vllm" => Some(Direction::VllmToVllm),
        "pdkv->vllm" => Some(Direction::PdkvToVllm),
        "vllm->pdkv" => Some(Direction::VllmToPdkv),
        _ => None,
    };
    let (verdict, detail) = match (interaction, direction) {
        (Some(_), Some(_)) if row.ok => (Verdict::Works, None),
        (Some(_), Some(_)) => fails(format!("{}: {}", row.layout, row.detail)),
        _ => fails(format!("unknown wire row {:?} {:?}", row.interaction, row.direction)),
    };
    Case {
        interaction: Interaction::Wire(interaction.unwrap_or(Wire::Handshake)),
        direction: direction.unwrap_or(Direction::VllmToVllm),
        class: row.layout.clone(),
        verdict,
        detail,
    }
}

/// What vLLM 0.33's handshake listener advertises, from its answer to a pdkv dial: both reply
/// messages through pdkv's own framing and decoders (`reply_payload`, `decode`,
/// `decode_layer_memory_descs`), as pdkv's decode rank reads them.
pub fn vllm_extensions(m: &VllmMetadata) -> Result<Extensions, String> {
    if let Some(error) = &m.error {
        return Err(format!("the harness got no answer: {error}"));
    }
    let reply = |k: usize| -> Result<Vec<Vec<u8>>, String> {
        let frames = m.frames.get(k).ok_or(format!("{} reply message(s), expected 2", m.frames.len()))?;
        frames.iter().map(|f| messages::unhex(f).ok_or(format!("frame {f:?} is not hex"))).collect()
    };
    let (first, second) = (reply(0)?, reply(1)?);
    let payload = wire::reply_payload(ReplyPart::Metadata, &first).map_err(|e| e.to_string())?;
    let extensions = match wire::decode(payload) {
        Ok(ControlMessage::HandshakeMetadata(meta)) => meta.extensions,
        Ok(other) => return Err(format!("the metadata decodes as {}", messages::variant(&other).1)),
        Err(e) => return Err(format!("the metadata does not decode: {e}")),
    };
    let layers = wire::reply_payload(ReplyPart::Layers, &second).map_err(|e| e.to_string())?;
    wire::decode_layer_memory_descs(layers).map_err(|e| format!("the layer map does not decode: {e}"))?;
    Ok(extensions)
}

/// The row of vLLM's metadata, then one case per message delivered: does vLLM's listener live
/// on? A listener that ended is a failure when pdkv's decode node sends that message to that
/// listener of a rank advertising what vLLM 0.33 advertises, and a documented difference when it
/// never does (verified by driving the node, `messages.rs`). A message pdkv's ledger counts as a
/// release must be counted by vLLM as that ack.
pub fn message_cases(sent: &Messages, answers: &Answers) -> Vec<Case> {
    let vllm = vllm_extensions(&answers.vllm_metadata);
    let (class, verdict, detail) = match &vllm {
        Ok(set) => (
            format!(
                "vLLM's metadata answer, pdkv's framing and decoder: advertises {}",
                messages::set_name(*set)
            ),
            Verdict::Works,
            None,
        ),
        Err(e) => (
            "vLLM's metadata answer, pdkv's framing and decoder".to_string(),
            Verdict::Fails,
            Some(e.clone()),
        ),
    };
    let mut out = vec![Case {
        interaction: Interaction::Wire(Wire::Handshake),
        direction: Direction::VllmToPdkv,
        class,
        verdict,
        detail,
    }];
    let vllm = vllm.ok();
    for m in &sent.messages {
        let found: Vec<&Delivery> = answers.messages.iter().filter(|d| d.id == m.id).collect();
        let (verdict, detail) = match found.as_slice() {
            [d] if d.name == m.name() && d.socket == m.socket.name() => judge(sent, m, d, vllm),
            [d] => fails(format!("{}: the harness answered for {} to {}", at(m), d.name, d.socket)),
            _ => fails(format!("{}: the harness answered {} time(s)", at(m), found.len())),
        };
        out.push(Case {
            interaction: Interaction::Wire(Wire::EveryMessage),
            direction: Direction::PdkvToVllm,
            class: message_class(m),
            verdict,
            detail,
        });
    }
    for d in &answers.messages {
        if !sent.messages.iter().any(|m| m.id == d.id) {
            out.push(Case {
                interaction: Interaction::Wire(Wire::EveryMessage),
                direction: Direction::PdkvToVllm,
                class: "unknown message".into(),
                verdict: Verdict::Fails,
                detail: Some(format!(
                    "the harness answered for message {} ({}), which xtask did not send",
                    d.id, d.name
                )),
            });
        }
    }
    out
}

/// The matrix row of a message: the capability set, and where the message comes from.
pub fn message_class(m: &Message) -> String {
    let origin = match m.origin {
        Origin::DecodeNode => "decode node's messages",
        Origin::EveryVariant => "every variant",
    };
    format!("advertises {}: {origin}", messages::set_name(m.capabilities))
}

fn at(m: &Message) -> String {
    format!(
        "{} to the {} listener of a rank advertising {} ({}{})",
        m.name(),
        m.socket.name(),
        messages::set_name(m.capabilities),
        m.origin.name(),
        if m.emitted { ", sent by pdkv's decode node" } else { ", never sent by pdkv's decode node" }
    )
}

fn judge(sent: &Messages, m: &Message, d: &Delivery, vllm: Option<Extensions>) -> Outcome {
    if !d.delivered {
        return fails(format!("{}: not delivered: {}", at(m), d.did));
    }
    if d.alive {
        // vLLM must count what pdkv's ledger counts as a release, as the same ack.
        if let Some(release) = m.message.as_release() {
            let want = (release.transfer_id.to_string(), i64::from(release.consumer_tp_size.unwrap_or(1)));
            if d.acks != [want.clone()] {
                return fails(format!("{}: vLLM counted {:?}, pdkv's ledger counts {want:?}", at(m), d.acks));
            }
        }
        return (Verdict::Works, None);
    }
    // The listener ended. Only a message the node sends, to a rank advertising what vLLM does
    // (or anything, when vLLM's metadata could not be read), is pdkv's fault.
    if m.emitted && vllm.is_none_or(|set| set == m.capabilities) {
        let why = d.error.as_deref().unwrap_or("no exception recorded");
        return fails(format!("{}: vLLM's listener ended ({why})", at(m)));
    }
    if m.emitted || sent.emitted_under_some_set(m.name(), m.socket) {
        (Verdict::Documented(Documented::AdvertisedOnly), None)
    } else {
        (Verdict::Documented(Documented::NeverSent), None)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::moriio::answers::AckRank;

    fn combo(decode: [u16; 2], prefill: [u16; 2], mla: bool, reads: Vec<(u16, bool, Vec<u32>)>) -> Combo {
        Combo {
            decode,
            prefill,
            mla,
            backend: "rdma".into(),
            owner: 0,
            ranks: vec![DecodeRank {
                dp: 0,
                tp: 0,
                reads,
                payloads: vec![
                    serde_json::json!({"type": "release", "transfer_id": TRANSFER_ID, "consumer_tp_size": decode[1]}),
                ],
                error: None,
            }],
            acks: vec![],
        }
    }

    #[test]
    fn identical_reads_work_and_a_wrong_rank_fails_with_both_answers() {
        // D TP2 rank 0 reads P TP4 rank 0; vLLM also releases rank 1 (a holder it did not read).
        let c = combo([1, 2], [1, 4], false, vec![(0, false, vec![61005, 61006]); 2]);
        let cases = source_and_release(&c, PeerRules::Vllm033);
        assert_eq!(cases[0].verdict, Verdict::Works);
        assert_eq!(cases[1].verdict, Verdict::Documented(Documented::UnreadHolders));
        let c = combo([1, 2], [1, 4], false, vec![(1, false, vec![61006])]);
        let cases = source_and_release(&c, PeerRules::Vllm033);
        assert_eq!(cases[0].verdict, Verdict::Fails);
        let detail = cases[0].detail.as_deref().unwrap();
        assert!(
            detail.contains("vLLM reads (dp 0, tp 1)") && detail.contains("pdkv reads (dp 0, tp 0)"),
            "{detail}"
        );
        assert_eq!(cases[1].verdict, Verdict::Fails, "{:?}", cases[1].detail);
    }

    #[test]
    fn unread_holder_acks_are_the_documented_difference() {
        let mut c = combo([1, 2], [1, 4], false, vec![]);
        let done = |received, reported: Vec<u32>| AckRank { tp: 0, received, reported };
        let mut ranks: Vec<AckRank> = (0..4).map(|_| done(1, vec![1])).collect();
        for (tp, r) in ranks.iter_mut().enumerate() {
            r.tp = tp as u16;
        }
        c.acks = vec![AckGroup { group: 0, expected: Some(1), ranks }];
        let verdicts: Vec<Verdict> =
            acks(&c, &c.acks[0], PeerRules::Vllm033).into_iter().map(|case| case.verdict).collect();
        let u = Verdict::Documented(Documented::UnreadHolders);
        assert_eq!(verdicts, [Verdict::Works, u.clone(), Verdict::Works, u]);
    }

    /// (rules, what vLLM's unread holder got) -> verdict: before 0.33 an unread holder that got
    /// nothing and never completed is the documented reaper wait; under 0.33's rules, where vLLM
    /// releases every holder, the same answer is a failure.
    #[test]
    fn unread_holders_left_to_the_reaper_are_documented_only_before_0_33() {
        let check = |rules: PeerRules, unread: (u32, Vec<u32>), expected: Verdict| {
            let mut c = combo([1, 2], [1, 4], false, vec![]);
            let ranks = (0..4u16)
                .map(|tp| {
                    let (received, reported) = if tp % 2 == 0 { (1, vec![1]) } else { unread.clone() };
                    AckRank { tp, received, reported }
                })
                .collect();
            c.acks = vec![AckGroup { group: 0, expected: Some(1), ranks }];
            let verdicts: Vec<Verdict> =
                acks(&c, &c.acks[0], rules).into_iter().map(|case| case.verdict).collect();
            assert_eq!(verdicts, [Verdict::Works, expected.clone(), Verdict::Works, expected], "{rules}");
        };
        let reaped = Verdict::Documented(Documented::UnreadHoldersReaped);
        for old in [PeerRules::Vllm027, PeerRules::Vllm028, PeerRules::Vllm030] {
            check(old, (0, vec![]), reaped.clone());
            check(old, (1, vec![1]), Verdict::Documented(Documented::UnreadHolders));
        }
        check(PeerRules::Vllm033, (0, vec![]), Verdict::Fails);
    }

    #[test]
    fn listener_ports_differ_only_where_dp_and_tp_are_both_above_one() {
        let rank = |dp, tp, listen: u32, dial: u32| super::super::answers::PortRank {
            dp,
            tp,
            handshake_listen: 6301 + listen,
            notify_listen: 61005 + listen,
            handshake_dial: 6301 + dial,
            release_dial: Some(61005 + dial),
        };
        let p = PortLayout { prefill: [2, 2], ranks: vec![rank(0, 1, 1, 1), rank(1, 1, 2, 3)] };
        let verdicts: Vec<Verdict> = ports(&p, PeerRules::Vllm033).into_iter().map(|c| c.verdict).collect();
        let d = Verdict::Documented(Documented::ListenerOffset);
        let w = Verdict::Works;
        // Per rank: pdkv's listeners, dials, then the vllm-0.33 rule set's listeners.
        assert_eq!(verdicts[..6], [w.clone(), w.clone(), w.clone(), w.clone(), w.clone(), w.clone()]);
        assert_eq!(verdicts[6..], [d.clone(), d, w.clone(), w.clone(), w.clone(), w]);
        let wrong = PortLayout { prefill: [2, 2], ranks: vec![rank(1, 1, 4, 2)] };
        assert!(ports(&wrong, PeerRules::Vllm033).iter().all(|c| c.verdict == Verdict::Fails));
    }

    /// Answers whose every delivery says what `fate` gives, and whose metadata is the reply of a
    /// listener advertising `vllm` (vLLM's, when it is `NONE`: no `pdkv_extensions` key).
    fn answers(
        sent: &Messages,
        vllm: Extensions,
        fate: impl Fn(&Message) -> (bool, Vec<(String, i64)>),
    ) -> Answers {
        let metadata = pdkv_core::wire::HandshakeMetadata {
            engine_id: "127.0.0.1:6301".into(),
            agent_metadata: vec![0x92],
            kv_caches_base_addr: vec![1 << 30],
            num_blocks: 128,
            block_len: 36864,
            attn_backend_name: "ROCM_AITER_MLA".into(),
            rank: None,
            extensions: vllm,
            incarnation: None,
        };
        let layers = vec![pdkv_core::wire::LayerMemoryDesc { layer_name: "l0".into(), descs: vec![vec![1]] }];
        let reply = wire::handshake_reply(&metadata, &layers);
        let frames = reply.iter().map(|m| m.iter().map(|f| messages::hex(f)).collect()).collect();
        Answers {
            vllm_version: "0.33.0".into(),
            python: "3.11.7".into(),
            max_ranks: 1,
            modules: Default::default(),
            ports: vec![],
            expected_acks: vec![],
            heads: vec![],
            writes: crate::moriio::answers::Writes { module: None, shapes: vec![] },
            combos: vec![],
            wire: vec![],
            messages: sent
                .messages
                .iter()
                .map(|m| {
                    let (alive, acks) = fate(m);
                    Delivery {
                        id: m.id,
                        name: m.name().into(),
                        socket: m.socket.name().into(),
                        delivered: true,
                        alive,
                        error: (!alive).then(|| "HandshakeError: Error processing message".into()),
                        acks,
                        did: String::new(),
                    }
                })
                .collect(),
            vllm_metadata: VllmMetadata { frames, error: None },
        }
    }

    /// What vLLM 0.33 does: a read lease, write_done, write_failed or metadata on the notify socket ends the
    /// listener, anything but get_meta_msg ends the handshake listener; releases are counted.
    fn vllm_033(m: &Message) -> (bool, Vec<(String, i64)>) {
        let alive = match m.socket {
            messages::Socket::Handshake => m.message == ControlMessage::HandshakeRequest,
            messages::Socket::Notify => {
                !matches!(m.name(), "read_lease" | "write_done" | "write_failed" | "handshake_metadata")
            }
        };
        let acks = match m.message.as_release() {
            Some(r) if alive => vec![(r.transfer_id.to_string(), i64::from(r.consumer_tp_size.unwrap_or(1)))],
            _ if alive
                && m.message == ControlMessage::HandshakeRequest
                && m.socket == messages::Socket::Notify =>
            {
                vec![("get_meta_msg".into(), 1)]
            }
            _ => vec![],
        };
        (alive, acks)
    }

    fn verdicts(cases: &[Case], class: &str) -> Vec<Verdict> {
        cases.iter().filter(|c| c.class == class).map(|c| c.verdict.clone()).collect()
    }

    /// The checker catches its bug: a pdkv that sent read leases to a rank advertising nothing
    /// (the gate of decode::lease switched off, `--pretend-ungated-leases`) reads "fails" in the
    /// rows of `{}`, while today's pdkv, against the same vLLM behaviour, fails nowhere.
    #[test]
    fn a_lease_to_a_rank_that_advertised_nothing_fails() {
        let gated = messages::build(false).unwrap();
        let cases = message_cases(&gated, &answers(&gated, Extensions::NONE, vllm_033));
        assert!(cases.iter().all(|c| c.verdict != Verdict::Fails), "{cases:?}");
        assert_eq!(cases[0].class, "vLLM's metadata answer, pdkv's framing and decoder: advertises {}");
        let node = verdicts(&cases, "advertises {}: decode node's messages");
        assert_eq!(node, [Verdict::Works, Verdict::Works]);
        let node = verdicts(&cases, "advertises {read_lease}: decode node's messages");
        assert!(node.contains(&Verdict::Documented(Documented::AdvertisedOnly)), "{node:?}");

        let ungated = messages::build(true).unwrap();
        let cases = message_cases(&ungated, &answers(&ungated, Extensions::NONE, vllm_033));
        let failed: Vec<&str> = cases
            .iter()
            .filter(|c| c.verdict == Verdict::Fails)
            .map(|c| c.detail.as_deref().unwrap_or_default())
            .collect();
        assert_eq!(failed.len(), 2, "{failed:?}");
        assert!(failed
            .iter()
            .all(|d| d.starts_with("read_lease to the notify listener of a rank advertising {}")));
        assert!(verdicts(&cases, "advertises {}: decode node's messages").contains(&Verdict::Fails));
    }

    /// A release vLLM does not count as pdkv's ledger does fails; so does a listener that ends on
    /// a message pdkv sends, and a message the harness did not answer for.
    #[test]
    fn an_uncounted_release_an_ended_listener_and_a_missing_answer_fail() {
        let sent = messages::build(false).unwrap();
        let wrong_ack = answers(&sent, Extensions::NONE, |m| {
            let (alive, acks) = vllm_033(m);
            (alive, acks.into_iter().map(|(t, _)| (t, 2)).collect())
        });
        let cases = message_cases(&sent, &wrong_ack);
        let detail = cases
            .iter()
            .find(|c| c.verdict == Verdict::Fails)
            .and_then(|c| c.detail.clone())
            .unwrap_or_default();
        assert!(detail.contains("vLLM counted") && detail.contains("pdkv's ledger counts"), "{detail}");

        let release_ends = answers(&sent, Extensions::NONE, |m| {
            if m.name() == "release" {
                (false, vec![])
            } else {
                vllm_033(m)
            }
        });
        let cases = message_cases(&sent, &release_ends);
        assert_eq!(
            verdicts(&cases, "advertises {}: decode node's messages"),
            [Verdict::Works, Verdict::Fails]
        );

        let mut missing = answers(&sent, Extensions::NONE, vllm_033);
        missing.messages.remove(0);
        let cases = message_cases(&sent, &missing);
        assert_eq!(cases.iter().filter(|c| c.verdict == Verdict::Fails).count(), 1);
    }

    /// Without vLLM's metadata the advertised set is unknown, so a listener ended by any
    /// message the node sends is a failure, and the metadata row fails.
    #[test]
    fn unreadable_vllm_metadata_fails_and_judges_every_sent_message_strictly() {
        let sent = messages::build(false).unwrap();
        let mut a = answers(&sent, Extensions::NONE, vllm_033);
        a.vllm_metadata.frames[0][0] = "00".into();
        let cases = message_cases(&sent, &a);
        assert_eq!(cases[0].verdict, Verdict::Fails);
        assert!(cases[0].detail.as_deref().unwrap_or_default().contains("delimiter"), "{:?}", cases[0]);
        assert!(verdicts(&cases, "advertises {read_lease}: decode node's messages").contains(&Verdict::Fails));
        let a = answers(&sent, Extensions::ALL, vllm_033);
        assert_eq!(vllm_extensions(&a.vllm_metadata), Ok(Extensions::ALL));
    }
    /// The WRITE mapping checker catches a pdkv that wrote MLA's latent from another holder than
    /// vLLM's first one (pdkv's spread rule put in vLLM's place), on vLLM 0.34.0's own answer for
    /// TP8 into TP1 as the harness records it.
    #[test]
    fn a_mapping_that_writes_from_another_holder_fails() {
        use crate::moriio::answers::WriteRankAnswer;
        let mut ranks = vec![WriteRankAnswer {
            local_heads: 1,
            remote_heads: 1,
            targets: vec![[0, 0, 0, 1, 0, 1, 0, 8, 1]],
        }];
        ranks.extend((1..8).map(|_| WriteRankAnswer { local_heads: 1, remote_heads: 1, targets: vec![] }));
        let answer = WriteAnswer {
            prefill_tp: 8,
            decode_tp: 1,
            kv_heads: 1,
            mla: true,
            mamba: false,
            ranks: Some(ranks),
            error: None,
        };
        assert_eq!(write_mapping(&answer, WriteRule::FirstHolder).verdict, Verdict::Works);
        let spread = write_mapping(&answer, WriteRule::SpreadHolders);
        assert_eq!(spread.verdict, Verdict::Fails);
        assert!(spread.detail.unwrap().starts_with("P TP8 -> D TP1, 1 KV heads, mla=true"));
        // What a vLLM decode rank sees is the same under both: the spread row works.
        assert_eq!(write_spread(&answer).verdict, Verdict::Works);
    }
    /// The port rows take 0.25's DP-rank-0 dials and missing releases above DP rank 0 only under
    /// a rule set that reads DP rank 0: the same answers under vllm-0.27's rules fail.
    #[test]
    fn dp0_dials_are_documented_only_for_the_releases_that_read_dp0() {
        use crate::moriio::answers::PortRank;
        // vLLM 0.25.0's answer for DP2 x TP2, rank (1, 0), as the harness records it.
        let layout = PortLayout {
            prefill: [2, 2],
            ranks: vec![PortRank {
                dp: 1,
                tp: 0,
                handshake_listen: 6302,
                notify_listen: 61006,
                handshake_dial: 6302,
                release_dial: None,
            }],
        };
        let verdicts = |rules| ports(&layout, rules).into_iter().map(|c| c.verdict).collect::<Vec<_>>();
        let old = verdicts(PeerRules::Vllm025);
        assert!(!old.contains(&Verdict::Fails), "{old:?}");
        assert_eq!(old.iter().filter(|v| **v == Verdict::Documented(Documented::ReadsDp0)).count(), 2);
        assert!(verdicts(PeerRules::Vllm027).contains(&Verdict::Fails));
    }
}
