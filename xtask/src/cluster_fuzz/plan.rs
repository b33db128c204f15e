//! What one fuzz run does, drawn from its seed: the deployment, workload, timeouts and faults,
//! and the `pdkv cluster` arguments and outside signals that carry them out.

use std::fmt::Write as _;

use super::HEARTBEAT_LOSS_MS;
use pdkv_core::ids::Role;
use pdkv_core::rng::Stream;
use pdkv_core::topology::Deployment;
use std::path::Path;

/// Deployments the runs draw from, each checked to be accepted by `pdkv cluster` with and
/// without `--mla` (its GQA model has as many KV heads as the smallest TP, so the head guard
/// accepts every pair).
pub(super) const DEPLOYMENTS: [&str; 11] = [
    "1P_TP1:1D_TP1",
    "1P_TP2:1D_TP2",
    "1P_TP4:1D_TP8",
    "1P_TP8:1D_TP4",
    "1P_TP4:1D_TP2",
    "1P_TP2:1D_TP4",
    "1P_DP2TP2:1D_TP4",
    "1P_DP2:1D_TP2",
    "1P_DP2:1D_DP2",
    "2P_TP2:1D_DP2",
    "2P_TP2:1D_TP4",
];

/// The fuzzer's draws: the project's seeded stream (`pdkv_core::rng`), so a printed seed
/// replays the same run, plus the shapes the fuzzer needs.
pub(super) struct Rng(Stream);

impl Rng {
    /// Uniform in `lo..=hi`.
    pub(super) fn range(&mut self, lo: u64, hi: u64) -> u64 {
        self.0.range(lo, hi)
    }

    /// True with probability `percent`/100.
    pub(super) fn chance(&mut self, percent: u64) -> bool {
        self.0.below(100) < percent
    }

    /// Log-uniform in `1..=max`: small values as often as large ones, so most runs stay short
    /// while some push hundreds of requests.
    pub(super) fn log_uniform(&mut self, max: u64) -> u64 {
        let bits = 64 - max.leading_zeros() as u64;
        let top = 1u64 << self.range(0, bits - 1);
        self.range(top, (2 * top - 1).min(max)).max(1)
    }

    pub(super) fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        self.0.pick(items)
    }
}

/// A fault this task delivers to a connector process from outside.
#[derive(Clone)]
pub(super) struct Outside {
    /// Milliseconds after `pdkv cluster` started.
    pub(super) at_ms: u64,
    /// The rank whose process gets it (the incarnation running at that moment).
    pub(super) rank: String,
    /// `None` for SIGKILL; `Some(ms)` for SIGSTOP, then SIGCONT this long after.
    pub(super) stop_ms: Option<u64>,
}

impl Outside {
    pub(super) fn describe(&self) -> String {
        match self.stop_ms {
            None => format!("at {} ms: SIGKILL {}", self.at_ms, self.rank),
            Some(ms) => format!("at {} ms: SIGSTOP {} for {ms} ms, then SIGCONT", self.at_ms, self.rank),
        }
    }
}

