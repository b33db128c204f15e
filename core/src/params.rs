//! The `kv_transfer_params` a decode request carries, and the strict reading of its sizes.
//!
//! MoRIIO's prefill answers with `tp_size`; the proxy adds `remote_tp_size` and `remote_dp_rank`
//! when it forwards the request to decode. A historical reader looked only at `tp_size` and
//! defaulted to 1, collapsing every read onto TP rank 0; pdkv reads both, prefers the explicit
//! `remote_tp_size`, and rejects missing or non-positive sizes.

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::ids::{Incarnation, TransferId};
#[cfg(doc)]
use crate::legacy::Legacy;
use crate::policy::TpSizeRule;
use crate::ports::EngineAddress;
use crate::topology::{Layout, MAX_PARALLEL_SIZE};
use crate::wire::{Extension, Extensions};

/// The remote-prefill fields of a decode request's `kv_transfer_params`, as received. Sizes
/// are kept as the signed integers a peer may send, so bad values can be reported, not wrapped.
/// An absent key is left out, never written as `null`: MoRIIO reads optional keys with
/// `params.get(key, default)`, which returns the `None` of a key present as null, and then fails on
/// `int(None)` (vLLM 0.33's `remote_dp_rank`, found by the mixed deployments of
/// `cargo xtask moriio-conformance`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(default)]
pub struct KvTransferParams {
    /// True on prefill's answer and the request to decode: the KV was computed remotely and
    /// decode must read it before its first step.
    pub do_remote_prefill: bool,
    /// True on the request to prefill: decode runs elsewhere, so prefill keeps the request's
    /// blocks after the step (delayed free) until releases or the reaper free them.
    pub do_remote_decode: bool,
    /// The proxy's `tx-<uuid>` id of the transfer; releases name it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub transfer_id: Option<String>,
    /// Prefill's KV block ids holding the prompt, in the owner DP rank's pool; decode reads them.
    /// One list per KV cache group as MoRIIO writes it, or one flat list.
    pub remote_block_ids: BlockIds,
    /// MoRIIO engine id of the prefill engine, `"<host>:<handshake port base>"`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub remote_engine_id: Option<String>,
    /// Host of the prefill engine's handshake and notify listeners.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub remote_host: Option<String>,
    /// Base of the prefill engine's handshake listeners; rank (dp, tp) listens at
    /// `base + dp * tp_size + tp`. Kept as received, not validated here.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub remote_handshake_port: Option<i64>,
    /// Base of the prefill engine's notify (release) listeners, offset per rank like the
    /// handshake base. Kept as received, not validated here.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub remote_notify_port: Option<i64>,
    /// DP size of the other side: decode's on the request to prefill, prefill's on the answer and
    /// on the request to decode. Read as 1 when absent.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub remote_dp_size: Option<i64>,
    /// The prefill DP rank that owns the request (holds its blocks), added by the proxy on the
    /// request to decode; absent when the prefill engine has one DP rank. pdkv's prefill leaves it
    /// to the proxy at DP 1; MoRIIO's producer always writes its own (global) DP rank.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub remote_dp_rank: Option<i64>,
    /// Prefill's own TP size as prefill writes it in its answer; the proxy clears it when it sets
    /// `remote_tp_size`. Read only when `remote_tp_size` is absent, except under
    /// [`Legacy::TpSizeKey`], where it is the only key read.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tp_size: Option<i64>,
    /// TP size of the other side: decode's on the request to prefill, prefill's on the request to
    /// decode. Preferred over `tp_size`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub remote_tp_size: Option<i64>,
    /// pdkv's own key: the extensions of MoRIIO's protocol the prefill engine speaks, by name
    /// (`["read_lease"]`), as a pdkv prefill engine writes them in its answer and the proxy
    /// forwards them (it keeps the answer's keys). Absent from a MoRIIO engine's answer, and
    /// then not sent. Kept as received; see [`KvTransferParams::advertised_extensions`].
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pdkv_extensions: Option<Vec<String>>,
    /// pdkv's own key: the incarnation of every TP rank of the owner DP group that holds the
    /// transfer's blocks, indexed by TP rank, as a pdkv prefill engine writes it in its answer
    /// (the proxy forwards it). A decode rank acts on the transfer only through a session with
    /// the incarnation named for the rank it uses. Absent from a MoRIIO engine's answer. Kept as
    /// received; see [`KvTransferParams::holder_incarnations`].
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pdkv_incarnations: Option<Vec<i64>>,
}

