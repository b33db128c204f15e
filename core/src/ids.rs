//! Newtype identifiers shared by every part of the core: roles, engines, ranks and transfers.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// Which phase an engine serves.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum Role {
    /// Computes the prompt's KV cache and holds its blocks until decode releases them.
    Prefill,
    /// Reads the KV cache from prefill and generates the output tokens.
    Decode,
}

impl Role {
    /// The letter the deployment notation uses for the role (`P` or `D`).
    pub fn letter(self) -> char {
        match self {
            Role::Prefill => 'P',
            Role::Decode => 'D',
        }
    }

    /// The role in words, for messages: `prefill` or `decode`.
    pub fn name(self) -> &'static str {
        match self {
            Role::Prefill => "prefill",
            Role::Decode => "decode",
        }
    }
}

/// An engine (one serving instance) of a role, numbered from 0 within that role.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct EngineId {
    /// Whether the engine runs prefill or decode.
    pub role: Role,
    /// Position among the engines of the same role, from 0 (the `1` of `P1`); indexes the
    /// role's list in a `Deployment` and an `AddressBook`.
    pub index: u16,
}

impl EngineId {
    /// Prefill engine number `index`.
    pub fn prefill(index: u16) -> EngineId {
        EngineId { role: Role::Prefill, index }
    }

    /// Decode engine number `index`.
    pub fn decode(index: u16) -> EngineId {
        EngineId { role: Role::Decode, index }
    }
}

impl fmt::Display for EngineId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}{}", self.role.letter(), self.index)
    }
}

/// One GPU (and its NIC): an engine plus its data-parallel and tensor-parallel rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct RankId {
    /// The engine the GPU belongs to.
    pub engine: EngineId,
    /// Data-parallel rank within the engine, below its DP size.
    pub dp: u16,
    /// Tensor-parallel rank within the DP group, below the engine's TP size.
    pub tp: u16,
}

impl RankId {
    /// Rank (`dp`, `tp`) of `engine`; not checked against the engine's layout.
    pub fn new(engine: EngineId, dp: u16, tp: u16) -> RankId {
        RankId { engine, dp, tp }
    }
}

impl fmt::Display for RankId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.dp{}.tp{}", self.engine, self.dp, self.tp)
    }
}

/// A label that is not an engine (`P0`, `D1`) or a rank (`P0.dp0.tp1`) as `Display` writes it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IdParseError(pub String);

impl fmt::Display for IdParseError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?} is not an engine like P0 or a rank like D1.dp2.tp3", self.0)
    }
}

impl std::error::Error for IdParseError {}

/// A number written the way `Display` writes it: decimal digits without a sign or a leading
/// zero, so that every label reads back to one id and writes back to the same text.
fn canonical_number(text: &str) -> Option<u16> {
    let plain = !text.is_empty() && text.bytes().all(|b| b.is_ascii_digit());
    if !plain || (text.len() > 1 && text.starts_with('0')) {
        return None;
    }
    text.parse().ok()
}

impl FromStr for EngineId {
    type Err = IdParseError;

    /// Reads the label `Display` writes: `P` or `D`, then the index.
    fn from_str(s: &str) -> Result<EngineId, IdParseError> {
        let role = match s.as_bytes().first() {
            Some(b'P') => Role::Prefill,
            Some(b'D') => Role::Decode,
            _ => return Err(IdParseError(s.to_string())),
        };
        let index = canonical_number(&s[1..]).ok_or_else(|| IdParseError(s.to_string()))?;
        Ok(EngineId { role, index })
    }
}

impl FromStr for RankId {
    type Err = IdParseError;

