//! The routing table of a deployment for an operator: who reads whom, at which ports, with
//! which release quorum, and the read count per prefill GPU over rounds of the fixed proxy.
//!
//! The read counts are not computed by formula: the real [`Proxy`] routes each request and each
//! decode worker's real [`ReadRouter`] (with its flexible counter) resolves its source, exactly
//! as a running deployment would, so legacy options show their effect here too.
//!
//! A round is one request for every pair of a prefill (engine, DP rank) slot and a decode DP
//! rank index, i.e. `prefill slots × largest decode DP size` requests. This is the round of
//! MoRIIO's reference tests: 16 rounds give 16 reads per GPU for `1P_TP8:1D_TP8` and
//! `2P_TP8:1D_DP8EP`, and 128 for `2P_DP8EP:3D_DP8EP` and `2P_DP8EP:4D_TP8`.

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Serialize};

use crate::ids::{EngineId, RankId, RequestId, Role, TransferId};
use crate::legacy::LegacyOptions;
use crate::params::{KvTransferParams, ParamsError, PrefillAnswer};
use crate::policy::{PeerBook, PeerRules, Policy};
use crate::ports::{AddressBook, ListenerKind, PortError, ReadTarget};
use crate::proxy::{flat_slots, Proxy, ProxyAction, ProxyError, Slot};
use crate::release::{quorum_plan, Quorum};
use crate::routing::{self, ReadRouter, RoutingError};
use crate::topology::Deployment;
use crate::wire::Extensions;

/// At most this many rounds, so the table is computed in bounded time.
pub const MAX_ROUNDS: u32 = 100_000;

/// Why a routing table cannot be produced.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RoutesError {
    /// A decode engine cannot read a prefill engine (guard, multiples, sizes).
    Pair {
        /// The decode engine.
        decode: EngineId,
        /// The prefill engine it cannot read.
        prefill: EngineId,
        /// What the routing check refused.
        error: RoutingError,
    },
    /// A prefill engine cannot write a decode engine in WRITE mode.
    Write {
        /// The decode engine.
        decode: EngineId,
        /// The prefill engine that cannot write it.
        prefill: EngineId,
        /// What the write rule refused.
        error: crate::write::WriteError,
    },
    /// A prefill rank's listener port would pass 65535.
    Port(PortError),
    /// The `kv_transfer_params` the proxy forwarded could not be read back (the
    /// [`ParamsError`]'s message).
    Params(String),
    /// The proxy refused a request or a prefill answer (the [`ProxyError`]'s message).
    Proxy(String),
    /// The round count is 0 or above [`MAX_ROUNDS`].
    Rounds {
        /// The rejected round count.
        rounds: u32,
    },
}

impl fmt::Display for RoutesError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RoutesError::Pair { decode, prefill, error } => {
                write!(f, "decode engine {decode} cannot read prefill engine {prefill}: {error}")
            }
            RoutesError::Write { decode, prefill, error } => {
                write!(f, "prefill engine {prefill} cannot write decode engine {decode}: {error}")
            }
            RoutesError::Port(e) => write!(f, "{e}"),
            RoutesError::Params(e) => write!(f, "{e}"),
            RoutesError::Proxy(e) => write!(f, "{e}"),
            RoutesError::Rounds { rounds } => {
                write!(f, "rounds must be in 1..={MAX_ROUNDS}, got {rounds}")
            }
        }
    }
}

impl std::error::Error for RoutesError {}

impl From<PortError> for RoutesError {
    fn from(e: PortError) -> RoutesError {
        RoutesError::Port(e)
    }
}

impl From<ParamsError> for RoutesError {
    fn from(e: ParamsError) -> RoutesError {
        RoutesError::Params(e.to_string())
    }
}

impl From<ProxyError> for RoutesError {
    fn from(e: ProxyError) -> RoutesError {
        RoutesError::Proxy(e.to_string())
    }
}

/// How one decode engine reads one prefill engine.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PairRoutes {
    /// The decode engine, e.g. `D0`.
    pub decode_engine: String,
    /// Its layout in canonical notation, e.g. `DP8EP`.
    pub decode_layout: String,
    /// The prefill engine, e.g. `P1`.
    pub prefill_engine: String,
    /// Its layout in canonical notation, e.g. `TP8`.
    pub prefill_layout: String,
    /// Decode reads this prefill engine with the flexible round-robin.
    pub flexible: bool,
    /// Prefill TP rank read by each decode TP rank (empty when flexible: the pick rotates).
    pub tp_map: Vec<u16>,
    /// Releases each prefill TP rank of the owner DP group waits for, per request
    /// (for flexible reads: 1, on whichever rank the decode worker picked).
    pub quorum_per_tp_rank: Vec<u16>,
    /// MoRIIO's uniform expectation (what each rank waits for without zero quorum).
    pub moriio_expected_releases: u16,
}