/// Everything one run does, drawn from its seed.
pub(super) struct Plan {
    pub(super) seed: u64,
    pub(super) deployment: &'static str,
    pub(super) mla: bool,
    pub(super) requests: u64,
    pub(super) concurrency: u64,
    pub(super) layers: u64,
    pub(super) handshake_ms: u64,
    pub(super) transfer_ms: u64,
    pub(super) defer_ms: u64,
    pub(super) timeout_ms: u64,
    /// `--kill RANK --kill-after N [--restart-after-ms T]`.
    pub(super) kill: Option<(String, u64, Option<u64>)>,
    /// `--drop-releases RANK=N`.
    pub(super) drops: Vec<(String, u64)>,
    /// Message faults: the flag (`--lose-messages`, `--duplicate-messages`,
    /// `--delay-messages`) and its value.
    pub(super) messages: Vec<(&'static str, String)>,
    pub(super) outside: Vec<Outside>,
    /// `--forge-messages`: a forger outside the deployment sends forged releases and leases.
    pub(super) forge: bool,
    /// A foreign decode side played by a driver that misbehaves (the run has no other fault).
    pub(super) driver: Option<Driver>,
    /// `--decode-max-batch N`: a small decode batch queues requests behind it (leased, and
    /// taken back from a group that loses a rank).
    pub(super) decode_max_batch: Option<u64>,
    pub(super) legacy: Vec<String>,
}

/// The rank name of an outside fault aimed at `pdkv cluster` itself (its scheduler).
pub(super) const SCHEDULER: &str = "pdkv cluster";

/// A foreign decode driver that misbehaves, as an `sh` script. Each `sleep` it starts sleeps a
/// number of seconds of its own (`sleeper`, `sleeper + 1`), so that the fuzzer can tell from
/// /proc whether one survived the run.
#[derive(Clone, Copy)]
pub(super) struct Driver {
    pub(super) kind: Misbehaviour,
    pub(super) sleeper: u64,
}

/// How the driver misbehaves.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Misbehaviour {
    /// Says ready, then reads nothing, and starts a process of its own.
    StopsReading,
    /// Answers bye to shutdown but does not exit.
    OutstaysBye,
    /// Starts a process at setup and exits after bye, leaving it running.
    LeavesChild,
}

impl Driver {
    pub(super) fn name(self) -> &'static str {
        match self.kind {
            Misbehaviour::StopsReading => "driver stops reading",
            Misbehaviour::OutstaysBye => "driver outstays bye",
            Misbehaviour::LeavesChild => "driver leaves a child",
        }
    }

    /// The `sh -c` script.
    pub(super) fn script(self) -> String {
        let (a, b) = (self.sleeper, self.sleeper + 1);
        // Answers ready to setup and bye to shutdown, and never answers a request.
        let polite = |at_setup: &str, after_bye: &str| {
            format!(
                "while IFS= read -r line; do case \"$line\" in \
                   *'\"op\":\"setup\"'*) {at_setup} echo '{{\"op\":\"ready\"}}' ;; \
                   *'\"op\":\"shutdown\"'*) echo '{{\"op\":\"bye\"}}'; {after_bye} ;; \
                 esac; done"
            )
        };
        match self.kind {
            Misbehaviour::StopsReading => format!("echo '{{\"op\":\"ready\"}}'; sleep {a} & exec sleep {b}"),
            Misbehaviour::OutstaysBye => polite("", &format!("sleep {a} & exec sleep {b}")),
            Misbehaviour::LeavesChild => polite(&format!("sleep {a} & sleep {b} &"), "exit 0"),
        }
    }

    /// The `sleep` arguments its processes run with.
    pub(super) fn sleepers(self) -> [String; 2] {
        [self.sleeper.to_string(), (self.sleeper + 1).to_string()]
    }
}

