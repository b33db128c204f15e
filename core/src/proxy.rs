//! The proxy: which prefill and decode (engine, DP rank) serve each request, and READ ordering.
//!
//! Routing visits every (engine, DP rank) slot of a role equally by flat interleaving: the k-th
//! request (k from 1) takes slot `(k - 1) mod S` of the interleaved slot list, so consecutive
//! requests alternate engines. The historical aliasing rule is [`Legacy::ProxyAliasing`].
//!
//! READ ordering is a rule of the proxy's state, not a convention: the only way to obtain a
//! [`ProxyAction::SendDecode`] is [`Proxy::handle_prefill_response`] for a request whose prefill
//! is outstanding.

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Serialize};

use crate::ids::{EngineId, RequestId, Role, TransferId};
#[cfg(doc)]
use crate::legacy::Legacy;
use crate::params::KvTransferParams;
use crate::policy::{PeerBook, ProxyRule, TpSizeRule};
use crate::topology::{Deployment, Layout};

/// Requests the proxy tracks at once; more are refused rather than grown without bound.
pub const MAX_PROXY_IN_FLIGHT: usize = 1 << 20;

/// An engine and, when the engine has more than one DP rank, the DP rank that serves a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct Slot {
    /// The engine chosen.
    pub engine: EngineId,
    /// The DP rank chosen; `None` when the engine has a single DP rank, in which case no
    /// `remote_dp_rank` is sent.
    pub dp_rank: Option<u16>,
}

impl Slot {
    /// The DP rank, 0 when the engine has one.
    pub fn dp(&self) -> u16 {
        self.dp_rank.unwrap_or(0)
    }
}

impl fmt::Display for Slot {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.dp_rank {
            Some(dp) => write!(f, "{}.dp{dp}", self.engine),
            None => write!(f, "{}", self.engine),
        }
    }
}

/// Every (engine, DP rank) slot of one role in interleaved order: DP rank 0 of every engine,
/// then DP rank 1 of every engine that has one, and so on. With n engines of equal DP size D
/// this is `engine = slot mod n`, `dp = slot / n`.
pub fn flat_slots(engines: &[Layout], role: Role) -> Vec<Slot> {
    let max_dp = engines.iter().map(|l| l.dp).max().unwrap_or(0);
    let mut slots = Vec::new();
    for dp in 0..max_dp {
        for (index, layout) in engines.iter().enumerate() {
            if dp < layout.dp {
                let engine = EngineId { role, index: index as u16 };
                slots.push(Slot { engine, dp_rank: (layout.dp > 1).then_some(dp) });
            }
        }
    }
    slots
}

/// The slot of the k-th request (k from 1) under the fixed rule or the legacy aliasing rule.
/// Panics if `k` is 0 or `engines` is empty.
pub fn route(engines: &[Layout], role: Role, k: u64, rule: ProxyRule) -> Slot {
    assert!(k >= 1 && !engines.is_empty(), "k from 1 over a non-empty side");
    if rule == ProxyRule::OneCounter {
        // Historical: engine and DP rank from the same counter.
        let index = (k % engines.len() as u64) as usize;
        let layout = engines[index];
        let dp = (k % u64::from(layout.dp)) as u16;
        let engine = EngineId { role, index: index as u16 };
        return Slot { engine, dp_rank: (layout.dp > 1).then_some(dp) };
    }
    // The slot `flat_slots` lists at this position, found without listing them: the proxy
    // routes every request on both sides, and a 1,024-GPU deployment has hundreds of slots.
    let total: u64 = engines.iter().map(|l| u64::from(l.dp)).sum();
    let mut index = (k - 1) % total;
    for dp in 0.. {
        let round = engines.iter().filter(|l| dp < l.dp).count() as u64;
        if index < round {
            let (engine, layout) =
                engines.iter().enumerate().filter(|(_, l)| dp < l.dp).nth(index as usize).expect("counted");
            let engine = EngineId { role, index: engine as u16 };
            return Slot { engine, dp_rank: (layout.dp > 1).then_some(dp) };
        }
        index -= round;
    }
    unreachable!("the rounds hold every slot")
}

