//! Injected faults: the timeline, what faults do to messages, engine crashes and restarts, and
//! the ranks each fault touched (which excuses failures).

use std::collections::BTreeSet;

use pdkv_core::ids::{EngineId, RankId, Role};
use pdkv_core::legacy::LegacyOptions;
use pdkv_core::policy::Policy;
use pdkv_core::prefill::{EngineEvent, PrefillEngine};

use crate::scenario::FaultKind;
use pdkv_engine::target::{parse_target, TargetPattern};

use super::build::{build_decode_worker, build_prefill_worker, draw_incarnation};
use super::decode::UnitState;
use super::{ms_ns, World};

pub(super) struct ActiveFault {
    pub(super) pattern: TargetPattern,
    pub(super) kind: FaultKind,
    remaining: Option<u32>,
}

impl World {
    /// What faults do to one message between `ranks`: `None` if it is lost, else the extra
    /// delay of each copy that arrives (two copies when duplicated).
    pub(super) fn fate(&mut self, ranks: &[RankId]) -> Option<Vec<u64>> {
        let fate = self.draw_fate(ranks);
        if fate.as_ref().is_none_or(|copies| copies.len() > 1 || copies[0] > 0) {
            for &rank in ranks {
                self.touch(rank, self.now, self.now);
            }
        }
        fate
    }

    /// [`World::fate`] without the record of which ranks a fault touched.
    fn draw_fate(&mut self, ranks: &[RankId]) -> Option<Vec<u64>> {
        let mut delay = 0u64;
        let mut copies = 1;
        for slot in self.faults.iter_mut() {
            let Some(fault) = slot else { continue };
            if !ranks.iter().any(|r| fault.pattern.matches(*r)) {
                continue;
            }
            let applies = matches!(
                fault.kind,
                FaultKind::LoseMessages | FaultKind::DelayMessages { .. } | FaultKind::DuplicateMessages
            );
            if !applies || fault.remaining == Some(0) {
                continue;
            }
            if let Some(n) = &mut fault.remaining {
                *n -= 1;
            }
            match fault.kind {
                FaultKind::LoseMessages => return None,
                FaultKind::DelayMessages { delay_ms } => delay = delay.saturating_add(ms_ns(delay_ms)),
                FaultKind::DuplicateMessages => copies = 2,
                _ => {}
            }
        }
        let swarm = &self.sc.faults.swarm;
        if swarm.loss > 0.0 && self.streams.chance(swarm.loss) {
            return None;
        }
        if swarm.delay > 0.0 && self.streams.chance(swarm.delay) {
            delay = delay.saturating_add(self.streams.below(ms_ns(swarm.max_delay_ms.max(1))));
        }
        if swarm.duplicate > 0.0 && self.streams.chance(swarm.duplicate) {
            copies = 2;
        }
        Some(vec![delay; copies])
    }

    /// Index of `rank` in NIC order (prefill ranks, then decode ranks).
    fn rank_slot(&self, rank: RankId) -> usize {
        match rank.engine.role {
            Role::Prefill => self.d.rank_index(rank),
            Role::Decode => self.prefill.ranks.len() + self.d.rank_index(rank),
        }
    }

    /// A fault touched `rank` from `from` to `to`: requests on it that fail up to `grace_ns`
    /// later are excused. Touches come in time order, so an overlapping one extends the last
    /// interval and the list stays short.
    pub(super) fn touch(&mut self, rank: RankId, from: u64, to: u64) {
        let to = to.saturating_add(self.checks.grace_ns);
        let slot = self.rank_slot(rank);
        let intervals = &mut self.checks.touched[slot];
        match intervals.last_mut() {
            Some(last) if last.1 >= from => last.1 = last.1.max(to),
            _ => intervals.push((from, to)),
        }
    }

    /// True when a fault touched one of `ranks` (NIC-order slots) during `[from, to]`.
    pub(super) fn touched_during(&self, slots: &[usize], from: u64, to: u64) -> bool {
        slots.iter().any(|&slot| self.checks.touched[slot].iter().any(|&(a, b)| a <= to && b >= from))
    }