impl Plan {
    pub(super) fn draw(seed: u64, legacy: &[String]) -> Plan {
        let mut rng = Rng(Stream::new(seed, 0));
        let deployment = *rng.pick(&DEPLOYMENTS);
        let mla = rng.chance(40);
        let parsed = Deployment::parse(deployment).expect("the fuzzer's deployments parse");
        let prefill: Vec<String> = parsed.ranks(Role::Prefill).iter().map(|r| r.to_string()).collect();
        let decode: Vec<String> = parsed.ranks(Role::Decode).iter().map(|r| r.to_string()).collect();
        let requests = rng.log_uniform(256);
        let concurrency = rng.log_uniform(256);
        let layers = rng.range(1, 6);
        // Short timeouts, so a faulted run ends in seconds; handshake < transfer < defer, as
        // docs/verification.md says they must be.
        let (handshake_ms, transfer_ms, defer_ms) =
            *rng.pick(&[(1_000, 3_000, 4_000), (2_000, 5_000, 6_000)]);
        let mut kill = None;
        if rng.chance(35) && requests > 1 {
            let rank = rng.pick(&prefill).clone();
            let after = rng.range(0, requests - 1);
            let restart = rng.chance(60).then(|| rng.range(100, 3_000));
            kill = Some((rank, after, restart));
        }
        let mut drops = vec![];
        if rng.chance(25) {
            drops.push((rng.pick(&decode).clone(), rng.range(1, requests.min(8))));
        }
        let timeouts = Timeouts { handshake_ms, transfer_ms, defer_ms };
        let mut messages = vec![];
        for _ in 0..rng.range(0, 2) {
            if rng.chance(40) {
                messages.push(draw_message_fault(&mut rng, &prefill, &decode, timeouts));
            }
        }
        // A restart while the dispatches of the killed rank's group are delayed: requests
        // prefilled before the kill reach decode after it, some after the restart. Every
        // dispatch of the group is late, so the delay is kept to what the run's rounds of
        // requests can afford (a round waits for its dispatch).
        if let Some((rank, _, Some(_))) = &kill {
            if rng.chance(50) {
                let group = rank.rsplit_once('.').map_or(rank.as_str(), |(group, _)| group);
                let rounds = requests.div_ceil(concurrency);
                let most = timeouts.late_delay_ms().min(LATE_DISPATCHES_MS / rounds).max(1);
                let delay = rng.range(1, most);
                messages.push(("--delay-messages", format!("{group}.tp*:dispatch:{delay}")));
            }
        }
        let mut outside = vec![];
        // A run here takes about 50 ms per round of a few requests (measured: 256 requests take
        // 13 s one at a time, 2.2 s 256 at a time), so a moment drawn up to this estimate lands
        // before, during or after the traffic.
        let horizon_ms = 50 + 40 * requests.div_ceil(concurrency.min(8));
        for _ in 0..rng.range(0, 2) {
            if !rng.chance(45) {
                continue;
            }
            let all = [prefill.as_slice(), decode.as_slice()].concat();
            let rank = rng.pick(&all).clone();
            let at_ms = rng.range(0, horizon_ms);
            let stop_ms = if rng.chance(50) {
                None
            } else if rng.chance(70) {
                Some(rng.range(50, HEARTBEAT_LOSS_MS - 1_000))
            } else {
                Some(rng.range(HEARTBEAT_LOSS_MS + 500, HEARTBEAT_LOSS_MS + 3_000))
            };
            outside.push(Outside { at_ms, rank, stop_ms });
        }
        // Drawn after everything above, so that a seed keeps the faults it drew before these
        // existed.
        let forge = rng.chance(25);
        if rng.chance(10) {
            let at_ms = rng.range(0, horizon_ms);
            // Longer than a quarter of the heartbeat timeout, which is when the scheduler
            // notices its own stall; up to past the heartbeat timeout and the reaper's delay.
            let stop_ms = rng.range(HEARTBEAT_LOSS_MS / 4 + 500, HEARTBEAT_LOSS_MS + 3_000);
            outside.push(Outside { at_ms, rank: SCHEDULER.to_string(), stop_ms: Some(stop_ms) });
        }
        let driver = rng.chance(10).then(|| Driver {
            kind: *rng.pick(&[
                Misbehaviour::StopsReading,
                Misbehaviour::OutstaysBye,
                Misbehaviour::LeavesChild,
            ]),
            // Unlikely to be any other process's sleep.
            sleeper: 9_000_000 + 2 * (seed % 500_000),
        });
        let decode_max_batch = rng.chance(30).then(|| rng.log_uniform(8));
        let mut plan = Plan {
            seed,
            deployment,
            mla,
            requests,
            concurrency,
            layers,
            handshake_ms,
            transfer_ms,
            defer_ms,
            // Long enough for a lost rank's transfers to be reaped (defer plus lease) after the
            // heartbeat finds it, on a loaded 2-core machine.
            timeout_ms: 60_000,
            kill,
            drops,
            messages,
            outside,
            forge,
            driver,
            decode_max_batch,
            legacy: legacy.to_vec(),
        };
        if plan.driver.is_some() {
            // The driver's misbehaviour alone: a few requests it never answers, a short budget.
            plan.kill = None;
            plan.drops.clear();
            plan.messages.clear();
            plan.outside.clear();
            plan.forge = false;
            plan.requests = plan.requests.min(8);
            plan.timeout_ms = 3_000;
        }
        plan
    }