/// One prefill GPU: its listeners, what dials them, and what it saw over the rounds.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PrefillRankRow {
    /// The rank, e.g. `P0.dp1.tp3`.
    pub rank: String,
    /// Port the rank's handshake listener binds (legacy offsets apply).
    pub handshake_listen_port: u16,
    /// Port peers dial for the rank's handshake, always `base + dp * tp_size + tp`.
    pub handshake_dial_port: u16,
    /// Port the rank's notify listener binds (legacy offsets apply).
    pub notify_listen_port: u16,
    /// Port decode workers send the rank's releases to, always `base + dp * tp_size + tp`.
    pub notify_dial_port: u16,
    /// Reads this GPU served over all rounds, one per decode worker whose read resolved to it.
    pub reads: u64,
    /// Requests whose blocks this rank held (owner DP group of the request's prefill slot).
    pub requests_held: u64,
}

/// The whole table; `--json` prints this object.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RoutesReport {
    /// The deployment in canonical notation.
    pub deployment: String,
    /// Whether the model uses MLA (replicated latent KV, never split).
    pub use_mla: bool,
    /// KV heads of the model (1 for MLA).
    pub kv_heads: u16,
    /// Names of the legacy options switched on, empty for the fixed protocol.
    pub legacy: Vec<String>,
    /// The rule set every engine follows (`pdkv`, or a vLLM release's dialect).
    pub rules: String,
    /// Rounds of the proxy that were routed.
    pub rounds: u32,
    /// Requests routed: rounds × prefill (engine, DP rank) slots × largest decode DP size.
    pub requests: u64,
    /// True when any decode engine reads any prefill engine with the flexible rule.
    pub flexible: bool,
    /// One entry per (decode engine, prefill engine) pair: decode engine 0 with every prefill
    /// engine, then decode engine 1, and so on.
    pub pairs: Vec<PairRoutes>,
    /// One row per prefill GPU, in rank order (engine, then DP, then TP).
    pub prefill_ranks: Vec<PrefillRankRow>,
    /// Reads per prefill GPU in rank order (engine, then DP, then TP).
    pub reads_per_prefill_gpu: Vec<u64>,
    /// Releases each prefill rank waits for per request it holds, against decode engine 0.
    pub expected_releases_per_prefill_rank: Vec<u16>,
    /// Prefill ranks whose notify listener is not where peers dial, and notify listeners that
    /// share a port (legacy offsets); empty for the fixed protocol. Handshake listeners use the
    /// same offsets and are not listed separately.
    pub port_problems: Vec<String>,
    /// Jain's fairness index of `reads_per_prefill_gpu` (1 is perfectly even).
    pub jain: f64,
}

/// Jain's fairness index `(Σx)² / (n Σx²)`; 0 for an empty or all-zero input.
pub fn jain_index(values: &[u64]) -> f64 {
    let sum: f64 = values.iter().map(|&v| v as f64).sum();
    let squares: f64 = values.iter().map(|&v| (v as f64) * (v as f64)).sum();
    if values.is_empty() || squares == 0.0 {
        return 0.0;
    }
    sum * sum / (values.len() as f64 * squares)
}

fn quorum_count(q: Quorum) -> u16 {
    match q {
        Quorum::Exact(n) => n,
        Quorum::AnyOfGroup => 1,
    }
}

/// Requests in `rounds` rounds: prefill (engine, DP rank) slots × largest decode DP size each.
pub(crate) fn round_requests(deployment: &Deployment, rounds: u32) -> u64 {
    let max_decode_dp = deployment.decode.iter().map(|l| u64::from(l.dp)).max().unwrap_or(1);
    flat_slots(&deployment.prefill, Role::Prefill).len() as u64 * max_decode_dp * u64::from(rounds)
}

/// One request as the proxy routed it to prefill and then to decode.
pub(crate) struct RoutedRequest {
    /// The proxy's id; the caller ends it with [`Proxy::handle_finished`].
    pub(crate) id: RequestId,
    /// The prefill slot holding the KV (the owner DP rank).
    pub(crate) prefill: Slot,
    /// The decode slot reading or written.
    pub(crate) decode: Slot,
    /// The transfer id the proxy minted.
    pub(crate) transfer_id: String,
    /// What the proxy forwarded to decode.
    pub(crate) params: KvTransferParams,
}

