//! Listener and dial ports per rank, engine ids and session keys (MoRIIO's arithmetic).
//!
//! A rank (dp, tp) of an engine whose TP size is T listens at `base + dp * T + tp`, one base for
//! handshakes and one for notifications (releases). Every address a decode worker uses for a
//! read is derived from one chosen source rank by [`ReadTarget::derive`], so the session, the
//! handshake dial and the release target cannot drift apart.
//!
//! Dialers use `dp * T + tp` under both [`PeerRules`]; an engine following vLLM 0.33's rules
//! binds its listeners at `dp + tp`, as vLLM 0.33 does, so the [`AddressBook`] carries the rules
//! of each engine and [`AddressBook::listen_endpoint`] applies them.

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::ids::{EngineId, RankId, Role};
use crate::policy::{ListenerOffset, PeerBook, PeerRules, Policy, SessionKeyRule};
use crate::topology::{Deployment, Layout};

/// MoRIIO's default base of the handshake listeners.
pub const DEFAULT_HANDSHAKE_PORT_BASE: u16 = 6301;
/// MoRIIO's default base of the notify listeners.
pub const DEFAULT_NOTIFY_PORT_BASE: u16 = 61005;

/// The two listeners every rank runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum ListenerKind {
    /// Answers `get_meta_msg` with the rank's engine metadata; based at the handshake port.
    Handshake,
    /// Receives releases (and WRITE-mode notices) for the rank; based at the notify port.
    Notify,
}

impl fmt::Display for ListenerKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ListenerKind::Handshake => "handshake",
            ListenerKind::Notify => "notify",
        })
    }
}

/// A host and port; the core never resolves or connects it.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct Endpoint {
    /// Host name or address, as configured or registered.
    pub host: String,
    /// TCP port: the listener's base plus the rank's offset.
    pub port: u16,
}

impl fmt::Display for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.host, self.port)
    }
}

/// Where one engine's ranks listen: a host and the two port bases.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, Hash)]
pub struct EngineAddress {
    /// Host every rank of the engine listens on; also the first half of its engine id.
    pub host: String,
    /// Handshake port of rank (0, 0); rank (dp, tp) listens at this plus `dp * tp_size + tp`.
    /// The second half of the engine id.
    pub handshake_port_base: u16,
    /// Notify port of rank (0, 0), offset per rank like the handshake base.
    pub notify_port_base: u16,
}

/// A port that does not fit in 16 bits: the layout is too large for its base.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct PortError {
    /// The rank whose port does not fit.
    pub rank: RankId,
    /// Which of the rank's listeners.
    pub kind: ListenerKind,
    /// The engine's port base for that listener.
    pub base: u16,
    /// The rank's offset from the base (the fixed form, or the legacy one for a listener).
    pub offset: u32,
}

impl fmt::Display for PortError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} port of {} would be {} + {} = {}, above 65535; choose a lower port base",
            self.kind,
            self.rank,
            self.base,
            self.offset,
            u32::from(self.base) + self.offset
        )
    }
}

impl std::error::Error for PortError {}

/// The offset every dialer uses and pdkv's listeners bind: `dp * tp_size + tp`, with the TP size
/// of the engine dialled. vLLM 0.33's READ-mode dialers use it too: `_moriio_handshake` and the
/// releases of `_read_blocks` pass the remote TP size to `get_port_offset`.
pub fn port_offset(layout: Layout, dp: u16, tp: u16) -> u32 {
    layout.flat_index(dp, tp)
}

/// The listener offset under `rule`: the dialers' offset, or vLLM 0.33's `dp + tp`.
pub fn listener_offset(layout: Layout, dp: u16, tp: u16, rule: ListenerOffset) -> u32 {
    match rule {
        ListenerOffset::DpTimesTpSizePlusTp => port_offset(layout, dp, tp),
        ListenerOffset::DpPlusTp => u32::from(dp) + u32::from(tp),
    }
}

/// The name a session with a remote rank is stored under.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct SessionKey(pub String);

impl fmt::Display for SessionKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Host and port bases of every engine in a deployment, and the rules each one follows.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct AddressBook {
    /// Address of each prefill engine, indexed by engine index.
    pub prefill: Vec<EngineAddress>,
    /// Address of each decode engine, indexed by engine index.
    pub decode: Vec<EngineAddress>,
    /// The rules of each engine: where its listeners bind, and what its peers release to it
    /// (pdkv's for every engine unless named).
    #[serde(default)]
    pub rules: PeerBook,
}

