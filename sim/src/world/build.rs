//! Building the world of a scenario: prefill and decode nodes with their memory regions,
//! listeners, and the decode groups and units.

use std::collections::{BTreeMap, BTreeSet, BinaryHeap};

use pdkv_core::decode::{DecodeConfig, DecodeWorker, ReadGranularity};
use pdkv_core::ids::{EngineId, Incarnation, RankId, Role};
use pdkv_core::legacy::LegacyOptions;
use pdkv_core::policy::Policy;
use pdkv_core::ports::{AddressBook, ListenerKind};
use pdkv_core::prefill::{EngineEvent, PrefillEngine, PrefillWorker};
use pdkv_core::proxy::Proxy;
use pdkv_core::time::Instant;
use pdkv_core::topology::{Deployment, Layout};
use pdkv_core::wire::{Extension, HandshakeMetadata, LayerMemoryDesc};
use pdkv_engine::decode::{DecodeNodes, DecodeScheduler, KvAllocation, SchedulerLimits};

use crate::cost::Cost;
use crate::nic::Nics;
use crate::rng::Streams;
use crate::scenario::{Clients, KvAllocationMode, Reads, Scenario};

use super::control::Listener;
use super::decode::{DGroup, Unit};
use super::prefill::PGroup;
use super::{Checks, ClientSide, DecodeSide, Network, PrefillSide, RunOptions, Stats, World};
use pdkv_engine::prefill::{PrefillNodes, PrefillScheduler};

/// A prefill worker of rank `rank` (index `i`) in its `epoch`-th life, named `incarnation` in its
/// metadata, with its memory regions (base addresses and their common length). Every life of
/// every rank gets a disjoint slice of one global address space, so a read's address says whose
/// memory it touches, and addresses of a crashed life are recognisably stale.
#[allow(clippy::too_many_arguments)]
pub(super) fn build_prefill_worker(
    sc: &Scenario,
    d: &Deployment,
    book: &AddressBook,
    cost: &Cost,
    policy: &Policy,
    rank: RankId,
    i: usize,
    epoch: u64,
    incarnation: Option<Incarnation>,
    num_blocks: u32,
) -> (PrefillWorker, Vec<u64>, u64) {
    let block_len = cost.block_bytes_per_layer(d.layout(rank.engine).tp);
    let region_len = u64::from(num_blocks) * block_len;
    let rank_base = ((i as u64 + 1) << 44) + (epoch << 38);
    let bases: Vec<u64> = (0..u64::from(sc.model.layers)).map(|l| rank_base + l * region_len).collect();
    let metadata = HandshakeMetadata {
        engine_id: book.engine_id(rank.engine),
        agent_metadata: Vec::new(),
        kv_caches_base_addr: bases.clone(),
        num_blocks,
        block_len,
        attn_backend_name: "pdkv-sim".into(),
        rank: None,
        extensions: book.rules.rules(rank.engine).extensions(),
        incarnation,
    };
    let layers = (0..sc.model.layers)
        .map(|l| LayerMemoryDesc { layer_name: format!("model.layers.{l}"), descs: vec![vec![0]] })
        .collect();
    // A lease lasts the decode's transfer timeout: the deployment's, or the shorter one a fault
    // injects; the worker takes none longer than the deployment's.
    let max_lease_ms = sc.protocol.timeouts().lease_ms().max(sc.timeouts().lease_ms());
    // The rank takes early releases as its engine's release does (vLLM 0.25 drops them).
    let policy = policy.own(book.rules.rules(rank.engine));
    let worker = PrefillWorker::new(rank, metadata, layers, &policy).with_max_lease_ms(max_lease_ms);
    (worker, bases, region_len)
}