/// Where a request is in the proxy.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Phase {
    /// Sent to prefill; decode must not see it yet.
    Prefilling,
    /// Prefill answered and the request was sent to decode.
    Decoding,
}

/// The proxy's record of one request in flight.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProxyRequest {
    /// The `tx-<uuid>` id minted when the request arrived.
    pub transfer_id: TransferId,
    /// Prefill engine and DP rank that computes the KV and holds its blocks (the owner DP rank).
    pub prefill: Slot,
    /// Decode engine and DP rank that reads the KV and generates the output.
    pub decode: Slot,
    /// Whether prefill has answered yet.
    pub phase: Phase,
}

/// What the proxy asks its driver to do.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum ProxyAction {
    /// Send the prompt to prefill with `max_tokens = 1` and these parameters
    /// (`do_remote_decode`, `transfer_id`, and the decode side's DP and TP sizes).
    SendPrefill {
        /// The proxy's number for the request.
        request: RequestId,
        /// Prefill engine and DP rank to send to.
        slot: Slot,
        /// The `kv_transfer_params` to attach.
        params: KvTransferParams,
    },
    /// Send the request to decode with the prefill's answer plus `remote_dp_rank` and
    /// `remote_tp_size`.
    SendDecode {
        /// The proxy's number for the request.
        request: RequestId,
        /// Decode engine and DP rank to send to.
        slot: Slot,
        /// Prefill's answer with `remote_dp_rank` and `remote_tp_size` set and `tp_size` cleared.
        params: KvTransferParams,
    },
}

/// A call the proxy refuses.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ProxyError {
    /// The request was never issued, or it finished already.
    UnknownRequest(RequestId),
    /// A prefill answer for a request that is not waiting for one (duplicate answer).
    NotPrefilling(RequestId),
    /// Prefill answered with another transfer id than the one the proxy minted for the request.
    TransferIdMismatch {
        /// The request.
        request: RequestId,
        /// The id the proxy minted.
        minted: TransferId,
        /// The id prefill answered with.
        answered: String,
    },
    /// [`MAX_PROXY_IN_FLIGHT`] requests are in flight already; the new one is refused.
    TooManyInFlight {
        /// The limit that was reached.
        limit: usize,
    },
}

impl fmt::Display for ProxyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ProxyError::UnknownRequest(id) => write!(f, "{id} is not known to the proxy"),
            ProxyError::NotPrefilling(id) => write!(f, "{id} is not waiting for its prefill answer"),
            ProxyError::TransferIdMismatch { request, minted, answered } => {
                write!(
                    f,
                    "{request}: prefill answered transfer id {answered:?} but the proxy minted {minted}"
                )
            }
            ProxyError::TooManyInFlight { limit } => write!(f, "more than {limit} requests in flight"),
        }
    }
}

impl std::error::Error for ProxyError {}

/// The proxy's routing state and request table.
#[derive(Clone, Debug)]
pub struct Proxy {
    prefill: Vec<Layout>,
    decode: Vec<Layout>,
    rule: ProxyRule,
    /// Per decode engine: whether it reads the prefill TP size from `tp_size` alone (vLLM 0.25
    /// and 0.26), so the prefill's `tp_size` is passed through to it.
    tp_size_only: Vec<bool>,
    /// Requests routed so far; the next one is k = routed + 1.
    routed: u64,
    requests: BTreeMap<RequestId, ProxyRequest>,
}

impl Proxy {
    /// A proxy over the engines of `deployment` that has routed nothing yet, so the next request
    /// is number 1. Panics if either role has no engine.
    pub fn new(deployment: &Deployment, rule: ProxyRule) -> Proxy {
        assert!(!deployment.prefill.is_empty() && !deployment.decode.is_empty());
        Proxy {
            prefill: deployment.prefill.clone(),
            decode: deployment.decode.clone(),
            rule,
            tp_size_only: vec![false; deployment.decode.len()],
            routed: 0,
            requests: BTreeMap::new(),
        }
    }

