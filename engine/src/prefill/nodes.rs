//! Prefill engines and their workers in one value, for a driver that runs the workers itself
//! (the simulator, the model checker, the scripted tests). It routes between them, so no driver
//! re-writes that wiring: a worker's finished part and its granted lease go to its engine, and
//! an engine's word for a worker (a registration, a group done, a retirement) goes to that
//! worker at once. Everything else leaves, in order, as a [`PrefillOutput`].

use std::collections::BTreeMap;

use pdkv_core::ids::RankId;
use pdkv_core::prefill::{
    EngineAction, EngineError, EngineEvent, PrefillEngine, PrefillWorker, WorkerAction, WorkerEvent,
};
use pdkv_core::time::Instant;

/// What the nodes ask of their driver, in the order it is to be carried out.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PrefillOutput {
    /// An action worker `worker` took; every one comes out, the ones routed to its engine too,
    /// each before what routing it caused.
    Worker {
        /// The worker.
        worker: usize,
        /// Its action.
        action: WorkerAction,
    },
    /// An action engine `engine` took; every one comes out, the ones delivered to a worker too,
    /// each before that delivery (a registration the driver holds is not delivered).
    Engine {
        /// The engine.
        engine: usize,
        /// Its action.
        action: EngineAction,
    },
    /// Engine `engine` refused an input (its actions up to then came out before).
    Refused {
        /// The engine.
        engine: usize,
        /// Why.
        error: EngineError,
    },
    /// Engine `engine` finished an input; `timeout` is its timer at that moment.
    EngineHandled {
        /// The engine.
        engine: usize,
        /// [`PrefillEngine::poll_timeout`] right after the input.
        timeout: Option<Instant>,
    },
}

/// Prefill engines and their workers, numbered in the order they are added. Its hash is its
/// state's (the spare buffers, always empty, are not state), for a model checker's visited set.
#[derive(Clone, Debug, Default)]
pub struct PrefillNodes {
    engines: Vec<PrefillEngine>,
    workers: Vec<PrefillWorker>,
    /// Each worker's number, by its rank.
    index: BTreeMap<RankId, usize>,
    /// Whether registrations are the driver's to deliver (it delays them), not the nodes'.
    hold_registrations: bool,
    /// Spare action buffers (reused, never shrunk): every release, registration and retirement
    /// passes through a worker and often its engine, and a fresh vector for each was a
    /// measurable share of a large run's time. A stack, because a worker's action reaches its
    /// engine, whose actions reach workers, while the first buffer is still in use.
    spare_worker: Vec<Vec<WorkerAction>>,
    spare_engine: Vec<Vec<EngineAction>>,
}

impl std::hash::Hash for PrefillNodes {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        (&self.engines, &self.workers, &self.index, self.hold_registrations).hash(state);
    }
}

impl PrefillNodes {
    /// No engines, no workers; registrations are delivered at once.
    pub fn new() -> Self {
        PrefillNodes::default()
    }

    /// Registrations leave as outputs only, for the driver to deliver (with
    /// [`Self::handle_worker`]) when it likes, instead of reaching their worker at once.
    pub fn with_held_registrations(mut self, hold: bool) -> Self {
        self.hold_registrations = hold;
        self
    }

    /// Adds an engine; returns its number.
    pub fn add_engine(&mut self, engine: PrefillEngine) -> usize {
        self.engines.push(engine);
        self.engines.len() - 1
    }

    /// Adds the worker of `rank`; returns its number. The engines' words for a rank no worker
    /// was added for are dropped (a driver may model only part of an engine).
    pub fn add_worker(&mut self, rank: RankId, worker: PrefillWorker) -> usize {
        let i = self.workers.len();
        assert!(self.index.insert(rank, i).is_none(), "{rank} added twice");
        self.workers.push(worker);
        i
    }

    /// Engine `engine`.
    pub fn engine(&self, engine: usize) -> &PrefillEngine {
        &self.engines[engine]
    }

    /// Every engine, by number.
    pub fn engines(&self) -> &[PrefillEngine] {
        &self.engines
    }

    /// Worker `worker`.
    pub fn worker(&self, worker: usize) -> &PrefillWorker {
        &self.workers[worker]
    }

    /// Worker `worker`, for inputs whose actions the driver carries out itself (a handshake
    /// request it answers on the listener that carried it).
    pub fn worker_mut(&mut self, worker: usize) -> &mut PrefillWorker {
        &mut self.workers[worker]
    }