/// The incarnation of a prefill rank's next life, drawn from the run's process stream, or `None`
/// for a rank whose engine follows a rule set without incarnations (vLLM's). A draw equal to any
/// earlier incarnation of the rank (`lives`, to which the new one is added) is drawn again, so
/// an incarnation is never reused.
pub(super) fn draw_incarnation(
    book: &AddressBook,
    rank: RankId,
    streams: &mut Streams,
    lives: &mut Vec<Incarnation>,
) -> Option<Incarnation> {
    if !book.rules.rules(rank.engine).extensions().has(Extension::Incarnation) {
        return None;
    }
    loop {
        let incarnation = Incarnation::from_bits(streams.incarnation_bits());
        if !lives.contains(&incarnation) {
            lives.push(incarnation);
            return Some(incarnation);
        }
    }
}

/// A decode worker for `rank` with the scenario's protocol settings.
pub(super) fn build_decode_worker(
    sc: &Scenario,
    d: &Deployment,
    book: &AddressBook,
    policy: &Policy,
    rank: RankId,
) -> DecodeWorker {
    // The worker reads as its engine's release does (vLLM 0.25: DP rank 0, lazily).
    let policy = policy.own(book.rules.rules(rank.engine));
    let mut config =
        DecodeConfig::new(rank, d.layout(rank.engine), d.model.clone(), policy, book.engine_id(rank.engine));
    config.peers = book.rules.clone();
    sc.timeouts().apply_to(&mut config);
    config.granularity = match sc.protocol.reads {
        Reads::PerLayer => ReadGranularity::PerLayer,
        Reads::PerRequest => ReadGranularity::PerRequest,
    };
    DecodeWorker::new(config)
}