/// `remote_block_ids`, as received or to be sent. vLLM's MoRIIO producer (0.33 and 0.34 alike)
/// writes one list per KV cache group (`[[3, 4, 5]]` for a model with full attention only), and
/// its consumer reads nothing else: its scheduler zips the groups with its own, so a flat list
/// raises there. pdkv wrote a flat list until its prefill met MoRIIO's decode inside vLLM; it now
/// writes MoRIIO's shape and reads both, so a writer of the flat form (an older pdkv, a test
/// harness) is still understood.
///
/// pdkv moves one KV cache group (models with full attention only), so a list of several groups
/// is kept as received and refused where it is used ([`BlockIds::single_group`]).
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(untagged)]
pub enum BlockIds {
    /// One flat list.
    Flat(Vec<u64>),
    /// One list per KV cache group.
    PerGroup(Vec<Vec<u64>>),
}

impl Default for BlockIds {
    fn default() -> BlockIds {
        BlockIds::Flat(Vec::new())
    }
}

impl From<Vec<u64>> for BlockIds {
    fn from(ids: Vec<u64>) -> BlockIds {
        BlockIds::Flat(ids)
    }
}

impl BlockIds {
    /// The block ids of the one KV cache group pdkv moves; an error when the list names none or
    /// several.
    pub fn single_group(&self) -> Result<&[u64], ParamsError> {
        match self {
            BlockIds::Flat(ids) => Ok(ids),
            BlockIds::PerGroup(groups) if groups.len() == 1 => Ok(&groups[0]),
            BlockIds::PerGroup(groups) => Err(ParamsError::KvCacheGroups { groups: groups.len() }),
        }
    }
}

/// `pdkv_incarnations` as a pdkv prefill engine writes it in its answer: the holding
/// incarnations of the owner DP group's TP ranks, in TP rank order.
pub fn incarnation_values(incarnations: &[Incarnation]) -> Option<Vec<i64>> {
    // An incarnation has 53 bits, so it always fits an i64.
    Some(incarnations.iter().map(|i| i.value() as i64).collect())
}

/// `pdkv_extensions` as a pdkv prefill engine writes it in its answer.
pub fn extension_names(extensions: Extensions) -> Option<Vec<String>> {
    Some(extensions.iter().map(|e| e.wire_name().to_owned()).collect())
}

/// What a prefill engine tells the proxy of one request whose prompt it computed: the source
/// of the one place its `kv_transfer_params` are built ([`KvTransferParams::prefill_answer`]).
#[derive(Clone, Copy, Debug)]
pub struct PrefillAnswer<'a> {
    /// The transfer, as the proxy minted it (absent from an answer that does not echo it).
    pub transfer_id: Option<&'a TransferId>,
    /// The blocks holding the prompt's KV on every rank of the owner DP group.
    pub blocks: &'a [u32],
    /// Where the engine's ranks listen, and its engine id.
    pub address: &'a EngineAddress,
    /// The engine's layout.
    pub layout: Layout,
    /// The extensions the engine's connector advertises (none from another connector's).
    pub extensions: Extensions,
    /// The incarnation of each TP rank holding the transfer, when the engine names them.
    pub holders: Option<&'a [Incarnation]>,
    /// Whether `remote_block_ids` is written as one list per KV cache group (vLLM 0.30 on,
    /// and pdkv) rather than one flat list, which a decode before 0.30 needs: it reads the value
    /// as block ids, so a list of lists is not understood there
    /// ([`crate::policy::PeerRules::block_ids_per_group`]).
    pub blocks_per_group: bool,
}

impl PrefillAnswer<'_> {
    /// The extensions an engine's connector advertises: its rule set's (none from an engine
    /// another connector plays), with authenticated control messages when its ranks hold the
    /// deployment's key. A decode rank leases before it dials, on this word, so it must name
    /// auth too.
    pub fn advertised(rule_set: Extensions, keyed: bool) -> Extensions {
        if rule_set.has(Extension::ReadLease) && keyed {
            rule_set.with(Extension::Auth)
        } else {
            rule_set
        }
    }
}

