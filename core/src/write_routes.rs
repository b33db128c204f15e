//! The WRITE-mode table of a deployment for an operator: which prefill ranks write which decode
//! ranks, how many writers each decode rank waits for, and the bytes each prefill GPU's NIC sends
//! over rounds of the fixed proxy.
//!
//! As with the read table ([`crate::routes`]), nothing is counted by formula: the real
//! [`Proxy`] routes every request and mints its transfer id, and every prefill TP rank of the
//! request's DP group asks [`write_plan`] what it writes, with the spread key of that id.

use serde::{Deserialize, Serialize};

use crate::ids::{EngineId, Role};
use crate::policy::{PeerRules, Policy};
use crate::ports::AddressBook;
use crate::proxy::Proxy;
use crate::routes::{jain_index, round_requests, route_request, RoutedRequest, RoutesError, MAX_ROUNDS};
use crate::topology::Deployment;
use crate::write::{spread_key, write_plan, writers_of, WriteError, WriteRule, WriteShape};

/// How one prefill engine writes one decode engine.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WritePairRoutes {
    /// The decode engine, e.g. `D0`.
    pub decode_engine: String,
    /// Its layout, e.g. `DP8EP`.
    pub decode_layout: String,
    /// The prefill engine, e.g. `P1`.
    pub prefill_engine: String,
    /// Its layout, e.g. `TP8`.
    pub prefill_layout: String,
    /// For each prefill TP rank, the decode TP ranks it writes under vLLM's first-holder pick
    /// (empty: another rank writes everything it holds). Under pdkv's spread rule the rank
    /// writing an identical copy varies per request; the decode ranks written do not.
    pub targets_per_prefill_tp_rank: Vec<Vec<u16>>,
    /// `write_done`s each decode TP rank waits for (`num_writers`).
    pub writers_per_decode_tp_rank: Vec<u16>,
    /// Whether some decode block is gathered from several prefill ranks or sliced from one.
    pub slices_heads: bool,
}

/// One prefill GPU's share of the writes over the rounds.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WriteRankRow {
    /// The rank, e.g. `P0.dp0.tp3`.
    pub rank: String,
    /// Writes it sent: one per (request, decode rank) it wrote.
    pub writes: u64,
    /// KV bytes its NIC sent per prompt token, summed over the requests (all layers).
    pub bytes_per_token: u64,
}

/// The whole WRITE table; `pdkv routes --mode write --json` prints this object.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct WriteRoutesReport {
    /// The deployment in canonical notation.
    pub deployment: String,
    /// Whether the model uses MLA.
    pub use_mla: bool,
    /// KV heads of the model (1 for MLA).
    pub kv_heads: u16,
    /// The rule set every engine follows.
    pub rules: String,
    /// The write rule it implies ([`WriteRule`]).
    pub write_rule: String,
    /// Rounds of the proxy that were routed.
    pub rounds: u32,
    /// Requests routed (as in the read table).
    pub requests: u64,
    /// One entry per (decode engine, prefill engine) pair.
    pub pairs: Vec<WritePairRoutes>,
    /// One row per prefill GPU, in rank order.
    pub prefill_ranks: Vec<WriteRankRow>,
    /// Jain's fairness index of the bytes each prefill GPU sent.
    pub jain: f64,
}

fn pair_error(decode: EngineId, prefill: EngineId, error: WriteError) -> RoutesError {
    RoutesError::Write { decode, prefill, error }
}

