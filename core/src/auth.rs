//! Authenticated control messages: a deployment's secret key, the MAC a pdkv decode rank puts on
//! the releases and leases it sends a rank that advertised `auth`, and the rule by which a
//! prefill worker takes or refuses them.
//!
//! A release frees blocks and a lease holds them, so whoever can send one to a notify port can
//! free KV under a live read or stall the pool. MoRIIO's notify listener takes any message from
//! anyone. pdkv ranks of one deployment share a secret [`ControlKey`]; a decode rank MACs every
//! release and lease it sends to a rank that advertised [`Extension::Auth`](crate::wire::Extension)
//! (HMAC-SHA-256 over the message's fields, truncated to 128 bits), and the prefill worker checks
//! it ([`ControlAuth`]). The MAC covers the transfer id, the sender and the incarnation, so a
//! captured message can only be replayed as itself: the ledger counts one release per sender and
//! transfer, and a transfer id is never reused.

use std::fmt;

use hmac::{Hmac, Mac as _};
use sha2::Sha256;

use crate::wire::{ReadLease, Release};

// A message's MAC and its length are defined with the messages that carry them.
pub use crate::wire::{Mac, MAC_BYTES};

/// Bytes of a [`ControlKey`].
pub const KEY_BYTES: usize = 32;

/// Domain separation: a MAC of this scheme is never a MAC of anything else keyed the same.
const DOMAIN: &[u8] = b"pdkv control message v1\0";

/// A deployment's shared secret. Its `Debug` never shows the bytes.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct ControlKey([u8; KEY_BYTES]);

impl ControlKey {
    /// A key of these bytes (drawn by the driver from the operating system's random source, or
    /// read from the deployment's secret file; the core draws nothing).
    pub fn from_bytes(bytes: [u8; KEY_BYTES]) -> ControlKey {
        ControlKey(bytes)
    }

    /// A key from its 64 hexadecimal digits (surrounding white space ignored).
    pub fn from_hex(text: &str) -> Result<ControlKey, KeyError> {
        let text = text.trim();
        if text.len() != 2 * KEY_BYTES {
            return Err(KeyError::Length { digits: text.len() });
        }
        let mut bytes = [0u8; KEY_BYTES];
        for (i, pair) in text.as_bytes().chunks_exact(2).enumerate() {
            let digit =
                |at: usize| char::from(pair[at]).to_digit(16).ok_or(KeyError::NotHex { at: 2 * i + at });
            // Two hexadecimal digits make at most 255.
            bytes[i] = (digit(0)? * 16 + digit(1)?) as u8;
        }
        Ok(ControlKey(bytes))
    }

    /// The key as 64 lowercase hexadecimal digits (to hand to a rank process).
    pub fn to_hex(&self) -> String {
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }

    fn hmac(&self) -> Hmac<Sha256> {
        // HMAC takes a key of any length, so this cannot fail.
        Hmac::<Sha256>::new_from_slice(&self.0).expect("HMAC takes any key length")
    }
}

impl fmt::Debug for ControlKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ControlKey(<secret>)")
    }
}

/// A key text that is not 64 hexadecimal digits.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KeyError {
    /// The text has this many characters, not 64.
    Length {
        /// Characters found (after trimming).
        digits: usize,
    },
    /// The character at this position is not a hexadecimal digit.
    NotHex {
        /// Its position in the trimmed text.
        at: usize,
    },
}

impl fmt::Display for KeyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            KeyError::Length { digits } => {
                write!(f, "a control key is {} hexadecimal digits, not {digits}", 2 * KEY_BYTES)
            }
            KeyError::NotHex { at } => {
                write!(f, "character {at} of the control key is not a hexadecimal digit")
            }
        }
    }
}

/// What the MAC covers, in a fixed order with lengths, so no two messages share an input.
struct Input(Vec<u8>);