impl World {
    /// Builds the world of `sc`; fails if the scenario cannot run.
    pub fn new(sc: &Scenario, options: RunOptions) -> Result<World, crate::SimError> {
        let d = crate::error::routable_deployment(&sc.deployment, sc.model_spec())?;
        crate::cost::kv_room(sc, &d)?;
        let policy = Policy::from(&sc.protocol.legacy.iter().copied().collect::<LegacyOptions>());
        let cost = Cost::of(sc);
        let peers = sc.peer_book(&d).map_err(crate::SimError::Peers)?;
        let book = AddressBook::one_host_per_engine(&d).with_rules(peers);
        let p_ranks = d.ranks(Role::Prefill);
        let d_ranks = d.ranks(Role::Decode);
        let blocks_for = |layout: Layout| {
            if sc.engines.kv_blocks_per_gpu > 0 {
                sc.engines.kv_blocks_per_gpu
            } else {
                cost.kv_blocks_per_gpu(layout)
            }
        };

        // Prefill: groups (engine, dp), engines, workers with their memory regions.
        let mut pgroup_base = Vec::new();
        let mut pgroups = Vec::new();
        let mut engines = Vec::new();
        for (e, &layout) in d.prefill.iter().enumerate() {
            pgroup_base.push(pgroups.len());
            for dp in 0..layout.dp {
                pgroups.push(PGroup {
                    engine: e,
                    dp,
                    layout,
                    sched: PrefillScheduler::new(blocks_for(layout), sc.model.block_size_tokens),
                    busy: false,
                    step_tokens: 0,
                });
            }
            let engine = PrefillEngine::new(EngineId::prefill(e as u16), layout, d.model.clone(), policy)
                .with_peers(book.rules.clone())
                .with_defer_timeout_ns(sc.timeouts().defer_ns());
            engines.push(engine);
        }
        let mut regions = BTreeMap::new();
        let mut pworkers = Vec::new();
        let mut streams = Streams::new(sc.seed);
        let mut incarnations = Vec::new();
        for (i, &rank) in p_ranks.iter().enumerate() {
            let blocks = blocks_for(d.layout(rank.engine));
            let mut lives = Vec::new();
            let incarnation = draw_incarnation(&book, rank, &mut streams, &mut lives);
            let (worker, bases, len) =
                build_prefill_worker(sc, &d, &book, &cost, &policy, rank, i, 0, incarnation, blocks);
            for base in bases {
                regions.insert(base, (i, len));
            }
            pworkers.push(worker);
            incarnations.push(lives);
            if let Some(incarnation) = incarnation {
                let e = usize::from(rank.engine.index);
                engines[e]
                    .handle(Instant::ZERO, EngineEvent::WorkerUp { rank, incarnation }, &mut Vec::new())
                    .expect("an engine takes its own worker's start");
            }
        }

        // Listeners, bound in rank order; a port taken already fails to bind (EADDRINUSE).
        let mut listeners = Vec::new();
        let mut listener_at = BTreeMap::new();
        for &rank in &p_ranks {
            for kind in [ListenerKind::Handshake, ListenerKind::Notify] {
                let Ok(endpoint) = book.listen_endpoint(&d, rank, kind, &policy) else { continue };
                let key = (endpoint.host, endpoint.port);
                if let std::collections::btree_map::Entry::Vacant(slot) = listener_at.entry(key) {
                    slot.insert(listeners.len());
                    listeners.push(Listener { rank, kind, busy_until: 0 });
                }
            }
        }

        // Decode: groups, units (an EP engine steps all its DP ranks together), workers.
        let mut dgroup_base = Vec::new();
        let mut dgroups = Vec::new();
        let mut units = Vec::new();
        let mut nodes = DecodeNodes::new();
        for (e, &layout) in d.decode.iter().enumerate() {
            dgroup_base.push(dgroups.len());
            let engine_unit = units.len();
            if layout.ep {
                units.push(Unit::new(e));
            }
            for dp in 0..layout.dp {
                let unit = if layout.ep {
                    engine_unit
                } else {
                    units.push(Unit::new(e));
                    units.len() - 1
                };
                let limits = SchedulerLimits {
                    width: layout.tp,
                    max_batch: sc.engines.decode_max_batch as usize,
                    pool_blocks: blocks_for(layout),
                    block_size_tokens: sc.model.block_size_tokens,
                    allocation: match sc.engines.decode_kv_allocation {
                        KvAllocationMode::Reserve => KvAllocation::Reserve,
                        KvAllocationMode::OnDemand => KvAllocation::OnDemand { watermark_blocks: 0 },
                    },
                };
                let handshake = policy.own(book.rules.rules(EngineId::decode(e as u16))).handshake;
                let g = nodes.add_group(DecodeScheduler::new(limits, handshake));
                debug_assert_eq!(g, dgroups.len(), "the nodes number groups as the world does");
                units[unit].groups.push(g);
                for tp in 0..layout.tp {
                    let rank = RankId::new(EngineId::decode(e as u16), dp, tp);
                    nodes.add_worker(g, build_decode_worker(sc, &d, &book, &policy, rank));
                }
                dgroups.push(DGroup { engine: e, unit });
            }
        }

        let (to_send, open_loop) = match sc.workload.clients {
            Clients::Closed { requests, .. } => (u64::from(requests), None),
            Clients::Open { rate_per_s, requests } => (u64::from(requests), Some(rate_per_s)),
        };
        let nic_count = p_ranks.len() + d_ranks.len();
        let (d_prefill_engines, d_decode_engines) = (d.prefill.len(), d.decode.len());
        // A delayed registration is the world's to deliver; otherwise the nodes deliver it.
        let mut prefill_nodes =
            PrefillNodes::new().with_held_registrations(sc.engines.prefill_register_delay_ms > 0);
        let engine_count = engines.len();
        for engine in engines {
            prefill_nodes.add_engine(engine);
        }
        for (&rank, worker) in p_ranks.iter().zip(pworkers) {
            let i = prefill_nodes.add_worker(rank, worker);
            debug_assert_eq!(i, d.rank_index(rank), "the nodes number prefill workers as the world does");
        }
        let (prefill_rank_count, prefill_group_count) = (p_ranks.len(), pgroups.len());
        let proxy = Proxy::new(&d, policy.proxy).with_peers(&book.rules);
        let mut world = World {
            streams,
            faults: Vec::new(),
            sc: sc.clone(),
            d,
            cost,
            book,
            now: 0,
            seq: 0,
            queue: BinaryHeap::new(),
            events: 0,
            clients: ClientSide {
                proxy,
                to_send,
                open_loop,
                requests: Default::default(),
                transfers: Default::default(),
                keep_rows: options.requests,
            },
            prefill: PrefillSide {
                engine_tick: vec![None; engine_count],
                ranks: p_ranks,
                group_base: pgroup_base,
                groups: pgroups,
                nodes: prefill_nodes,
                generation: vec![0; prefill_group_count],
                down: vec![false; d_prefill_engines],
                epoch: vec![0; prefill_rank_count],
                incarnations,
            },
            decode: DecodeSide {
                worker_tick: vec![None; nodes.workers().len()],
                ranks: d_ranks,
                group_base: dgroup_base,
                groups: dgroups,
                units,
                nodes,
                down: vec![false; d_decode_engines],
                spare: Vec::new(),
            },
            net: Network {
                nics: Nics::new(nic_count, sc.hardware.nic_gb_s),
                listeners,
                listener_at,
                regions,
                retired_regions: BTreeMap::new(),
                flows: BTreeMap::new(),
            },
            stats: Stats {
                reads: vec![0; prefill_rank_count],
                bytes: vec![0; prefill_rank_count],
                messages: vec![0; prefill_rank_count],
                kv_read_ms: Vec::new(),
                decode_steps: Vec::new(),
                prefill_steps: Vec::new(),
                refused: 0,
                reaped_excused: 0,
                lost_in_crash: 0,
                crashed_freed: 0,
                crashed_reaped: 0,
                max_hold_ns: 0,
                last_progress_ns: 0,
                preemptions: 0,
            },
            checks: Checks {
                violations: Vec::new(),
                hangs: Vec::new(),
                excused: BTreeSet::new(),
                touched: vec![Vec::new(); nic_count],
                grace_ns: sc.timeouts().handshake_ns().saturating_add(sc.timeouts().transfer_ns()),
                fenced: BTreeSet::new(),
            },
            stopped: false,
            budget_ended: false,
            trace_on: options.trace.is_some(),
            trace: options.trace,
        };
        world.start();
        Ok(world)
    }
}