impl KvTransferParams {
    /// A prefill engine's answer, as MoRIIO's producer writes it (one KV cache group; no DP
    /// rank: the proxy adds the one it routed to) with pdkv's extension keys.
    pub fn prefill_answer(answer: &PrefillAnswer) -> KvTransferParams {
        let address = answer.address;
        KvTransferParams {
            do_remote_prefill: true,
            transfer_id: answer.transfer_id.map(|t| t.to_string()),
            remote_block_ids: {
                let ids: Vec<u64> = answer.blocks.iter().map(|&b| u64::from(b)).collect();
                if answer.blocks_per_group {
                    BlockIds::PerGroup(vec![ids])
                } else {
                    BlockIds::Flat(ids)
                }
            },
            remote_engine_id: Some(address.engine_id()),
            remote_host: Some(address.host.clone()),
            remote_handshake_port: Some(i64::from(address.handshake_port_base)),
            remote_notify_port: Some(i64::from(address.notify_port_base)),
            remote_dp_size: Some(i64::from(answer.layout.dp)),
            tp_size: Some(i64::from(answer.layout.tp)),
            pdkv_extensions: extension_names(answer.extensions),
            pdkv_incarnations: answer.holders.and_then(incarnation_values),
            ..KvTransferParams::default()
        }
    }

    /// A prefill answer as the proxy forwards it to decode: the transfer id the proxy minted
    /// (whether or not prefill echoed it), the DP rank it routed the prefill to (`None` for a
    /// single DP group), and one TP size field, the explicit `remote_tp_size`, so a reader that
    /// looks only at `tp_size` (`Legacy::TpSizeKey`) falls back to 1, exactly as the historical
    /// pair did.
    pub fn forwarded(
        self,
        transfer_id: &TransferId,
        dp_rank: Option<u16>,
        prefill_tp: u16,
    ) -> KvTransferParams {
        KvTransferParams {
            do_remote_prefill: true,
            do_remote_decode: false,
            remote_dp_rank: dp_rank.map(i64::from),
            remote_tp_size: Some(i64::from(prefill_tp)),
            tp_size: None,
            transfer_id: Some(transfer_id.to_string()),
            ..self
        }
    }
}

/// A size or rank in `kv_transfer_params` that cannot be used.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum ParamsError {
    /// No key carries the prefill TP size.
    Missing {
        /// The key or keys looked for, e.g. `remote_tp_size (or tp_size)`.
        #[serde(deserialize_with = "error_field")]
        field: ErrorField,
    },
    /// `pdkv_incarnations` does not name one incarnation per TP rank of the prefill engine.
    IncarnationCount {
        /// Incarnations named.
        len: usize,
        /// The prefill TP size.
        tp: u16,
    },
    /// `remote_block_ids` names a number of KV cache groups other than one.
    KvCacheGroups {
        /// Groups named.
        groups: usize,
    },
    /// A size outside 1..=256, an owner DP rank outside 0..=255, or an incarnation outside
    /// 1..=2^53-1.
    OutOfRange {
        /// The key that held the value.
        #[serde(deserialize_with = "error_field")]
        field: ErrorField,
        /// The value as received.
        value: i64,
        /// Smallest accepted value.
        min: i64,
        /// Largest accepted value.
        max: i64,
    },
}

impl fmt::Display for ParamsError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ParamsError::Missing { field } => write!(f, "kv_transfer_params lacks {field}"),
            ParamsError::IncarnationCount { len, tp } => write!(
                f,
                "kv_transfer_params pdkv_incarnations names {len} incarnations for a prefill TP size of {tp}"
            ),
            ParamsError::KvCacheGroups { groups } => write!(
                f,
                "kv_transfer_params remote_block_ids names {groups} KV cache groups; pdkv moves exactly one (models with full attention only)"
            ),
            ParamsError::OutOfRange { field, value, min, max } => {
                write!(f, "kv_transfer_params {field} = {value} is outside {min}..={max}")
            }
        }
    }
}

impl std::error::Error for ParamsError {}