    /// Reads the label `Display` writes: `D1.dp2.tp3`.
    fn from_str(s: &str) -> Result<RankId, IdParseError> {
        let bad = || IdParseError(s.to_string());
        let mut parts = s.split('.');
        let (Some(engine), Some(dp), Some(tp), None) =
            (parts.next(), parts.next(), parts.next(), parts.next())
        else {
            return Err(bad());
        };
        let engine = engine.parse().map_err(|_| bad())?;
        let dp = dp.strip_prefix("dp").and_then(canonical_number).ok_or_else(bad)?;
        let tp = tp.strip_prefix("tp").and_then(canonical_number).ok_or_else(bad)?;
        Ok(RankId { engine, dp, tp })
    }
}

/// A GPU's tensor-parallel rank within its DP group: a member of the group's TP collectives.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct TpRank(pub u16);

impl RankId {
    /// The rank's place in its DP group's TP collectives.
    pub fn tp_rank(self) -> TpRank {
        TpRank(self.tp)
    }
}

impl fmt::Display for TpRank {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "tp{}", self.0)
    }
}

/// The proxy-minted identifier of one request's KV transfer (`tx-<uuid>` in MoRIIO).
///
/// It is a string on the wire, and peers may send ids pdkv did not mint, so it behaves as its
/// text in every way (equality, order, hash, `Debug`, serde). An id in the form the proxy mints
/// is kept as its 128 bits: every message, ledger and table names transfers, and comparing,
/// copying and hashing 16 bytes costs far less than a heap string does (no allocation per
/// clone, no byte-wise compare per lookup). Any other text is kept as it came.
#[derive(Clone, PartialEq, Eq)]
pub struct TransferId(Repr);

/// How a [`TransferId`] keeps its text. An id whose text has the minted form is always
/// `Minted` (every constructor reads the text), so two ids are equal exactly when their
/// representations are.
#[derive(Clone, PartialEq, Eq)]
enum Repr {
    /// The 128 bits [`TransferId::from_u128`] formats, as halves (high, low): eight-byte
    /// alignment keeps an id as small as the `String` it replaces.
    Minted(u64, u64),
    /// Any other id, as it came.
    Text(Box<str>),
}

/// The length of a minted id's text: `tx-` and 32 hex digits with four dashes.
const MINTED_LEN: usize = 39;

/// Where the four dashes of a minted id's hex part go (offsets after `tx-`).
const DASHES: [usize; 4] = [8, 13, 18, 23];

/// Where each of a minted id's 32 hex digits goes in its text, most significant first (every
/// offset from 3 but the dashes'): a table, because ids are written and read for every message.
const DIGIT_AT: [usize; 32] = {
    let mut at = [0; 32];
    let (mut digit, mut offset) = (0, 0);
    while digit < 32 {
        if offset != DASHES[0] && offset != DASHES[1] && offset != DASHES[2] && offset != DASHES[3] {
            at[digit] = offset + 3;
            digit += 1;
        }
        offset += 1;
    }
    at
};

impl TransferId {
    /// The id whose text is `text`, as a peer or a test names it.
    pub fn new(text: impl Into<String>) -> TransferId {
        let text = text.into();
        match minted_bits(&text) {
            Some(bits) => TransferId::from_u128(bits),
            None => TransferId(Repr::Text(text.into_boxed_str())),
        }
    }

    /// Formats a 128-bit value the way MoRIIO's proxy formats a UUID4: `tx-` and 32 hex digits
    /// in the 8-4-4-4-12 grouping. The caller supplies the bits (seeded in the simulator,
    /// random in production), which keeps the core free of randomness.
    pub fn from_u128(bits: u128) -> TransferId {
        TransferId(Repr::Minted((bits >> 64) as u64, bits as u64))
    }

    /// The 128 bits [`TransferId::from_u128`] formatted this id from, if it has exactly that
    /// form (`tx-`, lowercase hex in the 8-4-4-4-12 grouping); `None` for any other id, which a
    /// peer may send. Lets a driver that keeps many ids store 16 bytes for each.
    pub fn to_u128(&self) -> Option<u128> {
        match self.0 {
            Repr::Minted(high, low) => Some((u128::from(high) << 64) | u128::from(low)),
            Repr::Text(_) => None,
        }
    }