    pub(super) fn on_fault(&mut self, index: usize, start: bool) {
        let spec = self.sc.faults.timeline[index].clone();
        let Some(pattern) = parse_target(&spec.target.0) else { return };
        trace!(
            self,
            "fault",
            if start { "start" } else { "end" },
            spec.target.0.clone(),
            None,
            spec.fault.to_string(),
        );
        if start {
            self.touch_window(index, pattern);
        }
        // The fault is in force (or over) before its effects are applied, so recomputed state
        // (a NIC's combined slow-down) sees it.
        self.faults[index] =
            start.then_some(ActiveFault { pattern, kind: spec.fault.clone(), remaining: spec.count });
        let nics: Vec<usize> = self
            .prefill
            .ranks
            .iter()
            .chain(self.decode.ranks.iter())
            .enumerate()
            .filter(|(_, r)| pattern.matches(**r))
            .map(|(i, _)| i)
            .collect();
        match (&spec.fault, start) {
            (FaultKind::SlowNic { .. }, _) => {
                // Overlapping slow-NIC faults multiply; the end of one leaves the others.
                let ranks: Vec<RankId> =
                    self.prefill.ranks.iter().chain(self.decode.ranks.iter()).copied().collect();
                for nic in nics {
                    let factor: f64 = self
                        .faults
                        .iter()
                        .flatten()
                        .filter_map(|f| match f.kind {
                            FaultKind::SlowNic { factor } if f.pattern.matches(ranks[nic]) => Some(factor),
                            _ => None,
                        })
                        .product();
                    let finishes = self.net.nics.set_factor(self.now, nic, factor);
                    self.schedule_flows(&[nic], finishes);
                }
            }
            (FaultKind::NicDown, true) => {
                for nic in nics {
                    self.abort_flows_on(nic, "NIC down");
                }
            }
            (FaultKind::EngineCrash, _) => {
                let mut engines: BTreeSet<EngineId> = BTreeSet::new();
                for rank in self.prefill.ranks.iter().chain(self.decode.ranks.iter()) {
                    if pattern.matches(*rank) {
                        engines.insert(rank.engine);
                    }
                }
                for engine in engines {
                    if start {
                        self.crash(engine);
                    } else {
                        self.restart(engine);
                    }
                }
            }
            _ => {}
        }
    }

    /// Records the ranks a starting timeline fault touches, for its whole window. Message faults
    /// are recorded per message they change instead (in `fate`), since `count` may exhaust them
    /// early. An engine crash touches every rank of each engine it takes down, to the end of the
    /// run: sessions opened to the old incarnation fail at their first use, whenever that is.
    fn touch_window(&mut self, index: usize, pattern: TargetPattern) {
        let spec = &self.sc.faults.timeline[index];
        let end = spec.duration_ms.map_or(u64::MAX, |d| self.now.saturating_add(ms_ns(d)));
        let ranks: Vec<RankId> = self.prefill.ranks.iter().chain(self.decode.ranks.iter()).copied().collect();
        match spec.fault {
            FaultKind::LoseMessages | FaultKind::DelayMessages { .. } | FaultKind::DuplicateMessages => {}
            FaultKind::EngineCrash => {
                let engines: BTreeSet<EngineId> =
                    ranks.iter().filter(|r| pattern.matches(**r)).map(|r| r.engine).collect();
                for rank in ranks.into_iter().filter(|r| engines.contains(&r.engine)) {
                    self.touch(rank, self.now, u64::MAX);
                }
            }
            FaultKind::DeadListener
            | FaultKind::SlowListener { .. }
            | FaultKind::SlowNic { .. }
            | FaultKind::NicDown
            | FaultKind::SendQueueFull => {
                for rank in ranks.into_iter().filter(|r| pattern.matches(*r)) {
                    self.touch(rank, self.now, end);
                }
            }
        }
    }

    /// An engine crashes: its NICs and listeners go down, and everything in its memory is lost.
    fn crash(&mut self, engine: EngineId) {
        let e = usize::from(engine.index);
        trace!(self, "fault", "crash", engine.to_string(), None, String::new());
        match engine.role {
            Role::Prefill => {
                if self.prefill.down[e] {
                    return;
                }
                self.prefill.down[e] = true;
                let ranks: Vec<usize> = (0..self.prefill.ranks.len())
                    .filter(|&i| self.prefill.ranks[i].engine == engine)
                    .collect();
                // The step it was in dies with it, all-to-all included.
                self.set_background(&ranks, 0.0);
                for &i in &ranks {
                    self.abort_flows_on(i, "peer down");
                }
                // Its queued and prefilling requests die with it; its held blocks are gone.
                let first = self.prefill.group_base[e];
                let layout = self.d.prefill[e];
                for g in first..first + usize::from(layout.dp) {
                    self.prefill.generation[g] += 1;
                    // Queued requests first, then the prefilling ones; the pool restarts empty.
                    let lost = self.prefill.groups[g].sched.reset();
                    self.prefill.groups[g].busy = false;
                    for id in lost {
                        self.end_request(id, true);
                    }
                }
                let totals = self.prefill.nodes.engine(e).totals();
                self.stats.lost_in_crash += totals.held;
                self.stats.crashed_freed += totals.freed;
                self.stats.crashed_reaped += totals.reaped;
                let defer = self.sc.timeouts().defer_ns();
                let fresh = PrefillEngine::new(engine, layout, self.d.model.clone(), self.policy())
                    .with_peers(self.book.rules.clone())
                    .with_defer_timeout_ns(defer);
                self.prefill.nodes.replace_engine(e, fresh);
                self.prefill.engine_tick[e] = None;
            }
            Role::Decode => {
                if self.decode.down[e] {
                    return;
                }
                self.decode.down[e] = true;
                let first = self.decode.group_base[e];
                for g in first..first + usize::from(self.d.decode[e].dp) {
                    // The group restarts with its workers: a fresh barrier on no step, an empty pool.
                    let lost = self.decode.nodes.sched_mut(g).reset();
                    for w in self.decode.nodes.members(g).to_vec() {
                        // The step it was in dies with it, all-to-all included.
                        self.set_background(&[self.decode_nic(w)], 0.0);
                        self.abort_flows_on(self.decode_nic(w), "peer down");
                        let fresh = build_decode_worker(
                            &self.sc,
                            &self.d,
                            &self.book,
                            &self.policy(),
                            self.decode.ranks[w],
                        );
                        self.decode.nodes.replace_worker(w, fresh);
                        self.decode.worker_tick[w] = None;
                    }
                    for id in lost {
                        // Its prefill side will reap these transfers: expected, since the reader died.
                        self.checks.excused.insert(self.clients.requests[&id].transfer);
                        self.end_request(id, true);
                    }
                }
                for unit in 0..self.decode.units.len() {
                    if self.decode.units[unit].engine == e {
                        // Bumping the step makes in-flight step events stale.
                        self.decode.units[unit].step += 1;
                        self.decode.units[unit].state = UnitState::Idle;
                        self.decode.units[unit].last_step_end = None;
                    }
                }
            }
        }
    }