impl Input {
    fn new(kind: u8) -> Input {
        let mut v = DOMAIN.to_vec();
        v.push(kind);
        Input(v)
    }
    fn bytes(&mut self, b: &[u8]) {
        // Transfer ids and engine ids are bounded far below 4 GiB by the wire decoder.
        self.0.extend_from_slice(&(b.len() as u32).to_be_bytes());
        self.0.extend_from_slice(b);
    }
    fn opt_u64(&mut self, v: Option<u64>) {
        match v {
            None => self.0.push(0),
            Some(v) => {
                self.0.push(1);
                self.0.extend_from_slice(&v.to_be_bytes());
            }
        }
    }
}

/// The MAC of a release under `key`; its own `mac` field is not covered.
pub fn release_mac(key: &ControlKey, release: &Release) -> Mac {
    let mut input = Input::new(1);
    input.bytes(release.transfer_id.as_str().as_bytes());
    input.opt_u64(release.consumer_tp_size.map(u64::from));
    match &release.sender {
        None => input.0.push(0),
        Some(s) => {
            input.0.push(1);
            input.bytes(s.engine_id.as_bytes());
            input.opt_u64(Some(u64::from(s.dp_rank)));
            input.opt_u64(Some(u64::from(s.tp_rank)));
        }
    }
    input.opt_u64(release.incarnation.map(|i| i.value()));
    finish(key, &input)
}

/// The MAC of a read lease under `key`; its own `mac` field is not covered.
pub fn lease_mac(key: &ControlKey, lease: &ReadLease) -> Mac {
    let mut input = Input::new(2);
    input.bytes(lease.transfer_id.as_str().as_bytes());
    input.opt_u64(Some(u64::from(lease.lease_ms)));
    input.opt_u64(lease.incarnation.map(|i| i.value()));
    finish(key, &input)
}

fn finish(key: &ControlKey, input: &Input) -> Mac {
    let mut h = key.hmac();
    h.update(&input.0);
    let full = h.finalize().into_bytes();
    let mut mac = [0u8; MAC_BYTES];
    mac.copy_from_slice(&full[..MAC_BYTES]);
    Mac(mac)
}

/// Compares two MACs in time independent of where they differ.
fn same(a: &Mac, b: &Mac) -> bool {
    a.0.iter().zip(b.0.iter()).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// How a prefill worker treats the releases and leases it is sent.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Default)]
pub enum ControlAuth {
    /// No key: every message is taken, as MoRIIO's listener takes it (and nothing is advertised).
    #[default]
    Open,
    /// A key, and peers that may not have it (vLLM ranks speaking plain MoRIIO): a message with
    /// a MAC must carry the right one; a message without one is taken. Advertises `auth`.
    Verify(ControlKey),
    /// A key every peer has (a deployment of pdkv ranks only): a message without the right MAC
    /// is refused. Advertises `auth`.
    Require(ControlKey),
}

/// What a worker decided about one message's MAC.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum Verdict {
    /// Taken: its MAC is right, or the worker takes messages without one.
    Taken,
    /// Refused: it carries no MAC and the worker requires one.
    Unauthenticated,
    /// Refused: its MAC is not the one the deployment's key gives.
    BadMac,
}

impl ControlAuth {
    /// The key, if the worker has one (it then advertises `auth`).
    pub fn key(&self) -> Option<&ControlKey> {
        match self {
            ControlAuth::Open => None,
            ControlAuth::Verify(k) | ControlAuth::Require(k) => Some(k),
        }
    }