    /// The number of `rank`'s worker, if it has one.
    pub fn worker_of(&self, rank: RankId) -> Option<usize> {
        self.index.get(&rank).copied()
    }

    /// Puts `fresh` in engine `engine`'s place (a restarted engine).
    pub fn replace_engine(&mut self, engine: usize, fresh: PrefillEngine) {
        self.engines[engine] = fresh;
    }

    /// Puts `fresh` in worker `worker`'s place (a restarted process).
    pub fn replace_worker(&mut self, worker: usize, fresh: PrefillWorker) {
        self.workers[worker] = fresh;
    }

    /// Worker `worker` handles `event`; see [`PrefillNodes`].
    pub fn handle_worker(
        &mut self,
        now: Instant,
        worker: usize,
        event: WorkerEvent,
        out: &mut Vec<PrefillOutput>,
    ) {
        let mut actions = self.spare_worker.pop().unwrap_or_default();
        self.workers[worker].handle(now, event, &mut actions);
        for action in actions.drain(..) {
            let routed = match &action {
                WorkerAction::Finished { rank, transfer_id } => Some((
                    *rank,
                    EngineEvent::WorkerFinished { rank: *rank, transfer_id: transfer_id.clone() },
                )),
                WorkerAction::Leased { rank, transfer_id, until } => {
                    Some((*rank, EngineEvent::Leased { transfer_id: transfer_id.clone(), until: *until }))
                }
                _ => None,
            };
            out.push(PrefillOutput::Worker { worker, action });
            if let Some((rank, event)) = routed {
                // A worker's engine is its rank's (the engines are numbered by engine index).
                let _ = self.handle_engine(now, usize::from(rank.engine.index), event, out);
            }
        }
    }