    /// A crashed engine comes back empty; a prefill engine registers its memory anew.
    fn restart(&mut self, engine: EngineId) {
        let e = usize::from(engine.index);
        trace!(self, "fault", "restart", engine.to_string(), None, String::new());
        match engine.role {
            Role::Prefill => {
                if !self.prefill.down[e] {
                    return;
                }
                self.prefill.down[e] = false;
                let policy = self.policy();
                for i in 0..self.prefill.ranks.len() {
                    let rank = self.prefill.ranks[i];
                    if rank.engine != engine {
                        continue;
                    }
                    let old: Vec<u64> =
                        self.net.regions.iter().filter(|(_, (r, _))| *r == i).map(|(b, _)| *b).collect();
                    for base in old {
                        if let Some(region) = self.net.regions.remove(&base) {
                            self.net.retired_regions.insert(base, region);
                        }
                    }
                    self.prefill.epoch[i] += 1;
                    let g = self.prefill.group_base[e] + usize::from(rank.dp);
                    let blocks = self.prefill.groups[g].sched.pool().capacity();
                    let incarnation = draw_incarnation(
                        &self.book,
                        rank,
                        &mut self.streams,
                        &mut self.prefill.incarnations[i],
                    );
                    let (worker, bases, len) = build_prefill_worker(
                        &self.sc,
                        &self.d,
                        &self.book,
                        &self.cost,
                        &policy,
                        rank,
                        i,
                        self.prefill.epoch[i],
                        incarnation,
                        blocks,
                    );
                    for base in bases {
                        self.net.regions.insert(base, (i, len));
                    }
                    self.prefill.nodes.replace_worker(i, worker);
                    if let Some(incarnation) = incarnation {
                        trace!(self, "fault", "incarnation", rank.to_string(), None, incarnation.to_string());
                        self.engine(e, EngineEvent::WorkerUp { rank, incarnation });
                    }
                }
                let first = self.prefill.group_base[e];
                for g in first..first + usize::from(self.d.prefill[e].dp) {
                    self.try_prefill(g);
                }
            }
            Role::Decode => {
                self.decode.down[e] = false;
            }
        }
    }

    fn policy(&self) -> Policy {
        Policy::from(&self.sc.protocol.legacy.iter().copied().collect::<LegacyOptions>())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scenario::{Scenario, Target, TimedFault};
    use crate::world::RunOptions;

    /// Two slow-NIC faults on one rank multiply while both last; ending one leaves the other.
    #[test]
    fn overlapping_slow_nic_faults_combine() {
        let mut sc = Scenario::from_notation("1P_TP1:1D_TP1");
        // Engines far too small for DeepSeek-R1's weights: a fixed KV share.
        sc.hardware.kv_memory_fraction = 0.5;
        for (factor, duration_ms) in [(0.5, 10_000), (0.25, 2_000)] {
            sc.faults.timeline.push(TimedFault {
                at_ms: 0,
                target: Target("P0.dp0.tp0".into()),
                fault: FaultKind::SlowNic { factor },
                duration_ms: Some(duration_ms),
                count: None,
            });
        }
        let mut world = World::new(&sc, RunOptions::default()).unwrap();
        let check = |world: &mut World, index: usize, start: bool, expected: f64| {
            world.on_fault(index, start);
            assert!(
                (world.net.nics.factor(0) - expected).abs() < 1e-12,
                "{} != {expected}",
                world.net.nics.factor(0)
            );
        };
        check(&mut world, 0, true, 0.5);
        check(&mut world, 1, true, 0.125);
        check(&mut world, 1, false, 0.5);
        check(&mut world, 0, false, 1.0);
    }
}