/// The key a [`ParamsError`] names. Spelled through an alias so that serde's derive, which reads
/// types by their spelling, does not take a `&'static str` as borrowed from the input.
type ErrorField = &'static str;

/// Every key a [`ParamsError`] names: an error read back from a driver's channel names one of
/// them, so its field stays a `&'static str`.
const ERROR_FIELDS: [&str; 6] = [
    "remote_tp_size (or tp_size)",
    "tp_size",
    "remote_tp_size",
    "remote_dp_size",
    "pdkv_incarnations",
    "remote_dp_rank",
];

/// Reads the field of a [`ParamsError`] back: one of [`ERROR_FIELDS`], or an error naming it.
fn error_field<'de, D: serde::Deserializer<'de>>(d: D) -> Result<ErrorField, D::Error> {
    let name = String::deserialize(d)?;
    ERROR_FIELDS
        .into_iter()
        .find(|&field| field == name)
        .ok_or_else(|| serde::de::Error::custom(format!("{name:?} is no kv_transfer_params key")))
}

fn in_range(field: &'static str, value: i64, min: i64, max: i64) -> Result<u16, ParamsError> {
    if value < min || value > max {
        return Err(ParamsError::OutOfRange { field, value, min, max });
    }
    Ok(value as u16)
}

impl KvTransferParams {
    /// The prefill TP size: `remote_tp_size`, else `tp_size`; must be in 1..=256. Under
    /// [`TpSizeRule::TpSizeKeyOnly`], only `tp_size`, defaulting to 1 (the historical collapse).
    pub fn prefill_tp_size(&self, rule: TpSizeRule) -> Result<u16, ParamsError> {
        let max = i64::from(MAX_PARALLEL_SIZE);
        if rule == TpSizeRule::TpSizeKeyOnly {
            return in_range("tp_size", self.tp_size.unwrap_or(1), 1, max);
        }
        match (self.remote_tp_size, self.tp_size) {
            (Some(v), _) => in_range("remote_tp_size", v, 1, max),
            (None, Some(v)) => in_range("tp_size", v, 1, max),
            (None, None) => Err(ParamsError::Missing { field: "remote_tp_size (or tp_size)" }),
        }
    }

    /// The prefill layout as far as reads need it: DP size (default 1) and TP size.
    pub fn prefill_layout(&self, rule: TpSizeRule) -> Result<Layout, ParamsError> {
        let dp =
            in_range("remote_dp_size", self.remote_dp_size.unwrap_or(1), 1, i64::from(MAX_PARALLEL_SIZE))?;
        Ok(Layout::new(dp, self.prefill_tp_size(rule)?, false))
    }

    /// What the prefill engine advertised in `pdkv_extensions`: `None` when the key is absent
    /// (a MoRIIO engine, or one that says nothing); names this pdkv does not know are ignored.
    pub fn advertised_extensions(&self) -> Option<Extensions> {
        let names = self.pdkv_extensions.as_ref()?;
        Some(
            names
                .iter()
                .filter_map(|name| Extension::from_wire_name(name))
                .fold(Extensions::NONE, Extensions::with),
        )
    }

    /// The incarnations holding the transfer, one per TP rank of the prefill engine (`tp`):
    /// `None` when `pdkv_incarnations` is absent (a MoRIIO engine's answer, which no fence
    /// protects), an error when the list is not one per rank or names a value outside
    /// `1..=2^53-1`.
    pub fn holder_incarnations(&self, tp: u16) -> Result<Option<Vec<Incarnation>>, ParamsError> {
        let Some(values) = &self.pdkv_incarnations else { return Ok(None) };
        if values.len() != usize::from(tp) {
            return Err(ParamsError::IncarnationCount { len: values.len(), tp });
        }
        let max = Incarnation::MAX as i64;
        values
            .iter()
            .map(|&v| {
                u64::try_from(v).ok().and_then(Incarnation::new).ok_or(ParamsError::OutOfRange {
                    field: "pdkv_incarnations",
                    value: v,
                    min: 1,
                    max,
                })
            })
            .collect::<Result<Vec<_>, _>>()
            .map(Some)
    }