/// Computes the WRITE table of `deployment`, every engine following `rules`, over `rounds`
/// rounds of the proxy.
pub fn write_routes(
    deployment: &Deployment,
    rules: PeerRules,
    rounds: u32,
) -> Result<WriteRoutesReport, RoutesError> {
    if rounds == 0 || rounds > MAX_ROUNDS {
        return Err(RoutesError::Rounds { rounds });
    }
    let rule = WriteRule::between(rules, rules);
    let policy = Policy::fixed();
    let model = &deployment.model;
    let shape_of = |prefill_tp: u16, decode_tp: u16| WriteShape {
        prefill_tp,
        decode_tp,
        kv_heads: model.kv_heads,
        use_mla: model.use_mla,
        has_mamba: false,
    };
    let mut pairs = Vec::new();
    for (di, &decode) in deployment.decode.iter().enumerate() {
        for (pi, &prefill) in deployment.prefill.iter().enumerate() {
            let (d, p) = (EngineId::decode(di as u16), EngineId::prefill(pi as u16));
            let shape = shape_of(prefill.tp, decode.tp);
            let mut targets = Vec::new();
            let mut slices = false;
            for rank in 0..prefill.tp {
                let plan = write_plan(shape, rank, rule, 0).map_err(|e| pair_error(d, p, e))?;
                slices |= plan.targets.iter().any(|t| !plan.copies_whole_block(t));
                targets.push(plan.decode_tp_ranks().collect());
            }
            let writers = (0..decode.tp)
                .map(|r| writers_of(shape, r, rule, 0).map(|w| w.len() as u16))
                .collect::<Result<_, _>>()
                .map_err(|e| pair_error(d, p, e))?;
            pairs.push(WritePairRoutes {
                decode_engine: d.to_string(),
                decode_layout: decode.to_string(),
                prefill_engine: p.to_string(),
                prefill_layout: prefill.to_string(),
                targets_per_prefill_tp_rank: targets,
                writers_per_decode_tp_rank: writers,
                slices_heads: slices,
            });
        }
    }

    let book = AddressBook::one_host_per_engine(deployment);
    let mut proxy = Proxy::new(deployment, policy.proxy);
    let prefill_ranks = deployment.ranks(Role::Prefill);
    let mut writes = vec![0u64; prefill_ranks.len()];
    let mut bytes = vec![0u64; prefill_ranks.len()];
    let requests = round_requests(deployment, rounds);
    // KV bytes of one token over all layers, for the whole model; a write moves its heads' part.
    let token_bytes = u64::from(model.bytes_per_token_per_layer) * u64::from(model.layers);
    let heads_total = if model.use_mla { 1 } else { u64::from(model.kv_heads.max(1)) };
    for k in 1..=requests {
        let RoutedRequest { id, prefill: prefill_slot, decode: decode_slot, transfer_id: transfer, .. } =
            route_request(&mut proxy, &book, deployment, k)?;
        let prefill_layout = deployment.layout(prefill_slot.engine);
        let decode_layout = deployment.layout(decode_slot.engine);
        let shape = shape_of(prefill_layout.tp, decode_layout.tp);
        let spread = spread_key(&transfer);
        for tp in 0..prefill_layout.tp {
            let plan = write_plan(shape, tp, rule, spread)
                .map_err(|e| pair_error(decode_slot.engine, prefill_slot.engine, e))?;
            let i =
                deployment.rank_index(crate::ids::RankId::new(prefill_slot.engine, prefill_slot.dp(), tp));
            for t in &plan.targets {
                // A target that writes no heads still sends a recurrent-state slice; these
                // models have none, so it moves nothing and is not a write.
                if t.heads > 0 {
                    writes[i] += 1;
                    bytes[i] += token_bytes * u64::from(t.heads) / heads_total;
                }
            }
        }
        proxy.handle_finished(id)?;
    }
    let rows = prefill_ranks
        .iter()
        .enumerate()
        .map(|(i, r)| WriteRankRow { rank: r.to_string(), writes: writes[i], bytes_per_token: bytes[i] })
        .collect();
    Ok(WriteRoutesReport {
        deployment: deployment.notation(),
        use_mla: model.use_mla,
        kv_heads: model.kv_heads,
        rules: rules.name().to_string(),
        write_rule: rule.name().to_string(),
        rounds,
        requests,
        pairs,
        prefill_ranks: rows,
        jain: jain_index(&bytes),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::topology::ModelSpec;

    fn bytes(notation: &str, heads: Option<u16>, rules: PeerRules) -> Vec<u64> {
        let mut d = Deployment::parse(notation).unwrap();
        if let Some(h) = heads {
            d = d.with_model(ModelSpec::gqa(h));
        }
        write_routes(&d, rules, 16).unwrap().prefill_ranks.iter().map(|r| r.bytes_per_token).collect()
    }

    /// TP8 prefill into DP8 TP1 decode with MLA: vLLM's first holder sends everything from TP
    /// rank 0; pdkv's spread rule uses all eight NICs.
    #[test]
    fn mla_fan_in_nic_table() {
        let vllm = bytes("2P_TP8:1D_DP8EP", None, PeerRules::Vllm033);
        let per_engine: u64 = vllm.iter().sum::<u64>() / 2;
        assert_eq!(vllm[0], per_engine);
        assert_eq!(vllm[8], per_engine);
        assert!(vllm.iter().enumerate().all(|(i, &b)| i % 8 == 0 || b == 0));
        let pdkv = bytes("2P_TP8:1D_DP8EP", None, PeerRules::Pdkv);
        assert_eq!(pdkv.iter().sum::<u64>(), vllm.iter().sum::<u64>());
        let jain = jain_index(&pdkv);
        assert!(jain > 0.95, "{pdkv:?} {jain}");
    }

    /// Split heads, TP4 into TP8: every prefill rank slices its two heads over two decode ranks;
    /// no rule changes who writes, and each decode rank waits for one writer.
    #[test]
    fn gqa_fan_out_table() {
        let d = Deployment::parse("2P_TP4:1D_TP8").unwrap().with_model(ModelSpec::gqa(8));
        let r = write_routes(&d, PeerRules::Pdkv, 16).unwrap();
        assert_eq!(r.pairs[0].targets_per_prefill_tp_rank, [vec![0, 1], vec![2, 3], vec![4, 5], vec![6, 7]]);
        assert_eq!(r.pairs[0].writers_per_decode_tp_rank, [1; 8]);
        assert!(r.pairs[0].slices_heads);
        assert!((r.jain - 1.0).abs() < 1e-12);
        let err = write_routes(&d, PeerRules::Vllm030, 16).unwrap_err();
        assert!(err.to_string().contains("before vLLM 0.33"), "{err}");
    }
}