    /// Judges a message whose right MAC under the key is `expected(key)` and which carries `mac`.
    pub fn judge(&self, mac: Option<Mac>, expected: impl FnOnce(&ControlKey) -> Mac) -> Verdict {
        match (self, mac) {
            (ControlAuth::Open, _) => Verdict::Taken,
            (ControlAuth::Verify(_), None) => Verdict::Taken,
            (ControlAuth::Require(_), None) => Verdict::Unauthenticated,
            (ControlAuth::Verify(k) | ControlAuth::Require(k), Some(mac)) => {
                if same(&mac, &expected(k)) {
                    Verdict::Taken
                } else {
                    Verdict::BadMac
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::{Incarnation, TransferId};
    use crate::release::ReleaseSender;

    fn key(byte: u8) -> ControlKey {
        ControlKey::from_bytes([byte; KEY_BYTES])
    }

    fn release() -> Release {
        Release {
            transfer_id: TransferId::from_u128(7),
            consumer_tp_size: Some(2),
            sender: Some(ReleaseSender { engine_id: "decode-0:6301".into(), dp_rank: 0, tp_rank: 1 }),
            incarnation: Incarnation::new(5),
            mac: None,
        }
    }

    #[test]
    fn a_mac_covers_every_field_and_the_key() {
        let base = release_mac(&key(1), &release());
        assert_eq!(base, release_mac(&key(1), &release()), "deterministic");
        let changed = [
            release_mac(&key(2), &release()),
            release_mac(&key(1), &Release { transfer_id: TransferId::from_u128(8), ..release() }),
            release_mac(&key(1), &Release { consumer_tp_size: Some(4), ..release() }),
            release_mac(&key(1), &Release { consumer_tp_size: None, ..release() }),
            release_mac(&key(1), &Release { sender: None, ..release() }),
            release_mac(
                &key(1),
                &Release {
                    sender: Some(ReleaseSender { engine_id: "decode-0:6301".into(), dp_rank: 0, tp_rank: 0 }),
                    ..release()
                },
            ),
            release_mac(&key(1), &Release { incarnation: Incarnation::new(6), ..release() }),
            release_mac(&key(1), &Release { incarnation: None, ..release() }),
        ];
        for (i, mac) in changed.iter().enumerate() {
            assert_ne!(*mac, base, "change {i}");
        }
        // The MAC field itself is not covered.
        assert_eq!(release_mac(&key(1), &Release { mac: Some(base), ..release() }), base);
        let lease = ReadLease {
            transfer_id: TransferId::from_u128(7),
            lease_ms: 30_000,
            incarnation: None,
            mac: None,
        };
        assert_ne!(
            lease_mac(&key(1), &lease),
            lease_mac(&key(1), &ReadLease { lease_ms: 30_001, ..lease.clone() })
        );
        assert_ne!(lease_mac(&key(1), &lease), lease_mac(&key(2), &lease));
    }

    #[test]
    fn each_mode_takes_or_refuses_as_documented() {
        let right = release_mac(&key(1), &release());
        let wrong = release_mac(&key(2), &release());
        let check = |auth: ControlAuth, mac: Option<Mac>, expected: Verdict| {
            assert_eq!(auth.judge(mac, |k| release_mac(k, &release())), expected, "{auth:?} {mac:?}");
        };
        check(ControlAuth::Open, None, Verdict::Taken);
        check(ControlAuth::Open, Some(wrong), Verdict::Taken);
        check(ControlAuth::Verify(key(1)), None, Verdict::Taken);
        check(ControlAuth::Verify(key(1)), Some(right), Verdict::Taken);
        check(ControlAuth::Verify(key(1)), Some(wrong), Verdict::BadMac);
        check(ControlAuth::Require(key(1)), None, Verdict::Unauthenticated);
        check(ControlAuth::Require(key(1)), Some(right), Verdict::Taken);
        check(ControlAuth::Require(key(1)), Some(wrong), Verdict::BadMac);
    }

    #[test]
    fn keys_read_back_from_hex_and_bad_text_is_named() {
        let k = ControlKey::from_bytes(std::array::from_fn(|i| i as u8 * 7));
        assert_eq!(ControlKey::from_hex(&format!(" {}\n", k.to_hex())), Ok(k.clone()));
        assert_eq!(format!("{k:?}"), "ControlKey(<secret>)");
        assert_eq!(ControlKey::from_hex("abc"), Err(KeyError::Length { digits: 3 }));
        let mut bad = k.to_hex();
        bad.replace_range(9..10, "g");
        assert_eq!(ControlKey::from_hex(&bad), Err(KeyError::NotHex { at: 9 }));
    }
}