    /// The arguments of `pdkv cluster`.
    pub(super) fn args(&self) -> Vec<String> {
        let mut a: Vec<String> = vec!["cluster".into(), self.deployment.into()];
        let mut flag = |name: &str, value: String| {
            a.push(name.into());
            a.push(value);
        };
        flag("--requests", self.requests.to_string());
        flag("--concurrency", self.concurrency.to_string());
        flag("--layers", self.layers.to_string());
        if let Some(batch) = self.decode_max_batch {
            flag("--decode-max-batch", batch.to_string());
        }
        flag("--seed", self.seed.to_string());
        flag("--handshake-timeout-ms", self.handshake_ms.to_string());
        flag("--transfer-timeout-ms", self.transfer_ms.to_string());
        flag("--defer-timeout-ms", self.defer_ms.to_string());
        flag("--timeout-ms", self.timeout_ms.to_string());
        if let Some((rank, after, restart)) = &self.kill {
            flag("--kill", rank.clone());
            flag("--kill-after", after.to_string());
            if let Some(ms) = restart {
                flag("--restart-after-ms", ms.to_string());
            }
        }
        for (rank, n) in &self.drops {
            flag("--drop-releases", format!("{rank}={n}"));
        }
        for (name, value) in &self.messages {
            flag(name, value.clone());
        }
        for name in &self.legacy {
            flag("--legacy", name.clone());
        }
        if self.mla {
            a.push("--mla".into());
        }
        if self.forge {
            a.push("--forge-messages".into());
        }
        if let Some(driver) = self.driver {
            a.extend(["--foreign-side", "decode", "--foreign-driver", "sh"].map(String::from));
            a.extend([
                "--foreign-driver-arg=-c".to_string(),
                format!("--foreign-driver-arg={}", driver.script()),
            ]);
        }
        a.push("--json".into());
        a
    }

    /// The command line, quoted for a POSIX shell where an argument needs it.
    pub(super) fn command_line(&self, exe: &Path) -> String {
        let quote = |a: &str| {
            if a.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_.,:=/@*+".contains(&b)) {
                a.to_string()
            } else {
                format!("'{}'", a.replace('\'', "'\\''"))
            }
        };
        let args: Vec<String> = self.args().iter().map(|a| quote(a)).collect();
        format!("{} {}", quote(&exe.display().to_string()), args.join(" "))
    }

    /// Short description for the progress line.
    pub(super) fn brief(&self) -> String {
        let mut s = format!(
            "{}{} req {} conc {} layers {}",
            self.deployment,
            if self.mla { " mla" } else { "" },
            self.requests,
            self.concurrency,
            self.layers
        );
        if let Some(batch) = self.decode_max_batch {
            let _ = write!(s, ", batch {batch}");
        }
        if let Some((rank, after, restart)) = &self.kill {
            let _ = write!(s, ", kill {rank} after {after}");
            if let Some(ms) = restart {
                let _ = write!(s, " restart {ms} ms");
            }
        }
        for (rank, n) in &self.drops {
            let _ = write!(s, ", drop {rank}={n}");
        }
        for (name, value) in &self.messages {
            let _ = write!(s, ", {} {value}", name.trim_start_matches("--").trim_end_matches("-messages"));
        }
        if self.forge {
            s.push_str(", forger");
        }
        if let Some(driver) = self.driver {
            let _ = write!(s, ", {}", driver.name());
        }
        for o in &self.outside {
            match o.stop_ms {
                None => {
                    let _ = write!(s, ", SIGKILL {} at {} ms", o.rank, o.at_ms);
                }
                Some(ms) => {
                    let _ = write!(s, ", SIGSTOP {} at {} ms for {ms} ms", o.rank, o.at_ms);
                }
            }
        }
        s
    }
}

