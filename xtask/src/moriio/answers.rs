//! vLLM's answers as tests/moriio/harness.py writes them (one JSON document), read strictly:
//! a missing field or a wrong type is a typed error naming where, and [`Answers::check`] refuses
//! sizes and ranks outside the layouts asked for, so the comparison never indexes past them.

use std::collections::BTreeMap;
use std::fmt;

use serde::Deserialize;

/// Largest DP or TP size a record may name (the harness asks up to `max_ranks` a side).
pub const MAX_SIZE: u16 = 64;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Answers {
    pub vllm_version: String,
    pub python: String,
    pub max_ranks: u16,
    /// Module name to the file it was imported from, relative to the extracted wheel.
    pub modules: BTreeMap<String, String>,
    pub ports: Vec<PortLayout>,
    pub expected_acks: Vec<ExpectedAcks>,
    pub heads: Vec<HeadGuard>,
    /// WRITE mode's TP mapping, from 0.33 on.
    pub writes: Writes,
    pub combos: Vec<Combo>,
    pub wire: Vec<WireRow>,
    /// What vLLM's listeners did with each of pdkv's messages (`--messages`).
    pub messages: Vec<Delivery>,
    /// vLLM's handshake listener's answer to a pdkv dial.
    pub vllm_metadata: VllmMetadata,
}

/// vLLM's ports for every rank of one prefill layout `[dp, tp]`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PortLayout {
    pub prefill: [u16; 2],
    pub ranks: Vec<PortRank>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PortRank {
    pub dp: u16,
    pub tp: u16,
    /// Where `_moriio_handshake_listener` binds (`side_channel_port`).
    pub handshake_listen: u32,
    /// Where the notify listener binds (`MoRIIOConfig.notify_port`).
    pub notify_listen: u32,
    /// Where `_moriio_handshake` dials this rank.
    pub handshake_dial: u32,
    /// Where `_read_blocks` sends this rank's release; None for a DP rank > 0 of a release
    /// whose decode reads DP rank 0 only (0.25, 0.26).
    pub release_dial: Option<u32>,
}

/// `get_moriio_expected_ack_count(producer, consumer)`: a value or vLLM's exception.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExpectedAcks {
    pub producer: u16,
    pub consumer: u16,
    #[serde(default)]
    pub value: Option<u16>,
    #[serde(default)]
    pub error: Option<String>,
}

/// `moriio_tp_mapping.compute_write_tp_mapping` over a grid of shapes; `module` is None for a
/// release without it (before 0.33), whose write path pairs equal TP ranks.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Writes {
    pub module: Option<String>,
    pub shapes: Vec<WriteAnswer>,
}

/// One shape: every prefill rank's mapping in rank order, or vLLM's refusal.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WriteAnswer {
    pub prefill_tp: u16,
    pub decode_tp: u16,
    pub kv_heads: u16,
    pub mla: bool,
    pub mamba: bool,
    #[serde(default)]
    pub ranks: Option<Vec<WriteRankAnswer>>,
    #[serde(default)]
    pub error: Option<String>,
}

/// `MoRIIOWriteTPMapping` of one prefill rank: its head counts and each `WriteTarget` as
/// `[tp_rank, local_head, remote_head, num_heads, local_slice, local_slices, remote_slice,
/// remote_slices, num_writers]`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WriteRankAnswer {
    pub local_heads: u16,
    pub remote_heads: u16,
    pub targets: Vec<[u16; 9]>,
}

/// `validate_moriio_heterogeneous_tp_kv_heads`: `error` is None when it passes.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HeadGuard {
    pub decode_tp: u16,
    pub prefill_tp: u16,
    pub kv_heads: u16,
    pub mla: bool,
    pub error: Option<String>,
}

/// One decode layout reading one prefill layout for a request owned by prefill DP rank `owner`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Combo {
    pub decode: [u16; 2],
    pub prefill: [u16; 2],
    pub mla: bool,
    /// `rdma` or `xgmi` (MoRIIO's `backend` option: xGMI never reads flexibly).
    pub backend: String,
    pub owner: u16,
    pub ranks: Vec<DecodeRank>,
    pub acks: Vec<AckGroup>,
}

/// What one decode rank did over its successive reads, or the exception vLLM raised.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DecodeRank {
    pub dp: u16,
    pub tp: u16,
    /// Each read: `(source TP rank, flexible, [notify ports released to])`.
    #[serde(default)]
    pub reads: Vec<(u16, bool, Vec<u32>)>,
    /// The distinct release messages (MessagePack maps, as JSON) the rank sent.
    #[serde(default)]
    pub payloads: Vec<serde_json::Value>,
    #[serde(default)]
    pub error: Option<String>,
}

/// The releases of one decode DP group's first reads, counted by each prefill TP rank of the
/// owner DP group.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AckGroup {
    pub group: u16,
    /// `get_moriio_expected_ack_count(prefill TP, decode TP)`, None when it refused.
    pub expected: Option<u16>,
    pub ranks: Vec<AckRank>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AckRank {
    pub tp: u16,
    pub received: u32,
    /// After how many releases `get_finished` reported the request done (0: before any); more
    /// than one entry means it was reported twice.
    pub reported: Vec<u32>,
}

