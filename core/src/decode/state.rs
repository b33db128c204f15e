//! The decode worker's own bookkeeping: the sessions it knows, the requests it holds (and the
//! phase of each) and the requests queued for a later step. A request's phase maps onto the
//! request machine of [`crate::recv`], which the worker checks it agrees with. (The step in
//! progress is the step machine's own state, which the worker holds: see `mod.rs`.)

use std::collections::BTreeMap;
use std::sync::Arc;

use crate::fence::FenceState;
use crate::handshake::{HandshakeParams, HandshakeState};
use crate::ids::{Incarnation, RankId, TransferId};
use crate::ports::{Endpoint, EngineAddress, ReadTarget};
use crate::recv::RecvState;
use crate::time::Instant;
use crate::topology::Layout;
use crate::wire::Extensions;

use super::plan::ReadPlan;
use super::RecvError;

/// A session the worker knows: its handshake machine and where it points.
#[derive(Clone, Debug, Hash)]
pub(super) struct SessionEntry {
    pub(super) rank: RankId,
    pub(super) endpoint: Endpoint,
    pub(super) params: HandshakeParams,
    pub(super) state: HandshakeState,
    /// What the rank last advertised in metadata from the engine dialled; `None` until then.
    /// Kept when the session fails or is invalidated: the address still names the same rank.
    pub(super) extensions: Option<Extensions>,
}

/// Where one request is.
#[derive(Clone, Debug, Hash)]
pub(super) enum RecvPhase {
    /// Waiting for its session (and, in eager mode, the step's vote).
    AwaitingSession,
    /// Reads posted; `outstanding` lists the layers (or `None`) not done yet; `plan` is what the
    /// reads as posted shared, kept for retries (the session may be dropped meanwhile by another
    /// request's failed read, but these reads' memory keys were taken when they were posted).
    Reading { outstanding: Layers, retries: BTreeMap<Option<u16>, Retry>, plan: Arc<ReadPlan> },
    /// Failed with reads posted: they were aborted, and `in_flight` lists the ones whose answer
    /// is still owed; the release (reporting `error`) waits for them.
    Draining { in_flight: Layers, error: RecvError },
}

impl RecvPhase {
    /// The phase as the request machine of [`crate::recv`] sees it.
    pub(super) fn machine(&self) -> RecvState {
        match self {
            RecvPhase::AwaitingSession => RecvState::AwaitingSession,
            RecvPhase::Reading { outstanding, retries, .. } => {
                let retrying = retries.values().filter(|r| r.due.is_some()).count();
                RecvState::Reading {
                    in_flight: (outstanding.len() - retrying) as u32,
                    retrying: retrying as u32,
                }
            }
            RecvPhase::Draining { in_flight, .. } => {
                RecvState::Draining { in_flight: in_flight.len() as u32 }
            }
        }
    }

    /// Whether the read of `layer` is posted and not answered yet: [`Self::in_flight`]'s
    /// membership without building the set, since it is asked once per read answered.
    pub(super) fn is_in_flight(&self, layer: Option<u16>) -> bool {
        match self {
            RecvPhase::AwaitingSession => false,
            RecvPhase::Reading { outstanding, retries, .. } => {
                outstanding.contains(&layer) && retries.get(&layer).is_none_or(|r| r.due.is_none())
            }
            RecvPhase::Draining { in_flight, .. } => in_flight.contains(&layer),
        }
    }

    /// Posted reads not answered yet (a read waiting for its retry is not posted).
    pub(super) fn in_flight(&self) -> Layers {
        match self {
            RecvPhase::AwaitingSession => Layers::default(),
            RecvPhase::Reading { outstanding, retries, .. } => {
                outstanding.iter().filter(|l| retries.get(l).is_none_or(|r| r.due.is_none())).collect()
            }
            RecvPhase::Draining { in_flight, .. } => in_flight.clone(),
        }
    }
}

/// A set of a request's reads, each named by its layer (`None`: the read of every layer): a
/// `BTreeSet<Option<u16>>` in behaviour (the same order, `Debug` and `Hash`), kept as bits. A
/// per-layer request posts a read per layer and each answer takes one out, so a B-tree's nodes
/// were allocated, searched and freed for every layer of every request.
#[derive(Clone, Default)]
pub(super) struct Layers {
    /// Whether the read of every layer (`None`) is in.
    whole: bool,
    /// Bit `l % 64` of word `l / 64` says whether layer `l` is in.
    bits: Vec<u64>,
    /// How many reads are in.
    len: usize,
}

impl Layers {
    /// Whether `layer` is in.
    pub(super) fn contains(&self, layer: &Option<u16>) -> bool {
        match *layer {
            None => self.whole,
            Some(l) => self.bits.get(usize::from(l) / 64).is_some_and(|w| w & (1 << (l % 64)) != 0),
        }
    }

    /// Puts `layer` in; whether it was not in yet.
    pub(super) fn insert(&mut self, layer: Option<u16>) -> bool {
        let fresh = match layer {
            None => !std::mem::replace(&mut self.whole, true),
            Some(l) => {
                let word = usize::from(l) / 64;
                if self.bits.len() <= word {
                    self.bits.resize(word + 1, 0);
                }
                let before = self.bits[word];
                self.bits[word] |= 1 << (l % 64);
                before != self.bits[word]
            }
        };
        self.len += usize::from(fresh);
        fresh
    }

