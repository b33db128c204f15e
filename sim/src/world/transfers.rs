//! The run's transfer ids, numbered in the order requests arrive, kept compactly: a run of a
//! million requests names a million transfers, and messages name them by their wire id.

use std::collections::{BTreeMap, HashMap};
use std::hash::{BuildHasherDefault, Hasher};

use pdkv_core::ids::TransferId;

/// Every transfer id of the run and its number (the owner number of the pools' blocks).
///
/// An id in the form the proxy mints (`TransferId::from_u128`, every id the simulated proxy
/// makes) is kept as its 16 bytes; any other as text, in a side table.
#[derive(Clone, Debug, Default)]
pub(super) struct Transfers {
    /// Each transfer's bits, by number (0 for one kept as text).
    bits: Vec<u128>,
    /// The numbers of the transfers kept as text, and their text.
    text: BTreeMap<u32, TransferId>,
    /// Looked up by key only, never iterated (so its order cannot reach a result): a lookup in
    /// a million random ids is one probe here where a B-tree missed the cache at every level,
    /// and releases and leases look one up for every message.
    by_bits: HashMap<u128, u32, BuildHasherDefault<Fold>>,
    by_text: BTreeMap<TransferId, u32>,
    /// The request of each transfer, by number, so a record naming a transfer can name its
    /// request too.
    requests: Vec<u64>,
}

impl Transfers {
    /// Numbers `id` (the next number); a repeated id now names the new transfer, as a map from
    /// id to number would.
    pub(super) fn push(&mut self, id: TransferId, request: u64) -> u32 {
        let number = self.bits.len() as u32;
        self.requests.push(request);
        match id.to_u128() {
            Some(bits) => {
                self.bits.push(bits);
                self.by_bits.insert(bits, number);
            }
            None => {
                self.bits.push(0);
                self.by_text.insert(id.clone(), number);
                self.text.insert(number, id);
            }
        }
        number
    }

    /// The number of the transfer `id` names (the latest one, if it was repeated).
    pub(super) fn number(&self, id: &TransferId) -> Option<u32> {
        match id.to_u128() {
            Some(bits) => self.by_bits.get(&bits).copied(),
            None => self.by_text.get(id).copied(),
        }
    }

    /// The request transfer `id` belongs to (the latest one's, if it was repeated): the proxy's
    /// number, as `req-N` names it.
    pub(super) fn request_of(&self, id: &TransferId) -> Option<u64> {
        self.number(id).and_then(|n| self.requests.get(n as usize).copied())
    }

    /// The id of transfer `number`.
    pub(super) fn id(&self, number: u32) -> Option<TransferId> {
        let bits = *self.bits.get(number as usize)?;
        Some(self.text.get(&number).cloned().unwrap_or_else(|| TransferId::from_u128(bits)))
    }
}

/// Hashes an id's bits by folding them: the proxy mints ids from a seeded random stream, so
/// their bits are already spread, and no outside party chooses them.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Fold(u64);

impl Hasher for Fold {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(b);
        }
    }

    fn write_u128(&mut self, bits: u128) {
        self.0 ^= (bits as u64) ^ ((bits >> 64) as u64).rotate_left(29);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_number_in_order_and_read_back_whatever_their_form() {
        let mut t = Transfers::default();
        let minted = TransferId::from_u128(7);
        let foreign = TransferId("req-42".into());
        assert_eq!(t.push(minted.clone(), 1), 0);
        assert_eq!(t.push(foreign.clone(), 2), 1);
        assert_eq!(t.push(minted.clone(), 3), 2, "a repeated id gets a number of its own");
        assert_eq!((t.request_of(&minted), t.request_of(&foreign)), (Some(3), Some(2)));
        assert_eq!(t.number(&minted), Some(2), "and the id names the latest");
        assert_eq!(t.number(&foreign), Some(1));
        assert_eq!(t.number(&TransferId::from_u128(8)), None);
        assert_eq!(
            [t.id(0), t.id(1), t.id(2), t.id(3)],
            [Some(minted.clone()), Some(foreign), Some(minted), None]
        );
    }
}