/// Routes request `k` through the real proxy: to prefill, then, on the prefill answer as MoRIIO's
/// producer writes it (no DP rank, which the proxy adds; no blocks, extensions or incarnations,
/// the tables being about routes), to decode.
pub(crate) fn route_request(
    proxy: &mut Proxy,
    book: &AddressBook,
    deployment: &Deployment,
    k: u64,
) -> Result<RoutedRequest, RoutesError> {
    let (id, send) = proxy.handle_request(u128::from(k))?;
    let ProxyAction::SendPrefill { slot: prefill, params: to_prefill, .. } = send else {
        unreachable!("a new request is always sent to prefill first")
    };
    let transfer_id = to_prefill.transfer_id.unwrap_or_else(|| format!("request-{k}"));
    let minted = TransferId::new(transfer_id.clone());
    let answer = KvTransferParams::prefill_answer(&PrefillAnswer {
        transfer_id: Some(&minted),
        blocks: &[],
        address: book.engine(prefill.engine),
        layout: deployment.layout(prefill.engine),
        extensions: Extensions::NONE,
        holders: None,
        blocks_per_group: true,
    });
    let ProxyAction::SendDecode { slot: decode, params, .. } = proxy.handle_prefill_response(id, answer)?
    else {
        unreachable!("a prefill answer is always followed by a decode dispatch")
    };
    Ok(RoutedRequest { id, prefill, decode, transfer_id, params })
}

/// Computes the routing table of `deployment` over `rounds` rounds of the proxy.
pub fn routes(
    deployment: &Deployment,
    legacy: &LegacyOptions,
    rounds: u32,
) -> Result<RoutesReport, RoutesError> {
    routes_under(deployment, legacy, PeerRules::Pdkv, rounds)
}