    /// Takes `layer` out; whether it was in.
    pub(super) fn remove(&mut self, layer: &Option<u16>) -> bool {
        let was = self.contains(layer);
        if was {
            match *layer {
                None => self.whole = false,
                Some(l) => self.bits[usize::from(l) / 64] &= !(1 << (l % 64)),
            }
            self.len -= 1;
        }
        was
    }

    /// How many reads are in.
    pub(super) fn len(&self) -> usize {
        self.len
    }

    /// The reads in, in a `BTreeSet`'s order: `None` first, then the layers ascending.
    pub(super) fn iter(&self) -> impl Iterator<Item = Option<u16>> + '_ {
        let layers = self.bits.iter().enumerate().flat_map(|(word, &bits)| {
            (0..64u16).filter(move |b| bits & (1 << b) != 0).map(move |b| Some(word as u16 * 64 + b))
        });
        self.whole.then_some(None).into_iter().chain(layers)
    }
}

impl FromIterator<Option<u16>> for Layers {
    fn from_iter<I: IntoIterator<Item = Option<u16>>>(iter: I) -> Layers {
        let mut set = Layers::default();
        for layer in iter {
            set.insert(layer);
        }
        set
    }
}

impl PartialEq for Layers {
    /// The same reads (however many words each grew to).
    fn eq(&self, other: &Layers) -> bool {
        self.len == other.len && self.iter().eq(other.iter())
    }
}

impl Eq for Layers {}

impl std::fmt::Debug for Layers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_set().entries(self.iter()).finish()
    }
}

impl std::hash::Hash for Layers {
    /// As a `BTreeSet` hashes: its length, then its items in order.
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        state.write_usize(self.len);
        for layer in self.iter() {
            layer.hash(state);
        }
    }
}

/// A read refused by a full send queue, waiting to be posted again.
#[derive(Clone, Copy, Debug, Hash)]
pub(super) struct Retry {
    /// Refusals so far: each doubles the delay before the next post, up to the cap.
    pub(super) attempts: u32,
    /// When to post it again; `None` once posted.
    pub(super) due: Option<Instant>,
}

/// A request the worker holds: where it reads, whom it releases, and where it is.
#[derive(Clone, Debug, Hash)]
pub(super) struct Recv {
    pub(super) transfer_id: TransferId,
    pub(super) target: ReadTarget,
    /// The prefill ranks released when the request ends, with their notify listeners and the
    /// incarnation of each that holds the transfer (when the answer named them).
    pub(super) releases: Vec<(RankId, Endpoint, Option<Incarnation>)>,
    /// The incarnation of the source rank that holds the transfer (`None`: the answer named
    /// none, and no fence applies), and where the request is with the fence.
    pub(super) incarnation: Option<Incarnation>,
    pub(super) fence: FenceState,
    pub(super) remote_block_ids: Arc<[u32]>,
    pub(super) local_block_ids: Arc<[u32]>,
    /// The prefill layout the parameters announced, and where that engine listens.
    pub(super) remote: Layout,
    pub(super) address: EngineAddress,
    pub(super) deadline: Instant,
    pub(super) arrived: Instant,
    pub(super) phase: RecvPhase,
    /// What the source's engine advertised in the request's `pdkv_extensions`, if anything.
    pub(super) engine_extensions: Option<Extensions>,
    /// A lease is owed to the source, held until its handshake metadata says whether it takes
    /// leases (see `lease.rs`).
    pub(super) lease_held: bool,
}

/// A request queued by the engine: routed, its source leased until admission.
#[derive(Clone, Debug, Hash)]
pub(super) struct Waiting {
    pub(super) recv: Recv,
    /// When to send the next lease.
    pub(super) renew_at: Instant,
}

#[cfg(test)]
mod tests {
    use super::Layers;
    use std::collections::BTreeSet;
    use std::hash::{BuildHasher, BuildHasherDefault, DefaultHasher};

    /// Every insert, removal and query answers as a `BTreeSet<Option<u16>>` does, in the same
    /// order, with the same `Debug` text and hash.
    #[test]
    fn layers_behave_as_a_btree_set() {
        let mut set = Layers::default();
        let mut model: BTreeSet<Option<u16>> = BTreeSet::new();
        let hash = BuildHasherDefault::<DefaultHasher>::default();
        let mut x = 12345u64;
        for _ in 0..20_000 {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            let layer = match (x >> 33) % 200 {
                0 => None,
                n => Some(((n * 7) % 150) as u16),
            };
            if (x >> 20).is_multiple_of(3) {
                assert_eq!(set.remove(&layer), model.remove(&layer));
            } else {
                assert_eq!(set.insert(layer), model.insert(layer));
            }
            assert_eq!(set.contains(&layer), model.contains(&layer));
            assert_eq!(set.len(), model.len());
        }
        assert_eq!(set.iter().collect::<Vec<_>>(), model.iter().copied().collect::<Vec<_>>());
        assert_eq!(format!("{set:?}"), format!("{model:?}"));
        assert_eq!(hash.hash_one(&set), hash.hash_one(&model));
        assert_eq!(model.iter().copied().collect::<Layers>(), set);
        assert!(!Layers::default().contains(&Some(9000)));
        let (mut grown, empty) = (Layers::default(), Layers::default());
        grown.insert(Some(1000));
        grown.remove(&Some(1000));
        assert_eq!(grown, empty, "trailing empty words do not count");
    }
}