/// The most time every dispatch of a group being late may add to a run, one round of requests
/// after another.
pub(super) const LATE_DISPATCHES_MS: u64 = 20_000;

/// A run's timeouts, which bound the delays drawn.
#[derive(Clone, Copy)]
pub(super) struct Timeouts {
    pub(super) handshake_ms: u64,
    pub(super) transfer_ms: u64,
    pub(super) defer_ms: u64,
}

impl Timeouts {
    /// The longest delay drawn for a dispatch or a read lease: past the reaper's delay by a
    /// transfer timeout, so that a late dispatch reaches decode after the reaper freed its
    /// blocks and maybe gave them to another request. Its reads must then be refused (the data
    /// plane serves a read only from blocks granted to its transfer), never served another
    /// request's KV.
    pub(super) fn late_delay_ms(self) -> u64 {
        self.defer_ms + self.transfer_ms
    }
}

/// The kinds a drawn message fault names (`None`: every message between two ranks).
const MESSAGE_KINDS: [Option<&str>; 7] = [
    None,
    Some("release"),
    Some("lease"),
    Some("handshake"),
    Some("handshake-request"),
    Some("handshake-reply"),
    Some("dispatch"),
];

/// One message fault: a flag and its value, on a rank pattern drawn from the deployment (a
/// rank, some of its parts `*`, or every rank), with a count (always, but for some
/// duplicates) and sometimes a probability.
fn draw_message_fault(
    rng: &mut Rng,
    prefill: &[String],
    decode: &[String],
    t: Timeouts,
) -> (&'static str, String) {
    let kinds = *rng.pick(&MESSAGE_KINDS);
    let all = [prefill, decode].concat();
    let pattern = if rng.chance(15) {
        "P*.dp*.tp*".to_string()
    } else {
        let rank = rng.pick(&all).clone();
        let mut parts: Vec<String> = rank.split('.').map(str::to_string).collect();
        for (i, star) in [(1, "dp*"), (2, "tp*")] {
            if rng.chance(40) {
                parts[i] = star.to_string();
            }
        }
        parts.join(".")
    };
    let verbs: &[&'static str] = if kinds == Some("dispatch") {
        &["--lose-messages", "--delay-messages"]
    } else {
        &["--lose-messages", "--duplicate-messages", "--delay-messages"]
    };
    let verb = *rng.pick(verbs);
    let mut value = pattern;
    if let Some(kinds) = kinds {
        value = format!("{value}:{kinds}");
    }
    if verb == "--delay-messages" {
        // A release may come after the reaper, a lease or a dispatch too (see `late_delay_ms`),
        // a handshake after its timeout.
        let max = match kinds {
            Some("release") => t.defer_ms + 1_000,
            Some("handshake" | "handshake-request" | "handshake-reply") => 2 * t.handshake_ms,
            _ => t.late_delay_ms(),
        };
        value = format!("{value}:{}", rng.range(1, max));
    }
    // A lost or late message can cost its request a handshake or a transfer timeout, and a
    // late release or lease holds blocks the next prefills wait for: a count keeps a run of
    // 256 requests one at a time within its budget. A lost or late handshake can cost a whole
    // step, so at most two per sender.
    let handshakes = kinds.is_none_or(|k| k.starts_with("handshake"));
    if verb != "--duplicate-messages" || rng.chance(50) {
        value = format!("{value}={}", rng.range(1, if handshakes { 2 } else { 8 }));
    }
    if rng.chance(30) {
        value = format!("{value}@{}", rng.pick(&["0.1", "0.25", "0.5"]));
    }
    (verb, value)
}
