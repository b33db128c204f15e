//! The notify socket's messages: the release map (MoRIIO's, with pdkv's optional sender keys;
//! [`Release`] is also what the ledger counts), pdkv's read lease, the [`Mac`] both may carry,
//! and WRITE mode's `remote_blocks`, `write_done` and `write_failed`, each with its wire mirror and its decoder. The legacy plain-string completion has no map and is decoded in `wire`.

use serde::{Deserialize, Serialize};

use super::error::WireError;
use super::fields::{blob, group, narrow, opt_incarnation, Fields, U16_MAX, U32_MAX};
use super::handshake::Bin;
use super::limits::MAX_BLOCK_IDS;
use crate::ids::{Incarnation, TransferId};

/// Bytes of a [`Mac`]: HMAC-SHA-256 truncated to its first 128 bits.
pub const MAC_BYTES: usize = 16;

/// A message's MAC (`pdkv_mac` on the wire, 16 bytes), computed and checked by [`crate::auth`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Mac(pub [u8; MAC_BYTES]);

/// Who sent a release: pdkv's optional sender fields (a MoRIIO peer sends none).
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct ReleaseSender {
    /// MoRIIO engine id of the decode engine, `"<host>:<handshake port base>"`.
    pub engine_id: String,
    /// DP rank of the decode worker that read.
    pub dp_rank: u16,
    /// TP rank of the decode worker that read, below the release's `consumer_tp_size`.
    pub tp_rank: u16,
}

/// One release message as the ledger sees it, whatever its wire form.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, Hash)]
pub struct Release {
    /// The transfer whose blocks the sender has finished reading.
    pub transfer_id: TransferId,
    /// Decode TP size; `None` for the legacy plain-string completion, which carries only the id.
    pub consumer_tp_size: Option<u16>,
    /// The decode rank that sent it, when the peer is pdkv; `None` is an anonymous release,
    /// which always counts.
    pub sender: Option<ReleaseSender>,
    /// The incarnation of the addressed prefill rank that holds the transfer, when the sender
    /// knows it (a pdkv decode rank releasing a pdkv prefill rank); the prefill worker ignores a
    /// release naming another incarnation of it. `None` is unfenced.
    pub incarnation: Option<Incarnation>,
    /// Its MAC under the deployment's key, when the sender has the key and the addressed rank
    /// advertised `auth` ([`crate::auth`]).
    pub mac: Option<Mac>,
}

/// A decode rank's notice of which of its blocks a prefill rank should write into (WRITE mode).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RemoteBlocks {
    /// vLLM's request id on the decode side (`req_id` on the wire).
    pub req_id: String,
    /// The transfer the blocks are for.
    pub transfer_id: TransferId,
    /// Decode-side block ids (`block_notify_list`), never empty.
    pub block_ids: Vec<u32>,
    /// The decode DP rank, global across pods (`decode_rank`).
    pub decode_dp_rank: u16,
}

/// A prefill rank's notice that all its writes of a transfer landed (WRITE mode).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WriteDone {
    /// The transfer whose writes landed.
    pub transfer_id: TransferId,
    /// How many prefill ranks write the addressed decode rank, each sending one `write_done`
    /// (`num_writers`, vLLM 0.33 on, sent only when not 1; see [`crate::write`]). The decode
    /// rank has its KV once it counted this many.
    pub writers: u16,
}

impl WriteDone {
    /// The notice of a transfer written by one prefill rank alone.
    pub fn single(transfer_id: TransferId) -> WriteDone {
        WriteDone { transfer_id, writers: 1 }
    }
}

/// A prefill rank's notice that it gave up on a transfer before writing it: the decode blocks
/// never arrived (WRITE mode, vLLM 0.33 on, `{"type": "write_failed", "transfer_id"}`). It is
/// sent to every decode DP rank because the one that took the request is unknown; the others
/// drop it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WriteFailed {
    /// The transfer given up on.
    pub transfer_id: TransferId,
}

/// A decode rank's promise that its reads of a transfer end within `lease_ms` (pdkv's own
/// message, `{"type": "read_lease", "transfer_id", "lease_ms"}`; a MoRIIO peer never sends it,
/// and is never sent it: only a rank that advertised
/// [`Extension::ReadLease`](super::Extension::ReadLease) is). The producer's reaper does not free
/// the transfer's blocks before the lease ends, because a read may still be in flight until then.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReadLease {
    /// The transfer about to be read.
    pub transfer_id: TransferId,
    /// How long the reads may last, from when the lease is sent, in milliseconds (at least 1).
    pub lease_ms: u32,
    /// The incarnation of the leased rank that holds the transfer (`pdkv_incarnation`), sent to a
    /// rank that advertised [`Extension::Incarnation`](super::Extension::Incarnation); the rank
    /// ignores a lease naming another incarnation of it.
    pub incarnation: Option<Incarnation>,
    /// The lease's MAC under the deployment's key (`pdkv_mac`), sent to a rank that advertised
    /// [`Extension::Auth`](super::Extension::Auth) ([`crate::auth`]).
    pub mac: Option<Mac>,
}