    /// This proxy in front of engines following `peers`: a decode engine whose release reads
    /// the prefill TP size only from `tp_size` (vLLM 0.25 and 0.26) is forwarded the prefill's
    /// `tp_size` too, as vLLM's own router passes a prefill answer through. Without it such an
    /// engine falls back to 1 and reads every request from TP rank 0 (the historical pair,
    /// [`crate::legacy::Legacy::TpSizeKey`], which a pdkv engine with that option still shows).
    pub fn with_peers(mut self, peers: &PeerBook) -> Proxy {
        for (i, keep) in self.tp_size_only.iter_mut().enumerate() {
            *keep = peers.rules(EngineId::decode(i as u16)).tp_size() == TpSizeRule::TpSizeKeyOnly;
        }
        self
    }

    /// A client request arrives. `transfer_bits` are 128 random bits from the driver (seeded in
    /// the simulator) that become the `tx-<uuid>` transfer id.
    pub fn handle_request(&mut self, transfer_bits: u128) -> Result<(RequestId, ProxyAction), ProxyError> {
        if self.requests.len() >= MAX_PROXY_IN_FLIGHT {
            return Err(ProxyError::TooManyInFlight { limit: MAX_PROXY_IN_FLIGHT });
        }
        self.routed += 1;
        let k = self.routed;
        let id = RequestId(k);
        let prefill = route(&self.prefill, Role::Prefill, k, self.rule);
        let decode = route(&self.decode, Role::Decode, k, self.rule);
        let transfer_id = TransferId::from_u128(transfer_bits);
        let decode_layout = self.decode[usize::from(decode.engine.index)];
        let params = KvTransferParams {
            do_remote_decode: true,
            do_remote_prefill: false,
            transfer_id: Some(transfer_id.to_string()),
            remote_dp_size: Some(i64::from(decode_layout.dp)),
            remote_tp_size: Some(i64::from(decode_layout.tp)),
            ..KvTransferParams::default()
        };
        let request = ProxyRequest { transfer_id, prefill, decode, phase: Phase::Prefilling };
        self.requests.insert(id, request);
        Ok((id, ProxyAction::SendPrefill { request: id, slot: prefill, params }))
    }

    /// Prefill answered with its `kv_transfer_params`; only now may the request go to decode.
    pub fn handle_prefill_response(
        &mut self,
        id: RequestId,
        answer: KvTransferParams,
    ) -> Result<ProxyAction, ProxyError> {
        let request = self.requests.get_mut(&id).ok_or(ProxyError::UnknownRequest(id))?;
        if request.phase != Phase::Prefilling {
            return Err(ProxyError::NotPrefilling(id));
        }
        if let Some(answered) = &answer.transfer_id {
            if answered.as_str() != &*request.transfer_id.as_str() {
                return Err(ProxyError::TransferIdMismatch {
                    request: id,
                    minted: request.transfer_id.clone(),
                    answered: answered.clone(),
                });
            }
        }
        request.phase = Phase::Decoding;
        let prefill_layout = self.prefill[usize::from(request.prefill.engine.index)];
        let mut params = answer.forwarded(&request.transfer_id, request.prefill.dp_rank, prefill_layout.tp);
        if self.tp_size_only[usize::from(request.decode.engine.index)] {
            params.tp_size = Some(i64::from(prefill_layout.tp));
        }
        Ok(ProxyAction::SendDecode { request: id, slot: request.decode, params })
    }

    /// The request finished (decode done) or failed; the proxy forgets it.
    pub fn handle_finished(&mut self, id: RequestId) -> Result<ProxyRequest, ProxyError> {
        self.requests.remove(&id).ok_or(ProxyError::UnknownRequest(id))
    }