    /// The id exactly as it travels on the wire.
    pub fn as_str(&self) -> IdText<'_> {
        match &self.0 {
            Repr::Minted(..) => {
                let bits = self.to_u128().unwrap_or_default();
                let mut bytes = [b'-'; MINTED_LEN];
                bytes[..3].copy_from_slice(b"tx-");
                // The 32 digits, most significant first, around the dashes (which stay).
                for (digit, slot) in DIGIT_AT.iter().enumerate() {
                    let nibble = (bits >> (4 * (31 - digit))) as usize & 0xf;
                    bytes[*slot] = b"0123456789abcdef"[nibble];
                }
                IdText::Minted(bytes)
            }
            Repr::Text(text) => IdText::Text(text),
        }
    }
}

/// The bits of `text` if it has the minted form exactly (see [`TransferId::to_u128`]).
fn minted_bits(text: &str) -> Option<u128> {
    let text = text.strip_prefix("tx-")?;
    let bytes = text.as_bytes();
    if bytes.len() != MINTED_LEN - 3 || DASHES.iter().any(|&i| bytes[i] != b'-') {
        return None;
    }
    let mut bits = 0u128;
    for slot in DIGIT_AT {
        let digit = match bytes[slot - 3] {
            b @ b'0'..=b'9' => b - b'0',
            b @ b'a'..=b'f' => b - b'a' + 10,
            _ => return None,
        };
        bits = (bits << 4) | u128::from(digit);
    }
    Some(bits)
}

/// A transfer id's text, which [`TransferId::as_str`] writes out for a minted id (it keeps only
/// the bits) and borrows for any other; it reads as a `&str`.
#[derive(Clone, Copy, Debug)]
pub enum IdText<'a> {
    /// A minted id's text, written out: ASCII, [`MINTED_LEN`] bytes.
    Minted([u8; MINTED_LEN]),
    /// Any other id's text.
    Text(&'a str),
}

impl std::ops::Deref for IdText<'_> {
    type Target = str;

    fn deref(&self) -> &str {
        match self {
            // Only ASCII is ever written into the buffer, so this never fails.
            IdText::Minted(bytes) => std::str::from_utf8(bytes).unwrap_or_default(),
            IdText::Text(text) => text,
        }
    }
}

impl PartialOrd for TransferId {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for TransferId {
    /// The order of the ids' texts. Two minted ids compare by their bits: their texts have the
    /// same length, dashes in the same places and lowercase hex digits, whose byte order is
    /// their value's order, so the texts compare as the numbers do.
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        match (&self.0, &other.0) {
            (Repr::Minted(a, b), Repr::Minted(c, d)) => (a, b).cmp(&(c, d)),
            (Repr::Text(a), Repr::Text(b)) => a.cmp(b),
            _ => (*self.as_str()).cmp(&*other.as_str()),
        }
    }
}

impl std::hash::Hash for TransferId {
    /// Hashes the text, as the `String` this id once was did.
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        (*self.as_str()).hash(state);
    }
}

impl fmt::Debug for TransferId {
    /// `TransferId::new("tx-...")`, as for a tuple struct of the text.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("TransferId").field(&&*self.as_str()).finish()
    }
}

impl Serialize for TransferId {
    /// The text, as a string: the wire form.
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(&self.as_str())
    }
}

impl<'de> Deserialize<'de> for TransferId {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<TransferId, D::Error> {
        String::deserialize(deserializer).map(TransferId::new)
    }
}

impl fmt::Display for TransferId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.as_str())
    }
}

/// One life of a rank's process: drawn by the driver when the process starts (the core draws no
/// randomness), never reused by the rank. A prefill rank's memory, its registered transfers and
/// its block ids belong to one incarnation; a transfer's parameters name the incarnation that
/// holds its blocks, and the rank's handshake metadata names the one answering, so a decode rank
/// never reads an old transfer's block ids from a restarted rank's memory.
///
/// The value lies in `1..=MAX` (53 bits), so it survives any JSON reader on the way (the proxy's
/// `kv_transfer_params` travel as JSON, and a double holds 53 bits exactly). Incarnations are not
/// ordered: two of one rank are only ever compared for equality.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Incarnation(u64);