#[derive(Serialize)]
pub(super) struct ReleaseWire<'a> {
    #[serde(rename = "type")]
    pub(super) kind: &'static str,
    pub(super) transfer_id: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) consumer_tp_size: Option<u16>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) sender_engine_id: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) sender_dp_rank: Option<u16>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) sender_tp_rank: Option<u16>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) pdkv_incarnation: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) pdkv_mac: Option<Bin<'a>>,
}

#[derive(Serialize)]
pub(super) struct RemoteBlocksWire<'a> {
    pub(super) req_id: &'a str,
    pub(super) transfer_id: &'a str,
    pub(super) block_notify_list: &'a [u32],
    pub(super) decode_rank: u16,
    #[serde(rename = "type")]
    pub(super) kind: &'static str,
}

#[derive(Serialize)]
pub(super) struct ReadLeaseWire<'a> {
    #[serde(rename = "type")]
    pub(super) kind: &'static str,
    pub(super) transfer_id: &'a str,
    pub(super) lease_ms: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) pdkv_incarnation: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) pdkv_mac: Option<Bin<'a>>,
}

#[derive(Serialize)]
pub(super) struct WriteDoneWire<'a> {
    #[serde(rename = "type")]
    pub(super) kind: &'static str,
    pub(super) transfer_id: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) num_writers: Option<u16>,
}

#[derive(Serialize)]
pub(super) struct WriteFailedWire<'a> {
    #[serde(rename = "type")]
    pub(super) kind: &'static str,
    pub(super) transfer_id: &'a str,
}

fn transfer_id(fields: &mut Fields) -> Result<TransferId, WireError> {
    fields.str("transfer_id").map(TransferId::new)
}

/// Reads the optional `pdkv_mac` key: a bin of exactly [`MAC_BYTES`].
fn opt_mac(f: &mut Fields) -> Result<Option<Mac>, WireError> {
    const FIELD: &str = "pdkv_mac";
    let Some(value) = f.take(FIELD) else { return Ok(None) };
    let bytes = blob(FIELD, value)?;
    let mac: [u8; MAC_BYTES] = bytes.as_slice().try_into().map_err(|_| WireError::WrongLength {
        field: FIELD,
        len: bytes.len(),
        expected: MAC_BYTES,
    })?;
    Ok(Some(Mac(mac)))
}

pub(super) fn release(mut f: Fields) -> Result<Release, WireError> {
    let transfer_id = transfer_id(&mut f)?;
    let consumer_tp_size = f.opt_int("consumer_tp_size", 1, U16_MAX)?.map(narrow::<u16>);
    let sender = group(
        "sender",
        ["sender_engine_id", "sender_dp_rank", "sender_tp_rank"],
        (
            f.opt_str("sender_engine_id")?,
            f.opt_int("sender_dp_rank", 0, U16_MAX)?,
            f.opt_int("sender_tp_rank", 0, U16_MAX)?,
        ),
    )?
    .map(|(engine_id, dp, tp)| ReleaseSender { engine_id, dp_rank: narrow(dp), tp_rank: narrow(tp) });
    // The sender is one of the `consumer_tp_size` decode ranks, so its TP rank must lie below.
    if let (Some(size), Some(s)) = (consumer_tp_size, &sender) {
        if s.tp_rank >= size {
            return Err(WireError::RankOutOfGroup { field: "sender_tp_rank", rank: s.tp_rank, size });
        }
    }
    let incarnation = opt_incarnation(&mut f)?;
    let mac = opt_mac(&mut f)?;
    Ok(Release { transfer_id, consumer_tp_size, sender, incarnation, mac })
}

pub(super) fn remote_blocks(mut f: Fields) -> Result<RemoteBlocks, WireError> {
    let req_id = f.str("req_id")?;
    let transfer_id = transfer_id(&mut f)?;
    let block_ids: Vec<u32> =
        f.int_list("block_notify_list", MAX_BLOCK_IDS, 0, U32_MAX)?.into_iter().map(narrow).collect();
    // MoRIIO raises on an empty list: there is nothing to write into.
    if block_ids.is_empty() {
        return Err(WireError::EmptyField { field: "block_notify_list" });
    }
    let decode_dp_rank = f.opt_int("decode_rank", 0, U16_MAX)?.map_or(0, narrow);
    Ok(RemoteBlocks { req_id, transfer_id, block_ids, decode_dp_rank })
}

pub(super) fn read_lease(mut f: Fields) -> Result<ReadLease, WireError> {
    let transfer_id = transfer_id(&mut f)?;
    let lease_ms = narrow::<u32>(f.int("lease_ms", 1, i128::from(u32::MAX))?);
    let incarnation = opt_incarnation(&mut f)?;
    let mac = opt_mac(&mut f)?;
    Ok(ReadLease { transfer_id, lease_ms, incarnation, mac })
}

pub(super) fn write_done(mut f: Fields) -> Result<WriteDone, WireError> {
    let transfer_id = transfer_id(&mut f)?;
    let writers = f.opt_int("num_writers", 1, U16_MAX)?.map_or(1, narrow);
    Ok(WriteDone { transfer_id, writers })
}

pub(super) fn write_failed(mut f: Fields) -> Result<WriteFailed, WireError> {
    Ok(WriteFailed { transfer_id: transfer_id(&mut f)? })
}