#[cfg(test)]
mod tests {
    use crate::scenario::{Outcome, Scenario};
    use crate::world::RunOptions;

    fn scenario(deployment: &str, peers: &str) -> Scenario {
        let text = format!(
            "(name: \"t\", deployment: \"{deployment}\", hardware: (kv_memory_fraction: 0.5), workload: (clients: Closed(concurrency: 4, requests: \
             8), input_tokens: Fixed(1024), output_tokens: Fixed(4)), protocol: (peers: {{{peers}}}))"
        );
        crate::load::parse_scenario(&text, "<test>").unwrap_or_else(|e| panic!("{e}"))
    }

    /// (deployment, engines under vLLM 0.33's rules) -> outcome, transfers freed by their
    /// releases, transfers reaped. The listener rule is the prefill engine's own: a vLLM 0.33
    /// DP2xTP4 prefill strands the dials of its DP rank 1 (half the requests, owned by it), a vLLM
    /// decode reading a pdkv prefill does not. The release plan and quorum are the pair's: P8 to
    /// D4 frees every transfer by its releases whichever engine follows vLLM 0.33.
    #[test]
    fn rules_per_engine_decide_listeners_and_releases() {
        let check = |deployment: &str, peers: &str, expected: (Outcome, u64, u64)| {
            let run = crate::run(&scenario(deployment, peers), RunOptions::default()).unwrap();
            let r = run.result;
            assert_eq!((r.outcome, r.ledger.freed, r.ledger.reaped), expected, "{deployment} {{{peers}}}");
        };
        let vllm = |engines: &[&str]| -> String {
            engines.iter().map(|e| format!("\"{e}\": \"vllm-0.33\"")).collect::<Vec<_>>().join(", ")
        };
        check("1P_DP2TP4:1D_TP4", "", (Outcome::Clean, 8, 0));
        check("1P_DP2TP4:1D_TP4", &vllm(&["P0"]), (Outcome::SafetyViolation, 4, 4));
        check("1P_DP2TP4:1D_TP4", &vllm(&["D0"]), (Outcome::Clean, 8, 0));
        check("1P_DP2TP4:1D_TP4", "\"P0\": \"pdkv\"", (Outcome::Clean, 8, 0));
        for peers in [vec![], vec!["P0"], vec!["D0"], vec!["P0", "D0"]] {
            check("1P_TP8:1D_TP4", &vllm(&peers), (Outcome::Clean, 8, 0));
        }
        check("2P_TP8:1D_DP8EP", &vllm(&["P1"]), (Outcome::Clean, 8, 0));
        // Before 0.33 a vLLM decode rank releases only the rank it read: with P8 to D4 and
        // vLLM on both sides every transfer's unread holders wait for their uniform count until
        // the reaper frees them (a leak until then). A pdkv side adapts: a pdkv prefill gives
        // the unread holders nothing to wait for, a pdkv decode releases every holder.
        for dialect in ["vllm-0.27", "vllm-0.28", "vllm-0.30"] {
            for (engines, expected) in [
                (vec!["P0"], (Outcome::Clean, 8, 0)),
                (vec!["D0"], (Outcome::Clean, 8, 0)),
                (vec!["P0", "D0"], (Outcome::Leak, 0, 8)),
            ] {
                let peers: Vec<String> = engines.iter().map(|e| format!("\"{e}\": \"{dialect}\"")).collect();
                check("1P_TP8:1D_TP4", &peers.join(", "), expected);
            }
        }
    }