impl AddressBook {
    /// One host per engine (`prefill-0`, `decode-0`, ...) with MoRIIO's default bases, as in a
    /// deployment where every engine has its own node.
    pub fn one_host_per_engine(deployment: &Deployment) -> AddressBook {
        let side = |role: Role, prefix: &str| {
            (0..deployment.engines(role).len())
                .map(|i| EngineAddress {
                    host: format!("{prefix}-{i}"),
                    handshake_port_base: DEFAULT_HANDSHAKE_PORT_BASE,
                    notify_port_base: DEFAULT_NOTIFY_PORT_BASE,
                })
                .collect()
        };
        AddressBook {
            prefill: side(Role::Prefill, "prefill"),
            decode: side(Role::Decode, "decode"),
            rules: PeerBook::pdkv(),
        }
    }

    /// This book with the engines following the rules `rules` names.
    pub fn with_rules(mut self, rules: PeerBook) -> AddressBook {
        self.rules = rules;
        self
    }

    /// The rules `engine` follows.
    pub fn rules_of(&self, engine: EngineId) -> PeerRules {
        self.rules.rules(engine)
    }

    /// The address of `engine`. Panics if the book has no such engine.
    pub fn engine(&self, engine: EngineId) -> &EngineAddress {
        let side = match engine.role {
            Role::Prefill => &self.prefill,
            Role::Decode => &self.decode,
        };
        &side[usize::from(engine.index)]
    }

    /// MoRIIO's engine id: `"<host>:<handshake port base>"`.
    pub fn engine_id(&self, engine: EngineId) -> String {
        self.engine(engine).engine_id()
    }

    /// Where `rank` binds its listener of `kind`: `base + dp * tp_size + tp`, or `base + dp + tp`
    /// under [`ListenerOffset::DpPlusTp`], which its engine's rules ([`PeerRules::Vllm033`]) or
    /// the policy's legacy option pick. Errors if the port would pass 65535.
    pub fn listen_endpoint(
        &self,
        deployment: &Deployment,
        rank: RankId,
        kind: ListenerKind,
        policy: &Policy,
    ) -> Result<Endpoint, PortError> {
        let policy = policy.under(self.rules_of(rank.engine));
        self.engine(rank.engine).listen(deployment.layout(rank.engine), rank, kind, &policy)
    }

    /// Where a peer dials to reach `rank`'s listener of `kind`: always `base + dp * tp_size + tp`,
    /// whatever the legacy options and under both rule sets. Errors if the port would pass 65535.
    pub fn dial_endpoint(
        &self,
        deployment: &Deployment,
        rank: RankId,
        kind: ListenerKind,
    ) -> Result<Endpoint, PortError> {
        self.engine(rank.engine).dial(deployment.layout(rank.engine), rank, kind)
    }

    /// Session key of a remote rank: `<engine id>_dp<d>_tp<t>`, or the legacy `<engine id>_dp<d>`.
    pub fn session_key(&self, rank: RankId, rule: SessionKeyRule) -> SessionKey {
        self.engine(rank.engine).session_key(rank, rule)
    }
}

impl EngineAddress {
    /// MoRIIO's engine id: `"<host>:<handshake port base>"`.
    pub fn engine_id(&self) -> String {
        format!("{}:{}", self.host, self.handshake_port_base)
    }

    fn endpoint(&self, rank: RankId, kind: ListenerKind, offset: u32) -> Result<Endpoint, PortError> {
        let base = match kind {
            ListenerKind::Handshake => self.handshake_port_base,
            ListenerKind::Notify => self.notify_port_base,
        };
        let port =
            u16::try_from(u32::from(base) + offset).map_err(|_| PortError { rank, kind, base, offset })?;
        Ok(Endpoint { host: self.host.clone(), port })
    }

    /// Where `rank` (of this engine, whose layout is `layout`) binds its listener of `kind`.
    pub fn listen(
        &self,
        layout: Layout,
        rank: RankId,
        kind: ListenerKind,
        policy: &Policy,
    ) -> Result<Endpoint, PortError> {
        self.endpoint(rank, kind, listener_offset(layout, rank.dp, rank.tp, policy.listener_offset))
    }

