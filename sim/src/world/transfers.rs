//! The run's transfer ids, numbered in the order requests arrive, kept compactly: a run of a
//! million requests names a million transfers, and messages name them by their wire id.

use std::collections::BTreeMap;

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
    /// The minted ids' numbers, found by their bits (`bits` holds the keys).
    by_bits: BitsIndex,
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
                self.by_bits.insert(&self.bits, number);
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
            Some(bits) => self.by_bits.get(&self.bits, bits),
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

/// The numbers of the minted ids, in an open-addressing table keyed by their bits (which
/// `Transfers::bits` holds, so a slot is a 4-byte number): releases and leases look an id up
/// for every message, and a lookup here is one probe where a B-tree of a million random keys
/// missed the cache at every level; it is also smaller (4 bytes a slot, at most half full,
/// against about 30 bytes an entry). Looked up, never iterated.
#[derive(Clone, Debug, Default)]
struct BitsIndex {
    /// A number, or `EMPTY`; the length is zero or a power of two.
    slots: Vec<u32>,
    /// Numbers in `slots`.
    len: usize,
}

/// A slot no number holds.
const EMPTY: u32 = u32::MAX;

impl BitsIndex {
    /// The first slot to probe for `bits`: the proxy mints ids from a seeded random stream, so
    /// folding their halves spreads them, and no outside party chooses them.
    fn home(&self, bits: u128) -> usize {
        let folded = (bits as u64) ^ ((bits >> 64) as u64).rotate_left(29);
        (folded as usize) & (self.slots.len() - 1)
    }

    /// The slot holding the number of `bits`, or the empty slot where it would go.
    fn probe(&self, keys: &[u128], bits: u128) -> usize {
        let mask = self.slots.len() - 1;
        let mut i = self.home(bits);
        while self.slots[i] != EMPTY && keys[self.slots[i] as usize] != bits {
            i = (i + 1) & mask;
        }
        i
    }

    /// Files `number`, whose bits are `keys[number]`, replacing an earlier number with the
    /// same bits.
    fn insert(&mut self, keys: &[u128], number: u32) {
        if 2 * (self.len + 1) > self.slots.len() {
            let grown = (self.slots.len() * 2).max(1024);
            let old = std::mem::replace(&mut self.slots, vec![EMPTY; grown]);
            for n in old.into_iter().filter(|&n| n != EMPTY) {
                let i = self.probe(keys, keys[n as usize]);
                self.slots[i] = n;
            }
        }
        let i = self.probe(keys, keys[number as usize]);
        if self.slots[i] == EMPTY {
            self.len += 1;
        }
        self.slots[i] = number;
    }

    /// The number filed for `bits`.
    fn get(&self, keys: &[u128], bits: u128) -> Option<u32> {
        if self.slots.is_empty() {
            return None;
        }
        let n = self.slots[self.probe(keys, bits)];
        (n != EMPTY).then_some(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_number_in_order_and_read_back_whatever_their_form() {
        let mut t = Transfers::default();
        let minted = TransferId::from_u128(7);
        let foreign = TransferId::new("req-42");
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

    /// Thousands of ids, a repeated one among them, all found through the table's growth, and
    /// ids that share a home slot (the same folded bits) told apart.
    #[test]
    fn many_ids_are_found_by_their_bits() {
        let mut t = Transfers::default();
        let spread = |i: u128| i.wrapping_mul(0x9E37_79B9_7F4A_7C15_F39C_C060_5CED_C835);
        for i in 0..5000u128 {
            assert_eq!(t.push(TransferId::from_u128(spread(i)), i as u64), i as u32);
        }
        // `a` and `b` fold to the same value, so they probe from the same slot.
        let (a, b) = (1u128 << 64, 1u128 << 29);
        assert_eq!([t.push(TransferId::from_u128(a), 1), t.push(TransferId::from_u128(b), 2)], [5000, 5001]);
        assert_eq!(t.push(TransferId::from_u128(spread(7)), 3), 5002);
        for i in (0..5000u128).filter(|&i| i != 7) {
            assert_eq!(t.number(&TransferId::from_u128(spread(i))), Some(i as u32));
        }
        assert_eq!(t.number(&TransferId::from_u128(spread(7))), Some(5002), "the latest of a repeated id");
        assert_eq!(t.number(&TransferId::from_u128(a)), Some(5000));
        assert_eq!(t.number(&TransferId::from_u128(b)), Some(5001));
        assert_eq!(t.number(&TransferId::from_u128(spread(5000))), None);
    }
}