    /// The request's owner DP rank on the prefill side (`remote_dp_rank`): `None` when absent,
    /// which [`ReadRouter::resolve`](crate::routing::ReadRouter::resolve) reads as DP rank 0.
    /// Rejects values outside 0..=255; the router checks the rank against the engine's DP size.
    pub fn owner_dp(&self) -> Result<Option<u16>, ParamsError> {
        self.remote_dp_rank
            .map(|v| in_range("remote_dp_rank", v, 0, i64::from(MAX_PARALLEL_SIZE) - 1))
            .transpose()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::legacy::{Legacy, LegacyOptions};
    use crate::policy::Policy;

    /// (the decode engine's rules) -> the answer's `remote_block_ids` as JSON: one flat list for
    /// a decode of vLLM 0.27 to 0.29, one list per KV cache group for the others; pdkv reads
    /// either back as the same blocks.
    #[test]
    fn a_prefill_answer_has_the_block_shape_its_reader_reads() {
        use crate::policy::PeerRules;
        let address = crate::ports::EngineAddress {
            host: "127.0.0.1".into(),
            handshake_port_base: 6301,
            notify_port_base: 61005,
        };
        let check = |rules: PeerRules, expected: &str| {
            let answer = KvTransferParams::prefill_answer(&PrefillAnswer {
                transfer_id: None,
                blocks: &[7, 9],
                address: &address,
                layout: crate::topology::Layout::new(1, 2, false),
                extensions: Extensions::NONE,
                holders: None,
                blocks_per_group: rules.block_ids_per_group(),
            });
            let json = serde_json::to_value(&answer).unwrap();
            assert_eq!(json["remote_block_ids"].to_string(), expected, "{rules}");
            assert_eq!(answer.remote_block_ids.single_group(), Ok(&[7u64, 9][..]), "{rules}");
        };
        check(PeerRules::Vllm027, "[7,9]");
        check(PeerRules::Vllm028, "[7,9]");
        for rules in [PeerRules::Pdkv, PeerRules::Vllm030, PeerRules::Vllm033] {
            check(rules, "[[7,9]]");
        }
    }

    /// (tp_size, remote_tp_size, legacy?) -> prefill TP size or error text.
    #[test]
    fn prefill_tp_size_table() {
        let check = |tp: Option<i64>, remote: Option<i64>, legacy: bool, expected: Result<u16, &str>| {
            let params = KvTransferParams { tp_size: tp, remote_tp_size: remote, ..Default::default() };
            let options = if legacy {
                Policy::from(LegacyOptions::none().with(Legacy::TpSizeKey))
            } else {
                Policy::fixed()
            };
            let got = params.prefill_tp_size(options.tp_size).map_err(|e| e.to_string());
            match expected {
                Ok(n) => assert_eq!(got, Ok(n), "{tp:?} {remote:?} {legacy}"),
                Err(text) => assert!(got.as_ref().unwrap_err().contains(text), "{got:?}"),
            }
        };
        check(None, Some(8), false, Ok(8));
        check(Some(8), None, false, Ok(8));
        check(Some(4), Some(8), false, Ok(8));
        check(None, None, false, Err("lacks remote_tp_size"));
        check(None, Some(0), false, Err("remote_tp_size = 0 is outside 1..=256"));
        check(None, Some(-8), false, Err("remote_tp_size = -8"));
        check(Some(0), None, false, Err("tp_size = 0"));
        check(None, Some(100_000), false, Err("outside 1..=256"));
        // The historical reader: remote_tp_size is ignored and the size collapses to 1.
        check(None, Some(8), true, Ok(1));
        check(Some(8), None, true, Ok(8));
    }

    /// A driver's channel carries these errors as values: every one the reads of this module
    /// make reads back equal from MessagePack, every key of [`ERROR_FIELDS`] is one of them, and
    /// a key the module never names is refused.
    #[test]
    fn errors_round_trip_through_messagepack_and_name_only_known_keys() {
        let params = |f: fn(&mut KvTransferParams)| {
            let mut p = KvTransferParams::default();
            f(&mut p);
            p
        };
        let errors = [
            params(|_| {}).prefill_tp_size(TpSizeRule::RemoteTpSize).unwrap_err(),
            params(|p| p.tp_size = Some(0)).prefill_tp_size(TpSizeRule::TpSizeKeyOnly).unwrap_err(),
            params(|p| p.remote_tp_size = Some(0)).prefill_tp_size(TpSizeRule::RemoteTpSize).unwrap_err(),
            params(|p| p.remote_dp_size = Some(0)).prefill_layout(TpSizeRule::RemoteTpSize).unwrap_err(),
            params(|p| p.pdkv_incarnations = Some(vec![0])).holder_incarnations(1).unwrap_err(),
            params(|p| p.pdkv_incarnations = Some(vec![1])).holder_incarnations(2).unwrap_err(),
            params(|p| p.remote_dp_rank = Some(-1)).owner_dp().unwrap_err(),
            params(|p| p.remote_block_ids = BlockIds::PerGroup(vec![vec![1], vec![2]]))
                .remote_block_ids
                .single_group()
                .unwrap_err(),
        ];
        let mut named = Vec::new();
        for error in errors {
            let bytes = rmp_serde::to_vec_named(&error).unwrap();
            assert_eq!(rmp_serde::from_slice::<ParamsError>(&bytes).unwrap(), error);
            if let ParamsError::Missing { field } | ParamsError::OutOfRange { field, .. } = error {
                named.push(field);
            }
        }
        named.sort_unstable();
        let mut all = ERROR_FIELDS.to_vec();
        all.sort_unstable();
        assert_eq!(named, all);
        #[derive(Serialize)]
        enum Stranger {
            Missing { field: &'static str },
        }
        let stranger = rmp_serde::to_vec_named(&Stranger::Missing { field: "tp_sizes" }).unwrap();
        let read = rmp_serde::from_slice::<ParamsError>(&stranger).unwrap_err();
        assert!(read.to_string().contains("\"tp_sizes\" is no kv_transfer_params key"), "{read}");
    }

    #[test]
    fn owner_dp_defaults_to_none_and_rejects_negative() {
        let mut params = KvTransferParams::default();
        assert_eq!(params.owner_dp(), Ok(None));
        params.remote_dp_rank = Some(3);
        assert_eq!(params.owner_dp(), Ok(Some(3)));
        params.remote_dp_rank = Some(-1);
        assert!(params.owner_dp().is_err());
    }

    /// Legacy `tp_size` key: with only `remote_tp_size` sent, every decode rank of a TP8
    /// engine reads prefill TP rank 0.
    #[test]
    fn legacy_tp_size_key_collapses_reads_onto_rank_zero() {
        use crate::ids::{EngineId, RankId};
        use crate::routing::ReadRouter;
        use crate::topology::ModelSpec;
        let params = KvTransferParams { remote_tp_size: Some(8), ..Default::default() };
        for (legacy, expected) in [
            (Policy::fixed(), vec![0, 1, 2, 3, 4, 5, 6, 7]),
            (Policy::from(LegacyOptions::none().with(Legacy::TpSizeKey)), vec![0; 8]),
        ] {
            let prefill = params.prefill_layout(legacy.tp_size).unwrap();
            let reads: Vec<u16> = (0..8)
                .map(|r| {
                    let local = RankId::new(EngineId::decode(0), 0, r);
                    let mut router = ReadRouter::new(local, Layout::tp(8), ModelSpec::deepseek_r1(), legacy);
                    router.resolve(EngineId::prefill(0), prefill, None).unwrap().rank.tp
                })
                .collect();
            assert_eq!(reads, expected, "{legacy:?}");
        }
    }

    /// `pdkv_incarnations` as received: absent is unfenced, one per TP rank in range is read,
    /// anything else is refused with what is wrong.
    #[test]
    fn holder_incarnations_are_one_per_rank_in_range() {
        let check = |values: Option<Vec<i64>>, tp: u16, expected: Result<Option<Vec<u64>>, &str>| {
            let params = KvTransferParams { pdkv_incarnations: values.clone(), ..Default::default() };
            let got = params
                .holder_incarnations(tp)
                .map(|v| v.map(|v| v.iter().map(|i| i.value()).collect::<Vec<u64>>()))
                .map_err(|e| e.to_string());
            match expected {
                Ok(v) => assert_eq!(got, Ok(v), "{values:?}"),
                Err(text) => assert!(got.as_ref().is_err_and(|e| e.contains(text)), "{values:?}: {got:?}"),
            }
        };
        let max = Incarnation::MAX as i64;
        check(None, 2, Ok(None));
        check(Some(vec![7, 9]), 2, Ok(Some(vec![7, 9])));
        check(Some(vec![max]), 1, Ok(Some(vec![Incarnation::MAX])));
        check(Some(vec![7]), 2, Err("names 1 incarnations for a prefill TP size of 2"));
        check(Some(vec![]), 1, Err("names 0 incarnations"));
        check(Some(vec![0, 1]), 2, Err("pdkv_incarnations = 0 is outside 1..=9007199254740991"));
        check(Some(vec![1, -5]), 2, Err("= -5 is outside"));
        check(Some(vec![max + 1]), 1, Err("is outside"));
        let written = incarnation_values(&[Incarnation::new(3).unwrap(), Incarnation::new(4).unwrap()]);
        assert_eq!(written, Some(vec![3, 4]));
    }

    /// `pdkv_extensions` as received: absent says nothing, a list names what the engine speaks
    /// (unknown names ignored), and a pdkv engine's answer reads back as what it wrote.
    #[test]
    fn advertised_extensions_come_from_the_engine_answer() {
        let with = |names: Option<&[&str]>| KvTransferParams {
            pdkv_extensions: names.map(|n| n.iter().map(|s| s.to_string()).collect()),
            ..Default::default()
        };
        let cases: [(Option<&[&str]>, Option<Extensions>); 6] = [
            (None, None),
            (Some(&[]), Some(Extensions::NONE)),
            (Some(&["read_lease", "incarnation"]), Some(Extensions::ALL)),
            (Some(&["later_thing", "incarnation", "read_lease"]), Some(Extensions::ALL)),
            (Some(&["read_lease"]), Some(Extensions::NONE.with(Extension::ReadLease))),
            (Some(&["later_thing"]), Some(Extensions::NONE)),
        ];
        for (names, expected) in cases {
            assert_eq!(with(names).advertised_extensions(), expected, "{names:?}");
        }
        let written =
            KvTransferParams { pdkv_extensions: extension_names(Extensions::ALL), ..Default::default() };
        assert_eq!(written.pdkv_extensions, Some(vec!["read_lease".to_owned(), "incarnation".to_owned()]));
        assert_eq!(written.advertised_extensions(), Some(Extensions::ALL));
    }

    /// `remote_block_ids` in both shapes: read from the JSON each release writes, written back
    /// unchanged (a proxy that parses and re-serializes keeps the peer's shape), and turned into
    /// the one group pdkv reads or refused with what is wrong.
    #[test]
    fn remote_block_ids_read_in_both_shapes() {
        let check = |json: &str, reads: bool, expected: Result<&[u64], &str>| {
            let text = format!("{{\"remote_block_ids\": {json}}}");
            let params = serde_json::from_str::<KvTransferParams>(&text);
            if !reads {
                let error = params.expect_err(json).to_string();
                assert!(error.contains(expected.unwrap_err()), "{json}: {error}");
                return;
            }
            let params = params.expect(json);
            let back = serde_json::to_value(&params).unwrap()["remote_block_ids"].clone();
            assert_eq!(back, serde_json::from_str::<serde_json::Value>(json).unwrap(), "{json}");
            let got = params.remote_block_ids.single_group().map_err(|e| e.to_string());
            match expected {
                Ok(ids) => assert_eq!(got, Ok(ids), "{json}"),
                Err(text) => assert!(got.as_ref().is_err_and(|e| e.contains(text)), "{json}: {got:?}"),
            }
        };
        check("[3, 4, 5]", true, Ok(&[3, 4, 5]));
        check("[]", true, Ok(&[]));
        check("[[3, 4, 5]]", true, Ok(&[3, 4, 5]));
        check("[[]]", true, Ok(&[]));
        check("[[3], [4]]", true, Err("names 2 KV cache groups; pdkv moves exactly one"));
        check("[3, [4]]", false, Err("did not match any variant"));
        check("[-1]", false, Err("did not match any variant"));
        check("[[18446744073709551616]]", false, Err("did not match any variant"));
        check("\"3\"", false, Err("did not match any variant"));
    }
}
