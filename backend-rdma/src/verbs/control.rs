//! The verbs control protocol's messages (see the module doc of `verbs`): HELLO's queue pair
//! info, the region table, and the reads of a server's answers on the client's TCP connection.

use std::io::{self, Read};
use std::net::TcpStream;

use crate::tcp::{remote_code, MAX_MESSAGE_BYTES};
use crate::transport::{Endpoint, TransportError};

/// First bytes of a HELLO: the control protocol's tag.
pub const CONTROL_MAGIC: [u8; 4] = *b"PKVR";
/// The control protocol's version.
pub const CONTROL_VERSION: u8 = 1;
/// Request kind: connect a queue pair and get the region table.
pub const KIND_HELLO: u8 = 1;
/// Request kind: check one range and get a fresh region table.
pub const KIND_REFRESH: u8 = 2;
/// Most entries a region table may hold.
pub const MAX_TABLE_ENTRIES: u32 = 65_536;
/// Bytes of one encoded [`QpInfo`].
pub(super) const QP_INFO_BYTES: usize = 29;
/// Bytes of one encoded table entry.
const ENTRY_BYTES: usize = 28;

/// What one side tells the other to connect its RC queue pair.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct QpInfo {
    pub(super) qpn: u32,
    pub(super) psn: u32,
    pub(super) lid: u16,
    pub(super) gid: [u8; 16],
    pub(super) mtu: u8,
    pub(super) rd_atom: u8,
    pub(super) link_layer: u8,
}

impl QpInfo {
    pub(super) fn encode(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.qpn.to_be_bytes());
        out.extend_from_slice(&self.psn.to_be_bytes());
        out.extend_from_slice(&self.lid.to_be_bytes());
        out.extend_from_slice(&self.gid);
        out.extend_from_slice(&[self.mtu, self.rd_atom, self.link_layer]);
    }

    pub(super) fn decode(b: &[u8; QP_INFO_BYTES]) -> QpInfo {
        let u32_at = |i: usize| u32::from_be_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let mut gid = [0u8; 16];
        gid.copy_from_slice(&b[10..26]);
        QpInfo {
            qpn: u32_at(0),
            psn: u32_at(4) & 0xff_ffff,
            lid: u16::from_be_bytes([b[8], b[9]]),
            gid,
            mtu: b[26],
            rd_atom: b[27],
            link_layer: b[28],
        }
    }
}

/// One entry of a region table.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct TableEntry {
    /// pdkv base address.
    pub(super) base: u64,
    pub(super) len: u64,
    /// Virtual address of the registered buffer.
    pub(super) va: u64,
    pub(super) rkey: u32,
}

pub(super) fn encode_table(table: &[TableEntry], out: &mut Vec<u8>) {
    out.extend_from_slice(&(table.len() as u32).to_be_bytes());
    for e in table {
        out.extend_from_slice(&e.base.to_be_bytes());
        out.extend_from_slice(&e.len.to_be_bytes());
        out.extend_from_slice(&e.va.to_be_bytes());
        out.extend_from_slice(&e.rkey.to_be_bytes());
    }
}

pub(super) fn read_message(stream: &TcpStream, peer: &Endpoint) -> Result<String, TransportError> {
    let io = |op| move |e: io::Error| TransportError::io(peer, op, &e);
    let mut len = [0u8; 4];
    (&*stream).read_exact(&mut len).map_err(io("read message"))?;
    let len = u32::from_be_bytes(len);
    if len > MAX_MESSAGE_BYTES {
        let detail = format!("message of {len} bytes; the limit is {MAX_MESSAGE_BYTES}");
        return Err(TransportError::Protocol { peer: peer.to_string(), detail });
    }
    let mut message = vec![0u8; len as usize];
    (&*stream).read_exact(&mut message).map_err(io("read message"))?;
    String::from_utf8(message).map_err(|e| TransportError::Protocol {
        peer: peer.to_string(),
        detail: format!("message is not UTF-8: {e}"),
    })
}

pub(super) fn read_refusal(stream: &TcpStream, peer: &Endpoint, status: u8) -> TransportError {
    match read_message(stream, peer) {
        Ok(message) => TransportError::Remote { peer: peer.to_string(), code: remote_code(status), message },
        Err(e) => e,
    }
}

pub(super) fn read_table(stream: &TcpStream, peer: &Endpoint) -> Result<Vec<TableEntry>, TransportError> {
    let io = |op| move |e: io::Error| TransportError::io(peer, op, &e);
    let mut count = [0u8; 4];
    (&*stream).read_exact(&mut count).map_err(io("read region table"))?;
    let count = u32::from_be_bytes(count);
    if count > MAX_TABLE_ENTRIES {
        let detail = format!("region table of {count} entries; the limit is {MAX_TABLE_ENTRIES}");
        return Err(TransportError::Protocol { peer: peer.to_string(), detail });
    }
    let mut body = vec![0u8; count as usize * ENTRY_BYTES];
    (&*stream).read_exact(&mut body).map_err(io("read region table"))?;
    let mut table: Vec<TableEntry> = body
        .chunks_exact(ENTRY_BYTES)
        .map(|c| {
            let u64_at = |i: usize| u64::from_be_bytes(c[i..i + 8].try_into().unwrap_or([0; 8]));
            TableEntry {
                base: u64_at(0),
                len: u64_at(8),
                va: u64_at(16),
                rkey: u32::from_be_bytes(c[24..28].try_into().unwrap_or([0; 4])),
            }
        })
        .collect();
    table.sort_by_key(|e| e.base);
    let overlapping = table.windows(2).any(|w| w[0].base.saturating_add(w[0].len) > w[1].base);
    if overlapping || table.iter().any(|e| e.base.checked_add(e.len).is_none()) {
        let detail = "region table has overlapping or overflowing entries".to_string();
        return Err(TransportError::Protocol { peer: peer.to_string(), detail });
    }
    Ok(table)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn verbs_wire_encodings_round_trip() {
        let info = QpInfo {
            qpn: 0x12_3456,
            psn: 0xab_cdef,
            lid: 7,
            gid: [3; 16],
            mtu: 5,
            rd_atom: 16,
            link_layer: 2,
        };
        let mut out = Vec::new();
        info.encode(&mut out);
        let bytes: [u8; QP_INFO_BYTES] = out.as_slice().try_into().expect("size");
        assert_eq!(QpInfo::decode(&bytes), info);
        let mut table = Vec::new();
        encode_table(&[TableEntry { base: 1, len: 2, va: 3, rkey: 4 }], &mut table);
        assert_eq!(table.len(), 4 + ENTRY_BYTES);
    }
}