impl Incarnation {
    /// The largest incarnation, `2^53 - 1`.
    pub const MAX: u64 = (1 << 53) - 1;

    /// The incarnation `value`, if it lies in `1..=MAX`; a value received from a peer outside
    /// that range is refused.
    pub fn new(value: u64) -> Option<Incarnation> {
        (1..=Self::MAX).contains(&value).then_some(Incarnation(value))
    }

    /// An incarnation from 64 random bits the driver drew (seeded in the simulator, from the
    /// operating system in production): the bits folded into `1..=MAX`.
    pub fn from_bits(bits: u64) -> Incarnation {
        Incarnation(bits % Self::MAX + 1)
    }

    /// The value as it travels on the wire.
    pub fn value(self) -> u64 {
        self.0
    }
}

impl fmt::Display for Incarnation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Hex, so that two incarnations in a log line are told apart at a glance.
        write!(f, "inc-{:x}", self.0)
    }
}

/// The proxy's own number for a client request, assigned in arrival order from 1.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct RequestId(pub u64);

impl fmt::Display for RequestId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "req-{}", self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transfer_id_has_uuid_shape() {
        let id = TransferId::from_u128(0x0123_4567_89ab_cdef_0011_2233_4455_6677);
        assert_eq!(&*id.as_str(), "tx-01234567-89ab-cdef-0011-223344556677");
    }

    /// Only the exact form `from_u128` writes reads back to its bits.
    #[test]
    fn transfer_ids_read_back_to_their_bits_only_in_the_minted_form() {
        let check = |text: &str, expected: Option<u128>| {
            assert_eq!(TransferId::new(text).to_u128(), expected, "{text}");
            assert_eq!(&*TransferId::new(text).as_str(), text);
            if let Some(bits) = expected {
                assert_eq!(&*TransferId::from_u128(bits).as_str(), text);
            }
        };
        check("tx-01234567-89ab-cdef-0011-223344556677", Some(0x0123_4567_89ab_cdef_0011_2233_4455_6677));
        check("tx-00000000-0000-0000-0000-000000000000", Some(0));
        check("tx-ffffffff-ffff-ffff-ffff-ffffffffffff", Some(u128::MAX));
        for other in [
            "",
            "tx-",
            "tx-01234567-89AB-cdef-0011-223344556677",
            "tx-0123456789ab-cdef-0011-2233-44556677",
            "tx-01234567-89ab-cdef-0011-2233445566778",
            "tx-01234567-89ab-cdef-0011-22334455667",
            "rx-01234567-89ab-cdef-0011-223344556677",
            "tx-01234567-89ab-cdef-0011-22334455667g",
            "tx-01234567_89ab-cdef-0011-223344556677",
            "tx-01234567-89ab-cdef-0011-2233445566é",
        ] {
            check(other, None);
        }
    }

    /// An id kept as bits behaves as its text: order, equality, hash, `Debug` and serde are
    /// those of the `String` it once was, minted or not, whichever way it was made.
    #[test]
    fn transfer_ids_behave_as_their_text() {
        use std::hash::{BuildHasher, BuildHasherDefault, DefaultHasher};
        let texts = [
            "tx-00000000-0000-0000-0000-000000000000",
            "tx-00000000-0000-0000-0000-00000000000a",
            "tx-0000000a-0000-0000-0000-000000000000",
            "tx-ffffffff-ffff-ffff-ffff-ffffffffffff",
            "tx-01234567-89AB-cdef-0011-223344556677",
            "tx-01234567-89ab-cdef-0011-22334455667",
            "tx-01234567-89ab-cdef-0011-2233445566770",
            "tx-1",
            "tx-g",
            "tx-",
            "t",
            "",
            "u",
            "é",
        ];
        let hash = BuildHasherDefault::<DefaultHasher>::default();
        for a in texts {
            let id = TransferId::new(a);
            assert_eq!(id, TransferId::new(a.to_string()));
            assert_eq!(&*id.as_str(), a);
            assert_eq!(id.to_string(), a);
            assert_eq!(format!("{id:?}"), format!("TransferId({a:?})"));
            assert_eq!(hash.hash_one(&id), hash.hash_one(a.to_string()), "{a}");
            assert_eq!(serde_json::to_string(&id).ok(), serde_json::to_string(a).ok());
            assert_eq!(
                serde_json::from_str::<TransferId>(&serde_json::to_string(a).unwrap_or_default()).ok(),
                Some(id.clone())
            );
            for b in texts {
                let other = TransferId::new(b);
                assert_eq!(id.cmp(&other), a.cmp(b), "{a} against {b}");
                assert_eq!(id == other, a == b, "{a} against {b}");
            }
        }
        let bits = 0x0123_4567_89ab_cdef_0011_2233_4455_6677;
        assert_eq!(TransferId::new(TransferId::from_u128(bits).to_string()), TransferId::from_u128(bits));
    }

    /// Incarnations lie in 1..=2^53-1 whatever the bits drawn, and values outside are refused.
    #[test]
    fn incarnations_stay_in_53_bits_and_are_never_zero() {
        for bits in [0, 1, Incarnation::MAX - 1, Incarnation::MAX, Incarnation::MAX + 1, u64::MAX] {
            let inc = Incarnation::from_bits(bits);
            assert!((1..=Incarnation::MAX).contains(&inc.value()), "{bits}");
            assert_eq!(Incarnation::new(inc.value()), Some(inc));
        }
        assert_eq!(Incarnation::new(0), None);
        assert_eq!(Incarnation::new(Incarnation::MAX + 1), None);
        assert_eq!(Incarnation::new(255).map(|i| i.to_string()), Some("inc-ff".to_string()));
    }

    #[test]
    fn rank_display_names_engine_dp_and_tp() {
        let rank = RankId::new(EngineId::prefill(1), 2, 3);
        assert_eq!(rank.to_string(), "P1.dp2.tp3");
    }

    /// Labels read back to the id `Display` wrote them from; anything else is refused.
    #[test]
    fn labels_read_back_exactly() {
        fn check(label: &str, expected: Option<RankId>) {
            let got = label.parse::<RankId>();
            assert_eq!(got.clone().ok(), expected, "{label}");
            match got {
                Ok(rank) => assert_eq!(rank.to_string(), label),
                Err(e) => assert_eq!(e, IdParseError(label.to_string())),
            }
        }
        let d = |engine, dp, tp| Some(RankId::new(EngineId::decode(engine), dp, tp));
        check("D0.dp0.tp3", d(0, 0, 3));
        check("D12.dp7.tp15", d(12, 7, 15));
        check("P1.dp2.tp3", Some(RankId::new(EngineId::prefill(1), 2, 3)));
        for bad in [
            "",
            "D0",
            "D0.dp0",
            "D0.dp0.tp3.x",
            "X0.dp0.tp0",
            "D.dp0.tp0",
            "D0.dp.tp0",
            "D0.tp0.dp0",
            "D01.dp0.tp0",
            "D0.dp+1.tp0",
            "D0.dp0.tp70000",
            "d0.dp0.tp0",
            "D0.dp0.tp3 ",
        ] {
            check(bad, None);
        }
        assert_eq!("D3".parse::<EngineId>(), Ok(EngineId::decode(3)));
        assert_eq!("P0".parse::<EngineId>(), Ok(EngineId::prefill(0)));
        assert!("P".parse::<EngineId>().is_err() && "Pé".parse::<EngineId>().is_err());
    }
}