/// One wire interaction the harness ran.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WireRow {
    pub interaction: String,
    pub direction: String,
    pub layout: String,
    pub ok: bool,
    pub detail: String,
}

/// One of pdkv's messages delivered to a fresh vLLM listener, and what became of it.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Delivery {
    /// The message's id in the list xtask wrote.
    pub id: usize,
    pub name: String,
    /// `notify` or `handshake`.
    pub socket: String,
    /// The listener received it (handled it, answered it, or ended on it).
    pub delivered: bool,
    /// The listener thread was still alive afterwards and served vLLM's own probe (a release
    /// it counted, or a handshake dial it answered).
    pub alive: bool,
    /// The exception that ended the listener thread, or that the handler raised.
    pub error: Option<String>,
    /// The acks vLLM's notify listener counted for the message (not the probe's):
    /// `(transfer_id, consumer_tp_size)`.
    pub acks: Vec<(String, i64)>,
    /// What vLLM did, in words.
    pub did: String,
}

/// The messages vLLM's handshake listener answered a pdkv dial (`get_meta_msg`) with, each a
/// list of frames in hex; or why there are none.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VllmMetadata {
    pub frames: Vec<Vec<String>>,
    pub error: Option<String>,
}

/// A record outside the layouts asked for.
#[derive(Debug, PartialEq, Eq)]
pub struct BadRecord(pub String);

impl fmt::Display for BadRecord {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "the harness's answers hold a record outside the layouts asked for: {}", self.0)
    }
}

impl std::error::Error for BadRecord {}

fn size(what: &str, n: u16) -> Result<(), BadRecord> {
    if (1..=MAX_SIZE).contains(&n) {
        Ok(())
    } else {
        Err(BadRecord(format!("{what} {n} is not in 1..={MAX_SIZE}")))
    }
}

fn below(what: &str, n: u16, limit: u16) -> Result<(), BadRecord> {
    if n < limit {
        Ok(())
    } else {
        Err(BadRecord(format!("{what} {n} is not below {limit}")))
    }
}

impl Answers {
    /// Checks every size and rank, so the comparison can build layouts and ranks from them.
    pub fn check(&self) -> Result<(), BadRecord> {
        size("max_ranks", self.max_ranks)?;
        for p in &self.ports {
            let [dp, tp] = p.prefill;
            size("prefill DP", dp)?;
            size("prefill TP", tp)?;
            for r in &p.ranks {
                below("port rank dp", r.dp, dp)?;
                below("port rank tp", r.tp, tp)?;
            }
        }
        for e in &self.expected_acks {
            size("producer TP", e.producer)?;
            size("consumer TP", e.consumer)?;
        }
        for h in &self.heads {
            size("decode TP", h.decode_tp)?;
            size("prefill TP", h.prefill_tp)?;
            size("kv heads", h.kv_heads)?;
        }
        for w in &self.writes.shapes {
            size("WRITE prefill TP", w.prefill_tp)?;
            size("WRITE decode TP", w.decode_tp)?;
            if w.kv_heads == 0 {
                return Err(BadRecord("WRITE kv heads 0".into()));
            }
            match (&w.ranks, &w.error) {
                (Some(ranks), None) if ranks.len() == usize::from(w.prefill_tp) => {
                    for t in ranks.iter().flat_map(|r| &r.targets) {
                        below("WRITE target tp rank", t[0], w.decode_tp)?;
                    }
                }
                (None, Some(_)) => {}
                _ => return Err(BadRecord(format!("WRITE shape {w:?}: one mapping per rank or an error"))),
            }
        }
        for c in &self.combos {
            let ([d_dp, d_tp], [p_dp, p_tp]) = (c.decode, c.prefill);
            for (what, n) in
                [("decode DP", d_dp), ("decode TP", d_tp), ("prefill DP", p_dp), ("prefill TP", p_tp)]
            {
                size(what, n)?;
            }
            below("owner DP rank", c.owner, p_dp)?;
            for r in &c.ranks {
                below("decode rank dp", r.dp, d_dp)?;
                below("decode rank tp", r.tp, d_tp)?;
            }
            for g in &c.acks {
                below("decode group", g.group, d_dp)?;
                for r in &g.ranks {
                    below("ack rank tp", r.tp, p_tp)?;
                }
            }
            if c.backend != "rdma" && c.backend != "xgmi" {
                return Err(BadRecord(format!("backend {:?}", c.backend)));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_fields_and_out_of_range_ranks_are_refused() {
        let doc = r#"{"vllm_version":"0.33.0","python":"3.11.7","max_ranks":2,"modules":{},
            "ports":[{"prefill":[1,2],"ranks":[{"dp":0,"tp":2,"handshake_listen":1,
            "notify_listen":1,"handshake_dial":1,"release_dial":1}]}],
            "expected_acks":[],"heads":[],"writes":{"module":null,"shapes":[]},"combos":[],"wire":[],"messages":[],
            "vllm_metadata":{"frames":[],"error":null}}"#;
        let answers: Answers = serde_json::from_str(doc).unwrap();
        assert_eq!(answers.check(), Err(BadRecord("port rank tp 2 is not below 2".into())));
        let extra = doc.replace("\"wire\":[]", "\"wire\":[],\"surprise\":1");
        assert!(serde_json::from_str::<Answers>(&extra).unwrap_err().to_string().contains("surprise"));
    }
}