/// The routing table of `deployment` with every engine following `rules`: a vLLM release's
/// listeners, release plan and quorum, and for 0.25 and 0.26 its reads (DP rank 0, no flexible
/// read), as [`Policy::between`] and [`Policy::own`] decide them for the simulator's nodes.
pub fn routes_under(
    deployment: &Deployment,
    legacy: &LegacyOptions,
    rules: PeerRules,
    rounds: u32,
) -> Result<RoutesReport, RoutesError> {
    if rounds == 0 || rounds > MAX_ROUNDS {
        return Err(RoutesError::Rounds { rounds });
    }
    // The report names the options; every decision below reads the policy they resolve to.
    let policy = Policy::from(legacy);
    let model = &deployment.model;
    let mut peers = PeerBook::pdkv();
    for engine in deployment
        .prefill
        .iter()
        .enumerate()
        .map(|(i, _)| EngineId::prefill(i as u16))
        .chain(deployment.decode.iter().enumerate().map(|(i, _)| EngineId::decode(i as u16)))
    {
        peers.set(engine, rules);
    }
    let book = AddressBook::one_host_per_engine(deployment).with_rules(peers.clone());
    let mut pairs = Vec::new();
    for (di, &decode) in deployment.decode.iter().enumerate() {
        for (pi, &prefill) in deployment.prefill.iter().enumerate() {
            let (d, p) = (EngineId::decode(di as u16), EngineId::prefill(pi as u16));
            let pair_error = |error| RoutesError::Pair { decode: d, prefill: p, error };
            let plan =
                quorum_plan(prefill, decode, model, &policy.between(&peers, p, d)).map_err(pair_error)?;
            let moriio = crate::release::expected_releases(prefill.tp, decode.tp).map_err(pair_error)?;
            let tp_map = if plan.flexible {
                Vec::new()
            } else {
                (0..decode.tp)
                    .map(|r| routing::fixed_tp_source(decode.tp, r, prefill.tp))
                    .collect::<Result<_, _>>()
                    .map_err(pair_error)?
            };
            pairs.push(PairRoutes {
                decode_engine: d.to_string(),
                decode_layout: decode.to_string(),
                prefill_engine: p.to_string(),
                prefill_layout: prefill.to_string(),
                flexible: plan.flexible,
                tp_map,
                quorum_per_tp_rank: plan.per_tp_rank.iter().map(|&q| quorum_count(q)).collect(),
                moriio_expected_releases: moriio,
            });
        }
    }

    // Drive the real proxy and the real per-worker routers.
    let mut proxy = Proxy::new(deployment, policy.proxy).with_peers(&peers);
    let mut routers: BTreeMap<RankId, ReadRouter> = BTreeMap::new();
    let decode_policy = policy.own(rules);
    for rank in deployment.ranks(Role::Decode) {
        let layout = deployment.layout(rank.engine);
        routers.insert(rank, ReadRouter::new(rank, layout, model.clone(), decode_policy));
    }
    let prefill_ranks = deployment.ranks(Role::Prefill);
    let mut reads = vec![0u64; prefill_ranks.len()];
    let mut held = vec![0u64; prefill_ranks.len()];
    let requests = round_requests(deployment, rounds);
    for k in 1..=requests {
        let RoutedRequest { id, prefill: prefill_slot, decode: decode_slot, params, .. } =
            route_request(&mut proxy, &book, deployment, k)?;
        let prefill_layout = deployment.layout(prefill_slot.engine);
        for tp in 0..prefill_layout.tp {
            held[deployment.rank_index(RankId::new(prefill_slot.engine, prefill_slot.dp(), tp))] += 1;
        }
        let decode_layout = deployment.layout(decode_slot.engine);
        let announced = params.prefill_layout(decode_policy.tp_size)?;
        let owner = params.owner_dp()?;
        for tp in 0..decode_layout.tp {
            let worker = RankId::new(decode_slot.engine, decode_slot.dp(), tp);
            let router = routers.get_mut(&worker).expect("every decode rank has a router");
            let source = router.resolve(prefill_slot.engine, announced, owner).map_err(|error| {
                RoutesError::Pair { decode: decode_slot.engine, prefill: prefill_slot.engine, error }
            })?;
            let target = ReadTarget::derive(&book, deployment, source.rank, policy.session_key)?;
            debug_assert_eq!(target.source, source.rank);
            reads[deployment.rank_index(target.source)] += 1;
        }
        proxy.handle_finished(id)?;
    }

    let mut rows = Vec::new();
    let mut problems = Vec::new();
    let mut listeners: BTreeMap<(String, u16), RankId> = BTreeMap::new();
    for (i, &rank) in prefill_ranks.iter().enumerate() {
        let port = |kind, listen: bool| -> Result<u16, PortError> {
            Ok(if listen {
                book.listen_endpoint(deployment, rank, kind, &policy)?.port
            } else {
                book.dial_endpoint(deployment, rank, kind)?.port
            })
        };
        let row = PrefillRankRow {
            rank: rank.to_string(),
            handshake_listen_port: port(ListenerKind::Handshake, true)?,
            handshake_dial_port: port(ListenerKind::Handshake, false)?,
            notify_listen_port: port(ListenerKind::Notify, true)?,
            notify_dial_port: port(ListenerKind::Notify, false)?,
            reads: reads[i],
            requests_held: held[i],
        };
        if row.notify_listen_port != row.notify_dial_port {
            problems.push(format!(
                "{rank}: listens on notify port {} but peers dial {}",
                row.notify_listen_port, row.notify_dial_port
            ));
        }
        let host = book.engine(rank.engine).host.clone();
        if let Some(other) = listeners.insert((host, row.notify_listen_port), rank) {
            problems
                .push(format!("{other} and {rank} both listen on notify port {}", row.notify_listen_port));
        }
        rows.push(row);
    }
    let expected: Vec<u16> = prefill_ranks
        .iter()
        .map(|r| {
            let pair = &pairs[usize::from(r.engine.index)];
            pair.quorum_per_tp_rank[usize::from(r.tp)]
        })
        .collect();
    Ok(RoutesReport {
        deployment: deployment.notation(),
        use_mla: model.use_mla,
        kv_heads: model.kv_heads,
        legacy: legacy.iter().map(|l| l.name().to_string()).collect(),
        rules: rules.name().to_string(),
        rounds,
        requests,
        flexible: pairs.iter().any(|p| p.flexible),
        pairs,
        prefill_ranks: rows,
        jain: jain_index(&reads),
        reads_per_prefill_gpu: reads,
        expected_releases_per_prefill_rank: expected,
        port_problems: problems,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::legacy::Legacy;
    use crate::topology::ModelSpec;

    /// The five configurations of the reference tests: 16 rounds, reads per prefill GPU.
    #[test]
    fn reference_read_count_table() {
        let check = |notation: &str, gpus: usize, each: u64, flexible: bool| {
            let d = Deployment::parse(notation).unwrap();
            let report = routes(&d, &LegacyOptions::none(), 16).unwrap();
            assert_eq!(report.reads_per_prefill_gpu, vec![each; gpus], "{notation}");
            assert_eq!(report.flexible, flexible, "{notation}");
            assert!((report.jain - 1.0).abs() < 1e-12, "{notation}");
        };
        check("1P_TP8:1D_TP8", 8, 16, false);
        check("2P_TP8:1D_DP8EP", 16, 16, true);
        check("2P_TP8:2D_TP8", 16, 16, false);
        check("2P_DP8EP:3D_DP8EP", 16, 128, false);
        check("2P_DP8EP:4D_TP8", 16, 128, false);
    }

    #[test]
    fn expected_releases_per_rank_table() {
        let check = |notation: &str, expected: &[u16]| {
            let d = Deployment::parse(notation).unwrap();
            let report = routes(&d, &LegacyOptions::none(), 1).unwrap();
            assert_eq!(report.expected_releases_per_prefill_rank, expected, "{notation}");
        };
        check("1P_TP8:1D_TP4", &[1, 0, 1, 0, 1, 0, 1, 0]);
        check("1P_TP4:1D_TP8", &[2, 2, 2, 2]);
        check("1P_DP2:1D_TP8", &[8, 8]);
        check("1P_TP8:1D_DP8EP", &[1; 8]);
    }

    #[test]
    fn guard_errors_name_the_pair() {
        let d = Deployment::parse("1P_TP4:1D_TP8").unwrap().with_model(ModelSpec::gqa(8));
        let err = routes(&d, &LegacyOptions::none(), 16).unwrap_err();
        assert!(err.to_string().contains("requires replicated KV heads"), "{err}");
        assert!(err.to_string().starts_with("decode engine D0 cannot read prefill engine P0"), "{err}");
        let d = Deployment::parse("1P_TP4:1D_TP6").unwrap();
        assert!(routes(&d, &LegacyOptions::none(), 1).unwrap_err().to_string().contains("multiple"));
        assert_eq!(routes(&d, &LegacyOptions::none(), 0).unwrap_err(), RoutesError::Rounds { rounds: 0 });
    }

    /// Legacy options seen through the table: a DP0 hot spot, aliasing's idle GPUs, collapsed
    /// TP reads, and listeners nobody can reach.
    #[test]
    fn legacy_options_show_in_the_table() {
        let run = |notation: &str, option: Legacy| {
            let d = Deployment::parse(notation).unwrap();
            routes(&d, &LegacyOptions::none().with(option), 16).unwrap()
        };
        let dp0 = run("1P_DP8EP:1D_TP8", Legacy::ReadFromDp0);
        assert_eq!(dp0.reads_per_prefill_gpu, [1024, 0, 0, 0, 0, 0, 0, 0]);
        let aliasing = run("2P_DP8EP:1D_TP8", Legacy::ProxyAliasing);
        assert_eq!(aliasing.reads_per_prefill_gpu.iter().filter(|&&r| r == 0).count(), 8);
        assert!(aliasing.jain < 0.51);
        let no_flex = run("2P_TP8:1D_DP8EP", Legacy::NoFlexibleReads);
        let on_rank0: Vec<u64> = (0..16).map(|i| if i % 8 == 0 { 128 } else { 0 }).collect();
        assert_eq!(no_flex.reads_per_prefill_gpu, on_rank0);
        assert!(!no_flex.flexible);
        let collapsed = run("1P_TP8:1D_TP8", Legacy::TpSizeKey);
        assert_eq!(collapsed.reads_per_prefill_gpu, [128, 0, 0, 0, 0, 0, 0, 0]);
        let offsets = run("1P_DP2TP2:1D_TP2", Legacy::ListenerOffsetDpPlusTp);
        assert_eq!(
            offsets.port_problems,
            [
                "P0.dp1.tp0: listens on notify port 61006 but peers dial 61007",
                "P0.dp0.tp1 and P0.dp1.tp0 both listen on notify port 61006",
                "P0.dp1.tp1: listens on notify port 61007 but peers dial 61008",
            ]
        );
        assert!(run("1P_DP2TP2:1D_TP2", Legacy::ReadFromDp0).port_problems.is_empty());
    }

    #[test]
    fn jain_index_table() {
        let check = |values: &[u64], expected: f64| {
            assert!((jain_index(values) - expected).abs() < 1e-12, "{values:?}");
        };
        check(&[16; 8], 1.0);
        check(&[1, 0], 0.5);
        check(&[3, 1], 0.8);
        check(&[], 0.0);
        check(&[0, 0], 0.0);
    }
}