    /// Where a peer dials `rank`'s listener of `kind` (always the fixed offset).
    pub fn dial(&self, layout: Layout, rank: RankId, kind: ListenerKind) -> Result<Endpoint, PortError> {
        self.endpoint(rank, kind, port_offset(layout, rank.dp, rank.tp))
    }

    /// Session key of `rank` of this engine: `<engine id>_dp<d>_tp<t>`, or the legacy
    /// `<engine id>_dp<d>` under [`SessionKeyRule::PerDpRank`].
    pub fn session_key(&self, rank: RankId, rule: SessionKeyRule) -> SessionKey {
        let engine = self.engine_id();
        match rule {
            SessionKeyRule::PerRank => SessionKey(format!("{engine}_dp{}_tp{}", rank.dp, rank.tp)),
            SessionKeyRule::PerDpRank => SessionKey(format!("{engine}_dp{}", rank.dp)),
        }
    }
}

/// Everything a decode worker addresses for one read, derived from one source rank.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, Hash)]
pub struct ReadTarget {
    /// The prefill rank read; every other field is derived from it.
    pub source: RankId,
    /// Key of the session with `source`, whose memory descriptors the read uses.
    pub session: SessionKey,
    /// Where to dial `source`'s handshake listener.
    pub handshake: Endpoint,
    /// Where to send the release once the read is done (or failed).
    pub notify: Endpoint,
}

impl ReadTarget {
    /// Derives the session key and the handshake and notify endpoints from `source` alone.
    /// Errors if a port would pass 65535; panics if `source`'s engine is missing from `book` or
    /// `deployment`.
    pub fn derive(
        book: &AddressBook,
        deployment: &Deployment,
        source: RankId,
        session_key: SessionKeyRule,
    ) -> Result<ReadTarget, PortError> {
        ReadTarget::for_engine(
            book.engine(source.engine),
            deployment.layout(source.engine),
            source,
            session_key,
        )
    }