    /// Engine `engine` handles `event`; see [`PrefillNodes`]. Its refusal comes back too (after
    /// a [`PrefillOutput::Refused`]), for a driver whose own input it was.
    pub fn handle_engine(
        &mut self,
        now: Instant,
        engine: usize,
        event: EngineEvent,
        out: &mut Vec<PrefillOutput>,
    ) -> Result<(), EngineError> {
        let mut actions = self.spare_engine.pop().unwrap_or_default();
        let result = self.engines[engine].handle(now, event, &mut actions);
        if let Err(error) = &result {
            out.push(PrefillOutput::Refused { engine, error: error.clone() });
        }
        for action in actions.drain(..) {
            let delivery = match &action {
                EngineAction::Register { rank, transfer_id, quorum, incarnation }
                    if !self.hold_registrations =>
                {
                    Some((
                        *rank,
                        WorkerEvent::Register {
                            transfer_id: transfer_id.clone(),
                            quorum: *quorum,
                            incarnation: *incarnation,
                        },
                    ))
                }
                EngineAction::GroupDone { rank, transfer_id } => {
                    Some((*rank, WorkerEvent::GroupDone { transfer_id: transfer_id.clone() }))
                }
                EngineAction::Retire { rank, transfer_id, incarnation } => Some((
                    *rank,
                    WorkerEvent::Retired { transfer_id: transfer_id.clone(), incarnation: *incarnation },
                )),
                _ => None,
            };
            out.push(PrefillOutput::Engine { engine, action });
            if let Some((rank, event)) = delivery {
                if let Some(worker) = self.worker_of(rank) {
                    self.handle_worker(now, worker, event, out);
                }
            }
        }
        self.spare_engine.push(actions);
        out.push(PrefillOutput::EngineHandled { engine, timeout: self.engines[engine].poll_timeout() });
        result
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pdkv_core::ids::{RequestId, TransferId};
    use pdkv_core::policy::Policy;
    use pdkv_core::prefill::PrefillDone;
    use pdkv_core::release::Release;
    use pdkv_core::topology::Deployment;
    use pdkv_core::wire::{Extensions, HandshakeMetadata};

    /// The engine and two workers of `1P_TP2:1D_TP2`'s prefill side, under pdkv's rules.
    fn nodes(hold: bool) -> (PrefillNodes, Deployment) {
        let d = Deployment::parse("1P_TP2:1D_TP2").expect("parses");
        let policy = Policy::default();
        let mut n = PrefillNodes::new().with_held_registrations(hold);
        for engine in PrefillEngine::for_deployment(&d, policy) {
            n.add_engine(engine);
        }
        for rank in d.ranks(pdkv_core::ids::Role::Prefill) {
            let metadata = HandshakeMetadata {
                engine_id: "prefill-0:6301".into(),
                agent_metadata: Vec::new(),
                kv_caches_base_addr: vec![1 << 30],
                num_blocks: 16,
                block_len: 4096,
                attn_backend_name: "pdkv".into(),
                rank: None,
                extensions: Extensions::ALL,
                incarnation: None,
            };
            n.add_worker(rank, PrefillWorker::new(rank, metadata, Vec::new(), &policy));
        }
        (n, d)
    }

    /// What came out, in a few words each.
    fn render(out: &[PrefillOutput]) -> Vec<String> {
        out.iter()
            .map(|o| match o {
                PrefillOutput::Worker { worker, action } => {
                    format!(
                        "w{worker} {}",
                        format!("{action:?}").split([' ', '(']).next().unwrap_or_default()
                    )
                }
                PrefillOutput::Engine { engine, action } => {
                    format!(
                        "e{engine} {}",
                        format!("{action:?}").split([' ', '(']).next().unwrap_or_default()
                    )
                }
                PrefillOutput::Refused { engine, .. } => format!("e{engine} refused"),
                PrefillOutput::EngineHandled { engine, .. } => format!("e{engine} handled"),
            })
            .collect()
    }

    /// A decode TP2 rank's release of transfer 1.
    fn release() -> WorkerEvent {
        WorkerEvent::Release(Release {
            transfer_id: TransferId::from_u128(1),
            consumer_tp_size: Some(2),
            sender: None,
            incarnation: None,
            mac: None,
        })
    }

    /// What the prefill nodes move through their output vector stays small: a handshake
    /// reply's metadata, large and rare, is boxed (an output was 176 bytes).
    #[test]
    fn outputs_stay_small() {
        use std::mem::size_of;
        assert!(size_of::<WorkerAction>() <= 48, "{}", size_of::<WorkerAction>());
        assert!(size_of::<PrefillOutput>() <= 72, "{}", size_of::<PrefillOutput>());
    }

    /// Registrations reach both workers inside the engine's input (unless held: then the
    /// workers know nothing of the transfer and ignore its releases); each worker's release
    /// finishes its part, which reaches the engine at once, and the second retires the transfer
    /// on both workers and frees its blocks, all inside that worker's event.
    #[test]
    fn the_engine_and_its_workers_reach_each_other() {
        for (hold, delivered) in [(false, true), (true, false)] {
            let (mut n, d) = nodes(hold);
            let done = EngineEvent::PrefillDone(PrefillDone {
                request: RequestId(1),
                transfer_id: TransferId::from_u128(1),
                owner_dp: 0,
                blocks: vec![4, 5],
                decode: d.decode[0],
                reader: None,
                holders: None,
            });
            let mut out = Vec::new();
            assert_eq!(n.handle_engine(Instant::ZERO, 0, done, &mut out), Ok(()));
            assert_eq!(render(&out), ["e0 Register", "e0 Register", "e0 handled"], "hold {hold}");
            out.clear();
            for w in 0..2 {
                n.handle_worker(Instant::ZERO, w, release(), &mut out);
            }
            let expected: &[&str] = if delivered {
                &[
                    "w0 Finished",
                    "e0 handled",
                    "w1 Finished",
                    "e0 FinishedSending",
                    "e0 Retire",
                    "e0 Retire",
                    "e0 FreeBlocks",
                    "e0 handled",
                ]
            } else {
                &["w0 Ignored", "w1 Ignored"]
            };
            assert_eq!(render(&out), expected, "hold {hold}");
        }
    }

    /// The hash is the state's: an event that changes nothing (a handshake request) leaves it
    /// equal, though the nodes now keep spare buffers, so a model checker sees one state.
    #[test]
    fn the_hash_ignores_spare_buffers() {
        use std::hash::{DefaultHasher, Hash, Hasher};
        let hash = |n: &PrefillNodes| {
            let mut h = DefaultHasher::new();
            n.hash(&mut h);
            h.finish()
        };
        let (before, _) = nodes(false);
        let mut after = before.clone();
        let mut out = Vec::new();
        after.handle_worker(Instant::ZERO, 0, WorkerEvent::HandshakeRequest { peer: 1 }, &mut out);
        assert_eq!(render(&out), ["w0 SendHandshakeReply"]);
        assert_eq!(hash(&before), hash(&after));
    }
}