    /// The record of a request in flight; `None` once it finished, or if it was never issued.
    pub fn request(&self, id: RequestId) -> Option<&ProxyRequest> {
        self.requests.get(&id)
    }

    /// Requests the proxy tracks now, prefilling or decoding.
    pub fn in_flight(&self) -> usize {
        self.requests.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::legacy::{Legacy, LegacyOptions};
    use crate::policy::PeerRules;
    use crate::policy::Policy;

    fn side(engines: usize, dp: u16) -> Vec<Layout> {
        vec![Layout::new(dp, 1, dp > 1); engines]
    }

    /// (engines, dp) -> every slot is hit exactly `rounds` times in `rounds * n * D` requests,
    /// and consecutive requests alternate engines when there are several.
    #[test]
    fn flat_routing_covers_every_slot_equally() {
        let check = |n: usize, dp: u16| {
            let engines = side(n, dp);
            let rounds = 5u64;
            let total = rounds * n as u64 * u64::from(dp);
            let mut hits: BTreeMap<(u16, u16), u64> = BTreeMap::new();
            let mut previous: Option<u16> = None;
            for k in 1..=total {
                let slot = route(&engines, Role::Prefill, k, ProxyRule::FlatSlots);
                *hits.entry((slot.engine.index, slot.dp())).or_default() += 1;
                assert_eq!(slot.dp_rank.is_some(), dp > 1, "no DP rank when D = 1");
                if n > 1 {
                    assert_ne!(previous, Some(slot.engine.index), "({n},{dp}) k={k}");
                }
                previous = Some(slot.engine.index);
                let expected = (k - 1) % (n as u64 * u64::from(dp));
                assert_eq!(u64::from(slot.engine.index), expected % n as u64);
                assert_eq!(u64::from(slot.dp()), expected / n as u64);
            }
            assert_eq!(hits.len(), n * usize::from(dp), "({n},{dp}) slots visited");
            assert!(hits.values().all(|&h| h == rounds), "({n},{dp}): {hits:?}");
        };
        for (n, dp) in [(1, 1), (2, 1), (4, 1), (1, 8), (2, 8), (3, 8)] {
            check(n, dp);
        }
    }

    /// The fixed rule's slot of every request is `flat_slots`' entry at its position, whatever
    /// the engines' DP sizes.
    #[test]
    fn route_picks_the_flat_slot_of_each_request() {
        let layouts = [
            vec![Layout::new(2, 1, false), Layout::new(4, 1, false)],
            vec![Layout::new(1, 8, false); 3],
            vec![Layout::new(64, 1, true); 8],
            vec![Layout::new(3, 1, false), Layout::new(1, 2, false), Layout::new(5, 1, false)],
        ];
        for engines in layouts {
            let slots = flat_slots(&engines, Role::Decode);
            for k in 1..=3 * slots.len() as u64 + 1 {
                let want = slots[((k - 1) % slots.len() as u64) as usize];
                assert_eq!(route(&engines, Role::Decode, k, ProxyRule::FlatSlots), want, "k={k}");
            }
        }
    }

    #[test]
    fn flat_slots_interleave_engines_of_different_dp_sizes() {
        let engines = [Layout::new(2, 1, false), Layout::new(4, 1, false)];
        let shown: Vec<String> = flat_slots(&engines, Role::Prefill).iter().map(|s| s.to_string()).collect();
        assert_eq!(shown, ["P0.dp0", "P1.dp0", "P0.dp1", "P1.dp1", "P1.dp2", "P1.dp3"]);
    }

    /// Legacy aliasing with 2 engines of DP8: engine 0 sees only even DP ranks, engine 1 only
    /// odd ones, so half of the 16 slots are never used.
    #[test]
    fn legacy_aliasing_leaves_half_the_slots_idle() {
        let engines = side(2, 8);
        let legacy = Policy::from(LegacyOptions::none().with(Legacy::ProxyAliasing)).proxy;
        let mut hits: BTreeMap<(u16, u16), u64> = BTreeMap::new();
        for k in 1..=160 {
            let slot = route(&engines, Role::Prefill, k, legacy);
            *hits.entry((slot.engine.index, slot.dp())).or_default() += 1;
            assert_eq!(slot.engine.index % 2, slot.dp() % 2, "k={k}");
        }
        assert_eq!(hits.len(), 8);
    }

    #[test]
    fn decode_is_dispatched_only_after_prefill_answered() {
        let d = Deployment::parse("2P_DP8EP:1D_TP8").unwrap();
        let mut proxy = Proxy::new(&d, ProxyRule::FlatSlots);
        let (id, first) = proxy.handle_request(7).unwrap();
        let ProxyAction::SendPrefill { slot, params, .. } = first else { panic!("{first:?}") };
        assert_eq!(slot, Slot { engine: EngineId::prefill(0), dp_rank: Some(0) });
        assert_eq!(params.remote_tp_size, Some(8), "prefill learns decode's TP size");
        assert_eq!(params.transfer_id.as_deref(), Some("tx-00000000-0000-0000-0000-000000000007"));
        assert_eq!(proxy.request(id).unwrap().phase, Phase::Prefilling);

        let (id2, _) = proxy.handle_request(8).unwrap();
        assert_eq!(
            proxy.request(id2).unwrap().prefill,
            Slot { engine: EngineId::prefill(1), dp_rank: Some(0) }
        );

        let answer =
            KvTransferParams { tp_size: Some(1), remote_block_ids: vec![4, 5].into(), ..Default::default() };
        let action = proxy.handle_prefill_response(id, answer.clone()).unwrap();
        let ProxyAction::SendDecode { params, .. } = action else { panic!("{action:?}") };
        assert_eq!((params.remote_dp_rank, params.remote_tp_size), (Some(0), Some(1)));
        assert_eq!(params.remote_block_ids, vec![4, 5].into());
        assert!(params.do_remote_prefill);
        assert_eq!(params.transfer_id.as_deref(), Some("tx-00000000-0000-0000-0000-000000000007"));
        assert_eq!(proxy.handle_prefill_response(id, answer.clone()), Err(ProxyError::NotPrefilling(id)));
        let wrong = KvTransferParams { transfer_id: Some("tx-other".into()), ..Default::default() };
        let err = proxy.handle_prefill_response(id2, wrong).unwrap_err();
        assert!(err.to_string().contains("answered transfer id \"tx-other\""), "{err}");
        assert_eq!(
            proxy.handle_prefill_response(RequestId(99), answer),
            Err(ProxyError::UnknownRequest(RequestId(99)))
        );
        proxy.handle_finished(id).unwrap();
        assert_eq!(proxy.in_flight(), 1);
    }
    /// A decode engine that reads the prefill TP size from `tp_size` alone (vLLM 0.25, 0.26) is
    /// forwarded the prefill's `tp_size`, as vLLM's router passes it through; any other gets
    /// `remote_tp_size` only.
    #[test]
    fn tp_size_passes_through_to_a_decode_that_reads_only_it() {
        let d = Deployment::parse("1P_TP4:2D_TP2").unwrap();
        let peers =
            PeerBook { prefill: vec![PeerRules::Pdkv], decode: vec![PeerRules::Vllm025, PeerRules::Pdkv] };
        let mut proxy = Proxy::new(&d, ProxyRule::FlatSlots).with_peers(&peers);
        let mut forwarded = Vec::new();
        for k in 1..=2u128 {
            let (id, _) = proxy.handle_request(k).unwrap();
            let ProxyAction::SendDecode { slot, params, .. } =
                proxy.handle_prefill_response(id, KvTransferParams::default()).unwrap()
            else {
                panic!("a decode dispatch")
            };
            forwarded.push((slot.engine.index, params.tp_size, params.remote_tp_size));
        }
        forwarded.sort_unstable();
        assert_eq!(forwarded, [(0, Some(4), Some(4)), (1, None, Some(4))]);
    }
}