    /// Two vLLM dialects in one deployment are refused by name, as pdkv does not model what
    /// two vLLM releases do with each other.
    #[test]
    fn one_deployment_follows_one_vllm_dialect() {
        let why = "vllm-0.30, but P0 follows vllm-0.33: one deployment may follow one vLLM dialect \
                   (pdkv does not model two vLLM releases talking to each other)";
        let text = "(name: \"t\", deployment: \"2P_TP8:1D_TP8\", protocol: (peers: {\"P0\": \"vllm-0.33\", \"D0\": \"vllm-0.30\"}))";
        let error = crate::load::parse_scenario(text, "<test>").err().map(|e| e.to_string());
        assert_eq!(error, Some(format!("<test>:1:80: field `protocol.peers[\"D0\"]`: {why}")));
        let mut sc = Scenario::from_notation("2P_TP8:1D_TP8");
        sc.protocol.peers =
            [("P0", "vllm-0.33"), ("D0", "vllm-0.30")].map(|(k, v)| (k.into(), v.into())).into();
        let error = crate::run(&sc, RunOptions::default()).err().map(|e| e.to_string());
        assert_eq!(error, Some(format!("protocol.peers[\"D0\"]: {why}")));
        let same = scenario("2P_TP8:1D_TP8", "\"P1\": \"vllm-0.30\", \"D0\": \"vllm-0.30\"");
        assert!(crate::run(&same, RunOptions::default()).is_ok());
    }

    /// A scenario made in code is not validated; `run` refuses a bad entry of `peers` by name.
    #[test]
    fn run_refuses_peers_outside_the_deployment() {
        let mut sc = Scenario::from_notation("1P_TP8:1D_TP8");
        sc.protocol.peers.insert("P3".into(), "vllm-0.33".into());
        let error = crate::run(&sc, RunOptions::default()).err().map(|e| e.to_string());
        let expected = "protocol.peers[\"P3\"]: 1P_TP8:1D_TP8 has no prefill engine P3 (engines P0..P0)";
        assert_eq!(error.as_deref(), Some(expected));
        sc.protocol.peers = [("P0".to_string(), "vllm".to_string())].into();
        let error = crate::run(&sc, RunOptions::default()).err().map(|e| e.to_string());
        assert_eq!(
            error.as_deref(),
            Some(
                "protocol.peers[\"P0\"]: unknown rule set \"vllm\"; known rule sets: pdkv, vllm-0.25, vllm-0.26, \
                 vllm-0.27, vllm-0.28, vllm-0.30, vllm-0.33"
            )
        );
    }
}