    /// The same derivation from the source engine's address and layout alone, as a decode
    /// worker knows them from a request's parameters.
    pub fn for_engine(
        address: &EngineAddress,
        layout: Layout,
        source: RankId,
        session_key: SessionKeyRule,
    ) -> Result<ReadTarget, PortError> {
        Ok(ReadTarget {
            source,
            session: address.session_key(source, session_key),
            handshake: address.dial(layout, source, ListenerKind::Handshake)?,
            notify: address.dial(layout, source, ListenerKind::Notify)?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::legacy::{Legacy, LegacyOptions};

    fn deployment(notation: &str) -> Deployment {
        Deployment::parse(notation).unwrap()
    }

    fn prefill(engine: u16, dp: u16, tp: u16) -> RankId {
        RankId::new(EngineId::prefill(engine), dp, tp)
    }

    /// (notation, rank, handshake port, notify port) for the fixed listener and the dialer.
    #[test]
    fn ports_use_dp_times_tp_size_plus_tp() {
        let check = |notation: &str, rank: RankId, handshake: u16, notify: u16| {
            let d = deployment(notation);
            let book = AddressBook::one_host_per_engine(&d);
            let none = Policy::fixed();
            for (kind, port) in [(ListenerKind::Handshake, handshake), (ListenerKind::Notify, notify)] {
                let listen = book.listen_endpoint(&d, rank, kind, &none).unwrap();
                let dial = book.dial_endpoint(&d, rank, kind).unwrap();
                assert_eq!((listen.port, dial.port), (port, port), "{notation} {rank} {kind}");
            }
        };
        check("1P_TP8:1D_TP8", prefill(0, 0, 0), 6301, 61005);
        check("1P_TP8:1D_TP8", prefill(0, 0, 7), 6308, 61012);
        check("1P_DP8:1D_TP8", prefill(0, 5, 0), 6306, 61010);
        check("1P_DP4TP16:1D_TP8", prefill(0, 2, 3), 6301 + 35, 61005 + 35);
        check("1P_DP4TP2:1D_TP8", prefill(0, 3, 1), 6308, 61012);
    }

    #[test]
    fn engine_ids_and_session_keys_name_engine_dp_and_tp() {
        let d = deployment("2P_DP2TP2:1D_TP4");
        let book = AddressBook::one_host_per_engine(&d);
        assert_eq!(book.engine_id(EngineId::prefill(1)), "prefill-1:6301");
        assert_eq!(book.engine_id(EngineId::decode(0)), "decode-0:6301");
        let key = book.session_key(prefill(1, 1, 0), SessionKeyRule::PerRank);
        assert_eq!(key.0, "prefill-1:6301_dp1_tp0");
        let legacy = Policy::from(LegacyOptions::none().with(Legacy::SessionKeyWithoutTp));
        assert_eq!(book.session_key(prefill(1, 1, 0), legacy.session_key).0, "prefill-1:6301_dp1");
    }

    /// Every (engine, dp, tp) gets its own session key and its own listener ports by default.
    #[test]
    fn default_keys_and_ports_are_distinct_per_rank() {
        let d = deployment("2P_DP4TP2:1D_DP2TP4");
        let book = AddressBook::one_host_per_engine(&d);
        let none = Policy::fixed();
        let ranks = d.ranks(Role::Prefill);
        let keys: std::collections::BTreeSet<_> =
            ranks.iter().map(|r| book.session_key(*r, none.session_key)).collect();
        assert_eq!(keys.len(), ranks.len());
        let ports: std::collections::BTreeSet<_> = ranks
            .iter()
            .map(|r| book.listen_endpoint(&d, *r, ListenerKind::Notify, &none).unwrap())
            .collect();
        assert_eq!(ports.len(), ranks.len());
    }

    /// Legacy `dp + tp`: with DP2×TP2, ranks (0,1) and (1,0) bind the same port, and the dial
    /// for (1,1) at offset 3 reaches no listener.
    #[test]
    fn legacy_listener_offset_collides_and_strands_dials() {
        let d = deployment("1P_DP2TP2:1D_TP2");
        let book = AddressBook::one_host_per_engine(&d);
        let legacy = Policy::from(LegacyOptions::none().with(Legacy::ListenerOffsetDpPlusTp));
        let listen = |dp, tp| {
            book.listen_endpoint(&d, prefill(0, dp, tp), ListenerKind::Notify, &legacy).unwrap().port
        };
        assert_eq!(listen(0, 1), listen(1, 0));
        let listening: Vec<u16> = vec![listen(0, 0), listen(0, 1), listen(1, 0), listen(1, 1)];
        assert_eq!(listening, [61005, 61006, 61006, 61007]);
        let dial = book.dial_endpoint(&d, prefill(0, 1, 1), ListenerKind::Notify).unwrap();
        assert_eq!(dial.port, 61008);
        assert!(!listening.contains(&dial.port));
        // With DP = 1 or TP = 1 the two forms agree, which is why the bug hid for so long.
        for notation in ["1P_TP8:1D_TP8", "1P_DP8:1D_TP8"] {
            let d = deployment(notation);
            let book = AddressBook::one_host_per_engine(&d);
            for rank in d.ranks(Role::Prefill) {
                let a = book.listen_endpoint(&d, rank, ListenerKind::Notify, &legacy).unwrap();
                assert_eq!(a, book.dial_endpoint(&d, rank, ListenerKind::Notify).unwrap());
            }
        }
    }

    /// Which rank a dial of each rank's notify port reaches, in rank order, when every rank
    /// binds in rank order and a port taken already fails to bind (EADDRINUSE), as the
    /// simulator binds them.
    fn reached(book: &AddressBook, d: &Deployment) -> Vec<Option<RankId>> {
        let mut bound = std::collections::BTreeMap::new();
        for rank in d.ranks(Role::Prefill) {
            let port = book.listen_endpoint(d, rank, ListenerKind::Notify, &Policy::fixed()).unwrap().port;
            bound.entry(port).or_insert(rank);
        }
        d.ranks(Role::Prefill)
            .into_iter()
            .map(|rank| bound.get(&book.dial_endpoint(d, rank, ListenerKind::Notify).unwrap().port).copied())
            .collect()
    }

    /// (notation, rules of P0) -> listener and dial offsets of every prefill rank in rank order,
    /// and the rank each dial reaches (`(dp, tp)`, `None` for no listener). The vLLM 0.33 numbers
    /// are `get_port_offset(dp, tp)` for the listeners (`MoRIIOConfig.from_vllm_config`,
    /// `side_channel_port`) and `get_port_offset(dp, tp, remote_tp_size)` for the dialers
    /// (`_moriio_handshake`, `_read_blocks`), computed by running vLLM 0.33.0's functions.
    #[test]
    fn listener_and_dial_offsets_under_both_rule_sets() {
        type Reach = Option<(u16, u16)>;
        let check = |notation: &str, rules: PeerRules, listen: &[u32], dial: &[u32], reach: &[Reach]| {
            let d = deployment(notation);
            let book = AddressBook::one_host_per_engine(&d)
                .with_rules(PeerBook::pdkv().with(EngineId::prefill(0), rules));
            let offsets = |port: fn(&AddressBook, &Deployment, RankId) -> u16| -> Vec<u32> {
                d.ranks(Role::Prefill).into_iter().map(|r| u32::from(port(&book, &d, r) - 61005)).collect()
            };
            let listened = offsets(|b, d, r| {
                b.listen_endpoint(d, r, ListenerKind::Notify, &Policy::fixed()).unwrap().port
            });
            let dialled = offsets(|b, d, r| b.dial_endpoint(d, r, ListenerKind::Notify).unwrap().port);
            let reached: Vec<Reach> =
                reached(&book, &d).into_iter().map(|r| r.map(|r| (r.dp, r.tp))).collect();
            assert_eq!((listened.as_slice(), dialled.as_slice()), (listen, dial), "{notation} {rules}");
            assert_eq!(reached, reach, "{notation} {rules}");
            // The handshake listener follows the same offsets from its own base.
            for (rank, offset) in d.ranks(Role::Prefill).into_iter().zip(listen) {
                let port =
                    book.listen_endpoint(&d, rank, ListenerKind::Handshake, &Policy::fixed()).unwrap().port;
                assert_eq!(u32::from(port), 6301 + offset, "{notation} {rules} {rank}");
            }
        };
        let own = |dp: u16, tp: u16| -> Vec<Reach> {
            (0..dp).flat_map(|d| (0..tp).map(move |t| Some((d, t)))).collect()
        };
        let seq = |n: u32| -> Vec<u32> { (0..n).collect() };
        use PeerRules::{Pdkv, Vllm033};
        // One DP rank or TP size 1: the two formulas agree, which is why the bug hid so long.
        for rules in [Pdkv, Vllm033] {
            check("1P_TP8:1D_TP8", rules, &seq(8), &seq(8), &own(1, 8));
            check("1P_DP8:1D_TP8", rules, &seq(8), &seq(8), &own(8, 1));
            check("1P_DP8EP:1D_TP8", rules, &seq(8), &seq(8), &own(8, 1));
        }
        for (notation, dp, tp) in
            [("1P_DP2TP2:1D_TP2", 2, 2), ("1P_DP2TP4:1D_TP4", 2, 4), ("1P_DP4TP2:1D_TP2", 4, 2)]
        {
            check(notation, Pdkv, &seq(u32::from(dp * tp)), &seq(u32::from(dp * tp)), &own(dp, tp));
        }
        check(
            "1P_DP2TP2:1D_TP2",
            Vllm033,
            &[0, 1, 1, 2],
            &seq(4),
            &[Some((0, 0)), Some((0, 1)), Some((1, 1)), None],
        );
        check(
            "1P_DP2TP4:1D_TP4",
            Vllm033,
            &[0, 1, 2, 3, 1, 2, 3, 4],
            &seq(8),
            &[Some((0, 0)), Some((0, 1)), Some((0, 2)), Some((0, 3)), Some((1, 3)), None, None, None],
        );
        // DP4xTP2: a dial for DP rank 1 reaches DP rank 2's listener, one for DP rank 2 DP rank 3's.
        check(
            "1P_DP4TP2:1D_TP2",
            Vllm033,
            &[0, 1, 1, 2, 2, 3, 3, 4],
            &seq(8),
            &[Some((0, 0)), Some((0, 1)), Some((1, 1)), Some((2, 1)), Some((3, 1)), None, None, None],
        );
        let mut dp2tp8 = own(1, 8);
        dp2tp8.push(Some((1, 7)));
        dp2tp8.extend([None; 7]);
        let listen: Vec<u32> = (0..8).chain(1..9).collect();
        check("1P_DP2TP8:1D_TP8", Vllm033, &listen, &seq(16), &dp2tp8);
    }

    /// Rules are per engine: a vLLM 0.33 engine binds `dp + tp`, its pdkv neighbour on the same
    /// deployment `dp * T + tp`; dial ports are the same under both.
    #[test]
    fn rules_are_per_engine() {
        let d = deployment("2P_DP2TP2:1D_TP2");
        let book = AddressBook::one_host_per_engine(&d)
            .with_rules(PeerBook::pdkv().with(EngineId::prefill(1), PeerRules::Vllm033));
        let listen = |engine| {
            let rank = prefill(engine, 1, 1);
            book.listen_endpoint(&d, rank, ListenerKind::Notify, &Policy::fixed()).unwrap().port
        };
        assert_eq!((listen(0), listen(1)), (61005 + 3, 61005 + 2));
        let dial = |engine| book.dial_endpoint(&d, prefill(engine, 1, 1), ListenerKind::Notify).unwrap().port;
        assert_eq!((dial(0), dial(1)), (61005 + 3, 61005 + 3));
        assert_eq!(
            (book.rules_of(EngineId::prefill(0)), book.rules_of(EngineId::prefill(1))),
            (PeerRules::Pdkv, PeerRules::Vllm033)
        );
    }

    /// A read target is a function of its source rank alone: two targets agree on session,
    /// handshake and notify exactly when their sources are the same rank.
    #[test]
    fn read_target_fields_follow_the_source_rank() {
        let d = deployment("2P_DP2TP4:1D_TP8");
        let book = AddressBook::one_host_per_engine(&d);
        let none = Policy::fixed();
        let targets: Vec<ReadTarget> = d
            .ranks(Role::Prefill)
            .into_iter()
            .map(|r| ReadTarget::derive(&book, &d, r, none.session_key).unwrap())
            .collect();
        for t in &targets {
            assert_eq!(t.session, book.session_key(t.source, none.session_key));
            assert_eq!(t.handshake, book.dial_endpoint(&d, t.source, ListenerKind::Handshake).unwrap());
            assert_eq!(t.notify, book.listen_endpoint(&d, t.source, ListenerKind::Notify, &none).unwrap());
            for u in &targets {
                let same = t.source == u.source;
                assert_eq!(t.session == u.session, same, "{} {}", t.source, u.source);
                assert_eq!(t.handshake == u.handshake, same, "{} {}", t.source, u.source);
                assert_eq!(t.notify == u.notify, same, "{} {}", t.source, u.source);
            }
        }
    }

    /// Legacy session keys: a flexible decode worker reads eight different prefill ranks, but
    /// all eight map to one session, so every read after the first would reuse the memory
    /// descriptors of the rank it handshook first.
    #[test]
    fn legacy_session_key_without_tp_merges_ranks() {
        use crate::routing::ReadRouter;
        let d = deployment("1P_TP8:1D_DP8EP");
        let book = AddressBook::one_host_per_engine(&d);
        for (legacy, sessions) in
            [(Policy::fixed(), 8), (Policy::from(LegacyOptions::none().with(Legacy::SessionKeyWithoutTp)), 1)]
        {
            let local = RankId::new(EngineId::decode(0), 0, 0);
            let mut router = ReadRouter::new(local, d.decode[0], d.model.clone(), legacy);
            let targets: Vec<ReadTarget> = (0..8)
                .map(|_| {
                    let source = router.resolve(EngineId::prefill(0), d.prefill[0], None).unwrap();
                    ReadTarget::derive(&book, &d, source.rank, legacy.session_key).unwrap()
                })
                .collect();
            let keys: std::collections::BTreeSet<_> = targets.iter().map(|t| &t.session).collect();
            let sources: std::collections::BTreeSet<_> = targets.iter().map(|t| t.source).collect();
            assert_eq!((keys.len(), sources.len()), (sessions, 8), "{legacy:?}");
        }
    }

    #[test]
    fn ports_past_65535_are_an_error() {
        let d = deployment("1P_DP2TP256:1D_TP8");
        let mut book = AddressBook::one_host_per_engine(&d);
        book.prefill[0].notify_port_base = 65100;
        let err = book.dial_endpoint(&d, prefill(0, 1, 255), ListenerKind::Notify).unwrap_err();
        assert_eq!((err.base, err.offset), (65100, 511));
        assert!(err.to_string().contains("above 65535"), "{err}");
    }
}
